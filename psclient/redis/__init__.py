"""The Redis backend."""
