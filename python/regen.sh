#!/usr/bin/env bash
# Regenerates kvxfer/v1 (the kvxfer.v1 stubs) from stream/proto with the
# pinned grpcio-tools. Usage: python/regen.sh [PYTHON] [OUTDIR]
# (PYTHON must have grpcio-tools==1.85.1; OUTDIR defaults to python/.)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${1:-python3}
out=${2:-$root/python}
"$py" -c 'import grpc_tools, importlib.metadata as m, sys; v = m.version("grpcio-tools"); sys.exit(0 if v == "1.85.1" else f"grpcio-tools {v}, want 1.85.1")'
"$py" -m grpc_tools.protoc -I "$root/stream/proto" --python_out="$out" --pyi_out="$out" \
  --grpc_python_out="$out" "$root/stream/proto/kvxfer/v1/kvxfer.proto"
touch "$out/kvxfer/v1/__init__.py"
