"""kvserve's benchmarks, each run from the repository root as `.venv/bin/python -m benchmarks.<name>`."""
