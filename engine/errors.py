"""Errors the engine raises for bad input; the server maps them to HTTP statuses in one place."""


class InvalidRequestError(ValueError):
    """A request the engine refuses; `field` names the offending parameter."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
