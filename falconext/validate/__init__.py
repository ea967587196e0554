"""validate phase."""
