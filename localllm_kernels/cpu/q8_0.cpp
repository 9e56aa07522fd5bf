// GGUF Q8_0 matrices used in place: the embedding lookup and the exact LM head.
//
// Why: the embedding and the head are where rounding flips tokens, so they stay exact, and Q8_0
// values are exact in fp32 (an fp16 scale times an int8 fits in 24 bits of mantissa). Expanded to
// fp32 they took 4 bytes a weight instead of 1.06 (113 MB on the 135M model, 403 MB on a 1B
// shape with a 49k vocabulary), and every sampled token read all of it: the head GEMV on fp32 was
// 6.4 ms a token on the 135M model, as long as the rest of the step. Here the file's own blocks
// (memory-mapped) are read: 3.8x fewer bytes, the same numbers.
//
// Layout: blocks uint8 [N, K/32, 34]: per block of 32 values an fp16 scale d, then 32 int8 q;
// the value is d * q.
//   q8_0_gemm(x fp32 [M, K], blocks) -> y fp32 [M, N] = x @ W^T, fp32 accumulation.
//   q8_0_rows(blocks, idx int64 [n]) -> fp32 [n, K]: rows of W.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32, kBytes = 34;
constexpr int kMc = 4;  // activation rows per pass over a weight row
// the head is streamed once per token from memory: asking for the bytes 4 KB ahead keeps more
// reads in flight than the hardware prefetcher does (cache-cold 135M head: 1.3-1.7x)
constexpr int64_t kPrefetch = 4096;

inline float scale_of(const uint8_t* blk) {
  uint16_t bits;
  std::memcpy(&bits, blk, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define Q8_AVX2 1
// 8 int8 values at p -> fp32 (exact)
inline __m256 quarter(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

// MC rows of x against weight rows [n0, n1).
template <int MC>
void gemm_rows(const float* x, int64_t K, const uint8_t* w, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  const int64_t nb = K / kBlock, row_bytes = nb * kBytes;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
#if defined(__AVX512F__)
    // two accumulators a row (one per half block): FMA latency, not throughput, bounds one chain
    __m512 acc[MC][2];
    for (int m = 0; m < MC; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + b * kBytes;
      const __m512 d = _mm512_set1_ps(scale_of(blk));
      // d * q is exact in fp32: the weights are the file's values, rounded nowhere
      const __m512 w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2)))));
      const __m512 w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18)))));
      for (int m = 0; m < MC; ++m) {
        const float* xb = x + m * K + b * kBlock;
        acc[m][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xb), acc[m][0]);
        acc[m][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + 16), acc[m][1]);
      }
    }
    for (int m = 0; m < MC; ++m) y[m * ldy + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]));
#elif defined(Q8_AVX2)
    // two accumulators a row, each taking two of a block's four 8-value quarters
    __m256 acc[MC][2];
    for (int m = 0; m < MC; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + b * kBytes;
      const __m256 d = _mm256_set1_ps(scale_of(blk));
      for (int h = 0; h < 4; ++h) {
        const __m256 wv = _mm256_mul_ps(d, quarter(blk + 2 + 8 * h));
        for (int m = 0; m < MC; ++m)
          acc[m][h & 1] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * K + b * kBlock + 8 * h), acc[m][h & 1]);
      }
    }
    for (int m = 0; m < MC; ++m) y[m * ldy + n] = hsum(_mm256_add_ps(acc[m][0], acc[m][1]));
#else
    float acc[MC][kBlock] = {};
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + b * kBytes;
      const float d = scale_of(blk);
      const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
      float wv[kBlock];
      for (int j = 0; j < kBlock; ++j) wv[j] = d * static_cast<float>(q[j]);
      for (int m = 0; m < MC; ++m) {
        const float* xb = x + m * K + b * kBlock;
        for (int j = 0; j < kBlock; ++j) acc[m][j] += wv[j] * xb[j];
      }
    }
    for (int m = 0; m < MC; ++m) {
      float s = 0.f;
      for (int j = 0; j < kBlock; ++j) s += acc[m][j];
      y[m * ldy + n] = s;
    }
#endif
  }
}

#if defined(__AVX512F__)
// One activation row (decode) against weight rows [n0, n1), two rows at a time: four independent
// FMA chains, where one row's two would leave the FMA units waiting on latency.
void gemv(const float* x, int64_t K, const uint8_t* w, int64_t n0, int64_t n1, float* y) {
  const int64_t nb = K / kBlock, row_bytes = nb * kBytes;
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2) {
    const uint8_t* r0 = w + n * row_bytes;
    const uint8_t* r1 = r0 + row_bytes;
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const __m512 x0 = _mm512_loadu_ps(x + b * kBlock), x1 = _mm512_loadu_ps(x + b * kBlock + 16);
      const uint8_t* p = r0 + b * kBytes;
      const uint8_t* q = r1 + b * kBytes;
      _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetch), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(q + kPrefetch), _MM_HINT_T0);
      const __m512 dp = _mm512_set1_ps(scale_of(p)), dq = _mm512_set1_ps(scale_of(q));
      const auto cvt = [](const uint8_t* at) {
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at))));
      };
      a0 = _mm512_fmadd_ps(_mm512_mul_ps(dp, cvt(p + 2)), x0, a0);
      a1 = _mm512_fmadd_ps(_mm512_mul_ps(dp, cvt(p + 18)), x1, a1);
      b0 = _mm512_fmadd_ps(_mm512_mul_ps(dq, cvt(q + 2)), x0, b0);
      b1 = _mm512_fmadd_ps(_mm512_mul_ps(dq, cvt(q + 18)), x1, b1);
    }
    y[n] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    y[n + 1] = _mm512_reduce_add_ps(_mm512_add_ps(b0, b1));
  }
  if (n < n1) gemm_rows<1>(x, K, w, n, n1, y, 0);
}
#endif

#if defined(Q8_AVX2)
// The AVX-512 gemv's shape with 8 lanes: two weight rows at a time, each with two accumulators
// (four independent FMA chains), the rows' bytes asked for 4 KB ahead.
void gemv(const float* x, int64_t K, const uint8_t* w, int64_t n0, int64_t n1, float* y) {
  const int64_t nb = K / kBlock, row_bytes = nb * kBytes;
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2) {
    const uint8_t* r0 = w + n * row_bytes;
    const uint8_t* r1 = r0 + row_bytes;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* p = r0 + b * kBytes;
      const uint8_t* q = r1 + b * kBytes;
      _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetch), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(q + kPrefetch), _MM_HINT_T0);
      const __m256 dp = _mm256_set1_ps(scale_of(p)), dq = _mm256_set1_ps(scale_of(q));
      for (int h = 0; h < 4; h += 2) {
        const __m256 x0 = _mm256_loadu_ps(x + b * kBlock + 8 * h), x1 = _mm256_loadu_ps(x + b * kBlock + 8 * h + 8);
        a0 = _mm256_fmadd_ps(_mm256_mul_ps(dp, quarter(p + 2 + 8 * h)), x0, a0);
        a1 = _mm256_fmadd_ps(_mm256_mul_ps(dp, quarter(p + 10 + 8 * h)), x1, a1);
        b0 = _mm256_fmadd_ps(_mm256_mul_ps(dq, quarter(q + 2 + 8 * h)), x0, b0);
        b1 = _mm256_fmadd_ps(_mm256_mul_ps(dq, quarter(q + 10 + 8 * h)), x1, b1);
      }
    }
    y[n] = hsum(_mm256_add_ps(a0, a1));
    y[n + 1] = hsum(_mm256_add_ps(b0, b1));
  }
  if (n < n1) gemm_rows<1>(x, K, w, n, n1, y, 0);
}
#endif

void check_blocks(const at::Tensor& blocks) {
  TORCH_CHECK(blocks.dim() == 3 && blocks.size(2) == kBytes && blocks.scalar_type() == at::kByte &&
              blocks.is_contiguous(), "q8_0: blocks must be contiguous uint8 [N, K/32, 34]");
}

at::Tensor q8_0_gemm(const at::Tensor& x, const at::Tensor& blocks) {
  check_blocks(blocks);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "q8_0_gemm: x must be fp32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = blocks.size(0);
  TORCH_CHECK(blocks.size(1) * kBlock == K, "q8_0_gemm: K mismatch: x has ", K, ", the matrix ",
              blocks.size(1) * kBlock);
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  // ~1k rows a task: the threads split a 49k vocabulary evenly, with few forks
  at::parallel_for(0, N, 1024, [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < M; m0 += kMc) {
      const float* xm = xp + m0 * K;
      float* ym = yp + m0 * N;
      switch (std::min<int64_t>(kMc, M - m0)) {
#if defined(__AVX512F__) || defined(Q8_AVX2)
        case 1: gemv(xm, K, w, n0, n1, ym); break;
#else
        case 1: gemm_rows<1>(xm, K, w, n0, n1, ym, N); break;
#endif
        case 2: gemm_rows<2>(xm, K, w, n0, n1, ym, N); break;
        case 3: gemm_rows<3>(xm, K, w, n0, n1, ym, N); break;
        default: gemm_rows<4>(xm, K, w, n0, n1, ym, N); break;
      }
    }
  });
  return y;
}

at::Tensor q8_0_rows(const at::Tensor& blocks, const at::Tensor& idx) {
  check_blocks(blocks);
  TORCH_CHECK(idx.dim() == 1 && idx.scalar_type() == at::kLong, "q8_0_rows: idx must be int64 [n]");
  const int64_t N = blocks.size(0), nb = blocks.size(1), K = nb * kBlock, n = idx.size(0);
  const at::Tensor ic = idx.contiguous();
  const int64_t* ip = ic.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < N, "q8_0_rows: row ", ip[i], " out of range");
  at::Tensor out = at::empty({n, K}, blocks.options().dtype(at::kFloat));
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const uint8_t* row = w + ip[i] * nb * kBytes;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = row + b * kBytes;
        const float d = scale_of(blk);
        const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
        float* o = op + i * K + b * kBlock;
        for (int j = 0; j < kBlock; ++j) o[j] = d * static_cast<float>(q[j]);
      }
    }
  });
  return out;
}

// -> the path this build takes (the compiler's target, -march=native): "avx512", "avx2" or "generic"
std::string q8_0_isa() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(Q8_AVX2)
  return "avx2";
#else
  return "generic";
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(localllm, m) {
  m.def("q8_0_isa() -> str", &q8_0_isa);
  m.def("q8_0_gemm(Tensor x, Tensor blocks) -> Tensor");
  m.def("q8_0_rows(Tensor blocks, Tensor idx) -> Tensor");
}

TORCH_LIBRARY_IMPL(localllm, CPU, m) {
  m.impl("q8_0_gemm", &q8_0_gemm);
  m.impl("q8_0_rows", &q8_0_rows);
}
