"""What a chat request's `tools`, `tool_choice` and `parallel_tool_calls` ask for: the tools the chat template
shows the model, the grammar that forces a call (`required`, a named function), and the parser that reads the
calls back out of the output.

- `none` (or no tools): the template gets no tools and the output is plain content.
- `auto` (the default with tools): the model decides; calls are read with the server's `--tool-call-parser`.
- `required`: the grammar forces a JSON list of calls to the given tools, each with arguments valid for the
  tool's parameter schema (`json_list` parser); one call at most with `parallel_tool_calls: false`.
- a named function: the grammar forces that function's arguments, and the whole output is them.
"""

import json
from dataclasses import dataclass

from kvserve.engine.sampling_params import GrammarSpec
from kvserve.server.errors import bad_request
from kvserve.server.protocol import ChatCompletionRequest, ToolDefinition
from kvserve.server.tool_parsers import (
    ParsedOutput,
    StreamingToolCallParser,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    new_tool_call_id,
    tool_call_parser,
)

ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    template_tools: list[dict] | None  # as the chat template takes them; None: no tools shown
    grammar: GrammarSpec | None  # forces the calls of `required` and a named function
    parser: "ToolCallParser | None"  # None: the output is content only
    max_calls: int | None  # 1 with parallel_tool_calls false

    def parse(self, text: str) -> ParsedOutput:
        """A finished output's tool calls (at most `max_calls`) and the content beside them; all of it is content
        when there is no parser or no call."""
        if self.parser is None:
            return ParsedOutput(text, [])
        parsed = self.parser.parse(text)
        calls = parsed.tool_calls[: self.max_calls]
        return ParsedOutput(parsed.content if calls else text, calls)

    def reader(self) -> "ToolCallReader":
        return ToolCallReader(self)


class ToolCallReader:
    """One streamed output split into content and tool-call deltas as it arrives (calls past `max_calls` dropped)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.max_calls = plan.max_calls
        self.parser = plan.parser.streaming() if plan.parser is not None else None

    def feed(self, text: str, finished: bool) -> tuple[str, list[ToolCallDelta]]:
        if self.parser is None:
            return text, []
        content, calls = self.parser.feed(text)
        if finished:
            more_content, more_calls = self.parser.finish()
            content, calls = content + more_content, calls + more_calls
        return content, [call for call in calls if self.max_calls is None or call.index < self.max_calls]


def plan_tools(body: ChatCompletionRequest, configured_parser: str | None) -> ToolPlan:
    tools = body.tools or []
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise bad_request("tool_choice needs tools", param="tool_choice")
    if choice == "none":
        return ToolPlan(None, None, None, None)
    template_tools = [tool.model_dump(exclude_none=True) for tool in tools]
    max_calls = 1 if body.parallel_tool_calls is False else None
    if choice == "auto":
        if configured_parser is None:
            raise bad_request(
                'tool_choice "auto" needs a server started with --tool-call-parser (hermes, llama3_json); '
                'use "required" or a named function otherwise',
                param="tool_choice",
            )
        return ToolPlan(template_tools, None, tool_call_parser(configured_parser), max_calls)
    if choice == "required":
        return ToolPlan(template_tools, _required_grammar(tools, max_calls), tool_call_parser("json_list"), max_calls)
    named = next((tool for tool in tools if tool.function.name == choice.function.name), None)
    if named is None:
        raise bad_request(f"tool_choice names {choice.function.name!r}, which is not in tools", param="tool_choice")
    schema = named.function.parameters or ANY_OBJECT
    grammar = GrammarSpec("json_schema", json.dumps(schema), param="tools")
    return ToolPlan(template_tools, grammar, NamedCall(named.function.name), 1)


def _required_grammar(tools: list[ToolDefinition], max_calls: int | None) -> GrammarSpec:
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"enum": [tool.function.name]},
                "arguments": tool.function.parameters or ANY_OBJECT,
            },
            "required": ["name", "arguments"],
        }
        for tool in tools
    ]
    schema = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if max_calls is not None:
        schema["maxItems"] = max_calls
    return GrammarSpec("json_schema", json.dumps(schema), param="tools")


class NamedCall(ToolCallParser):
    """The output of a forced named function: all of it is the call's arguments."""

    name = "named"

    def __init__(self, function_name: str) -> None:
        self.function_name = function_name

    def parse(self, text: str) -> ParsedOutput:
        return ParsedOutput(None, [ToolCall(new_tool_call_id(), self.function_name, text)])

    def streaming(self) -> "StreamingToolCallParser":
        return _StreamingNamedCall(self.function_name)


class _StreamingNamedCall:
    def __init__(self, function_name: str) -> None:
        self.function_name = function_name
        self.started = False

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        if not text:
            return "", []
        if self.started:
            return "", [ToolCallDelta(0, arguments=text)]
        self.started = True
        return "", [ToolCallDelta(0, id=new_tool_call_id(), name=self.function_name, arguments=text)]

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        return "", []
