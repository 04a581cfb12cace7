"""What the engine's own kernels reach on this machine, for the planner (docs/planning.md,
"A measured engine profile"): `kvserve plan --measure` adds these points to the roofline.

- **linear:FMT** (FMT = fp32, int8, int4-g32, ...): the engine's own linear module
  (`kvserve.model.linear.make_linear`: oneDNN-packed fp32, the integer kernels for quantised
  formats) over a weight much larger than the last-level cache, at 1 .. 32 batch rows; bytes/s
  counts the planner's bytes of that matrix in FMT (codes + fp16 scales) once per call. The planner streams a step's
  linear weights at the measured rate of its batch size instead of the GEMV bandwidth: small-batch
  GEMM kernels do not reach it (on the 2-core EPYC fp32 at 16 rows: ~70%).
- **dispatch**: the engine's decoder (`kvserve.model.decoder.DecoderLM`, CPU kernels on, paged
  cache, the step's attention metadata) at a tiny width, where the arithmetic is negligible, with
  1 and 1 + `dispatch_layers` layers: the slope is the host cost of one layer (Python, op dispatch,
  kernel launches), the intercept the forward's fixed cost (embedding, final norm, head,
  metadata), per batch size.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kvserve.measure import MeasureConfig, time_median_s
from kvserve.plan.hardware import MeasuredPoint

LINEAR_ROWS = (1, 2, 4, 8, 16, 32)
DISPATCH_ROWS = (1, 4, 16)


def measure_linear(
    cfg: MeasureConfig, fmt: str, deadline: float, rows: tuple[int, ...] = LINEAR_ROWS
) -> list[MeasuredPoint]:
    """The engine's linear module for weight format `fmt` at each batch row count."""
    from kvserve.model.linear import make_linear
    from kvserve.plan.formats import parse_tensor_format
    from kvserve.plan.model import TensorShape
    from kvserve.quant.scheme import parse_tensor_scheme

    out_f, in_f = cfg.gemv_rows, cfg.gemv_cols
    weight = torch.randn(out_f, in_f) * in_f**-0.5  # [out, in]
    scheme = None if fmt == "fp32" else parse_tensor_scheme(fmt)
    module = make_linear(weight, None, scheme, cfg.device)
    # the planner's bytes for this matrix in this format (codes + fp16 scales), so that the plan's
    # weight bytes over this rate is the measured time (the kernel's own layout may differ)
    num_bytes = parse_tensor_format(fmt).num_bytes(TensorShape("w", "linear", out_f, in_f))
    del weight
    points = []
    for n in rows:
        if time.perf_counter() > deadline:
            break
        x = torch.randn(n, in_f)  # [rows, in]
        median_s = time_median_s(lambda x=x: module(x), cfg)
        flops = 2 * out_f * in_f * n
        points.append(
            MeasuredPoint(
                f"linear:{fmt}",
                n,
                flops / median_s,
                num_bytes / median_s,
                flops / num_bytes,
                median_s,
            )  # fmt: skip
        )
    return points


def _tiny_decoder(num_layers: int) -> Callable[[int], Callable[[], object]]:
    """A random tiny DecoderLM in the engine's CPU layout; returns make_step(batch) -> one decode
    forward (+ logits of every row) at context 64."""
    from kvserve.config import ModelConfig
    from kvserve.model.attention import build_attention_metadata, get_attention_backend
    from kvserve.model.decoder import DecoderLM
    from kvserve.model.kv_cache import allocate_layers
    from kvserve.model.registry import get_arch

    config = ModelConfig(
        model_type="llama", vocab_size=256, hidden_size=64, num_layers=num_layers,
        num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128, rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=True,
    )  # fmt: skip
    model = DecoderLM(config, get_arch("llama"), 256).eval()
    model.use_cpu_weights()
    block_size, context = 16, 64
    num_blocks = 16 * (context // block_size + 1) + 1
    _, caches = allocate_layers(
        num_layers, num_blocks, block_size, 2, 16, torch.float32, "auto", torch.device("cpu")
    )
    backend = get_attention_backend("auto", torch.device("cpu"), torch.float32)
    per_seq = context // block_size + 1

    def make_step(batch: int) -> Callable[[], object]:
        chunks = [(context, 1, list(range(1 + i * per_seq, 1 + (i + 1) * per_seq))) for i in
                  range(batch)]  # fmt: skip
        ids = torch.zeros(batch, dtype=torch.long)
        positions = torch.full((batch,), context, dtype=torch.long)

        def step() -> object:
            meta = build_attention_metadata(chunks, block_size, torch.device("cpu"))
            hidden = model(ids, positions, caches, meta, backend)
            return model.compute_logits(hidden)

        return step

    return make_step


def measure_dispatch(
    cfg: MeasureConfig, dispatch_layers: int = 8, rows: tuple[int, ...] = DISPATCH_ROWS
) -> list[MeasuredPoint]:
    """Per batch size: `dispatch` (seconds per decoder layer) and `dispatch-fixed` (the rest of a
    forward) from the tiny decoder at 1 and 1 + dispatch_layers layers."""
    one, many = _tiny_decoder(1), _tiny_decoder(1 + dispatch_layers)
    points = []
    for n in rows:
        t_one = time_median_s(one(n), cfg)
        t_many = time_median_s(many(n), cfg)
        per_layer = max(0.0, (t_many - t_one) / dispatch_layers)
        points.append(MeasuredPoint("dispatch", n, 0.0, 0.0, 0.0, per_layer))
        points.append(
            MeasuredPoint("dispatch-fixed", n, 0.0, 0.0, 0.0, max(0.0, t_one - per_layer))
        )
    return points


def measure_engine(
    cfg: MeasureConfig,
    formats: tuple[str, ...] = ("fp32",),
    budget_s: float = 40.0,
    progress: Callable[[MeasuredPoint], None] | None = None,
) -> list[MeasuredPoint]:
    """The dispatch points and each format's linear points (CPU only: the engine's CPU layouts)."""
    deadline = time.perf_counter() + budget_s
    points: list[MeasuredPoint] = []
    with torch.inference_mode():
        for p in measure_dispatch(cfg):
            points.append(p)
            if progress:
                progress(p)
        for fmt in formats:
            for p in measure_linear(cfg, fmt, deadline):
                points.append(p)
                if progress:
                    progress(p)
    return points


def time_model_forward(
    model_dir: str,
    batch: int,
    context: int,
    quantization: str | None = None,
    cfg: MeasureConfig | None = None,
) -> float:
    """Median seconds of one decode forward (+ the head on every row) of the checkpoint in
    `model_dir`, loaded as the engine loads it (its own weights and quantisation), for `batch`
    sequences at `context` cached tokens: the model's part of a decode step, without the
    scheduler, the sampler or the engine's bookkeeping (benchmarks/plan_vs_measured.py)."""
    from kvserve.config import ModelConfig
    from kvserve.model.attention import build_attention_metadata, get_attention_backend
    from kvserve.model.kv_cache import allocate_layers
    from kvserve.model.loader import load_model

    cfg = cfg or MeasureConfig(min_time_s=1.0, min_samples=5)
    config = ModelConfig.from_dir(model_dir)
    block_size = 16
    per_seq = context // block_size + 1
    cpu = torch.device("cpu")
    with torch.inference_mode():
        model = load_model(model_dir, config, context + 1, "float32", "cpu", quantization).eval()
        _, caches = allocate_layers(
            config.num_layers, batch * per_seq + 1, block_size, config.num_kv_heads,
            config.head_dim, torch.float32, "auto", cpu,
        )  # fmt: skip
        backend = get_attention_backend("auto", cpu, torch.float32)
        chunks = [
            (context, 1, list(range(1 + i * per_seq, 1 + (i + 1) * per_seq))) for i in range(batch)
        ]
        ids = torch.zeros(batch, dtype=torch.long)
        positions = torch.full((batch,), context, dtype=torch.long)

        def step() -> object:
            meta = build_attention_metadata(chunks, block_size, cpu)
            return model.compute_logits(model(ids, positions, caches, meta, backend))

        return time_median_s(step, cfg)
