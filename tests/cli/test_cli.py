"""The command line: `kvserve generate` and the top-level parser."""

from __future__ import annotations

import json
import threading

from kvserve.cli import build_parser, main
from tests.faults import FaultGate


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


def test_generate_steps_pass_a_test_gate(gpt2_model_dir, capsys):
    """`--inject-fault gate:WHERE` (tests only; tests/faults.py): every offline step passes the
    test's gate, as the serving loop's steps do. Held from the start, not one step runs until the
    test lets two through; then held again mid-run; opened, the run ends as usual."""
    result = {}
    with FaultGate() as steps:
        steps.hold()  # what the core is told when it connects
        args = ["generate", "--model", str(gpt2_model_dir), "--prompt", "Hello there",
                "--max-tokens", "6", "--ignore-eos", "--json", "--kv-cache-memory", "16MiB",
                "--inject-fault", steps.spec()]  # fmt: skip
        run = threading.Thread(target=lambda: result.setdefault("rc", main(args)), daemon=True)
        run.start()
        steps.wait_for_cores(1, 120)
        steps.wait_held(1)  # before the first step, with the prompt in it
        assert steps.num_passed() == 0
        steps.step(2)
        steps.wait_passed(2)
        steps.wait_held(1)  # two steps taken (the prompt's and one decode): held mid-run
        assert run.is_alive()
        steps.open()
        run.join(120)
    assert result.get("rc") == 0
    line = json.loads(capsys.readouterr().out)
    assert len(line["token_ids"]) == 6 and line["finish_reason"] == "length"


def test_generate_refuses_a_bad_fault_spec(gpt2_model_dir, capsys):
    args = ["generate", "--model", str(gpt2_model_dir), "--prompt", "x", "--inject-fault", "delay:1"]
    assert main(args) == 2
    assert "gate:WHERE" in capsys.readouterr().err
