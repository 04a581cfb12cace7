"""`kvserve plan` from the command line, the roofline plot, the measurement, plan/ without torch."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from kvserve.cli import plan as plan_cli
from kvserve.lab.plan import get_profile, load_model, make_plan
from kvserve.lab.plan.hardware import load_profile_file
from tests import REPO_ROOT

ROOT = REPO_ROOT


def run_plan(argv: list[str], capsys) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    plan_cli.register(parser.add_subparsers())
    args = parser.parse_args(["plan", *argv])
    rc = args.func(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_json_parses(capsys):
    rc, out, _ = run_plan(["SmolLM2-135M", "--hardware", "h100-sxm", "--json"], capsys)
    assert rc == 0
    data = json.loads(out)
    assert data["num_params"] == 134_515_008
    assert data["model"]["name"] == "SmolLM2-135M"
    assert data["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 2
    assert data["latency"]["ttft_cold_s"] > 0 and data["load"]["output_tokens_per_s"] > 0
    assert data["assumptions"] == {
        "mfu": 0.5,
        "bandwidth_fraction": 0.8,
        "overhead_bytes": 2e9,
        "utilisation": None,
    }
    assert {row["name"] for row in data["formats"]} >= {"bf16", "int4-g128", "mixed"}


def test_cli_text_shows_results_with_assumptions(capsys):
    rc, out, _ = run_plan(
        [
            "Llama-3.1-8B",
            "--weights",
            "int4-g128-zp",
            "--kv-dtype",
            "fp8",
            "--shared-prefix",
            "500",
            "--price-per-hour",
            "2.5",
        ],
        capsys,
    )
    assert rc == 0
    for text in (
        "N_matmul",
        "int4-g128-zp",
        "TTFT cold",
        "TTFT cached prefix",
        "TPOT solo",
        "ridge peak / BW",
        "prefill",
        "Little's law",
        "MFU 0.5",
        "$2.5/h",
        "given",
        "per million output tokens",
    ):
        assert text in out, text


def test_cli_compare_and_manual_hardware(capsys):
    rc, out, _ = run_plan(
        [
            "Qwen2.5-7B",
            "--memory",
            "24",
            "--bandwidth",
            "1000",
            "--peak",
            "150",
            "--compare",
            "h100-sxm,l4",
            "--json",
        ],
        capsys,
    )
    assert rc == 0
    data = json.loads(out)
    assert data["hardware"]["bandwidth_bytes_per_s"] == 1e12
    assert [row["hardware"] for row in data["compare"]] == ["H100 SXM", "L4"]
    rc, out, _ = run_plan(["SmolLM2-360M", "--compare"], capsys)
    assert rc == 0 and "Apple M2 Ultra" in out and "DDR5 desktop" in out


def test_cli_errors_are_messages(capsys):
    rc, _, err = run_plan(["no-such-model"], capsys)
    assert rc == 2 and "preset" in err
    rc, _, err = run_plan(["SmolLM2-135M", "--weights", "int4-g0"], capsys)
    assert rc == 2 and "group size" in err
    rc, _, err = run_plan([], capsys)  # no MODEL: the default model, as `serve` (issue 46)
    assert rc == 0 and "the default model, smollm2-135m-instruct" in err


def test_plot_written(tmp_path, capsys):
    out_png = tmp_path / "roof.png"
    rc, out, _ = run_plan(["SmolLM2-135M", "--plot", str(out_png)], capsys)
    assert rc == 0 and str(out_png) in out
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_does_not_import_torch():
    code = (
        "import sys, argparse\n"
        "import kvserve.lab.plan, kvserve.lab.plan.arith, kvserve.lab.plan.report, kvserve.lab.plan.plot\n"
        "from kvserve.cli import plan as p\n"
        "parser = argparse.ArgumentParser(); p.register(parser.add_subparsers())\n"
        "args = parser.parse_args(['plan', 'SmolLM2-135M', '--json', '--compare', 'h100-sxm'])\n"
        "assert args.func(args) == 0\n"
        "assert 'torch' not in sys.modules, 'kvserve.lab.plan imported torch'\n"
        "assert 'matplotlib' not in sys.modules, 'matplotlib imported without a plot'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


TINY_MEASURE = dict(
    gemv_rows=128,
    gemv_cols=64,
    gemm_size=32,
    columns=(1, 4),
    warmup=1,
    min_samples=2,
    min_time_s=0.0,
    sample_s=1e-4,
)


def test_measure_tiny_and_plan_on_it(tmp_path):
    from kvserve.lab.measure import MeasureConfig, measure_roofline
    from kvserve.lab.plan.hardware import save_profile
    from kvserve.lab.plan.plot import plot_roofline

    profile = measure_roofline(MeasureConfig(**TINY_MEASURE))
    assert profile.measured and profile.compute_dtype == "fp32"
    assert [p.kind for p in profile.points] == ["gemv", "gemm", "gemm"]
    assert [p.num_columns for p in profile.points] == [1, 1, 4]
    assert profile.peak_flops_per_s == max(p.flops_per_s for p in profile.points[1:])
    assert profile.points[0].intensity_flops_per_byte == pytest.approx(
        2 * 128 * 64 / (4 * 128 * 65 + 4 * 64)
    )
    path = save_profile(profile, tmp_path / "m.json")
    assert load_profile_file(path) == profile
    plan = make_plan(load_model("SmolLM2-135M"), load_profile_file(path), "fp32")
    assert plan.assumptions.bandwidth_fraction == 1.0
    assert plot_roofline(tmp_path / "m.png", profile, plan).stat().st_size > 0


def test_cli_measure_saves_this_machine(tmp_path, monkeypatch, capsys):
    import kvserve.lab.measure as measure

    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(
        measure, "default_config", lambda device, dtype: measure.MeasureConfig(**TINY_MEASURE)
    )
    rc, out, err = run_plan(["--measure", "--json"], capsys)
    assert rc == 0 and "saved to" in err
    assert json.loads(out)["measured"] is True
    saved = tmp_path / "profiles" / "this-machine.json"
    assert get_profile("this-machine") == load_profile_file(saved)
    rc, out, _ = run_plan(
        [
            "SmolLM2-135M",
            "--hardware",
            "this-machine",
            "--weights",
            "fp32",
            "--plot",
            str(tmp_path / "p.png"),
        ],
        capsys,
    )
    assert rc == 0 and "measured" in out and (tmp_path / "p.png").is_file()
