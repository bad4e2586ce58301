"""The per-process GPU cache."""
