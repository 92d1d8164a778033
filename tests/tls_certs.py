"""Certificates for the TLS tests, generated with the `cryptography` package: a CA, a server
certificate for 127.0.0.1/localhost, a client certificate signed by the CA, and a client
certificate signed by a stranger's CA (which mutual TLS must refuse)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class CertFiles:
    ca: Path  # the CA every pdserve process trusts
    cert: Path  # a certificate signed by it, for servers and clients (127.0.0.1, localhost)
    key: Path
    rogue_cert: Path  # signed by another CA
    rogue_key: Path


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _sign(subject: str, key, issuer: str, issuer_key, is_ca: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True))
    if not is_ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False).add_extension(x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(path: Path, cert: x509.Certificate | None = None, key=None) -> Path:
    if cert is not None:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    else:
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return path


def make_certs(folder: Path) -> CertFiles:
    ca_key, rogue_ca_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(
        ec.SECP256R1())
    key, rogue_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(
        ec.SECP256R1())
    ca = _sign("pdserve test CA", ca_key, "pdserve test CA", ca_key, is_ca=True)
    cert = _sign("pdserve", key, "pdserve test CA", ca_key, is_ca=False)
    rogue = _sign("intruder", rogue_key, "someone else's CA", rogue_ca_key, is_ca=False)
    return CertFiles(_write(folder / "ca.pem", ca), _write(folder / "cert.pem", cert),
                     _write(folder / "key.pem", key=key), _write(folder / "rogue.pem", rogue),
                     _write(folder / "rogue-key.pem", key=rogue_key))
