"""sim phase."""
