"""Errors a caller of the engine can act on."""
from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine refuses as given. `param` names the request parameter at fault, as
    the OpenAI API spells it (None: the prompt as a whole); `code` is an OpenAI error code where
    one applies (e.g. context_length_exceeded). The server answers it with a 400 naming `param`."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def __reduce__(self):   # keeps param and code across processes (Ray replicas)
        return (type(self), (self.message, self.param, self.code))
