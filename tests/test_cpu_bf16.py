"""16-bit weights kept as stored on CPU (localllm_kernels.cpu_bf16): the kernel against fp64 on the
same bf16/fp16 weights on every instruction-set path, the paths equal bit for bit; an HF bf16
checkpoint of the embedded model loaded on it with greedy tokens equal to transformers' fp32 on
the same (upcast) weights; an F16 GGUF of the embedded model read in 16 bits."""

import gguf
import numpy as np
import pytest
import torch
from conftest import CHAT_PROMPTS, chat, make_engine
from test_families import gguf_reader
from test_reference import hf_greedy

from localllm.model import gguf_blocks
from localllm.model.layers import DenseLinear, W16Linear, W16Matrix
from localllm.model.loader import load_model
from localllm.planner import plan_for
from localllm_kernels import cpu_bf16

PATHS = ["amx", "avx512", "avx2", "generic"]


def isa_paths() -> list[str]:
    """The FMA-chain paths this CPU has (AVX-512, AVX2 on an AVX-512 CPU), the scalar one last:
    they give the same bits. The AMX path (another summation order) is `amx_paths()`."""
    assert cpu_bf16.load()
    best = PATHS.index(cpu_bf16.isa())
    return [p for p in PATHS[1:] if PATHS.index(p) >= best]


def amx_paths() -> list[str]:
    return ["amx"] if cpu_bf16.isa() == "amx" else []


def blas_route(path: str, m: int, n: int, k: int) -> bool:
    """Whether `path` runs m rows of an n x k matrix as torch's fp32 GEMM on widened weights
    (bf16_gemm.cpp's blas_rows): from 256 rows, on AVX2 from 64 (24 for 4M weights and more)."""
    return m >= (256 if path != "avx2" else 24 if -(-n // 32) * 32 * k >= 1 << 22 else 64)


def run_on(path: str, x, w, b):
    cpu_bf16.isa(path)
    try:
        assert cpu_bf16.isa() == path
        return cpu_bf16.w16_gemm(x, w, b)
    finally:
        cpu_bf16.isa("auto")


def case(dtype, n: int, k: int, m: int, bias: bool):
    g = torch.Generator().manual_seed(n * 7 + k * 3 + m)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    if dtype == torch.float16:
        w[0, :4] = torch.tensor([6e-8, -3e-5, 60000.0, 0.0])  # subnormals and the range's top convert exactly
    x = torch.randn(m, k, generator=g) * 2
    b = torch.randn(n, generator=g) if bias else None
    return w, x, b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(32, 64), (40, 100), (96, 257), (200, 33)])
@pytest.mark.parametrize("m", [1, 3, 16, 63, 64, 300])
def test_kernel_matches_fp64_on_every_path(dtype, n, k, m):
    """fp32 activations and accumulation on the exact 16-bit values: within fp32 rounding of the
    fp64 product (odd N padded to 32 rows, odd K, with and without bias), the same bits on every path."""
    w, x, b = case(dtype, n, k, m, bias=(n + m) % 2 == 0)
    packed = cpu_bf16.pack(w)
    assert packed.dtype == dtype and packed.shape == ((n + 31) // 32, k, 32)
    assert torch.equal(cpu_bf16.unpack(packed, n), w)
    ref = x.double() @ w.double().t() + (0 if b is None else b.double())
    outs = [run_on(p, x, packed, cpu_bf16.pad_bias(b, packed.shape[0])) for p in isa_paths()]
    y = outs[0]
    assert y.shape == (m, packed.shape[0] * 32)
    scale = (x.double().abs() @ w.double().abs().t()).max() + (0 if b is None else b.abs().max())
    assert (y[:, :n].double() - ref).abs().max() / scale < 1e-6
    assert torch.equal(y[:, n:], torch.zeros_like(y[:, n:]))  # padding rows
    for p, other in zip(isa_paths(), outs):  # the same bits on every path taking the same route
        assert torch.equal(other, outs[[blas_route(q, m, n, k) for q in isa_paths()].index(blas_route(p, m, n, k))])
    for p in amx_paths():  # fp32 activations as three exact bf16 parts: as close to fp64
        ya = run_on(p, x, packed, cpu_bf16.pad_bias(b, packed.shape[0]))
        assert (ya[:, :n].double() - ref).abs().max() / scale < 1e-6
        assert torch.equal(ya[:, n:], torch.zeros_like(ya[:, n:]))


def test_every_tile_edge_is_bit_identical():
    """Rows across the tile heights (AVX-512: 12, AVX2: 3) and panel groups (4, 2, 1): each output
    is one FMA chain over k in order on every path, whichever tile computes it."""
    w, _, b = case(torch.bfloat16, 300, 160, 1, bias=True)
    packed, pb = cpu_bf16.pack(w), cpu_bf16.pad_bias(b, 10)
    for m in (2, 4, 5, 7, 12, 13, 25):
        x = torch.randn(m, 160, generator=torch.Generator().manual_seed(m))
        outs = [run_on(p, x, packed, pb) for p in isa_paths()]
        assert all(torch.equal(o, outs[0]) for o in outs[1:]), m
        # and a row's result does not depend on the rows beside it
        assert torch.equal(run_on(isa_paths()[0], x[-1:], packed, pb)[0], outs[0][-1])


def test_bad_inputs_are_refused():
    assert cpu_bf16.load()
    w = cpu_bf16.pack(torch.zeros(32, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="x must be fp32"):
        cpu_bf16.w16_gemm(torch.zeros(1, 64, dtype=torch.bfloat16), w)
    with pytest.raises(RuntimeError, match="K = 32"):
        cpu_bf16.w16_gemm(torch.zeros(1, 32), w)
    with pytest.raises(RuntimeError, match="bf16 or fp16"):
        cpu_bf16.w16_gemm(torch.zeros(1, 64), w.float())
    with pytest.raises(RuntimeError, match="bias must be"):
        cpu_bf16.w16_gemm(torch.zeros(1, 64), w, torch.zeros(31))
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        cpu_bf16.pack(torch.zeros(4, 4))
    with pytest.raises(RuntimeError, match="force must be"):
        cpu_bf16.isa("avx9")


# ---- the embedded model as an HF bf16 checkpoint and as an F16 GGUF --------------------------------
@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory, hf_export_dir):
    """The embedded model's weights in bf16 safetensors, written by transformers (what hub models ship)."""
    import shutil

    import transformers

    out = tmp_path_factory.mktemp("bf16") / "smollm2-135m-bf16"
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_export_dir), dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    for f in hf_export_dir.iterdir():  # the tokenizer files
        if f.suffix != ".safetensors" and not (out / f.name).exists():
            shutil.copy(f, out / f.name)
    return out


def test_bf16_checkpoint_runs_on_the_kernel_with_transformers_fp32_tokens(bf16_dir):
    """Planned and loaded as 16-bit weights on our kernel (no fp32 copy of the linears); greedy
    tokens equal transformers' fp32 model on the same weights upcast."""
    import transformers

    p = plan_for(str(bf16_dir), max_memory=4)
    assert p.fits and p.precision == "auto"
    assert p.label == "16-bit weights (bf16 as stored, our kernel), fp32 activations"
    loaded = load_model(bf16_dir, "auto")
    assert loaded.precision == f"16-bit weights (bf16 as stored, our kernel, {cpu_bf16.isa()}), fp32 activations"
    linears = [m for layer in loaded.model.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    assert all(isinstance(m, W16Linear) and m.w.dtype == torch.bfloat16 for m in linears)
    held = sum(t.numel() * t.element_size() for m in linears for t in m.buffers())
    cfg = loaded.config
    assert held == 2 * cfg.linear_params  # every N of this model is a multiple of 32: no padding
    other = cfg.num_params - cfg.linear_params
    table = cfg.vocab_size * cfg.hidden_size  # the tied embedding, kept in bf16 (W16Matrix)
    assert isinstance(loaded.model.embed, W16Matrix) and loaded.model.head.exact is loaded.model.embed
    assert p.weights_bytes == 2 * cfg.linear_params + 2 * table + 4 * (other - table) + int(table * (0.5 + 4 / 32))
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(bf16_dir), dtype=torch.float32).eval()
    eng = make_engine(loaded)
    from localllm.sampling import SamplingParams

    prompt = chat(CHAT_PROMPTS[0])
    ids = eng.encode_prompt(prompt)
    *_, last = eng.generate(prompt, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert last.token_ids == hf_greedy(ref, ids, 32)
    fp32 = load_model(bf16_dir, "float32")  # --quant fp32: the fp32 copy, as before
    assert isinstance(fp32.model.layers[0].o, DenseLinear) and fp32.model.layers[0].o.weight.dtype == torch.float32


@pytest.fixture(scope="module")
def f16_gguf(tmp_path_factory, gguf_path):
    """The embedded model's weights as an F16 GGUF (matrices F16, norms F32) with its metadata,
    written with gguf-py: what llama.cpp's converter writes with --outtype f16."""
    from localllm.model.gguf import dequantize, read_gguf

    reader, src = gguf_reader(gguf_path), read_gguf(gguf_path)
    out = tmp_path_factory.mktemp("f16") / "smollm2-135m.F16.gguf"
    w = gguf.GGUFWriter(str(out), "llama")
    for key, fld in reader.fields.items():
        if not key.startswith("GGUF.") and key not in ("general.architecture", "general.file_type"):
            arr = fld.types[0] == gguf.GGUFValueType.ARRAY
            w.add_key_value(key, fld.contents(), fld.types[0], fld.types[-1] if arr else None)
    for name, t in src.tensors.items():
        raw = torch.from_numpy(src.read(t))
        if gguf_blocks.supported(t.qtype.name):  # the file's values, decoded exactly (and fast) in torch
            n, k = t.shape
            values = gguf_blocks.decode(t.qtype.name, raw.view(n, k // 32, -1)).values().numpy()
        else:
            values = np.asarray(dequantize(t, raw.numpy()))
        w.add_tensor(name, values.astype(np.float16 if values.ndim == 2 else np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.mark.slow  # ~20 s (writing the file, two loads): the kernel, the bf16 checkpoint and
# test_gguf_kquants' mixed file (an F16 tensor on this kernel) cover the path in the default run
def test_f16_gguf_is_read_in_16_bits(f16_gguf):
    """Each F16 matrix on the kernel holding the file's values; the layers' memory is the file's
    matrices' bytes; the model's scores follow the same file in fp32."""
    loaded = load_model(f16_gguf, "auto")
    assert loaded.precision.startswith("GGUF F16 weights as stored (our 16-bit kernels")
    layers = loaded.model.layers
    linears = [m for layer in layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    assert all(isinstance(m, W16Linear) and m.w.dtype == torch.float16 for m in linears)
    from localllm.model.gguf import read_gguf

    tensors = read_gguf(f16_gguf).tensors
    assert {t.qtype.name for n, t in tensors.items() if len(t.shape) == 2} == {"F16"}
    matrices = sum(t.nbytes for name, t in tensors.items() if name.startswith("blk.") and len(t.shape) == 2)
    held = sum(t.numel() * t.element_size() for m in linears for t in m.buffers())
    assert held == matrices
    dense = load_model(f16_gguf, "float32")
    for lo, ld in zip(layers, dense.model.layers):
        assert torch.equal(lo.o.weight16().float(), ld.o.weight)
    prompt = [1, 504, 3458, 282, 5248, 314, 17, 2, 9, 8822, 1137, 30, 42, 99, 1000, 20000]
    got, ref = make_engine(loaded).score(prompt), make_engine(dense).score(prompt)
    # (the difference is the 16-bit KV cache a GGUF's kernels run with; the weights are equal)
    assert ((got.double() - ref.double()).norm() / ref.double().norm()).item() < 1e-3
    assert plan_for(str(f16_gguf), max_memory=4).weights_bytes < 2 * matrices  # no fp32 copy planned
