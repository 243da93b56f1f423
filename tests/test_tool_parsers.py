"""Tool-call parsing: each format's whole-output parse, and streaming that always adds up to the same parse."""

import itertools
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.server.tool_parsers import (
    TOOL_CALL_PARSERS,
    ParsedOutput,
    ToolCallDelta,
    ToolCallParser,
    new_tool_call_id,
    tool_call_parser,
)

hermes = tool_call_parser("hermes")
llama3_json = tool_call_parser("llama3_json")
json_list = tool_call_parser("json_list")

TRICKY_ARGUMENTS = (
    '{"code": "if (a) { b[\\"}\\"] = \\"</tool_call>\\"; }", "nested": {"list": [1, {"x": null}], "t": true}}'
)


def calls_of(parsed: ParsedOutput) -> list[tuple[str, str]]:
    return [(call.name, call.arguments) for call in parsed.tool_calls]


def streamed(parser: ToolCallParser, pieces: list[str]) -> tuple[str, list[tuple[str, str]], list[str]]:
    """Feeds `pieces` then finishes; returns (content, [(name, arguments)], ids), checking the fragments' shape."""
    stream = parser.streaming()
    content: list[str] = []
    deltas: list[ToolCallDelta] = []
    for piece in pieces:
        text, new_deltas = stream.feed(piece)
        content.append(text)
        deltas += new_deltas
    text, new_deltas = stream.finish()
    content.append(text)
    deltas += new_deltas
    calls: list[list[str]] = []
    ids: list[str] = []
    for delta in deltas:
        if delta.index == len(calls):  # the first fragment of the next call
            assert delta.id is not None and delta.name is not None
            calls.append([delta.name, delta.arguments])
            ids.append(delta.id)
        else:
            assert delta.index == len(calls) - 1
            assert delta.id is None and delta.name is None and delta.arguments
            calls[-1][1] += delta.arguments
    return "".join(content), [(name, arguments) for name, arguments in calls], ids


def splits(text: str) -> list[list[str]]:
    """The text in two pieces at every split point, and one character at a time."""
    return [[text[:cut], text[cut:]] for cut in range(len(text) + 1)] + [list(text)]


def assert_streams_as_parsed(parser: ToolCallParser, text: str) -> None:
    parsed = parser.parse(text)
    for pieces in splits(text):
        content, calls, ids = streamed(parser, pieces)
        assert (content if content.strip() else None) == parsed.content, pieces
        assert calls == calls_of(parsed), pieces
        assert len(set(ids)) == len(ids)


def test_hermes_parses_one_call():
    parsed = hermes.parse('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    assert parsed.content is None
    assert calls_of(parsed) == [("get_weather", '{"city": "Paris"}')]
    assert re.fullmatch(r"call_[0-9a-f]{24}", parsed.tool_calls[0].id)


def test_hermes_keeps_content_around_calls_but_not_whitespace_before_them():
    text = (
        "Let me check both.\n\n"
        '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {\n  "y": [1, 2]\n}}\n</tool_call>\n'
        "Done.\n"
    )
    parsed = hermes.parse(text)
    assert parsed.content == "Let me check both.\nDone."
    assert calls_of(parsed) == [("a", '{"x": 1}'), ("b", '{\n  "y": [1, 2]\n}')]
    assert parsed.tool_calls[0].id != parsed.tool_calls[1].id


def test_hermes_takes_arguments_with_braces_quotes_and_closing_tags_inside_strings():
    text = f'<tool_call>{{"name": "run", "arguments": {TRICKY_ARGUMENTS}}}</tool_call>'
    assert calls_of(hermes.parse(text)) == [("run", TRICKY_ARGUMENTS)]
    assert json.loads(hermes.parse(text).tool_calls[0].arguments)["code"] == 'if (a) { b["}"] = "</tool_call>"; }'


def test_hermes_output_without_tags_is_all_content():
    assert hermes.parse("Paris is sunny, a < b\n") == ParsedOutput("Paris is sunny, a < b\n", [])
    assert hermes.parse(" \n") == ParsedOutput(None, [])


def test_hermes_call_without_arguments_has_empty_object_and_arguments_may_come_first():
    text = '<tool_call>{"name": "now"}</tool_call><tool_call>{"arguments": {"a": 1}, "name": "later"}</tool_call>'
    assert calls_of(hermes.parse(text)) == [("now", "{}"), ("later", '{"a": 1}')]


def test_hermes_forgives_a_missing_last_closing_tag():
    assert calls_of(hermes.parse('<tool_call>\n{"name": "f", "arguments": {}}\n')) == [("f", "{}")]


@pytest.mark.parametrize(
    "text",
    [
        'Sure. <tool_call>\n{"name": "f", "arguments": {"a": 1,}}\n</tool_call>',  # trailing comma
        '<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>',  # unclosed object
        '<tool_call>{"name": "f", "arguments": {"a": "cut',  # output cut short
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',  # name not a string
        "Use <tool_call> tags to call tools.",
        '<tool_call>{"name": "f"} oops </tool_call>',
        '<tool_call>{"name": "ok", "arguments": {}}</tool_call><tool_call>{"name": "bad" "arguments": {}}</tool_call>',
    ],
)
def test_hermes_output_with_broken_calls_is_all_content(text):
    assert hermes.parse(text) == ParsedOutput(text, [])


def test_llama3_json_parses_calls_separated_by_semicolons():
    text = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {"s": "}{"}}\n'
    parsed = llama3_json.parse(text)
    assert parsed.content is None
    assert calls_of(parsed) == [("a", '{"x": 1}'), ("b", '{"s": "}{"}')]


def test_llama3_json_takes_nested_and_tricky_arguments():
    assert calls_of(llama3_json.parse(f' {{"name": "run", "parameters": {TRICKY_ARGUMENTS}}}')) == [
        ("run", TRICKY_ARGUMENTS)
    ]


@pytest.mark.parametrize(
    "text", ["The weather is fine {really}.", "<b>bold</b>", "<|python_tag|>brave_search.call(query='x')", "  hi "]
)
def test_llama3_json_output_not_starting_with_an_object_is_content(text):
    assert llama3_json.parse(text) == ParsedOutput(text, [])


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "f", "parameters": {"a": }}',
        '{"name": "f", "parameters": {}} and some words',
        '{"name": "f", "parameters": {}};',
        '{"name": "f", "parameters": {"a": 1}',
    ],
)
def test_llama3_json_broken_output_is_all_content(text):
    assert llama3_json.parse(text) == ParsedOutput(text, [])


def test_json_list_parses_each_element_as_a_call():
    text = f'[{{"name": "a", "arguments": {{"x": [1, {{"y": 2}}]}}}}, {{"name": "b", "arguments": {TRICKY_ARGUMENTS}}}]'
    parsed = json_list.parse(text)
    assert parsed.content is None
    assert calls_of(parsed) == [("a", '{"x": [1, {"y": 2}]}'), ("b", TRICKY_ARGUMENTS)]
    assert json_list.parse("[]") == ParsedOutput(None, [])


@pytest.mark.parametrize(
    "text", ['{"name": "a", "arguments": {}}', '[{"name": "a", "arguments": {}}', '[{"name": "a"}] x', "[1]"]
)
def test_json_list_broken_output_is_all_content(text):
    assert json_list.parse(text) == ParsedOutput(text, [])


def test_streaming_holds_back_a_possible_tag_then_streams_name_then_arguments():
    stream = hermes.streaming()
    assert stream.feed("I'll look <tool") == ("I'll look", [])
    assert stream.feed('_call>\n{"name": "get_') == ("", [])
    (delta,) = stream.feed('weather", "arguments": {"city"')[1]
    assert (delta.index, delta.name, delta.arguments) == (0, "get_weather", '{"city"')
    assert stream.feed(': "Paris"}}\n</tool_call>') == ("", [ToolCallDelta(0, arguments=': "Paris"}')])
    assert stream.finish() == ("", [])


def test_streaming_finish_sends_a_partial_tag_as_content():
    stream = hermes.streaming()
    assert stream.feed("x <tool_ca") == ("x", [])
    assert stream.finish() == (" <tool_ca", [])


def test_llama3_json_streaming_holds_back_until_the_first_character_decides():
    stream = llama3_json.streaming()
    assert stream.feed("\n <|python") == ("", [])
    assert stream.feed("!") == ("\n <|python!", [])
    stream = llama3_json.streaming()
    assert stream.feed("\n <|python_tag|> ") == ("", [])
    (delta,) = stream.feed('{"name": "f", "parameters": {')[1]
    assert (delta.index, delta.name, delta.arguments) == (0, "f", "{")


def test_a_call_cut_short_streams_what_it_had():
    text = '<tool_call>{"name": "f", "arguments": {"a": "cu'
    content, calls, _ = streamed(hermes, [text])
    assert (content, calls) == ("", [("f", '{"a": "cu')])
    assert hermes.parse(text) == ParsedOutput(text, [])


HERMES_TEXTS = [
    'Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n',
    f'<tool_call>{{"name": "run", "arguments": {TRICKY_ARGUMENTS}}}</tool_call>\n<tool_call>{{"name": "b"}}'
    "</tool_call> and <b>more</b> <tool",
    'a <tool_call>{"arguments": {"x": "y"}, "name": "late"}</tool_call>',
    "just < text <tool_cal",
]
LLAMA3_TEXTS = [
    f'<|python_tag|>{{"name": "run", "parameters": {TRICKY_ARGUMENTS}}}; {{"name": "b", "parameters": {{}}}}',
    ' {"name": "f", "arguments": {"n": -1.5e3, "ok": false}}\n',
    " <|python_tag not really",
]
JSON_LIST_TEXTS = [f'[{{"name": "a", "arguments": {{"x": [1]}}}}, {{"name": "b", "arguments": {TRICKY_ARGUMENTS}}}]']


@pytest.mark.parametrize(
    ("parser", "text"),
    [(hermes, text) for text in HERMES_TEXTS]
    + [(llama3_json, text) for text in LLAMA3_TEXTS]
    + [(json_list, text) for text in JSON_LIST_TEXTS],
)
def test_streaming_adds_up_to_the_parse_wherever_the_text_is_split(parser, text):
    assert_streams_as_parsed(parser, text)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='ab {}[]"\\:,/<>_\n'),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=3), children, max_size=3),
    max_leaves=8,
)
call_lists = st.lists(
    st.tuples(
        st.sampled_from(["get_weather", "f"]),
        st.dictionaries(st.text(alphabet='k"{', max_size=3), json_values, max_size=3),
        st.sampled_from([None, 2]),
    ),
    min_size=1,
    max_size=3,
)


def render(parser_name: str, calls: list[tuple[str, dict, int | None]]) -> tuple[str, list[tuple[str, str]]]:
    """An output of the format calling `calls`, and the (name, arguments text) each call should parse to."""
    expected = [(name, json.dumps(arguments, indent=indent)) for name, arguments, indent in calls]
    objects = [f'{{"name": "{name}", "arguments": {arguments}}}' for name, arguments in expected]
    if parser_name == "hermes":
        return "Let me see.\n" + "".join(f"<tool_call>\n{obj}\n</tool_call>\n" for obj in objects), expected
    if parser_name == "llama3_json":
        return "<|python_tag|>" + "; ".join(objects), expected
    return "[" + ", ".join(objects) + "]", expected


@settings(max_examples=150, deadline=None)
@given(
    parser_name=st.sampled_from(sorted(TOOL_CALL_PARSERS)),
    calls=call_lists,
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=8),
)
def test_any_calls_stream_in_any_pieces_as_they_parse(parser_name, calls, cuts):
    parser = tool_call_parser(parser_name)
    text, expected = render(parser_name, calls)
    parsed = parser.parse(text)
    assert calls_of(parsed) == expected
    assert [json.loads(call.arguments) for call in parsed.tool_calls] == [arguments for _, arguments, _ in calls]
    bounds = sorted({0, len(text), *(cut for cut in cuts if cut < len(text))})
    content, streamed_calls, _ = streamed(parser, [text[start:end] for start, end in itertools.pairwise(bounds)])
    assert (content if content.strip() else None) == parsed.content
    assert streamed_calls == expected


def test_tool_call_ids_are_random():
    ids = {new_tool_call_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", call_id) for call_id in ids)


def test_parsers_are_found_by_name_and_unknown_names_are_refused():
    assert sorted(TOOL_CALL_PARSERS) == ["hermes", "json_list", "llama3_json"]
    assert all(tool_call_parser(name).name == name for name in TOOL_CALL_PARSERS)
    with pytest.raises(ValueError, match="known: hermes, json_list, llama3_json"):
        tool_call_parser("mistral")
