// The activations as our int4 and int8-lane GEMMs take them (int4_gemm.cpp, int8_gemm.cpp): per
// 32-block of an fp32 row, x = e * (p0 + p1/254) with int8 parts (round to nearest even, the
// last part clamped to +-127, e = amax / 127: about 16 bits where bf16 keeps 8), in tiles of
// rows laid out in the order the kernels read them. With one part (the opt-in 8-bit activations,
// llama.cpp's way though with a scale per 32 values, not per 256), x = e * p0: half the dot
// products, ~1.7x the multiply rate at prefill sizes, a relative error of ~5e-3 per product. The per-block arithmetic is written once
// here, so both kernels (and each kernel's AVX-512 and AVX2 paths) quantize to the same integers;
// each kernel keeps its own per-block record (Meta) and its own group sums.
#pragma once

#include <algorithm>
#include <cstdint>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace act_quant {

constexpr int kParts = 2;       // the default (see int4_gemm.cpp's top: 3 is as exact as fp32, and slower)
constexpr float kBase = 254.f;  // weight of each part against the next
// AVX2 has 16 vector registers (AVX-512: 32): tiles of 3 rows (thread CPU time on a 2-core EPYC,
// 1B shapes at M = 16-64: 3 ~ 4 rows, 2 rows 1.1-1.5x slower)
constexpr int kMcAvx2 = 3;

// The activations in tiles of `tile` rows (the last tile has mt = M % tile rows when that is not
// 0): tile t starts at row t * tile; within a tile, per 32-block, the rows' parts follow each
// other: parts int8 [.., K/32, mt, kParts, 32], meta [.., K/32, mt], s fp32 [.., G, mt] (group
// sums). One pointer walks a tile's whole working set in order.
template <class Meta>
struct Tiled {
  int64_t M, K, nb, ng;
  int64_t tile;  // rows per tile: the kernel's kMc with AVX-512, kMcAvx2 without
  int8_t* parts;
  Meta* meta;
  float* s;
  int np = kParts;  // parts per value: 2 (16-bit activations) or 1 (8-bit)
  int mt(int64_t t) const { return static_cast<int>(std::min<int64_t>(tile, M - t * tile)); }
  int8_t* tparts(int64_t t) const { return parts + t * tile * np * K; }
  Meta* tmeta(int64_t t) const { return meta + t * tile * nb; }
  float* ts(int64_t t) const { return s + t * tile * ng; }
};

#if defined(__x86_64__)
// One 32-block v (two halves of 16) -> its P parts at dst [P][32] and each part's int32 sums
// over the two 16-halves; returns the block scale e. |r| <= 127, and each remainder
// (r - round(r)) * 254 again: every part fits int8 (with 256 a tie at 0.5 would give 128).
template <int P = kParts>
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline float block_512(const __m512 v[2], int8_t* dst,
                                                                           int32_t sums[kParts][2]) {
  const __m512 lim = _mm512_set1_ps(127.f), nlim = _mm512_set1_ps(-127.f), base = _mm512_set1_ps(kBase);
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
  // blocks of zeros or denormals (127 / amax would overflow) contribute nothing
  const bool live = amax > 1e-30f;
  const __m512 inv = _mm512_set1_ps(live ? 127.f / amax : 0.f);
  __m512 r[2] = {_mm512_mul_ps(v[0], inv), _mm512_mul_ps(v[1], inv)};
  for (int p = 0; p < P; ++p) {
    for (int h = 0; h < 2; ++h) {
      __m512 qf = _mm512_roundscale_ps(r[h], kRound);
      if (p == P - 1) qf = _mm512_min_ps(lim, _mm512_max_ps(nlim, qf));
      const __m512i qi = _mm512_cvtps_epi32(qf);
      sums[p][h] = _mm512_reduce_add_epi32(qi);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + p * 32 + h * 16), _mm512_cvtsepi32_epi8(qi));
      r[h] = _mm512_mul_ps(_mm512_sub_ps(r[h], qf), base);
    }
  }
  return live ? amax / 127.f : 0.f;
}

// The same with AVX2, v as four 8-lane quarters: the same parts, sums and scale.
template <int P = kParts>
__attribute__((target("avx2,fma"))) inline float block_avx2(const __m256 v[4], int8_t* dst, int32_t sums[kParts][2]) {
  const __m256 lim = _mm256_set1_ps(127.f), nlim = _mm256_set1_ps(-127.f), base = _mm256_set1_ps(kBase);
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                  _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
  __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(mx, 1), _mm256_castps256_ps128(mx));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float amax = std::max(_mm_cvtss_f32(m4), _mm_cvtss_f32(_mm_shuffle_ps(m4, m4, 1)));
  const bool live = amax > 1e-30f;
  const __m256 inv = _mm256_set1_ps(live ? 127.f / amax : 0.f);
  __m256 r[4];
  for (int h = 0; h < 4; ++h) r[h] = _mm256_mul_ps(v[h], inv);
  for (int p = 0; p < P; ++p) {
    __m256i qi[4];
    for (int h = 0; h < 4; ++h) {
      __m256 qf = _mm256_round_ps(r[h], kRound);
      if (p == P - 1) qf = _mm256_min_ps(lim, _mm256_max_ps(nlim, qf));
      qi[h] = _mm256_cvtps_epi32(qf);
      r[h] = _mm256_mul_ps(_mm256_sub_ps(r[h], qf), base);
    }
    // int32 -> int8 (saturating, the values fit), back in order after the per-lane packs
    const __m256i b8 = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + p * 32), _mm256_permutevar8x32_epi32(b8, order));
    for (int h = 0; h < 2; ++h) {  // the 16-halves' integer sums
      const __m256i s8 = _mm256_add_epi32(qi[2 * h], qi[2 * h + 1]);
      __m128i s4 = _mm_add_epi32(_mm256_extracti128_si256(s8, 1), _mm256_castsi256_si128(s8));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
      sums[p][h] = _mm_cvtsi128_si32(s4);
    }
  }
  return live ? amax / 127.f : 0.f;
}
#endif

}  // namespace act_quant
