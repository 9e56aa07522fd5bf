// Weights of up to 8 bits in int8 lanes x fp32 activations: the GEMM for the GGUF types wider
// than 4 bits (Q8_0, Q6_K, Q5_K, Q5_0, Q5_1) and those whose values are not an affine 4-bit grid
// (IQ4_NL, IQ4_XS, MXFP4: codebook entries; Q3_K, Q2_K: 16-value groups), each repacked exactly at
// load (localllm_kernels.cpu_int8.pack). Without it those tensors were dequantized to fp32: 4 bytes
// a weight instead of 0.56-1.25 here (values and scales), and decode is bound by the bytes read.
// moe_int8w (at the end) runs a mixture-of-experts MLP on experts stacked in these layouts.
//
// Arithmetic as int4_gemm.cpp's (same 16-bit activation rule): per 32-block the activations are
// split into two int8 parts, x = e * (p0 + p1/254), and each part meets the u8 weights in
// VPDPBUSD (AVX-512 VNNI) or VPMADDUBSW + VPMADDWD (AVX2), giving exact int32 sums per group;
// a scalar path (any CPU) computes the same integers. The fp32 steps after them are the same
// operations in the same order on every path (the activations' parts, scales and group sums
// come from one scalar routine), so the three paths give bit-identical outputs. One exception:
// on the AVX2 path, prefill-sized calls (dense_wins) take dense_gemm (fp32 GEMM on the exactly
// dequantized weights; see there).
//
// Layouts (`planes`, told by w's shape):
//   bytes (planes -1): w uint8 [N/16, K/4, 64]: chunk c of a 16-row block holds, at byte 4r + j,
//      q[r, 4c + j]: 16 dword lanes of 4 consecutive weights each (one row per lane). 8-bit types.
//   nibbles and high bits (planes P = 0, 1, 2: values of 4 + P bits): w uint8 [N/16, K/8,
//      64 + 16P]: per 8 columns c, 64 bytes as int4_gemm's layout (byte 4r + j: q[r, 8c + j] & 15
//      in its low nibble, q[r, 8c + 4 + j] & 15 in its high one), then the values' bits 4.. :
//      P = 1: 16 bytes; bit 4 of the low (u = 0) or high (u = 1) nibble's value at nibble byte b
//      is bit 4 (b / 32) + 2u + (b / 16) % 2 of byte b % 16;
//      P = 2: 32 bytes of 2-bit pairs (q >> 4): byte i holds, from its low bits up, those of the
//      low and the high nibble value of nibble byte i (rows 0-7), then of nibble byte 32 + i (rows
//      8-15).
//      So one shift (per 128-bit lane for P = 1) and one AND put them above each half's nibbles.
//      The kernel rebuilds the byte lanes in registers, so a 5-bit type streams 0.625 bytes a
//      weight and a 6-bit one 0.75, not 1. (They were bit planes, one 64-bit mask per bit and
//      nibble: on AVX2, rebuilding bytes from bits cost ~35% of Q6_K's decode, 1B shape's 64 Q6_K
//      matrices at batch 1, 11.4 -> 17.1 GB/s on 1 thread with the pairs; Q5_K_M's 72 matrices
//      11.7-13.0 -> 14.1-14.2 with the shifted bits.)
//   sc half or float [N/16, G, S, 16], group size 16 or 32: S = 2: per group 16 scales d, then
//      16 offsets m, W = d * q + m; S = 1: scales only, W = d * (q - z) (symmetric types).
//   z: the zero point the kernel centers q by in int32 (exact): 2^(bits-1); with S = 1 it is the
//      type's own, with S = 2 that of the widest part of a stack (the offset m + z d takes the rest).
// y[m, n] = sum_g d[n,g] * sum_k (q[n,k] - z) x[m,k] + (m[n,g] + z d[n,g]) * sum_k x[m,k]  (k in g)
//
// On the AVX2 path VPMADDUBSW's int16 pair sums must not saturate: 2 * 255 * 127 would, so 8-bit
// weights (z = 128) take its signed form there: |q - 128| times x with q - 128's sign (VPSIGNB),
// which gives sum (q - 128) x directly; values of at most 6 bits (z <= 32) let two chunks' pair
// sums add in int16 before widening (2 * 2 * 63 * 127 = 32004).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/floor_divide.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/add.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/clamp_max.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "act_quant.h"
#include "group_scales.h"
#include "moe_route.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr int kRows = 16;  // output rows per block
constexpr int kMc = 6;     // activation rows per tile (AVX-512: 2 * kMc int32 chains, as int4_gemm)
using act_quant::kBase;
using act_quant::kMcAvx2;
using act_quant::kParts;
constexpr int64_t kWeightChunk = 64 * 1024;  // ~L2's share of weights that meets every tile (int4_gemm)
constexpr int64_t kPrefetch = 4096;  // decode streams weights once: ask for them 4 KB ahead

// Per activation row and 32-block: each part's sums over the block's two 16-halves (the kernel
// centers the weights by z with them) and the block scale e.
struct Meta {
  int32_t ps[kParts][2];
  float e;
  float pad;
};

// The activations in tiles of `tile` rows (act_quant.h); s: group sums [G, mt].
using Tiled = act_quant::Tiled<Meta>;

enum class Isa { kVnni, kAvx2, kGeneric };

bool cpu_has(Isa isa) {
#if defined(__x86_64__)
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                           __builtin_cpu_supports("f16c");
  static const bool vnni = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  return isa == Isa::kGeneric || (isa == Isa::kAvx2 ? avx2 : vnni);
#else
  return isa == Isa::kGeneric;
#endif
}

Isa best_isa() { return cpu_has(Isa::kVnni) ? Isa::kVnni : cpu_has(Isa::kAvx2) ? Isa::kAvx2 : Isa::kGeneric; }
std::atomic<int> g_forced{-1};  // tests: a slower path on a CPU that has a faster one
Isa isa_now() {
  const int f = g_forced.load(std::memory_order_relaxed);
  return f < 0 ? best_isa() : static_cast<Isa>(f);
}
const char* isa_str(Isa i) { return i == Isa::kVnni ? "avx512_vnni" : i == Isa::kAvx2 ? "avx2" : "generic"; }

// -> the path the kernel takes now; force: "avx2" or "generic" takes that one (where the CPU has
// it), "auto" restores the choice.
std::string int8w_isa(std::optional<std::string> force) {
  if (force) {
    if (*force == "auto") {
      g_forced.store(-1);
    } else {
      const Isa want = *force == "avx2" ? Isa::kAvx2 : *force == "generic" ? Isa::kGeneric : Isa::kVnni;
      TORCH_CHECK(*force == "avx2" || *force == "generic" || *force == "avx512_vnni",
                  "int8w_isa: force must be auto, avx512_vnni, avx2 or generic, got ", *force);
      TORCH_CHECK(cpu_has(want), "int8w_isa: this CPU cannot run the ", *force, " path");
      g_forced.store(static_cast<int>(want));
    }
  }
  return isa_str(isa_now());
}

// The sum of 16 floats in one fixed tree (lanes i and i + 8, then i + 4, i + 2, i + 1), the
// order AVX-512's halving reductions take: every path computes the group sums the same way.
inline float tree16(float* t) {
  for (int w = 8; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) t[i] = t[i] + t[i + w];
  return t[0];
}

// x rows [m0, m1) -> the tiled parts, as int4_gemm's quantize_rows computes them (round to
// nearest even, the last part clamped to +-127), group sums by tree16: the scalar path's form;
// quantize_512 and quantize_avx2 are the same arithmetic in intrinsics.
__attribute__((always_inline)) inline void quantize_impl(const float* x, const Tiled& q, int64_t gs, int64_t m0,
                                                         int64_t m1) {
  const int64_t K = q.K, nb = q.nb;
  for (int64_t m = m0; m < m1; ++m) {
    const int64_t t = m / q.tile, i = m % q.tile;
    const int mt = q.mt(t);
    int8_t* tp = q.tparts(t);
    Meta* tm = q.tmeta(t);
    float* ts = q.ts(t);
    for (int64_t blk = 0; blk < nb; ++blk) {
      const float* xb = x + m * K + blk * 32;
      float mx[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};  // (independent chains; max is exact)
      for (int j = 0; j < 32; ++j) mx[j % 8] = std::max(mx[j % 8], std::fabs(xb[j]));
      const float amax = std::max(std::max(std::max(mx[0], mx[1]), std::max(mx[2], mx[3])),
                                  std::max(std::max(mx[4], mx[5]), std::max(mx[6], mx[7])));
      const bool live = amax > 1e-30f;  // zeros or denormals contribute nothing
      const float inv = live ? 127.f / amax : 0.f;
      Meta& bm = tm[blk * mt + i];
      bm.e = live ? amax / 127.f : 0.f;
      float tr[16];
      if (gs == 16) {
        for (int h = 0; h < 2; ++h) {
          for (int j = 0; j < 16; ++j) tr[j] = xb[16 * h + j];
          ts[(2 * blk + h) * mt + i] = tree16(tr);
        }
      } else {
        for (int j = 0; j < 16; ++j) tr[j] = xb[j] + xb[16 + j];
        ts[blk * mt + i] = tree16(tr);
      }
      int8_t* dst = tp + (blk * mt + i) * q.np * 32;
      float r[32];
      for (int j = 0; j < 32; ++j) r[j] = xb[j] * inv;
      for (int p = 0; p < q.np; ++p) {
        int32_t qi[32];
        for (int j = 0; j < 32; ++j) {
          float qf = __builtin_roundevenf(r[j]);
          if (p == q.np - 1) qf = std::min(127.f, std::max(-127.f, qf));
          qi[j] = static_cast<int32_t>(qf);
          r[j] = (r[j] - qf) * kBase;
        }
        int32_t s0 = 0, s1 = 0;
        for (int j = 0; j < 16; ++j) s0 += qi[j];
        for (int j = 16; j < 32; ++j) s1 += qi[j];
        for (int j = 0; j < 32; ++j) dst[p * 32 + j] = static_cast<int8_t>(qi[j]);
        bm.ps[p][0] = s0;
        bm.ps[p][1] = s1;
      }
    }
  }
}

#if defined(__x86_64__)
__attribute__((target("avx512f"))) inline float tree16_512(__m512 v) {
  const __m256 t8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
  const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
  return _mm_cvtss_f32(t2) + _mm_cvtss_f32(_mm_shuffle_ps(t2, t2, 1));
}

// quantize_impl in AVX-512 (6x faster at 512 x 1536: the compiler kept roundeven scalar)
template <int P>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void quantize_512(const float* x, const Tiled& q, int64_t gs,
                                                                       int64_t m0, int64_t m1) {
  const int64_t K = q.K, nb = q.nb;
  for (int64_t m = m0; m < m1; ++m) {
    const int64_t t = m / q.tile, i = m % q.tile;
    const int mt = q.mt(t);
    int8_t* tp = q.tparts(t);
    Meta* tm = q.tmeta(t);
    float* ts = q.ts(t);
    for (int64_t blk = 0; blk < nb; ++blk) {
      const float* xb = x + m * K + blk * 32;
      const __m512 v[2] = {_mm512_loadu_ps(xb), _mm512_loadu_ps(xb + 16)};
      Meta& bm = tm[blk * mt + i];
      bm.e = act_quant::block_512<P>(v, tp + (blk * mt + i) * P * 32, bm.ps);
      if (gs == 16) {
        ts[(2 * blk) * mt + i] = tree16_512(v[0]);
        ts[(2 * blk + 1) * mt + i] = tree16_512(v[1]);
      } else {
        ts[blk * mt + i] = tree16_512(_mm512_add_ps(v[0], v[1]));
      }
    }
  }
}

__attribute__((target("avx2,fma"))) inline float tree16_avx2(__m256 a, __m256 b) {  // lanes 0-7, 8-15
  const __m256 t8 = _mm256_add_ps(a, b);
  const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
  const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
  return _mm_cvtss_f32(t2) + _mm_cvtss_f32(_mm_shuffle_ps(t2, t2, 1));
}

// quantize_impl in AVX2 intrinsics (int4_gemm.cpp's quantize_rows_avx2 with tree16 sums)
template <int P>
__attribute__((target("avx2,fma"))) void quantize_avx2(const float* x, const Tiled& q, int64_t gs, int64_t m0,
                                                       int64_t m1) {
  const int64_t K = q.K, nb = q.nb;
  for (int64_t m = m0; m < m1; ++m) {
    const int64_t t = m / q.tile, i = m % q.tile;
    const int mt = q.mt(t);
    int8_t* tp = q.tparts(t);
    Meta* tm = q.tmeta(t);
    float* ts = q.ts(t);
    for (int64_t blk = 0; blk < nb; ++blk) {
      const float* xb = x + m * K + blk * 32;
      __m256 v[4];
      for (int h = 0; h < 4; ++h) v[h] = _mm256_loadu_ps(xb + 8 * h);
      Meta& bm = tm[blk * mt + i];
      bm.e = act_quant::block_avx2<P>(v, tp + (blk * mt + i) * P * 32, bm.ps);
      if (gs == 16) {
        ts[(2 * blk) * mt + i] = tree16_avx2(v[0], v[1]);
        ts[(2 * blk + 1) * mt + i] = tree16_avx2(v[2], v[3]);
      } else {
        ts[blk * mt + i] = tree16_avx2(_mm256_add_ps(v[0], v[2]), _mm256_add_ps(v[1], v[3]));
      }
    }
  }
}
#endif
void quantize_generic(const float* x, const Tiled& q, int64_t gs, int64_t m0, int64_t m1) {
  quantize_impl(x, q, gs, m0, m1);
}
// each path quantizes with its own code (the activations are the same bit for bit: tests compare
// the three paths' outputs)
void quantize_rows(Isa isa, const float* x, const Tiled& q, int64_t gs, int64_t m0, int64_t m1) {
#if defined(__x86_64__)
  if (isa == Isa::kVnni) return q.np == 1 ? quantize_512<1>(x, q, gs, m0, m1) : quantize_512<2>(x, q, gs, m0, m1);
  if (isa == Isa::kAvx2) return q.np == 1 ? quantize_avx2<1>(x, q, gs, m0, m1) : quantize_avx2<2>(x, q, gs, m0, m1);
#endif
  quantize_generic(x, q, gs, m0, m1);
}

using group_scales::Flat;
using group_scales::Super;

// the IQ4 codebook (ggml's kvalues_iq4nl) + 128, what 4-bit indices with zero point 128 stand for
constexpr uint8_t kIq4[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};
// MXFP4's E2M1 values doubled (ggml's kvalues_mxfp4) + 16, what 4-bit indices with zero point 16 stand for
constexpr uint8_t kMx[16] = {16, 17, 18, 19, 20, 22, 24, 28, 16, 15, 14, 13, 12, 10, 8, 4};
constexpr int kLut = -2;    // `planes` of 4-bit codebook indices (the nibble layout, values from kIq4)
constexpr int kLutMx = -3;  // the same with kMx's values (below 64: the AVX2 path's unsigned form)
constexpr bool is_lut(int planes) { return planes == kLut || planes == kLutMx; }
constexpr const uint8_t* codebook(int planes) { return planes == kLutMx ? kMx : kIq4; }

// The scalar path: the same int32 sums and the same fp32 operations (std::fma where the vector
// paths fuse) as the vector paths, one output lane at a time.
// Bytes of one 32-column block of a 16-row block, and q[r, k] (k < 32) within it.
inline int64_t block_bytes(int planes) { return planes == -1 ? 8 * 64 : 4 * (64 + 16 * std::max(planes, 0)); }
inline int weight_at(const uint8_t* wb, int planes, int r, int k) {
  if (is_lut(planes)) return codebook(planes)[weight_at(wb, 0, r, k)];
  if (planes < 0) return wb[(k / 4) * 64 + 4 * r + k % 4];
  const uint8_t* rec = wb + (k / 8) * (64 + 16 * planes);
  const int j = k % 8, bit = 4 * r + j % 4;
  int v = j < 4 ? rec[bit] & 15 : rec[bit] >> 4;
  if (planes == 2) return v | ((rec[64 + bit % 32] >> (4 * (bit / 32) + 2 * (j / 4))) & 3) << 4;
  if (planes == 1) return v | ((rec[64 + bit % 16] >> (4 * (bit / 32) + 2 * (j / 4) + (bit / 16) % 2)) & 1) << 4;
  return v;
}

template <class F>
void block_rows_generic(int mc, int planes, const uint8_t* w, const typename F::E* sc, int64_t K, int64_t gs, int z,
                        const int8_t* px, const Meta* meta, const float* s, float* out, int64_t ldo, int np) {
  const int64_t nb = K / 32, hpg = gs / 16;  // 16-halves per group
  const float inv_base = 1.f / kBase, zf = static_cast<float>(z);
  for (int r = 0; r < kRows; ++r) {
    for (int m = 0; m < mc; ++m) {
      float acc = 0.f;
      for (int64_t blk = 0; blk < nb; ++blk) {
        const int8_t* xb = px + (blk * mc + m) * np * 32;
        const Meta& bm = meta[blk * mc + m];
        const uint8_t* wb = w + blk * block_bytes(planes);
        for (int64_t h0 = 0; h0 < 2; h0 += hpg) {  // the block's groups
          int32_t c[kParts] = {0, 0};
          for (int p = 0; p < np; ++p) {
            int32_t sum = 0, psum = 0;
            for (int64_t h = h0; h < h0 + hpg; ++h) {
              psum += bm.ps[p][h];
              for (int cc = 4 * h; cc < 4 * h + 4; ++cc)
                for (int j = 0; j < 4; ++j) sum += weight_at(wb, planes, r, cc * 4 + j) * xb[p * 32 + cc * 4 + j];
            }
            c[p] = sum - z * psum;
          }
          const float t = np == 2 ? std::fma(static_cast<float>(c[1]), inv_base, static_cast<float>(c[0])) : static_cast<float>(c[0]);
          const float ge = t * bm.e;
          const int64_t g = blk * (2 / hpg) + h0 / hpg;
          const float d = F::d(sc, g, r);
          acc = std::fma(ge, d, acc);
          if constexpr (F::kOff) {
            const float off = std::fma(zf, d, F::m(sc, g, r));
            acc = std::fma(off, s[g * mc + m], acc);
          }
        }
      }
      out[m * ldo + r] = acc;
    }
  }
}

#if defined(__x86_64__)

// lo, hi (a record's 64 low- and high-nibble values, rows 0-15) += their bits 4.. from the record
// (P = 1: the 16 bytes in each 16-byte lane, a bit per lane and nibble tested into a mask for a
// masked add; P = 2: the 2-bit pairs, shifted per half: rows 0-7 take bits 0-1 (lo) and 2-3 (hi) of
// each byte, rows 8-15 bits 4-5 and 6-7)
template <int PL>
__attribute__((target("avx512f,avx512bw"))) inline void high_bits_512(const uint8_t* rec, __m512i& lo, __m512i& hi) {
  if constexpr (PL == 1) {
    const __m512i bits = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 64)));
    // the bit each 16-byte lane (nibble bytes 16l..16l + 15) takes: lo 0, 1, 4, 5; hi 2, 3, 6, 7
    const __m512i sel_lo = _mm512_setr_epi32(0x01010101, 0x01010101, 0x01010101, 0x01010101, 0x02020202, 0x02020202,
                                             0x02020202, 0x02020202, 0x10101010, 0x10101010, 0x10101010, 0x10101010,
                                             0x20202020, 0x20202020, 0x20202020, 0x20202020);
    const __m512i sel_hi = _mm512_slli_epi32(sel_lo, 2);
    const __m512i add = _mm512_set1_epi8(16);
    lo = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(bits, sel_lo), lo, add);
    hi = _mm512_mask_add_epi8(hi, _mm512_test_epi8_mask(bits, sel_hi), hi, add);
  } else if constexpr (PL == 2) {
    const __m512i pairs = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64)));
    const __m512i shift = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_setzero_si256(), 1);  // rows 0-7: 4
    const __m512i m30 = _mm512_set1_epi8(0x30);
    lo = _mm512_or_si512(lo, _mm512_and_si512(_mm512_sllv_epi16(pairs, shift), m30));
    hi = _mm512_or_si512(hi, _mm512_and_si512(_mm512_sllv_epi16(_mm512_srli_epi16(pairs, 2), shift), m30));
  }
}

// the same for one 8-row half of a record (AVX2): half 0 is rows 0-7
template <int PL>
__attribute__((target("avx2"))) inline void high_bits_avx2(const uint8_t* rec, int half, __m256i& lo, __m256i& hi) {
  if constexpr (PL == 1) {  // bit 4 (half) + 2u + lane of each byte to bit 4: a shift per 128-bit lane
    const __m256i bits = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 64)));
    const __m256i m10 = _mm256_set1_epi8(0x10);
    if (half == 0) {
      lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_sllv_epi32(bits, _mm256_setr_epi32(4, 4, 4, 4, 3, 3, 3, 3)), m10));
      hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_sllv_epi32(bits, _mm256_setr_epi32(2, 2, 2, 2, 1, 1, 1, 1)), m10));
    } else {
      lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_srlv_epi32(bits, _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1)), m10));
      hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_srlv_epi32(bits, _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3)), m10));
    }
  } else if constexpr (PL == 2) {
    const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64));
    const __m256i m30 = _mm256_set1_epi8(0x30);
    if (half == 0) {
      lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(pairs, 4), m30));
      hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(pairs, 2), m30));
    } else {
      lo = _mm256_or_si256(lo, _mm256_and_si256(pairs, m30));
      hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_srli_epi16(pairs, 2), m30));
    }
  }
}

// acc += w . (4 int8 at p, broadcast to every lane), the broadcast folded into the instruction
// (int4_gemm.cpp's dot4)
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline __m512i dot4(__m512i acc, __m512i w,
                                                                           const int8_t* p) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
}

// One 16-row block against a tile of MC rows; SPLIT independent chains per row and part (few rows
// give few chains, and VPDPBUSD's latency would bound them). G16: groups of 16 (two per block).
template <int MC, int SPLIT, bool G16, class F, int PL, int P>
__attribute__((target("avx512f,avx512bw,avx512vnni,f16c"))) void block_rows_512(
    const uint8_t* w, const typename F::E* sc, int64_t K, int z, const int8_t* px, const Meta* meta, const float* s, float* out,
    int64_t ldo) {
  const int64_t nb = K / 32;
  constexpr int kGroups = G16 ? 2 : 1, kChunks = 8 / kGroups;
  constexpr int kRec = 64 + 16 * std::max(PL, 0);  // bytes per 8 columns (PL >= 0 or a codebook)
  const __m512 inv_base = _mm512_set1_ps(1.f / kBase), zf = _mm512_set1_ps(static_cast<float>(z));
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const __m512i lut = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codebook(PL))));
  __m512 acc[MC];
  for (int m = 0; m < MC; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t blk = 0; blk < nb; ++blk) {
    const int8_t* xb = px + blk * MC * P * 32;
    const Meta* bm = meta + blk * MC;
    const uint8_t* wb = w + blk * (PL == -1 ? 8 * 64 : 4 * kRec);
    for (int h = 0; h < kGroups; ++h) {
      __m512i ip[MC][P][SPLIT];
      for (int m = 0; m < MC; ++m)
        for (int p = 0; p < P; ++p)
          for (int j = 0; j < SPLIT; ++j)
            ip[m][p][j] = j ? _mm512_setzero_si512()
                            : _mm512_set1_epi32(-z * (G16 ? bm[m].ps[p][h] : bm[m].ps[p][0] + bm[m].ps[p][1]));
      if constexpr (PL == -1) {
        for (int cc = 0; cc < kChunks; ++cc) {
          const int c = h * kChunks + cc;
          _mm_prefetch(reinterpret_cast<const char*>(wb + kPrefetch + c * 64), _MM_HINT_T0);
          const __m512i raw = _mm512_loadu_si512(wb + c * 64);
          for (int m = 0; m < MC; ++m)
            for (int p = 0; p < P; ++p)
              ip[m][p][cc % SPLIT] = dot4(ip[m][p][cc % SPLIT], raw, xb + (m * P + p) * 32 + c * 4);
        }
      } else {
        for (int cc = 0; cc < kChunks; cc += 2) {  // one record: chunks c (low nibbles) and c + 1
          const int c = h * kChunks + cc;
          const uint8_t* rec = wb + (c / 2) * kRec;
          _mm_prefetch(reinterpret_cast<const char*>(rec + kPrefetch), _MM_HINT_T0);
          const __m512i raw = _mm512_loadu_si512(rec);
          __m512i lo = _mm512_and_si512(raw, nib), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nib);
          high_bits_512<PL>(rec, lo, hi);
          if constexpr (is_lut(PL)) {  // indices -> the codebook's values (+ z), in registers
            lo = _mm512_shuffle_epi8(lut, lo);
            hi = _mm512_shuffle_epi8(lut, hi);
          }
          for (int m = 0; m < MC; ++m)
            for (int p = 0; p < P; ++p) {
              const int8_t* xp = xb + (m * P + p) * 32 + c * 4;
              ip[m][p][cc % SPLIT] = dot4(ip[m][p][cc % SPLIT], lo, xp);
              ip[m][p][(cc + 1) % SPLIT] = dot4(ip[m][p][(cc + 1) % SPLIT], hi, xp + 4);
            }
        }
      }
      const int64_t g = blk * kGroups + h;
      const __m512 d = F::d16(sc, g);
      __m512 off = _mm512_setzero_ps();
      if constexpr (F::kOff) off = _mm512_fmadd_ps(zf, d, F::m16(sc, g));
      for (int m = 0; m < MC; ++m) {
        __m512i c[P];
        for (int p = 0; p < P; ++p) {
          c[p] = ip[m][p][0];
          for (int j = 1; j < SPLIT; ++j) c[p] = _mm512_add_epi32(c[p], ip[m][p][j]);
        }
        __m512 t = _mm512_cvtepi32_ps(c[0]);
        if constexpr (P == 2) t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c[1]), inv_base, t);
        acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(t, _mm512_set1_ps(bm[m].e)), d, acc[m]);
        if constexpr (F::kOff) acc[m] = _mm512_fmadd_ps(off, _mm512_set1_ps(s[g * MC + m]), acc[m]);
      }
    }
  }
  for (int m = 0; m < MC; ++m) _mm512_storeu_ps(out + m * ldo, acc[m]);
}


// A 16-row block in nibbles and `planes` high bits -> the same weights in byte lanes, with the
// instructions the kernels rebuild them with in registers.
__attribute__((target("avx512f,avx512bw"))) void widen_block_512(const uint8_t* src, int planes, int64_t K,
                                                                   uint8_t* dst) {
  const int np = std::max(planes, 0), rec = 64 + 16 * np;
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const __m512i lut = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codebook(planes))));
  for (int64_t c = 0; c < K / 8; ++c) {
    const uint8_t* r = src + c * rec;
    const __m512i raw = _mm512_loadu_si512(r);
    __m512i lo = _mm512_and_si512(raw, nib), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nib);
    if (planes == 1) high_bits_512<1>(r, lo, hi);
    if (planes == 2) high_bits_512<2>(r, lo, hi);
    if (is_lut(planes)) {
      lo = _mm512_shuffle_epi8(lut, lo);
      hi = _mm512_shuffle_epi8(lut, hi);
    }
    _mm512_storeu_si512(dst + 2 * c * 64, lo);
    _mm512_storeu_si512(dst + (2 * c + 1) * 64, hi);
  }
}

__attribute__((target("avx2"))) void widen_block_avx2(const uint8_t* src, int planes, int64_t K, uint8_t* dst) {
  const int np = std::max(planes, 0), rec = 64 + 16 * np;
  const __m256i nib = _mm256_set1_epi8(0x0F);
  const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codebook(planes))));
  for (int64_t c = 0; c < K / 8; ++c) {
    const uint8_t* r = src + c * rec;
    for (int half = 0; half < 2; ++half) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + 32 * half));
      __m256i lo = _mm256_and_si256(raw, nib), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nib);
      if (planes == 1) high_bits_avx2<1>(r, half, lo, hi);
      if (planes == 2) high_bits_avx2<2>(r, half, lo, hi);
      if (is_lut(planes)) {
        lo = _mm256_shuffle_epi8(lut, lo);
        hi = _mm256_shuffle_epi8(lut, hi);
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 2 * c * 64 + 32 * half), lo);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + (2 * c + 1) * 64 + 32 * half), hi);
    }
  }
}

// an activation part's 4 int8 at columns 4c.. of its 32-block, in every dword lane
__attribute__((target("avx2"))) inline __m256i xs(const int8_t* xp, int c) {
  int32_t x4;
  std::memcpy(&x4, xp + c * 4, 4);
  return _mm256_set1_epi32(x4);
}

// The AVX2 path, one 8-row half of the block at a time (a chunk's first 32 bytes are rows 0-7).
// SIGNED: 8-bit weights, z = 128 (see the top).
// NH = 2 at one activation row (decode): both 8-row halves from each chunk as it arrives, sharing
// the activations' broadcasts (int4_gemm.cpp's block_rows_avx2 says why: the halves one after the
// other leave the memory idle during the second pass). Byte lanes: the signed form (8-bit values)
// takes one chunk at a time, which leaves registers for both halves; the unsigned one (values below
// 64, two chunks' pair sums added in int16) keeps one half (with both, GCC spilled). Byte lanes
// prefetch every chunk's line: with one prefetch per two chunks (as before), 8-bit decode at the 1B
// shape streamed 16 GB/s at 2 threads; with every line 29 (this machine's read bandwidth: 29.5).
template <int MC, bool G16, class F, bool SIGNED, int PL, int P>
__attribute__((target("avx2,fma,f16c"))) void block_rows_avx2(const uint8_t* w, const typename F::E* sc, int64_t K, int z,
                                                               const int8_t* px, const Meta* meta, const float* s,
                                                               float* out, int64_t ldo) {
  constexpr int NH = MC == 1 && (PL != -1 || SIGNED) ? 2 : 1;
  const int64_t nb = K / 32;
  constexpr int kGroups = G16 ? 2 : 1, kChunks = 8 / kGroups;
  constexpr int kRec = 64 + 16 * std::max(PL, 0);
  const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i nib = _mm256_set1_epi8(0x0F);
  // the codebook as int8 (q - 128): with SIGNED, |q - 128| meets x with q - 128's sign
  const __m256i lut_s = _mm256_xor_si256(
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4))), flip);
  // MXFP4's values + 16 (below 64: the unsigned form, as the other nibble layouts)
  const __m256i lut_mx = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kMx)));
  const __m256 inv_base = _mm256_set1_ps(1.f / kBase), zf = _mm256_set1_ps(static_cast<float>(z));
  for (int h0 = 0; h0 < 2; h0 += NH) {
    __m256 acc[NH][MC];
    for (int h = 0; h < NH; ++h)
      for (int m = 0; m < MC; ++m) acc[h][m] = _mm256_setzero_ps();
    for (int64_t blk = 0; blk < nb; ++blk) {
      const int8_t* xb = px + blk * MC * P * 32;
      const Meta* bm = meta + blk * MC;
      const uint8_t* wb = w + blk * (PL == -1 ? 8 * 64 : 4 * kRec);
      for (int gi = 0; gi < kGroups; ++gi) {
        __m256i ip[NH][MC][P];
        for (int h = 0; h < NH; ++h)
          for (int m = 0; m < MC; ++m)
            for (int p = 0; p < P; ++p)
              ip[h][m][p] = SIGNED ? _mm256_setzero_si256()
                                   : _mm256_set1_epi32(-z * (G16 ? bm[m].ps[p][gi] : bm[m].ps[p][0] + bm[m].ps[p][1]));
        if constexpr (PL >= 0 || is_lut(PL)) {
          for (int cc = 0; cc < kChunks; cc += 2) {  // one record: chunks c (low nibbles) and c + 1
            const int c = gi * kChunks + cc;
            const uint8_t* rec = wb + (c / 2) * kRec;
            if (h0 == 0) _mm_prefetch(reinterpret_cast<const char*>(rec + kPrefetch), _MM_HINT_T0);
            __m256i lo[NH], hi[NH];
            for (int h = 0; h < NH; ++h) {
              const int half = h0 + h;
              const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + half * 32));
              lo[h] = _mm256_and_si256(raw, nib);
              hi[h] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nib);
              high_bits_avx2<PL>(rec, half, lo[h], hi[h]);
              if constexpr (PL == kLutMx) lo[h] = _mm256_shuffle_epi8(lut_mx, lo[h]), hi[h] = _mm256_shuffle_epi8(lut_mx, hi[h]);
            }
            if constexpr (PL == kLut) {  // 2 * 127 * 127 per pair: each product widened on its own
              __m256i sl[NH], sh[NH], al[NH], ah[NH];
              for (int h = 0; h < NH; ++h) {
                sl[h] = _mm256_shuffle_epi8(lut_s, lo[h]), sh[h] = _mm256_shuffle_epi8(lut_s, hi[h]);
                al[h] = _mm256_abs_epi8(sl[h]), ah[h] = _mm256_abs_epi8(sh[h]);
              }
              for (int m = 0; m < MC; ++m)
                for (int p = 0; p < P; ++p) {
                  const int8_t* xp = xb + (m * P + p) * 32;
                  const __m256i xl = xs(xp, c), xh = xs(xp, c + 1);
                  for (int h = 0; h < NH; ++h) {
                    const __m256i pl = _mm256_maddubs_epi16(al[h], _mm256_sign_epi8(xl, sl[h]));
                    const __m256i ph = _mm256_maddubs_epi16(ah[h], _mm256_sign_epi8(xh, sh[h]));
                    ip[h][m][p] = _mm256_add_epi32(ip[h][m][p], _mm256_add_epi32(_mm256_madd_epi16(pl, ones),
                                                                                 _mm256_madd_epi16(ph, ones)));
                  }
                }
              continue;
            }
            for (int m = 0; m < MC; ++m)
              for (int p = 0; p < P; ++p) {
                const int8_t* xp = xb + (m * P + p) * 32;
                const __m256i xl = xs(xp, c), xh = xs(xp, c + 1);
                for (int h = 0; h < NH; ++h) {
                  const __m256i d = _mm256_madd_epi16(
                      _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], xl), _mm256_maddubs_epi16(hi[h], xh)),
                      ones);  // values below 64: see the byte-lane loop
                  ip[h][m][p] = _mm256_add_epi32(ip[h][m][p], d);
                }
              }
          }
        }
        // the signed form, one chunk at a time (its products are widened one by one anyway):
        // fewer live registers, so both halves fit at one activation row
        for (int c = gi * kChunks; c < (PL == -1 && SIGNED ? (gi + 1) * kChunks : 0); ++c) {
          if (h0 == 0) _mm_prefetch(reinterpret_cast<const char*>(wb + kPrefetch + c * 64), _MM_HINT_T0);
          __m256i wv[NH], ws[NH];
          for (int h = 0; h < NH; ++h) {
            ws[h] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + c * 64 + (h0 + h) * 32)),
                                     flip);  // q - 128 as int8
            wv[h] = _mm256_abs_epi8(ws[h]);
          }
          for (int m = 0; m < MC; ++m)
            for (int p = 0; p < P; ++p) {
              const __m256i xv = xs(xb + (m * P + p) * 32, c);
              for (int h = 0; h < NH; ++h)
                ip[h][m][p] = _mm256_add_epi32(
                    ip[h][m][p], _mm256_madd_epi16(_mm256_maddubs_epi16(wv[h], _mm256_sign_epi8(xv, ws[h])), ones));
            }
        }
        for (int cc = 0; cc < (PL == -1 && !SIGNED ? kChunks : 0); cc += 2) {
          const int c = gi * kChunks + cc;
          if (h0 == 0) {  // both chunks' lines
            _mm_prefetch(reinterpret_cast<const char*>(wb + kPrefetch + c * 64), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(wb + kPrefetch + (c + 1) * 64), _MM_HINT_T0);
          }
          __m256i wv[NH][2];
          for (int h = 0; h < NH; ++h)
            for (int i = 0; i < 2; ++i)
              wv[h][i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + (c + i) * 64 + (h0 + h) * 32));
          for (int m = 0; m < MC; ++m) {
            for (int p = 0; p < P; ++p) {
              const int8_t* xp = xb + (m * P + p) * 32;
              const __m256i xv[2] = {xs(xp, c), xs(xp, c + 1)};
              for (int h = 0; h < NH; ++h) {
                // values below 64: two chunks' pair sums add up in int16 (2 * 2 * 63 * 127 = 32004)
                const __m256i d = _mm256_madd_epi16(
                    _mm256_add_epi16(_mm256_maddubs_epi16(wv[h][0], xv[0]), _mm256_maddubs_epi16(wv[h][1], xv[1])), ones);
                ip[h][m][p] = _mm256_add_epi32(ip[h][m][p], d);
              }
            }
          }
        }
        const int64_t g = blk * kGroups + gi;
        for (int h = 0; h < NH; ++h) {
          const __m256 d = F::d8(sc, g, h0 + h);
          __m256 off = _mm256_setzero_ps();
          if constexpr (F::kOff) off = _mm256_fmadd_ps(zf, d, F::m8(sc, g, h0 + h));
          for (int m = 0; m < MC; ++m) {
            __m256 t = _mm256_cvtepi32_ps(ip[h][m][0]);
            if constexpr (P == 2) t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ip[h][m][P - 1]), inv_base, t);
            acc[h][m] = _mm256_fmadd_ps(_mm256_mul_ps(t, _mm256_set1_ps(bm[m].e)), d, acc[h][m]);
            if constexpr (F::kOff) acc[h][m] = _mm256_fmadd_ps(off, _mm256_set1_ps(s[g * MC + m]), acc[h][m]);
          }
        }
      }
    }
    for (int h = 0; h < NH; ++h)
      for (int m = 0; m < MC; ++m) _mm256_storeu_ps(out + m * ldo + (h0 + h) * 8, acc[h][m]);
  }
}

#endif

// One call's constant shape of the weights: group size, zero point, layout (the scales' form is
// the type F: group_scales.h).
struct Form {
  bool g16;
  int z, planes;
};

template <class F>
constexpr bool kSuper = false;
template <int GPS, bool OFF>
constexpr bool kSuper<Super<GPS, OFF>> = true;

#if defined(__x86_64__)
template <int MC, int PL, class F, int P>
void run_mc_512_pl(const Form& f, const uint8_t* w, const typename F::E* sc, int64_t K, const int8_t* px,
                   const Meta* meta, const float* s, float* out, int64_t ldo) {
  constexpr int kSplit = MC == 1 ? 4 : MC == 2 ? 2 : 1;
  if constexpr (kSuper<F>) {  // the record fixes the group size
    return block_rows_512<MC, kSplit, F::kGroup == 16, F, PL, P>(w, sc, K, f.z, px, meta, s, out, ldo);
  } else {
    if (f.g16) return block_rows_512<MC, kSplit, true, F, PL, P>(w, sc, K, f.z, px, meta, s, out, ldo);
    return block_rows_512<MC, kSplit, false, F, PL, P>(w, sc, K, f.z, px, meta, s, out, ldo);
  }
}

template <int MC, class F, int P>
void run_mc_512(const Form& f, const uint8_t* w, const typename F::E* sc, int64_t K, const int8_t* px,
                const Meta* meta, const float* s, float* out, int64_t ldo) {
  switch (f.planes) {
    case -1: return run_mc_512_pl<MC, -1, F, P>(f, w, sc, K, px, meta, s, out, ldo);
    case 0: return run_mc_512_pl<MC, 0, F, P>(f, w, sc, K, px, meta, s, out, ldo);
    case 1: return run_mc_512_pl<MC, 1, F, P>(f, w, sc, K, px, meta, s, out, ldo);
    case 2: return run_mc_512_pl<MC, 2, F, P>(f, w, sc, K, px, meta, s, out, ldo);
    case kLut:
      if constexpr (!F::kOff) return run_mc_512_pl<MC, kLut, F, P>(f, w, sc, K, px, meta, s, out, ldo);
      return;
    default:
      if constexpr (!F::kOff) return run_mc_512_pl<MC, kLutMx, F, P>(f, w, sc, K, px, meta, s, out, ldo);
  }
}

template <int MC, bool SIGNED, int PL, class F, int P>
void run_mc_avx2_pl(const Form& f, const uint8_t* w, const typename F::E* sc, int64_t K, const int8_t* px,
                    const Meta* meta, const float* s, float* out, int64_t ldo) {
  if constexpr (kSuper<F>) {
    return block_rows_avx2<MC, F::kGroup == 16, F, SIGNED, PL, P>(w, sc, K, f.z, px, meta, s, out, ldo);
  } else {
    if (f.g16) return block_rows_avx2<MC, true, F, SIGNED, PL, P>(w, sc, K, f.z, px, meta, s, out, ldo);
    return block_rows_avx2<MC, false, F, SIGNED, PL, P>(w, sc, K, f.z, px, meta, s, out, ldo);
  }
}

// 8-bit weights (byte lanes, z = 128) and codebook values take the signed form; values of at most
// 6 bits the plain one
template <int MC, class F, int P>
void run_mc_avx2(const Form& f, const uint8_t* w, const typename F::E* sc, int64_t K, const int8_t* px,
                 const Meta* meta, const float* s, float* out, int64_t ldo) {
  switch (f.planes) {
    case -1:
      if (f.z == 128) return run_mc_avx2_pl<MC, true, -1, F, P>(f, w, sc, K, px, meta, s, out, ldo);
      return run_mc_avx2_pl<MC, false, -1, F, P>(f, w, sc, K, px, meta, s, out, ldo);
    case 0: return run_mc_avx2_pl<MC, false, 0, F, P>(f, w, sc, K, px, meta, s, out, ldo);
    case 1: return run_mc_avx2_pl<MC, false, 1, F, P>(f, w, sc, K, px, meta, s, out, ldo);
    case 2: return run_mc_avx2_pl<MC, false, 2, F, P>(f, w, sc, K, px, meta, s, out, ldo);
    case kLut:
      if constexpr (!F::kOff) return run_mc_avx2_pl<MC, true, kLut, F, P>(f, w, sc, K, px, meta, s, out, ldo);
      return;
    default:
      if constexpr (!F::kOff) return run_mc_avx2_pl<MC, false, kLutMx, F, P>(f, w, sc, K, px, meta, s, out, ldo);
  }
}
#endif

template <class F, int P>
void run_block(Isa isa, int mc, const Form& f, const uint8_t* w, const typename F::E* sc, int64_t K,
               const int8_t* px, const Meta* meta, const float* s, float* out, int64_t ldo) {
#if defined(__x86_64__)
  static_assert(kMc == 6 && kMcAvx2 == 3, "one case per tile height below");
  if (isa == Isa::kVnni) {
    switch (mc) {
      case 1: return run_mc_512<1, F, P>(f, w, sc, K, px, meta, s, out, ldo);
      case 2: return run_mc_512<2, F, P>(f, w, sc, K, px, meta, s, out, ldo);
      case 3: return run_mc_512<3, F, P>(f, w, sc, K, px, meta, s, out, ldo);
      case 4: return run_mc_512<4, F, P>(f, w, sc, K, px, meta, s, out, ldo);
      case 5: return run_mc_512<5, F, P>(f, w, sc, K, px, meta, s, out, ldo);
      default: return run_mc_512<6, F, P>(f, w, sc, K, px, meta, s, out, ldo);
    }
  }
  if (isa == Isa::kAvx2) {
    switch (mc) {
      case 1: return run_mc_avx2<1, F, P>(f, w, sc, K, px, meta, s, out, ldo);
      case 2: return run_mc_avx2<2, F, P>(f, w, sc, K, px, meta, s, out, ldo);
      default: return run_mc_avx2<3, F, P>(f, w, sc, K, px, meta, s, out, ldo);
    }
  }
#endif
  block_rows_generic<F>(mc, f.planes, w, sc, K, f.g16 ? 16 : 32, f.z, px, meta, s, out, ldo, P);
}

void widen_block_generic(const uint8_t* src, int planes, int64_t K, uint8_t* dst) {
  for (int64_t c = 0; c < K / 8; ++c)  // one 8-column record -> byte chunks 2c and 2c + 1
    for (int half = 0; half < 2; ++half)
      for (int r = 0; r < kRows; ++r)
        for (int j = 0; j < 4; ++j)
          dst[(2 * c + half) * 64 + 4 * r + j] = static_cast<uint8_t>(weight_at(src + (c / 4) * block_bytes(planes),
                                                                                planes, r, (c % 4) * 8 + 4 * half + j));
}

void widen_block(Isa isa, const uint8_t* src, int planes, int64_t K, uint8_t* dst) {
#if defined(__x86_64__)
  if (isa == Isa::kVnni) return widen_block_512(src, planes, K, dst);
  if (isa == Isa::kAvx2) return widen_block_avx2(src, planes, K, dst);
#endif
  widen_block_generic(src, planes, K, dst);
}

// ---- Prefill on AVX2 without VNNI: fp32 GEMM on exactly dequantized tiles of W ------------------
// 8-bit weights (Q8_0, the IQ4 codebook) take the signed form on the AVX2 path: a VPSIGNB on every
// product and no int16 pair sums, ~1.6x the instructions per weight of the other forms. From
// kDenseRows activation rows, tiles of W dequantized to fp32 and torch's fp32 GEMM (MKL) are faster
// and exact: fp32 products of the file's own values, where the kernel rounds the activations to 16
// bits. Zen 3, 2 threads, the 135M and 1B shapes (GMAC/s, kernel at 63 rows: 39-41): 64 rows
// 34-45, 96 rows 43-52, 128 rows 47-61, 512 rows 55-69. The dequantization (~0.35 ns a weight) is
// paid once per call whatever M, so below ~96 rows the kernel wins. The other forms (nibbles and
// bit planes: Q6_K, Q5_K, Q5_0/1, Q3_K, Q2_K) run the kernel at 35-65 GMAC/s whatever M, and the
// dense route overtakes them later: 1B-shape matrices of Q3_K / Q5_K / Q6_K files, the op against
// itself with the route forced, medians of 5: 128 rows 0.77-1.4x, 192 rows 0.92-1.4x, 256 rows
// 1.08-1.4x, 512 rows 1.05-1.6x (kDenseRowsNarrow). VNNI keeps the kernel: one VPDPBUSD per 64
// products per part outruns fp32 FMAs.
constexpr int64_t kDenseRows = 96;
constexpr int64_t kDenseRowsNarrow = 192;
constexpr int64_t kDenseTileFloats = 1 << 20;  // 4 MB of fp32 weights per GEMM call (MKL: ~75 GMAC/s at 256+ rows)

bool dense_wins(Isa isa, const Form& f, int64_t M) {
  const bool eight_bit = (f.planes == -1 && f.z == 128) || f.planes == kLut;
  return isa == Isa::kAvx2 && M >= (eight_bit ? kDenseRows : kDenseRowsNarrow);
}

// One 16-row block (b: its bytes in any layout, scb: its scales) -> fp32 rows out [16, K]: d * q + m
// or d * (q - z), in fp64 and rounded once, as cpu_int8.dequantize (gguf-py's values, signed zeros
// included). wide: scratch for the byte lanes of the other layouts; rows: scratch [16, K].
template <class F>
void dequant_block(Isa isa, const uint8_t* b, const typename F::E* scb, int64_t K, int64_t gs, const Form& f,
                   uint8_t* wide, uint8_t* rows, float* out) {
  const uint8_t* bytes = b;
  if (f.planes != -1) {
    widen_block(isa, b, f.planes, K, wide);
    bytes = wide;
  }
  for (int64_t c = 0; c < K / 4; ++c)  // chunk c holds q[r, 4c..4c+3] at bytes 4r..: rows in order
    for (int r = 0; r < kRows; ++r) std::memcpy(rows + r * K + 4 * c, bytes + c * 64 + 4 * r, 4);
  const double z = f.z;
  for (int r = 0; r < kRows; ++r) {
    const uint8_t* q = rows + r * K;
    float* o = out + r * K;
    for (int64_t g = 0; g < K / gs; ++g) {
      const double d = F::d(scb, g, r), m = F::kOff ? F::m(scb, g, r) : 0.0;
      for (int64_t k = g * gs; k < (g + 1) * gs; ++k)
        o[k] = static_cast<float>(F::kOff ? d * q[k] + m : d * (q[k] - z));
    }
  }
}

template <class F>
void dequant_blocks(Isa isa, const uint8_t* w, const typename F::E* sc, int64_t b0, int64_t b1, int64_t K,
                    int64_t gs, const Form& f, float* out) {
  const int64_t wstride = (K / 32) * block_bytes(f.planes), sstride = F::stride(K, gs);
  at::parallel_for(b0, b1, 1, [&](int64_t s, int64_t e) {
    std::vector<uint8_t> wide(f.planes == -1 ? 0 : (K / 32) * block_bytes(-1)), rows(kRows * K);
    for (int64_t nb = s; nb < e; ++nb)
      dequant_block<F>(isa, w + nb * wstride, sc + nb * sstride, K, gs, f, wide.data(), rows.data(),
                       out + (nb - b0) * kRows * K);
  });
}

// x [M, K] @ W^T into y [M, N]: W dequantized tile by tile, each tile one fp32 GEMM.
template <class F>
void dense_gemm(Isa isa, const at::Tensor& x, const uint8_t* w, const typename F::E* sc, int64_t nblocks,
                int64_t gs, const Form& f, at::Tensor& y) {
  const int64_t K = x.size(1), tb = std::max<int64_t>(1, kDenseTileFloats / (kRows * K));
  const at::Tensor tile = at::empty({std::min(tb, nblocks) * kRows, K}, x.options());
  for (int64_t b0 = 0; b0 < nblocks; b0 += tb) {
    const int64_t b1 = std::min(nblocks, b0 + tb), rows = (b1 - b0) * kRows;
    dequant_blocks<F>(isa, w, sc, b0, b1, K, gs, f, tile.data_ptr<float>());
    at::Tensor out = y.narrow(1, b0 * kRows, rows);
    at::mm_out(out, x, tile.narrow(0, 0, rows).t());
  }
}

// The activations of M rows quantized in tiles (Tiled), with their buffers (uninitialized: every
// byte is written before it is read).
struct Quantized {
  std::unique_ptr<int8_t[]> parts;
  std::unique_ptr<Meta[]> meta;
  std::unique_ptr<float[]> sums;
  Tiled q;
  Quantized(Isa isa, int64_t M, int64_t K, int64_t gs, int np)
      : parts(new int8_t[M * np * K]), meta(new Meta[M * (K / 32)]), sums(new float[M * (K / gs)]),
        q{M, K, K / 32, K / gs, isa == Isa::kAvx2 ? kMcAvx2 : kMc, parts.get(), meta.get(), sums.get(), np} {}
};

// Blocks [b0, b1) of W against every tile of q into y [M, N] (one thread's share of a GEMM). More
// than one tile: a block in nibbles and planes (or codebook indices) is widened to byte lanes once,
// not once per tile (the AVX2 path's bit expansion, redone per 3-row tile, ran prefill 2-4x slower).
template <class F>
void gemm_blocks(Isa isa, const Tiled& q, const uint8_t* w, const typename F::E* sc, int64_t b0, int64_t b1,
                 int64_t gs, const Form& f, float* y, int64_t N) {
  const int64_t K = q.K, wstride = (K / 32) * block_bytes(f.planes), sstride = F::stride(K, gs);
  const int64_t ntiles = (q.M + q.tile - 1) / q.tile;
  const bool widen = f.planes != -1 && ntiles > 1;
  const Form fw{f.g16, f.z, widen ? -1 : f.planes};
  const int64_t bstride = widen ? (K / 32) * block_bytes(-1) : wstride;
  const int64_t wchunk = std::max<int64_t>(1, kWeightChunk / bstride);
  std::vector<uint8_t> wide(widen ? (std::min(b1 - b0, wchunk)) * bstride : 0);
  for (int64_t c0 = b0; c0 < b1; c0 += wchunk) {
    const int64_t c1 = std::min(b1, c0 + wchunk);
    const uint8_t* wc = w + c0 * wstride;
    if (widen) {
      for (int64_t nbk = c0; nbk < c1; ++nbk) widen_block(isa, w + nbk * wstride, f.planes, K, &wide[(nbk - c0) * bstride]);
      wc = wide.data();
    }
    for (int64_t t = 0; t < ntiles; ++t)
      for (int64_t nbk = c0; nbk < c1; ++nbk)
        (q.np == 1 ? run_block<F, 1> : run_block<F, 2>)(isa, q.mt(t), fw, wc + (nbk - c0) * bstride,
                                                        sc + nbk * sstride, K, q.tparts(t), q.tmeta(t), q.ts(t),
                                                        y + t * q.tile * N + nbk * kRows, N);
  }
}

template <class F>
void gemm(Isa isa, const float* x, int64_t M, int64_t K, const uint8_t* w, const typename F::E* sc, int64_t nblocks,
          int64_t gs, const Form& f, float* y, int np) {
  const Quantized a(isa, M, K, gs, np);
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / K), [&](int64_t m0, int64_t m1) {
    quantize_rows(isa, x, a.q, gs, m0, m1);
  });
  at::parallel_for(0, nblocks, 8, [&](int64_t b0, int64_t b1) {
    gemm_blocks<F>(isa, a.q, w, sc, b0, b1, gs, f, y, nblocks * kRows);
  });
}

// The weights' layout and scales' form, checked: fn(F{}, scales pointer, Form) with the scales'
// type F (group_scales.h). `op` names the caller in errors.
template <class Fn>
void with_form(const char* op, const at::Tensor& w, const at::Tensor& sc, int64_t K, int64_t group_size,
               int64_t zero, Fn fn) {
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kByte && w.is_contiguous(), op,
              ": the weight must be contiguous uint8 [N/16, K/4, 64] or [N/16, K/8, 64 + 16P]");
  const int64_t nblocks = w.size(0);
  TORCH_CHECK(K % 32 == 0, op, ": K must be a multiple of 32, got ", K);
  int planes = -3;
  if (w.size(1) * 4 == K && w.size(2) == 64) planes = -1;
  else if (w.size(1) * 8 == K && (w.size(2) == 64 || w.size(2) == 80 || w.size(2) == 96))
    planes = static_cast<int>((w.size(2) - 64) / 16);
  TORCH_CHECK(planes >= -1, op, ": weight shape ", w.sizes(), " is no layout for K = ", K);
  TORCH_CHECK(group_size == 16 || group_size == 32, op, ": group size must be 16 or 32, got ", group_size);
  TORCH_CHECK(zero >= 0 && zero <= 255, op, ": zero point must be in [0, 255], got ", zero);
  // byte lanes: 8-bit values take z = 128 (the AVX2 path's signed form), others are below 64 (z
  // at most 32: that path adds two VPMADDUBSW pair sums in int16); nibbles with z = 128 are
  // indices into the IQ4 codebook (its values + 128), with z = 16 into MXFP4's (its values + 16:
  // plain 4-bit values take z 8, no pack gives them 16)
  TORCH_CHECK(planes >= 0 || zero <= 32 || zero == 128, op, ": zero point ", zero,
              " with byte lanes (values of 8 bits take 128, those of 6 bits or fewer at most 32)");
  TORCH_CHECK(planes < 0 || zero <= 32 || (planes == 0 && zero == 128), op, ": zero point ", zero,
              " for values of ", 4 + planes, " bits (nibbles with 128: IQ4 codebook indices)");
  if (planes == 0 && zero == 128) planes = kLut;
  if (planes == 0 && zero == 16) planes = kLutMx;
  const Form f{group_size == 16, static_cast<int>(zero), planes};
  auto run = [&](auto form, const auto* p) {
    if constexpr (decltype(form)::kOff) TORCH_CHECK(!is_lut(planes), op, ": codebook indices take scales without offsets");
    fn(form, p, f);
  };
  if (sc.scalar_type() == at::kByte) {  // K-quant records (group_scales.h)
    const int64_t gps = 256 / group_size, sym = 32 + gps * kRows;
    TORCH_CHECK(sc.dim() == 3 && sc.size(0) == nblocks && K % 256 == 0 && sc.size(1) == K / 256 &&
                    (sc.size(2) == sym || sc.size(2) == 2 * sym) && sc.is_contiguous(),
                op, ": K-quant scales must be contiguous uint8 [N/16, K/256, ", sym, " | ", 2 * sym,
                "] for groups of ", group_size);
    const bool off = sc.size(2) == 2 * sym;
    if (group_size == 32) {
      if (off) run(Super<8, true>{}, sc.data_ptr<uint8_t>());
      else run(Super<8, false>{}, sc.data_ptr<uint8_t>());
    } else {
      if (off) run(Super<16, true>{}, sc.data_ptr<uint8_t>());
      else run(Super<16, false>{}, sc.data_ptr<uint8_t>());
    }
    return;
  }
  TORCH_CHECK(sc.dim() == 4 && sc.size(0) == nblocks && sc.size(1) == K / group_size &&
              (sc.size(2) == 1 || sc.size(2) == 2) && sc.size(3) == kRows && sc.is_contiguous(),
              op, ": scales must be contiguous [N/16, K/group, 1 | 2, 16]");
  const bool off = sc.size(2) == 2;
  if (sc.scalar_type() == at::kHalf) {
    if (off) run(Flat<at::Half, 2>{}, sc.data_ptr<at::Half>());
    else run(Flat<at::Half, 1>{}, sc.data_ptr<at::Half>());
  } else {
    TORCH_CHECK(sc.scalar_type() == at::kFloat, op, ": scales must be fp16, fp32 or uint8 records");
    if (off) run(Flat<float, 2>{}, sc.data_ptr<float>());
    else run(Flat<float, 1>{}, sc.data_ptr<float>());
  }
}

// x fp32 [M, K] @ W^T -> fp32 [M, N padded to 16]; W in the layout at the top. parts: the
// activations' int8 parts, 2 (~16 bits, the default) or 1 (8 bits, the opt-in; act_quant.h)
at::Tensor int8w_gemm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& sc, int64_t group_size,
                      int64_t zero, int64_t parts) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "int8w_gemm: x must be fp32 [M, K]");
  TORCH_CHECK(parts == 1 || parts == 2, "int8w_gemm: parts must be 1 (8-bit activations) or 2 (16-bit), got ", parts);
  const int64_t M = x.size(0), K = x.size(1), nblocks = w.dim() == 3 ? w.size(0) : 0;
  const Isa isa = isa_now();
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, nblocks * kRows}, x.options());
  with_form("int8w_gemm", w, sc, K, group_size, zero, [&](auto form, const auto* p, const Form& f) {
    using F = decltype(form);
    if (M == 0) return;
    if (dense_wins(isa, f, M)) return dense_gemm<F>(isa, xc, w.data_ptr<uint8_t>(), p, nblocks, group_size, f, y);
    gemm<F>(isa, xc.data_ptr<float>(), M, K, w.data_ptr<uint8_t>(), p, nblocks, group_size, f, y.data_ptr<float>(),
            static_cast<int>(parts));
  });
  return y;
}

// W itself: fp32 [N padded to 16, K], the values the kernel multiplies by (dense_gemm's tiles).
at::Tensor int8w_dequantize(const at::Tensor& w, const at::Tensor& sc, int64_t group_size, int64_t zero) {
  TORCH_CHECK(w.dim() == 3 && (sc.dim() == 3 || sc.dim() == 4), "int8w_dequantize: weight [N/16, K/4 | K/8, bytes] "
              "and scales [N/16, K/group, 1 | 2, 16] or K-quant records [N/16, K/256, bytes]");
  // K as the scales tell it (byte lanes and nibbles share a 64-byte record size)
  const int64_t nblocks = w.size(0), K = sc.size(1) * (sc.dim() == 4 ? group_size : 256);
  at::Tensor out = at::empty({nblocks * kRows, K}, w.options().dtype(at::kFloat));
  with_form("int8w_dequantize", w, sc, K, group_size, zero, [&](auto form, const auto* p, const Form& f) {
    dequant_blocks<decltype(form)>(isa_now(), w.data_ptr<uint8_t>(), p, 0, nblocks, K, group_size, f,
                                   out.data_ptr<float>());
  });
  return out;
}

// One stacked matrix of the experts ([E, N/16, ...] and its scales [E, ...]), its form checked once.
struct ExpertStack {
  const at::Tensor &w, &sc;
  int64_t K, gs, zero;
};

// fn(F{}, expert e's scales pointer at e = 0, Form, expert's weight stride, scales stride)
template <class Fn>
void with_stack(const char* op, const ExpertStack& m, Fn fn) {
  TORCH_CHECK(m.w.dim() == 4 && m.sc.size(0) == m.w.size(0) && m.w.is_contiguous() && m.sc.is_contiguous(), op,
              ": experts must be contiguous [E, N/16, ...] with scales [E, ...]");
  with_form(op, m.w.select(0, 0), m.sc.select(0, 0), m.K, m.gs, m.zero, [&](auto form, const auto* p, const Form& f) {
    fn(form, p, f);
  });
}

// One expert's share of a call: its n pairs' activations and outputs (its rows of the call's tensors).
struct ExpertRows8 {
  int64_t e, n;
  float *x, *h1, *act, *h2;
};

// Every used expert's blocks of one stacked matrix: one parallel pass over the experts' rows to
// quantize them, one over the blocks for every expert (a fork per matrix, not per expert, as
// int4_gemm.cpp's moe_int4). An expert with enough rows for the dense route (AVX2 prefill: dense_wins) takes it,
// as int8w_gemm would for the same rows.
void experts_pass8(Isa isa, std::vector<ExpertRows8>& rows, const std::vector<std::pair<int64_t, int64_t>>& where,
                   const ExpertStack& m, bool first, int np) {
  with_stack("moe_int8w", m, [&](auto form, const auto* p, const Form& f) {
    using F = decltype(form);
    const int64_t nb = m.w.size(1), N = nb * kRows, K = m.K;
    const int64_t ws = m.w.stride(0), ss = m.sc.stride(0);
    const uint8_t* w = m.w.data_ptr<uint8_t>();
    std::vector<Quantized> q;
    q.reserve(rows.size());
    std::vector<int64_t> kernel;  // the experts the kernel runs (the others go dense)
    for (int64_t i = 0; i < static_cast<int64_t>(rows.size()); ++i) {
      const bool dense = dense_wins(isa, f, rows[i].n);
      q.emplace_back(isa, dense ? 0 : rows[i].n, K, m.gs, np);
      if (!dense) kernel.push_back(i);
    }
    at::parallel_for(0, static_cast<int64_t>(where.size()), std::max<int64_t>(1, 16384 / K), [&](int64_t p0, int64_t p1) {
      for (int64_t j = p0; j < p1; ++j) {
        const auto [i, row] = where[j];
        if (q[i].q.M) quantize_rows(isa, first ? rows[i].x : rows[i].act, q[i].q, m.gs, row, row + 1);
      }
    });
    for (int64_t i = 0; i < static_cast<int64_t>(rows.size()); ++i) {
      ExpertRows8& r = rows[i];
      if (q[i].q.M) continue;
      at::Tensor xt = at::from_blob(first ? r.x : r.act, {r.n, K}, at::kFloat);
      at::Tensor yt = at::from_blob(first ? r.h1 : r.h2, {r.n, N}, at::kFloat);
      dense_gemm<F>(isa, xt, w + r.e * ws, p + r.e * ss, nb, m.gs, f, yt);
    }
    // each thread the same share of every expert's blocks: the experts' rows differ (a prefill's
    // router sends more to some), so splitting the (expert, block) pairs in halves left one
    // thread most of the work (prefill 15% slower than one int8w_gemm an expert)
    at::parallel_for(0, nb, 8, [&](int64_t b0, int64_t b1) {
      for (const int64_t i : kernel) {
        ExpertRows8& r = rows[i];
        gemm_blocks<F>(isa, q[i].q, w + r.e * ws, p + r.e * ss, b0, b1, m.gs, f, first ? r.h1 : r.h2, N);
      }
    });
  });
}

// A mixture-of-experts MLP on int8-lane experts (MXFP4, Q5_K, Q6_K, Q8_0, ... stacked): y[t] = sum_j
// weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = ids[t, j]; int4_gemm.cpp's moe_int4
// with this kernel's layouts. w1/s1: the experts' gate and up rows stacked (gate 0..I-1, up
// I..2I-1) in int8w_gemm's layout and scale form, group1 / zero1 theirs; w2/s2 down (K = inter).
// Each expert's rows get the same arithmetic as int8w_gemm on them (the activations quantized per
// row, the same kernels and route), then silu in fp32. gpt-oss: b1 [E, 2I] / b2 [E, H] the experts'
// biases (added to each matrix's outputs, as a linear adds its bias), act 1 its clamped SwiGLU,
// (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit) (act 0: silu).
at::Tensor moe_int8w(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights, const at::Tensor& w1,
                     const at::Tensor& s1, const at::Tensor& w2, const at::Tensor& s2, int64_t group1, int64_t zero1,
                     int64_t group2, int64_t zero2, int64_t inter, int64_t parts,
                     const std::optional<at::Tensor>& b1, const std::optional<at::Tensor>& b2, int64_t act,
                     double alpha, double limit) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "moe_int8w: x must be fp32 [T, H]");
  TORCH_CHECK(parts == 1 || parts == 2, "moe_int8w: parts must be 1 or 2, got ", parts);
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == T && ids.scalar_type() == at::kLong, "moe_int8w: ids must be int64 [T, k]");
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.scalar_type() == at::kFloat,
              "moe_int8w: weights must be fp32 [T, k]");
  TORCH_CHECK(w1.dim() == 4 && w2.dim() == 4 && w1.size(0) == w2.size(0) && w1.size(1) * kRows >= 2 * inter &&
              w2.size(1) * kRows >= H, "moe_int8w: expert shapes do not match H = ", H, ", I = ", inter);
  TORCH_CHECK(act == 0 || act == 1, "moe_int8w: act must be 0 (silu) or 1 (clamped SwiGLU), got ", act);
  TORCH_CHECK(!b1.has_value() || (b1->dim() == 2 && b1->size(0) == w1.size(0) && b1->size(1) == 2 * inter &&
                                  b1->scalar_type() == at::kFloat), "moe_int8w: b1 must be fp32 [E, 2I]");
  TORCH_CHECK(!b2.has_value() || (b2->dim() == 2 && b2->size(0) == w1.size(0) && b2->size(1) == H &&
                                  b2->scalar_type() == at::kFloat), "moe_int8w: b2 must be fp32 [E, H]");
  const ExpertStack m1{w1, s1, H, group1, zero1}, m2{w2, s2, inter, group2, zero2};
  with_stack("moe_int8w", m1, [](auto, const auto*, const Form&) {});  // (both forms checked before any work)
  with_stack("moe_int8w", m2, [](auto, const auto*, const Form&) {});
  const Isa isa = isa_now();
  const int64_t k = ids.size(1), E = w1.size(0), N1 = w1.size(1) * kRows, N2 = w2.size(1) * kRows;
  at::Tensor y = at::zeros({T, H}, x.options());
  const at::Tensor xc = x.contiguous(), ic = ids.contiguous(), wc = weights.contiguous();
  const int64_t* ip = ic.data_ptr<int64_t>();
  std::vector<int64_t> start, order;  // the pairs t * k + j grouped by expert
  moe_route::by_expert(ip, T * k, E, "moe_int8w", start, order);
  const int64_t P = T * k;
  const at::Tensor sorted = at::from_blob(order.data(), {P}, at::kLong);
  const at::Tensor tokens = at::floor_divide(sorted, k);
  at::Tensor eids;  // each pair's expert, in expert order (whose bias row it takes)
  if (b1.has_value() || b2.has_value()) eids = at::index_select(ic.view({-1}), 0, sorted);
  std::vector<int64_t> pos(P);
  for (int64_t i = 0; i < P; ++i) pos[order[i]] = i;
  const float* wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int np = static_cast<int>(parts);
  // The experts in groups (in expert order) whose rows' buffers stay under 16 MB each: a prefill's
  // 2,048 gpt-oss pairs held at once (a 47 MB gate_up output) took fresh pages from the kernel at
  // every call, above malloc's mmap threshold (32 MB after load), ~25% of the op.
  const int64_t cap = std::max<int64_t>(1, (int64_t{16} << 20) / (4 * std::max({H, N1, N2})));
  for (int64_t e0 = 0; e0 < E;) {
    int64_t e1 = e0 + 1;
    while (e1 < E && start[e1 + 1] - start[e0] <= cap) ++e1;
    const int64_t p0 = start[e0], p1 = start[e1], Pg = p1 - p0;
    if (Pg > 0) {
      // the group's pairs' rows, as one tensor each: the gathered activations, the gate_up outputs,
      // the gated activations, the down outputs (uninitialized: zeroed buffers cost a prefill ~20%)
      const at::Tensor X = at::index_select(xc, 0, tokens.narrow(0, p0, Pg)), H1 = at::empty({Pg, N1}, x.options());
      at::Tensor A = at::empty({Pg, inter}, x.options());
      const at::Tensor H2 = at::empty({Pg, N2}, x.options());
      std::vector<ExpertRows8> rows;
      std::vector<std::pair<int64_t, int64_t>> where;  // pair (in expert order) -> (expert's rows, row)
      for (int64_t e = e0; e < e1; ++e) {
        const int64_t n = start[e + 1] - start[e], s0 = start[e] - p0;
        if (n == 0) continue;
        rows.push_back(ExpertRows8{e, n, X.data_ptr<float>() + s0 * H, H1.data_ptr<float>() + s0 * N1,
                                   A.data_ptr<float>() + s0 * inter, H2.data_ptr<float>() + s0 * N2});
        for (int64_t i = 0; i < n; ++i) where.emplace_back(rows.size() - 1, i);
      }
      experts_pass8(isa, rows, where, m1, true, np);
      if (b1.has_value()) H1.narrow(1, 0, 2 * inter).add_(at::index_select(*b1, 0, eids.narrow(0, p0, Pg)));
      // the gate as LoopExperts computes it (torch's ops, in moe.py's order): the same values
      const at::Tensor gate = H1.narrow(1, 0, inter), up = H1.narrow(1, inter, inter);
      if (act == 0) {
        at::mul_out(A, at::silu(gate), up);
      } else {
        const at::Tensor g = at::clamp_max(gate, limit);
        at::mul_out(A, at::add(at::clamp(up, -limit, limit), 1), at::mul(g, at::sigmoid(at::mul(g, alpha))));
      }
      experts_pass8(isa, rows, where, m2, false, np);
      if (b2.has_value()) H2.narrow(1, 0, H).add_(at::index_select(*b2, 0, eids.narrow(0, p0, Pg)));
      // weighted into each token's row, its pairs in expert order (as LoopExperts adds them: each
      // product rounded, then added; this generic code has no FMA to contract them into); the groups
      // come in expert order too
      const float* h2 = H2.data_ptr<float>();
      at::parallel_for(0, T, std::max<int64_t>(1, 4096 / (k * H)), [&](int64_t t0, int64_t t1) {
        std::vector<int64_t> mine;
        for (int64_t t = t0; t < t1; ++t) {
          mine.clear();
          for (int64_t j = 0; j < k; ++j)
            if (pos[t * k + j] >= p0 && pos[t * k + j] < p1) mine.push_back(pos[t * k + j]);
          std::sort(mine.begin(), mine.end());
          float* yr = yp + t * H;
          for (const int64_t i : mine) {
            const float wt = wp[order[i]];
            const float* hr = h2 + (i - p0) * N2;
            for (int64_t c = 0; c < H; ++c) yr[c] += wt * hr[c];
          }
        }
      });
    }
    e0 = e1;
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(localllm, m) {
  m.def("moe_int8w(Tensor x, Tensor ids, Tensor weights, Tensor w1, Tensor s1, Tensor w2, Tensor s2, int group1, "
        "int zero1, int group2, int zero2, int inter, int parts=2, Tensor? b1=None, Tensor? b2=None, int act=0, "
        "float alpha=0.0, float limit=0.0) -> Tensor");
  m.def("int8w_gemm(Tensor x, Tensor w, Tensor scales, int group_size, int zero, int parts=2) -> Tensor");
  m.def("int8w_dequantize(Tensor w, Tensor scales, int group_size, int zero) -> Tensor");
  m.def("int8w_isa(str? force=None) -> str", &int8w_isa);  // no tensors: one kernel for every key
}

TORCH_LIBRARY_IMPL(localllm, CPU, m) {
  m.impl("int8w_gemm", &int8w_gemm);
  m.impl("int8w_dequantize", &int8w_dequantize);
  m.impl("moe_int8w", &moe_int8w);
}
