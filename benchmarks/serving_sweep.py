"""The serving sweep beside peers: `kvserve bench serve --sweep` against kvserve, llama.cpp's
llama-server and vLLM's CPU build, one server at a time, on the same checkpoint (issue 14).

Each engine serves the same random SmolLM2-135M-shaped fp32 checkpoint (llama.cpp its f32 GGUF
conversion), prefix caching off; the load is the project's own tool, the same for every engine:
completions, 128-token prompts, 64 forced output tokens (ignore_eos + min_tokens), greedy, Poisson
arrivals at each rate of `--rates` and an unbounded rate (`inf`: every request at once, the
saturation point), the per-request objective TTFT <= 2 s and worst gap <= 500 ms for goodput.
The texts are saved (`--save-outputs`) and hashed, so the table says whether the engines
produced the same greedy tokens for the same prompts.

Every engine's run merges into one JSON (`--json`), so the engines can run in separate `kv-bench`
calls (a few minutes each):

    PYTHONPATH=$PWD kv-bench .venv/bin/python benchmarks/serving_sweep.py --engines kvserve
    PYTHONPATH=$PWD kv-bench .venv/bin/python benchmarks/serving_sweep.py --engines llamacpp
    PYTHONPATH=$PWD kv-bench .venv/bin/python benchmarks/serving_sweep.py --engines vllm,vllm-bind01
    .venv/bin/python benchmarks/serving_sweep.py --table   # the table of what the JSON holds

Engines: `kvserve` (kvserve serve, its defaults, --no-prefix-caching), `kvserve-fixed` (the same
with --thread-policy fixed: every step on both threads), `llamacpp` (llama-server
--no-cache-prompt, `--llama-parallel` slots), `vllm` (vLLM CPU as it comes), `vllm-bind01` (vLLM
with VLLM_CPU_OMP_THREADS_BIND=0-1: its compute threads on both cores), `vllm-bind01-bf16` (the same
in bf16, vLLM's own dtype on CPU when not told: the issue's configuration; the others run fp32). `--kvserve-args` adds
options to the kvserve servers (`"--kvserve-args=--max-num-batched-tokens 512"`) and `--suffix`
names the variant in the JSON (`--suffix=-b512`: kvserve-b512); both need `=`, as their values
start with a dash.

The real default model: kvserve serves the GGUF as shipped, vLLM the same weights dequantised into a
Hugging Face directory (benchmarks/peers/vllm_models.py real), and the load tokenizes with that
directory's tokenizer:

    --model /tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf --vllm-model /tmp/models/smollm2-hf \
        --tokenizer /tmp/models/smollm2-hf

`--busy-core` runs one unpinned `while True: pass` process beside the engine while the load runs
(started after the server is ready, killed when the load ends): the issue's "beside one busy core".
Run the same engines quiet and busy, alternated, and compare each engine's busy / quiet TPOT.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.server_utils import free_port  # noqa: E402

LLAMA_BIN = "/tmp/peers/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin"
SLO = "ttft=2s,worst_gap=500ms"
ENGINES = ("kvserve", "kvserve-fixed", "llamacpp", "vllm", "vllm-bind01", "vllm-bind01-bf16")


def server_command(engine: str, args, port: int) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of one engine's server on 127.0.0.1:port."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    if engine.startswith("kvserve"):
        cmd = [sys.executable, "-m", "kvserve.cli", "serve", args.model, "--host", "127.0.0.1",
               "--port", str(port), "--served-model-name", "smol", "--no-prefix-caching",
               "--log-level", "warning"]  # fmt: skip
        if engine == "kvserve-fixed":
            cmd += ["--thread-policy", "fixed"]
        return cmd + shlex.split(args.kvserve_args), env
    if engine == "llamacpp":
        cmd = [f"{args.llama_bin}/llama-server", "-m", args.gguf, "--host", "127.0.0.1",
               "--port", str(port), "--alias", "smol", "--no-cache-prompt", "-t", str(args.threads),
               "-np", str(args.llama_parallel), "--cont-batching",
               "-c", str(args.llama_ctx or args.llama_parallel * 256)]  # fmt: skip
        env["LD_LIBRARY_PATH"] = args.llama_bin
        return cmd, env
    if engine.startswith("vllm"):
        env |= {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2"}
        env.pop("PYTHONPATH", None)  # vLLM's venv, not kvserve's
        if engine.startswith("vllm-bind01"):
            env["VLLM_CPU_OMP_THREADS_BIND"] = "0-1"
        # vLLM's own dtype on CPU is bf16 (`--dtype auto`); -bf16 keeps it, the others ask for the
        # checkpoint's fp32 so that every engine computes on the same weights.
        dtype = "bfloat16" if engine.endswith("-bf16") else "float32"
        model = getattr(args, "vllm_model", None) or args.model  # a GGUF's weights as an HF dir
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--served-model-name", "smol", "--host", "127.0.0.1", "--port", str(port),
               "--no-enable-prefix-caching", "--max-model-len", "2048", "--dtype", dtype]  # fmt: skip
        return cmd, env
    raise ValueError(f"unknown engine {engine!r} (known: {', '.join(ENGINES)})")


@contextlib.contextmanager
def running(engine: str, args, log_path: Path):
    port = free_port()
    cmd, env = server_command(engine, args, port)
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + args.start_timeout_s
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"{engine} exited with {process.returncode}; see {log_path}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{engine} not ready after {args.start_timeout_s} s")
                time.sleep(0.5)
            yield url, cmd, env
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def bench_command(url: str, out: Path, args) -> list[str]:
    return [sys.executable, "-m", "kvserve.cli", "bench", "serve", "--base-url", url,
            "--model", "smol", "--endpoint", "completions", "--input-len", "128",
            "--output-len", "64", "--mode", "forced", "--sweep", args.rates,
            "--num-requests", str(args.num_requests), "--warmup", str(args.warmup),
            "--tokenizer", args.tokenizer or args.model, "--slo", SLO, "--save-outputs",
            "--out", str(out),
            "--label", "hardware=2-core-cpu", "--no-plots", "--no-progress"]  # fmt: skip


def output_hashes(run_dir: Path) -> dict[str, str]:
    """{request index: sha256 of its text} of the measured requests of one rate."""
    out = {}
    phases = {}
    for line in (run_dir / "requests.jsonl").read_text().splitlines():
        rec = json.loads(line)
        phases[rec["request_id"]] = rec["phase"]
    for line in (run_dir / "outputs.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if phases.get(rec["request_id"]) == "measured" and rec["text"] is not None:
            out[str(rec["index"])] = hashlib.sha256(rec["text"].encode()).hexdigest()
    return out


def rate_row(row: dict) -> dict:
    lat = row["latency_s"]
    return {
        "offered_rps": row["offered_rps"],
        "ok": row["ok"],
        "not_ok": row["not_ok"],
        "requests_per_s": row["requests_per_s"],
        "output_tokens_per_s": row["output_tokens_per_s"],
        "ttft_p50_s": lat["ttft"]["p50"],
        "ttft_p99_s": lat["ttft"]["p99"],
        "tpot_p50_s": lat["tpot"]["p50"],
        "itl_p99_s": lat["itl"]["p99"],
        "worst_gap_max_s": lat["worst_gap"]["max"],
        "goodput_rps": row["goodput_rps"],
        "passed": row["passed"],
    }


@contextlib.contextmanager
def busy_core(on: bool):
    """One busy-looping process beside the engine while the block runs (`--busy-core`)."""
    loop = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if on else None
    try:
        yield
    finally:
        if loop is not None:
            loop.kill()
            loop.wait()


def run_engine(engine: str, args) -> dict:
    out = Path(args.out_dir) / (engine + args.suffix)
    out.mkdir(parents=True, exist_ok=True)
    with running(engine, args, out / "server.log") as (url, server_cmd, env):
        cmd = bench_command(url, out, args)
        print("+ " + " ".join(cmd), flush=True)
        started = time.time()
        with busy_core(args.busy_core):
            subprocess.run(cmd, check=True)
        wall_s = time.time() - started
        thread_changes = None
        if engine.startswith("kvserve"):  # the adaptive thread policy's changes of pool size
            steps = httpx.get(f"{url}/debug/steps", params={"since": 0}, timeout=30).json()
            (out / "steps.json").write_text(json.dumps(steps))  # the server's own step log
            metrics = httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
            thread_changes = next((float(line.split()[-1]) for line in metrics
                                   if line.startswith("kvserve_engine_thread_changes_total")), None)  # fmt: skip
    sweep = json.loads((out / "sweep.json").read_text())
    rows = [rate_row(r) for r in sweep["rows"]]
    hashes = {str(r["offered_rps"]): output_hashes(Path(r["dir"])) for r in sweep["rows"]}
    thread_env = {k: env[k] for k in env if k.startswith(("OMP_", "VLLM_", "GOMP_"))}
    return {
        "server_command": " ".join(server_cmd),
        "server_env": thread_env,
        "bench_command": " ".join(["kvserve", *cmd[3:]]),
        "wall_s": wall_s,
        "busy_core": args.busy_core,
        "thread_changes": thread_changes,
        "rows": rows,
        "saturation": next((r for r in rows if str(r["offered_rps"]) == "inf"), None),
        "output_hashes": hashes,
    }


def agreement(engines: dict) -> dict:
    """Per engine pair: of the requests both answered (every rate, by prompt index), how many texts
    hash the same."""
    names = sorted(engines)
    out = {}
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            same = total = 0
            for rate, ha in engines[a]["output_hashes"].items():
                hb = engines[b]["output_hashes"].get(rate, {})
                for index, h in ha.items():
                    if index in hb:
                        total += 1
                        same += h == hb[index]
            out[f"{a} vs {b}"] = {"same": same, "compared": total}
    return out


def fmt_ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.0f}"


def print_table(doc: dict) -> None:
    print("| engine | rate | req/s | out tok/s | TTFT p50 / p99 ms | TPOT p50 ms | goodput req/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, e in doc["engines"].items():
        for r in e["rows"]:
            print(f"| {name} | {r['offered_rps']} | {r['requests_per_s']:.2f} | "
                  f"{r['output_tokens_per_s']:.0f} | {fmt_ms(r['ttft_p50_s'])} / "
                  f"{fmt_ms(r['ttft_p99_s'])} | {fmt_ms(r['tpot_p50_s'])} | "
                  f"{r['goodput_rps']:.2f} |")  # fmt: skip
    for pair, a in doc.get("agreement", {}).items():
        print(f"greedy texts identical, {pair}: {a['same']}/{a['compared']}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", default="kvserve", help=f"comma list of {', '.join(ENGINES)}")
    p.add_argument("--model", default="/tmp/kv/smol-gpt2")
    p.add_argument("--gguf", default="/tmp/kv/smol-gpt2-f32.gguf")
    p.add_argument("--tokenizer", default=None, help="the load's tokenizer (default: --model)")
    p.add_argument("--llama-bin", default=LLAMA_BIN)
    p.add_argument("--llama-parallel", type=int, default=16, help="llama-server slots")
    p.add_argument("--llama-ctx", type=int, default=0, help="llama-server -c (0: 256 a slot)")
    p.add_argument("--threads", type=int, default=2, help="llama-server threads")
    p.add_argument("--vllm-python", default="/tmp/kv/vllm-venv/bin/python")
    p.add_argument("--vllm-model", default=None,
                   help="vLLM's Hugging Face directory when --model is a GGUF file (default: --model)")  # fmt: skip
    p.add_argument("--rates", default="1,2,4,8,inf")
    p.add_argument("--num-requests", type=int, default=48, help="measured requests per rate")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--start-timeout-s", type=float, default=300.0)
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks/results/tmp/serving_sweep"))
    p.add_argument("--json", default=str(ROOT / "benchmarks/results/serving_sweep.json"))
    p.add_argument("--table", action="store_true", help="print the JSON's table and exit")
    p.add_argument("--kvserve-args", default="", help="more `kvserve serve` options (one string)")
    p.add_argument("--suffix", default="", help="appended to each engine's name in the JSON")
    p.add_argument(
        "--busy-core",
        action="store_true",
        help="one busy-looping process beside the engine while the load runs",
    )
    args = p.parse_args()
    from _report import stop_children_on_sigterm  # benchmarks/ is on sys.path

    stop_children_on_sigterm()  # a killed run takes its servers and clients with it
    path = Path(args.json)
    doc = json.loads(path.read_text()) if path.exists() else {"engines": {}}
    if not args.table:
        for engine in args.engines.split(","):
            doc["engines"][engine + args.suffix] = run_engine(engine, args) | {
                "timed_at": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
            }
            doc["agreement"] = agreement(doc["engines"])
            doc["workload"] = ("completions, 128-token prompts, 64 forced output tokens, greedy, "
                               f"Poisson at {args.rates} req/s, {args.num_requests} measured "
                               f"requests per rate, objective {SLO} per request")  # fmt: skip
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(doc, indent=1))
    print_table(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
