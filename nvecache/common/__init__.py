"""Common rules."""
