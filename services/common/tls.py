"""TLS on every gRPC connection between Ferry's services, and HTTPS on the gateway.

A process holds one certificate and key (``--tls-cert``, ``--tls-key``) and the CA that signs
its peers' (``--tls-ca``). Between services TLS is mutual: a server asks for the client's
certificate and refuses one the CA did not sign, and a client checks the server's against the
address it dials (so a certificate names every host a service is dialled by). The gateway's
public endpoints (REST, the public gRPC API) show their certificate and ask nothing of their
clients, who authenticate with the API key. Like the keepalive, one setting per process, made
once (``configure``) before any channel or server. UCX has no TLS: see services/kv_transfer/ucx.py.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True)
class TlsFiles:
    """PEM files; all three or none (plain text)."""

    cert: str = ""
    key: str = ""
    ca: str = ""

    def __post_init__(self) -> None:
        given = {"--tls-cert": self.cert, "--tls-key": self.key, "--tls-ca": self.ca}
        if any(given.values()) and not all(given.values()):
            missing = ", ".join(f for f, path in given.items() if not path)
            raise ValueError(f"--tls-cert, --tls-key and --tls-ca go together: give {missing}")
        for flag, path in given.items():
            if path and not os.access(path, os.R_OK):
                raise ValueError(f"{flag} {path}: no such file, or not readable")

    @property
    def on(self) -> bool:
        return bool(self.cert)

    def flags(self) -> list[str]:
        """The command-line flags that give a child process these files."""
        if not self.on:
            return []
        return ["--tls-cert", self.cert, "--tls-key", self.key, "--tls-ca", self.ca]


_files = TlsFiles()


def configure(files: TlsFiles) -> None:
    global _files
    _files = files


def files() -> TlsFiles:
    return _files


def _read(path: str) -> bytes:
    return Path(path).read_bytes()


def server_credentials(client_auth: bool = True) -> grpc.ServerCredentials | None:
    """None in plain text. ``client_auth``: refuse clients without a certificate of the CA's
    (between services); without it, any client (the public gRPC API)."""
    if not _files.on:
        return None
    return grpc.ssl_server_credentials(
        [(_read(_files.key), _read(_files.cert))],
        root_certificates=_read(_files.ca) if client_auth else None,
        require_client_auth=client_auth,
    )


def channel_credentials() -> grpc.ChannelCredentials | None:
    """None in plain text: this process's certificate, shown to servers that trust the CA."""
    if not _files.on:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=_read(_files.ca),
        private_key=_read(_files.key),
        certificate_chain=_read(_files.cert),
    )


def client_ssl_context() -> ssl.SSLContext | None:
    """For HTTPS requests to a gateway whose certificate the CA signed (None: plain HTTP)."""
    if not _files.on:
        return None
    return ssl.create_default_context(cafile=_files.ca)


def http_scheme() -> str:
    return "https" if _files.on else "http"
