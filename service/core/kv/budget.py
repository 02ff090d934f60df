"""The KV cache budget: how many bytes the block pool may hold (`--kv-cache-budget`)."""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx

GIB = 1 << 30
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmg]?)(?:i?b)?")
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


class BudgetError(ValueError):
    pass


CGROUP_ROOT = Path("/sys/fs/cgroup")
SELF_CGROUP = Path("/proc/self/cgroup")
# (limit, usage) files of a memory cgroup: v2, and v1's memory controller.
_V2 = ("memory.max", "memory.current")
_V1 = ("memory.limit_in_bytes", "memory.usage_in_bytes")
_UNLIMITED = 1 << 60  # v1 writes "no limit" as a page-rounded 2^63


def _headroom(directory: Path, files: tuple[str, str]) -> int | None:
    """One cgroup's limit less its usage, its inactive page cache counted as free (the kernel
    reclaims it before an OOM kill, as the kubelet's working set does); None: no limit here."""
    try:
        limit = (directory / files[0]).read_text().strip()
        usage = int((directory / files[1]).read_text())
    except (OSError, ValueError):
        return None
    if not limit.isdigit() or int(limit) >= _UNLIMITED:
        return None  # "max" (v2) or v1's sentinel
    inactive = 0
    try:
        for line in (directory / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key in ("inactive_file", "total_inactive_file"):
                inactive = int(value)
    except (OSError, ValueError):
        pass
    return max(0, int(limit) - max(0, usage - inactive))


def cgroup_memory_left(root: Path | None = None, membership: Path | None = None) -> int | None:
    """What the process's memory cgroups (a container's or a service's limit) still allow: the
    least headroom of its cgroup and the cgroups above it, v2 or v1 (`/proc/self/cgroup` names
    it; inside a container's namespace it is the mount's root). None where none has a limit."""
    root = CGROUP_ROOT if root is None else root
    try:
        lines = (SELF_CGROUP if membership is None else membership).read_text().splitlines()
    except OSError:
        lines = []
    leaves = []
    for line in lines:
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            leaves.append((root, root / path.lstrip("/"), _V2))
        elif "memory" in controllers.split(","):
            leaves.append((root / "memory", root / "memory" / path.lstrip("/"), _V1))
    leaves += [(root, root, _V2), (root / "memory", root / "memory", _V1)]
    for mount, leaf, files in leaves:
        if not (leaf / files[0]).exists():
            continue
        rooms = []
        directory = leaf
        while True:  # the cgroup and each one above it, up to the mount's root
            room = _headroom(directory, files)
            if room is not None:
                rooms.append(room)
            if directory == mount or directory == directory.parent:
                break
            directory = directory.parent
        return min(rooms) if rooms else None
    return None


def available_memory_bytes() -> int:
    """Memory the process could still take: the device's working set on a GPU, else the
    host's MemAvailable (Linux), within what the process's container may still use — on CPU
    the KV cache lives in host memory."""
    info = mx.device_info()
    for key in ("max_recommended_working_set_size", "memory_size", "total_memory"):
        if key in info and mx.default_device() != mx.cpu:
            return int(info[key]) - int(mx.get_active_memory())
    available = 8 * GIB
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass
    container = cgroup_memory_left()
    return available if container is None else min(available, container)


def auto_budget(weights_bytes: int, *, available: int | None = None) -> int:
    """Free memory minus the weights (if not already loaded) and an activation headroom."""
    free = available_memory_bytes() if available is None else available
    headroom = max(GIB, free // 10)
    return max(0, free - headroom - max(0, weights_bytes - int(mx.get_active_memory())))


def parse_budget(value: str, weights_bytes: int) -> int | None:
    """Bytes for the pool, or None for unlimited (`none`/0)."""
    text = value.strip().lower()
    if text in ("none", "0", "unlimited"):
        return None
    if text == "auto":
        return auto_budget(weights_bytes)
    match = _SIZE.fullmatch(text)
    if match is None:
        raise BudgetError(
            f"--kv-cache-budget {value!r}: use auto, none, or a size like 600000000 or 600M"
        )
    number = float(match.group(1)) * _UNITS[match.group(2) or ""]
    return int(number) or None
