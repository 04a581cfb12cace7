"""Prompt-chunk attention of a cold 3,000-token prompt (chunks of 2,048 + 952 at the default token budget)
on SmolLM2-135M's shape (9 q heads, 3 kv heads, head_dim 64), x30 layers: the masked SDPA of the torch
backend against the cpu backend's mask-free causal + prefix merge. Prints ms per prompt (30 layers).

    PYTHONPATH=$PWD kv-bench .venv/bin/python benchmarks/results/h14L_prefill/chunk_attention.py
"""

import time

import torch

from kvserve.model.attention import _multi_cpu, _multi_torch, build_attention_metadata
from kvserve.model.kv_cache import allocate_layers

bs, prompt, budget = 16, 3000, 2048
_, (cache,) = allocate_layers(
    1, prompt // bs + 2, bs, 3, 64, torch.float32, "auto", torch.device("cpu")
)
cache.k.normal_(), cache.v.normal_()
ids = list(range(prompt // bs + 1))
meta = build_attention_metadata(
    [
        (0, budget, ids),
    ],
    bs,
    torch.device("cpu"),
)
meta2 = build_attention_metadata([(budget, prompt - budget, ids)], bs, torch.device("cpu"))
chunks = [
    (torch.randn(budget, 9, 64), meta.multi[0]),
    (torch.randn(prompt - budget, 9, 64), meta2.multi[0]),
]
for name, fn in (("torch (mask)", _multi_torch), ("cpu (causal+merge)", _multi_cpu)) * 2:
    best = 1e9
    for _ in range(3):
        t0 = time.perf_counter()
        for _layer in range(30):
            for q, chunk in chunks:
                fn(q, cache, chunk, 0.125)
        best = min(best, time.perf_counter() - t0)
    print(
        f"{name:20s}: {best * 1e3:7.0f} ms per 3,000-token prompt (30 layers, {torch.get_num_threads()} threads)"
    )
