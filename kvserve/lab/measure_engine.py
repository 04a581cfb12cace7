"""What the engine's own kernels reach on this machine, for the planner (docs/planning.md,
"A measured engine profile"): `kvserve plan --measure` adds these points to the roofline.

- **linear:FMT** (FMT = fp32, int8, int4-g32, ...): the engine's own linear module
  (`kvserve.model.linear.make_linear`: oneDNN-packed fp32, the integer kernels for quantised
  formats) at 1 .. 32 batch rows, over a weight much larger than the last-level cache, or over
  a model's own block matrices (`--measure-model`: small matrices stream slower than one large
  one, by 20-45% here); bytes/s counts the planner's bytes of the matrices in FMT (codes + fp16
  scales) over the streaming time: the calls' time less the same calls on 64 x 64 matrices (the
  per-call host cost, counted by `dispatch`). The planner streams a step's weights at the
  measured rate of its batch size instead of the GEMV bandwidth: small-batch kernels do not
  reach it.
- **attention**: the engine's decode attention over several layers' paged fp32 caches at
  contexts 128 and 2048: the extra cache bytes over the extra time (the KV cache's read rate;
  ~5-8 GB/s here against a 22 GB/s GEMV).
- **dispatch**: the engine's decoder (`kvserve.model.decoder.DecoderLM`, CPU kernels on, paged
  cache, the step's attention metadata) at a tiny width, where the arithmetic is negligible, with
  1 and 1 + `dispatch_layers` layers: the slope is the host cost of one layer (Python, op dispatch,
  kernel launches), the intercept the forward's fixed cost (embedding, final norm, head,
  metadata), per batch size.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from kvserve.lab.measure import MeasureConfig, stream_copies, time_median_s
from kvserve.lab.plan.hardware import MeasuredPoint

LINEAR_ROWS = (1, 2, 4, 8, 16, 32)
DISPATCH_ROWS = (1, 4, 16)
FUSED_ROWS = (1, 2, 4, 8, 16, 32, 64)  # the fused step's host cost, at those it takes
# decode_step.c runs the fused step as one OpenMP region (the pooled step) at every context whenever
# at least this many threads run (use_pooled_step); a test checks the planner's path rule against the
# kernel's choice (tests/lab/test_plan_engine_overhead.py)
POOL_MIN_THREADS = 2
FIXED_KIND = {
    "dispatch": "dispatch-fixed",
    "fused-dispatch": "fused-fixed",
    "fork-dispatch": "fork-fixed",
}


def linear_shapes(cfg: MeasureConfig, model=None) -> list[tuple[int, int]]:
    """[(out, in)] of the matrices one linear point streams: one weight much larger than the
    last-level cache, or a model's block linears, one set per layer (as its decode step streams
    them: q/k/v fused, o, gate/up fused, down; kvserve.lab.plan.ModelSpec)."""
    if model is None:
        return [(cfg.gemv_rows, cfg.gemv_cols)]
    d, f = model.hidden_size, model.intermediate_size
    layer = [(model.q_dim + 2 * model.kv_dim, d), (d, model.q_dim), (2 * f, d), (d, f)]
    return layer * model.num_layers


def step_weight_bytes(model, fmt: str) -> float:
    """The planner's bytes of the weights a decode step of `model` (a kvserve.lab.plan.ModelSpec)
    streams with its block linears and head in `fmt`: every layer's linears and the head."""
    from kvserve.lab.plan.formats import parse_tensor_format
    from kvserve.lab.plan.model import TensorShape

    tensor_format = parse_tensor_format(fmt)
    shapes = [TensorShape("w", "linear", o, i) for o, i in linear_shapes(MeasureConfig(), model)]
    shapes.append(TensorShape("head", "head", model.vocab_size, model.hidden_size))
    return float(sum(tensor_format.num_bytes(t) for t in shapes))


def measure_linear(
    cfg: MeasureConfig,
    fmt: str,
    deadline: float,
    rows: tuple[int, ...] = LINEAR_ROWS,
    model=None,
) -> list[MeasuredPoint]:
    """The engine's linear modules for weight format `fmt` over `linear_shapes`, at each batch
    row count: one sample calls every matrix once, in order, over as many copies of the set as
    `stream_copies` asks (so that they stream from memory as a step's weights do); fp32 also
    `linear-fused:fp32`, the panel GEMV the fused step streams fp32 weights with at the rows (8,
    16) where the per-op path takes oneDNN instead."""
    from kvserve.lab.plan.formats import parse_tensor_format
    from kvserve.lab.plan.model import TensorShape
    from kvserve.model import fused_decode
    from kvserve.model.linear import make_linear
    from kvserve.quant.scheme import parse_tensor_scheme

    scheme = None if fmt == "fp32" else parse_tensor_scheme(fmt)
    tensor_format = parse_tensor_format(fmt)
    shapes = linear_shapes(cfg, model)
    # the planner's bytes of these matrices in this format (codes + fp16 scales), so that the
    # plan's weight bytes over this rate is the measured time (kernels' layouts may differ)
    num_bytes = sum(tensor_format.num_bytes(TensorShape("w", "linear", o, i)) for o, i in shapes)
    flops_per_row = sum(2 * o * i for o, i in shapes)
    # the calls cycle through copies, so that a small format's matrices stream from memory as
    # in a decode step rather than from the last-level cache: as many bytes as the model's step
    # reads, or without a model as the same matrices in fp32 (the config's "much larger")
    fp32_bytes = 4.0 * sum(o * i for o, i in shapes)
    step_bytes = fp32_bytes if model is None else step_weight_bytes(model, fmt)
    copies = stream_copies(num_bytes, step_bytes, cfg.device)
    modules, tiny = [], []
    for out_f, in_f in shapes * copies:
        weight = torch.randn(out_f, in_f) * in_f**-0.5  # [out, in]
        modules.append((make_linear(weight, None, scheme, cfg.device), in_f))
        # the same call on a 64 x 64 matrix: its per-call host cost, which the dispatch points
        # already count (the tiny decoder's linears), is taken out of the streaming time
        tiny.append((make_linear(torch.randn(64, 64) / 8, None, scheme, cfg.device), 64))
    kinds = [(f"linear:{fmt}", modules, tiny, rows)]
    if fmt == "fp32" and fused_decode.max_step_rows() > fused_decode.max_rows():
        keep: list = []

        def panel(mods: list) -> list:  # the fused step's own GEMV on each matrix's fp32 panels
            descs = [(fused_decode.linear_descriptor(m, keep), k) for m, k in mods]
            return [(lambda x, d=d: fused_decode.small_linear(d, x), k) for d, k in descs]

        panel_rows = tuple(
            n for n in FUSED_ROWS if fused_decode.max_rows() < n <= fused_decode.max_step_rows()
        )
        if all(fused_decode.linear_descriptor(m, keep) for m, _ in modules + tiny):
            kinds.append(("linear-fused:fp32", panel(modules), panel(tiny), panel_rows))
    points = []
    for kind, mods, tiny_mods, kind_rows in kinds:
        points += _linear_points(
            kind, mods, tiny_mods, kind_rows, cfg, deadline, num_bytes, flops_per_row, copies
        )
    return points


def _linear_points(
    kind: str,
    modules: list,
    tiny: list,
    rows: tuple[int, ...],
    cfg: MeasureConfig,
    deadline: float,
    num_bytes: float,
    flops_per_row: int,
    copies: int = 1,
) -> list[MeasuredPoint]:
    """Points per row count; `modules` are `copies` sets of matrices of `num_bytes`: each point's
    time is one set's share of the calls' streaming time."""
    points = []
    for i, n in enumerate(rows):
        if i and time.perf_counter() > deadline:  # every format gets its first row count
            break

        def calls(mods: list, n: int = n) -> Callable[[], None]:
            xs = [(m, torch.randn(n, in_f)) for m, in_f in mods]  # [rows, in] each

            def call() -> None:
                for m, x in xs:
                    m(x)

            return call

        total_s = time_median_s(calls(modules), cfg)
        overhead_s = time_median_s(calls(tiny), cfg)
        median_s = max(total_s - overhead_s, 0.05 * total_s) / copies  # streaming, one set
        flops = flops_per_row * n
        points.append(
            MeasuredPoint(
                kind,
                n,
                flops / median_s,
                num_bytes / median_s,
                flops / num_bytes,
                median_s,
            )
        )
    return points


def interleaved_medians_s(
    calls: dict[int, Callable[[], object]],
    cfg: MeasureConfig,
    rounds: int,
    timer: Callable[[Callable[[], object], MeasureConfig], float] = time_median_s,
) -> dict[int, float]:
    """{key: the median over `rounds` of timer(call)}, the calls in A B C order in even rounds and
    C B A in odd ones, so that a slow phase of the machine (tens of seconds here) lands in one
    round of every key rather than in all of one key's samples."""
    keys = list(calls)
    samples: dict[int, list[float]] = {k: [] for k in keys}
    for r in range(rounds):
        for k in keys if r % 2 == 0 else keys[::-1]:
            samples[k].append(timer(calls[k], cfg))
    return {k: statistics.median(v) for k, v in samples.items()}


def measure_attention(
    cfg: MeasureConfig,
    rows: tuple[int, ...] = DISPATCH_ROWS,
    num_kv_heads: int = 4,
    head_dim: int = 64,
    num_heads: int | None = None,
) -> list[MeasuredPoint]:
    """The engine's decode attention (the backend `auto` picks: the in-place CPU kernel for
    fp32, the same C function the fused step calls) at each of `cfg.attention_contexts`, over as
    many layers' paged caches as make about `cfg.attention_cache_bytes` at the longest context
    (so that they stream from memory, as a model's do), per batch size:

    - `attention-time`: seconds per layer at (rows, context) (`context_tokens`), which the
      planner interpolates in context (the cache read at the context it is predicted for), the
      median of `cfg.attention_rounds` interleaved rounds (`interleaved_medians_s`);
    - `attention`: the extra cache bytes of the longest context over the shortest, over the
      extra time (a rate, for profiles read by older planners)."""
    from kvserve.model.attention import build_attention_metadata, get_attention_backend
    from kvserve.model.kv_cache import allocate_layers

    cpu = torch.device("cpu")
    backend = get_attention_backend("auto", cpu, torch.float32)
    block_size, num_heads = 16, num_heads or 2 * num_kv_heads
    contexts = sorted(set(cfg.attention_contexts))
    short, long = contexts[0], contexts[-1]
    per_seq = long // block_size + 1
    token_bytes = 2 * num_kv_heads * head_dim * 4  # K and V of one token of one layer, fp32
    points = []
    for n in rows:
        per_layer = n * per_seq * block_size * token_bytes
        num_layers = int(min(64, max(1, cfg.attention_cache_bytes // per_layer)))
        _, caches = allocate_layers(
            num_layers,
            n * per_seq + 1,
            block_size,
            num_kv_heads,
            head_dim,
            torch.float32,
            "auto",
            cpu,
        )
        for c in caches:
            c.k.normal_()
            c.v.normal_()
        q = torch.randn(n, num_heads, head_dim)  # [B, heads, head_dim]
        calls = {}
        for context in contexts:
            blocks = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(n)]
            meta = build_attention_metadata([(context - 1, 1, b) for b in blocks], block_size, cpu)

            def call(meta=meta, caches=caches, q=q) -> None:
                for c in caches:
                    backend(q, c, meta, head_dim**-0.5)

            calls[context] = call
        medians = interleaved_medians_s(calls, cfg, cfg.attention_rounds)
        times = [medians[context] for context in contexts]
        for context, t in zip(contexts, times, strict=True):
            points.append(
                MeasuredPoint(
                    "attention-time", n, 0.0, 0.0, 0.0, t / num_layers, context, token_bytes
                )
            )
        extra_bytes = n * (long - short) * token_bytes * num_layers
        # (a noisy pair at tiny sizes can come out reversed: the rate stays positive)
        rate = extra_bytes / max(times[-1] - times[0], 0.01 * times[-1], 1e-9)
        points.append(MeasuredPoint("attention", n, 0.0, rate, 0.0, times[-1]))
    return points


def tiny_decoder(
    num_layers: int,
    fused: bool,
    context: int = 64,
    max_batch: int = 64,
    shape=None,
    scheme=None,
    cache_rows: int | None = None,
) -> tuple[Callable[..., Callable[[], object]], object]:
    """A random tiny DecoderLM in the engine's CPU layout, its fused decode step on or off;
    returns (make_step(batch) -> one decode forward (+ logits of every row) at `context`, the
    model: `model.fused.num_steps` counts the steps that ran fused). `shape` (a
    kvserve.lab.plan.ModelSpec): its layers' widths and heads instead of the tiny ones (the
    vocabulary stays tiny); `scheme` (a TensorScheme): its block linears quantised by RTN, as the
    engine's `--quantization` does; make_step(batch, at) runs at `at` <= `context` tokens.
    The cache holds `cache_rows` (default `max_batch`) sequences of `context` tokens, and a step's
    sequences lie one after another in it, so more rows fit at fewer tokens (ValueError past it)."""
    from kvserve.config import ModelConfig
    from kvserve.model.attention import build_attention_metadata, get_attention_backend
    from kvserve.model.decoder import DecoderLM
    from kvserve.model.kv_cache import allocate_layers
    from kvserve.model.registry import get_arch

    widths = dict(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128)
    if shape is not None:
        widths = {k: getattr(shape, k) for k in widths}
    config = ModelConfig(
        model_type="llama",
        vocab_size=256,
        num_layers=num_layers,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=max(256, 2 * context),
        tie_word_embeddings=True,
        **widths,
    )
    model = DecoderLM(config, get_arch("llama"), config.max_position_embeddings).eval()
    if scheme is not None:  # as the loader applies `--quantization linear=FMT`
        from kvserve.model.linear import apply_weight_scheme
        from kvserve.quant.scheme import WeightScheme

        apply_weight_scheme(model, WeightScheme(scheme.name, scheme))
    model.use_cpu_weights()
    model.fused_decode = model.fused_decode and fused  # as the engine decides, or the per-op path
    block_size = 16
    num_blocks = (cache_rows or max_batch) * (context // block_size + 1) + 1
    _, caches = allocate_layers(
        num_layers,
        num_blocks,
        block_size,
        config.num_kv_heads,
        config.head_dim,
        torch.float32,
        "auto",
        torch.device("cpu"),
    )
    for c in caches:  # values, as a served cache holds (not the zero pages of a fresh tensor)
        c.k.normal_()
        c.v.normal_()
    backend = get_attention_backend("auto", torch.device("cpu"), torch.float32)

    def make_step(batch: int, at: int | None = None) -> Callable[[], object]:
        at = context if at is None else at
        per_seq = at // block_size + 1
        if batch * per_seq > num_blocks - 1:
            raise ValueError(f"{batch} rows of {at} tokens do not fit the {num_blocks - 1} blocks")
        chunks = [
            (at, 1, list(range(1 + i * per_seq, 1 + (i + 1) * per_seq))) for i in range(batch)
        ]
        ids = torch.zeros(batch, dtype=torch.long)
        positions = torch.full((batch,), at, dtype=torch.long)

        def step() -> object:
            meta = build_attention_metadata(chunks, block_size, torch.device("cpu"))
            hidden = model(ids, positions, caches, meta, backend)
            return model.compute_logits(hidden)

        return step

    return make_step, model


def fused_rows() -> int:
    """The most decode rows the engine's fused decode step takes here when every projection is
    fp32, as the tiny decoder's are (0: not built)."""
    from kvserve.model import fused_decode

    return fused_decode.max_step_rows()


def fused_profile_fields(points: list[MeasuredPoint], num_threads: int) -> dict[str, object]:
    """The HardwareProfile fields that say which step shape the engine runs (docs/planning.md):
    the fused step's rows with quantised projections (`decode_fused_rows`: the per-op fp32 linear
    changes kernel there too) and with fp32 ones (`decode_fused_f32_rows`: the most rows its
    fixed host cost was measured at, every row count the step takes), and whether it is the pooled
    step at every context (`num_threads`, the threads the engine runs with). Not the per-layer
    points' rows: with a model those are the pooled step's host points, at 1, 4 and 16 rows only, and a
    profile said 16 while the engine fused steps of up to 64 rows."""
    from kvserve.model import fused_decode

    fused = [p.num_columns for p in points if p.kind == "fused-dispatch"]
    if not fused:
        return {
            "decode_fused_rows": 0,
            "decode_fused_f32_rows": 0,
            "decode_pooled_any_context": False,
        }
    fixed = [p.num_columns for p in points if p.kind == "fused-fixed"]
    return {
        "decode_fused_rows": min(fused_decode.max_rows(), max(fused)),
        "decode_fused_f32_rows": max(fixed or fused),
        "decode_pooled_any_context": num_threads >= POOL_MIN_THREADS,
    }


def measure_dispatch(
    cfg: MeasureConfig,
    dispatch_layers: int = 8,
    rows: tuple[int, ...] = DISPATCH_ROWS,
    fused_shape_rows: tuple[int, ...] | None = None,
) -> list[MeasuredPoint]:
    """Per batch size, from the tiny decoder at 1 and 1 + dispatch_layers layers: the per-op path
    (its fused step off) at `rows`: `dispatch` (seconds per decoder layer) and `dispatch-fixed`
    (the rest of a forward); the fused step at `FUSED_ROWS` up to `fused_rows()`, where it runs:
    `fused-dispatch` and `fused-fixed` (its cost per layer inside the native call, and the rest
    of the step: embedding, RoPE tables, metadata, the call, the head: the pooled step, one
    OpenMP region, with more than one thread); `fused_shape_rows` overrides those rows (a quick
    probe). Each point is the median over `cfg.dispatch_rounds` rounds of the two decoders'
    difference. (The forking path of older kernels, `fork-dispatch`, is no step shape now: the
    kernel runs the pooled step at every context.)"""
    max_fused = fused_rows()
    shapes = [("dispatch", False, rows)]
    if max_fused:
        fused_rows_ = tuple(n for n in fused_shape_rows or FUSED_ROWS if n <= max_fused)
        if max_fused not in fused_rows_ and not fused_shape_rows:
            fused_rows_ += (max_fused,)
        shapes += [("fused-dispatch", True, fused_rows_)]

    points = []
    for kind, fused, shape_rows in shapes:
        (one, m_one), (many, m_many) = (
            tiny_decoder(1, fused),
            tiny_decoder(1 + dispatch_layers, fused),
        )
        for n in shape_rows:
            steps_before = m_many.fused.num_steps if fused and m_many.fused else 0
            ones, slopes = [], []
            # rounds of one and many, alternating which goes first: a slow phase of the machine
            # lands in one round's difference, not in all of one decoder's samples
            for r in range(cfg.dispatch_rounds):
                order = (one, many) if r % 2 == 0 else (many, one)
                times = {dec: time_median_s(dec(n), cfg) for dec in order}
                ones.append(times[one])
                slopes.append((times[many] - times[one]) / dispatch_layers)
            if fused and not (
                m_one.fused and m_many.fused and m_many.fused.num_steps > steps_before
            ):
                break  # the fused step did not run at n rows: there is no such step shape
            per_layer = max(0.0, statistics.median(slopes))
            fixed = max(0.0, statistics.median(ones) - per_layer)
            points.append(MeasuredPoint(kind, n, 0.0, 0.0, 0.0, per_layer))
            points.append(MeasuredPoint(FIXED_KIND[kind], n, 0.0, 0.0, 0.0, fixed))
    return points


def measure_engine(
    cfg: MeasureConfig,
    formats: tuple[str, ...] = ("fp32",),
    budget_s: float = 60.0,
    progress: Callable[[MeasuredPoint], None] | None = None,
    model=None,
) -> list[MeasuredPoint]:
    """The dispatch and attention points and each format's linear points (CPU only: the engine's
    CPU layouts); the linears over `model`'s own matrices when given (a kvserve.lab.plan.ModelSpec).
    kvserve.lab.measure_pool.measure_engine_on_model adds the fused step's host per layer on its layer
    shapes."""
    deadline = time.perf_counter() + budget_s
    points: list[MeasuredPoint] = []
    with torch.inference_mode():
        heads = {}
        if model is not None:  # the model's own attention shape
            heads = dict(
                num_kv_heads=model.num_kv_heads, head_dim=model.head_dim, num_heads=model.num_heads
            )
        for p in measure_dispatch(cfg) + measure_attention(cfg, **heads):
            points.append(p)
            if progress:
                progress(p)
        for fmt in formats:
            for p in measure_linear(cfg, fmt, deadline, model=model):
                points.append(p)
                if progress:
                    progress(p)
    return points
