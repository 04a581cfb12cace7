"""Calibrated methods: GPTQ, AWQ, SmoothQuant, and the activation-outlier report (docs/quantization.md).

Calibration statistics come from one pass of the float model (transformers, the reference
implementation) over the calibration tokens, with hooks on every block linear's input: the Hessian
X^T X (GPTQ), per-channel max |x| (SmoothQuant, outliers), mean |x| and a sample of rows (AWQ). All
layers are calibrated on float activations (one pass, not layer by layer).

Scales that move range between a linear's input and its weight are folded where that is exact:
into the preceding RMSNorm for q/k/v and gate/up, into up_proj's rows for down_proj
(down(silu(g) * u) with u scaled by 1/s and down's columns by s is the same function).
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvserve.quant.rtn import QuantizedTensor, quantize, quantize_with, scales_for
from kvserve.quant.scheme import TensorScheme, WeightScheme

_SAMPLE_ROWS = 512
# (input shared by, preceding op to fold 1/s into, how it folds)
_GROUPS = {
    "attn_in": (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "input_layernorm"),
    "mlp_in": (("mlp.gate_proj", "mlp.up_proj"), "post_attention_layernorm"),
    "down": (("mlp.down_proj",), "mlp.up_proj"),
}


class Stats:
    def __init__(self, num_cols: int) -> None:
        self.hessian = torch.zeros(num_cols, num_cols, dtype=torch.float64)
        self.absmax = torch.zeros(num_cols)
        self.abssum = torch.zeros(num_cols, dtype=torch.float64)
        self.rows: list[torch.Tensor] = []
        self.count = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()  # [T, K]
        self.hessian += x.double().t() @ x.double()
        self.absmax = torch.maximum(self.absmax, x.abs().amax(0))
        self.abssum += x.abs().sum(0).double()
        self.count += x.shape[0]
        kept = sum(r.shape[0] for r in self.rows)
        if kept < _SAMPLE_ROWS:
            self.rows.append(x[: _SAMPLE_ROWS - kept].clone())

    @property
    def sample(self) -> torch.Tensor:
        return torch.cat(self.rows)


def collect_stats(model_dir: Path, token_ids: list[int], chunk: int = 256) -> dict[str, Stats]:
    """Input statistics of every block linear (HF module name -> Stats) over the calibration ids."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    stats: dict[str, Stats] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in name:
            stats[name] = Stats(module.in_features)
            hooks.append(module.register_forward_hook(lambda m, a, o, n=name: stats[n].add(a[0])))
    from kvserve.progress import progress

    starts = range(0, len(token_ids), chunk)
    with torch.no_grad():
        for start in progress(starts, len(starts), "calibrating"):
            model(torch.tensor([token_ids[start : start + chunk]]))
    for hook in hooks:
        hook.remove()
    return stats


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


def calibrated_quantize(
    model_dir: Path,
    checkpoint: dict[str, torch.Tensor],
    scheme: WeightScheme,
    method: str,
    token_ids: list[int],
    alpha: float = 0.5,
) -> tuple[dict[str, QuantizedTensor], dict[str, torch.Tensor], dict]:
    """Quantise `checkpoint`'s block linears by `method`; returns (quantized, the possibly rescaled
    float checkpoint, report extras). Other classes (the head) use RTN."""
    from kvserve.progress import progress
    from kvserve.quant.convert import quantized_formats

    stats = collect_stats(Path(model_dir), token_ids)
    dtypes = {k: v.dtype for k, v in checkpoint.items()}
    checkpoint = {
        k: v.float() if v.is_floating_point() else v.clone() for k, v in checkpoint.items()
    }
    formats = quantized_formats(checkpoint, scheme)
    linear = scheme.for_class("linear")
    layers = sorted({n.rsplit(".", 3)[0] for n in formats if n.startswith("model.layers.")})
    extra: dict = {"outliers": outlier_report(stats)}
    if method in ("smoothquant", "awq"):
        chosen = {}
        for layer in layers:
            for group, (linears, _) in _GROUPS.items():
                weights = [checkpoint[f"{layer}.{lin}.weight"] for lin in linears]
                st = stats[f"{layer}.{linears[0]}"]
                if method == "smoothquant":
                    s = smooth_scales(weights, st, alpha)
                else:
                    s, chosen[f"{layer}.{group}"] = awq_scales(weights, st, linear)
                fold(checkpoint, layer, group, s)
                if method == "smoothquant":
                    st.absmax = st.absmax / s  # the smoothed input's range, for the report
        if method == "awq":
            extra["awq_alpha"] = chosen
        else:
            extra["smoothquant_alpha"] = alpha
            extra["outliers_after"] = outlier_report(stats)
    quantized = {}
    for name, fmt in progress(formats.items(), len(formats), f"quantising ({method})"):
        module = name.removesuffix(".weight")
        if method == "gptq" and module in stats:
            quantized[name] = gptq(checkpoint[name], stats[module].hessian, fmt)
        else:
            quantized[name] = quantize(checkpoint[name], fmt)
    # tensors left in float go back to the checkpoint's dtype (bf16 norms: the fold then rounds)
    checkpoint = {k: v.to(dtypes[k]) for k, v in checkpoint.items()}
    return quantized, checkpoint, extra
