"""The serving-overhead harness's pieces that need no server: the `tiny-vocab` preset (its
shape, a forward pass, and that the embedded tokenizer streams any id it can generate), and the
/proc parsing of bench/serving_overhead.py. (The harness itself starts a server: run it as its
docstring says.)"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
import pytest

from bench import serving_overhead as so
from service.common.os_thread import ENGINE_THREAD, name_this_thread
from service.core.models.presets import dummy_model

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")


def test_tiny_vocab_is_one_narrow_layer_over_512_tokens() -> None:
    model, config = dummy_model(so.PRESET, mx.float32)
    assert config["vocab_size"] == so.VOCAB == 512
    assert config["num_hidden_layers"] == 1 and config["hidden_size"] == 64
    assert len(model.layers) == 1
    logits = model(mx.array([[so.FIRST_PLAIN_ID, 100, so.VOCAB - 1]]))
    assert logits.shape == (1, 3, so.VOCAB)
    assert mx.all(mx.isfinite(logits)).item()


@pytest.mark.model
def test_the_embedded_tokenizer_streams_every_id_the_model_can_generate() -> None:
    from service.common.tokenizer import tokenizer_from_gguf
    from service.core.models.gguf import read_gguf_metadata
    from service.core.models.loader import embedded_gguf_path
    from service.frontend.detokenizer import IncrementalDetokenizer

    tok = tokenizer_from_gguf(read_gguf_metadata(embedded_gguf_path()))
    assert tok.vocab_size > so.VOCAB
    assert all(tok.decode([i]) for i in range(so.VOCAB))  # each id is spelled
    rng = random.Random(0)
    ids = [rng.randrange(so.VOCAB) for _ in range(2000)]  # byte pieces, special tokens, words
    detok = IncrementalDetokenizer(tok.decode, (), tok.ends_mid_character, tok.text_bytes)
    text = "".join(detok.push(i) for i in ids) + detok.flush()
    assert text and detok.text == text


def test_stat_parsing_takes_the_fields_after_the_command_name() -> None:
    fields = ["S", "42"] + ["0"] * 9 + ["7", "5"] + ["0"] * 30
    assert so.parse_stat(f"123 (a (b) c) {' '.join(fields)}") == (42, 12)


def test_cpu_ticks_and_children_of_a_live_process() -> None:
    before = so.cpu_ticks(os.getpid())
    deadline = time.process_time() + 0.1
    while time.process_time() < deadline:
        pass
    after = so.cpu_ticks(os.getpid())
    assert before is not None and after is not None and after >= before + 5  # 10 ms ticks
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        roles = so.server_processes(os.getpid())
        assert roles["frontend"][0] == os.getpid()
        assert child.pid in roles["frontend"] and roles["core"] == []
    finally:
        child.kill()
        child.wait()
    assert so.cpu_ticks(child.pid) is None  # reaped: gone from /proc


def test_machine_ticks() -> None:
    line = "cpu  100 5 50 1000 20 3 2 1 7 0\ncpu0 1 2 3 4 5 6 7 8 9 0\n"
    assert so.parse_machine_ticks(line) == (161, 1181)
    busy, total = so.machine_ticks()
    assert 0 < busy < total


def test_summary_and_table() -> None:
    windows = [
        {
            "window": k + 1,
            "loadavg_1m_before": 1.0 + k,
            "others_cores": 0.1,
            "tokens_per_second": 1000.0 * (k + 1),
            "tokens": 1000 * (k + 1),
            "messages": 500,
            "errors": 0,
            "core_us_per_token": 10.0 + k,
            "frontend_us_per_token": 20.0,
            "client_us_per_token": 5.0,
            "core_cores": 0.9,
            "frontend_cores": 0.5,
            "client_cores": 0.2,
            # Without --metrics the steps are not known.
            "steps_per_second": 400.0 + k if k else None,
            "serial_step_share": 0.5 + k / 10 if k else None,
        }
        for k in range(3)
    ]
    summary = so.summarize(windows)
    assert summary["tokens_per_second"] == {"median": 2000.0, "min": 1000.0, "max": 3000.0}
    assert summary["serial_step_share"] == pytest.approx({"median": 0.65, "min": 0.6, "max": 0.7})
    table = so.format_table(windows, summary)
    assert "1000-3000" in table and "median" in table
    assert "0.60-0.70" in table and "401-402" in table


def test_the_cores_threads_by_role_from_their_os_names() -> None:
    """The server names its engine threads for the OS; MLX's and OpenBLAS's keep the process's
    name; the main thread and ZeroMQ's carry the transport."""
    assert so.thread_role(10, 12, "engine") == "engine"
    assert so.thread_role(10, 13, "engine-update") == "engine"
    assert so.thread_role(10, 10, "python") == "transport"
    assert so.thread_role(10, 14, "ZMQbg/IO/0") == "transport"
    assert so.thread_role(10, 15, "python") == "mlx"
    spent = threading.Event()
    done = threading.Event()

    def engine() -> None:
        name_this_thread(ENGINE_THREAD)
        deadline = time.thread_time() + 0.2
        while time.thread_time() < deadline:
            pass
        spent.set()
        done.wait(30)

    thread = threading.Thread(target=engine)
    thread.start()
    try:
        assert spent.wait(30)
        ticks = so.thread_ticks(os.getpid())
        assert set(ticks) == set(so.THREAD_ROLES)
        assert ticks["engine"] >= 10  # its 0.2 s of CPU time, in 10 ms ticks
    finally:
        done.set()
        thread.join()
