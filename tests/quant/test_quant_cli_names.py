"""`kvserve quantize` and `kvserve eval compare` take the built-in model names, as every other command
does (they used to be read as directories: 'no config.json' and a FileNotFoundError traceback)."""

from __future__ import annotations

import json

from kvserve.cli import main


def test_quantize_and_compare_the_builtin_demo(tmp_path, capsys):
    out = tmp_path / "demo-int8"
    assert main(["quantize", "kvserve-demo", "--out", str(out), "--weights", "int8"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["scheme"] == "int8" and (out / "config.json").is_file()
    data = tmp_path / "heldout.jsonl"
    data.write_text(json.dumps({"text": "def add(a, b):\n    return a + b\n" * 4}) + "\n")
    args = ["eval", "compare", "kvserve-demo", str(out), "--data", str(data), "--window", "32"]
    assert main([*args, "--json", str(tmp_path / "r.json")]) == 0
    compared = json.loads((tmp_path / "r.json").read_text())
    assert compared["kl_mean"] < 0.01 and compared["top1_agreement"] > 0.9
