"""`ferry up --tls`: mutual TLS between the services (the gRPC KV transport included), HTTPS
and TLS gRPC for clients; a peer without a certificate of the cluster's CA is refused."""

from __future__ import annotations

import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest

from ferry.gateway.sdk import FerryClient
from ferry.infra import certs
from ferry.protos import scheduler_pb2, scheduler_pb2_grpc
from tests.cluster import Cluster, ferry_up, greedy
from tests.helpers import Checkpoint

PROMPT = [5, 17, 99, 23, 8, 41]
CHECKPOINT = Checkpoint(seed=3)


@pytest.fixture(scope="module")
def cluster(checkpoint: Path) -> Iterator[Cluster]:
    with ferry_up(
        "",  # its own redis-server
        "--tls",
        "--model",
        str(checkpoint),
        "--num-kv-blocks",
        "64",
        "--kv-transport",
        "grpc",  # the KV pulls go over mutual TLS too
        "--worker-args",
        "--block-size 16 --verify-checksum",
        cluster="tls",
    ) as c:
        yield c


def _generate(scheduler: str, credentials: grpc.ChannelCredentials | None) -> list[int]:
    """A Generate call to the scheduler, over TLS with ``credentials`` (None: plain text)."""
    channel = (
        grpc.secure_channel(scheduler, credentials)
        if credentials
        else grpc.insecure_channel(scheduler)
    )
    with channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        request = scheduler_pb2.GenerateRequest(
            prompt_token_ids=PROMPT, sampling_params=greedy(8, ignore_eos=True)
        )
        return [t for chunk in stub.Generate(request, timeout=30) for t in chunk.token_ids]


def _credentials(cert_dir: Path, ca: str) -> grpc.ChannelCredentials:
    """A client showing the certificate in ``cert_dir`` (certs.write's files), trusting ``ca``."""
    return grpc.ssl_channel_credentials(
        root_certificates=Path(ca).read_bytes(),
        private_key=(cert_dir / "cluster.key").read_bytes(),
        certificate_chain=(cert_dir / "cluster.pem").read_bytes(),
    )


def test_a_tls_cluster_serves_its_clients_over_https_and_tls_grpc(cluster: Cluster) -> None:
    assert cluster.gateway.startswith("https://")
    http = openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=cluster.tls_ca))
    client = openai.OpenAI(base_url=f"{cluster.gateway}/v1", api_key="-", http_client=http)
    (model,) = client.models.list().data
    reply = client.completions.create(model=model.id, prompt="hello", max_tokens=5)
    assert reply.usage is not None and reply.usage.completion_tokens == 5

    assert cluster.logged('"event": "Application startup complete."')  # uvicorn's, as JSON
    assert not cluster.logged("INFO:     ")
    with FerryClient(cluster.grpc, tls_ca=cluster.tls_ca) as sdk:
        assert sdk.complete("hello", max_tokens=5).usage.completion_tokens == 5
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):  # not our CA
        urllib.request.urlopen(f"{cluster.gateway}/health", timeout=10)


def test_a_peer_without_a_certificate_of_the_cluster_ca_is_refused(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The scheduler (as every internal server) asks for the client's certificate: plain text,
    TLS without a certificate and a certificate of another CA are all refused; the cluster's
    own certificate is served."""
    ours = Path(cluster.tls_ca).parent
    assert len(_generate(cluster.scheduler, _credentials(ours, cluster.tls_ca))) == 8

    other = certs.new_ca("another CA")
    key, cert = certs.issue(other, certs.local_hosts("127.0.0.1"), "intruder")
    certs.write(tmp_path, "cluster", key, cert)
    refused = {
        "plain text": None,
        "no client certificate": grpc.ssl_channel_credentials(
            root_certificates=Path(cluster.tls_ca).read_bytes()
        ),
        "another CA's certificate": _credentials(tmp_path, cluster.tls_ca),
    }
    for how, credentials in refused.items():
        with pytest.raises(grpc.RpcError) as e:
            _generate(cluster.scheduler, credentials)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, how
    cluster.wait_for("blocks freed", cluster.all_blocks_free, 10)
