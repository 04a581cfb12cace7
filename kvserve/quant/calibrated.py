"""Calibrated methods: GPTQ, AWQ, SmoothQuant, and the activation-outlier report (docs/quantization.md).

Calibration statistics come from the float model (transformers, the reference implementation) run
over the calibration tokens, with hooks on the block linears' inputs: the Hessian X^T X (GPTQ),
per-channel max |x| (SmoothQuant, outliers), mean |x|, a sample of rows and the Hessian's diagonal
blocks of each scale group (AWQ). One float pass keeps only what the method reads (`Stats`,
`_stats_needed`).
- SmoothQuant and AWQ: one pass of the float model (AutoAWQ also searches each layer on the float
  layer before it). AWQ searches each group's input scales, then each weight group's clipping range
  (`awq_clip`, every block linear but q/k, whose errors meet in the attention scores, as in AutoAWQ).
- GPTQ: layer by layer, as the GPTQ reference does (`sequential_gptq`): each linear's Hessian comes
  from the inputs it sees once every linear before it (earlier layers, and earlier projections of its
  own layer: q/k/v, then o, then gate/up, then down) holds its quantised weights. On the demo target
  it measured the same as one float pass (int4-g32 KL 0.00143 both); it holds one group's Hessian at
  a time (every linear's whole Hessian would be ~57 GB of float64 for a 7B Llama).

Scales that move range between a linear's input and its weight are folded where that is exact:
into the preceding RMSNorm for q/k/v and gate/up, into up_proj's rows for down_proj
(down(silu(g) * u) with u scaled by 1/s and down's columns by s is the same function).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from kvserve.quant.methods import CALIB_TOKENS, check_method, read_calibration
from kvserve.quant.rtn import QuantizedTensor, quantize, quantize_with, scales_for
from kvserve.quant.scheme import TensorScheme, WeightScheme
from kvserve.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

_SAMPLE_ROWS = 512
# (input shared by, preceding op to fold 1/s into, how it folds)
_GROUPS = {
    "attn_in": (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "input_layernorm"),
    "mlp_in": (("mlp.gate_proj", "mlp.up_proj"), "post_attention_layernorm"),
    "down": (("mlp.down_proj",), "mlp.up_proj"),
}


class Stats:
    """Input statistics of one linear over the calibration tokens. `hessian`: 0 keeps the whole
    X^T X (GPTQ); g > 0 only its g x g blocks on the diagonal, one per scale group of g inputs
    (AWQ's clipping search reads no other entry); None none (SmoothQuant, the outlier report).
    `keep_rows`: keep a sample of input rows (AWQ's scale search). A 7B Llama's whole Hessians
    take ~57 GB of float64; AWQ at g128 keeps ~0.9 GB of blocks and ~1.3 GB of fp32 rows."""

    def __init__(self, num_cols: int, hessian: int | None = 0, keep_rows: bool = True) -> None:
        if hessian is not None and hessian < 0:
            raise ValueError(f"hessian must be None, 0 (whole) or a block size > 0, got {hessian}")
        self.num_cols, self.block, self.keep_rows = num_cols, hessian, keep_rows
        shape: tuple[int, ...] = (0,)
        if hessian is not None and (hessian == 0 or hessian >= num_cols):
            self.block, shape = 0, (num_cols, num_cols)
        elif hessian is not None:
            shape = (-(-num_cols // hessian), hessian, hessian)  # a short last block zero-padded
        self.hessian = torch.zeros(shape, dtype=torch.float64)
        self.absmax = torch.zeros(num_cols)
        self.abssum = torch.zeros(num_cols, dtype=torch.float64)
        self.rows: list[torch.Tensor] = []
        self.count = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()  # [T, K]
        if self.block == 0:
            self.hessian += x.double().t() @ x.double()
        elif self.block is not None:
            blocks, g = self.hessian.shape[0], self.block
            xb = torch.nn.functional.pad(x.double(), (0, blocks * g - self.num_cols))
            xb = xb.view(-1, blocks, g).transpose(0, 1)  # [blocks, T, g]
            self.hessian += xb.transpose(1, 2) @ xb
        self.absmax = torch.maximum(self.absmax, x.abs().amax(0))
        self.abssum += x.abs().sum(0).double()
        self.count += x.shape[0]
        kept = sum(r.shape[0] for r in self.rows)
        if self.keep_rows and kept < _SAMPLE_ROWS:
            self.rows.append(x[: _SAMPLE_ROWS - kept].clone())

    @property
    def sample(self) -> torch.Tensor:
        if not self.rows:
            raise ValueError("these statistics kept no input rows (keep_rows=False)")
        return torch.cat(self.rows)


def collect_stats(
    model_dir: Path,
    token_ids: list[int],
    chunk: int = 256,
    needs: Callable[[str, int], tuple[int | None, bool]] | None = None,
) -> dict[str, Stats]:
    """Input statistics of every block linear (HF module name -> Stats) over the calibration ids.
    `needs(name, in_features)` gives each one's (`hessian`, `keep_rows`) (Stats); default all."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    stats: dict[str, Stats] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in name:
            hessian, keep_rows = needs(name, module.in_features) if needs else (0, True)
            stats[name] = Stats(module.in_features, hessian, keep_rows)
            hooks.append(module.register_forward_hook(lambda m, a, o, n=name: stats[n].add(a[0])))
    from kvserve.progress import progress

    starts = range(0, len(token_ids), chunk)
    with torch.no_grad():
        for start in progress(starts, len(starts), "calibrating"):
            model(torch.tensor([token_ids[start : start + chunk]]))
    for hook in hooks:
        hook.remove()
    return stats


class _Stop(Exception):
    """Raised by the hook that captures the first decoder layer's inputs (the rest is not run)."""


# the projections of one decoder layer in the order GPTQ quantises them; each tuple shares its input
_SEQUENTIAL = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)


def sequential_gptq(
    model_dir: Path,
    checkpoint: dict[str, torch.Tensor],
    formats: dict[str, TensorScheme],
    token_ids: list[int],
    chunk: int = 256,
) -> tuple[dict[str, QuantizedTensor], dict[str, Stats]]:
    """GPTQ layer by layer. `formats`: checkpoint weight name -> scheme for the linears to quantise.
    Returns (the block linears' codes, the input statistics each was quantised with, by module name).

    The float model's first decoder layer inputs are captured once per calibration chunk; then, per
    layer and per group of `_SEQUENTIAL`, the layer runs over every chunk with a hook on the group's
    (shared) input, the group's linears are quantised from those statistics, and their dequantised
    weights replace the float ones in the layer; the layer's output with all its linears quantised
    is the next layer's input. Only one group's Hessian is held at a time."""
    from transformers import AutoModelForCausalLM

    from kvserve.progress import progress

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    layers = model.model.layers
    captured: list[tuple[torch.Tensor, dict]] = []  # per chunk: (hidden [1, T, H], layer kwargs)

    def capture(module, args, kwargs):
        hidden = args[0] if args else kwargs.pop("hidden_states")
        captured.append((hidden, dict(kwargs)))
        raise _Stop

    hook = layers[0].register_forward_pre_hook(capture, with_kwargs=True)
    with torch.no_grad():
        for start in range(0, len(token_ids), chunk):
            try:
                model(torch.tensor([token_ids[start : start + chunk]]), use_cache=False)
            except _Stop:
                pass
    hook.remove()

    def run(layer) -> list[torch.Tensor]:
        outs = []
        for hidden, kwargs in captured:
            out = layer(hidden, **kwargs)
            outs.append(out[0] if isinstance(out, tuple) else out)
        return outs

    quantized: dict[str, QuantizedTensor] = {}
    all_stats: dict[str, Stats] = {}
    with torch.no_grad():
        for index in progress(range(len(layers)), len(layers), "GPTQ, layer by layer"):
            layer, prefix = layers[index], f"model.layers.{index}"
            for group in _SEQUENTIAL:
                names = [n for n in group if f"{prefix}.{n}.weight" in formats]
                if not names:
                    continue
                first = layer.get_submodule(names[0])
                stats = Stats(first.in_features, hessian=0, keep_rows=False)
                hook = first.register_forward_hook(lambda m, a, o, s=stats: s.add(a[0]))
                run(layer)
                hook.remove()
                for name in names:
                    key = f"{prefix}.{name}.weight"
                    quantized[key] = gptq(checkpoint[key], stats.hessian, formats[key])
                    module = layer.get_submodule(name)
                    module.weight.copy_(quantized[key].dequantize().to(module.weight.dtype))
                    all_stats[f"{prefix}.{name}"] = stats
                stats.hessian = stats.hessian.new_empty(0)  # used: one group's held at a time
            captured = [
                (out, kwargs) for out, (_, kwargs) in zip(run(layer), captured, strict=True)
            ]
    return quantized, all_stats


def outlier_report(stats: dict[str, Stats]) -> dict[str, float]:
    """Per layer and projection: max over median of the channels' max |x|."""
    return {
        name.removeprefix("model."): (s.absmax.max() / s.absmax.median().clamp(min=1e-12)).item()
        for name, s in stats.items()
    }


def _channel_scheme(scheme: TensorScheme) -> TensorScheme:
    return TensorScheme(scheme.name, scheme.bits, "channel", zero_point=scheme.zero_point)


def gptq(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    scheme: TensorScheme,
    damp: float = 0.01,
    block: int = 128,
) -> QuantizedTensor:
    """GPTQ (Frantar et al.): quantise columns in order, spreading each column's rounding error over
    the columns not yet quantised through the inverse Hessian's Cholesky factor; blocked updates;
    group scales computed from the error-updated weights when a group starts."""
    w = weight.double().clone()  # [N, K]
    num_rows, num_cols = w.shape
    h = hessian.double().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += damp * torch.diag(h).mean() * torch.eye(num_cols, dtype=h.dtype)
    h_inv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    group = scheme.group_len(num_cols)
    if scheme.granularity == "group" and block % group:
        block = group
    if scheme.granularity == "group":
        num_groups = -(-num_cols // group)
        scales = torch.zeros(num_rows, num_groups, dtype=torch.float16)
        zeros = torch.zeros_like(scales) if scheme.zero_point else None
    else:  # one scale per row or tensor, from the original weights
        scales, zeros = scales_for(weight, scheme)
    expand = QuantizedTensor(scheme, torch.empty(0, 0, dtype=torch.int8), scales, zeros)
    q_max = 2 ** (scheme.bits - 1) - 1
    out = torch.zeros_like(w)
    for i1 in range(0, num_cols, block):
        i2 = min(i1 + block, num_cols)
        w1, err1, hinv1 = w[:, i1:i2].clone(), torch.zeros_like(w[:, i1:i2]), h_inv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if scheme.granularity == "group" and col % group == 0:
                g = col // group
                s, z = scales_for(w1[:, i : i + group].float(), _channel_scheme(scheme))
                scales[:, g : g + 1] = s
                if zeros is not None:
                    zeros[:, g : g + 1] = z
            g = 0 if scheme.granularity != "group" else col // group
            s = scales[:, g].double() if scales.shape[0] > 1 else scales[0, 0].double()
            if zeros is None:
                deq = torch.round(w1[:, i] / s).clamp(-q_max, q_max) * s
            else:
                z = zeros[:, g].double() if zeros.shape[0] > 1 else zeros[0, 0].double()
                deq = (torch.round(w1[:, i] / s) + z).clamp(0, 2**scheme.bits - 1) - z
                deq = deq * s
            out[:, col] = deq
            err = (w1[:, i] - deq) / hinv1[i, i]
            w1[:, i:] -= err[:, None] * hinv1[i, i:][None, :]
            err1[:, i] = err
        w[:, i2:] -= err1 @ h_inv[i1:i2, i2:]
    del expand
    return quantize_with(out.float(), scheme, scales, zeros)


def awq_scales(
    weights: list[torch.Tensor], stats: Stats, scheme: TensorScheme, grid: int = 20
) -> tuple[torch.Tensor, float]:
    """AWQ (Lin et al.): per input channel s = mean|x|^alpha (normalised), alpha on a grid, chosen to
    minimise ||X W^T - X (Q(W diag s) diag s^-1)^T|| over the sampled rows for the weights sharing
    this input. Returns (s, alpha); alpha = 0 is plain RTN."""
    x = stats.sample  # [R, K]
    w = torch.cat(weights)  # [N, K]
    ref = x @ w.t()
    mean_abs = (stats.abssum / max(stats.count, 1)).float().clamp(min=1e-8)
    best = (None, 0.0, float("inf"))
    for step in range(grid + 1):
        alpha = step / grid
        s = mean_abs.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        w_hat = quantize(w * s, scheme).dequantize() / s
        loss = (ref - x @ w_hat.t()).pow(2).sum().item()
        if loss < best[2]:
            best = (s, alpha, loss)
    return best[0], best[1]


def awq_clip(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    scheme: TensorScheme,
    grid: int = 20,
    max_shrink: float = 0.5,
) -> torch.Tensor:
    """AWQ's clipping search (AutoAWQ `auto_clip`): per output row and scale group, clamp the weights
    to +-r max|w| for r on a grid from 1 down to 1 - max_shrink, keeping the r whose rounding error
    e (weights - their dequantised codes) gives the least e H e^T, H the block of the input Hessian
    X^T X (all calibration tokens) over the group's inputs. r = 1 is plain rounding, so no group's
    error grows. `weight` [N, K]; `hessian` [K, K], or its diagonal blocks [groups, g, g] (Stats with
    hessian=g); returns the clamped weights (a tensor-wide scale: unchanged)."""
    if scheme.granularity == "tensor":
        return weight
    num_rows, num_cols = weight.shape
    glen = scheme.group_len(num_cols)
    w = weight.double()
    best_w = w.clone()
    best_err = torch.full((num_rows, -(-num_cols // glen)), float("inf"), dtype=torch.float64)
    for step in range(grid + 1):
        ratio = 1.0 - max_shrink * step / grid
        clipped = torch.empty_like(w)
        for c0 in range(0, num_cols, glen):
            part = w[:, c0 : c0 + glen]
            bound = part.abs().amax(1, keepdim=True) * ratio
            clipped[:, c0 : c0 + glen] = torch.minimum(torch.maximum(part, -bound), bound)
        err = w - quantize(clipped.float(), scheme).dequantize().double()  # [N, K]
        for g, c0 in enumerate(range(0, num_cols, glen)):
            e = err[:, c0 : c0 + glen]
            h = hessian_block(hessian, c0, min(c0 + glen, num_cols)).double()
            group_err = ((e @ h) * e).sum(1)  # [N]
            better = group_err < best_err[:, g]
            best_err[:, g] = torch.where(better, group_err, best_err[:, g])
            best_w[better, c0 : c0 + glen] = clipped[better, c0 : c0 + glen]
    return best_w.to(weight.dtype)


def hessian_block(hessian: torch.Tensor, c0: int, c1: int) -> torch.Tensor:
    """Rows and columns [c0, c1) of X^T X from the whole matrix [K, K] or from its diagonal blocks
    [groups, g, g] (a range inside one block)."""
    if hessian.dim() == 2:
        return hessian[c0:c1, c0:c1]
    g = hessian.shape[1]
    if c0 % g or c1 - c0 > g:
        raise ValueError(f"columns [{c0}, {c1}) are not inside one {g}-column block")
    return hessian[c0 // g, : c1 - c0, : c1 - c0]


def divided_by_scales(hessian: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """X^T X of the input x / s: H / (s s^T), for the whole matrix or its diagonal blocks."""
    sd = s.double()
    if hessian.dim() == 2:
        return hessian / (sd[:, None] * sd[None, :])
    groups, g, _ = hessian.shape
    sd = torch.nn.functional.pad(sd, (0, groups * g - sd.numel()), value=1.0).view(groups, g)
    return hessian / (sd[:, :, None] * sd[:, None, :])


def smooth_scales(weights: list[torch.Tensor], stats: Stats, alpha: float) -> torch.Tensor:
    """SmoothQuant: s_j = max|X_j|^alpha / max|W_j|^(1 - alpha) over the weights sharing this input."""
    w_max = torch.cat(weights).abs().amax(0).clamp(min=1e-5)
    x_max = stats.absmax.clamp(min=1e-5)
    return (x_max.pow(alpha) / w_max.pow(1 - alpha)).clamp(min=1e-5)


def fold(checkpoint: dict[str, torch.Tensor], layer: str, group: str, s: torch.Tensor) -> None:
    """W[:, j] *= s_j for the group's linears; the preceding op's output channel j /= s_j."""
    linears, before = _GROUPS[group]
    for lin in linears:
        key = f"{layer}.{lin}.weight"
        checkpoint[key] = checkpoint[key] * s
    key = f"{layer}.{before}.weight"
    t = checkpoint[key]
    checkpoint[key] = t / s if t.dim() == 1 else t / s[:, None]  # norm vector, or up_proj rows


# the linears AWQ clips (not q/k, whose errors meet in the attention scores, as in AutoAWQ)
_AWQ_CLIPPED = (
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def _stats_needed(
    name: str, in_features: int, method: str, formats: dict[str, TensorScheme]
) -> tuple[int | None, bool]:
    """What one float pass keeps of a block linear's input (Stats' hessian, keep_rows): AWQ's
    clipping reads the g x g diagonal blocks of its scale groups, its scale search a sample of the
    rows of each input group's first linear; SmoothQuant and the outlier report read only the
    per-channel maxima."""
    if method != "awq":
        return None, False
    lin = name.partition(".layers.")[2].partition(".")[2]  # e.g. self_attn.v_proj
    fmt = formats.get(f"{name}.weight")
    clipped = lin in _AWQ_CLIPPED and fmt is not None and fmt.granularity != "tensor"
    first = any(lin == linears[0] for linears, _ in _GROUPS.values())
    return (fmt.group_len(in_features) if clipped else None), first


def calibrated_quantize(
    model_dir: Path,
    checkpoint: dict[str, torch.Tensor],
    scheme: WeightScheme,
    method: str,
    token_ids: list[int],
    alpha: float = 0.5,
    whole_groups: bool = True,
) -> tuple[dict[str, QuantizedTensor], dict[str, torch.Tensor], dict]:
    """Quantise `checkpoint`'s block linears by `method`; returns (quantized, the possibly rescaled
    float checkpoint, report extras). Other classes (the head) use RTN. `whole_groups=False`
    allows a short last scale group (quantised at load: no artifact has to hold it)."""
    from kvserve.progress import progress
    from kvserve.quant.convert import quantized_formats

    dtypes = {k: v.dtype for k, v in checkpoint.items()}
    checkpoint = {
        k: v.float() if v.is_floating_point() else v.clone() for k, v in checkpoint.items()
    }
    formats = quantized_formats(checkpoint, scheme, whole_groups)
    linear = scheme.for_class("linear")
    layers = sorted({n.rsplit(".", 3)[0] for n in formats if n.startswith("model.layers.")})
    if method == "gptq":
        blocks = {n: f for n, f in formats.items() if n.startswith("model.layers.")}
        quantized, stats = sequential_gptq(Path(model_dir), checkpoint, blocks, token_ids)
        # inputs as the quantised model's earlier linears produce them
        extra: dict = {"outliers": outlier_report(stats), "calibration_order": "layer by layer"}
    else:
        needs = functools.partial(_stats_needed, method=method, formats=formats)
        quantized, stats = {}, collect_stats(Path(model_dir), token_ids, needs=needs)
        extra = {"outliers": outlier_report(stats), "calibration_order": "one float pass"}
    if method in ("smoothquant", "awq"):
        chosen = {}
        for layer in layers:
            input_scales: dict[str, torch.Tensor] = {}
            for group, (linears, _) in _GROUPS.items():
                weights = [checkpoint[f"{layer}.{lin}.weight"] for lin in linears]
                st = stats[f"{layer}.{linears[0]}"]
                if method == "smoothquant":
                    s = smooth_scales(weights, st, alpha)
                else:
                    s, chosen[f"{layer}.{group}"] = awq_scales(weights, st, linear)
                fold(checkpoint, layer, group, s)
                for lin in linears:
                    input_scales[lin] = s
                if method == "smoothquant":
                    st.absmax = st.absmax / s  # the smoothed input's range, for the report
            if method == "awq":  # clip once every fold of the layer is in (down's moves up_proj)
                for lin in _AWQ_CLIPPED:
                    key = f"{layer}.{lin}.weight"
                    if key not in formats or formats[key].granularity == "tensor":
                        continue  # one scale for the whole tensor: nothing to clip per group
                    h = stats[f"{layer}.{lin}"].hessian
                    if lin in input_scales:  # the input is x / s
                        h = divided_by_scales(h, input_scales[lin])
                    checkpoint[key] = awq_clip(checkpoint[key], h, formats[key])
        if method == "awq":
            extra["awq_alpha"] = chosen
        else:
            extra["smoothquant_alpha"] = alpha
            extra["outliers_after"] = outlier_report(stats)
    rest = {n: f for n, f in formats.items() if n not in quantized}  # GPTQ: the head (RTN)
    for name, fmt in progress(rest.items(), len(rest), f"quantising ({method})"):
        quantized[name] = quantize(checkpoint[name], fmt)
    # tensors left in float go back to the checkpoint's dtype (bf16 norms: the fold then rounds)
    checkpoint = {k: v.to(dtypes[k]) for k, v in checkpoint.items()}
    return quantized, checkpoint, extra


def calibrated_at_load(
    model_dir: Path,
    checkpoint: dict,
    scheme: WeightScheme,
    method: str,
    calib: str | None,
) -> tuple[dict, dict]:
    """For the loader (`--quantization FMT --quantization-method M --calib FILE`): the block
    linears of `scheme` quantised by `method` on the first CALIB_TOKENS tokens of `calib`, as
    `kvserve quantize` takes them, a row's last scale group short where the group does not divide
    it. Returns ({HF weight name: QuantizedTensor}, the float checkpoint, rescaled where the
    method folds scales into the preceding norm); the head and the table are left to the loader's
    round to nearest."""
    check_method(scheme, method)
    ids = read_calibration(calib, method, load_tokenizer(model_dir), CALIB_TOKENS)
    blocks = replace(scheme, embed=None, head=None)
    quantized, checkpoint, _ = calibrated_quantize(
        model_dir, checkpoint, blocks, method, ids, whole_groups=False
    )
    logger.info(
        "quantization %s: %s on %d calibration tokens at load", scheme.name, method, len(ids)
    )
    return quantized, checkpoint
