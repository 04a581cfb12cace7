"""The command line: `kvserve generate` and the top-level parser."""

from __future__ import annotations

import json

from kvserve.cli import build_parser, main


def test_every_command_is_registered():
    commands = set(build_parser()._subparsers._group_actions[0].choices)
    assert {"generate", "serve", "bench", "plan", "simulate", "eval"} <= commands


def test_generate_prints_json(gpt2_model_dir, capsys):
    args = ["generate", "--model", str(gpt2_model_dir), "--prompt", "Hello there", "--prompt", "Bye",
            "--max-tokens", "5", "--ignore-eos", "--json", "--kv-cache-memory", "16MiB"]  # fmt: skip
    assert main(args) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["prompt"] for line in lines] == ["Hello there", "Bye"]
    assert all(len(line["token_ids"]) == 5 and line["finish_reason"] == "length" for line in lines)
    assert all(0 < line["ttft_s"] <= line["e2e_s"] for line in lines)


def test_generate_reports_bad_input(gpt2_model_dir, capsys):
    args = ["generate", "--model", str(gpt2_model_dir), "--prompt", "x", "--temperature", "-1"]
    assert main(args) == 2
    assert "temperature must be >= 0" in capsys.readouterr().err
