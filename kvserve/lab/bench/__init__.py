"""kvserve.lab.bench: an HTTP load generator for OpenAI-compatible servers, and its metrics and reports;
and an offline phase-split latency bench of the in-process engine.

`bench serve` speaks HTTP only (never imports the engine), so it measures kvserve, vLLM and
llama.cpp's server the same way. Definitions follow spec.md sections 1-3. Only `latency` imports the
engine (its public LLM API, design.md).

Module map:

- `records`    frozen records: a prepared request, a streamed event, a finished request
- `text`       synthetic text: `code` (easy to predict) and `prose` (hard to predict)
- `tokenization` token counts (server `/tokenize`, local dir, approximate), exact-length fitting
- `workloads`  random / sharegpt / shared-prefix request lists, seeded per request index
- `arrivals`   open-loop gamma/Poisson schedules, traces, gap statistics
- `client`     one streamed OpenAI request -> RequestRecord; server identity probes
- `loadgen`    the asyncio driver: absolute-time sends, closed loop, lag monitor, Ctrl-C
- `metrics`    pure per-request metrics and percentiles from raw records
- `slo`        named objectives (per-request and pooled-percentile) and goodput
- `prometheus` server-side counters over a run from `/metrics` (queue time, cache hits, acceptance)
- `summary`    run level: window, throughput, goodput, Little's law, wall-clock decomposition
- `capacity`   the rate search (bisection, then neighbour checks), independent of the network
- `runner`     one run: connect, prepare, execute, write the run directory
- `session`    one invocation: a single run, a sweep of rates, or a capacity search
- `identity`   what was measured: server, model, tokenizer, manifest, hardware (docs/load-tests.md)
- `report`     console table and HTML report; `plots` draws its figures (matplotlib Agg)
- `compare`    two runs: metric deltas and per-request output identity by hash
- `latency`    `bench latency`: time each engine step of a batch over a B x P x O grid (in-process)
- `phases`     its pure part: prefill/decode split, identical-output check, roofline bound per regime
- `latency_report` its console table and figure
"""
