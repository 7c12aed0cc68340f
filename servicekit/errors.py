"""Errors that carry the gRPC status they should be reported with."""

from __future__ import annotations

import grpc


class StatusError(Exception):
    """An error a servicer reports to the caller with `code` and a plain-words message.

    `retry_after_s`, when set, goes to the caller as gRPC's `grpc-retry-pushback-ms` trailer.
    """

    code = grpc.StatusCode.INTERNAL
    retry_after_s: float | None = None

    def __init__(
        self, message: str, code: grpc.StatusCode | None = None, retry_after_s: float | None = None
    ):
        super().__init__(message)
        if code is not None:
            self.code = code
        if retry_after_s is not None:
            self.retry_after_s = retry_after_s


class InvalidArgument(StatusError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(StatusError):
    code = grpc.StatusCode.NOT_FOUND


class ResourceExhausted(StatusError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    retry_after_s = 1.0


class Unavailable(StatusError):
    code = grpc.StatusCode.UNAVAILABLE


class StartupError(Exception):
    """The service cannot start (e.g. a port is busy): one line for the operator, exit code 2."""


class ServiceFailed(Exception):
    """The service cannot go on (e.g. its engine died): exit non-zero for a supervisor to restart."""


_CODES = {c.name: c for c in grpc.StatusCode}
_RETRY_AFTER_S = {grpc.StatusCode.RESOURCE_EXHAUSTED: 1.0}


def as_status_error(exc: BaseException) -> StatusError | None:
    """`exc` as a StatusError: itself, or a core error whose `status_code` names a gRPC code.

    Core packages (the engine) stay free of grpc by naming their code as a string.
    """
    if isinstance(exc, StatusError):
        return exc
    code = _CODES.get(getattr(exc, "status_code", None) or "")
    if code is None or code == grpc.StatusCode.OK:
        return None
    return StatusError(str(exc), code, retry_after_s=_RETRY_AFTER_S.get(code))
