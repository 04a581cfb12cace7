"""The suite's layout (tests/README.md): every test module sits in one of the folders the README
lists, and every folder it lists exists, so a newcomer finds a package's tests where the README says."""

from __future__ import annotations

import re

from tests import REPO_ROOT

TESTS = REPO_ROOT / "tests"


def listed_folders() -> set[str]:
    text = (TESTS / "README.md").read_text()
    return set(re.findall(r"^\| `([a-z_]+)/` \|", text, re.M))


def test_no_test_module_sits_at_the_top_level():
    assert sorted(p.name for p in TESTS.glob("test_*.py")) == []


def test_every_test_folder_is_listed_in_the_readme_and_every_listed_folder_exists():
    folders = {p.parent.name for p in TESTS.glob("*/test_*.py")}
    assert folders == listed_folders()
    for folder in folders:
        assert (TESTS / folder / "__init__.py").is_file(), folder
