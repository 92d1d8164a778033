"""service_infra/tls.py on a real grpc server on loopback with generated certificates: mutual TLS
admits a client certificate signed by the CA and refuses no certificate, a stranger's
certificate and plaintext; flag and environment errors are clear."""

from __future__ import annotations

import argparse
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from service_infra.tls import TLSConfig, add_port, add_tls_arguments, channel, tls_from_args
from tests.tls_certs import make_certs


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


def args_for(*argv: str, is_public: bool = False) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_tls_arguments(p, is_public)
    return p.parse_args(argv)


@pytest.fixture(scope="module")
def server(certs):
    """An internal (worker-like) server: mutual TLS required."""
    tls = tls_from_args(args_for("--tls-cert", str(certs.cert), "--tls-key", str(certs.key),
                                 "--tls-ca", str(certs.ca)), is_public=False, environ={})
    assert tls.require_client_cert
    srv = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), srv)
    port = add_port(srv, "127.0.0.1:0", tls)
    srv.start()
    yield f"127.0.0.1:{port}"
    srv.stop(0)


def check(address: str, tls: TLSConfig | None) -> grpc.StatusCode:
    with channel(address, tls) as ch:
        try:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            return grpc.StatusCode.OK
        except grpc.RpcError as e:
            return e.code()


def test_mutual_tls_admits_the_ca_signed_client(server, certs):
    tls = TLSConfig(certs.cert.read_bytes(), certs.key.read_bytes(), certs.ca.read_bytes(),
                    require_client_cert=True)
    assert check(server, tls) == grpc.StatusCode.OK


def test_mutual_tls_refuses_strangers_and_plaintext(server, certs):
    rogue = TLSConfig(certs.rogue_cert.read_bytes(), certs.rogue_key.read_bytes(),
                      certs.ca.read_bytes(), require_client_cert=False)
    assert check(server, rogue) == grpc.StatusCode.UNAVAILABLE  # handshake refused
    assert check(server, None) == grpc.StatusCode.UNAVAILABLE  # plaintext to a TLS port
    with grpc.secure_channel(server, grpc.ssl_channel_credentials(
            root_certificates=certs.ca.read_bytes())) as ch:  # TLS, but no client certificate
        with pytest.raises(grpc.RpcError) as info:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_flags_environment_and_errors(certs, tmp_path):
    assert tls_from_args(args_for(), is_public=False, environ={}) is None  # plaintext
    env = {"PDSERVE_TLS_CERT": str(certs.cert), "PDSERVE_TLS_KEY": str(certs.key)}
    public = tls_from_args(args_for(is_public=True), is_public=True, environ=env)
    assert public is not None and not public.require_client_cert  # public: certs optional
    with pytest.raises(ValueError, match="tls-ca"):  # internal servers must verify clients
        tls_from_args(args_for(), is_public=False, environ=env)
    with pytest.raises(ValueError, match="both --tls-cert and --tls-key"):
        tls_from_args(args_for("--tls-cert", str(certs.cert)), is_public=True, environ={})
    with pytest.raises(ValueError, match="cannot read the TLS key"):
        tls_from_args(args_for("--tls-cert", str(certs.cert), "--tls-key",
                               str(tmp_path / "missing.pem")), is_public=True, environ={})
