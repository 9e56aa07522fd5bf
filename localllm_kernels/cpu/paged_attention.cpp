// Paged attention for CPU: queries of a flattened batch against the paged KV cache, read in place.
//
// Why: the torch path gathers every sequence's K/V through the block table into a dense tensor
// (and converts it to fp32) before SDPA: at long context that copy costs as much as the attention.
// Here a work item (sequence, query tile, range of KV heads, context chunk) walks its block table
// in tiles of 16 positions; for each tile it takes the KV heads in turn (a tile's rows of all heads
// lie together in the cache: walking one head's rows across the whole context instead reads
// memory at a stride and runs ~3x slower), and reads each K/V row once for all G query heads of its
// KV head and all query rows of the tile (the whole sequence up to 16 rows: decode, speculative
// verify, prefix-hit extend), with an online softmax per tile (flash-decoding). When the items are
// few against the threads (decode at batch 1), long contexts are split into chunks whose partial
// (max, sum, acc) are merged afterwards, and short ones into groups of KV heads. Items are taken
// from a shared counter, longest first. fp16/bf16 caches are converted to fp32 on load (once per
// tile and head); all arithmetic is fp32. A q8_0 cache (uint8, llama.cpp's Q8_0 blocks: an fp16
// scale d and 32 int8 q per 32 values of a head's row, localllm_kernels/kv_quant.py) is read as d * q (exact
// in fp32) where it lies, 16 values at a time: half the bytes of an fp16 cache.
//
// Built with -march=native (the cached library is keyed by the CPU's flags): AVX-512, AVX2+F16C+FMA,
// or plain loops for any other CPU; every path works on 16 floats at a time (D % 16 == 0).
//
// q [T, H, D] fp32; k_cache, v_cache [num_blocks, block_size, KVH, D] fp32/fp16/bf16 (q8_0: uint8
// [num_blocks, block_size, KVH, D / 32 * 34]);
// block_tables [B, max_blocks], cu_seqlens_q [B + 1], context_lens [B] int64. Row i of sequence b
// (n_b = cu[b+1] - cu[b] rows) sits at position ctx_b - n_b + i and sees positions 0 ..= that.
// Query head h uses KV head h / (H / KVH). Returns [T, H, D] fp32.
// window > 0 (sliding-window layers): a row at position p sees positions > p - window only; a work
// item starts at the first position any of its rows sees, so the cost follows the window, not the
// context. softcap > 0 (Gemma 2): scores s become softcap * tanh(s / softcap) before the softmax.
// sinks [H] (gpt-oss): a learned logit per query head joins each softmax's denominator (no value):
// applied once, where a row's output is normalized.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int kTile = 16;       // keys per softmax step: one query's scores over a tile are one Vec16
constexpr int kMinChunk = 256;  // keys: shortest context chunk worth a work item of its own
constexpr int64_t kSerialWork = 1 << 17;  // multiply-adds per pass (q.k or p.v) below which one thread runs
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// One q8_0 block: 32 values d * q. A row pointer of this type advances by blocks, so the loads below
// take (row, column) rather than an element pointer (`at`).
struct Q8Block {
  uint16_t d;  // fp16 bits
  int8_t q[32];
};
static_assert(sizeof(Q8Block) == 34, "Q8_0 blocks are 34 bytes");

// ---- 16 floats ------------------------------------------------------------------------------

#if defined(__AVX512F__)
#define PA_ISA "avx512"
constexpr int kAccQ = 4, kAccC = 4;  // accumulate block: queries x 16-column chunks (registers)
struct Vec16 {
  __m512 v;
};
inline Vec16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline Vec16 load(const c10::Half* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline Vec16 load(const c10::BFloat16* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
}
// columns [c, c + 16) of a q8_0 row (c % 16 == 0): one block's scale times 16 of its int8
inline Vec16 at(const Q8Block* row, int64_t c) {
  const Q8Block& b = row[c >> 5];
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.q + (c & 31)));
  return {_mm512_mul_ps(_mm512_set1_ps(_cvtsh_ss(b.d)), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)))};
}
inline void store(float* p, Vec16 a) { _mm512_storeu_ps(p, a.v); }
inline Vec16 set1(float x) { return {_mm512_set1_ps(x)}; }
inline Vec16 zero() { return {_mm512_setzero_ps()}; }
inline Vec16 fma(Vec16 a, Vec16 b, Vec16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec16 mul(Vec16 a, Vec16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Vec16 sub(Vec16 a, Vec16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Vec16 div(Vec16 a, Vec16 b) { return {_mm512_div_ps(a.v, b.v)}; }
inline Vec16 vmin(Vec16 a, Vec16 b) { return {_mm512_min_ps(a.v, b.v)}; }
inline Vec16 vmax(Vec16 a, Vec16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline float hsum(Vec16 a) { return _mm512_reduce_add_ps(a.v); }
inline float hmax(Vec16 a) { return _mm512_reduce_max_ps(a.v); }
// e^x for x <= 0 (Cephes expf, ~1 ulp); below -87 (e^x < FLT_MIN, and -inf) gives 0
inline Vec16 exp_nonpos(Vec16 a) {
  const __m512 x = _mm512_max_ps(a.v, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __m512 out = _mm512_mul_ps(y, _mm512_castsi512_ps(e));
  return {_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a.v, _mm512_set1_ps(-87.f), _CMP_GE_OQ), out)};
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PA_ISA "avx2"
#define PA_AVX2 1
constexpr int kQB = 1, kKB = 4;      // score block: queries x keys (16 ymm registers)
constexpr int kAccQ = 2, kAccC = 2;  // accumulate block: queries x 16-column chunks
struct Vec16 {
  __m256 lo, hi;
};
inline Vec16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline Vec16 load(const c10::Half* p) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm256_cvtph_ps(_mm256_castsi256_si128(w)), _mm256_cvtph_ps(_mm256_extracti128_si256(w, 1))};
}
inline Vec16 load(const c10::BFloat16* p) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i lo = _mm256_cvtepu16_epi32(_mm256_castsi256_si128(w));
  const __m256i hi = _mm256_cvtepu16_epi32(_mm256_extracti128_si256(w, 1));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16))};
}
inline Vec16 at(const Q8Block* row, int64_t c) {
  const Q8Block& b = row[c >> 5];
  const __m256 d = _mm256_set1_ps(_cvtsh_ss(b.d));
  const int8_t* q = b.q + (c & 31);
  const __m256i lo = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
  const __m256i hi = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8)));
  return {_mm256_mul_ps(d, _mm256_cvtepi32_ps(lo)), _mm256_mul_ps(d, _mm256_cvtepi32_ps(hi))};
}
inline void store(float* p, Vec16 a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline Vec16 set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline Vec16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Vec16 fma(Vec16 a, Vec16 b, Vec16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline Vec16 mul(Vec16 a, Vec16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline Vec16 sub(Vec16 a, Vec16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline Vec16 div(Vec16 a, Vec16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline Vec16 vmin(Vec16 a, Vec16 b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline Vec16 vmax(Vec16 a, Vec16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline float hsum8(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float hsum(Vec16 a) { return hsum8(_mm256_add_ps(a.lo, a.hi)); }
// out[j] = hsum(a[j]) for 4 vectors at once
inline void hsum4(const Vec16* a, float* out) {
  const __m256 h01 = _mm256_hadd_ps(_mm256_add_ps(a[0].lo, a[0].hi), _mm256_add_ps(a[1].lo, a[1].hi));
  const __m256 h23 = _mm256_hadd_ps(_mm256_add_ps(a[2].lo, a[2].hi), _mm256_add_ps(a[3].lo, a[3].hi));
  const __m256 h = _mm256_hadd_ps(h01, h23);  // per 128-bit half: the 4 sums of that half
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}
inline float hmax(Vec16 a) {
  const __m256 m = _mm256_max_ps(a.lo, a.hi);
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline __m256 exp8_nonpos(__m256 a) {
  const __m256 x = _mm256_max_ps(a, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 out = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  return _mm256_and_ps(out, _mm256_cmp_ps(a, _mm256_set1_ps(-87.f), _CMP_GE_OQ));
}
inline Vec16 exp_nonpos(Vec16 a) { return {exp8_nonpos(a.lo), exp8_nonpos(a.hi)}; }

#else
#define PA_ISA "generic"
constexpr int kQB = 2, kKB = 2;
constexpr int kAccQ = 2, kAccC = 2;
struct Vec16 {
  float f[16];
};
template <typename T>
inline Vec16 load(const T* p) {
  Vec16 r;
  for (int i = 0; i < 16; ++i) r.f[i] = static_cast<float>(p[i]);
  return r;
}
inline Vec16 at(const Q8Block* row, int64_t c) {
  const Q8Block& b = row[c >> 5];
  const float d = static_cast<float>(c10::Half(b.d, c10::Half::from_bits()));
  Vec16 r;
  for (int i = 0; i < 16; ++i) r.f[i] = d * static_cast<float>(b.q[(c & 31) + i]);
  return r;
}
inline void store(float* p, Vec16 a) { std::memcpy(p, a.f, sizeof(a.f)); }
inline Vec16 set1(float x) {
  Vec16 r;
  for (int i = 0; i < 16; ++i) r.f[i] = x;
  return r;
}
inline Vec16 zero() { return set1(0.f); }
inline Vec16 fma(Vec16 a, Vec16 b, Vec16 c) {
  for (int i = 0; i < 16; ++i) c.f[i] = a.f[i] * b.f[i] + c.f[i];
  return c;
}
inline Vec16 mul(Vec16 a, Vec16 b) {
  for (int i = 0; i < 16; ++i) a.f[i] *= b.f[i];
  return a;
}
inline Vec16 sub(Vec16 a, Vec16 b) {
  for (int i = 0; i < 16; ++i) a.f[i] -= b.f[i];
  return a;
}
inline Vec16 div(Vec16 a, Vec16 b) {
  for (int i = 0; i < 16; ++i) a.f[i] /= b.f[i];
  return a;
}
inline Vec16 vmin(Vec16 a, Vec16 b) {
  for (int i = 0; i < 16; ++i) a.f[i] = std::min(a.f[i], b.f[i]);
  return a;
}
inline Vec16 vmax(Vec16 a, Vec16 b) {
  for (int i = 0; i < 16; ++i) a.f[i] = std::max(a.f[i], b.f[i]);
  return a;
}
inline float hsum(Vec16 a) {
  for (int w = 8; w > 0; w /= 2)
    for (int i = 0; i < w; ++i) a.f[i] += a.f[i + w];
  return a.f[0];
}
inline float hmax(Vec16 a) {
  float m = a.f[0];
  for (int i = 1; i < 16; ++i) m = std::max(m, a.f[i]);
  return m;
}
inline Vec16 exp_nonpos(Vec16 a) {
  for (int i = 0; i < 16; ++i) a.f[i] = a.f[i] < -87.f ? 0.f : std::exp(a.f[i]);
  return a;
}
#endif

// up to this many queries per head, 16-bit rows are converted where they are read, else once per
// tile. AVX2: one, as each query's pass converted the rows again, and VCVTPH2PS (8 values a
// cycle) bound the scores: 2,000 positions of the 135M shape (3 queries per KV head), fp16 cache,
// 30 layers, 1 thread: 10.4 -> 8.4 ms a token (2 threads, bound by memory: 5.5 -> 5.2)
#if defined(PA_AVX2)
constexpr int64_t kDirectM = 1;
#else
constexpr int64_t kDirectM = 4;
#endif

// tanh(x), a few ulp, as a rational function odd / even in x (Eigen's fast tanh: no cancellation
// near 0, unlike forms built on e^2x); beyond |x| = 7.905 tanh rounds to +-1 in fp32
inline Vec16 tanh16(Vec16 x) {
  x = vmin(vmax(x, set1(-7.90531110763549805f)), set1(7.90531110763549805f));
  const Vec16 x2 = mul(x, x);
  Vec16 p = set1(-2.76076847742355e-16f);
  p = fma(p, x2, set1(2.00018790482477e-13f));
  p = fma(p, x2, set1(-8.60467152213735e-11f));
  p = fma(p, x2, set1(5.12229709037114e-08f));
  p = fma(p, x2, set1(1.48572235717979e-05f));
  p = fma(p, x2, set1(6.37261928875436e-04f));
  p = fma(p, x2, set1(4.89352455891786e-03f));
  Vec16 q = set1(1.19825839466702e-06f);
  q = fma(q, x2, set1(1.18534705686654e-04f));
  q = fma(q, x2, set1(2.26843463243900e-03f));
  q = fma(q, x2, set1(4.89352518554385e-03f));
  return div(mul(x, p), q);
}

// columns [c, c + 16) of a row of floats, fp16 or bf16
template <typename T>
inline Vec16 at(const T* row, int64_t c) {
  return load(row + c);
}

// elements of a head's row in the cache (q8_0: blocks of 32)
template <typename T>
constexpr int64_t kPer = std::is_same_v<T, Q8Block> ? 32 : 1;

// ---- the attention ---------------------------------------------------------------------------

struct Problem {
  const float* q;
  const void* k;
  const void* v;
  const int64_t* bt;   // [B, MB]
  const int64_t* cu;   // [B + 1]
  const int64_t* ctx;  // [B]
  int64_t H, KVH, G, D, BS, MB;
  float scale;
  int64_t window;  // > 0: a query at position p sees positions > p - window only
  float softcap;   // > 0: scores s become softcap * tanh(s / softcap)
  const float* sinks;  // [H] or null: a logit per query head in every softmax's denominator (gpt-oss)
  float* out;      // [T, H, D]
};

// 1 / the softmax's denominator of query head h, whose running max and sum over the scores are mx and
// l, and the factor that brings its acc to that max: with a sink s, out = acc e^(mx - M) / (l e^(mx - M)
// + e^(s - M)), M = max(mx, s) (no score seen: acc = 0, out = 0, as the sink takes all the weight)
inline void finish(const Problem& P, int64_t h, float mx, float l, float& inv, float& rescale) {
  if (!P.sinks) {
    inv = 1.f / l, rescale = 1.f;
    return;
  }
  const float s = P.sinks[h], M = std::max(mx, s);
  rescale = mx == kNegInf ? 0.f : std::exp(mx - M);
  inv = 1.f / (l * rescale + std::exp(s - M));
}

// A sequence's query rows [r0, r1) with KV heads [h0, h1) over key positions [c0, c1).
struct Item {
  int64_t b, r0, r1, h0, h1, c0, c1;
  int64_t part;  // offset of its partials (per head: acc [M, D], max [M], sum [M]); -1: writes the output
  int64_t cost;
};

struct Scratch {
  // per head of the item: scaled queries [M, D], acc [M, D], running max and sum [M]; per tile:
  // scores / probabilities [M, 16], rescale factors and the keys [vis0, vis) visible [M], fp32 K/V
  // rows [16, D]
  std::vector<float> qs, acc, mx, sum, alpha, s, kbuf, vbuf, zeros;
  std::vector<int> vis0, vis;
  Scratch(int64_t heads_m, int64_t M, int64_t D)
      : qs(heads_m * D), acc(heads_m * D), mx(heads_m), sum(heads_m), alpha(M), s(M * kTile),
        kbuf(kTile * D), vbuf(kTile * D), zeros(D), vis0(M), vis(M) {}
};

#if defined(__AVX512F__)
// lane j of the result = the sum of the lanes of a[j]: four rounds of shuffles and adds (45 instructions
// instead of 16 separate reductions), then one permute back into key order
inline __m512 transpose_sum(__m512 a[16]) {
  __m512 b[8], c[4], d[2];
  for (int j = 0; j < 8; ++j)
    b[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a[j], a[j + 8], 0x44), _mm512_shuffle_f32x4(a[j], a[j + 8], 0xEE));
  for (int j = 0; j < 4; ++j)
    c[j] = _mm512_add_ps(_mm512_shuffle_f32x4(b[j], b[j + 4], 0x88), _mm512_shuffle_f32x4(b[j], b[j + 4], 0xDD));
  for (int j = 0; j < 2; ++j)
    d[j] = _mm512_add_ps(_mm512_shuffle_ps(c[j], c[j + 2], 0x44), _mm512_shuffle_ps(c[j], c[j + 2], 0xEE));
  const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15), e);
}

// s[m * kTile + j] = q_m . k_j: per query, the 16 keys' dot products in 16 accumulators
// (rows past kt point at zeros)
template <typename R>
inline void scores(int64_t M, int kt, const float* qs, int64_t D, const R* const* kr, float* s) {
  (void)kt;
  for (int64_t m = 0; m < M; ++m) {
    __m512 a[16];
    for (int j = 0; j < 16; ++j) a[j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 qv = _mm512_loadu_ps(qs + m * D + d);
      for (int j = 0; j < 16; ++j) a[j] = _mm512_fmadd_ps(qv, at(kr[j], d).v, a[j]);
    }
    _mm512_storeu_ps(s + m * kTile, transpose_sum(a));
  }
}
constexpr bool kFullTile = true;  // scores() reads 16 key rows
#else
constexpr bool kFullTile = false;

// s[i * kTile + j] = q_i . k_j for NQ queries (rows D apart) and NK keys
template <int NQ, int NK, typename R>
inline void dots(const float* qs, int64_t D, const R* const* kr, float* s) {
  Vec16 a[NQ][NK];
  for (int i = 0; i < NQ; ++i)
    for (int j = 0; j < NK; ++j) a[i][j] = zero();
  for (int64_t d = 0; d < D; d += 16) {
    Vec16 kv[NK];
    for (int j = 0; j < NK; ++j) kv[j] = at(kr[j], d);
    for (int i = 0; i < NQ; ++i) {
      const Vec16 qv = load(qs + i * D + d);
      for (int j = 0; j < NK; ++j) a[i][j] = fma(qv, kv[j], a[i][j]);
    }
  }
  for (int i = 0; i < NQ; ++i) {
#if defined(PA_AVX2)
    if constexpr (NK == 4) {
      hsum4(a[i], s + i * kTile);
      continue;
    }
#endif
    for (int j = 0; j < NK; ++j) s[i * kTile + j] = hsum(a[i][j]);
  }
}

template <int NQ, typename R>
inline void dots_q(int nk, const float* qs, int64_t D, const R* const* kr, float* s) {
  if constexpr (kKB >= 4) {
    if (nk == 4) return dots<NQ, 4, R>(qs, D, kr, s);
    if (nk == 3) return dots<NQ, 3, R>(qs, D, kr, s);
  }
  if (nk >= 2) return dots<NQ, 2, R>(qs, D, kr, s);
  return dots<NQ, 1, R>(qs, D, kr, s);
}

template <typename R>
inline void scores(int64_t M, int kt, const float* qs, int64_t D, const R* const* kr, float* s) {
  for (int j0 = 0; j0 < kt; j0 += kKB) {
    const int nk = std::min(kKB, kt - j0);
    int64_t m0 = 0;
    for (; m0 + kQB <= M; m0 += kQB) dots_q<kQB, R>(nk, qs + m0 * D, D, kr + j0, s + m0 * kTile + j0);
    for (; m0 < M; ++m0) dots_q<1, R>(nk, qs + m0 * D, D, kr + j0, s + m0 * kTile + j0);
  }
}
#endif

// acc_i = acc_i * alpha_i + sum_j p[i][j] v_j for NQ queries and NC x 16 columns from d: the NQ x NC
// accumulators stay in registers over the tile's keys (independent FMA chains)
template <int NQ, int NC, typename R>
inline void accumulate(float* acc, int64_t D, int64_t d, const float* p, const float* alpha, const R* const* vr,
                       int kt) {
  Vec16 a[NQ][NC];
  for (int i = 0; i < NQ; ++i)
    for (int c = 0; c < NC; ++c) a[i][c] = mul(load(acc + i * D + d + 16 * c), set1(alpha[i]));
  for (int j = 0; j < kt; ++j)
    for (int c = 0; c < NC; ++c) {
      const Vec16 vv = at(vr[j], d + 16 * c);
      for (int i = 0; i < NQ; ++i) a[i][c] = fma(set1(p[i * kTile + j]), vv, a[i][c]);
    }
  for (int i = 0; i < NQ; ++i)
    for (int c = 0; c < NC; ++c) store(acc + i * D + d + 16 * c, a[i][c]);
}

template <int NQ, typename R>
inline void accumulate_rows(float* acc, int64_t D, const float* p, const float* alpha, const R* const* vr, int kt) {
  int64_t d = 0;
  for (; d + 16 * kAccC <= D; d += 16 * kAccC) accumulate<NQ, kAccC, R>(acc, D, d, p, alpha, vr, kt);
  for (; d < D; d += 16) accumulate<NQ, 1, R>(acc, D, d, p, alpha, vr, kt);
}

template <typename R>
inline void accumulate_all(int64_t M, float* acc, int64_t D, const float* p, const float* alpha, const R* const* vr,
                           int kt) {
  int64_t m = 0;
  for (; m + kAccQ <= M; m += kAccQ) accumulate_rows<kAccQ, R>(acc + m * D, D, p + m * kTile, alpha + m, vr, kt);
  for (; m < M; ++m) accumulate_rows<1, R>(acc + m * D, D, p + m * kTile, alpha + m, vr, kt);
}

// One head over one tile of kt keys (rows kr, vr): scores, online softmax, acc update.
template <typename R>
inline void head_tile(const Problem& P, Scratch& S, int64_t M, int64_t hh, int kt, const R* const* kr,
                      const R* const* vr) {
  const int64_t D = P.D;
  const float* qs = S.qs.data() + hh * M * D;
  float* acc = S.acc.data() + hh * M * D;
  float* mx = S.mx.data() + hh * M;
  float* sum = S.sum.data() + hh * M;
  float* s = S.s.data();
  scores(M, kt, qs, D, kr, s);
  if (P.softcap > 0.f) {
    const Vec16 inv = set1(1.f / P.softcap), cap = set1(P.softcap);
    for (int64_t m = 0; m < M; ++m) store(s + m * kTile, mul(cap, tanh16(mul(load(s + m * kTile), inv))));
  }
  for (int64_t m = 0; m < M; ++m) {
    float* sm = s + m * kTile;
    if (S.vis0[m] >= S.vis[m]) {  // nothing visible here: leave this query as it is
      std::fill_n(sm, kTile, 0.f);
      S.alpha[m] = 1.f;
      continue;
    }
    std::fill_n(sm, S.vis0[m], kNegInf);
    for (int j = S.vis[m]; j < kTile; ++j) sm[j] = kNegInf;
    const Vec16 sv = load(sm);
    const float nm = std::max(mx[m], hmax(sv));
    const float alpha = std::exp(mx[m] - nm);  // 0 on the first tile (max -inf)
    const Vec16 p = exp_nonpos(sub(sv, set1(nm)));
    sum[m] = sum[m] * alpha + hsum(p);
    store(sm, p);
    mx[m] = nm;
    S.alpha[m] = alpha;
  }
  accumulate_all(M, acc, D, s, S.alpha.data(), vr, kt);
}

// Reads every 64-byte line of n K rows and n V rows ([start, start + span) bytes of each), so the
// lines are in cache when the heads are taken in turn.
template <typename T>
inline void touch(const T* const* kp, const T* const* vp, int n, int64_t start, int64_t span) {
  unsigned sink = 0;  // one byte a line (a wider load could pass the span's end: q8_0 rows are 34 bytes a block)
  for (int j = 0; j < n; ++j) {
    const unsigned char* kb = reinterpret_cast<const unsigned char*>(kp[j]) + start;
    const unsigned char* vb = reinterpret_cast<const unsigned char*>(vp[j]) + start;
    for (int64_t b = 0; b < span; b += 64) sink |= kb[b] | vb[b];
  }
  asm volatile("" : : "r"(sink));  // the loads are kept
}

// One work item: per head, its partial (max, sum, unnormalized acc) per query, in S. Tiles of 16
// positions outside, heads inside: the tile's K/V rows of all heads lie together in the cache.
template <typename T>
void attend(const Problem& P, const Item& it, Scratch& S) {
  const int64_t D = P.D, G = P.G, H = P.H, nh = it.h1 - it.h0;
  const int64_t n = P.cu[it.b + 1] - P.cu[it.b], cached = P.ctx[it.b] - n, t0 = P.cu[it.b];
  const int64_t M = (it.r1 - it.r0) * G;
  const Vec16 sc = set1(P.scale);
  for (int64_t hh = 0; hh < nh; ++hh)
    for (int64_t r = 0; r < it.r1 - it.r0; ++r)
      for (int64_t g = 0; g < G; ++g) {
        const float* src = P.q + ((t0 + it.r0 + r) * H + (it.h0 + hh) * G + g) * D;
        float* dst = S.qs.data() + (hh * M + r * G + g) * D;
        for (int64_t d = 0; d < D; d += 16) store(dst + d, mul(load(src + d), sc));
      }
  std::fill_n(S.mx.data(), nh * M, kNegInf);
  std::fill_n(S.sum.data(), nh * M, 0.f);
  std::fill_n(S.acc.data(), nh * M * D, 0.f);

  const T* kc = static_cast<const T*>(P.k);
  const T* vc = static_cast<const T*>(P.v);
  const int64_t* bt = P.bt + it.b * P.MB;
  int64_t bi = it.c0 / P.BS, off = it.c0 % P.BS;
  const T* kp[kTile];
  const T* vp[kTile];
  const T* kd[kTile];
  const T* vd[kTile];
  const float* kr[kTile];
  const float* vr[kTile];
  const int64_t row_bytes = D / kPer<T> * static_cast<int64_t>(sizeof(T));  // one head's row
  for (int64_t pos0 = it.c0; pos0 < it.c1; pos0 += kTile) {
    const int kt = static_cast<int>(std::min<int64_t>(kTile, it.c1 - pos0));
    for (int j = 0; j < kt; ++j) {  // position j's rows of every KV head
      const int64_t row = (bt[bi] * P.BS + off) * P.KVH * (D / kPer<T>);
      kp[j] = kc + row;
      vp[j] = vc + row;
      if (++off == P.BS) off = 0, ++bi;
    }
    // the tile's rows of the item's heads read once in memory order before the heads take them in
    // turn: each head's rows are a short run every row (128 bytes of 1 KB at the 1B shape's 8
    // heads of 64), which the hardware prefetcher does not stream, and software prefetches of the
    // tile measured no gain (AVX2 Zen 3, bench/decode_attention.py, 2,000 positions, 16 layers
    // streaming from memory: 1B shape 1.5-1.6x, 1.7B (MHA) 1.4-1.7x, 135M 1.2-1.3x)
    touch(kp, vp, kt, it.h0 * row_bytes, nh * row_bytes);
    // keys [vis0, vis) of the tile each query sees: all kt, except on the causal diagonal and at
    // the window's lower edge
    for (int64_t m = 0; m < M; ++m) {
      const int64_t p = cached + it.r0 + m / G - pos0;  // the query's position in the tile
      S.vis[m] = static_cast<int>(std::clamp<int64_t>(p + 1, 0, kt));
      S.vis0[m] = P.window > 0 ? static_cast<int>(std::clamp<int64_t>(p - P.window + 1, 0, kt)) : 0;
    }
    for (int64_t hh = 0; hh < nh; ++hh) {
      const int64_t hd = (it.h0 + hh) * (D / kPer<T>);
      if (std::is_same_v<T, float> || M <= kDirectM) {  // rows read (and converted) where they lie
        for (int j = 0; j < kt; ++j) kd[j] = kp[j] + hd, vd[j] = vp[j] + hd;
        if (kFullTile)
          for (int j = kt; j < kTile; ++j) kd[j] = reinterpret_cast<const T*>(S.zeros.data());
        head_tile(P, S, M, hh, kt, kd, vd);
      } else {  // 16-bit rows converted once for all the head's queries
        for (int j = 0; j < kt; ++j) {
          float* kb = S.kbuf.data() + j * D;
          float* vb = S.vbuf.data() + j * D;
          for (int64_t d = 0; d < D; d += 16) store(kb + d, at(kp[j] + hd, d)), store(vb + d, at(vp[j] + hd, d));
          kr[j] = kb, vr[j] = vb;
        }
        if (kFullTile)
          for (int j = kt; j < kTile; ++j) kr[j] = S.zeros.data();
        head_tile(P, S, M, hh, kt, kr, vr);
      }
    }
  }
}

// Output row of query m of head h (an absolute KV head) of an item.
inline float* out_row(const Problem& P, const Item& it, int64_t h, int64_t m) {
  const int64_t r = it.r0 + m / P.G, g = m % P.G;
  return P.out + ((P.cu[it.b] + r) * P.H + h * P.G + g) * P.D;
}

// A (sequence, query tile) split into chunks x head groups; items[first + c * groups + g].
struct Split {
  int64_t b, r0, r1, first, chunks, groups, group_heads;
};

template <typename T>
void run(const Problem& P, int64_t B) {
  const int64_t D = P.D, G = P.G, KVH = P.KVH;
  const int64_t qt = std::max<int64_t>(16, 64 / G);  // query rows per tile: up to 16 always in one
  // (sequence, query tile) units over all KV heads, the keys they need and what they cost
  // (a window skips the keys [0, first) that none of the unit's rows sees)
  struct Unit {
    int64_t b, r0, r1, first, keys, cost;
  };
  std::vector<Unit> units;
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = P.cu[b + 1] - P.cu[b], cached = P.ctx[b] - n;
    for (int64_t r0 = 0; r0 < n; r0 += qt) {
      const int64_t r1 = std::min(n, r0 + qt), keys = cached + r1;
      const int64_t first = P.window > 0 ? std::max<int64_t>(0, cached + r0 - P.window + 1) : 0;
      const int64_t cost = (keys - first) * (r1 - r0) * KVH;
      units.push_back({b, r0, r1, first, keys, cost});
      total += cost;
    }
  }
  // one thread for small calls (waking the others costs more than they save); else ~4 items per
  // thread: split long contexts into chunks, then (short ones) the KV heads into groups. The heads
  // of an item also share its scratch (at most kScratch floats).
  constexpr int64_t kScratch = 1 << 16;
  const int threads = total * D < kSerialWork ? 1 : at::get_num_threads();
  const int64_t target = threads > 1 ? std::max<int64_t>(1, total / (4 * threads)) : total;
  std::vector<Item> items;
  std::vector<Split> splits;  // units split into chunks: their partials are merged at the end
  int64_t part_floats = 0, max_heads_m = 0, max_m = 0;
  for (const Unit& u : units) {
    const int64_t M = (u.r1 - u.r0) * G;
    const int64_t parts = (u.cost + target - 1) / target, span = u.keys - u.first;
    int64_t chunks = std::clamp<int64_t>(parts, 1, (span + kMinChunk - 1) / kMinChunk);
    int64_t chunk = (span + chunks - 1) / chunks;
    chunk = (chunk + kTile - 1) / kTile * kTile;
    chunks = (span + chunk - 1) / chunk;
    int64_t groups = std::clamp<int64_t>((parts + chunks - 1) / chunks, 1, KVH);
    groups = std::max(groups, (KVH * M * (2 * D + 2) + kScratch - 1) / kScratch);
    const int64_t gh = (KVH + std::min(groups, KVH) - 1) / std::min(groups, KVH);
    groups = (KVH + gh - 1) / gh;
    max_heads_m = std::max(max_heads_m, gh * M);
    max_m = std::max(max_m, M);
    if (chunks > 1) splits.push_back({u.b, u.r0, u.r1, static_cast<int64_t>(items.size()), chunks, groups, gh});
    for (int64_t c = 0; c < chunks; ++c)
      for (int64_t g = 0; g < groups; ++g) {
        Item it{u.b, u.r0, u.r1, g * gh, std::min(KVH, (g + 1) * gh), u.first + c * chunk,
                std::min(u.keys, u.first + (c + 1) * chunk), -1, 0};
        it.cost = (it.c1 - it.c0) * (it.r1 - it.r0) * (it.h1 - it.h0);
        if (chunks > 1) {
          it.part = part_floats;
          part_floats += (it.h1 - it.h0) * M * (D + 2);
        }
        items.push_back(it);
      }
  }
  std::vector<float> partials(part_floats);
  std::vector<int64_t> order(items.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return items[a].cost > items[b].cost; });

  std::atomic<int64_t> next{0};
  const int64_t n_items = static_cast<int64_t>(items.size());
  at::parallel_for(0, n_items, threads > 1 ? 1 : n_items, [&](int64_t, int64_t) {
    Scratch S(max_heads_m, max_m, D);  // for the largest item
    for (int64_t k; (k = next.fetch_add(1)) < n_items;) {
      const Item& it = items[order[k]];
      attend<T>(P, it, S);
      const int64_t M = (it.r1 - it.r0) * G;
      for (int64_t hh = 0; hh < it.h1 - it.h0; ++hh) {
        const float* acc = S.acc.data() + hh * M * D;
        if (it.part < 0) {
          for (int64_t m = 0; m < M; ++m) {
            float inv, rescale;
            finish(P, (it.h0 + hh) * G + m % G, S.mx[hh * M + m], S.sum[hh * M + m], inv, rescale);
            const Vec16 f = set1(inv * rescale);
            float* o = out_row(P, it, it.h0 + hh, m);
            for (int64_t d = 0; d < D; d += 16) store(o + d, mul(load(acc + m * D + d), f));
          }
        } else {
          float* pp = partials.data() + it.part + hh * M * (D + 2);
          std::copy_n(acc, M * D, pp);
          std::copy_n(S.mx.data() + hh * M, M, pp + M * D);
          std::copy_n(S.sum.data() + hh * M, M, pp + M * D + M);
        }
      }
    }
  });

  // merge the chunks of split units, per KV head: out = sum_c e^(m_c - m) acc_c / sum_c e^(m_c - m) l_c
  const int64_t n_merge = static_cast<int64_t>(splits.size()) * KVH;
  at::parallel_for(0, n_merge, std::max<int64_t>(1, n_merge / (4 * threads)), [&](int64_t begin, int64_t end) {
    std::vector<const float*> pc;
    std::vector<float> w;
    for (int64_t i = begin; i < end; ++i) {
      const Split& sp = splits[i / KVH];
      const int64_t h = i % KVH, g = h / sp.group_heads, M = (sp.r1 - sp.r0) * G;
      pc.resize(sp.chunks), w.resize(sp.chunks);
      for (int64_t c = 0; c < sp.chunks; ++c) {
        const Item& it = items[sp.first + c * sp.groups + g];
        pc[c] = partials.data() + it.part + (h - it.h0) * M * (D + 2);
      }
      const Item& it0 = items[sp.first + g];
      for (int64_t m = 0; m < M; ++m) {
        float mx = kNegInf;
        for (int64_t c = 0; c < sp.chunks; ++c) mx = std::max(mx, pc[c][M * D + m]);
        float l = 0.f;
        for (int64_t c = 0; c < sp.chunks; ++c) {
          w[c] = pc[c][M * D + m] == kNegInf ? 0.f : std::exp(pc[c][M * D + m] - mx);
          l += w[c] * pc[c][M * D + M + m];
        }
        float inv_l, rescale;
        finish(P, h * G + m % G, mx, l, inv_l, rescale);
        const Vec16 inv = set1(inv_l * rescale);
        float* o = out_row(P, it0, h, m);
        for (int64_t d = 0; d < D; d += 16) {
          Vec16 a = zero();
          for (int64_t c = 0; c < sp.chunks; ++c) a = fma(set1(w[c]), load(pc[c] + m * D + d), a);
          store(o + d, mul(a, inv));
        }
      }
    }
  });
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q,
                           const at::Tensor& context_lens, double scale, int64_t window, double softcap,
                           const std::optional<at::Tensor>& sinks) {
  const char* me = "paged_attention: ";
  for (const at::Tensor* t : {&q, &k_cache, &v_cache, &block_tables, &cu_seqlens_q, &context_lens})
    TORCH_CHECK(t->device().is_cpu(), me, "all tensors must be on the CPU");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, me, "q must be float32 [T, H, D], got ",
              q.scalar_type(), " ", q.sizes());
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), me,
              "k_cache and v_cache must both be [num_blocks, block_size, KVH, D], got ", k_cache.sizes(), " and ",
              v_cache.sizes());
  const auto dt = k_cache.scalar_type();
  TORCH_CHECK(v_cache.scalar_type() == dt &&
                  (dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16 || dt == at::kByte), me,
              "k_cache and v_cache must both be float32, float16, bfloat16 or uint8 (q8_0 blocks), got ", dt, " and ",
              v_cache.scalar_type());
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), me, "the caches must be contiguous");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t NB = k_cache.size(0), BS = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(D > 0 && D % 16 == 0, me, "head dim must be a multiple of 16, got ", D);
  if (dt == at::kByte) {
    TORCH_CHECK(D % 32 == 0 && k_cache.size(3) == D / 32 * 34, me, "a q8_0 cache of head dim ", D,
                " must have rows of D / 32 * 34 bytes (D a multiple of 32), got ", k_cache.size(3));
  } else {
    TORCH_CHECK(k_cache.size(3) == D, me, "head dim of the cache (", k_cache.size(3), ") != q's (", D, ")");
  }
  TORCH_CHECK(KVH > 0 && H % KVH == 0, me, "query heads (", H, ") must be a multiple of KV heads (", KVH, ")");
  TORCH_CHECK(BS > 0, me, "block_size must be positive");
  TORCH_CHECK(window >= 0, me, "window must be >= 0 (0: none), got ", window);
  TORCH_CHECK(softcap >= 0, me, "softcap must be >= 0 (0: none), got ", softcap);
  for (const at::Tensor* t : {&block_tables, &cu_seqlens_q, &context_lens})
    TORCH_CHECK(t->scalar_type() == at::kLong, me, "block_tables, cu_seqlens_q and context_lens must be int64, got ",
                t->scalar_type());
  TORCH_CHECK(cu_seqlens_q.dim() == 1 && cu_seqlens_q.size(0) >= 1, me, "cu_seqlens_q must be [B + 1]");
  const int64_t B = cu_seqlens_q.size(0) - 1;
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == B, me, "context_lens must be [B] = [", B, "], got ",
              context_lens.sizes());
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == B, me, "block_tables must be [B, max_blocks] with B = ",
              B, ", got ", block_tables.sizes());
  const at::Tensor qc = q.contiguous(), btc = block_tables.contiguous(), cuc = cu_seqlens_q.contiguous(),
                   ctc = context_lens.contiguous();
  const int64_t MB = btc.size(1);
  const int64_t* bt = btc.data_ptr<int64_t>();
  const int64_t* cu = cuc.data_ptr<int64_t>();
  const int64_t* ctx = ctc.data_ptr<int64_t>();
  TORCH_CHECK(cu[0] == 0 && cu[B] == T, me, "cu_seqlens_q must run from 0 to T = ", T, ", got ", cu[0], " .. ", cu[B]);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = cu[b + 1] - cu[b];
    TORCH_CHECK(n >= 1, me, "sequence ", b, " has ", n, " query rows (needs >= 1)");
    TORCH_CHECK(ctx[b] >= n, me, "sequence ", b, ": context length ", ctx[b], " < its ", n, " query rows");
    TORCH_CHECK(ctx[b] <= MB * BS, me, "sequence ", b, ": context length ", ctx[b], " > block table capacity ",
                MB * BS);
    for (int64_t i = 0; i < (ctx[b] + BS - 1) / BS; ++i)
      TORCH_CHECK(bt[b * MB + i] >= 0 && bt[b * MB + i] < NB, me, "sequence ", b, ": block id ", bt[b * MB + i],
                  " out of range [0, ", NB, ")");
  }
  at::Tensor sk;
  if (sinks.has_value()) {
    sk = sinks->contiguous();
    TORCH_CHECK(sk.device().is_cpu() && sk.scalar_type() == at::kFloat && sk.dim() == 1 && sk.size(0) == H, me,
                "sinks must be float32 [H] = [", H, "], got ", sk.scalar_type(), " ", sk.sizes());
  }
  at::Tensor out = at::empty({T, H, D}, q.options());
  if (T == 0) return out;
  const Problem P{qc.data_ptr<float>(), k_cache.data_ptr(), v_cache.data_ptr(), bt, cu, ctx, H, KVH, H / KVH,
                  D, BS, MB, static_cast<float>(scale), window, static_cast<float>(softcap),
                  sk.defined() ? sk.data_ptr<float>() : nullptr, out.data_ptr<float>()};
  if (dt == at::kFloat) run<float>(P, B);
  else if (dt == at::kHalf) run<c10::Half>(P, B);
  else if (dt == at::kByte) run<Q8Block>(P, B);
  else run<c10::BFloat16>(P, B);
  return out;
}

std::string isa() { return PA_ISA; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(localllm, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor cu_seqlens_q, "
        "Tensor context_lens, float scale, int window=0, float softcap=0.0, Tensor? sinks=None) -> Tensor");
  m.def("paged_attention_isa() -> str", &isa);
}

TORCH_LIBRARY_IMPL(localllm, CPU, m) {
  m.impl("paged_attention", &paged_attention);
}
