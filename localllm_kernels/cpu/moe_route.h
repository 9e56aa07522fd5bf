// The (token, slot) pairs of a mixture-of-experts call grouped by expert, for int4_gemm.cpp's
// moe_int4 and int8_gemm.cpp's moe_int8w: one routing for both ops.
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>
#include <vector>

namespace moe_route {

// ids [P] (pair p = t * k + j -> its expert, < E) -> start [E + 1] (expert e's pairs are
// order[start[e] .. start[e + 1])) and order [P]: a stable counting sort, so an expert's rows
// stay in token order. `op` names the caller in errors.
inline void by_expert(const int64_t* ids, int64_t P, int64_t E, const char* op, std::vector<int64_t>& start,
                      std::vector<int64_t>& order) {
  start.assign(E + 1, 0);
  order.resize(P);
  for (int64_t p = 0; p < P; ++p) {
    TORCH_CHECK(ids[p] >= 0 && ids[p] < E, op, ": expert id ", ids[p], " out of range");
    ++start[ids[p] + 1];
  }
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t p = 0; p < P; ++p) order[fill[ids[p]]++] = p;
}

}  // namespace moe_route
