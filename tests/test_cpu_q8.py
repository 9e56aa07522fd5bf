"""GGUF Q8_0 matrices read in place (localllm_kernels/cpu/q8_0.cpp): against fp64 on the expanded matrix,
and the embedded model's embedding and head loaded that way."""

import os
import platform
import shutil
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from localllm.model.layers import DenseMatrix, Q8Matrix
from localllm_kernels import cpu_q8


def random_blocks(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-4).half()
    if n > 1:
        d[0, 0] = 0.0  # a zero block
    q = torch.randint(-128, 128, (n, k // 32, 32), generator=g, dtype=torch.int8)
    return torch.cat([d.view(torch.uint8).view(n, k // 32, 2), q.view(torch.uint8)], -1).contiguous()


def test_dequantize_is_exact():
    b = random_blocks(40, 96)
    d = b[..., :2].contiguous().view(torch.float16).double()
    q = b[..., 2:].contiguous().view(torch.int8).double()
    assert torch.equal(cpu_q8.dequantize(b).double(), (d * q).reshape(40, 96))


GEMM_SHAPES = [(1, 32), (17, 64), (1100, 576), (300, 2048)]


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("n,k", GEMM_SHAPES)
def test_gemm_matches_fp64(m, n, k):
    assert cpu_q8.load()
    assert torch.ops.localllm.q8_0_isa() in ("avx512", "avx2", "generic")
    check_gemm(m, n, k)


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which(os.environ.get("CXX", "c++")) is None,
                    reason="x86-64 builds need a C++ compiler")
def test_portable_builds(tmp_path):
    """The AVX2 and the plain-loop paths (what CPUs without AVX-512 get from -march=native; the
    machine running the suite has one of the three), each built for that baseline and run in a
    fresh process against fp64."""
    portable = {"avx2": "-march=x86-64-v3", "generic": "-march=x86-64"}
    base = [f for f in cpu_q8.CXXFLAGS if not f.startswith("-march")]
    with ThreadPoolExecutor(len(portable)) as pool:
        list(pool.map(lambda isa: cpu_q8.build(tmp_path / f"{isa}.so", [*base, portable[isa]]), portable))
    code = textwrap.dedent("""
        import sys, torch
        from test_cpu_q8 import GEMM_SHAPES, check_gemm
        torch.ops.load_library(sys.argv[1])
        assert torch.ops.localllm.q8_0_isa() == sys.argv[2], torch.ops.localllm.q8_0_isa()
        torch.set_num_threads(2)
        for n, k in GEMM_SHAPES:
            for m in (1, 2, 4, 5):
                check_gemm(m, n, k)
        print("ok")
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(__file__), os.environ.get("PYTHONPATH")]))}
    for isa in portable:
        done = subprocess.run([sys.executable, "-c", code, str(tmp_path / f"{isa}.so"), isa], env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0 and done.stdout.strip() == "ok", (isa, done.stderr[-3000:])


def check_gemm(m: int, n: int, k: int) -> None:
    b = random_blocks(n, k, seed=n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    ref = x.double() @ cpu_q8.dequantize(b).double().t()
    y = torch.ops.localllm.q8_0_gemm(x, b)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    # fp32 accumulation of exact products: as close as an fp32 GEMM on the expanded matrix
    err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
    dense_err = (((x @ cpu_q8.dequantize(b).t()).double() - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-6 and err < 10 * dense_err + 1e-7


def test_rows_equal_the_expanded_matrix_and_errors():
    assert cpu_q8.load()
    b = random_blocks(500, 128)
    idx = torch.tensor([0, 499, 7, 7, 250])
    assert torch.equal(torch.ops.localllm.q8_0_rows(b, idx), cpu_q8.dequantize(b)[idx])
    assert torch.ops.localllm.q8_0_rows(b, idx[:0]).shape == (0, 128)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.localllm.q8_0_rows(b, torch.tensor([500]))
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.localllm.q8_0_rows(b, torch.tensor([-1]))
    with pytest.raises(RuntimeError, match="K mismatch"):
        torch.ops.localllm.q8_0_gemm(torch.zeros(1, 96), b)
    with pytest.raises(RuntimeError, match="fp32"):
        torch.ops.localllm.q8_0_gemm(torch.zeros(1, 128, dtype=torch.float64), b)
    with pytest.raises(RuntimeError, match="contiguous uint8"):
        torch.ops.localllm.q8_0_gemm(torch.zeros(1, 128), b[:, :, :33])


def test_embedded_model_reads_its_q8_0_embedding_in_place(int4_model, gguf_path):
    """The GGUF's Q8_0 embedding is not copied: embedding rows, exact logits and greedy picks equal
    those of the fp32 matrix it used to be expanded into."""
    from localllm.model.weights import open_weights

    model = int4_model.model
    assert isinstance(model.embed, Q8Matrix) and model.head.exact is model.embed  # tied: one matrix
    w = open_weights(gguf_path).dense("model.embed_tokens.weight")
    dense = DenseMatrix(w)
    ids = torch.tensor([[0, 1, 2], [49151, 500, 7]])
    assert torch.equal(model.embed.rows(ids), w[ids])
    h = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(0))
    ref = h.double() @ w.double().t()
    logits = model.head(h)
    assert ((logits.double() - ref).abs().max() / ref.abs().max()) < 1e-6
    assert torch.equal(model.head.greedy(h), dense.matmul(h).argmax(-1))
    # mapped from the file, not resident: its storage is the GGUF's
    assert model.embed.blocks.untyped_storage().nbytes() >= model.embed.blocks.numel()


def resident_mb(path) -> float:
    """MB of `path` mapped into this process (its pages counted in our RSS)."""
    import struct

    total = 0
    with open("/proc/self/maps") as maps, open("/proc/self/pagemap", "rb") as pm:
        for line in maps:
            if line.rstrip().endswith(str(path)):
                a, b = (int(x, 16) for x in line.split()[0].split("-"))
                pm.seek(a // 4096 * 8)
                d = pm.read((b - a) // 4096 * 8)
                total += sum(struct.unpack_from("Q", d, i * 8)[0] >> 63 for i in range((b - a) // 4096))
    return total * 4096 / 1e6


def test_small_gguf_tensors_are_read_without_mapping_the_file(gguf_path, tmp_path):
    """Norms are read with pread: through the map, each of the 61 small reads left ~0.4 MB of the
    layers around it mapped (25 MB of RSS on the 135M model). A truncated file is a clear error."""
    import shutil

    from localllm.model import gguf
    from localllm.model.weights import open_weights

    copy = tmp_path / "m.gguf"
    shutil.copy(gguf_path, copy)
    w = open_weights(copy)
    f = w.file
    norm = f.tensors["blk.3.attn_norm.weight"]
    before = resident_mb(copy)
    for i in range(30):
        w.dense(f"model.layers.{i}.input_layernorm.weight")
        w.dense(f"model.layers.{i}.post_attention_layernorm.weight")
    assert resident_mb(copy) - before < 1.0
    assert torch.equal(w.dense("model.layers.3.input_layernorm.weight"),
                       torch.from_numpy(gguf.dequantize(norm).copy()))  # the same numbers as the map
    with open(copy, "r+b") as fh:
        fh.truncate(norm.offset + 10)
    with pytest.raises(gguf.GGUFError, match="truncated"):
        f.read(norm)
