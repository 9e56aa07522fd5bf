#!/usr/bin/env bash
# GPU check for localllm's Triton kernels (one command, < 8 minutes on an H100/H200):
#   1. kernel unit tests natively (no interpreter), incl. bf16 cases that only run on CUDA
#   2. each kernel timed against torch (triton.testing.do_bench), GB/s for decode / int4
#   3. [hook] end-to-end decode benchmark, if localllm.bench_gpu_e2e exists
#   4. the summary table, printed last
# Usage: bash bench/gpu_check.sh            (from anywhere; env PYTHON=... to pick an interpreter)
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
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

# The kernels install as `localllm_kernels` (package-dir mapping); without an install, expose
# kernels/ under that name through a symlink on PYTHONPATH.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import localllm_kernels" >/dev/null 2>&1; then
  mkdir -p "$OUT/shim" && ln -s "$ROOT/kernels" "$OUT/shim/localllm_kernels"
  export PYTHONPATH="$OUT/shim:$PYTHONPATH"
fi

"$PY" - <<'EOF' || true
import torch, triton
p = torch.cuda.get_device_properties(0)
print(f"== {p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB; "
      f"torch {torch.__version__}, triton {triton.__version__}, CUDA {torch.version.cuda}")
EOF

echo "== 1/3 kernel tests (native)"
timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels_*.py 2>&1 | tee "$OUT/tests.log"
TEST_RC=${PIPESTATUS[0]}

echo "== 2/3 kernel timings vs torch"
timeout 240 "$PY" bench/gpu_kernels.py 2>&1 | tee "$OUT/bench.log"
BENCH_RC=${PIPESTATUS[0]}

# TODO(engine owner): end-to-end decode with/without CUDA graphs lives in localllm.bench_gpu_e2e.
E2E="not present (localllm.bench_gpu_e2e)"
if "$PY" -c "import importlib.util as u, sys; sys.exit(0 if u.find_spec('localllm.bench_gpu_e2e') else 1)" \
    >/dev/null 2>&1; then
  echo "== 3/3 end-to-end decode (localllm.bench_gpu_e2e)"
  timeout 120 "$PY" -m localllm.bench_gpu_e2e 2>&1 | tee "$OUT/e2e.log"
  E2E="rc=${PIPESTATUS[0]}"
else
  echo "== 3/3 end-to-end decode: skipped, localllm.bench_gpu_e2e does not exist yet"
fi

echo
echo "== summary"
echo "tests: rc=$TEST_RC  $(grep -E '(passed|failed|error)' "$OUT/tests.log" | tail -1)"
echo "bench: rc=$BENCH_RC   e2e: $E2E"
sed -n '/^## GPU kernels/,$p' "$OUT/bench.log"
[ "$TEST_RC" -eq 0 ] && [ "$BENCH_RC" -eq 0 ]
