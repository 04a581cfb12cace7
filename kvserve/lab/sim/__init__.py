"""kvserve.lab.sim: a discrete-event simulator around the engine's own scheduler and KV manager.

The digital twin of design.md: `kvserve.sched.Scheduler` and `kvserve.kv.KVCacheManager` make every
decision, exactly as in the engine; a cost model says how long each step takes instead of a model
runner. Never imports torch, the model or the runner (tests/project/test_layers.py). Metrics reuse
kvserve.lab.bench's definitions (records -> summary), so a simulation and a load test of the same
workload report the same quantities.

Module map:

- `workload`  simulated requests: seeded synthetic workloads (the bench's arrivals and lengths),
              bench traces and raw bench records
- `cost`      StepLoad (what a step computes), the roofline cost model (kvserve.lab.plan.arith) and
              calibrated step profiles (fit, save, load)
- `timeline`  per-request timelines and their conversion to bench records
- `loop`      continuous batching: the discrete-event loop around Scheduler and KVCacheManager
- `static`    static batching, a policy of its own (padded batches, nobody joins)
- `study`     policies, engine limits, one run's metrics, sweeps, capacity search, cost
- `setup`     deployments: model + hardware -> roofline and cache size, or a calibrated profile
- `report`    text tables and the p99 TTFT / ITL vs rate plot

- `fit`       fitting a step profile to timed steps, its error, the bound a saved fit must meet
- `noise`     step-cost noise drawn from a fit's residuals (tails from the model)
- `server_steps` calibration from a live server's logged steps (GET /debug/steps)
- `speculative` speculative decoding: acceptance draws and the draft's cost

Calibration (timing the real engine) lives in kvserve.lab.calibration: it needs torch and the engine,
which the simulator never imports.
"""
