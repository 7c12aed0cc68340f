"""Errors that carry the gRPC status they should be reported with."""

from __future__ import annotations

import grpc


class StatusError(Exception):
    """An error a servicer reports to the caller with `code` and a plain-words message."""

    code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, code: grpc.StatusCode | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code


class InvalidArgument(StatusError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(StatusError):
    code = grpc.StatusCode.NOT_FOUND


class ResourceExhausted(StatusError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(StatusError):
    code = grpc.StatusCode.UNAVAILABLE
