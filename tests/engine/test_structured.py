"""Structured output through xgrammar: sampled documents parse and validate, constraints stay per request,
bad constraints are 400s, and speculation respects the grammar."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from kvserve import LLM, SamplingParams
from kvserve.core.errors import InvalidRequestError
from kvserve.core.sampling_params import StructuredOutput
from kvserve.structured.schema import lookahead_at, refuse_unenforceable_schema
from tests.server_utils import running_server

SCHEMAS = {
    "nested_object": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 999},
                    "tag": {"type": "string", "maxLength": 6},
                },
                "required": ["id", "tag"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
        "additionalProperties": False,
    },
    "array_min_max_items": {
        "type": "object",
        "properties": {
            "scores": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "minItems": 2,
                "maxItems": 4,
            }
        },
        "required": ["scores"],
        "additionalProperties": False,
    },
    "enum_and_bounded_integer": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "level": {"type": "integer", "minimum": -5, "maximum": 5},
        },
        "required": ["color", "level"],
        "additionalProperties": False,
    },
    "string_pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
        "required": ["code"],
        "additionalProperties": False,
    },
}
REGEX = r"(yes|no), [a-z]{2,5} [0-9]{1,3}"
CHOICES = ["alpha", "beta gamma", "δέλτα"]


@pytest.fixture(scope="module")
def llm(gpt2_model_dir):
    return LLM(str(gpt2_model_dir), max_model_len=512, num_blocks=512)


def sample_20(llm, structured: StructuredOutput, prompt: str = "Output:") -> list:
    params = [
        SamplingParams(max_tokens=64, temperature=1.0, seed=seed, structured=structured)
        for seed in range(20)
    ]
    return [o.outputs[0] for o in llm.generate([prompt] * 20, params)]


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_sampled_json_validates(llm, name):
    schema = SCHEMAS[name]
    completions = sample_20(llm, StructuredOutput("json_schema", json.dumps(schema)))
    complete = [c for c in completions if c.finish_reason != "length"]
    assert len(complete) >= 10, "most documents should finish within 64 tokens"
    for c in completions:
        assert c.structured_complete == (c.finish_reason == "stop")
    for c in complete:
        jsonschema.validate(json.loads(c.text), schema)


def test_sampled_regex_and_choice_match(llm):
    for c in sample_20(llm, StructuredOutput("regex", REGEX)):
        if c.finish_reason != "length":
            assert re.fullmatch(REGEX, c.text), c.text
    texts = [c.text for c in sample_20(llm, StructuredOutput("choice", json.dumps(CHOICES)))]
    assert set(texts) <= set(CHOICES) and len(set(texts)) > 1


def test_choices_outside_the_basic_plane_come_out_whole(llm):
    """fuzzing: a choice with an emoji reached the grammar as two UTF-16 surrogate escapes, and the output
    was six U+FFFD with `complete` true. Each sample must be one of the choices, byte for byte."""
    choices = ["😀", "ok 😀", "漢字 \U0001f680", 'é\n"q\\']
    texts = [c.text for c in sample_20(llm, StructuredOutput("choice", json.dumps(choices)))]
    assert set(texts) <= set(choices) and len(set(texts)) > 1, texts


def test_json_object_and_grammar(llm):
    completed = [
        c for c in sample_20(llm, StructuredOutput("json_object")) if c.finish_reason != "length"
    ]
    # A random model rarely closes a document by chance: biasing the braces (the grammar allows `}` only
    # where the object may end) makes completed documents certain, so the check always runs.
    braces = {llm.tokenizer.encode(b)[-1]: 100.0 for b in "{}"}
    biased = [
        SamplingParams(max_tokens=64, temperature=1.0, seed=seed, logit_bias=braces,
                       structured=StructuredOutput("json_object"))
        for seed in range(10)
    ]  # fmt: skip
    outputs = [o.outputs[0] for o in llm.generate(["Output:"] * 10, biased)]
    completed += [c for c in outputs if c.finish_reason != "length"]
    assert len(completed) >= 10, [c.text for c in completed]
    for c in completed:
        assert isinstance(json.loads(c.text), dict), c.text
    ebnf = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    for c in sample_20(llm, StructuredOutput("grammar", ebnf)):
        if c.finish_reason != "length":
            assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", c.text), c.text


def test_constraints_apply_per_request(llm):
    prompts = ["The weather today", "Output:", "Once upon", "Output:"]
    free = [
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.9, seed=5, ignore_eos=True),
    ]
    alone = [o.outputs[0].token_ids for o in llm.generate([prompts[0], prompts[2]], free)]
    constrained = SamplingParams(
        max_tokens=40, temperature=1.0, seed=1,
        structured=StructuredOutput("json_schema", json.dumps(SCHEMAS["string_pattern"])),
    )  # fmt: skip
    mixed = llm.generate(prompts, [free[0], constrained, free[1], constrained])
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == alone
    for i in (1, 3):
        if mixed[i].outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(mixed[i].outputs[0].text), SCHEMAS["string_pattern"])


@pytest.mark.parametrize(
    "structured, fragment",
    [
        (StructuredOutput("json_schema", '{"type": "nonsense"}'), "Unsupported type"),
        (StructuredOutput("json_schema", "{not json"), "json_schema"),
        (StructuredOutput("regex", "a(b"), "parenthesis is not closed"),
        (StructuredOutput("grammar", 'root ::= "a" | '), "EBNF parser error"),
        # xgrammar drops a schema pattern's lookahead (it let "x" through "(?!x)."): refused as the regex is.
        (
            StructuredOutput("json_schema", '{"type": "string", "pattern": "(?!x)."}'),
            "the pattern '(?!x).' at /pattern has a lookahead at position 0",
        ),
        (StructuredOutput("regex", "(?!x)."), "Lookahead is not supported"),
        # xgrammar let an external $ref's value be any JSON (a warning in its log only)
        (
            StructuredOutput(
                "json_schema", '{"type": "object", "properties": {"a": {"$ref": "other.json#/x"}}}'
            ),
            "the $ref 'other.json#/x' at /properties/a is not local",
        ),
        (
            StructuredOutput("json_schema", '{"$ref": "https://example.com/s.json"}'),
            "the $ref 'https://example.com/s.json' at / is not local",
        ),
        # grammars no output satisfies: served, they gave "" with complete: false
        (StructuredOutput("grammar", 'root ::= x\nx ::= x "a"'), "it matches no string"),
        (StructuredOutput("regex", "[^\\x00-\\U0010FFFF]"), "it matches no string"),
    ],
)
def test_invalid_constraints_are_typed_errors(llm, structured, fragment):
    with pytest.raises(InvalidRequestError, match=re.escape(fragment)):
        llm.generate(["x"], SamplingParams(max_tokens=4, structured=structured))
    assert llm.engine.num_free_blocks() == 512


def test_lookahead_patterns_are_found_where_a_schema_has_patterns():
    assert [lookahead_at(p) for p in ["(?=a)b", "a(?!b)", r"\(?=a", "[(?=]", "[]?!(]x", "[^]](?=a)", "ab"]] == [
        0, 1, None, None, None, 4, None,
    ]  # fmt: skip
    for schema, where in [
        ({"properties": {"a": {"items": {"pattern": "(?=x)"}}}}, "/properties/a/items/pattern"),
        ({"patternProperties": {"^(?!_)": {}}}, "/patternProperties"),
        ({"propertyNames": {"pattern": "(?!_)"}}, "/propertyNames/pattern"),
        ({"anyOf": [{}, {"pattern": "a(?=b)"}]}, "/anyOf/1/pattern"),
        ({"$defs": {"t": {"pattern": "(?!x)"}}}, "/$defs/t/pattern"),
        # review: properties named like data keywords are schemas, not data
        ({"properties": {"default": {"pattern": "(?!x)."}}}, "/properties/default/pattern"),
        ({"$defs": {"enum": {"pattern": "(?=a)"}}}, "/$defs/enum/pattern"),
    ]:
        with pytest.raises(ValueError, match=re.escape(f"at {where} has a lookahead")):
            refuse_unenforceable_schema(schema)
    # Local references pass; a $ref inside data is data.
    refuse_unenforceable_schema({"$ref": "#", "properties": {"a": {"$ref": "#/$defs/t"}}})
    refuse_unenforceable_schema({"const": {"$ref": "http://x"}, "enum": [{"$ref": "y.json"}]})
    # Data keywords, a property named "pattern", and plain patterns pass.
    refuse_unenforceable_schema(
        {
            "properties": {"pattern": {"type": "string", "pattern": "^[a-z]+$"}},
            "const": {"pattern": "(?=x)"},
            "enum": [{"pattern": "(?!x)"}],
            "default": {"pattern": "(?!x)"},
            "examples": [{"pattern": "(?!x)"}],
        }
    )


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_speculation_respects_the_grammar(gpt2_model_dir, method, tmp_path_factory):
    from tests.engine.test_spec_decode import speculative_llm

    draft = None
    if method == "draft":
        draft = gpt2_model_dir  # the target as its own draft: every proposal passes the model check
    spec = speculative_llm(gpt2_model_dir, draft, num_blocks=256)
    plain = LLM(str(gpt2_model_dir), max_model_len=512, num_blocks=256)
    structured = StructuredOutput("json_schema", json.dumps(SCHEMAS["enum_and_bounded_integer"]))
    greedy = SamplingParams(max_tokens=48, temperature=0, structured=structured)
    prompts = ["Output:", "JSON please", "{"]
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy)]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, greedy)] == expected
    sampled = spec.generate(prompts * 4, greedy.with_updates(temperature=1.0, seed=3))
    for output in sampled:
        if output.outputs[0].finish_reason == "stop":
            jsonschema.validate(
                json.loads(output.outputs[0].text), SCHEMAS["enum_and_bounded_integer"]
            )
    assert spec.engine.runner.spec_stats.num_proposed > 0
    assert spec.engine.num_free_blocks() == 256


@pytest.mark.slow
def test_server_structured_outputs(gpt2_model_dir):
    with running_server(gpt2_model_dir, "--max-model-len", "512", "--kv-cache-memory", "64MiB") as (
        url,
        _,
    ):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        schema = SCHEMAS["enum_and_bounded_integer"]
        chat = client.chat.completions.create(
            model=gpt2_model_dir.name, messages=[{"role": "user", "content": "Give JSON"}],
            max_tokens=40, temperature=1.0, seed=2,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        )  # fmt: skip
        assert chat.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(chat.choices[0].message.content), schema)
        assert chat.choices[0].model_extra["structured_output"] == {"complete": True}
        # a length cut is reported as incomplete
        cut = httpx.post(f"{url}/v1/completions", json={
            "prompt": "x", "max_tokens": 2, "structured_outputs": {"json": schema}}).json()  # fmt: skip
        assert cut["choices"][0]["finish_reason"] == "length"
        assert cut["choices"][0]["structured_output"] == {"complete": False}
        # vLLM's older names, streaming
        stream = httpx.post(f"{url}/v1/completions", json={
            "prompt": "x", "max_tokens": 20, "stream": True, "guided_choice": CHOICES}).text  # fmt: skip
        chunks = [json.loads(e[6:]) for e in stream.split("\n\n") if e.startswith("data: {")]
        assert "".join(ch["text"] for c in chunks for ch in c["choices"]) in CHOICES
        # invalid constraints: 400 with the library's message, and the server keeps serving
        for body in (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "nonsense"}},
                }
            },
            {"structured_outputs": {"regex": "a(b"}},
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            {"response_format": {"type": "xml"}},
        ):
            bad = httpx.post(f"{url}/v1/completions", json={"prompt": "x", **body})
            assert bad.status_code == 400, bad.text
            assert bad.json()["error"]["type"] == "invalid_request_error"
        ok = httpx.post(f"{url}/v1/completions", json={
            "prompt": "x", "max_tokens": 20, "structured_outputs": {"regex": "[ab]{3}"}}).json()  # fmt: skip
        assert re.fullmatch("[ab]{3}", ok["choices"][0]["text"])
        metrics = httpx.get(f"{url}/metrics").text
        assert "kvserve_grammar_compile_seconds_count" in metrics
        mask_count = [line for line in metrics.splitlines()
                      if line.startswith("kvserve_grammar_mask_seconds_count")]  # fmt: skip
        assert float(mask_count[0].split()[-1]) > 0


def test_json_strings_never_hold_raw_control_characters(llm):
    """xgrammar 0.2.9 lets length-bounded JSON strings take raw control characters; the engine bans
    those tokens for JSON grammars. Biasing the model hard towards tab and newline tokens must still
    give documents that a strict JSON parser accepts."""
    tokenizer = llm.tokenizer
    controls = [tokenizer.convert_tokens_to_ids(t) for t in ("ĉ", "Ċ")]  # byte-level "\t", "\n"
    assert tokenizer.decode(controls) == "\t\n"
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 10}},
              "required": ["s"], "additionalProperties": False}  # fmt: skip
    params = SamplingParams(
        max_tokens=30, temperature=0, logit_bias={t: 100.0 for t in controls},
        structured=StructuredOutput("json_schema", json.dumps(schema)),
    )  # fmt: skip
    completion = llm.generate(["x"], params)[0].outputs[0]
    assert completion.finish_reason == "stop"
    jsonschema.validate(json.loads(completion.text), schema)


def test_parallel_samples_each_follow_the_grammar(llm):
    schema = SCHEMAS["enum_and_bounded_integer"]
    params = SamplingParams(
        n=3, max_tokens=40, temperature=1.0, seed=4,
        structured=StructuredOutput("json_schema", json.dumps(schema)),
    )  # fmt: skip
    output = llm.generate(["Output:"], params)[0]
    assert len(output.outputs) == 3
    for completion in output.outputs:
        if completion.finish_reason == "stop":
            jsonschema.validate(json.loads(completion.text), schema)
    assert len({c.text for c in output.outputs}) > 1
    assert llm.engine.num_free_blocks() == 512
