"""The one way benchmarks write their JSON: the report plus the machine it ran on."""

from __future__ import annotations

import json
import platform
from pathlib import Path


def write_report(out: str | Path, report: dict) -> None:
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report | {"machine": platform.platform()}, indent=2))
    print(f"wrote {path}")
