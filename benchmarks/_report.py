"""The one way benchmarks write their JSON: the report plus the machine it ran on."""

from __future__ import annotations

import json
import platform
from pathlib import Path


def cpu_description() -> dict[str, object]:
    """The CPU the run had (Linux /proc/cpuinfo): model name, family and model (AMD family 25 is Zen 3
    at model 1, Zen 4 at model 17), the vector extensions that choose kernels, and the CPUs usable."""
    import os

    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        return {}
    flags = set(fields.get("flags", "").split())
    return {"model_name": fields.get("model name"), "family": fields.get("cpu family"),
            "model": fields.get("model"),
            "vector": sorted(f for f in flags if f.startswith(("avx2", "avx512", "fma"))),
            "cpus": len(os.sched_getaffinity(0))}  # fmt: skip


def write_report(out: str | Path, report: dict) -> None:
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    report = report | {"machine": platform.platform(), "cpu": cpu_description()}
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")


def kvserve_llm():
    """kvserve's `LLM`, imported as a user's program imports it: before torch is loaded, so kvserve's
    OpenMP thread defaults (docs/performance.md, "Threads") apply to this process while it loads
    torch, and child processes (llama.cpp) keep the environment they had. Call it before anything
    imports torch; if torch is already loaded it says so (the run then has OpenMP's own defaults)."""
    import sys

    if "torch" in sys.modules:
        print("note: torch was imported before kvserve: kvserve's thread defaults do not apply")
    from kvserve import LLM

    return LLM


def threads_used() -> str:
    """The thread configuration kvserve's engine runs with in this process, for the report."""
    import torch

    from kvserve.threads import describe_threads

    return describe_threads(torch.get_num_threads())


def stop_children_on_sigterm() -> None:
    """Make SIGTERM end this benchmark as Ctrl-C does: as an exception, so `subprocess.run` kills its
    child (a running `kvserve bench serve`) and the scripts' `finally` blocks stop their servers.
    Python's default for SIGTERM ends the process at once, leaving such children behind."""
    import signal
    import sys

    def _exit(signum, frame):  # noqa: ARG001 - a signal handler's signature
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)
