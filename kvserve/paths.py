"""Files on disk, torch-free: where kvserve caches what it builds or measures on a machine (the one
place that reads KVSERVE_CACHE_DIR and XDG_CACHE_HOME): $KVSERVE_CACHE_DIR/KIND, else
$XDG_CACHE_HOME/kvserve/KIND, else ~/.cache/kvserve/KIND; and a file's content hash."""

from __future__ import annotations

import hashlib
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


def sha256_file(path: Path, chunk_bytes: int = 1 << 20) -> str:
    """The file's sha256 (hex), read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()
