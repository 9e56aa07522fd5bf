// GGUF token tables and output heads in their file's block types, used in place: the embedding
// lookup and the exact LM head for the types q8_0.cpp does not take (Q4_0, Q4_1, Q5_0, Q5_1,
// Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS: what llama.cpp's quantizer writes for
// token_embd / output in the K-quant mixes).
//
// Why: the embedding and the head are where rounding flips tokens, so they stay exact; expanded to
// fp32 they took 4 bytes a weight (a 128k x 2048 Q6_K table: 1.07 GB against the file's 0.22).
// Every value of these types is d * q + m (or d * q) with d and m products of fp16 numbers and
// small integers that fp32 holds exactly, and d * q exact too, so one fmaf per value gives the
// fp32 value gguf-py's `quants.dequantize` gives, bit for bit; products take those fp32 values
// with fp32 activations and fp32 accumulation: an fp32 GEMM on the expanded matrix up to
// summation order. Nothing is rounded to 16 bits (unlike the int4 / int8-lane layer kernels).
//
// Layout: blocks uint8 [N, K / block values, block bytes], the file's bytes (ggml-quants.c's
// block_* structs; gguf_blocks.py decodes the same in torch).
//   gguf_table_gemm(x fp32 [M, K], blocks, kind) -> y fp32 [M, N] = x @ W^T.
//   gguf_table_rows(blocks, kind, idx int64 [n]) -> fp32 [n, K]: rows of W.
// A row is decoded once into fp32 (L1) and meets every activation row there; each output is one
// dot product in a fixed order (32 lanes, k mod 32, then a fixed tree), so it does not depend on
// M, the threads, or the instruction set the compiler vectorized for (fmaf is exact rounding).
// One activation row times a Q6_K table (a sampled decode step's head) takes dot_q6k_row on
// AVX-512 or AVX2: the same operations in the same order, the row's values kept in registers.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

enum class Kind { Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS };

struct Type {
  const char* name;
  Kind kind;
  int values, bytes;  // per block
};

constexpr Type kTypes[] = {
    {"Q4_0", Kind::Q4_0, 32, 18},     {"Q4_1", Kind::Q4_1, 32, 20},     {"Q5_0", Kind::Q5_0, 32, 22},
    {"Q5_1", Kind::Q5_1, 32, 24},     {"Q2_K", Kind::Q2_K, 256, 84},    {"Q3_K", Kind::Q3_K, 256, 110},
    {"Q4_K", Kind::Q4_K, 256, 144},   {"Q5_K", Kind::Q5_K, 256, 176},   {"Q6_K", Kind::Q6_K, 256, 210},
    {"IQ4_NL", Kind::IQ4_NL, 32, 18}, {"IQ4_XS", Kind::IQ4_XS, 256, 136},
};

// ggml's kvalues_iq4nl
constexpr int8_t kIq4[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

const Type& type_of(const std::string& name) {
  for (const Type& t : kTypes)
    if (name == t.name) return t;
  TORCH_CHECK(false, "gguf_table: unsupported block type ", name,
              " (Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS)");
}

inline float f16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Q4_K / Q5_K: sub-block j's 6-bit scale and min from the 12 packed bytes (get_scale_min_k4)
inline void scale_min_k4(int j, const uint8_t* s, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// One block -> its unsigned integers q (t.values bytes) and per 16 values the scale d and offset
// m. A value is fmaf(d, q, m) (types with offsets), d * (q - zero) (symmetric types) or d * kIq4[q]
// (codebook types): each as gguf-py's dequantize computes it (exact products, one rounding for
// + m). The bit fields are cut 8 bytes at a time (SWAR on 64-bit words): the integers of a row
// cost a few operations per 8 values, on every CPU.
struct Dec {
  uint8_t* q;
  float* d;
  float* m;
};

enum class Form { kAffine, kZero, kCodebook };

template <Kind K>
constexpr Form kForm = (K == Kind::Q4_1 || K == Kind::Q5_1 || K == Kind::Q2_K || K == Kind::Q4_K || K == Kind::Q5_K)
                           ? Form::kAffine
                       : (K == Kind::IQ4_NL || K == Kind::IQ4_XS) ? Form::kCodebook
                                                                  : Form::kZero;
template <Kind K>
constexpr int kZero = K == Kind::Q4_0 ? 8 : K == Kind::Q5_0 ? 16 : K == Kind::Q6_K ? 32 : K == Kind::Q3_K ? 4 : 0;

constexpr uint64_t kLow = 0x0101010101010101ULL;  // bit 0 of every byte

inline uint64_t ld(const uint8_t* p) {
  uint64_t w;
  std::memcpy(&w, p, 8);
  return w;
}
inline void st(uint8_t* p, uint64_t w) { std::memcpy(p, &w, 8); }

// byte i of kSpread[b] = bit i of b
struct SpreadTable {
  uint64_t v[256];
  constexpr SpreadTable() : v() {
    for (int b = 0; b < 256; ++b)
      for (int i = 0; i < 8; ++i) v[b] |= static_cast<uint64_t>((b >> i) & 1) << (8 * i);
  }
};
constexpr SpreadTable kSpread;

// bytes src[0..n) -> their low nibbles at lo[0..n), high nibbles at hi[0..n) (n a multiple of 8)
inline void nibbles(const uint8_t* src, int n, uint8_t* lo, uint8_t* hi) {
  for (int i = 0; i < n; i += 8) {
    const uint64_t w = ld(src + i);
    st(lo + i, w & (15 * kLow));
    st(hi + i, (w >> 4) & (15 * kLow));
  }
}

template <Kind K>
inline void decode(const uint8_t* b, Dec o) {
  if constexpr (K == Kind::Q4_0 || K == Kind::Q4_1 || K == Kind::IQ4_NL) {
    nibbles(b + (K == Kind::Q4_1 ? 4 : 2), 16, o.q, o.q + 16);
    o.d[0] = o.d[1] = f16(b);
    if constexpr (K == Kind::Q4_1) o.m[0] = o.m[1] = f16(b + 2);
  } else if constexpr (K == Kind::Q5_0 || K == Kind::Q5_1) {
    constexpr int off = K == Kind::Q5_0 ? 2 : 4;
    nibbles(b + off + 4, 16, o.q, o.q + 16);
    for (int i = 0; i < 4; ++i)  // bit l of the 32-bit qh is the fifth bit of value l
      st(o.q + 8 * i, ld(o.q + 8 * i) | (kSpread.v[b[off + i]] << 4));
    o.d[0] = o.d[1] = f16(b);
    if constexpr (K == Kind::Q5_1) o.m[0] = o.m[1] = f16(b + 2);
  } else if constexpr (K == Kind::Q2_K || K == Kind::Q3_K) {
    // values 128h + 32j + l: bits 2j of qs[32h + l]; Q3_K's third bit: bit 4h + j of hmask[l]
    const uint8_t* qs = b + (K == Kind::Q2_K ? 16 : 32);
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < 4; ++j)
        for (int l = 0; l < 32; l += 8) {
          uint64_t v = (ld(qs + 32 * h + l) >> (2 * j)) & (3 * kLow);
          if constexpr (K == Kind::Q3_K) v |= ((ld(b + l) >> (4 * h + j)) & kLow) << 2;
          st(o.q + 128 * h + 32 * j + l, v);
        }
    if constexpr (K == Kind::Q2_K) {
      const float d = f16(b + 80), dmin = f16(b + 82);
      for (int g = 0; g < 16; ++g) {  // group g: values 16g.., scale byte g
        o.d[g] = d * static_cast<float>(b[g] & 15);
        o.m[g] = -(dmin * static_cast<float>(b[g] >> 4));
      }
    } else {
      const uint8_t* s = b + 96;
      const float d = f16(b + 108);
      for (int g = 0; g < 16; ++g) {
        const int lsc = g < 8 ? (s[g] & 15) : (s[g - 8] >> 4);
        const int hsc = (s[8 + g % 4] >> (2 * (g / 4))) & 3;
        o.d[g] = d * static_cast<float>((lsc | (hsc << 4)) - 32);
      }
    }
  } else if constexpr (K == Kind::Q4_K || K == Kind::Q5_K) {
    const float d = f16(b), dmin = f16(b + 2);
    const uint8_t* s = b + 4;
    const uint8_t* qs = b + (K == Kind::Q4_K ? 16 : 48);
    for (int c = 0; c < 4; ++c) nibbles(qs + 32 * c, 32, o.q + 64 * c, o.q + 64 * c + 32);  // sub-blocks 2c, 2c+1
    if constexpr (K == Kind::Q5_K)  // bit j of qh[l]: the fifth bit of value l of sub-block j
      for (int j = 0; j < 8; ++j)
        for (int l = 0; l < 32; l += 8)
          st(o.q + 32 * j + l, ld(o.q + 32 * j + l) | (((ld(b + 16 + l) >> j) & kLow) << 4));
    for (int j = 0; j < 8; ++j) {
      int sc, mn;
      scale_min_k4(j, s, sc, mn);
      o.d[2 * j] = o.d[2 * j + 1] = d * static_cast<float>(sc);
      o.m[2 * j] = o.m[2 * j + 1] = -(dmin * static_cast<float>(mn));
    }
  } else if constexpr (K == Kind::Q6_K) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = f16(b + 208);
    // values 128h + 32j + l: nibble j / 2 of ql[64h + 32 (j % 2) + l], high bits 2j of qh[32h + l]
    for (int h = 0; h < 2; ++h) {
      nibbles(ql + 64 * h, 64, o.q + 128 * h, o.q + 128 * h + 64);
      for (int j = 0; j < 4; ++j)
        for (int l = 0; l < 32; l += 8) {
          uint8_t* at = o.q + 128 * h + 32 * j + l;
          st(at, ld(at) | (((ld(qh + 32 * h + l) >> (2 * j)) & (3 * kLow)) << 4));
        }
    }
    for (int g = 0; g < 16; ++g) o.d[g] = d * static_cast<float>(sc[g]);
  } else {  // IQ4_XS
    const float d = f16(b);
    uint16_t sh;
    std::memcpy(&sh, b + 2, 2);
    const uint8_t* sl = b + 4;
    for (int i = 0; i < 8; ++i) {
      nibbles(b + 8 + 16 * i, 16, o.q + 32 * i, o.q + 32 * i + 16);
      const int ls = ((sl[i / 2] >> (4 * (i % 2))) & 15) | (((sh >> (2 * i)) & 3) << 4);
      o.d[2 * i] = o.d[2 * i + 1] = d * static_cast<float>(ls - 32);
    }
  }
}

// A row's integers and scales -> its fp32 values (value i from q[i], d[i / 16], m[i / 16] as
// `decode` says); every path computes each value by the same exact operations, so all agree.
template <Form F, int Z>
void values(const Dec& r, int64_t K, float* y) {
  int64_t g = 0;
#if defined(__AVX512F__)
  const __m512 tab = _mm512_setr_ps(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113);
  for (; g < K / 16; ++g) {
    const __m512i qi = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r.q + 16 * g)));
    const __m512 d = _mm512_set1_ps(r.d[g]);
    __m512 v;
    if constexpr (F == Form::kAffine) {
      v = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(qi), _mm512_set1_ps(r.m[g]));
    } else if constexpr (F == Form::kCodebook) {
      v = _mm512_mul_ps(d, _mm512_permutexvar_ps(qi, tab));
    } else {
      v = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(qi, _mm512_set1_epi32(Z))));
    }
    _mm512_storeu_ps(y + 16 * g, v);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 tlo = _mm256_setr_ps(-127, -104, -83, -65, -49, -35, -22, -10);
  const __m256 thi = _mm256_setr_ps(1, 13, 25, 38, 53, 69, 89, 113);
  for (; g < K / 16; ++g)
    for (int h = 0; h < 2; ++h) {
      const __m256i qi = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(r.q + 16 * g + 8 * h)));
      const __m256 d = _mm256_set1_ps(r.d[g]);
      __m256 v;
      if constexpr (F == Form::kAffine) {
        v = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(qi), _mm256_set1_ps(r.m[g]));
      } else if constexpr (F == Form::kCodebook) {
        const __m256 hi = _mm256_castsi256_ps(_mm256_slli_epi32(qi, 28));  // bit 3 of q in the sign bit
        v = _mm256_mul_ps(d, _mm256_blendv_ps(_mm256_permutevar8x32_ps(tlo, qi), _mm256_permutevar8x32_ps(thi, qi), hi));
      } else {
        v = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(qi, _mm256_set1_epi32(Z))));
      }
      _mm256_storeu_ps(y + 16 * g + 8 * h, v);
    }
#endif
  for (; g < K / 16; ++g)
    for (int l = 0; l < 16; ++l) {
      const int q = r.q[16 * g + l];
      float v;
      if constexpr (F == Form::kAffine) {
        v = std::fmaf(r.d[g], static_cast<float>(q), r.m[g]);
      } else if constexpr (F == Form::kCodebook) {
        v = r.d[g] * static_cast<float>(kIq4[q]);
      } else {
        v = r.d[g] * static_cast<float>(q - Z);
      }
      y[16 * g + l] = v;
    }
}

// the 32 lanes' sums folded by a fixed tree (every dot product's last step, on every path)
inline float fold32(float* acc) {
  for (int s = 16; s >= 1; s /= 2)
    for (int l = 0; l < s; ++l) acc[l] += acc[l + s];
  return acc[0];
}

// sum_k w[k] x[k] in a fixed order: lane k % 32 accumulates by fmaf, then a fixed tree
inline float dot(const float* w, const float* x, int64_t K) {
  alignas(64) float acc[32];
  int64_t k = 0;
#if defined(__AVX512F__)
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  for (; k < K; k += 32) {
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k), _mm512_loadu_ps(x + k), a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k + 16), _mm512_loadu_ps(x + k + 16), a1);
  }
  _mm512_store_ps(acc, a0);
  _mm512_store_ps(acc + 16, a1);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (; k < K; k += 32)
    for (int j = 0; j < 4; ++j) a[j] = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 8 * j), _mm256_loadu_ps(x + k + 8 * j), a[j]);
  for (int j = 0; j < 4; ++j) _mm256_store_ps(acc + 8 * j, a[j]);
#else
  for (int l = 0; l < 32; ++l) acc[l] = 0.f;
  for (; k < K; k += 32)
    for (int l = 0; l < 32; ++l) acc[l] = std::fmaf(w[k + l], x[k + l], acc[l]);
#endif
  return fold32(acc);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// One Q6_K row times one activation row (a decode step's sampled head), each block's values made
// in registers and a 256-byte buffer: the same fp32 values (d * sc * (q - 32)) multiplied into the
// same lanes in the same order as decode_row + dot, so the same bits, with a third of their
// instructions (the 6-bit integers cut 64 at a time; a 49k x 2048 head: 11 -> 5 ms, 2 threads).
float dot_q6k_row(const uint8_t* row, int64_t nb, const float* x) {
  __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  const __m512i low4 = _mm512_set1_epi8(0x0F), low2 = _mm512_set1_epi8(3), zero = _mm512_set1_epi8(32);
  // qh's 2-bit field for values 128h + 32j + l sits at bit 2j of qh[32h + l]: j = 0, 1 (the low
  // nibbles' 64 values) and j = 2, 3 (the high nibbles'), one shift count per 256-bit half
  const __m512i shift_lo = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
  const __m512i shift_hi = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);
  alignas(64) int8_t qb[256];
  alignas(64) float ds[16];
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* b = row + 210 * i;
    for (int h = 0; h < 2; ++h) {
      const __m512i l = _mm512_loadu_si512(b + 64 * h);
      const __m512i hq = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h)));
      const __m512i lo = _mm512_and_si512(l, low4), hi = _mm512_and_si512(_mm512_srli_epi16(l, 4), low4);
      const __m512i blo = _mm512_and_si512(_mm512_srlv_epi16(hq, shift_lo), low2);
      const __m512i bhi = _mm512_and_si512(_mm512_srlv_epi16(hq, shift_hi), low2);
      _mm512_store_si512(qb + 128 * h, _mm512_sub_epi8(_mm512_or_si512(lo, _mm512_slli_epi16(blo, 4)), zero));
      _mm512_store_si512(qb + 128 * h + 64, _mm512_sub_epi8(_mm512_or_si512(hi, _mm512_slli_epi16(bhi, 4)), zero));
    }
    const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192))));
    _mm512_store_ps(ds, _mm512_mul_ps(_mm512_set1_ps(f16(b + 208)), sc));  // d * sc[g], as decode makes it
    const float* xb = x + 256 * i;
    for (int g = 0; g < 16; ++g) {
      const __m512i q = _mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(qb + 16 * g)));
      const __m512 w = _mm512_mul_ps(_mm512_set1_ps(ds[g]), _mm512_cvtepi32_ps(q));
      acc[g % 2] = _mm512_fmadd_ps(w, _mm512_loadu_ps(xb + 16 * g), acc[g % 2]);
    }
  }
  alignas(64) float a[32];
  _mm512_store_ps(a, acc[0]);
  _mm512_store_ps(a + 16, acc[1]);
  return fold32(a);
}
#define LOCALLLM_Q6K_ROW 1
#elif defined(__AVX2__) && defined(__FMA__)
// The same on AVX2: 32 integers at a time, values 8 at a time into dot's four 8-lane accumulators
// (lane k % 32), so the same bits again.
float dot_q6k_row(const uint8_t* row, int64_t nb, const float* x) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  const __m256i low4 = _mm256_set1_epi8(0x0F), low2 = _mm256_set1_epi8(3), zero = _mm256_set1_epi8(32);
  alignas(32) int8_t qb[256];
  alignas(32) float ds[16];
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* b = row + 210 * i;
    for (int h = 0; h < 2; ++h) {  // values 128h + 32j + l: nibble j / 2 of ql[64h + 32 (j % 2) + l]
      const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h));
      const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32));
      const __m256i hq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
      const __m256i nib[4] = {_mm256_and_si256(l0, low4), _mm256_and_si256(l1, low4),
                              _mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
                              _mm256_and_si256(_mm256_srli_epi16(l1, 4), low4)};
      for (int j = 0; j < 4; ++j) {
        const __m256i hb = _mm256_and_si256(_mm256_srl_epi16(hq, _mm_cvtsi32_si128(2 * j)), low2);
        _mm256_store_si256(reinterpret_cast<__m256i*>(qb + 128 * h + 32 * j),
                           _mm256_sub_epi8(_mm256_or_si256(nib[j], _mm256_slli_epi16(hb, 4)), zero));
      }
    }
    const float d = f16(b + 208);
    for (int g = 0; g < 16; ++g) ds[g] = d * static_cast<float>(reinterpret_cast<const int8_t*>(b + 192)[g]);
    const float* xb = x + 256 * i;
    for (int g = 0; g < 16; ++g) {
      const __m256 d = _mm256_set1_ps(ds[g]);
      for (int e = 0; e < 2; ++e) {
        const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qb + 16 * g + 8 * e)));
        const __m256 w = _mm256_mul_ps(d, _mm256_cvtepi32_ps(q));
        acc[2 * (g % 2) + e] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xb + 16 * g + 8 * e), acc[2 * (g % 2) + e]);
      }
    }
  }
  alignas(32) float a[32];
  for (int j = 0; j < 4; ++j) _mm256_store_ps(a + 8 * j, acc[j]);
  return fold32(a);
}
#define LOCALLLM_Q6K_ROW 1
#endif

// A row of blocks -> its fp32 values; q, d, m: scratch of K, K / 16, K / 16
template <Kind K>
void decode_row(const uint8_t* row, int64_t nb, int bytes, int vals, uint8_t* q, float* d, float* m, float* y) {
  for (int64_t i = 0; i < nb; ++i)
    decode<K>(row + i * bytes, Dec{q + i * vals, d + i * vals / 16, m + i * vals / 16});
  values<kForm<K>, kZero<K>>(Dec{q, d, m}, nb * vals, y);
}

using RowFn = void (*)(const uint8_t*, int64_t, int, int, uint8_t*, float*, float*, float*);

RowFn row_fn(Kind k) {
  switch (k) {
    case Kind::Q4_0: return decode_row<Kind::Q4_0>;
    case Kind::Q4_1: return decode_row<Kind::Q4_1>;
    case Kind::Q5_0: return decode_row<Kind::Q5_0>;
    case Kind::Q5_1: return decode_row<Kind::Q5_1>;
    case Kind::Q2_K: return decode_row<Kind::Q2_K>;
    case Kind::Q3_K: return decode_row<Kind::Q3_K>;
    case Kind::Q4_K: return decode_row<Kind::Q4_K>;
    case Kind::Q5_K: return decode_row<Kind::Q5_K>;
    case Kind::Q6_K: return decode_row<Kind::Q6_K>;
    case Kind::IQ4_NL: return decode_row<Kind::IQ4_NL>;
    case Kind::IQ4_XS: return decode_row<Kind::IQ4_XS>;
  }
  return nullptr;
}

// per-thread scratch for one row
struct Scratch {
  std::vector<uint8_t> q;
  std::vector<float> d, m, y;
  explicit Scratch(int64_t K) : q(K), d(K / 16), m(K / 16), y(K) {}
  void row(RowFn fn, const uint8_t* r, int64_t nb, const Type& t, float* out) {
    fn(r, nb, t.bytes, t.values, q.data(), d.data(), m.data(), out);
  }
};

const Type& check_blocks(const at::Tensor& blocks, const std::string& kind) {
  const Type& t = type_of(kind);
  TORCH_CHECK(blocks.dim() == 3 && blocks.size(2) == t.bytes && blocks.scalar_type() == at::kByte &&
                  blocks.is_contiguous(),
              "gguf_table: ", kind, " blocks must be contiguous uint8 [N, K/", t.values, ", ", t.bytes, "]");
  return t;
}

at::Tensor gguf_table_gemm(const at::Tensor& x, const at::Tensor& blocks, const std::string& kind) {
  const Type& t = check_blocks(blocks, kind);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "gguf_table_gemm: x must be fp32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = blocks.size(0), nb = blocks.size(1);
  TORCH_CHECK(nb * t.values == K, "gguf_table_gemm: K mismatch: x has ", K, ", the matrix ", nb * t.values);
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t row_bytes = nb * t.bytes;
  const RowFn fn = row_fn(t.kind);
  // ~1k rows a task: the threads split a vocabulary evenly, with few forks (as q8_0.cpp)
  at::parallel_for(0, N, 1024, [&](int64_t n0, int64_t n1) {
    Scratch sc(K);
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = w + n * row_bytes;
#if defined(__x86_64__)
      // the head is streamed once per token: the next rows' bytes asked for ahead of the decode
      for (int64_t off = 0; off < row_bytes; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(row + 4 * row_bytes + off), _MM_HINT_T0);
#endif
#if defined(LOCALLLM_Q6K_ROW)
      if (M == 1 && t.kind == Kind::Q6_K) {  // the K-quant mixes' head, at a decode step
        yp[n] = dot_q6k_row(row, nb, xp);
        continue;
      }
#endif
      sc.row(fn, row, nb, t, sc.y.data());
      for (int64_t m = 0; m < M; ++m) yp[m * N + n] = dot(sc.y.data(), xp + m * K, K);
    }
  });
  return y;
}

at::Tensor gguf_table_rows(const at::Tensor& blocks, const std::string& kind, const at::Tensor& idx) {
  const Type& t = check_blocks(blocks, kind);
  TORCH_CHECK(idx.dim() == 1 && idx.scalar_type() == at::kLong, "gguf_table_rows: idx must be int64 [n]");
  const int64_t N = blocks.size(0), nb = blocks.size(1), K = nb * t.values, n = idx.size(0);
  const at::Tensor ic = idx.contiguous();
  const int64_t* ip = ic.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < N, "gguf_table_rows: row ", ip[i], " out of range");
  at::Tensor out = at::empty({n, K}, blocks.options().dtype(at::kFloat));
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const RowFn fn = row_fn(t.kind);
  at::parallel_for(0, n, 64, [&](int64_t i0, int64_t i1) {
    Scratch sc(K);
    for (int64_t i = i0; i < i1; ++i) sc.row(fn, w + ip[i] * nb * t.bytes, nb, t, op + i * K);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(localllm, m) {
  m.def("gguf_table_gemm(Tensor x, Tensor blocks, str kind) -> Tensor");
  m.def("gguf_table_rows(Tensor blocks, str kind, Tensor idx) -> Tensor");
}

TORCH_LIBRARY_IMPL(localllm, CPU, m) {
  m.impl("gguf_table_gemm", &gguf_table_gemm);
  m.impl("gguf_table_rows", &gguf_table_rows);
}
