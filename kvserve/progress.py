"""A progress line for long loops (model load, quantisation, evaluation, benchmarks), drawn only when
stderr is a terminal (logs and pipes get nothing, so output stays clean to parse)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def progress(items: Iterable[T], total: int, label: str, stream=None) -> Iterator[T]:
    """Yield `items`, redrawing `label [#####.....] i/total, elapsed` on a TTY."""
    stream = stream or sys.stderr
    if not stream.isatty() or total <= 0:
        yield from items
        return
    start = time.monotonic()
    width = 30
    for i, item in enumerate(items):
        yield item
        done = i + 1
        filled = width * done // total
        elapsed = time.monotonic() - start
        eta = elapsed / done * (total - done)
        stream.write(
            f"\r{label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} "
            f"{elapsed:.0f}s elapsed, ~{eta:.0f}s left "
        )
        stream.flush()
    stream.write("\n")
    stream.flush()
