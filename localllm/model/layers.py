"""Building blocks of the decoder: linear layers in each precision, RMSNorm, RoPE, LM head."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .int4 import Int4Weight, quantize_rtn


class DenseLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.out_features = weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


# From this many rows (prefill, big batches) an fp32 GEMM on the dequantized weight beats the
# int4 kernels, whose cost grows linearly with the rows. 2 cores, SmolLM2 layer shapes, per layer:
# torch's kernel 16 rows 0.92 ms vs fp32 0.98, 32 rows 1.7 vs 1.3, 512 rows 28.6 vs 12.6; our int4
# kernel 32 rows 1.0 vs 1.7, 128 rows 3.9 vs 4.0, 512 rows 16.4 vs 14.3.
DENSE_MIN_ROWS = 32
CPU_INT4_DENSE_MIN_ROWS = 160


def kernel_dequantize(w: Int4Weight) -> torch.Tensor:
    """fp32 [N, K] equal to what torch's CPU int4 kernel multiplies by: scales and zeros rounded
    to bf16 as it stores them, (q - 8) * scale exact in fp32, one rounding for + zero."""
    n, k = w.q.shape
    g = w.group_size
    s = w.scales.to(torch.bfloat16).float().t().unsqueeze(-1)
    z = w.zeros.to(torch.bfloat16).float().t().unsqueeze(-1)
    return ((w.q.view(n, k // g, g).float() - 8.0) * s + z).reshape(n, k)


def _cpu_int4_kernel(n: int, k: int, group_size: int) -> bool:
    from localllm_kernels import cpu_int4

    return cpu_int4.fits(n, k, group_size) and cpu_int4.load()


class Int4Linear(nn.Module):
    """Weight-only int4.

    On CPU, `kind` is "cpu_int4" where our kernel runs (localllm_kernels.cpu_int4, AVX-512 VNNI or AVX2: fp32
    in and out, activations rounded to 16 bits inside, scales exact), else "aten": torch's int4pack
    kernel, fed bf16 (with fp32 activations it takes a path 5-30x slower) with bf16 scales. With
    `dense`, calls of `dense_min_rows` rows or more run an fp32 GEMM on a dequantized copy instead:
    exact for "cpu_int4" (the kernel's 16-bit activations are the only difference), rounded as torch's
    kernel rounds for "aten" (the same numbers up to summation order). On CUDA: our Triton kernel."""

    act_parts = 2  # the activations' int8 parts on our CPU kernel: 2 (~16 bits) or 1 (8 bits, opt-in)

    def __init__(self, w: Int4Weight, act_dtype: torch.dtype, bias: torch.Tensor | None = None,
                 device: str = "cpu", dense: bool = False, triton: bool | None = None, cpu_kernel: bool = True):
        """triton: use our Triton kernel (default: on CUDA; tests run it on CPU, interpreted).
        cpu_kernel: on CPU, our kernel where this machine has it (False: torch's)."""
        super().__init__()
        self.cuda_path = device.startswith("cuda") if triton is None else triton
        n, k = w.shape
        self.out_features, self.group_size = n, w.group_size
        self.kind = ("triton" if self.cuda_path else "cpu_int4" if cpu_kernel and _cpu_int4_kernel(n, k, w.group_size)
                     else "aten")
        self.dense_min_rows = CPU_INT4_DENSE_MIN_ROWS if self.kind == "cpu_int4" else DENSE_MIN_ROWS
        copy = dense and not self.cuda_path and w.in_perm is None
        self.register_buffer("dense", None if not copy else w.dequantize() if self.kind == "cpu_int4"
                             else kernel_dequantize(w))
        self.dense_mapped = False
        self.bias = None if bias is None else nn.Parameter(bias.to(act_dtype), requires_grad=False)
        # GPTQ act-order: the weight's K was permuted at load, so the input is gathered the same way
        self.register_buffer("in_perm", None if w.in_perm is None else w.in_perm.to(device, torch.long))
        if self.kind == "triton":
            self.register_buffer("qweight", w.packed().to(device))
            self.register_buffer("scales", w.scales.to(device, act_dtype))
            self.register_buffer("zeros", w.zeros.to(device, act_dtype))
        elif self.kind == "cpu_int4":
            from localllm_kernels import cpu_int4

            qw, qsc = cpu_int4.pack(w.q, w.scales, w.zeros)
            self.register_buffer("qw", qw)
            self.register_buffer("qsc", qsc)
        else:
            # torch's kernel always runs in bf16: fp32 would hit a slow path, fp16 risks overflow
            self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(w.q.to(torch.int32), 2))
            sz = torch.stack([w.scales, w.zeros], dim=-1).to(torch.bfloat16).contiguous()
            self.register_buffer("scales_zeros", sz)

    def kernel_tensors(self) -> dict[str, torch.Tensor]:
        """The converted CPU buffers, by name: what the loader's conversion cache stores."""
        names = ("qw", "qsc") if self.kind == "cpu_int4" else ("packed", "scales_zeros")
        return {n: getattr(self, n) for n in names}

    @classmethod
    def from_kernel_tensors(cls, tensors: dict[str, torch.Tensor], out_features: int, group_size: int,
                            bias: torch.Tensor | None = None, dense: torch.Tensor | None = None) -> Int4Linear:
        """A CPU layer from already converted buffers (the loader's conversion cache)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.kind = "cpu_int4" if "qw" in tensors else "aten"
        if self.kind == "cpu_int4":
            from localllm_kernels import cpu_int4

            cpu_int4.load()  # registers the op (the cache holds its buffers only where it loads)
        self.dense_min_rows = CPU_INT4_DENSE_MIN_ROWS if self.kind == "cpu_int4" else DENSE_MIN_ROWS
        self.register_buffer("dense", dense)
        # the cache's dense copy is a file-backed mmap: copied into anonymous memory on first use
        # (GEMMs on it ran 25% slower; copying at load would cost every cold start 0.1-0.4 s)
        self.dense_mapped = dense is not None
        self.out_features, self.group_size = out_features, group_size
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.cuda_path = False
        self.register_buffer("in_perm", None)
        for name, t in tensors.items():
            self.register_buffer(name, t)
        return self

    def _apply(self, fn, recurse=True):  # .to() and the like replace the buffers: forget them
        self.__dict__.pop("_decode", None)
        return super()._apply(fn, recurse)

    def kernel_rows(self) -> int | None:
        """The input rows below which our CPU kernel runs this layer (above: its dense copy), or
        None where the layer is not on our kernel as it is (another kind, an input permutation)."""
        if self.kind != "cpu_int4" or self.in_perm is not None:
            return None
        return self.dense_min_rows if self.dense is not None else 1 << 62

    def _decode_args(self) -> tuple | None:
        """(qw, qsc, group size, out features, rows below which our kernel runs) as one plain
        attribute when this layer takes the one-call decode case (no bias): nn.Module's
        __getattr__ costs ~1 us per buffer name, ~10 of them a call, 4 calls a layer."""
        rows = self.kernel_rows()
        if rows is None or self.bias is not None:
            return None
        return self.qw, self.qsc, self.group_size, self.out_features, rows

    def decode_args(self) -> tuple | None:
        """_decode_args(), computed once (the fused CPU ops' decode step reads it too)."""
        fast = self.__dict__.get("_decode", False)
        if fast is False:
            fast = self.__dict__["_decode"] = self._decode_args()
        return fast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():  # a traced step must see the buffers themselves
            fast = self.decode_args()
            if fast is not None and x.dtype == torch.float32 and x.dim() == 2 and x.shape[0] < fast[4]:
                # the decode step's case, in one call (the general path below costs ~6 more per layer)
                y = torch.ops.localllm.int4_gemm(x, fast[0], fast[1], fast[2], self.act_parts)
                return y if y.shape[1] == fast[3] else y[:, :fast[3]]
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.in_perm is not None:
            x2 = x2.index_select(-1, self.in_perm)
        if self.cuda_path:
            from localllm_kernels import int4_matmul

            y = int4_matmul(x2, self.qweight, self.scales, self.zeros, self.group_size)
        elif self.dense is not None and x2.shape[0] >= self.dense_min_rows:
            if self.dense_mapped and not torch.compiler.is_compiling():
                self.dense, self.dense_mapped = self.dense.clone(), False
            if self.kind == "cpu_int4":
                y = F.linear(x2.float(), self.dense).to(x.dtype)
            else:
                y = F.linear(x2.to(torch.bfloat16).float(), self.dense).to(torch.bfloat16).to(x.dtype)
        elif self.kind == "cpu_int4":
            y = torch.ops.localllm.int4_gemm(x2.float(), self.qw, self.qsc, self.group_size, self.act_parts)
            y = (y if y.shape[1] == self.out_features else y[:, :self.out_features]).to(x.dtype)
        else:
            y = torch._weight_int4pack_mm_for_cpu(x2.to(torch.bfloat16), self.packed, self.group_size,
                                                  self.scales_zeros).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


class Int8wLinear(nn.Module):
    """Weights of up to 8 bits per value in int8 lanes, on our CPU kernel (localllm_kernels.cpu_int8):
    GGUF's Q8_0, Q6_K, Q5_K, Q5_0, Q5_1, IQ4_NL, IQ4_XS, Q3_K and Q2_K repacked exactly (values
    d * q + m per group of 16 or 32, or d * (q - zero)). fp32 in and out, activations rounded to
    16 bits inside (as Int4Linear's kernel); on AVX2 CPUs without VNNI, prefill-sized calls (96 rows
    or more on 8-bit weights: Q8_0, IQ4; 192 on the others) multiply in fp32 on exactly dequantized
    tiles instead (faster there)."""

    kind = "int8w"
    act_parts = 2  # the activations' int8 parts in the kernel: 2 (~16 bits) or 1 (8 bits, opt-in)

    def __init__(self, qw: torch.Tensor, qsc: torch.Tensor, out_features: int, group_size: int, zero: int,
                 bias: torch.Tensor | None = None):
        from localllm_kernels import cpu_int8

        super().__init__()
        cpu_int8.load()  # registers the op (buffers from the conversion cache come without a pack)
        self.register_buffer("qw", qw)
        self.register_buffer("qsc", qsc)
        self.out_features, self.group_size, self.zero = out_features, group_size, zero
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)

    def kernel_tensors(self) -> dict[str, torch.Tensor]:
        return {"qw8": self.qw, "qsc8": self.qsc}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.localllm.int8w_gemm(x.reshape(-1, shape[-1]).float(), self.qw, self.qsc, self.group_size,
                                          self.zero, self.act_parts)
        y = (y if y.shape[1] == self.out_features else y[:, :self.out_features]).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


class W16Linear(nn.Module):
    """16-bit weights as the checkpoint stores them (bf16 or fp16: GGUF F16/BF16, HF safetensors), on
    our CPU kernel (localllm_kernels.cpu_bf16): each weight converted exactly to fp32 in registers,
    fp32 activations and accumulation, so the outputs are an fp32 linear's on the upcast weights
    up to summation order, from half its bytes (decode reads every weight once a step)."""

    kind = "w16"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        from localllm_kernels import cpu_bf16

        super().__init__()
        cpu_bf16.load()  # registers the op
        self.out_features = weight.shape[0]
        self.register_buffer("w", cpu_bf16.pack(weight))
        self.register_buffer("b", cpu_bf16.pad_bias(bias, self.w.shape[0]))

    def weight16(self) -> torch.Tensor:
        """The weights [N, K] as stored."""
        from localllm_kernels import cpu_bf16

        return cpu_bf16.unpack(self.w, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.localllm.w16_gemm(x.reshape(-1, shape[-1]).float(), self.w, self.b)
        y = (y if y.shape[1] == self.out_features else y[:, :self.out_features]).to(x.dtype)
        return y.reshape(*shape[:-1], self.out_features)


class ConcatLinear(nn.Module):
    """Several linears on the same input, outputs concatenated: a fused qkv / gate_up whose parts
    cannot share one int4 matrix (act-order checkpoints with different input permutations, GGUF
    parts of types that run on different kernels)."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


class Int8Linear(nn.Module):
    """Weight-only int8, per output channel, symmetric."""

    def __init__(self, weight: torch.Tensor, act_dtype: torch.dtype, bias: torch.Tensor | None = None):
        super().__init__()
        w = weight.float()
        scale = (w.abs().amax(1) / 127).clamp_min(1e-10)
        self.register_buffer("qweight", torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8))
        self.kernel_dtype = torch.bfloat16 if act_dtype == torch.float32 else act_dtype
        self.register_buffer("scales", scale.to(self.kernel_dtype))
        self.bias = None if bias is None else nn.Parameter(bias.to(act_dtype), requires_grad=False)
        self.out_features = weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch._weight_int8pack_mm(x.reshape(-1, shape[-1]).to(self.kernel_dtype), self.qweight, self.scales)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


def rope_inv_freq(rotary_dim: int, theta: float, scaling: dict | None,
                  max_positions: int) -> tuple[torch.Tensor, float]:
    """-> (inverse frequencies [rotary_dim / 2], factor on cos/sin). max_positions is the context
    the table serves: LongRoPE picks its factor set by it (see RotaryEmbedding)."""
    # fp32 exactly as transformers computes it, so long positions give the same angles
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv = 1.0 / (theta ** exponent)
    if not scaling:
        return inv.float(), 1.0
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
        factor = scaling["factor"]
        lo, hi = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling["original_max_position_embeddings"]
        lo_wl, hi_wl = old_ctx / lo, old_ctx / hi
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > lo_wl, inv / factor, inv)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= hi_wl) & (wavelen <= lo_wl)
        return torch.where(is_mid, mid, scaled).float(), 1.0
    if kind == "linear":
        return (inv / scaling["factor"]).float(), 1.0
    if kind == "freq_factors":  # a GGUF's rope_freqs (Llama 3.1+): each frequency over its factor, as llama.cpp
        factors = torch.tensor(scaling["freq_factors"], dtype=torch.float32)
        if factors.numel() != rotary_dim // 2:
            raise ValueError(f"rope_freqs has {factors.numel()} factors, expected rotary_dim / 2 = {rotary_dim // 2}")
        return (inv / factors).float(), 1.0
    if kind == "longrope":
        # transformers' _compute_longrope_parameters: 1 / (ext_factor * theta^(2i/d))
        long = max_positions > scaling["original_max_position_embeddings"]
        ext = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        if ext.numel() != rotary_dim // 2:
            raise ValueError(f"longrope factors have {ext.numel()} entries, expected rotary_dim / 2 = {rotary_dim // 2}")
        return 1.0 / (ext * theta ** exponent), float(scaling.get("attention_factor", 1.0))
    if kind == "yarn":
        return _yarn(theta ** exponent, rotary_dim, theta, scaling)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3, longrope, yarn, "
                     "freq_factors)")


def _yarn(pos_freqs: torch.Tensor, dim: int, theta: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN as transformers computes it (_compute_yarn_parameters): the frequencies blend from
    extrapolated (kept) to interpolated (/ factor) over a linear ramp between the dims where
    beta_fast and beta_slow rotations fit the original context; cos/sin scaled by 0.1 ln(factor) + 1
    (unless the config gives attention_factor)."""
    factor, orig = float(scaling["factor"]), scaling["original_max_position_embeddings"]
    attn = scaling.get("attention_factor")
    if attn is None:
        attn = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0

    def corr_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = corr_dim(scaling.get("beta_fast") or 32), corr_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (transformers' guard against a zero-width ramp)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv.float(), float(attn)


ROPE_CHUNK = 8192  # positions a table fills at a time


def rope_rows(fn, inv: torch.Tensor, out: torch.Tensor, start: int, stop: int, factor: float,
              chunk: int = ROPE_CHUNK) -> None:
    """Rows [start, stop) of `out` [n, 2 * len(inv)]: transformers' table, fn(cat([t * inv, t * inv]))
    * factor in fp32 cast to out's dtype for positions t, built `chunk` positions at a time with
    each value computed once for both halves (whole-table temporaries peaked ~80 MB above the
    table's own 64 MB at 131,072 positions). Each row's value depends on t alone."""
    half = inv.numel()
    for p in range(start, stop, chunk):
        t = torch.arange(p, min(p + chunk, stop), dtype=torch.float32)
        v = (fn(torch.outer(t, inv)) * factor).to(out.dtype)
        out[p:p + len(t), :half] = v
        out[p:p + len(t), half:] = v


class RotaryEmbedding(nn.Module):
    """HF rotate_half RoPE with a precomputed cos/sin table [max_positions, rotary_dim] indexed by
    position; with rotary_dim < head_dim (partial rotary) the rest of each head passes through.

    LongRoPE: transformers switches between the short and the long factors per forward by the
    sequence's length (long once it exceeds original_max_position_embeddings, re-rotating nothing
    already cached). Positions here live in a paged cache shared across steps and requests, so the
    set is picked once by the context this table serves, as llama.cpp does by its n_ctx: short
    factors when max_positions <= original (then identical to transformers), long ones otherwise
    (then sequences shorter than the original length differ from transformers, which would use the
    short factors for them).

    lazy: the rows are filled as positions come into use (`cover`), ROPE_CHUNK at a time, into
    memory allocated for all of them: on CPU, pages never written are never resident. A
    131,072-position table of 64 columns is 64 MB of cos and sin, Gemma 3's two tables of 256
    columns 512 MB, for a context most runs never reach."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 dtype: torch.dtype, rotary_dim: int | None = None, mrope_section: tuple[int, ...] | None = None,
                 mrope_interleaved: bool = False, lazy: bool = False):
        """mrope_section (Qwen2-VL / 2.5-VL's M-RoPE): the rotary frequencies split in sections, section i
        rotated by row i % 3 (temporal, height, width) of [3, T] positions (see `at`). Interleaved
        (Qwen3-VL): frequency j by height where j % 3 == 1 and j < 3 * sections[1], by width where
        j % 3 == 2 and j < 3 * sections[2], else by time."""
        super().__init__()
        self.rotary_dim = rotary_dim or head_dim
        self.inv, self.attn_factor = rope_inv_freq(self.rotary_dim, theta, scaling, max_positions)
        self.register_buffer("cos", torch.empty(max_positions, self.rotary_dim, dtype=dtype), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, self.rotary_dim, dtype=dtype), persistent=False)
        self._filled = 0  # rows [0, filled) hold their values (private: no part of a package's key)
        self.lazy = lazy
        if not lazy:
            self.cover(max_positions)
        self.half = self.rotary_dim // 2
        self.partial = self.rotary_dim < head_dim
        self.register_buffer("mrope_rows", None, persistent=False)
        if mrope_section:
            if sum(mrope_section) != self.half:
                raise ValueError(f"mrope_section {list(mrope_section)} sums to {sum(mrope_section)}, "
                                 f"expected rotary_dim / 2 = {self.half}")
            if mrope_interleaved:
                j = torch.arange(self.half)
                rows = torch.zeros(self.half, dtype=torch.long)
                for r in (1, 2):
                    rows[(j % 3 == r) & (j < 3 * mrope_section[r])] = r
            else:
                rows = torch.cat([torch.full((n,), i % 3) for i, n in enumerate(mrope_section)])
            self.register_buffer("mrope_rows", torch.cat([rows, rows]), persistent=False)

    def cover(self, n: int) -> None:
        """Fill the rows of positions < n (whole chunks: the values are those of a table filled at
        once)."""
        n = min(n, self.cos.shape[0])
        if n <= self._filled:
            return
        stop = min(-(-n // ROPE_CHUNK) * ROPE_CHUNK, self.cos.shape[0])
        for table, fn in ((self.cos, torch.cos), (self.sin, torch.sin)):
            rope_rows(fn, self.inv, table, self._filled, stop, self.attn_factor)  # (computed on CPU)
        self._filled = stop

    @property
    def filled(self) -> int:
        """Rows [0, filled) hold their values."""
        return self._filled

    def at(self, positions: torch.Tensor) -> tuple[RotaryEmbedding | RopeRows, torch.Tensor]:
        """(the table, the positions into it) a step rotates with. Positions [T]: this table. M-RoPE
        positions [3, T] (a step with image tokens): a table of the step's T rows, each column's
        angle from its section's row (transformers' mrope recomposition), indexed by 0..T-1, so
        every RoPE op (torch, Triton, the fused CPU one) runs unchanged. Text-only and decode steps
        pass [T] positions: with all three rows equal M-RoPE is this plain RoPE."""
        if positions.dim() == 1:
            return self, positions
        if self.mrope_rows is None:
            raise ValueError("[3, T] positions given to a model without M-RoPE")
        sel = self.mrope_rows.view(1, 1, -1).expand(1, positions.shape[1], -1)
        cos = self.cos[positions].gather(0, sel)[0]  # [3, T, rotary_dim] -> [T, rotary_dim]
        sin = self.sin[positions].gather(0, sel)[0]
        return RopeRows(cos, sin, self), torch.arange(positions.shape[1], device=positions.device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, rotary_dim]
        sin = self.sin[positions].unsqueeze(1)
        if self.partial:
            r = self.rotary_dim
            return (torch.cat([_rotate(q[..., :r], cos, sin, self.half), q[..., r:]], dim=-1),
                    torch.cat([_rotate(k[..., :r], cos, sin, self.half), k[..., r:]], dim=-1))
        return _rotate(q, cos, sin, self.half), _rotate(k, cos, sin, self.half)


class RopeRows:
    """One step's cos/sin rows in a RotaryEmbedding's place (RotaryEmbedding.at)."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, table: RotaryEmbedding):
        self.cos, self.sin = cos, sin
        self.rotary_dim, self.half, self.partial = table.rotary_dim, table.half, table.partial

    forward = __call__ = RotaryEmbedding.forward


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, half: int) -> torch.Tensor:
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class RMSNorm(nn.Module):
    """scale_in_fp32 (Gemma): the weight (1 + w) stays fp32 and scales before the cast to a 16-bit
    activation dtype, as transformers' Gemma norms do (Llama's: cast, then scale in that dtype;
    1 + w rounded to bf16 would be off by up to 0.4%)."""

    def __init__(self, weight: torch.Tensor, eps: float, scale_in_fp32: bool = False):
        super().__init__()
        self.weight = nn.Parameter(weight.float() if scale_in_fp32 else weight, requires_grad=False)
        self.eps = eps
        self.scale_in_fp32 = scale_in_fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # as transformers: normalize in fp32, then cast and scale (Llama) or scale and cast (Gemma)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.scale_in_fp32:
            return (xf * self.weight).to(x.dtype)
        return self.weight * xf.to(x.dtype)


class DenseMatrix(nn.Module):
    """A [V, H] matrix read by rows (the embedding) and by products (the head): a plain tensor."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.shape = tuple(weight.shape)

    def rows(self, idx: torch.Tensor) -> torch.Tensor:
        return self.weight[idx]

    def matmul(self, h: torch.Tensor) -> torch.Tensor:
        """h [M, H] @ W^T -> fp32 [M, V]."""
        return F.linear(h.to(self.weight.dtype), self.weight).float()

    def dense(self) -> torch.Tensor:
        return self.weight


class Q8Matrix(nn.Module):
    """A [V, H] matrix kept as GGUF Q8_0 blocks (uint8 [V, H/32, 34], usually a view of the
    memory-mapped file) and read in place by our C++ ops: the values d * q are exact in fp32, so
    rows and products equal those of the fp32 matrix (up to summation order) at a quarter of the
    memory and of the bytes a sampled token's head reads (localllm_kernels.cpu_q8)."""

    def __init__(self, blocks: torch.Tensor):
        super().__init__()
        self.register_buffer("blocks", blocks)
        self.shape = (blocks.shape[0], blocks.shape[1] * 32)

    def rows(self, idx: torch.Tensor) -> torch.Tensor:
        return torch.ops.localllm.q8_0_rows(self.blocks, idx.reshape(-1)).view(*idx.shape, self.shape[1])

    def matmul(self, h: torch.Tensor) -> torch.Tensor:
        return torch.ops.localllm.q8_0_gemm(h.float(), self.blocks)

    def dense(self) -> torch.Tensor:
        from localllm_kernels import cpu_q8

        return cpu_q8.dequantize(self.blocks)


class BlockMatrix(nn.Module):
    """A [V, H] matrix kept as the GGUF blocks of another type (Q4_K, Q5_K, Q6_K, Q5_0, IQ4_XS, ...:
    what llama.cpp writes for token_embd / output in the K-quant mixes; uint8 [V, H / block
    values, block bytes], usually a view of the memory-mapped file) and read in place by our C++
    ops (localllm_kernels.cpu_table): rows are gguf-py's dequantized values bit for bit, products
    those of the fp32 matrix up to summation order (fp32 activations and accumulation), from the
    file's bytes (an fp32 copy took 4 bytes a weight: 1.07 GB for a 128k x 2048 Q6_K table)."""

    def __init__(self, blocks: torch.Tensor, kind: str):
        from localllm_kernels import cpu_table

        super().__init__()
        self.register_buffer("blocks", blocks)
        self.kind = kind
        self.shape = (blocks.shape[0], blocks.shape[1] * cpu_table.VALUES[kind])

    def rows(self, idx: torch.Tensor) -> torch.Tensor:
        return torch.ops.localllm.gguf_table_rows(self.blocks, self.kind, idx.reshape(-1)).view(*idx.shape,
                                                                                                self.shape[1])

    def matmul(self, h: torch.Tensor) -> torch.Tensor:
        return torch.ops.localllm.gguf_table_gemm(h.float(), self.blocks, self.kind)

    def dense(self) -> torch.Tensor:
        return self.rows(torch.arange(self.shape[0]))


class W16Matrix(nn.Module):
    """A [V, H] matrix kept in the 16 bits it is stored in (GGUF F16/BF16, HF bf16/fp16) as our
    16-bit kernel's panels (localllm_kernels.cpu_bf16): rows are the exact fp32 upcast and products
    those of the fp32 matrix up to summation order (fp32 activations and accumulation), from half
    its bytes (an fp32 copy took 113 MB on the 135M model's 49k x 576 table)."""

    def __init__(self, weight16: torch.Tensor):
        super().__init__()
        self.lin = W16Linear(weight16)
        self.shape = tuple(weight16.shape)

    def rows(self, idx: torch.Tensor) -> torch.Tensor:
        from localllm_kernels import cpu_bf16

        flat = idx.reshape(-1)  # row n is column n % 32 of panel n // 32
        r = self.lin.w[flat // cpu_bf16.ROWS, :, flat % cpu_bf16.ROWS].float()
        return r.view(*idx.shape, self.shape[1])

    def matmul(self, h: torch.Tensor) -> torch.Tensor:
        return self.lin(h.float())

    def dense(self) -> torch.Tensor:
        return self.lin.weight16().float()


class LMHead(nn.Module):
    """Logits over the vocabulary.

    `exact` holds the exact head (a DenseMatrix, the GGUF's Q8_0 embedding as a Q8Matrix, one of
    another block type as a BlockMatrix, or a 16-bit checkpoint's as a W16Matrix).
    With `fast_greedy`, greedy rows are scored by an int4 copy and the top candidates are
    re-scored exactly: the argmax equals the exact head's unless the true winner falls outside
    the int4 top-k, at a fraction of the bandwidth."""

    def __init__(self, exact: DenseMatrix | Q8Matrix | BlockMatrix | W16Matrix, fast_greedy: bool = False, rescore_k: int = 32,
                 device: str = "cpu", fast: Int4Linear | None = None, cpu_kernel: bool = True,
                 softcap: float | None = None, read_rows=None):
        """softcap: logits become softcap * tanh(logits / softcap) (Gemma 2); monotonic, so the
        greedy path skips it. read_rows(r0, r1): told of each range of exact rows the ranking
        copy's build has read (the loader drops a mapped file's pages behind it)."""
        super().__init__()
        self.exact = exact
        self.softcap = softcap
        self.rescore_k = rescore_k
        self.fast = fast  # prebuilt int4 copy (conversion cache)
        if fast_greedy and fast is None:
            v, h = exact.shape
            if h % 32 == 0:
                self.fast = ranking_head(exact, device, cpu_kernel, read_rows)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.exact.matmul(h)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def greedy(self, h: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
        """Argmax token per row, equal to forward(h).argmax(-1); with `allowed` (bool [B, V]: a
        constraint's mask) the argmax among the allowed tokens."""
        if self.fast is None:
            logits = self.forward(h)
            return (logits if allowed is None else logits.masked_fill(~allowed, float("-inf"))).argmax(-1)
        approx = self.fast(h)
        if allowed is not None:
            approx = approx[:, :allowed.shape[1]].masked_fill(~allowed, float("-inf"))
        cand = top_indices(approx, self.rescore_k)  # [B, k]
        rows = self.exact.rows(cand)  # [B, k, H]
        exact = torch.bmm(rows, h.to(rows.dtype).unsqueeze(-1)).squeeze(-1)  # (einsum: ~70 us more a head call, 2 threads)
        if allowed is not None:  # fewer allowed tokens than k: the rest stay out
            exact = exact.masked_fill(~allowed.gather(1, cand), float("-inf"))
        return cand.gather(1, exact.argmax(-1, keepdim=True)).squeeze(1)


def _ranking_rows(exact: DenseMatrix | Q8Matrix | BlockMatrix | W16Matrix, r0: int, r1: int) -> Int4Weight:
    """Rows [r0, r1) of the int4 ranking copy: RTN groups of 32 of the exact rows, scales and
    offsets rounded to fp16 (fewer bytes for our int4 kernel; this copy only ranks)."""
    w = quantize_rtn(exact.rows(torch.arange(r0, r1)).float(), 32)
    d, m = w.scales.half().float(), (w.zeros - 8 * w.scales).half().float()
    return Int4Weight(w.q, d, m + 8 * d, 32)


def ranking_head(exact: DenseMatrix | Q8Matrix | BlockMatrix | W16Matrix, device: str = "cpu", cpu_kernel: bool = True,
                 read_rows=None) -> Int4Linear:
    """The int4 copy of the head that ranks greedy rows (LMHead.fast). On our CPU kernel it is
    packed 1024 rows at a time into buffers allocated once: the whole matrix's fp32 rows, its
    RTN temporaries and the unpacked q took ~110 MB of transient peak on the 135M model's first
    load (2.7 GB on a 1B shape with a 49k vocabulary when done in one piece)."""
    v, h = exact.shape
    if device != "cpu" or not (cpu_kernel and _cpu_int4_kernel(v, h, 32)):
        w = Int4Weight.cat([_ranking_rows(exact, r, min(r + 4096, v)) for r in range(0, v, 4096)])
        return Int4Linear(w, torch.bfloat16, device=device, cpu_kernel=cpu_kernel)
    from localllm_kernels import cpu_int4

    step = 1024  # a multiple of the kernel's 16-row blocks: packed chunks are slices of the whole
    nb = -(-v // cpu_int4.ROWS)
    qw = torch.empty(nb, h // 8, 64, dtype=torch.uint8)
    qsc = torch.empty(nb, h // 32, 2, cpu_int4.ROWS)
    for r in range(0, v, step):
        # _ranking_rows' numbers, packed in C++ (the torch route took ~1 s of a 49k x 2048 head)
        cq, cs = cpu_int4.rtn_pack(exact.rows(torch.arange(r, min(r + step, v))))
        if read_rows is not None:
            read_rows(r, min(r + step, v))
        b = r // cpu_int4.ROWS
        qw[b:b + cq.shape[0]], qsc[b:b + cs.shape[0]] = cq, cs
    half = qsc.half()
    exact16 = torch.isfinite(half).all() and torch.equal(half.float(), qsc)
    return Int4Linear.from_kernel_tensors({"qw": qw, "qsc": half if exact16 else qsc}, v, 32)


def top_indices(x: torch.Tensor, k: int, chunk: int = 32) -> torch.Tensor:
    """x.topk(k).indices (in no particular order) for a wide x [B, V]: the k largest values lie
    in the k chunks with the largest maxima (a chunk holding one of them has a max above all
    but at most k-1 other chunks' maxima), so only k * chunk values are ranked. 3x faster than
    torch's CPU topk over a 49k vocabulary."""
    B, V = x.shape
    if V % chunk or V // chunk < 4 * k:
        return x.topk(k, dim=-1).indices
    best = x.view(B, V // chunk, chunk).amax(-1).topk(k, dim=-1).indices  # [B, k]
    idx = (best.unsqueeze(-1) * chunk + torch.arange(chunk, device=x.device)).view(B, k * chunk)
    return idx.gather(1, x.gather(1, idx).topk(k, dim=-1).indices)
