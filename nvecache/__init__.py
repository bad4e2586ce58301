"""The project's namespace."""
