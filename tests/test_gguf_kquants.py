"""GGUF's K-quants and other block types on our CPU kernels, exactly: the decoding against gguf-py's
dequantizers bit for bit, the repacked layouts unpacked back to the same values, both kernels'
matmuls against fp64 on every instruction-set path (the file's own scale form, K-quant sub-scales
and IQ4 indices, giving the outputs of the fp32-product and byte layouts bit for bit), the bytes
held against the file's, and the loader putting each tensor of a mixed file on its own kernel
(and the conversion cache giving the same layers back)."""

import gguf
import numpy as np
import pytest
import torch
from conftest import make_engine
from test_cpu_fused import assert_one_call_equals_one_by_one
from test_families import tokenizer_fields

from localllm.model import gguf_blocks
from localllm.model.convert_cache import ConvertCache
from localllm.model.cpu_ops import decode_layer_args
from localllm.model.layers import ConcatLinear, Int4Linear, Int8wLinear, W16Linear
from localllm.model.loader import load_model
from localllm_kernels import cpu_int4, cpu_int8

KINDS = list(gguf_blocks.BLOCK_BYTES)
# the fp16 fields of each block (scales d, and mins / dmin): the byte offsets
F16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "IQ4_NL": [0], "IQ4_XS": [0],
              "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "Q3_K": [108], "Q2_K": [80, 82], "MXFP4": []}
# MXFP4's scale: one E8M0 byte (2^(e - 128)); every byte is a valid one
E8M0_FIELD = {"MXFP4": 0}


def random_blocks(kind: str, n: int, k: int, seed: int, std: float | None = None) -> np.ndarray:
    """Blocks of random bytes, uint8 [n, k / block values, block bytes]: any bytes with finite fp16
    fields are a valid block. std None: the fp16 fields random over their whole finite range
    (subnormals and 65504 included); else scaled so the values have about that std (per block
    x0.5-1.5), as a real matrix would."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // gguf_blocks.BLOCK_VALUES[kind], gguf_blocks.BLOCK_BYTES[kind]), np.uint8)

    def put(vals: np.ndarray) -> None:
        for off in F16_FIELDS[kind]:
            raw[..., off:off + 2] = vals.astype(np.uint16).view(np.uint8).reshape(*raw.shape[:2], 2)

    if kind in E8M0_FIELD:  # random bytes span the whole range (2^-128 .. 2^127) already
        if std is not None:
            raw[..., E8M0_FIELD[kind]] = 128
            rms = float(np.sqrt(np.mean(reference(kind, raw).astype(np.float64) ** 2)))
            raw[..., E8M0_FIELD[kind]] = 128 + round(np.log2(std / rms)) + rng.integers(-1, 2, raw.shape[:2])
        return raw
    if std is None:
        bits = rng.integers(0, 1 << 16, raw.shape[:2], dtype=np.uint16)
        put(np.where((bits >> 10) & 31 == 31, bits & ~np.uint16(1 << 14), bits))  # no inf / nan exponent
        return raw
    put(np.full(raw.shape[:2], np.float16(1.0)).view(np.uint16))
    rms = float(np.sqrt(np.mean(reference(kind, raw).astype(np.float64) ** 2)))
    put((std / rms * rng.uniform(0.5, 1.5, raw.shape[:2])).astype(np.float16).view(np.uint16))
    return raw


def reference(kind: str, raw: np.ndarray) -> np.ndarray:
    """gguf-py's dequantization, fp32 [n, k]."""
    n = raw.shape[0]
    return gguf.quants.dequantize(raw.reshape(n, -1), gguf.GGMLQuantizationType[kind]).reshape(n, -1)


def bits_equal(a: torch.Tensor | np.ndarray, b: np.ndarray) -> bool:
    a = a.numpy() if isinstance(a, torch.Tensor) else a
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def file_form(b: gguf_blocks.Blocks) -> dict:
    """The keyword arguments that pack a type in the loader's form: its own sub-scales, its codebook."""
    return {"sub": None if b.sub is None else b.sub.packed(), "lut": b.lut}


def int4_values(w: torch.Tensor, sc: torch.Tensor, n: int) -> torch.Tensor:
    """What the int4 layout holds: d * q + m per group of 32, rounded once."""
    q, d, m = cpu_int4.unpack(w, sc, n)
    v = d.double().repeat_interleave(32, 1) * q.double() + m.double().repeat_interleave(32, 1)
    return v.float()


@pytest.mark.parametrize("kind", KINDS)
def test_decoding_and_repacks_equal_gguf_dequantize(kind):
    """Random blocks (every fp16 field over its whole range): our decoding, and the kernel layouts
    built from it unpacked again, give gguf-py's values bit for bit (signed zeros included)."""
    n, k = 20, 2 * gguf_blocks.BLOCK_VALUES[kind] * (2 if kind in ("Q4_0", "Q4_1", "Q5_0") else 1)
    raw = random_blocks(kind, n, k, seed=KINDS.index(kind))
    ref = reference(kind, raw)
    b = gguf_blocks.decode(kind, torch.from_numpy(raw))
    assert b.q.shape == (n, k) and int(b.q.max()) < 2 ** b.bits
    assert bits_equal(b.values(), ref)
    m = b.m if b.m is not None else -b.zero * b.d
    w, sc = cpu_int8.pack(b.q, b.d, b.m, b.zero, b.bits)
    planes = cpu_int8.planes_for(b.bits)
    assert w.shape == ((2, k // 4, 64) if planes < 0 else (2, k // 8, 64 + 16 * planes))
    assert bits_equal(cpu_int8.dequantize(w, sc, n, b.group, b.zero), ref)
    w8, sc8 = cpu_int8.pack(b.q, b.d, b.m, b.zero)  # byte lanes, as a stack with an 8-bit part has them
    assert bits_equal(cpu_int8.dequantize(w8, sc8, n, b.group, b.zero), ref)
    wf, scf = cpu_int8.pack(b.q, b.d, b.m, b.zero, b.bits, **file_form(b))  # the loader's: the file's form
    assert bits_equal(cpu_int8.dequantize(wf, scf, n, b.group, b.zero), ref)
    assert cpu_int8.load()
    for lw, lsc in ((w, sc), (w8, sc8), (wf, scf)):  # the kernel's own fp32 tiles (the dense prefill path)
        dense = torch.ops.localllm.int8w_dequantize(lw, lsc, b.group, b.zero)
        assert bits_equal(dense[:n], ref) and torch.equal(dense[n:], torch.zeros_like(dense[n:]))
    if b.bits == 4 and b.group == 32:  # the int4 kernel's layout: an explicit m (Q4_0's d * 8 - 8d is
        # +0 where gguf's d * 0 is -0 for d < 0: equal values, one zero's sign apart) and the file's form
        assert np.array_equal(int4_values(*cpu_int4.pack_dm(b.q, b.d, m), n).numpy(), ref)
        assert np.array_equal(int4_values(*cpu_int4.pack_dm(b.q, b.d, b.m, file_form(b)["sub"]), n).numpy(), ref)
    # the file's form: its fp16 scales, or (K-quants) records of its fp16 super-scales and integer
    # sub-scales (the fp32 products d * sc take fp32); codebook types as 4-bit indices
    # (MXFP4's scales over their whole range, 2^-128 .. 2^127, take fp32: fp16 holds 2^-24 .. 2^15)
    assert sc.dtype == (torch.float16 if gguf_blocks.BLOCK_VALUES[kind] == 32 and kind != "MXFP4" else torch.float32)
    assert scf.dtype == (torch.uint8 if kind in gguf_blocks.SUB_SCALES else
                         torch.float32 if kind == "MXFP4" else torch.float16)
    if kind in gguf_blocks.CODEBOOK:
        assert wf.shape == (2, k // 8, 64) and torch.equal(b.lut, torch.tensor(cpu_int8.CODEBOOKS[b.zero], dtype=torch.uint8))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4"])
def test_blocks_from_a_real_quantizer(kind):
    """gguf-py's own quantizer (ggml's reference rounding) on a Gaussian matrix."""
    data = np.random.default_rng(1).standard_normal((16, 256)).astype(np.float32) * 0.05
    raw = gguf.quants.quantize(data, gguf.GGMLQuantizationType[kind]).reshape(16, 8, -1)
    assert bits_equal(gguf_blocks.decode(kind, torch.from_numpy(raw)).values(), reference(kind, raw))


def isa_paths() -> list[str]:
    assert cpu_int8.load()
    best = cpu_int8.isa()
    return {"avx512_vnni": ["avx512_vnni", "avx2", "generic"], "avx2": ["avx2", "generic"]}.get(best, ["generic"])


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("parts", [2, 1])
@pytest.mark.parametrize("kind", KINDS)
def test_int8_kernel_matches_fp64_on_every_path(kind, parts):
    """Every type on the int8-lane kernel (the 4-bit ones too: what a mixed stack of them takes), in
    its own layout (nibbles and high bits up to 6 bits) and in byte lanes (a stack with an
    8-bit part), batch 1 and a few rows, N padded to 16, against fp64 on the dequantized weights;
    the AVX-512 VNNI, AVX2 and scalar paths and both layouts give the same outputs bit for bit.
    parts=1 (--act-bits 8): one int8 part per activation, ~8-bit rounding's error."""
    n, k = 40, 512
    raw = random_blocks(kind, n, k, seed=100 + KINDS.index(kind), std=0.05)
    b = gguf_blocks.decode(kind, torch.from_numpy(raw))
    ref_w = torch.from_numpy(reference(kind, raw)).double()
    gen = torch.Generator().manual_seed(7)
    xs = [torch.randn(m, k, generator=gen) * 2 for m in (1, 2, 5, 7, 13)]  # 13: widened to bytes per tile
    xs[2][0, :32] *= 1e-3  # a block far smaller than the rest: per-block activation scales
    outs = {}
    layouts = {"file": cpu_int8.pack(b.q, b.d, b.m, b.zero, b.bits, **file_form(b)),
               "planes": cpu_int8.pack(b.q, b.d, b.m, b.zero, b.bits), "bytes": cpu_int8.pack(b.q, b.d, b.m, b.zero)}
    try:
        for path in isa_paths():
            torch.ops.localllm.int8w_isa(path)
            for name, (w, sc) in layouts.items():
                outs[path, name] = [cpu_int8.int8w_gemm(x, w, sc, b.group, b.zero, parts) for x in xs]
    finally:
        torch.ops.localllm.int8w_isa("auto")
    first = next(iter(outs.values()))
    for x, y in zip(xs, first):
        assert y.shape == (x.shape[0], 48)
        err = rel_err(y[:, :n], x.double() @ ref_w.t())
        assert err < 2e-4 if parts == 2 else 1e-3 < err < 1.5e-2
        assert torch.equal(y[:, n:], torch.zeros_like(y[:, n:]))
    for path, ys in outs.items():
        assert all(torch.equal(a, c) for a, c in zip(ys, first)), path


# the forms the AVX2 path multiplies in its signed form (8-bit values: Q8_0, the IQ4 codebook)
SIGNED_KINDS = ["Q8_0", "IQ4_NL", "IQ4_XS"]


@pytest.mark.parametrize("kind", SIGNED_KINDS + ["Q6_K", "Q4_K", "Q3_K"])
def test_prefill_rows_run_fp32_on_avx2(kind):
    """Prefill-sized calls on the AVX2 path (no VNNI) multiply by an fp32 GEMM on the weights'
    exact fp32 values, tile by tile: 8-bit weights (Q8_0, the IQ4 codebook) from 96 rows, the
    other forms (nibbles, bit planes, narrower bytes) from 192. Within fp32 rounding of fp64 on the
    dequantized weights there, where the kernel's 16-bit activations are ~1e-5 off; one row fewer
    stays on the kernel (bit for bit the scalar path's), and every other path keeps the kernel at
    any row count (bit for bit the scalar path's)."""
    n, k = 40, 512
    raw = random_blocks(kind, n, k, seed=200 + KINDS.index(kind), std=0.05)
    b = gguf_blocks.decode(kind, torch.from_numpy(raw))
    ref_w = torch.from_numpy(reference(kind, raw)).double()
    gen = torch.Generator().manual_seed(11)
    xs = {m: torch.randn(m, k, generator=gen) * 2 for m in (95, 96, 191, 192, 300)}
    layouts = {"file": cpu_int8.pack(b.q, b.d, b.m, b.zero, b.bits, **file_form(b)),
               "bytes": cpu_int8.pack(b.q, b.d, b.m, b.zero)}
    outs = {}
    try:
        for path in isa_paths():
            torch.ops.localllm.int8w_isa(path)
            for name, (w, sc) in layouts.items():
                for m, x in xs.items():
                    outs[path, name, m] = cpu_int8.int8w_gemm(x, w, sc, b.group, b.zero)
    finally:
        torch.ops.localllm.int8w_isa("auto")
    dense_from = 96 if kind in SIGNED_KINDS else 192
    for (path, name, m), y in outs.items():
        assert torch.equal(y[:, n:], torch.zeros_like(y[:, n:]))
        err = rel_err(y[:, :n], xs[m].double() @ ref_w.t())
        if path == "avx2" and m >= dense_from:
            assert err < 1e-6, (path, name, m, err)
        else:
            assert 1e-6 < err < 2e-4, (path, name, m, err)
            assert torch.equal(y, outs["generic", name, m]), (path, name, m)


@pytest.fixture(params=["auto", "avx2"])
def int4_isa(request):
    assert cpu_int4.load()
    torch.ops.localllm.int4_isa(request.param == "avx2")
    yield
    torch.ops.localllm.int4_isa(False)


@pytest.mark.skipif(not cpu_int4.supported(), reason="this CPU has no AVX2 (with FMA and F16C)")
@pytest.mark.parametrize("m", [1, 6])
def test_q4_k_on_the_int4_kernel_matches_fp64(m, int4_isa):
    """Q4_K in the int4 kernel, its own sub-scales under fp16 super-scales (0.578 bytes a weight,
    the file's 0.5625): batch 1 and a tile of rows against fp64, and bit for bit the outputs of
    the per-32 fp32 scales and offsets it was held in before (0.75)."""
    n, k = 40, 512
    raw = random_blocks("Q4_K", n, k, seed=3, std=0.05)
    b = gguf_blocks.decode("Q4_K", torch.from_numpy(raw))
    w, sc = cpu_int4.pack_dm(b.q, b.d, b.m, b.sub.packed())
    assert sc.dtype == torch.uint8 and (w.numel() + sc.numel()) / (48 * k) == 0.5 + 320 / 4096
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    y = cpu_int4.int4_gemm(x, w, sc, 32)
    assert torch.equal(y, cpu_int4.int4_gemm(x, *cpu_int4.pack_dm(b.q, b.d, b.m), 32))
    assert rel_err(y[:, :n], x.double() @ torch.from_numpy(reference("Q4_K", raw)).double().t()) < 2e-4


# ---- a mixed file through the loader --------------------------------------------------------------
H, F, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 2
# per layer and role: the type each tensor is stored in (the K-quants need K % 256 == 0)
MIX = [{"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q5_0", "ffn_gate": "Q5_K",
        "ffn_up": "Q8_0", "ffn_down": "Q6_K"},
       {"attn_q": "Q4_0", "attn_k": "Q5_1", "attn_v": "IQ4_NL", "attn_output": "IQ4_XS", "ffn_gate": "Q3_K",
        "ffn_up": "Q2_K", "ffn_down": "F16"}]
SHAPES = {"attn_q": (H, H), "attn_k": (H // 2, H), "attn_v": (H // 2, H), "attn_output": (H, H),
          "ffn_gate": (F, H), "ffn_up": (F, H), "ffn_down": (H, F)}


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory, gguf_path):
    """A 2-layer Llama with the real tokenizer whose matrices are stored in 12 different types."""
    out = tmp_path_factory.mktemp("kquants") / "mixed.gguf"
    w = gguf.GGUFWriter(str(out), "llama")
    fields = tokenizer_fields(gguf_path)
    for key, val, vtype, sub in fields:
        w.add_key_value(key, val, vtype, sub)
    vocab = len(next(val for key, val, *_ in fields if key == "tokenizer.ggml.tokens"))
    w.add_block_count(LAYERS)
    w.add_context_length(1024)
    w.add_embedding_length(H)
    w.add_feed_forward_length(F)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    rng = np.random.default_rng(0)
    emb = gguf.quants.quantize(rng.standard_normal((vocab, H), dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("token_embd.weight", emb, raw_shape=emb.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("output_norm.weight", np.ones(H, np.float32))
    for i, types in enumerate(MIX):
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", np.ones(H, np.float32))
        for role, kind in types.items():
            n, k = SHAPES[role]
            std = 1.5 / k ** 0.5
            if kind == "F16":
                w.add_tensor(f"blk.{i}.{role}.weight", (rng.standard_normal((n, k)) * std).astype(np.float16))
                continue
            raw = random_blocks(kind, n, k, seed=10 * i + list(types).index(role), std=std).reshape(n, -1)
            w.add_tensor(f"blk.{i}.{role}.weight", raw, raw_shape=raw.shape,
                         raw_dtype=gguf.GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def layer_values(m) -> torch.Tensor:
    """The weights a loaded linear multiplies by, fp32 [out, in]."""
    if isinstance(m, ConcatLinear):
        return torch.cat([layer_values(p) for p in m.parts])
    if isinstance(m, Int8wLinear):
        return cpu_int8.dequantize(m.qw, m.qsc, m.out_features, m.group_size, m.zero)
    if isinstance(m, Int4Linear):
        return int4_values(m.qw, m.qsc, m.out_features)
    if isinstance(m, W16Linear):
        return m.weight16().float()
    return m.weight.detach()


def test_mixed_file_runs_each_tensor_on_its_kernel(mixed_gguf):
    """Each tensor on its type's kernel (parts of one fused layer split where their kernels
    differ), holding exactly the file's values; logits follow the same file loaded in fp32; a
    second load from the conversion cache builds the same layers."""
    dense = load_model(mixed_gguf, "float32")
    ours = load_model(mixed_gguf, "auto")
    assert "GGUF" in ours.precision and "int8-lane" in ours.precision
    l0, l1 = ours.model.layers
    kinds = {name: [type(p).__name__ for p in (m.parts if isinstance(m, ConcatLinear) else [m])]
             for name, m in (("0.qkv", l0.qkv), ("0.o", l0.o), ("0.gate_up", l0.gate_up), ("0.down", l0.down),
                             ("1.qkv", l1.qkv), ("1.o", l1.o), ("1.gate_up", l1.gate_up), ("1.down", l1.down))}
    # int8-lane parts stack only where group and zero point agree (each at its own bytes per weight)
    assert kinds == {"0.qkv": ["Int4Linear", "Int8wLinear"], "0.o": ["Int8wLinear"],
                     "0.gate_up": ["Int8wLinear", "Int8wLinear"], "0.down": ["Int8wLinear"],
                     "1.qkv": ["Int4Linear", "Int8wLinear", "Int8wLinear"], "1.o": ["Int8wLinear"],
                     "1.gate_up": ["Int8wLinear", "Int8wLinear"], "1.down": ["W16Linear"]}
    q5k, q8 = l0.gate_up.parts
    q3k, q2k = l1.gate_up.parts
    # the K-quants' scales as the file keeps them: per 256 columns and 16 rows, fp16 super-scales
    # (and -dmin) and int8 sub-scales (and mins) per group of 16 (Q6_K, Q3_K, Q2_K) or 32 (Q5_K)
    assert (l0.down.group_size, l0.down.zero, l0.down.qsc.dtype, l0.down.qsc.shape[2]) == (16, 32, torch.uint8, 288)
    assert (q5k.group_size, q5k.qsc.shape[2]) == (32, 320) and (q8.group_size, q8.zero, q8.qsc.shape[2]) == (32, 128, 1)
    assert (q3k.group_size, q3k.zero, q3k.qsc.shape[2]) == (16, 4, 288) and (q2k.group_size, q2k.qsc.shape[2]) == (16, 576)
    iq4nl, iq4xs = l1.qkv.parts[2], l1.o
    assert (iq4nl.zero, iq4nl.qsc.dtype, iq4xs.qsc.shape[2]) == (128, torch.float16, 160)
    assert l0.qkv.parts[0].qsc.dtype == torch.uint8 and l1.qkv.parts[0].qsc.shape[2] == 1  # Q4_K records, Q4_0 d
    # the layouts: Q6_K's 2 high-bit planes (byte lanes where the CPU has no AVX2: cpu_int8.preferred_bits),
    # Q5_0's and Q5_K's 1, Q8_0 in byte lanes, Q3_K and Q2_K in nibbles, IQ4_NL / IQ4_XS as 4-bit codebook indices
    q6k_rec = 96 if cpu_int8.preferred_bits(6) == 6 else 64
    assert [m.qw.shape[2] for m in (l0.down, l0.o, q5k, q8, q3k, q2k, iq4nl, iq4xs)] == [q6k_rec, 80, 80, 64, 64, 64, 64, 64]
    assert q8.qw.shape[1] * 4 == H and q3k.qw.shape[1] * 8 == H and iq4xs.qw.shape[1] * 8 == H
    for ld, lo in zip(dense.model.layers, ours.model.layers):
        for f in ("qkv", "o", "gate_up", "down"):
            # equal values (a stack given offsets -zero * d would have d * 4 - 4d = +0 for -0)
            assert torch.equal(layer_values(getattr(lo, f)), layer_values(getattr(ld, f))), f
    assert isinstance(l1.down, W16Linear) and l1.down.w.dtype == torch.float16  # F16 kept in 16 bits
    prompt = [1, 504, 3458, 282, 5248, 314, 17, 2, 9, 8822, 1137, 30, 42, 99, 1000, 20000]
    ref = make_engine(dense).score(prompt)
    got = make_engine(ours).score(prompt)
    assert rel_err(got, ref.double()) < 1e-3
    cache = ConvertCache(mixed_gguf)
    assert cache.hit and "0.qkv.parts" in cache.tensors and "0.down.qw8" in cache.tensors
    again = load_model(mixed_gguf, "auto")
    for la, lo in zip(again.model.layers, ours.model.layers):
        for f in ("qkv", "o", "gate_up", "down"):
            a, o = getattr(la, f), getattr(lo, f)
            assert type(a) is type(o) and bits_equal(layer_values(a), layer_values(o).numpy()), f
            assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), o.state_dict().values()))
    assert torch.equal(make_engine(again).score(prompt), got)


def test_k_quant_parts_are_repacked_in_one_cpp_pass(mixed_gguf, tmp_path, monkeypatch):
    """A first load (an empty home: no conversion cache) takes the C++ repack for each of the file's
    ten block types (Q2_K to Q6_K, IQ4_XS, Q5_0, Q5_1, IQ4_NL, Q8_0; Q4_0 has its own) (localllm_kernels.cpu_repack) and builds the layers the torch path
    builds, byte for byte."""
    from localllm.model import loader
    from localllm_kernels import cpu_repack

    calls = []
    q4_k, int8, block32 = cpu_repack.q4_k, cpu_repack.int8, cpu_repack.block32
    monkeypatch.setattr(cpu_repack, "q4_k", lambda raw, rows: calls.append("Q4_K") or q4_k(raw, rows))
    monkeypatch.setattr(cpu_repack, "int8", lambda raw, kind, *a: calls.append(kind) or int8(raw, kind, *a))
    monkeypatch.setattr(cpu_repack, "block32", lambda raw, kind, *a: calls.append(kind) or block32(raw, kind, *a))
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path / "fast"))
    fast = load_model(mixed_gguf, "auto")
    assert sorted(set(calls)) == ["IQ4_NL", "IQ4_XS", "Q2_K", "Q3_K", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0"]
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path / "torch"))
    monkeypatch.setattr(loader, "_gguf_repacked_linear", lambda *a: None)
    slow = load_model(mixed_gguf, "auto")
    for lf, ls in zip(fast.model.layers, slow.model.layers):
        for f in ("qkv", "o", "gate_up", "down"):
            a, b = getattr(lf, f), getattr(ls, f)
            assert type(a) is type(b), f
            assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values())), f
            for pa, pb in zip(getattr(a, "parts", [a]), getattr(b, "parts", [b])):
                assert (getattr(pa, "zero", None), getattr(pa, "group_size", None)) == \
                    (getattr(pb, "zero", None), getattr(pb, "group_size", None)), f


def test_eight_bit_activations_reach_every_kernel_part(mixed_gguf):
    """--act-bits 8 (model.use_act_bits(8)): every int4 and int8-lane part of every layer takes one
    activation part, in the one-call decode step as in the ops one by one (same bits), the outputs
    within 8-bit rounding of the 16-bit ones and not equal to them; an engine with
    the default config sets 16 again and the 16-bit outputs come back exactly (the one-call step's
    cached arguments follow)."""
    from localllm.model.attention import describe_batch

    loaded = load_model(mixed_gguf, "auto")
    m = loaded.model
    pos, meta = describe_batch(torch.tensor([[1, 2]]), [1], [21], 16)
    ids = torch.tensor([7])

    def hidden():
        kv = m.new_kv_cache(3, 16, torch.float32)
        for k, v in kv:
            k.copy_(torch.randn(k.shape, generator=torch.Generator().manual_seed(5)))
            v.copy_(torch.randn(v.shape, generator=torch.Generator().manual_seed(6)))
        return m(ids, pos, meta, kv)

    h16 = hidden()
    m.use_act_bits(8)
    kinds = [p for layer in m.layers for p in layer.modules() if isinstance(p, (Int4Linear, Int8wLinear))]
    assert {type(p) for p in kinds} == {Int4Linear, Int8wLinear} and all(p.act_parts == 1 for p in kinds)
    h8 = hidden()
    assert not torch.equal(h8, h16) and rel_err(h8, h16.double()) < 3e-2
    assert_one_call_equals_one_by_one(m, torch.float16)
    make_engine(loaded, act_bits=8)
    assert "8-bit matmul inputs" in loaded.precision and torch.equal(hidden(), h8)
    make_engine(loaded)  # a default engine on the same model: back to 16 bits
    assert "16-bit matmul inputs" in loaded.precision and torch.equal(hidden(), h16)
    with pytest.raises(ValueError, match="8 or 16"):
        m.use_act_bits(4)


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.float32])
def test_mixed_file_decodes_each_layer_in_one_call(mixed_gguf, kv_dtype):
    """Every layer of the 12-type file takes the one-call decode step (its fused linears' parts on
    the int4, int8-lane and 16-bit kernels each), with the bits of the same ops one by one; a
    replaced buffer (`.to()` and the like) is seen, not a stale one used."""
    loaded = load_model(mixed_gguf, "auto")
    m = loaded.model
    assert m.ops.layer.__module__ == "localllm.model.cpu_ops"
    args = [decode_layer_args(layer) for layer in m.layers]
    assert all(a is not None for a in args)
    assert [a[1][5:9] for a in args] == [[2, 1, 2, 1], [3, 1, 2, 1]]  # parts of qkv, o, gate_up, down
    assert [a[1][-4] for a in args] == [1, 2]  # the downs: Q6_K int8-lane, F16 16-bit
    assert_one_call_equals_one_by_one(m, kv_dtype)
    down = m.layers[1].down
    down.w = down.w.clone()
    again = decode_layer_args(m.layers[1])
    assert again is not args[1] and again[0][-3] is down.w


def test_mixed_file_one_call_layers_add_each_parts_bias(mixed_gguf):
    """The 12-type file with a bias on every int4 and int8-lane part of its fused linears (as a
    Qwen2 K-quant file's qkv has): each part's bias after its cut, the bits of the ops one by one."""
    m = load_model(mixed_gguf, "auto").model
    g = torch.Generator().manual_seed(7)
    biased = 0
    for layer in m.layers:
        for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
            for part in (lin.parts if isinstance(lin, ConcatLinear) else [lin]):
                if isinstance(part, (Int4Linear, Int8wLinear)):
                    part.bias = torch.nn.Parameter(torch.randn(part.out_features, generator=g), requires_grad=False)
                    biased += 1
    assert biased >= 6
    assert all(decode_layer_args(layer) is not None for layer in m.layers)
    assert_one_call_equals_one_by_one(m, torch.float32)


def test_mixed_file_holds_the_files_bytes_where_the_layout_allows(mixed_gguf):
    """The 12-type file: the types whose layout is the file's hold its bytes per weight (within 5%:
    the K-quants' sub-scales kept as int8 lanes, not 6-bit fields); the planner says what every
    layer holds."""
    from test_model_memory import LIKE_FILE, held_by_gguf_tensor, planner_matches_held

    loaded = load_model(mixed_gguf, "auto")
    per = held_by_gguf_tensor(loaded, mixed_gguf)
    # (without AVX2 Q6_K takes byte lanes: cpu_int8.preferred_bits)
    like = LIKE_FILE - ({"Q6_K"} if cpu_int8.preferred_bits(6) != 6 else set())
    checked = set()
    for name, (kind, file_b, held) in per.items():
        if kind in like:
            assert file_b * 0.99 <= held <= file_b * 1.05, (name, kind, held / file_b)
            checked.add(kind)
    # (Q4_K shares its layer with Q4_K and Q6_K parts here: counted by test_planner_bytes_are_the_layouts_bytes)
    assert checked >= {"Q4_0", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "Q5_0", "Q8_0"} & like, checked
    planner_matches_held(loaded, mixed_gguf)


@pytest.mark.parametrize("kind", KINDS)
def test_planner_bytes_are_the_layouts_bytes(kind):
    """The planner's bytes per weight of each type (gguf_blocks.cpu_bytes_per_value) are what the
    loader's layout of a matrix of that type takes, on this CPU's kernel path."""
    n, k = 32, 512
    b = gguf_blocks.decode(kind, torch.from_numpy(random_blocks(kind, n, k, seed=5, std=0.05)))
    form = file_form(b)
    if kind in ("Q4_0", "Q4_1", "Q4_K") and cpu_int4.supported():
        w, sc = cpu_int4.pack_dm(b.q, b.d, b.m, form["sub"])
    else:
        assert cpu_int8.load()
        w, sc = cpu_int8.pack(b.q, b.d, b.m, b.zero, cpu_int8.preferred_bits(b.bits), **form)
    got = (w.numel() * w.element_size() + sc.numel() * sc.element_size()) / (n * k)
    expected = gguf_blocks.cpu_bytes_per_value(kind)
    if kind == "Q6_K" and cpu_int8.preferred_bits(6) != 6:
        expected += 0.25  # byte lanes without AVX2 (see cpu_bytes_per_value)
    assert got == expected
    file = gguf_blocks.BLOCK_BYTES[kind] / gguf_blocks.BLOCK_VALUES[kind]
    # the file's bytes within 5%, but for the 2- and 3-bit K-quants (held as nibbles) and MXFP4 (its
    # one-byte scales held as fp16: 0.5625 bytes a weight for the file's 0.53)
    wider = {"Q2_K": 2, "Q3_K": 2, "MXFP4": 1.06}
    assert file <= gguf_blocks.cpu_bytes_per_value(kind) <= file * wider.get(kind, 1.05)
