"""The front end: the `kvserve` command line, the OpenAI-compatible HTTP server (its protocol translators onto the
engine's one door, `AsyncLLMEngine`), metrics, the console and `kvserve bench`."""
