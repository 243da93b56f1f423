"""Every error the server returns, in the OpenAI shape (Anthropic's on its routes), mapped from exceptions in one
place."""

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.engine import InvalidRequestError
from kvserve.engine.async_engine import EngineOverloadedError, EngineStepError, EngineUnavailableError
from kvserve.server.protocol import ErrorBody, ErrorResponse

RETRY_AFTER_S = 1
logger = logging.getLogger(__name__)


@dataclass
class APIError(Exception):
    """An error response: HTTP status, OpenAI error type, offending parameter, message."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def error_response(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorBody(message=self.message, type=self.type, param=self.param, code=self.code))

    def body(self) -> dict:
        return self.error_response().model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


@contextlib.contextmanager
def renamed_params(renames: dict[str, str]) -> Iterator[None]:
    """Errors of the request another protocol became, naming the fields the client sent (the longest renamed prefix
    of the param is replaced)."""
    try:
        yield
    except (APIError, InvalidRequestError) as error:
        api_error = to_api_error(error)
        if api_error.param is not None:
            for name in sorted(renames, key=len, reverse=True):
                if api_error.param == name or api_error.param.startswith(name + "."):
                    api_error.param = renames[name] + api_error.param[len(name) :]
                    break
        raise api_error from None


def to_api_error(error: Exception) -> APIError:
    """The one mapping from exceptions to HTTP errors."""
    match error:
        case APIError():
            return error
        case InvalidRequestError():
            return bad_request(error.message, param=error.field)
        case RequestValidationError():
            return _validation_error(error)
        case EngineOverloadedError():
            return APIError(
                429, f"server overloaded: {error}; retry later", type="overloaded_error",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )  # fmt: skip
        case EngineUnavailableError():
            return APIError(503, str(error), type="service_unavailable_error")
        case EngineStepError():
            return APIError(500, str(error), type="internal_error")
        case StarletteHTTPException(status_code=400):
            return bad_request(f"request body could not be parsed as UTF-8 JSON ({error.detail})")
        case StarletteHTTPException():
            return APIError(error.status_code, str(error.detail), type=_type_for_status(error.status_code))
    return APIError(500, "internal error", type="internal_error")


def _validation_error(error: RequestValidationError) -> APIError:
    first = error.errors()[0]
    location = _field_path(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        return bad_request(f"request body is not valid JSON: {first.get('msg')}")
    if not location and first.get("type") in ("model_attributes_type", "dict_type", "model_type"):
        return bad_request("request body must be a JSON object")
    param = ".".join(location) or None
    return bad_request(f"{param or 'body'}: {first.get('msg')}", param=param)


_UNION_MEMBER_NAMES = frozenset({"str", "int", "float", "bool"})


def _field_path(loc: tuple) -> list[str]:
    """The request field a pydantic error is about: without FastAPI's "body" and cut before the union member
    pydantic names for `str | list[...]` fields ("prompt", not "prompt.list[int]")."""
    path = []
    for part in loc[1:] if loc[:1] == ("body",) else loc:
        if isinstance(part, str) and (part in _UNION_MEMBER_NAMES or "[" in part):
            break
        path.append(str(part))
    return path


def _type_for_status(status: int) -> str:
    return {401: "authentication_error", 404: "not_found_error", 413: "request_too_large"}.get(
        status, "invalid_request_error"
    )


# Exception classes the app registers `handle_exception` for; `Exception` last, for 500s.
HANDLED_ERRORS = (
    APIError, InvalidRequestError, RequestValidationError, StarletteHTTPException,
    EngineOverloadedError, EngineUnavailableError, EngineStepError, Exception,
)  # fmt: skip


# Anthropic's error types by status (its API names no parameter: the message begins with it).
_ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
}  # fmt: skip
ANTHROPIC_ROUTES = "/v1/messages"


def anthropic_error(error: APIError) -> dict:
    """An error in the shape of Anthropic's API, for its routes."""
    message = error.message
    if error.param is not None and error.param not in message:
        message = f"{error.param}: {message}"
    kind = _ANTHROPIC_ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


async def handle_exception(request: Request, error: Exception) -> JSONResponse:
    api_error = to_api_error(error)
    if api_error.status == 500:
        # A failed step was logged with its traceback by the engine thread, once for all its requests.
        traceback = None if isinstance(error, EngineStepError) else error
        logger.error("request %s failed", request.url.path, exc_info=traceback)
    rejected_reason = {400: "validation", 429: "overload"}.get(api_error.status)
    if rejected_reason is not None:
        request.app.state.ctx.metrics.requests_rejected[rejected_reason].inc()
    if request.url.path.startswith(ANTHROPIC_ROUTES):
        return JSONResponse(anthropic_error(api_error), status_code=api_error.status, headers=api_error.headers)
    return api_error.response()
