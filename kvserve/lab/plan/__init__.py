"""kvserve.lab.plan: capacity arithmetic (docs/planning.md) from a model's config and a hardware profile.

Pure arithmetic: never imports torch (the measurement that writes `this-machine` lives in
kvserve.lab.measure) and imports matplotlib only inside `plot.plot_roofline`.

- model.py     ModelSpec from a HF config.json or a preset; parameter counts; tensor shapes
- formats.py   weight formats (bits per weight including scales) and KV dtypes
- hardware.py  hardware profiles: built in, by hand, measured; where measured ones are saved
- arith.py     the formulas, one small function each (shared with the simulator's cost model)
- planner.py   make_plan(): every number of the plan, as frozen dataclasses
- report.py    text and compare-table rendering
- plot.py      roofline plot
"""

from __future__ import annotations

from kvserve.lab.plan.formats import KVFormat, WeightFormat, parse_weight_format
from kvserve.lab.plan.hardware import BUILTIN, HardwareProfile, get_profile
from kvserve.lab.plan.model import PRESETS, ModelSpec, PlanError, from_hf_config, load_model
from kvserve.lab.plan.planner import Assumptions, PlanResult, Prices, Workload, make_plan

__all__ = [
    "BUILTIN",
    "PRESETS",
    "Assumptions",
    "HardwareProfile",
    "KVFormat",
    "ModelSpec",
    "PlanError",
    "PlanResult",
    "Prices",
    "WeightFormat",
    "Workload",
    "from_hf_config",
    "get_profile",
    "load_model",
    "make_plan",
    "parse_weight_format",
]
