// Fused elementwise ops of the decoder layer on CPU, fp32 activations: what the eager decode step
// spent most of its time on besides the GEMMs (BENCHMARKS.md, issue 31: ~20 small aten calls per
// layer for the norms, RoPE, the qkv split and the cache writes, each paying the dispatcher).
//
//   rms_norm(x, w, eps) -> x * rsqrt(mean(x^2) + eps) * w, per row of x [T, n]
//   add_rms_norm(x, residual, w, eps) -> (rms_norm(residual + x, w, eps), residual + x)
//   rope_store(qkv, positions, cos, sin, k_cache, v_cache, slots, H, KVH, D, rotary_dim, q_w?, k_w?, eps)
//       -> q [T, H, D]: splits each row of qkv [T, (H + 2 KVH) D] into q, k, v; per-head RMSNorm of q
//       and k when q_w/k_w are given (Qwen3, Gemma 3); HF rotate_half RoPE of the first rotary_dim
//       columns of each head by cos/sin [P, rotary_dim] at positions [T]; k and v written into the
//       paged caches [blocks, block_size, KVH, D] (fp32/fp16/bf16; or uint8 [.., KVH, D / 32 * 34]: q8_0
//       blocks, quantized as localllm_kernels/kv_quant.py does, bit for bit) at slots [T]; q returned.
//   silu_mul(gate_up [T, 2I]) -> silu(gate) * up;  gelu_tanh_mul(gate_up) -> gelu_tanh(gate) * up
//
// RoPE, the residual add and the cache writes do what the torch ops they replace do, one rounding
// per torch op (this file is built with -ffp-contract=off so no multiply-add is fused behind our
// back): bit-exact. The norms' sums run in 16 fp32 lanes and the activations' exp is a polynomial:
// within a few ulp of torch's. Each op has an AVX-512 path, an AVX2+FMA path and a generic one,
// chosen at run time (fused_isa(force) pins one, for tests); the three give the same results but
// for the activations' tails (AVX2 flushes e^x below 2^-126 to 0).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/add.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace {

enum class Isa : int { kGeneric = 0, kAvx2 = 1, kAvx512 = 2 };

bool cpu_has(Isa isa) {
#if defined(__x86_64__)
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  static const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
  return isa == Isa::kGeneric || (isa == Isa::kAvx2 ? avx2 : avx512);
#else
  return isa == Isa::kGeneric;
#endif
}

std::atomic<int> g_force{-1};  // tests: a pinned path

Isa isa_now() {
  const int f = g_force.load(std::memory_order_relaxed);
  if (f >= 0) return static_cast<Isa>(f);
  return cpu_has(Isa::kAvx512) ? Isa::kAvx512 : cpu_has(Isa::kAvx2) ? Isa::kAvx2 : Isa::kGeneric;
}

const char* isa_str(Isa i) { return i == Isa::kAvx512 ? "avx512" : i == Isa::kAvx2 ? "avx2" : "generic"; }

// -> the path the ops take ("avx512", "avx2" or "generic"); force pins one ("auto" restores the choice)
std::string fused_isa(std::optional<std::string> force) {
  if (force) {
    if (*force == "auto") {
      g_force.store(-1);
    } else {
      const Isa want = *force == "avx512" ? Isa::kAvx512 : *force == "avx2" ? Isa::kAvx2 : Isa::kGeneric;
      TORCH_CHECK(*force == "avx512" || *force == "avx2" || *force == "generic",
                  "fused_isa: force must be auto, avx512, avx2 or generic, got ", *force);
      TORCH_CHECK(cpu_has(want), "fused_isa: this CPU cannot run the ", *force, " path");
      g_force.store(static_cast<int>(want));
    }
  }
  return isa_str(isa_now());
}

// ---- sum of squares in 16 lanes, the same order on every path ------------------------------------

float sumsq_generic(const float* x, int64_t n) {
  float acc[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) acc[l] = std::fma(x[i + l], x[i + l], acc[l]);
  float s = 0.f;
  for (int l = 0; l < 16; ++l) s += acc[l];
  for (; i < n; ++i) s = std::fma(x[i], x[i], s);
  return s;
}

#if defined(__x86_64__)
__attribute__((target("avx512f,avx512dq"))) float sumsq_512(const float* x, int64_t n) {
  __m512 a = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    a = _mm512_fmadd_ps(v, v, a);
  }
  alignas(64) float acc[16];
  _mm512_store_ps(acc, a);
  float s = 0.f;
  for (int l = 0; l < 16; ++l) s += acc[l];
  for (; i < n; ++i) s = std::fma(x[i], x[i], s);
  return s;
}

__attribute__((target("avx2,fma"))) float sumsq_avx2(const float* x, int64_t n) {
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
    lo = _mm256_fmadd_ps(a, a, lo);
    hi = _mm256_fmadd_ps(b, b, hi);
  }
  alignas(32) float acc[16];
  _mm256_store_ps(acc, lo);
  _mm256_store_ps(acc + 8, hi);
  float s = 0.f;
  for (int l = 0; l < 16; ++l) s += acc[l];
  for (; i < n; ++i) s = std::fma(x[i], x[i], s);
  return s;
}
#endif

float sumsq(Isa isa, const float* x, int64_t n) {
#if defined(__x86_64__)
  if (isa == Isa::kAvx512) return sumsq_512(x, n);
  if (isa == Isa::kAvx2) return sumsq_avx2(x, n);
#endif
  return sumsq_generic(x, n);
}

// out = x * rsqrt(mean(x^2) + eps) * w (torch's fp32 rms_norm: the inverse rms times x, then times w)
inline void rms_row(Isa isa, const float* x, const float* w, float eps, int64_t n, float* out) {
  const float r = 1.f / std::sqrt(sumsq(isa, x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * r * w[i];
}

// ---- activations --------------------------------------------------------------------------------

// e^a for a <= 0 (sampler.cpp's: a = (n + f) ln 2, e^(f ln 2) by its Taylor series to the 7th power)
inline float exp_nonpos_generic(float a) {
  const float t = std::fmax(a * 1.44269504088896341f, -160.f);
  const float n = std::nearbyint(t);
  const float y = (t - n) * 0.693147180559945309f;
  float p = 1.f / 5040.f;
  p = std::fma(p, y, 1.f / 720.f);
  p = std::fma(p, y, 1.f / 120.f);
  p = std::fma(p, y, 1.f / 24.f);
  p = std::fma(p, y, 1.f / 6.f);
  p = std::fma(p, y, 0.5f);
  p = std::fma(p, y, 1.f);
  p = std::fma(p, y, 1.f);
  return std::ldexp(p, static_cast<int>(n));
}

inline float silu_generic(float g) {
  const float e = exp_nonpos_generic(-std::fabs(g));  // sigmoid from e^-|g|: no overflow
  return g * ((g >= 0.f ? 1.f : e) / (1.f + e));
}

// 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) with tanh(y) = sign(y) (1 - e) / (1 + e), e = e^-2|y|
inline float gelu_generic(float g) {
  const float y = 0.7978845608028654f * (g + 0.044715f * g * g * g);
  const float e = exp_nonpos_generic(-2.f * std::fabs(y));
  const float th = std::copysign((1.f - e) / (1.f + e), y);
  return 0.5f * g * (1.f + th);
}

#if defined(__x86_64__)
__attribute__((target("avx512f,avx512dq"))) inline __m512 exp_nonpos_512(__m512 a) {
  const __m512 t = _mm512_max_ps(_mm512_mul_ps(a, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(-160.f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 y = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));
  __m512 p = _mm512_set1_ps(1.f / 5040.f);
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.f / 720.f));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

__attribute__((target("avx512f,avx512dq"))) void act_mul_512(bool gelu, const float* g, const float* u, int64_t n,
                                                             float* out) {
  const __m512 one = _mm512_set1_ps(1.f), half = _mm512_set1_ps(0.5f);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(g + i);
    __m512 a;
    if (gelu) {
      const __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
      const __m512 y = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                                     _mm512_add_ps(x, _mm512_mul_ps(_mm512_set1_ps(0.044715f), x3)));
      const __m512 ay = _mm512_abs_ps(y);
      const __m512 e = exp_nonpos_512(_mm512_mul_ps(_mm512_set1_ps(-2.f), ay));
      __m512 th = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
      th = _mm512_or_ps(th, _mm512_and_ps(y, _mm512_set1_ps(-0.f)));  // copysign
      a = _mm512_mul_ps(_mm512_mul_ps(half, x), _mm512_add_ps(one, th));
    } else {
      const __m512 e = exp_nonpos_512(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
      const __mmask16 pos = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ);
      const __m512 num = _mm512_mask_blend_ps(pos, e, one);
      a = _mm512_mul_ps(x, _mm512_div_ps(num, _mm512_add_ps(one, e)));
    }
    _mm512_storeu_ps(out + i, _mm512_mul_ps(a, _mm512_loadu_ps(u + i)));
  }
  for (; i < n; ++i) out[i] = (gelu ? gelu_generic(g[i]) : silu_generic(g[i])) * u[i];
}

// AVX2: 2^n put in the exponent bits; below 2^-126 the result is 0 (sampler.cpp's)
__attribute__((target("avx2,fma"))) inline __m256 exp_nonpos_avx2(__m256 a) {
  const __m256 t = _mm256_mul_ps(a, _mm256_set1_ps(1.44269504088896341f));
  const __m256 live = _mm256_cmp_ps(t, _mm256_set1_ps(-126.f), _CMP_GE_OQ);
  const __m256 tc = _mm256_max_ps(t, _mm256_set1_ps(-126.f));
  const __m256 n = _mm256_round_ps(tc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 y = _mm256_mul_ps(_mm256_sub_ps(tc, n), _mm256_set1_ps(0.693147180559945309f));
  __m256 p = _mm256_set1_ps(1.f / 5040.f);
  p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(1.f / 720.f));
  p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(1.f / 120.f));
  p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(1.f / 6.f));
  p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, y, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), live);
}

__attribute__((target("avx2,fma"))) void act_mul_avx2(bool gelu, const float* g, const float* u, int64_t n,
                                                     float* out) {
  const __m256 one = _mm256_set1_ps(1.f), half = _mm256_set1_ps(0.5f), sign = _mm256_set1_ps(-0.f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    __m256 a;
    if (gelu) {
      const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
      const __m256 y = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                                     _mm256_add_ps(x, _mm256_mul_ps(_mm256_set1_ps(0.044715f), x3)));
      const __m256 ay = _mm256_andnot_ps(sign, y);
      const __m256 e = exp_nonpos_avx2(_mm256_mul_ps(_mm256_set1_ps(-2.f), ay));
      __m256 th = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
      th = _mm256_or_ps(th, _mm256_and_ps(y, sign));
      a = _mm256_mul_ps(_mm256_mul_ps(half, x), _mm256_add_ps(one, th));
    } else {
      const __m256 e = exp_nonpos_avx2(_mm256_or_ps(x, sign));  // -|x|
      const __m256 pos = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ);
      const __m256 num = _mm256_blendv_ps(e, one, pos);
      a = _mm256_mul_ps(x, _mm256_div_ps(num, _mm256_add_ps(one, e)));
    }
    _mm256_storeu_ps(out + i, _mm256_mul_ps(a, _mm256_loadu_ps(u + i)));
  }
  for (; i < n; ++i) out[i] = (gelu ? gelu_generic(g[i]) : silu_generic(g[i])) * u[i];
}
#endif

void act_mul_row(Isa isa, bool gelu, const float* g, const float* u, int64_t n, float* out) {
#if defined(__x86_64__)
  if (isa == Isa::kAvx512) return act_mul_512(gelu, g, u, n, out);
  if (isa == Isa::kAvx2) return act_mul_avx2(gelu, g, u, n, out);
#endif
  for (int64_t i = 0; i < n; ++i) out[i] = (gelu ? gelu_generic(g[i]) : silu_generic(g[i])) * u[i];
}

// rows per parallel task: one thread for decode-sized work (a fork/join costs more than the rows)
int64_t grain(int64_t per_row) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(per_row, 1)); }

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2 && t.stride(1) == 1,
              name, " must be a float32 CPU matrix with contiguous rows, got ", t.scalar_type(), " ", t.sizes());
}

// ---- the ops ------------------------------------------------------------------------------------

void norm_rows(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight, double eps,
               at::Tensor* r, at::Tensor& out) {
  check_rows(x, "rms_norm: x");
  const int64_t T = x.size(0), n = x.size(1);
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == n,
              "rms_norm: weight must be float32 [", n, "]");
  if (residual) {
    check_rows(*residual, "add_rms_norm: residual");
    TORCH_CHECK(residual->sizes() == x.sizes(), "add_rms_norm: residual ", residual->sizes(), " != x ", x.sizes());
  }
  const Isa isa = isa_now();
  const float e = static_cast<float>(eps);
  const float* px = x.data_ptr<float>();
  const float* pr = residual ? residual->data_ptr<float>() : nullptr;
  const float* pw = weight.data_ptr<float>();
  float* prr = r ? r->data_ptr<float>() : nullptr;
  float* po = out.data_ptr<float>();
  const int64_t sx = x.stride(0), sr = residual ? residual->stride(0) : 0;
  at::parallel_for(0, T, grain(n), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* src = px + t * sx;
      if (pr) {
        float* rr = prr + t * n;
        const float* a = pr + t * sr;
        for (int64_t i = 0; i < n; ++i) rr[i] = a[i] + src[i];
        src = rr;
      }
      rms_row(isa, src, pw, e, n, po + t * n);
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor out = at::empty(x.sizes(), x.options());
  norm_rows(x, nullptr, weight, eps, nullptr, out);
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  at::Tensor out = at::empty(x.sizes(), x.options()), r = at::empty(x.sizes(), x.options());
  norm_rows(x, &residual, weight, eps, &r, out);
  return {out, r};
}

template <typename C>
inline void store_row(const float* src, C* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<C>(src[i]);
}

// a q8_0 row (the 8-bit KV cache): per 32 values d = max|x| / 127, q = roundf(x * (1 / d)), d as fp16
// bits, then the 32 int8 (llama.cpp's quantize_row_q8_0_ref; kv_quant.quantize is the reference)
inline void store_row(const float* src, uint8_t* dst, int64_t n) {
  for (int64_t b = 0; b < n / 32; ++b, src += 32, dst += 34) {
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(src[j]));
    const float d = amax / 127.f, inv = d != 0.f ? 1.f / d : 0.f;
    const uint16_t bits = c10::Half(d).x;
    std::memcpy(dst, &bits, 2);
    for (int j = 0; j < 32; ++j) dst[2 + j] = static_cast<uint8_t>(static_cast<int8_t>(std::roundf(src[j] * inv)));
  }
}

// cache elements of a head's row of D values
template <typename C>
constexpr int64_t row_elems(int64_t D) {
  return std::is_same_v<C, uint8_t> ? D / 32 * 34 : D;
}

// x [D] (already normed or not) -> out [D]: rotate_half RoPE on the first r columns, the rest copied
inline void rope_row(const float* x, const float* c, const float* s, int64_t r, int64_t D, float* out) {
  const int64_t h = r / 2;
  for (int64_t i = 0; i < h; ++i) out[i] = x[i] * c[i] + (-x[i + h]) * s[i];
  for (int64_t i = h; i < r; ++i) out[i] = x[i] * c[i] + x[i - h] * s[i];
  for (int64_t i = r; i < D; ++i) out[i] = x[i];
}

template <typename C>
void rope_store_impl(Isa isa, const at::Tensor& qkv, const int64_t* pos, const float* cos, const float* sin,
                     C* kc, C* vc, const int64_t* slots, int64_t H, int64_t KVH, int64_t D, int64_t r,
                     const float* qw, const float* kw, float eps, float* q) {
  const int64_t T = qkv.size(0), stride = qkv.stride(0);
  const float* base = qkv.data_ptr<float>();
  at::parallel_for(0, T, grain((H + 2 * KVH) * D), [&](int64_t t0, int64_t t1) {
    float tmp[1024];
    for (int64_t t = t0; t < t1; ++t) {
      const float* row = base + t * stride;
      const float* c = cos + pos[t] * r;
      const float* s = sin + pos[t] * r;
      for (int64_t h = 0; h < H; ++h) {
        const float* x = row + h * D;
        if (qw) {
          rms_row(isa, x, qw, eps, D, tmp);
          x = tmp;
        }
        rope_row(x, c, s, r, D, q + (t * H + h) * D);
      }
      const int64_t slot = slots[t], rb = row_elems<C>(D);
      float krow[1024];
      for (int64_t h = 0; h < KVH; ++h) {
        const float* x = row + (H + h) * D;
        if (kw) {
          rms_row(isa, x, kw, eps, D, tmp);
          x = tmp;
        }
        rope_row(x, c, s, r, D, krow);
        store_row(krow, kc + (slot * KVH + h) * rb, D);
        store_row(row + (H + KVH + h) * D, vc + (slot * KVH + h) * rb, D);
      }
    }
  });
}

at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                      at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots, int64_t H, int64_t KVH,
                      int64_t D, int64_t rotary_dim, const std::optional<at::Tensor>& q_w,
                      const std::optional<at::Tensor>& k_w, double eps) {
  check_rows(qkv, "rope_store: qkv");
  const int64_t T = qkv.size(0);
  TORCH_CHECK(H > 0 && KVH > 0 && D > 0 && D <= 1024 && qkv.size(1) == (H + 2 * KVH) * D,
              "rope_store: qkv must be [T, (H + 2 KVH) D] with D <= 1024, got ", qkv.sizes(), " for H=", H,
              " KVH=", KVH, " D=", D);
  TORCH_CHECK(rotary_dim > 0 && rotary_dim <= D && rotary_dim % 2 == 0, "rope_store: bad rotary_dim ", rotary_dim);
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.dim() == 2 && cos.size(1) == rotary_dim && sin.sizes() == cos.sizes(),
              "rope_store: cos and sin must be contiguous float32 [positions, rotary_dim]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slots.scalar_type() == at::kLong && positions.is_contiguous() &&
                  slots.is_contiguous() && positions.numel() == T && slots.numel() == T,
              "rope_store: positions and slots must be contiguous int64 [T]");
  const bool q8 = k_cache.scalar_type() == at::kByte;
  TORCH_CHECK(!q8 || D % 32 == 0, "rope_store: a q8_0 cache needs D % 32 == 0, got ", D);
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.size(2) == KVH &&
                  k_cache.size(3) == (q8 ? D / 32 * 34 : D) && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "rope_store: caches must be contiguous [blocks, block_size, KVH, D] (q8_0: D / 32 * 34 bytes) of one "
              "dtype");
  for (const auto* w : {&q_w, &k_w})
    if (*w)
      TORCH_CHECK((*w)->scalar_type() == at::kFloat && (*w)->is_contiguous() && (*w)->numel() == D,
                  "rope_store: q_w / k_w must be float32 [D]");
  TORCH_CHECK(q_w.has_value() == k_w.has_value(), "rope_store: q_w and k_w come together");
  const int64_t nslots = k_cache.size(0) * k_cache.size(1), npos = cos.size(0);
  const int64_t* ps = positions.data_ptr<int64_t>();
  const int64_t* ss = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(ps[t] >= 0 && ps[t] < npos, "rope_store: position ", ps[t], " outside the table of ", npos);
    TORCH_CHECK(ss[t] >= 0 && ss[t] < nslots, "rope_store: slot ", ss[t], " outside the cache of ", nslots);
  }
  at::Tensor q = at::empty({T, H, D}, qkv.options());
  const Isa isa = isa_now();
  const float* qwp = q_w ? q_w->data_ptr<float>() : nullptr;
  const float* kwp = k_w ? k_w->data_ptr<float>() : nullptr;
  const float e = static_cast<float>(eps);
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  switch (k_cache.scalar_type()) {
    case at::kFloat:
      rope_store_impl(isa, qkv, ps, cp, sp, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), ss, H, KVH, D,
                      rotary_dim, qwp, kwp, e, q.data_ptr<float>());
      break;
    case at::kHalf:
      rope_store_impl(isa, qkv, ps, cp, sp, k_cache.data_ptr<at::Half>(), v_cache.data_ptr<at::Half>(), ss, H, KVH,
                      D, rotary_dim, qwp, kwp, e, q.data_ptr<float>());
      break;
    case at::kBFloat16:
      rope_store_impl(isa, qkv, ps, cp, sp, k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(), ss,
                      H, KVH, D, rotary_dim, qwp, kwp, e, q.data_ptr<float>());
      break;
    case at::kByte:
      rope_store_impl(isa, qkv, ps, cp, sp, k_cache.data_ptr<uint8_t>(), v_cache.data_ptr<uint8_t>(), ss, H, KVH, D,
                      rotary_dim, qwp, kwp, e, q.data_ptr<float>());
      break;
    default:
      TORCH_CHECK(false, "rope_store: caches must be float32, float16, bfloat16 or uint8 (q8_0), got ",
                  k_cache.scalar_type());
  }
  return q;
}

at::Tensor act_mul(const at::Tensor& gate_up, bool gelu) {
  check_rows(gate_up, gelu ? "gelu_tanh_mul: gate_up" : "silu_mul: gate_up");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even number of columns, got ", gate_up.size(1));
  at::Tensor out = at::empty({T, I}, gate_up.options());
  const Isa isa = isa_now();
  const float* p = gate_up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t s = gate_up.stride(0);
  at::parallel_for(0, T, grain(2 * I), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) act_mul_row(isa, gelu, p + t * s, p + t * s + I, I, o + t * I);
  });
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate_up) { return act_mul(gate_up, false); }
at::Tensor gelu_tanh_mul(const at::Tensor& gate_up) { return act_mul(gate_up, true); }

// ---- one decoder layer's decode step ------------------------------------------------------------

// y = x W^T by our GEMMs in the other libraries (int4_gemm.cpp, int8_gemm.cpp, bf16_gemm.cpp),
// reached through the dispatcher from C++ (~0.2 us, where a call from Python costs ~6 us), their
// padded columns cut to n
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& sc, int64_t group, int64_t n,
                       int64_t parts) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("localllm::int4_gemm", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t)>();
  at::Tensor y = op.call(x, w, sc, group, parts);
  return y.size(1) == n ? y : y.narrow(1, 0, n);
}

at::Tensor int8w_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& sc, int64_t group, int64_t zero,
                        int64_t n, int64_t parts) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("localllm::int8w_gemm", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t)>();
  at::Tensor y = op.call(x, w, sc, group, zero, parts);
  return y.size(1) == n ? y : y.narrow(1, 0, n);
}

at::Tensor w16_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, int64_t n) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("localllm::w16_gemm", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&)>();
  at::Tensor y = op.call(x, w, bias);
  return y.size(1) == n ? y : y.narrow(1, 0, n);
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q,
                           const at::Tensor& context_lens, double scale, int64_t window, double softcap) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("localllm::paged_attention", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, double, int64_t, double,
                            const std::optional<at::Tensor>&)>();
  // (no sinks: a layer with them never takes this one-call step)
  return op.call(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, window, softcap,
                 std::nullopt);
}

enum PartKind : int64_t { kInt4 = 0, kInt8w = 1, kW16 = 2 };
constexpr int64_t kMlpRows = 256;  // a prompt chunk's MLP rows at a time, or more (cpu_ops.py: mlp_rows)
constexpr int64_t kPartInts = 4;     // kind, group size, out features, zero point
constexpr int64_t kPartTensors = 3;  // weights, scales (empty for 16-bit), bias (empty: none)

// One linear of the layer as the layers' forwards compute it (layers.py): each part on its own
// kernel (the file's type: Int4Linear, Int8wLinear, W16Linear), the bias added after the cut (int4,
// int8-lane) or in the kernel (16-bit), the parts' outputs side by side (ConcatLinear).
at::Tensor linear(const at::Tensor& x, at::TensorList weights, at::IntArrayRef ints, int64_t& wi, int64_t& ii,
                  int64_t parts, int64_t act_parts) {
  std::vector<at::Tensor> outs;
  outs.reserve(parts);
  for (int64_t p = 0; p < parts; ++p, wi += kPartTensors, ii += kPartInts) {
    const int64_t kind = ints[ii], group = ints[ii + 1], n = ints[ii + 2], zero = ints[ii + 3];
    const at::Tensor& w = weights[wi];
    const at::Tensor& bias = weights[wi + 2];
    at::Tensor y;
    if (kind == kW16) {
      y = w16_linear(x, w, bias.numel() ? std::optional<at::Tensor>(bias) : std::nullopt, n);
    } else {
      TORCH_CHECK(kind == kInt4 || kind == kInt8w, "decode_layer: part kind ", kind, " is none of int4 (0), ",
                  "int8-lane (1), 16-bit (2)");
      y = kind == kInt4 ? int4_linear(x, w, weights[wi + 1], group, n, act_parts)
                        : int8w_linear(x, w, weights[wi + 1], group, zero, n, act_parts);
      if (bias.numel()) y = at::add(y, bias);
    }
    outs.push_back(std::move(y));
  }
  return parts == 1 ? outs[0] : at::cat(outs, 1);
}

// decode_layer: llama.py's DecoderLayer.forward for a layer whose linears are on our GEMMs and
// which has no output norms or experts, as the same sequence of our ops the fused Ops set calls
// one by one from Python (cpu_ops.py): add_rms_norm, qkv GEMM(s), rope_store, paged attention,
// o GEMM(s), add_rms_norm, gate_up GEMM(s), silu_mul / gelu_tanh_mul, down GEMM(s); the same
// kernels, so the same bits, with no Python between them (at batch 1 the ~10 calls of a layer from
// Python cost ~3 ms per token on the 135M model: as much as a third of its GEMMs).
//   weights: input norm, post norm[, q norm, k norm], then per part of qkv, o, gate_up and down in
//            that order (a GGUF's fused linear may have parts of different types): its weights,
//            scales and bias (empty tensors where a part has none)
//   ints: H, KVH, D, window, gelu; the parts of qkv, o, gate_up, down; the activations' int8 parts
//         in the int4 / int8-lane GEMMs (2: ~16 bits, 1: 8 bits); per part its kind (0 int4,
//         1 int8-lane, 2 16-bit), group size, out features and zero point
//   floats: input norm eps, post norm eps, q/k norm eps, softcap
// (rotary_dim and scale come with the call: they are the model's, not the layer's)
// -> (the MLP's output, the residual stream), as DecoderLayer.forward.
std::tuple<at::Tensor, at::Tensor> decode_layer(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                                at::TensorList weights, at::IntArrayRef ints,
                                                at::ArrayRef<double> floats, const at::Tensor& positions,
                                                const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                                                at::Tensor& v_cache, const at::Tensor& slots,
                                                const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q,
                                                const at::Tensor& context_lens, int64_t rotary_dim,
                                                double scale) {
  TORCH_CHECK(ints.size() >= 10 && floats.size() == 4, "decode_layer: 10 ints and 4 per linear part, and 4 floats; got ",
              ints.size(), " ints and ", floats.size(), " floats");
  const int64_t H = ints[0], KVH = ints[1], D = ints[2];
  const int64_t parts = ints[5] + ints[6] + ints[7] + ints[8];
  const int64_t norms = static_cast<int64_t>(weights.size()) - kPartTensors * parts;
  TORCH_CHECK(std::min({ints[5], ints[6], ints[7], ints[8]}) >= 1 &&
                  static_cast<int64_t>(ints.size()) == 10 + kPartInts * parts && (norms == 2 || norms == 4),
              "decode_layer: weights must be 2 norms (4 with q/k norms) and 3 tensors per linear part, ints 10 and 4 ",
              "per part (each linear at least one); got ", weights.size(), " tensors and ", ints.size(),
              " ints for ", parts, " parts");
  std::optional<at::Tensor> qw, kw;
  if (norms == 4) qw = weights[2], kw = weights[3];
  int64_t wi = norms, ii = 10;
  const int64_t act = ints[9];
  at::Tensor h, r;
  if (residual) {
    std::tie(h, r) = add_rms_norm(x, *residual, weights[0], floats[0]);
  } else {
    h = rms_norm(x, weights[0], floats[0]);
    r = x;
  }
  const at::Tensor qkv = linear(h, weights, ints, wi, ii, ints[5], act);
  const at::Tensor q = rope_store(qkv, positions, cos, sin, k_cache, v_cache, slots, H, KVH, D, rotary_dim, qw, kw,
                                  floats[2]);
  const at::Tensor att = paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale,
                                         ints[3], floats[3]);
  const at::Tensor a = linear(att.view({att.size(0), H * D}), weights, ints, wi, ii, ints[6], act);
  auto [h2, r2] = add_rms_norm(a, r, weights[1], floats[1]);
  // a prompt chunk's MLP in blocks of kMlpRows rows or more (the last takes the rest): its gate/up
  // output and activation were the chunk's largest tensors (a 1B shape's 512-token chunk: 32 + 16
  // MB of a 107 MB live peak). Rows are independent in every GEMM, and no block is small enough
  // to take another route than the whole chunk would. One block (decode): its output as is.
  const int64_t T = h2.size(0), blocks = std::max<int64_t>(1, T / kMlpRows);
  at::Tensor out;
  const int64_t wi0 = wi, ii0 = ii;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t r0 = b * kMlpRows, n = b + 1 == blocks ? T - r0 : kMlpRows;
    wi = wi0, ii = ii0;
    const at::Tensor gu = linear(h2.narrow(0, r0, n), weights, ints, wi, ii, ints[7], act);
    const at::Tensor y = linear(act_mul(gu, ints[4] != 0), weights, ints, wi, ii, ints[8], act);
    if (blocks == 1) return {y, r2};
    if (!out.defined()) out = at::empty({T, y.size(1)}, y.options());
    out.narrow(0, r0, n).copy_(y);
  }
  return {out, r2};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(localllm, m) {
  m.def("fused_isa(str? force=None) -> str", &fused_isa);  // no tensors: one kernel for every key
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rope_store(Tensor qkv, Tensor positions, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slots, int H, int KVH, int D, int rotary_dim, Tensor? q_w, Tensor? k_w, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("gelu_tanh_mul(Tensor gate_up) -> Tensor");
  m.def("decode_layer(Tensor x, Tensor? residual, Tensor[] weights, int[] ints, float[] floats, Tensor positions, "
        "Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, Tensor block_tables, "
        "Tensor cu_seqlens_q, Tensor context_lens, int rotary_dim, float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(localllm, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope_store", &rope_store);
  m.impl("silu_mul", &silu_mul);
  m.impl("gelu_tanh_mul", &gelu_tanh_mul);
  m.impl("decode_layer", &decode_layer);
}
