"""The packages' layering and their names once installed.

The engine runs where only torch, triton and transformers are installed (as on the GPU machine): nothing below
`server/` imports the HTTP or metrics packages. Every module is imported as `kvserve.<package>`: the folders sit at
the top of the repository, but no generic top-level name (`server`, `engine`, `kernels`, ...) is ever imported, so
kvserve neither shadows nor is shadowed by another distribution's package of that name.
"""

import ast
import subprocess
import sys
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
SERVER_ONLY_PACKAGES = ("fastapi", "starlette", "uvicorn", "pydantic", "prometheus_client", "openai")
# Not on the GPU machine's image either: only a request for structured outputs needs it.
GRAMMAR_PACKAGES = ("llguidance",)
# The repository's top-level folders that are kvserve packages once installed.
PACKAGE_FOLDERS = ("server", "engine", "scheduler", "kvcache", "kernels", "testing")
ENGINE_MODULES = (
    "kvserve.engine, kvserve.engine.llm, kvserve.engine.async_engine, kvserve.engine.core, "
    "kvserve.engine.input_processor, kvserve.engine.output_processor, kvserve.engine.worker, kvserve.engine.step_plan, "
    "kvserve.engine.parallel.rank_process, kvserve.kernels, kvserve.kernels.triton_backend, "
    "kvserve.kernels.cpu_backend, kvserve.scheduler, kvserve.kvcache, kvserve.testing.fault_injection, "
    "kvserve.testing.tiny_checkpoint"
)


def run_python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=cwd)


def without_packages(packages: tuple[str, ...], code: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    # A None entry in sys.modules makes importing that package raise ImportError.
    return run_python(f"import sys\nfor name in {packages!r}:\n    sys.modules[name] = None\n{code}", cwd)


def import_without_server_packages(modules: str) -> subprocess.CompletedProcess:
    return without_packages(SERVER_ONLY_PACKAGES + GRAMMAR_PACKAGES, f"import {modules}\n")


def test_engine_and_kernels_import_without_server_packages():
    result = import_without_server_packages(ENGINE_MODULES)
    assert result.returncode == 0, result.stderr


def test_the_engine_generates_without_server_or_grammar_packages(tiny_checkpoints, tmp_path):
    """As on the GPU machine's image: greedy generation works, and a request for structured outputs is refused
    with an error naming its field and the missing package, not an ImportError from the engine."""
    code = (
        "from kvserve.engine import LLM, SamplingParams\n"
        "from kvserve.engine.errors import InvalidRequestError\n"
        "from kvserve.engine.sampling_params import GrammarSpec\n"
        f"llm = LLM({str(tiny_checkpoints['qwen3'])!r}, kv_cache_memory_bytes=1 << 22)\n"
        "(output,) = llm.generate(['Once upon a time'], SamplingParams(max_tokens=4, ignore_eos=True))\n"
        "assert len(output.token_ids) == 4\n"
        "try:\n"
        "    llm.generate(['x'], SamplingParams(structured_output=GrammarSpec('regex', '[a-z]+')))\n"
        "except InvalidRequestError as error:\n"
        "    assert error.field == 'structured_output' and 'llguidance' in error.message, error\n"
        "else:\n"
        "    raise AssertionError('a constrained request ran without llguidance')\n"
        f"assert not set({SERVER_ONLY_PACKAGES + GRAMMAR_PACKAGES!r}) & {{m.split('.')[0] for m in sys.modules\n"
        "                                                   if sys.modules[m] is not None}\n"
    )
    result = without_packages(SERVER_ONLY_PACKAGES + GRAMMAR_PACKAGES, code, tmp_path)
    assert result.returncode == 0, result.stderr


def test_the_server_does_need_them():
    result = import_without_server_packages("kvserve.server.app")
    assert result.returncode != 0
    assert "halted; None in sys.modules" in result.stderr


def imported_modules(path: Path) -> set[str]:
    """The absolute module names a Python file imports (at any depth: in functions too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_no_file_imports_a_package_by_its_folder_name():
    python_files = [
        path for folder in (*PACKAGE_FOLDERS, "tests", "benchmarks") for path in (REPO / folder).rglob("*.py")
    ]
    assert len(python_files) > 100
    bare = {
        f"{path.relative_to(REPO)}: {name}"
        for path in python_files
        for name in imported_modules(path)
        if name.split(".")[0] in PACKAGE_FOLDERS
    }
    assert bare == set()


def test_installed_kvserve_puts_no_generic_name_on_the_path(tmp_path):
    """From outside the repository (as a user's program runs), the packages exist as kvserve.* only: a bare name
    finds nothing of kvserve's (Hugging Face's `kernels` is found: it is installed too)."""
    code = (
        "import importlib.util, sys\n"
        f"import kvserve.server.app, {ENGINE_MODULES}\n"
        f"ours = {[str(REPO / name / '__init__.py') for name in PACKAGE_FOLDERS]!r}\n"
        f"specs = [importlib.util.find_spec(name) for name in {PACKAGE_FOLDERS!r}]\n"
        "found = [spec.origin for spec in specs if spec is not None and spec.origin in ours]\n"
        "assert found == [], found\n"
        f"assert not set({PACKAGE_FOLDERS!r}) & set(sys.modules), 'a bare name was imported'\n"
    )
    result = run_python(code, tmp_path)
    assert result.returncode == 0, result.stderr


def test_hugging_faces_kernels_package_and_kvserve_work_side_by_side(tiny_checkpoints, tmp_path):
    """Hugging Face's `kernels` (the kernel hub transformers uses) is installed beside kvserve (a test extra): each
    imports as itself, and the offline API and `kvserve serve` run from a user's directory."""
    from tests.test_server_process import serve_process

    model_dir = tiny_checkpoints["llama"]
    code = (
        "import kernels, kvserve.kernels\n"
        "assert hasattr(kernels, 'get_kernel') and 'site-packages' in kernels.__file__, kernels.__file__\n"
        "from kvserve.engine import LLM, SamplingParams\n"
        f"llm = LLM({str(model_dir)!r}, kv_cache_memory_bytes=1 << 22)\n"
        "(output,) = llm.generate(['Once upon a time'], SamplingParams(max_tokens=4, ignore_eos=True))\n"
        "assert len(output.token_ids) == 4\n"
    )
    result = run_python(code, tmp_path)
    assert result.returncode == 0, result.stderr
    with serve_process(model_dir, tmp_path) as server:
        body = {"prompt": "Once upon a time", "max_tokens": 4, "ignore_eos": True}
        response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4


def test_benchmarks_run_from_the_repository_do_not_shadow_installed_packages():
    """`python -m benchmarks.<name>` runs from the repository root, whose folders would shadow installed packages of
    the same name (Hugging Face's `kernels`, which transformers imports): the benchmarks package moves the root to
    the end of the path, where it still provides `benchmarks` and `tests`."""
    code = (
        "import importlib.util, sys\n"
        "import benchmarks\n"
        "assert 'site-packages' in importlib.util.find_spec('kernels').origin, importlib.util.find_spec('kernels')\n"
        "import benchmarks.checkpoints, tests.test_layering, transformers\n"
        "assert 'kernels' not in sys.modules or 'site-packages' in sys.modules['kernels'].__file__\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.checkpoints"], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert result.returncode == 0, result.stderr
    result = run_python(code, REPO)
    assert result.returncode == 0, result.stderr
