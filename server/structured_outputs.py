"""The structured-output fields of a request (OpenAI's `response_format`, vLLM's `structured_outputs` and
`guided_*` extras) as the one `GrammarSpec` the engine constrains sampling with."""

import json

from kvserve.engine import InvalidRequestError
from kvserve.engine.sampling_params import GrammarSpec
from kvserve.server.context import ServerContext
from kvserve.server.errors import bad_request
from kvserve.server.protocol import SamplingFields


async def compiled_grammar(ctx: ServerContext, body: SamplingFields) -> GrammarSpec | None:
    """The request's constraint, compiled (a 400 naming its field if it does not compile), or None;
    a 400 if it asks for more than one."""
    specs = [(param, spec) for param, spec in _candidates(body) if spec is not None]
    if len(specs) > 1:
        names = ", ".join(param for param, _ in specs)
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
    """(the field that holds it, the constraint) for each field of the request that can hold one."""
    yield _from_response_format(body)
    yield _from_structured_outputs(body)
    if body.guided_json is not None:
        yield "guided_json", json_schema_spec(body.guided_json, "guided_json")
    if body.guided_regex is not None:
        yield "guided_regex", GrammarSpec("regex", body.guided_regex)
    if body.guided_choice is not None:
        yield "guided_choice", choice_spec(body.guided_choice, "guided_choice")
    if body.guided_grammar is not None:
        yield "guided_grammar", GrammarSpec("grammar", body.guided_grammar)


def _from_response_format(body: SamplingFields) -> tuple[str, GrammarSpec | None]:
    response_format = body.response_format
    if response_format is None or response_format.type == "text":
        return "response_format", None
    if response_format.type == "json_object":
        return "response_format", GrammarSpec("json_object")
    json_schema = response_format.json_schema
    param = "response_format.json_schema.schema"
    if json_schema is None or json_schema.schema_ is None:
        raise bad_request("response_format json_schema needs json_schema.schema", param=param)
    return param, json_schema_spec(json_schema.schema_, param, strict=bool(json_schema.strict))


def _from_structured_outputs(body: SamplingFields) -> tuple[str, GrammarSpec | None]:
    param = "structured_outputs"
    outputs = body.structured_outputs
    if outputs is None:
        return param, None
    given = []
    if outputs.json_ is not None:
        given.append((f"{param}.json", json_schema_spec(outputs.json_, f"{param}.json")))
    if outputs.regex is not None:
        given.append((f"{param}.regex", GrammarSpec("regex", outputs.regex)))
    if outputs.choice is not None:
        given.append((f"{param}.choice", choice_spec(outputs.choice, f"{param}.choice")))
    if outputs.grammar is not None:
        given.append((f"{param}.grammar", GrammarSpec("grammar", outputs.grammar)))
    if outputs.json_object:
        given.append((f"{param}.json_object", GrammarSpec("json_object")))
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
