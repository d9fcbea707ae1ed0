// Small-M matmuls for CPU verify steps (quickdraft issue 19): float32, int8 and group-wise int4
// weights (the int4 layout is described at its kernel below), float32 activations.
//
// y (M, N) = x (M, K) @ W + bias, with W stored in column blocks of 64 outputs:
// packed (N/64, K, 64), block j holding W[:, 64j : 64j + 64] row after row (zero-padded past N).
// Each block is read once, contiguously, for all M rows (M <= 16 is the verify case; more rows
// re-read the block from cache), so k + 1 rows stream the same bytes as one row: a GEMV-like
// kernel for every small M, where a BLAS sgemm packs the whole weight again at each call.
//
// Every output element is the bias plus x[m, k] * W[k, n] accumulated with FMAs in k order
// 0..K-1, whatever M, however the rows are grouped and on any thread count (the portable path
// too: std::fma rounds as the instruction does), so a row's result does not depend on the other
// rows: a verify step's matmuls give a token the bits a decode step gives it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>
#include <type_traits>

namespace {

constexpr int64_t NB = 64;  // outputs per block: four 16-float vectors
#ifndef PF
#define PF 4096  // bytes ahead of the read
#endif

// The lanes of a 16-float vector below `left` outputs (all of them from 16 on, none at 0 or less).
inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
}

// Sixteen weights of a block row as floats: float32 as stored; int8 widened exactly.
__attribute__((target("avx512f"))) inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
__attribute__((target("avx512f"))) inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// MR rows over NBLK adjacent blocks at once (NBLK read streams, MR * 4 * NBLK running sums in
// registers: at most 24 of AVX-512's 32). Prefetching PF bytes ahead keeps enough cache-line
// reads in flight for one core to stream at its bandwidth.
// float32 weights: y = bias + sum_k x w (the sums start from the bias).
// int8 weights: y = (sum_k x q) * scale + bias (one FMA at the end), scale per output.
template <typename W, int MR, int NBLK>
__attribute__((target("avx512f"))) void block_rows(const float* x, int64_t ldx, const W* wb, int64_t K,
                                                   const float* scale, const float* bias, float* y, int64_t ldy,
                                                   int64_t ncols) {
  constexpr int V = 4 * NBLK;  // vectors per row
  constexpr bool scaled = !std::is_same<W, float>::value;
  __m512 acc[MR][V];
#pragma GCC unroll 8
  for (int j = 0; j < V; ++j) {
    // (adjacent blocks' biases are adjacent; masked: the last block may be partial)
    __m512 b = (bias && !scaled) ? _mm512_maskz_loadu_ps(tail_mask(ncols - 16 * j), bias + 16 * j) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) acc[r][j] = b;
  }
  for (int64_t k = 0; k < K; ++k) {
    __m512 w[V];
#pragma GCC unroll 8
    for (int c = 0; c < NBLK; ++c) {
      const W* src = wb + c * K * NB + k * NB;
      const char* ahead = reinterpret_cast<const char*>(src) + PF;
#pragma GCC unroll 4
      for (int line = 0; line < int(NB * sizeof(W)); line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) w[4 * c + q] = load16(src + 16 * q);
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      __m512 xv = _mm512_set1_ps(x[r * ldx + k]);
#pragma GCC unroll 8
      for (int j = 0; j < V; ++j) acc[r][j] = _mm512_fmadd_ps(xv, w[j], acc[r][j]);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < V; ++j) {
    if (ncols - 16 * j <= 0) break;
    const __mmask16 mask = tail_mask(ncols - 16 * j);
    __m512 s = _mm512_setzero_ps(), b = _mm512_setzero_ps();
    if (scaled) {
      s = _mm512_maskz_loadu_ps(mask, scale + 16 * j);
      if (bias) b = _mm512_maskz_loadu_ps(mask, bias + 16 * j);
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      __m512 out = scaled ? _mm512_fmadd_ps(acc[r][j], s, b) : acc[r][j];
      _mm512_mask_storeu_ps(y + r * ldy + 16 * j, mask, out);
    }
  }
}

// Portable path (no AVX-512): the same products in the same order, one row at a time.
template <typename W>
void block_rows_generic(const float* x, int64_t ldx, int64_t rows, const W* wb, int64_t K, const float* scale,
                        const float* bias, float* y, int64_t ldy, int64_t ncols) {
  constexpr bool scaled = !std::is_same<W, float>::value;
  for (int64_t r = 0; r < rows; ++r) {
    float acc[NB];
    for (int64_t n = 0; n < NB; ++n) acc[n] = (bias && !scaled && n < ncols) ? bias[n] : 0.f;
    for (int64_t k = 0; k < K; ++k) {
      const float xv = x[r * ldx + k];
      const W* w = wb + k * NB;
      for (int64_t n = 0; n < NB; ++n) acc[n] = std::fma(xv, float(w[n]), acc[n]);
    }
    for (int64_t n = 0; n < ncols; ++n)
      y[r * ldy + n] = scaled ? std::fma(acc[n], scale[n], bias ? bias[n] : 0.f) : acc[n];
  }
}

bool has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f");
  return yes;
}

// One row reads four blocks at once (four streams) on Intel: 4-8% faster than two there (the
// Emerald Rapids Xeon, SmolLM2's and the bundled target's shapes). On an AMD EPYC (Zen 4) one
// row took 30-50% longer with four streams than two rows with two (SmolLM2's 576 x 49152
// lm_head 4489 vs 2942 us, 1 thread), so there a row gets two. Either way the same FMAs in the
// same order per output: the bits do not change.
bool four_streams() {
  static const bool yes = !__builtin_cpu_is("amd");
  return yes;
}

// Rows [0, M) of NBLK adjacent blocks (NBLK = 4: M = 1 only; NBLK = 2: M <= 3 only; NBLK = 1: any
// M, six rows at a time). Only the combinations that fit the registers are instantiated.
template <typename W, int NBLK>
void run_rows(const float* x, int64_t ldx, int64_t M, const W* wb, int64_t K, const float* scale, const float* bias,
              float* y, int64_t ldy, int64_t ncols) {
  int64_t m = 0;
  if (NBLK == 1)
    for (; m + 6 <= M; m += 6) block_rows<W, 6, 1>(x + m * ldx, ldx, wb, K, scale, bias, y + m * ldy, ldy, ncols);
  const float* xm = x + m * ldx;
  float* ym = y + m * ldy;
  if (NBLK == 4) {
    block_rows<W, 1, NBLK>(xm, ldx, wb, K, scale, bias, ym, ldy, ncols);
    return;
  }
  constexpr int N2 = NBLK == 4 ? 1 : NBLK;  // (never 4 below: keeps the unused instances small)
  switch (M - m) {
    case 5: block_rows<W, 5, 1>(xm, ldx, wb, K, scale, bias, ym, ldy, ncols); break;
    case 4: block_rows<W, 4, 1>(xm, ldx, wb, K, scale, bias, ym, ldy, ncols); break;
    case 3: block_rows<W, 3, N2>(xm, ldx, wb, K, scale, bias, ym, ldy, ncols); break;
    case 2: block_rows<W, 2, N2>(xm, ldx, wb, K, scale, bias, ym, ldy, ncols); break;
    case 1: block_rows<W, 1, N2>(xm, ldx, wb, K, scale, bias, ym, ldy, ncols); break;
    default: break;
  }
}

// ---- int4: 4-bit weights in groups of 32 inputs, a scale and an offset per group and output ----
//
// Layout (uint8): packed (N/64, G, GB), G = K / 32 groups; block b's group g holds
//   32 rows of 32 bytes, row k: byte j = q[k][j] | q[k][j + 32] << 4 (q in 0..15, outputs j, j + 32),
//   then 64 float16 scales s, then 64 float16 offsets o: w = q * s + o.
// Each (block, group) is one contiguous 1280-byte piece: the block is still a single read stream.
//
// Per row and output: y = bias + sum_g (s_g * A_g + o_g * X_g), A_g = sum_{k in g} x_k q_k (exact
// products, FMAs in k order), X_g = sum_{k in g} x_k (computed once per call, k order). Again a
// row's result does not depend on the other rows, the row grouping or the thread count.
constexpr int64_t QG = 32;                      // inputs per group
constexpr int64_t QGB = QG * NB / 2 + 2 * NB * 2;  // bytes per (block, group): 1024 + 256

// Sixteen bytes of 4-bit pairs as 2 x 16 floats, by table lookup: vpermps reads only the low four
// bits of each 32-bit index, so the bytes widened to 32 bits index the low nibbles as they are and,
// shifted right by 4, the high ones (3 instructions for 32 weights, where masking and converting
// took 6: the one-row int4 step is bound by these, not by memory).
__attribute__((target("avx512f"))) inline void nibbles32(__m128i bytes, __m512 table, __m512& lo, __m512& hi) {
  const __m512i idx = _mm512_cvtepu8_epi32(bytes);
  lo = _mm512_permutexvar_ps(idx, table);
  hi = _mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), table);
}

// MR rows over NBLK adjacent blocks. The group's partial sums stay in registers (MR * 4 * NBLK
// of them); the running sums live in y itself (in L1), updated once per group, which leaves the
// registers to the partial sums of more rows: each nibble widened once serves up to six rows.
template <int MR, int NBLK>
__attribute__((target("avx512f"))) void block_rows_q4(const float* x, int64_t ldx, const float* xs, int64_t G,
                                                      const uint8_t* wb, const float* bias, float* y, int64_t ldy,
                                                      int64_t ncols) {
  constexpr int V = 4 * NBLK;
  const __m512 table = _mm512_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f, 9.f, 10.f, 11.f, 12.f, 13.f, 14.f, 15.f);
#pragma GCC unroll 16
  for (int j = 0; j < V; ++j) {
    const __mmask16 mask = tail_mask(ncols - 16 * j);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * j) : _mm512_setzero_ps();
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(y + r * ldy + 16 * j, mask, b);
  }
  for (int64_t g = 0; g < G; ++g) {
    __m512 part[MR][V];
#pragma GCC unroll 16
    for (int j = 0; j < V; ++j)
#pragma GCC unroll 6
      for (int r = 0; r < MR; ++r) part[r][j] = _mm512_setzero_ps();
    const float* xg = x + g * QG;
#pragma GCC unroll 32
    for (int k = 0; k < QG; ++k) {
      __m512 xv[MR];
#pragma GCC unroll 6
      for (int r = 0; r < MR; ++r) xv[r] = _mm512_set1_ps(xg[r * ldx + k]);
#pragma GCC unroll 4
      for (int c = 0; c < NBLK; ++c) {
        const uint8_t* piece = wb + (c * G + g) * QGB;
        // one cache line of the piece PF bytes ahead per k, its 20 lines over the first 20 k
        if (k < int(QGB / 64)) _mm_prefetch(reinterpret_cast<const char*>(piece) + PF + 64 * k, _MM_HINT_T0);
        const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(piece + 32 * k));
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(piece + 32 * k + 16));
        __m512 w[4];
        nibbles32(a, table, w[0], w[2]);
        nibbles32(b, table, w[1], w[3]);
#pragma GCC unroll 4
        for (int q = 0; q < 4; ++q)
#pragma GCC unroll 6
          for (int r = 0; r < MR; ++r) part[r][4 * c + q] = _mm512_fmadd_ps(xv[r], w[q], part[r][4 * c + q]);
      }
    }
#pragma GCC unroll 16
    for (int j = 0; j < V; ++j) {
      const uint8_t* piece = wb + ((j / 4) * G + g) * QGB;
      const __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(piece + 1024 + 32 * (j % 4))));
      const __m512 of = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(piece + 1152 + 32 * (j % 4))));
      const __mmask16 mask = tail_mask(ncols - 16 * j);
#pragma GCC unroll 6
      for (int r = 0; r < MR; ++r) {
        float* yr = y + r * ldy + 16 * j;
        const __m512 acc = _mm512_fmadd_ps(part[r][j], sc, _mm512_maskz_loadu_ps(mask, yr));
        _mm512_mask_storeu_ps(yr, mask, _mm512_fmadd_ps(_mm512_set1_ps(xs[r * G + g]), of, acc));
      }
    }
  }
}

// The portable int4 path: the same operations in the same order, one row at a time.
inline float half_to_float(const uint8_t* p) {
  return float(*reinterpret_cast<const c10::Half*>(p));
}

void block_rows_q4_generic(const float* x, int64_t ldx, int64_t rows, const float* xs, int64_t G,
                           const uint8_t* wb, const float* bias, float* y, int64_t ldy, int64_t ncols) {
  for (int64_t r = 0; r < rows; ++r) {
    float acc[NB];
    for (int64_t n = 0; n < NB; ++n) acc[n] = (bias && n < ncols) ? bias[n] : 0.f;
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* piece = wb + g * QGB;
      float part[NB] = {0.f};
      for (int64_t k = 0; k < QG; ++k) {
        const float xv = x[r * ldx + g * QG + k];
        for (int64_t n = 0; n < NB; ++n) {
          const uint8_t byte = piece[32 * k + (n % 32)];
          part[n] = std::fma(xv, float(n < 32 ? byte & 15 : byte >> 4), part[n]);
        }
      }
      for (int64_t n = 0; n < NB; ++n)
        acc[n] = std::fma(xs[r * G + g], half_to_float(piece + 1152 + 2 * n),
                          std::fma(part[n], half_to_float(piece + 1024 + 2 * n), acc[n]));
    }
    for (int64_t n = 0; n < ncols; ++n) y[r * ldy + n] = acc[n];
  }
}

// Rows [0, M) of NBLK adjacent int4 blocks: four blocks for one row, two for two or three rows,
// one block six rows at a time for more (at most 24 partial sums in registers).
template <int NBLK>
void run_rows_q4(const float* x, int64_t ldx, int64_t M, const float* xs, int64_t G, const uint8_t* wb,
                 const float* bias, float* y, int64_t ldy, int64_t ncols) {
  constexpr int N2 = NBLK == 4 ? 2 : NBLK;  // (keeps the instances that cannot occur small)
  if (NBLK == 4) {
    block_rows_q4<1, NBLK>(x, ldx, xs, G, wb, bias, y, ldy, ncols);
    return;
  }
  if (NBLK == 2) {
    if (M == 3) block_rows_q4<3, N2>(x, ldx, xs, G, wb, bias, y, ldy, ncols);
    if (M == 2) block_rows_q4<2, N2>(x, ldx, xs, G, wb, bias, y, ldy, ncols);
    if (M == 1) block_rows_q4<1, N2>(x, ldx, xs, G, wb, bias, y, ldy, ncols);
    return;
  }
  int64_t m = 0;
  for (; m + 6 <= M; m += 6) block_rows_q4<6, 1>(x + m * ldx, ldx, xs + m * G, G, wb, bias, y + m * ldy, ldy, ncols);
  const float* xm = x + m * ldx;
  const float* xsm = xs + m * G;
  float* ym = y + m * ldy;
  switch (M - m) {
    case 5: block_rows_q4<5, 1>(xm, ldx, xsm, G, wb, bias, ym, ldy, ncols); break;
    case 4: block_rows_q4<4, 1>(xm, ldx, xsm, G, wb, bias, ym, ldy, ncols); break;
    case 3: block_rows_q4<3, 1>(xm, ldx, xsm, G, wb, bias, ym, ldy, ncols); break;
    case 2: block_rows_q4<2, 1>(xm, ldx, xsm, G, wb, bias, ym, ldy, ncols); break;
    case 1: block_rows_q4<1, 1>(xm, ldx, xsm, G, wb, bias, ym, ldy, ncols); break;
    default: break;
  }
}

// ---- the drivers: checks, then the blocks split over PyTorch's threads ----

struct Checked {
  int64_t M, K, nblk;
  at::Tensor x;  // rows with unit column stride
};

Checked check(const at::Tensor& x, const at::Tensor& packed, int64_t k_packed, const c10::optional<at::Tensor>& scale,
              const c10::optional<at::Tensor>& bias, int64_t n, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, name, ": x must be a 2-D float32 tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous(), name, ": packed must be a contiguous 3-D tensor");
  const int64_t K = x.size(1), nblk = packed.size(0);
  TORCH_CHECK(k_packed == K, name, ": x has ", K, " columns, the weight ", k_packed, " rows");
  TORCH_CHECK(n > (nblk - 1) * NB && n <= nblk * NB, name, ": n does not match the packed blocks");
  // per-output vectors of exactly n floats: the kernels read them masked, never past n
  for (const auto* v : {&scale, &bias})
    if (v->has_value() && (*v)->defined())
      TORCH_CHECK((*v)->numel() == n && (*v)->scalar_type() == at::kFloat && (*v)->is_contiguous(), name, ": ",
                  v == &bias ? "bias" : "scale", " must be a contiguous (n,) float32 tensor");
  return {x.size(0), K, nblk, x.stride(1) == 1 ? x : x.contiguous()};
}

inline const float* data_or_null(const c10::optional<at::Tensor>& v) {
  return v.has_value() && v->defined() ? v->data_ptr<float>() : nullptr;
}

template <typename W>
at::Tensor run(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& scale,
               const c10::optional<at::Tensor>& bias, int64_t n, const char* name) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == NB, name, ": packed must be a (N/64, K, 64) tensor");
  const Checked c = check(x, packed, packed.size(1), scale, bias, n, name);
  const int64_t M = c.M, K = c.K, nblk = c.nblk;
  const float* sptr = data_or_null(scale);
  const float* bptr = data_or_null(bias);
  at::Tensor y = at::empty({M, n}, x.options());
  if (M == 0) return y;
  const float* xp = c.x.data_ptr<float>();
  const int64_t ldx = c.x.stride(0);
  const W* wp = packed.data_ptr<W>();
  float* yp = y.data_ptr<float>();
  auto at_block = [&](const float* v, int64_t b) { return v ? v + b * NB : nullptr; };
  at::parallel_for(0, nblk, 1, [&](int64_t b0, int64_t b1) {
    int64_t b = b0;
    if (!has_avx512()) {
      for (; b < b1; ++b)
        block_rows_generic<W>(xp, ldx, M, wp + b * K * NB, K, at_block(sptr, b), at_block(bptr, b), yp + b * NB, n,
                              std::min(NB, n - b * NB));
      return;
    }
    // Several blocks at a time: more read streams, more sums in flight (measured on SmolLM2's and
    // the bundled target's shapes: one row 4-8% faster with four streams than with two on Intel,
    // slower on AMD: four_streams; two streams for 2-3 rows; 4+ rows gain nothing from a second).
    if (M == 1 && four_streams())
      for (; b + 3 < b1; b += 4)
        run_rows<W, 4>(xp, ldx, M, wp + b * K * NB, K, at_block(sptr, b), at_block(bptr, b), yp + b * NB, n,
                       std::min(4 * NB, n - b * NB));
    if (M <= 3)
      for (; b + 1 < b1; b += 2)
        run_rows<W, 2>(xp, ldx, M, wp + b * K * NB, K, at_block(sptr, b), at_block(bptr, b), yp + b * NB, n,
                       std::min(2 * NB, n - b * NB));
    for (; b < b1; ++b)
      run_rows<W, 1>(xp, ldx, M, wp + b * K * NB, K, at_block(sptr, b), at_block(bptr, b), yp + b * NB, n,
                     std::min(NB, n - b * NB));
  });
  return y;
}

at::Tensor blocked_mm(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                      int64_t n) {
  TORCH_CHECK(packed.scalar_type() == at::kFloat, "blocked_mm: packed must be float32");
  return run<float>(x, packed, c10::nullopt, bias, n, "blocked_mm");
}

at::Tensor blocked_mm_int8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                           const c10::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(packed.scalar_type() == at::kChar, "blocked_mm_int8: packed must be int8");
  return run<int8_t>(x, packed, scale, bias, n, "blocked_mm_int8");
}

at::Tensor blocked_mm_int4(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                           int64_t n) {
  const char* name = "blocked_mm_int4";
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.size(2) == QGB, name,
              ": packed must be a uint8 (N/64, K/32, ", QGB, ") tensor");
  const Checked c = check(x, packed, packed.size(1) * QG, c10::nullopt, bias, n, name);
  const int64_t M = c.M, G = packed.size(1), nblk = c.nblk;
  const float* bptr = data_or_null(bias);
  at::Tensor y = at::empty({M, n}, x.options());
  if (M == 0) return y;
  const float* xp = c.x.data_ptr<float>();
  const int64_t ldx = c.x.stride(0);
  // X_g: each row's sum over each group of inputs, in input order (shared by every block)
  at::Tensor xsum = at::empty({M, G}, x.options());
  float* xs = xsum.data_ptr<float>();
  for (int64_t r = 0; r < M; ++r)
    for (int64_t g = 0; g < G; ++g) {
      float t = 0.f;
      for (int64_t k = 0; k < QG; ++k) t += xp[r * ldx + g * QG + k];
      xs[r * G + g] = t;
    }
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t stride = G * QGB;  // bytes per block
  at::parallel_for(0, nblk, 1, [&](int64_t b0, int64_t b1) {
    int64_t b = b0;
    if (!has_avx512()) {
      for (; b < b1; ++b)
        block_rows_q4_generic(xp, ldx, M, xs, G, wp + b * stride, bptr ? bptr + b * NB : nullptr, yp + b * NB, n,
                              std::min(NB, n - b * NB));
      return;
    }
    if (M == 1 && four_streams())
      for (; b + 3 < b1; b += 4)
        run_rows_q4<4>(xp, ldx, M, xs, G, wp + b * stride, bptr ? bptr + b * NB : nullptr, yp + b * NB, n,
                       std::min(4 * NB, n - b * NB));
    if (M <= 3)
      for (; b + 1 < b1; b += 2)
        run_rows_q4<2>(xp, ldx, M, xs, G, wp + b * stride, bptr ? bptr + b * NB : nullptr, yp + b * NB, n,
                       std::min(2 * NB, n - b * NB));
    for (; b < b1; ++b)
      run_rows_q4<1>(xp, ldx, M, xs, G, wp + b * stride, bptr ? bptr + b * NB : nullptr, yp + b * NB, n,
                     std::min(NB, n - b * NB));
  });
  return y;
}


// ---- Attention over the cache for a few query rows (decode and verify steps) -----------------
// out (B, H, T, D) = softmax(q k^T * scale, keys where mask is true) v, per head; query head h
// reads kv head h / (H / H_kv) (grouped-query attention). q (B, H, T, D), k and v (B, H_kv, L, D)
// (views of the cache: any strides but the last), mask (B or 1, 1, T, L) bool. The result has
// the memory order (B, T, H, D), so the output projection reads it without a copy.
//
// Why: PyTorch's CPU flash attention runs a one-query step as BLAS calls of one row over 512-key
// blocks, reading the cache at 8-16 GB/s on this machine's 2 GHz cores; here each kv head's keys
// and values are read once for up to RC query rows: one query row 0.46-0.63x PyTorch's time, 12
// rows 0.75-0.95x (benchmarks/results/attention_cpu.json).
//
// Numerics, per query row: the score of key j is the FMA sum over d in vector order, then one
// fixed reduction, times nothing (q is scaled first); the softmax's max, exponentials (a
// polynomial, within 2 ulp) and sum, and the weighted sum of v run in key order. A row's result
// depends on its own query, its mask row and the keys only, however the rows are grouped and on
// any thread count (row-invariant): a verify step attends for a token as a decode step does.
// More than ATTEND_ROWS query rows (a prefill, a large token tree) go to PyTorch's attention: from
// about 12 rows on its blocked matmuls do the scores faster than one pass per 4 rows here
// (benchmarks/results/attention_cpu.json); chains of up to 11 drafts stay row-invariant.
constexpr int64_t ATTEND_ROWS = 12;
constexpr int RC = 4;  // query rows per pass over a kv head's keys

// exp(x) for x <= 0: 2^n p(r), x = n ln2 + r (ln2 split in two for an exact n ln2), |r| <= ln2/2,
// p a degree-7 polynomial (Cephes' expf coefficients).
__attribute__((target("avx512f"))) inline __m512 exp_nonpos(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// (a0 ... a15) -> the vector of their lane sums (lane u: the sum of a_u's 16 lanes), by one
// fixed tree of adds: within 128-bit quarters (unpack, then shuffle), then across quarters.
__attribute__((target("avx512f"))) inline __m512 sum16(const __m512* a) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)  // quarter q of t_i: [a(2i)0+a(2i)2, a(2i+1)0+a(2i+1)2, a(2i)1+a(2i)3, a(2i+1)1+a(2i+1)3]
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // quarter q of u_i: keys 4i .. 4i+3, each summed over that quarter
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44), _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
  const __m512 x01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x44), _mm512_shuffle_f32x4(u[0], u[1], 0xEE));
  const __m512 x23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x44), _mm512_shuffle_f32x4(u[2], u[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, 0x88), _mm512_shuffle_f32x4(x01, x23, 0xDD));
}

struct AttendArgs {
  const float* q;
  int64_t qs0, qs1, qs2;  // strides of q (B, H, T, D)
  const float *k, *v;
  int64_t ks0, ks1, ks2, vs0, vs1, vs2;
  const bool* mask;
  int64_t ms0, ms2, ms3;  // strides of mask (B, 1, T, L); 0 where broadcast
  float* out;             // (B, T, H, D) contiguous
  int64_t H, T, D, G, L;
  float scale;
};

// out_r = inv_r * sum_j p_r[j] v_j over keys [0, last), for R rows and CW vectors of 16 outputs
// (compile-time, so the R x CW sums stay in registers), in key order.
template <int R, int CW>
__attribute__((target("avx512f"))) void attend_pv(const float* vb, int64_t vs, const float* p, int64_t ldp,
                                                  int64_t last, const float* inv, float* const* out) {
  __m512 acc[R][CW];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CW; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < last; ++j) {
    __m512 vv[CW];
    for (int c = 0; c < CW; ++c) vv[c] = _mm512_loadu_ps(vb + j * vs + 16 * c);
    for (int r = 0; r < R; ++r) {
      const __m512 w = _mm512_set1_ps(p[r * ldp + j]);
      for (int c = 0; c < CW; ++c) acc[r][c] = _mm512_fmadd_ps(w, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CW; ++c) _mm512_storeu_ps(out[r] + 16 * c, _mm512_mul_ps(acc[r][c], _mm512_set1_ps(inv[r])));
}

template <int R>
void attend_pv_rows(int cw, const float* vb, int64_t vs, const float* p, int64_t ldp, int64_t last, const float* inv,
                    float* const* out) {
  switch (cw) {
    case 1: return attend_pv<R, 1>(vb, vs, p, ldp, last, inv, out);
    case 2: return attend_pv<R, 2>(vb, vs, p, ldp, last, inv, out);
    case 3: return attend_pv<R, 3>(vb, vs, p, ldp, last, inv, out);
    default: return attend_pv<R, 4>(vb, vs, p, ldp, last, inv, out);
  }
}

void attend_pv_dispatch(int rc, int cw, const float* vb, int64_t vs, const float* p, int64_t ldp, int64_t last,
                        const float* inv, float* const* out) {
  switch (rc) {
    case 1: return attend_pv_rows<1>(cw, vb, vs, p, ldp, last, inv, out);
    case 2: return attend_pv_rows<2>(cw, vb, vs, p, ldp, last, inv, out);
    case 3: return attend_pv_rows<3>(cw, vb, vs, p, ldp, last, inv, out);
    default: return attend_pv_rows<4>(cw, vb, vs, p, ldp, last, inv, out);
  }
}

// Query rows [i0, i0 + rc) of kv head hk of batch row b; row i is query head hk * G + i / T at
// query position i % T.
__attribute__((target("avx512f"))) void attend_rows(const AttendArgs& a, int64_t b, int64_t hk, int64_t i0, int rc,
                                                    std::vector<float>& buf) {
  const int64_t D = a.D, L = a.L, T = a.T;
  const int64_t nv = D / 16;
  const int64_t Lp = (L + 15) / 16 * 16;
  buf.resize(RC * (D + Lp));
  float* qs = buf.data();          // RC x D: the scaled queries
  float* s = buf.data() + RC * D;  // RC x Lp: scores, then weights
  const bool* mrow[RC];
  int64_t last = 0;  // keys [0, last) hold every key a row of this pass sees
  for (int r = 0; r < rc; ++r) {
    const int64_t i = i0 + r, h = hk * a.G + i / T, t = i % T;
    const float* qp = a.q + b * a.qs0 + h * a.qs1 + t * a.qs2;
    for (int64_t d = 0; d < D; ++d) qs[r * D + d] = qp[d] * a.scale;
    mrow[r] = a.mask + b * a.ms0 + t * a.ms2;
    int64_t j = L;
    while (j > last && !mrow[r][(j - 1) * a.ms3]) --j;
    last = std::max(last, j);
  }
  const float* kb = a.k + b * a.ks0 + hk * a.ks1;
  const float* vb = a.v + b * a.vs0 + hk * a.vs1;
  const float ninf = -std::numeric_limits<float>::infinity();
  // Scores 16 keys at a time: per key, D/16 FMAs into one vector of partial sums; then the 16
  // vectors are summed across lanes together (sum16): ~3 instructions a key instead of ~9.
  // Keys past `last` in the final group read key 0 again (always present) and are dropped.
  for (int64_t j0 = 0; j0 < last; j0 += 16) {
    const float* kj[16];
    for (int u = 0; u < 16; ++u) kj[u] = kb + (j0 + u < last ? j0 + u : 0) * a.ks2;
    for (int r = 0; r < rc; ++r) {
      const float* qr = qs + r * D;
      __m512 acc[16];
      const __m512 q0 = _mm512_loadu_ps(qr);
#pragma GCC unroll 16
      for (int u = 0; u < 16; ++u) acc[u] = _mm512_mul_ps(q0, _mm512_loadu_ps(kj[u]));
      for (int64_t c = 1; c < nv; ++c) {
        const __m512 qc = _mm512_loadu_ps(qr + 16 * c);
#pragma GCC unroll 16
        for (int u = 0; u < 16; ++u) acc[u] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(kj[u] + 16 * c), acc[u]);
      }
      __m512 sc = sum16(acc);
      __mmask16 seen = 0;
      if (a.ms3 == 1 && j0 + 16 <= last) {  // 16 mask bytes (0 or 1) to 16 bits
        const __m128i m8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(mrow[r] + j0));
        seen = (__mmask16)_mm512_test_epi32_mask(_mm512_cvtepu8_epi32(m8), _mm512_cvtepu8_epi32(m8));
      } else {
        for (int u = 0; u < 16; ++u)
          if (j0 + u < last && mrow[r][(j0 + u) * a.ms3]) seen |= (__mmask16)(1u << u);
      }
      _mm512_storeu_ps(s + r * Lp + j0, _mm512_mask_mov_ps(_mm512_set1_ps(ninf), seen, sc));
    }
  }
  float inv[RC];
  for (int r = 0; r < rc; ++r) {
    float* sr = s + r * Lp;
    for (int64_t j = last; j < Lp; ++j) sr[j] = ninf;
    __m512 mx = _mm512_set1_ps(ninf);
    for (int64_t j = 0; j < last; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sr + j));
    const float m = _mm512_reduce_max_ps(mx);
    __m512 sum = _mm512_setzero_ps();
    const __m512 mv = _mm512_set1_ps(m == ninf ? 0.f : m);
    for (int64_t j = 0; j < last; j += 16) {
      const __m512 x = _mm512_loadu_ps(sr + j);
      const __m512 p = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(ninf), _CMP_NEQ_OQ),
                                           exp_nonpos(_mm512_sub_ps(x, mv)));
      _mm512_storeu_ps(sr + j, p);
      sum = _mm512_add_ps(sum, p);
    }
    const float l = _mm512_reduce_add_ps(sum);
    inv[r] = l > 0.f ? 1.f / l : 0.f;  // a row that sees no key gets zeros
  }
  for (int64_t c0 = 0; c0 < nv; c0 += 4) {  // 64 outputs at a time: rc x 4 sums in registers
    const int cw = (int)std::min<int64_t>(4, nv - c0);
    float* o[RC];
    for (int r = 0; r < rc; ++r) {
      const int64_t i = i0 + r;
      o[r] = a.out + ((b * T + i % T) * a.H + hk * a.G + i / T) * D + 16 * c0;
    }
    attend_pv_dispatch(rc, cw, vb + 16 * c0, a.vs2, s, Lp, last, inv, o);
  }
}

at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                  double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && mask.dim() == 4,
              "attend: q, k, v and mask must be 4-D");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), L = k.size(2);
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && v.size(1) == Hkv && v.size(2) == L && k.size(3) == D &&
                  v.size(3) == D && Hkv > 0 && H % Hkv == 0,
              "attend: q ", q.sizes(), ", k ", k.sizes(), " and v ", v.sizes(), " do not match");
  TORCH_CHECK((mask.size(0) == B || mask.size(0) == 1) && mask.size(1) == 1 && mask.size(2) == T &&
                  mask.size(3) == L && mask.scalar_type() == at::kBool,
              "attend: the mask must be bool (B, 1, T, L)");
  at::Tensor out = at::empty({B, T, H, D}, q.options());
  const bool ours = has_avx512() && q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
                    v.scalar_type() == at::kFloat && D % 16 == 0 && T <= ATTEND_ROWS && L > 0;
  if (!ours) {  // a prefill, another dtype or CPU: PyTorch's attention
    out.transpose(1, 2).copy_(at::scaled_dot_product_attention(q, k, v, mask, 0.0, false, scale, Hkv != H));
    return out.transpose(1, 2);
  }
  const at::Tensor qc = q.stride(3) == 1 ? q : q.contiguous();
  const at::Tensor kc = k.stride(3) == 1 ? k : k.contiguous();
  const at::Tensor vc = v.stride(3) == 1 ? v : v.contiguous();
  AttendArgs a{qc.data_ptr<float>(), qc.stride(0), qc.stride(1), qc.stride(2),
               kc.data_ptr<float>(), vc.data_ptr<float>(), kc.stride(0), kc.stride(1), kc.stride(2),
               vc.stride(0), vc.stride(1), vc.stride(2), mask.data_ptr<bool>(),
               mask.size(0) == 1 ? 0 : mask.stride(0), mask.stride(2), mask.stride(3),
               out.data_ptr<float>(), H, T, D, H / Hkv, L, (float)scale};
  // Tasks: (batch row, kv head, chunk of RC query rows). (Smaller chunks to even out 3 kv heads
  // over 2 threads were measured slower: each extra chunk reads its head's keys again, and the
  // reads are the cost; splitting the keys instead is the way to balance such a step.)
  const int64_t rows = a.G * T;
  const int rc = RC;
  const int64_t chunks = (rows + rc - 1) / rc;
  at::parallel_for(0, B * Hkv * chunks, 1, [&](int64_t t0, int64_t t1) {
    thread_local std::vector<float> buf;
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t c = task % chunks, bh = task / chunks;
      const int64_t i0 = c * rc;
      attend_rows(a, bh / Hkv, bh % Hkv, i0, (int)std::min<int64_t>(rc, rows - i0), buf);
    }
  });
  return out.transpose(1, 2);
}

}  // namespace

// C entry points for AOTInductor packages (quickdraft.aot): a package calls these directly, where
// it would otherwise reach the op through its proxy executor (boxing the arguments at each call:
// ~20 us, a tenth of a small layer's matmul). The AOTI calling convention: tensors by handle (an
// at::Tensor*), an optional tensor as a pointer to a handle (null: None), the result as a new
// handle, 0 for success. Declared with plain pointers so no AOTI header is needed to build this.
namespace {
template <typename F>
int32_t shim_call(F&& f) {
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    TORCH_WARN("quickdraft kernel: ", e.what());
    return 1;
  }
}
c10::optional<at::Tensor> opt(void** handle) {
  return handle && *handle ? c10::optional<at::Tensor>(*static_cast<at::Tensor*>(*handle)) : c10::nullopt;
}
}  // namespace

extern "C" __attribute__((visibility("default"))) int32_t aoti_torch_cpu_blocked_mm(void* x, void* packed, void** bias,
                                                                                    int64_t n, void** ret0) {
  return shim_call([&] {
    *ret0 = new at::Tensor(
        blocked_mm(*static_cast<at::Tensor*>(x), *static_cast<at::Tensor*>(packed), opt(bias), n));
  });
}

extern "C" __attribute__((visibility("default"))) int32_t aoti_torch_cpu_blocked_mm_int8(void* x, void* packed,
                                                                                         void* scale, void** bias,
                                                                                         int64_t n, void** ret0) {
  return shim_call([&] {
    *ret0 = new at::Tensor(blocked_mm_int8(*static_cast<at::Tensor*>(x), *static_cast<at::Tensor*>(packed),
                                           *static_cast<at::Tensor*>(scale), opt(bias), n));
  });
}

extern "C" __attribute__((visibility("default"))) int32_t aoti_torch_cpu_blocked_mm_int4(void* x, void* packed,
                                                                                         void** bias, int64_t n,
                                                                                         void** ret0) {
  return shim_call([&] {
    *ret0 = new at::Tensor(blocked_mm_int4(*static_cast<at::Tensor*>(x), *static_cast<at::Tensor*>(packed), opt(bias), n));
  });
}

extern "C" __attribute__((visibility("default"))) int32_t aoti_torch_cpu_attend(void* q, void* k, void* v, void* mask,
                                                                                double scale, void** ret0) {
  return shim_call([&] {
    *ret0 = new at::Tensor(attend(*static_cast<at::Tensor*>(q), *static_cast<at::Tensor*>(k),
                                  *static_cast<at::Tensor*>(v), *static_cast<at::Tensor*>(mask), scale));
  });
}

TORCH_LIBRARY(quickdraft, m) {
  m.def("blocked_mm(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
  m.def("blocked_mm_int8(Tensor x, Tensor packed, Tensor scale, Tensor? bias, int n) -> Tensor");
  m.def("blocked_mm_int4(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
  m.def("attend(Tensor q, Tensor k, Tensor v, Tensor mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(quickdraft, CPU, m) {
  m.impl("blocked_mm", &blocked_mm);
  m.impl("blocked_mm_int8", &blocked_mm_int8);
  m.impl("blocked_mm_int4", &blocked_mm_int4);
  m.impl("attend", &attend);
}
