"""The twin against the real engine: same decisions on the same requests, and calibration."""

from __future__ import annotations

import numpy as np
import pytest

from kvserve.core.block_tables import BlockTables
from kvserve.core.sampling_params import SamplingParams
from kvserve.lab.sim.loop import simulate_continuous
from kvserve.lab.sim.workload import SimRequest
from tests.checkpoints import build_checkpoint
from tests.lab.test_sim import RecordingCost

# (prompt tokens, output tokens): one prompt longer than the step budget, more requests than
# max_num_seqs, and a cache small enough that on_demand admission preempts.
SIZES = [(30, 12), (10, 25), (70, 6), (18, 30), (40, 9), (12, 14), (55, 20)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("sim-engine") / "llama"
    build_checkpoint(path, "llama")
    return path


def make_engine(model_dir, admission: str):
    from kvserve.engine.args import build_engine_config
    from kvserve.engine.core import EngineCore

    config = build_engine_config(
        model_dir,
        dtype="float32",
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=24,
        block_size=4,
        num_blocks=30,
        admission=admission,
    )
    return EngineCore(config, load_default_tokenizer=False)


def decisions(outputs) -> list[tuple]:
    """What the scheduler decided, without the sampled token values (the model's, or fake); each
    chunk with its block table as a runner rebuilds it from the steps' changes."""
    tables = BlockTables(1)
    out = []
    for o in outputs:
        for request_id in o.finished_request_ids + o.preempted_request_ids:
            tables.drop(request_id)
        chunks = tuple(
            (
                c.request_id,
                c.start_position,
                c.num_tokens,
                tuple(tables.apply_chunk(c)[0]),
                c.sample,
            )
            for c in o.chunks
        )
        if not o.empty:
            out.append((chunks, o.preempted_request_ids))
    return out


@pytest.mark.parametrize("admission", ["on_demand", "reserve"])
def test_the_simulator_decides_what_the_engine_decides(tiny_dir, admission):
    engine = make_engine(tiny_dir, admission)
    engine_outputs = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda now=0.0: (
        engine_outputs.append(schedule(now)) or engine_outputs[-1]
    )
    rng = np.random.default_rng(0)
    for i, (num_prompt, num_output) in enumerate(SIZES):
        prompt = [int(t) for t in rng.integers(3, 256, size=num_prompt)]
        params = SamplingParams(max_tokens=num_output, ignore_eos=True, temperature=0.0)
        engine.add_request(f"sim-{i}", prompt, params, arrival_time=0.0)
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_invariants()

    recorder = RecordingCost()
    requests = tuple(SimRequest(i, 0.0, p, o) for i, (p, o) in enumerate(SIZES))
    run = simulate_continuous(requests, recorder, engine.config.scheduler, 30, block_size=4)
    assert decisions(recorder.outputs) == decisions(engine_outputs)
    assert (run.num_preemptions > 0) == (admission == "on_demand")
    assert run.num_preemptions == engine.scheduler.stats.num_preemptions


def test_calibration_fits_a_profile_the_simulator_runs_with(tiny_dir):
    from kvserve.lab.calibration import calibrate
    from kvserve.lab.sim.setup import profile_deployment
    from kvserve.lab.sim.study import EngineShape, Policy, run_policy

    engine = make_engine(tiny_dir, "on_demand")
    profile = calibrate(engine, max_len=48, budget_s=5.0)
    fit = profile.meta["fit"]
    assert fit["num_steps"] == len(profile.meta["samples"]["wall_s"]) >= 20
    assert min(profile.coef_s) >= 0 and profile.coef_s[0] > 0  # a step is never free
    assert profile.meta["engine"]["num_blocks"] == 30
    deployment = profile_deployment(profile)
    assert deployment.defaults["max_num_batched_tokens"] == 24
    shape = EngineShape(
        num_blocks=deployment.defaults["num_blocks"],
        max_model_len=deployment.defaults["max_model_len"],
        block_size=deployment.defaults["block_size"],
        max_num_seqs=deployment.defaults["max_num_seqs"],
        chunk_tokens=deployment.defaults["max_num_batched_tokens"],
    )
    requests = tuple(SimRequest(i, 0.0, p, o) for i, (p, o) in enumerate(SIZES))
    run = run_policy(Policy.parse("on_demand-chunked"), shape, deployment.cost_model, requests)
    assert run.end_s > 0 and all(t.finish_s is not None for t in run.timelines)
