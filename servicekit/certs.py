"""A private CA and the certificates the three services need for mutual TLS (`--tls-dir`).

`python -m servicekit.certs DIR [--name HOST ...]` writes into DIR, keeping files already there:
ca.pem / ca-key.pem (the CA), and for each of text-service, vocoder-service and orchestrator a
`<name>.pem` / `<name>-key.pem` pair valid both as server and as client certificate, naming
localhost, 127.0.0.1, ::1, the service's own name and every --name. Keys are P-256, readable by
the owner only; certificates last a year.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SERVICES = ("text-service", "vocoder-service", "orchestrator")
VALID_DAYS = 365


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)


def _builder(subject: str, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
    )


def make_ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """The CA in `directory` (ca.pem, ca-key.pem), made when missing."""
    cert_path, key_path = directory / "ca.pem", directory / "ca-key.pem"
    if cert_path.is_file() and key_path.is_file():
        ca_key = serialization.load_pem_private_key(key_path.read_bytes(), None)
        if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{key_path}: not an elliptic-curve key; remove it to make a new CA")
        return x509.load_pem_x509_certificate(cert_path.read_bytes()), ca_key
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "split-tts private CA")])
    cert = (
        _builder("split-tts private CA", name, key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    _write_key(key_path, key)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert, key


def issue(
    directory: Path, name: str, hosts: list[str], ca: tuple | None = None
) -> tuple[Path, Path]:
    """`<name>.pem` and `<name>-key.pem` signed by the CA, as server and client; kept if present."""
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}-key.pem"
    if cert_path.is_file() and key_path.is_file():
        return cert_path, key_path
    ca_cert, ca_key = ca or make_ca(directory)
    key = ec.generate_private_key(ec.SECP256R1())
    alt: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(host.strip("[]"))))
        except ValueError:
            alt.append(x509.DNSName(host))
    cert = (
        _builder(name, ca_cert.subject, key.public_key())
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    _write_key(key_path, key)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


def make_all(directory: str | Path, extra_names: Sequence[str] = ()) -> Path:
    """The CA and one certificate per service in `directory` (created), missing ones made."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ca = make_ca(directory)
    for service in SERVICES:
        issue(directory, service, ["localhost", "127.0.0.1", "::1", service, *extra_names], ca)
    return directory


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m servicekit.certs",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("directory")
    p.add_argument(
        "--name",
        action="append",
        default=[],
        help="another DNS name or IP address for every certificate (repeatable)",
    )
    args = p.parse_args(argv)
    print(make_all(args.directory, args.name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
