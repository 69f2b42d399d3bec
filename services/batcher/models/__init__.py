"""Small models shipped with the batcher (demos and tests)."""
