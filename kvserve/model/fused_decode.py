"""The fused decode step: every decoder layer of a decode step in one native call, for a few rows.

At batch 1 a step is ~10 dispatched calls per layer, and their Python and dispatch cost as much as the
arithmetic (docs/performance.md, "The fused decode step"). `FusedDecoder` describes the model's weights
and KV tensors once, as C structs (csrc/decode_step.c), and runs a step of up to `max_rows()`
single-token rows (`max_step_rows()`) with one ctypes call from the token ids and positions (the RoPE
rows, and the embedding rows where C can read the table, are looked up in C too): the GEMVs (on the panel-interleaved fp32 or quantised
layouts of csrc/decode_step.h, built once at load) split columns over the threads, the small ops and the paged attention
are the same C functions the per-op path calls. `small_linear` runs one linear the same way, any number of rows (every fp32
`PackedLinear`: the LM head, prefill).

It applies when the C kernels are on (fp32 activations on CPU), every projection has a native layout
(`PackedLinear` with its fp32 panels, or `QuantLinear` on the panel layout), the KV cache is fp32 or
8-bit (int8 / fp8 codes with fp16 scales: the step writes them as kv_cache.quantise does, bit for
bit, and the attention reads them in place), there is no q/k norm, and the step is decode rows only;
anything else takes the per-op path.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kvserve.model import cpu_kernels

_PTR, _INT, _F32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_LIN_F32, _LIN_Q8, _LIN_Q4, _LIN_BF16, _LIN_BF16DOT = 0, 1, 2, 3, 4
FPANEL = 16  # output columns per panel of the fp32 layout (csrc/decode_step.h)
ISA_NAMES = {3: "avx512", 2: "avx2", 0: "scalar"}  # 3: AVX-512 F/BW/VL with VNNI


class _Linear(ctypes.Structure):
    _fields_ = [
        ("kind", _INT),
        ("n", _INT),
        ("k", _INT),
        ("kp", _INT),
        ("groups", _INT),
        ("bpg", _INT),
        ("act_mode", _INT),
        ("w", _PTR),
        ("scales", _PTR),
        ("zeros", _PTR),
        ("bias", _PTR),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _PTR),
        ("post_norm", _PTR),
        ("qkv", _Linear),
        ("o", _Linear),
        ("gate_up", _Linear),
        ("down", _Linear),
        ("k_cache", _PTR),
        ("v_cache", _PTR),
        ("k_scale", _PTR),
        ("v_scale", _PTR),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        ("num_layers", _INT),
        ("hidden", _INT),
        ("num_heads", _INT),
        ("num_kv_heads", _INT),
        ("head_dim", _INT),
        ("inter", _INT),
        ("block_size", _INT),
        ("eps", _F32),
        ("scale", _F32),
        ("layers", ctypes.POINTER(_Layer)),
        ("final_norm", _PTR),
        ("kv_kind", _INT),
        ("kv_lut", _PTR),
    ]


@functools.cache
def max_rows() -> int:
    """Rows the fused step and `small_linear` take (0 when the C kernels are not built here)."""
    library = cpu_kernels.load_kernel()
    return 0 if library is None else int(library.decode_max_rows())


def max_step_rows() -> int:
    """Rows a fused step may have (64 unless `set_f32_max_rows` lowered it), fp32 or quantised
    projections alike: the panel GEMVs reuse each weight panel for all rows (csrc/decode_step.c
    decode_step_max_rows). `max_rows()` (4) is the GEMVs' register tile."""
    library = cpu_kernels.load_kernel()
    return 0 if library is None else max(max_rows(), int(library.decode_f32_max_rows()))


def set_f32_max_rows(rows: int) -> None:
    """Cap the rows of a fused step, fp32 or quantised (1-64; benchmarks and tests compare 64 with 4,
    where larger batches take the per-op path, one panel GEMM per linear)."""
    cpu_kernels.load_kernel().decode_set_f32_max_rows(rows)


def isa() -> str:
    """The instruction set the fused kernels run on: "avx512", "avx2" or "scalar" ("unavailable": no
    build). Chosen at run time by what this CPU reports (csrc/decode_step.c decode_isa)."""
    library = cpu_kernels.load_kernel()
    return "unavailable" if library is None else ISA_NAMES[int(library.decode_isa())]


def available_isas() -> list[str]:
    """The instruction sets this CPU and build can run, best first (each lower one is a fallback that
    tests force with `set_max_isa`): e.g. ["avx512", "avx2", "scalar"]; [] without the library."""
    library = cpu_kernels.load_kernel()
    if library is None:
        return []
    best = int(library.decode_cpu_isa())
    return [name for level, name in ISA_NAMES.items() if level <= best]


def set_max_isa(name: str) -> None:
    """Cap the fused kernels' instruction set ("avx512", "avx2" or "scalar"; a cap above what the CPU
    has runs the best it has): tests run the fallbacks this way."""
    level = {v: k for k, v in ISA_NAMES.items()}[name]
    cpu_kernels.load_kernel().decode_set_max_isa(level)


def reset_isa() -> None:
    """Lift the cap: the best instruction set this CPU has."""
    set_max_isa("avx512")


def set_pooled_step(enabled: bool) -> None:
    """Run a fused step's layers as the pooled step, in one OpenMP region whose thread pool stays up
    for the whole step (the default, any context), or fork and join per linear (the same arithmetic
    and bits; tests compare the two)."""
    cpu_kernels.load_kernel().decode_set_pooled_step(int(enabled))


def set_guided(enabled: bool) -> None:
    """In the pooled step, hand each linear's panels to the threads in shrinking chunks (the
    default) or give each thread a fixed share (the same bits; tests compare the two)."""
    cpu_kernels.load_kernel().decode_set_guided(int(enabled))


def pooled_steps() -> int:
    """Pooled steps (one region each) run so far in this process (tests check it is taken)."""
    return int(cpu_kernels.load_kernel().decode_pooled_steps())


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def linear_descriptor(module: torch.nn.Module, keep: list) -> _Linear | None:
    """The C description of a projection, or None when it has no native layout here. Tensors the
    description points to are appended to `keep` (the caller holds them). Each projection class
    describes itself (`native_descriptor`: linear.PackedLinear, qlinear.QuantLinear) through the
    two constructors below, so this module knows the C layouts and not the classes."""
    describe = getattr(module, "native_descriptor", None)
    return None if describe is None else describe(keep)


def panel_descriptor(
    panels: torch.Tensor, out_features: int, in_features: int, bias: torch.Tensor | None, keep: list
) -> _Linear:
    """A float projection on its panels: fp32 or bf16 [P, K, 16], or bf16 pairs [P, Kp / 2, 16, 2]
    (bf16 products, csrc/bf16dot.c)."""
    bias = None if bias is None else bias.float().contiguous()
    keep += [panels, bias]
    n, k = out_features, in_features
    if panels.dim() == 4:
        return _Linear(
            _LIN_BF16DOT,
            n,
            k,
            2 * panels.shape[1],
            1,
            1,
            0,
            panels.data_ptr(),
            None,
            None,
            _ptr(bias),
        )
    kind = _LIN_BF16 if panels.dtype == torch.bfloat16 else _LIN_F32
    return _Linear(kind, n, k, k, 1, 1, 0, panels.data_ptr(), None, None, _ptr(bias))


def quant_panel_descriptor(
    bits: int,
    out_features: int,
    in_features: int,
    w: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bias: torch.Tensor | None,
    bpg: int,
    act_mode: int,
    keep: list,
) -> _Linear:
    """An integer projection on its panels (csrc/decode_step.h): w [P, nb, 8, 8, 4] int8 |
    [P, nb, 4, 8, 4] uint8, scales [P, G, 8]."""
    keep += [w, scales, zeros, bias]
    return _Linear(
        _LIN_Q8 if bits == 8 else _LIN_Q4,
        out_features,
        in_features,
        w.shape[1] * 32,
        scales.shape[1],
        int(bpg),
        act_mode,
        w.data_ptr(),
        scales.data_ptr(),
        _ptr(zeros),
        _ptr(bias),
    )


def f32_panels(weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """weight [N, K] -> the fp32 panel layout [ceil(N / 16), K, 16] of csrc/decode_step.h: panel p,
    input k holds columns 16p .. 16p + 15 (one 64-byte line; padded columns are zeros). `dtype`
    bfloat16 stores the same layout in bf16 (`bf16_exact` weights only: the kernels widen each value
    back to the fp32 it was, so the product is the fp32 one, from half the bytes)."""
    n, k = weight.shape
    padded = torch.zeros(-(-n // FPANEL) * FPANEL, k, dtype=dtype)
    padded[:n] = weight.detach()
    return padded.view(-1, FPANEL, k).transpose(1, 2).contiguous()  # [P, K, 16]


def flush_subnormals(t: torch.Tensor) -> torch.Tensor:
    """fp32 subnormals to zero: vdpbf16ps reads bf16 subnormals as zero (csrc/bf16dot.c)."""
    return torch.where(t.abs() < torch.finfo(torch.float32).tiny, torch.zeros_like(t), t)


def bf16_pair_panels(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> the bf16 products' layout [ceil(N / 16), Kp / 2, 16, 2] of csrc/decode_step.h
    (K padded to an even Kp): panel p, pair j holds columns 16p .. 16p + 15 at inputs 2j, 2j + 1 (one
    64-byte line). The weights are rounded to bf16 (nearest, ties to even) and subnormals flushed to
    zero, as vdpbf16ps reads them (csrc/bf16dot.c)."""
    n, k = weight.shape
    w = flush_subnormals(weight.detach().float())
    padded = torch.zeros(-(-n // FPANEL) * FPANEL, k + k % 2, dtype=torch.bfloat16)
    padded[:n, :k] = w.to(torch.bfloat16)
    # [Np, Kp] -> [P, 16, Kp / 2, 2] -> [P, Kp / 2, 16, 2]
    return padded.view(-1, FPANEL, padded.shape[1] // 2, 2).transpose(1, 2).contiguous()


def bf16_insn() -> bool:
    """Whether the bf16 products run on vdpbf16ps here (AVX512_BF16); else the same arithmetic on
    fp32 multiply-adds (AVX-512 F) or the portable loops."""
    library = cpu_kernels.load_kernel()
    return library is not None and isa() == "avx512" and bool(library.decode_has_bf16_insn())


def set_bf16_insn(enabled: bool) -> None:
    """Use vdpbf16ps where the CPU has it (the default), or its emulation (tests compare the two)."""
    cpu_kernels.load_kernel().decode_set_bf16_insn(int(enabled))


def bf16_exact(weight: torch.Tensor) -> bool:
    """Whether every value of an fp32 `weight` is a bf16 value (a bf16 checkpoint upcast to fp32):
    then its panels are stored in bf16, losslessly. Checked in slices of rows (no full-size copy)."""
    rows = max(1, (1 << 22) // max(1, weight.shape[-1]))
    for part in weight.detach().split(rows):
        if not torch.equal(part.to(torch.bfloat16).float(), part):
            return False
    return True


def small_linear(desc: _Linear, x: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp32 -> [M, N] through the native panel GEMV / GEMM (any M, 0 included)."""
    x = x.contiguous()
    y = x.new_empty(x.shape[0], desc.n)
    if x.shape[0] == 0:
        return y
    status = cpu_kernels.load_kernel().small_linear(
        ctypes.byref(desc), x.data_ptr(), x.shape[0], y.data_ptr(), torch.get_num_threads()
    )
    if status != 0:
        raise RuntimeError(f"small_linear failed (status {status}) for {x.shape[0]} rows")
    return y


class FusedDecoder:
    """A DecoderLM's layers and KV tensors as C structs; `__call__` runs one decode step."""

    def __init__(self, model: torch.nn.Module, kv_caches: list, model_struct: _Model, keep: list):
        self.model_struct = model_struct
        self.keep = keep  # the tensors and structs the C side points to
        self.cache_key = _cache_key(kv_caches)
        self.caches = kv_caches  # the list matched last (matches: the same list object is enough)
        # the RoPE tables [max_positions, head_dim / 2] fp32, looked up by position in C
        self.cos = model.rotary.cos.float().contiguous()
        self.sin = model.rotary.sin.float().contiguous()
        self.num_steps = 0  # steps run here (tests check the fast path is taken)

    @classmethod
    def build(cls, model: torch.nn.Module, kv_caches: list) -> FusedDecoder | None:
        """None when some part of `model` has no native path (the per-op path runs it)."""
        cfg = model.config
        if not model.arch.fused_decode:  # the native step computes Llama's layer only
            return None
        if max_rows() == 0 or len(kv_caches) != len(model.layers):
            return None
        keep: list = []
        layers = (_Layer * len(model.layers))()
        kind = kv_caches[0].kind if kv_caches else "float"
        for i, (layer, cache) in enumerate(zip(model.layers, kv_caches, strict=True)):
            attn, mlp = layer.self_attn, layer.mlp
            if attn.q_norm is not None or cache.kind != kind or kind not in cpu_kernels.KV_KINDS:
                return None
            if cache.k.dtype != (torch.float32 if kind == "float" else torch.uint8):
                return None
            descs = [
                linear_descriptor(m, keep)
                for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            ]
            norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            if any(d is None for d in descs) or any(w.dtype != torch.float32 for w in norms):
                return None
            norms = [w.detach().contiguous() for w in norms]
            scales = [cache.k_scale, cache.v_scale] if cache.quantised else []
            keep += norms + [cache.k, cache.v] + scales
            layers[i] = _Layer(
                norms[0].data_ptr(),
                norms[1].data_ptr(),
                *descs,
                cache.k.data_ptr(),
                cache.v.data_ptr(),
                *(t.data_ptr() for t in scales),
            )
        final_norm = model.norm.weight.detach().contiguous()
        block_size = kv_caches[0].k.shape[1]
        lut = None if kind == "float" else cpu_kernels.code_table(kind)
        struct = _Model(
            cfg.num_layers,
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.intermediate_size,
            block_size,
            cfg.rms_norm_eps,
            cfg.head_dim**-0.5,
            layers,
            final_norm.data_ptr(),
            cpu_kernels.KV_KINDS[kind],
            None if lut is None else lut.data_ptr(),
        )
        keep += [layers, final_norm, lut]
        return cls(model, kv_caches, struct, keep)

    def max_rows(self) -> int:
        """Rows this model's step takes (csrc/decode_step.c decode_step_max_rows)."""
        return int(cpu_kernels.load_kernel().decode_step_max_rows(ctypes.byref(self.model_struct)))

    def matches(self, kv_caches: list) -> bool:
        """Whether `kv_caches` are the caches this step was built on: the list it last matched (the
        runner passes one list every step; its LayerKVCache entries are frozen, and no code replaces
        them), else the same tensors."""
        if kv_caches is self.caches:
            return True
        if _cache_key(kv_caches) != self.cache_key:
            return False
        self.caches = kv_caches
        return True

    def __call__(
        self,
        input_ids: torch.Tensor,  # [M] int64
        positions: torch.Tensor,  # [M] int64
        embed: torch.nn.Module,  # the model's embedding (its table is read in C where it can be)
        slot_mapping: torch.Tensor,  # [M] int64
        block_table: torch.Tensor,  # [M, max_blocks] int32
        context_lens: torch.Tensor,  # [M] int32
    ) -> torch.Tensor:
        """-> [M, hidden_size]: the final norm of the residual stream after every layer. The
        embedding rows and the RoPE rows are looked up in C (csrc/decode_step.c
        decode_step_tokens), or the embedding by `embed` itself when C cannot read its table (a
        quantised table). An id outside the table is an IndexError either way."""
        lib = cpu_kernels.load_kernel()
        ids = input_ids.to(torch.int64).contiguous()
        positions = positions.to(torch.int64).contiguous()
        block_table, context_lens = cpu_kernels.table_args(block_table, context_lens)
        out = torch.empty(ids.shape[0], self.model_struct.hidden, dtype=torch.float32)
        step = getattr(lib, "decode_step_tokens", None)
        if step is None:  # a build of sources older than decode_step_tokens (ab_switch.py)
            out.copy_(embed(ids))
            cos, sin = self.cos[positions].contiguous(), self.sin[positions].contiguous()
            vocab, status = (
                0,
                lib.decode_layers(
                    ctypes.byref(self.model_struct),
                    out.data_ptr(),
                    out.shape[0],
                    cos.data_ptr(),
                    sin.data_ptr(),
                    slot_mapping.data_ptr(),
                    block_table.data_ptr(),
                    block_table.shape[1],
                    context_lens.data_ptr(),
                    torch.get_num_threads(),
                ),
            )
        else:
            kind, table, vocab = embedding_table(embed)
            if kind == 0:
                out.copy_(embed(ids))
            status = step(
                ctypes.byref(self.model_struct),
                ids.data_ptr(),
                positions.data_ptr(),
                out.shape[0],
                kind,
                0 if table is None else table.data_ptr(),
                vocab,
                self.cos.data_ptr(),
                self.sin.data_ptr(),
                self.cos.shape[0],
                out.data_ptr(),
                slot_mapping.data_ptr(),
                block_table.data_ptr(),
                block_table.shape[1],
                context_lens.data_ptr(),
                torch.get_num_threads(),
            )
        if status == -3:
            raise cpu_kernels.context_error(context_lens, block_table, self.model_struct.block_size)
        if status == -4:
            raise IndexError(f"token id out of range for an embedding of {vocab} rows")
        if status == -5:
            raise IndexError(f"position out of range for a RoPE table of {self.cos.shape[0]} rows")
        if status != 0:
            raise RuntimeError(f"fused decode step failed (status {status})")
        self.num_steps += 1
        return out


def embedding_table(embed: torch.nn.Module) -> tuple[int, torch.Tensor | None, int]:
    """(kind, table, rows) of an embedding for csrc/decode_step.c decode_step_tokens: 1 an fp32
    `nn.Embedding` table, 2 / 3 the fp32 / bf16 panels of a tied head (`native_table()`:
    linear.PanelEmbedding); 0 (no table) for any other module, which then looks its rows up itself."""
    native_table = getattr(embed, "native_table", None)
    if native_table is not None:
        panels, rows = native_table()
        kind = {torch.float32: 2, torch.bfloat16: 3}.get(panels.dtype, 0)
        if kind and panels.is_contiguous():
            return kind, panels, rows
    elif type(embed) is torch.nn.Embedding and embed.max_norm is None:
        weight = embed.weight
        if weight.dtype == torch.float32 and weight.is_contiguous() and weight.device.type == "cpu":
            return 1, weight, embed.num_embeddings
    return 0, None, 0


def _cache_key(kv_caches: list) -> tuple:
    return tuple((c.k.data_ptr(), c.v.data_ptr()) for c in kv_caches)
