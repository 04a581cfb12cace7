"""Gemma 3 (`gemma3_text`) against transformers, and sliding-window attention in every backend.

The tiny checkpoint (tests/checkpoints.py SEPARATE_ARCHS) has 6 layers, sliding, sliding, global twice,
a window of 12 keys, and every Gemma element whose config value differs from a default (attention
scale, local and scaled global RoPE, final softcap, randomised offset norms). Prompts run past the
window, so a window off by one key, a wrong RoPE base or a norm without its offset moves the logits.

Tolerance: fp32 logits within 1e-4 of transformers' fp32 logits (measured: 4e-6 on the C-kernel path,
0 on the torch path, logit magnitude up to ~4), as the other architectures' equivalence tests.
"""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import ModelConfig
from kvserve.core.errors import UnsupportedModelError
from kvserve.model import fused_decode
from kvserve.model.attention import build_attention_metadata, cpu_attention, torch_attention
from kvserve.model.kv_cache import allocate_layers
from tests.checkpoints import SEPARATE_ARCHS, build_checkpoint
from tests.oracle import assert_logits_close, assert_same_tokens

TOL = 1e-4
WINDOW = SEPARATE_ARCHS["gemma3"][2]["sliding_window"]  # 12
PROMPT = [(i * 37 + 11) % 500 + 3 for i in range(53)]  # 53 tokens: over 4 windows, 3 blocks of 16
BACKENDS = ("cpu", "torch")
needs_kernel = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler"
)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """(model dir, transformers model)."""
    path = tmp_path_factory.mktemp("gemma3")
    return path, build_checkpoint(path, "gemma3", vocab_size=512)


def _hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0]  # [T, vocab]


def _hf_greedy(hf_model, prompt: list[int], num_tokens: int) -> list[int]:
    hf_model.generation_config.eos_token_id = None
    hf_model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=num_tokens, do_sample=False, min_new_tokens=0
        )
    return out[0, len(prompt) :].tolist()


# --- the whole model against transformers ---------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", [4, 16])
def test_prompt_logits_match_transformers(gemma, backend, block_size):
    """One pass over a prompt 4x the window; the window's 12 keys span 3-4 blocks of 4, or part of
    one or two blocks of 16."""
    model_dir, hf_model = gemma
    llm = LLM(str(model_dir), num_blocks=64, block_size=block_size, attention_backend=backend)
    assert_logits_close(llm.engine.score(PROMPT), _hf_logits(hf_model, PROMPT), TOL, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunk_size", [None, 200])
def test_long_prompt_chunks_match_transformers(gemma, backend, chunk_size):
    """400 tokens, whole or in chunks of 200: chunks past forward.py's row-by-row bound, so the CPU
    backend attends them at once (the window's mask, after a cached prefix for the second chunk)
    rather than as decode rows."""
    from kvserve.runner.forward import attends_by_row

    model_dir, hf_model = gemma
    prompt = [(i * 53 + 7) % 500 + 3 for i in range(400)]
    assert not attends_by_row(0, 200) and not attends_by_row(200, 200)
    llm = LLM(str(model_dir), num_blocks=128, block_size=16, attention_backend=backend)
    actual = llm.engine.score(prompt, chunk_size=chunk_size)
    assert_logits_close(actual, _hf_logits(hf_model, prompt), TOL, f"{backend} chunk {chunk_size}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunk_size", [1, 7, 20])
def test_chunked_prefill_and_decode_rows_match_transformers(gemma, backend, chunk_size):
    """Chunks of 1 (every position a decode row: the C kernel's window), 7 (chunks whose queries
    see keys of earlier chunks through the window) and 20 (chunks longer than the window)."""
    model_dir, hf_model = gemma
    llm = LLM(str(model_dir), num_blocks=64, block_size=4, attention_backend=backend)
    actual = llm.engine.score(PROMPT, chunk_size=chunk_size)
    assert_logits_close(actual, _hf_logits(hf_model, PROMPT), TOL, f"{backend} chunk {chunk_size}")
    llm.engine.check_invariants()


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_decode_past_the_window_matches_transformers(gemma, backend):
    """40 tokens decoded from a 9-token prompt (transformers' own sliding cache as the oracle), and
    the decode path's logits over the whole sequence."""
    model_dir, hf_model = gemma
    prompt = PROMPT[:9]
    expected = _hf_greedy(hf_model, prompt, 40)
    llm = LLM(str(model_dir), num_blocks=64, block_size=4, attention_backend=backend)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    actual = llm.generate([prompt], params)[0].outputs[0].token_ids
    reference = _hf_logits(hf_model, prompt + expected)
    assert_same_tokens(actual, expected, reference[len(prompt) - 1 :], backend)
    decoded = llm.engine.score(prompt + expected, chunk_size=1)
    assert_logits_close(decoded, reference, TOL, f"{backend} decode rows")
    llm.engine.check_invariants()
    assert llm.engine.num_free_blocks() == llm.engine.num_blocks


@pytest.mark.parametrize("backend", BACKENDS)
def test_batched_requests_of_different_lengths_match_transformers(gemma, backend):
    """Requests of 3, 11, 12, 13 and 53 tokens (under, at and past the window) in one batch, under
    a token budget that chunks the long one beside the others' decode rows."""
    model_dir, hf_model = gemma
    prompts = [PROMPT[:3], PROMPT[5:16], PROMPT[1:13], PROMPT[20:33], PROMPT]
    llm = LLM(
        str(model_dir), num_blocks=128, block_size=4, attention_backend=backend,
        max_num_batched_tokens=24,
    )  # fmt: skip
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = _hf_greedy(hf_model, prompt, 24)
        reference = _hf_logits(hf_model, prompt + expected)[len(prompt) - 1 :]
        assert_same_tokens(
            output.outputs[0].token_ids, expected, reference, f"{backend}, {len(prompt)} tokens"
        )
    llm.engine.check_invariants()


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefix_cache_hit_on_a_prompt_past_the_window_equals_cold_run(gemma, backend):
    """53 tokens: a hit serves the first 48 from the cache; the 5 recomputed ones' window reaches
    back into the cached blocks. The top-20 logprobs of every step equal the cold run's, and
    transformers' log-softmax."""
    model_dir, hf_model = gemma
    llm = LLM(str(model_dir), num_blocks=64, block_size=16, attention_backend=backend)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=20)
    cold = llm.generate([PROMPT], params)[0]
    warm = llm.generate([PROMPT], params)[0]
    assert (cold.num_cached_tokens, warm.num_cached_tokens) == (0, 48)
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    reference = torch.log_softmax(
        _hf_logits(hf_model, PROMPT + cold.outputs[0].token_ids)[len(PROMPT) - 1 : -1], dim=-1
    )
    pairs = zip(cold.outputs[0].logprobs, warm.outputs[0].logprobs, strict=True)
    for step, (c, w) in enumerate(pairs):
        cold_top, warm_top = dict(c.top), dict(w.top)
        assert cold_top.keys() == warm_top.keys(), f"step {step}: top-20 tokens differ"
        ids = sorted(cold_top)
        cold_lp, warm_lp = (torch.tensor([top[t] for t in ids]) for top in (cold_top, warm_top))
        assert_logits_close(warm_lp, cold_lp, TOL, f"step {step}: prefix-cache hit")
        assert_logits_close(cold_lp, reference[step, ids], TOL, f"step {step}: transformers")
    llm.engine.check_invariants()


def test_speculative_decoding_reproduces_greedy(gemma):
    """Verification chunks of 5 tokens attend through the window like prompt chunks (n-gram
    proposals on a repetitive prompt; a draft model needs a tokenizer, which the tiny checkpoint
    lacks); both accepted and rejected proposals must occur."""
    model_dir, hf_model = gemma
    prompt = PROMPT[:10] * 3
    expected = _hf_greedy(hf_model, prompt, 40)
    llm = LLM(
        str(model_dir), num_blocks=64, block_size=4, speculative_method="ngram",
        num_speculative_tokens=4,
    )  # fmt: skip
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    actual = llm.generate([prompt], params)[0].outputs[0].token_ids
    reference = _hf_logits(hf_model, prompt + expected)[len(prompt) - 1 :]
    assert_same_tokens(actual, expected, reference, "speculative (n-gram)")
    stats = llm.engine.runner.spec_stats
    assert 0 < stats.num_accepted < stats.num_proposed, "both acceptance and rejection must occur"
    llm.engine.check_invariants()


def test_the_fused_llama_step_is_never_built_for_gemma(gemma):
    """csrc/decode_step.c computes Llama's layer: Gemma's decode rows run the per-op path."""
    model_dir, hf_model = gemma
    llm = LLM(str(model_dir), num_blocks=64, attention_backend="cpu")
    model = llm.engine.runner.model
    assert fused_decode.FusedDecoder.build(model, llm.engine.runner.kv_caches) is None
    llm.engine.score(PROMPT[:20], chunk_size=1)  # decode rows
    # never built: refused where the layout is one table, not tried where each group has its own
    assert model.fused is None
    assert not model.fused_decode or llm.engine.kv_manager.layout.hybrid


def test_tensor_parallel_gemma_is_refused_before_workers_start(gemma):
    with pytest.raises(UnsupportedModelError, match="gemma3_text.*tensor-parallel"):
        LLM(str(gemma[0]), num_blocks=16, tensor_parallel_size=2)


# --- config.json as transformers reads it ---------------------------------------------------------

# google/gemma-3-270m's config.json (transformers 4.x keys), with layer_types left to the pattern
GEMMA3_270M = {
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": None, "bos_token_id": 2, "eos_token_id": 1,
    "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 640, "intermediate_size": 2048, "max_position_embeddings": 32768,
    "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 18,
    "num_key_value_heads": 1, "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000.0, "rope_scaling": None, "rope_theta": 1000000.0,
    "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16",
    "vocab_size": 262144,
}  # fmt: skip


def _rope(params: dict) -> tuple[str, dict]:
    """(rope type, its other parameters) without theta."""
    rest = {k: v for k, v in params.items() if k not in ("rope_type", "rope_theta")}
    return params.get("rope_type", "default"), rest


@pytest.mark.parametrize(
    "overrides",
    [{}, {"rope_scaling": {"rope_type": "linear", "factor": 8.0}}, {"sliding_window_pattern": 3}],
    ids=["270m", "4b-rope-scaling", "pattern-3"],
)
def test_config_reads_what_transformers_reads(overrides):
    import transformers

    raw = GEMMA3_270M | overrides
    expected = transformers.Gemma3TextConfig(**raw)
    config = ModelConfig.from_dict(raw)
    assert list(config.layer_types) == expected.layer_types
    windows = [512 if kind == "sliding_attention" else None for kind in expected.layer_types]
    assert list(config.layer_windows) == windows
    assert not config.caps_context_at_window  # the window is masked, not the context capped
    global_rope = expected.rope_parameters["full_attention"]
    local_rope = expected.rope_parameters["sliding_attention"]
    assert config.rope_theta == global_rope["rope_theta"]
    assert config.rope_local_theta == local_rope["rope_theta"]
    assert _rope(config.rope_scaling_dict) == _rope(global_rope)
    # the scaling is the global layers' only
    assert _rope(dict(config.rope_local_scaling)) == _rope(local_rope) == ("default", {})
    assert config.attention_scale == expected.query_pre_attn_scalar**-0.5
    assert config.hidden_activation == expected.hidden_activation


def test_saved_config_round_trips(gemma):
    """The transformers-5 layout: rope_parameters per layer type."""
    config = ModelConfig.from_dir(gemma[0])
    hf = gemma[1].config
    assert list(config.layer_types) == hf.layer_types
    assert config.rope_theta == hf.rope_parameters["full_attention"]["rope_theta"] == 10000.0
    assert config.rope_local_theta == hf.rope_parameters["sliding_attention"]["rope_theta"] == 100
    assert config.rope_type == "linear" and config.rope_scaling_dict["factor"] == 2.0
    assert config.final_logit_softcapping == 20.0 and config.attention_scale == 24**-0.5


@pytest.mark.parametrize(
    "change, message",
    [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"sliding_window_pattern": None}, "layer_types"),
        ({"rope_local_base_freq": None}, "rope_local_theta"),
        ({"hidden_activation": "relu"}, "activation 'relu'"),
        ({"layer_types": ["linear_attention"] * 6}, "layer_types.*linear_attention"),
    ],
)
def test_what_kvserve_cannot_run_or_would_assume_is_refused(tmp_path, gemma, change, message):
    import json

    for item in gemma[0].iterdir():
        shutil.copy(item, tmp_path / item.name)
    raw = json.loads((tmp_path / "config.json").read_text())
    if "sliding_window_pattern" in change:
        raw.pop("layer_types")
        raw.pop("sliding_window_pattern", None)
    if "rope_local_base_freq" in change:
        raw["rope_parameters"].pop("sliding_attention")
    raw.update({k: v for k, v in change.items() if v is not None})
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedModelError, match=message):
        LLM(str(tmp_path), num_blocks=8)


# --- the kernels: only the window is read -----------------------------------------------------------


def _windowed_reference(q, keys, values, positions, window, scale):
    """q: [H, D] at each of `positions`; keys, values: [ctx, KVH, D]: softmax over p - W + 1 .. p."""
    outs = []
    group = q.shape[1] // keys.shape[1]
    for row, p in enumerate(positions):
        lo = max(0, p - window + 1)
        k = keys[lo : p + 1].repeat_interleave(group, dim=1)  # [n, H, D]
        v = values[lo : p + 1].repeat_interleave(group, dim=1)
        weights = torch.softmax(torch.einsum("hd,nhd->hn", q[row], k) * scale, dim=-1)
        outs.append(torch.einsum("hn,nhd->hd", weights, v))
    return torch.stack(outs)


def _poisoned_cache(contexts, window, block_size, num_new=None, seed=0):
    """Random K/V for requests of `contexts` tokens on shuffled blocks, every block wholly before
    the window of a request's first query set to NaN: a read of one makes its row NaN (a masked
    read too: SDPA's masked NaN score stays NaN)."""
    gen = torch.Generator().manual_seed(seed)
    kv_heads, head_dim, num_blocks = 2, 32, 512
    _, layers = allocate_layers(1, num_blocks, block_size, kv_heads, head_dim, torch.float32,
                                "auto", torch.device("cpu"))  # fmt: skip
    cache = layers[0]
    # block 0 pads the tables of short rows (read and masked by the torch backend): kept finite
    cache.k[0] = cache.v[0] = 0.0
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    chunks, written = [], []
    for context, new in zip(contexts, num_new or [1] * len(contexts), strict=True):
        count = -(-context // block_size)
        ids, free = free[:count], free[count:]
        meta = build_attention_metadata([(0, context, ids)], block_size, torch.device("cpu"))
        k, v = torch.randn(2, context, kv_heads, head_dim, generator=gen)
        cache.write(k, v, meta.slot_mapping)
        first_seen = max(0, context - new - window + 1)
        for b in ids[: first_seen // block_size]:
            cache.k[b] = cache.v[b] = float("nan")
        written.append((k, v))
        chunks.append((context - new, new, ids))
    return cache, build_attention_metadata(chunks, block_size, torch.device("cpu")), written


@needs_kernel
@pytest.mark.parametrize("isa", ["avx2", "scalar"])
@pytest.mark.parametrize("window", [1, 5, 12, 300])
def test_decode_rows_read_only_their_window(isa, window):
    """The C kernel (AVX2 and portable loops) and the torch backend, on contexts under, at and past
    the window, and past a 256-position split (window 300)."""
    if isa not in fused_decode.available_isas():
        pytest.skip(f"this CPU (or build) has no {isa}")
    contexts = [1, 5, 12, 13, 40, 299, 301, 700]
    cache, meta, written = _poisoned_cache(contexts, window, block_size=4)
    q = torch.randn(len(contexts), 4, 32, generator=torch.Generator().manual_seed(1))
    expected = torch.cat([
        _windowed_reference(q[i : i + 1], k, v, [c - 1], window, 0.2)
        for i, (c, (k, v)) in enumerate(zip(contexts, written, strict=True))
    ])  # fmt: skip
    fused_decode.set_max_isa(isa)
    try:
        actual = cpu_attention(q, cache, meta, 0.2, window)
    finally:
        fused_decode.reset_isa()
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch_attention(q, cache, meta, 0.2, window), expected)


@pytest.mark.parametrize("backend", [cpu_attention, torch_attention], ids=["cpu", "torch"])
@pytest.mark.parametrize("window", [3, 12, 64])
def test_prompt_chunks_read_only_their_window(backend, window):
    """Chunks after a cached prefix (the prefill mask), longer and shorter than the window, beside
    a decode row."""
    contexts, num_new = [30, 70, 9, 50], [7, 30, 9, 1]
    cache, meta, written = _poisoned_cache(contexts, window, block_size=8, num_new=num_new)
    total = sum(num_new)
    q = torch.randn(total, 4, 32, generator=torch.Generator().manual_seed(2))
    expected, row = [], 0
    for context, new, (k, v) in zip(contexts, num_new, written, strict=True):
        positions = list(range(context - new, context))
        expected.append(_windowed_reference(q[row : row + new], k, v, positions, window, 0.3))
        row += new
    actual = backend(q, cache, meta, 0.3, window)
    assert not actual.isnan().any(), "a block outside the window was read"
    torch.testing.assert_close(actual, torch.cat(expected), atol=1e-5, rtol=1e-5)


def test_full_attention_layers_ignore_the_window_machinery():
    """window None gives the full context (a Llama layer's call is unchanged)."""
    cache, meta, written = _poisoned_cache([40], window=math.inf, block_size=4)
    q = torch.randn(1, 4, 32, generator=torch.Generator().manual_seed(3))
    expected = _windowed_reference(q, *written[0], [39], 10**6, 0.2)
    for backend in (cpu_attention, torch_attention):
        torch.testing.assert_close(backend(q, cache, meta, 0.2), expected, atol=1e-5, rtol=1e-5)
