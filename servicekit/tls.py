"""TLS for every gRPC port: server credentials (mutual TLS with a client CA) and client credentials.

Flags in Riva's spirit. A server takes `--tls-cert` and `--tls-key` (PEM) and, for mutual TLS,
`--tls-client-ca`: the CA that signed the certificates its clients must present. A client of an
internal hop takes `--tls-ca` (the CA that signed the server's certificate) and, where the server
asks for one, `--tls-client-cert` and `--tls-client-key`. Without them a port is plaintext, which
is meant only for 127.0.0.1: serving plaintext on any other address logs a warning.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import overload

import grpc

log = logging.getLogger(__name__)


@overload
def _read(flag: str, path: str) -> bytes: ...
@overload
def _read(flag: str, path: str | None) -> bytes | None: ...
def _read(flag: str, path: str | None) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise FileNotFoundError(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from None


@dataclass(frozen=True)
class ServerTLS:
    """A server's certificate chain and key (PEM), and the CA its clients must be signed by."""

    cert: bytes
    key: bytes
    client_ca: bytes | None = None
    cert_path: str | None = None
    key_path: str | None = None

    @property
    def mutual(self) -> bool:
        """True when clients must present a certificate signed by `client_ca`."""
        return self.client_ca is not None

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)],
            root_certificates=self.client_ca,
            require_client_auth=self.mutual,
        )


@dataclass(frozen=True)
class ClientTLS:
    """What a client trusts (`ca`; None: the system's roots) and the certificate it presents."""

    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    """--tls-cert, --tls-key, --tls-client-ca, --reflection/--no-reflection and --health-port."""
    g = parser.add_argument_group("TLS (plaintext without --tls-cert; meant for 127.0.0.1 only)")
    g.add_argument("--tls-cert", metavar="PEM", help="this server's certificate chain")
    g.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")
    g.add_argument(
        "--tls-client-ca",
        metavar="PEM",
        help="require client certificates signed by this CA (mutual TLS)",
    )
    parser.add_argument(
        "--reflection",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serve gRPC server reflection",
    )
    parser.add_argument(
        "--health-port",
        type=int,
        default=-1,
        help="also serve grpc.health.v1 alone, in plaintext, on this port for "
        "probes that cannot speak TLS (0 picks one, -1: off)",
    )


def add_client_flags(parser: argparse.ArgumentParser) -> None:
    """--tls-ca, --tls-client-cert, --tls-client-key for the channels this process dials."""
    g = parser.add_argument_group("TLS to the backends (plaintext without --tls-ca)")
    g.add_argument(
        "--tls-ca",
        metavar="PEM",
        help="dial the backends over TLS, trusting this CA for their certificates",
    )
    g.add_argument(
        "--tls-client-cert",
        metavar="PEM",
        help="certificate to present to the backends (their --tls-client-ca signed it)",
    )
    g.add_argument("--tls-client-key", metavar="PEM", help="the private key of --tls-client-cert")


def server_tls(args: argparse.Namespace) -> ServerTLS | None:
    """The server's TLS from its flags, or None for plaintext; a flag without its partner errs."""
    if args.tls_cert is None and args.tls_key is None:
        if args.tls_client_ca is not None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS)")
        return None
    if args.tls_cert is None or args.tls_key is None:
        raise ValueError("--tls-cert and --tls-key go together: give both or neither")
    return ServerTLS(
        _read("--tls-cert", args.tls_cert),
        _read("--tls-key", args.tls_key),
        _read("--tls-client-ca", args.tls_client_ca),
        args.tls_cert,
        args.tls_key,
    )


def client_tls(args: argparse.Namespace) -> ClientTLS | None:
    """The backends' channel TLS from the client flags, or None for plaintext."""
    if (args.tls_client_cert is None) != (args.tls_client_key is None):
        raise ValueError("--tls-client-cert and --tls-client-key go together: give both or neither")
    if args.tls_ca is None:
        if args.tls_client_cert is not None:
            raise ValueError(
                "--tls-client-cert needs --tls-ca (a client certificate is only sent over TLS)"
            )
        return None
    return ClientTLS(
        _read("--tls-ca", args.tls_ca),
        _read("--tls-client-cert", args.tls_client_cert),
        _read("--tls-client-key", args.tls_client_key),
    )


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and localhost: addresses no other host can reach."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def warn_if_exposed(host: str, port: int, tls: ServerTLS | None) -> None:
    """Log where the port listens and how; plaintext beyond loopback is a loud warning."""
    if tls is not None:
        log.info("gRPC on %s:%d over %s", host, port, "mutual TLS" if tls.mutual else "TLS")
    elif is_loopback(host):
        log.info("gRPC on %s:%d in plaintext (loopback only)", host, port)
    else:
        log.warning(
            "gRPC on %s:%d in PLAINTEXT: anyone who reaches this address can call it "
            "unencrypted; pass --tls-cert and --tls-key (and --tls-client-ca for the "
            "internal services), or bind 127.0.0.1",
            host,
            port,
            extra={"fields": {"host": host, "port": port, "tls": False}},
        )
