"""service.common.ports: a free port is drawn below the kernel's ephemeral range (where no
outgoing connection can take it before its process binds it), and is free."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from service.common import ports


def _range_file(tmp_path: Path, low: int, high: int) -> Path:
    path = tmp_path / "ip_local_port_range"
    path.write_text(f"{low}\t{high}\n")
    return path


def test_a_port_is_drawn_below_the_ephemeral_range_and_can_be_bound(tmp_path: Path) -> None:
    path = _range_file(tmp_path, 40000, 60999)
    for _ in range(20):
        port = ports.free_port(path=path)
        assert 40000 - 16384 <= port < 40000
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))


def test_a_held_port_is_passed_over(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _range_file(tmp_path, 40000, 60999)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", ports.free_port(path=path)))
        taken = held.getsockname()[1]
        draws = iter([taken, taken, taken + 1 if taken + 1 < 40000 else taken - 1])
        monkeypatch.setattr(ports.random, "randrange", lambda a, b: next(draws))
        port = ports.free_port(path=path)
    assert port != taken and abs(port - taken) == 1


def test_without_room_below_the_range_the_kernel_chooses(tmp_path: Path) -> None:
    path = _range_file(tmp_path, 1024, 65535)
    port = ports.free_port(path=path)
    assert 1024 <= port <= 65535


def test_an_unreadable_range_reads_as_linux_default(tmp_path: Path) -> None:
    assert ports.ephemeral_range(tmp_path / "missing") == (32768, 60999)
    (tmp_path / "bad").write_text("not numbers")
    assert ports.ephemeral_range(tmp_path / "bad") == (32768, 60999)
    assert ports.ephemeral_range(_range_file(tmp_path, 20000, 50000)) == (20000, 50000)
