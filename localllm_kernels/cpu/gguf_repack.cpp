// GGUF Q4_K and Q6_K blocks -> our CPU layer kernels' layouts, in one pass at load.
//
// Why: the torch path (gguf_blocks.decode, then cpu_int4.pack_dm / cpu_int8.pack) expands every
// value to a byte, builds fp32 group products it then drops, and reorders in several passes: ~6 of
// a 1B-shape Q4_K_M file's 9.8 s first load. Here each 16-row block is read once and written
// once, bit-identical to that path (tests/test_gguf_repack.py compares them).
//
// In: blocks uint8 [N, K / 256, block bytes] (ggml-quants.c's block_q4_K: d, dmin fp16, 12 bytes of
// 6-bit scales and mins, 128 bytes of nibbles; block_q6_K: 128 bytes of low nibbles, 64 of high
// bit pairs, 16 int8 scales, d fp16). Out (rows past N are zeros, to a multiple of 16):
//   q4_k_repack -> (w uint8 [N/16, K/8, 64]: cpu_int4's nibbles, value k of row r in byte
//     16-row block b, chunk k/8, byte 4r + k%4, low nibble for k%8 < 4;
//     records uint8 [N/16, K/256, 320]: group_scales.h's Super form: the 16 rows' d, then -dmin
//     (fp16), then 8 sub-scales and 8 mins a row (int8, [group][row])).
//   q6_k_repack(planes) -> (w: cpu_int8's layout of 6-bit values, planes 2: [N/16, K/8, 96], the
//     low nibbles as above then per bit 4 and 5 a 16-byte mask, bit j of byte i the value at
//     8i + j of the chunk's (half, row, k%4) order; planes -1: byte lanes [N/16, K/4, 64], value
//     k of row r at byte 4r + k%4 of chunk k/4; records [N/16, K/256, 288]: d, then 16 int8
//     scales a row, [group][row]). Zero point 32 (the kernel's), as gguf_blocks gives it.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <tuple>

namespace {

constexpr int64_t kRows = 16;

// Q4_K's 12 bytes of packed 6-bit scales and mins -> sc[8], mn[8]
inline void k_scales(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 15) | ((s[j] >> 2) & 0x30);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30);
  }
}

// one super-block's 256 values of a row into q (0..15 for Q4_K, 0..63 for Q6_K)
inline void q4_k_values(const uint8_t* blk, uint8_t* q) {
  const uint8_t* qs = blk + 16;
  for (int j = 0; j < 8; ++j)
    for (int i = 0; i < 32; ++i) q[32 * j + i] = (qs[(j / 2) * 32 + i] >> (4 * (j % 2))) & 15;
}

inline void q6_k_values(const uint8_t* blk, uint8_t* q) {
  const uint8_t *ql = blk, *qh = blk + 128;
  for (int h = 0; h < 2; ++h)
    for (int t = 0; t < 4; ++t)
      for (int i = 0; i < 32; ++i) {
        const int lo = (ql[h * 64 + (t % 2) * 32 + i] >> (4 * (t / 2))) & 15;
        const int hi = (qh[h * 32 + i] >> (2 * t)) & 3;
        q[h * 128 + t * 32 + i] = static_cast<uint8_t>(lo | (hi << 4));
      }
}

void check_blocks(const at::Tensor& b, int64_t bytes, const char* what) {
  TORCH_CHECK(b.dim() == 3 && b.scalar_type() == at::kByte && b.is_contiguous() && b.size(2) == bytes, what,
              ": blocks must be contiguous uint8 [N, K / 256, ", bytes, "]");
}

// the nibbles of a 16-row block's chunk c (values 8c..8c+7 of each row's q) into dst[64]
inline void nibbles(const uint8_t* q, int64_t ld, int64_t rows, int64_t c, uint8_t* dst) {
  for (int64_t r = 0; r < rows; ++r)
    for (int t = 0; t < 4; ++t) dst[4 * r + t] = (q[r * ld + 8 * c + t] & 15) | ((q[r * ld + 8 * c + 4 + t] & 15) << 4);
}

std::tuple<at::Tensor, at::Tensor> q4_k_repack(const at::Tensor& blocks) {
  check_blocks(blocks, 144, "q4_k_repack");
  const int64_t N = blocks.size(0), S = blocks.size(1), K = S * 256, nb = (N + kRows - 1) / kRows;
  at::Tensor w = at::zeros({nb, K / 8, 64}, blocks.options());
  at::Tensor rec = at::zeros({nb, S, 320}, blocks.options());
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* wp = w.data_ptr<uint8_t>();
  uint8_t* rp = rec.data_ptr<uint8_t>();
  at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
    std::vector<uint8_t> q(kRows * 256);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t rows = std::min(kRows, N - b * kRows);
      for (int64_t s = 0; s < S; ++s) {
        uint8_t* r = rp + (b * S + s) * 320;
        for (int64_t i = 0; i < rows; ++i) {
          const uint8_t* blk = src + ((b * kRows + i) * S + s) * 144;
          std::memcpy(r + 2 * i, blk, 2);  // d
          const uint16_t nm = static_cast<uint16_t>((blk[2] | (blk[3] << 8)) ^ 0x8000);  // -dmin
          r[32 + 2 * i] = nm & 255;
          r[33 + 2 * i] = nm >> 8;
          uint8_t sc[8], mn[8];
          k_scales(blk + 4, sc, mn);
          for (int j = 0; j < 8; ++j) {
            r[64 + 16 * j + i] = sc[j];
            r[192 + 16 * j + i] = mn[j];
          }
          q4_k_values(blk, q.data() + i * 256);
        }
        for (int64_t c = 0; c < 32; ++c) nibbles(q.data(), 256, rows, c, wp + (b * (K / 8) + s * 32 + c) * 64);
      }
    }
  });
  return {w, rec};
}

std::tuple<at::Tensor, at::Tensor> q6_k_repack(const at::Tensor& blocks, int64_t planes) {
  check_blocks(blocks, 210, "q6_k_repack");
  TORCH_CHECK(planes == 2 || planes == -1, "q6_k_repack: planes must be 2 (nibbles and two bit planes) or -1 "
              "(byte lanes), got ", planes);
  const int64_t N = blocks.size(0), S = blocks.size(1), K = S * 256, nb = (N + kRows - 1) / kRows;
  const bool lanes = planes < 0;
  at::Tensor w = lanes ? at::zeros({nb, K / 4, 64}, blocks.options()) : at::zeros({nb, K / 8, 96}, blocks.options());
  at::Tensor rec = at::zeros({nb, S, 288}, blocks.options());
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* wp = w.data_ptr<uint8_t>();
  uint8_t* rp = rec.data_ptr<uint8_t>();
  at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
    std::vector<uint8_t> q(kRows * 256);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t rows = std::min(kRows, N - b * kRows);
      for (int64_t s = 0; s < S; ++s) {
        uint8_t* r = rp + (b * S + s) * 288;
        for (int64_t i = 0; i < rows; ++i) {
          const uint8_t* blk = src + ((b * kRows + i) * S + s) * 210;
          std::memcpy(r + 2 * i, blk + 208, 2);  // d
          for (int g = 0; g < 16; ++g) r[32 + 16 * g + i] = blk[192 + g];
          q6_k_values(blk, q.data() + i * 256);
        }
        if (lanes) {
          for (int64_t c = 0; c < 64; ++c) {
            uint8_t* dst = wp + (b * (K / 4) + s * 64 + c) * 64;
            for (int64_t i = 0; i < rows; ++i)
              for (int t = 0; t < 4; ++t) dst[4 * i + t] = q[i * 256 + 4 * c + t];
          }
          continue;
        }
        for (int64_t c = 0; c < 32; ++c) {
          uint8_t* dst = wp + (b * (K / 8) + s * 32 + c) * 96;
          nibbles(q.data(), 256, rows, c, dst);
          // value f of the chunk's (half, row, k%4) order: row (f % 64) / 4, k = 8c + 4 (f / 64) + f % 4
          for (int p = 0; p < 2; ++p)
            for (int byte = 0; byte < 16; ++byte) {
              uint8_t mask = 0;
              for (int j = 0; j < 8; ++j) {
                const int f = 8 * byte + j, row = (f % 64) / 4;
                if (row < rows) mask |= ((q[row * 256 + 8 * c + 4 * (f / 64) + f % 4] >> (4 + p)) & 1) << j;
              }
              dst[64 + 16 * p + byte] = mask;
            }
        }
      }
    }
  });
  return {w, rec};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(localllm, m) {
  m.def("q4_k_repack(Tensor blocks) -> (Tensor, Tensor)");
  m.def("q6_k_repack(Tensor blocks, int planes) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(localllm, CPU, m) {
  m.impl("q4_k_repack", &q4_k_repack);
  m.impl("q6_k_repack", &q6_k_repack);
}
