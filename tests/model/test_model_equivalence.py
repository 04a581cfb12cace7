"""kvserve against transformers, the reference implementation, for every supported architecture."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from tests.checkpoints import ARCHS
from tests.oracle import assert_logits_close, assert_same_tokens

PROMPT = [5, 17, 99, 3, 42, 7, 7, 120, 64, 33, 250, 11, 9, 1, 77, 200, 18, 30, 31, 4]


@pytest.fixture(scope="module", params=sorted(ARCHS))
def arch_pair(request, checkpoints):
    model_dir, hf_model = checkpoints[request.param]
    return request.param, LLM(str(model_dir), num_blocks=64, block_size=16), hf_model


def test_logits_match_transformers(arch_pair):
    arch, llm, hf_model = arch_pair
    with torch.no_grad():
        expected = hf_model(torch.tensor([PROMPT])).logits[0]
    actual = llm.engine.score(PROMPT)
    assert_logits_close(actual, expected, atol=1e-4, what=arch)


def test_greedy_generation_matches_transformers(arch_pair):
    arch, llm, hf_model = arch_pair
    hf_model.generation_config.eos_token_id = None  # 64 tokens, whatever they are
    hf_model.generation_config.pad_token_id = 0
    with torch.no_grad():
        generated = hf_model.generate(
            torch.tensor([PROMPT]),
            max_new_tokens=64,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    expected = generated.sequences[0, len(PROMPT) :].tolist()
    expected_logits = torch.stack(generated.logits)[:, 0]
    output = llm.generate([PROMPT], SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))[
        0
    ]
    assert len(output.outputs[0].token_ids) == 64
    assert_same_tokens(output.outputs[0].token_ids, expected, expected_logits, what=arch)
    llm.engine.check_invariants()
    assert llm.engine.num_free_blocks() == llm.engine.num_blocks


def test_unknown_architecture_is_a_clear_error(tmp_path, llama_dir):
    import json
    import shutil

    from kvserve.core.errors import UnsupportedModelError

    for item in llama_dir.iterdir():
        shutil.copy(item, tmp_path / item.name)
    config = json.loads((tmp_path / "config.json").read_text())
    config["model_type"] = "gpt_neox"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        UnsupportedModelError,
        match="gpt_neox.*supported: gemma3_text, llama, mistral, qwen2, qwen3",
    ):
        LLM(str(tmp_path), num_blocks=8)


def test_repetition_penalty_matches_transformers(checkpoints):
    """HF's RepetitionPenaltyLogitsProcessor is the oracle: divide positive logits, multiply negative
    ones, over every token already in the sequence (prompt and output)."""
    model_dir, hf_model = checkpoints["llama"]
    hf_model.generation_config.eos_token_id = None
    hf_model.generation_config.pad_token_id = 0
    with torch.no_grad():
        generated = hf_model.generate(
            torch.tensor([PROMPT]), max_new_tokens=32, do_sample=False, repetition_penalty=1.5
        )
    expected = generated[0, len(PROMPT) :].tolist()
    llm = LLM(str(model_dir), num_blocks=64)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, repetition_penalty=1.5)
    assert llm.generate([PROMPT], params)[0].outputs[0].token_ids == expected
