// 16-bit weights (bf16 or fp16, the checkpoint's own values) x fp32 activations: the CPU GEMM
// for GGUF F16/BF16 tensors and HF bf16/fp16 safetensors checkpoints.
//
// Why: expanded to fp32 those weights take twice the file's memory, and decode, bound by the
// bytes it reads, reads twice as many. Here each weight is converted exactly to fp32 in
// registers (bf16: the 16 bits shifted up; fp16: VCVTPH2PS) and meets fp32 activations in fp32
// FMAs: the same numbers as an fp32 GEMM on the upcast weights, up to summation order. No
// activation is rounded (avx512_bf16's VDPBF16PS would round them to bf16: not used).
//
// Layout: w [P, K, 32] of bf16 or fp16 (told by its dtype): panel p holds rows 32p..32p+31 of
// W [N, K], element [p, k, j] = W[32p + j, k] (rows past N are zero); one k of a panel is one
// 64-byte line, and the output rows lie in the vector lanes, so no horizontal sums are needed.
//   w16_gemm(x fp32 [M, K], w, bias fp32 [32P] or None) -> y fp32 [M, 32P] = x @ W^T (+ bias).
//
// Summation order: every output y[m, n] is one fp32 FMA chain over k = 0, 1, ..., K-1 starting
// from 0 (acc = fma(w[n, k], x[m, k], acc)), then + bias[n] (one more rounding). The AVX-512
// path (16 lanes), the AVX2 path (8 lanes) and the scalar path (std::fma) all compute exactly
// that chain per lane, so the three give bit-identical outputs; only how many outputs run at once
// differs (tiles of rows x panels), never the order within one. Prefill (more rows than one tile)
// converts a panel's K-block to fp32 once into a per-thread buffer and runs every row tile on it;
// the accumulators go through y between K-blocks, which is exact (they are fp32 either way).
// From 256 rows on (long prefills) the weights are widened to fp32 a chunk at a time and torch's
// fp32 GEMM runs on them (gemm_blas): faster there than our tiles, its summation order torch's,
// the same whichever of our paths is chosen. The AVX2 path (no AVX-512) takes it from 16-64 rows
// (blas_rows): there its order is torch's while the other paths' is the FMA chain.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
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

constexpr int kPanel = 32;    // output rows per panel
constexpr int64_t kKc = 128;  // K-block of the prefill path: a 16 KB fp32 panel block, beside the x tile in L1

enum class Isa { kAmx, kAvx512, kAvx2, kGeneric };
enum class Src { kBf16, kF16, kF32 };  // what a tile reads: the weights, or the converted buffer

// AMX-BF16 (Sapphire Rapids on): the CPU has it and Linux grants this process the tile state
bool amx_ready() {
#if defined(__x86_64__) && defined(__linux__)
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 22))) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;  // arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

bool cpu_has(Isa isa) {
#if defined(__x86_64__)
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                           __builtin_cpu_supports("f16c");
  static const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                             __builtin_cpu_supports("avx512vl");
  if (isa == Isa::kAmx) return avx512 && amx_ready();
  return isa == Isa::kGeneric || (isa == Isa::kAvx2 ? avx2 : avx512);
#else
  return isa == Isa::kGeneric;
#endif
}

Isa best_isa() {
  return cpu_has(Isa::kAmx) ? Isa::kAmx : cpu_has(Isa::kAvx512) ? Isa::kAvx512 : cpu_has(Isa::kAvx2) ? Isa::kAvx2 : Isa::kGeneric; }
std::atomic<int> g_forced{-1};  // tests: a slower path on a CPU that has a faster one
Isa isa_now() {
  const int f = g_forced.load(std::memory_order_relaxed);
  return f < 0 ? best_isa() : static_cast<Isa>(f);
}
const char* isa_str(Isa i) {
  return i == Isa::kAmx ? "amx" : i == Isa::kAvx512 ? "avx512" : i == Isa::kAvx2 ? "avx2" : "generic"; }

// -> the path the kernel takes now; force: "avx512", "avx2" or "generic" takes that one (where
// the CPU has it), "amx" too, "auto" restores the choice.
std::string w16_isa(std::optional<std::string> force) {
  if (force) {
    if (*force == "auto") {
      g_forced.store(-1);
    } else {
      TORCH_CHECK(*force == "amx" || *force == "avx512" || *force == "avx2" || *force == "generic",
                  "w16_isa: force must be auto, amx, avx512, avx2 or generic, got ", *force);
      const Isa want = *force == "avx2" ? Isa::kAvx2 : *force == "generic" ? Isa::kGeneric
                       : *force == "amx" ? Isa::kAmx : Isa::kAvx512;
      TORCH_CHECK(cpu_has(want), "w16_isa: this CPU cannot run the ", *force, " path");
      g_forced.store(static_cast<int>(want));
    }
  }
  return isa_str(isa_now());
}

// ---- the scalar path (any CPU): the reference order ------------------------------------------------
inline float to_f32(uint16_t v, bool bf16) {
  if (bf16) {
    const uint32_t b = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &b, 4);
    return f;
  }
  return static_cast<float>(c10::Half(v, c10::Half::from_bits()));
}

void gemm_generic(const float* x, int64_t M, int64_t K, const uint16_t* w, bool bf16, int64_t p0, int64_t p1,
                  const float* bias, float* y, int64_t ldy) {
  std::vector<float> acc(kPanel);
  for (int64_t p = p0; p < p1; ++p) {
    const uint16_t* wp = w + p * K * kPanel;
    for (int64_t m = 0; m < M; ++m) {
      std::fill(acc.begin(), acc.end(), 0.f);
      const float* xm = x + m * K;
      for (int64_t k = 0; k < K; ++k)
        for (int j = 0; j < kPanel; ++j) acc[j] = std::fma(to_f32(wp[k * kPanel + j], bf16), xm[k], acc[j]);
      for (int j = 0; j < kPanel; ++j) y[m * ldy + p * kPanel + j] = bias ? acc[j] + bias[p * kPanel + j] : acc[j];
    }
  }
}

#if defined(__x86_64__)
// ---- AVX-512 -------------------------------------------------------------------------------------
template <Src S>
__attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c"), always_inline)) inline __m512 load_512(const uint8_t* p) {
  if constexpr (S == Src::kF32) {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(p));
  } else if constexpr (S == Src::kF16) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  } else {
    const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  }
}

// MC rows x NV vectors of 16 outputs, over kn steps of k. w: the first vector's k = 0; vector v
// lies at (v / 2) * pstride + (v % 2) * 16 elements (two vectors a panel); a k step is 32 elements.
// acc starts from y (accumulate) or 0; the last K-block adds the bias.
template <int MC, int NV, Src S>
__attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c"))) void tile_512(const uint8_t* w, int64_t pstride,
                                                                             int64_t kn, const float* x, int64_t xk,
                                                                             int64_t xm, float* y, int64_t ldy,
                                                                             bool accumulate, const float* bias) {
  constexpr int64_t es = S == Src::kF32 ? 4 : 2, rec = kPanel * es;
  __m512 acc[MC][NV];
  for (int m = 0; m < MC; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = accumulate ? _mm512_loadu_ps(y + m * ldy + v * 16) : _mm512_setzero_ps();
  const uint8_t* base[NV];
  for (int v = 0; v < NV; ++v) base[v] = w + (v / 2) * pstride + (v % 2) * 16 * es;
  for (int64_t k = 0; k < kn; ++k) {
    if constexpr (NV > 2) {  // few rows, many vectors: the rows' broadcasts stay in registers
      __m512 xb[MC];
      for (int m = 0; m < MC; ++m) xb[m] = _mm512_set1_ps(x[m * xm + k * xk]);
      for (int v = 0; v < NV; ++v) {
        const __m512 wv = load_512<S>(base[v] + k * rec);
        for (int m = 0; m < MC; ++m) acc[m][v] = _mm512_fmadd_ps(wv, xb[m], acc[m][v]);
      }
    } else {  // many rows: the panel's two vectors stay in registers
      __m512 wv[NV];
      for (int v = 0; v < NV; ++v) wv[v] = load_512<S>(base[v] + k * rec);
      for (int m = 0; m < MC; ++m) {
        const __m512 xb = _mm512_set1_ps(x[m * xm + k * xk]);
        for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_fmadd_ps(wv[v], xb, acc[m][v]);
      }
    }
  }
  for (int v = 0; v < NV; ++v) {
    const __m512 b = bias ? _mm512_loadu_ps(bias + v * 16) : _mm512_setzero_ps();
    for (int m = 0; m < MC; ++m) _mm512_storeu_ps(y + m * ldy + v * 16, bias ? _mm512_add_ps(acc[m][v], b) : acc[m][v]);
  }
}

// ---- AVX2 (F16C conversion, FMA) -----------------------------------------------------------------
template <Src S>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline __m256 load_256(const uint8_t* p) {
  if constexpr (S == Src::kF32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  } else if constexpr (S == Src::kF16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else {
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  }
}

// tile_512 with vectors of 8 outputs, four a panel
template <int MC, int NV, Src S>
__attribute__((target("avx2,fma,f16c"))) void tile_avx2(const uint8_t* w, int64_t pstride, int64_t kn, const float* x,
                                                        int64_t xk, int64_t xm, float* y, int64_t ldy, bool accumulate,
                                                        const float* bias) {
  constexpr int64_t es = S == Src::kF32 ? 4 : 2, rec = kPanel * es;
  __m256 acc[MC][NV];
  for (int m = 0; m < MC; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = accumulate ? _mm256_loadu_ps(y + m * ldy + v * 8) : _mm256_setzero_ps();
  const uint8_t* base[NV];
  for (int v = 0; v < NV; ++v) base[v] = w + (v / 4) * pstride + (v % 4) * 8 * es;
  for (int64_t k = 0; k < kn; ++k) {
    __m256 xb[MC];
    for (int m = 0; m < MC; ++m) xb[m] = _mm256_broadcast_ss(x + m * xm + k * xk);
    for (int v = 0; v < NV; ++v) {
      const __m256 wv = load_256<S>(base[v] + k * rec);
      for (int m = 0; m < MC; ++m) acc[m][v] = _mm256_fmadd_ps(wv, xb[m], acc[m][v]);
    }
  }
  for (int v = 0; v < NV; ++v) {
    const __m256 b = bias ? _mm256_loadu_ps(bias + v * 8) : _mm256_setzero_ps();
    for (int m = 0; m < MC; ++m) _mm256_storeu_ps(y + m * ldy + v * 8, bias ? _mm256_add_ps(acc[m][v], b) : acc[m][v]);
  }
}

// one panel's K-block [k0, k0 + kn) -> fp32 [kn, 32] (exact)
template <bool BF16>
__attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c"))) void widen_512(const uint16_t* src, int64_t kn,
                                                                              float* dst) {
  const auto* s = reinterpret_cast<const uint8_t*>(src);
  for (int64_t i = 0; i < kn * 2; ++i)
    _mm512_storeu_ps(dst + i * 16, load_512<BF16 ? Src::kBf16 : Src::kF16>(s + i * 32));
}

template <bool BF16>
__attribute__((target("avx2,fma,f16c"))) void widen_avx2(const uint16_t* src, int64_t kn, float* dst) {
  const auto* s = reinterpret_cast<const uint8_t*>(src);
  for (int64_t i = 0; i < kn * 4; ++i)
    _mm256_storeu_ps(dst + i * 8, load_256<BF16 ? Src::kBf16 : Src::kF16>(s + i * 16));
}

// ---- AMX-BF16 (bf16 weights, 8+ rows): fp32 activations as three exact bf16 parts ------------------
// An fp32 x is hi + mid + lo exactly, each a bf16 (8 significant bits each cover x's 24; only
// parts below bf16's normal range, |x| < ~2^-110, are lost to the tile unit's flush to zero). A
// bf16 weight times a bf16 part is exact in fp32, and the tile unit (TDPBF16PS) adds those
// products into fp32 accumulators: an fp32 GEMM on the exact values in another summation order
// (per output, k in blocks of 32, each block's hi products, then its mid ones, then its lo ones,
// then + bias). No activation is rounded. A tile op does 16 x 16 x 32 multiply-adds where an
// AVX-512 FMA does 16, so from 8 rows on (a batch of 8+ decoding streams) the GEMMs run well
// above the FMA tiles' rate (BENCHMARKS.md).
constexpr int kAmxK = 32;                                  // k per tile step (16 pairs)
constexpr int64_t kAmxMinRows = 8, kAmxMaxRows = 1 << 30;  // rows the AMX path takes (measured: BENCHMARKS.md)
constexpr int kAmxTile = 16 * kAmxK;                       // bf16 values of one activation tile (1 KB)

struct alignas(64) TileCfg {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tiles 0-3: accumulators (two panels x two halves of 16 outputs); 4-6: the activation parts
// (hi, mid, lo) of a row tile's k-block; 7: one half panel's k-block of weights, pairs adjacent
__attribute__((target("amx-tile"))) void amx_config(int mc) {
  TileCfg cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = t == 7 ? kAmxK / 2 : mc;
  }
  _tile_loadconfig(&cfg);
}

// RNE fp32 -> bf16 in integer math (no flush to zero: the parts of small x stay exact), as fp32 bits
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline)) inline __m512i rne_bf16(__m512i b) {
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  return _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
}

// x [M, K] fp32 -> parts [3][Mt][nkb][16][32] bf16: hi, mid, lo, each row tile's k-blocks as
// contiguous 1 KB tiles (rows K apart would share L1 sets); zero past M and K
__attribute__((target("avx512f,avx512bw,avx512vl"))) void amx_split(const float* x, int64_t M, int64_t K,
                                                                    int64_t Mt, int64_t nkb, uint16_t* parts) {
  std::memset(parts, 0, sizeof(uint16_t) * 3 * Mt * nkb * kAmxTile);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; k += 16) {
      const __mmask16 mask = K - k >= 16 ? 0xffff : static_cast<__mmask16>((1u << (K - k)) - 1);
      __m512 r = _mm512_maskz_loadu_ps(mask, x + m * K + k);
      for (int64_t part = 0; part < 3; ++part) {
        const __m512i hb = rne_bf16(_mm512_castps_si512(r));
        r = _mm512_sub_ps(r, _mm512_castsi512_ps(hb));  // exact: hb is r to 8 significant bits
        uint16_t* dst = parts + ((part * Mt + m / 16) * nkb + k / kAmxK) * kAmxTile + (m % 16) * kAmxK + k % kAmxK;
        _mm256_mask_storeu_epi16(dst, mask, _mm512_cvtepi32_epi16(_mm512_srli_epi32(hb, 16)));
      }
    }
  }
}

// k-block [k0, k0 + 32) of one panel [K, 32] -> two weight tiles [16 pairs, 16 outputs, 2]
// (outputs 0-15, 16-31; rows past K zero)
__attribute__((target("avx512f,avx512bw,avx512vl"))) void amx_repack(const uint16_t* panel, int64_t K, int64_t k0,
                                                                     uint16_t* dst) {
  alignas(64) static const uint16_t lo_idx[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                                  8,  40, 9,  41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t r = 0; r < kAmxK / 2; ++r) {
    const int64_t k = k0 + 2 * r;
    const __m512i a = k < K ? _mm512_loadu_si512(panel + k * kPanel) : _mm512_setzero_si512();
    const __m512i b = k + 1 < K ? _mm512_loadu_si512(panel + (k + 1) * kPanel) : _mm512_setzero_si512();
    _mm512_store_si512(dst + r * 32, _mm512_permutex2var_epi16(a, lo, b));
    _mm512_store_si512(dst + kAmxTile + r * 32, _mm512_permutex2var_epi16(a, hi, b));
  }
}

// panels [p0, p1) for all M rows, two panels a pass (the activation tiles serve four weight tiles)
__attribute__((target("avx512f,avx512bw,avx512vl,amx-tile,amx-bf16"))) void gemm_amx(
    const uint16_t* parts, int64_t M, int64_t Mt, int64_t K, int64_t nkb, const uint16_t* w, int64_t p0, int64_t p1,
    const float* bias, float* y, int64_t ldy) {
  alignas(64) uint16_t wt[4][kAmxTile];  // the pass's weight tiles of one k-block
  alignas(64) float acc[16][16];
  int config = 0;
  for (int64_t p = p0; p < p1; p += 2) {
    const int np = p + 1 < p1 ? 2 : 1;
    for (int64_t t = 0; t < Mt; ++t) {
      const int mc = static_cast<int>(std::min<int64_t>(16, M - t * 16));
      if (mc != config) amx_config(config = mc);
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t kb = 0; kb < nkb; ++kb) {
        for (int j = 0; j < np; ++j) amx_repack(w + (p + j) * K * kPanel, K, kb * kAmxK, wt[2 * j]);
        const uint16_t* a = parts + (t * nkb + kb) * kAmxTile;
        const int64_t part = Mt * nkb * kAmxTile;
        _tile_loadd(4, a, 64);
        _tile_loadd(5, a + part, 64);
        _tile_loadd(6, a + 2 * part, 64);
        // (tile numbers are immediates: the four weight tiles spelled out)
        _tile_loadd(7, wt[0], 64);
        _tile_dpbf16ps(0, 4, 7);
        _tile_dpbf16ps(0, 5, 7);
        _tile_dpbf16ps(0, 6, 7);
        _tile_loadd(7, wt[1], 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(1, 5, 7);
        _tile_dpbf16ps(1, 6, 7);
        if (np == 2) {
          _tile_loadd(7, wt[2], 64);
          _tile_dpbf16ps(2, 4, 7);
          _tile_dpbf16ps(2, 5, 7);
          _tile_dpbf16ps(2, 6, 7);
          _tile_loadd(7, wt[3], 64);
          _tile_dpbf16ps(3, 4, 7);
          _tile_dpbf16ps(3, 5, 7);
          _tile_dpbf16ps(3, 6, 7);
        }
      }
      float* out = y + t * 16 * ldy + p * kPanel;
      _tile_stored(0, out, ldy * 4);
      _tile_stored(1, out + 16, ldy * 4);
      if (np == 2) {
        _tile_stored(2, out + 32, ldy * 4);
        _tile_stored(3, out + 48, ldy * 4);
      }
      if (bias) {
        for (int m = 0; m < mc; ++m)
          for (int v = 0; v < 2 * np; ++v)
            _mm512_storeu_ps(out + m * ldy + v * 16, _mm512_add_ps(_mm512_loadu_ps(out + m * ldy + v * 16),
                                                                  _mm512_loadu_ps(bias + p * kPanel + v * 16)));
      }
    }
  }
  _tile_release();
}
#endif

using TileFn = void (*)(const uint8_t*, int64_t, int64_t, const float*, int64_t, int64_t, float*, int64_t, bool,
                       const float*);

#if defined(__x86_64__)
template <int MC, Src S>
TileFn tile_for(Isa isa, int nv) {  // the vector counts the dispatch below asks for
  if (isa == Isa::kAvx512) {
    if constexpr (MC <= 3) {
      if (nv == 8) return &tile_512<MC, 8, S>;
    }
    if constexpr (MC <= 6) {
      if (nv == 4) return &tile_512<MC, 4, S>;
    }
    return &tile_512<MC, 2, S>;
  }
  if constexpr (MC == 1) {
    if (nv == 8) return &tile_avx2<1, 8, S>;
  }
  if constexpr (MC <= 3) return &tile_avx2<MC, 4, S>;
  return nullptr;
}

template <Src S>
TileFn pick_tile(Isa isa, int mc, int nv) {
  switch (mc) {
    case 1: return tile_for<1, S>(isa, nv);
    case 2: return tile_for<2, S>(isa, nv);
    case 3: return tile_for<3, S>(isa, nv);
    case 4: return tile_for<4, S>(isa, nv);
    case 5: return tile_for<5, S>(isa, nv);
    case 6: return tile_for<6, S>(isa, nv);
    case 7: return tile_for<7, S>(isa, nv);
    case 8: return tile_for<8, S>(isa, nv);
    case 9: return tile_for<9, S>(isa, nv);
    case 10: return tile_for<10, S>(isa, nv);
    case 11: return tile_for<11, S>(isa, nv);
    default: return tile_for<12, S>(isa, nv);
  }
}

int tile_rows(Isa isa) { return isa == Isa::kAvx512 ? 12 : 3; }

// x [M, K] -> tiles of `tile` rows, each [K, mc] (k major): the layout gemm_simd reads
void pack_x(const float* x, int64_t M, int64_t K, int tile, float* out) {
  for (int64_t m0 = 0; m0 < M; m0 += tile) {
    const int64_t mc = std::min<int64_t>(tile, M - m0);
    float* o = out + m0 * K;
    for (int64_t i = 0; i < mc; ++i)
      for (int64_t k = 0; k < K; ++k) o[k * mc + i] = x[(m0 + i) * K + k];
  }
}

// Panels [p0, p1) for all M rows on a vector path; x packed by pack_x.
void gemm_simd(Isa isa, const float* x, int64_t M, int64_t K, const uint16_t* w, bool bf16, int64_t p0, int64_t p1,
               const float* bias, float* y, int64_t ldy) {
  const bool avx512 = isa == Isa::kAvx512;
  const int vpp = avx512 ? 2 : 4;          // vectors a panel
  const int big = tile_rows(isa);          // rows of a prefill tile
  const int64_t pstride = K * kPanel * 2;  // bytes between panels
  const auto* wb = reinterpret_cast<const uint8_t*>(w);
  if (M <= big) {  // one row tile: stream the weights once, converting in registers
    // as many panels at once as leave registers for the rows (FMA latency needs >= 8 chains)
    const int group = avx512 ? (M <= 3 ? 4 : M <= 6 ? 2 : 1) : (M == 1 ? 2 : 1);
    const Src src = bf16 ? Src::kBf16 : Src::kF16;
    for (int64_t p = p0; p < p1;) {
      const int g = static_cast<int>(std::min<int64_t>(group, p1 - p)) >= group ? group : 1;
      const TileFn fn = src == Src::kBf16 ? pick_tile<Src::kBf16>(isa, static_cast<int>(M), g * vpp)
                                          : pick_tile<Src::kF16>(isa, static_cast<int>(M), g * vpp);
      fn(wb + p * pstride, pstride, K, x, M, 1, y + p * kPanel, ldy, false, bias ? bias + p * kPanel : nullptr);
      p += g;
    }
    return;
  }
  std::vector<float> buf(kKc * kPanel);
  const auto* bb = reinterpret_cast<const uint8_t*>(buf.data());
  for (int64_t p = p0; p < p1; ++p) {
    for (int64_t k0 = 0; k0 < K; k0 += kKc) {
      const int64_t kn = std::min(kKc, K - k0);
      const uint16_t* src = w + (p * K + k0) * kPanel;
      if (avx512) {
        bf16 ? widen_512<true>(src, kn, buf.data()) : widen_512<false>(src, kn, buf.data());
      } else {
        bf16 ? widen_avx2<true>(src, kn, buf.data()) : widen_avx2<false>(src, kn, buf.data());
      }
      const bool last = k0 + kn == K;
      for (int64_t m0 = 0; m0 < M; m0 += big) {
        const int mc = static_cast<int>(std::min<int64_t>(big, M - m0));
        // x packed by tiles ([K, mc] each): one stream of broadcasts, not mc rows K floats apart
        // (rows 8 KB apart all fall into one L1 set: prefill at K = 2048 ran at 60% of the rate)
        pick_tile<Src::kF32>(isa, mc, vpp)(bb, 0, kn, x + m0 * K + k0 * mc, mc, 1, y + m0 * ldy + p * kPanel, ldy,
                                           k0 > 0, last && bias ? bias + p * kPanel : nullptr);
      }
    }
  }
}
#endif

// 32 weights of one panel row -> fp32 (exact)
void widen32(Isa isa, const uint16_t* src, bool bf16, float* dst) {
#if defined(__x86_64__)
  if (isa == Isa::kAvx512) return bf16 ? widen_512<true>(src, 1, dst) : widen_512<false>(src, 1, dst);
  if (isa == Isa::kAvx2) return bf16 ? widen_avx2<true>(src, 1, dst) : widen_avx2<false>(src, 1, dst);
#endif
  for (int j = 0; j < kPanel; ++j) dst[j] = to_f32(src[j], bf16);
}

// From kBlasRows rows on (long prefills) torch's fp32 GEMM on the weights widened to fp32 a chunk
// of panels at a time (~1 MB of fp32 each, 256 columns and up: beside the GEMM's in L2) is faster than our tiles: 512 rows
// of 8192 x 2048 on one thread, ~150 ms against ~210-240 (a loaded machine; BENCHMARKS.md). Its
// summation order is torch's, the same on every path of ours (AVX2 alone takes it earlier: blas_rows).
constexpr int64_t kBlasRows = 256;
// AVX2 alone: our 8-lane tiles run ~27 GMAC/s (Zen 3, 2 threads) where torch's GEMM reaches 40-60
// from a few dozen rows. Against the tiles, per matrix (paired runs in one process): 3072 x 576 and
// 576 x 1536 1.6-1.7x at 64 rows, 1.9-2.1x at 128 (0.9-1.06x below 64), 8192 x 2048 and
// 2048 x 8192 1.0-1.2x at 16 rows, 1.3-1.4x at 24, 1.45-1.9x at 32-64, 2.2x at 128: the widening
// is paid once a call, so a large matrix pays it back from fewer rows.
int64_t blas_rows(Isa isa, int64_t N, int64_t K) {
  if (isa != Isa::kAvx2) return kBlasRows;
  return N * K >= (int64_t{1} << 22) ? 24 : 64;
}
constexpr int64_t kBlasBytes = 1 << 20;

void gemm_blas(Isa isa, const at::Tensor& xc, const uint16_t* w, bool bf16, int64_t P, const float* bias,
               at::Tensor& y) {
  const int64_t K = xc.size(1);
  const int64_t chunk = std::min(P, std::max<int64_t>(8, kBlasBytes / (K * kPanel * 4)));  // panels a call
  std::vector<float> buf(K * chunk * kPanel);
  for (int64_t p0 = 0; p0 < P; p0 += chunk) {
    const int64_t np = std::min(chunk, P - p0), cols = np * kPanel;
    at::parallel_for(0, K, 64, [&](int64_t k0, int64_t k1) {
      for (int64_t k = k0; k < k1; ++k)
        for (int64_t p = 0; p < np; ++p) widen32(isa, w + ((p0 + p) * K + k) * kPanel, bf16, &buf[k * cols + p * kPanel]);
    });
    const at::Tensor wt = at::from_blob(buf.data(), {K, cols}, xc.options());
    at::Tensor out = y.narrow(1, p0 * kPanel, cols);  // written in place (the GEMM takes its row stride)
    at::mm_out(out, xc, wt);
    if (bias) out.add_(at::from_blob(const_cast<float*>(bias) + p0 * kPanel, {cols}, xc.options()));
  }
}

at::Tensor w16_gemm(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "w16_gemm: x must be fp32 [M, K]");
  TORCH_CHECK(w.dim() == 3 && w.size(2) == kPanel && w.is_contiguous() &&
              (w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kHalf),
              "w16_gemm: the weight must be contiguous bf16 or fp16 [N/32, K, 32]");
  const int64_t M = x.size(0), K = x.size(1), P = w.size(0);
  TORCH_CHECK(w.size(1) == K, "w16_gemm: x has K = ", K, " but the weight ", w.size(1));
  const float* b = nullptr;
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == P * kPanel && bias->scalar_type() == at::kFloat &&
                bias->is_contiguous(), "w16_gemm: bias must be contiguous fp32 [32 * panels]");
    b = bias->data_ptr<float>();
  }
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, P * kPanel}, x.options());
  if (M == 0 || P == 0) return y;
  if (K == 0) return b ? bias->unsqueeze(0).expand({M, P * kPanel}).clone() : y.zero_();
  const bool bf16 = w.scalar_type() == at::kBFloat16;
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const Isa chosen = isa_now();
#if defined(__x86_64__)
  if (chosen == Isa::kAmx && bf16 && M >= kAmxMinRows && M < kAmxMaxRows) {
    const int64_t Mt = (M + 15) / 16, nkb = (K + kAmxK - 1) / kAmxK;
    std::vector<uint16_t> parts(3 * Mt * nkb * kAmxTile);
    amx_split(xp, M, K, Mt, nkb, parts.data());
    const int64_t grain = std::max<int64_t>(2, (128 << 10) / (K * kPanel * 2));
    at::parallel_for(0, (P + 1) / 2, (grain + 1) / 2, [&](int64_t q0, int64_t q1) {  // pairs of panels
      gemm_amx(parts.data(), M, Mt, K, nkb, wp, 2 * q0, std::min(P, 2 * q1), b, yp, P * kPanel);
    });
    return y;
  }
#endif
  // below kAmxMinRows (and fp16 weights) the AMX path takes the AVX-512 one
  const Isa isa = chosen == Isa::kAmx ? Isa::kAvx512 : chosen;
  if (M >= blas_rows(isa, P * kPanel, K)) {
    gemm_blas(isa, xc, wp, bf16, P, b, y);
    return y;
  }
  std::vector<float> packed;
  if (isa != Isa::kGeneric && M > 1) {
    packed.resize(M * K);
    pack_x(xp, M, K, tile_rows(isa), packed.data());
  }
  const float* xs = packed.empty() ? xp : packed.data();
  // a chunk of at least ~128 KB of weights per thread task
  const int64_t grain = std::max<int64_t>(1, (128 << 10) / (K * kPanel * 2));
  at::parallel_for(0, P, grain, [&](int64_t p0, int64_t p1) {
#if defined(__x86_64__)
    if (isa != Isa::kGeneric) return gemm_simd(isa, xs, M, K, wp, bf16, p0, p1, b, yp, P * kPanel);
#endif
    gemm_generic(xp, M, K, wp, bf16, p0, p1, b, yp, P * kPanel);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(localllm, m) {
  m.def("w16_gemm(Tensor x, Tensor w, Tensor? bias=None) -> Tensor");
  m.def("w16_isa(str? force=None) -> str", &w16_isa);  // no tensors: one kernel for every key
}

TORCH_LIBRARY_IMPL(localllm, CPU, m) { m.impl("w16_gemm", &w16_gemm); }
