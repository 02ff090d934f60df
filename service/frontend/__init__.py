"""The gRPC front end: no MLX here (the engine core is another process, service.core.server)."""
