"""Random paged-attention shapes: cpu kernel (both isas) vs float64 SDPA reference; bits equal across thread counts."""

import random
import sys

import torch
import torch.nn.functional as F

from kvserve.model import fused_decode
from kvserve.model.attention import build_attention_metadata, cpu_attention
from kvserve.model.kv_cache import allocate_layers

rng = random.Random(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
worst = 0.0
for trial in range(int(sys.argv[2]) if len(sys.argv) > 2 else 40):
    kvh = rng.choice([1, 2, 3, 4])
    g = rng.choice([1, 2, 3, 5, 8])
    d = rng.choice([8, 16, 24, 40, 64, 72, 128, 136, 256])
    bs = rng.choice([1, 3, 16, 32])
    batch = rng.choice([1, 1, 2, 5])
    contexts = [
        rng.choice([1, 2, 7, 8, 9, 255, 256, 257, 300, 513, rng.randint(1, 1500)])
        for _ in range(batch)
    ]
    nblocks = sum(-(-c // bs) for c in contexts) + 3
    _, (cache,) = allocate_layers(
        1, nblocks, bs, kvh, d, torch.float32, "auto", torch.device("cpu")
    )
    gen = torch.Generator().manual_seed(trial)
    blocks = torch.randperm(nblocks, generator=gen).tolist()
    chunks, ks, vs = [], [], []
    for c in contexts:
        ids, blocks = blocks[: -(-c // bs)], blocks[-(-c // bs) :]
        meta = build_attention_metadata([(0, c, ids)], bs, torch.device("cpu"))
        k, v = torch.randn(2, c, kvh, d, generator=gen)
        cache.write(k, v, meta.slot_mapping)
        ks.append(k)
        vs.append(v)
        chunks.append((c - 1, 1, ids))
    meta = build_attention_metadata(chunks, bs, torch.device("cpu"))
    q = torch.randn(batch, kvh * g, d, generator=gen)
    ref = torch.stack(
        [
            F.scaled_dot_product_attention(
                q[b : b + 1, :, None].double(),
                ks[b].double().transpose(0, 1)[None],
                vs[b].double().transpose(0, 1)[None],
                scale=d**-0.5,
                enable_gqa=True,
            )[0, :, 0]
            for b in range(batch)
        ]
    )
    for isa in ["avx2", "scalar"]:
        fused_decode.set_max_isa(isa)
        outs = []
        for nt in (1, 2, 3):
            torch.set_num_threads(nt)
            outs.append(cpu_attention(q, cache, meta, d**-0.5))
        for o in outs[1:]:
            assert torch.equal(o, outs[0]), (trial, isa, kvh, g, d, bs, contexts)
        err = (outs[0].double() - ref).abs().max().item()
        worst = max(worst, err)
        assert err < 2e-5, (trial, isa, kvh, g, d, bs, contexts, err)
fused_decode.set_max_isa("avx2")
print("ok, worst", worst)
