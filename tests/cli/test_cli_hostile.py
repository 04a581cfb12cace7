"""Hostile input to the command-line tools (fuzzing, session 1204d): a one-line error and exit 2, never
a traceback or a hang; a malformed answer from a server fails its own request, not the bench run."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from kvserve.cli import _subparsers, build_parser, finite_float, main
from kvserve.lab.bench.client import ClientConfig, _Stream, send_request
from kvserve.lab.bench.records import RequestSpec


def test_no_float_option_takes_nan_or_inf():
    """`simulate --burstiness nan` spun for ever; `bench --duration inf` overflowed; `plan --years nan`
    printed invalid JSON. Every option declared `type=float` now parses through `finite_float`."""
    parser = build_parser()
    floats = [a for sub in _subparsers(parser) for a in sub._actions if a.type is finite_float]
    assert len(floats) > 50
    assert not [a for sub in _subparsers(parser) for a in sub._actions if a.type is float]
    for text in ("nan", "inf", "-inf", "NaN", "x"):
        with pytest.raises(SystemExit) as info:
            main(["simulate", "SmolLM2-135M", "--hardware", "h100-sxm", "--burstiness", text])
        assert info.value.code == 2
    assert finite_float("1e3") == 1000.0


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--years", "0", "--device-cost", "1000"], "amortisation years must be > 0"),
        (["--overhead-gb", "-100"], "runtime overhead must be >= 0"),
        (["--price-per-hour", "-3"], "price per hour usd must be >= 0"),
        (["--power-w", "-1", "--device-cost", "1000"], "power w must be >= 0"),
    ],
)
def test_plan_refuses_impossible_numbers(args, fragment, capsys):
    assert main(["plan", "SmolLM2-135M", *args]) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err


def test_plan_json_is_strict(capsys):
    assert main(["plan", "SmolLM2-135M", "--json"]) == 0
    json.loads(capsys.readouterr().out, parse_constant=lambda name: pytest.fail(name))


def test_an_output_path_that_cannot_be_made_is_a_one_line_error(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    args = ["simulate", "SmolLM2-135M", "--hardware", "h100-sxm", "--num-requests", "3",
            "--input-len", "16", "--output-len", "4", "--output", str(blocker / "x.json")]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvserve simulate: error:") and "Traceback" not in err


@pytest.mark.parametrize(
    "event, what",
    [
        ("[1, 2, 3]", "not a JSON object"),
        ('{"choices": [{"delta": "x"}]}', "`delta` is not an object"),
        ('{"choices": {"0": {}}}', "`choices` is not a list"),
        ('{"choices": [], "usage": {"completion_tokens": "3"}}', "usage.completion_tokens"),
        ('{"choices": [{"text": 5}]}', "a text field is not a string"),
    ],
)
def test_a_malformed_event_is_a_value_error(event, what):
    """These crashed the whole run with an AttributeError or a TypeError, and its directory stayed
    empty; `send_request` records a ValueError as its request's failure."""
    stream = _Stream("completions" if "text" in event else "chat")
    with pytest.raises(ValueError, match=what):
        stream.feed(0.0, event)


def test_a_server_sending_a_malformed_event_fails_that_request_only():
    body = 'data: {"choices": [{"delta": {"content": "a"}}]}\n\ndata: [1, 2]\n\n'
    transport = httpx.MockTransport(
        lambda request: httpx.Response(
            200, text=body, headers={"content-type": "text/event-stream"}
        )
    )
    cfg = ClientConfig(base_url="http://test", model="m", endpoint="chat")
    spec = RequestSpec(index=0, prompt="hi", num_prompt_tokens=1, max_tokens=4)

    async def run():
        async with httpx.AsyncClient(base_url="http://test", transport=transport) as http:
            return await send_request(http, cfg, spec, "r0", "measured", 0.0, 0.0, {})

    record, text = asyncio.run(run())
    assert record.outcome == "failed" and "not a JSON object" in record.error
    assert text == "a"  # what arrived before the bad event is kept


def test_bench_library_checks_refuse_nan(tmp_path):
    """The checks were written `x <= 0`, which NaN passes."""
    from kvserve.lab.bench.arrivals import ArrivalSpec
    from kvserve.lab.bench.records import BenchError
    from kvserve.lab.bench.workloads import LengthDist

    with pytest.raises(BenchError, match="burstiness"):
        ArrivalSpec("gamma", 1.0, float("nan"))
    with pytest.raises(BenchError, match="lognormal"):
        LengthDist.parse("lognormal:5:nan")
    with pytest.raises(BenchError, match="--timeout"):
        ClientConfig(base_url="http://x", model="m", timeout_s=float("nan"))


def test_a_sharegpt_file_with_odd_turns_is_read_or_refused_cleanly(tmp_path):
    from kvserve.lab.bench.workloads import load_sharegpt

    path = tmp_path / "d.json"
    good = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    path.write_text(json.dumps([{"conversations": 5}, {"conversations": [1, "x"]}, good]))
    assert load_sharegpt(path) == [("q", "a")]


def test_bench_compare_says_a_cut_summary_is_not_a_run(tmp_path, capsys):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text("")
        (tmp_path / name / "requests.jsonl").write_text("")
    assert main(["bench", "compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    assert "summary.json is not valid JSON" in capsys.readouterr().err


# --- round 2: generate, serve, quantize, eval, check (fuzzing, session 1204d) ---------------------


def _demo_copy(tmp_path):
    import shutil

    from kvserve.models import ASSETS_DIR

    copy = tmp_path / "model"
    shutil.copytree(ASSETS_DIR / "target", copy)
    return copy


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("{not json", "is not valid JSON"),
        ("[1, 2]", "is not a JSON object"),
        ('{"model_type": "llama", "hidden_size": "abc"}', "wrong type or range"),
    ],
)
def test_a_bad_config_json_is_a_model_load_error(tmp_path, text, fragment):
    from kvserve.config import ModelConfig
    from kvserve.core.errors import ModelLoadError

    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ModelLoadError, match=fragment):
        ModelConfig.from_dir(tmp_path)


def test_bad_model_files_are_model_load_errors(tmp_path):
    from kvserve.config import ModelConfig
    from kvserve.core.errors import ModelLoadError
    from kvserve.model.loader import read_checkpoint
    from kvserve.tokenizer import stop_token_ids

    model = _demo_copy(tmp_path)
    (model / "generation_config.json").write_text("{cut")
    with pytest.raises(ModelLoadError, match="generation config"):
        stop_token_ids(model, ModelConfig.from_dir(model), None)
    (model / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ModelLoadError, match="not a readable safetensors file"):
        read_checkpoint(model)


def test_engine_options_refused_before_loading():
    import argparse

    from kvserve.core.errors import InvalidRequestError
    from kvserve.engine.args import EngineArgs, _check_device
    from kvserve.options import parse_bytes

    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes("infGiB")  # OverflowError before
    with pytest.raises(InvalidRequestError, match="is not a device"):
        _check_device("foo")
    with pytest.raises(InvalidRequestError, match="speculative-method draft"):
        EngineArgs(
            model="kvserve-demo", speculative_method="ngram", speculative_model="/does/not/exist"
        ).create_engine_config()


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--max-n", "0"], "--max-n must be >= 1"),
        (["--api-key", "a:"], "empty secret"),
        (["--port", "70000"], "--port must be in [0, 65535]"),
        (["--request-timeout", "0"], "--request-timeout must be > 0"),
        (["--max-waiting", "0"], "--max-waiting must be >= 1"),
    ],
)
def test_serve_refuses_bad_flags_before_binding(args, fragment, capsys):
    assert main(["serve", "kvserve-demo", *args]) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err


@pytest.mark.parametrize("template, fragment", [("{% if %}", "line 1"), ("  \n", "is empty")])
def test_serve_compiles_its_chat_template_at_start(tmp_path, template, fragment, capsys):
    """A broken template gave every chat request a 400 blaming the client's messages; an empty file
    was silently the tokenizer's own template."""
    path = tmp_path / "t.jinja"
    path.write_text(template)
    assert main(["serve", "kvserve-demo", "--chat-template", str(path)]) == 2
    assert fragment in capsys.readouterr().err


def test_a_template_using_transformers_extensions_compiles(tmp_path):
    """{% break %} and {% generation %} are transformers' extensions, not plain jinja2's: review."""
    from kvserve.cli.serve import _read_chat_template

    text = "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% break %}{% endfor %}"
    path = tmp_path / "t.jinja"
    path.write_text(text)
    assert _read_chat_template(str(path)) == text


def test_quantize_refuses_before_writing(tmp_path, capsys):
    out = tmp_path / "out"
    smooth = ["--weights", "w8a8", "--method", "smoothquant", "--alpha", "50"]
    assert main(["quantize", "kvserve-demo", "--out", str(out), *smooth]) == 2
    assert "--alpha must be in [0, 1]" in capsys.readouterr().err  # it wrote NaN scales
    mixed = ["--weights", "linear=int8,head=int4"]
    assert main(["quantize", "kvserve-demo", "--out", str(out), *mixed]) == 2
    assert "kvserve quantize: error:" in capsys.readouterr().err  # on stderr, not stdout
    assert not out.exists()  # it left model.safetensors behind
    assert main(["quantize", "kvserve-demo", "--out", str(out), "--weights", "head=int8"]) == 2
    assert "quantises no tensor" in capsys.readouterr().err  # the demo's head is tied


def test_eval_and_check_inputs(tmp_path):
    from kvserve.cli.check import read_prompts

    for window in ("1", "0"):
        with pytest.raises(SystemExit):  # argparse: before the model loads
            main(["eval", "perplexity", "kvserve-demo", "--data", "x.txt", "--window", window])
    prompts = tmp_path / "p.jsonl"
    for bad in ('{"prompt_token_ids": 5}', '{"prompt_token_ids": [1.7, true]}'):
        prompts.write_text(bad + "\n")
        with pytest.raises(ValueError, match="must be a list of integers"):
            read_prompts(str(prompts))


def test_eval_compare_record_never_writes_into_a_builtin_or_a_float_model(tmp_path, capsys):
    """fuzzing (noted): `--record` with kvserve-demo as the candidate would write into the package."""
    data = tmp_path / "d.txt"
    data.write_text("hello world " * 20)
    base = ["eval", "compare", "kvserve-demo", "kvserve-demo", "--data", str(data), "--record"]
    assert main(base) == 2
    assert "built-in" in capsys.readouterr().err
    copy = _demo_copy(tmp_path)
    assert main([*base[:3], str(copy), *base[4:], "--candidate-quantization", "int8"]) == 2
    assert "--candidate-quantization" in capsys.readouterr().err
    assert not (copy / "kvserve_evaluation.json").exists()
