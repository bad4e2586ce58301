"""The file:// backend."""
