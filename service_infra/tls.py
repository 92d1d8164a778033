"""TLS and mutual TLS on every gRPC hop, from PEM files given by flags or the environment.

    gateway  (public)   server: --tls-cert/--tls-key; clients need not present a certificate
                        unless --tls-client-auth
    gateway -> workers  client: verifies the worker against --tls-ca, presents its own
                        --tls-cert/--tls-key (mutual TLS)
    prefill -> decode   the same (the KV transfer control plane and the grpc transport)
    workers  (internal) server: --tls-cert/--tls-key and --tls-ca, and a client certificate
                        signed by that CA is required: unauthenticated peers are refused in the
                        TLS handshake, before any RPC runs
Without --tls-cert everything is plaintext (the embedded default for `pdserve up` on one
host). Environment variables PDSERVE_TLS_CERT, PDSERVE_TLS_KEY, PDSERVE_TLS_CA stand in for
the flags (helm mounts the files from a Secret).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # grpc loads where channels and servers are made (the CLI starts fast)
    import grpc


@dataclass(frozen=True)
class TLSConfig:
    cert: bytes  # this process's certificate chain (PEM): server side, and client side for mTLS
    key: bytes  # its private key (PEM)
    ca: bytes | None  # CA bundle (PEM) that verifies peers; None: the system roots (clients)
    require_client_cert: bool  # servers: refuse peers without a certificate signed by `ca`
    server_name: str | None = None  # clients: expected name in the peer's certificate
    cert_file: str = ""  # where cert and key came from (servers that take paths: uvicorn)
    key_file: str = ""
    ca_file: str = ""

    def __post_init__(self) -> None:
        if self.require_client_cert and self.ca is None:
            raise ValueError("requiring client certificates needs --tls-ca (the CA that "
                             "signed them)")

    def server_credentials(self) -> grpc.ServerCredentials:
        import grpc

        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=self.require_client_cert)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        import grpc

        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    def channel_options(self) -> list[tuple[str, str]]:
        if self.server_name:
            return [("grpc.ssl_target_name_override", self.server_name)]
        return []


def add_tls_arguments(p: argparse.ArgumentParser, is_public: bool) -> None:
    g = p.add_argument_group("TLS")
    g.add_argument("--tls-cert", default=None, metavar="PEM",
                   help="certificate chain of this process (turns TLS on; env PDSERVE_TLS_CERT)")
    g.add_argument("--tls-key", default=None, metavar="PEM",
                   help="its private key (env PDSERVE_TLS_KEY)")
    g.add_argument("--tls-ca", default=None, metavar="PEM",
                   help="CA bundle that verifies peers (env PDSERVE_TLS_CA)"
                        + ("" if is_public else "; client certificates must be signed by it"))
    g.add_argument("--tls-server-name", default=None,
                   help="name the peers' certificates carry, when it differs from the address")
    if is_public:
        g.add_argument("--tls-client-auth", action="store_true",
                       help="require client certificates on the public gRPC API too")


def tls_from_args(args: argparse.Namespace, is_public: bool,
                  environ=os.environ) -> TLSConfig | None:
    """The process's TLS configuration, or None for plaintext. Internal servers (workers)
    always require client certificates; the public gateway only with --tls-client-auth."""
    def pick(flag: str, env: str) -> str | None:
        return getattr(args, flag, None) or environ.get(env) or None

    cert, key = pick("tls_cert", "PDSERVE_TLS_CERT"), pick("tls_key", "PDSERVE_TLS_KEY")
    ca = pick("tls_ca", "PDSERVE_TLS_CA")
    if not cert and not key:
        if ca:
            raise ValueError("--tls-ca needs --tls-cert and --tls-key too")
        return None
    if not (cert and key):
        raise ValueError("TLS needs both --tls-cert and --tls-key")

    def read(path: str, what: str) -> bytes:
        try:
            return Path(path).read_bytes()
        except OSError as e:
            raise ValueError(f"cannot read the TLS {what} {path!r}: {e.strerror}") from None

    return TLSConfig(read(cert, "certificate"), read(key, "key"),
                     read(ca, "CA bundle") if ca else None,
                     require_client_cert=getattr(args, "tls_client_auth", False) or not is_public,
                     server_name=getattr(args, "tls_server_name", None),
                     cert_file=cert, key_file=key, ca_file=ca or "")


def add_port(server, address: str, tls: TLSConfig | None) -> int:
    """Bind a grpc (or grpc.aio) server to address, with TLS when configured; the port."""
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, tls.server_credentials())


def channel(address: str, tls: TLSConfig | None, options=(), is_aio: bool = False,
            interceptors=None):
    """A channel to address: TLS (presenting our certificate) when configured; `interceptors`
    for an aio channel (service_infra/tracing.py's)."""
    import grpc

    module = grpc.aio if is_aio else grpc
    options = [*options, *(tls.channel_options() if tls else ())]
    extra = {"interceptors": interceptors} if is_aio and interceptors else {}
    if tls is None:
        return module.insecure_channel(address, options=options, **extra)
    return module.secure_channel(address, tls.channel_credentials(), options=options, **extra)
