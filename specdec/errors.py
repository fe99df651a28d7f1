"""Exceptions shared by the configuration objects and the engine's fault handling."""

from __future__ import annotations

MAX_SHOWN_CHARS = 200  # of a refused value's repr in a FieldError (a client may send megabytes)


class FieldError(ValueError):
    """A configuration field has a bad type or value. ``owner`` and ``field`` name it (the CLI maps
    them back to the command-line argument); the message says what is allowed and what was given."""

    def __init__(self, owner: str, field: str, rule: str, value: object) -> None:
        shown = repr(value)
        shown = shown if len(shown) <= MAX_SHOWN_CHARS else f"{shown[:MAX_SHOWN_CHARS - 3]}..."
        super().__init__(f"{owner}.{field} {rule}, got {shown}")
        self.owner, self.field = owner, field


class RequestFault(RuntimeError):
    """A step could not be completed for specific requests (e.g. non-finite logits); ``request_ids``
    names them. The engine fails exactly those requests and carries on with the others."""

    def __init__(self, request_ids: list[str], message: str) -> None:
        super().__init__(message)
        self.request_ids = list(request_ids)
