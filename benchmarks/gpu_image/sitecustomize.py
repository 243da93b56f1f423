"""The GPU machine's image, as far as imports go, for `gpu_check.sh --dry-run` on a CPU.

Python imports `sitecustomize` at start-up from the first folder on its path that holds one; the dry run puts this
folder on PYTHONPATH, so every process of the check (pytest, each benchmark) loads it. It hides kvserve and the
packages it requires that the image lacks (benchmarks/gpu_image_packages.txt): they are not found, as there,
unless a folder outside site-packages provides them (the carried wheels gpu_check.sh
installed, or its link to this checkout as `kvserve`). What stays different from the image: the versions (this
venv's torch, not 2.11+cu130), the projects nothing of kvserve's requires, and CUDA itself.
"""

import importlib.machinery
import importlib.metadata
import re
import sys
import sysconfig
from pathlib import Path

_IMAGE_LIST = Path(__file__).resolve().parents[1] / "gpu_image_packages.txt"


def _normalised(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements(project: str, extras: bool = False) -> set[str]:
    """The projects `project` requires as installed here (those of its extras too if `extras`)."""
    from packaging.requirements import Requirement  # the image has packaging too

    try:
        lines = importlib.metadata.requires(project) or ()
    except importlib.metadata.PackageNotFoundError:
        return set()
    requirements = [Requirement(line) for line in lines]
    return {
        _normalised(requirement.name)
        for requirement in requirements
        if extras or requirement.marker is None or requirement.marker.evaluate({"extra": ""})
    }


def _closure(projects: set[str]) -> set[str]:
    found, todo = set(), list(projects)
    while todo:
        project = todo.pop()
        if project not in found:
            found.add(project)
            todo.extend(_requirements(project) - found)
    return found


def _hidden_projects() -> frozenset[str]:
    """kvserve, what it requires (its test extras too) that the image lacks, and what those require that the image
    lacks, less what the image's projects require as installed here (their versions differ from the image's:
    huggingface_hub here needs a project the image's may not; transformers from 5.25 needs Hugging Face's
    `kernels`, which kvserve's tests install too)."""
    image = {line.strip() for line in _IMAGE_LIST.read_text().splitlines() if line.strip() and line[0] != "#"}
    installed = {_normalised(dist.metadata["Name"]) for dist in importlib.metadata.distributions()}
    direct = _requirements("kvserve", extras=True) - image
    return frozenset({"kvserve"} | ((direct | _closure(direct)) - image - _closure(image & installed)))


def _hidden_names(projects: frozenset[str]) -> frozenset[str]:
    """Top-level module names that only hidden projects provide."""
    return frozenset(
        name
        for name, providers in importlib.metadata.packages_distributions().items()
        if all(_normalised(project) in projects for project in providers)
    )


_HIDDEN_PROJECTS = _hidden_projects()
_HIDDEN = _hidden_names(_HIDDEN_PROJECTS)
_SITE_DIRS = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}


class _ImagePathFinder(importlib.machinery.PathFinder):
    """The path finder, looking for a hidden name only outside site-packages: not found there, it is not found at
    all (`importlib.util.find_spec` gives None, as transformers' checks for optional packages expect)."""

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if path is None and fullname in _HIDDEN:
            path = [entry for entry in sys.path if entry not in _SITE_DIRS and not entry.startswith("__editable__")]
        return super().find_spec(fullname, path, target)

    @classmethod
    def find_distributions(cls, *args, **kwargs):
        """Their metadata is not found in site-packages either: a package's version check (transformers' for
        Hugging Face's `kernels`) agrees with its import."""
        for dist in super().find_distributions(*args, **kwargs):
            hidden = _normalised(dist.metadata["Name"] or "") in _HIDDEN_PROJECTS
            if not (hidden and str(dist.locate_file("")) in _SITE_DIRS):
                yield dist


# kvserve's editable install has a finder of its own; the check reaches kvserve through its folder of links instead.
sys.meta_path[:] = [
    _ImagePathFinder if finder is importlib.machinery.PathFinder else finder
    for finder in sys.meta_path
    if not type(finder).__module__.startswith("__editable__")
    and not getattr(finder, "__module__", "").startswith("__editable__")
]
