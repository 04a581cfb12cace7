"""Paths, seeds, special tokens and model presets shared by every step of the demo pipeline."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

PIPELINE_DIR = Path(__file__).resolve().parent
REPO_ROOT = PIPELINE_DIR.parents[1]
# Big intermediates (corpus text, token arrays, checkpoints, logs); git-ignored.
WORK_DIR = PIPELINE_DIR / "work"
MANIFEST_PATH = PIPELINE_DIR / "corpus_manifest.json"
ASSETS_DIR = REPO_ROOT / "kvserve" / "assets" / "demo"

SEED = 1234
KINDS = ("code", "prose")
SPLITS = ("train", "heldout")

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|end|>"  # ends a document in pre-training and a turn in chat: one stop token
PAD_TOKEN = "<|pad|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, *ROLE_TOKENS)

# Role-tagged template: <|bos|><|user|>\n...<|end|>\n<|assistant|>\n...<|end|>\n
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


@dataclass(frozen=True)
class ModelPreset:
    """Shape of one Llama model; every other LlamaConfig field keeps transformers' default."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"{self.name}: hidden_size must divide into num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{self.name}: num_attention_heads must be a multiple of kv heads")


# Sizes chosen from measured single-thread CPU throughput; see README.md ("Budget").
PRESETS: dict[str, ModelPreset] = {
    "draft": ModelPreset("draft", 128, 384, 4, 4, 2, 512),
    "target": ModelPreset("target", 320, 864, 8, 5, 5, 512),
    # A few-step smoke-test size for the end-to-end check.
    "tiny": ModelPreset("tiny", 64, 128, 2, 2, 1, 512),
}


def llama_config(
    preset: ModelPreset, vocab_size: int, bos_token_id: int, eos_token_id: int, pad_token_id: int
):
    """The transformers LlamaConfig for `preset` (tied embeddings, no biases, RoPE theta 10000)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_hidden_layers,
        num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_key_value_heads,
        max_position_embeddings=preset.max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        initializer_range=0.02,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )


def hardware_description(device: str, threads: int) -> str:
    """A one-line description of where training ran, for the model card."""
    if device.startswith("cuda"):
        import torch

        return f"{torch.cuda.get_device_name(0)} (CUDA, bf16 autocast)"
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {threads} CPU thread(s), fp32"


def write_json(path: Path, obj: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")
    tmp.replace(path)


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def preset_dict(preset: ModelPreset) -> dict:
    return asdict(preset)
