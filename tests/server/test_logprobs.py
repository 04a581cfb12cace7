"""Logprob token texts are each token's decoded contribution in context: they concatenate to the text,
`text_offset` indexes it, partial UTF-8 characters show as `bytes:\\x..`; on hand-checked ids of GPT-2
(byte-level BPE) and a Llama-2-style SentencePiece tokenizer, offline and through a live server."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from kvserve.core.outputs import TokenLogprob
from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.server.logprob_text import (
    PARTIAL_PREFIX,
    TokenBytes,
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
)
from tests.checkpoints import GPT2_TOKENIZER
from tests.server_utils import running_server

GPT2_EOS = 50256


@pytest.fixture(scope="module")
def gpt2():
    return AutoTokenizer.from_pretrained(GPT2_TOKENIZER)


def llama2_style_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style tokenizer built like Llama 2's tokenizer.json: "▁" marks a space, byte
    fallback <0xNN> for characters outside the vocabulary, and a decoder that strips the first space."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)]
    vocab += [(f"<0x{b:02X}>", 0.0) for b in range(256)]
    vocab += [("▁", -2.0), ("▁concentr", -1.0), ("▁Hello", -1.0), ("ate", -1.5)]
    vocab += [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyzH"]
    tokenizer = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
         decoders.Strip(" ", 1, 0)]
    )  # fmt: skip
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def entries(ids: list[int], top: dict[int, list[int]] | None = None) -> list[TokenLogprob]:
    top = top or {}
    return [
        TokenLogprob(i, -1.0, 1, tuple((t, -2.0) for t in top.get(k, [])))
        for k, i in enumerate(ids)
    ]


def engine_text(tokenizer, prompt_ids: list[int], ids: list[int]) -> str:
    """The oracle: the text the engine's incremental detokenizer produces for these tokens."""
    detok = IncrementalDetokenizer(tokenizer, tuple(prompt_ids), SamplingParams())
    return detok.update(ids, finished=True)


def run(tokenizer, prompt: str, ids: list[int], chunks: int = 1, top=None) -> dict:
    texts = TokenTexts(tokenizer, TokenBytes(tokenizer), tokenizer.encode(prompt))
    es = entries(ids, top)
    size = -(-len(es) // chunks)
    parts = [completion_logprobs(texts, es[i : i + size]) for i in range(0, len(es), size)]
    return {k: [v for p in parts for v in p[k]] for k in parts[0]}


def test_gpt2_leading_space_tokens_equal_vllm_and_concatenate(gpt2):
    ids = gpt2.encode(" concentr concentr concentr")
    assert ids == [5280, 81, 5280, 81, 5280, 81]  # hand-checked: " concent" + "r", three times
    lp = run(gpt2, "Hello", ids)
    assert lp["tokens"] == [" concent", "r"] * 3
    assert lp["tokens"] == [gpt2.decode([i]) for i in ids]  # vLLM's per-token decode, same here
    assert lp["text_offset"] == [0, 8, 9, 17, 18, 26]
    text = engine_text(gpt2, gpt2.encode("Hello"), ids)
    assert "".join(lp["tokens"]) == text == " concentr concentr concentr"


def test_gpt2_partial_utf8_shows_bytes_and_the_completing_token_carries_the_character(gpt2):
    ids = [64, 851, 275, 6184, 120, 10545, 245, 98, GPT2_EOS]
    assert gpt2.convert_ids_to_tokens(ids[3:8]) == ["ĠÃ", "¼", "Ġæ", "Ĺ", "¥"]
    lp = run(gpt2, "Hello", ids)
    assert lp["tokens"] == [
        "a", " —", " b", "bytes:\\x20\\xc3", " ü", "bytes:\\x20\\xe6", "bytes:\\x97", " 日",
        "<|endoftext|>",
    ]  # fmt: skip
    assert lp["text_offset"] == [0, 1, 3, 5, 5, 7, 7, 7, 9]
    text = engine_text(gpt2, gpt2.encode("Hello"), ids)
    assert text == "a — b ü 日"
    committed = [
        t for t, i in zip(lp["tokens"], ids, strict=True) if not t.startswith(PARTIAL_PREFIX)
    ]
    assert "".join(committed[:-1]) == text  # all but EOS, which adds no text
    for token, offset in zip(lp["tokens"], lp["text_offset"], strict=True):
        if not token.startswith(PARTIAL_PREFIX) and token != "<|endoftext|>":
            assert text[offset : offset + len(token)] == token


def test_streamed_chunks_give_the_same_texts_as_one_pass(gpt2):
    ids = [64, 851, 275, 6184, 120, 10545, 245, 98, 5280, 81]
    top = {3: [6184, 64], 4: [120, 5280]}  # alternatives are decoded in the same context
    whole = run(gpt2, "Hello", ids, top=top)
    assert run(gpt2, "Hello", ids, chunks=4, top=top) == whole
    assert whole["top_logprobs"][3] == {"bytes:\\x20\\xc3": -2.0, "a": -2.0}
    # after the pending b" \xc3", " concent" would leave that byte invalid: it adds " \ufffd concent"
    assert whole["top_logprobs"][4] == {" ü": -2.0, " \ufffd concent": -2.0}


def test_sentencepiece_tokens_keep_their_space_in_context():
    tokenizer = llama2_style_tokenizer()
    concentr, e2, x80, x94 = (tokenizer.convert_tokens_to_ids(t)
                              for t in ("▁concentr", "<0xE2>", "<0x80>", "<0x94>"))  # fmt: skip
    assert tokenizer.decode([concentr]) == "concentr"  # alone, the decoder strips the space
    ids = [concentr] * 3
    lp = run(tokenizer, "Hello", ids)
    assert lp["tokens"] == [" concentr"] * 3
    assert lp["text_offset"] == [0, 9, 18]
    assert "".join(lp["tokens"]) == engine_text(tokenizer, tokenizer.encode("Hello"), ids)
    dash = run(tokenizer, "Hello", [concentr, e2, x80, x94])
    assert dash["tokens"] == [" concentr", "bytes:\\xe2", "bytes:\\x80", "—"]
    assert dash["text_offset"] == [0, 9, 9, 9]


def test_chat_bytes_are_each_tokens_own_bytes(gpt2):
    texts = TokenTexts(gpt2, TokenBytes(gpt2), gpt2.encode("Hi"))
    content = chat_logprobs(texts, entries([275, 6184, 120]))["content"]
    assert [c["token"] for c in content] == [" b", "bytes:\\x20\\xc3", " ü"]
    assert [c["bytes"] for c in content] == [[32, 98], [32, 0xC3], [0xBC]]
    assert bytes(b for c in content for b in c["bytes"]).decode() == " b ü"


# --- live server ---------------------------------------------------------------------------------------

# Push the sampler towards byte-fragment tokens so that partial characters occur.
PARTIAL_BIAS = {str(t): 12.0 for t in (6184, 120, 10545, 245, 98)}


@pytest.fixture(scope="module")
def server(gpt2_model_dir):
    with running_server(gpt2_model_dir, "--max-model-len", "256", "--kv-cache-memory", "32MiB") as (
        url,
        _,
    ):
        yield url


def partial_bytes(token: str) -> bytes:
    return bytes(int(h, 16) for h in token[len(PARTIAL_PREFIX) :].split("\\x")[1:])


def check_tokens(tokens: list[str], offsets: list[int], text: str) -> None:
    joined, held = "", b""
    for token, offset in zip(tokens, offsets, strict=True):
        assert offset == len(joined)
        if token.startswith(PARTIAL_PREFIX):
            held += partial_bytes(token)
        elif token != "<|endoftext|>":
            joined, held = joined + token, b""
    # Bytes still held when the output ended (a character never completed) are in the text as U+FFFD.
    assert text == joined + held.decode("utf-8", errors="replace")


@pytest.mark.slow
def test_live_completions_and_chat_logprobs_concatenate(server):
    model = httpx.get(f"{server}/v1/models").json()["data"][0]["id"]
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0)
    seen_partial = False
    for seed in range(3):
        kwargs = dict(model=model, prompt="Hello", max_tokens=24, temperature=1.0, seed=seed,
                      logprobs=2, logit_bias=PARTIAL_BIAS)  # fmt: skip
        done = client.completions.create(**kwargs).choices[0]
        check_tokens(done.logprobs.tokens, done.logprobs.text_offset, done.text)
        seen_partial |= any(t.startswith(PARTIAL_PREFIX) for t in done.logprobs.tokens)
        tokens, offsets = [], []
        for chunk in client.completions.create(**kwargs, stream=True):
            if chunk.choices and chunk.choices[0].logprobs:
                tokens += chunk.choices[0].logprobs.tokens
                offsets += chunk.choices[0].logprobs.text_offset
        assert (tokens, offsets) == (done.logprobs.tokens, done.logprobs.text_offset)

        chat = dict(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=16,
                    temperature=1.0, seed=seed, logprobs=True, top_logprobs=2,
                    logit_bias=PARTIAL_BIAS)  # fmt: skip
        message = client.chat.completions.create(**chat).choices[0]
        content = message.logprobs.content
        raw = b"".join(bytes(c.bytes) for c in content if c.token != "<|endoftext|>")
        assert raw.decode("utf-8", errors="replace") == message.message.content
        streamed = [
            c.token
            for chunk in client.chat.completions.create(**chat, stream=True)
            if chunk.choices and chunk.choices[0].logprobs
            for c in chunk.choices[0].logprobs.content
        ]
        assert streamed == [c.token for c in content]
    assert seen_partial, "the bias should have produced at least one partial character"
    body = httpx.post(f"{server}/v1/completions", json={"prompt": "Hi", "max_tokens": 3,
                                                        "logprobs": 0}).json()  # fmt: skip
    assert json.dumps(body)  # plain JSON all the way
