// Int4 weight x fp32 activation GEMM for x86 CPUs with AVX-512 VNNI, for decode-sized batches;
// CPUs without VNNI (AVX2 only: AMD before Zen 4, most desktop Intel) take block_rows_avx2 below.
//
// Why: torch's CPU int4 kernel dequantizes every weight to fp32 and needs two FMAs per weight,
// so at batch 1 it streams weights at ~20 GB/s, and its cost grows linearly with the rows. Here
// the activations are split per 32-block into two int8 parts, x = e * (p0 + p1/254) (error
// <= e/508, about 16 bits where bf16 keeps 8), and each part meets the raw 4-bit weights in
// VPDPBUSD (64 u8*s8 products per instruction). Weights are read once per call and reused for
// every row of x. The kernel is bound by VPDPBUSD throughput: a third part (24 bits; logit error
// against fp32 on the default model 9e-5 instead of 1e-2) cost 13% at batch 1 and 75% at 16.
//
// Loop shape (measured on a 2-core Xeon with AVX-512 VNNI, 135M/1B shapes, against the previous
// 4-row version; outputs bit-identical): x is quantized into tiles of kMc = 6 rows whose parts,
// block scales and sums lie in the order the kernel reads them (one pointer, immediate offsets);
// each 16-row weight block meets a tile with 12 independent int32 chains (2 per row: VPDPBUSD has
// 5 cycles of latency and 2 per cycle of throughput), the activations broadcast by the instruction
// itself ({1to16}), the accumulators started at -8 * the part sums (no subtraction per block), and
// for group size 32 no per-group fp32 partial. Rows 1-2 split their chains per chunk instead. At
// large M, ~64 KB of weights meets every tile before the next (the tiles stream from L2 once per
// chunk). The quantization of x runs on all threads. 1 thread: 1.2-1.4x at M = 1..16, 1.3-1.45x at
// M = 64..512 (qkv M=64 124 -> 178 GFLOP/s); 2 threads 1.35-1.65x at M >= 64; int4_gemm's share of
// a 512-token prefill on the 135M model ~1.33x faster. 8 rows (spills) was no faster than 6.
//
// Layout (built by localllm_kernels.cpu_int4.pack):
//   w  uint8 [N/16, K/8, 64]: for rows r of a 16-row block and k-chunk c (8 columns), byte 4r+j
//      holds q[r, 8c+j] in its low nibble and q[r, 8c+4+j] in its high nibble, so the low
//      nibbles of a 64-byte chunk are 16 dword lanes of 4 consecutive weights each.
//   sc half or float [N/16, G, 2, 16]: per group, 16 scales d then 16 offsets m; W = d*q + m;
//      or half [N/16, G, 1, 16]: scales only, W = d * (q - 8) (Q4_0); or uint8 [N/16, K/256, 320]:
//      GGUF Q4_K's own sub-scales under fp16 super-scales (group_scales.h), d and m formed exactly.
// y[m, n] = sum_g d[n,g] * sum_k (q[n,k] - 8) x[m,k] + (m[n,g] + 8 d[n,g]) * sum_k x[m,k]  (k in g)

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "act_quant.h"
#include "group_scales.h"
#include "moe_route.h"

#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <algorithm>
#include <atomic>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace {

constexpr int kRows = 16;  // output rows per block (one zmm of fp32)
// activation rows per pass over a weight block (a "tile" of x): 2 * kMc int32 chains hide
// VPDPBUSD's latency; 6 measured as fast as 8 (which spills its fp32 accumulators) and 1.3x 4
constexpr int kMc = 6;
// at large M, the weight blocks of ~64 KB (L2) meet every tile before the next ones: the tiles'
// activations stream from L2 once per 64 KB of weights, not once per 16-row block
constexpr int64_t kWeightChunk = 64 * 1024;
// decode streams each weight once from memory: asking for the bytes 4 KB ahead keeps more reads
// in flight than the hardware prefetcher does (1 thread, cache-cold 1B-shape layers: 1.15-1.2x)
constexpr int64_t kPrefetch = 4096;

using act_quant::kBase;
using act_quant::kMcAvx2;
using act_quant::kParts;

// Per activation row and 32-block: 8 x each part's block sum (to center the weights exactly in
// int32) and the block scale e.
struct BlockMeta {
  int32_t ps[kParts];
  float e;
  float pad;
};

// Activations as the kernel reads them (act_quant.h), in tiles of kMc rows with AVX-512 VNNI,
// kMcAvx2 without.
using Tiled = act_quant::Tiled<BlockMeta>;

// The AVX-512 VNNI kernel where the CPU has it, else the AVX2 one (same layouts, same arithmetic:
// exact int32 block sums, then the same fp32 operations per output lane).
bool cpu_has_vnni() {
  static const bool v = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  return v;
}
std::atomic<bool> g_avx2_only{false};  // tests: the AVX2 path on a CPU that has VNNI
bool has_vnni() { return cpu_has_vnni() && !g_avx2_only.load(std::memory_order_relaxed); }

// -> the instruction set the kernels use: "avx512_vnni" or "avx2"; avx2_only=true makes them
// take the AVX2 path even where VNNI is there (tests compare the two), false restores the choice.
std::string int4_isa(std::optional<bool> avx2_only) {
  if (avx2_only) g_avx2_only.store(*avx2_only);
  return has_vnni() ? "avx512_vnni" : "avx2";
}

// x [M, K] -> the tiled activations above. Each part is int8; x = e * (p0 + p1/254) per block.
template <int P>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void quantize_rows_512(const float* x, const Tiled& q,
                                                                            int64_t gs, int64_t m0, int64_t m1) {
  const int64_t K = q.K, nb = q.nb, bpg = gs / 32;
  for (int64_t m = m0; m < m1; ++m) {
    const int64_t t = m / q.tile, i = m % q.tile;
    const int mt = q.mt(t);
    int8_t* tp = q.tparts(t);
    BlockMeta* tm = q.tmeta(t);
    float* ts = q.ts(t);
    for (int64_t blk = 0; blk < nb; ++blk) {
      const float* xb = x + m * K + blk * 32;
      const __m512 v[2] = {_mm512_loadu_ps(xb), _mm512_loadu_ps(xb + 16)};
      BlockMeta& bm = tm[blk * mt + i];
      int32_t sums[kParts][2];
      bm.e = act_quant::block_512<P>(v, tp + (blk * mt + i) * P * 32, sums);
      // times 8: folds into the accumulators' start
      for (int p = 0; p < P; ++p) bm.ps[p] = 8 * (sums[p][0] + sums[p][1]);
      float& sg = ts[(blk / bpg) * mt + i];
      if (blk % bpg == 0) sg = 0.f;
      sg += _mm512_reduce_add_ps(_mm512_add_ps(v[0], v[1]));
    }
  }
}

// The same with AVX2. The fp32 group sums are added in _mm512_reduce_add_ps's order (halves of
// 256, 128, 64 bits, then the last two), so the parts, scales and sums equal the AVX-512 ones.
__attribute__((target("avx2,fma"))) inline float hsum_as_512(__m256 a, __m256 b) {
  const __m256 t3 = _mm256_add_ps(b, a);  // lanes i and i + 8 of the 16-lane vector (a, b)
  const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, 1));
}

template <int P>
__attribute__((target("avx2,fma"))) void quantize_rows_avx2(const float* x, const Tiled& q, int64_t gs, int64_t m0,
                                                           int64_t m1) {
  const int64_t K = q.K, nb = q.nb, bpg = gs / 32;
  for (int64_t m = m0; m < m1; ++m) {
    const int64_t t = m / q.tile, i = m % q.tile;
    const int mt = q.mt(t);
    int8_t* tp = q.tparts(t);
    BlockMeta* tm = q.tmeta(t);
    float* ts = q.ts(t);
    for (int64_t blk = 0; blk < nb; ++blk) {
      const float* xb = x + m * K + blk * 32;
      __m256 v[4];
      for (int h = 0; h < 4; ++h) v[h] = _mm256_loadu_ps(xb + 8 * h);
      BlockMeta& bm = tm[blk * mt + i];
      int32_t sums[kParts][2];
      bm.e = act_quant::block_avx2<P>(v, tp + (blk * mt + i) * P * 32, sums);
      for (int p = 0; p < P; ++p) bm.ps[p] = 8 * (sums[p][0] + sums[p][1]);
      float& sg = ts[(blk / bpg) * mt + i];
      if (blk % bpg == 0) sg = 0.f;
      // the 512-bit version's v[0] + v[1]: lanes 0-7 and 8-15 of x[0:16] + x[16:32]
      sg += hsum_as_512(_mm256_add_ps(v[0], v[2]), _mm256_add_ps(v[1], v[3]));
    }
  }
}

void quantize_rows(const float* x, const Tiled& q, int64_t gs, int64_t m0, int64_t m1) {
  if (has_vnni())
    q.np == 1 ? quantize_rows_512<1>(x, q, gs, m0, m1) : quantize_rows_512<2>(x, q, gs, m0, m1);
  else
    q.np == 1 ? quantize_rows_avx2<1>(x, q, gs, m0, m1) : quantize_rows_avx2<2>(x, q, gs, m0, m1);
}

using group_scales::Flat;
using group_scales::Super;

// acc += w . (4 int8 at p, broadcast to every lane), the broadcast folded into the instruction
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline __m512i dot4(__m512i acc, __m512i w,
                                                                           const int8_t* p) {
  // (the compiler keeps a separate VPBROADCASTD per use: one more uop to issue, 1.05-1.3x slower)
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
}

// One 16-row block against a tile of MC activation rows. SPLIT independent int32 chains per row
// and part (summed exactly at the end of each 32-block): few rows give few chains, and VPDPBUSD's
// 5-cycle latency would bound them.
template <int MC, int SPLIT, bool BPG1, class F, int P>
__attribute__((target("avx512f,avx512bw,avx512vnni,f16c"))) void block_rows(
    const uint8_t* w, const typename F::E* sc, int64_t K, int64_t gs, const int8_t* px, const BlockMeta* meta,
    const float* s, float* out, int64_t ldo) {
  const int64_t ng = K / gs, bpg = BPG1 ? 1 : gs / 32;
  const __m512i mask = _mm512_set1_epi8(0x0F);
  const __m512 inv_base = _mm512_set1_ps(1.f / kBase);
  __m512 acc[MC];
  for (int m = 0; m < MC; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    __m512 gacc[MC];
    for (int m = 0; m < MC; ++m) gacc[m] = _mm512_setzero_ps();
    for (int64_t bb = 0; bb < bpg; ++bb) {
      const int64_t blk = g * bpg + bb;
      const int8_t* xb = px + blk * MC * P * 32;
      const BlockMeta* bm = meta + blk * MC;
      __m512i ip[MC][P][SPLIT];
      // sum (q - 8) * part = sum q * part - 8 * sum part: centered weights, exact in int32, so
      // the fp32 sums below see small terms (sum q * x alone would cancel against m * sum x)
      for (int m = 0; m < MC; ++m)
        for (int p = 0; p < P; ++p)
          for (int j = 0; j < SPLIT; ++j)
            ip[m][p][j] = j == 0 ? _mm512_set1_epi32(-bm[m].ps[p]) : _mm512_setzero_si512();
      const uint8_t* wb = w + blk * 4 * 64;
      for (int c = 0; c < 4; ++c) {
        _mm_prefetch(reinterpret_cast<const char*>(wb + kPrefetch + c * 64), _MM_HINT_T0);
        const __m512i raw = _mm512_loadu_si512(wb + c * 64);
        const __m512i lo = _mm512_and_si512(raw, mask);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask);
        for (int m = 0; m < MC; ++m) {
          for (int p = 0; p < P; ++p) {
            const int8_t* xp = xb + (m * P + p) * 32 + c * 8;
            constexpr int kLo = 0, kHi = SPLIT == 1 ? 0 : 1;
            const int jl = SPLIT == 4 ? (2 * c) % 4 + kLo : kLo, jh = SPLIT == 4 ? (2 * c) % 4 + kHi : kHi;
            ip[m][p][jl] = dot4(ip[m][p][jl], lo, xp);
            ip[m][p][jh] = dot4(ip[m][p][jh], hi, xp + 4);
          }
        }
      }
      for (int m = 0; m < MC; ++m) {
        __m512i c[P];
        for (int p = 0; p < P; ++p) {
          c[p] = ip[m][p][0];
          for (int j = 1; j < SPLIT; ++j) c[p] = _mm512_add_epi32(c[p], ip[m][p][j]);
        }
        __m512 t = _mm512_cvtepi32_ps(c[P - 1]);
        for (int p = P - 2; p >= 0; --p) t = _mm512_fmadd_ps(t, inv_base, _mm512_cvtepi32_ps(c[p]));
        if (BPG1)  // fma(t, e, +0) but for the sign of a zero, which acc below never shows
          gacc[m] = _mm512_mul_ps(t, _mm512_set1_ps(bm[m].e));
        else
          gacc[m] = _mm512_fmadd_ps(t, _mm512_set1_ps(bm[m].e), gacc[m]);
      }
    }
    const __m512 d = F::d16(sc, g);
    __m512 off = _mm512_setzero_ps();
    if constexpr (F::kOff) off = _mm512_fmadd_ps(_mm512_set1_ps(8.f), d, F::m16(sc, g));  // m + 8d
    for (int m = 0; m < MC; ++m) {
      acc[m] = _mm512_fmadd_ps(gacc[m], d, acc[m]);
      // symmetric (Q4_0: m = -8d): m + 8d is 0, so the term is left out (the sums equal, up to a zero's sign)
      if constexpr (F::kOff) acc[m] = _mm512_fmadd_ps(off, _mm512_set1_ps(s[g * MC + m]), acc[m]);
    }
  }
  for (int m = 0; m < MC; ++m) _mm512_storeu_ps(out + m * ldo, acc[m]);
}


// block_rows with AVX2: a ymm holds 8 of the block's 16 rows (a 64-byte chunk's first 32 bytes
// are rows 0-7). No VPDPBUSD: VPMADDUBSW multiplies the u8 weights by the int8 parts into int16
// pairs (at most 2 * 15 * 127 = 3810 each, so the 8 of a 32-block add up in int16 without
// saturating: 30480) and one VPMADDWD per block widens them to int32. The sums are the VNNI
// kernel's exact integers, and the fp32 steps after them are its steps, lane by lane.
// NH = 2: both 8-row halves from each chunk as it arrives, sharing the activations' broadcasts.
// At one activation row (decode) the halves one after the other (NH = 1) read each cache line
// twice and leave the memory idle during the second pass (135M shapes streaming from DRAM, 2
// threads: 3.07 -> 2.77 ms for the 30 layers' 120 matrices). At a full tile of 3 rows (prefill)
// the shared broadcasts outweigh the spills of 12 int16 accumulators: 1B-shape Q4_K matrices, 2
// threads, the op against itself, 7-11% more GMAC/s at M = 3..512 (bit-identical). At two rows
// NH = 2 was 7-13% slower.
template <int MC, bool BPG1, class F, int P>
__attribute__((target("avx2,fma,f16c"))) void block_rows_avx2(const uint8_t* w, const typename F::E* sc, int64_t K, int64_t gs,
                                                               const int8_t* px, const BlockMeta* meta, const float* s,
                                                               float* out, int64_t ldo) {
  constexpr int NH = MC == 2 ? 1 : 2;
  const int64_t ng = K / gs, bpg = BPG1 ? 1 : gs / 32;
  const __m256i mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const __m256 inv_base = _mm256_set1_ps(1.f / kBase);
  for (int h0 = 0; h0 < 2; h0 += NH) {
    __m256 acc[NH][MC];
    for (int h = 0; h < NH; ++h)
      for (int m = 0; m < MC; ++m) acc[h][m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < ng; ++g) {
      __m256 gacc[NH][MC];
      for (int h = 0; h < NH; ++h)
        for (int m = 0; m < MC; ++m) gacc[h][m] = _mm256_setzero_ps();
      for (int64_t bb = 0; bb < bpg; ++bb) {
        const int64_t blk = g * bpg + bb;
        const int8_t* xb = px + blk * MC * P * 32;
        const BlockMeta* bm = meta + blk * MC;
        __m256i ip[NH][MC][P];
        for (int h = 0; h < NH; ++h)
          for (int m = 0; m < MC; ++m)
            for (int p = 0; p < P; ++p) ip[h][m][p] = _mm256_setzero_si256();
        const uint8_t* wb = w + blk * 4 * 64 + h0 * 32;
        for (int c = 0; c < 4; ++c) {
          if (h0 == 0) _mm_prefetch(reinterpret_cast<const char*>(wb + kPrefetch + c * 64), _MM_HINT_T0);
          __m256i lo[NH], hi[NH];
          for (int h = 0; h < NH; ++h) {
            const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + c * 64 + h * 32));
            lo[h] = _mm256_and_si256(raw, mask);
            hi[h] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
          }
          for (int m = 0; m < MC; ++m) {
            for (int p = 0; p < P; ++p) {
              const int8_t* xp = xb + (m * P + p) * 32 + c * 8;
              int32_t xl, xh;
              std::memcpy(&xl, xp, 4);
              std::memcpy(&xh, xp + 4, 4);
              const __m256i bl = _mm256_set1_epi32(xl), bh = _mm256_set1_epi32(xh);
              for (int h = 0; h < NH; ++h) {
                const __m256i d = _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], bl), _mm256_maddubs_epi16(hi[h], bh));
                ip[h][m][p] = _mm256_add_epi16(ip[h][m][p], d);
              }
            }
          }
        }
        for (int h = 0; h < NH; ++h)
          for (int m = 0; m < MC; ++m) {
            __m256i c[P];
            for (int p = 0; p < P; ++p)
              c[p] = _mm256_sub_epi32(_mm256_madd_epi16(ip[h][m][p], ones), _mm256_set1_epi32(bm[m].ps[p]));
            __m256 t = _mm256_cvtepi32_ps(c[P - 1]);
            for (int p = P - 2; p >= 0; --p) t = _mm256_fmadd_ps(t, inv_base, _mm256_cvtepi32_ps(c[p]));
            if (BPG1)
              gacc[h][m] = _mm256_mul_ps(t, _mm256_set1_ps(bm[m].e));
            else
              gacc[h][m] = _mm256_fmadd_ps(t, _mm256_set1_ps(bm[m].e), gacc[h][m]);
          }
      }
      for (int h = 0; h < NH; ++h) {
        const __m256 d = F::d8(sc, g, h0 + h);
        __m256 off = _mm256_setzero_ps();
        if constexpr (F::kOff) off = _mm256_fmadd_ps(_mm256_set1_ps(8.f), d, F::m8(sc, g, h0 + h));
        for (int m = 0; m < MC; ++m) {
          acc[h][m] = _mm256_fmadd_ps(gacc[h][m], d, acc[h][m]);
          if constexpr (F::kOff) acc[h][m] = _mm256_fmadd_ps(off, _mm256_set1_ps(s[g * MC + m]), acc[h][m]);
        }
      }
    }
    for (int h = 0; h < NH; ++h)
      for (int m = 0; m < MC; ++m) _mm256_storeu_ps(out + m * ldo + (h0 + h) * 8, acc[h][m]);
  }
}

template <int MC, class F, int P>
void run_mc_avx2(int64_t gs, const uint8_t* w, const typename F::E* sc, int64_t K, const int8_t* px, const BlockMeta* meta,
                 const float* s, float* out, int64_t ldo) {
  if (gs == 32)
    block_rows_avx2<MC, true, F, P>(w, sc, K, gs, px, meta, s, out, ldo);
  else
    block_rows_avx2<MC, false, F, P>(w, sc, K, gs, px, meta, s, out, ldo);
}

template <int MC, class F, int P>
void run_mc(int64_t gs, const uint8_t* w, const typename F::E* sc, int64_t K, const int8_t* px, const BlockMeta* meta,
            const float* s, float* out, int64_t ldo) {
  constexpr int kSplit = MC == 1 ? 4 : MC == 2 ? 2 : 1;
  if (gs == 32)
    block_rows<MC, kSplit, true, F, P>(w, sc, K, gs, px, meta, s, out, ldo);
  else
    block_rows<MC, kSplit, false, F, P>(w, sc, K, gs, px, meta, s, out, ldo);
}

template <class F, int P>
void run_block(int mc, int64_t gs, const uint8_t* w, const typename F::E* sc, int64_t K, const int8_t* px,
               const BlockMeta* meta, const float* s, float* out, int64_t ldo) {
  static_assert(kMc >= 4 && kMc <= 8, "one case per tile height below");
  static_assert(kMcAvx2 >= 2 && kMcAvx2 <= 4, "one case per AVX2 tile height below");
  if (!has_vnni()) {
    switch (mc) {
      case 1: return run_mc_avx2<1, F, P>(gs, w, sc, K, px, meta, s, out, ldo);
      case 2: return run_mc_avx2<2, F, P>(gs, w, sc, K, px, meta, s, out, ldo);
      case 3: return run_mc_avx2<std::min(3, kMcAvx2), F, P>(gs, w, sc, K, px, meta, s, out, ldo);
      default: return run_mc_avx2<kMcAvx2, F, P>(gs, w, sc, K, px, meta, s, out, ldo);
    }
  }
  switch (mc) {
    case 1: return run_mc<1, F, P>(gs, w, sc, K, px, meta, s, out, ldo);
    case 2: return run_mc<2, F, P>(gs, w, sc, K, px, meta, s, out, ldo);
    case 3: return run_mc<3, F, P>(gs, w, sc, K, px, meta, s, out, ldo);
    case 4: return run_mc<4, F, P>(gs, w, sc, K, px, meta, s, out, ldo);
    case 5: return run_mc<std::min(5, kMc), F, P>(gs, w, sc, K, px, meta, s, out, ldo);
    case 6: return run_mc<std::min(6, kMc), F, P>(gs, w, sc, K, px, meta, s, out, ldo);
    case 7: return run_mc<std::min(7, kMc), F, P>(gs, w, sc, K, px, meta, s, out, ldo);
    default: return run_mc<kMc, F, P>(gs, w, sc, K, px, meta, s, out, ldo);
  }
}

// Activations of M rows quantized for the kernel, with their storage.
struct TiledBuf {
  std::vector<int8_t> px;
  std::vector<BlockMeta> meta;
  std::vector<float> s;
  Tiled q;
  TiledBuf(int64_t M, int64_t K, int64_t gs, int parts = kParts)
      : px(M * parts * K), meta(M * (K / 32)), s(M * (K / gs)) {
    q = Tiled{M, K, K / 32, K / gs, has_vnni() ? kMc : kMcAvx2, px.data(), meta.data(), s.data(), parts};
  }
};

// Output blocks [b0, b1) of one weight against every tile of q: at large M, ~64 KB of weights
// meets every tile before the next (the tiles' activations stream from L2 once per chunk).
template <class F>
void gemm_blocks(const Tiled& q, int64_t gs, const uint8_t* w, const typename F::E* sc, int64_t b0, int64_t b1, float* y,
                 int64_t N) {
  const int64_t K = q.K, wstride = (K / 8) * 64, sstride = F::stride(K, gs), ntiles = (q.M + q.tile - 1) / q.tile;
  const int64_t wchunk = std::max<int64_t>(1, kWeightChunk / wstride);
  for (int64_t c0 = b0; c0 < b1; c0 += wchunk) {
    const int64_t c1 = std::min(b1, c0 + wchunk);
    for (int64_t t = 0; t < ntiles; ++t) {
      for (int64_t nbk = c0; nbk < c1; ++nbk) {
        (q.np == 1 ? run_block<F, 1> : run_block<F, 2>)(q.mt(t), gs, w + nbk * wstride, sc + nbk * sstride, K,
                                                         q.tparts(t), q.tmeta(t), q.ts(t),
                                                         y + t * q.tile * N + nbk * kRows, N);
      }
    }
  }
}

template <class F>
void gemm(const float* x, int64_t M, int64_t K, const uint8_t* w, const typename F::E* sc, int64_t nblocks, int64_t gs,
          float* y, int parts) {
  TiledBuf a(M, K, gs, parts);
  // rows are independent: split them over the threads once there are enough to pay for a fork
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / K), [&](int64_t m0, int64_t m1) {
    quantize_rows(x, a.q, gs, m0, m1);
  });
  // ~8 blocks per task: enough to split the smallest layers over the threads, few enough forks
  at::parallel_for(0, nblocks, 8, [&](int64_t begin, int64_t end) {
    gemm_blocks<F>(a.q, gs, w, sc, begin, end, y, nblocks * kRows);
  });
}

// The scales' form of sc (see group_scales.h): fp32 or fp16 [.., G, 2, 16] (d and m), fp16
// [.., G, 1, 16] (symmetric: m = -8d), or uint8 [.., K/256, 320] (Q4_K's records, groups of 32);
// `lead` dimensions before them (1: a stack of experts). Calls fn(form, its pointer).
template <class Fn>
void with_form(const at::Tensor& sc, int64_t lead, int64_t nblocks, int64_t K, int64_t gs, const char* who, Fn&& fn) {
  if (sc.scalar_type() == at::kByte) {
    using KQ = Super<8, true>;
    TORCH_CHECK(sc.dim() == lead + 3 && sc.size(lead) == nblocks && gs == 32 && K % 256 == 0 &&
                    sc.size(lead + 1) == K / 256 && sc.size(lead + 2) == KQ::kRec && sc.is_contiguous(),
                who, ": K-quant scales must be contiguous uint8 [N/16, K/256, ", KQ::kRec, "] with groups of 32");
    return fn(KQ{}, sc.data_ptr<uint8_t>());
  }
  TORCH_CHECK(sc.dim() == lead + 4 && sc.size(lead) == nblocks && sc.size(lead + 1) == K / gs &&
                  (sc.size(lead + 2) == 2 || (sc.size(lead + 2) == 1 && sc.scalar_type() == at::kHalf)) &&
                  sc.size(lead + 3) == kRows && sc.is_contiguous(),
              who, ": scales must be contiguous [N/16, K/group, 2, 16] (fp16 or fp32) or [N/16, K/group, 1, 16] (fp16)");
  if (sc.scalar_type() == at::kHalf) {
    if (sc.size(lead + 2) == 1) return fn(Flat<at::Half, 1>{}, sc.data_ptr<at::Half>());
    return fn(Flat<at::Half, 2>{}, sc.data_ptr<at::Half>());
  }
  TORCH_CHECK(sc.scalar_type() == at::kFloat, who, ": scales must be fp16, fp32 or uint8 records");
  return fn(Flat<float, 2>{}, sc.data_ptr<float>());
}

// parts: 2 (the activations to ~16 bits, the default) or 1 (8 bits: the opt-in; see act_quant.h)
at::Tensor int4_gemm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& sc, int64_t group_size, int64_t parts) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "int4_gemm: x must be fp32 [M, K]");
  TORCH_CHECK(parts == 1 || parts == 2, "int4_gemm: parts must be 1 (8-bit activations) or 2 (16-bit), got ", parts);
  TORCH_CHECK(w.dim() == 3 && w.size(2) == 64 && w.scalar_type() == at::kByte, "int4_gemm: bad packed weight");
  const int64_t M = x.size(0), K = x.size(1), nblocks = w.size(0);
  TORCH_CHECK(w.size(1) * 8 == K, "int4_gemm: K mismatch: x has ", K, ", weight ", w.size(1) * 8);
  TORCH_CHECK(group_size % 32 == 0 && K % group_size == 0, "int4_gemm: bad group size ", group_size);
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, nblocks * kRows}, x.options());
  with_form(sc, 0, nblocks, K, group_size, "int4_gemm", [&](auto form, const auto* p) {
    if (M > 0) gemm<decltype(form)>(xc.data_ptr<float>(), M, K, w.data_ptr<uint8_t>(), p, nblocks, group_size,
                                    y.data_ptr<float>(), static_cast<int>(parts));
  });
  return y;
}

// Blocks [b0, b1) of expert e's matrix in a stack (w [E, N/16, K/8, 64], sc [E, ...] a form above).
void expert_blocks(const Tiled& q, int64_t gs, const at::Tensor& w, const at::Tensor& sc, int64_t e, int64_t b0,
                   int64_t b1, float* y, int64_t N) {
  const uint8_t* we = w.data_ptr<uint8_t>() + e * w.stride(0);
  with_form(sc, 1, w.size(1), q.K, gs, "moe_int4", [&](auto form, const auto* p) {
    gemm_blocks<decltype(form)>(q, gs, we, p + e * sc.stride(0), b0, b1, y, N);
  });
}

// One expert's share of a call: its (token, slot) pairs, its activations and outputs.
struct ExpertRows {
  int64_t e, n;
  const int64_t* pairs;
  std::vector<float> x, h1, act, h2;
  TiledBuf a1, a2;
  ExpertRows(int64_t e, int64_t n, const int64_t* pairs, int64_t H, int64_t I, int64_t N1, int64_t N2, int64_t g1,
             int64_t g2)
      : e(e), n(n), pairs(pairs), x(n * H), h1(n * N1), act(n * I), h2(n * N2), a1(n, H, g1), a2(n, I, g2) {}
};

// Every used expert's blocks of one matrix in a single parallel pass (a fork per matrix, not per
// expert: on 2 busy cores each fork/join waited for a descheduled thread, 32 of them per layer).
void experts_pass(std::vector<ExpertRows>& rows, const at::Tensor& w, const at::Tensor& sc, int64_t gs, bool first) {
  const int64_t nb = w.size(1), N = nb * kRows;
  at::parallel_for(0, static_cast<int64_t>(rows.size()) * nb, 8, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end;) {
      ExpertRows& r = rows[b / nb];
      const int64_t b1 = std::min(end, (b / nb + 1) * nb);
      expert_blocks(first ? r.a1.q : r.a2.q, gs, w, sc, r.e, b % nb, b1 - (b / nb) * nb,
                    first ? r.h1.data() : r.h2.data(), N);
      b = b1;
    }
  });
}

// A mixture-of-experts MLP on int4 experts: y[t] = sum_j weights[t, j] * down_e(silu(gate_e(x[t])) *
// up_e(x[t])) with e = ids[t, j]. The (token, slot) pairs are grouped by expert: each used expert
// gathers its rows and multiplies them by each of its matrices once (the weights are read once
// for all of them, and the experts no token chose are never read: at batch 1 that is k of E).
// w1/s1: the experts' gate and up rows stacked (gate rows 0..I-1, up rows I..2I-1), [E, ...] in
// int4_gemm's layout; w2/s2: down, K = inter.
at::Tensor moe_int4(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights, const at::Tensor& w1,
                    const at::Tensor& s1, const at::Tensor& w2, const at::Tensor& s2, int64_t group1, int64_t group2,
                    int64_t inter) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "moe_int4: x must be fp32 [T, H]");
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == T && ids.scalar_type() == at::kLong, "moe_int4: ids must be int64 [T, k]");
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.scalar_type() == at::kFloat,
              "moe_int4: weights must be fp32 [T, k]");
  TORCH_CHECK(w1.dim() == 4 && w2.dim() == 4 && w1.scalar_type() == at::kByte && w2.scalar_type() == at::kByte &&
              w1.size(3) == 64 && w2.size(3) == 64 && w1.size(0) == w2.size(0) && w1.is_contiguous() &&
              w2.is_contiguous(), "moe_int4: experts must be contiguous uint8 [E, N/16, K/8, 64]");
  TORCH_CHECK(w1.size(2) * 8 == H && w2.size(2) * 8 == inter && w1.size(1) * kRows >= 2 * inter &&
              w2.size(1) * kRows >= H, "moe_int4: expert shapes do not match H = ", H, ", I = ", inter);
  TORCH_CHECK(group1 % 32 == 0 && H % group1 == 0 && group2 % 32 == 0 && inter % group2 == 0, "moe_int4: bad group size");
  TORCH_CHECK(s1.size(0) == w1.size(0) && s2.size(0) == w2.size(0), "moe_int4: scales do not match the experts");
  // (each form's shapes checked here, before any work)
  with_form(s1, 1, w1.size(1), H, group1, "moe_int4", [](auto, const auto*) {});
  with_form(s2, 1, w2.size(1), inter, group2, "moe_int4", [](auto, const auto*) {});
  const int64_t k = ids.size(1), E = w1.size(0), N1 = w1.size(1) * kRows, N2 = w2.size(1) * kRows;
  at::Tensor y = at::zeros({T, H}, x.options());
  const at::Tensor xc = x.contiguous(), ic = ids.contiguous(), wc = weights.contiguous();
  const float* xp = xc.data_ptr<float>();
  const int64_t* ip = ic.data_ptr<int64_t>();
  const float* wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  std::vector<int64_t> start, order;  // the pairs t * k + j grouped by expert
  moe_route::by_expert(ip, T * k, E, "moe_int4", start, order);
  std::vector<ExpertRows> rows;
  rows.reserve(E);
  std::vector<std::pair<int64_t, int64_t>> where;  // pair (in expert order) -> (expert's rows, row)
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = start[e + 1] - start[e];
    if (n == 0) continue;
    rows.emplace_back(e, n, order.data() + start[e], H, inter, N1, N2, group1, group2);
    for (int64_t i = 0; i < n; ++i) where.emplace_back(rows.size() - 1, i);
  }
  const int64_t P = T * k;
  at::parallel_for(0, P, std::max<int64_t>(1, 16384 / H), [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      ExpertRows& r = rows[where[p].first];
      const int64_t i = where[p].second;
      std::memcpy(&r.x[i * H], xp + (r.pairs[i] / k) * H, H * sizeof(float));
      quantize_rows(r.x.data(), r.a1.q, group1, i, i + 1);
    }
  });
  experts_pass(rows, w1, s1, group1, true);
  at::parallel_for(0, P, std::max<int64_t>(1, 16384 / inter), [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      ExpertRows& r = rows[where[p].first];
      const int64_t i = where[p].second;
      const float* g = &r.h1[i * N1];
      float* a = &r.act[i * inter];
      for (int64_t c = 0; c < inter; ++c) a[c] = g[c] / (1.f + std::exp(-g[c])) * g[inter + c];
      quantize_rows(r.act.data(), r.a2.q, group2, i, i + 1);
    }
  });
  experts_pass(rows, w2, s2, group2, false);
  for (const ExpertRows& r : rows) {  // weighted into each token's row (pairs of a token: serial)
    for (int64_t i = 0; i < r.n; ++i) {
      const float wt = wp[r.pairs[i]];
      float* yr = yp + (r.pairs[i] / k) * H;
      const float* hr = &r.h2[i * N2];
      for (int64_t c = 0; c < H; ++c) yr[c] += wt * hr[c];
    }
  }
  return y;
}

// Row r (of its 16-row block) of rtn_pack_int4: its groups of 32 into the block's bytes wb and
// scales sb. With AVX2 the rounding is one instruction where the plain x86-64 build calls libm's
// nearbyint per value (0.3 s of a 49k x 2048 head's first load, ~0.8 s at a 128k vocabulary); no
// FMA in the clones: contracting lo + 8 * scale would change the bytes.
#if defined(__x86_64__)
__attribute__((target_clones("avx2", "default")))
#endif
void rtn_row(const float* row, int64_t K, int64_t r, uint8_t* wb, float* sb) {
  uint8_t q[32];
  for (int64_t g = 0; g < K / 32; ++g) {
    const float* v = row + 32 * g;
    float lo = v[0], hi = v[0];
    for (int i = 1; i < 32; ++i) {
      lo = std::min(lo, v[i]);
      hi = std::max(hi, v[i]);
    }
    const float scale = std::max((hi - lo) / 15.0f, 1e-10f);
    for (int i = 0; i < 32; ++i) q[i] = static_cast<uint8_t>(std::clamp(std::nearbyint((v[i] - lo) / scale), 0.0f, 15.0f));
    const float zeros = lo + 8.0f * scale;
    const float d = static_cast<float>(at::Half(scale));
    const float m = static_cast<float>(at::Half(zeros - 8.0f * scale));
    float* s = sb + g * 2 * kRows;
    s[r] = d;
    s[kRows + r] = (m + 8.0f * d) - 8.0f * d;
    uint8_t* o = wb + g * 4 * 64 + 4 * r;
    for (int c = 0; c < 4; ++c)
      for (int j = 0; j < 4; ++j) o[c * 64 + j] = q[8 * c + j] | (q[8 * c + 4 + j] << 4);
  }
}

// fp32 rows -> the layout above by round-to-nearest int4 groups of 32 (min/max), as the greedy
// head's ranking copy is made (localllm/model/layers.py ranking_head: int4.quantize_rtn, then the
// scale and offset rounded to fp16): the same fp32 operations in the same order, so the same
// bytes, in one pass (the torch route took ~1 s of a 49k x 2048 head's first load). x [n, K] ->
// (w uint8 [ceil(n/16), K/8, 64], sc fp32 [ceil(n/16), K/32, 2, 16]: d = fp16(scale) and
// m = (fp16(lo + 8 scale - 8 scale) + 8 d) - 8 d); rows past n are zeros.
std::tuple<at::Tensor, at::Tensor> rtn_pack_int4(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % 32 == 0,
              "rtn_pack_int4: x must be fp32 [n, K], K a multiple of 32");
  const at::Tensor xc = x.contiguous();
  const int64_t n = xc.size(0), K = xc.size(1), G = K / 32, nb = (n + kRows - 1) / kRows;
  at::Tensor w = at::zeros({nb, K / 8, 64}, xc.options().dtype(at::kByte));
  at::Tensor sc = at::zeros({nb, G, 2, kRows}, xc.options());
  const float* xp = xc.data_ptr<float>();
  uint8_t* wo = w.data_ptr<uint8_t>();
  float* so = sc.data_ptr<float>();
  at::parallel_for(0, nb, 4, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t r = 0; r < std::min<int64_t>(kRows, n - b * kRows); ++r)
        rtn_row(xp + (b * kRows + r) * K, K, r, wo + b * (K / 8) * 64, so + b * G * 2 * kRows);
  });
  return {w, sc};
}

}  // namespace

TORCH_LIBRARY(localllm, m) {
  m.def("int4_gemm(Tensor x, Tensor w, Tensor scales, int group_size, int parts=2) -> Tensor");
  m.def("int4_isa(bool? avx2_only=None) -> str", &int4_isa);  // no tensors: one kernel for every key
  m.def("rtn_pack_int4(Tensor x) -> (Tensor, Tensor)");
  m.def("moe_int4(Tensor x, Tensor ids, Tensor weights, Tensor w1, Tensor s1, Tensor w2, Tensor s2, int group1, "
        "int group2, int inter) -> Tensor");
}

TORCH_LIBRARY_IMPL(localllm, CPU, m) {
  m.impl("int4_gemm", &int4_gemm);
  m.impl("rtn_pack_int4", &rtn_pack_int4);
  m.impl("moe_int4", &moe_int4);
}
