"""The committed generated code in ps_proto/ matches proto/ps.proto, and the daemon serves
every method the contract declares."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import grpc
import pytest

REPO = Path(__file__).resolve().parents[2]
PROTO = REPO / "proto" / "ps.proto"
GENERATED = ["ps_pb2.py", "ps_pb2.pyi", "ps_pb2_grpc.py"]


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("protoc")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-Ips_offload/proto=proto",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            "proto/ps.proto",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"protoc failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
    return out / "ps_offload" / "proto"


@pytest.mark.parametrize("name", GENERATED)
def test_generated_code_is_fresh(regenerated: Path, name: str):
    fresh = regenerated / name
    committed = REPO / "ps_proto" / name
    assert fresh.is_file(), f"protoc did not write {name}"
    assert committed.read_bytes() == fresh.read_bytes(), (
        f"ps_proto/{name} is out of date with proto/ps.proto: run `make proto` and commit the result"
    )


# -- every declared method has a handler -----------------------------------------------------

HandlerCallDetails = namedtuple("HandlerCallDetails", ["method", "invocation_metadata"])

_RPC = re.compile(r"rpc\s+(\w+)\s*\(\s*(stream\s+)?[\w.]+\s*\)\s*returns\s*\(\s*(stream\s+)?[\w.]+\s*\)")


def _declared_methods() -> dict[str, dict[str, tuple[bool, bool]]]:
    """service -> method -> (client streaming, server streaming), read from the .proto text
    itself (comments removed), independently of the generated code."""
    text = re.sub(r"//[^\n]*", "", PROTO.read_text())
    services: dict[str, dict[str, tuple[bool, bool]]] = {}
    for match in re.finditer(r"service\s+(\w+)\s*\{(.*?)\}", text, re.DOTALL):
        services[match.group(1)] = {
            rpc.group(1): (bool(rpc.group(2)), bool(rpc.group(3))) for rpc in _RPC.finditer(match.group(2))
        }
    return services


def _package() -> str:
    match = re.search(r"^package\s+([\w.]+)\s*;", PROTO.read_text(), re.MULTILINE)
    assert match, "proto/ps.proto declares no package"
    return match.group(1)


@pytest.fixture(scope="module")
def handlers() -> dict[str, grpc.GenericRpcHandler]:
    from ps_offload.daemon.composition import open_store
    from ps_offload.daemon.rpc import servicer
    from ps_offload.daemon.rpc.staging import StagingPool

    store = open_store(ram_bytes=1 << 20, default_shard_bytes=4096)
    return {
        "ParameterServer": servicer.parameter_server_handler(
            servicer.ParameterServerServicer(
                store, max_pull_wait=1.0, chunk_bytes=1 << 16, staging=StagingPool(max_bytes=1 << 20)
            )
        ),
        "Admin": servicer.admin_handler(servicer.AdminServicer(store)),
    }


def test_proto_parse_matches_descriptor():
    """Guards the regex reading of ps.proto: it must see what protoc saw."""
    from ps_offload.proto import ps_pb2

    declared = _declared_methods()
    assert declared, "no services found in proto/ps.proto"
    assert set(declared) == set(ps_pb2.DESCRIPTOR.services_by_name)
    for service, methods in declared.items():
        descriptor = ps_pb2.DESCRIPTOR.services_by_name[service]
        assert descriptor.full_name == f"{_package()}.{service}"
        assert set(methods) == {m.name for m in descriptor.methods}, service
        for m in descriptor.methods:
            assert methods[m.name] == (m.client_streaming, m.server_streaming), f"{service}.{m.name}"


def test_every_declared_service_has_a_handler(handlers):
    assert set(_declared_methods()) == set(handlers)


def test_every_declared_method_has_a_handler(handlers):
    package = _package()
    for service, methods in _declared_methods().items():
        for method, (client_streaming, server_streaming) in methods.items():
            path = f"/{package}.{service}/{method}"
            handler = handlers[service].service(HandlerCallDetails(method=path, invocation_metadata=()))
            assert handler is not None, f"no handler for {path}"
            assert handler.request_streaming == client_streaming, f"{path}: request streaming"
            assert handler.response_streaming == server_streaming, f"{path}: response streaming"


def test_lookup_of_undeclared_method_finds_nothing(handlers):
    """The lookup above can fail: an unknown method or a method of the other service is None."""
    package = _package()
    server = handlers["ParameterServer"]
    assert server.service(HandlerCallDetails(f"/{package}.ParameterServer/NoSuchMethod", ())) is None
    assert server.service(HandlerCallDetails(f"/{package}.Admin/Stats", ())) is None
    assert server.service(HandlerCallDetails("/other.v1.ParameterServer/Pull", ())) is None


def test_missing_handler_fails_at_construction():
    from ps_offload.daemon.rpc import servicer

    with pytest.raises(RuntimeError, match="Stats"):
        servicer._handlers("Admin", {})
