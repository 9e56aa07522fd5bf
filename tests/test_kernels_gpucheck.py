"""The CPU-runnable parts of bench/gpu_kernels.py (the GPU check's helper).

--dry-run runs the benchmark code on tiny shapes (interpreted without CUDA) and exits non-zero
if any kernel disagrees with its torch baseline. --compile-only compiles the kernels for sm_90a
(Hopper) without a GPU: it catches what the interpreter cannot (tl.dot shape rules, register
and shared-memory limits), so it runs in a fresh process without TRITON_INTERPRET.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_kernels.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("gpu_kernels", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gpu_kernels_dry_run(capsys):
    rc = load_bench().main(["--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "## GPU kernels" in out
    for kernel in ("prefill", "decode", "int4 fused", "int4 dequant+mm", "store_kv"):
        assert f"| {kernel} " in out
    assert "| prefill           | tiny-window-cap w16 cap5 " in out  # Gemma's window + soft-cap
    assert "| decode            | tiny-window-cap w16 cap5 " in out


@pytest.mark.slow  # ~10 s of sm_90a compiles with no GPU: `make test-slow` (CI's budget; the dry run stays in CI)
def test_gpu_kernels_compile_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, str(SCRIPT), "--compile-only", "--quick"], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert " 0 failed" in res.stdout
    for kernel in ("_prefill_kernel", "_decode_split_kernel", "_decode_merge_kernel", "_int4_mm_kernel",
                   "_int4_dequant_kernel", "_store_kv_kernel", "_rms_norm_kernel", "_rope_kernel"):
        assert kernel in res.stdout


@pytest.mark.slow  # ~22 s: the GPU end-to-end script's CPU dry run; `make test-slow`, outside CI's budget
def test_gpu_e2e_dry_run(capsys):
    """bench/gpu_e2e.py's whole flow on a tiny model with the kernels interpreted: fp32 greedy ==
    transformers, seeded sampling, n-gram speculation == greedy, graph-path tokens == eager."""
    spec = importlib.util.spec_from_file_location("gpu_e2e", ROOT / "bench" / "gpu_e2e.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rc = mod.main(["--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "fp32 greedy vs transformers fp32 (6 tokens): equal" in out
    assert "## GPU end-to-end decode" in out and "| tiny | float32 | 3 |" in out


def test_int4_sweep_dry_run(capsys):
    """--sweep-int4 (the next GPU check: the fused int4 kernel's launch configurations) runs and
    checks every configuration's result; interpreted on tiny shapes here."""
    rc = load_bench().main(["--dry-run", "--sweep-int4"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "## int4 fused kernel sweep" in out and "| M1 N64 K128 g32 |" in out
