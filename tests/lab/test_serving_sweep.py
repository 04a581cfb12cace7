"""benchmarks/serving_sweep.py's greedy-text agreement: the measured requests' texts are hashed by
prompt index (warm-up and failed requests left out), and each engine pair counts the prompts both
answered with the same text."""

from __future__ import annotations

import hashlib
import json

from benchmarks.serving_sweep import agreement, output_hashes, server_command


def write_run(path, texts: dict[int, str | None], warmup: int = 1) -> None:
    path.mkdir(parents=True)
    requests, outputs = [], []
    for index, text in texts.items():
        rid = f"req-{index:06d}"
        requests.append({"request_id": rid, "phase": "warmup" if index < warmup else "measured"})
        outputs.append({"request_id": rid, "index": index, "text": text})
    (path / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in requests))
    (path / "outputs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in outputs))


def test_texts_are_hashed_per_measured_prompt_and_compared_across_engines(tmp_path):
    write_run(tmp_path / "a", {0: "warm", 1: "same", 2: "left", 3: "x"})
    write_run(tmp_path / "b", {0: "other warm", 1: "same", 2: "right", 3: None})
    a, b = output_hashes(tmp_path / "a"), output_hashes(tmp_path / "b")
    assert set(a) == {"1", "2", "3"} and set(b) == {"1", "2"}  # no warm-up, no failed request
    assert a["1"] == hashlib.sha256(b"same").hexdigest()
    engines = {"a": {"output_hashes": {"1.0": a}}, "b": {"output_hashes": {"1.0": b}}}
    assert agreement(engines) == {"a vs b": {"same": 1, "compared": 2}}


def test_each_engine_serves_with_prefix_caching_off(tmp_path):
    class Args:
        model, gguf, llama_bin, llama_parallel, threads = "M", "G.gguf", "/bin", 16, 2
        llama_ctx = None  # llama-server's -c: 256 tokens a slot unless given
        vllm_python = "/venv/python"
        kvserve_args = "--max-num-batched-tokens 512"

    kv, _ = server_command("kvserve", Args, 1)
    llama, _ = server_command("llamacpp", Args, 1)
    vllm, env = server_command("vllm-bind01", Args, 1)
    assert "--no-prefix-caching" in kv and "--no-cache-prompt" in llama
    assert llama[llama.index("-c") + 1] == str(16 * 256)
    assert kv[-2:] == ["--max-num-batched-tokens", "512"]  # --kvserve-args, for kvserve only
    assert "--max-num-batched-tokens" not in llama + vllm
    assert "--no-enable-prefix-caching" in vllm and vllm[vllm.index("--dtype") + 1] == "float32"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and "PYTHONPATH" not in env
    assert vllm[vllm.index("--model") + 1] == "M"  # no --vllm-model: vLLM serves --model


def test_vllm_serves_its_own_directory_when_kvserve_serves_a_gguf():
    class Args:
        model, vllm_model, vllm_python = "/m/file.gguf", "/m/hf-dir", "/venv/python"
        kvserve_args = "--gguf-activations int8"

    kv, _ = server_command("kvserve", Args, 1)
    vllm, _ = server_command("vllm-bind01", Args, 1)
    assert kv[kv.index("serve") + 1] == "/m/file.gguf" and kv[-2:] == ["--gguf-activations", "int8"]
    assert vllm[vllm.index("--model") + 1] == "/m/hf-dir"
