"""gRPC server reflection (v1 and v1alpha), so `grpcurl` can list and call eds-server's services.

The file descriptors come from `eds_server/pb/descriptors.binpb`, written by `make protos` from
our own .proto files (imports included). They are indexed here with the protobuf wire reader,
so reflection needs no protobuf runtime.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from importlib import resources

import grpclib.const
import grpclib.server
from grpclib.const import Cardinality

from ..pb.grpc.reflection.v1 import (
    ErrorResponse,
    FileDescriptorResponse,
    ListServiceResponse,
    ServerReflectionRequest,
    ServerReflectionResponse,
    ServiceResponse,
)
from ..protowire import FieldValue, fields, text

NOT_FOUND = 5  # grpc status code


def _message(value: FieldValue) -> memoryview:
    if isinstance(value, int):
        raise ValueError("expected a message")
    return value


def _name(raw: FieldValue) -> str:
    """Field 1, the `name` of every descriptor message."""
    return next((text(v) for n, v in fields(_message(raw)) if n == 1), "")


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _message_symbols(prefix: str, raw: FieldValue) -> Iterator[str]:
    """A DescriptorProto's full name, and those of its nested messages and enums."""
    name = _join(prefix, _name(raw))
    yield name
    for number, value in fields(_message(raw)):
        if number == 3:  # nested_type
            yield from _message_symbols(name, value)
        elif number == 4:  # enum_type
            yield _join(name, _name(value))


class DescriptorIndex:
    """File name -> encoded FileDescriptorProto and its imports; symbol -> file name."""

    def __init__(self, descriptor_set: bytes) -> None:
        self.files: dict[str, bytes] = {}
        self.imports: dict[str, list[str]] = {}
        self.symbols: dict[str, str] = {}
        self.services: list[str] = []
        for number, raw in fields(descriptor_set):
            if number != 1 or isinstance(raw, int):
                continue
            top = list(fields(raw))
            name = next(text(v) for n, v in top if n == 1)
            package = next((text(v) for n, v in top if n == 2), "")
            self.files[name] = bytes(raw)
            self.imports[name] = [text(v) for n, v in top if n == 3]
            for n, value in top:
                names: Iterable[str] = ()
                if n == 4:  # message_type
                    names = _message_symbols(package, value)
                elif n == 5:  # enum_type
                    names = [_join(package, _name(value))]
                elif n == 6:  # service, and its methods
                    service = _join(package, _name(value))
                    self.services.append(service)
                    names = [service, *(f"{service}.{_name(m)}" for k, m in fields(_message(value)) if k == 2)]
                for symbol in names:
                    self.symbols[symbol] = name

    def with_imports(self, name: str) -> list[bytes]:
        """The file and everything it imports, each once, imports first."""
        order: list[str] = []

        def visit(n: str) -> None:
            if n in order or n not in self.files:
                return
            for dep in self.imports[n]:
                visit(dep)
            order.append(n)

        visit(name)
        return [self.files[n] for n in order]


def load_index() -> DescriptorIndex:
    data = resources.files("eds_server.pb").joinpath("descriptors.binpb").read_bytes()
    return DescriptorIndex(data)


class ReflectionService:
    """grpc.reflection.v1 and v1alpha ServerReflectionInfo (their messages are the same)."""

    def __init__(self, served: Iterable[str], index: DescriptorIndex | None = None) -> None:
        self.index = index or load_index()
        self.served = sorted(set(served))

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        return {
            f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo": grpclib.const.Handler(
                self.info, Cardinality.STREAM_STREAM, ServerReflectionRequest, ServerReflectionResponse
            )
            for version in ("v1", "v1alpha")
        }

    async def info(self, stream: grpclib.server.Stream[ServerReflectionRequest, ServerReflectionResponse]) -> None:
        async for request in stream:
            await stream.send_message(self.answer(request))

    def answer(self, request: ServerReflectionRequest) -> ServerReflectionResponse:
        response = ServerReflectionResponse(valid_host=request.host, original_request=request)
        file = None
        if request.list_services is not None:
            response.list_services_response = ListServiceResponse(
                service=[ServiceResponse(name=s) for s in self.served]
            )
            return response
        if request.file_by_filename is not None:
            file = request.file_by_filename if request.file_by_filename in self.index.files else None
        elif request.file_containing_symbol is not None:
            file = self.index.symbols.get(request.file_containing_symbol.lstrip("."))
        if file is None:
            response.error_response = ErrorResponse(error_code=NOT_FOUND, error_message="not found")
        else:
            response.file_descriptor_response = FileDescriptorResponse(
                file_descriptor_proto=self.index.with_imports(file)
            )
        return response
