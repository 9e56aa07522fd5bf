// What the sampler needs from a row of logits, in one pass each and on one thread.
//
// Why: top-p draws from a prefix of the tokens in falling order, and that prefix lies among the
// few tokens near the best; what reads the whole row is the softmax normaliser and finding those
// tokens. As torch ops over a 49k vocabulary that is four to six ops of ~49k elements, each split
// over the OpenMP team (torch parallelises from 32k elements): 0.25 ms a token on an idle
// machine, 0.6 ms inside the engine's decode loop, and far worse when another process holds a
// core. Here: 3 vectorised passes (AVX-512 or AVX2), ~20 us.
//
//   softmax_top(x fp32 [V], inv_t, span) -> (idx int64 [n], stats fp32 [2])
//     stats = (max x, sum exp((x - max) * inv_t)); idx = the tokens with x >= max - span / inv_t,
//     in index order.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
// e^a for a <= 0 (-inf -> 0): a = (n + f) ln 2 with n an integer and |f| <= 1/2, e^(f ln 2) by
// its Taylor series to the 7th power (error < 6e-9), times 2^n by VSCALEFPS.
inline __m512 exp_nonpositive(__m512 a) {
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
#elif defined(__AVX2__) && defined(__FMA__)
// The same with AVX2, 2^n put in the exponent bits; terms below 2^-126 (no normal float, and
// nothing beside the max's 1) are 0 rather than VSCALEFPS's denormals.
inline __m256 exp_nonpositive(__m256 a) {
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
#endif

std::tuple<at::Tensor, at::Tensor> softmax_top(const at::Tensor& x, double inv_t, double span) {
  TORCH_CHECK(x.dim() == 1 && x.scalar_type() == at::kFloat && x.size(0) > 0,
              "softmax_top: x must be a non-empty fp32 vector");
  const at::Tensor xc = x.contiguous();
  const float* p = xc.data_ptr<float>();
  const int64_t V = xc.size(0);
  const float it = static_cast<float>(inv_t), ninf = -std::numeric_limits<float>::infinity();
  float m = ninf, z = 0.f;
  std::vector<int64_t> idx;
  int64_t i = 0;
#if defined(__AVX512F__)
  const int64_t body = V - V % 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (V % 16)) - 1);
  __m512 vm = _mm512_set1_ps(ninf);
  for (i = 0; i < body; i += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(p + i));
  if (tail) vm = _mm512_max_ps(vm, _mm512_mask_loadu_ps(_mm512_set1_ps(ninf), tail, p + body));
  m = _mm512_reduce_max_ps(vm);
  const __m512 bm = _mm512_set1_ps(m), bt = _mm512_set1_ps(it), thr = _mm512_set1_ps(m - static_cast<float>(span) / it);
  __m512 vz = _mm512_setzero_ps();
  for (i = 0; i < V; i += 16) {
    const __mmask16 k = i < body ? static_cast<__mmask16>(0xFFFF) : tail;
    const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(ninf), k, p + i);
    vz = _mm512_add_ps(vz, exp_nonpositive(_mm512_mul_ps(_mm512_sub_ps(v, bm), bt)));
    for (uint32_t hits = _mm512_cmp_ps_mask(v, thr, _CMP_GE_OQ); hits; hits &= hits - 1)
      idx.push_back(i + __builtin_ctz(hits));
  }
  z = _mm512_reduce_add_ps(vz);
#elif defined(__AVX2__) && defined(__FMA__)
  const int64_t body = V - V % 8;
  __m256 vm = _mm256_set1_ps(ninf);
  for (i = 0; i < body; i += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(p + i));
  __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(vm, 1), _mm256_castps256_ps128(vm));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m = std::max(_mm_cvtss_f32(m4), _mm_cvtss_f32(_mm_shuffle_ps(m4, m4, 1)));
  for (i = body; i < V; ++i) m = std::max(m, p[i]);
  const float thr_s = m - static_cast<float>(span) / it;
  const __m256 bm = _mm256_set1_ps(m), bt = _mm256_set1_ps(it), thr = _mm256_set1_ps(thr_s);
  __m256 vz = _mm256_setzero_ps();
  for (i = 0; i < body; i += 8) {
    const __m256 v = _mm256_loadu_ps(p + i);
    vz = _mm256_add_ps(vz, exp_nonpositive(_mm256_mul_ps(_mm256_sub_ps(v, bm), bt)));
    for (uint32_t hits = _mm256_movemask_ps(_mm256_cmp_ps(v, thr, _CMP_GE_OQ)); hits; hits &= hits - 1)
      idx.push_back(i + __builtin_ctz(hits));
  }
  __m128 z4 = _mm_add_ps(_mm256_extractf128_ps(vz, 1), _mm256_castps256_ps128(vz));
  z4 = _mm_add_ps(z4, _mm_movehl_ps(z4, z4));
  z = _mm_cvtss_f32(z4) + _mm_cvtss_f32(_mm_shuffle_ps(z4, z4, 1));
  for (i = body; i < V; ++i) {
    z += std::exp((p[i] - m) * it);
    if (p[i] >= thr_s) idx.push_back(i);
  }
#else
  for (i = 0; i < V; ++i) m = std::max(m, p[i]);
  const float thr = m - static_cast<float>(span) / it;
  double zd = 0.0;  // one fp32 chain over ~49k terms would lose ~1e-5 of the sum
  for (i = 0; i < V; ++i) {
    zd += std::exp((p[i] - m) * it);
    if (p[i] >= thr) idx.push_back(i);
  }
  z = static_cast<float>(zd);
#endif
  at::Tensor out = at::empty({static_cast<int64_t>(idx.size())}, x.options().dtype(at::kLong));
  if (!idx.empty()) std::memcpy(out.data_ptr<int64_t>(), idx.data(), idx.size() * sizeof(int64_t));
  at::Tensor stats = at::empty({2}, x.options());
  stats.data_ptr<float>()[0] = m;
  stats.data_ptr<float>()[1] = z;
  return {out, stats};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(localllm, m) {
  m.def("softmax_top(Tensor x, float inv_t, float span) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(localllm, CPU, m) {
  m.impl("softmax_top", &softmax_top);
}
