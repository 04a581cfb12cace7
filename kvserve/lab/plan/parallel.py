"""More than one device (docs/parallel.md): tensor-parallel shards, their all-reduces, interconnects.

Tensor parallelism over N ranks (Megatron): q/k/v and gate/up split by output columns, o_proj and
down_proj by input rows with one all-reduce after each, the embedding and the head split by vocabulary
(an all-reduce after the embedding lookup, a gather of the logits for sampling). KV heads are split,
or replicated when N > n_kv. One rank is then a smaller model of the same family, `shard_model`: every
formula of kvserve.lab.plan.arith applies to it unchanged, and the planner adds the communication term.

Ring all-reduce of M bytes over N ranks: each rank sends 2 (N-1)/N x M bytes in 2 (N-1) steps, so
time = 2 (N-1)/N x M / link bandwidth + 2 (N-1) x link latency. Per token and layer the two
all-reduces carry d activations each (M = d x b). Data parallelism: independent replicas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from kvserve.lab.plan.figures import Latency, Load, Workload
from kvserve.lab.plan.model import ModelSpec, PlanError

if TYPE_CHECKING:
    from kvserve.lab.plan.arith import RooflineCost
    from kvserve.lab.plan.formats import WeightFormat


@dataclass(frozen=True)
class Interconnect:
    """One rank's link to the others: bandwidth per direction and the latency of one ring step."""

    name: str
    bandwidth_bytes_per_s: float  # per direction, per rank
    latency_s: float  # per ring step (a send of one chunk to the neighbour)
    source: str = ""

    def __post_init__(self) -> None:
        if not self.bandwidth_bytes_per_s > 0 or not self.latency_s >= 0:
            raise PlanError(f"interconnect {self.name}: bandwidth > 0 and latency >= 0 needed")


# one-way network delays a ring step waits for: gloo's TCP transport sends once its receiver has
# posted the receive, so the ready notice crosses the link, then the data (docs/parallel.md)
RING_STEP_DELAYS = 2

_LATENCY_NOTE = (
    "Latency per ring step is an assumed order of magnitude, not a datasheet figure: measure yours "
    "(nccl-tests all_reduce_perf at 8 B-64 kB) and pass --link-latency-us."
)

INTERCONNECTS: dict[str, Interconnect] = {
    "nvlink4": Interconnect(
        "NVLink 4 (H100 SXM, NVSwitch)",
        450e9,
        1e-6,
        "NVIDIA H100 datasheet: NVLink 900 GB/s per GPU (18 links, both directions) -> 450 GB/s "
        "each way. " + _LATENCY_NOTE,
    ),
    "nvlink3": Interconnect(
        "NVLink 3 (A100 SXM, NVSwitch)",
        300e9,
        1e-6,
        "NVIDIA A100 datasheet: NVLink 600 GB/s per GPU (both directions) -> 300 GB/s each way. "
        + _LATENCY_NOTE,
    ),
    "pcie5": Interconnect(
        "PCIe 5.0 x16",
        64e9,
        2e-6,
        "PCI-SIG PCIe 5.0: 32 GT/s x 16 lanes, 128b/130b = 63 GB/s each way (the H100 PCIe "
        "datasheet's 128 GB/s counts both). " + _LATENCY_NOTE,
    ),
    "pcie4": Interconnect(
        "PCIe 4.0 x16",
        32e9,
        2e-6,
        "PCI-SIG PCIe 4.0: 16 GT/s x 16 lanes = 31.5 GB/s each way (A100 PCIe datasheet: 64 GB/s "
        "both ways). " + _LATENCY_NOTE,
    ),
    "ethernet-100g": Interconnect(
        "100 Gigabit Ethernet (RoCE)",
        12.5e9,
        10e-6,
        "IEEE 802.3 100GBASE: 100 Gbit/s = 12.5 GB/s each way. " + _LATENCY_NOTE,
    ),
    "ethernet-10g": Interconnect(
        "10 Gigabit Ethernet (TCP)",
        1.25e9,
        30e-6,
        "IEEE 802.3 10GBASE: 10 Gbit/s = 1.25 GB/s each way; TCP through the kernel. "
        + _LATENCY_NOTE,
    ),
}
_ALIASES = {"nvlink": "nvlink4", "pcie": "pcie5", "ethernet": "ethernet-100g"}


def get_interconnect(name: str) -> Interconnect:
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in INTERCONNECTS:
        raise PlanError(
            f"unknown interconnect {name!r}: use one of {', '.join(INTERCONNECTS)} "
            "(or --link-bandwidth / --link-latency-us)"
        )
    return INTERCONNECTS[key]


def kv_heads_per_rank(num_kv_heads: int, tensor_parallel: int) -> int:
    """n_kv / N when N divides n_kv; 1 (each head replicated N / n_kv times) when n_kv divides N."""
    n, kv = tensor_parallel, num_kv_heads
    if kv % n == 0:
        return kv // n
    if n % kv == 0:
        return 1
    raise PlanError(f"tensor parallel {n} must divide the {kv} KV heads or be a multiple of them")


def shard_model(model: ModelSpec, tensor_parallel: int) -> ModelSpec:
    """One rank's share of `model` as a ModelSpec: n_q / N query heads, the KV heads of
    `kv_heads_per_rank`, f / N FFN columns, ceil(V / N) vocabulary rows; norms (and o_proj's and
    down_proj's biases, added after the all-reduce) replicated."""
    n = tensor_parallel
    if n < 1:
        raise PlanError("tensor parallel size must be >= 1")
    if n == 1:
        return model
    if model.num_heads % n:
        raise PlanError(f"tensor parallel {n} must divide the {model.num_heads} attention heads")
    if model.intermediate_size % n:
        raise PlanError(f"tensor parallel {n} must divide the FFN width {model.intermediate_size}")
    return replace(
        model,
        name=f"{model.name} (one of {n} TP ranks)",
        num_heads=model.num_heads // n,
        num_kv_heads=kv_heads_per_rank(model.num_kv_heads, n),
        intermediate_size=model.intermediate_size // n,
        vocab_size=math.ceil(model.vocab_size / n),
    )


def allreduce_bytes_per_rank(num_ranks: int, message_bytes: float) -> float:
    """Ring all-reduce: each rank sends (and receives) 2 (N-1)/N x the message."""
    return 2 * (num_ranks - 1) / num_ranks * message_bytes


def allreduce_s(num_ranks: int, message_bytes: float, link: Interconnect) -> float:
    """2 (N-1)/N x M / BW + 2 (N-1) x latency; 0 on one rank."""
    if num_ranks == 1:
        return 0.0
    return (
        allreduce_bytes_per_rank(num_ranks, message_bytes) / link.bandwidth_bytes_per_s
        + 2 * (num_ranks - 1) * link.latency_s
    )


def gather_s(num_ranks: int, message_bytes: float, link: Interconnect) -> float:
    """Gather of a message split N ways onto one rank (the logits): (N-1)/N x M received by it,
    (N-1) ring steps."""
    if num_ranks == 1:
        return 0.0
    return (num_ranks - 1) / num_ranks * message_bytes / link.bandwidth_bytes_per_s + (
        num_ranks - 1
    ) * link.latency_s


@dataclass(frozen=True)
class TensorParallelComm:
    """The communication of one tensor-parallel step: 2 L all-reduces of [tokens, d] activations
    (docs/parallel.md), one after the vocabulary-parallel embedding, and the logits gather of the
    sampled rows. Not overlapped with compute: each all-reduce sits on the critical path."""

    model: ModelSpec  # the whole model (d, L, V)
    tensor_parallel: int
    link: Interconnect
    activation_bytes: float = 2.0  # bf16 activations; 4 for fp32

    def __post_init__(self) -> None:
        if self.tensor_parallel < 1 or self.activation_bytes <= 0:
            raise PlanError("tensor parallel >= 1 and activation bytes > 0 needed")

    @property
    def num_allreduces_per_step(self) -> int:
        """2 per layer (o_proj, down_proj) + 1 (embedding)."""
        return 2 * self.model.num_layers + 1 if self.tensor_parallel > 1 else 0

    def layer_bytes_per_token(self) -> float:
        """Bytes one rank sends per token and layer: 2 x 2 (N-1)/N x d x b (docs/parallel.md)."""
        message = self.model.hidden_size * self.activation_bytes
        return 2 * allreduce_bytes_per_rank(self.tensor_parallel, message)

    def step_bytes(self, num_tokens: float, num_sampled: float) -> float:
        """Bytes one rank sends in a step (the gather counted at the receiving rank)."""
        n = self.tensor_parallel
        if n == 1:
            return 0.0
        d, b = self.model.hidden_size, self.activation_bytes
        layers = self.model.num_layers * self.layer_bytes_per_token() * num_tokens
        embed = allreduce_bytes_per_rank(n, num_tokens * d * b)
        logits = (n - 1) / n * num_sampled * self.model.vocab_size * b
        return layers + embed + logits

    def step_s(self, num_tokens: float, num_sampled: float) -> float:
        """Time of a step's collectives for `num_tokens` rows, `num_sampled` of them sampled."""
        n, link = self.tensor_parallel, self.link
        if n == 1 or num_tokens <= 0:
            return 0.0
        message = num_tokens * self.model.hidden_size * self.activation_bytes
        logits = num_sampled * self.model.vocab_size * self.activation_bytes
        gather = gather_s(n, logits, link) if num_sampled > 0 else 0.0
        return self.num_allreduces_per_step * allreduce_s(n, message, link) + gather


@dataclass(frozen=True)
class Parallelism:
    """`--tensor-parallel N` ranks per replica over `link`, `--data-parallel M` replicas."""

    tensor_parallel: int = 1
    data_parallel: int = 1
    link: Interconnect = INTERCONNECTS["nvlink4"]
    # one message between the API server and an engine core on another host, one way (0: the
    # cores are local): a request's first message in and its first delta out each pay it, so TTFT
    # and E2E grow by 2 x this; TPOT does not (the core steps without waiting for the client)
    core_message_s: float = 0.0

    def __post_init__(self) -> None:
        if self.tensor_parallel < 1 or self.data_parallel < 1:
            raise PlanError("tensor and data parallel sizes must be >= 1")
        if not self.core_message_s >= 0:
            raise PlanError(
                f"the remote core's message time must be >= 0, got {self.core_message_s}"
            )

    @property
    def num_devices(self) -> int:
        return self.tensor_parallel * self.data_parallel

    def comm(self, model: ModelSpec, activation_bytes: float) -> TensorParallelComm:
        return TensorParallelComm(model, self.tensor_parallel, self.link, activation_bytes)


@dataclass(frozen=True)
class ParallelPlan:
    """Tensor parallel x data parallel (docs/parallel.md). The plan's weight, KV, latency and
    capacity numbers are then per device / per replica; these are the totals and the
    communication behind them."""

    tensor_parallel: int
    data_parallel: int
    num_devices: int
    interconnect: Interconnect
    activation_bytes: float
    num_kv_heads_per_rank: int
    kv_heads_replicated: bool  # N > n_kv: each rank holds a copy of one KV head
    weight_bytes_total: float  # the whole model, once
    weight_bytes_per_device: float
    kv_bytes_per_token_total: float  # the unsharded k
    kv_bytes_per_token_per_device: float
    allreduce_bytes_per_layer_per_token: float  # 2 x 2 (N-1)/N x d x b per rank
    num_allreduces_per_step: int
    comm_bytes_per_decode_token: float  # layers + embedding + logits gather, per rank
    decode_comm_s_solo: float
    decode_comm_share_solo: float  # of TPOT solo
    decode_comm_s_max_batch: float | None
    prefill_comm_s: float
    max_concurrent_total: int  # per replica x replicas
    tokens_per_s_max_batch_total: float | None
    full_load_output_tokens_per_s_total: float | None


def activation_bytes(fmt: WeightFormat) -> float:
    """Bytes of one activation the all-reduces carry: fp32 models compute in fp32, the rest in
    16 bits (quantised weights are dequantised to bf16 activations)."""
    return 4.0 if fmt.linear.name == "fp32" else 2.0


def parallel_plan(
    model: ModelSpec,
    fmt: WeightFormat,
    b: float,
    parallel: Parallelism,
    cost: RooflineCost,
    w: Workload,
    b_max: int,
    latency: Latency,
    load: Load | None,
) -> ParallelPlan:
    tp, dp = parallel.tensor_parallel, parallel.data_parallel
    comm = parallel.comm(model, activation_bytes(fmt))
    rank = cost.model
    solo_comm = cost.comm_s(1, 1)
    big_comm = cost.comm_s(b_max, b_max) if b_max else None
    return ParallelPlan(
        tensor_parallel=tp,
        data_parallel=dp,
        num_devices=parallel.num_devices,
        interconnect=parallel.link,
        activation_bytes=comm.activation_bytes,
        num_kv_heads_per_rank=rank.num_kv_heads,
        kv_heads_replicated=tp > model.num_kv_heads,
        weight_bytes_total=fmt.weight_bytes(model),
        weight_bytes_per_device=cost.weight_bytes,
        kv_bytes_per_token_total=2 * model.num_layers * model.num_kv_heads * model.head_dim * b,
        kv_bytes_per_token_per_device=cost.kv_bytes_per_token,
        allreduce_bytes_per_layer_per_token=comm.layer_bytes_per_token(),
        num_allreduces_per_step=comm.num_allreduces_per_step,
        comm_bytes_per_decode_token=comm.step_bytes(1, 1),
        decode_comm_s_solo=solo_comm,
        decode_comm_share_solo=solo_comm / latency.tpot_solo_s,
        decode_comm_s_max_batch=big_comm,
        prefill_comm_s=cost.comm_s(w.prompt_tokens, 1),
        max_concurrent_total=b_max * dp,
        tokens_per_s_max_batch_total=(
            latency.tokens_per_s_max_batch * dp if latency.tokens_per_s_max_batch else None
        ),
        full_load_output_tokens_per_s_total=load.output_tokens_per_s * dp if load else None,
    )
