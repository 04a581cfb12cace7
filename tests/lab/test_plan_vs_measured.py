"""benchmarks/plan_vs_measured.py's verdict per cell (benchmarks/_plan_explain.py): a step within
the tolerance says so, a step that is not memory-bound names its cause (dispatch overhead, kernel
efficiency) with the plan's numbers, and a miss is split with the forward timed alone."""

from __future__ import annotations

from benchmarks._plan_explain import explain


def row(measured_s: float, bound: str, forward_s: float | None = None, **terms: float) -> dict:
    t = {"weights": 0.010, "kv": 0.001, "dispatch": 0.002, "compute": 0.001, "bandwidth": 0.010}
    t |= terms
    plan_s = t["weights"] + t["kv"] + t["dispatch"]
    r = {"weights": "fp32", "batch": 1, "context": 128.0, "measured_s": measured_s,
         "roofline_s": t["bandwidth"], "plan_s": plan_s, "bound": bound, "terms_s": t,
         "path": "fused"}  # fmt: skip
    if forward_s is not None:
        r["forward_s"] = forward_s
    return r


def test_a_memory_bound_step_within_the_tolerance_says_so():
    (r,) = rows = [row(0.0135, "memory")]
    explain(rows)
    assert r["within_tolerance"] and r["cause"] == "memory-bound, within 15%"
    assert r["measured_over_plan"] == 0.0135 / 0.013


def test_a_dispatch_or_kernel_bound_step_names_its_cause_even_within_the_tolerance():
    rows = [
        row(0.013, "dispatch", weights=0.001, bandwidth=0.001, dispatch=0.011),
        row(0.013, "kernel", weights=0.010, bandwidth=0.004),
    ]
    explain(rows)
    assert rows[0]["cause"].startswith("dispatch overhead: host cost 11.0 ms")
    assert "fused path" in rows[0]["cause"]
    assert rows[1]["cause"].startswith("kernel efficiency")
    assert "11.0 ms where the bytes need 4.0 ms at the GEMV bandwidth" in rows[1]["cause"]


def test_a_miss_is_split_by_the_forward_timed_alone():
    # the forward matches the plan (13 ms): the 7 ms more are the engine's work outside it
    (host,) = rows = [row(0.020, "memory", forward_s=0.013)]
    explain(rows)
    assert not host["within_tolerance"]
    assert host["cause"].startswith("engine host work outside the forward: 7.0 ms")
    # the forward itself is slower than the plan's kernels at long context
    slow = row(0.020, "memory", forward_s=0.019)
    slow["context"] = 2000.0
    explain([slow])
    assert "the model's forward takes 19.0 ms" in slow["cause"]
    assert "the cache read at long context" in slow["cause"]
    # nothing to split it with
    bare = row(0.030, "memory")
    explain([bare])
    assert bare["cause"] == "unexplained (the forward was not timed alone)"


def test_a_gap_that_the_machines_drift_explains_is_named_not_corrected():
    # the steps ran while the GEMV probe was 1.3x faster than around the profile: 0.8 -> ~1.04
    fast = row(0.0104, "memory", forward_s=0.0104)
    fast["gemv_speed_vs_profile"] = 1.3
    explain([fast])
    assert fast["measured_over_plan"] == 0.0104 / 0.013  # the ratio itself stays as measured
    assert "machine drift: the GEMV probe ran 1.30x the profile's speed" in fast["cause"]
    assert "~ 1.04, within 15%" in fast["cause"]
    steady = row(0.0104, "memory", forward_s=0.0104)
    steady["gemv_speed_vs_profile"] = 1.02
    explain([steady])
    assert "machine drift" not in steady["cause"]


def test_the_plan_with_its_kernels_timed_again_beside_the_steps_is_named_not_swapped():
    # a miss against the profile's plan (20 / 13 ms); the same plan from points timed beside the
    # steps says 18.5 ms: the gap is the machine's speed, which the verdict names
    slow = row(0.020, "memory", forward_s=0.0195)
    slow["plan_now_s"] = 0.0185
    explain([slow])
    assert not slow["within_tolerance"]  # the verdict stays the profile's plan's
    assert slow["measured_over_plan_now"] == 0.020 / 0.0185
    assert "timed again beside these steps: measured / plan 1.08 (within 15%)" in slow["cause"]
    far = row(0.030, "memory", forward_s=0.029)
    far["plan_now_s"] = 0.013
    explain([far])
    assert "measured / plan 2.31 (still outside 15%)" in far["cause"]
    inside = row(0.0135, "memory")
    inside["plan_now_s"] = 0.0135
    explain([inside])
    assert inside["cause"] == "memory-bound, within 15%"


def test_the_retimed_profile_replaces_the_pooled_layers_and_head_of_the_plans_formats(monkeypatch):
    import benchmarks.plan_vs_measured as pvm
    import kvserve.lab.measure_pool as mt
    from kvserve.lab.plan.hardware import HardwareProfile, MeasuredPoint
    from kvserve.lab.plan.model import ModelSpec

    spec = ModelSpec(
        name="tiny", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=128, vocab_size=100, max_position_embeddings=512,
        tie_word_embeddings=True,
    )  # fmt: skip
    seen = []

    def pooled(cfg, model, fmt, fixed, rows):
        seen.append(("pooled", fmt, rows, max(cfg.attention_contexts), tuple(fixed)))
        return [MeasuredPoint(f"pool-layer:{fmt}", n, 0.0, 1.0, 0.0, 9.0, c)
                for n in rows for c in (16, max(cfg.attention_contexts))]  # fmt: skip

    def head(cfg, model, fmt, rows):
        seen.append(("head", fmt, rows))
        return [MeasuredPoint(f"head:{fmt}", n, 0.0, 2.0, 0.0, 9.0) for n in rows]

    monkeypatch.setattr(mt, "measure_pool_layers", pooled)
    monkeypatch.setattr(mt, "measure_head", head)
    old = (
        MeasuredPoint("fused-fixed", 1, 0.0, 0.0, 0.0, 1e-4),
        MeasuredPoint("pool-layer:int4-g32", 1, 0.0, 5.0, 0.0, 1e-3, 16),
        MeasuredPoint("pool-layer:int4-g32", 16, 0.0, 5.0, 0.0, 1e-3, 16),
        MeasuredPoint("pool-layer:fp32", 1, 0.0, 5.0, 0.0, 1e-3, 16),
        MeasuredPoint("head:int8", 1, 0.0, 5.0, 0.0, 1e-3),
        MeasuredPoint("head:fp32", 1, 0.0, 5.0, 0.0, 1e-3),
    )
    profile = HardwareProfile("m", 1e12, 1e9, 1e15, "fp32", measured=True, points=old)
    new = pvm.retimed_profile(profile, spec, "linear=int4-g32,head=int8", [4, 1], [128, 2000])
    assert seen == [("pooled", "int4-g32", (1, 4), 2000, ((1, 1e-4),)), ("head", "int8", (1, 4))]
    kinds = sorted((p.kind, p.num_columns, p.context_tokens) for p in new.points)
    assert kinds == sorted([
        ("fused-fixed", 1, 0), ("pool-layer:fp32", 1, 16), ("head:fp32", 1, 0),
        ("pool-layer:int4-g32", 1, 16), ("pool-layer:int4-g32", 1, 2000),
        ("pool-layer:int4-g32", 4, 16), ("pool-layer:int4-g32", 4, 2000),
        ("head:int8", 1, 0), ("head:int8", 4, 0),
    ])  # fmt: skip
    seen.clear()
    pvm.retimed_profile(profile, spec, "fp32", [1], [128])
    assert [(kind, fmt) for kind, fmt, *_ in seen] == [("pooled", "fp32"), ("head", "fp32")]


def test_the_benchmark_process_runs_with_the_engines_thread_settings():
    # regression: the probes and the forward timed alone ran with OpenMP's spinning default while
    # the profile and bench latency (the `kvserve` command line) ran with kvserve's PASSIVE
    import os
    import subprocess
    import sys

    from kvserve.threads import THREAD_VARIABLES

    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARIABLES}
    code = "import os, benchmarks.plan_vs_measured, torch; print(os.environ.get('OMP_WAIT_POLICY'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)  # fmt: skip
    assert out.stdout.strip() == "PASSIVE"
