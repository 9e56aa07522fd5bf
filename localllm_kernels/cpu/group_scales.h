// The forms of the per-group scales our int4 and int8-lane GEMMs read (int4_gemm.cpp,
// int8_gemm.cpp), for one 16-row block of weights: each form gives a group's scales d and
// offsets m of the block's 16 rows in fp32, the same values on every path (AVX-512, AVX2, scalar).
//
//   Flat<T, NS>: T [G, NS, 16]: per group 16 scales d, then (NS = 2) 16 offsets m.
//   Super<GPS, OFF>: GGUF's K-quant form, read as the file keeps it: per 256 columns one record of
//      16 fp16 super-scales d, (OFF) 16 fp16 -dmin, then int8 sub-scales sc [GPS][16] and (OFF)
//      int8 mins mn [GPS][16] (GPS = 256 / group). A group's d * sc and -dmin * mn are formed in
//      fp32 here: exact (an 11-bit mantissa times an integer of at most 8 bits), so they are the
//      products gguf-py's dequantizers use, from 18-36 bytes per row and 256 values where fp32
//      products took 64-128 (Q4_K: 0.58 bytes a weight, the file's 0.56, not 0.75).
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace group_scales {

constexpr int kRows = 16;  // output rows per block

inline float to_f(float v) { return v; }
inline float to_f(c10::Half v) { return static_cast<float>(v); }
inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

#if defined(__x86_64__)
__attribute__((target("avx512f,avx512bw,f16c"))) inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
__attribute__((target("avx512f,avx512bw,f16c"))) inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
__attribute__((target("avx2,f16c"))) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2,f16c"))) inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif

template <typename T, int NS>
struct Flat {
  using E = T;
  static constexpr bool kOff = NS == 2;
  static int64_t stride(int64_t K, int64_t gs) { return (K / gs) * NS * kRows; }  // elements per 16 rows
  static float d(const E* p, int64_t g, int r) { return to_f(p[g * NS * kRows + r]); }
  static float m(const E* p, int64_t g, int r) { return to_f(p[(g * NS + 1) * kRows + r]); }
#if defined(__x86_64__)
  __attribute__((target("avx512f,avx512bw,f16c"))) static __m512 d16(const E* p, int64_t g) {
    return load16(p + g * NS * kRows);
  }
  __attribute__((target("avx512f,avx512bw,f16c"))) static __m512 m16(const E* p, int64_t g) {
    return load16(p + (g * NS + 1) * kRows);
  }
  __attribute__((target("avx2,f16c"))) static __m256 d8(const E* p, int64_t g, int half) {
    return load8(p + g * NS * kRows + half * 8);
  }
  __attribute__((target("avx2,f16c"))) static __m256 m8(const E* p, int64_t g, int half) {
    return load8(p + (g * NS + 1) * kRows + half * 8);
  }
#endif
};

template <int GPS, bool OFF>
struct Super {
  using E = uint8_t;
  static constexpr bool kOff = OFF;
  static constexpr int kHead = 32 * (1 + OFF);                 // the fp16 d (and -dmin) of 16 rows
  static constexpr int kRec = kHead + GPS * kRows * (1 + OFF);  // bytes per 16 rows and 256 columns
  static constexpr int kGroup = 256 / GPS;
  static int64_t stride(int64_t K, int64_t) { return (K / 256) * kRec; }
  static const uint8_t* rec(const E* p, int64_t g) { return p + (g / GPS) * kRec; }
  static const int8_t* sub(const E* p, int64_t g, int which) {  // which 0: sc, 1: mn
    return reinterpret_cast<const int8_t*>(rec(p, g) + kHead + (which * GPS + g % GPS) * kRows);
  }
  static float d(const E* p, int64_t g, int r) { return half_at(rec(p, g) + 2 * r) * static_cast<float>(sub(p, g, 0)[r]); }
  static float m(const E* p, int64_t g, int r) {
    return half_at(rec(p, g) + 32 + 2 * r) * static_cast<float>(sub(p, g, 1)[r]);
  }
#if defined(__x86_64__)
  __attribute__((target("avx512f,avx512bw,f16c"))) static __m512 mul16(const uint8_t* h, const int8_t* s) {
    return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h))),
                         _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)))));
  }
  __attribute__((target("avx2,f16c"))) static __m256 mul8(const uint8_t* h, const int8_t* s) {
    return _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h))),
                         _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s)))));
  }
  __attribute__((target("avx512f,avx512bw,f16c"))) static __m512 d16(const E* p, int64_t g) {
    return mul16(rec(p, g), sub(p, g, 0));
  }
  __attribute__((target("avx512f,avx512bw,f16c"))) static __m512 m16(const E* p, int64_t g) {
    return mul16(rec(p, g) + 32, sub(p, g, 1));
  }
  __attribute__((target("avx2,f16c"))) static __m256 d8(const E* p, int64_t g, int half) {
    return mul8(rec(p, g) + 16 * half, sub(p, g, 0) + 8 * half);
  }
  __attribute__((target("avx2,f16c"))) static __m256 m8(const E* p, int64_t g, int half) {
    return mul8(rec(p, g) + 32 + 16 * half, sub(p, g, 1) + 8 * half);
  }
#endif
};

}  // namespace group_scales
