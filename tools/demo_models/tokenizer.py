"""Step 2: train the byte-level BPE tokenizer and encode the corpus into token arrays.

Trains on the train split only (code and prose), saves a transformers-loadable directory
(tokenizer.json + tokenizer_config.json with the chat template) to work/tokenizer/, then writes
work/tokens/{train,heldout}_{code,prose}.bin (uint16, documents as <|bos|> text <|end|>) and adds
token counts per source to corpus_manifest.json.

A seeded tenth of the train prose documents is wrapped in the chat template (first line or sentence
as the user turn, the rest as the assistant turn) so that the models learn the role tags and to stop
with <|end|>.

    python -m tools.demo_models.tokenizer [--vocab-size 8192] [--force]
    python -m tools.demo_models.tokenizer --reuse kvserve/assets/demo/target   # the shipped one

`--reuse DIR` copies an existing tokenizer (tokenizer.json, tokenizer_config.json) instead of training
one, so that a rebuilt corpus is encoded exactly as the shipped models were trained (the BPE trainer
is not guaranteed to give the same merges on another version of `tokenizers`).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from tools.demo_models.common import (
    BOS_TOKEN,
    CHAT_TEMPLATE,
    EOS_TOKEN,
    KINDS,
    MANIFEST_PATH,
    PAD_TOKEN,
    ROLE_TOKENS,
    SEED,
    SPECIAL_TOKENS,
    SPLITS,
    WORK_DIR,
    read_json,
    write_json,
)
from tools.demo_models.corpus import CORPUS_DIR, in_heldout

TOKENIZER_DIR = WORK_DIR / "tokenizer"
TOKENS_DIR = WORK_DIR / "tokens"
CHAT_WRAP_FRACTION = 0.1
MAX_USER_CHARS = 300


def read_documents(corpus_dir: Path, split: str, kind: str) -> Iterator[dict]:
    with open(corpus_dir / f"{split}_{kind}.jsonl", encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)


def train_tokenizer(corpus_dir: Path, vocab_size: int, out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    texts = (d["text"] for kind in KINDS for d in read_documents(corpus_dir, "train", kind))
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS_TOKEN)
    # Plain encoding prepends <|bos|>, as the models saw every document start in training.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=list(ROLE_TOKENS),
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    # Portable config: the chat template inline (not chat_template.jinja) and a class name that
    # transformers 4.x and 5.x both know, so the engine's loader and older transformers agree.
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(
        tokenizer_class="PreTrainedTokenizerFast",
        chat_template=CHAT_TEMPLATE,
        additional_special_tokens=list(ROLE_TOKENS),
        extra_special_tokens=list(ROLE_TOKENS),
    )
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "chat_template.jinja").unlink(missing_ok=True)


def chat_wrap(text: str) -> str:
    """Render a document as one user/assistant exchange: first line or sentence, then the rest."""
    cut = text.find("\n")
    if cut < 0 or cut > MAX_USER_CHARS:
        cut = text.find(". ", 0, MAX_USER_CHARS)
        cut = cut + 1 if cut >= 0 else min(len(text) // 4, MAX_USER_CHARS)
    head, tail = text[:cut].strip(), text[cut:].strip()
    return f"{BOS_TOKEN}<|user|>\n{head}{EOS_TOKEN}\n<|assistant|>\n{tail}{EOS_TOKEN}\n"


def encode_corpus(
    corpus_dir: Path, tokenizer_dir: Path, out_dir: Path, seed: int
) -> dict[str, dict]:
    """Write the token arrays; return {source: {split_tokens: n}} (text tokens, no specials)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    if tok.get_vocab_size() > np.iinfo(np.uint16).max:
        raise ValueError("vocab does not fit uint16 token arrays")
    bos, eos = tok.token_to_id(BOS_TOKEN), tok.token_to_id(EOS_TOKEN)
    counts: dict[str, dict] = {}
    out_dir.mkdir(parents=True, exist_ok=True)
    for split in SPLITS:
        for kind in KINDS:
            docs = list(read_documents(corpus_dir, split, kind))
            plain = tok.encode_batch([d["text"] for d in docs], add_special_tokens=False)
            arrays = []
            for doc, enc in zip(docs, plain, strict=True):
                entry = counts.setdefault(doc["source"], {f"{s}_tokens": 0 for s in SPLITS})
                entry[f"{split}_tokens"] += len(enc.ids)
                wrap = (
                    split == "train"
                    and kind == "prose"
                    and in_heldout("chat:" + doc["id"], CHAT_WRAP_FRACTION, seed)
                )
                if wrap:
                    ids = tok.encode(chat_wrap(doc["text"]), add_special_tokens=False).ids
                else:
                    ids = [bos, *enc.ids, eos]
                arrays.append(np.asarray(ids, dtype=np.uint16))
            np.concatenate(arrays).tofile(out_dir / f"{split}_{kind}.bin")
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--corpus", type=Path, default=CORPUS_DIR)
    parser.add_argument("--out", type=Path, default=TOKENIZER_DIR)
    parser.add_argument("--tokens-out", type=Path, default=TOKENS_DIR)
    parser.add_argument("--force", action="store_true", help="retrain even if the tokenizer exists")
    parser.add_argument(
        "--reuse",
        type=Path,
        default=None,
        help="copy this directory's tokenizer instead of training one (e.g. the shipped target's)",
    )
    args = parser.parse_args(argv)

    if args.reuse is not None:
        import shutil

        args.out.mkdir(parents=True, exist_ok=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(args.reuse / name, args.out / name)
    elif args.force or not (args.out / "tokenizer.json").exists():
        train_tokenizer(args.corpus, args.vocab_size, args.out)
    counts = encode_corpus(args.corpus, args.out, args.tokens_out, args.seed)
    manifest = read_json(MANIFEST_PATH)
    for entry in manifest["sources"]:
        entry.update(counts[entry["name"]])
    from tokenizers import Tokenizer

    vocab_size = Tokenizer.from_file(str(args.out / "tokenizer.json")).get_vocab_size()
    manifest["tokenizer"] = {"type": "byte-level BPE (HF tokenizers)", "vocab_size": vocab_size}
    write_json(MANIFEST_PATH, manifest)
    for entry in manifest["sources"]:
        print(
            f"{entry['name']:26s} tokens {entry['train_tokens']:10,d} + {entry['heldout_tokens']:8,d}"
        )
    for path in sorted(args.tokens_out.glob("*.bin")):
        print(f"{path.name:20s} {path.stat().st_size // 2:10,d} tokens")


if __name__ == "__main__":
    main()
