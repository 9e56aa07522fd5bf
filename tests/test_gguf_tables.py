"""GGUF token tables and heads in block types other than Q8_0 read in place (localllm_kernels/cpu/gguf_table.cpp,
layers.BlockMatrix): rows bit-equal to gguf-py's dequantization, products against fp64 on the
dequantized matrix, and a file with a Q4_K embedding and a Q6_K head (as llama.cpp's Q4_K_M mix
writes them) loaded without an fp32 copy, its tokens and logprobs those of the fp32 tables."""

import gguf
import numpy as np
import pytest
import torch
from conftest import make_engine
from test_families import tokenizer_fields
from test_gguf_kquants import F16_FIELDS, bits_equal, random_blocks, reference
from test_model_memory import nbytes, planner_matches_held

from localllm.model.gguf import read_gguf
from localllm.model.layers import BlockMatrix, DenseMatrix, LMHead
from localllm.model.loader import load_model
from localllm.sampling import SamplingParams
from localllm_kernels import cpu_table

KINDS = list(cpu_table.KINDS)


@pytest.mark.parametrize("kind", KINDS)
def test_rows_equal_gguf_dequantize_and_products_match_fp64(kind):
    """Random blocks: rows bit for bit gguf-py's values (every fp16 field over its whole range,
    signed zeros included); products within fp32 summation error of fp64 on those values, each
    output row the same whatever the number of rows beside it."""
    assert cpu_table.load()
    n, k = 37, 2 * cpu_table.VALUES[kind] * (4 if cpu_table.VALUES[kind] == 32 else 1)
    raw = random_blocks(kind, n, k, seed=KINDS.index(kind))
    idx = torch.tensor([0, 36, 5, 5, 17])
    rows = torch.ops.localllm.gguf_table_rows(torch.from_numpy(raw), kind, idx)
    assert bits_equal(rows, reference(kind, raw)[idx.numpy()])
    raw = random_blocks(kind, n, k, seed=50 + KINDS.index(kind), std=0.05)
    w = torch.from_numpy(reference(kind, raw))
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(1))
    y = torch.ops.localllm.gguf_table_gemm(x, torch.from_numpy(raw), kind)
    ref = x.double() @ w.double().t()
    err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
    dense_err = (((x @ w.t()).double() - ref).abs().max() / ref.abs().max()).item()
    assert y.shape == (6, n) and err < 1e-6 and err < 10 * dense_err + 1e-7
    assert torch.equal(torch.ops.localllm.gguf_table_gemm(x[2:3], torch.from_numpy(raw), kind), y[2:3])


def test_one_row_q6_k_products_are_the_many_row_products_bit_for_bit():
    """A decode step's head (one activation row) takes Q6_K rows on their own AVX-512 path, the
    values made in registers: the same bits as the rows decoded once for many activation rows, at
    a real head's width and across the threads' 1024-row tasks."""
    raw = torch.from_numpy(random_blocks("Q6_K", 1030, 2048, seed=7, std=0.05))
    x = torch.randn(2, 2048, generator=torch.Generator().manual_seed(3))
    both = torch.ops.localllm.gguf_table_gemm(x, raw, "Q6_K")
    for r in range(2):
        assert torch.equal(torch.ops.localllm.gguf_table_gemm(x[r:r + 1], raw, "Q6_K"), both[r:r + 1])


def test_kernel_errors():
    assert cpu_table.load()
    b = torch.from_numpy(random_blocks("Q6_K", 10, 256, seed=0))
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.localllm.gguf_table_rows(b, "Q6_K", torch.tensor([10]))
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.localllm.gguf_table_rows(b, "Q6_K", torch.tensor([-1]))
    with pytest.raises(RuntimeError, match="K mismatch"):
        torch.ops.localllm.gguf_table_gemm(torch.zeros(1, 512), b, "Q6_K")
    with pytest.raises(RuntimeError, match="fp32"):
        torch.ops.localllm.gguf_table_gemm(torch.zeros(1, 256, dtype=torch.float64), b, "Q6_K")
    with pytest.raises(RuntimeError, match="Q4_K blocks must be contiguous uint8"):
        torch.ops.localllm.gguf_table_gemm(torch.zeros(1, 256), b, "Q4_K")  # 210-byte blocks are not Q4_K's
    with pytest.raises(RuntimeError, match="unsupported block type Q8_0"):
        torch.ops.localllm.gguf_table_rows(b, "Q8_0", torch.tensor([0]))


H, F = 256, 512


def table_blocks(kind: str, n: int, k: int, seed: int, std: float) -> np.ndarray:
    """random_blocks for a large n: random bytes for every row, the fp16 fields (the scales that
    give values of about `std`) of 256 rows scaled once, repeated."""
    head = random_blocks(kind, 256, k, seed=seed, std=std)
    raw = np.random.default_rng(seed).integers(0, 256, (n, *head.shape[1:]), np.uint8)
    for off in F16_FIELDS[kind]:
        raw[..., off:off + 2] = np.resize(head[..., off:off + 2], (n, *head.shape[1:2], 2))
    return raw


def write_gguf(path, gguf_path, embed_kind: str, head_kind: str | None):
    """A 1-layer Llama with the real tokenizer, its token table in `embed_kind` and an untied
    output head in `head_kind` (None: tied), random blocks scaled like real tables."""
    w = gguf.GGUFWriter(str(path), "llama")
    fields = tokenizer_fields(gguf_path)
    for key, val, vtype, sub in fields:
        w.add_key_value(key, val, vtype, sub)
    vocab = len(next(val for key, val, *_ in fields if key == "tokenizer.ggml.tokens"))
    w.add_block_count(1)
    w.add_context_length(512)
    w.add_embedding_length(H)
    w.add_feed_forward_length(F)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)

    def blocks(name, kind, n, k, seed, std):
        raw = table_blocks(kind, n, k, seed, std).reshape(n, -1)
        w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType[kind])

    blocks("token_embd.weight", embed_kind, vocab, H, 1, 0.05)
    if head_kind:
        blocks("output.weight", head_kind, vocab, H, 2, 0.1)
    w.add_tensor("output_norm.weight", np.ones(H, np.float32))
    for norm in ("attn_norm", "ffn_norm"):
        w.add_tensor(f"blk.0.{norm}.weight", np.ones(H, np.float32))
    for j, (role, n, k) in enumerate([("attn_q", H, H), ("attn_k", H // 2, H), ("attn_v", H // 2, H),
                                      ("attn_output", H, H), ("ffn_gate", F, H), ("ffn_up", F, H),
                                      ("ffn_down", H, F)]):
        blocks(f"blk.0.{role}.weight", "Q8_0", n, k, 10 + j, 1.5 / k ** 0.5)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def k_tables(tmp_path_factory, gguf_path):
    """A Q4_K token table with a Q6_K head, as Q4_K_M writes an untied model's."""
    return write_gguf(tmp_path_factory.mktemp("tables") / "q4k.gguf", gguf_path, "Q4_K", "Q6_K")


def mapped_from(addr: int) -> str | None:
    """The file mapped at address `addr` of this process (None: anonymous memory)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, *_, name = line.split(maxsplit=5) if len(line.split()) == 6 else (*line.split(), None)
            a, b = (int(x, 16) for x in span.split("-"))
            if a <= addr < b:
                return name.strip() if name else None
    return None


def test_k_quant_tables_are_read_in_place(k_tables):
    """No fp32 copy: the embedding and head are the file's mapped blocks; embedding rows are gguf-py's
    values bit for bit; logits, greedy tokens and logprobs equal the fp32 tables' (up to summation
    order), from a quarter of the bytes or less; the planner counts what is held."""
    ours = load_model(k_tables, "auto")
    m = ours.model
    assert isinstance(m.embed, BlockMatrix) and m.embed.kind == "Q4_K"
    assert isinstance(m.head.exact, BlockMatrix) and m.head.exact.kind == "Q6_K"
    f = read_gguf(k_tables)
    ts = f.tensors
    for mat, name in ((m.embed, "token_embd.weight"), (m.head.exact, "output.weight")):
        assert nbytes(mat) == ts[name].nbytes  # the file's bytes, mapped
        assert mapped_from(mat.blocks.data_ptr()) == str(k_tables)  # a view of the file's map, no copy
    embed_w = torch.from_numpy(reference("Q4_K", f.read(ts["token_embd.weight"]).reshape(49152, -1)))
    head_w = torch.from_numpy(reference("Q6_K", f.read(ts["output.weight"]).reshape(49152, -1)))
    ids = torch.tensor([[0, 1, 49151], [500, 7, 7]])
    assert bits_equal(m.embed.rows(ids).reshape(-1, H), embed_w[ids.reshape(-1)].numpy())
    assert bits_equal(m.embed.dense(), embed_w.numpy())
    h = torch.randn(3, H, generator=torch.Generator().manual_seed(0))
    ref = h.double() @ head_w.double().t()
    assert ((m.head(h).double() - ref).abs().max() / ref.abs().max()) < 1e-6
    assert torch.equal(m.head.greedy(h), ref.argmax(-1))
    planner_matches_held(ours, k_tables)
    prompt = [1, 504, 3458, 282, 5248, 314, 17, 2, 9, 8822]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    sampled = SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True, logprobs=3)
    runs = [[*make_engine(ours).generate(prompt, p)][-1] for p in (greedy, sampled)]
    # the same model on fp32 copies of the tables (what the loader built before), the same int4
    # ranking copy (built from rows equal to these)
    m.embed, m.head = DenseMatrix(embed_w), LMHead(DenseMatrix(head_w), fast_greedy=True, fast=m.head.fast)
    for params, a in zip((greedy, sampled), runs):
        *_, b = make_engine(ours).generate(prompt, params)
        assert a.token_ids == b.token_ids
        assert [[t for t, _ in lp["top"]] for lp in a.logprobs] == [[t for t, _ in lp["top"]] for lp in b.logprobs]
        got = torch.tensor([lp["logprob"] for lp in a.logprobs])
        want = torch.tensor([lp["logprob"] for lp in b.logprobs])
        assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()
