#!/usr/bin/env bash
# An MLP file batch through the whole system on a GPU machine, with and without the batcher moving
# the chunks' bytes itself (batcher.claim_check_io), against direct torch on the same GPU (each
# batch copied from the host, as the batcher's are): bench/system/batch_files_ab.py with
# BENCH_DEVICE=cuda. Writes bench/results/batch_files_ab_gpu.md (and .json), and copies them and the
# log to $OUT when set (the device tool's output folder).
#
#   bench/gpu_batch_files.sh            PYTHON (default python3) must hold torch with CUDA
#
# On a machine without this project's packages, wheels in .whl/ are installed into /tmp/site
# first, offline: bench/gpu_prepare.sh [BASE_REVISION] makes them here (23 MB, this venv's versions
# for the device image's Python 3.12) and exports a base revision for GPU_BATCH_BASE_TREE; a device
# call then carries [".whl", ".base-tree"].
# Settings: GPU_BATCH_RECORDS (100000), GPU_BATCH_ROUNDS (2; 0: no system run), GPU_BATCH_WARMUP_ROUNDS
# (1: a round of every variant first, not counted; 0 saves its device time), GPU_BATCH_VARIANTS
# (two-streams,two-streams-claim-check-io; bench/system/batch_files_ab.py's names, e.g.
# two-streams+claim-check-io+4-batchers), GPU_BATCH_NAME (batch_files_ab_gpu), GPU_BATCH_BASE_TREE
# (the base variants' tree: another revision's files, e.g. `git archive REV | tar -x -C DIR`); BENCH_BATCHES
# (bench/system/batch_files.py) passes batch settings, e.g. chunks_in_flight=32,drive_interval_s=0.05;
# GPU_BATCH_PROFILE=1 records py-spy profiles of the scheduler and the first batcher (py-spy must
# be installed or among the wheels, and allowed to read its children) into $OUT/profiles;
# GPU_BACKEND_OVERHEAD=1 first runs bench/backend_overhead.py (the torch backend against a direct
# call, in one process) on the GPU. GPU_MPS=1 runs the batch under NVIDIA's Multi-Process Service
# (nvidia-cuda-mps-control started for the run and stopped after it), so several batchers' kernels
# share the GPU instead of being time-sliced between their contexts; exit 5 where it cannot start.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if compgen -G ".whl/*.whl" >/dev/null; then
  [[ -d /tmp/site ]] ||
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PATH="/tmp/site/bin:$PATH"
fi
export PYTHONUNBUFFERED=1 BENCH_DEVICE=cuda
nvidia-smi -L || exit 2
"$PY" -c 'import sys, torch; print("torch", torch.__version__, torch.cuda.get_device_name(0)); sys.exit(0 if torch.cuda.is_available() else 4)' || exit 4
NAME="${GPU_BATCH_NAME:-batch_files_ab_gpu}"
if [[ "${GPU_BACKEND_OVERHEAD:-0}" == 1 ]]; then
  "$PY" -m bench.backend_overhead --name backend_overhead_gpu
  [[ -n "${OUT:-}" ]] && cp bench/results/backend_overhead_gpu.md bench/results/backend_overhead_gpu.json "$OUT"/
fi
if [[ "${GPU_BATCH_PROFILE:-0}" == 1 ]]; then
  if py-spy record --nonblocking -o /tmp/py-spy-check.txt --format raw -- "$PY" -c 'sum(range(10**7))' >/dev/null 2>&1; then
    export BENCH_PROFILE_DIR="${OUT:-/tmp}/profiles"
  else
    echo "py-spy cannot profile here: running without profiles"
  fi
fi
[[ "${GPU_BATCH_ROUNDS:-2}" == 0 ]] && exit 0
if [[ "${GPU_MPS:-0}" == 1 ]]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/asyncinfer-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/asyncinfer-mps/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d || { echo "bench/gpu_batch_files.sh: MPS did not start"; exit 5; }
  trap 'echo quit | nvidia-cuda-mps-control; cat "$CUDA_MPS_LOG_DIRECTORY"/control.log 2>/dev/null | tail -5' EXIT
  "$PY" -c 'import torch; torch.ones(1, device="cuda"); print("MPS: a client started")' || exit 5
fi
"$PY" -m bench.system.batch_files_ab --records "${GPU_BATCH_RECORDS:-100000}" --rounds "${GPU_BATCH_ROUNDS:-2}" \
  --warmup-rounds "${GPU_BATCH_WARMUP_ROUNDS:-1}" \
  --variants "${GPU_BATCH_VARIANTS:-two-streams,two-streams-claim-check-io}" --name "$NAME" \
  ${GPU_BATCH_BASE_TREE:+--base-tree "$GPU_BATCH_BASE_TREE"}
status=$?
if [[ -n "${OUT:-}" ]]; then
  cp "bench/results/$NAME.md" "bench/results/$NAME.json" "$OUT"/ 2>/dev/null
fi
exit $status
