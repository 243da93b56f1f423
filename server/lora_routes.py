"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter, with vLLM's request bodies, plain-text answers and error
shapes. They exist only with `allow_runtime_lora_updating` (as vLLM's need VLLM_ALLOW_RUNTIME_LORA_UPDATING): a
request that loads an adapter makes the server read a directory of its choosing, a privilege for operators."""

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from kvserve.engine.lora.peft_adapter import LoraAdapterError
from kvserve.server.context import ServerContext
from kvserve.server.errors import APIError, bad_request
from kvserve.server.openapi_docs import TEXT, error_responses
from kvserve.server.protocol import LoadLoraAdapterRequest, UnloadLoraAdapterRequest

_ANSWER = {"content": {"text/plain": {"schema": TEXT}}}


def add_lora_routes(app: FastAPI, ctx: ServerContext, dependencies: list) -> None:
    @app.post("/v1/load_lora_adapter", dependencies=dependencies, response_class=PlainTextResponse,
              responses={200: _ANSWER, **error_responses(400, 401, 404)})  # fmt: skip
    async def load_lora_adapter(body: LoadLoraAdapterRequest):
        ctx.check_known_fields(body)
        name, path = body.lora_name, body.lora_path
        if not name or not path:
            raise bad_request(
                "Both 'lora_name' and 'lora_path' must be provided.", param="lora_name" if not name else "lora_path"
            )
        if body.is_3d_lora_weight:
            raise bad_request("is_3d_lora_weight (MoE expert weights) is not supported", param="is_3d_lora_weight")
        if not ctx.engine.serves_loras:
            raise bad_request(
                "this server does not serve LoRA adapters: start it with --enable-lora", param="lora_name"
            )
        if name == ctx.model_name:
            raise bad_request(f"The lora adapter '{name}' conflicts with a served base model.", param="lora_name")
        if ctx.engine.lora_tag(name) is not None and not body.load_inplace:
            raise bad_request(
                f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, "
                "set 'load_inplace' to True.", param="lora_name",
            )  # fmt: skip
        if not Path(path).is_dir():
            raise APIError(404, f"Loading lora {name} failed: No adapter found for {path}", type="not_found_error",
                           param="lora_path")  # fmt: skip
        try:
            await ctx.engine.load_lora(name, path, replace=body.load_inplace)
        except (LoraAdapterError, ValueError) as error:
            raise bad_request(f"Loading lora {name} failed: {error}", param="lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", dependencies=dependencies, response_class=PlainTextResponse,
              responses={200: _ANSWER, **error_responses(400, 401, 404)})  # fmt: skip
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest):
        ctx.check_known_fields(body)
        name = body.lora_name
        if not name:
            raise bad_request("'lora_name' needs to be provided to unload a LoRA adapter.", param="lora_name")
        tag = ctx.engine.lora_tag(name)
        if tag is None:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", type="not_found_error",
                           param="lora_name")  # fmt: skip
        if body.lora_int_id is not None and body.lora_int_id != tag.adapter_id:
            raise bad_request(f"lora_int_id {body.lora_int_id} is not the id of '{name}' ({tag.adapter_id})",
                              param="lora_int_id")  # fmt: skip
        ctx.engine.unload_lora(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
