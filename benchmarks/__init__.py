"""kvserve's benchmarks, each run from the repository root as `.venv/bin/python -m benchmarks.<name>`.

`python -m` puts the working folder first on the path, so the repository's package folders (installed as
kvserve.*) would shadow installed packages of the same top-level name: Hugging Face's `kernels`, which transformers
imports when it is installed, would resolve to kvserve's kernels/ and break `import transformers`. Importing this
package moves the repository to the end of the path, where it still provides `benchmarks` and `tests`.
"""

import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent


def _is_repo(entry: str) -> bool:
    return Path(entry or ".").resolve() == _REPO


_repo_entries = [entry for entry in sys.path if _is_repo(entry)]
sys.path[:] = [entry for entry in sys.path if not _is_repo(entry)] + _repo_entries[:1]
