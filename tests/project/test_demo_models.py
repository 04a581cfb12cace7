"""The embedded demonstration models: they load in transformers and in kvserve with matching logits, share
one tokenizer (so the draft can speculate for the target). The default model is the real SmolLM2 instead
(tests/gguf/test_gguf_smollm2.py holds it to transformers); here it answers the README's question."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.models import ASSETS_DIR, default_model_dir, resolve_model
from tests.oracle import assert_logits_close

PROMPTS = {
    "code": 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n',
    "prose": "And God said, Let there be light: and there was light. And God saw the light,",
}


@pytest.mark.parametrize("name", ["target", "draft"])
def test_demo_model_logits_match_transformers(name):
    from transformers import AutoModelForCausalLM

    model_dir = ASSETS_DIR / name
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(str(model_dir), num_blocks=64)
    for kind, text in PROMPTS.items():
        ids = llm.tokenizer.encode(text)
        with torch.no_grad():
            expected = hf_model(torch.tensor([ids])).logits[0]
        assert_logits_close(llm.engine.score(ids), expected, 1e-4, f"{name} on {kind}")


def test_default_model_is_smollm2_and_answers():
    assert default_model_dir() == resolve_model("smollm2-135m-instruct")
    llm = LLM(num_blocks=64)
    assert llm.engine.config.model_dir == str(default_model_dir())
    prompt = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True,
        tokenize=False,
    )  # fmt: skip
    output = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0))[0].outputs[0]
    assert "Paris" in output.text and output.finish_reason == "stop"


def test_draft_speculates_for_the_target_exactly():
    target, draft = str(ASSETS_DIR / "target"), str(ASSETS_DIR / "draft")
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    plain = LLM(target, num_blocks=64).generate(PROMPTS["code"], params)[0].outputs[0]
    spec = LLM(target, num_blocks=64, speculative_model=draft, num_speculative_tokens=4)
    output = spec.generate(PROMPTS["code"], params)[0].outputs[0]
    assert output.token_ids == plain.token_ids
    assert output.num_spec_accepted > 0, (
        "trained on the same text, the draft should agree sometimes"
    )


def test_assets_are_small():
    total = sum(p.stat().st_size for p in ASSETS_DIR.rglob("*") if p.is_file())
    assert total < 60e6, f"embedded models take {total / 1e6:.1f} MB"
    for name in ("target", "draft"):
        assert (ASSETS_DIR / name / "README.md").is_file(), "every model ships a model card"
