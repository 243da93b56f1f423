"""The FastAPI application: routes, auth, request limits, draining, and the error handlers."""

import hmac
import time
from importlib.metadata import PackageNotFoundError, version

from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, RedirectResponse, Response
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from starlette.types import ASGIApp, Receive, Scope, Send

from kvserve.kvcache import AdapterTag
from kvserve.server.anthropic_protocol import (
    AnthropicError,
    CountTokensRequest,
    MessageResponse,
    MessagesRequest,
    TokenCount,
)
from kvserve.server.chat import chat_prompt, create_chat_completion
from kvserve.server.completions import create_completion
from kvserve.server.console import ConsoleFiles
from kvserve.server.context import ServerContext
from kvserve.server.embeddings import EmbeddingRequest, EmbeddingResponse, create_embeddings
from kvserve.server.errors import HANDLED_ERRORS, APIError, handle_exception
from kvserve.server.lora_routes import add_lora_routes
from kvserve.server.messages import count_tokens, create_message
from kvserve.server.metrics import CountHTTPRequests
from kvserve.server.openapi_docs import TEXT, document_streams, error_responses, generation_responses
from kvserve.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    EngineStateResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
    now_s,
)
from kvserve.server.request_limits import BodySizeLimit, HeaderLimits
from kvserve.server.response_store import ResponseStore
from kvserve.server.responses import create_response
from kvserve.server.responses_protocol import DeletedResponse, ResponseObject, ResponsesRequest


def kvserve_version() -> str:
    try:
        return version("kvserve")
    except PackageNotFoundError:
        return "unknown"


class RefuseUnlessServing:
    """Answers 503 to every request but /health and /metrics while the engine starts, once `state.draining` is set,
    and after a failed start.

    Plain ASGI on purpose: an `@app.middleware("http")` wraps `receive` so that a handler's
    `request.is_disconnected()` never sees the client go, and a request nobody waits for runs on.
    """

    def __init__(self, app: ASGIApp, state) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in ("/health", "/metrics"):
            refusal = "the server is shutting down" if self.state.draining else None
            phase = self.state.ctx.engine.starting()
            if phase is not None:
                refusal = f"the server is starting: {phase}"
            elif not self.state.ctx.engine.ready:
                refusal = "the server failed to start"
            if refusal is not None:
                error = APIError(503, refusal, type="service_unavailable_error")
                return await error.response()(scope, receive, send)
        return await self.app(scope, receive, send)


def create_app(ctx: ServerContext) -> FastAPI:
    app = FastAPI(title="kvserve", version=kvserve_version(), description="OpenAI-compatible LLM inference server")
    app.state.ctx = ctx
    document_streams(app)
    app.state.draining = False
    # Starlette answers a handler registered for plain `Exception` and then re-raises the error, so uvicorn
    # logs a traceback and closes the keep-alive connection: every expected error needs its own entry.
    for error_type in HANDLED_ERRORS:
        app.add_exception_handler(error_type, handle_exception)
    if ctx.settings.cors_allow_origins:
        app.add_middleware(CORSMiddleware, allow_origins=ctx.settings.cors_allow_origins, allow_methods=["*"],
                           allow_headers=["*"])  # fmt: skip
    app.add_middleware(BodySizeLimit, max_bytes=ctx.settings.max_body_bytes)
    app.add_middleware(HeaderLimits)
    app.add_middleware(RefuseUnlessServing, state=app.state)
    app.add_middleware(CountHTTPRequests, metrics=ctx.metrics, routes=app.routes)  # last added runs first

    def require_api_key(request: Request) -> None:
        expected = ctx.settings.api_key
        if expected is None:
            return
        # OpenAI's clients send the key as a bearer token, Anthropic's in x-api-key: either is taken, on every route.
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            token = request.headers.get("x-api-key", "")
        if not hmac.compare_digest(token.encode(), expected.encode()):
            raise APIError(401, "missing or invalid API key", type="authentication_error", code="invalid_api_key")

    authorized = [Depends(require_api_key)]

    @app.get(
        "/health", summary="200 while the engine loop is alive and making progress, else 503",
        response_model=HealthResponse, responses={503: {"model": HealthResponse, "description": "unhealthy"}},
    )  # fmt: skip
    async def health():
        phase = ctx.engine.starting()
        if phase is not None:
            return JSONResponse({"status": f"starting: {phase}"}, status_code=503)
        if app.state.draining or not ctx.engine.is_healthy():
            return JSONResponse({"status": "unhealthy"}, status_code=503)
        return {"status": "ok"}

    @app.get(
        "/metrics", summary="Prometheus metrics (text format); open like /health, so scrapers need no key",
        response_class=Response, responses={200: {"content": {CONTENT_TYPE_PLAIN_0_0_4: {"schema": TEXT}}}},
    )  # fmt: skip
    async def metrics():
        # The classic text format (0.0.4), which every Prometheus reads; prometheus-client's newest is 1.0.0.
        return Response(ctx.metrics.exposition(), media_type=CONTENT_TYPE_PLAIN_0_0_4)

    @app.get("/version", response_model=VersionResponse, responses=error_responses())
    async def get_version():
        return {"version": kvserve_version()}

    def model_card(lora: AdapterTag | None) -> ModelCard:
        card = ModelCard(id=ctx.model_name, created=now_s(), max_model_len=ctx.engine.max_model_len)
        if lora is None:
            return card
        return card.model_copy(update={"id": lora.name, "root": lora.path, "parent": ctx.model_name})

    @app.get("/v1/models", dependencies=authorized, response_model=ModelList, responses=error_responses(401))
    async def list_models():
        return ModelList(data=[model_card(lora) for lora in [None, *ctx.engine.loaded_loras()]])

    @app.get("/v1/models/{model_id:path}", dependencies=authorized, response_model=ModelCard,
             responses=error_responses(401, 404))  # fmt: skip
    async def get_model(model_id: str):
        return model_card(ctx.lora_of(model_id))

    @app.post("/v1/completions", dependencies=authorized, responses=generation_responses(CompletionResponse))
    async def completions(body: CompletionRequest, request: Request):
        return await create_completion(body, request, ctx)

    @app.post("/v1/chat/completions", dependencies=authorized, responses=generation_responses(ChatCompletionResponse))
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await create_chat_completion(body, request, ctx)

    @app.post("/v1/embeddings", dependencies=authorized, response_model=EmbeddingResponse,
              responses=error_responses(400, 401, 404, 429))  # fmt: skip
    async def embeddings(body: EmbeddingRequest, request: Request):
        return await create_embeddings(body, request, ctx)

    @app.post("/v1/messages", dependencies=authorized,
              responses=generation_responses(MessageResponse, error_model=AnthropicError))  # fmt: skip
    async def messages(body: MessagesRequest, request: Request):
        return await create_message(body, request, ctx)

    @app.post("/v1/messages/count_tokens", dependencies=authorized, response_model=TokenCount,
              responses=error_responses(400, 401, 404, error_model=AnthropicError))  # fmt: skip
    async def messages_count_tokens(body: CountTokensRequest):
        return await count_tokens(body, ctx)

    response_store = ResponseStore(ctx.settings.responses_store_max_entries, ctx.settings.responses_store_ttl_s)

    @app.post("/v1/responses", dependencies=authorized, responses=generation_responses(ResponseObject))
    async def responses(body: ResponsesRequest, request: Request):
        return await create_response(body, request, ctx, response_store)

    def stored_response(response_id: str) -> dict:
        stored = response_store.get(response_id)
        if stored is None:
            raise APIError(404, f"no stored response {response_id!r} (never stored, expired, or deleted)",
                           type="not_found_error", param="response_id")  # fmt: skip
        return stored.response

    @app.get("/v1/responses/{response_id}", dependencies=authorized, response_model=ResponseObject,
             responses=error_responses(401, 404))  # fmt: skip
    async def get_response(response_id: str):
        return stored_response(response_id)

    @app.delete("/v1/responses/{response_id}", dependencies=authorized, response_model=DeletedResponse,
                responses=error_responses(401, 404))  # fmt: skip
    async def delete_response(response_id: str):
        stored_response(response_id)
        response_store.delete(response_id)
        return DeletedResponse(id=response_id)

    @app.get(
        "/v1/engine/state", dependencies=authorized, response_model=EngineStateResponse,
        responses=error_responses(401),
        summary="The console's snapshot: the KV cache block by block, the requests' blocks, the last minute's figures",
    )  # fmt: skip
    async def engine_state():
        state = await ctx.engine.engine_state()
        return EngineStateResponse.of(state, age_s=time.monotonic() - state.taken_at_monotonic_s)

    @app.post("/tokenize", dependencies=authorized, response_model=TokenizeResponse,
              responses=error_responses(400, 401, 404))  # fmt: skip
    async def tokenize(body: TokenizeRequest):
        ctx.check_known_fields(body)
        ctx.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        prompt = body.prompt if body.messages is None else chat_prompt(body.messages, add_generation_prompt=True)
        tokens = ctx.engine.tokenize(prompt, add_special_tokens=body.add_special_tokens)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": ctx.engine.max_model_len}

    @app.post("/detokenize", dependencies=authorized, response_model=DetokenizeResponse,
              responses=error_responses(400, 401, 404))  # fmt: skip
    async def detokenize(body: DetokenizeRequest):
        ctx.check_known_fields(body)
        ctx.check_model(body.model)
        if not body.tokens:
            raise APIError(400, "tokens must not be empty", param="tokens")
        return {"prompt": ctx.engine.decode(body.tokens, skip_special_tokens=False)}

    if ctx.settings.allow_runtime_lora_updating:
        add_lora_routes(app, ctx, authorized)
    if ctx.settings.console:
        # The pages hold no data and are open: a browser cannot send a bearer token when it navigates. Every
        # figure they show comes from /v1 routes, which ask for the key (the page prompts for it on a 401).
        @app.get("/", include_in_schema=False)
        async def console_home():
            return RedirectResponse("/console/")

        app.mount("/console", ConsoleFiles(), name="console")
    return app
