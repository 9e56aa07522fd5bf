"""CMAKE_ARGS for building llama-cpp-python here: this CPU's vector ISA named explicitly.

    CMAKE_ARGS="$(python bench/llama_cpp_cmake_args.py)" pip install 'llama-cpp-python>=0.3'

Why not GGML_NATIVE=ON: these VMs report AMX in cpuid but the kernel does not enable its tile
state, so a -march=native build executes `ldtilecfg` on the first matmul and dies with a general
protection fault (0.3.36, seen 2026-11-30). Naming the ISA from /proc/cpuinfo gives llama.cpp
every AVX-512 / VNNI path this machine really runs, and no AMX.
"""

from pathlib import Path

FLAGS = {"avx": "AVX", "avx2": "AVX2", "fma": "FMA", "f16c": "F16C", "bmi2": "BMI2", "avx512f": "AVX512",
         "avx512vbmi": "AVX512_VBMI", "avx512_vnni": "AVX512_VNNI", "avx512_bf16": "AVX512_BF16",
         "avx_vnni": "AVX_VNNI"}


def cmake_args() -> str:
    line = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    have = set(line.split())
    on = [f"-DGGML_{v}=ON" for k, v in FLAGS.items() if k in have]
    return " ".join(["-DGGML_NATIVE=OFF", *on, "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"])


if __name__ == "__main__":
    print(cmake_args())
