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


def _rss_anon_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))


def test_lazy_rope_tables_fill_whole_chunks_with_the_whole_tables_values():
    """A lazy table covered step by step (inside a chunk, across its edge, past the end) holds
    the values of a table filled at once, bit for bit, in whole chunks only."""
    from localllm.model import layers
    from localllm.model.layers import RotaryEmbedding

    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    n, d, chunk = 20000, 64, layers.ROPE_CHUNK
    whole = RotaryEmbedding(d, n, 500000.0, scaling, torch.float32)
    lazy = RotaryEmbedding(d, n, 500000.0, scaling, torch.float32, lazy=True)
    assert lazy.filled == 0 and whole.filled == n
    for want, filled in [(1, chunk), (chunk, chunk), (chunk + 1, 2 * chunk), (5, 2 * chunk), (10 ** 6, n)]:
        lazy.cover(want)
        assert lazy.filled == filled
        assert torch.equal(lazy.cos[:filled], whole.cos[:filled]) and torch.equal(lazy.sin[:filled], whole.sin[:filled])


def test_lazy_rope_tables_are_not_resident_beyond_their_rows():
    """Gemma-3-sized tables (131,072 positions x 256 columns: 256 MB of cos and sin) cost the process
    only the chunk a short context covers."""
    from localllm.model.layers import RotaryEmbedding

    before = _rss_anon_kb()
    rope = RotaryEmbedding(256, 131072, 1_000_000.0, None, torch.float32, lazy=True)
    rope.cover(100)
    grown_mb = (_rss_anon_kb() - before) / 1024
    assert rope.cos.numel() * 4 * 2 == 256 * 2 ** 20 and grown_mb < 40, grown_mb


def test_a_cpu_model_covers_the_positions_each_step_reaches(tiny_gguf, monkeypatch):
    """Through the engine (prefill chunks, decode steps, a second request), the lazy tables cover
    exactly the chunks reached, and greedy tokens and logits equal a model whose tables were
    filled at load."""
    from conftest import make_engine

    from localllm.model import layers
    from localllm.model.loader import load_model
    from localllm.sampling import SamplingParams

    monkeypatch.setattr(layers, "ROPE_CHUNK", 16)  # many chunk edges in a short run
    lazy, full = load_model(tiny_gguf, "auto"), load_model(tiny_gguf, "auto")
    assert lazy.model.rope.lazy and lazy.model.rope.filled == 0
    full.model.cover(full.model.rope.cos.shape[0])
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)
    prompt = list(range(100, 130))
    outs = []
    for loaded in (lazy, full):
        engine = make_engine(loaded, max_num_batched_tokens=8)
        *_, a = engine.generate(prompt, params)
        *_, b = engine.generate(prompt[:5], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        outs.append((a.token_ids, [lp for lp in a.logprobs], b.token_ids))
    assert outs[0] == outs[1]
    assert lazy.model.rope.filled == 80  # positions 0..68: five chunks of 16
