#!/usr/bin/env python3
"""Regenerate the betterproto2 code in eds_server/pb/ from the .proto files in proto/.

Usage: python scripts/gen_protos.py [OUT_DIR]   (default: eds_server/pb)

The output is a pure function of the .proto files and the installed versions of
grpcio-tools, betterproto2-compiler and ruff:

* protoc runs with the .proto paths relative to proto/ (they end up in the
  "# sources:" headers) and with grpcio-tools' bundled google/protobuf includes.
* betterproto2-compiler formats its output with `ruff check --fix` and
  `ruff format`, run in the plugin's working directory, and only emits an
  `__init__.py` for a package directory if that path does not already exist
  relative to its working directory. So the plugin runs in an empty temporary
  directory holding nothing but a fixed ruff.toml, with the ruff next to this
  interpreter first on PATH and RUFF_* variables removed from its environment.

OUT_DIR is replaced as a whole (files no longer generated are removed). To avoid
wiping a directory by mistake, a non-empty OUT_DIR must look like generated code
(contain message_pool.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_DIR = REPO / "proto"
DEFAULT_OUT = REPO / "eds_server" / "pb"

PLUGIN_OPTIONS = "client_generation=async,server_generation=async"

# Formatting of the generated code; fixed here so the caller's cwd and any
# project or user ruff configuration cannot change the output.
RUFF_TOML = """\
line-length = 120
target-version = "py311"
"""

MARKER = "message_pool.py"
DESCRIPTOR_SET = "descriptors.binpb"


def proto_files() -> list[str]:
    """All .proto files under proto/, as sorted posix paths relative to it."""
    return sorted(p.relative_to(PROTO_DIR).as_posix() for p in PROTO_DIR.rglob("*.proto"))


def _grpc_tools_include() -> Path:
    import grpc_tools

    return Path(grpc_tools.__file__).resolve().parent / "_proto"


def _write_plugin(path: Path) -> None:
    """Wrapper so protoc runs the plugin with this interpreter, wherever it is."""
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m betterproto2_compiler.plugin "$@"\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def generate(out_dir: Path) -> list[Path]:
    """Generate into out_dir (replacing it); return the generated files, relative."""
    out_dir = out_dir.resolve()
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / MARKER).exists():
        raise SystemExit(f"refusing to replace {out_dir}: not empty and has no {MARKER}")

    files = proto_files()
    if not files:
        raise SystemExit(f"no .proto files under {PROTO_DIR}")

    with tempfile.TemporaryDirectory(prefix="gen_protos.") as tmp_name:
        tmp = Path(tmp_name)
        work, gen = tmp / "work", tmp / "out"
        work.mkdir()
        gen.mkdir()
        (work / "ruff.toml").write_text(RUFF_TOML)
        plugin = tmp / "protoc-gen-python_betterproto2"
        _write_plugin(plugin)

        env = {k: v for k, v in os.environ.items() if not k.startswith("RUFF_")}
        bin_dir = str(Path(sys.executable).parent)
        env["PATH"] = os.pathsep.join([bin_dir, env.get("PATH", "")])

        cmd = [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"--proto_path={PROTO_DIR}",
            f"--proto_path={_grpc_tools_include()}",
            f"--plugin=protoc-gen-python_betterproto2={plugin}",
            f"--python_betterproto2_out={gen}",
            f"--python_betterproto2_opt={PLUGIN_OPTIONS}",
            # every file's descriptor, with its imports: what gRPC server reflection hands out
            f"--descriptor_set_out={gen / DESCRIPTOR_SET}",
            "--include_imports",
            *files,
        ]
        proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout + proc.stderr)
            raise SystemExit(f"protoc failed with exit code {proc.returncode}")
        leftovers = sorted(p.name for p in work.iterdir() if p.name != "ruff.toml")
        if leftovers:  # e.g. invalid-generated-code.py
            raise SystemExit(f"code generation left files behind: {leftovers}")

        generated = sorted(p.relative_to(gen) for p in gen.rglob("*") if p.is_file())
        if out_dir.exists():
            shutil.rmtree(out_dir)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(gen, out_dir)
    return generated


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "out_dir",
        nargs="?",
        type=Path,
        default=DEFAULT_OUT,
        help=f"output directory (default: {DEFAULT_OUT.relative_to(REPO)})",
    )
    args = parser.parse_args(argv)
    generated = generate(args.out_dir)
    print(f"generated {len(generated)} files into {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
