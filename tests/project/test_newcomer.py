"""What a new user meets first: built-in model names, clear errors instead of tracebacks, the bench
tool fitting a workload into the server's context, and grouped failure reasons."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from kvserve.core.errors import ModelLoadError
from kvserve.lab.bench.records import BenchError, RequestRecord
from kvserve.lab.bench.summary import failures_by_reason
from kvserve.lab.bench.workloads import LengthDist, WorkloadSpec
from kvserve.models import (
    ASSETS_DIR,
    builtin_name,
    resolve_model,
)
from kvserve.structured.grammar import sanitize_compiler_error


def _kvserve(*args: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvserve", *args], capture_output=True, text=True, timeout=timeout_s
    )


def test_builtin_names_resolve_to_the_shipped_pair():
    assert resolve_model("kvserve-demo") == ASSETS_DIR / "target"
    assert resolve_model("kvserve-demo-draft") == ASSETS_DIR / "draft"
    assert resolve_model(None) == resolve_model("smollm2-135m-instruct")
    assert builtin_name(ASSETS_DIR / "draft") == "kvserve-demo-draft"
    assert builtin_name(ASSETS_DIR) is None


def test_hub_id_gets_a_message_not_a_traceback():
    with pytest.raises(ModelLoadError, match="not a local directory.*never downloads"):
        resolve_model("Qwen/Qwen2.5-0.5B-Instruct")
    result = _kvserve("generate", "--model", "Qwen/Qwen2.5-0.5B-Instruct", "--prompt", "hi")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "hf download Qwen/Qwen2.5-0.5B-Instruct" in result.stderr
    assert "kvserve-demo" in result.stderr


def test_missing_directory_and_missing_eval_data_are_clear(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model(str(tmp_path / "nope"))
    result = _kvserve("eval", "perplexity", "--data", str(tmp_path / "missing.jsonl"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "does not exist" in result.stderr and '"text"' in result.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    result = _kvserve("eval", "perplexity", "kvserve-demo", "--data", str(bad))
    assert result.returncode == 2 and f"{bad}:2" in result.stderr


def test_generate_labels_each_of_several_prompts_and_takes_builtin_names():
    result = _kvserve(
        "generate",
        "--model",
        "kvserve-demo",
        "--speculative-model",
        "kvserve-demo-draft",
        "--prompt",
        "def add(a, b):",
        "--prompt",
        "The king",
        "--max-tokens",
        "4",
    )
    assert result.returncode == 0, result.stderr
    assert "--- [0] prompt: 'def add(a, b):'" in result.stdout
    assert "--- [1] prompt: 'The king'" in result.stdout


def _subparser(parser, name: str):
    return next(
        a for a in parser._actions if a.dest in ("command", "bench_command", "eval_command")
    ).choices[name]


def test_help_shows_defaults_and_every_flag_has_help():
    from kvserve.cli import build_parser

    parser = build_parser()
    bench = _subparser(_subparser(parser, "bench"), "serve")
    perplexity = _subparser(_subparser(parser, "eval"), "perplexity")
    commands = {"serve": _subparser(parser, "serve"), "generate": _subparser(parser, "generate"),
                "bench serve": bench, "eval perplexity": perplexity}  # fmt: skip
    for name, sub in commands.items():
        for action in sub._actions:
            assert action.help, f"{name} {action.option_strings or action.dest} has no help"
    text = " ".join(commands["serve"].format_help().split())
    for default in ("(default: 127.0.0.1)", "(default: 8000)", "(default: auto)", "(default: 64)"):
        assert default in text
    bench_text = " ".join(bench.format_help().split())
    assert "(default: 512)" in bench_text and "(default: 600.0)" in bench_text


def test_grammar_compiler_errors_lose_timestamp_path_and_check_clause():
    raw = (
        "[09:12:56] /project/cpp/json_schema_converter.cc:5077: Check failed: (error.empty()) is "
        "false: Failed to parse JSON: syntax error at line 1 near: bad\n"
    )
    assert sanitize_compiler_error(RuntimeError(raw)) == (
        "Failed to parse JSON: syntax error at line 1 near: bad"
    )
    regex = "[10:00:01] /project/cpp/regex_converter.cc:94: Regex parsing error at position 5: x\n"
    assert sanitize_compiler_error(RuntimeError(regex)) == "Regex parsing error at position 5: x"
    assert sanitize_compiler_error(RuntimeError("")) == "RuntimeError"


def test_real_compiler_error_through_the_engine_is_sanitized():
    from kvserve.core.errors import InvalidRequestError
    from kvserve.core.sampling_params import StructuredOutput
    from kvserve.engine.llm import LLM

    grammars = LLM("kvserve-demo", kv_cache_memory_bytes=1 << 20).engine.grammars()
    with pytest.raises(InvalidRequestError) as info:
        grammars.compile(StructuredOutput("regex", "[0-9"))
    message = str(info.value)
    assert message.startswith("invalid regex constraint: ")
    assert ".cc:" not in message and "/project" not in message and not message[27:].startswith("[")


def test_workload_clips_prompts_to_the_server_context_and_refuses_impossible_outputs():
    spec = WorkloadSpec(max_model_len=512, prompt_overhead_tokens=7)
    assert spec.fit_to_context(0, 512, 128) == (512 - 7 - 128, True)
    assert spec.fit_to_context(0, 100, 128) == (100, False)
    assert WorkloadSpec().fit_to_context(0, 5000, 128) == (5000, False)  # context unknown
    with pytest.raises(BenchError, match="no room for a prompt.*lower --output-len"):
        spec.fit_to_context(3, 10, 505)
    shared = WorkloadSpec(
        kind="shared-prefix", prefix_len=400, input_len=LengthDist("fixed", 64),
        max_model_len=512, prompt_overhead_tokens=7,
    )  # fmt: skip
    assert shared.fit_to_context(0, 64, 64) == (512 - 7 - 400 - 64, True)
    with pytest.raises(BenchError, match="--prefix-len"):
        shared.fit_to_context(0, 64, 110)


def _failed(i: int, error: str, outcome: str = "failed") -> RequestRecord:
    return RequestRecord(f"r{i}", i, "measured", outcome, 0.0, 0.0, 1.0, 16, error=error)


def test_failures_are_counted_by_reason_with_numbers_folded():
    body = {"error": {"message": "prompt (530 tokens) + max_tokens (128) = 658 exceeds 512"}}
    records = [
        _failed(0, f"HTTP 400: {json.dumps(body)}"),
        _failed(1, "HTTP 400: " + json.dumps(body).replace("530", "531")),
        _failed(2, "no complete answer within 5 s", "timeout"),
        RequestRecord("r3", 3, "measured", "ok", 0.0, 0.0, 1.0, 16),
    ]
    assert failures_by_reason(records) == [
        {
            "reason": "failed: HTTP N: prompt (N tokens) + max_tokens (N) = N exceeds N",
            "count": 2,
        },
        {"reason": "timeout: no complete answer within N s", "count": 1},
    ]


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


def test_progress_draws_on_a_terminal_only():
    from kvserve.cli.progress import progress

    pipe, tty = _Stream(False), _Stream(True)
    assert list(progress(range(3), 3, "eval", stream=pipe)) == [0, 1, 2]
    assert pipe.getvalue() == ""
    assert list(progress(range(4), 4, "eval", stream=tty)) == [0, 1, 2, 3]
    lines = tty.getvalue().split("\r")
    assert lines[-1].startswith("eval [" + "#" * 30 + "] 4/4") and lines[-1].endswith("\n")
    assert "] 2/4" in lines[2]


def test_plan_and_simulate_default_to_the_default_model(capsys):
    """issue 46: `plan` and `simulate` needed a model where `serve` defaults to one, and simulate's
    default workload (up to 6,000 + 4,000 tokens) did not fit the default model's 8,192."""
    from kvserve.cli import main

    assert main(["plan"]) == 0
    captured = capsys.readouterr()
    assert "the default model, smollm2-135m-instruct" in captured.err
    assert "max context 8,192" in captured.out
    assert (
        main(["simulate", "--num-requests", "4", "--hardware", "h100-sxm", "--policy", "on_demand"])
        == 0
    )
    captured = capsys.readouterr()
    assert "the default model, smollm2-135m-instruct" in captured.err
    header = next(line for line in captured.out.splitlines() if " fail " in line).split()
    row = next(
        line for line in captured.out.splitlines() if line.split()[:1] == ["on_demand"]
    ).split()
    assert header[-2:] == ["fail", "$/Mtok"], header
    assert row[-2] == "0", captured.out  # every request fits the context: none failed
