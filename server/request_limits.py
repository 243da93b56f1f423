"""ASGI middleware that refuses oversized requests before the app reads them: headers (431) and bodies (413).

Both answer in the OpenAI error shape. Beneath them, uvicorn's h11 refuses a request head still incomplete
beyond `serve.MAX_INCOMPLETE_EVENT_BYTES` with its own plain-text 400, before the app sees it (one socket read
takes up to 256 KiB, so heads up to that size may reach these limits instead).
"""

from starlette.types import ASGIApp, Receive, Scope, Send

from kvserve.server.errors import APIError

MAX_HEADERS = 100  # as Apache's LimitRequestFields
MAX_HEADER_FIELD_BYTES = 8 * 1024  # one name plus value, as Apache's LimitRequestFieldSize
MAX_HEADER_BYTES = 32 * 1024  # all names and values together


class HeaderLimits:
    """Refuses requests with more than MAX_HEADERS headers, or headers over the size limits, with 431."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            problem = _header_problem(scope["headers"])
            if problem is not None:
                error = APIError(431, f"request headers too large: {problem}", type="request_too_large")
                return await error.response()(scope, receive, send)
        return await self.app(scope, receive, send)


def _header_problem(headers: list[tuple[bytes, bytes]]) -> str | None:
    if len(headers) > MAX_HEADERS:
        return f"{len(headers)} headers, at most {MAX_HEADERS} allowed"
    sizes = [len(name) + len(value) for name, value in headers]
    if max(sizes, default=0) > MAX_HEADER_FIELD_BYTES:
        return f"a header of {max(sizes)} bytes, at most {MAX_HEADER_FIELD_BYTES} allowed"
    if sum(sizes) > MAX_HEADER_BYTES:
        return f"{sum(sizes)} bytes of headers, at most {MAX_HEADER_BYTES} allowed"
    return None


class BodySizeLimit:
    """Refuses bodies over `max_bytes` with 413 before reading them whole.

    A declared Content-Length is checked up front; a chunked body is read up to the limit, then
    handed on (bodies under the limit are small enough to hold).
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if not declared.isdigit() or int(declared) > self.max_bytes:
                return await self._too_large(scope, receive, send)
            return await self.app(scope, receive, send)
        chunks, num_bytes, more_body = [], 0, True
        while more_body:
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, _replay([message]), send)
            chunks.append(message.get("body", b""))
            num_bytes += len(chunks[-1])
            more_body = message.get("more_body", False)
            if num_bytes > self.max_bytes:
                return await self._too_large(scope, receive, send)
        return await self.app(scope, _replay([{"type": "http.request", "body": b"".join(chunks)}], receive), send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(413, f"request body is larger than {self.max_bytes} bytes", type="request_too_large")
        await error.response()(scope, receive, send)


def _replay(messages: list[dict], then: Receive | None = None) -> Receive:
    async def receive() -> dict:
        if messages:
            return messages.pop(0)
        return await then() if then is not None else {"type": "http.disconnect"}

    return receive
