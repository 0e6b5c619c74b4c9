"""Internal-plane mutual TLS (cluster/internal_tls.py) on a real cluster: router -> worker gRPC and prefill ->
decode KV transfer run over TLS with the cluster's certificates, and a client without one is refused at every
internal port, whatever secret it carries."""

from __future__ import annotations

import socket
import subprocess
import sys

import grpc
import pytest
from cluster_helpers import internal_channel, rpc_error, wait_idle, worker_components, worker_stats

from cluster import grpc_plumbing, internal_tls
from cluster.internal_tls import SERVER_NAME, InternalTLS
from deploy.local_cluster import ClusterConfig, LocalCluster
from duet.client import Client, stream_to_record
from duet.internal.v1 import workers_pb2 as wpb
from duet.internal.v1 import workers_pb2_grpc as wpb_grpc
from engine import LLM, SamplingParams
from kvtransfer import messages as m


def test_generated_material_loads_from_a_directory_and_the_environment(tmp_path, monkeypatch):
    from cryptography import x509

    tls = internal_tls.generate()
    cert = x509.load_pem_x509_certificate(tls.cert_pem)
    ca = x509.load_pem_x509_certificate(tls.ca_pem)
    assert cert.issuer == ca.subject and cert.subject != ca.subject
    assert cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName) == [SERVER_NAME]
    assert "PRIVATE KEY" not in repr(tls)
    directory = tls.write(tmp_path / "tls")
    assert sorted(p.name for p in directory.iterdir()) == ["ca.crt", "tls.crt", "tls.key"]
    assert (directory / "tls.key").stat().st_mode & 0o077 == 0
    assert InternalTLS.load(directory) == tls and InternalTLS.load(None) is None
    (directory / "ca.crt").unlink()
    with pytest.raises(ValueError, match=r"--internal-tls-dir=.* must hold ca.crt, tls.crt, tls.key; missing .*ca.crt"):
        InternalTLS.load(directory)
    other = internal_tls.generate()
    for name, value in other.env().items():
        monkeypatch.setenv(name, value)
    assert InternalTLS.load(directory) == other  # the environment overrides the directory
    monkeypatch.delenv("DUET_INTERNAL_TLS_KEY")
    with pytest.raises(ValueError, match="missing DUET_INTERNAL_TLS_KEY"):
        InternalTLS.load()


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir):
    config = ClusterConfig(model_dir=str(tiny_llama_dir), internal_tls=True,
                           worker_args=["--max-model-len", "256", "--num-kv-blocks", "32"])
    with LocalCluster(config).start() as c:
        yield c


def _workers(cluster):
    return [next(w for w in worker_components(cluster) if w.name.startswith(role)) for role in ("prefill", "decode")]


def test_requests_run_over_internal_tls_with_the_offline_tokens(cluster, tiny_llama_dir):
    prompts = [[5, 6, 7, 8] * 9, [40, 41, 42] * 7]
    params = SamplingParams(max_tokens=8, temperature=0)
    expected = [o.outputs[0].token_ids for o in LLM(str(tiny_llama_dir), max_model_len=256).generate(prompts, params)]
    with Client(cluster.router_address) as client:
        got = [stream_to_record(client.generate(p, params, timeout_s=60))["token_ids"] for p in prompts]
    assert got == expected
    stats = wait_idle(cluster)
    assert stats["decode-0"].num_free_blocks == 32


def test_internal_ports_refuse_a_client_without_the_clusters_certificate(cluster):
    prefill, decode = _workers(cluster)
    others = internal_tls.generate()  # another cluster's CA and certificate
    impostor = InternalTLS(cluster.internal_tls.ca_pem, others.cert_pem, others.key_pem)  # trusts ours; not trusted
    for address, role in ((prefill.address, "prefill"), (decode.address, "decode")):
        for tls in (None, others, impostor):  # each with the right cluster secret
            err = rpc_error(lambda a=address, r=role, t=tls: worker_stats(a, r, tls=t))
            assert err.code() == grpc.StatusCode.UNAVAILABLE, err.details()
            assert not grpc_plumbing.health_check(address, tls=tls)
        assert grpc_plumbing.health_check(address, tls=cluster.internal_tls)
        assert worker_stats(address, role, tls=cluster.internal_tls).integrity_error == ""
    with internal_channel(decode.address, tls=cluster.internal_tls) as ch:  # certificate and secret
        assert wpb_grpc.DecodeWorkerStub(ch).Stats(wpb.StatsRequest(), timeout=10).num_kv_blocks == 32
    with grpc_plumbing.channel(decode.address, tls=cluster.internal_tls) as ch:  # a certificate, but no secret
        err = rpc_error(lambda: wpb_grpc.DecodeWorkerStub(ch).Stats(wpb.StatsRequest(), timeout=10))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED


def test_the_kv_port_speaks_only_tls(cluster):
    """A plaintext HELLO to the decode worker's KV receiver gets no HELLO_REPLY: the connection is dropped."""
    from cluster.cluster_secret import load_cluster_secret
    from cluster.registry import WorkerRegistry

    registry = WorkerRegistry.from_url(cluster.redis_url, cluster_secret=load_cluster_secret())
    (model_id,) = registry.list_models()
    (decode,) = registry.list_workers(model_id, "decode")
    host, port = m.split_endpoint(decode.info.kv_address)
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(m.encode_frame_header(m.HELLO, {"transport": "tcp"}))
        sock.settimeout(5)
        try:
            reply = sock.recv(1 << 16)
        except ConnectionResetError:
            reply = b""
        assert reply[:1] in (b"", b"\x15")  # EOF or reset, or a TLS alert record
    wait_idle(cluster)


def test_torch_transport_is_refused_with_internal_tls(tmp_path, tiny_llama_dir):
    tls_dir = internal_tls.generate().write(tmp_path / "tls")
    up = subprocess.run([sys.executable, "-m", "duet", "up", "--internal-tls", "--kv-transport", "torch"],
                        capture_output=True, text=True, timeout=60)
    assert up.returncode == 2 and "--internal-tls needs --kv-transport tcp" in up.stderr
    worker = subprocess.run([sys.executable, "-m", "duet", "decode", "--model", str(tiny_llama_dir),
                             "--redis-url", "redis://127.0.0.1:9", "--kv-transport", "torch",
                             "--internal-tls-dir", str(tls_dir)], capture_output=True, text=True, timeout=120)
    assert worker.returncode != 0
    assert "--kv-transport=torch cannot be used with internal TLS" in worker.stderr, worker.stderr[-2000:]
