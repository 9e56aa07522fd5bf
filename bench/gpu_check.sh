#!/usr/bin/env bash
# GPU check for localllm's Triton kernels (one command, < 8 minutes on an H100/H200):
#   1. kernel unit tests natively (no interpreter), incl. bf16 cases that only run on CUDA
#   2. each kernel timed against torch (triton.testing.do_bench), GB/s for decode / int4
#   3. end-to-end decode (bench/gpu_e2e.py): engine vs transformers, eager vs CUDA graphs
#   4. the summary tables, printed last
# Usage: bash bench/gpu_check.sh            (from anywhere; env PYTHON=... to pick an interpreter)
# Logs and JSON are copied to $SAVE_DIR (default: $OUT when set, as on the device machine).
# Missing pure-Python dependencies (gguf) are installed from wheels in .whl/ when present.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
SAVE_DIR="${SAVE_DIR:-${OUT:-}}"
LOGS="$(mktemp -d)"
trap 'rm -rf "$LOGS"' EXIT
unset TRITON_INTERPRET  # native compilation

has_stack() {  # python with torch + triton and a visible CUDA device
  "$1" -c "import torch, triton, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1
}

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for cand in "$ROOT/.venv/bin/python" python python3; do
    if command -v "$cand" >/dev/null 2>&1 && has_stack "$cand"; then PY="$cand"; break; fi
  done
fi
if [ -z "$PY" ]; then
  # A separate (git-ignored) venv, so an existing CPU-only .venv is never touched.
  VENV="$ROOT/.cache/gpu-venv"
  echo "== no python with torch+triton+CUDA found: creating $VENV"
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV" || exit 1
  "$VENV/bin/pip" install -q torch triton pytest numpy || exit 1
  PY="$VENV/bin/python"
  has_stack "$PY" || { echo "torch in $VENV sees no CUDA device"; exit 1; }
fi
"$PY" -m pytest --version >/dev/null 2>&1 || "$PY" -m pip install -q pytest

# The repo root on PYTHONPATH exposes localllm and localllm_kernels without an install.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

if ls "$ROOT"/.whl/*.whl >/dev/null 2>&1 && ! "$PY" -c "import gguf" >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$LOGS/site" "$ROOT"/.whl/*.whl \
    && export PYTHONPATH="$LOGS/site:$PYTHONPATH"
fi

"$PY" - <<'EOF' || true
import torch, triton
p = torch.cuda.get_device_properties(0)
print(f"== {p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB; "
      f"torch {torch.__version__}, triton {triton.__version__}, CUDA {torch.version.cuda}")
EOF

echo "== 1/3 kernel tests (native)"
timeout 200 "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels_attention.py tests/test_kernels_int4.py \
  tests/test_kernels_norm_rope.py 2>&1 | tee "$LOGS/tests.log"
TEST_RC=${PIPESTATUS[0]}

echo "== 2/3 kernel timings vs torch"
timeout 200 "$PY" bench/gpu_kernels.py 2>&1 | tee "$LOGS/bench.log"
BENCH_RC=${PIPESTATUS[0]}

echo "== 3/3 end-to-end decode"
timeout "${E2E_TIMEOUT:-220}" "$PY" bench/gpu_e2e.py --json "$LOGS/e2e.json" 2>&1 | tee "$LOGS/e2e.log"
E2E_RC=${PIPESTATUS[0]}

[ -n "$SAVE_DIR" ] && cp "$LOGS"/*.log "$LOGS"/*.json "$SAVE_DIR"/ 2>/dev/null

echo
echo "== summary"
echo "tests: rc=$TEST_RC  $(grep -E '(passed|failed|error)' "$LOGS/tests.log" | tail -1)"
echo "kernel bench: rc=$BENCH_RC   end-to-end: rc=$E2E_RC"
sed -n '/^## GPU kernels/,$p' "$LOGS/bench.log"
sed -n '/^## GPU end-to-end/,$p' "$LOGS/e2e.log"
[ "$TEST_RC" -eq 0 ] && [ "$BENCH_RC" -eq 0 ] && [ "$E2E_RC" -eq 0 ]
