"""Code the tests share: servers and waiting on them (server), request builders (requests),
metrics (metrics), /proc (processes), TLS certificates (certs), tiny engines (tiny), real
model families' tiny checkpoints (model_zoo), paged attention inputs (attention), the
repository's root (paths). Test modules import from here, never from each other."""
