"""control phase."""
