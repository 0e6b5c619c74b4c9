"""The router's grpc.health.v1 follows the workers (NOT_SERVING while no worker of a role is up, Check and
Watch alike), and server reflection answers v1 as well as v1alpha, on the router and the workers (real processes,
real redis)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cluster import grpc_plumbing, reflection_v1
from deploy.redis_server import RedisServer
from engine.ports import pick_free_port
from router.server import HEALTH_POLL_S, RouterConfig, RouterServer
from router.worker_view import NoWorkers

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
ROUTER_SERVICES = {"duet.v1.Generation", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                   "grpc.reflection.v1.ServerReflection"}


def v1_reflect(channel: grpc.Channel, *requests: dict) -> list:
    """ServerReflectionInfo over v1's method path, with v1's own message types."""
    reflection_v1.register_v1_descriptor()
    pool = descriptor_pool.Default()
    request_type = message_factory.GetMessageClass(pool.FindMessageTypeByName(
        "grpc.reflection.v1.ServerReflectionRequest"))
    response_type = message_factory.GetMessageClass(pool.FindMessageTypeByName(
        "grpc.reflection.v1.ServerReflectionResponse"))
    call = channel.stream_stream("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                                 request_serializer=request_type.SerializeToString,
                                 response_deserializer=response_type.FromString)
    return list(call(iter([request_type(**r) for r in requests]), timeout=10))


def start_worker(role: str, redis_url: str, model_dir) -> tuple[subprocess.Popen, str]:
    port = pick_free_port()
    proc = subprocess.Popen([sys.executable, "-m", "duet", role, "--port", str(port), "--redis-url", redis_url,
                             "--model", str(model_dir), "--num-kv-blocks", "32"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while not grpc_plumbing.health_check(address):
        assert proc.poll() is None and time.monotonic() < deadline, f"{role} did not start"
        time.sleep(0.2)
    return proc, address


def wait_status(health: health_pb2_grpc.HealthStub, service: str, status: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status != status:
        name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
        assert time.monotonic() < deadline, f"{service!r} never became {name}"
        time.sleep(0.1)


def test_v1_descriptor_is_v1alpha_renamed():
    """Wire-identical: the same messages, fields, numbers and types; only the package differs."""
    v1 = reflection_v1.v1_file_descriptor()
    v1alpha = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(v1alpha)
    assert (v1.name, v1.package) == ("grpc/reflection/v1/reflection.proto", "grpc.reflection.v1")
    shape = [(m.name, [(f.name, f.number, f.type, f.label, f.type_name.rsplit(".", 1)[-1]) for f in m.field])
             for m in v1alpha.message_type]
    assert shape == [(m.name, [(f.name, f.number, f.type, f.label, f.type_name.rsplit(".", 1)[-1]) for f in m.field])
                     for m in v1.message_type]
    assert all(".v1alpha." not in f.type_name for m in v1.message_type for f in m.field)


def test_router_health_follows_the_workers_and_reflection_answers_v1(tiny_llama_dir):
    procs: list[subprocess.Popen] = []
    with RedisServer() as redis_server:
        router = RouterServer(RouterConfig(redis_url=redis_server.url, model_dir=tiny_llama_dir, port=0))
        router.start()
        try:
            with grpc.insecure_channel(router.address) as channel:
                health = health_pb2_grpc.HealthStub(channel)
                watched: list[int] = []
                watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=180)
                watcher = threading.Thread(target=lambda: watched.extend(r.status for r in _until_cancelled(watch)))
                watcher.start()

                # no worker: the service is NOT_SERVING, the process is up
                for service in ("", "duet.v1.Generation"):
                    assert health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status == NOT_SERVING
                assert health.Check(health_pb2.HealthCheckRequest(service="grpc.health.v1.Health"),
                                    timeout=5).status == SERVING

                # reflection, v1 and v1alpha alike
                listed, described, reflected = v1_reflect(channel, {"list_services": ""},
                                                          {"file_containing_symbol": "duet.v1.Generation"},
                                                          {"file_containing_symbol": reflection_v1.SERVICE_NAME})
                assert {s.name for s in listed.list_services_response.service} == ROUTER_SERVICES
                files = [descriptor_pb2.FileDescriptorProto.FromString(b)
                         for b in described.file_descriptor_response.file_descriptor_proto]
                assert files[0].name == "duet/v1/generation.proto"
                assert [m.name for m in files[0].service[0].method] == ["Generate", "Abort", "ExplainRoute"]
                v1_file = descriptor_pb2.FileDescriptorProto.FromString(
                    reflected.file_descriptor_response.file_descriptor_proto[0])
                assert (v1_file.name, v1_file.service[0].name) == (reflection_v1.V1_FILE, "ServerReflection")
                replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
                assert {s.name for r in replies for s in r.list_services_response.service} == ROUTER_SERVICES

                # a prefill worker alone: still NOT_SERVING (the router sees it, and no decode worker)
                prefill, prefill_address = start_worker("prefill", redis_server.url, tiny_llama_dir)
                procs.append(prefill)
                with grpc.insecure_channel(prefill_address) as worker_channel:  # workers reflect v1 too
                    (worker_listed,) = v1_reflect(worker_channel, {"list_services": ""})
                    assert "duet.internal.v1.PrefillWorker" in {s.name for s in
                                                                worker_listed.list_services_response.service}
                time.sleep(0.6)  # past the registry cache
                with pytest.raises(NoWorkers, match="no decode worker"):
                    router.router.view.workers()
                time.sleep(2 * HEALTH_POLL_S)
                assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status == NOT_SERVING

                # and a decode worker: SERVING
                decode, _ = start_worker("decode", redis_server.url, tiny_llama_dir)
                procs.append(decode)
                wait_status(health, "", SERVING)
                wait_status(health, "duet.v1.Generation", SERVING, timeout_s=1)

                # the decode worker stops (deregisters): NOT_SERVING again
                decode.terminate()
                decode.wait(30)
                wait_status(health, "", NOT_SERVING)
                wait_status(health, "duet.v1.Generation", NOT_SERVING, timeout_s=1)
                watch.cancel()
                watcher.join(10)
                assert watched == [NOT_SERVING, SERVING, NOT_SERVING]
        finally:
            router.stop()
            for proc in procs:
                proc.terminate()
                proc.wait(30)


def _until_cancelled(stream):
    try:
        yield from stream
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.CANCELLED, e
