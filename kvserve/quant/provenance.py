"""What identifies quantised weights on disk, for /manifest and the evaluation record: the
artifact's hash, the recorded evaluation beside it, a GPTQ or AWQ checkpoint's label. Torch-free:
the API process reads these (docs/design.md)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

HF_METHODS = (
    "gptq",
    "awq",
)  # pre-quantised Hugging Face checkpoints kvserve reads (hf_checkpoints.py)
EVALUATION_NAME = "kvserve_evaluation.json"  # written beside an artifact by `eval compare --record`


def artifact_sha256(model_dir: str | Path) -> str:
    """SHA-256 over config.json and the weight files, in name order: the artifact's identity."""
    model_dir = Path(model_dir)
    digest = hashlib.sha256()
    for path in [model_dir / "config.json", *sorted(model_dir.glob("*.safetensors"))]:
        digest.update(path.name.encode())
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def recorded_evaluation(model_dir: str | Path) -> dict | None:
    """The evaluation recorded beside an artifact (`eval compare --record`), if it still matches the
    files: its hash and whether it passed."""
    path = Path(model_dir) / EVALUATION_NAME
    if not path.is_file():
        return None
    report = json.loads(path.read_text())
    current = report.get("candidate", {}).get("artifact_sha256") == artifact_sha256(model_dir)
    return {"sha256": report.get("sha256"), "passed": report.get("passed"), "current": current}


def describe_hf_checkpoint(qconfig: dict) -> str:
    """The served scheme's label for /manifest, e.g. `gptq int4-g128` or `awq int4-g128-zp`."""
    group = qconfig.get("group_size", qconfig.get("q_group_size"))
    grouping = "" if group in (-1, None) else f"-g{group}"
    method = qconfig.get("quant_method")
    zp = method == "awq" or not qconfig.get("sym", True)
    return f"{method} int{qconfig.get('bits', qconfig.get('w_bit'))}{grouping}{'-zp' if zp else ''}"
