# mlxserve: `make serve` and `make test` install everything they need first.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PORT ?= 50051
PROTO_SRC := protos/mlxserve/v1/generation.proto

# MLX's CPU backend is fast only with OpenBLAS preloaded (SPEC §8); service/blas.py holds the logic.
BLAS_ENV = $$($(PY) -m service.blas --env)

.PHONY: install serve test proto proto-check lint bench buf-lint clean

install: $(STAMP)

$(STAMP): pyproject.toml scripts/install.sh
	bash scripts/install.sh
	touch $(STAMP)

serve: install
	env $(BLAS_ENV) $(PY) -m service --port $(PORT)

test: install
	env $(BLAS_ENV) $(PY) -m pytest -q

proto: install
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTO_SRC)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

buf-lint:
	npx --yes @bufbuild/buf lint

bench: install
	env $(BLAS_ENV) $(PY) -m client bench --spawn-server --concurrency 1,4,8,16 --max-tokens 64 --peer mlx-lm-batch

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
