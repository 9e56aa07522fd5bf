// fp32 GEMM at fp32-level accuracy on the AMX-BF16 tile unit ("bf16x3"): the encoders' linears
// (all-MiniLM, bge...) at thousands of rows a forward, with the bias and exact GELU fused.
//
// Why: an encoder forward is GEMM-bound (64 sentences of 128 tokens: 8192 rows); MKL's fp32
// sgemm runs at the AVX-512 FMA rate, a tile op (TDPBF16PS, 16 x 16 x 32 bf16 products added in
// fp32) does 16x the multiply-adds per cycle. Rounding weights or activations to bf16 once
// costs ~3 significant digits; here each is split into two bf16 parts, value = hi + lo with
// hi = bf16(value), lo = bf16(value - hi) (16 significant bits, relative error <= 2^-17), and
// the three products that matter, x_hi w_hi + x_lo w_hi + x_hi w_lo, are exact in fp32 and
// accumulated in fp32 (the dropped x_lo w_lo is ~2^-16 of the product). The outputs are an
// fp32 GEMM's to ~1e-5 relative, far inside the 0.9999 cosine the encoders must keep.
//
// Layout: w [Nt, nkb, 2, 16, 16, 2] bf16 (localllm_kernels/cpu_bf16x3.py `pack`): column tile c (outputs
// 16c..16c+15), k-block kb (k 32kb..32kb+31), part (hi, lo), then a tile as TDPBF16PS reads its
// B operand: [k pair r][output j][k parity e] = W[16c + j, 32kb + 2r + e]; Nt even, zeros past N
// and K. x fp32 [M, K]; bias fp32 [16 Nt] or none; y fp32 [M, N]:
//   y = act(x @ W^T + bias), act "none" or "gelu" (the erf GELU BERT is trained with).
// Each task takes a block of rows and a range of column-tile pairs, splits its rows into a
// per-thread buffer of activation tiles, and runs 2 x 2 tile accumulators (32 rows x 32 outputs)
// over K; the epilogue adds the bias and applies the activation on the way to y.
//
// Without the tile unit, on AVX512-BF16 CPUs (AMD Zen 4 and later, Intel Cooper Lake): one weight
// part only ("bfloat16"), the activations rounded to bf16 too (one product, VDPBF16PS: 32
// multiply-adds a cycle against fp32 FMA's 16; 1.85x MKL's fp32 sgemm measured on Zen 4). The same
// weight layout: a tile's k pair r is one 64-byte row, 16 outputs x 2 k, VDPBF16PS's operand as it
// is; 12 rows x 2 column tiles of accumulators, the activations' k pair broadcast from a bf16
// row-major copy of x.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

namespace {

constexpr int kK = 32;                // k per tile step
constexpr int kTile = 16 * kK;        // bf16 values of one tile (1 KB)
constexpr int64_t kChunkBytes = 768 << 10;  // weight tiles a task keeps in L2 (2 MB a core here)
constexpr int64_t kGroupRows = 256;        // rows a task runs over one column chunk
constexpr int64_t kSliceK = 8;  // k-blocks a slice (see gemm_block; 4 and 12 measured no better)

// AMX-BF16 and AVX-512 on the CPU and the tile state granted to this process by Linux
bool amx_ready() {
#if defined(__x86_64__) && defined(__linux__)
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 22))) return false;
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw")) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;  // arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

// AVX512-BF16 (CPUID.(7,1):EAX bit 5) with AVX-512 F/BW/VL
bool dot_ready() {
#if defined(__x86_64__)
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !(a & (1u << 5))) return false;
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
  }();
  return ok;
#else
  return false;
#endif
}

bool bf16x3_available() { return amx_ready(); }
bool bf16dot_available() { return dot_ready(); }

#if defined(__x86_64__)
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))
#define AMX __attribute__((target("avx512f,avx512bw,avx512vl,fma,amx-tile,amx-bf16")))
#define BF16DOT __attribute__((target("avx512f,avx512bw,avx512vl,fma,avx512bf16")))

struct alignas(64) TileCfg {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

AMX void tile_config() {  // 8 tiles of 16 rows x 64 bytes
  TileCfg cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

// RNE fp32 -> bf16 in integer math (no flush to zero), as fp32 bits with the low half zero
AVX512 inline __m512i rne_bf16(__m512i b) {
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  return _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
}

// row tiles [t0, t1) of x [M, K] -> a [row tile][nkb][2][16][32] bf16 (hi, lo); zero past M and K
AVX512 void split_rows(const float* x, int64_t M, int64_t K, int64_t t0, int64_t t1, int64_t nkb, uint16_t* a) {
  const int64_t tstride = nkb * 2 * kTile;
  if (t1 * 16 > M || K % kK) std::memset(a + (t1 - 1) * tstride, 0, sizeof(uint16_t) * tstride);  // the tails
  if (K % kK) std::memset(a + t0 * tstride, 0, sizeof(uint16_t) * (t1 - t0) * tstride);
  for (int64_t i = t0 * 16; i < std::min(M, t1 * 16); ++i) {
    const float* xr = x + i * K;
    for (int64_t k = 0; k < K; k += 16) {
      const __mmask16 mask = K - k >= 16 ? 0xffff : static_cast<__mmask16>((1u << (K - k)) - 1);
      const __m512 v = _mm512_maskz_loadu_ps(mask, xr + k);
      const __m512i hi = rne_bf16(_mm512_castps_si512(v));
      const __m512i lo = rne_bf16(_mm512_castps_si512(_mm512_sub_ps(v, _mm512_castsi512_ps(hi))));  // v - hi exact
      uint16_t* dst = a + ((i / 16) * nkb + k / kK) * 2 * kTile + (i % 16) * kK + k % kK;
      _mm256_mask_storeu_epi16(dst, mask, _mm512_cvtepi32_epi16(_mm512_srli_epi32(hi, 16)));
      _mm256_mask_storeu_epi16(dst + kTile, mask, _mm512_cvtepi32_epi16(_mm512_srli_epi32(lo, 16)));
    }
  }
}

// e^x, Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-7 polynomial, then 2^n (~1 ulp)
AVX512 inline __m512 exp_512(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-88.3762626647949f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// the exact GELU, x (1 + erf(x / sqrt 2)) / 2, with erf by Abramowitz & Stegun 7.1.26 (absolute
// error <= 1.5e-7, about fp32's rounding of 1 + erf): the tanh form would be another function
AVX512 inline __m512 gelu_512(__m512 x) {
  const __m512 z = _mm512_mul_ps(x, _mm512_set1_ps(0.70710678118654752f));
  const __m512 az = _mm512_abs_ps(z);
  const __m512 t = _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_fmadd_ps(_mm512_set1_ps(0.3275911f), az, _mm512_set1_ps(1.f)));
  __m512 p = _mm512_set1_ps(1.061405429f);
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-1.453152027f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.421413741f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-0.284496736f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.254829592f));
  // q = 1 - erf(|z|) = erfc(|z|), kept apart so 1 + erf(z) for z < 0 is q itself (no cancellation)
  const __m512 q = _mm512_mul_ps(_mm512_mul_ps(p, t), exp_512(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), az), az)));
  const __mmask16 neg = _mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512 one_plus_erf = _mm512_mask_blend_ps(neg, _mm512_sub_ps(_mm512_set1_ps(2.f), q), q);
  return _mm512_mul_ps(_mm512_mul_ps(x, _mm512_set1_ps(0.5f)), one_plus_erf);
}

// row tiles [t0, t1) x column tiles [c0, c1) (pairs): a holds x split (split_rows), M rows; WP
// weight parts (2: hi, lo; 1: the weights rounded to bf16)
template <int WP>
AMX void gemm_block(const uint16_t* a, int64_t M, int64_t t0, int64_t t1, int64_t nkb, const uint16_t* w, int64_t c0,
                    int64_t c1, const float* bias, bool gelu, float* y, int64_t N) {
  alignas(64) float acc[32][32];
  const int64_t tstride = nkb * 2 * kTile, mt = (M + 15) / 16;  // bf16 values per row tile
  const int64_t bstride = nkb * WP * kTile;                         // per column tile
  // K in slices of ~kSliceK: a row pair's slice of activation tiles (<= 32 KB) stays in L1 while
  // every column pair of the range multiplies it (a whole K = 1536 pair, 192 KB, came from L2 for
  // each column pair: 1.35x torch's time); the partial sums wait in `part` between slices
  const int64_t slices = (nkb + kSliceK - 1) / kSliceK, ld = (c1 - c0) * 16;
  std::vector<float> part(slices > 1 ? 32 * ld + 16 : 0);
  float* ps = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(part.data()) + 63) & ~uintptr_t{63});
  for (int64_t t = t0; t < t1; t += 2) {
    const uint16_t* a0 = a + t * tstride;
    const uint16_t* a1 = t + 1 < mt ? a0 + tstride : a0;  // an odd last tile pairs with itself
    for (int64_t s = 0; s < slices; ++s) {
    const int64_t k0 = nkb * s / slices, k1 = nkb * (s + 1) / slices;
    for (int64_t c = c0; c < c1; c += 2) {
      const uint16_t* b0 = w + c * bstride;
      const uint16_t* b1 = b0 + bstride;
      float* pc = ps + (c - c0) * 16;
      if (s == 0) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
      } else {
        _tile_loadd(0, pc, ld * 4);
        _tile_loadd(1, pc + 16, ld * 4);
        _tile_loadd(2, pc + 16 * ld, ld * 4);
        _tile_loadd(3, pc + 16 * ld + 16, ld * 4);
      }
      for (int64_t kb = k0; kb < k1; ++kb) {
        const int64_t o = kb * 2 * kTile, ob = kb * WP * kTile;
        // x_lo w_hi, then x_hi w_hi (w_hi stays), then x_hi w_lo (x_hi stays): 8 loads, 12 products
        _tile_loadd(4, a0 + o + kTile, 64);
        _tile_loadd(5, a1 + o + kTile, 64);
        _tile_loadd(6, b0 + ob, 64);
        _tile_loadd(7, b1 + ob, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
        _tile_loadd(4, a0 + o, 64);
        _tile_loadd(5, a1 + o, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
        if constexpr (WP == 2) {
          _tile_loadd(6, b0 + ob + kTile, 64);
          _tile_loadd(7, b1 + ob + kTile, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      if (s + 1 < slices) {
        _tile_stored(0, pc, ld * 4);
        _tile_stored(1, pc + 16, ld * 4);
        _tile_stored(2, pc + 16 * ld, ld * 4);
        _tile_stored(3, pc + 16 * ld + 16, ld * 4);
        continue;
      }
      _tile_stored(0, &acc[0][0], 128);
      _tile_stored(1, &acc[0][16], 128);
      _tile_stored(2, &acc[16][0], 128);
      _tile_stored(3, &acc[16][16], 128);
      const int64_t rows = std::min<int64_t>(32, M - t * 16);
      for (int h = 0; h < 2; ++h) {
        const int64_t n0 = (c + h) * 16;
        if (n0 >= N) break;
        const __mmask16 mask = N - n0 >= 16 ? 0xffff : static_cast<__mmask16>((1u << (N - n0)) - 1);
        const __m512 bv = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
        for (int64_t i = 0; i < rows; ++i) {
          __m512 v = _mm512_add_ps(_mm512_load_ps(&acc[i][16 * h]), bv);
          if (gelu) v = gelu_512(v);
          _mm512_mask_storeu_ps(y + (t * 16 + i) * N + n0, mask, v);
        }
      }
    }
    }
  }
}

// tasks [q0, q1) of the column chunks x row groups on this thread (its own tile state)
AMX void run_tasks(const uint16_t* a, int64_t M, int64_t nkb, const uint16_t* w, int wp, int64_t nt, int64_t chunk_tiles,
                   int64_t groups, int64_t q0, int64_t q1, const float* b, bool gelu, float* y, int64_t N) {
  tile_config();
  const int64_t mt = (M + 15) / 16;
  for (int64_t q = q0; q < q1; ++q) {
    const int64_t cc = q / groups, g = q % groups;
    const int64_t t0 = mt * g / groups / 2 * 2, t1 = g + 1 == groups ? mt : mt * (g + 1) / groups / 2 * 2;
    const int64_t c0 = cc * chunk_tiles, c1 = std::min(nt, c0 + chunk_tiles);
    if (t0 < t1 && wp == 2) gemm_block<2>(a, M, t0, t1, nkb, w, c0, c1, b, gelu, y, N);
    if (t0 < t1 && wp == 1) gemm_block<1>(a, M, t0, t1, nkb, w, c0, c1, b, gelu, y, N);
  }
  _tile_release();
}

// rows [r0, r1) of x [M, K] -> xb [M, Kp] bf16 rounded to nearest even, zeros past K
AVX512 void round_rows(const float* x, int64_t K, int64_t Kp, int64_t r0, int64_t r1, uint16_t* xb) {
  for (int64_t i = r0; i < r1; ++i) {
    for (int64_t k = 0; k < Kp; k += 16) {
      const __mmask16 mask = K - k >= 16 ? 0xffff : K > k ? static_cast<__mmask16>((1u << (K - k)) - 1) : 0;
      const __m512i v = rne_bf16(_mm512_castps_si512(_mm512_maskz_loadu_ps(mask, x + i * K + k)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xb + i * Kp + k), _mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16)));
    }
  }
}

// MR rows of xb (from a, row stride lda) x column tiles c and c + 1 (b0, b0 + bstride) over nkb
// k-blocks: 2 MR accumulators; the epilogue adds the bias, applies the activation and stores
// outputs n0 .. n0 + 31 (those below N) of the MR rows of y
template <int MR>
BF16DOT void dot_tile(const uint16_t* a, int64_t lda, const uint16_t* b0, int64_t bstride, int64_t nkb,
                      const float* bias, bool gelu, float* y, int64_t N, int64_t n0) {
  __m512 acc[MR][2];
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < nkb; ++kb) {
    const uint16_t* bk = b0 + kb * kTile;
    const uint16_t* ak = a + kb * kK;
    for (int r = 0; r < 16; ++r) {
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(bk + r * 32);
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512(bk + bstride + r * 32);
      for (int i = 0; i < MR; ++i) {
        int32_t pair;
        std::memcpy(&pair, ak + i * lda + 2 * r, sizeof pair);
        const __m512bh av = (__m512bh)_mm512_set1_epi32(pair);
        acc[i][0] = _mm512_dpbf16_ps(acc[i][0], av, w0);
        acc[i][1] = _mm512_dpbf16_ps(acc[i][1], av, w1);
      }
    }
  }
  for (int h = 0; h < 2; ++h) {
    const int64_t n = n0 + 16 * h;
    if (n >= N) break;
    const __mmask16 mask = N - n >= 16 ? 0xffff : static_cast<__mmask16>((1u << (N - n)) - 1);
    const __m512 bv = bias ? _mm512_loadu_ps(bias + n) : _mm512_setzero_ps();
    for (int i = 0; i < MR; ++i) {
      __m512 v = _mm512_add_ps(acc[i][h], bv);
      if (gelu) v = gelu_512(v);
      _mm512_mask_storeu_ps(y + i * N + n, mask, v);
    }
  }
}

constexpr int kDotRows = 12;  // 24 accumulators + 2 weight rows + 1 broadcast of the 32 registers

template <int... R>
constexpr auto dot_tiles(std::integer_sequence<int, R...>) {
  return std::array{&dot_tile<R + 1>...};
}

// rows [r0, r1) x column-tile pairs [p0, p1): each pair's weights (K x 32 outputs) stay in L1/L2
// while the rows stream by in groups of kDotRows
void dot_block(const uint16_t* xb, int64_t Kp, int64_t r0, int64_t r1, const uint16_t* w, int64_t nkb, int64_t p0,
               int64_t p1, const float* bias, bool gelu, float* y, int64_t N) {
  static constexpr auto tiles = dot_tiles(std::make_integer_sequence<int, kDotRows>{});
  const int64_t bstride = nkb * kTile;
  for (int64_t p = p0; p < p1; ++p) {
    for (int64_t i = r0; i < r1; i += kDotRows) {
      const int64_t rows = std::min<int64_t>(kDotRows, r1 - i);
      tiles[rows - 1](xb + i * Kp, Kp, w + 2 * p * bstride, bstride, nkb, bias, gelu, y + i * N, N, 32 * p);
    }
  }
}

AVX512 void gelu_rows(float* y, int64_t n) {  // tests: the epilogue's GELU on its own
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = n - i >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(y + i, mask, gelu_512(_mm512_maskz_loadu_ps(mask, y + i)));
  }
}
#endif

at::Tensor bf16x3_gemm(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, int64_t N,
                       const std::string& act) {
  const bool amx = amx_ready();
  TORCH_CHECK(amx || dot_ready(), "bf16x3_gemm: this CPU (or kernel) has neither the AMX-BF16 tile unit nor AVX512-BF16");
  TORCH_CHECK(amx || w.size(2) == 1, "bf16x3_gemm: without the AMX-BF16 tile unit the weights must be one bf16 part "
              "(two parts need AMX)");
  TORCH_CHECK(act == "none" || act == "gelu", "bf16x3_gemm: act must be none or gelu, got ", act);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "bf16x3_gemm: x must be fp32 [M, K]");
  TORCH_CHECK(w.dim() == 6 && w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.size(0) % 2 == 0 &&
              (w.size(2) == 1 || w.size(2) == 2) && w.size(3) == 16 && w.size(4) == 16 && w.size(5) == 2,
              "bf16x3_gemm: the weight must be contiguous bf16 [Nt (even), nkb, 1 or 2, 16, 16, 2]");
  const int64_t M = x.size(0), K = x.size(1), Nt = w.size(0), nkb = w.size(1);
  TORCH_CHECK((K + kK - 1) / kK == nkb, "bf16x3_gemm: x has K = ", K, " but the weight ", nkb, " k-blocks");
  TORCH_CHECK(N > 16 * (Nt - 2) && N <= 16 * Nt, "bf16x3_gemm: N = ", N, " does not fit ", Nt, " column tiles");
  const float* b = nullptr;
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == 16 * Nt && bias->scalar_type() == at::kFloat &&
                bias->is_contiguous(), "bf16x3_gemm: bias must be contiguous fp32 [16 Nt]");
    b = bias->data_ptr<float>();
  }
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
#if defined(__x86_64__)
  const float* xp = xc.data_ptr<float>();
  const auto* wp_ = reinterpret_cast<const uint16_t*>(w.data_ptr());
  float* yp = y.data_ptr<float>();
  const bool gelu = act == "gelu";
  const int64_t threads = at::get_num_threads();
  if (!amx) {
    // x rounded once (half its bytes), shared; tasks of a row group x a range of column-tile pairs,
    // enough of them for every thread (a short batch is cut by columns too)
    const int64_t Kp = nkb * kK, pairs = Nt / 2;
    std::vector<uint16_t> xbuf(M * Kp + 32);
    uint16_t* xb = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(xbuf.data()) + 63) & ~uintptr_t{63});
    at::parallel_for(0, M, 64, [&](int64_t r0, int64_t r1) { round_rows(xp, K, Kp, r0, r1, xb); });
    const int64_t groups = (M + 95) / 96;
    int64_t chunks = 1;
    while (groups * chunks < 4 * threads && chunks < pairs) ++chunks;
    at::parallel_for(0, groups * chunks, 1, [&](int64_t q0, int64_t q1) {
      for (int64_t q = q0; q < q1; ++q) {
        const int64_t g = q / chunks, c = q % chunks;
        dot_block(xb, Kp, M * g / groups, M * (g + 1) / groups, wp_, nkb, pairs * c / chunks, pairs * (c + 1) / chunks,
                  b, gelu, yp, N);
      }
    });
    return y;
  }
  // x split once into activation tiles (as many bytes as x), shared by the threads; then tasks of
  // a column chunk (~kChunkBytes of weight tiles: stays in L2 while its row group streams by) x a
  // group of rows, column-major so each thread keeps one chunk for many tasks; a short batch is
  // cut into more chunks so every thread has work
  const int64_t mt = (M + 15) / 16, tstride = nkb * 2 * kTile;
  std::vector<uint16_t> abuf(mt * tstride + 32);
  uint16_t* a = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(abuf.data()) + 63) & ~uintptr_t{63});
  at::parallel_for(0, mt, 16, [&](int64_t t0, int64_t t1) { split_rows(xp, M, K, t0, t1, nkb, a); });
  const int parts = static_cast<int>(w.size(2));
  int64_t chunk_tiles = std::max<int64_t>(2, kChunkBytes / (nkb * parts * kTile * 2) / 2 * 2);
  const int64_t groups = std::max<int64_t>(1, std::min((mt + 1) / 2, mt * 16 / kGroupRows));
  while (chunk_tiles > 2 && ((Nt + chunk_tiles - 1) / chunk_tiles) * groups < 2 * threads) chunk_tiles -= 2;
  const int64_t chunks = (Nt + chunk_tiles - 1) / chunk_tiles;
  at::parallel_for(0, chunks * groups, 1, [&](int64_t q0, int64_t q1) {
    run_tasks(a, M, nkb, wp_, parts, Nt, chunk_tiles, groups, q0, q1, b, gelu, yp, N);
  });
#endif
  return y;
}

at::Tensor bf16x3_gelu(const at::Tensor& x) {  // the epilogue's GELU alone, for tests
  TORCH_CHECK(amx_ready() || dot_ready(), "bf16x3_gelu: this CPU (or kernel) has no AVX-512 bf16 unit");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "bf16x3_gelu: x must be fp32");
  at::Tensor y = x.contiguous().clone();
#if defined(__x86_64__)
  gelu_rows(y.data_ptr<float>(), y.numel());
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(localllm, m) {
  m.def("bf16x3_gemm(Tensor x, Tensor w, Tensor? bias, int n, str act) -> Tensor");
  m.def("bf16x3_gelu(Tensor x) -> Tensor");
  m.def("bf16x3_available() -> bool", &bf16x3_available);
  m.def("bf16dot_available() -> bool", &bf16dot_available);
}

TORCH_LIBRARY_IMPL(localllm, CPU, m) {
  m.impl("bf16x3_gemm", &bf16x3_gemm);
  m.impl("bf16x3_gelu", &bf16x3_gelu);
}
