"""What /openapi.json says about responses: each route's models and error statuses, and the SSE events of streams.

Every documented error is in the OpenAI shape (`ErrorResponse`). "4XX" covers the rest (405, 413, 431) and keeps
FastAPI from documenting a 422 that this server never sends (its validation errors are 400s). The schemathesis
tests hold the server to this document.
"""

from fastapi import FastAPI
from pydantic.json_schema import models_json_schema

from kvserve.server.protocol import ChatCompletionChunk, CompletionChunk, ErrorResponse

REF_TEMPLATE = "#/components/schemas/{model}"
TEXT = {"type": "string"}
_ERROR_DESCRIPTIONS = {
    400: "invalid request: a field out of range, a bad prompt or messages, malformed JSON",
    401: "missing or wrong API key (when the server has one)",
    404: "unknown model",
    429: "too many requests waiting; retry after `Retry-After` seconds",
    500: "a model step failed while the request was in flight",
    503: "the server is shutting down or its engine has stopped",
    "4XX": "any other client error (405, 413 body too large, 431 headers too large)",
}
# The model of each streamed route's chunks.
_STREAMED_CHUNKS = {"/v1/completions": CompletionChunk, "/v1/chat/completions": ChatCompletionChunk}


def error_responses(*statuses: int, error_model: type = ErrorResponse) -> dict:
    """`error_model`: the shape of the route's errors (OpenAI's; Anthropic's on its routes)."""
    documented = (*statuses, 500, 503, "4XX")
    return {status: {"model": error_model, "description": _ERROR_DESCRIPTIONS[status]} for status in documented}


def generation_responses(response_model: type, error_model: type = ErrorResponse) -> dict:
    """A generation route: the response model, or with `stream` an event stream (see `document_streams`)."""
    return {200: {"model": response_model}, **error_responses(400, 401, 404, 429, error_model=error_model)}


def document_streams(app: FastAPI) -> None:
    """Make `app.openapi` describe each streamed route's `text/event-stream`: every event's data is a chunk, an
    error object (then the stream ends) or `[DONE]`. FastAPI documents only JSON bodies itself."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            _add_event_streams(build())  # build() caches the document in app.openapi_schema
        return app.openapi_schema

    app.openapi = openapi


def _add_event_streams(document: dict) -> None:
    models = [(model, "serialization") for model in (*_STREAMED_CHUNKS.values(), ErrorResponse)]
    _, definitions = models_json_schema(models, ref_template=REF_TEMPLATE)
    components = document["components"]["schemas"]
    for name, definition in definitions["$defs"].items():
        components.setdefault(name, definition)
    for path, model in _STREAMED_CHUNKS.items():
        content = document["paths"][path]["post"]["responses"]["200"]["content"]
        content["text/event-stream"] = {"schema": _event_schema(model.__name__)}


def _event_schema(chunk_model: str) -> dict:
    """One SSE event (OpenAPI before 3.2 describes a stream by the schema of each event)."""
    payload = {"anyOf": [{"$ref": REF_TEMPLATE.format(model=name)} for name in (chunk_model, "ErrorResponse")]}
    data = {"anyOf": [{"const": "[DONE]"}, {**TEXT, "contentMediaType": "application/json", "contentSchema": payload}]}
    return {"type": "object", "properties": {"data": data}, "required": ["data"]}
