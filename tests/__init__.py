"""The test suite: one folder per package of kvserve (tests/README.md), helpers at this level."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
FIXTURES = REPO_ROOT / "tests" / "fixtures"
