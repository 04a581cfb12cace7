"""The real models' GGUF files, from the packages `make install` installs; a test skips without them."""

from __future__ import annotations

from pathlib import Path

import pytest


def smollm2_gguf() -> Path:
    from kvserve.core.errors import ModelLoadError
    from kvserve.models import SMOLLM2, packaged_gguf

    try:
        return packaged_gguf(SMOLLM2)
    except ModelLoadError as exc:
        pytest.skip(str(exc))
