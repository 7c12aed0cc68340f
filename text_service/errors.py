"""Errors the engine core raises for a request; the gRPC layer maps `status_code` to a status."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of the errors a request can meet in the engine core."""

    status_code = "INTERNAL"


class InvalidRequestError(EngineError, ValueError):
    """A request field breaks a rule: reported as INVALID_ARGUMENT, retrying cannot help."""

    status_code = "INVALID_ARGUMENT"

    def __init__(self, field: str, rule: str):
        super().__init__(f"{field}: {rule}")
        self.field = field
        self.rule = rule


class CapacityError(EngineError):
    """The engine is full right now: reported as RESOURCE_EXHAUSTED, retry later."""

    status_code = "RESOURCE_EXHAUSTED"


class EngineDeadError(EngineError):
    """The engine loop stopped after an internal error: UNAVAILABLE, retry on another replica."""

    status_code = "UNAVAILABLE"

    def __init__(self) -> None:
        super().__init__(
            "the text engine stopped after an internal error; this replica is "
            "restarting, retry on another one"
        )
