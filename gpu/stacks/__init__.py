"""The layer stacks."""
