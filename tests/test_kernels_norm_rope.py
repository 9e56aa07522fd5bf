"""rms_norm (optionally fused with the residual add), apply_rope and silu_and_mul against torch references."""

import pytest
import torch
import torch.nn.functional as F

from localllm_kernels import apply_rope, rms_norm, silu_and_mul

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])


def rms_norm_ref(x: torch.Tensor, w: torch.Tensor, eps: float, scale_in_fp32: bool = False) -> torch.Tensor:
    """transformers' LlamaRMSNorm: fp32 normalise, cast, scale; Gemma's: fp32 scale, then cast."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * w.float()).to(x.dtype) if scale_in_fp32 else w * y.to(x.dtype)


def rope_ref(positions, x, cos, sin):
    half = x.shape[-1] // 2
    c = cos[positions].unsqueeze(1).double()
    s = sin[positions].unsqueeze(1).double()
    xd = x.double()
    return xd * c + torch.cat([-xd[..., half:], xd[..., :half]], dim=-1) * s


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,gemma", [(64, False), (96, False), (96, True)])
def test_rms_norm(n, gemma, dtype):
    gen = torch.Generator().manual_seed(n)
    x = (torch.randn(2, 5, n, generator=gen) * 3).to(dtype)
    r = torch.randn(2, 5, n, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(n, generator=gen))
    w = w if gemma else w.to(dtype)  # Gemma's (1 + w) stays fp32
    # one ulp of slack: the kernel's rsqrt and reduction order differ from torch's
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    out = rms_norm(x.to(DEV), w.to(DEV), 1e-5, scale_in_fp32=gemma)
    torch.testing.assert_close(out.cpu(), rms_norm_ref(x, w, 1e-5, gemma), **tol)
    out, h = rms_norm(x.to(DEV), w.to(DEV), 1e-5, residual=r.to(DEV), scale_in_fp32=gemma)
    assert torch.equal(h.cpu(), x + r)
    torch.testing.assert_close(out.cpu(), rms_norm_ref(x + r, w, 1e-5, gemma), **tol)


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_apply_rope(dtype, inplace):
    gen = torch.Generator().manual_seed(3)
    t, h, kvh, d, max_pos = 7, 6, 2, 64, 50
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(max_pos).float(), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=gen).to(dtype)
    q = qkv[:, :h * d].view(t, h, d)  # strided views, as the engine's fused projection gives
    k = qkv[:, h * d:(h + kvh) * d].view(t, kvh, d)
    positions = torch.randint(0, max_pos, (t,), generator=gen)
    ref_q, ref_k = rope_ref(positions, q, cos, sin), rope_ref(positions, k, cos, sin)
    qd, kd = qkv.to(DEV)[:, :h * d].view(t, h, d), qkv.to(DEV)[:, h * d:(h + kvh) * d].view(t, kvh, d)
    oq, ok = apply_rope(positions.to(DEV), qd, kd, cos.to(DEV), sin.to(DEV), inplace=inplace)
    if inplace:
        assert oq.data_ptr() == qd.data_ptr() and ok.data_ptr() == kd.data_ptr()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(oq.cpu().double(), ref_q, **tol)
    torch.testing.assert_close(ok.cpu().double(), ref_k, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("f", [96, 1536])  # one tile with a ragged end; several column tiles
def test_silu_and_mul(f, dtype):
    gen = torch.Generator().manual_seed(f)
    gu = (torch.randn(3, 2 * f, generator=gen) * 4).to(DEV, dtype)
    g, u = gu.split(f, dim=-1)
    ref = F.silu(g) * u  # in the activation dtype, as the unfused model computes it
    out = torch.full((3, f), float("nan"), dtype=dtype, device=DEV)
    out.copy_(silu_and_mul(gu))
    assert not out.isnan().any()
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                                     {"rope_type": "linear", "factor": 2.0}])
def test_rope_tables_built_in_chunks_equal_the_whole_table(dtype, scaling):
    """RotaryEmbedding's cos/sin, built 8192 positions at a time with each angle's value computed
    once for both halves, equal transformers' whole-table form (cat the angles, cos/sin, scale,
    cast) bit for bit, across chunk edges and a partial last chunk."""
    from localllm.model.layers import RotaryEmbedding, rope_inv_freq

    n, d = 20000, 64
    rope = RotaryEmbedding(d, n, 500000.0, scaling, dtype)
    inv, factor = rope_inv_freq(d, 500000.0, scaling, n)
    freqs = torch.outer(torch.arange(n, dtype=torch.float32), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    assert torch.equal(rope.cos, (emb.cos() * factor).to(dtype))
    assert torch.equal(rope.sin, (emb.sin() * factor).to(dtype))
