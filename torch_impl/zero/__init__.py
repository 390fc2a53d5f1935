"""moezero.zero."""
