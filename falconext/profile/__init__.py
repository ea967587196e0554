"""profile phase."""
