"""The structured-output fields of a request (OpenAI's `response_format`, vLLM's `structured_outputs` and
`guided_*` extras) as the one `GrammarSpec` the engine constrains sampling with."""

import json

from engine import InvalidRequestError
from engine.sampling_params import GrammarSpec
from server.context import ServerContext
from server.errors import bad_request
from server.protocol import SamplingFields


async def compiled_grammar(ctx: ServerContext, body: SamplingFields) -> GrammarSpec | None:
    """The request's constraint, compiled (a 400 naming its field if it does not compile), or None;
    a 400 if it asks for more than one."""
    specs = [(name, spec) for name, spec in _candidates(body) if spec is not None]
    if len(specs) > 1:
        names = ", ".join(name for name, _ in specs)
        raise bad_request(f"give at most one structured-output constraint, got {names}", param=specs[1][0])
    if not specs:
        return None
    await compile_grammar(ctx, *specs[0])
    return specs[0][1]


async def compile_grammar(ctx: ServerContext, param: str, spec: GrammarSpec) -> None:
    try:
        await ctx.engine.compile_grammar(spec)
    except InvalidRequestError as error:
        raise bad_request(f"{param}: {error.message}", param=param) from None


def _candidates(body: SamplingFields):
    yield "response_format", _from_response_format(body)
    yield "structured_outputs", _from_structured_outputs(body)
    yield "guided_json", None if body.guided_json is None else json_schema_spec(body.guided_json, "guided_json")
    yield "guided_regex", None if body.guided_regex is None else GrammarSpec("regex", body.guided_regex)
    yield "guided_choice", None if body.guided_choice is None else choice_spec(body.guided_choice, "guided_choice")
    yield "guided_grammar", None if body.guided_grammar is None else GrammarSpec("grammar", body.guided_grammar)


def _from_response_format(body: SamplingFields) -> GrammarSpec | None:
    response_format = body.response_format
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return GrammarSpec("json_object")
    json_schema = response_format.json_schema
    if json_schema is None or json_schema.schema_ is None:
        raise bad_request("response_format json_schema needs json_schema.schema", param="response_format.json_schema")
    return json_schema_spec(json_schema.schema_, "response_format.json_schema.schema", strict=bool(json_schema.strict))


def _from_structured_outputs(body: SamplingFields) -> GrammarSpec | None:
    outputs = body.structured_outputs
    if outputs is None:
        return None
    param = "structured_outputs"
    given = [
        spec
        for spec in (
            None if outputs.json_ is None else json_schema_spec(outputs.json_, f"{param}.json"),
            None if outputs.regex is None else GrammarSpec("regex", outputs.regex),
            None if outputs.choice is None else choice_spec(outputs.choice, f"{param}.choice"),
            None if outputs.grammar is None else GrammarSpec("grammar", outputs.grammar),
            GrammarSpec("json_object") if outputs.json_object else None,
        )
        if spec is not None
    ]
    if len(given) != 1:
        raise bad_request(f"{param} must give exactly one of json, regex, choice, grammar, json_object", param=param)
    return given[0]


def json_schema_spec(schema: dict | str, param: str, strict: bool = True) -> GrammarSpec:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as error:
            raise bad_request(f"{param} is not valid JSON: {error}", param=param) from None
    if not isinstance(schema, dict):
        raise bad_request(f"{param} must be a JSON schema object", param=param)
    return GrammarSpec("json_schema", json.dumps(schema), strict=strict)  # key order kept: it orders the output


def choice_spec(choices: list[str], param: str) -> GrammarSpec:
    if not choices or not all(choices):
        raise bad_request(f"{param} must list at least one non-empty string", param=param)
    return GrammarSpec("choice", json.dumps(choices))
