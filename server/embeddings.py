"""POST /v1/embeddings (OpenAI's): one vector per input, from an embedding model (a sentence-transformers directory,
or a decoder served with `--task embed`), batched through the same scheduler as generation; each input's prompt is
prefilled, pooled, and its KV blocks are freed at once (engine/pooling.py)."""

import base64
from typing import Literal

import numpy as np
from fastapi import Request
from pydantic import BaseModel, Field

from kvserve.engine.pooling import EMBEDDING_PARAMS
from kvserve.engine.request import GenerationRequest
from kvserve.server.context import ServerContext
from kvserve.server.errors import bad_request, renamed_params
from kvserve.server.generation import Generation
from kvserve.server.protocol import RequestModel, random_id


class EmbeddingRequest(RequestModel):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None  # an identifier: no effect on the vectors
    priority: int = 0  # vLLM's, with --scheduling-policy priority (as on chat)


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64: little-endian float32, as OpenAI encodes it


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


async def create_embeddings(body: EmbeddingRequest, request: Request, ctx: ServerContext) -> EmbeddingResponse:
    ctx.check_known_fields(body)
    lora = ctx.lora_of(body.model)
    pooling = ctx.engine.pooling
    if pooling is None:
        model = body.model or ctx.model_name
        raise bad_request(f"model {model!r} generates text: it makes no embeddings", param="model")
    inputs = _inputs(body.input)
    if body.dimensions is not None:
        allowed = pooling.matryoshka_dimensions
        if allowed is None or (allowed and body.dimensions not in allowed):
            sizes = "none" if allowed is None else ", ".join(map(str, allowed))
            raise bad_request(f"this model's vectors cannot be cut to {body.dimensions} dimensions (it allows "
                              f"{sizes})", param="dimensions")  # fmt: skip
    prompts = [pooling.prompt(item) if isinstance(item, str) else item for item in inputs]
    engine_request = GenerationRequest(prompts, EMBEDDING_PARAMS, 1, None, lora, body.priority)
    with renamed_params({"prompt": "input", "max_tokens": "input", "messages": "input"}):
        generation = await Generation.start(ctx.engine, engine_request, random_id("embd"), ctx.count_disconnect,
                                            ctx.response_model(lora))  # fmt: skip
    await generation.run_to_end(request)
    data = []
    for choice in generation.choices:
        vector = np.asarray(choice.embedding, dtype=np.float32)
        if body.dimensions is not None:
            # Matryoshka: the leading dimensions carry the meaning; cut, then normalised again (vLLM's way).
            vector = vector[: body.dimensions]
            vector = vector / max(float(np.linalg.norm(vector)), 1e-12) if pooling.normalize else vector
        data.append(EmbeddingData(index=choice.index, embedding=_encoded(vector, body.encoding_format)))
    prompt_tokens = generation.usage().prompt_tokens
    usage = EmbeddingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens)
    return EmbeddingResponse(data=data, model=generation.model, usage=usage)


def _inputs(value: str | list) -> list[str | list[int]]:
    """The inputs as a list: each a text, or a list of token ids."""
    one = isinstance(value, str) or (value and all(isinstance(item, int) for item in value))
    inputs = [value] if one else value
    if not inputs:
        raise bad_request("input must not be empty", param="input")
    for index, item in enumerate(inputs):
        if not item:
            raise bad_request(f"input {index} is empty", param="input")
    return inputs


def _encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()
