"""Where the default model lives: the project's embedded demo target (see tools/demo_models)."""

from __future__ import annotations

from pathlib import Path

from kvserve.core.errors import ModelLoadError

ASSETS_DIR = Path(__file__).parent / "assets" / "demo"


def default_model_dir() -> Path:
    target = ASSETS_DIR / "target"
    if not (target / "config.json").is_file():
        raise ModelLoadError(
            f"the embedded default model is missing ({target}); pass a model directory instead"
        )
    return target


def default_draft_dir() -> Path:
    draft = ASSETS_DIR / "draft"
    if not (draft / "config.json").is_file():
        raise ModelLoadError(f"the embedded draft model is missing ({draft})")
    return draft
