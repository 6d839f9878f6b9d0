"""The VRAM control plane: the pure policy and lease book, the run-time reserve's requests, the
controller of each device and the loop that samples, checks and resizes. It reaches the engine
only through ``strata.daemon.engine_port`` and imports neither the HTTP edge nor the commands."""
