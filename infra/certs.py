"""Certificates for ``ferry up --tls``: a throwaway CA and one certificate, signed by it, that
every process of a local cluster shows (as a server and as a client). A real deployment brings
its own (``--tls-cert``, ``--tls-key``, ``--tls-ca``; cert-manager in Kubernetes)."""

from __future__ import annotations

import datetime
import ipaddress
import socket
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ferry.services.common.tls import TlsFiles

VALID_FOR = datetime.timedelta(days=7)  # a local cluster's certificates die with it anyway


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(
    subject: str, issuer: x509.Name, key: ec.EllipticCurvePrivateKey
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # a peer's clock a little behind
        .not_valid_after(now + VALID_FOR)
    )


def new_ca(common_name: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _builder(common_name, _name(common_name), key)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
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
    return key, cert


def issue(
    ca: tuple[ec.EllipticCurvePrivateKey, x509.Certificate], hosts: Sequence[str], name: str
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A certificate for servers dialled at ``hosts`` (names or IP addresses) that is also a
    client's (mutual TLS)."""
    ca_key, ca_cert = ca
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    cert = (
        _builder(name, ca_cert.subject, key)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def write(
    directory: Path, stem: str, key: ec.EllipticCurvePrivateKey | None, cert: x509.Certificate
) -> tuple[str, str]:
    """``stem``.pem (the certificate) and ``stem``.key (mode 600) in ``directory``; their paths."""
    cert_path, key_path = directory / f"{stem}.pem", directory / f"{stem}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is not None:
        key_path.touch(mode=0o600)
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    return str(cert_path), str(key_path)


def local_hosts(host: str) -> list[str]:
    """The names a local cluster's services are dialled by: loopback, this host's name, and
    the address they bind (`ferry up` dials that one, 0.0.0.0 included)."""
    return ["localhost", "127.0.0.1", "::1", socket.gethostname(), *([host] if host else [])]


def throwaway(directory: Path, host: str) -> TlsFiles:
    """A new CA and a certificate for every service of a cluster bound to ``host``, written to
    ``directory`` (which should be the user's alone); the CA's key is not kept."""
    ca = new_ca("ferry up throwaway CA")
    ca_path, _ = write(directory, "ca", None, ca[1])
    key, cert = issue(ca, local_hosts(host), "ferry local cluster")
    cert_path, key_path = write(directory, "cluster", key, cert)
    return TlsFiles(cert=cert_path, key=key_path, ca=ca_path)
