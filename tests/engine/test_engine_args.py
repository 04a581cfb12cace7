"""One `EngineArgs`: every command's engine flags, defaults and help come from it, and `LLM(...)`'s
keyword arguments are validated by it."""

from __future__ import annotations

import argparse
import ast
from dataclasses import fields
from pathlib import Path

import pytest

from kvserve.cli import build_parser
from kvserve.core.errors import InvalidRequestError
from kvserve.core.options import option_of
from kvserve.engine.args import EngineArgs, build_engine_config
from kvserve.options import format_bytes, parse_bytes
from tests import REPO_ROOT

COMMANDS = {
    "generate": ["generate", "--prompt", "x"],
    "serve": ["serve"],
    "bench latency": ["bench", "latency"],
    "tp-node": ["tp-node"],
}
PACKAGE = REPO_ROOT / "kvserve"


def _subparser(parser: argparse.ArgumentParser, *names: str) -> argparse.ArgumentParser:
    for name in names:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_takes_every_option_with_the_same_default(command):
    args = build_parser().parse_args(COMMANDS[command])
    assert EngineArgs.from_cli_args(args) == EngineArgs()  # no flag given: the dataclass defaults
    parser = _subparser(build_parser(), *command.split())
    dests = {a.dest: a for a in parser._actions}
    for f in fields(EngineArgs):
        if f.name == "model":
            continue
        assert f.name in dests, f"{command} has no flag for {f.name}"
        assert dests[f.name].default == f.default
        # the CLI's one pass (kvserve.cli.show_defaults) may append the default to the help text
        assert dests[f.name].help.removesuffix(" (default: %(default)s)") == option_of(f).help


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_shows_the_defaults(command, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args([*command.split(), "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for shown in (
        "(default: 64)",
        "(default: 2048)",
        "(default: auto, 50% of the memory",
        "(default: on_demand)",
    ):
        assert shown in text, f"{command} --help lacks {shown}"


def test_flags_parse_into_the_fields():
    argv = ["generate", "--prompt", "x", "--kv-cache-memory", "1GiB", "--no-prefix-caching",
            "--max-num-seqs", "3", "--speculative-method", "ngram", "--num-blocks", "40"]  # fmt: skip
    engine_args = EngineArgs.from_cli_args(build_parser().parse_args(argv), model="m")
    assert engine_args == EngineArgs(
        model="m",
        kv_cache_memory_bytes=1024**3,
        enable_prefix_caching=False,
        max_num_seqs=3,
        speculative_method="ngram",
        num_blocks=40,
    )
    with pytest.raises(SystemExit):  # a bad size is an argparse error, not a traceback
        build_parser().parse_args(["generate", "--prompt", "x", "--kv-cache-memory", "lots"])


def test_keyword_options_are_validated_before_any_model_is_read():
    with pytest.raises(InvalidRequestError, match="unknown engine option.*max_num_seq"):
        EngineArgs.from_options("no-such-dir", max_num_seq=4)
    with pytest.raises(InvalidRequestError, match="max_num_seqs must be int"):
        EngineArgs(max_num_seqs="4")
    with pytest.raises(InvalidRequestError, match="enable_prefix_caching must be bool"):
        EngineArgs(enable_prefix_caching=1)
    with pytest.raises(InvalidRequestError, match="block_size must be int"):
        EngineArgs(block_size=True)
    with pytest.raises(InvalidRequestError, match="admission must be one of"):
        EngineArgs(admission="eager")
    # the same through the public entry points, before the model directory is looked at
    with pytest.raises(InvalidRequestError, match="unknown engine option"):
        build_engine_config("no-such-dir", kv_cache_memory=1)
    assert EngineArgs(model=Path("a/b")).model == "a/b"


def test_options_round_trip_through_the_config(gpt2_model_dir):
    engine_args = EngineArgs(
        model=str(gpt2_model_dir), max_num_seqs=5, block_size=8, num_blocks=64, seed=3
    )
    config = engine_args.create_engine_config()
    assert (config.scheduler.max_num_seqs, config.cache.block_size, config.seed) == (5, 8, 3)
    assert config == build_engine_config(gpt2_model_dir, **engine_args.options())
    assert "model" not in engine_args.options()


def test_byte_sizes():
    assert parse_bytes("512MiB") == 512 * 1024**2 and parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes("4096") == 4096
    assert format_bytes(512 * 1024**2) == "512MiB" and format_bytes(1000) == "1000"
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes("big")


def _attribute_chains(path: Path) -> set[str]:
    chains = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            chains.add(f"{node.value.id}.{node.attr}")
    return chains


def test_the_latency_bench_uses_only_the_public_llm_api():
    path = PACKAGE / "lab" / "bench" / "latency.py"
    chains = _attribute_chains(path)
    assert not {c for c in chains if c.endswith((".engine", ".add_request", ".step", ".tokenizer"))}
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvserve."):
            imported.add(node.module)
    assert {m for m in imported if m.startswith("kvserve.engine")} <= {
        "kvserve.engine.llm",
        "kvserve.engine.args",
    }
    assert not {m for m in imported if m.startswith("kvserve.cli")}
