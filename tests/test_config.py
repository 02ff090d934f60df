"""Server flags: defaults, environment variables, and a precise error for each bad value."""

from __future__ import annotations

import argparse
from dataclasses import replace

import mlx.core as mx
import pytest

from service.common.config import (
    ConfigError,
    SchedulingConfig,
    ServerConfig,
    add_server_arguments,
    auto_api_workers,
    config_from_args,
)
from service.core.engine.config import DEBUG_REFERENCE_ENV, EngineConfig, resolve
from service.core.engine.storage import PoolShape, make_storage
from service.core.models.families import family
from service.core.models.layout import probe_layout
from tests.helpers.runtime import loaded_runtime
from tests.helpers.tiny import tiny_llama


def parse(*argv: str) -> ServerConfig:
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    return config_from_args(parser.parse_args(list(argv)))


def test_defaults_leave_device_dependent_choices_to_the_runtime():
    config = parse()
    assert config.kv.decode_storage_backend == "auto"  # paged for verified families
    assert config.scheduling.max_batch_prefill is None  # by device (prefill_limits)


@pytest.mark.parametrize(
    "argv, flag",
    [
        (("--decode-storage-backend", "ring"), "--decode-storage-backend"),
        (("--preemption-policy", "random"), "--preemption-policy"),
        (("--port", "0"), "--port"),
        (("--kv-admission-watermark", "0.9"), "--kv-admission-watermark"),
        (("--max-request-bytes", "0"), "--max-request-bytes"),
        (("--max-connection-age", "-1"), "--max-connection-age"),
        (("--max-connection-age", "nan"), "--max-connection-age"),
        (("--max-connection-age-grace", "-1"), "--max-connection-age-grace"),
        (("--tls-cert", __file__), "--tls-cert and --tls-key"),
        (("--tls-key", __file__), "--tls-cert and --tls-key"),
        (("--tls-client-ca", __file__), "--tls-client-ca"),
        (("--tls-cert", "/no/such.pem", "--tls-key", __file__), "--tls-cert /no/such.pem"),
        (("--auth-token-file", "/no/tokens"), "--auth-token-file /no/tokens"),
        (("--reflection-requires-auth",), "--reflection-requires-auth"),
        (("--max-prefill-stall-ms", "-1"), "--max-prefill-stall-ms"),
        (("--max-prefill-stall-ms", "inf"), "--max-prefill-stall-ms"),
        (("--max-prefill-stall-ms", "200", "--prefill-chunk-size", "512"), "--prefill-chunk-size"),
        (("--max-prefill-stall-ms", "200", "--deterministic"), "--deterministic"),
        (("--log-level", "verbose"), "--log-level 'verbose': use debug"),
        (("--log-format", "xml"), "--log-format 'xml': use auto"),
    ],
)
def test_bad_values_name_their_flag(argv, flag):
    with pytest.raises(ConfigError, match=flag):
        parse(*argv)


@pytest.mark.parametrize(
    "flag", ["--decode-attention", "--overlap-steps", "--compile-decode", "--shape-buckets"]
)
def test_implementation_picking_flags_are_gone(flag, capsys):
    with pytest.raises(SystemExit):
        parse(flag, "auto")
    assert "unrecognized arguments" in capsys.readouterr().err


def test_environment_variables_set_flags(monkeypatch):
    monkeypatch.setenv("MLXSERVE_DECODE_STORAGE_BACKEND", "dense")
    monkeypatch.setenv("MLXSERVE_MAX_BATCH_PREFILL", "6")
    config = parse()
    assert (config.kv.decode_storage_backend, config.scheduling.max_batch_prefill) == ("dense", 6)


def test_security_and_connection_flags_have_their_variables(monkeypatch):
    config = parse()
    assert (
        config.transport.max_connection_age,
        config.transport.tls_cert,
        config.transport.auth_token_file,
    ) == (0, None, None)
    assert not config.frontend.allow_special_tokens_in_content
    monkeypatch.setenv("MLXSERVE_MAX_CONNECTION_AGE", "600")
    monkeypatch.setenv("MLXSERVE_MAX_CONNECTION_AGE_GRACE", "30")
    monkeypatch.setenv("MLXSERVE_AUTH_TOKEN_FILE", __file__)
    monkeypatch.setenv("MLXSERVE_REFLECTION_REQUIRES_AUTH", "1")
    monkeypatch.setenv("MLXSERVE_ALLOW_SPECIAL_TOKENS_IN_CONTENT", "true")
    monkeypatch.setenv("MLXSERVE_TLS_CERT", __file__)
    monkeypatch.setenv("MLXSERVE_TLS_KEY", __file__)
    monkeypatch.setenv("MLXSERVE_TLS_CLIENT_CA", __file__)
    config = parse()
    assert (config.transport.max_connection_age, config.transport.max_connection_age_grace) == (
        600,
        30,
    )
    assert (
        config.transport.auth_token_file
        == config.transport.tls_cert
        == config.transport.tls_client_ca
        == __file__
    )
    assert (
        config.transport.reflection_requires_auth
        and config.frontend.allow_special_tokens_in_content
    )


def test_max_request_bytes_defaults_to_grpcs_limit_and_has_its_variable(monkeypatch):
    assert parse().transport.max_request_bytes == 4 * 1024 * 1024
    monkeypatch.setenv("MLXSERVE_MAX_REQUEST_BYTES", "65536")
    assert parse().transport.max_request_bytes == 65536


def test_max_prefill_stall_ms_default_auto_zero_off_and_its_variable(monkeypatch):
    assert parse().scheduling.max_prefill_stall_ms is None  # 4 running median decode steps
    assert parse("--max-prefill-stall-ms", "auto").scheduling.max_prefill_stall_ms is None
    assert parse("--max-prefill-stall-ms", "250").scheduling.max_prefill_stall_ms == 250.0
    # 0 (off) goes with a fixed chunk size; so does the default bound, which a fixed size turns off.
    assert parse("--max-prefill-stall-ms", "0", "-b", "512").scheduling.prefill_chunk_size == 512
    assert parse("-b", "512").scheduling.max_prefill_stall_ms is None
    monkeypatch.setenv("MLXSERVE_MAX_PREFILL_STALL_MS", "1500")
    assert parse().scheduling.max_prefill_stall_ms == 1500.0


def test_a_max_prefill_stall_ms_that_is_no_number_names_the_flag(capsys):
    with pytest.raises(SystemExit):
        parse("--max-prefill-stall-ms", "soon")
    assert "--max-prefill-stall-ms: 'soon' is not auto or a number" in capsys.readouterr().err


@pytest.mark.model  # the dummy preset takes the embedded model's tokenizer
@pytest.mark.skipif(mx.cuda.is_available(), reason="a CUDA host resolves the CUDA path")
def test_runtime_resolves_the_cpu_path_on_this_machine():
    with loaded_runtime(max_batch_size=2) as runtime:
        config = runtime.runner.config
        # No CUDA here: MLX ops, decode steps over the contiguous mirror of the batch.
        assert config.decode_attention == "mirror"
        assert not (config.shape_buckets or config.in_place_writes or config.overlap_steps)
        assert runtime.runner.decode_graph is None
        assert config.decode_path == "native batched forward"
        assert runtime.scheduler.config.max_batch_prefill == 4
        assert runtime.scheduler.config.max_prefill_stall_ms is None  # the bound, by default


LLAMA = probe_layout(tiny_llama())


def test_cuda_path_of_a_plain_attention_family():
    config = resolve(family("llama"), LLAMA, paged=True, batched=True, cuda=True)
    assert config == EngineConfig(
        decode_attention="direct",
        in_place_writes=True,
        rope_in_kernels=True,
        overlap_steps=True,
        update_beside_dispatch=True,
        compile_decode=True,
        shape_buckets=True,
        lora_kernel=True,
        fused_projections=True,
        decode_gemm=True,
        fused_add_norm=True,
        fold_quantized_rows=True,
    )


def test_cuda_path_narrowed_by_the_model():
    # Attention sinks: the kernel cannot read them, so decode steps gather.
    assert resolve(family("gpt_oss"), LLAMA, paged=True, batched=True, cuda=True) == (
        EngineConfig(
            shape_buckets=True,
            lora_kernel=True,
            fused_projections=True,
            decode_gemm=True,
            fused_add_norm=True,
            fold_quantized_rows=True,
        )
    )
    # Dense storage: no pool to read directly.
    assert resolve(family("llama"), LLAMA, paged=False, batched=True, cuda=True) == (
        EngineConfig(
            storage="dense",
            shape_buckets=True,
            lora_kernel=True,
            fused_projections=True,
            decode_gemm=True,
            fused_add_norm=True,
            fold_quantized_rows=True,
        )
    )
    # A head size the kernel does not take.
    config = resolve(
        family("llama"), LLAMA, paged=True, batched=True, cuda=True, head_dim_supported=False
    )
    assert config.decode_attention == "gather"


def test_a_rope_that_reads_offsets_on_the_host_is_not_compiled():
    config = resolve(family("llama"), LLAMA, paged=True, batched=True, cuda=True, compilable=False)
    assert config.decode_attention == "direct" and not config.compile_decode


def test_the_reference_path_can_be_forced(monkeypatch):
    monkeypatch.setenv(DEBUG_REFERENCE_ENV, "1")
    config = resolve(
        family("llama"), LLAMA, paged=True, batched=True, cuda=True, cpu=False, float32=True
    )
    assert config == EngineConfig(decode_attention="mirror")


def test_only_the_cpu_dequantizes_quantized_weights():
    cpu = resolve(family("llama"), LLAMA, paged=True, batched=True, cuda=False, cpu=True)
    assert cpu == EngineConfig(
        decode_attention="mirror",
        dequantize_weights=True,
        shared_rope_angles=True,
        compiled_norms=True,
    )
    metal = resolve(family("llama"), LLAMA, paged=True, batched=True, cuda=False, cpu=False)
    assert metal == EngineConfig(decode_attention="mirror")
    assert not resolve(
        family("llama"), LLAMA, paged=True, batched=True, cuda=True
    ).dequantize_weights


def test_float32_mirrored_steps_attend_with_the_multiply_add_exp():
    """On the CPU in float32, mirrored decode steps compute attention themselves where the
    family's attention is mlx-lm's function; not in other dtypes, nor for a family that
    soft-caps its logits (gemma2), nor on Metal (its attention is a kernel), nor on CUDA."""
    on = resolve(
        family("llama"), LLAMA, paged=True, batched=True, cuda=False, cpu=True, float32=True
    )
    assert on.decode_attention == "mirror" and on.fast_mirror_attention and on.fast_swiglu
    for config in (
        resolve(family("llama"), LLAMA, paged=True, batched=True, cuda=False),
        resolve(family("gemma2"), LLAMA, paged=True, batched=True, cuda=False, float32=True),
        resolve(family("llama"), LLAMA, paged=True, batched=True, cuda=True, float32=True),
        resolve(
            family("llama"), LLAMA, paged=True, batched=True, cuda=False, cpu=False, float32=True
        ),
    ):
        assert not config.fast_mirror_attention
    with pytest.raises(ValueError, match="needs mirror decode attention"):
        EngineConfig(fast_mirror_attention=True)


def test_only_the_cpu_shares_ropes_angles_between_layers():
    """MLX's CPU RoPE is a fallback that makes its angles in every call; Metal's and CUDA's
    are kernels."""
    assert resolve(
        family("llama"), LLAMA, paged=True, batched=True, cuda=False, cpu=True
    ).shared_rope_angles
    for cuda, cpu in ((False, False), (True, False)):
        config = resolve(family("llama"), LLAMA, paged=True, batched=True, cuda=cuda, cpu=cpu)
        assert not config.shared_rope_angles


def test_unverified_families_run_each_row_alone():
    config = resolve(family("some_new_arch"), LLAMA, paged=False, batched=False, cuda=False)
    assert config.decode_path == "per-row fallback"


def test_the_factory_builds_the_storage_the_config_names():
    model = tiny_llama()
    cpu = resolve(family("llama"), LLAMA, paged=True, batched=True, cuda=False)
    paged = make_storage(cpu, model, LLAMA, PoolShape(num_blocks=8, block_size=4))
    assert paged.name == "paged" and paged.mirror is not None and not paged.write_in_place
    dense = make_storage(replace(cpu, storage="dense", decode_attention="gather"), model, LLAMA)
    assert dense.name == "dense"
    with pytest.raises(ValueError, match="pool shape"):
        make_storage(cpu, model, LLAMA)
    with pytest.raises(ValueError, match="needs paged storage"):
        EngineConfig(storage="dense", decode_attention="mirror")
    with pytest.raises(ValueError, match="needs overlapped steps"):
        EngineConfig(update_beside_dispatch=True)


def test_parallel_and_max_batch_size_are_one_setting(monkeypatch, capsys):
    assert parse("--parallel", "8").scheduling.batch_size == 8
    assert parse("-np", "6", "--max-batch-size", "6").scheduling.max_batch_size == 6
    with pytest.raises(SystemExit):
        parse("--parallel", "8", "--max-batch-size", "4")
    assert "--parallel 8 and --max-batch-size 4 set the same value" in capsys.readouterr().err
    monkeypatch.setenv("MLXSERVE_PARALLEL", "3")
    assert parse().scheduling.max_batch_size == 3
    assert parse("--no-batch").scheduling.batch_size == 1


def test_adapters_are_repeated_flags_with_a_comma_separated_variable(monkeypatch, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert parse().model.adapters == ()
    assert parse("--adapter", f"sql={a}", "--adapter", f"chat={b}").model.adapters == (
        ("sql", a),
        ("chat", b),
    )
    monkeypatch.setenv("MLXSERVE_ADAPTER", f"sql={a}, chat={b}")
    assert parse().model.adapters == (("sql", a), ("chat", b))
    # Flags on the command line replace the variable's list.
    assert parse("--adapter", f"only={b}").model.adapters == (("only", b),)
    assert parse("--adapter", f"x={a}").core.model.adapters == (("x", a),)


@pytest.mark.parametrize(
    "value, message",
    [
        ("sql", "is not NAME=PATH"),
        ("=/x", "adapter name ''"),
        ("a b=/x", "adapter name 'a b'"),
        ("sql=", "is not NAME=PATH"),
    ],
)
def test_a_malformed_adapter_flag_is_refused(value, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse("--adapter", value)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_adapter_names_are_unique_and_paths_exist(tmp_path):
    with pytest.raises(ConfigError, match="--adapter sql=/no/such: no such directory"):
        parse("--adapter", "sql=/no/such")
    with pytest.raises(ConfigError, match="--adapter sql: the name is given twice"):
        parse("--adapter", f"sql={tmp_path}", "--adapter", f"sql={tmp_path}")


def test_a_malformed_adapter_variable_is_refused(monkeypatch):
    monkeypatch.setenv("MLXSERVE_ADAPTER", "sql")
    with pytest.raises(ConfigError, match="MLXSERVE_ADAPTER: 'sql' is not NAME=PATH"):
        parse()


def test_help_lists_the_flags_by_group():
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    text = parser.format_help().split("\noptions:", 1)[1]
    groups = ["transport and security", "front end", "scheduler", "KV cache", "model"]
    groups.append("structured output")
    positions = [text.index(f"\n{g}:") for g in [*groups, "observability"]]
    assert positions == sorted(positions)
    assert text.index("--tls-cert") < text.index("\nfront end:") < text.index("--api-workers")


def test_each_process_gets_only_its_part():
    config = parse("--port", "50123", "--model", "/m", "--kv-cache-budget", "none")
    core, frontend = config.core, config.frontend_process
    assert (core.model.path, core.kv.kv_cache_budget) == ("/m", "none")
    assert not hasattr(core, "transport") and not hasattr(frontend, "scheduling")
    assert frontend.transport.port == 50123 and not hasattr(frontend, "kv")


def test_api_workers_default_to_one_per_four_cores(monkeypatch):
    assert [auto_api_workers(n) for n in (1, 2, 4, 8, 16, 64)] == [1, 1, 1, 2, 4, 4]
    assert parse().frontend.api_workers == auto_api_workers()
    assert parse("--api-workers", "3").frontend.api_workers == 3
    monkeypatch.setenv("MLXSERVE_API_WORKERS", "2")
    assert parse().frontend.api_workers == 2


def test_structured_output_flags_reach_both_processes(monkeypatch):
    config = parse("--max-grammar-compile-ms", "750", "--grammar-cache-size", "32")
    assert config.core.structured.max_grammar_compile_ms == 750.0
    assert config.frontend_process.structured.grammar_cache_size == 32
    monkeypatch.setenv("MLXSERVE_MAX_GRAMMAR_COMPILE_MS", "1500")
    monkeypatch.setenv("MLXSERVE_GRAMMAR_CACHE_SIZE", "8")
    config = parse()
    assert config.structured.max_grammar_compile_ms == 1500.0
    assert config.structured.grammar_cache_size == 8
    with pytest.raises(ConfigError, match="--max-grammar-compile-ms"):
        parse("--max-grammar-compile-ms", "0")
    with pytest.raises(ConfigError, match="--grammar-cache-size"):
        parse("--grammar-cache-size", "0")


def test_prefill_limits_by_device_unless_set():
    from service.common.config import CPU_PREFILL_ROWS, GPU_PREFILL_TOKENS

    config = SchedulingConfig(max_batch_size=256)
    assert config.prefill_limits(gpu=True) == (256, GPU_PREFILL_TOKENS)  # the whole batch
    assert config.prefill_limits(gpu=False) == (CPU_PREFILL_ROWS, None)  # scheduler-derived
    flags = SchedulingConfig(max_batch_size=256, max_batch_prefill=8, max_batch_prefill_tokens=0)
    assert flags.prefill_limits(gpu=True) == flags.prefill_limits(gpu=False) == (8, 0)
