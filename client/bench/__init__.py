"""Load generator for mlxserve (`python -m client bench`).

Layout, so that new workloads and targets slot in without touching the rest:
- workload.py  what is sent: prompts, lengths, concurrency levels, arrival pattern
- metrics.py   per-request records and per-level summaries (tok/s, TTFT, ITL percentiles)
- grpc_target.py   runs a workload against an mlxserve server over gRPC (streaming)
- server.py    spawns and stops a local server for --spawn-server
- peer_mlx_lm_batch.py   the same workload through mlx-lm's batch_generate, in a subprocess
- report.py    the side-by-side table, JSON and PNG
- cli.py       options and orchestration
Nothing here imports MLX or the server at import time.
"""
