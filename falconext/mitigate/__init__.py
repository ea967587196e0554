"""mitigate phase."""
