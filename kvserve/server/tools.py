"""Tool calling for chat completions (docs/tools.md): the request's `tools` and `tool_choice`, the chat
template's view of tool messages, forced calls as a grammar, and tool calls in responses and streams.

- `none`: the tools are rendered (when the template can) and the output is plain content.
- `auto`: the template renders the tools; the server's `--tool-call-parser` finds calls in the output.
- `required` / a named function: decoding is constrained (xgrammar structural tag) to the parser's call
  syntax, with arguments valid against the function's `parameters` schema.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvserve.core.errors import InvalidRequestError
from kvserve.core.sampling_params import SamplingParams, StructuredOutput
from kvserve.server.tool_parsers import (
    DEFAULT_FORCED_FORMAT,
    DEFAULT_MAX_PARALLEL_CALLS,
    ToolParser,
    get_tool_parser,
)

_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_EMPTY_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request asks of tools. `choice`: none | auto | required | named."""

    tools: tuple[dict, ...]  # OpenAI tool objects: {"type": "function", "function": {...}}
    choice: str
    name: str | None = None  # the named function
    parallel: bool = True

    @property
    def functions(self) -> list[dict]:
        return [t["function"] for t in self.tools]

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "named")


def plan_tools(
    tools: list[dict] | None, tool_choice: Any, parallel: bool | None
) -> ToolPlan | None:
    """Validate `tools` / `tool_choice` / `parallel_tool_calls`; None when the request has no tools."""
    if tool_choice is not None and not tools and tool_choice != "none":
        raise InvalidRequestError("tool_choice needs `tools`", "tool_choice")
    if not tools:
        if parallel is not None:
            raise InvalidRequestError("parallel_tool_calls needs `tools`", "parallel_tool_calls")
        return None
    checked = tuple(_check_tool(tool, i) for i, tool in enumerate(tools))
    names = [t["function"]["name"] for t in checked]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tool function names must be unique", "tools")
    choice, name = _choice(tool_choice, names)
    return ToolPlan(checked, choice, name, True if parallel is None else parallel)


def _check_tool(tool: Any, index: int) -> dict:
    param = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise InvalidRequestError("only tools of type `function` are supported", f"{param}.type")
    function = tool.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidRequestError("a tool needs `function.name`", f"{param}.function")
    if not _FUNCTION_NAME.fullmatch(function["name"]):
        raise InvalidRequestError(
            "function names are 1-64 characters of a-z, A-Z, 0-9, _ and -", f"{param}.function.name"
        )
    parameters = function.get("parameters")
    if parameters is None:
        parameters = _EMPTY_PARAMETERS
    if not isinstance(parameters, dict):
        raise InvalidRequestError(
            "function.parameters must be a JSON schema object", f"{param}.function.parameters"
        )
    # Arguments are a JSON object (OpenAI refuses any other top-level type the same way): with
    # {"type": "string"} or {}, a forced call's grammar would let the model write `"arguments": "x"`,
    # and the client would get `x`, which is not JSON.
    if "type" not in parameters:
        parameters = {"type": "object", **parameters}
    elif parameters["type"] != "object":
        raise InvalidRequestError(
            f"function.parameters must be a JSON schema of type 'object', got type "
            f"{parameters['type']!r}",
            f"{param}.function.parameters",
        )
    if not isinstance(function.get("strict", False), bool):
        raise InvalidRequestError("function.strict must be a boolean", f"{param}.function.strict")
    unknown = set(function) - {"name", "description", "parameters", "strict"}
    if unknown:
        raise InvalidRequestError(
            f"unsupported function field {sorted(unknown)[0]!r}", f"{param}.function"
        )
    return {"type": "function", "function": {**function, "parameters": parameters}}


def _choice(tool_choice: Any, names: list[str]) -> tuple[str, str | None]:
    if tool_choice is None:
        return "auto", None
    if tool_choice in ("none", "auto", "required"):
        return tool_choice, None
    named = isinstance(tool_choice, dict) and tool_choice.get("type") == "function"
    if named and isinstance(function := tool_choice.get("function"), dict):  # else: the error below
        name = function.get("name")
        if name not in names:
            raise InvalidRequestError(
                f"tool_choice names function {name!r}, which is not in `tools`", "tool_choice"
            )
        return "named", name
    raise InvalidRequestError(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
        '{"name": ...}}',
        "tool_choice",
    )


# --- the chat template -------------------------------------------------------------------------------


def template_renders_tools(template: str) -> bool:
    """Whether a Jinja chat template reads the `tools` variable (Qwen 2.5, Llama 3.1, Mistral do)."""
    return re.search(r"\btools\b", template) is not None


def template_message(message, content: str, index: int) -> dict:
    """One message as chat templates expect it: tool calls with arguments as objects, tool results with
    their `tool_call_id`."""
    role = message.role
    param = f"messages[{index}]"
    if role not in _ROLES:
        raise InvalidRequestError(
            f"message role {role!r} is not supported ({', '.join(_ROLES)})", f"{param}.role"
        )
    entry: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
    if message.name is not None:
        entry["name"] = message.name
    if role == "tool":
        if not message.tool_call_id:
            raise InvalidRequestError(
                "a tool message needs `tool_call_id`", f"{param}.tool_call_id"
            )
        entry["tool_call_id"] = message.tool_call_id
    elif message.tool_call_id is not None:
        raise InvalidRequestError(
            "only tool messages carry `tool_call_id`", f"{param}.tool_call_id"
        )
    if message.tool_calls:
        if role != "assistant":
            raise InvalidRequestError("only assistant messages carry `tool_calls`", param)
        entry["tool_calls"] = [
            _template_call(c, f"{param}.tool_calls[{i}]") for i, c in enumerate(message.tool_calls)
        ]
    return entry


def _template_call(call: Any, param: str) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidRequestError("a tool call needs `function.name`", param)
    arguments = function.get("arguments")
    if arguments is None or arguments == "":  # none: as vLLM, no arguments
        arguments = {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            arguments = None
    if not isinstance(arguments, dict):  # "5" or "[1, 2]" must not reach the template
        raise InvalidRequestError(
            "tool call arguments must be a JSON object", f"{param}.function.arguments"
        )
    return {
        "id": call.get("id"),
        "type": "function",
        "function": {"name": function["name"], "arguments": arguments},
    }


def template_kwargs(plan: ToolPlan | None, template: str) -> dict:
    """`tools=` for apply_chat_template; a 400 when the request needs tools the template cannot show."""
    if plan is None:
        return {}
    if not template_renders_tools(template):
        if plan.choice == "none":
            return {}
        raise InvalidRequestError(
            "this model's chat template cannot render tools; start the server with "
            "--chat-template FILE (a template that reads `tools`) or send tool_choice none",
            "tools",
        )
    return {"tools": list(plan.tools)}


# --- decoding ----------------------------------------------------------------------------------------


def output_parser(plan: ToolPlan | None, parser_name: str | None) -> ToolParser | None:
    """The parser that reads this request's output, or None when it is plain content."""
    if plan is None or plan.choice == "none":
        return None
    if plan.choice == "auto" and parser_name is None:
        raise InvalidRequestError(
            'tool_choice "auto" needs the server started with --tool-call-parser NAME; '
            'send tool_choice "required" or a named function, or "none"',
            "tool_choice",
        )
    return get_tool_parser(parser_name or DEFAULT_FORCED_FORMAT)


def constrain(
    params: SamplingParams,
    plan: ToolPlan | None,
    parser: ToolParser | None,
    max_parallel_calls: int = DEFAULT_MAX_PARALLEL_CALLS,
):
    """Forced calls: decoding follows the parser's call syntax and each function's schema; parallel
    forced calls are at most `max_parallel_calls`, so the grammar ends."""
    if plan is None or not plan.forced or parser is None:
        return params
    if params.structured is not None:
        raise InvalidRequestError(
            "a forced tool call cannot be combined with another structured-output constraint",
            "tool_choice",
        )
    functions = plan.functions
    if plan.choice == "named":
        functions = [f for f in functions if f["name"] == plan.name]
    parallel = plan.parallel and plan.choice == "required"
    fmt = parser.forced_format(functions, parallel=parallel, max_calls=max_parallel_calls)
    tag = json.dumps({"type": "structural_tag", "format": fmt})
    return params.with_updates(structured=StructuredOutput("structural_tag", tag, "tools"))


# --- responses ---------------------------------------------------------------------------------------


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def finish_reason(plan: ToolPlan, has_calls: bool, reason: str | None) -> str | None:
    # OpenAI: "tool_calls" when the model called tools; a named tool_choice finishes with "stop".
    if has_calls and reason == "stop" and plan.choice != "named":
        return "tool_calls"
    return reason


def message(plan: ToolPlan, parser: ToolParser, text: str, reason: str | None) -> tuple[dict, str]:
    """Non-streaming: the assistant message with `tool_calls`, and the finish reason."""
    if reason not in ("stop", "length", None):  # aborted: no call to trust
        return {"role": "assistant", "content": text}, reason
    # cut by length: the calls completed before the cut are returned (they were null, issue 46), the
    # cut one stays content, and the finish reason stays "length"
    content, calls = parser.parse(text, cut=reason == "length")
    body: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        body["tool_calls"] = [
            {
                "id": call_id(),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c in calls
        ]
    return body, finish_reason(plan, bool(calls), reason)


@dataclass
class ToolStream:
    """Streaming: turns content deltas into content and `tool_calls` deltas, one per choice."""

    plan: ToolPlan
    parser: ToolParser
    text: str = ""
    content_sent: int = 0
    calls_sent: list[list[str]] = field(default_factory=list)  # per call: [id, arguments sent]

    def delta(self, new_text: str, final: bool) -> dict:
        self.text += new_text
        scan = self.parser.scan(self.text, final, started=len(self.calls_sent))
        out: dict[str, Any] = {}
        if len(scan.content) > self.content_sent:
            out["content"] = scan.content[self.content_sent :]
            self.content_sent = len(scan.content)
        deltas = []
        for index, call in enumerate(scan.calls):
            if index >= len(self.calls_sent):
                if call.name is None or (call.done and not call.valid):
                    break
                self.calls_sent.append([call_id(), ""])
                deltas.append(
                    {
                        "index": index,
                        "id": self.calls_sent[index][0],
                        "type": "function",
                        "function": {"name": call.name, "arguments": ""},
                    }
                )
            sent = self.calls_sent[index]
            if not call.valid or not call.arguments.startswith(sent[1]):
                continue  # announced, then malformed: what was sent stands
            fragment = call.arguments[len(sent[1]) :]
            if fragment:
                sent[1] = call.arguments
                if deltas and deltas[-1]["index"] == index:
                    deltas[-1]["function"]["arguments"] += fragment
                else:
                    deltas.append({"index": index, "function": {"arguments": fragment}})
        if deltas:
            out["tool_calls"] = deltas
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        return finish_reason(self.plan, bool(self.calls_sent), reason)
