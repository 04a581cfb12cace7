"""CPU weights in memory backed by transparent huge pages (docs/performance.md, "Weights on huge pages").

A decode step streams every weight from memory, and on 4 KiB pages that stream crosses a page (a TLB
miss, and the end of the hardware prefetcher's run) every 4 KiB. The kernels' weight layouts
(`fused_decode.f32_panels`, the quantised panels of model/qlinear.py) are therefore allocated here.
On a 2-vCPU AMD EPYC Zen 3 the batch-1 fp32 decode step of a 135M model ran 1.05-1.29x faster than on
4 KiB pages, in each of five alternated rounds (one process per setting).

`huge_empty` hands out tensors from arenas: anonymous mappings aligned to 2 MiB and advised
`MADV_HUGEPAGE` before any page is touched, so the kernel backs them with huge pages whenever
`/sys/kernel/mm/transparent_hugepage/enabled` is `always` or `madvise` (with `never` they are ordinary
pages, and everything works the same). Each tensor starts on a 64-byte line; tensors share an arena, so a
1.3 MB matrix sits on huge pages too. An arena's mapping lives as long as any tensor cut from it (each
holds a reference to it through its storage) and is unmapped with the last one.

`KVSERVE_HUGE_PAGES=0` in the environment turns it off (plain `torch.empty`), as does a platform other
than Linux. `describe()` says what this process got, for the startup summary.
"""

from __future__ import annotations

import mmap
import os
import re
import sys
import threading

import torch

HUGE_PAGE = 2 << 20
ARENA_BYTES = 64 << 20  # a tensor above half of this gets a mapping of its own
_LINE = 64
_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"

_lock = threading.Lock()
_arena: dict = {"map": None, "start": 0, "used": 0, "size": 0}
_ranges: list[tuple[int, int]] = []  # (address, bytes) of every advised range, for resident()


def enabled() -> bool:
    """Whether weights are put on huge-page-advised memory here (Linux, not switched off)."""
    if os.environ.get("KVSERVE_HUGE_PAGES", "1") == "0":
        return False
    return sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")


def _mapping(nbytes: int) -> tuple[mmap.mmap, int, int]:
    """A new anonymous mapping with `nbytes` (rounded up to 2 MiB) usable from a 2 MiB-aligned
    offset: (the map, the offset, the usable size)."""
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    address = torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr()
    offset = -address % HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, offset, size)
        _ranges.append((address + offset, size))
    except OSError:  # a kernel without transparent huge pages: ordinary pages
        pass
    return region, offset, size


def huge_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor on huge-page-advised memory (module docstring)."""
    nbytes = dtype.itemsize
    for dim in shape:
        nbytes *= dim
    if nbytes == 0 or not enabled():
        return torch.empty(shape, dtype=dtype)
    with _lock:
        if nbytes > ARENA_BYTES // 2:
            region, offset, _ = _mapping(nbytes)
        else:
            start = -(-_arena["used"] // _LINE) * _LINE
            if _arena["map"] is None or start + nbytes > _arena["size"]:
                region, base, size = _mapping(ARENA_BYTES)
                _arena.update(map=region, start=base, used=0, size=size)
                start = 0
            region, offset = _arena["map"], _arena["start"] + start
            _arena["used"] = start + nbytes
    flat = torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=offset)
    return flat.view(dtype).view(shape)


def to_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of CPU tensor `t` on huge-page-advised memory (another device's: `t`)."""
    if t.device.type != "cpu":
        return t
    out = huge_empty(tuple(t.shape), t.dtype)
    out.copy_(t)
    return out


def resident() -> tuple[int, int]:
    """(resident bytes, of them on huge pages) of this process's huge-page-advised mappings now, from
    /proc/self/smaps; (0, 0) when there are none or it cannot be read."""
    if not _ranges:
        return 0, 0
    try:
        with open("/proc/self/smaps") as f:
            text = f.read()
    except OSError:
        return 0, 0
    totals, ours = {"Rss:": 0, "AnonHugePages:": 0}, False
    for line in text.splitlines():
        head = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            start, end = int(head.group(1), 16), int(head.group(2), 16)
            ours = any(a < end and start < a + n for a, n in _ranges)
        elif ours and line.split(":")[0] + ":" in totals:
            totals[line.split(":")[0] + ":"] += int(line.split()[1]) * 1024
    return totals["Rss:"], totals["AnonHugePages:"]


def describe() -> str:
    """The startup summary's line, e.g. 'kernel layouts on huge pages: 536.0 of 545.3 MiB
    (transparent_hugepage: madvise)'."""
    if not enabled():
        why = "KVSERVE_HUGE_PAGES=0" if sys.platform.startswith("linux") else sys.platform
        return f"kernel layouts on ordinary pages ({why})"
    try:
        with open(_THP_SETTING) as f:
            setting = re.search(r"\[(\w+)\]", f.read()).group(1)
    except (OSError, AttributeError):
        setting = "unknown"
    rss, huge = resident()
    return (
        f"kernel layouts on huge pages: {huge / 2**20:,.1f} of {rss / 2**20:,.1f} MiB "
        f"(transparent_hugepage: {setting})"
    )
