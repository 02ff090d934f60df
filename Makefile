# mlxserve: `make serve` and `make test` install everything they need first.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PORT ?= 50051
PROTO_SRC := protos/mlxserve/v1/generation.proto

# MLX's CPU backend is fast only with OpenBLAS preloaded (docs/cpu-backend.md); service/common/blas.py holds the logic.
BLAS_ENV = $$($(PY) -m service.common.blas --env)

BUF := .tools/node_modules/.bin/buf
# `buf breaking` compares the API with its last release: the newest v* tag, or main's copy of
# protos/ while there is none.
LAST_RELEASE := $(shell git describe --tags --abbrev=0 --match 'v*' 2>/dev/null)
BUF_AGAINST ?= .git\#$(if $(LAST_RELEASE),tag=$(LAST_RELEASE),branch=main)

.PHONY: install serve test test-fast proto proto-check lint bench buf-lint buf-breaking dist smoke-dist clean

install: $(STAMP)

$(STAMP): pyproject.toml scripts/install.sh
	bash scripts/install.sh
	touch $(STAMP)

serve: install
	env $(BLAS_ENV) $(PY) -m service --port $(PORT)

# The project's bytecode is compiled first: where PYTHONDONTWRITEBYTECODE is set, each of the many
# server processes the tests start would otherwise compile every module it imports again.
test: install
	$(PY) -m compileall -q service client mlxserve tests
	env $(BLAS_ENV) $(PY) -m pytest -q

# The tests not marked slow (no server or other process of ours, no real model; tests/conftest.py
# says what is slow): under a minute.
test-fast: install
	env $(BLAS_ENV) $(PY) -m pytest -q -m "not slow"

proto: install
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTO_SRC)

lint: install buf-lint buf-breaking
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# buf comes from npm into .tools (make install).
buf-lint: install
	$(BUF) lint

buf-breaking: install
	$(BUF) breaking --against '$(BUF_AGAINST)'

# The two wheels, mlxserve-client and mlxserve, into dist/.
dist:
	rm -rf dist
	python3 -m pip wheel -q --no-deps --wheel-dir dist ./packaging/mlxserve-client .

# Build the wheels and install each into a fresh venv, outside the checkout: the client alone,
# and the server serving the embedded model to it.
smoke-dist:
	bash scripts/smoke_dist.sh

bench: install
	env $(BLAS_ENV) $(PY) -m bench.compare --spawn-server --concurrency 1,4,8,16 --max-tokens 64 --peer mlx-lm-batch

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis dist gen
