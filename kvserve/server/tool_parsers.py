"""Tool-call parsers: model output text -> content and OpenAI tool calls (docs/tools.md).

One parser per output format, chosen with `kvserve serve --tool-call-parser NAME`:

| name | format |
|---|---|
| hermes (Qwen 2.5, Hermes) | `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeated |
| llama3_json (Llama 3.1+) | `<|python_tag|>`? `{"name": ..., "parameters": {...}}`, several joined by `;` |
| mistral | `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` or `[TOOL_CALLS]name[ARGS]{...}` |

A parser's `scan(text, final)` is prefix-stable: the content and each call's name and argument text it
returns for a prefix of the output are prefixes of what it returns for the whole, so streaming emits only
the new part of each. `arguments` is the model's own JSON text of the arguments value (not a re-encoding),
so streamed fragments concatenate to the non-streamed string. A call whose JSON does not parse when it ends
is left in the content, unless streaming already announced it.

Each parser also gives the structural tag (xgrammar) that forces its syntax for `tool_choice` `required` or
a named function, with the arguments constrained by the function's JSON schema.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

_NAME_PREFIX = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(arguments|parameters)"\s*:\s*'
)
_ARGS_KEY = re.compile(r'"(arguments|parameters)"\s*:\s*')
_SCALAR = re.compile(r"-?\d+(\.\d+)?([eE][-+]?\d+)?|true|false|null")


# Forced parallel calls (tool_choice "required"): at most this many in one response, unless the
# server's --max-parallel-tool-calls says otherwise (docs/tools.md).
DEFAULT_MAX_PARALLEL_CALLS = 4


def _const(text: str) -> dict:
    return {"type": "const_string", "value": text}


@dataclass(frozen=True)
class CallView:
    """A tool call as far as the text shows it: name once known, the argument text so far."""

    name: str | None
    arguments: str
    done: bool
    valid: bool = True


@dataclass
class Scan:
    content: str = ""
    calls: list[CallView] = field(default_factory=list)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text


def value_end(text: str, start: int) -> int | None:
    """End index of the JSON value starting at `start`, or None while it is incomplete."""
    if start >= len(text):
        return None
    if text[start] not in '{["':
        match = _SCALAR.match(text, start)
        return match.end() if match and match.end() < len(text) else None
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if depth == 0:
                    return i + 1
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def call_view(body: str, done: bool) -> CallView:
    """View of one `{"name": ..., "arguments": ...}` object; `done`: the text of it is complete."""
    if done:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return CallView(None, body, True, valid=False)
        key = "arguments" if isinstance(obj, dict) and "arguments" in obj else "parameters"
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or key not in obj:
            return CallView(None, body, True, valid=False)
        args = obj[key]
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                inner = json.loads(args)
            except (json.JSONDecodeError, RecursionError):
                inner = None
            # only an object is a call's arguments: anything else stays content, as the server
            # refuses other arguments when a client sends the call back
            if not isinstance(inner, dict):
                return CallView(None, body, True, valid=False)
            return CallView(obj["name"], args, True)
        if not isinstance(args, dict):
            return CallView(None, body, True, valid=False)
        match = _ARGS_KEY.search(body)
        start = match.end()
        return CallView(obj["name"], body[start : value_end(body, start)], True)
    match = _NAME_PREFIX.match(body)
    if not match:
        return CallView(None, "", False)
    name = json.loads(f'"{match.group(1)}"')
    start = match.end()
    if start >= len(body) or body[start] != "{":
        # not an object yet: nothing is announced until the arguments open as one, or the whole
        # call is there (a string holding an object is a call; anything else stays content)
        return CallView(None, "", False)
    end = value_end(body, start)
    return CallView(name, body[start : end if end is not None else len(body)], False)


def holdback(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ToolParser(ABC):
    """Finds tool calls in one output format; see the module docstring."""

    name: str
    args_key = "arguments"

    @abstractmethod
    def scan(self, text: str, final: bool, started: int = 0) -> Scan:
        """Content and calls of `text`. `final`: the output has ended. Calls with index < `started`
        were announced while streaming and stay calls even if their JSON turns out invalid."""

    def parse(self, text: str, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
        """Non-streaming: (content or None, calls). An output with a call that does not parse is
        returned whole, as content; unless `cut` (ended by length): then the calls completed before
        the cut are calls and the cut one is content."""
        # started: keep malformed calls as calls, to see them (or, when cut, leave them as content)
        scan = self.scan(text, final=True, started=0 if cut else 1 << 30)
        if any(not c.valid or not c.name for c in scan.calls):
            return text, []
        calls = [ToolCall(c.name, c.arguments) for c in scan.calls if c.valid and c.name]
        content = scan.content
        if calls and not content.strip():
            content = None
        return content, calls

    def _call_tag(self, tool: dict) -> tuple[str, str]:
        """(begin, end) around a function's arguments in the forced syntax."""
        name = json.dumps(tool["name"])
        return f'{{"name": {name}, "{self.args_key}": ', "}"

    def _tags(self, tools: list[dict]) -> list[dict]:
        tags = []
        for tool in tools:
            begin, end = self._call_tag(tool)
            tags.append(
                {
                    "type": "tag",
                    "begin": begin,
                    "end": end,
                    "content": {
                        "type": "json_schema",
                        "json_schema": tool["parameters"],
                        "max_whitespace_cnt": 1,
                    },
                }
            )
        return tags

    separator = ""

    def forced_format(
        self, tools: list[dict], parallel: bool, max_calls: int = DEFAULT_MAX_PARALLEL_CALLS
    ) -> dict:
        """Structural-tag format: one call of one of `tools`, or with `parallel` one to
        `max_calls` calls. The bound makes the grammar end: unbounded, a model that never
        chooses EOS after a call (the demo model) emitted calls until the context was full, and the
        response had none (issue 46; docs/tools.md)."""
        one = {
            "type": "tags_with_separator",
            "tags": self._tags(tools),
            "separator": "",
            "at_least_one": True,
            "stop_after_first": True,
        }
        if not parallel:
            return one
        calls = one
        for _ in range(max_calls - 1):  # one call, then optionally (separator, calls)
            more = calls
            if self.separator:
                more = {"type": "sequence", "elements": [_const(self.separator), calls]}
            calls = {
                "type": "sequence",
                "elements": [one, {"type": "or", "elements": [_const(""), more]}],
            }
        return calls

    def _add_segment(self, scan: Scan, segment: str, final: bool) -> None:
        """Text outside calls is content; after a call, a whitespace-only run is dropped."""
        if not scan.calls:
            scan.content += segment
        elif segment.strip():
            scan.content += segment
        elif not final:
            pass  # held back: may be the separator before the next call

    def _add_call(self, scan: Scan, view: CallView, raw: str, started: int) -> None:
        if view.done and not view.valid and len(scan.calls) >= started:
            scan.content += raw  # malformed: leave it as the model wrote it
        else:
            scan.calls.append(view)


class HermesToolParser(ToolParser):
    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"

    def _call_tag(self, tool: dict) -> tuple[str, str]:
        begin, end = super()._call_tag(tool)
        return self.start + begin, end + self.end

    def scan(self, text: str, final: bool, started: int = 0) -> Scan:
        scan, pos = Scan(), 0
        while True:
            begin = text.find(self.start, pos)
            if begin == -1:
                tail = text[pos:]
                if not final:
                    tail = tail[: len(tail) - holdback(tail, self.start)]
                self._add_segment(scan, tail, final)
                return scan
            self._add_segment(scan, text[pos:begin], final)
            body_start = begin + len(self.start)
            close = self._close(text, body_start)
            body = text[body_start : close if close != -1 else len(text)]
            if close == -1 and not final:
                body = body[: len(body) - holdback(body, self.end)]
            raw = text[begin : close + len(self.end) if close != -1 else len(text)]
            self._add_call(scan, call_view(body.strip(), close != -1 or final), raw, started)
            if close == -1:
                return scan
            pos = close + len(self.end)

    def _close(self, text: str, body_start: int) -> int:
        """Where the call's end tag starts (-1: not yet); a JSON body is skipped whole, so an end tag
        inside a string argument does not end the call."""
        obj = len(text) - len(text[body_start:].lstrip())
        if obj < len(text) and text[obj] == "{":
            end = value_end(text, obj)
            if end is None:
                return -1
            after = len(text) - len(text[end:].lstrip())
            if self.end.startswith(text[after:]) and not text.startswith(self.end, after):
                return -1  # the end tag is still arriving
            return text.find(self.end, after)
        return text.find(self.end, body_start)


class _JSONSequenceParser(ToolParser):
    """Calls as JSON objects after a start (a marker, or the object itself), joined by a separator."""

    def _objects(
        self, scan: Scan, text: str, pos: int, final: bool, started: int, sep: str, close: str = ""
    ) -> int:
        """Scan objects from `pos`; returns where the sequence ended (len(text) if still open)."""
        while True:
            ws = len(text) - len(text[pos:].lstrip())
            pos = ws
            if pos >= len(text):
                return pos
            if close and text.startswith(close, pos):
                return pos + len(close)
            if text[pos] != "{":
                return pos
            end = value_end(text, pos)
            raw = text[pos : end if end is not None else len(text)]
            self._add_call(scan, call_view(raw, end is not None or final), raw, started)
            if end is None:
                return len(text)
            rest = text[end:]
            stripped = rest.lstrip()
            if stripped.startswith(sep.strip()) and sep.strip():
                pos = end + (len(rest) - len(stripped)) + len(sep.strip())
            else:
                pos = end
                if close or not stripped:
                    continue
                return pos


class Llama3JSONToolParser(_JSONSequenceParser):
    name = "llama3_json"
    args_key = "parameters"
    separator = "; "
    python_tag = "<|python_tag|>"
    _start = re.compile(r'<\|python_tag\|>|\{\s*"name"\s*:')

    def scan(self, text: str, final: bool, started: int = 0) -> Scan:
        scan = Scan()
        match = self._start.search(text)
        if match is None:
            tail = text
            if not final:  # hold back what could still become `{"name":` or the python tag
                cut = max(text.rfind("{"), text.rfind("<"))
                if cut != -1 and _could_start(text[cut:]):
                    tail = text[:cut]
            self._add_segment(scan, tail, final)
            return scan
        self._add_segment(scan, text[: match.start()], final)
        pos = match.start()
        if text.startswith(self.python_tag, pos):
            pos += len(self.python_tag)
        end = self._objects(scan, text, pos, final, started, self.separator)
        if end < len(text):
            self._add_segment(scan, text[end:], final)
        return scan


def _could_start(fragment: str) -> bool:
    squeezed = re.sub(r"\s+", "", fragment)
    return '{"name":'.startswith(squeezed) or "<|python_tag|>".startswith(fragment)


class MistralToolParser(_JSONSequenceParser):
    name = "mistral"
    marker, args_marker = "[TOOL_CALLS]", "[ARGS]"
    separator = ", "

    def forced_format(
        self, tools: list[dict], parallel: bool, max_calls: int = DEFAULT_MAX_PARALLEL_CALLS
    ) -> dict:
        calls = super().forced_format(tools, parallel, max_calls)
        return {
            "type": "sequence",
            "elements": [
                {"type": "const_string", "value": self.marker + "["},
                calls,
                {"type": "const_string", "value": "]"},
            ],
        }

    def scan(self, text: str, final: bool, started: int = 0) -> Scan:
        scan = Scan()
        begin = text.find(self.marker)
        if begin == -1:
            tail = text if final else text[: len(text) - holdback(text, self.marker)]
            self._add_segment(scan, tail, final)
            return scan
        self._add_segment(scan, text[:begin], final)
        pos = begin
        while text.startswith(self.marker, pos):
            pos += len(self.marker)
            rest = text[pos:].lstrip()
            pos = len(text) - len(rest)
            if rest.startswith("["):
                pos = self._objects(scan, text, pos + 1, final, started, ",", close="]")
            else:
                pos = self._named(scan, text, pos, final, started)
            if pos >= len(text):
                return scan
        tail = text[pos:]
        if not final:
            tail = tail[: len(tail) - holdback(tail, self.marker)]
        self._add_segment(scan, tail, final)
        return scan

    def _named(self, scan: Scan, text: str, pos: int, final: bool, started: int) -> int:
        """`name[ARGS]{...}` (Mistral's v11 tokenizer format)."""
        mark = text.find(self.args_marker, pos)
        if mark == -1:
            if final:
                self._add_call(scan, CallView(None, "", True, False), text[pos:], started)
            return len(text)
        name = text[pos:mark].strip()
        start = mark + len(self.args_marker)
        end = value_end(text, start)
        args = text[start : end if end is not None else len(text)]
        if end is None and final:
            view = CallView(name, args, True, valid=_parses(args))
        else:
            view = CallView(name, args, end is not None, valid=end is None or _parses(args))
        raw = text[pos - len(self.marker) : end if end is not None else len(text)]
        self._add_call(scan, view, raw, started)
        return end if end is not None else len(text)


def _parses(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesToolParser, Llama3JSONToolParser, MistralToolParser)
}
DEFAULT_FORCED_FORMAT = "hermes"  # forced calls when the server has no --tool-call-parser


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(
            f"unknown tool-call parser {name!r}; choose one of {sorted(TOOL_PARSERS)}"
        ) from None
