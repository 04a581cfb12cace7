"""From the user's description of a deployment to a cost model and a KV cache size.

- roofline: a model (preset, HF directory or config.json), a weight format, a KV dtype and a
  hardware profile, through kvserve.lab.plan: the cache holds what the memory leaves after the weights
  and the runtime overhead (docs/planning.md's memory budget).
- profile: a calibrated step profile, which also records the engine configuration it was measured
  with (cache blocks, block size, limits), so the twin runs with the same cache by default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserve.kv.groups import KVLayout, plan_layout
from kvserve.lab.plan import (
    Assumptions,
    HardwareProfile,
    KVFormat,
    ModelSpec,
    arith,
    parse_weight_format,
)
from kvserve.lab.sim.cost import CostModel, RooflineStepCost, StepProfile
from kvserve.lab.sim.delivery import DeliveryJitter
from kvserve.lab.sim.noise import NoisyCost
from kvserve.lab.sim.workload import SimError


@dataclass(frozen=True)
class Deployment:
    """A cost model and the cache it runs with; `defaults` are engine settings the cost model
    came with (a profile's engine configuration), used where the user gave none."""

    cost_model: CostModel
    kv_cache_bytes: float | None  # None: given as blocks
    kv_bytes_per_token: float | None
    description: dict[str, Any]
    defaults: dict[str, Any]
    # per layer, the keys a query sees (None: all); () when every layer is global (plan.model)
    layer_windows: tuple[int | None, ...] = ()

    def layout(self, max_model_len: int) -> KVLayout | None:
        """The engine's KV groups for this model (kv/groups.py), None when it keeps one table."""
        if not self.layer_windows:
            return None
        layout = plan_layout(self.layer_windows, max_model_len)
        return layout if layout.hybrid else None

    def num_blocks(self, block_size: int, layout: KVLayout | None = None) -> int:
        """Blocks the cache holds; a hybrid layout's block holds one group's layers, not all."""
        if self.kv_cache_bytes is None or not self.kv_bytes_per_token:
            raise SimError(
                "this cost model does not say how large the KV cache is: give --num-blocks"
            )
        per_token = self.kv_bytes_per_token
        if layout is not None:
            per_token = per_token * layout.group_size / layout.num_layers
        num = int(self.kv_cache_bytes // (per_token * block_size))
        if num < 1:
            raise SimError(
                f"the KV cache ({self.kv_cache_bytes / 1e9:.3g} GB) holds no block of {block_size} "
                "tokens: the weights and overhead fill the memory"
            )
        return num


def roofline_deployment(
    model: ModelSpec,
    hardware: HardwareProfile,
    weights: str = "bf16",
    kv_dtype: str = "bf16",
    assumptions: Assumptions | None = None,
    step_overhead_s: float = 0.0,
    kv_cache_bytes: float | None = None,
) -> Deployment:
    a = (assumptions or Assumptions()).resolved(hardware)
    fmt = parse_weight_format(weights)
    weight_bytes = fmt.weight_bytes(model)
    b = KVFormat(kv_dtype).bytes_per_value(model.head_dim)
    k = arith.kv_bytes_per_token(model, b)
    bandwidth = hardware.bandwidth_bytes_per_s * a.bandwidth_fraction
    roofline = arith.RooflineCost(
        model, weight_bytes, k, bandwidth, hardware.peak_flops_per_s, a.mfu
    )
    free = arith.free_cache_bytes(hardware.memory_bytes, weight_bytes, a.overhead_bytes)
    if kv_cache_bytes is None:
        kv_cache_bytes = free
    description = {
        "cost_model": "roofline",
        "model": model.name,
        "model_source": model.source,
        "hardware": hardware.name,
        "hardware_source": hardware.source,
        "weights": fmt.name,
        "kv_dtype": kv_dtype,
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": k,
        "kv_cache_bytes": kv_cache_bytes,
        "assumptions": {
            "mfu": a.mfu,
            "bandwidth_fraction": a.bandwidth_fraction,
            "overhead_bytes": a.overhead_bytes,
            "step_overhead_s": step_overhead_s,
        },
    }
    return Deployment(
        RooflineStepCost(roofline, step_overhead_s),
        kv_cache_bytes,
        k,
        description,
        {"max_model_len": model.max_position_embeddings},
        model.layer_windows,
    )


# Engine settings a profile records and the twin adopts by default.
PROFILE_ENGINE_KEYS = (
    "num_blocks",
    "block_size",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "enable_prefix_caching",
)


def profile_deployment(
    profile: StepProfile, noise: bool | str = False, seed: int = 0
) -> Deployment:
    """A profile's deployment; with `noise`, each step's cost is scaled by a ratio drawn from the
    fit's residuals (kvserve.lab.sim.noise), when the profile kept them: `True` or "residuals" per
    step class and correlated in time as measured (where the profile recorded it), with each
    token's delivery jitter where the profile measured it (kvserve.lab.sim.delivery), "pooled" from
    all steps alike, independent draws, no delivery jitter (the earlier model)."""
    engine = profile.meta.get("engine", {})
    cost: CostModel = profile
    fit = profile.meta.get("fit", {})
    quantiles = fit.get("residual_ratio_quantiles")
    if noise and quantiles:
        by_class, rho = {}, 0.0
        if noise != "pooled":
            by_class = {
                k: tuple(v["quantiles"])
                for k, v in fit.get("residual_ratio_quantiles_by_class", {}).items()
            }
            rho = float(fit.get("residual_lag1_correlation", 0.0))
        delivery = None
        if noise != "pooled" and (jitter := profile.meta.get("delivery_jitter")):
            delivery = DeliveryJitter(
                jitter["quantiles"],
                jitter["lag1_correlation"],
                seed,
                jitter.get("intake_quantiles"),
            )
        cost = NoisyCost(profile, tuple(quantiles), seed, by_class, rho, delivery)
    description = {"cost_model": "profile"} | cost.describe()
    defaults = {k: engine[k] for k in PROFILE_ENGINE_KEYS if engine.get(k) is not None}
    return Deployment(cost, None, None, description, defaults)
