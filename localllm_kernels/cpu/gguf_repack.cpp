// GGUF K-quant blocks (Q2_K .. Q6_K, IQ4_XS) and the 32-value types (Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q8_0)
// -> our CPU layer kernels' layouts, in one pass at load.
//
// Why: the torch path (gguf_blocks.decode, then cpu_int4.pack_dm / cpu_int8.pack) expands every
// value to a byte, builds fp32 group products it then drops, and reorders in several passes: ~6 of
// a 1B-shape Q4_K_M file's 9.8 s first load. Here each 16-row block is read once and written
// once, bit-identical to that path (tests/test_gguf_repack.py compares them).
//
// In: blocks uint8 [N, K / values a block, block bytes], ggml-quants.c's block_* structs.
// (Q3_K, Q2_K: their 3- and 2-bit values held as nibbles, as the torch path holds them.) With
// `rows` (int64 [N'], optional): output row r is block row rows[r] (q/k's rotate_half order over
// the parts of a fused layer, read into one buffer: no gathered or concatenated copy at load).
// Out (rows past N are zeros, to a multiple of 16):
//   q4_k_repack -> (w uint8 [N/16, K/8, 64]: cpu_int4's nibbles, value k of row r of a 16-row
//     block in chunk k/8, byte 4r + k%4, the low nibble for k%8 < 4; records)
//   k_repack(kind, planes) -> (w: cpu_int8's layout: planes >= 0: [N/16, K/8, 64 + 16 planes],
//     the nibbles as above then the bits above 4 (planes 1: 16 bytes of shifted bits; planes 2: 32
//     bytes of 2-bit pairs: int8_gemm.cpp's layouts); planes -1: byte lanes [N/16, K/4, 64], value k of
//     row r at byte 4r + k%4 of chunk k/4; records). Q5_K takes 1 plane, Q6_K 2, Q3_K and Q2_K
//     0, or byte lanes; IQ4_XS 0 (its 4-bit codebook indices as they are).
//   block32_repack(kind, planes) -> (w as k_repack's, the blocks' fp16 d (and m) [N/16, K/32, 1 | 2, 16]):
//     Q5_0, Q5_1 (1 plane or bytes), IQ4_NL (its indices), Q8_0 (bytes of value + 128), [N, K/32, bytes];
//     MXFP4 also as gpt-oss's checkpoints hold it: [N, K/32, 16] nibbles with the E8M0 scales [N, K/32] beside
//   pack_gguf_q4(parts, rows, K) -> Q4_0 / Q4_1 parts (and a row order) into cpu_int4's layout, fp16 scales
//   records uint8 [N/16, K/256, bytes]: group_scales.h's Super form: the 16 rows' fp16 d (and -dmin),
//     then the int8 sub-scales (and mins), [group][row].

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

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

// one super-block's 256 values of a row into q: 0..15 (Q4_K; IQ4_XS: the codebook's indices),
// 0..31 (Q5_K), 0..63 (Q6_K), as gguf_blocks.decode orders them
inline void q45_k_values(const uint8_t* blk, bool five, uint8_t* q) {
  const uint8_t* qs = blk + (five ? 48 : 16);
  for (int j = 0; j < 8; ++j)
    for (int i = 0; i < 32; ++i) {
      uint8_t v = (qs[(j / 2) * 32 + i] >> (4 * (j % 2))) & 15;
      if (five) v |= ((blk[16 + i] >> j) & 1) << 4;  // bit j of qh byte i: the fifth bit of sub-block j
      q[32 * j + i] = v;
    }
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

inline void q3_k_values(const uint8_t* blk, uint8_t* q) {  // 0..7: 2 low bits from qs, the third from hmask
  const uint8_t *hmask = blk, *qs = blk + 32;
  for (int j = 0; j < 8; ++j)
    for (int i = 0; i < 32; ++i)
      q[32 * j + i] = static_cast<uint8_t>(((qs[(j / 4) * 32 + i] >> (2 * (j % 4))) & 3) | (((hmask[i] >> j) & 1) << 2));
}

inline void q2_k_values(const uint8_t* blk, uint8_t* q) {  // 0..3
  const uint8_t* qs = blk + 16;
  for (int j = 0; j < 8; ++j)
    for (int i = 0; i < 32; ++i) q[32 * j + i] = (qs[(j / 4) * 32 + i] >> (2 * (j % 4))) & 3;
}

inline void iq4_xs_values(const uint8_t* blk, uint8_t* q) {
  const uint8_t* qs = blk + 8;
  for (int j = 0; j < 8; ++j)
    for (int i = 0; i < 16; ++i) {
      q[32 * j + i] = qs[16 * j + i] & 15;
      q[32 * j + 16 + i] = qs[16 * j + i] >> 4;
    }
}

void check_blocks(const at::Tensor& b, int64_t bytes, const char* what) {
  TORCH_CHECK(b.dim() == 3 && b.scalar_type() == at::kByte && b.is_contiguous() && b.size(2) == bytes, what,
              ": blocks must be contiguous uint8 [N, K / 256, ", bytes, "]");
}

// the source row of each output row: `rows` checked against the blocks' N, or 0..N-1 (empty)
std::vector<int64_t> row_order(const at::Tensor& blocks, const std::optional<at::Tensor>& rows, const char* what) {
  const int64_t n = blocks.size(0);
  if (!rows.has_value()) {
    std::vector<int64_t> order(n);
    for (int64_t i = 0; i < n; ++i) order[i] = i;
    return order;
  }
  const at::Tensor r = rows->contiguous();
  TORCH_CHECK(r.dim() == 1 && r.scalar_type() == at::kLong, what, ": rows must be int64 [N]");
  const int64_t* p = r.data_ptr<int64_t>();
  std::vector<int64_t> order(p, p + r.size(0));
  for (int64_t v : order) TORCH_CHECK(v >= 0 && v < n, what, ": row ", v, " is outside the ", n, " rows given");
  return order;
}

// zeros where a last 16-row block is partial (its missing rows must read as zeros); else every
// byte is written by the repack, and zeroing first was a second pass over ~the file's size
at::Tensor output(at::IntArrayRef shape, int64_t n, const at::TensorOptions& options) {
  return n % kRows ? at::zeros(shape, options) : at::empty(shape, options);
}

// the types, their block bytes, record bytes and high-bit planes (-1: byte lanes)
enum Kind { kQ4K, kQ5K, kQ6K, kIQ4XS, kQ3K, kQ2K };

struct Spec {
  int64_t block, record;
};

constexpr Spec spec(Kind k) {
  switch (k) {
    case kQ4K: return {144, 320};
    case kQ5K: return {176, 320};
    case kQ6K: return {210, 288};
    case kQ3K: return {110, 288};
    case kQ2K: return {84, 576};
    default: return {136, 160};
  }
}

// row i's part of a super-block's scale record r (group_scales.h's Super form, 16 rows)
inline void record_row(Kind kind, const uint8_t* blk, int64_t i, uint8_t* r) {
  if (kind == kQ4K || kind == kQ5K) {
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
  } else if (kind == kQ6K) {
    std::memcpy(r + 2 * i, blk + 208, 2);
    for (int g = 0; g < 16; ++g) r[32 + 16 * g + i] = blk[192 + g];
  } else if (kind == kQ3K) {  // 6-bit scales: low nibbles in bytes 96..103, high bit pairs in 104..107
    std::memcpy(r + 2 * i, blk + 108, 2);
    const uint8_t* s = blk + 96;
    for (int g = 0; g < 16; ++g) {
      const int low = (s[g % 8] >> (4 * (g / 8))) & 15, high = (s[8 + g % 4] >> (2 * (g / 4))) & 3;
      r[32 + 16 * g + i] = static_cast<uint8_t>((low | (high << 4)) - 32);
    }
  } else if (kind == kQ2K) {  // 16 bytes: a scale (low nibble) and a min (high nibble) per group
    std::memcpy(r + 2 * i, blk + 80, 2);
    const uint16_t nm = static_cast<uint16_t>((blk[82] | (blk[83] << 8)) ^ 0x8000);  // -dmin
    r[32 + 2 * i] = nm & 255;
    r[33 + 2 * i] = nm >> 8;
    for (int g = 0; g < 16; ++g) {
      r[64 + 16 * g + i] = blk[g] & 15;
      r[320 + 16 * g + i] = blk[g] >> 4;
    }
  } else {  // IQ4_XS: 6-bit scales, low nibbles in bytes 4..7, high bit pairs in the uint16 at 2
    std::memcpy(r + 2 * i, blk, 2);
    const int high = blk[2] | (blk[3] << 8);
    for (int j = 0; j < 8; ++j) {
      const int low = (blk[4 + j / 2] >> (4 * (j % 2))) & 15;
      r[32 + 16 * j + i] = static_cast<uint8_t>((low | (((high >> (2 * j)) & 3) << 4)) - 32);
    }
  }
}

// the 16 rows x ld values q (row stride ld) of a block column into the weight layout: `planes` >= 0:
// chunks of 8 values as nibbles then their bits above 4 (1: 16 bytes of bit 4s; 2: 32 bytes of
// 2-bit pairs; int8_gemm.cpp's layouts); -1: byte lanes in chunks of 4
void write_values(const uint8_t* q, int64_t ld, int64_t rows, int planes, uint8_t* dst) {
  if (planes < 0) {
    for (int64_t c = 0; c < ld / 4; ++c, dst += 64)
      for (int64_t i = 0; i < rows; ++i)
        for (int t = 0; t < 4; ++t) dst[4 * i + t] = q[i * ld + 4 * c + t];
    return;
  }
  const int64_t stride = 64 + 16 * planes;
  for (int64_t c = 0; c < ld / 8; ++c, dst += stride) {
    // the values each nibble byte b = 4 row + t holds: lo[b] (low nibble, k = 8c + t) and hi[b]
    // (high nibble, k = 8c + 4 + t), zeros for rows past the matrix; then every output byte is a
    // function of bytes i, 16 + i, 32 + i, 48 + i of these, which the compiler vectorizes (the
    // per-value bit loops this replaces made Q5_K / Q6_K repacks ~3 cycles a value)
    uint8_t lo[64] = {}, hi[64] = {};
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(lo + 4 * r, q + r * ld + 8 * c, 4);
      std::memcpy(hi + 4 * r, q + r * ld + 8 * c + 4, 4);
    }
    for (int b = 0; b < 64; ++b) dst[b] = static_cast<uint8_t>((lo[b] & 15) | ((hi[b] & 15) << 4));
    if (planes == 2) {  // byte i, from its low bits up: (q >> 4) of the values at nibble byte i
      // (row i / 4: its low then high nibble's value), then at nibble byte 32 + i (row 8 + i / 4)
      for (int i = 0; i < 32; ++i)
        dst[64 + i] = static_cast<uint8_t>((lo[i] >> 4) | ((hi[i] >> 4) << 2) | ((lo[32 + i] >> 4) << 4) |
                                           ((hi[32 + i] >> 4) << 6));
    } else if (planes == 1) {
      // bit 4 of the low / high (u) nibble's value at nibble byte b = 32hh + 16ll + i (row b / 4,
      // k = 8c + 4u + b % 4) as bit 4hh + 2u + ll of byte i
      for (int i = 0; i < 16; ++i) {
        uint8_t bits = 0;
        for (int hh = 0; hh < 2; ++hh)
          for (int ll = 0; ll < 2; ++ll) {
            const int b = 32 * hh + 16 * ll + i;
            bits |= (((lo[b] >> 4) & 1) << (4 * hh + ll)) | (((hi[b] >> 4) & 1) << (4 * hh + 2 + ll));
          }
        dst[64 + i] = bits;
      }
    }
  }
}

// Super-block rows [b0, b1) of 16 (repack's work per thread). A function of its own, its scratch
// on the stack: inside repack's lambda, reaching everything through the captured references, the
// same loops ran 1.15-1.2x slower (1B Q4_K_M shape, gate and down, 2 threads, the two builds in
// one process: 0.37-0.39 -> 0.31-0.32 s).
void repack_blocks(const uint8_t* src, const int64_t* order, int64_t N, int64_t S, Kind kind, int planes,
                   int64_t chunk_bytes, int64_t b0, int64_t b1, uint8_t* wp, uint8_t* rp) {
  const Spec sp = spec(kind);
  uint8_t q[kRows * 256];
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t rows = std::min(kRows, N - b * kRows);
    for (int64_t s = 0; s < S; ++s) {
      for (int64_t i = 0; i < rows; ++i) {
        const uint8_t* blk = src + (order[b * kRows + i] * S + s) * sp.block;
        record_row(kind, blk, i, rp + (b * S + s) * sp.record);
        uint8_t* qi = q + i * 256;
        if (kind == kQ6K) q6_k_values(blk, qi);
        else if (kind == kIQ4XS) iq4_xs_values(blk, qi);
        else if (kind == kQ3K) q3_k_values(blk, qi);
        else if (kind == kQ2K) q2_k_values(blk, qi);
        else q45_k_values(blk, kind == kQ5K, qi);
      }
      write_values(q, 256, rows, planes, wp + (b * S + s) * chunk_bytes);
    }
  }
}

std::tuple<at::Tensor, at::Tensor> repack(const at::Tensor& blocks, const std::optional<at::Tensor>& rows, Kind kind,
                                          int planes, const char* what) {
  const Spec sp = spec(kind);
  check_blocks(blocks, sp.block, what);
  const std::vector<int64_t> order = row_order(blocks, rows, what);
  const int64_t N = static_cast<int64_t>(order.size()), S = blocks.size(1), K = S * 256, nb = (N + kRows - 1) / kRows;
  const int64_t chunk_bytes = planes < 0 ? 64 * 64 : 32 * (64 + 16 * planes);  // one super-block's
  at::Tensor w = output({nb, S * chunk_bytes}, N, blocks.options());
  at::Tensor rec = output({nb, S, sp.record}, N, blocks.options());
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* wp = w.data_ptr<uint8_t>();
  uint8_t* rp = rec.data_ptr<uint8_t>();
  at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
    repack_blocks(src, order.data(), N, S, kind, planes, chunk_bytes, b0, b1, wp, rp);
  });
  const int64_t record = planes < 0 ? 64 : 64 + 16 * planes;
  return {w.view({nb, K / (planes < 0 ? 4 : 8), record}), rec};
}

std::tuple<at::Tensor, at::Tensor> q4_k_repack(const at::Tensor& blocks, const std::optional<at::Tensor>& rows) {
  return repack(blocks, rows, kQ4K, 0, "q4_k_repack");
}

std::tuple<at::Tensor, at::Tensor> k_repack(const at::Tensor& blocks, const std::string& kind, int64_t planes,
                                            const std::optional<at::Tensor>& rows) {
  const Kind k = kind == "Q5_K" ? kQ5K : kind == "Q6_K" ? kQ6K : kind == "Q3_K" ? kQ3K : kind == "Q2_K" ? kQ2K : kIQ4XS;
  TORCH_CHECK(kind == "Q5_K" || kind == "Q6_K" || kind == "Q3_K" || kind == "Q2_K" || kind == "IQ4_XS",
              "k_repack: kind must be Q5_K, Q6_K, Q3_K, Q2_K or IQ4_XS, got ", kind);
  const int own = k == kQ5K ? 1 : k == kQ6K ? 2 : 0;  // 2- to 4-bit values: nibbles alone
  // IQ4_XS's nibbles are codebook indices: no byte-lane form
  TORCH_CHECK(planes == own || (planes == -1 && k != kIQ4XS), "k_repack: ", kind, " packs with ", own, " bit planes",
              k != kIQ4XS ? " or in byte lanes (-1)" : "", ", got ", planes);
  return repack(blocks, rows, k, static_cast<int>(planes), "k_repack");
}

// A 32-value block's 16 nibble bytes (value i in the low nibble of qs[i], value 16 + i in the high
// one) -> the four 4-byte words of its row in the nibble layout's four 8-column records (chunk c
// pairs values 8c + j and 8c + 4 + j, j < 4): with a_i the bytes qs[4i..4i+3], chunks 0 and 1 are
// the low nibbles of (a0, a1) and (a2, a3), chunks 2 and 3 their high nibbles.
// mx: MXFP4's index 8 (-0) made 0 (+0) first, as cpu_int8.pack gives them: one index a value.
inline void nibble_chunks(const uint8_t* qs, uint32_t c[4], bool mx = false) {
  constexpr uint32_t kLo = 0x0F0F0F0Fu, kHi = 0xF0F0F0F0u;
  uint32_t a[4];
  std::memcpy(a, qs, 16);
  for (int i = 0; mx && i < 4; ++i) {
    const uint32_t y = a[i] ^ 0x88888888u;  // a nibble of 8 -> 0
    const uint32_t nonzero = (y | (y >> 1) | (y >> 2) | (y >> 3)) & 0x11111111u;  // per nibble, at its bit 0
    a[i] &= ~((~nonzero & 0x11111111u) * 15u);
  }
  c[0] = (a[0] & kLo) | ((a[1] & kLo) << 4);
  c[1] = (a[2] & kLo) | ((a[3] & kLo) << 4);
  c[2] = ((a[0] >> 4) & kLo) | (a[1] & kHi);
  c[3] = ((a[2] >> 4) & kLo) | (a[3] & kHi);
}

// the 32-value block types: d (and m) fp16 first, then Q5_0 / Q5_1: the fifth bits as a 32-bit
// little-endian word and 16 bytes of nibbles; IQ4_NL: the nibbles (codebook indices); Q8_0: 32 int8;
// MXFP4: an E8M0 byte (d = 2^(e - 128)), then nibbles indexing its doubled E2M1 values (kept as
// indices, as IQ4_NL's: int8_gemm.cpp's kMx with zero point 16)
struct Block32 {
  int64_t bytes;
  int scales, planes;  // fp16 scales a block (d; d and m), the layout's own bit planes (-1: bytes)
  bool mx = false;     // MXFP4: the scale a power of two
};

Block32 block32(const std::string& kind) {
  if (kind == "Q5_0") return {22, 1, 1};
  if (kind == "Q5_1") return {24, 2, 1};
  if (kind == "IQ4_NL") return {18, 1, 0};
  if (kind == "MXFP4") return {17, 1, 0, true};
  TORCH_CHECK(kind == "Q8_0", "block32_repack: kind must be Q5_0, Q5_1, IQ4_NL, Q8_0 or MXFP4, got ", kind);
  return {34, 1, -1};
}

// 2^(e - 128) as fp16 bits where fp16 holds it exactly (2^-24 .. 2^15), else a NaN: the caller
// then takes the torch path, which keeps fp32 scales
inline uint16_t e8m0_half(uint8_t e) {
  const int p = e - 128;
  if (p >= -14 && p <= 15) return static_cast<uint16_t>((p + 15) << 10);
  if (p >= -24 && p < -14) return static_cast<uint16_t>(1u << (p + 24));  // subnormal
  return 0x7E00;
}

inline void block32_values(const uint8_t* blk, const Block32& t, uint8_t* q) {
  if (t.planes < 0) {  // Q8_0: int8 + 128
    for (int i = 0; i < 32; ++i) q[i] = blk[2 + i] ^ 0x80;
    return;
  }
  const uint8_t* qs = blk + t.bytes - 16;
  uint32_t high = 0;
  if (t.planes == 1) std::memcpy(&high, blk + 2 * t.scales, 4);
  for (int i = 0; i < 16; ++i) {
    q[i] = (qs[i] & 15) | (((high >> i) & 1) << 4);
    q[16 + i] = (qs[i] >> 4) | (((high >> (16 + i)) & 1) << 4);
  }
}

// gpt-oss's MXFP4 nibbles (byte m: values 2m and 2m + 1) -> GGUF's (qs[j]: values j and j + 16): qs[2m]
// takes the low nibbles of bytes m and m + 8, qs[2m + 1] their high ones
inline void mxfp4_gguf_order(const uint8_t* hf, uint8_t qs[16]) {
  for (int m = 0; m < 8; ++m) {
    qs[2 * m] = static_cast<uint8_t>((hf[m] & 15) | (hf[m + 8] << 4));
    qs[2 * m + 1] = static_cast<uint8_t>((hf[m] >> 4) | (hf[m + 8] & 0xF0));
  }
}

// Q5_0, Q5_1, IQ4_NL, Q8_0 or MXFP4 blocks [N, K / 32, bytes] -> cpu_int8's layout (`planes`: the type's
// own, or -1 for byte lanes where the values are not codebook indices) and the blocks' fp16
// scales [N/16, K/32, 1 | 2, 16]. `scales` (MXFP4 only): the checkpoint's layout, blocks [N, K / 32, 16]
// of gpt-oss's nibble order with their E8M0 bytes [N, K / 32] apart (no GGUF copy made first).
std::tuple<at::Tensor, at::Tensor> block32_repack(const at::Tensor& blocks, const std::string& kind, int64_t planes,
                                                  const std::optional<at::Tensor>& rows,
                                                  const std::optional<at::Tensor>& scales) {
  const Block32 t = block32(kind);
  const bool indices = kind == "IQ4_NL" || t.mx;  // codebook indices: no byte lanes
  TORCH_CHECK(planes == t.planes || (planes == -1 && !indices), "block32_repack: ", kind, " packs with ",
              t.planes, " bit planes", !indices ? " or in byte lanes (-1)" : "", ", got ", planes);
  const bool apart = scales.has_value();
  const int64_t bytes = apart ? 16 : t.bytes;
  TORCH_CHECK(!apart || t.mx, "block32_repack: scales apart are MXFP4's only");
  TORCH_CHECK(blocks.dim() == 3 && blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
              blocks.size(2) == bytes, "block32_repack: blocks must be contiguous uint8 [N, K / 32, ", bytes, "]");
  TORCH_CHECK(!apart || (scales->scalar_type() == at::kByte && scales->is_contiguous() && scales->dim() == 2 &&
                         scales->size(0) == blocks.size(0) && scales->size(1) == blocks.size(1)),
              "block32_repack: scales must be contiguous uint8 [N, K / 32]");
  const uint8_t* esrc = apart ? scales->data_ptr<uint8_t>() : nullptr;
  const std::vector<int64_t> order = row_order(blocks, rows, "block32_repack");
  const int64_t N = static_cast<int64_t>(order.size()), G = blocks.size(1), K = G * 32, nb = (N + kRows - 1) / kRows;
  const int64_t record = planes < 0 ? 64 : 64 + 16 * planes, group_bytes = planes < 0 ? 8 * 64 : 4 * record;
  at::Tensor w = output({nb, K / (planes < 0 ? 4 : 8), record}, N, blocks.options());
  at::Tensor sc = output({nb, G, t.scales, kRows}, N, blocks.options().dtype(at::kHalf));
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* wp = w.data_ptr<uint8_t>();
  uint8_t* sp = reinterpret_cast<uint8_t*>(sc.data_ptr<at::Half>());
  at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
    uint8_t q[kRows * 32];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t rows = std::min(kRows, N - b * kRows);
      for (int64_t g = 0; g < G; ++g) {
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t at = order[b * kRows + r] * G + g;
          const uint8_t* blk = src + at * bytes;
          uint8_t qs[16];
          if (apart) mxfp4_gguf_order(blk, qs);
          if (t.mx) {
            const uint16_t d = e8m0_half(apart ? esrc[at] : blk[0]);
            std::memcpy(sp + ((b * G + g) * kRows + r) * 2, &d, 2);
          } else {
            for (int j = 0; j < t.scales; ++j)
              std::memcpy(sp + (((b * G + g) * t.scales + j) * kRows + r) * 2, blk + 2 * j, 2);
          }
          if (planes == 0) {  // 4-bit indices (IQ4_NL, MXFP4): the file's nibbles straight into the records
            uint32_t c[4];
            nibble_chunks(apart ? qs : blk + t.bytes - 16, c, t.mx);
            for (int k = 0; k < 4; ++k) std::memcpy(wp + (b * G + g) * group_bytes + k * 64 + 4 * r, &c[k], 4);
          } else {
            block32_values(blk, t, q + r * 32);
          }
        }
        if (planes != 0) write_values(q, 32, rows, static_cast<int>(planes), wp + (b * G + g) * group_bytes);
      }
    }
  });
  return {w, sc};
}

// GGUF Q4_0 / Q4_1 blocks straight into cpu_int4's layout: a lossless shuffle of nibbles and
// scales, with no pass through unpacked or fp32 weights (the first load of a 1 GB GGUF spent
// ~20 s in those passes). raws: the parts of one layer (fused qkv / gate_up), each uint8
// [n_i, K/32, 18 | 20] in the file's block layout; rows [N] (N a multiple of 16): for each output
// row its source row in the parts stacked, -1 for padding. Q4_1 keeps the file's d and m
// (scales [N/16, K/32, 2, 16]); Q4_0 its d alone (symmetric: [N/16, K/32, 1, 16]), the file's bytes.
std::tuple<at::Tensor, at::Tensor> pack_gguf_q4(at::TensorList raws, const at::Tensor& rows, int64_t K) {
  TORCH_CHECK(!raws.empty() && K % 32 == 0, "pack_gguf_q4: no parts, or K not a multiple of 32");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.size(0) % kRows == 0,
              "pack_gguf_q4: rows must be int64 [N], N a multiple of 16");
  const int64_t nbk = K / 32, bsz = raws[0].size(2), N = rows.size(0);
  TORCH_CHECK(bsz == 18 || bsz == 20, "pack_gguf_q4: blocks of 18 (Q4_0) or 20 (Q4_1) bytes");
  std::vector<const uint8_t*> base;
  std::vector<int64_t> start{0};
  for (const at::Tensor& r : raws) {
    TORCH_CHECK(r.dim() == 3 && r.size(1) == nbk && r.size(2) == bsz && r.scalar_type() == at::kByte &&
                r.is_contiguous(), "pack_gguf_q4: every part must be contiguous uint8 [n, K/32, ", bsz, "]");
    base.push_back(r.data_ptr<uint8_t>());
    start.push_back(start.back() + r.size(0));
  }
  const at::Tensor rc = rows.contiguous();
  const int64_t* rix = rc.data_ptr<int64_t>();
  for (int64_t i = 0; i < N; ++i)
    TORCH_CHECK(rix[i] >= -1 && rix[i] < start.back(), "pack_gguf_q4: row ", rix[i], " out of range");
  at::Tensor w = at::empty({N / kRows, K / 8, 64}, rows.options().dtype(at::kByte));
  const int ns = bsz == 20 ? 2 : 1;
  at::Tensor sc = at::empty({N / kRows, nbk, ns, kRows}, rows.options().dtype(at::kHalf));
  uint8_t* wo = w.data_ptr<uint8_t>();
  at::Half* so = sc.data_ptr<at::Half>();
  at::parallel_for(0, N / kRows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb) {
      for (int r = 0; r < kRows; ++r) {
        const int64_t src = rix[nb * kRows + r];
        const uint8_t* row = nullptr;
        if (src >= 0) {
          const size_t p = std::upper_bound(start.begin(), start.end(), src) - start.begin() - 1;
          row = base[p] + (src - start[p]) * nbk * bsz;
        }
        for (int64_t b = 0; b < nbk; ++b) {
          at::Half d(0.f), m(0.f);
          uint32_t c[4] = {0, 0, 0, 0};
          if (row) {
            const uint8_t* blk = row + b * bsz;
            uint16_t bits;
            std::memcpy(&bits, blk, 2);
            d = at::Half(bits, at::Half::from_bits());
            if (bsz == 20) {
              std::memcpy(&bits, blk + 2, 2);
              m = at::Half(bits, at::Half::from_bits());
            }
            nibble_chunks(blk + bsz - 16, c);
          }
          uint8_t* o = wo + (nb * (K / 8) + b * 4) * 64 + 4 * r;
          for (int k = 0; k < 4; ++k) std::memcpy(o + k * 64, &c[k], 4);
          at::Half* s = so + (nb * nbk + b) * ns * kRows;
          s[r] = d;
          if (ns == 2) s[kRows + r] = m;
        }
      }
    }
  });
  return {w, sc};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(localllm, m) {
  m.def("q4_k_repack(Tensor blocks, Tensor? rows=None) -> (Tensor, Tensor)");
  m.def("k_repack(Tensor blocks, str kind, int planes, Tensor? rows=None) -> (Tensor, Tensor)");
  m.def("block32_repack(Tensor blocks, str kind, int planes, Tensor? rows=None, Tensor? scales=None) -> (Tensor, Tensor)");
  m.def("pack_gguf_q4(Tensor[] raws, Tensor rows, int K) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(localllm, CPU, m) {
  m.impl("q4_k_repack", &q4_k_repack);
  m.impl("k_repack", &k_repack);
  m.impl("block32_repack", &block32_repack);
  m.impl("pack_gguf_q4", &pack_gguf_q4);
}
