"""User-facing entry points: the `kvserve` command line (and, later, the OpenAI-compatible HTTP server)."""
