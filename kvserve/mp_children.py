"""Letting a daemonic process start helper processes (torch-free)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0
_saved: object = None


@contextlib.contextmanager
def children_allowed() -> Iterator[None]:
    """Let a daemonic process (an engine core started with daemon=True) start children: multiprocessing
    refuses children of daemons only so that they are not orphaned, and ours are not (tensor-parallel
    workers exit when their pipe to the engine closes; grammar compile workers die with their forkserver,
    which exits with the engine). Reentrant and thread-safe: the flag is restored by the last to leave."""
    global _depth, _saved
    config = mp.current_process()._config  # noqa: SLF001 (multiprocessing keeps the flag here)
    with _lock:
        if _depth == 0:
            _saved = config.get("daemon")
            config["daemon"] = False
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _saved is not None:
                config["daemon"] = _saved
