"""Where kvserve caches what it builds or measures on a machine (torch-free; the one place that reads
KVSERVE_CACHE_DIR and XDG_CACHE_HOME): $KVSERVE_CACHE_DIR/KIND, else $XDG_CACHE_HOME/kvserve/KIND, else
~/.cache/kvserve/KIND."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(kind: str) -> Path:
    """`kind`: "profiles" (measured hardware), "kernels" (the C kernels), "ext" (the quantised GEMM)."""
    root = os.environ.get("KVSERVE_CACHE_DIR")
    if root:
        return Path(root).expanduser() / kind
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "kvserve" / kind
