"""Multi-GPU tables."""
