"""service/core/kv/budget.py: the memory a process may still take counts its container's (or
service's) cgroup limit, v2 or v1, nested or namespaced; `--kv-cache-budget` parsing."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from service.core.kv import budget

GIB = 1 << 30
MIB = 1 << 20


def write(directory: Path, **files: str | int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, value in files.items():
        (directory / name.replace("__", ".")).write_text(f"{value}\n")


def membership(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "self-cgroup"
    path.write_text(text)
    return path


def test_a_v2_container_counts_its_limit_less_its_working_set(tmp_path):
    root = tmp_path / "cg"
    write(root, memory__max=4 * GIB, memory__current=GIB, memory__stat=f"inactive_file {512 * MIB}")
    left = budget.cgroup_memory_left(root, membership(tmp_path, "0::/\n"))
    assert left == 4 * GIB - (GIB - 512 * MIB)


def test_a_nested_v2_service_takes_the_tightest_limit_above_it(tmp_path):
    root = tmp_path / "cg"
    write(root / "system.slice" / "x.service", memory__max="max", memory__current=GIB)
    write(root / "system.slice", memory__max=2 * GIB, memory__current=3 * GIB // 2)
    self_cgroup = membership(tmp_path, "0::/system.slice/x.service\n")
    assert budget.cgroup_memory_left(root, self_cgroup) == GIB // 2


def test_a_v1_memory_cgroup_and_its_unlimited_parent(tmp_path):
    root = tmp_path / "cg"
    unlimited = 9223372036854771712  # what v1 writes for no limit
    write(root / "memory", memory__limit_in_bytes=unlimited, memory__usage_in_bytes=8 * GIB)
    write(
        root / "memory" / "docker" / "abc",
        memory__limit_in_bytes=GIB,
        memory__usage_in_bytes=256 * MIB,
        memory__stat="cache 0\ntotal_inactive_file 0",
    )
    self_cgroup = membership(tmp_path, "5:cpu:/\n\n4:memory:/docker/abc\n0::/\n")
    assert budget.cgroup_memory_left(root, self_cgroup) == GIB - 256 * MIB


def test_no_limit_or_no_cgroup_says_none(tmp_path):
    root = tmp_path / "cg"
    write(root / "memory", memory__limit_in_bytes=9223372036854771712, memory__usage_in_bytes=1)
    assert budget.cgroup_memory_left(root, membership(tmp_path, "4:memory:/\n")) is None
    assert budget.cgroup_memory_left(tmp_path / "none", tmp_path / "no-such-file") is None
    # Usage above the limit (charged page cache it has not reclaimed yet): no room, not less.
    write(root, memory__max=GIB, memory__current=2 * GIB)
    assert budget.cgroup_memory_left(root, membership(tmp_path, "0::/\n")) == 0


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="a GPU counts its own memory")
def test_available_memory_is_capped_by_the_container(tmp_path, monkeypatch):
    root = tmp_path / "cg"
    write(root, memory__max=300 * MIB, memory__current=100 * MIB)
    monkeypatch.setattr(budget, "CGROUP_ROOT", root)
    monkeypatch.setattr(budget, "SELF_CGROUP", membership(tmp_path, "0::/\n"))
    assert budget.available_memory_bytes() == 200 * MIB
    monkeypatch.setattr(budget, "CGROUP_ROOT", tmp_path / "none")
    assert budget.available_memory_bytes() > 200 * MIB  # the host's MemAvailable


def test_budget_values():
    assert budget.parse_budget("none", 0) is None
    assert budget.parse_budget("600M", 0) == 600 * MIB
    assert budget.auto_budget(0, available=10 * GIB) == 9 * GIB  # a tenth kept as headroom
    with pytest.raises(budget.BudgetError, match="--kv-cache-budget"):
        budget.parse_budget("lots", 0)
