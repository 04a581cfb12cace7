"""Tool-call parsers on hand-written outputs: one call, several calls, text before a call, malformed JSON
left as content; streamed one character at a time, the deltas concatenate to the non-streamed result."""

from __future__ import annotations

import json

import pytest

from kvserve.server.tool_parsers import ToolCall, get_tool_parser, value_end
from kvserve.server.tools import ToolPlan, ToolStream

WEATHER = ToolCall("get_weather", '{"city": "Paris", "days": [1, {"x": "}</tool_call>"}]}')
TIME = ToolCall("get_time", '{"zone": "UTC"}')

CASES = {
    "hermes": {
        "one": (f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER.arguments}}}\n</tool_call>',
                None, [WEATHER]),
        "several": (f'<tool_call>{{"name": "get_weather", "arguments": {WEATHER.arguments}}}</tool_call>\n'
                    f'<tool_call>{{"name": "get_time", "arguments": {TIME.arguments}}}</tool_call>',
                    None, [WEATHER, TIME]),
        "text_before": (f'Let me look. <tool_call>{{"name": "get_time", "arguments": '
                        f"{TIME.arguments}}}</tool_call>", "Let me look. ", [TIME]),
        "malformed": ('Hi <tool_call>{"name": "get_time", "arguments": {"zone": }</tool_call>',
                      'Hi <tool_call>{"name": "get_time", "arguments": {"zone": }</tool_call>', []),
        "plain": ("No calls here, only <b>text</b>.", "No calls here, only <b>text</b>.", []),
    },
    "llama3_json": {
        "one": (f'{{"name": "get_weather", "parameters": {WEATHER.arguments}}}', None, [WEATHER]),
        "several": (f'<|python_tag|>{{"name": "get_weather", "parameters": {WEATHER.arguments}}}; '
                    f'{{"name": "get_time", "parameters": {TIME.arguments}}}', None, [WEATHER, TIME]),
        "text_before": (f'Sure. {{"name": "get_time", "parameters": {TIME.arguments}}}', "Sure. ",
                        [TIME]),
        "malformed": ('{"name": "get_time", "parameters": {"zone": "UTC"}',
                      '{"name": "get_time", "parameters": {"zone": "UTC"}', []),
        "plain": ("A set {1, 2} is not a call.", "A set {1, 2} is not a call.", []),
    },
    "mistral": {
        "one": (f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {WEATHER.arguments}}}]', None,
                [WEATHER]),
        "several": (f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {WEATHER.arguments}}}, '
                    f'{{"name": "get_time", "arguments": {TIME.arguments}}}]', None, [WEATHER, TIME]),
        "text_before": (f'Checking. [TOOL_CALLS]get_time[ARGS]{TIME.arguments}', "Checking. ", [TIME]),
        "malformed": ('[TOOL_CALLS] [{"name": "get_time", "arguments": {"zone" "UTC"}}]',
                      '[TOOL_CALLS] [{"name": "get_time", "arguments": {"zone" "UTC"}}]', []),
        "plain": ("Use [brackets] freely.", "Use [brackets] freely.", []),
    },
}  # fmt: skip
PARAMS = [(fmt, case) for fmt, cases in CASES.items() for case in cases]


@pytest.mark.parametrize("fmt, case", PARAMS)
def test_parse(fmt, case):
    text, content, calls = CASES[fmt][case]
    assert get_tool_parser(fmt).parse(text) == (content, calls)
    for call in calls:
        assert isinstance(json.loads(call.arguments), dict)


def stream(fmt: str, text: str, step: int = 1) -> tuple[str, list[tuple[str, str]], list[dict]]:
    s = ToolStream(ToolPlan((), "auto"), get_tool_parser(fmt))
    deltas = [s.delta(text[i : i + step], final=False) for i in range(0, len(text), step)]
    deltas.append(s.delta("", final=True))
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        for c in d.get("tool_calls", []):
            entry = calls.setdefault(c["index"], ["", ""])
            if "id" in c:
                assert c["id"].startswith("call_") and c["type"] == "function" and not entry[0]
                entry[0] = c["function"]["name"]
            entry[1] += c["function"]["arguments"]
    assert s.finish_reason("stop") == ("tool_calls" if calls else "stop")
    return content, [tuple(calls[i]) for i in sorted(calls)], deltas


@pytest.mark.parametrize("fmt, case", [p for p in PARAMS if p[1] != "malformed"])
@pytest.mark.parametrize("step", [1, 3, 7])
def test_streamed_deltas_concatenate_to_the_parse(fmt, case, step):
    text, content, calls = CASES[fmt][case]
    streamed_content, streamed_calls, _ = stream(fmt, text, step)
    assert streamed_content == (content or "")
    assert streamed_calls == [(c.name, c.arguments) for c in calls]


def test_arguments_stream_in_fragments_before_the_call_closes():
    text = f'<tool_call>{{"name": "get_weather", "arguments": {WEATHER.arguments}}}</tool_call>'
    _, _, deltas = stream("hermes", text)
    fragments = [c["function"]["arguments"] for d in deltas for c in d.get("tool_calls", [])]
    assert len([f for f in fragments if f]) > 10  # not one blob at the end
    first = next(c for d in deltas for c in d.get("tool_calls", []))
    assert first["index"] == 0 and first["function"]["name"] == "get_weather"


def test_malformed_call_announced_while_streaming_stays_a_call():
    text = '<tool_call>{"name": "get_time", "arguments": {"zone": }</tool_call>'
    content, calls, _ = stream("hermes", text)
    assert content == "" and calls == [("get_time", '{"zone": }')]


@pytest.mark.parametrize(
    "text, start, end",
    [('{"a": "}"} tail', 0, 10), ('x [1, [2]]', 2, 10), ('"s\\"q" ', 0, 6), ("12, 3", 0, 2),
     ('{"a": ', 0, None), ("12", 0, None)],
)  # fmt: skip
def test_value_end(text, start, end):
    assert value_end(text, start) == end


def test_arguments_written_as_a_string_holding_an_object_are_that_object():
    text = '<tool_call>{"name": "f", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>'
    _, calls = get_tool_parser("hermes").parse(text)
    assert calls == [ToolCall("f", '{"city": "Paris"}')]


@pytest.mark.parametrize("written", ['"x"', '"é \\"q\\""', '"5"', '"[1, 2]"', '"null"', "[1, 2]"])
def test_arguments_that_are_no_object_leave_the_text_as_content(written):
    """Review: "5" or "x" became a call whose arguments the server then refused when the client
    sent the assistant message back (arguments must be a JSON object): not a call, but text."""
    text = f'<tool_call>{{"name": "f", "arguments": {written}}}</tool_call>'
    content, calls = get_tool_parser("hermes").parse(text)
    assert calls == [] and written in content
    content, calls, _ = stream("hermes", text)  # streamed: not announced as a call either
    assert calls == [] and written in content


def test_parameters_are_an_object_schema():
    """fuzzing: {"type": "string"} (or {}) let a forced call's grammar write a string as the arguments."""
    from kvserve.core.errors import InvalidRequestError
    from kvserve.server.tools import _check_tool

    def tool(parameters):
        return {"type": "function", "function": {"name": "f", "parameters": parameters}}

    assert _check_tool(tool({}), 0)["function"]["parameters"] == {"type": "object"}
    untyped = {"properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert _check_tool(tool(untyped), 0)["function"]["parameters"] == {"type": "object", **untyped}
    for bad in ({"type": "string"}, {"type": ["object", "null"]}, {"type": "array"}):
        with pytest.raises(InvalidRequestError, match="of type 'object'") as info:
            _check_tool(tool(bad), 3)
        assert info.value.param == "tools[3].function.parameters"


CITY_TOOL = {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}  # fmt: skip


def _matcher(fmt: dict):
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from tests.checkpoints import GPT2_TOKENIZER

    info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(str(GPT2_TOKENIZER)))
    spec = json.dumps({"type": "structural_tag", "format": fmt})
    return xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_structural_tag(spec))


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral"])
def test_forced_parallel_calls_end_after_max_calls(name):
    """issue 46: `required` with parallel calls let the grammar go on calling forever (the demo model
    filled its context, and the response had no calls); it now ends after max_calls."""
    parser = get_tool_parser(name)
    fmt = parser.forced_format([CITY_TOOL], parallel=True, max_calls=3)
    one = _one_call_text(parser)
    for count in (1, 3):
        matcher = _matcher(fmt)
        assert matcher.accept_string(_calls_text(parser, [one] * count)), count
        assert matcher.is_completed()
    assert not _matcher(fmt).accept_string(_calls_text(parser, [one] * 4))  # a fourth: refused


def _one_call_text(parser) -> str:
    begin, end = parser._call_tag(CITY_TOOL)
    return begin + '{"city": "Paris"}' + end


def _calls_text(parser, calls: list[str]) -> str:
    body = parser.separator.join(calls)
    return f"{parser.marker}[{body}]" if parser.name == "mistral" else body


def test_a_reply_cut_by_length_keeps_its_complete_calls():
    parser = get_tool_parser("hermes")
    done = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    text = done + '<tool_call>{"name": "get_weather", "argu'
    content, calls = parser.parse(text, cut=True)
    assert calls == [ToolCall("get_weather", '{"city": "Paris"}')]
    assert content == '<tool_call>{"name": "get_weather", "argu'
    assert parser.parse(text) == (text, [])  # not cut: a malformed output is content, whole
