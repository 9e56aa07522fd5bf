"""Our own 4-bit quantizer: RTN, GPTQ and AWQ, writing standard AutoGPTQ/GPTQModel and AutoAWQ
checkpoints (config.json with quantization_config, model.safetensors, tokenizer files).

Calibration runs the real model (`load_model(src, "float32")`: fp32 DenseLinear layers), one
decoder layer at a time through the pieces of its own forward (`LlamaModel.embed_tokens`,
`LlamaModel.run_layer`, `DecoderLayer.mlp`: Gemma's embedding scale, GeGLU and norms included),
over the whole calibration set as one flattened batch of sequences (`Calibration`); the inputs
of each linear are captured with forward hooks, and what a layer's quantization changes is
written into that layer's weights, so the next layer sees the quantized model's activations (the
whole model never runs at once):

- RTN: per-group min/max rounding, no data.
- GPTQ (Frantar et al.; the reference `fasterquant`): per linear, H = 2/n X Xᵀ of its inputs,
  1% mean-diagonal damping, upper Cholesky factor of H⁻¹, columns quantized left to right with
  the error spread over the not-yet-quantized columns (lazy 128-column blocks); by default
  act-order, asymmetric, and each group's scale/zero from a Hessian-weighted shrink search
  (`mse_params`). Layers and, within a layer, qkv -> o -> gate/up -> down are quantized in
  sequence, each fed the outputs of what is already quantized (true-sequential).
- AWQ (Lin et al.; AutoAWQ's algorithm): per input channel scales s = x̄^α / w̄^(1-α), α on a
  20-point grid, chosen to minimize the error of the block's output (attention / MLP / down) over
  all calibration tokens, folded into the previous RMSNorm or linear; then a per-group clipping
  search, then the same min/max rounding as AutoAWQ.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..model.attention import describe_batch
from ..model.hf_weights import HFWeights
from ..model.llama import DecoderLayer, LlamaModel
from ..model.loader import load_model
from ..model.quant_formats import AWQ_ORDER
from ..model.weights import open_weights
from .calib_text import CALIBRATION

METHODS = ("rtn", "gptq", "awq")


class QuantizeError(ValueError):
    """Bad quantizer input (method, group size, source model)."""


@dataclass
class QLinear:
    """One quantized linear in checkpoint terms: w[n, k] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]."""

    q: torch.Tensor  # int32 [K, N], 0..15
    z: torch.Tensor  # int32 [G, N], 0..15 (true zero point)
    s: torch.Tensor  # float16 [G, N]
    g_idx: torch.Tensor  # int32 [K]

    def dequantize(self) -> torch.Tensor:
        g = self.g_idx.long()
        return ((self.q.float() - self.z[g].float()) * self.s[g].float()).t().contiguous()


@dataclass
class QuantizeResult:
    path: Path
    method: str
    group_size: int
    seconds: float
    calib_tokens: int
    dequantized: dict[str, torch.Tensor] = field(default_factory=dict)  # HF weight name -> [N, K]


# ---- rounding ---------------------------------------------------------------------------------
def _fp16(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-65504, 65504).half().float()


def minmax_params(w: torch.Tensor, sym: bool, zero_in_range: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale (fp16-representable) and integer zero per row of a group `w` [N, g].

    zero_in_range=True is GPTQ's quantizer (the range always includes 0; sym: zero 8);
    False is AutoAWQ's pseudo_quantize (plain min/max)."""
    lo, hi = w.amin(1), w.amax(1)
    if zero_in_range:
        lo, hi = lo.clamp(max=0), hi.clamp(min=0)
    if sym:
        hi = torch.maximum(lo.abs(), hi)
        lo = -hi
        hi = torch.where(hi == 0, torch.ones_like(hi), hi)
        lo = torch.where(lo == 0, -torch.ones_like(lo), lo)
        scale = _fp16((hi - lo) / 15).clamp_min(6.2e-5)
        return scale, torch.full_like(scale, 8.0)
    scale = _fp16(((hi - lo) / 15).clamp_min(1e-5)).clamp_min(6.2e-5)
    zero = torch.round(-lo / scale).clamp(0, 15)
    return scale, zero


def quantize_cols(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """w [N, c] with per-row scale/zero [N] -> q [N, c] in 0..15."""
    return torch.clamp(torch.round(w / scale[:, None]) + zero[:, None], 0, 15)


def mse_params(w: torch.Tensor, sym: bool, v1_zeros: bool, col_weight: torch.Tensor, grid: int = 100,
               max_shrink: float = 0.8) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ's quantizer with the reference `Quantizer(mse=True)` grid: per row of the group `w`
    [N, g], shrink its (zero-including) range by 1 - i/grid, i < max_shrink*grid, and keep the
    scale/zero with the smallest Σ col_weight·(w - ŵ)². col_weight is the Hessian diagonal of the
    group's columns (the reference uses a plain |w - ŵ|^2.4): an error on a column with large
    activations costs more (measured gains: BENCHMARKS.md, Quantization)."""
    lo, hi = w.amin(1).clamp(max=0), w.amax(1).clamp(min=0)
    best = best_s = best_z = None
    for i in range(int(max_shrink * grid)):  # a loop: [P, N, g] at once measured 2-6x slower
        p = 1 - i / grid
        s, z = minmax_params(torch.stack([lo * p, hi * p], 1), sym, zero_in_range=True)
        if v1_zeros:
            z = z.clamp(min=1)
        err = (((quantize_cols(w, s, z) - z[:, None]) * s[:, None] - w).pow(2) * col_weight).sum(1)
        if best is None:
            best, best_s, best_z = err, s, z
            continue
        better = err < best  # ties keep the wider range
        best = torch.where(better, err, best)
        best_s, best_z = torch.where(better, s, best_s), torch.where(better, z, best_z)
    return best_s, best_z


def rtn(w: torch.Tensor, group: int, sym: bool, zero_in_range: bool, v1_zeros: bool = False) -> QLinear:
    """Round-to-nearest per group of `group` input channels. w [N, K] fp32."""
    n, k = w.shape
    wg = w.reshape(n, k // group, group).transpose(0, 1).reshape(-1, group)  # [G*N, g]
    s, z = minmax_params(wg, sym, zero_in_range)
    if v1_zeros:
        z = z.clamp(min=1)
    q = quantize_cols(wg, s, z).view(k // group, n, group).permute(0, 2, 1).reshape(k, n)
    return QLinear(q.int(), z.view(-1, n).int(), s.view(-1, n).half(), (torch.arange(k) // group).int())


# ---- GPTQ -------------------------------------------------------------------------------------
def gptq(w: torch.Tensor, H: torch.Tensor, group: int, sym: bool = True, act_order: bool = False,
         damp_percent: float = 0.01, block: int = 128, mse: bool = False) -> QLinear:
    """GPTQ of one linear: w [N, K] fp32, H [K, K] = 2/n Σ x xᵀ of its inputs. mse: each group's
    scale/zero from the Hessian-weighted shrink search (`mse_params`) instead of its min/max."""
    W = w.clone().float()
    n, k = W.shape
    H = H.clone().double()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    perm = torch.arange(k)
    if act_order:  # quantize the columns with the largest activations first
        perm = torch.argsort(torch.diag(H), descending=True)
        W, H = W[:, perm], H[perm][:, perm]
    hdiag = torch.diag(H).float()
    H += torch.eye(k, dtype=H.dtype) * damp_percent * torch.mean(torch.diag(H))
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True).float()
    Q = torch.zeros(n, k)
    S = torch.zeros(k // group, n)
    Z = torch.zeros(k // group, n)
    block = max(group, block // group * group)  # groups never straddle a block
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        W1, Hinv1 = W[:, i1:i2].clone(), Hinv[i1:i2, i1:i2]
        Err1 = torch.zeros_like(W1)
        for i in range(i2 - i1):
            col = i1 + i
            if col % group == 0:  # scale/zero from the group's columns as updated so far
                if mse:
                    s, z = mse_params(W1[:, i:i + group], sym, not sym, hdiag[col:col + group])
                else:
                    s, z = minmax_params(W1[:, i:i + group], sym, zero_in_range=True)
                if not sym:
                    z = z.clamp(min=1)  # v1 checkpoints store zero - 1 in 4 bits
                S[col // group], Z[col // group] = s, z
            wcol = W1[:, i]
            q = torch.clamp(torch.round(wcol / s) + z, 0, 15)
            Q[:, col] = q
            err = (wcol - (q - z) * s) / Hinv1[i, i]
            W1[:, i:] -= err[:, None] * Hinv1[i, i:][None, :]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    inv = torch.argsort(perm)
    g_idx = (torch.arange(k) // group)[inv]  # original column c sits at permuted position inv[c]
    return QLinear(Q[:, inv].t().int().contiguous(), Z.int(), S.half(), g_idx.int())


# ---- calibration: the real model, one decoder layer at a time --------------------------------
# The fused modules of a DecoderLayer; the checkpoint linears each one holds (in row order) are
# the model's: separate q/k/v and gate/up, or Phi-3's qkv_proj and gate_up_proj as AutoAWQ and
# GPTQModel write them for Phi-3 (ModelConfig.checkpoint_linears).
FUSED = ("qkv", "o", "gate_up", "down")


def _parts(layer: DecoderLayer, fused: str, modules: tuple[str, ...]) -> list[tuple[str, int]]:
    """(checkpoint module, rows) of each part of the fused linear `fused`."""
    n = getattr(layer, fused).out_features
    if len(modules) == 1:
        return [(modules[0], n)]
    sizes = list(layer.split) if fused == "qkv" else [n // 2, n // 2]
    return list(zip(modules, sizes))


def _split_rows(cfg: ModelConfig, layer: DecoderLayer, fused: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """A fused weight (or bias) [N, ...] -> its checkpoint parts by module name."""
    parts = _parts(layer, fused, cfg.checkpoint_linears()[fused])
    return dict(zip([m for m, _ in parts], t.split([n for _, n in parts])))


def _record(qlinears: dict, prefix: str, cfg: ModelConfig, layer: DecoderLayer, fused: str, ql: QLinear) -> None:
    """Split a QLinear of a fused module into its checkpoint linears (columns of q/z/s)."""
    n0 = 0
    for m, n in _parts(layer, fused, cfg.checkpoint_linears()[fused]):
        qlinears[prefix + m] = QLinear(ql.q[:, n0:n0 + n].contiguous(), ql.z[:, n0:n0 + n].contiguous(),
                                            ql.s[:, n0:n0 + n].contiguous(), ql.g_idx.clone())
        n0 += n


class _Stop(Exception):
    """Ends a layer's forward once the part that is needed has run."""


class Calibration:
    """The calibration batch as the model's layers take it: B sequences of T tokens flattened to
    [B*T, hidden] rows with their positions, described by one `AttnMeta` (B fresh prompts) over a
    paged KV cache for one layer, which every layer reuses (a layer writes its K/V before it reads
    them). `embed` and `run` are the model's own pieces of its forward (`LlamaModel.embed_tokens`,
    `LlamaModel.run_layer`): no family's math is spelled here."""

    def __init__(self, model: LlamaModel, ids: torch.Tensor, block_size: int = 16):
        if model.attention_backend != "torch":
            raise QuantizeError("the quantizer runs the model on CPU (torch attention backend)")
        B, T = ids.shape
        nb = -(-T // block_size)
        self.model, self.ids = model, ids
        tables = 1 + torch.arange(B * nb).view(B, nb)  # block 0 is the null block
        self.positions, self.meta = describe_batch(tables, [T] * B, [T] * B, block_size)
        model.cover(T)  # run_layer's RoPE rows (forward covers its own)
        # the MLP on all rows at once: run_to's hooks take a module's whole input from its first call
        self.ops = replace(model.ops, mlp_rows=0)
        c = model.cfg
        shape = (1 + B * nb, block_size, c.num_kv_heads, c.head_dim)
        self.kv = (torch.zeros(shape), torch.zeros(shape))

    def embed(self) -> torch.Tensor:
        """The first layer's input (Gemma: scaled by sqrt(hidden), as the model's forward does)."""
        return self.model.embed_tokens(self.ids.reshape(-1))

    def run(self, layer: DecoderLayer, x: torch.Tensor, residual: torch.Tensor | None):
        """-> (x, residual) for the next layer, as LlamaModel.forward passes them on."""
        return self.model.run_layer(layer, x, residual, self.positions, self.meta, self.kv, self.ops)

    def run_to(self, layer: DecoderLayer, x: torch.Tensor, residual: torch.Tensor | None, module: nn.Module,
               output: bool = False) -> torch.Tensor:
        """The input of `module` (one of the layer's linears) when the layer runs on (x, residual),
        or with output=True its output; the forward stops there."""
        got = []

        def pre(_mod, args):
            got.append(args[0])
            raise _Stop

        def post(_mod, _args, out):
            got.append(out)
            raise _Stop

        hook = module.register_forward_hook(post) if output else module.register_forward_pre_hook(pre)
        try:
            self.run(layer, x, residual)
        except _Stop:
            pass
        finally:
            hook.remove()
        return got[0]


@contextmanager
def _weight(module: nn.Module, w: torch.Tensor):
    """Run `module` with weight `w` for a while (candidate weights of a search)."""
    old = module.weight.data
    module.weight.data = w
    try:
        yield module
    finally:
        module.weight.data = old


def _hessian(x: torch.Tensor) -> torch.Tensor:
    x = x.reshape(-1, x.shape[-1]).double()
    return 2.0 / x.shape[0] * (x.t() @ x)


# ---- AWQ --------------------------------------------------------------------------------------
def _awq_fake_quant(w: torch.Tensor, group: int) -> torch.Tensor:
    n, k = w.shape
    wg = w.reshape(-1, group)
    s, z = minmax_params(wg, sym=False, zero_in_range=False)
    return ((quantize_cols(wg, s, z) - z[:, None]) * s[:, None]).view(n, k)


def _awq_search(x: torch.Tensor, ws: list[torch.Tensor], group: int, block_out: Callable, n_grid: int = 20
                ) -> torch.Tensor:
    """Per-input-channel scales for the linears `ws` (all fed x) minimizing the error of
    block_out(list of weights) against the unquantized block output (AutoAWQ, duo scaling)."""
    x_mean = x.reshape(-1, x.shape[-1]).abs().mean(0)
    wcat = torch.cat(ws)
    wa = wcat.abs().view(-1, group)
    w_mean = (wa / (wa.amax(1, keepdim=True) + 1e-6)).view(wcat.shape).mean(0)
    ref = block_out(ws)
    best, best_s = math.inf, torch.ones_like(x_mean)
    for r in range(n_grid):
        a = r / n_grid
        s = (x_mean.pow(a) / (w_mean.pow(1 - a) + 1e-4)).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        out = block_out([_awq_fake_quant(w * s, group) / s for w in ws])
        loss = (ref - out).pow(2).mean().item()
        if loss < best:
            best, best_s = loss, s
    return best_s


def _awq_clip(w: torch.Tensor, x: torch.Tensor, group: int, n_grid: int = 20, max_shrink: float = 0.5,
              n_tokens: int = 512) -> torch.Tensor:
    """AutoAWQ's clipping search: per (output row, group) the max |w| that minimizes the group's
    output error; returns w clamped to it."""
    n, k = w.shape
    x = x.reshape(-1, k)
    x = x[:: max(1, x.shape[0] // n_tokens)].view(-1, k // group, group)  # [T, G, g]
    wg = w.view(n, k // group, group)
    out = torch.empty_like(wg)
    for b in range(0, n, 256):
        wb = wg[b:b + 256]
        org_max = wb.abs().amax(-1, keepdim=True)  # [c, G, 1]
        best_max, min_err = org_max.clone(), torch.full_like(org_max, math.inf)
        ref = torch.einsum("tgk,cgk->cgt", x, wb)
        for i in range(int(max_shrink * n_grid)):
            mx = org_max * (1 - i / n_grid)
            qw = _awq_fake_quant(torch.clamp(wb, -mx, mx).reshape(-1, k), group).view_as(wb)
            err = (torch.einsum("tgk,cgk->cgt", x, qw) - ref).pow(2).mean(-1, keepdim=True)
            better = err < min_err
            min_err[better], best_max[better] = err[better], mx[better]
        out[b:b + 256] = torch.clamp(wb, -best_max, best_max)
    return out.view(n, k)


def _awq_layer(calib: Calibration, layer: DecoderLayer, x: torch.Tensor, residual: torch.Tensor | None,
               group: int, clip: bool) -> None:
    """Scale search + folding + clipping for one layer, in place on its fp32 weights, judged on
    all calibration tokens (as AutoAWQ: on SmolLM2 the first 512 of 2816 tokens gave +12.9%
    perplexity, all +9.0%). Each block's input is what the layer computes with the weights as
    scaled so far; v is clipped last, so the MLP's searches see the attention before that clip."""
    c, ops = calib.model.cfg, calib.ops
    qkv, o, gate_up, down = layer.qkv, layer.o, layer.gate_up, layer.down
    # 1) input_layernorm -> q, k, v (one fused matrix: the search is per input channel, the
    # rounding per row); judged on the attention output
    h = calib.run_to(layer, x, residual, qkv)

    def attn_out(ws):
        with _weight(qkv, ws[0]):
            return calib.run_to(layer, x, residual, o, output=True)

    s = _awq_search(h, [qkv.weight], group, attn_out)
    layer.input_norm.weight.div_(s)
    qkv.weight.mul_(s)
    # 2) v -> o (only without GQA: v's outputs must be o's inputs one to one)
    a = calib.run_to(layer, x, residual, o)
    v_rows = slice(sum(layer.split[:2]), None)
    if c.num_kv_heads == c.num_heads and qkv.bias is None:
        def o_out(ws):
            with _weight(o, ws[0]):
                return o(a)

        s = _awq_search(a, [o.weight], group, o_out)
        qkv.weight[v_rows] /= s[:, None]
        o.weight.mul_(s)
        a = a / s
    if clip:
        o.weight.copy_(_awq_clip(o.weight, a, group))
    # 3) post_attention_layernorm -> gate, up; judged on the MLP block's output (the layer's own
    # `mlp`: Gemma's GeGLU, others' SiLU)
    h2 = calib.run_to(layer, x, residual, gate_up)

    def mlp_out(ws):
        with _weight(gate_up, ws[0]):
            return layer.mlp(h2, ops)

    s = _awq_search(h2, [gate_up.weight], group, mlp_out)
    layer.post_norm.weight.div_(s)
    gate_up.weight.mul_(s)
    h2 = calib.run_to(layer, x, residual, gate_up)
    # 4) up -> down
    act = calib.run_to(layer, x, residual, down)

    def down_out(ws):
        with _weight(down, ws[0]):
            return down(act)

    s = _awq_search(act, [down.weight], group, down_out)
    gate_up.weight[gate_up.out_features // 2:] /= s[:, None]
    down.weight.mul_(s)
    if clip:  # per (row, group): gate and up clip as one matrix. Not q/k: their errors only shift
        # attention scores (AutoAWQ skips them too)
        gate_up.weight.copy_(_awq_clip(gate_up.weight, h2, group))
        down.weight.copy_(_awq_clip(down.weight, calib.run_to(layer, x, residual, down), group))
        qkv.weight[v_rows] = _awq_clip(qkv.weight[v_rows], calib.run_to(layer, x, residual, qkv), group)


# ---- driver -----------------------------------------------------------------------------------
def calibration_ids(tokenizer, texts: list[str] | None, num_samples: int, seq_len: int) -> torch.Tensor:
    """Concatenated calibration text cut into [B, seq_len] blocks (AutoAWQ style)."""
    ids = tokenizer.encode("\n\n".join(texts or CALIBRATION))
    if len(ids) < 64:
        raise QuantizeError(f"calibration text is too short ({len(ids)} tokens; need at least 64)")
    seq_len = min(seq_len, len(ids))
    n = min(num_samples, len(ids) // seq_len)
    return torch.tensor(ids[: n * seq_len]).view(n, seq_len)


def default_group_size(k_dims: list[int]) -> int:
    """128 unless an input dim is not a multiple of it (SmolLM2: 576 = 9 * 64)."""
    return next((g for g in (128, 64, 32) if all(k % g == 0 for k in k_dims)), 0)


def quantize_model(src: str | Path, out: str | Path, method: str = "gptq", bits: int = 4,
                   group_size: int | None = None, calib_texts: list[str] | None = None,
                   num_samples: int = 128, seq_len: int = 256, act_order: bool | None = None,
                   sym: bool | None = None, awq_clip: bool = True, keep_dequantized: bool = False,
                   layers: int | None = None, progress: Callable[[str], None] | None = None,
                   mse: bool | None = None) -> QuantizeResult:
    """Quantize a dense checkpoint (HF directory or GGUF) into a standard AWQ/GPTQ directory.

    `rtn` writes a GPTQ-format checkpoint (no calibration); `sym` applies to gptq/rtn (AWQ is
    always asymmetric, as AutoAWQ's gemm). `layers` quantizes only the first N decoder layers and
    keeps the rest in float (listed as not converted: quick experiments and tests).

    None means the measured best for the method (BENCHMARKS.md, Quantization): asymmetric for
    gptq/rtn; for gptq act-order and the Hessian-weighted scale search (`mse`) too."""
    t0 = time.perf_counter()
    if method not in METHODS:
        raise QuantizeError(f"--method must be one of {', '.join(METHODS)}, got {method!r}")
    if bits != 4:
        raise QuantizeError(f"--bits {bits} is not supported (only 4)")
    weights = open_weights(src)
    if isinstance(weights, HFWeights) and weights.quant is not None:
        raise QuantizeError(f"{src} is already quantized ({weights.quant['quant_method']}); "
                            "quantize the original float checkpoint")
    cfg = weights.config
    if cfg.num_experts:
        raise QuantizeError(f"{src}: mixture-of-experts models ({cfg.architecture}) cannot be quantized yet; "
                            "run it with --quant int4 (quantized on load) instead")
    if cfg.sandwich_norms and not isinstance(weights, HFWeights):
        raise QuantizeError(f"{src}: a Gemma GGUF is not written back as a checkpoint; quantize its Hugging Face "
                            "checkpoint")
    k_dims = [cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.intermediate_size]
    if group_size is None:
        group_size = default_group_size(k_dims)
        if not group_size:
            raise QuantizeError(f"no group size in 128/64/32 divides the input dims {k_dims}")
    bad = [k for k in k_dims if k % group_size]
    if group_size not in (32, 64, 128) or bad:
        hint = default_group_size(k_dims)
        raise QuantizeError(f"--group-size {group_size} does not divide the input dim(s) {bad or k_dims} "
                            f"(supported: 32, 64, 128{'; use --group-size ' + str(hint) if hint else ''})")
    say = progress or (lambda _msg: None)
    if method != "gptq" and act_order:
        raise QuantizeError("--act-order applies to GPTQ only")
    if method != "gptq" and mse:
        raise QuantizeError("the scale search (mse) applies to GPTQ only")
    gptq_default = method == "gptq"
    act_order = gptq_default if act_order is None else act_order
    mse = gptq_default if mse is None else mse
    sym = False if sym is None else sym
    seq_len = min(seq_len, cfg.max_position_embeddings)
    # the real model in fp32 (DenseLinear layers); calibration rewrites its layers' weights
    model = load_model(src, "float32", max_model_len=seq_len).model
    tok = weights.tokenizer()
    qlinears: dict[str, QLinear] = {}
    n_tokens = 0
    todo = list(model.layers)[:layers] if layers is not None else list(model.layers)
    with torch.no_grad():
        if method == "rtn":
            for i, layer in enumerate(todo):
                for fused in FUSED:
                    for m, w in _split_rows(cfg, layer, fused, getattr(layer, fused).weight).items():
                        qlinears[f"model.layers.{i}.{m}"] = rtn(w, group_size, sym, zero_in_range=True,
                                                                      v1_zeros=not sym)
        else:
            ids = calibration_ids(tok, calib_texts, num_samples, seq_len)
            n_tokens = ids.numel()
            calib = Calibration(model, ids)
            x, residual = calib.embed(), None
            for i, layer in enumerate(todo):
                p = f"model.layers.{i}."
                if method == "gptq":
                    x, residual = _gptq_layer(calib, layer, x, residual, group_size, sym, act_order, mse,
                                              qlinears, p)
                else:
                    _awq_layer(calib, layer, x, residual, group_size, awq_clip)
                    # AutoAWQ feeds the next layer the unquantized (scaled, clipped) outputs
                    x, residual = calib.run(layer, x, residual)
                    for fused in FUSED:
                        for m, w in _split_rows(cfg, layer, fused, getattr(layer, fused).weight).items():
                            qlinears[p + m] = rtn(w, group_size, sym=False, zero_in_range=False)
                say(f"layer {i + 1}/{len(todo)} quantized")
    path = _write_checkpoint(weights, cfg, model, qlinears, Path(out), method, group_size, sym, act_order)
    deq = {k + ".weight": v.dequantize() for k, v in qlinears.items()} if keep_dequantized else {}
    return QuantizeResult(path, method, group_size, time.perf_counter() - t0, n_tokens, deq)


def _gptq_layer(calib: Calibration, layer: DecoderLayer, x: torch.Tensor, residual: torch.Tensor | None,
                group: int, sym: bool, act_order: bool, mse: bool, qlinears: dict, p: str):
    """True-sequential GPTQ of one layer in one forward: each linear is quantized when the forward
    reaches it (a pre-hook: H from its input, GPTQ, the dequantized weight written into the
    layer), so o sees the outputs of the quantized qkv, gate_up those of the quantized attention,
    down those of the quantized gate_up. -> the quantized layer's (x, residual) for the next one."""

    def quantize_on_call(fused: str):
        def hook(mod, args):
            # q/k/v (gate/up) share their input, hence H and the act-order permutation: GPTQ
            # treats rows independently, so the fused matrix goes through it at once (2-3x
            # faster than one by one, identical result)
            ql = gptq(mod.weight, _hessian(args[0]), group, sym, act_order, mse=mse)
            _record(qlinears, p, calib.model.cfg, layer, fused, ql)
            mod.weight.copy_(ql.dequantize())
        return hook

    hooks = [getattr(layer, f).register_forward_pre_hook(quantize_on_call(f)) for f in FUSED]
    try:
        return calib.run(layer, x, residual)
    finally:
        for h in hooks:
            h.remove()


# ---- writing ----------------------------------------------------------------------------------
def _to_int32(x: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(x.numpy().astype(np.int64).astype(np.uint32).view(np.int32).copy())


def pack_awq(q: torch.Tensor) -> torch.Tensor:
    """int [R, C] -> int32 [R, C/8], nibble i of word c = column 8c + AWQ_ORDER[i]."""
    r, c = q.shape
    q = q.long().view(r, c // 8, 8)[..., AWQ_ORDER]
    return _to_int32(sum(q[..., i] << (4 * i) for i in range(8)))


def pack_cols(q: torch.Tensor) -> torch.Tensor:
    """int [R, C] -> int32 [R, ceil(C/8)], sequential nibbles (GPTQ qzeros)."""
    r, c = q.shape
    q = F.pad(q.long(), (0, -c % 8)).view(r, -1, 8)
    return _to_int32(sum(q[..., i] << (4 * i) for i in range(8)))


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """int [R, C] -> int32 [R/8, C], nibble j of row r = row 8r + j (GPTQ qweight)."""
    r, c = q.shape
    q = q.long().view(r // 8, 8, c)
    return _to_int32(sum(q[:, j] << (4 * j) for j in range(8)))


def _write_checkpoint(weights, cfg, model: LlamaModel, qlinears: dict[str, QLinear], out: Path, method: str,
                      group: int, sym: bool, act_order: bool) -> Path:
    """The checkpoint: the model's own linears (separate q/k/v/gate/up sliced from our fused ones,
    or Phi-3's fused qkv_proj/gate_up_proj), norms as calibration left them (AWQ folds its
    scales into them)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": model.embed.dense().half()}
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        for attr, m in cfg.checkpoint_norms().items():  # Gemma's checkpoints store w for a scale of (1 + w)
            t[p + m + ".weight"] = (getattr(layer, attr).weight.float() - cfg.norm_weight_offset).half()
        if layer.qkv.bias is not None:
            for m, b in _split_rows(cfg, layer, "qkv", layer.qkv.bias).items():
                t[p + m + ".bias"] = b.half()
    t["model.norm.weight"] = weights.dense("model.norm.weight").half()
    if not cfg.tie_word_embeddings and weights.has("lm_head.weight"):
        t["lm_head.weight"] = weights.dense("lm_head.weight").half()
    skipped = [f"model.layers.{i}." for i in range(len(model.layers))
               if f"model.layers.{i}.mlp.down_proj" not in qlinears]
    for i, layer in enumerate(model.layers):
        if f"model.layers.{i}." in skipped:
            for fused in FUSED:
                for m, w in _split_rows(cfg, layer, fused, getattr(layer, fused).weight).items():
                    t[f"model.layers.{i}.{m}.weight"] = w.half()
    for name, ql in qlinears.items():
        if method == "awq":
            t[name + ".qweight"] = pack_awq(ql.q)
            t[name + ".qzeros"] = pack_awq(ql.z)
        else:
            t[name + ".qweight"] = pack_rows(ql.q)
            t[name + ".qzeros"] = pack_cols((ql.z - 1) & 15)  # checkpoint_format "gptq" (v1)
            t[name + ".g_idx"] = ql.g_idx.int()
        t[name + ".scales"] = ql.s.half()
    save_file({k: v.contiguous() for k, v in t.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})

    if method == "awq":
        qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
              "modules_to_not_convert": skipped or None}
    else:
        qc = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order, "sym": sym,
              "damp_percent": 0.01, "true_sequential": True, "static_groups": False, "checkpoint_format": "gptq",
              "lm_head": False, "pack_dtype": "int32", "meta": {"quantizer": [f"localllm:{method}"]}}
        if skipped:  # GPTQModel's syntax for modules left in float
            qc["dynamic"] = {"-:" + re.escape(p) + ".*": {} for p in skipped}
    tok = weights.tokenizer()
    if isinstance(weights, HFWeights):
        hf = dict(weights.raw_config)
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                  "generation_config.json"):
            if (weights.path / f).is_file() and (weights.path / f).resolve() != (out / f).resolve():
                shutil.copy(weights.path / f, out / f)
    else:
        hf = cfg.to_hf()
        hf["bos_token_id"], hf["eos_token_id"] = tok.bos_id, tok.eos_id
        (out / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": tok.bos_id, "eos_token_id": sorted(tok.eos_ids)}, indent=2))
        tok.save_hf(out)
    hf["torch_dtype"] = "float16"
    hf["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    if method != "awq":  # older GPTQ loaders read this file
        (out / "quantize_config.json").write_text(json.dumps(qc, indent=2))
    return out


# ---- evaluation -------------------------------------------------------------------------------
def perplexity(loaded, ids: list[int], window: int = 512) -> float:
    """exp(mean NLL) of `ids` under a LoadedModel, in non-overlapping windows, each scored by the
    engine (LLMEngine.score: the runner's forward over the paged cache, as a prompt would run)."""
    from ..config import EngineConfig
    from ..engine.engine import LLMEngine

    eng = LLMEngine(loaded, EngineConfig(num_kv_blocks=window // 16 + 4, max_model_len=window, compile=False))
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start:start + window]
        if len(chunk) < 2:
            break
        logits = eng.score(chunk)
        nll += F.cross_entropy(logits[:-1], torch.tensor(chunk[1:]), reduction="sum").item()
        count += len(chunk) - 1
    return math.exp(nll / count)
