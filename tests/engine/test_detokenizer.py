"""Incremental detokenisation with a real byte-level BPE tokenizer (GPT-2's)."""

from __future__ import annotations

import json

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvserve.core.sampling_params import SamplingParams
from kvserve.engine.detokenizer import IncrementalDetokenizer
from tests.checkpoints import GPT2_TOKENIZER


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(GPT2_TOKENIZER))


def stream(tokenizer, text: str, stop=(), prompt="Say:"):
    """Feed `text`'s tokens one at a time; returns (deltas, detokenizer)."""
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(
        tokenizer, tuple(tokenizer.encode(prompt)), SamplingParams(stop=stop)
    )
    deltas = []
    for i, token_id in enumerate(ids):
        deltas.append(detok.update([token_id], finished=i == len(ids) - 1))
        if detok.stopped:
            break
    return deltas, detok


def test_multibyte_characters_are_never_split(tokenizer):
    text = "naïve café 🙂 日本語 done"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.split()), "the emoji and CJK must span several byte-level tokens"
    deltas, _ = stream(tokenizer, text)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


def test_stop_string_is_never_emitted(tokenizer):
    deltas, detok = stream(tokenizer, "alpha beta STOP gamma", stop=("STOP",))
    assert "".join(deltas) == "alpha beta "
    assert detok.stopped and detok.stop_string == "STOP"
    assert not any("ST" in d for d in deltas)


def test_partial_stop_prefix_is_released_when_it_turns_out_not_to_stop(tokenizer):
    deltas, detok = stream(tokenizer, "one END two ENDING", stop=("ENDX",))
    assert "".join(deltas) == "one END two ENDING" and not detok.stopped


def stopped_text(tokenizer, text: str, stops: list[str]) -> str:
    """The definition, token by token as a server streams (vLLM's): after each token, the first stop
    string seen anywhere in the text so far ends it at that stop string's start (the leftmost one
    when several are there); with none seen, the whole text. An incomplete character at the end
    (decoded as U+FFFD) is not text yet."""
    ids = tokenizer.encode(text)
    for k in range(1, len(ids) + 1):
        seen = tokenizer.decode(ids[:k]).rstrip("\ufffd")
        found = [seen.find(s) for s in stops if s in seen]
        if found:
            return seen[: min(found)]
    return tokenizer.decode(ids)


@settings(max_examples=60, deadline=None)
@given(
    text=st.text(alphabet="ab cé🙂\n", min_size=1, max_size=30),
    stops=st.lists(st.text(alphabet="ab cé🙂", min_size=1, max_size=3), max_size=2),
)
# found by the property test: "é" completes first, so "aéa" (leftmost in the end) never stops it
@example(text="aéa", stops=["é", "aéa"])
def test_stream_equals_truncated_full_decode(tokenizer, text, stops):
    deltas, _ = stream(tokenizer, text, stop=tuple(stops))
    assert "".join(deltas) == stopped_text(tokenizer, text, stops)


def test_engine_stop_string_truncates_and_frees(gpt2_model_dir):
    from kvserve import LLM

    llm = LLM(str(gpt2_model_dir), num_blocks=32)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    free_run = llm.generate("The quick brown fox", params)[0].outputs[0]
    text = free_run.text
    assert len(text) > 6
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    expected = text[: text.find(stop)]
    stopped = llm.generate("The quick brown fox", params.with_updates(stop=(stop,)))[0].outputs[0]
    assert stopped.text == expected
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert free_run.token_ids[: len(stopped.token_ids)] == stopped.token_ids
    llm.engine.check_invariants()
    assert llm.engine.num_free_blocks() == 32


def test_a_stop_string_completed_by_the_last_allowed_token_is_a_stop(gpt2_model_dir):
    """fuzzing: completed by the max_tokens-th token, the text was cut but the reason stayed "length"
    (the scheduler had finished the request in the same step); vLLM says "stop"."""
    from kvserve import LLM

    llm = LLM(str(gpt2_model_dir), num_blocks=32)
    prompt = "The quick brown fox"
    for n in (9, 15, 24):
        text = llm.generate(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        text = text[0].outputs[0].text
        # the shortest suffix that first occurs at the end: the n-th token completes it
        stop = next(
            text[-k:] for k in range(1, len(text) + 1) if text.find(text[-k:]) == len(text) - k
        )
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, stop=[stop])
        out = llm.generate(prompt, params)[0].outputs[0]
        assert out.text == text[: -len(stop)]
        assert (out.finish_reason, out.stop_reason) == ("stop", stop), (n, stop)
        assert len(out.token_ids) == n
    assert llm.engine.num_free_blocks() == 32


def test_a_stop_string_keeps_the_tokens_up_to_the_one_completing_it(tokenizer):
    """Several tokens at once (a speculative step): `num_used` counts those up to the stop string."""
    ids = tokenizer.encode(" alpha beta gamma delta")
    detok = IncrementalDetokenizer(
        tokenizer, tuple(tokenizer.encode("Say:")), SamplingParams(stop=["beta"])
    )
    assert detok.update(ids, finished=False) == " alpha "
    assert detok.stopped and detok.num_used == 2  # " alpha", " beta"
    plain = IncrementalDetokenizer(tokenizer, (), SamplingParams())
    plain.update(ids, finished=False)
    assert plain.num_used == len(ids)


@pytest.fixture(scope="module")
def metaspace_tokenizer(tmp_path_factory):
    """A SentencePiece-style tokenizer (Metaspace "▁" word starts, byte fallback), as Llama 2 and Mistral
    use: decoding a token on its own drops its leading space, so streaming must keep context."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    tok.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)
    ])  # fmt: skip
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"])
    corpus = [
        "the quick brown fox jumps over the lazy dog",
        "hello world, said the café owner",
    ] * 50
    tok.train_from_iterator(corpus, trainer)
    spec = json.loads(tok.to_str())  # byte pieces join the model's own vocabulary, as in Llama 2
    vocab = spec["model"]["vocab"]
    for i in range(256):
        vocab.setdefault(f"<0x{i:02X}>", len(vocab))
    tok = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")  # fmt: skip


def test_metaspace_streaming_keeps_word_spaces(metaspace_tokenizer):
    tok = metaspace_tokenizer
    assert (
        tok.decode(tok.encode("the fox", add_special_tokens=False)[1:]) == "fox"
    )  # space dropped alone
    text = "the quick fox said hello to the café 🙂 owner"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(
        tok, tuple(tok.encode("Say:", add_special_tokens=False)), SamplingParams()
    )
    deltas = [detok.update([t], finished=i == len(ids) - 1) for i, t in enumerate(ids)]
    assert "".join(deltas) == " " + tok.decode(ids)  # a continuation after the prompt starts a word
    assert all("\ufffd" not in d for d in deltas)


def _reference_holdback(text: str, stops) -> int:
    """The definition, by brute force: the longest suffix of text that is a proper prefix of a stop."""
    return max(
        (n for s in stops for n in range(1, len(s)) if len(text) >= n and text.endswith(s[:n])),
        default=0,
    )


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc", max_size=30),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=6), min_size=1, max_size=5),
)
def test_holdback_and_stop_search_match_their_definitions(text, stops):
    """The windowed regex search equals the brute-force definitions of hold-back and first stop."""

    class Chars:  # a "tokenizer" whose token ids are characters: text arrives one character a token
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(i) for i in ids)

    detok = IncrementalDetokenizer(Chars(), (), SamplingParams(stop=stops))
    released = ""
    for i, ch in enumerate(text):
        released += detok.update([ord(ch)], finished=False)
        if detok.stopped:
            break
        assert len(detok.text) - len(released) == _reference_holdback(text[: i + 1], stops)
    # Streaming stops at the first stop string to complete, cut at its (earliest) start.
    ends = [i for i in range(1, len(text) + 1) if any(s in text[:i] for s in stops)]
    if not ends:
        assert not detok.stopped and detok.text == text
    else:
        seen = text[: ends[0]]
        assert detok.stopped and detok.text == text[: min(seen.find(s) for s in stops if s in seen)]


@pytest.mark.parametrize("stop_at", [None, 9000, 20_000])
def test_a_long_output_keeps_a_bounded_tail_and_the_same_text(stop_at):
    """n tokens cost O(n): the detokenizer drops released text and ids it can no longer need, and
    what it releases (stop strings found anywhere, hold-back at the end) is unchanged."""

    class Chars:  # one character a token
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(i) for i in ids)

    body = "".join("abcdefg "[i % 7 + (i // 7) % 2] for i in range(20_000))
    text = body if stop_at is None else body[:stop_at] + "XYZ!" + body[stop_at:]
    detok = IncrementalDetokenizer(Chars(), (), SamplingParams(stop=["XYZ!", "qq"]))
    released, largest = [], 0
    for i, ch in enumerate(text):
        released.append(detok.update([ord(ch)], finished=i == len(text) - 1))
        largest = max(largest, len(detok.text), len(detok._ids))
        if detok.stopped:
            break
    expected = text if stop_at is None else text[:stop_at]
    assert "".join(released) == expected
    assert detok.stopped == (stop_at is not None)
    assert largest <= 2 * 4096 + 8  # _TRIM_AT twice at most, not the whole 20,000 characters


def test_n_samples_with_a_stop_string_keep_tokens_text_and_logprobs_aligned(gpt2_model_dir):
    """n > 1 with logprobs: each sample ends at the token completing the stop string, and its token
    ids, logprobs and text are the free run's, cut there (the oracle: the same request without it)."""
    from kvserve import LLM

    llm = LLM(str(gpt2_model_dir), num_blocks=32)
    params = SamplingParams(n=2, max_tokens=20, temperature=0, ignore_eos=True, logprobs=1)
    free_run = llm.generate("The quick brown fox", params)[0].outputs
    text = free_run[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    stopped = llm.generate("The quick brown fox", params.with_updates(stop=(stop,)))[0].outputs
    assert [o.index for o in stopped] == [0, 1]
    for free, out in zip(free_run, stopped, strict=True):
        assert out.text == free.text[: free.text.find(stop)]
        assert (out.finish_reason, out.stop_reason) == ("stop", stop)
        num = len(out.token_ids)
        assert out.token_ids == free.token_ids[:num] and num < len(free.token_ids)
        decode = llm.tokenizer.decode
        assert stop in decode(out.token_ids) and stop not in decode(out.token_ids[:-1])
        assert [lp.token_id for lp in out.logprobs] == list(out.token_ids)
    llm.engine.check_invariants()
    assert llm.engine.num_free_blocks() == 32
