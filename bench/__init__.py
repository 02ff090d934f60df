"""The repository's benchmark scripts (not shipped in any wheel): the peers and the comparison
entry point built on the client's harness (`python -m bench.compare`), and the scripts that
measure one thing each (`python bench/NAME.py` or `python -m bench.NAME`)."""
