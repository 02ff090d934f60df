"""service.core.models.swap: children replaced in place, under their own names."""

from __future__ import annotations

from mlx import nn

from service.core.models.swap import swap_modules


class _Wrapped(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner


def test_every_wanted_child_is_wrapped_under_its_name() -> None:
    model = nn.Sequential(nn.RMSNorm(4), nn.Linear(4, 4), nn.Sequential(nn.RMSNorm(4)))
    norms = [model.layers[0], model.layers[2].layers[0]]
    count = swap_modules(model, lambda child: type(child) is nn.RMSNorm, _Wrapped)
    assert count == 2
    assert type(model.layers[0]) is _Wrapped and model.layers[0].inner is norms[0]
    assert type(model.layers[2].layers[0]) is _Wrapped
    assert model.layers[2].layers[0].inner is norms[1]
    assert type(model.layers[1]) is nn.Linear


def test_nothing_wanted_changes_nothing() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    assert swap_modules(model, lambda child: False, _Wrapped) == 0
    assert type(model.layers[0]) is nn.Linear
