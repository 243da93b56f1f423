"""The built-in default model: a ~3.8M-parameter Llama trained here on public-domain text, shipped in the package.

`benchmarks/train_default_model.py` trained it (on the King James Bible, Debian's fortune cookies and a few
dozen short conversations written for it) and its model card, `assets/default_model/README.md`, says how well
it does. It answers a greeting and writes old-fashioned English; it is a toy to see the stack work with nothing
downloaded, not an assistant.
"""

import os
from importlib import resources
from pathlib import Path

DEFAULT_MODEL_NAME = "kvserve-default-kjv-v2"
DEFAULT_MODEL_NOTICE = (
    f"no model given: serving the built-in {DEFAULT_MODEL_NAME}, a 3.8M-parameter toy trained on the King James "
    "Bible and fortune cookies (it greets you and writes old-fashioned text; it is not an assistant: pass a HF "
    "checkpoint directory for a real model)"
)


def cache_root() -> Path:
    """Where benchmarks keep the checkpoints they build."""
    return Path(os.environ.get("KVSERVE_CACHE_DIR", Path.home() / ".cache" / "kvserve"))


def default_model_dir() -> Path:
    """The shipped checkpoint's directory (inside the installed package)."""
    return Path(str(resources.files("kvserve.engine").joinpath("assets", "default_model")))


def default_draft_dir() -> Path:
    """The shipped draft model of the default model (speculative decoding; `benchmarks/train_default_draft.py`)."""
    return Path(str(resources.files("kvserve.engine").joinpath("assets", "default_draft")))
