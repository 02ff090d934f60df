"""Server flags: defaults, environment variables, and a precise error for each bad value."""

from __future__ import annotations

import argparse

import pytest

from service.config import ConfigError, ServerConfig, add_server_arguments, config_from_args
from service.runtime import Runtime


def parse(*argv: str) -> ServerConfig:
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    return config_from_args(parser.parse_args(list(argv)))


def test_defaults_leave_device_dependent_choices_to_the_runtime():
    config = parse()
    assert config.shape_buckets == "auto"
    assert config.decode_attention == "auto"
    assert config.max_batch_prefill is None  # 16 with CUDA, 4 elsewhere


@pytest.mark.parametrize(
    "argv, flag",
    [
        (("--shape-buckets", "maybe"), "--shape-buckets"),
        (("--decode-attention", "fast"), "--decode-attention"),
        (("--overlap-steps", "on"), "--overlap-steps"),
        (("--compile-decode", "on"), "--compile-decode"),
        (("--decode-storage-backend", "ring"), "--decode-storage-backend"),
        (("--preemption-policy", "random"), "--preemption-policy"),
        (("--port", "0"), "--port"),
        (("--kv-admission-watermark", "0.9"), "--kv-admission-watermark"),
    ],
)
def test_bad_values_name_their_flag(argv, flag):
    with pytest.raises(ConfigError, match=flag):
        parse(*argv)


def test_environment_variables_set_the_new_flags(monkeypatch):
    monkeypatch.setenv("MLXSERVE_SHAPE_BUCKETS", "on")
    monkeypatch.setenv("MLXSERVE_DECODE_ATTENTION", "gather")
    monkeypatch.setenv("MLXSERVE_MAX_BATCH_PREFILL", "6")
    config = parse()
    assert (config.shape_buckets, config.decode_attention, config.max_batch_prefill) == (
        "on",
        "gather",
        6,
    )


def test_runtime_resolves_auto_choices_on_this_machine():
    runtime = Runtime(ServerConfig(load_format="dummy:tiny", parallel=2))
    runtime.load()
    try:
        # No CUDA here: no shape buckets, gathered decode attention, 4 prompts per prefill.
        assert runtime.engine.shape_buckets is False
        assert runtime.engine.direct_decode is False
        assert runtime.decode_attention == "mirror"  # contiguous copy of the batch's K/V
        # No in-place pool writes without the CUDA kernel: steps are not overlapped.
        assert runtime.engine.overlap_steps is False
        assert runtime.engine.storage.write_in_place is False
        assert runtime.engine.decode_graph is None
        assert runtime.scheduler.config.max_batch_prefill == 4
    finally:
        runtime.shutdown()


def test_mirror_decode_attention_refuses_dense_storage():
    config = ServerConfig(
        load_format="dummy:tiny", decode_storage_backend="dense", decode_attention="mirror"
    )
    with pytest.raises(ConfigError, match="--decode-attention mirror needs the paged backend"):
        Runtime(config).load()


def test_direct_decode_attention_refuses_dense_storage():
    config = ServerConfig(
        load_format="dummy:tiny", decode_storage_backend="dense", decode_attention="direct"
    )
    with pytest.raises(ConfigError, match="--decode-attention direct needs the paged backend"):
        Runtime(config).load()
