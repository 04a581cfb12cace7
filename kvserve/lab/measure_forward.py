"""The model's decode forward timed alone (benchmarks/plan_vs_measured.py, docs/planning.md
"Checked against measured steps"): the model's part of a measured decode step, without the
scheduler, the sampler or the engine's bookkeeping."""

from __future__ import annotations

import torch

from kvserve.lab.measure import MeasureConfig, time_median_s


def time_model_forwards(
    model_dir: str,
    shapes: list[tuple[int, int]],
    quantization: str | None = None,
    cfg: MeasureConfig | None = None,
) -> dict[tuple[int, int], float]:
    """{(batch, context): median seconds of one decode forward (+ the head on every row)} of the
    checkpoint in `model_dir`, loaded once as the engine loads it (its own weights and
    quantisation), for `batch` sequences at `context` cached tokens: the model's part of a
    decode step (the fused step where the engine takes it), without the scheduler, the sampler
    or the engine's bookkeeping (benchmarks/plan_vs_measured.py)."""
    from kvserve.config import ModelConfig
    from kvserve.model.attention import build_attention_metadata, get_attention_backend
    from kvserve.model.kv_cache import allocate_layers
    from kvserve.model.loader import load_model

    cfg = cfg or MeasureConfig(min_time_s=1.0, min_samples=5)
    config = ModelConfig.from_dir(model_dir)
    block_size = 16
    cpu = torch.device("cpu")
    longest = max(c for _, c in shapes)
    out = {}
    with torch.inference_mode():
        model = load_model(model_dir, config, longest + 1, "float32", "cpu", quantization).eval()
        backend = get_attention_backend("auto", cpu, torch.float32)
        for batch, context in shapes:
            per_seq = context // block_size + 1
            _, caches = allocate_layers(
                config.num_layers,
                batch * per_seq + 1,
                block_size,
                config.num_kv_heads,
                config.head_dim,
                torch.float32,
                "auto",
                cpu,
            )
            chunks = [
                (context, 1, list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)))
                for i in range(batch)
            ]
            ids = torch.zeros(batch, dtype=torch.long)
            positions = torch.full((batch,), context, dtype=torch.long)

            def step(chunks=chunks, ids=ids, positions=positions, caches=caches) -> object:
                meta = build_attention_metadata(chunks, block_size, cpu)
                return model.compute_logits(model(ids, positions, caches, meta, backend))

            out[(batch, context)] = time_median_s(step, cfg)
            del caches
    return out
