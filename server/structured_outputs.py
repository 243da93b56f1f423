"""The structured-output fields of a request (OpenAI's `response_format`, vLLM's `structured_outputs` and
`guided_*` extras) as the one `GrammarSpec` the engine constrains sampling with (and builds: a grammar that does
not is a 400 naming the field it came from)."""

import json

from kvserve.engine.sampling_params import GrammarSpec
from kvserve.server.errors import bad_request
from kvserve.server.protocol import SamplingFields


def grammar_of(body: SamplingFields) -> GrammarSpec | None:
    """The request's constraint, or None; a 400 if it asks for more than one."""
    specs = [spec for spec in _candidates(body) if spec is not None]
    if len(specs) > 1:
        names = ", ".join(spec.param for spec in specs)
        raise bad_request(f"give at most one structured-output constraint, got {names}", param=specs[1].param)
    return specs[0] if specs else None


def _candidates(body: SamplingFields):
    """The constraint each field of the request that can hold one holds (None where it holds none)."""
    yield _from_response_format(body)
    yield _from_structured_outputs(body)
    if body.guided_json is not None:
        yield json_schema_spec(body.guided_json, "guided_json")
    if body.guided_regex is not None:
        yield GrammarSpec("regex", body.guided_regex, param="guided_regex")
    if body.guided_choice is not None:
        yield choice_spec(body.guided_choice, "guided_choice")
    if body.guided_grammar is not None:
        yield GrammarSpec("grammar", body.guided_grammar, param="guided_grammar")


def _from_response_format(body: SamplingFields) -> GrammarSpec | None:
    response_format = body.response_format
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return GrammarSpec("json_object", param="response_format")
    json_schema = response_format.json_schema
    param = "response_format.json_schema.schema"
    if json_schema is None or json_schema.schema_ is None:
        raise bad_request("response_format json_schema needs json_schema.schema", param=param)
    return json_schema_spec(json_schema.schema_, param, strict=bool(json_schema.strict))


def _from_structured_outputs(body: SamplingFields) -> GrammarSpec | None:
    param = "structured_outputs"
    outputs = body.structured_outputs
    if outputs is None:
        return None
    given = []
    if outputs.json_ is not None:
        given.append(json_schema_spec(outputs.json_, f"{param}.json"))
    if outputs.regex is not None:
        given.append(GrammarSpec("regex", outputs.regex, param=f"{param}.regex"))
    if outputs.choice is not None:
        given.append(choice_spec(outputs.choice, f"{param}.choice"))
    if outputs.grammar is not None:
        given.append(GrammarSpec("grammar", outputs.grammar, param=f"{param}.grammar"))
    if outputs.json_object:
        given.append(GrammarSpec("json_object", param=f"{param}.json_object"))
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
    # Key order kept: it orders the output.
    return GrammarSpec("json_schema", json.dumps(schema), strict=strict, param=param)


def choice_spec(choices: list[str], param: str) -> GrammarSpec:
    if not choices or not all(choices):
        raise bad_request(f"{param} must list at least one non-empty string", param=param)
    return GrammarSpec("choice", json.dumps(choices), param=param)
