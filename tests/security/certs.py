"""Throw-away PKI for the tests: a CA, a service certificate, a client certificate, and a
certificate from a CA nobody trusts. EC P-256 keys (fast to make)."""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from dsmesh.runtime.security import TLSConfig


@dataclass(frozen=True)
class Pair:
    cert: Path
    key: Path


@dataclass(frozen=True)
class Pki:
    ca: Path
    service: Pair  # SAN 127.0.0.1 + localhost; server and client use (services dial each other)
    client: Pair  # a user of the gateway
    rogue: Pair  # signed by a CA the mesh does not trust
    rogue_ca: Path

    def client_tls(self, pair: Pair | None = None, ca: Path | None = None) -> TLSConfig:
        pair = pair or self.client
        return TLSConfig(str(pair.cert), str(pair.key), str(ca or self.ca))

    def service_flags(self) -> list[str]:
        s = self.service
        return ["--tls-cert", str(s.cert), "--tls-key", str(s.key), "--tls-ca", str(self.ca)]


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(folder: Path, stem: str, cert: x509.Certificate, key) -> Pair:
    cert_path, key_path = folder / f"{stem}.pem", folder / f"{stem}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_path.chmod(0o600)
    return Pair(cert_path, key_path)


def _builder(subject: str, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


def _ca(common_name: str):
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _builder(common_name, _name(common_name), key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return cert, key


LOCAL_NAMES = ("127.0.0.1", "localhost")


def _san(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _leaf(common_name: str, ca_cert, ca_key, server: bool, names: Sequence[str] = LOCAL_NAMES):
    key = ec.generate_private_key(ec.SECP256R1())
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
    builder = _builder(common_name, ca_cert.subject, key.public_key()).add_extension(
        x509.BasicConstraints(ca=False, path_length=None), critical=True
    )
    if server:
        usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
        san = x509.SubjectAlternativeName([_san(name) for name in names])
        builder = builder.add_extension(san, critical=False)
    cert = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False).sign(
        ca_key, hashes.SHA256()
    )
    return cert, key


def make_service_pair(folder: Path, names: Sequence[str]) -> tuple[Path, Pair]:
    """A CA of its own (returned) and a service certificate with exactly the SANs ``names``
    (IP addresses and DNS names)."""
    ca_cert, ca_key = _ca("dsmesh names CA")
    ca_path = folder / "names-ca.pem"
    ca_path.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    pair = _write(folder, "named", *_leaf("dsmesh-service", ca_cert, ca_key, True, names))
    return ca_path, pair


def make_pki(folder: Path) -> Pki:
    ca_cert, ca_key = _ca("dsmesh test CA")
    rogue_cert, rogue_key = _ca("rogue CA")
    ca_path, rogue_ca_path = folder / "ca.pem", folder / "rogue-ca.pem"
    ca_path.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    rogue_ca_path.write_bytes(rogue_cert.public_bytes(serialization.Encoding.PEM))
    return Pki(
        ca=ca_path,
        service=_write(folder, "service", *_leaf("dsmesh-service", ca_cert, ca_key, True)),
        client=_write(folder, "client", *_leaf("dsmesh-client", ca_cert, ca_key, False)),
        rogue=_write(folder, "rogue", *_leaf("dsmesh-service", rogue_cert, rogue_key, True)),
        rogue_ca=rogue_ca_path,
    )
