"""CUDA runtime access."""
