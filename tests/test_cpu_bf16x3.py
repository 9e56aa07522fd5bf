"""The encoders' bf16 GEMM (localllm_kernels.cpu_bf16x3) on whichever unit this CPU has: on AMX,
against fp64 with the error bound its splits give (weights in two bf16 parts: fp32-level; in one:
fp64 on the bf16-rounded weights); with AVX512-BF16 alone, against fp64 on the bf16-rounded
weights and inputs (two parts refused); its fused erf GELU against fp64, the shapes it refuses;
the loader's default is the one-part mode where either unit is, torch's fp32 linears elsewhere
(the float32 path's embeddings bit for bit); the real all-MiniLM in each mode on held-out
sentences against sentence-transformers."""

import pytest
import torch
import torch.nn.functional as F
from embed_reference import SENTENCES, st_vectors

from localllm.engine.embedder import Embedder
from localllm.model import bf16x3
from localllm.model.encoder_loader import load_encoder
from localllm.model.errors import ModelLoadError
from localllm.model.layers import DenseLinear
from localllm.registry import resolve_model
from localllm_kernels import cpu_bf16x3

AMX = cpu_bf16x3.available()
DOT = not AMX and cpu_bf16x3.dot_available()  # VDPBF16PS without the tile unit
# texts unlike the 50 of embed_reference (held out from every check made while building the mode)
HELD_OUT = [f"Item {i}: the {w} of {v} was measured again on day {i * 7 % 31} and it changed by {i * 3} percent."
            for i, (w, v) in enumerate(zip(["weight", "price", "length", "speed", "colour", "height", "volume", "age"] * 3,
                                           ["the bridge", "a ticket", "the river", "my bicycle", "the house", "a tree",
                                            "the tank", "the wine"] * 3))]


def fp64_bound(x: torch.Tensor, w: torch.Tensor, rel: float) -> torch.Tensor:
    """|x| @ |w|^T times (rel + K fp32 roundings): what per-product relative errors `rel` and fp32
    accumulation over K can add up to."""
    k = x.shape[1]
    return (x.double().abs() @ w.double().abs().T) * (rel + k * 2.0 ** -24)


SHAPES = [(1, 7, 3), (37, 50, 70), (129, 384, 1152), (300, 1536, 48), (20, 33, 17)]


@pytest.mark.parametrize("act", ["none", "gelu"])
@pytest.mark.parametrize("parts", [2, 1])
def test_gemm_against_fp64(parts, act):
    if not AMX and not DOT:  # no bf16 unit: the op refuses, clearly (the loader never asks it; see below)
        with pytest.raises(RuntimeError, match="neither the AMX-BF16 tile unit nor AVX512-BF16"):
            cpu_bf16x3.gemm(torch.randn(2, 32), cpu_bf16x3.pack(torch.randn(16, 32), parts), None, 16)
        return
    if DOT and parts == 2:
        with pytest.raises(RuntimeError, match="two parts need AMX"):
            cpu_bf16x3.gemm(torch.randn(2, 32), cpu_bf16x3.pack(torch.randn(16, 32), 2), None, 16)
        return
    torch.manual_seed(parts)
    for m, k, n in SHAPES:
        x, w, b = torch.randn(m, k) * 3, torch.randn(n, k) * 0.05, torch.randn(n)
        wp = cpu_bf16x3.pack(w, parts)
        y = cpu_bf16x3.gemm(x, wp, cpu_bf16x3.pad_bias(b, wp), n, act)
        assert y.shape == (m, n) and y.dtype == torch.float32
        # parts=2: each of x and w to 16 significant bits (2^-17 each), the dropped x_lo w_lo
        # (2^-18); parts=1: the weights as rounded, x to 16 bits and x_lo w (2^-17 + 2^-18); with
        # AVX512-BF16 alone, x rounded too: exact products, only fp32's accumulation
        wr = w.double() if parts == 2 else w.to(torch.bfloat16).double()
        xr = x.to(torch.bfloat16).double() if DOT else x.double()
        ref = xr @ wr.T + b.double()
        bound = fp64_bound(xr, wr, 0.0 if DOT else 2.0 ** -15) + 1e-6
        if act == "gelu":
            ref = F.gelu(ref)  # |gelu'| <= 1.13, plus the erf approximation's 1.5e-7 (x / 2 of it)
            bound = bound * 1.13 + ref.abs() * 2e-7 + 1e-6
        assert ((y.double() - ref).abs() <= bound).all(), (m, k, n, (y.double() - ref).abs().max())
        if parts == 2 and k >= 50:  # fp32-level: far inside the error of rounding the weights to bf16
            rounded = x.double() @ w.to(torch.bfloat16).double().T + b.double()
            exact = x.double() @ w.double().T + b.double()
            assert (y.double() - ref).abs().max() < 0.05 * (rounded - exact).abs().max()


def test_gelu_against_fp64():
    if not AMX and not DOT:
        return
    z = torch.cat([torch.linspace(-12, 12, 200_001), torch.tensor([0.0, -0.0, 1e-30, -1e-30, 40.0, -40.0])])
    g = cpu_bf16x3.gelu(z).double()
    ref = F.gelu(z.double())
    assert ((g - ref).abs() <= 5e-7 + 2e-7 * ref.abs()).all(), (g - ref).abs().max()
    assert torch.isfinite(g).all()


def test_gemm_many_rows_two_threads_equals_one():
    """The task split (row groups x column chunks, per thread count) does not change a bit: each
    output is one accumulation order whoever computes it."""
    if not AMX and not DOT:
        return
    torch.manual_seed(3)
    x, w, b = torch.randn(700, 384), torch.randn(1536, 384) * 0.05, torch.randn(1536)
    wp = cpu_bf16x3.pack(w, 2 if AMX else 1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_bf16x3.gemm(x, wp, cpu_bf16x3.pad_bias(b, wp), 1536, "gelu")
        torch.set_num_threads(2)
        two = cpu_bf16x3.gemm(x, wp, cpu_bf16x3.pad_bias(b, wp), 1536, "gelu")
        rows = cpu_bf16x3.gemm(x[:5], wp, cpu_bf16x3.pad_bias(b, wp), 1536, "gelu")
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert torch.equal(rows, one[:5])  # a row's output does not depend on the other rows


def test_gemm_refuses_bad_shapes():
    if not AMX and not DOT:
        return
    wp = cpu_bf16x3.pack(torch.randn(40, 64), 2 if AMX else 1)
    with pytest.raises(RuntimeError, match="K = 65"):
        cpu_bf16x3.gemm(torch.randn(3, 65), wp, None, 40)
    with pytest.raises(RuntimeError, match="N = 70"):
        cpu_bf16x3.gemm(torch.randn(3, 64), wp, None, 70)
    with pytest.raises(RuntimeError, match="act must be"):
        cpu_bf16x3.gemm(torch.randn(3, 64), wp, None, 40, "relu")
    with pytest.raises(RuntimeError, match="bias must be"):
        cpu_bf16x3.gemm(torch.randn(3, 64), wp, torch.randn(40), 40)
    with pytest.raises(RuntimeError, match="fp32"):
        cpu_bf16x3.gemm(torch.randn(3, 64).double(), wp, None, 40)
    with pytest.raises(ValueError, match="parts"):
        cpu_bf16x3.pack(torch.randn(4, 4), 3)
    with pytest.raises(ValueError, match="act"):
        bf16x3.Bf16x3Linear(torch.randn(4, 4), act="tanh")


@pytest.fixture(scope="module")
def minilm_dir():
    return resolve_model("all-minilm").local_path


def test_without_bf16_dot_products_the_loader_keeps_torch_fp32(minilm_dir, monkeypatch):
    """A CPU with neither AMX-BF16 nor AVX512-BF16 (AVX2, early AVX-512): "auto" builds torch's
    fp32 linears, the same numbers as "float32"; asking for a bf16 mode there is a clear load error."""
    monkeypatch.setattr(bf16x3, "available", lambda device="cpu": False)
    monkeypatch.setattr(bf16x3, "dot_available", lambda device="cpu": False)
    auto = load_encoder(minilm_dir)
    assert all(type(m) is DenseLinear for layer in auto.model.layers for m in (layer.qkv, layer.o, layer.up, layer.down))
    ref = load_encoder(minilm_dir, precision="float32")
    a, r = Embedder(auto), Embedder(ref)
    assert torch.equal(a.embed(a.tokenize(SENTENCES[:4])), r.embed(r.tokenize(SENTENCES[:4])))
    with pytest.raises(ModelLoadError, match="AMX"):
        load_encoder(minilm_dir, precision="bf16x3")
    with pytest.raises(ModelLoadError, match="bf16 dot products"):
        load_encoder(minilm_dir, precision="bfloat16")
    with pytest.raises(ModelLoadError, match="int8"):
        load_encoder(minilm_dir, precision="int8")


def test_auto_is_the_one_part_bf16_mode_where_the_cpu_has_bf16_dot_products(minilm_dir):
    """Where AMX-BF16 or AVX512-BF16 is, "auto" is "bfloat16" (the weights rounded to bf16 in the
    kernel's layout, the GELU fused), the same embeddings bit for bit; without AMX, "bf16x3" is a
    clear load error. Elsewhere "auto" is torch's fp32 (the test above)."""
    if not AMX and not DOT:
        assert not bf16x3.dot_available()
        return
    auto = load_encoder(minilm_dir)
    for layer in auto.model.layers:
        for m in (layer.qkv, layer.o, layer.up, layer.down):
            assert type(m) is bf16x3.Bf16x3Linear and m.w.shape[2] == 1
        assert layer.up.act == "gelu"
    a, b = Embedder(auto), Embedder(load_encoder(minilm_dir, precision="bfloat16"))
    assert torch.equal(a.embed(a.tokenize(SENTENCES)), b.embed(b.tokenize(SENTENCES)))
    if DOT:
        with pytest.raises(ModelLoadError, match="AMX"):
            load_encoder(minilm_dir, precision="bf16x3")


@pytest.mark.slow  # ~18 s: three loads of the real model and sentence-transformers
def test_minilm_modes_on_held_out_sentences(minilm_dir):
    """The real all-MiniLM-L6-v2 against sentence-transformers on sentences no mode was tuned on:
    the default >= 0.9999 (the bf16 mode where the CPU has bf16 dot products: measured min 0.99997
    on 300 other held-out sentences), float32 and, on AMX, bf16x3 >= 0.99999."""
    st = st_vectors(minilm_dir, HELD_OUT).float()
    modes = {"auto": 0.9999, "float32": 0.99999} | ({"bf16x3": 0.99999} if AMX else {})
    for precision, bar in modes.items():
        loaded = load_encoder(minilm_dir, precision=precision)
        want = bf16x3.Bf16x3Linear if (AMX or DOT) and precision != "float32" else DenseLinear
        assert type(loaded.model.layers[0].up) is want
        emb = Embedder(loaded)
        cos = F.cosine_similarity(emb.embed(emb.tokenize(HELD_OUT)).float(), st)
        assert cos.min().item() >= bar, (precision, cos.min().item())


def test_parameter_count_is_the_checkpoints(minilm_dir):
    """The AMX linears keep their weights in buffers: the count a model reports is the fp32
    model's parameters all the same."""
    ref = load_encoder(minilm_dir, precision="float32")
    assert load_encoder(minilm_dir).params == ref.params == sum(p.numel() for p in ref.model.parameters())
