"""How much memory this machine can give kvserve, and the KV cache's default size from it.

Torch-free. The one place that reads /proc/meminfo and the cgroup's memory limit (docs/operations.md
"KV-cache size"). `auto_kv_cache_bytes` is pure arithmetic, so tests feed it a fake reading.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

KV_CACHE_MEMORY_FRACTION = 0.5  # of the memory still available once the weights are loaded
# at most this by default, as vLLM's CPU backend (VLLM_CPU_KVCACHE_SPACE defaults to 4 GiB): zeroing
# 11 GiB for SmolLM2's 64 x 8,192 tokens took seconds at start-up, and two such servers side by side
# would hold most of a 24 GiB machine
KV_CACHE_MAX_BYTES = 4 * 2**30
_NO_LIMIT = 1 << 60  # cgroup v1 writes a huge number for "no limit"


@dataclass(frozen=True)
class MemoryReading:
    """Bytes available to this process now, and where the figure came from."""

    available_bytes: int
    source: str  # "MemAvailable", "cgroup limit", ...


def read_available_memory(
    meminfo: Path = Path("/proc/meminfo"), cgroup_root: Path = Path("/sys/fs/cgroup")
) -> MemoryReading | None:
    """The smaller of MemAvailable and the cgroup's limit minus its usage (v2, else v1); None when
    neither can be read (not Linux)."""
    readings: list[MemoryReading] = []
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                readings.append(MemoryReading(int(line.split()[1]) * 1024, "MemAvailable"))
    except (OSError, ValueError, IndexError):
        pass
    for limit_name, usage_name in (
        ("memory.max", "memory.current"),  # cgroup v2
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),  # cgroup v1
    ):
        try:
            limit_text = (cgroup_root / limit_name).read_text().strip()
            if limit_text == "max" or int(limit_text) >= _NO_LIMIT:
                continue
            usage = int((cgroup_root / usage_name).read_text().strip())
        except (OSError, ValueError):
            continue
        readings.append(MemoryReading(max(0, int(limit_text) - usage), "cgroup limit - usage"))
        break
    return min(readings, key=lambda r: r.available_bytes) if readings else None


def device_memory_reading(device: str) -> MemoryReading | None:
    """Free memory where the KV cache will live: the GPU's (torch, lazily) or this machine's."""
    if device.startswith("cuda"):
        import torch

        index = int(device.split(":")[1]) if ":" in device else 0
        free_bytes, _ = torch.cuda.mem_get_info(index)
        return MemoryReading(int(free_bytes), f"free memory of {device}")
    return read_available_memory()


def checkpoint_bytes(model_dir: str | Path) -> int:
    """Bytes of the checkpoint's weight files: what loading them will take, about."""
    from kvserve.gguf.source import gguf_source

    source = gguf_source(model_dir)
    if source is not None:  # a GGUF file's directory holds no weights: they stay in the file
        return source.stat().st_size
    total = 0
    for pattern in ("*.safetensors", "*.bin", "*.gguf"):
        total += sum(p.stat().st_size for p in Path(model_dir).glob(pattern) if p.is_file())
    return total


@dataclass(frozen=True)
class KVCacheSize:
    """The KV cache's byte budget and one line saying how it was chosen (the startup banner)."""

    num_bytes: int
    reason: str


def auto_kv_cache_bytes(
    reading: MemoryReading | None,
    *,
    weights_bytes: int,
    kv_bytes_per_token: int,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    fraction: float = KV_CACHE_MEMORY_FRACTION,
) -> KVCacheSize:
    """`fraction` of the memory left once the weights are loaded, at most what `max_num_seqs`
    full-length sequences can use, at least one full-length sequence."""
    block_bytes = kv_bytes_per_token * block_size
    seq_bytes = math.ceil(max_model_len / block_size) * block_bytes
    need_bytes = seq_bytes * max_num_seqs
    gib = 2**30
    if reading is None:
        return KVCacheSize(
            min(need_bytes, max(seq_bytes, 512 * 2**20)),
            "no memory reading on this system: 512 MiB, within [1, max running] full sequences",
        )
    spare_bytes = max(0, reading.available_bytes - weights_bytes)
    share_bytes = int(spare_bytes * fraction)
    text = (
        f"{fraction:.0%} of {spare_bytes / gib:.1f} GiB ({reading.source} "
        f"{reading.available_bytes / gib:.1f} GiB - weights {weights_bytes / gib:.1f} GiB)"
    )
    if share_bytes > KV_CACHE_MAX_BYTES:
        share_bytes = KV_CACHE_MAX_BYTES
        text += f", at most {KV_CACHE_MAX_BYTES / gib:.0f} GiB by default"
    if share_bytes > need_bytes:
        return KVCacheSize(
            need_bytes, f"{text}, capped at {max_num_seqs} sequences x {max_model_len} tokens"
        )
    if share_bytes < seq_bytes:
        return KVCacheSize(
            seq_bytes,
            f"{text} is less than one {max_model_len}-token sequence: "
            "one sequence (pass --kv-cache-memory to choose)",
        )
    return KVCacheSize(share_bytes, text)
