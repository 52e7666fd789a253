"""The ext_proc wire classes live in a private descriptor pool: another definition of the same proto names in
protobuf's default pool, registered before or after importing `wire`, changes nothing (a fresh interpreter each)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


# Another definition of the same names in protobuf's default pool, with other field numbers and another
# type for `body` (as an old or foreign copy would have), registered before and after importing wire.
_CLASH = """
import sys
from google.protobuf import descriptor_pb2, descriptor_pool
def clash():
    f = descriptor_pb2.FileDescriptorProto(name="envoy/service/ext_proc/v3/external_processor.proto",
                                           package="envoy.service.ext_proc.v3", syntax="proto3")
    m = f.message_type.add(name="HttpBody")
    m.field.add(name="body", number=7, type=descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
                label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL)
    descriptor_pool.Default().Add(f)
if sys.argv[1] == "before":
    clash()
from prefixroute.extproc import wire
if sys.argv[1] == "after":
    clash()
body = wire.HttpBody(body=b"\\xff\\x00", end_of_stream=True)
assert body.SerializeToString() == b"\\x0a\\x02\\xff\\x00\\x10\\x01", body.SerializeToString()
assert descriptor_pool.Default().FindMessageTypeByName("envoy.service.ext_proc.v3.HttpBody").fields[0].number == 7
print("ok")
"""


@pytest.mark.parametrize("when", ["before", "after"])
def test_another_definition_of_the_same_protos_in_the_process_changes_nothing(when: str):
    out = subprocess.run([sys.executable, "-c", _CLASH, when], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
