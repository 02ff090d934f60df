"""The operating system's name for the calling thread: what `top -H`, `perf` and
/proc/PID/task/TID/comm show. Python's thread names stay inside Python; the engine core's busy
threads get OS names too, so that its CPU can be split by thread from outside the process
(bench/serving_overhead.py does) and read in a profile. MLX's own stream threads keep the
process's name."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from concurrent.futures import ThreadPoolExecutor

_PR_SET_NAME = 15
NAME_BYTES = 15  # the kernel keeps 15 bytes and a terminating zero
# The engine core's threads: the loop's, and the one that reads a step beside the next one's
# dispatch (service.core.loop).
ENGINE_THREAD = "engine"
UPDATE_THREAD = "engine-update"


@functools.cache
def _libc() -> ctypes.CDLL | None:
    path = ctypes.util.find_library("c")
    return ctypes.CDLL(path, use_errno=True) if path else None


def name_this_thread(name: str) -> None:
    """Name the calling thread (Linux; elsewhere nothing), truncated to NAME_BYTES bytes."""
    if not sys.platform.startswith("linux"):
        return
    libc = _libc()
    if libc is not None:
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:NAME_BYTES]), 0, 0, 0)


def named_executor(workers: int, name: str) -> ThreadPoolExecutor:
    """A thread pool whose threads carry `name` in Python and for the OS (`name_this_thread`)."""
    return ThreadPoolExecutor(
        workers, thread_name_prefix=name, initializer=name_this_thread, initargs=(name,)
    )
