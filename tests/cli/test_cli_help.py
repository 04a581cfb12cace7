"""`--help` of every kvserve sub-command documents every flag and names its default."""

from __future__ import annotations

import argparse

import pytest

from kvserve.cli import _subparsers, build_parser, shows_default

SKIPPED = (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)


def _parsers() -> list[argparse.ArgumentParser]:
    return _subparsers(build_parser())


def _flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, SKIPPED)]


def test_the_walk_reaches_every_subcommand():
    progs = {p.prog for p in _parsers()}
    for name in ("serve", "generate", "bench serve", "bench latency", "plan", "simulate", "eval"):
        assert f"kvserve {name}" in progs


@pytest.mark.parametrize("parser", _parsers(), ids=lambda p: p.prog)
def test_every_flag_has_help_and_states_its_default(parser):
    parser.format_help()  # every help string expands (no stray %)
    formatter = parser._get_formatter()
    for action in _flags(parser):
        name = "/".join(action.option_strings) or action.dest
        if action.help == argparse.SUPPRESS:  # hidden on purpose (test-only flags)
            continue
        assert action.help, f"{parser.prog} {name}: no help text"
        if action.option_strings and action.default not in (None, False) and action.nargs != 0:
            text = formatter._expand_help(action)
            assert "default" in text or str(action.default) in text, (
                f"{parser.prog} {name}: --help does not state the default {action.default!r}"
            )


def test_shows_default_appends_once():
    parser = argparse.ArgumentParser()
    stated = parser.add_argument("--a", default=3, help="a count (default 3)")
    bare = parser.add_argument("--b", default=3, help="a count")
    flag = parser.add_argument("--c", action="store_true", help="a flag")
    assert not shows_default(stated) and shows_default(bare) and not shows_default(flag)
