"""A GGUF file's tensors under Hugging Face names: quantised ones as `BlockWeight`s, the rest fp32.

Quantised matrices keep the file's blocks (repacked once into the kernels' layout,
model/block_weights.py); F32, F16 and BF16 tensors become fp32 tensors. The converter's changes are
undone here (gguf/config.py): llama's q/k rows are put back in Hugging Face's order (a row
permutation, which keeps every block whole) and Gemma's norms lose the 1 that was added.
"""

from __future__ import annotations

import torch

from kvserve.core.errors import ModelLoadError
from kvserve.gguf.config import GGUFArch, gguf_arch, hf_tensor_name, unpermute_rows
from kvserve.gguf.reader import GGUFFile
from kvserve.model.block_weights import (
    FLOAT_TYPES,
    BlockWeight,
    UnsupportedQuantizationError,
    float_tensor,
    repack,
)


def read_gguf_weights(
    gguf: GGUFFile, num_heads: int, num_kv_heads: int, keep_blocks: bool = True
) -> dict[str, torch.Tensor | BlockWeight]:
    """Hugging Face name -> fp32 tensor or `BlockWeight` (`keep_blocks=False`: every tensor fp32,
    dequantised exactly as `gguf.quants.dequantize` does, for requantising with --quantization)."""
    arch = gguf_arch(gguf)
    weights: dict[str, torch.Tensor | BlockWeight] = {}
    for name, info in gguf.tensors.items():
        hf_name = hf_tensor_name(name, arch)
        if hf_name is None:
            continue
        shape = tuple(reversed(info.dims))  # ggml dims are fastest first: torch's [rows, cols]
        type_name = info.ggml_type.name
        if type_name in FLOAT_TYPES:
            tensor: torch.Tensor | BlockWeight = float_tensor(gguf.raw(name), type_name, shape)
        elif len(shape) != 2:
            raise ModelLoadError(
                f"{gguf.path}: tensor {name!r} is {type_name} with {len(shape)} "
                "dimensions; quantised tensors must be matrices"
            )
        else:
            try:
                tensor = repack(gguf.raw(name), type_name, shape)
            except UnsupportedQuantizationError as exc:
                raise ModelLoadError(f"{gguf.path}: tensor {name!r}: {exc}") from None
            if not keep_blocks:
                tensor = tensor.dequantize()
        weights[hf_name] = _undo_converter(tensor, hf_name, arch, num_heads, num_kv_heads)
    return weights


def _undo_converter(
    tensor: torch.Tensor | BlockWeight,
    hf_name: str,
    arch: GGUFArch,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor | BlockWeight:
    if arch.permuted_qk and hf_name.endswith(
        ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")
    ):
        heads = num_heads if ".q_proj." in hf_name else num_kv_heads
        order = torch.from_numpy(unpermute_rows(tensor.shape[0], heads))
        return tensor.select_rows(order) if isinstance(tensor, BlockWeight) else tensor[order]
    if arch.norm_shift and hf_name.endswith("norm.weight"):
        return tensor - arch.norm_shift
    return tensor
