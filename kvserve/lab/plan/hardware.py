"""Hardware profiles: memory, bandwidth and peak FLOP/s of a device, built in or measured.

Built-in numbers are datasheet peaks (dense, no sparsity). Prices are illustrative references only,
for the `--compare` table; pass your own with `--price-per-hour` or `--device-cost`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from kvserve.lab.plan.model import PlanError
from kvserve.paths import cache_dir


@dataclass(frozen=True)
class MeasuredPoint:
    """One timed kernel from `kvserve plan --measure`: a GEMV (num_columns = 1, reads a weight
    matrix), a GEMM over `num_columns` batch columns, or an engine point (kvserve.lab.measure_engine,
    docs/planning.md: num_columns = the step's rows; `context_tokens` for attention-time)."""

    kind: str  # "gemv" | "gemm" | "linear:FMT" | "dispatch" | "fused-dispatch" | "pool-layer:FMT" | ...
    num_columns: int
    flops_per_s: float
    bytes_per_s: float
    intensity_flops_per_byte: float
    median_s: float
    context_tokens: int = 0  # the cached tokens per row (attention-time points); 0: not applicable
    # K and V bytes of one token of one layer in the cache the attention-time point was timed on
    # (its model's KV heads x head_dim, fp32); 0: not recorded (then planned unscaled)
    kv_token_bytes: int = 0


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    memory_bytes: float
    bandwidth_bytes_per_s: float
    peak_flops_per_s: float
    compute_dtype: str = "bf16"  # the dtype the peak is for
    power_w: float | None = None
    price_per_hour_usd: float | None = None  # illustrative rental price
    device_cost_usd: float | None = None  # illustrative purchase price
    measured: bool = False
    source: str = ""
    points: tuple[MeasuredPoint, ...] = field(default=())
    # the most decode rows the engine's fused decode step (one native call for every layer) took
    # when this profile was measured; 0: no fused step (or a profile from before it existed)
    decode_fused_rows: int = 0
    # the most rows of a fused step whose projections are all fp32 (decode_step.c
    # decode_step_max_rows: the panel GEMV takes 16); 0: decode_fused_rows (an older profile)
    decode_fused_f32_rows: int = 0
    # the fused step is the pooled step (one OpenMP region whose thread pool stays up for the whole
    # step) at every context: measured with more than one thread on a kernel whose pool splits the
    # attention itself (decode_step.c)
    decode_pooled_any_context: bool = False
    # an older kernel's rule: the pooled step while rows x context x KV heads x head_dim stay below
    # this, a region per linear above; 0: not measured or no pooled step
    decode_pooled_values: int = 0

    def __post_init__(self) -> None:
        for name in ("memory_bytes", "bandwidth_bytes_per_s", "peak_flops_per_s"):
            if not getattr(self, name) > 0:
                raise PlanError(f"hardware {self.name}: {name} must be positive")

    @property
    def ridge_flops_per_byte(self) -> float:
        """I* = peak / BW: kernels below it are memory-bound."""
        return self.peak_flops_per_s / self.bandwidth_bytes_per_s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HardwareProfile:
        """A profile from its JSON, today's or an earlier version's (`_EARLIER_FIELDS`,
        `_EARLIER_KINDS`: read here and nowhere else)."""
        data = dict(data)
        for earlier, field_name in _EARLIER_FIELDS.items():
            if earlier in data:
                value = data.pop(earlier)
                data.setdefault(field_name, value)
        data["points"] = tuple(MeasuredPoint(**_current_kind(p)) for p in data.get("points", ()))
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})


# Profiles saved by earlier versions call the pooled step (decode_step.c: the fused step as one
# OpenMP region whose thread pool stays up for the whole step) the "team" step; from_dict reads
# their names as these.
_EARLIER_FIELDS = {
    "decode_team_any_context": "decode_pooled_any_context",
    "decode_team_values": "decode_pooled_values",
}
_EARLIER_KINDS = {"team-layer:": "pool-layer:"}  # kind prefix -> today's


def _current_kind(point: dict[str, Any]) -> dict[str, Any]:
    """A MeasuredPoint's JSON with an earlier version's kind under today's name."""
    kind = point.get("kind", "")
    for earlier, current in _EARLIER_KINDS.items():
        if kind.startswith(earlier):
            return {**point, "kind": current + kind.removeprefix(earlier)}
    return point


def _gpu(
    name: str,
    mem_gb: float,
    bw_gbs: float,
    tflops: float,
    power_w: float,
    price: float,
    source: str,
) -> HardwareProfile:
    return HardwareProfile(
        name,
        mem_gb * 1e9,
        bw_gbs * 1e9,
        tflops * 1e12,
        power_w=power_w,
        price_per_hour_usd=price,
        source=source,
    )


BUILTIN: dict[str, HardwareProfile] = {
    "h100-sxm": _gpu(
        "H100 SXM",
        80,
        3350,
        989.4,
        700,
        3.00,
        "NVIDIA H100 datasheet: 80 GB HBM3, 3.35 TB/s, BF16 989 TFLOP/s dense (1979 sparse), "
        "700 W. Price: illustrative on-demand cloud rate.",
    ),
    "a100-80gb": _gpu(
        "A100 80GB",
        80,
        2039,
        312,
        400,
        1.80,
        "NVIDIA A100 datasheet (SXM): 80 GB HBM2e, 2,039 GB/s, BF16 312 TFLOP/s dense, 400 W. "
        "Price: illustrative on-demand cloud rate.",
    ),
    "l40s": _gpu(
        "L40S",
        48,
        864,
        362.05,
        350,
        1.00,
        "NVIDIA L40S datasheet: 48 GB GDDR6, 864 GB/s, BF16 362 TFLOP/s dense (733 sparse), "
        "350 W. Price: illustrative cloud rate.",
    ),
    "l4": _gpu(
        "L4",
        24,
        300,
        121,
        72,
        0.80,
        "NVIDIA L4 datasheet: 24 GB GDDR6, 300 GB/s, BF16 121 TFLOP/s dense (242 sparse), 72 W. "
        "Price: illustrative cloud rate.",
    ),
    "rtx-4090": HardwareProfile(
        "RTX 4090",
        24e9,
        1008e9,
        165.2e12,
        power_w=450,
        device_cost_usd=1800,
        source="NVIDIA Ada whitepaper: 24 GB GDDR6X, 1,008 GB/s, BF16 tensor 165.2 TFLOP/s dense "
        "with FP32 accumulate, 450 W. Price: illustrative street price of the card.",
    ),
    "m2-ultra": HardwareProfile(
        "Apple M2 Ultra",
        192e9,
        800e9,
        27.2e12,
        power_w=300,
        device_cost_usd=6600,
        source="Apple: up to 192 GB unified memory at 800 GB/s; 76-core GPU ~27.2 TFLOP/s FP32 "
        "(FP16/BF16 run at the same rate). Power ~300 W at full load (approximate). Price: "
        "illustrative US list price of a Mac Studio with 76-core GPU and 192 GB.",
    ),
    "ddr5-desktop": HardwareProfile(
        "DDR5 desktop (dual channel)",
        64e9,
        89.6e9,
        1.15e12,
        compute_dtype="fp32",
        power_w=200,
        device_cost_usd=1500,
        source="2 x 64-bit DDR5-5600 = 89.6 GB/s, 64 GB; 8 Zen 4 cores x 4.5 GHz x 32 FP32 "
        "FLOP/cycle (two 256-bit FMA pipes) = 1.15 TFLOP/s; CPU BF16 is emulated or at best 2x via "
        "AVX512-BF16, so the FP32 FMA peak is used. Power and price illustrative.",
    ),
}

THIS_MACHINE = "this-machine"


def profiles_dir() -> Path:
    """Where measured profiles live (kvserve/paths.py)."""
    return cache_dir("profiles")


def default_profile_path() -> Path:
    return profiles_dir() / f"{THIS_MACHINE}.json"


def save_profile(profile: HardwareProfile, path: Path | None = None) -> Path:
    path = Path(path) if path else default_profile_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile.to_dict(), indent=2) + "\n")
    return path


def load_profile_file(path: Path) -> HardwareProfile:
    try:
        return HardwareProfile.from_dict(json.loads(Path(path).read_text()))
    except (OSError, json.JSONDecodeError, TypeError) as exc:
        raise PlanError(f"cannot read hardware profile {path}: {exc}") from exc


def _key(name: str) -> str:
    return name.strip().lower().replace(" ", "-").replace("_", "-")


_ALIASES = {
    "h100": "h100-sxm",
    "h100-sxm5": "h100-sxm",
    "a100": "a100-80gb",
    "a100-80g": "a100-80gb",
    "4090": "rtx-4090",
    "rtx4090": "rtx-4090",
    "apple-m2-ultra": "m2-ultra",
    "ddr5": "ddr5-desktop",
    "desktop": "ddr5-desktop",
}


def get_profile(name: str) -> HardwareProfile:
    """A built-in key (h100-sxm, a100-80gb, l40s, l4, rtx-4090, m2-ultra, ddr5-desktop),
    `this-machine` (the saved measurement), or the path of a profile JSON."""
    key = _key(name)
    key = _ALIASES.get(key, key)
    if key in BUILTIN:
        return BUILTIN[key]
    if key == THIS_MACHINE:
        path = default_profile_path()
        if not path.is_file():
            raise PlanError(f"no measured profile at {path}: run `kvserve plan --measure` first")
        return load_profile_file(path)
    path = Path(name).expanduser()
    if path.is_file():
        return load_profile_file(path)
    raise PlanError(
        f"unknown hardware {name!r}: use one of {', '.join(BUILTIN)}, {THIS_MACHINE}, "
        "a profile JSON path, or --memory/--bandwidth/--peak"
    )


def manual_profile(
    memory_gb: float,
    bandwidth_gb_per_s: float,
    peak_tflops: float,
    base: HardwareProfile | None = None,
) -> HardwareProfile:
    """`--memory GB --bandwidth GB/s --peak TFLOP/s`; any left None is taken from `base`."""
    if base is None and None in (memory_gb, bandwidth_gb_per_s, peak_tflops):
        raise PlanError(
            "without --hardware, give all of --memory GB, --bandwidth GB/s, --peak TFLOP/s"
        )
    name = f"{base.name} (edited)" if base else "manual"
    profile = base or HardwareProfile("manual", 1, 1, 1, source="given by hand")
    return replace(
        profile,
        name=name,
        memory_bytes=memory_gb * 1e9 if memory_gb is not None else profile.memory_bytes,
        bandwidth_bytes_per_s=(
            bandwidth_gb_per_s * 1e9
            if bandwidth_gb_per_s is not None
            else profile.bandwidth_bytes_per_s
        ),
        peak_flops_per_s=peak_tflops * 1e12
        if peak_tflops is not None
        else profile.peak_flops_per_s,
        source=(profile.source + "; " if base else "") + "values given by hand",
    )
