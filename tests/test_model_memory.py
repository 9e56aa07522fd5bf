"""Memory like the file (the 12-type mixed file's check is in test_gguf_kquants, beside its
fixture): what the loader holds per weight against the GGUF's own tensor sizes, the
planner's figure against what is held, and the leaner holdings (16-bit tables, the chunked int4
ranking head) against the holdings they replace."""

import pytest
import torch

from localllm.model.gguf import read_gguf
from localllm.model.int4 import Int4Weight
from localllm.model.layers import (
    DenseMatrix,
    Int4Linear,
    LMHead,
    Q8Matrix,
    W16Matrix,
    _ranking_rows,
    ranking_head,
)
from localllm.planner import facts_for_path
from localllm_kernels import cpu_bf16, cpu_int4

# types whose kernel layout takes the file's own bytes per weight, within 5% (the K-quants'
# sub-scales as int8 lanes: Q4_K 0.578 vs 0.5625, Q5_K 0.703 vs 0.6875, IQ4_XS 0.539 vs 0.531;
# not yet Q3_K, Q2_K: their 2-3-bit values held as nibbles)
LIKE_FILE = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "F16", "BF16"}


def nbytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def held_by_gguf_tensor(loaded, path) -> dict[str, tuple[str, int, int]]:
    """GGUF matrix name -> (type, the file's bytes, the bytes its layer holds), for matrices whose
    layer holds that tensor alone (a fused qkv / gate_up of one type is split by rows)."""
    tensors = read_gguf(path).tensors
    cfg = loaded.config
    mods = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",), "gate_up": ("ffn_gate", "ffn_up"),
            "down": ("ffn_down",)}
    out = {}
    for i, layer in enumerate(loaded.model.layers):
        for f, names in mods.items():
            m = getattr(layer, f)
            parts = list(m.parts) if hasattr(m, "parts") else [m]
            ts = [tensors[f"blk.{i}.{n}.weight"] for n in names]
            if len(parts) == len(ts):  # one layer per tensor
                pairs = zip(ts, parts)
            elif len(parts) == 1 and len({t.qtype.name for t in ts}) == 1:  # one fused layer
                pairs = [(t, None) for t in ts]
                whole = nbytes(parts[0])
            else:
                continue
            for t, p in pairs:
                held = nbytes(p) if p is not None else whole * t.shape[0] // sum(x.shape[0] for x in ts)
                out[t.name] = (t.qtype.name, t.nbytes, held)
    assert len(out) > 0 and cfg.num_layers > 0
    return out


def planner_matches_held(loaded, path) -> None:
    """The planner's CPU weight figure is what the model holds (layers, tables, norms, the int4
    ranking head; the RoPE tables are not weights), within 2%."""
    m = loaded.model
    held = sum(nbytes(layer) for layer in m.layers) + nbytes(m.embed) + nbytes(m.norm)
    if m.head.exact is not m.embed:
        held += nbytes(m.head.exact)
    if m.head.fast is not None:
        held += nbytes(m.head.fast)
    planned = facts_for_path(path).native_bytes["cpu"]
    assert abs(planned - held) / held < 0.02, (planned, held)


def test_embedded_model_holds_the_files_bytes(int4_model, gguf_path):
    """The embedded Q4_1 model: each layer holds its tensor's own bytes (scales included), the
    Q8_0 table is the file's blocks, and the planner's figure is the held bytes."""
    per = held_by_gguf_tensor(int4_model, gguf_path)
    assert {k for k, _, _ in per.values()} == {"Q4_1"}
    for name, (_, file_b, held) in per.items():
        assert file_b <= held <= file_b * 1.01, name
    embed = int4_model.model.embed
    assert isinstance(embed, Q8Matrix)
    assert nbytes(embed) == read_gguf(gguf_path).tensors["token_embd.weight"].nbytes
    planner_matches_held(int4_model, gguf_path)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_table_is_the_fp32_table_at_half_the_bytes(dtype):
    """W16Matrix (a 16-bit checkpoint's embedding and tied head): rows bit-equal to the fp32 upcast
    it replaces; products within fp32 summation-order error of it (a different kernel: not the same
    bits), greedy picks through LMHead equal."""
    assert cpu_bf16.load()
    g = torch.Generator().manual_seed(0)
    v, h = 1000, 96  # V not a multiple of the kernel's 32-row panels
    w16 = (torch.randn(v, h, generator=g) * 0.05).to(dtype)
    table, dense = W16Matrix(w16), DenseMatrix(w16.float())
    assert nbytes(table) == 2 * h * 32 * -(-v // 32)  # half of fp32's (+ the last panel's padding)
    ids = torch.tensor([[0, 1, 999], [31, 32, 500]])
    assert torch.equal(table.rows(ids), dense.rows(ids))
    x = torch.randn(5, h, generator=g)
    ref = x.double() @ w16.double().t()
    for got in (table.matmul(x), dense.matmul(x)):
        assert got.shape == (5, v) and ((got.double() - ref).abs().max() / ref.abs().max()) < 1e-6
    fast, exact = LMHead(table, fast_greedy=True), LMHead(dense, fast_greedy=True)
    assert torch.equal(fast.greedy(x), exact.greedy(x))
    assert torch.equal(fast.greedy(x), dense.matmul(x).argmax(-1))


def test_ranking_head_built_in_chunks_is_the_one_piece_copy(int4_model):
    """The int4 ranking copy packed 1024 rows at a time equals the one built from the whole
    matrix (the same bytes, so the same greedy candidates)."""
    exact = int4_model.model.head.exact
    v, _ = exact.shape
    chunked = ranking_head(exact)
    assert cpu_int4.load() and chunked.kind == "cpu_int4"
    whole = Int4Linear(Int4Weight.cat([_ranking_rows(exact, r, min(r + 4096, v)) for r in range(0, v, 4096)]),
                       torch.bfloat16)
    assert whole.kind == "cpu_int4"
    assert chunked.qw.dtype == whole.qw.dtype and torch.equal(chunked.qw, whole.qw)
    assert chunked.qsc.dtype == whole.qsc.dtype and torch.equal(chunked.qsc, whole.qsc)
    h = torch.randn(3, exact.shape[1], generator=torch.Generator().manual_seed(1))
    assert torch.equal(chunked(h), whole(h))
