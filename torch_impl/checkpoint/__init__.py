"""moezero.checkpoint."""
