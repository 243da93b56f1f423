"""Tool calls in a model's generated text, for the OpenAI chat API's `tool_calls`, whole (`parse`) or streamed.

Formats, by `--tool-call-parser` name: hermes (Hermes, Qwen2.5, Qwen3: content with `<tool_call>{...}</tool_call>`
tags), llama3_json (Llama 3.1/3.2: call objects separated by `;`, maybe after `<|python_tag|>`; any output that does
not start with `{` is content) and json_list (`[{...}, ...]`, what the grammar for `tool_choice: "required"` forces).
A call object is `{"name": ..., "arguments" or "parameters": ...}`; its arguments' JSON text is kept as the model
wrote it ("{}" when missing). `parse` is the streaming parser run over the whole text, so the two always agree.

Decisions:
- Whitespace directly before a tool call is not content, nor is whitespace that ends an output with tool calls.
- Output that breaks its format (a call that is not a JSON object with a string "name", a call cut short, stray
  text where a tag or separator belongs) has no tool calls to `parse`: it is all content, as in vLLM. A stream cannot
  take back what it sent: it streams the rest as content from where the format breaks (for hermes, up to the next
  `<tool_call>`); a call object that never closes takes the rest of the output, and stays as streamed.
- `finish` sends what was held back as content (a partial `<tool_call>` tag, a lone `<|python_tag|>`).
"""

import json
import secrets
from dataclasses import dataclass
from typing import ClassVar

ARGUMENT_KEYS = ("arguments", "parameters")
_CONTENT = "content"  # the format state in which text is content
_CALL_OBJECT = "{"  # the literal that opens a call object


def new_tool_call_id() -> str:
    """A fresh OpenAI tool call id: "call_" and 24 random hex digits."""
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class ToolCall:
    """One complete call: `arguments` is the JSON text of the arguments object."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCallDelta:
    """One OpenAI streamed fragment of call `index`: the first carries id and name, all carry more argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True)
class ParsedOutput:
    """A whole output split into content (None when empty or whitespace only) and tool calls."""

    content: str | None
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class _Format:
    """Where a format's call objects may be. Outside a call the parser is in a state: in the content state the text
    is content up to `content_exit` (a literal, and the state it leads to); in the others whitespace and then one of
    `expects[state]`'s literals must follow, each leading to a state ("{" opens a call object, then leads there)."""

    start: str
    expects: dict[str, dict[str, str]]
    end_states: frozenset[str]  # where, besides the content state, the output may end
    content_exit: tuple[str, str] | None = None


class _CallScanner:
    """Follows one call object, `{"name": ..., "arguments": ...}`, character by character as it arrives: its name,
    once that string is complete, and the raw span of its arguments value as it grows."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.id = new_tool_call_id()
        self.text = ""
        self.name: str | None = None
        self.done = False
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._expecting_key = False
        self._key: str | None = None
        self._token_start = 0  # of the key or value being read in the object itself
        self._arguments_start: int | None = None
        self._arguments_end: int | None = None
        self._sent_name = False
        self._sent_arguments = 0

    def feed(self, chunk: str) -> int:
        """Scans `chunk`; returns how many of its characters belong to the object (all, unless it closed)."""
        start = len(self.text)
        self.text += chunk
        for offset, char in enumerate(chunk):
            self._scan(start + offset, char)
            if self.done:
                self.text = self.text[: start + offset + 1]
                return offset + 1
        return len(chunk)

    def _scan(self, position: int, char: str) -> None:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
                if self._depth == 1:
                    self._string_closed(position + 1)
            return
        # Numbers, true, false and null are not followed: a name must be a string, and such arguments read as "{}".
        if char == '"':
            self._in_string = True
            if self._depth == 1 and self._expecting_key:
                self._token_start = position
            elif self._depth == 1:
                self._value_started(position)
        elif char in "{[":
            if self._depth == 0:
                self._expecting_key = True
            elif self._depth == 1:
                self._value_started(position)
            self._depth += 1
        elif char in "}]":
            self._depth -= 1
            if self._depth == 1:
                self._value_ended(position + 1)
            self.done = self._depth == 0
        elif char == "," and self._depth == 1:
            self._expecting_key = True

    def _string_closed(self, end: int) -> None:
        if self._expecting_key:
            self._key = _json_string(self.text[self._token_start : end])
            self._expecting_key = False
        else:
            self._value_ended(end)

    def _value_started(self, position: int) -> None:
        self._token_start = position
        if self._key in ARGUMENT_KEYS and self._arguments_start is None:
            self._arguments_start = position

    def _value_ended(self, end: int) -> None:
        if self._key == "name" and self.name is None and self.text[self._token_start] == '"':
            self.name = _json_string(self.text[self._token_start : end])
        if self._token_start == self._arguments_start and self._arguments_end is None:
            self._arguments_end = end

    def arguments(self, skip: int = 0) -> str:
        """The arguments' JSON text so far, less its first `skip` characters."""
        if self._arguments_start is None:
            return "{}"[skip:] if self.done else ""
        end = len(self.text) if self._arguments_end is None else self._arguments_end
        return self.text[self._arguments_start + skip : end]

    def new_deltas(self) -> list[ToolCallDelta]:
        """What is not streamed yet: nothing before the name is complete; then id and name, and new argument text."""
        if self.name is None:
            return []
        arguments = self.arguments(skip=self._sent_arguments)
        self._sent_arguments += len(arguments)
        if not self._sent_name:
            self._sent_name = True
            return [ToolCallDelta(self.index, self.id, self.name, arguments)]
        return [ToolCallDelta(self.index, arguments=arguments)] if arguments else []

    def tool_call(self) -> ToolCall | None:
        """The call, if its object is complete, valid JSON and has a string name."""
        try:
            valid = self.done and self.name is not None and isinstance(json.loads(self.text), dict)
        except json.JSONDecodeError:
            valid = False
        return ToolCall(self.id, self.name, self.arguments()) if valid else None


def _json_string(literal: str) -> str | None:
    try:
        return json.loads(literal)
    except json.JSONDecodeError:
        return None


def _partial_length(text: str, literal: str) -> int:
    """Length of the longest end of `text` that could begin `literal`."""
    for length in range(min(len(text), len(literal) - 1), 0, -1):
        if text.endswith(literal[:length]):
            return length
    return 0


class StreamingToolCallParser:
    """Parses one choice's output as it is generated: each `feed` returns the content and call fragments that can be
    sent now, holding back only what is still undecided; `finish` flushes it at the end of the output."""

    def __init__(self, output_format: _Format) -> None:
        self._format = output_format
        self._state = output_format.start
        self._buffer = ""  # received but not yet decided
        self._glue = ""  # format text read since the last call or content: content after all if the format breaks
        self._held_whitespace = ""  # content unless a call follows
        self._call: _CallScanner | None = None
        self._calls: list[_CallScanner] = []
        self._format_broken = False

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """New generated text in; returns (content text to stream now, tool-call fragments to stream now)."""
        self._buffer += text
        return self._advance(final=False)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """End of output: returns what was held back, as for `feed`."""
        content, deltas = self._advance(final=True)
        if not self._calls:
            content += self._held_whitespace
        self._held_whitespace = ""
        return content, deltas

    def tool_calls(self) -> list[ToolCall] | None:
        """After `finish`: the calls, or None if the output broke its format."""
        calls = [call.tool_call() for call in self._calls]
        if self._format_broken or None in calls:
            return None
        return calls

    def _advance(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        progressed = True
        while progressed:
            if self._call is None:
                text, progressed = self._step(final)
                content.append(self._as_content(text))
                continue
            self._buffer = self._buffer[self._call.feed(self._buffer) :]
            deltas += self._call.new_deltas()
            progressed = self._call.done
            if self._call.done:
                self._call = None
        return "".join(content), deltas

    def _as_content(self, text: str) -> str:
        text = self._held_whitespace + text
        kept = text.rstrip()
        self._held_whitespace = text[len(kept) :]
        return kept

    def _step(self, final: bool) -> tuple[str, bool]:
        """Reads the buffer in the current state; returns (content, whether the state moved on)."""
        if self._state == _CONTENT:
            return self._step_in_content(final)
        rest = self._buffer.lstrip()
        expected = self._format.expects[self._state]
        for literal, next_state in expected.items():
            if rest.startswith(literal):
                self._glue += self._buffer[: len(self._buffer) - len(rest)]
                self._enter(next_state, literal, rest)
                return "", True
        if not rest and (not final or self._state in self._format.end_states):
            return "", False
        if not final and any(literal.startswith(rest) for literal in expected):
            return "", False
        self._format_broken = True
        glue, self._glue, self._state = self._glue, "", _CONTENT
        return glue, True

    def _enter(self, state: str, literal: str, rest: str) -> None:
        self._state = state
        if literal == _CALL_OBJECT:
            self._buffer, self._glue, self._held_whitespace = rest, "", ""
            self._call = _CallScanner(index=len(self._calls))
            self._calls.append(self._call)
            return
        self._buffer = rest[len(literal) :]
        # Format text that led to content was well-formed, so it will never be content.
        self._glue = "" if state == _CONTENT else self._glue + literal

    def _step_in_content(self, final: bool) -> tuple[str, bool]:
        if self._format.content_exit is None:
            text, self._buffer = self._buffer, ""
            return text, False
        literal, next_state = self._format.content_exit
        found = self._buffer.find(literal)
        if found >= 0:
            text = self._buffer[:found]
            self._enter(next_state, literal, self._buffer[found:])
            return text, True
        held = 0 if final else _partial_length(self._buffer, literal)
        text, self._buffer = self._buffer[: len(self._buffer) - held], self._buffer[len(self._buffer) - held :]
        return text, False


class ToolCallParser:
    """Finds the tool calls of one format in a model's output: `parse` for a whole output, `streaming` for one
    choice's output as it is generated."""

    name: ClassVar[str]
    output_format: ClassVar[_Format]

    def parse(self, text: str) -> ParsedOutput:
        """Splits a whole output; output that breaks the format is all content (see the module docstring)."""
        stream = self.streaming()
        content = stream.feed(text)[0] + stream.finish()[0]
        tool_calls = stream.tool_calls()
        if tool_calls is None:
            return ParsedOutput(text if text.strip() else None, [])
        return ParsedOutput(content if content.strip() else None, tool_calls)

    def streaming(self) -> StreamingToolCallParser:
        return StreamingToolCallParser(self.output_format)


class HermesToolCallParser(ToolCallParser):
    """Content with calls in `<tool_call>...</tool_call>` tags (Hermes, Qwen2.5, Qwen3)."""

    name = "hermes"
    output_format = _Format(
        start=_CONTENT,
        content_exit=("<tool_call>", "open"),
        expects={"open": {"{": "close"}, "close": {"</tool_call>": _CONTENT}},
        end_states=frozenset({"close"}),  # a missing last </tool_call> is forgiven
    )


class Llama3JsonToolCallParser(ToolCallParser):
    """Call objects separated by `;`, optionally after `<|python_tag|>` (Llama 3.1/3.2)."""

    name = "llama3_json"
    output_format = _Format(
        start="start",
        expects={"start": {"<|python_tag|>": "call", "{": "after"}, "call": {"{": "after"}, "after": {";": "call"}},
        end_states=frozenset({"start", "after"}),
    )


class JsonListToolCallParser(ToolCallParser):
    """A JSON list of call objects, as the grammar for `tool_choice: "required"` forces."""

    name = "json_list"
    output_format = _Format(
        start="start",
        expects={
            "start": {"[": "first"},
            "first": {"{": "after", "]": "end"},
            "after": {",": "next", "]": "end"},
            "next": {"{": "after"},
            "end": {},
        },
        end_states=frozenset({"end"}),
    )


TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    parser.name: parser for parser in (HermesToolCallParser, Llama3JsonToolCallParser, JsonListToolCallParser)
}


def tool_call_parser(name: str) -> ToolCallParser:
    """A parser by its `--tool-call-parser` name; ValueError naming the known ones for any other."""
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(sorted(TOOL_CALL_PARSERS))}")
    return TOOL_CALL_PARSERS[name]()
