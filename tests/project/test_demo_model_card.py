"""The demo model card's training rounds: an export chained through --init-from keeps every round."""

from tools.demo_models.export import card_section, earlier_rounds, stage_text

FIRST = "- tokens seen: 8,192,000 (2,000 steps)\n- optimiser: AdamW"


def test_stage_names_follow_the_row_mix():
    assert stage_text({"mix": {"code": 3, "prose": 5}}) == "continued pre-training"
    assert stage_text({"mix": {"sft": 8}}) == "instruction tuning"
    assert stage_text({"mix": {"code": 2, "prose": 2, "sft": 4}}) == (
        "instruction tuning with pre-training rows"
    )
    assert stage_text({"mix": {"code": 3, "prose": 3, "sft": 2}}) == (
        "continued pre-training mixed with instruction pairs"
    )
    assert stage_text({}) == "continued pre-training"


def test_a_chain_of_exports_numbers_every_round_once():
    assert earlier_rounds("", {"mix": {"code": 1}}) == []
    second = "\n".join(earlier_rounds(FIRST, {"mix": {"code": 3, "prose": 5}}))
    assert second.count("Round 1 (pre-training; from the previous card):") == 1
    assert "Round 2 (started from those weights" in second
    card = f"# card\n\n## Training\n\n{second}\n- tokens seen: 2,457,600\n\n## Corpus\n\nx\n"
    third = "\n".join(
        earlier_rounds(card_section(card, "Training"), {"mix": {"sft": 4, "code": 4}})
    )
    for n in (1, 2, 3):
        assert third.count(f"Round {n} ") == 1, third
    assert "Round 3 (started from those weights, fp32, fresh optimizer; instruction tuning" in third
    assert FIRST in third and "2,457,600" in third
