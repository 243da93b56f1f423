"""The one exception of the bench: why it could not run, as a line for the user (no traceback)."""


class BenchError(Exception):
    """The target, the dataset or the tokenizer cannot be used; the message is what the user sees."""
