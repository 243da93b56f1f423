"""lm-evaluation-harness's local tasks (tests/data/lm_eval) scored against a live server as published evals score a
server: its `local-completions` model, sending token-id prompts."""

from pathlib import Path

import lm_eval
import yaml
from lm_eval.models.openai_completions import LocalCompletionsAPI
from lm_eval.tasks import TaskManager

DATA_DIR = Path(__file__).parent / "data" / "lm_eval"


def write_task(file_name: str, task_dir: Path) -> None:
    """The task's YAML names its data file relative to DATA_DIR; the copy in `task_dir` names it absolutely
    (datasets resolves data files against the working directory) and keeps the datasets cache in `task_dir`."""
    config = yaml.safe_load((DATA_DIR / file_name).read_text())
    dataset_kwargs = config["dataset_kwargs"]
    dataset_kwargs["data_files"] = {split: str(DATA_DIR / name) for split, name in dataset_kwargs["data_files"].items()}
    dataset_kwargs["cache_dir"] = str(task_dir / "datasets")
    (task_dir / file_name).write_text(yaml.safe_dump(config))


def local_completions(base_url: str, model: str, tokenizer: Path, num_concurrent: int = 1) -> LocalCompletionsAPI:
    return LocalCompletionsAPI(
        model=model, base_url=f"{base_url}/v1/completions", tokenizer=str(tokenizer), tokenizer_backend="huggingface",
        tokenized_requests=True, num_concurrent=num_concurrent, max_retries=1,
    )  # fmt: skip


def evaluate(lm: LocalCompletionsAPI, task_files: dict[str, str], task_dir: Path, **options) -> dict:
    """lm_eval.simple_evaluate on the tasks named in `task_files` (task name: YAML file in DATA_DIR)."""
    for file_name in task_files.values():
        write_task(file_name, task_dir)
    return lm_eval.simple_evaluate(
        model=lm, tasks=list(task_files), task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
        # Leave the process's random generators as they were: other code in the process shares them.
        random_seed=None, numpy_random_seed=None, torch_random_seed=None, **options,
    )  # fmt: skip
