"""A bearer token on the public API: gRPC metadata `authorization: Bearer <token>`, HTTP likewise.

Health checks stay open (probes carry no token). On the HTTP port the token guards `/v1/*`
always and, with `--web-auth`, the web demo and `/metrics` too; a browser brings it once as
`/?token=...`, which sets an HttpOnly same-site cookie and drops the token from the address bar.
"""

from __future__ import annotations

import argparse
import hmac
from pathlib import Path

import grpc

OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
COOKIE = "splittts_token"


def add_flags(parser: argparse.ArgumentParser) -> None:
    """--api-token / --api-token-file, --web-auth, --allow-origin."""
    g = parser.add_argument_group("authentication")
    tokens = g.add_mutually_exclusive_group()
    tokens.add_argument(
        "--api-token-file",
        metavar="FILE",
        help="require 'authorization: Bearer <token>' on the public API, the token "
        "being this file's content (whitespace stripped)",
    )
    tokens.add_argument(
        "--api-token",
        metavar="TOKEN",
        help="as --api-token-file with the token inline (visible in the process "
        "list: prefer the file)",
    )
    g.add_argument(
        "--web-auth",
        action="store_true",
        help="the web demo and /metrics on the HTTP port need the token too "
        "(open the page once as /?token=TOKEN)",
    )
    g.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="a page origin besides the demo's own allowed to open /ws, e.g. "
        "https://app.example (repeatable; * allows any)",
    )


def load_token(args: argparse.Namespace) -> str | None:
    """The token from --api-token or --api-token-file, or None when the API is open."""
    if args.api_token_file is not None:
        try:
            token = Path(args.api_token_file).read_text().strip()
        except OSError as exc:
            raise FileNotFoundError(
                f"--api-token-file {args.api_token_file}: cannot read it ({exc.strerror or exc})"
            ) from None
        flag = "--api-token-file"
    elif args.api_token is not None:
        token, flag = args.api_token.strip(), "--api-token"
    else:
        if args.web_auth:
            raise ValueError("--web-auth needs --api-token-file or --api-token")
        return None
    if len(token) < 16 or any(c.isspace() for c in token):
        raise ValueError(f"{flag}: the token must be at least 16 characters without spaces")
    return token


def check_bearer(header: str | None, token: str) -> str | None:
    """None when `header` is 'Bearer <token>'; otherwise what is wrong, in words for the caller."""
    if not header:
        return "missing credentials: send the header 'authorization: Bearer <token>'"
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return "malformed credentials: the authorization header must be 'Bearer <token>'"
    if not hmac.compare_digest(value.strip().encode(), token.encode()):
        return "invalid credentials: the bearer token is not valid"
    return None


def _deny(kind: str, message: str):
    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def streaming(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # an async generator, as the streaming handler kinds expect

    return streaming if kind.endswith("_stream") else unary


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for any call but health without the right bearer token."""

    def __init__(self, token: str):
        self.token = token

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_PREFIXES):
            return handler
        header = next(
            (v for k, v in handler_call_details.invocation_metadata or () if k == "authorization"),
            None,
        )
        problem = check_bearer(header if isinstance(header, str) else None, self.token)
        if problem is None:
            return handler
        for kind, factory in (
            ("unary_unary", grpc.unary_unary_rpc_method_handler),
            ("unary_stream", grpc.unary_stream_rpc_method_handler),
            ("stream_unary", grpc.stream_unary_rpc_method_handler),
            ("stream_stream", grpc.stream_stream_rpc_method_handler),
        ):
            if getattr(handler, kind) is not None:
                return factory(
                    _deny(kind, problem),
                    request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer,
                )
        return handler


class _AddToken:
    """Adds the bearer token to a call's metadata (the HTTP port's relay to the public API)."""

    def __init__(self, token: str):
        self.pair = ("authorization", f"Bearer {token}")

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self.pair)
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )


# grpc.aio files a channel's interceptor under the first kind it is, so one class per kind
class _UnaryUnary(_AddToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _UnaryStream(_AddToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _StreamUnary(_AddToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


class _StreamStream(_AddToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


def token_interceptors(token: str | None) -> list:
    """Client interceptors that send `token` on every call (none without one)."""
    if token is None:
        return []
    return [kind(token) for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]
