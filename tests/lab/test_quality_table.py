"""benchmarks/quality_table.py's row selection: its labels hold commas ("file's blocks, as shipped"), so
`--rows` is ';'-separated; a comma-separated list once selected nothing and ran an empty table."""

from __future__ import annotations

import importlib

import pytest

from tests import REPO_ROOT


@pytest.fixture
def quality_table(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO_ROOT / "benchmarks"))  # its `_report` import, as run
    return importlib.import_module("benchmarks.quality_table")


def test_rows_are_selected_by_labels_that_hold_commas(quality_table):
    labels = "file's blocks, int8 activations; file's blocks, as shipped"
    chosen = quality_table.select_rows(labels)
    assert [r.label for r in chosen] == ["file's blocks, as shipped", "file's blocks, int8 activations"]
    assert quality_table.select_rows(None) == list(quality_table.ROWS)


def test_an_unknown_or_comma_separated_label_is_refused(quality_table):
    with pytest.raises(SystemExit, match="unknown labels"):
        quality_table.select_rows("file's blocks, as shipped,file's blocks, int8 activations")
