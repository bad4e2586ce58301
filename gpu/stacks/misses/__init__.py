"""What the cached layer stacks share about their misses: listing and deduplicating them,
reading them from the tiers below, staging and admitting the rows, following changes."""
