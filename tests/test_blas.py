"""service.common.blas: the environment that gives MLX's Linux CPU backend OpenBLAS."""

from __future__ import annotations

import pytest

from service.common import blas


@pytest.fixture
def openblas(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.setattr(blas, "_openblas_path", lambda: "/usr/lib/libblas.so.3")
    for name in ("MLXSERVE_NO_OPENBLAS", "OPENBLAS_THREAD_TIMEOUT", "OPENBLAS_CORETYPE"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_openblas_is_preloaded_with_its_threads_sleeping_between_products(openblas):
    env = blas.blas_env()
    assert env["LD_PRELOAD"] == "/usr/lib/libblas.so.3"
    assert env["OPENBLAS_THREAD_TIMEOUT"] == "4"


def test_settings_from_outside_are_kept(openblas):
    openblas.setenv("OPENBLAS_THREAD_TIMEOUT", "28")
    openblas.setenv("OPENBLAS_CORETYPE", "Zen")
    env = blas.blas_env()
    assert (env["OPENBLAS_THREAD_TIMEOUT"], env["OPENBLAS_CORETYPE"]) == ("28", "Zen")


def test_nothing_where_openblas_is_refused_or_missing(openblas):
    openblas.setenv("MLXSERVE_NO_OPENBLAS", "1")
    assert blas.blas_env() == {}
    openblas.delenv("MLXSERVE_NO_OPENBLAS")
    openblas.setattr(blas, "_openblas_path", lambda: None)
    assert blas.blas_env() == {}
