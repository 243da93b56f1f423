"""Server and engine settings: one pydantic model filled from defaults, a YAML file, KVSERVE_* env, CLI flags.

Precedence, lowest to highest: defaults < `--config` YAML < `KVSERVE_<FIELD>` environment variables
< command-line flags. Unknown keys and wrong types are refused with a message naming the key.
"""

import json
import os
from dataclasses import fields
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator

from kvserve.engine import EngineConfig
from kvserve.engine.speculative import SpeculativeConfig
from kvserve.engine.speculative.config import DEFAULT_DRAFT

ENV_PREFIX = "KVSERVE_"


class SettingsError(ValueError):
    """A settings file, variable or flag is unknown or has the wrong type."""


class _ServerOnlySettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # What to serve (the checkpoint itself is the engine's `model`)
    served_model_name: str | None = Field(None, description="model name clients use; default: the directory name")
    chat_template: str | None = Field(None, description="Jinja chat template (text or file) over the tokenizer's")
    tool_call_parser: Literal["hermes", "llama3_json"] | None = Field(
        None, description='how tool calls are read from the output for tool_choice "auto" (hermes: Qwen, Hermes)'
    )
    # HTTP
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_key: str | None = Field(None, description="if set, /v1 routes need `Authorization: Bearer <key>`")
    cors_allow_origins: list[str] = Field(default_factory=list, description="CORS is off when empty")
    console: bool = Field(True, description="serve the web console at / (playground, live view, KV-cache map)")
    max_body_bytes: int = Field(1 << 20, ge=1024)
    max_queued_requests: int = Field(256, ge=1, description="waiting requests beyond this get 429")
    max_n: int = Field(16, ge=1, description="largest `n` a request may ask for")
    max_stop_strings: int = Field(16, ge=1)
    max_stop_string_chars: int = Field(1024, ge=1)
    max_prompts: int = Field(64, ge=1, description="largest number of prompts in one completions request")
    accept_unknown_fields: bool = Field(
        False, description="accept request fields kvserve does not know (logged, then ignored) instead of a 400"
    )
    drain_timeout_s: float = Field(30.0, ge=0, description="on SIGTERM, how long in-flight requests may finish")
    startup_timeout_s: float | None = Field(
        None, gt=0, description="exit with status 1, naming the phase, if start-up takes longer (default: no limit)"
    )
    max_consecutive_step_failures: int = Field(
        3, ge=1, description="after this many failed model steps in a row the server exits with status 1"
    )
    engine_stall_timeout_s: float = Field(
        60.0, gt=0, description="/health turns 503 when requests wait and no model step has ended for this long"
    )
    responses_store_max_entries: int = Field(
        1024, ge=0, description="responses kept for previous_response_id and GET /v1/responses/{id} (oldest dropped)"
    )
    responses_store_ttl_s: float = Field(3600.0, gt=0, description="how long a stored response is kept")
    allow_runtime_lora_updating: bool = Field(
        False, description="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (they read server paths)"
    )

    @field_validator("lora_modules", mode="before", check_fields=False)
    @classmethod
    def _lora_modules(cls, value):
        """`name=path` strings (flags, env) or {name, path} objects (YAML, vLLM's JSON form) as (name, path) pairs."""
        if not isinstance(value, list | tuple):
            return value
        return [_lora_module(item) for item in value]

    @field_validator("speculative_config", mode="before", check_fields=False)
    @classmethod
    def _speculative_config(cls, value):
        """JSON or YAML text (a flag, an env variable) read as the mapping it writes; unknown keys refused. "default":
        the built-in model's draft model (`{"model": "default"}`)."""
        value = yaml.safe_load(value) if isinstance(value, str) else value
        if value == DEFAULT_DRAFT:
            value = {"model": DEFAULT_DRAFT}
        if isinstance(value, dict):
            unknown = sorted(set(value) - {field.name for field in fields(SpeculativeConfig)})
            if unknown:
                raise ValueError(f"unknown keys {unknown}")
        return value

    def engine_config(self) -> EngineConfig:
        return EngineConfig(**{field.name: getattr(self, field.name) for field in fields(EngineConfig)})


# The engine settings are EngineConfig's own fields, types and defaults: declared once, in engine/config.py.
ServerSettings = create_model(
    "ServerSettings",
    __base__=_ServerOnlySettings,
    __doc__="Server and engine settings, as one flat model (YAML keys, KVSERVE_* variables and flags).",
    **{field.name: (field.type, field.default) for field in fields(EngineConfig)},
)


def _lora_module(item):
    if isinstance(item, str) and item.lstrip().startswith("{"):
        item = json.loads(item)
    if isinstance(item, dict):
        unknown = set(item) - {"name", "path"}
        if unknown or not {"name", "path"} <= set(item):
            raise ValueError(f"a LoRA module is {{name, path}}, got {sorted(item)}")
        return (item["name"], item["path"])
    if isinstance(item, str):
        name, equals, path = item.partition("=")
        if not equals or not name or not path:
            raise ValueError(f"a LoRA module is name=path, got {item!r}")
        return (name, path)
    return item


def load_settings(config_file: str | Path | None, cli_overrides: dict, environ: dict | None = None) -> ServerSettings:
    """Merge the layers in precedence order and validate once."""
    values: dict = {}
    if config_file is not None:
        loaded = yaml.safe_load(Path(config_file).read_text()) or {}
        if not isinstance(loaded, dict):
            raise SettingsError(f"{config_file}: expected a mapping of settings, got {type(loaded).__name__}")
        values.update(loaded)
    environ = os.environ if environ is None else environ
    for name in ServerSettings.model_fields:
        env_name = ENV_PREFIX + name.upper()
        if env_name in environ:
            values[name] = yaml.safe_load(environ[env_name])  # so "8", "true", "[a, b]" get their types
    values.update({key: value for key, value in cli_overrides.items() if value is not None})
    try:
        settings = ServerSettings(**values)
        settings.engine_config()  # EngineConfig's own checks (e.g. block_size a power of two), named, at start-up
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
        raise SettingsError(f"invalid settings: {problems}") from None
    except ValueError as error:
        raise SettingsError(f"invalid settings: {error}") from None
    return settings
