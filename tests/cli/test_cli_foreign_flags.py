"""vLLM's and llama.cpp's spellings: the same meaning is the same option; a different meaning is a
one-line error that names kvserve's option (never `unrecognized arguments`)."""

from __future__ import annotations

import pytest

from kvserve.cli import build_parser
from kvserve.engine.args import EngineArgs


@pytest.fixture(scope="module")
def parser():
    return build_parser()


def test_aliases_parse_into_kvserve_options(parser):
    args = parser.parse_args(["serve", "-m", "kvserve-demo", "--no-enable-prefix-caching",
                              "--max-model-len", "128", "--served-model-name", "x",
                              "--host", "0.0.0.0", "--port", "9"])  # fmt: skip
    assert args.model_option == "kvserve-demo" and args.served_model_name == "x"
    assert EngineArgs.from_cli_args(args).enable_prefix_caching is False
    assert EngineArgs.from_cli_args(args).max_model_len == 128
    args = parser.parse_args(["generate", "-m", "d", "--prompt", "p", "--enable-prefix-caching"])
    assert args.model == "d" and args.enable_prefix_caching is True
    args = parser.parse_args(["bench", "latency", "-m", "d", "--no-enable-prefix-caching"])
    assert args.model == "d" and args.enable_prefix_caching is False


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["serve", "--gpu-memory-utilization", "0.9"], "--kv-cache-memory SIZE"),
        (["serve", "--gpu-memory-utilization=0.9"], "--kv-cache-memory SIZE"),
        (["serve", "--ctx-size", "8192"], "--max-model-len N"),
        (["serve", "-c", "8192"], "--max-model-len N"),
        (["generate", "--prompt", "p", "--n-gpu-layers", "99"], "--device cuda"),
        (["serve", "-ngl", "99"], "--device cuda"),
        (["serve", "-np", "4"], "--max-num-seqs N"),
    ],
)
def test_other_meanings_name_kvserves_option(parser, capsys, argv, named):
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Did you mean " + named in err, err
    assert "unrecognized arguments" not in err
    assert f"kvserve {argv[0]}" in err


def test_a_flag_with_no_counterpart_says_so(parser, capsys):
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "latency", "--trust-remote-code"])
    err = capsys.readouterr().err
    assert "--trust-remote-code is vLLM's switch" in err and "runs its own model code only" in err


def test_foreign_flags_stay_out_of_help(parser, capsys):
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--help"])
    out = capsys.readouterr().out
    assert "--gpu-memory-utilization" not in out and "-ngl" not in out
    assert "--prefix-caching, --no-prefix-caching, --enable-prefix-caching" in " ".join(out.split())
