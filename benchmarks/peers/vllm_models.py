"""The two Hugging Face directories the vLLM peer serves (benchmarks/serving_sweep.py), made locally:

- `random`: the random SmolLM2-135M-shaped fp32 Llama over GPT-2's tokenizer that every serving
  sweep has used (`/tmp/kv/smol-gpt2`): hidden 576, intermediate 1536, 30 layers, 9 heads, 3 KV
  heads, rope theta 1e5, 8192 positions, initializer range 0.05, seed 0, tied embeddings;
- `real`: SmolLM2-135M-Instruct as the project ships it (the Q4_1 GGUF), dequantised to fp32 by
  transformers (`from_pretrained(dir, gguf_file=...)`) and saved with its tokenizer
  (`/tmp/models/smollm2-hf`), so that vLLM serves the same weights kvserve reads from the GGUF.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/peers/vllm_models.py random [--out DIR]
    PYTHONPATH=$PWD .venv/bin/python benchmarks/peers/vllm_models.py real [--gguf FILE] [--out DIR]

Idempotent: a directory that already has config.json is left as it is.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2_135M_SHAPE = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    rope_theta=100000.0,
    max_position_embeddings=8192,
    initializer_range=0.05,
)


def make_random(out: Path) -> Path:
    sys.path.insert(0, str(ROOT))
    from tests.checkpoints import build_gpt2_tokenized_checkpoint

    build_gpt2_tokenized_checkpoint(out, **SMOLLM2_135M_SHAPE)
    return out


def make_real(gguf: Path, out: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    # transformers marks a GGUF-loaded model as quantised and refuses to save it; its tensors are
    # already dequantised, so they move into a plain model of the same config
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.load_state_dict(loaded.state_dict())
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("which", choices=("random", "real"))
    p.add_argument("--gguf", default="/tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    default = {"random": "/tmp/kv/smol-gpt2", "real": "/tmp/models/smollm2-hf"}[args.which]
    out = Path(args.out or default)
    if (out / "config.json").is_file():
        print(f"{out} already has config.json; left as it is")
        return 0
    made = make_random(out) if args.which == "random" else make_real(Path(args.gguf), out)
    print(made)
    return 0


if __name__ == "__main__":
    sys.exit(main())
