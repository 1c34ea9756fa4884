"""The error a bad request raises: a ``ValueError`` that names the offending parameter."""

from __future__ import annotations


class ParamError(ValueError):
    """A request parameter is invalid. ``param`` is its name as the API spells it (``"max_tokens"``,
    ``"prompt"``, ...), so a server can answer with an OpenAI-style error naming the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message
