// What the sampler needs from a row of logits, in one pass each and on one thread.
//
// Why: top-p draws from a prefix of the tokens in falling order, and that prefix lies among the
// few tokens near the best; what reads the whole row is the softmax normaliser and finding those
// tokens. As torch ops over a 49k vocabulary that is four to six ops of ~49k elements, each split
// over the OpenMP team (torch parallelises from 32k elements): 0.25 ms a token on an idle
// machine, 0.6 ms inside the engine's decode loop, and far worse when another process holds a
// core. Here: 3 vectorised passes, ~20 us.
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

#if defined(__AVX512F__)
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
#else
  for (i = 0; i < V; ++i) m = std::max(m, p[i]);
  const float thr = m - static_cast<float>(span) / it;
  for (i = 0; i < V; ++i) {
    z += std::exp((p[i] - m) * it);
    if (p[i] >= thr) idx.push_back(i);
  }
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
