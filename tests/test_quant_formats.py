"""AWQ / GPTQ checkpoint loading: tiny tensors packed here by explicit loops (not by our packer)
must dequantize to values computed here independently; config validation gives clear errors."""

import json

import pytest
import torch
from safetensors.torch import save_file

from localllm.model.errors import ModelLoadError
from localllm.model.hf_weights import HFWeights

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # restated from the AutoAWQ format, not imported
K, N, G = 128, 32, 32  # in, out, group: N % 16 == 0 and K % 32 == 0 so the int4 kernel takes it
NAME = "model.layers.0.self_attn.q_proj"


def tiny_config(**extra) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": K,
            "intermediate_size": 256, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
            **extra}


def write(tmp_path, tensors: dict, config: dict, legacy: tuple[str, dict] | None = None) -> HFWeights:
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    if legacy:
        (tmp_path / legacy[0]).write_text(json.dumps(legacy[1]))
    return HFWeights(tmp_path)


def to_i32(word: int) -> int:
    return word - (1 << 32) if word >= 1 << 31 else word


def rand_ints(shape, hi=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, hi, shape, generator=g)


def rand_scales(shape, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=g) * 0.02 + 0.001).half()


def expected(q, z, s, group_of) -> torch.Tensor:
    """w[n][k] = (q[k][n] - z[group(k)][n]) * s[group(k)][n], element by element."""
    kk, nn = q.shape
    w = torch.zeros(nn, kk)
    for k in range(kk):
        gk = group_of(k)
        for n in range(nn):
            w[n, k] = (float(q[k, n]) - float(z[gk, n])) * float(s[gk, n])
    return w


def pack_cols_loops(x, order=tuple(range(8))) -> torch.Tensor:
    """8 nibbles per int32 along each row; nibble i holds column 8c + order[i]."""
    rows, cols = x.shape
    out = torch.zeros(rows, cols // 8, dtype=torch.int32)
    for r in range(rows):
        for c in range(cols // 8):
            word = 0
            for i in range(8):
                word |= int(x[r, 8 * c + order[i]]) << (4 * i)
            out[r, c] = to_i32(word)
    return out


def pack_awq_loops(x) -> torch.Tensor:
    return pack_cols_loops(x, AWQ_ORDER)


def pack_seq_cols_loops(x) -> torch.Tensor:
    return pack_cols_loops(x)


def pack_rows_loops(x) -> torch.Tensor:
    rows, cols = x.shape
    out = torch.zeros(rows // 8, cols, dtype=torch.int32)
    for r in range(rows // 8):
        for c in range(cols):
            word = 0
            for j in range(8):
                word |= int(x[8 * r + j, c]) << (4 * j)
            out[r, c] = to_i32(word)
    return out


def check(weights, want: torch.Tensor, expect_perm: bool = False):
    w4 = weights.int4(NAME + ".weight")
    assert w4 is not None
    assert (w4.in_perm is not None) == expect_perm
    assert torch.equal(w4.dequantize_logical(), want)  # exact: integers times fp16 scales in fp32
    assert torch.equal(weights.dense(NAME + ".weight"), want)
    # and through the CPU int4 kernel (bf16 inputs and scales: close, not exact)
    from localllm.model.layers import Int4Linear

    x = torch.randn(3, K)
    y = Int4Linear(w4, torch.float32)(x)
    ref = x @ want.t()
    assert (y - ref).abs().max() < 0.02 * ref.abs().max()


def test_awq_nibble_order_and_zeros(tmp_path):
    q, z, s = rand_ints((K, N)), rand_ints((K // G, N), seed=2), rand_scales((K // G, N))
    t = {NAME + ".qweight": pack_awq_loops(q), NAME + ".qzeros": pack_awq_loops(z), NAME + ".scales": s}
    qc = {"quant_method": "awq", "bits": 4, "group_size": G, "zero_point": True, "version": "gemm"}
    w = write(tmp_path, t, tiny_config(quantization_config=qc))
    check(w, expected(q, z, s, lambda k: k // G))


def test_awq_legacy_quant_config_file(tmp_path):
    q, z, s = rand_ints((K, N), seed=5), rand_ints((K // G, N), seed=6), rand_scales((K // G, N), seed=7)
    t = {NAME + ".qweight": pack_awq_loops(q), NAME + ".qzeros": pack_awq_loops(z), NAME + ".scales": s}
    legacy = ("quant_config.json", {"zero_point": True, "q_group_size": G, "w_bit": 4, "version": "GEMM"})
    w = write(tmp_path, t, tiny_config(), legacy)
    assert w.quant["quant_method"] == "awq" and w.quant["group_size"] == G
    check(w, expected(q, z, s, lambda k: k // G))


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_gptq_zero_convention(tmp_path, fmt):
    """v1 stores zero - 1 (and readers add 1 back without wrapping: a stored 15 means 16)."""
    q, s = rand_ints((K, N)), rand_scales((K // G, N))
    stored = rand_ints((K // G, N), seed=3)
    stored[0, 0] = 15
    true_z = stored + 1 if fmt == "gptq" else stored
    t = {NAME + ".qweight": pack_rows_loops(q), NAME + ".qzeros": pack_seq_cols_loops(stored), NAME + ".scales": s,
         NAME + ".g_idx": torch.tensor([k // G for k in range(K)], dtype=torch.int32)}
    qc = {"quant_method": "gptq", "bits": 4, "group_size": G, "desc_act": False, "sym": False,
          "checkpoint_format": fmt}
    w = write(tmp_path, t, tiny_config(quantization_config=qc))
    check(w, expected(q, true_z, s, lambda k: k // G))


def test_gptq_act_order_g_idx(tmp_path):
    """Non-monotonic g_idx: K is permuted at load and the layer gathers its input to match."""
    q, s, stored = rand_ints((K, N), seed=8), rand_scales((K // G, N), seed=9), rand_ints((K // G, N), seed=10)
    gen = torch.Generator().manual_seed(11)
    order = torch.randperm(K, generator=gen)  # the act-order column order
    g_idx = torch.zeros(K, dtype=torch.int32)
    for pos, col in enumerate(order.tolist()):
        g_idx[col] = pos // G
    t = {NAME + ".qweight": pack_rows_loops(q), NAME + ".qzeros": pack_seq_cols_loops(stored), NAME + ".scales": s,
         NAME + ".g_idx": g_idx}
    legacy = ("quantize_config.json", {"bits": 4, "group_size": G, "desc_act": True, "sym": False})
    w = write(tmp_path, t, tiny_config(), legacy)
    check(w, expected(q, stored + 1, s, lambda k: int(g_idx[k])), expect_perm=True)


def test_gptq_g128_with_k_not_multiple_of_128_regroups(tmp_path):
    """A g128 checkpoint with K = 192 (partial last group) is re-expressed exactly as g64."""
    k_dim = 192
    groups = -(-k_dim // 128)
    q, s, stored = rand_ints((k_dim, N), seed=12), rand_scales((groups, N), seed=13), rand_ints((groups, N), seed=14)
    t = {NAME + ".qweight": pack_rows_loops(q), NAME + ".qzeros": pack_seq_cols_loops(stored),
         NAME + ".scales": s, NAME + ".g_idx": torch.tensor([k // 128 for k in range(k_dim)], dtype=torch.int32)}
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True}
    w = write(tmp_path, t, tiny_config(quantization_config=qc, hidden_size=k_dim))
    w4 = w.int4(NAME + ".weight")
    assert w4.group_size == 64
    assert torch.equal(w4.dequantize_logical(), expected(q, stored + 1, s, lambda k: k // 128))


def test_k_not_multiple_of_32_falls_back_to_dense(tmp_path):
    """K = 72 with g8 fits no kernel group: int4() says None, dense() still dequantizes exactly."""
    k_dim, g = 72, 8
    q, s, stored = rand_ints((k_dim, N), seed=15), rand_scales((k_dim // g, N)), rand_ints((k_dim // g, N))
    t = {NAME + ".qweight": pack_rows_loops(q), NAME + ".qzeros": pack_seq_cols_loops(stored),
         NAME + ".scales": s, NAME + ".g_idx": torch.tensor([k // g for k in range(k_dim)], dtype=torch.int32)}
    qc = {"quant_method": "gptq", "bits": 4, "group_size": g, "sym": False, "checkpoint_format": "gptq_v2"}
    w = write(tmp_path, t, tiny_config(quantization_config=qc, hidden_size=k_dim))
    assert w.int4(NAME + ".weight") is None
    assert torch.equal(w.dense(NAME + ".weight"), expected(q, stored, s, lambda k: k // g))


def test_module_left_in_float(tmp_path):
    q, z, s = rand_ints((K, N)), rand_ints((K // G, N), seed=2), rand_scales((K // G, N))
    dense = torch.randn(N, K)
    t = {NAME + ".qweight": pack_awq_loops(q), NAME + ".qzeros": pack_awq_loops(z), NAME + ".scales": s,
         "model.layers.0.mlp.gate_proj.weight": dense}
    qc = {"quant_method": "awq", "bits": 4, "group_size": G, "version": "gemm",
          "modules_to_not_convert": ["mlp.gate"]}
    w = write(tmp_path, t, tiny_config(quantization_config=qc))
    assert w.int4("model.layers.0.mlp.gate_proj.weight") is None
    assert torch.equal(w.dense("model.layers.0.mlp.gate_proj.weight"), dense)
    assert w.int4(NAME + ".weight") is not None


@pytest.mark.parametrize("qc, words", [
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, ["version", "gemv"]),
    ({"quant_method": "awq", "bits": 4, "version": "gemv_fast"}, ["version", "gemv_fast"]),
    ({"quant_method": "gptq", "bits": 8}, ["bits=8"]),
    ({"quant_method": "gptq", "bits": 3}, ["bits=3"]),
    ({"quant_method": "compressed-tensors"}, ["quant_method", "compressed-tensors"]),
    ({"quant_method": "bitsandbytes"}, ["quant_method", "bitsandbytes"]),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, ["checkpoint_format", "marlin"]),
    ({"quant_method": "awq", "bits": 4, "version": "marlin"}, ["version", "marlin"]),
])
def test_unsupported_variants_name_the_field(tmp_path, qc, words):
    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(tiny_config(quantization_config=qc)))
    with pytest.raises(ModelLoadError) as e:
        HFWeights(tmp_path)
    for w in words:
        assert w in str(e.value)
