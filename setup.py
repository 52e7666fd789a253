"""Build hook: compiles extproc/proto/*.proto into the descriptor set `prefixroute.extproc.wire` loads.

Everything else about the package is declared in pyproject.toml. The compile runs as a sub-command of
`build`, so it runs for every way of building: `pip install .`, `pip install -e .`, `pip wheel .` and
`python -m build` (sdist, then a wheel from it: MANIFEST.in puts the .proto files in the sdist).

The output is a serialized FileDescriptorSet with its imports (google/protobuf/struct.proto), not generated
`_pb2` modules: it registers nothing in protobuf's default pool and fixes no protobuf runtime version, so it
coexists with any other package defining the same Envoy protos (xds-protos).
"""

from __future__ import annotations

import os
from pathlib import Path

from setuptools import Command, setup
from setuptools.command.build import build
from setuptools.errors import SetupError

PROTO_DIR = Path("extproc", "proto")
PACKAGE = "prefixroute.extproc"
PACKAGE_SOURCE = Path("extproc")
DESCRIPTOR_SET = "wire.binpb"  # read by extproc/wire.py, which names it too


class build_proto(Command):  # noqa: N801 - setuptools command names are lower case
    """Compile the ext_proc .proto files into the package's descriptor set (see module docstring)."""

    description = "compile extproc/proto/*.proto into a protobuf descriptor set"
    user_options: list = []
    editable_mode = False  # set by setuptools for `pip install -e`: the file then goes into the source folder

    def initialize_options(self) -> None:
        self.build_lib: str | None = None

    def finalize_options(self) -> None:
        self.set_undefined_options("build_py", ("build_lib", "build_lib"))

    def _source_output(self) -> Path:
        return PACKAGE_SOURCE / DESCRIPTOR_SET

    def _build_output(self) -> Path:
        return Path(self.build_lib, *PACKAGE.split("."), DESCRIPTOR_SET)

    def run(self) -> None:
        try:
            from grpc_tools import protoc
        except ImportError as exc:
            raise SetupError("building prefixroute needs grpcio-tools (a [build-system] requirement); with "
                             "--no-build-isolation install it first") from exc
        protos = sorted(PROTO_DIR.glob("*.proto"))
        if not protos:
            raise SetupError(f"no .proto files in {PROTO_DIR}")
        out = self._source_output() if self.editable_mode else self._build_output()
        out.parent.mkdir(parents=True, exist_ok=True)
        well_known = Path(protoc.__file__).parent / "_proto"  # google/protobuf/*.proto shipped with grpcio-tools
        args = ["protoc", f"-I{PROTO_DIR}", f"-I{well_known}", f"--descriptor_set_out={out}", "--include_imports",
                *(p.name for p in protos)]
        self.announce(f"compiling {', '.join(p.name for p in protos)} -> {out}", level=2)
        if protoc.main(args) != 0:
            raise SetupError(f"protoc failed on {PROTO_DIR} (its messages above)")

    def get_outputs(self) -> list[str]:
        return [os.fspath(self._build_output())]

    def get_output_mapping(self) -> dict[str, str]:
        # Editable installs: the built file lives in the source folder (the import finder points there).
        return {os.fspath(self._build_output()): os.fspath(self._source_output())}

    def get_source_files(self) -> list[str]:
        return [os.fspath(p) for p in sorted(PROTO_DIR.glob("*.proto"))]


class build_with_proto(build):  # noqa: N801
    sub_commands = [("build_proto", None), *build.sub_commands]


setup(cmdclass={"build": build_with_proto, "build_proto": build_proto})
