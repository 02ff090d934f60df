"""A process's children and whether one has MLX mapped, read from /proc (Linux only)."""

from __future__ import annotations

from pathlib import Path


def children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def maps_mlx(pid: int) -> bool:
    return "libmlx" in Path(f"/proc/{pid}/maps").read_text()


def core_of(pid: int) -> int:
    (core,) = [c for c in children(pid) if maps_mlx(c)]
    return core
