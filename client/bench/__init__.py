"""Load generator for mlxserve (`python -m client bench`).

Layout, so that new workloads and targets slot in without touching the rest:
- workload.py  what is sent: the recipe (lengths, arrivals, levels) and the materialized plan
- runner.py    drives a plan's load pattern (burst, closed loop, Poisson) against any target
- metrics.py   per-request records and per-level summaries (tok/s, req/s, TTFT/ITL percentiles)
- grpc_target.py   our server over gRPC (StreamGenerate)
- server.py    spawns and stops a local server for --spawn-server
- export.py    writes the served weights as an mlx-lm directory for the peers (cached)
- peer_mlx_lm_server.py   mlx_lm.server on the same weights, over HTTP (streaming SSE)
- peer_raw.py  the raw mlx-lm batched forward loop (upper bound), in a subprocess
- peer_mlx_lm_batch.py   mlx-lm's batch_generate, in a subprocess
- report.py    tables, target checks, JSON and PNG (`python -m client.bench.report FILE`)
- cli.py       options and orchestration
Nothing here imports MLX or the server at import time.
"""
