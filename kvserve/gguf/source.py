"""What a GGUF model directory (gguf/model_dir.py) points at, read without the GGUF reader: the file, its
matrices' ggml types, and which of those types kvserve's integer panel kernel runs as they are.

Torch-free and light (json only), so the engine's config can decide `--gguf-activations auto` in any
process.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvserve.core.errors import ModelLoadError

POINTER = "gguf.json"  # written last by gguf_model_dir: its presence marks a whole directory

# ggml types whose blocks are one of kvserve's integer formats over groups of 32 (docs/gguf.md): with
# int8 activations they run on the panel kernel with the file's codes and fp16 scales as they are.
PANEL_FORMATS = {"Q4_0": "int4-g32", "Q4_1": "int4-g32-zp", "Q5_0": "int8-g32", "Q8_0": "int8-g32"}


def gguf_source(model_dir: str | Path) -> Path | None:
    """The GGUF file behind a directory written by `gguf_model_dir`, else None."""
    pointer = Path(model_dir) / POINTER
    if not pointer.is_file():
        return None
    path = Path(json.loads(pointer.read_text())["file"])
    if not path.is_file():
        raise ModelLoadError(f"{model_dir}: its GGUF file {path} is gone")
    return path


def gguf_matrix_types(model_dir: str | Path) -> dict[str, int]:
    """ggml type -> how many of the file's matrices are in it ({} for a directory of another kind)."""
    pointer = Path(model_dir) / POINTER
    return json.loads(pointer.read_text()).get("matrix_types", {}) if pointer.is_file() else {}
