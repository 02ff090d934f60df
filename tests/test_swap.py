"""service.core.models.swap: children replaced in place, under their own names."""

from __future__ import annotations

from mlx import nn

from service.core.models.swap import swap_modules


class _Wrapped(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(4)
        self.proj = nn.Linear(4, 4)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = [_Block(), _Block()]
        self.norm = nn.RMSNorm(4)


def test_every_wanted_attribute_child_is_wrapped_under_its_name() -> None:
    model = _Model()
    norms = [model.layers[0].norm, model.layers[1].norm, model.norm]
    count = swap_modules(model, lambda child: type(child) is nn.RMSNorm, _Wrapped)
    assert count == 3
    assert [m.inner for m in (model.layers[0].norm, model.layers[1].norm, model.norm)] == norms
    assert all(type(block.proj) is nn.Linear for block in model.layers)


def test_nothing_wanted_changes_nothing() -> None:
    model = _Model()
    assert swap_modules(model, lambda child: False, _Wrapped) == 0
    assert type(model.norm) is nn.RMSNorm
