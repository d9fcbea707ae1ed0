// Small-M float32 matmul for CPU verify steps (quickdraft issue 19).
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

namespace {

constexpr int64_t NB = 64;  // outputs per block: four 16-float vectors
#ifndef PF
#define PF 1024  // floats: 4 KiB ahead of the read
#endif

// MR rows over NBLK adjacent blocks at once (NBLK read streams, MR * 4 * NBLK running sums in
// registers: at most 24 of AVX-512's 32). Prefetching PF floats ahead keeps enough cache-line
// reads in flight for one core to stream at its bandwidth.
template <int MR, int NBLK>
__attribute__((target("avx512f"))) void block_rows(const float* x, int64_t ldx, const float* wb, int64_t K,
                                                   const float* bias, float* y, int64_t ldy, int64_t ncols) {
  constexpr int V = 4 * NBLK;  // vectors per row
  __m512 acc[MR][V];
#pragma GCC unroll 8
  for (int j = 0; j < V; ++j) {
    __m512 b = bias ? _mm512_loadu_ps(bias + 16 * j) : _mm512_setzero_ps();  // the blocks' biases are adjacent
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) acc[r][j] = b;
  }
  for (int64_t k = 0; k < K; ++k) {
    __m512 w[V];
#pragma GCC unroll 8
    for (int c = 0; c < NBLK; ++c) {
      const float* src = wb + c * K * NB + k * NB;
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) {
        _mm_prefetch(reinterpret_cast<const char*>(src + PF + 16 * q), _MM_HINT_T0);
        w[4 * c + q] = _mm512_loadu_ps(src + 16 * q);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      __m512 xv = _mm512_set1_ps(x[r * ldx + k]);
#pragma GCC unroll 8
      for (int j = 0; j < V; ++j) acc[r][j] = _mm512_fmadd_ps(xv, w[j], acc[r][j]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 8
    for (int j = 0; j < V; ++j) {
      int64_t left = ncols - 16 * j;
      if (left >= 16) {
        _mm512_storeu_ps(y + r * ldy + 16 * j, acc[r][j]);
      } else if (left > 0) {
        _mm512_mask_storeu_ps(y + r * ldy + 16 * j, (__mmask16)((1u << left) - 1), acc[r][j]);
      }
    }
  }
}

// Portable path (no AVX-512): the same products in the same order, one row at a time.
void block_rows_generic(const float* x, int64_t ldx, int64_t rows, const float* wb, int64_t K, const float* bias,
                        float* y, int64_t ldy, int64_t ncols) {
  for (int64_t r = 0; r < rows; ++r) {
    float acc[NB];
    for (int64_t n = 0; n < NB; ++n) acc[n] = bias ? bias[n] : 0.f;
    for (int64_t k = 0; k < K; ++k) {
      const float xv = x[r * ldx + k];
      const float* w = wb + k * NB;
      for (int64_t n = 0; n < NB; ++n) acc[n] = std::fma(xv, w[n], acc[n]);
    }
    std::copy(acc, acc + ncols, y + r * ldy);
  }
}

bool has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f");
  return yes;
}

// Rows [0, M) of NBLK adjacent blocks (NBLK = 2: M <= 3 only; NBLK = 1: any M, six rows at a time).
template <int NBLK>
void run_rows(const float* x, int64_t ldx, int64_t M, const float* wb, int64_t K, const float* bias, float* y,
              int64_t ldy, int64_t ncols) {
  int64_t m = 0;
  if (NBLK == 1)
    for (; m + 6 <= M; m += 6) block_rows<6, 1>(x + m * ldx, ldx, wb, K, bias, y + m * ldy, ldy, ncols);
  switch (M - m) {
    case 5: block_rows<5, 1>(x + m * ldx, ldx, wb, K, bias, y + m * ldy, ldy, ncols); break;
    case 4: block_rows<4, 1>(x + m * ldx, ldx, wb, K, bias, y + m * ldy, ldy, ncols); break;
    case 3: block_rows<3, NBLK>(x + m * ldx, ldx, wb, K, bias, y + m * ldy, ldy, ncols); break;
    case 2: block_rows<2, NBLK>(x + m * ldx, ldx, wb, K, bias, y + m * ldy, ldy, ncols); break;
    case 1: block_rows<1, NBLK>(x + m * ldx, ldx, wb, K, bias, y + m * ldy, ldy, ncols); break;
    default: break;
  }
}

at::Tensor blocked_mm(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                      int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "blocked_mm: x must be a 2-D float32 tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == NB && packed.scalar_type() == at::kFloat &&
                  packed.is_contiguous(),
              "blocked_mm: packed must be a contiguous (N/64, K, 64) float32 tensor");
  const int64_t M = x.size(0), K = x.size(1), nblk = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "blocked_mm: x has ", K, " columns, the weight ", packed.size(1), " rows");
  TORCH_CHECK(n > (nblk - 1) * NB && n <= nblk * NB, "blocked_mm: n does not match the packed blocks");
  at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  at::Tensor bpad;
  const float* bptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n && bias->scalar_type() == at::kFloat, "blocked_mm: bias must be (n,) float32");
    bpad = at::zeros({nblk * NB}, x.options());
    bpad.narrow(0, 0, n).copy_(*bias);
    bptr = bpad.data_ptr<float>();
  }
  at::Tensor y = at::empty({M, n}, x.options());
  if (M == 0) return y;
  const float* xp = xc.data_ptr<float>();
  const int64_t ldx = xc.stride(0);
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, nblk, 1, [&](int64_t b0, int64_t b1) {
    int64_t b = b0;
    if (!has_avx512()) {
      for (; b < b1; ++b)
        block_rows_generic(xp, ldx, M, wp + b * K * NB, K, bptr ? bptr + b * NB : nullptr, yp + b * NB, n,
                           std::min(NB, n - b * NB));
      return;
    }
    if (M <= 3)  // two blocks at a time: two read streams (measured: 4+ rows gain nothing from it)
      for (; b + 1 < b1; b += 2)
        run_rows<2>(xp, ldx, M, wp + b * K * NB, K, bptr ? bptr + b * NB : nullptr, yp + b * NB, n,
                    std::min(2 * NB, n - b * NB));
    for (; b < b1; ++b)
      run_rows<1>(xp, ldx, M, wp + b * K * NB, K, bptr ? bptr + b * NB : nullptr, yp + b * NB, n,
                  std::min(NB, n - b * NB));
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(quickdraft, m) { m.def("blocked_mm(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor"); }

TORCH_LIBRARY_IMPL(quickdraft, CPU, m) { m.impl("blocked_mm", &blocked_mm); }
