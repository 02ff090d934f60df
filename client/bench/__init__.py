"""Load generator for mlxserve (`python -m client bench`).

Layout, so that new workloads and targets slot in without touching the rest:
- workload.py  what is sent: the recipe (lengths, arrivals, levels) and the materialized plan
- runner.py    drives a plan's load pattern (burst, closed loop, Poisson) against any target
- metrics.py   per-request records and per-level summaries (tok/s, req/s, TTFT/ITL percentiles)
- grpc_target.py   our server over gRPC (StreamGenerate)
- server.py    spawns and stops a local server for --spawn-server
- report.py    tables, JSON and PNG (`python -m client.bench.report FILE`)
- cli.py       options and orchestration; peers plug in as `PeerRun`s
Nothing here imports MLX or the server: the peers that run mlx-lm beside our server live in the
repository (bench/peers/, `python -m bench.compare`).
"""
