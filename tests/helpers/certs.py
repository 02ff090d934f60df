"""Real X.509 certificates for the TLS tests, made with `cryptography`: a CA, a server
certificate for 127.0.0.1/localhost and a client certificate it signed, and a second CA with a
client certificate of its own (one the server must not accept)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# The bearer token of conftest's mutual-TLS server (secured_server).
SECURED_TOKEN = "secured-test-token"


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path
    other_client_cert: Path
    other_client_key: Path

    def server_flags(self, *, mutual: bool = False) -> list[str]:
        flags = ["--tls-cert", str(self.server_cert), "--tls-key", str(self.server_key)]
        return [*flags, "--tls-client-ca", str(self.ca)] if mutual else flags

    def channel_credentials(self, *, client_cert: bool = False) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca.read_bytes(),
            private_key=self.client_key.read_bytes() if client_cert else None,
            certificate_chain=self.client_cert.read_bytes() if client_cert else None,
        )


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


def _write_cert(cert: x509.Certificate, path: Path) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _builder(
    subject: str, issuer: str, public_key: ec.EllipticCurvePublicKey
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


def _ca(directory: Path, name: str) -> tuple[ec.EllipticCurvePrivateKey, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _builder(name, name, key.public_key())
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
    path = directory / f"{name}.pem"
    _write_cert(cert, path)
    return key, path


def _leaf(
    directory: Path,
    name: str,
    ca_name: str,
    ca_key: ec.EllipticCurvePrivateKey,
    *,
    server: bool,
) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = _builder(name, ca_name, key.public_key()).add_extension(
        x509.ExtendedKeyUsage([usage]), critical=False
    )
    if server:
        names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}.key"
    _write_cert(builder.sign(ca_key, hashes.SHA256()), cert_path)
    _write_key(key, key_path)
    return cert_path, key_path


def make_pki(directory: Path) -> Pki:
    ca_key, ca = _ca(directory, "test-ca")
    server_cert, server_key = _leaf(directory, "server", "test-ca", ca_key, server=True)
    client_cert, client_key = _leaf(directory, "client", "test-ca", ca_key, server=False)
    other_key, other_ca = _ca(directory, "other-ca")
    other_cert, other_client_key = _leaf(directory, "intruder", "other-ca", other_key, server=False)
    return Pki(
        ca, server_cert, server_key, client_cert, client_key, other_ca, other_cert, other_client_key
    )
