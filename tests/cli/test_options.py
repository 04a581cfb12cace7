"""Options declared once (kvserve/core/options.py): each option's name, type, default, help and
bound are written in one place, and the flags, the dataclasses' checks and docs/options.md are made
from it."""

from __future__ import annotations

import argparse
import ast
from collections import Counter
from dataclasses import MISSING, fields
from pathlib import Path

import pytest

from kvserve.cli import build_parser
from kvserve.cli import main as cli_main
from kvserve.cli.options_doc import DOCS_PATH, REGENERATE, options_markdown
from kvserve.config import CacheConfig, DistConfig, SchedulerConfig, SpeculativeConfig
from kvserve.core.errors import InvalidRequestError
from kvserve.core.options import (
    declared,
    declared_field,
    flag_of,
    option_of,
    value_type,
    values_from_cli,
)
from kvserve.engine.args import EngineArgs
from kvserve.server.args import SERVE_OPTION_CLASSES, ServeArgs
from kvserve.server.limits import RequestLimits
from kvserve.server.serving import ServingOptions
from tests import REPO_ROOT

ROOT = REPO_ROOT
PACKAGE = ROOT / "kvserve"


def _serve_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices["serve"]


def test_the_docs_table_is_generated_from_the_declarations():
    on_disk = (ROOT / DOCS_PATH).read_text(encoding="utf-8")
    assert on_disk == options_markdown(), f"{DOCS_PATH} is stale: regenerate it with `{REGENERATE}`"
    for flag in ("`--max-num-seqs MAX_NUM_SEQS`", "`--max-n MAX_N`", "`--port PORT`"):
        assert flag in on_disk
    assert "--inject-fault" not in on_disk  # a test hook: hidden from --help and the docs
    assert "](options.md)" in (ROOT / "docs" / "server.md").read_text(encoding="utf-8")


def test_every_engine_option_sets_exactly_one_config_field():
    """Each `EngineArgs` field names one config field, no two name the same one, and the ones not
    resolved by `create_engine_config` take the config field's default, type, help and bound."""
    targets = Counter()
    for f, spec in declared(EngineArgs):
        assert spec.config is not None, f"EngineArgs.{f.name} sets no config field"
        config_class, name = spec.config
        targets[spec.config] += 1
        if name == "model_dir":
            continue
        source = declared_field(config_class, name)
        assert value_type(f)[0] is value_type(source)[0], f"{f.name}: type differs from {name}"
        if not spec.resolved:
            assert f.default == source.default, f"{f.name}: default differs from {name}'s"
            assert value_type(f) == value_type(source)
        for attribute in ("ge", "gt", "le"):
            assert getattr(spec, attribute) == getattr(option_of(source), attribute)
    assert [t for t, n in targets.items() if n > 1] == []


def _class_fields(path: Path):
    """(class name, field name, value node) for every annotated class attribute in `path`."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    yield node.name, item.target.id, item.value


def _call_name(node) -> str | None:
    if isinstance(node, ast.Call):
        func = node.func
        return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    return None


def test_no_option_restates_a_default_or_a_bound():
    """An `EngineArgs` field that copies a config field writes no default, help or bound of its
    own; only a resolved option (None: auto) states its own default."""
    found = {
        name: value
        for cls, name, value in _class_fields(PACKAGE / "engine" / "args.py")
        if cls == "EngineArgs"
    }
    for f, spec in declared(EngineArgs):
        value = found[f.name]
        if f.name == "model":
            continue
        assert _call_name(value) == "of", f"EngineArgs.{f.name} is not Option.of(...)"
        keywords = {k.arg for k in value.keywords}
        assert not keywords & {"ge", "gt", "le"}, f"EngineArgs.{f.name} restates its bound"
        if not spec.resolved:
            assert not keywords & {"default", "help"}, f"EngineArgs.{f.name} restates its default"


_OPERATORS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Pow: lambda a, b: a**b,
    ast.LShift: lambda a, b: a << b,
}


def _constant(node):
    """The value of a literal, or of arithmetic on literals (`8 * 1024 * 1024`); MISSING for a name
    or a call: a reference to a default, not a copy."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _constant(node.operand)
        return MISSING if inner is MISSING else -inner
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _constant(node.left), _constant(node.right)
        if MISSING not in (left, right):
            return _OPERATORS[type(node.op)](left, right)
    if isinstance(node, ast.Tuple):
        items = [_constant(e) for e in node.elts]
        return MISSING if MISSING in items else tuple(items)
    return MISSING


def _literal_default(value):
    """The default a class attribute writes as a literal: `= 64` or `= option(64, ...)`."""
    if _call_name(value) == "option" and value.args:
        value = value.args[0]
    return _constant(value)


def test_each_default_is_written_once():
    """Over the engine and the server (the lab has its own configurations), no class attribute
    named after an option writes that option's default again: `max_num_seqs = 64` once,
    `max_waiting_grammars = 64` once, each limit of RequestLimits once. (None, "not given", and
    False are no one's default to copy.)"""
    defaults: dict[str, set] = {}
    for cls in (*SERVE_OPTION_CLASSES, EngineArgs):
        for f, spec in declared(cls):
            names = {f.name} | ({spec.config[1]} if spec.config else set())
            for name in names:
                defaults.setdefault(name, set()).add(f.default)
    written = Counter()
    places = {}
    for path in PACKAGE.rglob("*.py"):
        if "lab" in path.relative_to(PACKAGE).parts:
            continue
        for cls, name, value in _class_fields(path):
            if name not in defaults or value is None:
                continue
            literal = _literal_default(value)
            if literal is MISSING or literal is None or literal is False or literal == ():
                continue
            if literal not in defaults[name]:
                continue
            written[name] += 1
            places.setdefault(name, []).append(f"{path.relative_to(ROOT)}:{cls}")
    assert written["max_num_seqs"] == 1 and written["max_waiting_grammars"] == 1
    assert all(written[f.name] == 1 for f, _ in declared(RequestLimits))
    # quant.compare.EvalModel (quant may not import config) restates two engine defaults
    known = {"kv_cache_dtype", "gguf_activations"}
    twice = {name: places[name] for name, n in written.items() if n > 1 and name not in known}
    assert twice == {}, f"defaults written more than once: {twice}"


def test_serve_spells_no_generated_flag_by_hand():
    tree = ast.parse((PACKAGE / "cli" / "serve.py").read_text(encoding="utf-8"))
    spelled = {
        arg.value
        for node in ast.walk(tree)
        if _call_name(node) == "add_argument"
        for arg in node.args
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str)
    }
    assert spelled == {"model", "--model"}


def test_serve_flags_parse_into_the_declared_defaults():
    args = build_parser().parse_args(["serve"])
    serve_values = values_from_cli(ServeArgs, args)
    assert ServeArgs(**serve_values) == ServeArgs()
    assert RequestLimits(**values_from_cli(RequestLimits, args)) == RequestLimits()
    assert ServingOptions("m", **values_from_cli(ServingOptions, args)) == ServingOptions("m")
    parser = _serve_parser()
    dests = {a.dest: a for a in parser._actions}
    for cls in SERVE_OPTION_CLASSES:
        for f, spec in declared(cls):
            action = dests[f.name]
            default = list(f.default) if isinstance(f.default, tuple) else f.default
            assert action.default == default, f.name
            if not spec.hidden:
                assert action.help.removesuffix(" (default: %(default)s)") == spec.help


@pytest.mark.parametrize(
    "cls, name, value, flag_message",
    [
        (RequestLimits, "max_n", 0, "--max-n must be >= 1, got 0"),
        (ServingOptions, "max_parallel_tool_calls", 65, "--max-parallel-tool-calls must be in [1, 64]"),
        (ServingOptions, "request_timeout_s", 0.0, "--request-timeout must be > 0, got 0.0"),
        (ServeArgs, "port", 70000, "--port must be in [0, 65535], got 70000"),
        (EngineArgs, "max_num_seqs", 0, "--max-num-seqs must be >= 1, got 0"),
        (EngineArgs, "dist_timeout", float("nan"), "--dist-timeout must be > 0, got nan"),
    ],
)
def test_one_bound_checks_the_flag_and_the_dataclass(cls, name, value, flag_message):
    """The bound is declared once; the flag's check names the flag, the dataclass's names the
    field."""
    args = build_parser().parse_args(["serve"])
    setattr(args, name, value)
    with pytest.raises(InvalidRequestError, match=flag_message.replace("[", r"\[")) as exc:
        values_from_cli(cls, args)
    assert exc.value.param == name
    with pytest.raises(InvalidRequestError, match="must be"):
        cls(**({"served_model_name": "m"} if cls is ServingOptions else {}), **{name: value})


def test_the_config_classes_check_their_declared_bounds():
    with pytest.raises(InvalidRequestError, match="max_num_seqs must be >= 1, got 0"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(InvalidRequestError, match="admission must be one of"):
        SchedulerConfig(admission="eager")
    with pytest.raises(InvalidRequestError, match=r"num_speculative_tokens must be in \[1, 16\]"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=17)
    with pytest.raises(InvalidRequestError, match="timeout_s must be > 0"):
        DistConfig(timeout_s=0.0)
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype must be one of"):
        CacheConfig(kv_cache_dtype="int4")
    assert SchedulerConfig(max_num_seqs=1).max_num_seqs == 1


def test_a_bad_serve_flag_is_one_line_naming_the_flag(capsys):
    assert cli_main(["serve", "kvserve-demo", "--max-waiting-grammars", "0"]) == 2
    err = capsys.readouterr().err
    assert "--max-waiting-grammars must be >= 1, got 0" in err and "Traceback" not in err
    assert cli_main(["serve", "kvserve-demo", "--max-num-seqs", "0"]) == 2
    assert "--max-num-seqs must be >= 1, got 0" in capsys.readouterr().err


def test_fields_without_a_declaration_are_not_options():
    """The declared fields are the flags; the rest (a config's derived sizing, the server's resolved
    template text) are set by code, never by a user."""
    assert {f.name for f in fields(ServingOptions)} - {f.name for f, _ in declared(ServingOptions)} == {
        "served_model_name",
        "chat_template",
        "limits",
    }
    assert all(f.default is not MISSING for f, _ in declared(ServeArgs))


_UNITS = {"KiB": 1024, "MiB": 1024**2, "s": 1}


def _limit_cell(text: str):
    """The value a "Limits" row of docs/server.md gives before any remark: '8 MiB (413 above)'
    -> 8388608, '1,048,576 (...)' -> 1048576, '60 s' -> 60, 'unbounded; ...' -> None."""
    words = text.split("(")[0].replace(";", " ").split()
    if words[0] == "unbounded":
        return None
    number = int(words[0].replace(",", ""))
    return number * _UNITS[words[1]] if len(words) > 1 and words[1] in _UNITS else number


def test_the_server_docs_limits_table_agrees_with_the_declarations():
    """docs/server.md's "Limits" table says more than the generated one (what a request sees past
    each limit), so it is written by hand; its defaults must still be the declared ones."""
    flags = {}
    for cls in (*SERVE_OPTION_CLASSES, EngineArgs):
        for f, _ in declared(cls):
            flags["--" + f.name.replace("_", "-")] = f.default
            flags[flag_of(f)] = f.default
    checked = 0
    text = (ROOT / "docs" / "server.md").read_text(encoding="utf-8")
    section = text.split("\n## Limits\n")[1].split("\n## ")[0]
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[2].startswith("`--"):
            continue
        flag = cells[2].strip("`")
        assert _limit_cell(cells[1]) == flags[flag], f"docs/server.md says {cells[1]!r} for {flag}"
        checked += 1
    assert checked >= 10
