"""The runtime on the CPU dequantizes a quantized model's layers at load where the float weights
take at most half the free memory, and keeps them quantized (saying so) where they do not."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx import nn
from structlog.testing import capture_logs

from service.core import runtime as runtime_module
from service.core.models.activations import FastSwiGLUMLP
from tests.helpers.runtime import loaded_runtime

pytestmark = [
    pytest.mark.model,  # the dummy preset takes the embedded model's tokenizer
    pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the CPU path dequantizes"),
]


def quantized_layers(model: nn.Module) -> int:
    return sum(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())


def test_a_quantized_model_is_served_dequantized_on_the_cpu():
    with capture_logs() as logs, loaded_runtime("tiny-4bit") as runtime:
        assert runtime.runner.config.dequantize_weights
        model = runtime.runner.model
        assert quantized_layers(model) == 0
        assert model.layers[0].mlp.down_proj.weight.dtype == mx.float32
        # Dequantized first, the float32 MLPs take the CPU's fast SwiGLU like any float model.
        assert isinstance(model.layers[0].mlp, FastSwiGLUMLP)
        info = runtime.model_info()
        assert info.quantization.dequantized and info.quantization.bits == 4
    events = [e for e in logs if e["event"] == "quantized weights dequantized for the CPU"]
    assert len(events) == 1 and events[0]["layers"] > 0 and events[0]["extra_bytes"] > 0


def test_weights_that_would_not_fit_stay_quantized(monkeypatch):
    monkeypatch.setattr(runtime_module, "available_memory_bytes", lambda: 1 << 20)
    with capture_logs() as logs, loaded_runtime("tiny-4bit") as runtime:
        assert quantized_layers(runtime.runner.model) > 0
        assert not runtime.model_info().quantization.dequantized
    (event,) = [e for e in logs if e["event"].startswith("quantized weights kept")]
    assert event["log_level"] == "warning" and event["available_bytes"] == 1 << 20
