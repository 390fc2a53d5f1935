"""moezero.offload."""
