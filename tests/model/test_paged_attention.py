"""The in-place CPU decode kernel and the 8-bit KV caches: against the gathering torch backend, against a
full fp32 recompute, and the decode path's KV reads (no gather) and the cache's size at a fixed budget."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvserve import LLM
from kvserve.model import fused_decode
from kvserve.model.attention import build_attention_metadata, cpu_attention, torch_attention
from kvserve.model.cpu_kernels import kernel_available
from kvserve.model.kv_cache import allocate_layers, dequantise, quantise
from tests.oracle import assert_logits_close

# With a compiler on the machine the kernels must build: a build failure fails these tests.
needs_kernel = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler"
)
PROMPT = [(i * 37 + 11) % 250 + 3 for i in range(53)]
# Against an fp32 cache, measured on the tiny llama (logit std 0.79): int8 max 0.044 / mean 0.0055, fp8
# (3 mantissa bits: up to 6% per value) max 0.20 / mean 0.024. Tolerances: about 2x those.
KV_TOL = {"int8": (0.1, 0.012), "fp8": (0.4, 0.05)}  # (max, mean) |logit difference|


def _filled_cache(kind: str, contexts: list[int], block_size: int = 16, kv_heads: int = 3,
                  head_dim: int = 64, num_blocks: int = 200, seed: int = 0, written=None):  # fmt: skip
    """A cache with random K/V for requests of `contexts` tokens on shuffled blocks, and the decode
    metadata of each request's last token. `written`, a list: each request's (k, v) appended."""
    gen = torch.Generator().manual_seed(seed)
    _, layers = allocate_layers(1, num_blocks, block_size, kv_heads, head_dim, torch.float32, kind,
                                torch.device("cpu"))  # fmt: skip
    cache = layers[0]
    blocks = torch.randperm(num_blocks, generator=gen).tolist()
    chunks = []
    for context in contexts:
        ids, blocks = blocks[: -(-context // block_size)], blocks[-(-context // block_size) :]
        meta = build_attention_metadata([(0, context, ids)], block_size, torch.device("cpu"))
        k, v = torch.randn(2, context, kv_heads, head_dim, generator=gen)
        cache.write(k, v, meta.slot_mapping)
        if written is not None:
            written.append((k, v))
        chunks.append((context - 1, 1, ids))
    return cache, build_attention_metadata(chunks, block_size, torch.device("cpu"))


@needs_kernel
@pytest.mark.parametrize("isa", ["avx512", "avx2", "scalar"])
@pytest.mark.parametrize("kind", ["auto", "int8", "fp8"])
def test_cpu_kernel_equals_torch_backend(kind, isa):
    """Both kernels (the AVX2 one with its vector exp, an 8-bit cache's rows dequantised first; the
    portable loops) chosen at run time by decode_isa()."""
    assert kernel_available()
    if isa not in fused_decode.available_isas():
        pytest.skip(f"this CPU (or build) has no {isa}")
    fused_decode.set_max_isa(isa)
    try:
        _kernel_equals_torch_backend(kind)
    finally:
        fused_decode.reset_isa()


def _kernel_equals_torch_backend(kind):
    # One-token, block-straddling, multi-split (> 256 tokens) contexts, GQA 9 q heads over 3 kv heads.
    cache, meta = _filled_cache(kind, [1, 17, 300, 700, 40])
    q = torch.randn(5, 9, 64, generator=torch.Generator().manual_seed(1))
    expected = torch_attention(q, cache, meta, 0.125)
    torch.testing.assert_close(cpu_attention(q, cache, meta, 0.125), expected, atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("isa", ["avx512", "avx2", "scalar"])
def test_a_nan_in_the_cache_or_query_reaches_the_output_as_in_torch(isa):
    """A NaN score must not be hidden (the AVX2 max once returned its finite operand): the row whose
    cache or query holds a NaN comes out NaN in every kernel, as torch's softmax gives; the others
    stay finite. Contexts of one split and of several (the merge)."""
    if isa not in fused_decode.available_isas():
        pytest.skip(f"this CPU (or build) has no {isa}")
    cache, meta = _filled_cache("auto", [40, 600, 40])
    q = torch.randn(3, 9, 64, generator=torch.Generator().manual_seed(2))
    q[2, 0, 5] = float("nan")  # row 2: query head 0 (kv head 0)
    table = meta.single.block_table
    cache.k[table[0, 1], 3, 0, 7] = float("nan")  # row 0, position 19, kv head 0
    cache.k[table[1, 30], 9, 1, 0] = float("nan")  # row 1, position 489 (a later split), kv head 1
    fused_decode.set_max_isa(isa)
    try:
        out = cpu_attention(q, cache, meta, 0.125)  # [3, 9, 64]
    finally:
        fused_decode.reset_isa()
    expected = torch_attention(q, cache, meta, 0.125)
    assert torch.equal(out.isnan(), expected.isnan())
    assert out.isnan().flatten(1).any(dim=-1).tolist() == [True, True, True]


@needs_kernel
@pytest.mark.parametrize("isa", ["avx512", "avx2", "scalar"])
@pytest.mark.parametrize("kind", ["auto", "int8", "fp8"])
def test_the_cut_into_items_does_not_change_the_bits(isa, kind):
    """The thread count picks the cut (all kv heads per item; one kv head; q-head chunks of one): a
    row's numbers must not depend on it (an 8-bit item dequantises only its own kv heads' rows)."""
    if isa not in fused_decode.available_isas():
        pytest.skip(f"this CPU (or build) has no {isa}")
    cache, meta = _filled_cache(kind, [600])
    q = torch.randn(1, 9, 64, generator=torch.Generator().manual_seed(3))
    threads = torch.get_num_threads()
    fused_decode.set_max_isa(isa)
    try:
        outs = []
        for num_threads in (1, 2, 8):  # 3 items of 9 heads; 9 of 3; 27 of 1
            torch.set_num_threads(num_threads)
            outs.append(cpu_attention(q, cache, meta, 0.125))
    finally:
        torch.set_num_threads(threads)
        fused_decode.reset_isa()
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    torch.testing.assert_close(
        outs[0], torch_attention(q, cache, meta, 0.125), atol=1e-5, rtol=1e-5
    )


@needs_kernel
@pytest.mark.parametrize("isa", ["avx2", "scalar"])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 6, 7, 8, 12])
def test_every_q_heads_per_kv_head_against_float64(isa, group):
    """The AVX2 scores take a position's row once for all q heads of each kv head, with code built for
    1-8 q heads per kv head (more: a q head at a time). Each group size, head dims 8 and 72, a tail
    group of positions and several splits, against a float64 SDPA; and the bits do not depend on the
    cut into items. 2 kv heads: 1, 4 and 8 threads cut whole rows (read in row order), one kv head,
    and q-head chunks of one kv head (a q head at a time). 1 kv head: every item is whole rows, the
    chunks starting past the first q head."""
    if isa not in fused_decode.available_isas():
        pytest.skip(f"this CPU (or build) has no {isa}")
    contexts = [13, 517]
    for kv_heads, head_dim in ((2, 8), (2, 72), (1, 72)):
        written: list = []
        cache, meta = _filled_cache("auto", contexts, kv_heads=kv_heads, head_dim=head_dim,
                                    num_blocks=37, seed=100 * group + 10 * kv_heads + head_dim,
                                    written=written)  # fmt: skip
        gen = torch.Generator().manual_seed(group)
        q = torch.randn(len(contexts), kv_heads * group, head_dim, generator=gen)
        expected = torch.stack([
            torch.nn.functional.scaled_dot_product_attention(
                q[b : b + 1, :, None].double(), k.double().transpose(0, 1)[None],
                v.double().transpose(0, 1)[None], scale=head_dim**-0.5, enable_gqa=True,
            )[0, :, 0]
            for b, (k, v) in enumerate(written)
        ])  # fmt: skip
        threads = torch.get_num_threads()
        fused_decode.set_max_isa(isa)
        try:
            outs = []
            for num_threads in (1, 4, 8):
                torch.set_num_threads(num_threads)
                outs.append(cpu_attention(q, cache, meta, head_dim**-0.5))
        finally:
            torch.set_num_threads(threads)
            fused_decode.reset_isa()
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
        torch.testing.assert_close(outs[0].double(), expected, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("kind", ["auto", "int8"])
def test_prompt_chunks_equal_the_masked_torch_backend(kind):
    """The cpu backend's prompt chunks (causal over the chunk, the cached prefix merged by logsumexp)
    against the torch backend's one masked SDPA: a chunk from position 0, one after a 300-token
    prefix, a one-token decode row beside them."""
    cache, decode = _filled_cache(kind, [340, 90, 20])
    ids = [row[:n] for row, n in zip(decode.single.block_table.tolist(), (22, 6, 2), strict=True)]
    meta = build_attention_metadata(
        [(300, 40, ids[0]), (0, 90, ids[1]), (19, 1, ids[2])], 16, torch.device("cpu")
    )
    q = torch.randn(131, 9, 64, generator=torch.Generator().manual_seed(4))
    expected = torch_attention(q, cache, meta, 0.125)
    torch.testing.assert_close(cpu_attention(q, cache, meta, 0.125), expected, atol=1e-5, rtol=1e-5)


@needs_kernel
def test_a_context_longer_than_its_block_table_row_is_refused():
    """The kernel would read past the row (the scheduler never builds one): a clear error instead."""
    cache, meta = _filled_cache("auto", [40])
    group = meta.single
    short = dataclasses.replace(
        group, block_table=group.block_table[:, :2]
    )  # 2 x 16 < 40 positions
    q = torch.randn(1, 9, 64)
    with pytest.raises(ValueError, match="exceeds the block table's 2 blocks x 16 positions"):
        cpu_attention(q, cache, dataclasses.replace(meta, single=short), 0.125)


@needs_kernel
def test_a_column_slice_of_a_wider_block_table_reads_each_rows_own_blocks():
    """The kernel steps rows by the table's width: a non-contiguous slice (rows 6 apart, 3 wide)
    read row 1 from row 0's tail before the wrapper made it contiguous."""
    from kvserve.model import cpu_kernels

    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 10, 16, 1, 16, generator=gen)  # [blocks, block, kv heads, head dim]
    full = torch.tensor([[1, 2, 7, 8, 9, 0], [3, 4, 5, 6, 0, 0]], dtype=torch.int32)
    context = torch.tensor([40, 40], dtype=torch.int32)
    q = torch.randn(2, 2, 16, generator=gen)
    sliced, packed = torch.empty(2, 2, 16), torch.empty(2, 2, 16)
    cpu_kernels.paged_decode(q, k, v, None, None, "float", full[:, :3], context, 0.25, sliced)
    cpu_kernels.paged_decode(
        q, k, v, None, None, "float", full[:, :3].clone(), context, 0.25, packed
    )
    assert torch.equal(sliced, packed)
    with pytest.raises(TypeError, match="int32"):
        cpu_kernels.paged_decode(q, k, v, None, None, "float", full.long(), context, 0.25, packed)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantise_round_trip(kind):
    values = torch.randn(7, 3, 64) * torch.tensor([1e-3, 1.0, 50.0])[None, :, None]
    codes, scales = quantise(values, kind)
    assert codes.dtype == torch.uint8 and scales.shape == (7, 3)
    restored = dequantise(codes, scales, kind, torch.float32)
    # Error per value is bounded by half a code step (int8) or 2^-4 of the value's magnitude (e4m3).
    amax = values.abs().amax(-1, keepdim=True)
    bound = amax / 127 * 0.51 if kind == "int8" else values.abs() / 16 + amax / 448 * 2**-9
    assert ((restored - values).abs() <= bound * 1.01 + 1e-7).all()


class _CacheGathers(TorchDispatchMode):
    """Counts index/index_select ops whose source is one of the KV cache's backing tensors."""

    def __init__(self, cache_tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self.storages = {t.untyped_storage().data_ptr() for t in cache_tensors}
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        gathers = (torch.ops.aten.index.Tensor, torch.ops.aten.index_select.default)
        if func in gathers and args[0].untyped_storage().data_ptr() in self.storages:
            self.count += 1
        return func(*args, **(kwargs or {}))


@needs_kernel
@pytest.mark.parametrize("backend,expect_gathers", [("cpu", False), ("torch", True)])
def test_decode_step_reads_the_cache_in_place(llama_dir, backend, expect_gathers):
    """The cpu backend's decode step reads no KV through a gather; the torch backend (the test of the
    test) gathers every layer's keys and values."""
    from kvserve import SamplingParams

    llm = LLM(str(llama_dir), num_blocks=64, attention_backend=backend)
    engine = llm.engine
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    engine.step()  # the prompt
    mode = _CacheGathers(engine.runner.kv_tensors)
    with mode:
        engine.step()  # one decode step
    num_layers = engine.config.model.num_layers
    assert mode.count == (2 * num_layers if expect_gathers else 0)


@needs_kernel
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_quantised_cache_decode_close_to_fp32_recompute(llama_dir, kind):
    reference = LLM(str(llama_dir), num_blocks=64).engine.score(PROMPT)  # fp32 cache, one pass
    max_tol, mean_tol = KV_TOL[kind]
    for backend in ("cpu", "torch"):
        engine = LLM(str(llama_dir), num_blocks=64, kv_cache_dtype=kind, attention_backend=backend)
        cached = engine.engine.score(PROMPT, chunk_size=1)  # every token reads the 8-bit cache
        assert_logits_close(cached, reference, max_tol, f"{kind} cache ({backend})")
        assert (cached - reference).abs().mean() < mean_tol
        assert not torch.allclose(cached, reference, atol=1e-3)  # it really is quantised
        # The cached path equals a recompute through the same 8-bit cache (one pass) to fp32 rounding.
        assert_logits_close(cached, engine.engine.score(PROMPT), 1e-4, f"{kind} cached vs one pass")


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_block_count_at_fixed_budget(checkpoints, kind):
    """At one memory budget an 8-bit cache holds 4 head_dim / (head_dim + 2) times the fp32 blocks
    (codes plus one fp16 scale per token and head), and the tensors allocated take that budget."""
    model_dir, hf_model = checkpoints["qwen3"]  # head_dim 32
    cfg = hf_model.config
    head_dim = cfg.head_dim
    budget = 4 * 1024**2
    fp32 = LLM(str(model_dir), kv_cache_memory_bytes=budget).engine
    quant = LLM(str(model_dir), kv_cache_memory_bytes=budget, kv_cache_dtype=kind).engine
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (head_dim + 2)
    assert quant.runner.kv_bytes_per_token == per_token == quant.config.kv_bytes_per_token
    assert quant.num_blocks == budget // (per_token * 16)
    assert quant.runner.kv_cache_bytes <= budget
    assert quant.num_blocks / fp32.num_blocks == pytest.approx(4 * head_dim / (head_dim + 2), 0.01)


def test_unknown_kv_cache_dtype_is_refused(llama_dir):
    from kvserve.core.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="kv_cache_dtype"):
        LLM(str(llama_dir), num_blocks=8, kv_cache_dtype="int4")
