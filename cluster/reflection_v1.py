"""gRPC server reflection v1 (`grpc.reflection.v1.ServerReflection`), served by grpcio-reflection's own
v1alpha servicer.

grpcio-reflection ships only v1alpha (grpc/grpc#38576), while newer clients (grpcurl, Postman, grpc-java's
tools) ask v1 first. The two protocols are the same schema under another package name: every message and field
number is identical, so the bytes on the wire are too. v1 is therefore the library's v1alpha servicer mounted
at v1's method path, its messages (de)serialized by the v1alpha classes; and so that v1 is described like any
other service (ListServices names it, FileContainingSymbol finds it), its file descriptor (the v1alpha one
renamed) is added to the default descriptor pool.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2

V1ALPHA_PACKAGE = "grpc.reflection.v1alpha"
V1_PACKAGE = "grpc.reflection.v1"
V1_FILE = "grpc/reflection/v1/reflection.proto"
SERVICE_NAME = f"{V1_PACKAGE}.ServerReflection"
_METHOD = "ServerReflectionInfo"


def v1_file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    """v1's reflection.proto: v1alpha's with the package (and the type names that carry it) renamed."""
    proto = descriptor_pb2.FileDescriptorProto()
    v1alpha_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name, proto.package = V1_FILE, V1_PACKAGE
    proto.options.Clear()  # v1alpha's language options (java package, go package) name v1alpha
    for message in proto.message_type:
        for field in message.field:
            if field.HasField("type_name"):  # (a proto2 field: assigning even "" would mark it set)
                field.type_name = _renamed(field.type_name)
    for service in proto.service:
        for method in service.method:
            method.input_type, method.output_type = _renamed(method.input_type), _renamed(method.output_type)
    return proto


def _renamed(type_name: str) -> str:
    return type_name.replace(f".{V1ALPHA_PACKAGE}.", f".{V1_PACKAGE}.")


def register_v1_descriptor(pool: descriptor_pool.DescriptorPool | None = None) -> None:
    """Add v1's file descriptor to `pool` (the default one) unless it holds it already. Idempotent."""
    pool = pool or descriptor_pool.Default()
    try:
        pool.FindFileByName(V1_FILE)
    except KeyError:
        pool.AddSerializedFile(v1_file_descriptor().SerializeToString())


def enable_server_reflection_v1(service_names: Iterable[str], server: grpc.Server) -> None:
    """Serve reflection v1 on `server` for `service_names` (which should name SERVICE_NAME too)."""
    register_v1_descriptor()
    servicer = reflection.ReflectionServicer(list(service_names))
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=v1alpha_pb2.ServerReflectionRequest.FromString,
        response_serializer=v1alpha_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, {_METHOD: handler}),))
