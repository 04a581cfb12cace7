"""`kvserve generate`'s sampling flags are SamplingParams' declarations (kvserve/core/options.py):
each flag's help, type and bound are the field's, its default the field's or one of generate's
declared overrides (`SAMPLING_DEFAULTS`), and a value out of bound is refused before the model
loads."""

from __future__ import annotations

import argparse
import ast
import math

import pytest

from kvserve.cli import build_parser, finite_float, main
from kvserve.cli import generate as generate_cli
from kvserve.core.errors import InvalidRequestError
from kvserve.core.options import declared, flag_of, value_type, values_from_cli
from kvserve.core.sampling_params import SamplingParams
from tests import REPO_ROOT

SAMPLING_FLAGS = {
    "--max-tokens",
    "--temperature",
    "--top-k",
    "--top-p",
    "--sample-seed",
    "--ignore-eos",
    "--stop",
}


def _generate_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices["generate"]


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["generate", "--prompt", "p", *argv])


def _sampling(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(**values_from_cli(SamplingParams, args, generate_cli._SAMPLING_DEST))


def test_each_sampling_flag_is_a_declared_field():
    """The flags are exactly the declared fields; each flag's help and default are the
    declaration's (or generate's override), its type the field's."""
    parser = _generate_parser()
    by_flag = {s: a for a in parser._actions for s in a.option_strings}
    declared_flags = {flag_of(f) for f, _ in declared(SamplingParams)}
    assert declared_flags == SAMPLING_FLAGS
    for f, spec in declared(SamplingParams):
        action = by_flag[flag_of(f)]
        assert action.dest == generate_cli._SAMPLING_DEST + f.name
        assert action.help.removesuffix(" (default: %(default)s)") == spec.help
        default = generate_cli.SAMPLING_DEFAULTS.get(f.name, f.default)
        assert action.default == (list(default) if isinstance(default, tuple) else default)
        kind, _, repeated = value_type(f)
        if kind is not bool:
            # build_parser gives every float flag finite_float (no nan, no inf)
            assert action.type is (finite_float if kind is float else kind)
            assert isinstance(action, argparse._AppendAction) == repeated


def test_generate_overrides_only_what_differs():
    """generate's own defaults are named once, and each differs from the dataclass's (an override
    equal to the declared default would be a second copy of it)."""
    fields_by_name = {f.name: f for f, _ in declared(SamplingParams)}
    assert generate_cli.SAMPLING_DEFAULTS == {"max_tokens": 64, "temperature": 0.0}
    for name, value in generate_cli.SAMPLING_DEFAULTS.items():
        assert fields_by_name[name].default != value
    assert _sampling(_parse()) == SamplingParams(max_tokens=64, temperature=0.0)


def test_generate_spells_no_sampling_flag_by_hand():
    tree = ast.parse((REPO_ROOT / "kvserve" / "cli" / "generate.py").read_text(encoding="utf-8"))
    spelled = {
        node.value
        for call in ast.walk(tree)
        if isinstance(call, ast.Call) and getattr(call.func, "attr", None) == "add_argument"
        for node in call.args
        if isinstance(node, ast.Constant)
    }
    assert spelled == {"--model", "--prompt", "--json", "--inject-fault"}


def test_the_flags_set_their_fields_and_the_sample_seed_is_not_the_engine_seed():
    args = _parse(
        "--max-tokens", "5", "--temperature", "0.5", "--top-k", "-1", "--top-p", "0.9",
        "--sample-seed", "3", "--seed", "7", "--stop", "a", "--stop", "b", "--ignore-eos",
    )  # fmt: skip
    assert args.seed == 7  # the engine's --seed
    assert _sampling(args) == SamplingParams(
        max_tokens=5, temperature=0.5, top_k=0, top_p=0.9, seed=3, stop=("a", "b"), ignore_eos=True
    )


def _outside(f, bound: str, value):
    """The nearest value past the bound `bound` (ge, gt or le) = `value` of field `f`."""
    kind = value_type(f)[0]
    if bound == "gt":
        return value
    step = -1 if bound == "ge" else 1
    return value + step if kind is int else math.nextafter(value, step * math.inf)


_BOUNDS = [
    (f, bound, getattr(spec, bound))
    for f, spec in declared(SamplingParams)
    for bound in ("ge", "gt", "le")
    if getattr(spec, bound) is not None
]


@pytest.mark.parametrize("f, bound, value", _BOUNDS, ids=lambda x: getattr(x, "name", str(x)))
def test_a_declared_bound_is_the_one_validate_enforces(f, bound, value):
    """The declaration restates a bound of `_validate` (whose messages the API's errors keep): the
    value just past it is refused by the flag (naming the flag) and by the dataclass (naming the
    field); the bound itself (or, for `gt`, just past it) passes both."""
    inside = value if bound != "gt" else math.nextafter(value, math.inf)
    SamplingParams(**{f.name: inside})
    args = _parse()
    setattr(args, generate_cli._SAMPLING_DEST + f.name, inside)
    values_from_cli(SamplingParams, args, generate_cli._SAMPLING_DEST)

    outside = _outside(f, bound, value)
    with pytest.raises(InvalidRequestError) as exc:
        SamplingParams(**{f.name: outside})
    assert exc.value.param == f.name
    setattr(args, generate_cli._SAMPLING_DEST + f.name, outside)
    with pytest.raises(InvalidRequestError, match=f"^{flag_of(f)} must be") as exc:
        values_from_cli(SamplingParams, args, generate_cli._SAMPLING_DEST)
    assert exc.value.param == f.name


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
        (["--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
        (["--stop", ""], "stop strings must be non-empty"),  # _validate's own check
    ],
)
def test_a_bad_sampling_flag_is_refused_before_the_model_loads(monkeypatch, capsys, argv, message):
    from kvserve.engine.llm import LLM

    def no_model(*args, **kwargs):
        raise AssertionError("the model loaded before the sampling flags were checked")

    monkeypatch.setattr(LLM, "from_engine_args", no_model)
    assert main(["generate", "--model", "kvserve-demo", "--prompt", "x", *argv]) == 2
    err = capsys.readouterr().err
    assert f"kvserve generate: error: {message}" in err and "Traceback" not in err
