"""service.common.os_thread: threads named for the operating system (what /proc shows)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from service.common.os_thread import NAME_BYTES, name_this_thread, named_executor

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's /proc")


def _os_name() -> str:
    return Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()


@linux_only
def test_a_thread_takes_the_name_truncated_to_the_kernels_bytes() -> None:
    seen: list[str] = []

    def run() -> None:
        name_this_thread("a-rather-long-thread-name")
        seen.append(_os_name())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == ["a-rather-long-thread-name"[:NAME_BYTES]]


@linux_only
def test_a_named_executors_threads_carry_its_name_in_python_and_for_the_os() -> None:
    with named_executor(2, "probe-pool") as pool:
        names = {pool.submit(lambda: (threading.current_thread().name, _os_name())).result()}
    for python_name, os_name in names:
        assert python_name.startswith("probe-pool")
        assert os_name == "probe-pool"
