"""moezero.distributed."""
