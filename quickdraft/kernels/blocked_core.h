// quickdraft's CPU kernels without PyTorch: the blocked float32 / bfloat16 / int8 / int4 small-M
// matmuls and the attention over the cache, on every path (portable C++, AVX2 + FMA, AVX-512,
// ARM NEON), and the dispatch table. Included by blocked_mm.cpp (the PyTorch ops) and by
// tests/kernels/neon_harness.cpp (the same kernels, run on an AArch64 build under qemu and
// compared bit for bit with the x86 library). One translation unit per binary includes it (its
// definitions sit in an anonymous namespace).
//
// y (M, N) = x (M, K) @ W + bias, with W stored in column blocks of 64 outputs:
// packed (N/64, K, 64), block j holding W[:, 64j : 64j + 64] row after row (zero-padded past N).
// Each block is read once, contiguously, for all M rows (M <= 16 is the verify case; more rows
// re-read the block from cache), so k + 1 rows stream the same bytes as one row: a GEMV-like
// kernel for every small M, where a BLAS sgemm packs the whole weight again at each call. (On
// AVX2 and AVX-512, 2+ / 4+ rows take a block in 16 KB chunks, every row group's pass over a
// chunk while it is in L1, a later chunk prefetched during those passes (on AMD's AVX2 path
// for float32 from 7 rows only): blocks_avx2.)
// bfloat16 weights use the same layout and are widened in registers (a 16-bit shift: exact), so
// their result is the float32 kernel's on the widened weights, bit for bit, at half the bytes.
//
// Every output element is the bias plus x[m, k] * W[k, n] accumulated with FMAs in k order
// 0..K-1, whatever M, however the rows are grouped and on any thread count (the portable path
// too: std::fma rounds as the instruction does), so a row's result does not depend on the other
// rows: a verify step's matmuls give a token the bits a decode step gives it. (int8 and int4 have
// their own layouts and numerics: their activations are quantised to int8 per group of 32 and
// their sums are exact integer dot products, then one fixed float epilogue per group; see their
// sections.)
//
// Four paths, one result: AVX-512 (16-float vectors), AVX2 + FMA (8-float vectors), NEON (4-float
// vectors, vfmaq_f32) and portable C++ (scalar std::fma). Each output is the same chain of FMAs in
// the same k order on every path, and the attention's reductions follow one fixed order (written
// out below), so a row has the same bits on every path too. Build with -ffp-contract=off (the
// compiler must not fuse a separate multiply and add anywhere). The path is chosen when the
// library loads: the best the CPU has, or the one QUICKDRAFT_ISA names (checked by
// quickdraft/kernels/__init__.py, which calls quickdraft_set_isa); the dispatch is in one place, PATHS.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#define QD_X86 1
#include <cpuid.h>
#include <immintrin.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#else
#define QD_X86 0
#endif
#if defined(__aarch64__)
#define QD_ARM 1
#include <arm_neon.h>
#if defined(__linux__)
#include <sys/auxv.h>
#endif
#else
#define QD_ARM 0
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>
#include <type_traits>

namespace {

// ---- instruction sets ----
enum Isa : int { ISA_PORTABLE = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_NEON = 3 };
constexpr int ISA_COUNT = 4;

bool cpu_has(int isa) {
  switch (isa) {
    case ISA_PORTABLE: return true;
#if QD_X86
    case ISA_AVX2:
      __builtin_cpu_init();  // (may run before libgcc's own constructor)
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case ISA_AVX512: __builtin_cpu_init(); return __builtin_cpu_supports("avx512f");
#endif
#if QD_ARM
    case ISA_NEON: return true;  // Advanced SIMD, fused multiply-add included, is part of every AArch64 CPU
#endif
    default: return false;
  }
}

int best_isa() {
  if (cpu_has(ISA_NEON)) return ISA_NEON;
  return cpu_has(ISA_AVX512) ? ISA_AVX512 : cpu_has(ISA_AVX2) ? ISA_AVX2 : ISA_PORTABLE;
}

// The path the kernels take; read once per call (all threads of a call take the same path).
std::atomic<int> chosen_isa{best_isa()};

constexpr int64_t NB = 64;  // outputs per block: four 16-float vectors

// A bfloat16 weight: the top 16 bits of a float32, so widening it is a shift (exact).
struct Bf16 {
  uint16_t bits;
};
struct F16 {  // IEEE binary16 (a 16-bit KV cache: attend)
  uint16_t bits;
};
inline float to_float(float w) { return w; }
inline float to_float(Bf16 w) {
  const uint32_t u = uint32_t(w.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
#ifndef PF
#define PF 4096  // bytes ahead of the read
#endif

#if QD_X86
// How far ahead (bytes) the x86 kernels prefetch a weight stream in software, 0 for not at all.
// On Intel, PF. On an AMD EPYC (Zen 4) the hardware prefetchers alone streamed faster, every
// format: the same matmuls over SmolLM2-1.7B's layer shapes from DRAM, one row, in one process
// with the two settings alternating (10 rounds), took 0.61x the time without software prefetch
// (AVX-512 int4), int8 0.83x, float32 0.78x, bfloat16 0.87x at 1 thread; int4 0.79x, float32 0.93x,
// int8 0.96x at 2 threads; six rows 0.80-1.01x; AVX2 0.79-0.98x. Prefetches change no result.
// QUICKDRAFT_PREFETCH (bytes, 0: none) overrides the choice (read once; benchmarks compare them).
int prefetch_ahead() {
  static const int n = [] {
    const char* env = std::getenv("QUICKDRAFT_PREFETCH");
    if (env && *env) return std::max(0, std::atoi(env)) & ~63;
    return __builtin_cpu_is("amd") ? 0 : PF;
  }();
  return n;
}

// The lanes of a 16-float vector below `left` outputs (all of them from 16 on, none at 0 or less).
inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
}

// Sixteen weights of a block row as floats: float32 as stored; bfloat16 widened exactly.
__attribute__((target("avx512f"))) inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
__attribute__((target("avx512f"))) inline __m512 load16(const Bf16* p) {
  const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
}
__attribute__((target("avx512f"))) inline __m512 load16(const F16* p) {  // (a 16-bit cache's keys and values)
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// MR rows over NBLK adjacent blocks at once (NBLK read streams, MR * 4 * NBLK running sums in
// registers: at most 24 of AVX-512's 32). Prefetching PF bytes ahead keeps enough cache-line
// reads in flight for one core to stream at its bandwidth.
// y = bias + sum_k x w (the sums start from the bias).
template <typename W, int MR, int NBLK>
__attribute__((target("avx512f"))) void block_rows(const float* x, int64_t ldx, const W* wb, int64_t K,
                                                   const float* bias, float* y, int64_t ldy, int64_t ncols) {
  const int pf = prefetch_ahead();  // (0 on AMD: the hardware's prefetchers alone)
  constexpr int V = 4 * NBLK;  // vectors per row
  __m512 acc[MR][V];
#pragma GCC unroll 8
  for (int j = 0; j < V; ++j) {
    // (adjacent blocks' biases are adjacent; masked: the last block may be partial)
    __m512 b = bias ? _mm512_maskz_loadu_ps(tail_mask(ncols - 16 * j), bias + 16 * j) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) acc[r][j] = b;
  }
  for (int64_t k = 0; k < K; ++k) {
    __m512 w[V];
#pragma GCC unroll 8
    for (int c = 0; c < NBLK; ++c) {
      const W* src = wb + c * K * NB + k * NB;
      if (pf) {
        const char* ahead = reinterpret_cast<const char*>(src) + pf;
#pragma GCC unroll 4
        for (int line = 0; line < int(NB * sizeof(W)); line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
      }
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
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(y + r * ldy + 16 * j, mask, acc[r][j]);
  }
}

#endif  // QD_X86

// Portable path (no AVX-512): the same products in the same order, one row at a time.
template <typename W>
void block_rows_generic(const float* x, int64_t ldx, int64_t rows, const W* wb, int64_t K, const float* bias, float* y,
                        int64_t ldy, int64_t ncols) {
  for (int64_t r = 0; r < rows; ++r) {
    float acc[NB];
    for (int64_t n = 0; n < NB; ++n) acc[n] = (bias && n < ncols) ? bias[n] : 0.f;
    for (int64_t k = 0; k < K; ++k) {
      const float xv = x[r * ldx + k];
      const W* w = wb + k * NB;
      for (int64_t n = 0; n < NB; ++n) acc[n] = std::fma(xv, to_float(w[n]), acc[n]);
    }
    for (int64_t n = 0; n < ncols; ++n) y[r * ldy + n] = acc[n];
  }
}

#if QD_X86
// One row reads four blocks at once (four streams) on Intel: 4-8% faster than two there (the
// Emerald Rapids Xeon, SmolLM2's and the bundled target's shapes). On an AMD EPYC (Zen 4) one
// row took 30-50% longer with four streams than two rows with two (SmolLM2's 576 x 49152
// lm_head 4489 vs 2942 us, 1 thread), and with the weights on 2 MiB pages (kernels.
// weights_memory) one stream beat two: SmolLM2 float32 decoding 8-11% faster, 1 thread, 3
// alternating pairs, the same as the AVX2 path's one stream. So on AMD the float32 and bfloat16
// kernels give one row one stream, and the int8 and int4 kernels one stream to one to three rows
// (two blocks at a time streamed from DRAM at half the speed there: SmolLM2-1.7B's shape, int4,
// its 2048 x 49152 lm_head 4.2-4.6 ms per row against 2.0-2.3 ms, 1, 2 and 3 rows alike, and a
// whole eager step 88-98 ms against 57-61 ms; int8 4.1-4.5 against 3.4-3.7 ms, the step 98-109
// against 85-88 ms; Zen 4, 1 thread). Either way the same FMAs or integer sums in the same order
// per output: the bits do not change.
// QUICKDRAFT_ROW_STREAMS (1, 2 or 4) overrides the choice (read once; benchmarks compare them).
int row_streams() {
  static const int n = [] {
    const char* env = std::getenv("QUICKDRAFT_ROW_STREAMS");
    const int asked = env ? std::atoi(env) : 0;
    if (asked == 1 || asked == 2 || asked == 4) return asked;
    return __builtin_cpu_is("amd") ? 1 : 4;
  }();
  return n;
}
bool four_streams() { return row_streams() == 4; }
// Adjacent blocks the AVX2 int4 (else int8) kernel reads at once for a call of M rows (group after
// group, each block's group in turn): int4 row_streams() for one row and at most two for 2-5 rows,
// int8 at most two for 2-6 rows, else one. On an Intel Xeon with AMX (AVX2 forced, 1 thread,
// alternating trees, whole eager steps), against one block at a time: SmolLM2-1.7B's shape in int4
// 0.87x the time at one row, 0.79x at two, 0.83x at four, 0.86x at five, 0.96x at six (SmolLM2's,
// from L3, 1.00x at five but 1.07x at six: six keep one); in int8 0.84x at two, 0.83x at four,
// 0.87x at six rows (SmolLM2 0.92-0.97x), one row 1.03x (keeps one)
// (benchmarks/results/avx2_streams_xeon_amx_cpu.md). AMD keeps one (row_streams(): one stream
// from DRAM ran fastest there).
int64_t avx2_streams(int64_t M, bool int4) {
  if (int4) return M == 1 ? row_streams() : M <= 5 ? std::min(2, row_streams()) : 1;
  return M >= 2 && M <= 6 ? std::min(2, row_streams()) : 1;
}

// QUICKDRAFT_HALVES (0 or 1, read once; else -1): the int8 and int4 kernels' halves (below) off or on
// on any CPU, for tests and benchmarks (the bits are the same).
int halves_env() {
  static const int n = [] {
    const char* env = std::getenv("QUICKDRAFT_HALVES");
    return env && (env[0] == '0' || env[0] == '1') && env[1] == 0 ? env[0] - '0' : -1;
  }();
  return n;
}
// The fewest rows of an AVX-512 int8 call that run a block's two halves one after the other
// (block_rows_q8_halves: every sum in registers, the next block streamed evenly over both passes),
// up to six at a time; 0 for none. Five on AMD, where four rows in halves were slower than one pass;
// four on Intel, where four to six took 0.70-0.90x its time (an Intel Xeon, SmolLM2-1.7B's layer
// matrices from DRAM, 1 thread; K = 8192's about the same either way). QUICKDRAFT_HALVES=1: four.
int q8_halves_from() {
  static const int n = halves_env() == 0 ? 0 : halves_env() == 1 || !__builtin_cpu_is("amd") ? 4 : 5;
  return n;
}
// int4's groups of 4-6 rows of a call of M rows of a matrix of G groups in halves
// (block_rows_q4_halves): where the kernels read one stream (AMD), on Intel for verify-sized calls
// (M <= 12) where G <= Q4_HALVES_INTEL_G, or as QUICKDRAFT_HALVES says.
// On an Intel Xeon (Sapphire Rapids class with AMX, 1 thread, SmolLM2-1.7B's matrices from DRAM)
// the halves took 0.83-0.92x one pass's time at 4-6 rows for K = 2048 (G = 64: qkv, o, gate_up,
// lm_head) but 1.13-1.18x for K = 8192 (down, G = 256: a 320 KB block), and for SmolLM2's K = 576
// and 1,536 (G = 18, 48; five and six rows) 0.84-1.04x; the 1.7B shape's whole steps 0.94-0.95x at
// four and six rows (benchmarks/results/verify_steps_int4_halves_xeon_amx_cpu.md).
constexpr int64_t Q4_HALVES_INTEL_G = 64;
bool q4_halves(int64_t M, int64_t G) {
  return halves_env() >= 0 ? halves_env() == 1 : row_streams() == 1 || (M <= 12 && G <= Q4_HALVES_INTEL_G);
}

// Rows [0, M) of NBLK adjacent blocks (NBLK = 4: M = 1 only; NBLK = 2: M <= 3 only; NBLK = 1: any
// M, six rows at a time; blocks_avx512 sends 4+ rows to chunked_avx512 instead, but 4-6 float32 rows
// and 4-5 bfloat16 rows on AMD). Only the combinations that fit the registers are instantiated.
template <typename W, int NBLK>
void run_rows(const float* x, int64_t ldx, int64_t M, const W* wb, int64_t K, const float* bias, float* y, int64_t ldy,
              int64_t ncols) {
  int64_t m = 0;
  if (NBLK == 1)
    for (; m + 6 <= M; m += 6) block_rows<W, 6, 1>(x + m * ldx, ldx, wb, K, bias, y + m * ldy, ldy, ncols);
  const float* xm = x + m * ldx;
  float* ym = y + m * ldy;
  if (NBLK == 4) {
    block_rows<W, 1, NBLK>(xm, ldx, wb, K, bias, ym, ldy, ncols);
    return;
  }
  constexpr int N2 = NBLK == 4 ? 1 : NBLK;  // (never 4 below: keeps the unused instances small)
  switch (M - m) {
    case 5: block_rows<W, 5, 1>(xm, ldx, wb, K, bias, ym, ldy, ncols); break;
    case 4: block_rows<W, 4, 1>(xm, ldx, wb, K, bias, ym, ldy, ncols); break;
    case 3: block_rows<W, 3, N2>(xm, ldx, wb, K, bias, ym, ldy, ncols); break;
    case 2: block_rows<W, 2, N2>(xm, ldx, wb, K, bias, ym, ldy, ncols); break;
    case 1: block_rows<W, 1, N2>(xm, ldx, wb, K, bias, ym, ldy, ncols); break;
    default: break;
  }
}

// ---- AVX2 + FMA: 8-float vectors, 16 registers ----

// Lanes [0, left) of an 8-float vector as a maskload / maskstore mask.
__attribute__((target("avx2,fma"))) inline __m256i lanes_below(int64_t left) {
  const int l = left >= 8 ? 8 : left <= 0 ? 0 : (int)left;
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(l), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// Eight weights of a block row as floats (bfloat16 widened exactly).
__attribute__((target("avx2,fma"))) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2,fma"))) inline __m256 load8(const Bf16* p) {
  const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8(const F16* p) {  // (a 16-bit cache's keys and values)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Eight floats at p, of which `left` are real (the rest neither read nor written). Whole vectors
// take plain loads and stores: AMD's masked stores cost several times a store.
__attribute__((target("avx2,fma"))) inline __m256 load_left(const float* p, int64_t left) {
  return left >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lanes_below(left));
}
__attribute__((target("avx2,fma"))) inline void store_left(float* p, __m256 v, int64_t left) {
  if (left >= 8)
    _mm256_storeu_ps(p, v);
  else
    _mm256_maskstore_ps(p, lanes_below(left), v);
}

// One input k of MR rows x 8V outputs (src: the block row's first of those outputs): acc[r][j] +=
// x[r][k] * w[8j ..], one FMA per row and vector, in the same order on every caller (so the same bits).
// MR * V sums + MR broadcasts + a weight vector fit the 16 registers, else the V weight vectors are
// kept and the broadcasts made one at a time.
template <typename W, int MR, int V>
__attribute__((target("avx2,fma"), always_inline)) inline void fma_rows_avx2(const float* x, int64_t ldx, int64_t k,
                                                                             const W* src, __m256 (&acc)[MR][V]) {
  if constexpr (MR * V + MR + 1 <= 16) {  // the rows' broadcasts kept, one weight vector at a time
    __m256 xv[MR];
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) xv[r] = _mm256_set1_ps(x[r * ldx + k]);
#pragma GCC unroll 8
    for (int j = 0; j < V; ++j) {
      const __m256 w = load8(src + 8 * j);
#pragma GCC unroll 6
      for (int r = 0; r < MR; ++r) acc[r][j] = _mm256_fmadd_ps(xv[r], w, acc[r][j]);
    }
  } else {  // the V weight vectors kept (widened once for all MR rows), one broadcast at a time
    __m256 w[V];
#pragma GCC unroll 8
    for (int j = 0; j < V; ++j) w[j] = load8(src + 8 * j);
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      const __m256 xv = _mm256_set1_ps(x[r * ldx + k]);
#pragma GCC unroll 8
      for (int j = 0; j < V; ++j) acc[r][j] = _mm256_fmadd_ps(xv, w[j], acc[r][j]);
    }
  }
}

// MR rows x outputs [c0, c0 + 8V) of one block (the block's first `ncols` outputs are real): the
// same sums as block_rows, 8 outputs a vector. MR * V sums + MR broadcasts + a weight vector fit
// the 16 registers for (MR, V) = (1, 8), (3, 4), (2, 4).
template <typename W, int MR, int V>
__attribute__((target("avx2,fma"))) void block_rows_avx2(const float* x, int64_t ldx, const W* wb, int64_t K,
                                                         int64_t c0, const float* bias, float* y, int64_t ldy,
                                                         int64_t ncols, bool prefetch) {
  const int pf = prefetch_ahead();  // (0 on AMD: the hardware's prefetchers alone)
  __m256 acc[MR][V];
#pragma GCC unroll 8
  for (int j = 0; j < V; ++j) {
    const int64_t o = c0 + 8 * j;
    const __m256 b = bias ? load_left(bias + o, ncols - o) : _mm256_setzero_ps();
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) acc[r][j] = b;
  }
  for (int64_t k = 0; k < K; ++k) {
    const W* src = wb + k * NB + c0;
    if (prefetch && pf) {  // the whole block row (the first of the calls that share it)
      const char* ahead = reinterpret_cast<const char*>(wb + k * NB) + pf;
#pragma GCC unroll 4
      for (int line = 0; line < int(NB * sizeof(W)); line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    }
    fma_rows_avx2<W, MR, V>(x, ldx, k, src, acc);
  }
#pragma GCC unroll 8
  for (int j = 0; j < V; ++j) {
    const int64_t o = c0 + 8 * j, left = ncols - o;
    if (left <= 0) break;
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) store_left(y + r * ldy + o, acc[r][j], left);
  }
}

#endif  // QD_X86

// The arguments of a float32 / bfloat16 blocked matmul, for the paths' block loops.
template <typename W>
struct MatArgs {
  const float* x;
  int64_t ldx, M;
  const W* w;  // packed (nblk, K, 64)
  int64_t K;
  const float* bias;  // (n,) or null
  float* y;                   // (M, n)
  int64_t n;
};

// The row groups every path's kernels of 4+ rows take (float32 / bfloat16 chunks on AVX-512,
// bfloat16 on AVX2, int4 on AVX-512 and AVX2): f(MR, first row), MR a std::integral_constant,
// for groups of at most 6 rows: 6s first, 7 left as 4 + 3 (a group of fewer than 4 rows leaves sums
// waiting on the latency of their FMAs or dot products).
template <typename F>
void row_groups(int64_t rows, F&& f) {
  using std::integral_constant;
  int64_t m = 0;
  for (; rows - m > 7; m += 6) f(integral_constant<int, 6>{}, m);
  if (rows - m == 7) {
    f(integral_constant<int, 4>{}, m);
    m += 4;
  }
  switch (rows - m) {
    case 6: f(integral_constant<int, 6>{}, m); break;
    case 5: f(integral_constant<int, 5>{}, m); break;
    case 4: f(integral_constant<int, 4>{}, m); break;
    case 3: f(integral_constant<int, 3>{}, m); break;
    case 2: f(integral_constant<int, 2>{}, m); break;
    case 1: f(integral_constant<int, 1>{}, m); break;
    default: break;
  }
}

#if QD_X86
// Blocks [b0, b1): one row reads the whole block row (8 sums in registers, block_rows_avx2; bfloat16
// on AMD takes the chunks).
// More rows take the block in chunks of CHUNK_BYTES (64 block rows of float32, 128 of bfloat16),
// up to PANEL_AVX2 rows at a time: every pass of the panel (its row groups x column
// pieces) runs over one chunk while the chunk is in L1, the sums of the panel's rows kept in a
// 32 x 64 buffer between chunks (stored and loaded exactly: each output is still one chain of
// FMAs in k order), and the passes spread software prefetches of the next chunk over their
// iterations, so the weights stream from DRAM (or L3) once, overlapped with the FMAs, for up to 32
// rows. (Before: each row group and column piece read the whole block in turn; the first pass
// streamed it from DRAM with a fraction of the FMAs, the others from L2 with no DRAM traffic,
// and a block of K = 8192 (2 MB) did not even fit L2: 6 rows cost 1.3-2.1x one row.)
// Row groups: float32 has no widening to share: 2-3 rows over 32 outputs (the rows' broadcasts
// kept, 8-12 sums; over 16 where the even prefetch stream runs: blocks_avx2). bfloat16 widens each
// weight vector once per group: 4-6 rows over 16 outputs (the 2 weight vectors kept, 8-12 sums),
// 2-3 rows over 32; 7 rows as 4 + 3, more as 6s first (fewer than 8 sums wait on the FMA latency).
constexpr int64_t CHUNK_BYTES = 16384;
constexpr int64_t PANEL = 16;  // rows per panel on AVX-512 (sums: PANEL x 64 floats, 4 KB)
// rows per panel on AVX2 (sums: 8 KB). Against 16 on an AMD EPYC Zen 3 (1 thread, 24 matrices of
// 512 x 1408 and of 576 x 1536 from DRAM, the two alternating in one process, medians of 7-9
// rounds, same bits): float32 20 rows 0.78x the time, 24 rows 0.88-0.89x, 28 rows 0.99-1.01x,
// 32 rows 0.93-0.94x, 40 rows 0.95x; bfloat16 0.87x, 0.94x, 1.04x, 0.98x, 0.98x (a panel of 16
// left a few rows to a panel of their own, in passes of fewer rows: 20 as 6 + 6 + 4, then 4). 24
// rows per panel were no better.
constexpr int64_t PANEL_AVX2 = 32;

// MR rows x outputs [c0, c0 + 8V) over block rows [0, kc) of a chunk (src: its first row), the
// sums in sums[r * 64 + c0 ..] (loaded, updated, stored). Pass `pass` of `passes` over the chunk
// prefetches the rows k of the chunk after next with k % passes == pass into L2 (each line once per
// chunk; past the block's end, the next block's first rows: the blocks are contiguous). Into L1
// measured slower (the fill buffers a DRAM line holds all its latency are few); the next chunk
// rather than the one after it, slower on an AMD EPYC Zen 4 (1 thread, float32, 3 alternating
// processes each): 6 rows of SmolLM2's 576 x 49152 lm_head 5.35-5.58 ms against 4.97-5.28 two
// chunks ahead, the 1.7B shape's 2048 x 16384 6.66-6.90 against 6.06-6.43 ms (4 rows 2-5%
// faster, 1-2 rows and bfloat16 the same; three chunks ahead no better; the AVX-512 kernel's
// chunks, the same change, no faster there).
// The even prefetch stream of a panel of few rows where prefetch_ahead() is 0 (AMD; blocks_avx2
// decides): the lines of the chunk after the current one (as many bytes as the current one; past a
// block's end, the next block's first rows), in order, spread evenly over every iteration of every
// pass over the current chunk (one line per iteration for 4 passes of 64 float32 block rows), so the
// DRAM stream goes on while the passes run from L1. Bursts of a block row's lines every few
// iterations two chunks ahead (two 16 KB chunks in flight besides the current one: more than Zen 3's
// 32 KB L1, which the T1 hint fills too on Zen 3) were slower there than no software prefetch.
struct EvenPrefetch {
  const char* next;  // the next line to fetch
  int64_t left, lines, iters, frac;  // lines left; per chunk: lines, iterations of its passes; accumulator
  __attribute__((always_inline)) inline void step() {
    for (frac += lines; frac >= iters; frac -= iters)
      if (left > 0) {
        _mm_prefetch(next, _MM_HINT_T1);
        next += 64;
        --left;
      }
  }
};

template <typename W, int MR, int V>
__attribute__((target("avx2,fma"))) void chunk_rows_avx2(const float* x, int64_t ldx, const W* src, int64_t kc,
                                                         int64_t c0, float* sums, int pass, int passes,
                                                         EvenPrefetch* even) {
  __m256 acc[MR][V];
#pragma GCC unroll 8
  for (int j = 0; j < V; ++j)
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) acc[r][j] = _mm256_loadu_ps(sums + r * NB + c0 + 8 * j);
  const char* next = reinterpret_cast<const char*>(src + 2 * kc * NB);  // (the chunk after next)
  // the next row to prefetch (a counter: a division per row costs more than its FMAs); none when
  // `passes` is 0 (blocks_avx2 decides)
  int64_t ahead = passes ? pass : kc;
  for (int64_t k = 0; k < kc; ++k) {
    const W* wk = src + k * NB + c0;
    if (k == ahead) {
#pragma GCC unroll 4
      for (int line = 0; line < int(NB * sizeof(W)); line += 64) _mm_prefetch(next + k * NB * sizeof(W) + line, _MM_HINT_T1);
      ahead += passes;
    }
    if (even) even->step();
    fma_rows_avx2<W, MR, V>(x, ldx, k, wk, acc);
  }
#pragma GCC unroll 8
  for (int j = 0; j < V; ++j)
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) _mm256_storeu_ps(sums + r * NB + c0 + 8 * j, acc[r][j]);
}

// The passes of `rows` rows (rows <= PANEL_AVX2) over the outputs [0, ncols) of one chunk, in order:
// f(MR, V, first row, c0) with MR and V as std::integral_constant (the groups described above).
template <typename W, typename F>
void panel_passes(int64_t rows, int64_t ncols, bool quarters, F&& f) {
  using std::integral_constant;
  if constexpr (std::is_same<W, float>::value) {
    if (quarters && rows <= 3) {  // (float32 with the even prefetch stream: every row over 16 outputs)
      for (int64_t c0 = 0; c0 < ncols; c0 += 16) {
        if (rows == 3) f(integral_constant<int, 3>{}, integral_constant<int, 2>{}, 0, c0);
        if (rows == 2) f(integral_constant<int, 2>{}, integral_constant<int, 2>{}, 0, c0);
        if (rows == 1) f(integral_constant<int, 1>{}, integral_constant<int, 2>{}, 0, c0);
      }
      return;
    }
    for (int64_t c0 = 0; c0 < ncols; c0 += 32) {
      int64_t m = 0;
      for (; m + 3 <= rows && rows - m != 4; m += 3) f(integral_constant<int, 3>{}, integral_constant<int, 4>{}, m, c0);
      for (; m + 2 <= rows; m += 2) f(integral_constant<int, 2>{}, integral_constant<int, 4>{}, m, c0);
      if (m < rows) f(integral_constant<int, 1>{}, integral_constant<int, 4>{}, m, c0);  // (a panel of 1 row)
    }
    return;
  }
  row_groups(rows, [&](auto mr, int64_t m) {  // 4-6 rows over 16 outputs, 2-3 over 32, 1 over 64
    constexpr int MR = decltype(mr)::value, V = MR >= 4 ? 2 : MR >= 2 ? 4 : 8;
    for (int64_t c0 = 0; c0 < ncols; c0 += 8 * V) f(mr, integral_constant<int, V>{}, m, c0);
  });
}

template <typename W>
__attribute__((target("avx2,fma"))) void blocks_avx2(const MatArgs<W>& a, int64_t b0, int64_t b1) {
  constexpr int64_t CR = CHUNK_BYTES / (NB * int64_t(sizeof(W)));  // block rows per chunk
  const int64_t M = a.M, K = a.K;
  alignas(32) float sums[PANEL_AVX2 * NB];
  for (int64_t b = b0; b < b1; ++b) {
    const W* wb = a.w + b * K * NB;
    const float* bias = a.bias ? a.bias + b * NB : nullptr;
    float* y = a.y + b * NB;
    const int64_t ncols = std::min(NB, a.n - b * NB);
    // One row: float32 reads each block row whole (8 sums in registers, the hardware's prefetchers
    // alone on AMD: through the chunks below with their even prefetch stream it took 1.16-1.20x the
    // time on an AMD EPYC Zen 3); bfloat16 on AMD takes the chunks, whose stream overlaps its widening
    // and FMAs (0.93-0.94x the time there: 30 matrices of 576 x 3072, two of 2048 x 16384, 1 thread,
    // the two alternating in one process, medians of 9 rounds, same bits).
    if (M == 1 && (std::is_same<W, float>::value || prefetch_ahead())) {
      block_rows_avx2<W, 1, 8>(a.x, a.ldx, wb, K, 0, bias, y, a.n, ncols, true);
      continue;
    }
    for (int64_t p0 = 0; p0 < M; p0 += PANEL_AVX2) {
      const int64_t rows = std::min(PANEL_AVX2, M - p0);
      const float* xp = a.x + p0 * a.ldx;
      // Software prefetch: where prefetch_ahead() is 0 (AMD), a float32 panel of up to 7 rows and a
      // bfloat16 panel of up to 5 stream the next chunk evenly over their passes (EvenPrefetch), float32
      // panels of 2-3 rows in four passes of 16 outputs rather than two of 32 (the stream's rate at most
      // a line per iteration); other panels prefetch the block rows k of the chunk after next with
      // k % passes == pass (each row's lines at once). On an AMD EPYC Zen 3 (AVX2 only; 1 thread,
      // SmolLM2's 30 layers and lm_head from DRAM, float32, the settings alternating in one process,
      // medians of 9 rounds, same bits), against no software prefetch for up to 6 rows (faster there
      // than the bursts): 2 rows 0.94x the time, 3 rows 0.91x, 4 rows 0.76x, 6 rows 0.73x (4 rows
      // 41.0 ms against 52.2, 6 rows 42.4 against 60.2, one row 31); in the kernel alone (30 matrices
      // of 576 x 3072, 7-11 rounds), 5 rows 0.78x, 7 rows 0.87x against the bursts; 9 and 12 rows took
      // 1.12-1.35x (they keep the bursts). bfloat16 against its bursts: 2-5 rows 0.83-0.94x, 6 rows
      // 0.85-1.09x, 7 rows 1.10x.
      const bool spread = !prefetch_ahead() && rows <= (std::is_same<W, float>::value ? 7 : 5);
      int passes = 0;
      panel_passes<W>(rows, ncols, spread, [&](auto, auto, int64_t, int64_t) { ++passes; });
      const int pf_passes = spread ? 0 : passes;
      EvenPrefetch even{nullptr, 0, 0, 0, 0};
      for (int64_t c = 0; c < NB; c += 8) {  // the sums start from the bias (zeros past ncols)
        const __m256 b8 = bias ? load_left(bias + c, ncols - c) : _mm256_setzero_ps();
        for (int64_t r = 0; r < rows; ++r) _mm256_storeu_ps(sums + r * NB + c, b8);
      }
      for (int64_t k0 = 0; k0 < K; k0 += CR) {
        const int64_t kc = std::min(CR, K - k0);
        if (spread) {
          const int64_t lines = kc * NB * int64_t(sizeof(W)) / 64;
          even = {reinterpret_cast<const char*>(wb + (k0 + kc) * NB), lines, lines, passes * kc, 0};
        }
        int pass = 0;
        panel_passes<W>(rows, ncols, spread, [&](auto mr, auto v, int64_t m, int64_t c0) {
          chunk_rows_avx2<W, decltype(mr)::value, decltype(v)::value>(xp + m * a.ldx + k0, a.ldx, wb + k0 * NB, kc, c0,
                                                                      sums + m * NB, pass++, pf_passes,
                                                                      spread ? &even : nullptr);
        });
      }
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < ncols; c += 8) store_left(y + (p0 + r) * a.n + c, _mm256_loadu_ps(sums + r * NB + c), ncols - c);
    }
  }
}

// AVX-512: several blocks at a time: more read streams, more sums in flight (measured on
// SmolLM2's and the bundled target's shapes: one row 4-8% faster with four streams than with two
// on Intel, slower on AMD: four_streams; two streams for 2-3 rows); 4+ rows: chunked_avx512.
// 4+ rows: the chunks of blocks_avx2 (one block, its 64 outputs in one pass per row group of up
// to 6: 24 sums, the 4 weight vectors kept; 7 rows as 4 + 3, more as 6s first), the sums of up to
// PANEL rows kept between chunks; the next chunk prefetched over the passes.
template <typename W, int MR>
__attribute__((target("avx512f"))) void chunk_rows_avx512(const float* x, int64_t ldx, const W* src, int64_t kc,
                                                          float* sums, int pass, int passes) {
  __m512 acc[MR][4];
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j)
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) acc[r][j] = _mm512_loadu_ps(sums + r * NB + 16 * j);
  const char* next = reinterpret_cast<const char*>(src + kc * NB);
  int64_t ahead = pass;  // (a counter, as chunk_rows_avx2)
  for (int64_t k = 0; k < kc; ++k) {
    const W* wk = src + k * NB;
    if (k == ahead) {
#pragma GCC unroll 4
      for (int line = 0; line < int(NB * sizeof(W)); line += 64) _mm_prefetch(next + k * NB * sizeof(W) + line, _MM_HINT_T1);
      ahead += passes;
    }
    __m512 w[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) w[j] = load16(wk + 16 * j);
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * ldx + k]);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_fmadd_ps(xv, w[j], acc[r][j]);
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j)
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) _mm512_storeu_ps(sums + r * NB + 16 * j, acc[r][j]);
}

template <typename W>
__attribute__((target("avx512f"))) void chunked_avx512(const MatArgs<W>& a, int64_t b0, int64_t b1) {
  constexpr int64_t CR = CHUNK_BYTES / (NB * int64_t(sizeof(W)));
  const int64_t M = a.M, K = a.K;
  alignas(64) float sums[PANEL * NB];
  for (int64_t b = b0; b < b1; ++b) {
    const W* wb = a.w + b * K * NB;
    const float* bias = a.bias ? a.bias + b * NB : nullptr;
    const int64_t ncols = std::min(NB, a.n - b * NB);
    for (int64_t p0 = 0; p0 < M; p0 += PANEL) {
      const int64_t rows = std::min(PANEL, M - p0);
      const float* xp = a.x + p0 * a.ldx;
      int passes = 0;
      row_groups(rows, [&](auto, int64_t) { ++passes; });
      for (int j = 0; j < 4; ++j) {  // the sums start from the bias (zeros past ncols)
        const __m512 b16 = bias ? _mm512_maskz_loadu_ps(tail_mask(ncols - 16 * j), bias + 16 * j) : _mm512_setzero_ps();
        for (int64_t r = 0; r < rows; ++r) _mm512_storeu_ps(sums + r * NB + 16 * j, b16);
      }
      for (int64_t k0 = 0; k0 < K; k0 += CR) {
        const int64_t kc = std::min(CR, K - k0);
        int pass = 0;
        row_groups(rows, [&](auto mr, int64_t m) {
          chunk_rows_avx512<W, decltype(mr)::value>(xp + m * a.ldx + k0, a.ldx, wb + k0 * NB, kc, sums + m * NB,
                                                     pass++, passes);
        });
      }
      for (int j = 0; j < 4; ++j) {
        const __mmask16 mask = tail_mask(ncols - 16 * j);
        if (!mask) break;
        for (int64_t r = 0; r < rows; ++r)
          _mm512_mask_storeu_ps(a.y + (p0 + r) * a.n + b * NB + 16 * j, mask, _mm512_loadu_ps(sums + r * NB + 16 * j));
      }
    }
  }
}

template <typename W>
void blocks_avx512(const MatArgs<W>& a, int64_t b0, int64_t b1) {
  const int64_t M = a.M, K = a.K, n = a.n;
  // Where one stream is the choice (AMD), 4-6 float32 rows and 4-5 bfloat16 rows: one pass over each
  // block, every sum in registers (block_rows; six rows: 24 sums, 4 weight vectors and a broadcast,
  // 29 of the 32 registers), faster there than the chunks. On an AMD EPYC Zen 4, 1 thread, float32,
  // alternating processes: 4 rows of SmolLM2-1.7B's 2048 x 49152 lm_head 11.5-11.7 ms against
  // 17.9-18.1, its 2048 x 16384 gate_up 3.3-3.4 against 5.2; 5 rows 12.1-12.3 against 14.9-15.3 and
  // 3.6-3.7 against 3.8 (its 2048 x 6144 qkv 1.32 against 1.23-1.24 ms: slower); the bundled target's
  // whole verify step T(4)/T(1) 0.97-1.01 against 1.28, T(5) 1.02 against 1.11. Six rows measured 8-11%
  // slower so in that comparison, but with every layer's weight streamed from DRAM (blocked_rows.py
  // --dram) their T(6)/T(1) was 0.92-1.07 against 0.98-1.25 in chunks, and whole eager steps took 0.88x
  // the time for SmolLM2 at 1 thread (T(6)/T(1) 1.25 -> 1.12), 0.80x at 2, the 1.7B shape's 0.94x
  // (benchmarks/results/verify_steps_f32_six_rows_zen4_cpu.md). bfloat16's six rows, bound by their
  // widening, were slower so (1.7B's layers T(6)/T(1) 1.71-1.81 against 1.51-1.66), and its 4-5 rows
  // the same either way.
  constexpr int64_t one_pass = std::is_same<W, float>::value ? 6 : 5;
  if (M >= 4 && !(M <= one_pass && row_streams() == 1)) return chunked_avx512(a, b0, b1);
  auto at_block = [&](const float* v, int64_t b) { return v ? v + b * NB : nullptr; };
  int64_t b = b0;
  if (M == 1 && four_streams())
    for (; b + 3 < b1; b += 4)
      run_rows<W, 4>(a.x, a.ldx, M, a.w + b * K * NB, K, at_block(a.bias, b), a.y + b * NB, n,
                     std::min(4 * NB, n - b * NB));
  if (M <= 3 && (M > 1 || row_streams() != 1))
    for (; b + 1 < b1; b += 2)
      run_rows<W, 2>(a.x, a.ldx, M, a.w + b * K * NB, K, at_block(a.bias, b), a.y + b * NB, n,
                     std::min(2 * NB, n - b * NB));
  for (; b < b1; ++b)
    run_rows<W, 1>(a.x, a.ldx, M, a.w + b * K * NB, K, at_block(a.bias, b), a.y + b * NB, n,
                   std::min(NB, n - b * NB));
}

#endif  // QD_X86

template <typename W>
void blocks_portable(const MatArgs<W>& a, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b)
    block_rows_generic<W>(a.x, a.ldx, a.M, a.w + b * a.K * NB, a.K, a.bias ? a.bias + b * NB : nullptr, a.y + b * NB,
                          a.n, std::min(NB, a.n - b * NB));
}

// ---- int4: 4-bit weights in groups of 32 inputs, a scale and an offset per group and output,
// times int8 activations (integer dot products) ----
//
// Layout (uint8): packed (N/64, G, QGB), G = K / 32 groups. Block b's group g is one contiguous
// 1280-byte piece (so a block is a single read stream): 8 quads of inputs (k = 4c .. 4c + 3,
// c = 0..7) of 128 bytes each, two 64-byte chunks h = 0, 1 per quad, byte 4i + j of chunk h
// (i = 0..15, j = 0..3) holding q[32h + i][4c + j] | q[32h + 16 + i][4c + j] << 4 (q in 0..15,
// [output][input]); then 64 float16 scales s, then 64 float16 offsets o: w = q s + o (the
// symmetric layout, QGB_SYM bytes, stores no offsets: o = -8 s, computed in float32 where the
// other layout loads it, so a GGUF's Q4_0 matrix runs at its own 4.5 bits per weight; an
// offset -8 s stored as float16 is the same float, so both layouts give the same bits). A chunk's
// low nibbles are outputs 32h .. 32h + 15 and its high nibbles 32h + 16 .. 32h + 31, each 32-bit
// lane four consecutive inputs of one output: the operand of vpdpbusd (and of maddubs + madd,
// NEON's vmull + vpadal) against four activation bytes broadcast to every lane.
//
// Activations (q4_quantize, once per call: the portable path's scalar function, which the vector
// paths' quantisers follow operation for operation (Paths::quant), so the int8 values and scales
// are the same bits everywhere): per row and group of 32 inputs,
//   amax = max_k |x_k|,  d = amax / 127,  a_k = rne(x_k * (1 / d)) in [-127, 127]
//   (all a_k = 0 where d < FLT_MIN),  X = d * float(sum_k a_k)
// (rne: round to nearest even, by adding and subtracting 1.5 * 2^23; the clamp never binds but
// is kept). A group holding a NaN or an infinity gets d = X = NaN: its row's outputs are NaN,
// as the float kernels' would be.
//
// Per row and output, on every path, in this order (float32, one rounding per operation):
//   y = bias (or 0);  for g = 0 .. G-1:  t = float(I_g) * d_g;  y = fma(t, s_g, y);  y = fma(X_g, o_g, y)
// with I_g = sum_{k in g} a_k q_k, exact in int32 (|I_g| <= 32 * 127 * 15). So y = bias +
// sum_g sum_k (q_k s_g + o_g)(a_k d_g): the dequantised weights times the dequantised
// activations (what llama.cpp's Q4_1 x Q8_1 computes, rounded in its own order). The integer
// sums are exact in any order and the epilogue is fixed, so a row's result has the same bits on
// every path, at any row count, beside any other rows and on any thread count.
constexpr int64_t QG = 32;                         // inputs per group
constexpr int64_t QGB = QG * NB / 2 + 2 * NB * 2;  // bytes per (block, group): 1024 + 256
constexpr int64_t QGB_SYM = QG * NB / 2 + NB * 2;  // the symmetric layout's: 1024 + 128 (no offsets)

// The super-block layout (with quant.INT4_SUPER_BLOCKS: a GGUF's Q4_K as it is, and quantization="int4"
// where the group count is a multiple of QSG): packed (N/64, G/8, QSB), per block and super group of QSG = 8 groups (256
// inputs) one contiguous QSB-byte piece: a header of 64 float16 scale factors D then 64 float16
// offset factors O (one per output), then the 8 groups' pieces of QSP bytes each: the nibbles as
// above, then per half h of the outputs (32h .. 32h + 31) one 64-byte line: their 32 scale codes
// (uint8), then their 32 offset codes (int8), so a pass over one half of a block (the AVX-512 4-6-row
// kernel's) reads only its own lines, as in the float16 layout. A group's s = float(scale code) * D and
// o = float(offset code) * O: both products exact in float32 (8 bits times float16's 11), so every
// path gets the same floats and the epilogue below is unchanged; 4.625 bits a weight, against 5
// (float16 scales and offsets) and Q4_K's 4.5 (6-bit codes packed: unpacked here to whole bytes).
// Not the default yet: a verify step of 5 / 6 rows (block_rows_q4_halves) took 1.37x / 1.26x the
// float16 layout's time from DRAM (one row 0.89x; benchmarks/results/verify_table_int4_super_zen4_cpu.md),
// though only 1.04-1.09x with the weights in L3. GCC spills the quads' weights there (the codes'
// conversion takes registers); an asm load ended the spills at 5 rows but not the gap (1.2-1.3x from
// DRAM, 1 thread), so the rest is how that kernel's every-other-line reads stream this layout. With that
// kernel's even prefetch of the next block its calls of 3-9 rows from DRAM took 1.05-1.11x the float16
// layout's time, one row 0.83x; on AVX2 0.95-1.09x at every row count
// (benchmarks/results/blocked_rows_dram_prefetch_zen4_cpu.md): still not the default.
constexpr int64_t QSG = 8;                          // groups per super group
constexpr int64_t QSP = QG * NB / 2 + 2 * NB;       // bytes of one group in it: 1024 + 64 + 64
constexpr int64_t QSH = 4 * NB;                     // its header: 64 D + 64 O, float16
constexpr int64_t QSB = QSH + QSG * QSP;            // bytes per (block, super group): 256 + 8 * 1152
enum Q4Layout : int { Q4_ASYM = 0, Q4_SYM = 1, Q4_SUPER = 2 };
// The layout of a packed weight from its last dimension (QGB, QGB_SYM or QSB).
constexpr int q4_layout(int64_t gb) { return gb == QSB ? Q4_SUPER : gb == QGB_SYM ? Q4_SYM : Q4_ASYM; }
constexpr int64_t q4_size(int L) { return L == Q4_SUPER ? QSB : L == Q4_SYM ? QGB_SYM : QGB; }
// Bytes of one block (all G groups) and, in the block at wb, group g's piece and its super group's header.
constexpr int64_t q4_block_bytes(int64_t gb, int64_t G) { return gb == QSB ? (G / QSG) * QSB : G * gb; }
inline const uint8_t* q4_piece(const uint8_t* wb, int64_t gb, int64_t g) {
  return gb == QSB ? wb + (g / QSG) * QSB + QSH + (g % QSG) * QSP : wb + g * gb;
}
inline const uint8_t* q4_header(const uint8_t* wb, int64_t g) { return wb + (g / QSG) * QSB; }
// In a super-block piece, output o's scale code (its offset code 32 bytes further).
constexpr int64_t q4_code_at(int64_t o) { return 1024 + 64 * (o / 32) + o % 32; }
// Bytes of a piece (what a path prefetches per group).
constexpr int64_t q4_piece_bytes(int64_t gb) { return gb == QSB ? QSP : gb; }

// The integer dot-product instructions where the CPU has them (AVX-512 VNNI, AVX-VNNI), else
// maddubs + madd: exact integer sums either way, so the bits are the same; off forces the latter
// (tests and benchmarks: quickdraft_set_vnni, QUICKDRAFT_VNNI=0).
std::atomic<bool> vnni_allowed{true};

// A row's activations, quantised: q (rows, ldq) int8, d and X (rows, G) float32.
struct Q4Act {
  const int8_t* q;
  int64_t ldq;
  const float* d;
  const float* xs;
  int64_t G;
};

// q4_quantize's formula for rows [0, M) of x (M, G * 32): q (M, G * 32), d and xs (M, G).
inline void q4_quantize(const float* x, int64_t ldx, int64_t M, int64_t G, int8_t* q, float* d, float* xs) {
  const float round_magic = 12582912.f;  // 1.5 * 2^23: v + m - m rounds v (|v| < 2^22) to the nearest even integer
  for (int64_t r = 0; r < M; ++r)
    for (int64_t g = 0; g < G; ++g) {
      const float* xg = x + r * ldx + g * QG;
      int8_t* qg = q + r * G * QG + g * QG;
      float amax = 0.f;
      bool finite = true;
      for (int64_t k = 0; k < QG; ++k) {
        const float a = std::fabs(xg[k]);
        finite = finite && a <= std::numeric_limits<float>::max();  // (false for NaN too)
        amax = a > amax ? a : amax;
      }
      const float dg = amax / 127.f;
      const float id = dg >= std::numeric_limits<float>::min() ? 1.f / dg : 0.f;
      int32_t sum = 0;
      for (int64_t k = 0; k < QG; ++k) {
        float v = finite ? (xg[k] * id + round_magic) - round_magic : 0.f;
        v = v > 127.f ? 127.f : v < -127.f ? -127.f : v;
        qg[k] = int8_t(int32_t(v));
        sum += qg[k];
      }
      d[r * G + g] = finite ? dg : std::numeric_limits<float>::quiet_NaN();
      xs[r * G + g] = finite ? dg * float(sum) : std::numeric_limits<float>::quiet_NaN();
    }
}

// The paths' activation quantisers: q4_quantize's formula (the portable path is q4_quantize itself),
// and where `sums` is not null each group's sum_k a_k too (int8's epilogue needs it). The vector
// paths take a group's 32 inputs in vectors with the same operations per element: the maximum of
// the absolute values (exact in any order), one scalar division for d and for 1 / d as above, then
// per element a multiply, an add and a subtract (never fused: -ffp-contract=off), the clamp and an
// exact conversion; so the same bits on every path. On an AMD EPYC Zen 3 (1 thread) the scalar
// loop took ~2 ns an input, a tenth of a one-row int4 matmul's time at SmolLM2's shapes and more
// at several rows (a 6-row verify step quantises 6 rows on one thread before its matmul).
using QuantizeFn = void (*)(const float* x, int64_t ldx, int64_t M, int64_t G, int8_t* q, float* d, float* xs,
                            int32_t* sums);

void quantize_portable(const float* x, int64_t ldx, int64_t M, int64_t G, int8_t* q, float* d, float* xs,
                       int32_t* sums) {
  q4_quantize(x, ldx, M, G, q, d, xs);
  if (sums)
    for (int64_t i = 0; i < M * G; ++i) {
      int32_t s = 0;
      for (int64_t k = 0; k < QG; ++k) s += q[i * QG + k];
      sums[i] = s;
    }
}

// Four activation bytes (inputs 4c .. 4c + 3 of a row) as one 32-bit lane.
inline int32_t quad_at(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// The arguments of an int4 blocked matmul, for the paths' block loops.
struct Q4Args {
  Q4Act x;  // the rows' quantised activations
  int64_t M, G;
  const uint8_t* w;  // packed (nblk, G, gb)
  const float* bias;
  float* y;
  int64_t n;
  int64_t gb = QGB;  // the layout (q4_layout): QGB, QGB_SYM (o = -8 s), or QSB (the super-block layout)
};

// The portable int4 path: the same integer sums and the same epilogue, one row at a time.
inline float half_to_float(const uint8_t* p) {  // IEEE binary16 (little-endian) -> float32, exact
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, e = (h >> 10) & 31u, m = h & 1023u;
  if (e == 0) {  // zero or subnormal: m 2^-24, exact in float32
    const float f = float(m) * 5.9604644775390625e-8f;
    return sign ? -f : f;
  }
  const uint32_t u = sign | (e == 31 ? 0x7F800000u | (m << 13) : ((e + 112) << 23) | (m << 13));
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Nibble q[n][k] of a piece (the layout above).
inline int32_t q4_at(const uint8_t* piece, int64_t n, int64_t k) {
  const int64_t h = n / 32, i = n % 16, hi = (n % 32) / 16;
  const uint8_t byte = piece[128 * (k / 4) + 64 * h + 4 * i + k % 4];
  return hi ? byte >> 4 : byte & 15;
}

// Output n's scale s and offset o in group g (piece: its piece in the block at wb), in float32.
inline void q4_scale_offset(const uint8_t* wb, int64_t gb, int64_t g, const uint8_t* piece, int64_t n, float& s,
                            float& o) {
  if (gb == QSB) {  // codes times the super group's factors (exact)
    const uint8_t* h = q4_header(wb, g);
    s = float(piece[q4_code_at(n)]) * half_to_float(h + 2 * n);
    o = float(int8_t(piece[q4_code_at(n) + 32])) * half_to_float(h + 128 + 2 * n);
    return;
  }
  s = half_to_float(piece + 1024 + 2 * n);
  o = gb == QGB_SYM ? -8.f * s : half_to_float(piece + 1152 + 2 * n);
}

void block_rows_q4_generic(const Q4Act& x, int64_t rows, const uint8_t* wb, int64_t gb, const float* bias, float* y,
                           int64_t ldy, int64_t ncols) {
  const int64_t G = x.G;
  for (int64_t r = 0; r < rows; ++r) {
    float acc[NB];
    for (int64_t n = 0; n < NB; ++n) acc[n] = (bias && n < ncols) ? bias[n] : 0.f;
    const int8_t* a = x.q + r * x.ldq;
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* piece = q4_piece(wb, gb, g);
      const float dg = x.d[r * G + g], xs = x.xs[r * G + g];
      for (int64_t n = 0; n < NB; ++n) {
        int32_t isum = 0;
        for (int64_t k = 0; k < QG; ++k) isum += int32_t(a[g * QG + k]) * q4_at(piece, n, k);
        float sc, of;
        q4_scale_offset(wb, gb, g, piece, n, sc, of);
        const float t = float(isum) * dg;
        acc[n] = std::fma(xs, of, std::fma(t, sc, acc[n]));
      }
    }
    for (int64_t n = 0; n < ncols; ++n) y[r * ldy + n] = acc[n];
  }
}

void q4_portable(const Q4Args& a, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b)
    block_rows_q4_generic(a.x, a.M, a.w + b * q4_block_bytes(a.gb, a.G), a.gb, a.bias ? a.bias + b * NB : nullptr, a.y + b * NB,
                          a.n, std::min(NB, a.n - b * NB));
}

#if QD_X86
bool cpu_avx512_vnni() {
  static const bool yes = (__builtin_cpu_init(), __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni"));
  return yes;
}
bool cpu_avx512_bw() {
  static const bool yes = (__builtin_cpu_init(), __builtin_cpu_supports("avx512bw"));
  return yes;
}
bool cpu_avx_vnni() {
  static const bool yes = (__builtin_cpu_init(), __builtin_cpu_supports("avxvnni"));
  return yes;
}

// A group's sums, one quad at a time: acc + the four-product sums of each 32-bit lane (w unsigned
// bytes: nibbles; a signed bytes). VNNI: vpdpbusd into int32 lanes. Without: maddubs (adjacent
// pairs of products into int16: at most 2 * 15 * 127 = 3810, never saturating) added into int16
// lanes over the group's 8 quads (at most 8 * 3810 = 30480 < 2^15: exact), and finish4x16 adds
// each lane's two int16 sums into int32 (madd with ones): the same exact integer sums.
template <bool VNNI>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline __m512i dot4x16(__m512i acc, __m512i w, __m512i a) {
  if constexpr (VNNI) return _mm512_dpbusd_epi32(acc, w, a);
  else return _mm512_add_epi16(acc, _mm512_maddubs_epi16(w, a));
}
template <bool VNNI>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline __m512i finish4x16(__m512i acc) {
  if constexpr (VNNI) return acc;
  else return _mm512_madd_epi16(acc, _mm512_set1_epi16(1));
}

// A 64-byte chunk's nibbles as bytes: lo (its low nibbles: 16 outputs' quads) and hi (the high ones).
__attribute__((target("avx512f,avx512bw"), always_inline)) inline void nibbles16(const uint8_t* chunk, __m512i& lo,
                                                                                __m512i& hi) {
  const __m512i low = _mm512_set1_epi8(15), v = _mm512_loadu_si512(chunk);
  lo = _mm512_and_si512(v, low);
  hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
}

// A super group's header lines read before its pieces' (the order a stream prefetcher follows; the
// epilogue reads them after the first group's nibbles otherwise): lines first, first + step, ...
// (4 lines: D then O), in each of NBLK blocks bb bytes apart.
template <int NBLK>
__attribute__((target("avx512f"), always_inline)) inline void q4_touch_header(const uint8_t* wb, int64_t bb, int64_t g,
                                                                             int first, int step) {
  for (int blk = 0; blk < NBLK; ++blk)
    for (int line = first; line < 4; line += step)
      _mm_prefetch(reinterpret_cast<const char*>(q4_header(wb + blk * bb, g)) + 64 * line, _MM_HINT_T0);
}

// Outputs o .. o + 15's scales and offsets in group g (piece: its piece in the block at wb), layout L.
template <int L>
__attribute__((target("avx512f,avx512bw,f16c"), always_inline)) inline void q4_scales16(const uint8_t* wb, int64_t g,
                                                                                        const uint8_t* piece, int64_t o,
                                                                                        __m512& sc, __m512& of) {
  if constexpr (L == Q4_SUPER) {
    const uint8_t* h = q4_header(wb, g);
    const __m128i cs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(piece + q4_code_at(o)));
    const __m128i co = _mm_loadu_si128(reinterpret_cast<const __m128i*>(piece + q4_code_at(o) + 32));
    sc = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(cs)),
                       _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + 2 * o))));
    of = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(co)),
                       _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + 128 + 2 * o))));
  } else {
    sc = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(piece + 1024 + 2 * o)));
    of = L == Q4_SYM ? _mm512_mul_ps(sc, _mm512_set1_ps(-8.f))
                     : _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(piece + 1152 + 2 * o)));
  }
}

// MR rows over NBLK adjacent blocks, all groups. A group's integer sums stay in registers (MR * 4 *
// NBLK); the running float sums live in y itself (in L1), updated once per group; each unpacked
// weight vector serves all MR rows.
template <int MR, int NBLK, bool VNNI, int L>
__attribute__((target("avx512f,avx512bw,avx512vnni,f16c"))) void block_rows_q4(const Q4Act& x, const uint8_t* wb,
                                                                               const float* bias, float* y,
                                                                               int64_t ldy, int64_t ncols) {
  const int pf = prefetch_ahead();  // (0 on AMD: the hardware's prefetchers alone)
  constexpr int V = 4 * NBLK;
  constexpr int64_t gb = q4_size(L), pb = q4_piece_bytes(gb);
  const int64_t G = x.G, bb = q4_block_bytes(gb, G);
#pragma GCC unroll 16
  for (int j = 0; j < V; ++j) {
    const __mmask16 mask = tail_mask(ncols - 16 * j);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * j) : _mm512_setzero_ps();
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(y + r * ldy + 16 * j, mask, b);
  }
  for (int64_t g = 0; g < G; ++g) {
    if constexpr (L == Q4_SUPER)
      if (g % QSG == 0) q4_touch_header<NBLK>(wb, bb, g, 0, 1);
    __m512i acc[MR][V];
#pragma GCC unroll 16
    for (int j = 0; j < V; ++j)
#pragma GCC unroll 6
      for (int r = 0; r < MR; ++r) acc[r][j] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      __m512i av[MR];
#pragma GCC unroll 6
      for (int r = 0; r < MR; ++r) av[r] = _mm512_set1_epi32(quad_at(x.q + r * x.ldq + g * QG + 4 * c));
#pragma GCC unroll 4
      for (int blk = 0; blk < NBLK; ++blk) {
        const uint8_t* piece = q4_piece(wb + blk * bb, gb, g);
        // the piece's 20 lines (18 symmetric or super-block) PF bytes ahead, over the 8 quads
        if (pf) {
          const char* ahead = reinterpret_cast<const char*>(piece) + pf;
          _mm_prefetch(ahead + 64 * c, _MM_HINT_T0);
          _mm_prefetch(ahead + 64 * (c + 8), _MM_HINT_T0);
          if (64 * (c + 16) < pb) _mm_prefetch(ahead + 64 * (c + 16), _MM_HINT_T0);
        }
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          __m512i lo, hi;
          nibbles16(piece + 128 * c + 64 * h, lo, hi);
#pragma GCC unroll 6
          for (int r = 0; r < MR; ++r) {
            acc[r][4 * blk + 2 * h] = dot4x16<VNNI>(acc[r][4 * blk + 2 * h], lo, av[r]);
            acc[r][4 * blk + 2 * h + 1] = dot4x16<VNNI>(acc[r][4 * blk + 2 * h + 1], hi, av[r]);
          }
        }
      }
    }
    // vector j: block j / 4, outputs 16 (j % 4) ..
#pragma GCC unroll 16
    for (int j = 0; j < V; ++j) {
      const uint8_t* wbj = wb + (j / 4) * bb;
      __m512 sc, of;
      q4_scales16<L>(wbj, g, q4_piece(wbj, gb, g), 16 * (j % 4), sc, of);
      const __mmask16 mask = tail_mask(ncols - 16 * j);
#pragma GCC unroll 6
      for (int r = 0; r < MR; ++r) {
        float* yr = y + r * ldy + 16 * j;
        const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(finish4x16<VNNI>(acc[r][j])), _mm512_set1_ps(x.d[r * G + g]));
        const __m512 yv = _mm512_fmadd_ps(t, sc, _mm512_maskz_loadu_ps(mask, yr));
        _mm512_mask_storeu_ps(yr, mask, _mm512_fmadd_ps(_mm512_set1_ps(x.xs[r * G + g]), of, yv));
      }
    }
  }
}

// Four to six rows of one block (five or six where it has fewer than HALVES_LONG groups), its sums
// in registers: the block's two halves (outputs 0 .. 31 from each quad's first 64-byte chunk,
// 32 .. 63 from its second) one after the other, each over
// all groups, MR rows x 2 vectors of running float sums and as many integer sums, so a group's
// epilogue neither loads nor stores y (block_rows_q4 keeps 4 x MR sums of 16 outputs, more than
// the registers hold beside the integer sums, in y itself: a load and a store per sum and group,
// and at six rows spills). The same integer sums and the same epilogue per output in the same group
// order: the same bits. Each half reads every other line of the block, which the hardware's
// prefetchers stream slowly from DRAM, so while the two passes run (from L2 after the first) the
// kernel prefetches the next block's lines evenly over them (EvenPrefetch: its only prefetch, on
// any CPU), and the DRAM stream goes on under the compute. Measured on an AMD EPYC Zen 4, 1 thread,
// SmolLM2-1.7B's layer shapes from DRAM (6 layers, thread clock, alternating processes): without the
// even stream five rows took 2.1-3.1x the time of six (29.5 / 44.1 against 17.6 / 21.2 ms), with it
// 14.1-14.9 ms and six 16.0-16.7; four rows then 0.90-0.94x block_rows_q4's time (2 threads: ~0.95x),
// three 0.92-1.0x (2 threads 1.04-1.08x: three stay on block_rows_q4). SmolLM2's shapes (K = 576,
// 1536: 18 and 48 groups, once 1.3-1.4x block_rows_q4's time), per row count against one row's
// time, 1 / 2 threads (medians of 3 / 5 runs): five rows 1.60 / 1.38 against 1.74 / 1.43, six 1.79 /
// 1.44 against 1.94 / 1.57, but four 1.34 / 1.22 against 1.47 / 1.16 and three 1.21 / 1.16
// against 1.15 / 1.09: such short blocks take it from five rows. Two rows stay on block_rows_q4
// (1.1-1.4x there). (The same split of int8's blocks, two lines of every four, took 2.7x the time
// there without a prefetch stream.) It runs where the kernels read one stream (row_streams: AMD, or
// QUICKDRAFT_ROW_STREAMS=1, or QUICKDRAFT_HALVES=1), and on Intel for matrices of up to 64 groups
// (q4_halves: K = 8192's were slower there), the choices measured.
constexpr int64_t HALVES_LONG = 64;  // groups from which four rows take it
template <int MR, bool VNNI, int L>
__attribute__((target("avx512f,avx512bw,avx512vnni,f16c"))) void block_rows_q4_halves(const Q4Act& x, const uint8_t* wb,
                                                                                      const float* bias, float* y,
                                                                                      int64_t ldy, int64_t ncols) {
  constexpr int64_t gb = q4_size(L);
  const int64_t G = x.G;
  // the next block's lines, evenly over the 2 x G x 8 chunk iterations of both passes
  const int64_t lines = q4_block_bytes(gb, G) / 64;
  EvenPrefetch even{reinterpret_cast<const char*>(wb) + 64 * lines, lines, lines, 2 * G * 8, 0};
  for (int h = 0; h < 2 && 32 * h < ncols; ++h) {
    __m512 f[MR][2];
#pragma GCC unroll 2
    for (int e = 0; e < 2; ++e) {
      const __mmask16 mask = tail_mask(ncols - 32 * h - 16 * e);
      const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + 32 * h + 16 * e) : _mm512_setzero_ps();
#pragma GCC unroll 6
      for (int r = 0; r < MR; ++r) f[r][e] = b;
    }
    for (int64_t g = 0; g < G; ++g) {
      if constexpr (L == Q4_SUPER)
        if (g % QSG == 0) q4_touch_header<1>(wb, 0, g, h, 2);  // (this half's: lines h and 2 + h)
      const uint8_t* piece = q4_piece(wb, gb, g);
      const int8_t* xq = x.q + g * QG;
      __m512i acc[MR][2];
#pragma GCC unroll 6
      for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) {
        __m512i lo, hi;
        nibbles16(piece + 128 * c + 64 * h, lo, hi);
        even.step();
#pragma GCC unroll 6
        for (int r = 0; r < MR; ++r) {
          const __m512i a = _mm512_set1_epi32(quad_at(xq + r * x.ldq + 4 * c));
          acc[r][0] = dot4x16<VNNI>(acc[r][0], lo, a);
          acc[r][1] = dot4x16<VNNI>(acc[r][1], hi, a);
        }
      }
#pragma GCC unroll 2
      for (int e = 0; e < 2; ++e) {  // outputs 32h + 16e ..: the piece's scale (and offset) vector 2h + e
        __m512 sc, of;
        q4_scales16<L>(wb, g, piece, 32 * h + 16 * e, sc, of);
#pragma GCC unroll 6
        for (int r = 0; r < MR; ++r) {
          const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(finish4x16<VNNI>(acc[r][e])), _mm512_set1_ps(x.d[r * G + g]));
          f[r][e] = _mm512_fmadd_ps(_mm512_set1_ps(x.xs[r * G + g]), of, _mm512_fmadd_ps(t, sc, f[r][e]));
        }
      }
    }
#pragma GCC unroll 2
    for (int e = 0; e < 2; ++e) {
      const __mmask16 mask = tail_mask(ncols - 32 * h - 16 * e);
#pragma GCC unroll 6
      for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(y + r * ldy + 32 * h + 16 * e, mask, f[r][e]);
    }
  }
}

// Rows [0, M) of NBLK adjacent blocks: four blocks for one row, two for two or three rows (one on
// AMD: row_streams), one block for more, in row groups of up to six (block_rows_q4_halves for 4-6 or 5-6 on AMD).
template <int NBLK, bool VNNI, int L>
void run_rows_q4(const Q4Act& x, int64_t M, const uint8_t* wb, const float* bias, float* y, int64_t ldy,
                 int64_t ncols) {
  constexpr int N2 = NBLK == 4 ? 2 : NBLK;  // (keeps the instances that cannot occur small)
  if (NBLK == 4) {
    block_rows_q4<1, NBLK, VNNI, L>(x, wb, bias, y, ldy, ncols);
    return;
  }
  if (NBLK == 2) {
    if (M == 3) block_rows_q4<3, N2, VNNI, L>(x, wb, bias, y, ldy, ncols);
    if (M == 2) block_rows_q4<2, N2, VNNI, L>(x, wb, bias, y, ldy, ncols);
    if (M == 1) block_rows_q4<1, N2, VNNI, L>(x, wb, bias, y, ldy, ncols);
    return;
  }
  row_groups(M, [&](auto mr, int64_t m) {
    constexpr int MR = decltype(mr)::value;
    const Q4Act xm{x.q + m * x.ldq, x.ldq, x.d + m * x.G, x.xs + m * x.G, x.G};
    if constexpr (MR >= 4)
      if (q4_halves(M, x.G) && MR >= (x.G >= HALVES_LONG ? 4 : 5))
        return block_rows_q4_halves<MR, VNNI, L>(xm, wb, bias, y + m * ldy, ldy, ncols);
    block_rows_q4<MR, 1, VNNI, L>(xm, wb, bias, y + m * ldy, ldy, ncols);
  });
}

template <bool VNNI, int L>
void q4_avx512_rows(const Q4Args& a, int64_t b0, int64_t b1) {
  const int64_t M = a.M, n = a.n, stride = q4_block_bytes(q4_size(L), a.G);  // bytes per block
  auto bias_at = [&](int64_t b) { return a.bias ? a.bias + b * NB : nullptr; };
  int64_t b = b0;
  if (M == 1 && four_streams())
    for (; b + 3 < b1; b += 4)
      run_rows_q4<4, VNNI, L>(a.x, M, a.w + b * stride, bias_at(b), a.y + b * NB, n, std::min(4 * NB, n - b * NB));
  if (M <= 3 && row_streams() != 1)
    for (; b + 1 < b1; b += 2)
      run_rows_q4<2, VNNI, L>(a.x, M, a.w + b * stride, bias_at(b), a.y + b * NB, n, std::min(2 * NB, n - b * NB));
  for (; b < b1; ++b)
    run_rows_q4<1, VNNI, L>(a.x, M, a.w + b * stride, bias_at(b), a.y + b * NB, n, std::min(NB, n - b * NB));
}

// (each layout in a copy of its own: the symmetric one's offsets -8 s computed, the super-block
// one's scales and offsets from codes, the strides constants)
template <bool VNNI>
void q4_avx512_blocks(const Q4Args& a, int64_t b0, int64_t b1) {
  switch (q4_layout(a.gb)) {
    case Q4_SYM: return q4_avx512_rows<VNNI, Q4_SYM>(a, b0, b1);
    case Q4_SUPER: return q4_avx512_rows<VNNI, Q4_SUPER>(a, b0, b1);
    default: return q4_avx512_rows<VNNI, Q4_ASYM>(a, b0, b1);
  }
}

void q4_avx2(const Q4Args& a, int64_t b0, int64_t b1);
bool amx_takes(int64_t rows, bool int4);  // (blocked_amx.h)
void q4_amx(const Q4Args& a, int64_t b0, int64_t b1);

// AMX for several rows where it runs (blocked_amx.h); else AVX-512 VNNI (Intel since Cascade
// Lake, AMD Zen 4); AVX-512 BW's maddubs + madd without it (or with vnni_allowed off); a CPU with
// AVX-512F alone (Knights Landing) takes the AVX2 kernel.
void q4_avx512(const Q4Args& a, int64_t b0, int64_t b1) {
  if (a.gb != QSB && amx_takes(a.M, true)) return q4_amx(a, b0, b1);  // (AMX: not the super-block layout)
  if (cpu_avx512_vnni() && vnni_allowed.load(std::memory_order_relaxed)) return q4_avx512_blocks<true>(a, b0, b1);
  if (cpu_avx512_bw()) return q4_avx512_blocks<false>(a, b0, b1);
  q4_avx2(a, b0, b1);
}

// AVX2: dot4x16 / finish4x16 on 8 lanes (vpdpbusd of AVX-VNNI, or maddubs into int16 sums).
template <bool VNNI>
__attribute__((target("avx2,fma,f16c,avxvnni"))) inline __m256i dot4x8(__m256i acc, __m256i w, __m256i a) {
  if constexpr (VNNI) return _mm256_dpbusd_avx_epi32(acc, w, a);
  else return _mm256_add_epi16(acc, _mm256_maddubs_epi16(w, a));
}
template <bool VNNI>
__attribute__((target("avx2,fma,f16c,avxvnni"))) inline __m256i finish4x8(__m256i acc) {
  if constexpr (VNNI) return acc;
  else return _mm256_madd_epi16(acc, _mm256_set1_epi16(1));
}

// Outputs o .. o + 7's scales and offsets in group g (piece: its piece in the block at wb), layout L.
template <int L>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline void q4_scales8(const uint8_t* wb, int64_t g,
                                                                               const uint8_t* piece, int64_t o,
                                                                               __m256& sc, __m256& of) {
  if constexpr (L == Q4_SUPER) {
    const uint8_t* h = q4_header(wb, g);
    const __m128i cs = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(piece + q4_code_at(o)));
    const __m128i co = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(piece + q4_code_at(o) + 32));
    sc = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(cs)),
                       _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 2 * o))));
    of = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(co)),
                       _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 128 + 2 * o))));
  } else {
    sc = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(piece + 1024 + 2 * o)));
    of = L == Q4_SYM ? _mm256_mul_ps(sc, _mm256_set1_ps(-8.f))
                     : _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(piece + 1152 + 2 * o)));
  }
}

// AVX2 int4, one group of one block: MR rows x NH half-chunks from t0 (half-chunk t: 32 bytes at
// 64 (t / 2) + 32 (t % 2) of each quad; its low nibbles are outputs 32 (t / 2) + 8 (t % 2) .. + 7,
// its high ones 16 further). The group's integer sums in registers (MR * 2NH), the running sums in
// y, as block_rows_q4.
// FULL: a whole block (every block of a matrix but a partial last one), whose outputs need no checks.
template <int MR, int NH, bool VNNI, int L, bool FULL>
__attribute__((target("avx2,fma,f16c,avxvnni"))) void group_q4_avx2(const Q4Act& x, int64_t g, const uint8_t* wb,
                                                                    const uint8_t* piece, int t0, float* y, int64_t ldy,
                                                                    int64_t ncols) {
  // The sums: VNNI's from zero; maddubs's from the first quad's products (no zeroed registers to add
  // them to: GCC kept those on the stack). The same exact integer sums: on an AMD EPYC Zen 3, 6 rows
  // 0.91x the time, 9 rows 0.94x, a 338-row prefill 0.94x (1-5 rows the same; same bits).
  __m256i acc[MR][2 * NH];
  if constexpr (VNNI) {
#pragma GCC unroll 8
    for (int v = 0; v < 2 * NH; ++v)
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) acc[r][v] = _mm256_setzero_si256();
  }
  const __m256i low = _mm256_set1_epi8(15);
#pragma GCC unroll 8
  for (int c = 0; c < 8; ++c) {
    if constexpr (MR * 2 * NH + MR + 3 <= 16) {  // the rows' activation quads kept, one half-chunk at a time
      __m256i av[MR];
#pragma GCC unroll 6
      for (int r = 0; r < MR; ++r) av[r] = _mm256_set1_epi32(quad_at(x.q + r * x.ldq + g * QG + 4 * c));
#pragma GCC unroll 4
      for (int t = 0; t < NH; ++t) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(piece + 128 * c + 32 * (t0 + t)));
        const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
#pragma GCC unroll 6
        for (int r = 0; r < MR; ++r) {
          acc[r][2 * t] = VNNI || c ? dot4x8<VNNI>(acc[r][2 * t], lo, av[r]) : _mm256_maddubs_epi16(lo, av[r]);
          acc[r][2 * t + 1] = VNNI || c ? dot4x8<VNNI>(acc[r][2 * t + 1], hi, av[r]) : _mm256_maddubs_epi16(hi, av[r]);
        }
      }
    } else {  // (5-6 rows, one half-chunk) the unpacked weights kept, one row's quad at a time: 12 sums in flight
      static_assert(NH == 1, "one half-chunk");
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(piece + 128 * c + 32 * t0));
      const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
#pragma GCC unroll 6
      for (int r = 0; r < MR; ++r) {
        const __m256i av = _mm256_set1_epi32(quad_at(x.q + r * x.ldq + g * QG + 4 * c));
        acc[r][0] = VNNI || c ? dot4x8<VNNI>(acc[r][0], lo, av) : _mm256_maddubs_epi16(lo, av);
        acc[r][1] = VNNI || c ? dot4x8<VNNI>(acc[r][1], hi, av) : _mm256_maddubs_epi16(hi, av);
      }
    }
    // The sums pinned to registers at each quad (an empty asm that "changes" them): otherwise GCC
    // loads the group's 8 quads of weights ahead, spills them all to the stack and reloads them (all
    // 8 quads unrolled: ~130 stack accesses per call). The same integer sums in the same order.
#pragma GCC unroll 8
    for (int v = 0; v < 2 * NH; ++v)
#pragma GCC unroll 6
      for (int r = 0; r < MR; ++r) asm volatile("" : "+x"(acc[r][v]));
  }
  // (the checks and the scales' pointers out of the way: on an AMD EPYC Zen 3, 1 thread, SmolLM2's
  // matrices at 2-64 rows 0.88-1.03x the time, most near 0.95x; the same bits:
  // benchmarks/results/blocked_rows_full_epilogue_zen3_cpu.md)
  const float *const xd = x.d + g, *const xx = x.xs + g;
#pragma GCC unroll 8
  for (int v = 0; v < 2 * NH; ++v) {
    const int t = t0 + v / 2;
    const int64_t o = 32 * (t / 2) + 8 * (t % 2) + 16 * (v % 2);
    if (!FULL && o >= ncols) continue;
    const int64_t left = FULL ? 8 : ncols - o;
    __m256 sc, of;
    q4_scales8<L>(wb, g, piece, o, sc, of);
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      float* yr = y + r * ldy + o;
      const __m256 tv = _mm256_mul_ps(_mm256_cvtepi32_ps(finish4x8<VNNI>(acc[r][v])), _mm256_set1_ps(xd[r * x.G]));
      const __m256 yv = _mm256_fmadd_ps(tv, sc, load_left(yr, left));
      store_left(yr, _mm256_fmadd_ps(_mm256_set1_ps(xx[r * x.G]), of, yv), left);
    }
  }
}

// Rows [m, m + MR) of one group of one block, NH half-chunks (16 NH outputs) at a time.
template <int MR, int NH, bool VNNI, int L>
void group_q4_rows_avx2(const Q4Args& a, int64_t m, int64_t g, const uint8_t* wb, const uint8_t* piece, float* y,
                        int64_t ncols) {
  const Q4Act xm{a.x.q + m * a.x.ldq, a.x.ldq, a.x.d + m * a.G, a.x.xs + m * a.G, a.G};
  if (ncols == NB) {
    for (int t0 = 0; t0 < 4; t0 += NH) group_q4_avx2<MR, NH, VNNI, L, true>(xm, g, wb, piece, t0, y + m * a.n, a.n, ncols);
    return;
  }
  for (int t0 = 0; t0 < 4; t0 += NH)
    if (32 * (t0 / 2) + 8 * (t0 % 2) < ncols)  // (a half-chunk's first output)
      group_q4_avx2<MR, NH, VNNI, L, false>(xm, g, wb, piece, t0, y + m * a.n, a.n, ncols);
}

// Blocks [b0, b1), group after group (a group's 1280 bytes serve every row and half-chunk from L1),
// the rows in as few passes as the 16 registers allow (row_groups): 5-6 rows take one half-chunk
// at a time with its unpacked weights kept (10-12 sums), 3-4 rows one with their activation quads
// kept (6-8 sums), 2 rows two, 1 row all four. (Groups of 4 before: 6-row groups cut the passes
// and their unpacking by a third and keep 12 dot products in flight.)
template <bool VNNI, int L>
__attribute__((target("avx2,fma,f16c"))) void q4_avx2_rows(const Q4Args& a, int64_t b0, int64_t b1) {
  constexpr int64_t gb = q4_size(L), pb = q4_piece_bytes(gb);
  // Where prefetch_ahead() is 0 (AMD: the hardware's prefetchers alone), six rows or more still
  // prefetch two groups ahead: there each group's passes from L1 take long enough that the
  // hardware's stream falls behind. On an AMD EPYC Zen 4 (AVX2 forced, 1 thread, SmolLM2-1.7B's
  // layer shapes from DRAM, 3 paired runs: benchmarks/results/blocked_rows_dram_prefetch_zen4_cpu.md)
  // 9 rows took 0.71-0.85x the time, 6 rows 0.86-1.01x; in single runs 16 rows 0.76x, 48 rows 0.91x,
  // SmolLM2's shapes 9-16 rows 0.80-0.86x. One group ahead was about as good, but at 3-5 rows either
  // was 2-7% slower (the same bits either way).
  const int pf = prefetch_ahead() ? prefetch_ahead() : a.M >= 6 ? int(2 * pb) : 0;
  const int64_t M = a.M, G = a.G, ld = a.n, streams = avx2_streams(M, true);
  for (int64_t b = b0; b < b1; b += streams) {
    const int64_t nb = std::min(streams, b1 - b);  // blocks b .. b + nb - 1, group after group
    for (int64_t i = b; i < b + nb; ++i) {  // the running sums start from the bias
      const int64_t ncols = std::min(NB, a.n - i * NB);
      for (int64_t r = 0; r < M; ++r)
        for (int64_t c = 0; c < ncols; ++c) a.y[r * ld + i * NB + c] = a.bias ? a.bias[i * NB + c] : 0.f;
    }
    for (int64_t g = 0; g < G; ++g)
      for (int64_t i = b; i < b + nb; ++i) {
        const uint8_t* wb = a.w + i * q4_block_bytes(gb, G);
        const uint8_t* piece = q4_piece(wb, gb, g);
        float* y = a.y + i * NB;
        const int64_t ncols = std::min(NB, a.n - i * NB);
        if (pf) {
#pragma GCC unroll 4
          for (int line = 0; line < int(pb / 64); ++line)
            _mm_prefetch(reinterpret_cast<const char*>(piece) + pf + 64 * line, _MM_HINT_T0);
        }
        row_groups(M, [&](auto mr, int64_t m) {  // 3-6 rows over one half-chunk, 2 over two, 1 over all four
          constexpr int MR = decltype(mr)::value;
          group_q4_rows_avx2<MR, MR >= 3 ? 1 : MR == 2 ? 2 : 4, VNNI, L>(a, m, g, wb, piece, y, ncols);
        });
      }
  }
}

template <bool VNNI>
void q4_avx2_blocks(const Q4Args& a, int64_t b0, int64_t b1) {
  switch (q4_layout(a.gb)) {
    case Q4_SYM: return q4_avx2_rows<VNNI, Q4_SYM>(a, b0, b1);
    case Q4_SUPER: return q4_avx2_rows<VNNI, Q4_SUPER>(a, b0, b1);
    default: return q4_avx2_rows<VNNI, Q4_ASYM>(a, b0, b1);
  }
}

// AVX-VNNI's vpdpbusd on 8 lanes where the CPU has it (Intel since Alder Lake / Sapphire Rapids,
// AMD Zen 5) and vnni_allowed; maddubs + madd elsewhere.
void q4_avx2(const Q4Args& a, int64_t b0, int64_t b1) {
  if (cpu_avx_vnni() && vnni_allowed.load(std::memory_order_relaxed)) return q4_avx2_blocks<true>(a, b0, b1);
  q4_avx2_blocks<false>(a, b0, b1);
}

// q4_quantize's formula on 8-float vectors (also the AVX-512 path's: the same bits; a group is
// four vectors either way). Per group: |x| and the finiteness check per lane, the maximum
// reduced across lanes (exact), d and 1 / d as scalars, then (x * (1 / d) + m) - m, the clamp, an
// exact conversion, and the bytes packed back into input order.
__attribute__((target("avx2,fma,f16c"))) void quantize_avx2(const float* x, int64_t ldx, int64_t M, int64_t G,
                                                            int8_t* q, float* d, float* xs, int32_t* sums) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 fmax = _mm256_set1_ps(std::numeric_limits<float>::max());
  const __m256 round_magic = _mm256_set1_ps(12582912.f);
  const __m256 hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // (packs interleaves the 128-bit lanes)
  for (int64_t r = 0; r < M; ++r)
    for (int64_t g = 0; g < G; ++g) {
      const float* xg = x + r * ldx + g * QG;
      int8_t* qg = q + r * G * QG + g * QG;
      __m256 v[4], a[4];
      int finite = 0xff;
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(xg + 8 * i);
        a[i] = _mm256_and_ps(v[i], absmask);
        finite &= _mm256_movemask_ps(_mm256_cmp_ps(a[i], fmax, _CMP_LE_OQ));  // (false for NaN too)
      }
      const __m256 m8 = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
      const int64_t at = r * G + g;
      if (finite != 0xff) {
        std::memset(qg, 0, QG);
        d[at] = xs[at] = std::numeric_limits<float>::quiet_NaN();
        if (sums) sums[at] = 0;
        continue;
      }
      const float dg = amax / 127.f;
      const __m256 id = _mm256_set1_ps(dg >= std::numeric_limits<float>::min() ? 1.f / dg : 0.f);
      __m256i n[4];
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        const __m256 t = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(v[i], id), round_magic), round_magic);
        n[i] = _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(t, lo), hi));  // (an integer already: exact)
      }
      const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qg), _mm256_permutevar8x32_epi32(bytes, order));
      const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
      const int32_t sum = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1)));
      d[at] = dg;
      xs[at] = dg * float(sum);
      if (sums) sums[at] = sum;
    }
}

#endif  // QD_X86

// ---- int8: 8-bit weights with a scale per output, times int8 activations (integer dot products) ----
//
// Weights: q in [-127, 127] and a float32 scale s per output (w = q s; model/formats.py's
// int8_quantize). Layout (int8): packed (N/64, Kq, 256), Kq = 8 ceil(K / 32) quads of four
// inputs (K zero-padded to whole groups of 32): block b's quad c is 256 bytes, bytes 4n .. 4n + 3
// the inputs 4c .. 4c + 3 of output 64b + n (zero past N and past K). Each 32-bit lane is four
// consecutive inputs of one output, the operand of vpdpbusd (maddubs + madd, NEON's sdot or
// vmull + vpadal) against four activation bytes broadcast to every lane; a vector of 16 (AVX-512),
// 8 (AVX2) or 4 (NEON) lanes is 16, 8 or 4 adjacent outputs; a block's group of 32 inputs is one
// contiguous 2 KB piece.
//
// Activations: the int4 section's q4_quantize, the same formula and quantisers (one activation
// quantisation in the library, llama.cpp's Q8_0 formula): per row and group g of 32 inputs (of the row
// zero-padded to 32 Kq / 8), int8 a_k and a float32 scale d_g (NaN for a group holding a NaN or
// an infinity: its row's outputs are NaN).
//
// The spec. Per row and output, on every path, in this order (float32, one rounding per operation):
//   acc = 0;  for g = 0 .. G-1:  acc = fma(float(I_g), d_g, acc);    y = fma(acc, s, bias (or 0))
// with I_g = sum_{k in g} a_k q_k exact in int32 (|I_g| <= 32 * 127 * 127 < 2^24: float(I_g) is
// exact too). So y = bias + s sum_g d_g I_g: the dequantised weights times the dequantised
// activations (what llama.cpp's Q8_0 x Q8_0 computes, with one scale per output instead of per
// block, rounded in its own order). The integer sums are exact in any order and the float
// epilogue is fixed, so a row's result has the same bits on every path, at any row count, beside
// any other rows and on any thread count (the int8 format's row-invariance, which keeps a verify
// step's rows equal to decode rows).
//
// The integer sums per path: AVX-512 VNNI / AVX-VNNI's vpdpbusd multiplies unsigned by signed
// bytes, so the weights go in as q xor 0x80 = q + 128 (unsigned) and each group's sums start
// from -128 sum_k a_k (Q8Act::asum); without VNNI, maddubs(|q|, a with q's sign) (pairs of
// products: at most 2 * 127 * 127 = 32258, never saturating), madd with ones into int32; NEON:
// sdot (DotProd) or vmull_s8 + a pairwise add + vpadal. All exact.
constexpr int64_t Q8B = QG * NB;  // bytes per (block, group): 2048

// A call's quantised activations: q (M, ldq) int8, d and asum (M, G) (asum: sum_k a_k per group).
struct Q8Act {
  const int8_t* q;
  int64_t ldq;
  const float* d;
  const int32_t* asum;
  int64_t G;       // groups per row (the row stride of d and asum)
  int64_t ng = 0;  // groups a kernel sums (from q, d, asum as given), 0: all G (k_chunk)
  int64_t g0 = 0;  // where those groups start in the row (q, d and asum point there already)
  Q8Act rows_from(int64_t m) const { return {q + m * ldq, ldq, d + m * G, asum + m * G, G, ng, g0}; }
  int64_t groups() const { return ng ? ng : G; }
  bool first() const { return g0 == 0; }            // the running sums start from zero
  bool last() const { return g0 + groups() == G; }  // then the epilogue y = fma(acc, s, bias)
};

// The arguments of an int8 blocked matmul, for the paths' block loops.
struct Q8Args {
  Q8Act x;
  int64_t M;
  const int8_t* w;  // packed (nblk, 8 G, 256)
  const float *scale, *bias;  // scale (n,); bias (n,) or null
  float* y;                   // (M, n)
  int64_t n;
};

// The activations of rows [0, M) of x (M, K), zero-padded to G * 32 inputs: q (M, G * 32), d and
// asum (M, G); `pad` is scratch of G * 32 floats (used where K is not whole groups); `quant`: the
// path's quantiser (Paths::quant: the same bits on every path).
inline void q8_quantize(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t G, int8_t* q, float* d,
                        int32_t* asum, float* xs, float* pad, QuantizeFn quant) {
  if (K == G * QG) return quant(x, ldx, M, G, q, d, xs, asum);
  for (int64_t r = 0; r < M; ++r) {
    std::memcpy(pad, x + r * ldx, K * sizeof(float));
    std::fill(pad + K, pad + G * QG, 0.f);
    quant(pad, G * QG, 1, G, q + r * G * QG, d + r * G, xs + r * G, asum + r * G);
  }
}

// The portable path: the same integer sums and the same epilogue, one row at a time.
void q8_portable(const Q8Args& a, int64_t b0, int64_t b1) {
  const int64_t G = a.x.G;
  for (int64_t b = b0; b < b1; ++b) {
    const int8_t* wb = a.w + b * G * Q8B;
    const int64_t ncols = std::min(NB, a.n - b * NB);
    for (int64_t r = 0; r < a.M; ++r) {
      const int8_t* ar = a.x.q + r * a.x.ldq;
      for (int64_t n = 0; n < ncols; ++n) {
        float acc = 0.f;
        for (int64_t g = 0; g < G; ++g) {
          int32_t isum = 0;
          for (int64_t k = 0; k < QG; ++k) isum += int32_t(ar[g * QG + k]) * int32_t(wb[g * Q8B + 256 * (k / 4) + 4 * n + k % 4]);
          acc = std::fma(float(isum), a.x.d[r * G + g], acc);
        }
        const int64_t o = b * NB + n;
        a.y[r * a.n + o] = std::fma(acc, a.scale[o], a.bias ? a.bias[o] : 0.f);
      }
    }
  }
}

#if QD_X86
#include "blocked_amx.h"  // AMX: int8 and int4 calls of several rows (a part of this file, in its namespace)

// AVX-512: one quad's products of a weight vector (16 outputs) and a row's broadcast quad, added
// into the int32 sums. VNNI: w is q xor 0x80 (the caller's), the sums started from -128 asum.
// Without: maddubs(|q|, a negated where q < 0), madd with ones.
template <bool VNNI>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline __m512i q8_dot16(__m512i acc, __m512i w, __m512i a) {
  if constexpr (VNNI) {
    return _mm512_dpbusd_epi32(acc, w, a);
  } else {
    const __m512i sa = _mm512_mask_sub_epi8(a, _mm512_movepi8_mask(w), _mm512_setzero_si512(), a);
    acc = _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(w), sa), _mm512_set1_epi16(1)));
    asm("" : "+v"(acc));  // (a chain, as vpdpbusd's: else GCC reassociates the adds and spills every product)
    return acc;
  }
}

// MR rows over NBLK adjacent blocks (`stride` bytes apart), all groups: a group's integer sums in
// registers (MR * 4 * NBLK), the running float sums in y itself (in L1), updated once per group;
// each weight vector loaded once for all MR rows. Then y = fma(acc, s, bias).
template <int MR, int NBLK, bool VNNI>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void block_rows_q8(const Q8Act& x, const int8_t* wb,
                                                                          int64_t stride, const float* scale,
                                                                          const float* bias, float* y, int64_t ldy,
                                                                          int64_t ncols) {
  const int pf = prefetch_ahead();  // (0 on AMD: the hardware's prefetchers alone)
  constexpr int V = 4 * NBLK;
  const int64_t G = x.G, NG = x.groups();
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  if (x.first())
#pragma GCC unroll 16
    for (int j = 0; j < V; ++j)
#pragma GCC unroll 6
      for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(y + r * ldy + 16 * j, tail_mask(ncols - 16 * j), _mm512_setzero_ps());
  for (int64_t g = 0; g < NG; ++g) {
    __m512i acc[MR][V];
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      const __m512i init = VNNI ? _mm512_set1_epi32(-128 * x.asum[r * G + g]) : _mm512_setzero_si512();
#pragma GCC unroll 16
      for (int j = 0; j < V; ++j) acc[r][j] = init;
    }
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
#pragma GCC unroll 4
      for (int blk = 0; blk < NBLK; ++blk) {  // the piece's 32 lines PF bytes ahead, 4 a quad
        const char* ahead = reinterpret_cast<const char*>(wb + blk * stride + g * Q8B + 256 * c) + pf;
        if (pf) {
#pragma GCC unroll 4
          for (int line = 0; line < 4; ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
        }
      }
      if constexpr (MR * V + MR + 2 < 32) {  // the rows' broadcasts kept, one weight vector at a time
        __m512i av[MR];
#pragma GCC unroll 6
        for (int r = 0; r < MR; ++r) av[r] = _mm512_set1_epi32(quad_at(x.q + r * x.ldq + g * QG + 4 * c));
#pragma GCC unroll 16
        for (int j = 0; j < V; ++j) {
          __m512i w = _mm512_loadu_si512(wb + (j / 4) * stride + g * Q8B + 256 * c + 64 * (j % 4));
          if (VNNI) w = _mm512_xor_si512(w, flip);
#pragma GCC unroll 6
          for (int r = 0; r < MR; ++r) acc[r][j] = q8_dot16<VNNI>(acc[r][j], w, av[r]);
        }
      } else {  // the V weight vectors kept, one broadcast at a time
        __m512i w[V];
#pragma GCC unroll 16
        for (int j = 0; j < V; ++j) {
          w[j] = _mm512_loadu_si512(wb + (j / 4) * stride + g * Q8B + 256 * c + 64 * (j % 4));
          if (VNNI) w[j] = _mm512_xor_si512(w[j], flip);
        }
#pragma GCC unroll 6
        for (int r = 0; r < MR; ++r) {
          const __m512i av = _mm512_set1_epi32(quad_at(x.q + r * x.ldq + g * QG + 4 * c));
#pragma GCC unroll 16
          for (int j = 0; j < V; ++j) acc[r][j] = q8_dot16<VNNI>(acc[r][j], w[j], av);
        }
      }
    }
#pragma GCC unroll 16
    for (int j = 0; j < V; ++j) {
      const __mmask16 mask = tail_mask(ncols - 16 * j);
#pragma GCC unroll 6
      for (int r = 0; r < MR; ++r) {
        float* yr = y + r * ldy + 16 * j;
        const __m512 t = _mm512_cvtepi32_ps(acc[r][j]);
        _mm512_mask_storeu_ps(yr, mask, _mm512_fmadd_ps(t, _mm512_set1_ps(x.d[r * G + g]), _mm512_maskz_loadu_ps(mask, yr)));
      }
    }
  }
  if (!x.last()) return;  // (y holds the running sums: the next chunk of groups goes on from them)
#pragma GCC unroll 16
  for (int j = 0; j < V; ++j) {
    const __mmask16 mask = tail_mask(ncols - 16 * j);
    const __m512 s = _mm512_maskz_loadu_ps(mask, scale + 16 * j);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * j) : _mm512_setzero_ps();
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      float* yr = y + r * ldy + 16 * j;
      _mm512_mask_storeu_ps(yr, mask, _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, yr), s, b));
    }
  }
}

// Three to six rows of one block with every sum in registers (block_rows_q8 keeps its running
// float sums in y: a masked load and store per sum and group): the block's two halves (outputs
// 0 .. 31 from each quad's first two lines, 32 .. 63 from its last two) one after the other, each
// over all groups, MR x 2 integer sums and MR x 2 running float sums. The same integer sums and the
// same epilogue per output in the same group order: the same bits. The next block's lines are
// prefetched evenly over both passes (EvenPrefetch, as block_rows_q4_halves: its only prefetch, on
// Intel too, where without it five and six rows took 1.3-1.5x one pass's time), or part `part` of
// `parts` of them where the block's rows are several groups. From q8_halves_from() rows: five on AMD,
// four on Intel (there, 7-12 rows as two groups: run_rows_q8). Measured on an AMD EPYC Zen 4 from DRAM against block_rows_q8
// (SmolLM2's and SmolLM2-1.7B's layer shapes, alternating processes): six rows 0.72x the time at
// 1 thread (median over ten matrices), 0.64x at 2; five rows 0.83x / 0.92x; the 1.7B shape's
// six-row eager step 0.69x at 1 thread, T(6)/T(1) 1.67 -> 1.24 (SmolLM2: 1.47 -> 1.15;
// benchmarks/results/verify_steps_int8_halves_zen4_cpu.md). Four rows in halves were slower than
// block_rows_q8 (1.2-1.45x one row's time against 1.0-1.2), the one-pass kernel with the same
// prefetch stream no faster, and seven rows in halves (31 registers) no faster than 4 + 3. On an
// Intel Xeon (AVX-512 VNNI, 1 thread) four to six rows in halves took 0.70-0.90x one pass's time
// from DRAM (SmolLM2-1.7B's layer matrices; K = 8192's 0.96-1.07x), whole eager steps of four to
// six rows 0.85-0.90x, T(6) / T(1) 1.41 -> 1.23 (the 1.7B shape), 1.44 -> 1.25 (SmolLM2)
// (benchmarks/results/verify_steps_int8_halves_xeon_amx_cpu.md).
template <int MR, bool VNNI>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void block_rows_q8_halves(const Q8Act& x, const int8_t* wb,
                                                                                 int64_t stride, const float* scale,
                                                                                 const float* bias, float* y,
                                                                                 int64_t ldy, int64_t ncols,
                                                                                 int part = 0, int parts = 1) {
  const int64_t G = x.G, NG = x.groups();
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  // the next block's lines of these groups (part `part` of `parts`: the block's row groups share
  // them), evenly over the 2 x NG x 8 quad iterations of both passes
  const int64_t lines = NG * Q8B / 64, l0 = lines * part / parts, l1 = lines * (part + 1) / parts;
  EvenPrefetch even{reinterpret_cast<const char*>(wb) + stride + 64 * l0, l1 - l0, l1 - l0, 2 * NG * 8, 0};
  for (int h = 0; h < 2 && 32 * h < ncols; ++h) {
    __m512 f[MR][2];
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
      for (int e = 0; e < 2; ++e)  // (a later chunk of groups goes on from the sums stored in y)
        f[r][e] = x.first() ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(tail_mask(ncols - 32 * h - 16 * e), y + r * ldy + 32 * h + 16 * e);
    for (int64_t g = 0; g < NG; ++g) {
      const int8_t* piece = wb + g * Q8B + 128 * h;  // (this half's two lines of each quad)
      __m512i acc[MR][2];
#pragma GCC unroll 6
      for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = VNNI ? _mm512_set1_epi32(-128 * x.asum[r * G + g]) : _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) {
        __m512i w0 = _mm512_loadu_si512(piece + 256 * c), w1 = _mm512_loadu_si512(piece + 256 * c + 64);
        if (VNNI) {
          w0 = _mm512_xor_si512(w0, flip);
          w1 = _mm512_xor_si512(w1, flip);
        }
        even.step();
#pragma GCC unroll 6
        for (int r = 0; r < MR; ++r) {
          const __m512i a = _mm512_set1_epi32(quad_at(x.q + r * x.ldq + g * QG + 4 * c));
          acc[r][0] = q8_dot16<VNNI>(acc[r][0], w0, a);
          acc[r][1] = q8_dot16<VNNI>(acc[r][1], w1, a);
        }
      }
#pragma GCC unroll 6
      for (int r = 0; r < MR; ++r) {
        const __m512 d = _mm512_set1_ps(x.d[r * G + g]);
        f[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][0]), d, f[r][0]);
        f[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][1]), d, f[r][1]);
      }
    }
#pragma GCC unroll 2
    for (int e = 0; e < 2; ++e) {
      const __mmask16 mask = tail_mask(ncols - 32 * h - 16 * e);
      if (!x.last()) {
#pragma GCC unroll 6
        for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(y + r * ldy + 32 * h + 16 * e, mask, f[r][e]);
        continue;
      }
      const __m512 s = _mm512_maskz_loadu_ps(mask, scale + 32 * h + 16 * e);
      const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + 32 * h + 16 * e) : _mm512_setzero_ps();
#pragma GCC unroll 6
      for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(y + r * ldy + 32 * h + 16 * e, mask, _mm512_fmadd_ps(f[r][e], s, b));
    }
  }
}

// Rows [0, M) of NBLK adjacent blocks: NBLK = 2: one to three rows on Intel (two read streams: as
// fast as one block at one row, a little faster at two and three; four blocks, the float kernel's
// choice for one row on Intel, were slower here; on AMD one block: row_streams); 1: any, six rows
// at a time, 7 as 4 + 3 (at most 24 integer sums in registers: each weight vector serves six rows,
// faster than two passes of three; groups of 4-6 rows, 5-6 on AMD, in halves: block_rows_q8_halves).
// (Measured with a standalone timing of these functions, SmolLM2's shapes, the Intel Xeon with VNNI.)
template <int NBLK, bool VNNI>
void run_rows_q8(const Q8Act& x, int64_t M, const int8_t* wb, int64_t stride, const float* scale, const float* bias,
                 float* y, int64_t ldy, int64_t ncols) {
  if (NBLK == 2) {
    if (M == 3) block_rows_q8<3, NBLK, VNNI>(x, wb, stride, scale, bias, y, ldy, ncols);
    if (M == 2) block_rows_q8<2, NBLK, VNNI>(x, wb, stride, scale, bias, y, ldy, ncols);
    if (M == 1) block_rows_q8<1, NBLK, VNNI>(x, wb, stride, scale, bias, y, ldy, ncols);
    return;
  }
  int64_t m = 0;
  // from this many rows, up to six, in halves (0: none). Where that is four (Intel), calls of more
  // than 12 rows (prefill chunks where AMX does not take them) keep one pass: halves were measured
  // for verify-sized calls only there.
  const int from = q8_halves_from() == 4 && M > 12 ? 0 : q8_halves_from();
  if (from == 4 && M > 6) {
    // seven to twelve rows (from four in halves: Intel) in two even groups (7: 4 + 3), both in
    // halves, sharing the next block's prefetch stream. On the Intel Xeon (1.7B shape's matrices
    // from DRAM, 1 thread) 7-9 rows took 0.84-0.96x the time of a group of six (or four) in halves
    // and the rest in one pass, which streamed nothing while the second group ran; whole eager steps
    // 0.92-0.98x (benchmarks/results/verify_steps_int8_groups_xeon_amx_cpu.md).
    const int64_t a = (M + 1) / 2, b = M / 2;
    auto run = [&](int64_t rows, int64_t at, int part) {
      const Q8Act xm = x.rows_from(at);
      float* ym = y + at * ldy;
      switch (rows) {
        case 6: return block_rows_q8_halves<6, VNNI>(xm, wb, stride, scale, bias, ym, ldy, ncols, part, 2);
        case 5: return block_rows_q8_halves<5, VNNI>(xm, wb, stride, scale, bias, ym, ldy, ncols, part, 2);
        case 4: return block_rows_q8_halves<4, VNNI>(xm, wb, stride, scale, bias, ym, ldy, ncols, part, 2);
        default: return block_rows_q8_halves<3, VNNI>(xm, wb, stride, scale, bias, ym, ldy, ncols, part, 2);
      }
    };
    run(a, 0, 0);
    run(b, a, 1);
    return;
  }
  auto group = [&](auto mr, const Q8Act& xm, float* ym) {
    constexpr int MR = decltype(mr)::value;
    if (from && MR >= from) block_rows_q8_halves<MR, VNNI>(xm, wb, stride, scale, bias, ym, ldy, ncols);
    else block_rows_q8<MR, 1, VNNI>(xm, wb, stride, scale, bias, ym, ldy, ncols);
  };
  for (; M - m > 7; m += 6) group(std::integral_constant<int, 6>{}, x.rows_from(m), y + m * ldy);
  if (M - m == 7) {
    group(std::integral_constant<int, 4>{}, x.rows_from(m), y + m * ldy);
    m += 4;
  }
  const Q8Act xm = x.rows_from(m);
  float* ym = y + m * ldy;
  switch (M - m) {
    case 6: group(std::integral_constant<int, 6>{}, xm, ym); break;
    case 5: group(std::integral_constant<int, 5>{}, xm, ym); break;
    case 4: group(std::integral_constant<int, 4>{}, xm, ym); break;
    case 3: block_rows_q8<3, 1, VNNI>(xm, wb, stride, scale, bias, ym, ldy, ncols); break;
    case 2: block_rows_q8<2, 1, VNNI>(xm, wb, stride, scale, bias, ym, ldy, ncols); break;
    case 1: block_rows_q8<1, 1, VNNI>(xm, wb, stride, scale, bias, ym, ldy, ncols); break;
    default: break;
  }
}

// Groups per chunk where the AVX-512 int8 kernel takes a call's inputs in chunks, every block over one
// chunk before the next (0: whole blocks). A row group (up to six rows) walks its activations, 40 bytes
// per row and group (32 int8 values, d and the sum), once per pass over a block; where they pass
// L1 they come from L2 again for every block. So calls of 4-12 rows take chunks of groups whose
// activations fit KSPLIT_BYTES, each block's running sums kept in y between chunks (stored and
// loaded exactly, the groups in the same order: the same bits). On an Intel Xeon with AMX (1
// thread, int8, 4,096 outputs from L3), against whole blocks: K = 12,288 0.66-0.72x the time at four
// and six rows, K = 8,192 0.85-0.88x (six rows 1.10x one row's time, against 1.24-1.57x); SmolLM2-1.7B's
// down projection (K = 8,192) from DRAM 0.84-0.92x at four to six rows, 0.83-0.86x at nine (16 KB;
// 32 KB: 0.84-0.93x); its whole int8 steps 0.96x at four and six rows
// (benchmarks/results/verify_steps_int8_kchunks_xeon_amx_cpu.md). Measured there for
// verify-sized calls (4-12 rows) only; AMD (not measured) keeps whole blocks.
// QUICKDRAFT_KSPLIT (bytes, read once; 0: whole blocks) sets the budget on any CPU (tests, benchmarks).
constexpr int64_t KSPLIT_BYTES = 16384;
inline int64_t k_chunk(int64_t M, int64_t G) {
  static const int64_t budget = [] {
    const char* e = std::getenv("QUICKDRAFT_KSPLIT");
    if (e && *e) return std::max<int64_t>(0, std::atoll(e));
    return __builtin_cpu_is("amd") ? int64_t(0) : KSPLIT_BYTES;
  }();
  if (M < 4 || M > 12 || budget == 0) return 0;
  const int64_t gc = std::max<int64_t>(8, budget / (40 * std::min<int64_t>(M, 6)) / 8 * 8);
  return gc < G ? gc : 0;
}

template <bool VNNI>
void q8_avx512_blocks(const Q8Args& a, int64_t b0, int64_t b1) {
  const int64_t M = a.M, n = a.n, stride = a.x.G * Q8B;  // bytes per block
  auto at_block = [&](const float* v, int64_t b) { return v ? v + b * NB : nullptr; };
  if (const int64_t gc = k_chunk(M, a.x.G)) {  // every block over one chunk of groups, then the next chunk
    for (int64_t g0 = 0; g0 < a.x.G; g0 += gc) {
      Q8Act xc = a.x;
      xc.q += g0 * QG;
      xc.d += g0;
      xc.asum += g0;
      xc.ng = std::min(gc, a.x.G - g0);
      xc.g0 = g0;
      for (int64_t b = b0; b < b1; ++b)
        run_rows_q8<1, VNNI>(xc, M, a.w + b * stride + g0 * Q8B, stride, at_block(a.scale, b), at_block(a.bias, b),
                             a.y + b * NB, n, std::min(NB, n - b * NB));
    }
    return;
  }
  auto run = [&](auto nblk_tag, int64_t b) {
    constexpr int NBLK = decltype(nblk_tag)::value;
    run_rows_q8<NBLK, VNNI>(a.x, M, a.w + b * stride, stride, at_block(a.scale, b), at_block(a.bias, b), a.y + b * NB,
                            n, std::min(NBLK * NB, n - b * NB));
  };
  int64_t b = b0;
  if (M <= 3 && row_streams() != 1)
    for (; b + 1 < b1; b += 2) run(std::integral_constant<int, 2>{}, b);
  for (; b < b1; ++b) run(std::integral_constant<int, 1>{}, b);
}

void q8_avx2(const Q8Args& a, int64_t b0, int64_t b1);

// AMX for several rows where it runs (blocked_amx.h); else AVX-512 VNNI; AVX-512 BW's maddubs +
// madd without it (or with vnni_allowed off); a CPU with AVX-512F alone takes the AVX2 kernel (as int4).
void q8_avx512(const Q8Args& a, int64_t b0, int64_t b1) {
  if (amx_takes(a.M, false)) return q8_amx(a, b0, b1);
  if (cpu_avx512_vnni() && vnni_allowed.load(std::memory_order_relaxed)) return q8_avx512_blocks<true>(a, b0, b1);
  if (cpu_avx512_bw()) return q8_avx512_blocks<false>(a, b0, b1);
  q8_avx2(a, b0, b1);
}

// AVX2: q8_dot16 on 8 lanes (AVX-VNNI's vpdpbusd, or maddubs(|q|, sign(a, q)) + madd).
template <bool VNNI>
__attribute__((target("avx2,fma,avxvnni"))) inline __m256i q8_dot8(__m256i acc, __m256i w, __m256i a) {
  if constexpr (VNNI) return _mm256_dpbusd_avx_epi32(acc, w, a);
  acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(a, w)),
                                                _mm256_set1_epi16(1)));
  asm("" : "+x"(acc));  // (a chain, as vpdpbusd's: else GCC reassociates the adds and spills every product)
  return acc;
}

// AVX2, one group of one block: MR rows x V vectors of 8 outputs from vector v0; the group's
// integer sums in registers (MR * V), the running float sums in y.
template <int MR, int V, bool VNNI, bool FULL>  // (FULL: as group_q4_avx2's)
__attribute__((target("avx2,fma,avxvnni"))) void group_q8_avx2(const Q8Act& x, int64_t g, const int8_t* piece, int v0,
                                                              float* y, int64_t ldy, int64_t ncols) {
  __m256i acc[MR][V];
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) {
    const __m256i init = VNNI ? _mm256_set1_epi32(-128 * x.asum[r * x.G + g]) : _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) acc[r][v] = init;
  }
  const __m256i flip = _mm256_set1_epi8(char(0x80));
#pragma GCC unroll 8
  for (int c = 0; c < 8; ++c) {
    __m256i av[MR];
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) av[r] = _mm256_set1_epi32(quad_at(x.q + r * x.ldq + g * QG + 4 * c));
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) {
      __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(piece + 256 * c + 32 * (v0 + v)));
      if (VNNI) w = _mm256_xor_si256(w, flip);
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) acc[r][v] = q8_dot8<VNNI>(acc[r][v], w, av[r]);
    }
    // (vpdpbusd's sums pinned at each quad, as int4's: else GCC loads the group's weights ahead and
    // spills them; the same integer sums in the same order)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v)
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) asm volatile("" : "+x"(acc[r][v]));
  }
  const float* const xd = x.d + g;
#pragma GCC unroll 8
  for (int v = 0; v < V; ++v) {
    const int64_t o = 8 * (v0 + v);
    if (!FULL && o >= ncols) break;
    const int64_t left = FULL ? 8 : ncols - o;
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      float* yr = y + r * ldy + o;
      const __m256 t = _mm256_cvtepi32_ps(acc[r][v]);
      store_left(yr, _mm256_fmadd_ps(t, _mm256_set1_ps(xd[r * x.G]), load_left(yr, left)), left);
    }
  }
}

// Rows [m, m + MR) of one group of one block, V vectors (8 V outputs) at a time.
template <int MR, int V, bool VNNI>
void group_q8_rows_avx2(const Q8Args& a, int64_t m, int64_t g, const int8_t* piece, float* y, int64_t ncols) {
  const Q8Act xm = a.x.rows_from(m);
  if (ncols == NB) {
    for (int v0 = 0; v0 < 8; v0 += V) group_q8_avx2<MR, V, VNNI, true>(xm, g, piece, v0, y + m * a.n, a.n, ncols);
    return;
  }
  for (int v0 = 0; v0 < 8 && 8 * v0 < ncols; v0 += V)
    group_q8_avx2<MR, V, VNNI, false>(xm, g, piece, v0, y + m * a.n, a.n, ncols);
}

// Blocks [b0, b1), group after group (a group's 2 KB serve every row and vector from L1), the
// rows in as few passes as the 16 registers allow: 4 rows over 16 outputs at a time (8 sums),
// 3 rows over 16, 2 rows over 32, 1 row over all 64; more rows go as 4s first.
template <bool VNNI>
__attribute__((target("avx2,fma"))) void q8_avx2_blocks(const Q8Args& a, int64_t b0, int64_t b1) {
  const int pf = prefetch_ahead();  // (0 on AMD: the hardware's prefetchers alone)
  const int64_t M = a.M, G = a.x.G, ld = a.n, streams = avx2_streams(M, false);
  for (int64_t b = b0; b < b1; b += streams) {
    const int64_t nb = std::min(streams, b1 - b);  // blocks b .. b + nb - 1, group after group
    for (int64_t i = b; i < b + nb; ++i) {  // the running sums start from 0
      const int64_t ncols = std::min(NB, a.n - i * NB);
      for (int64_t r = 0; r < M; ++r)
        for (int64_t c = 0; c < ncols; ++c) a.y[r * ld + i * NB + c] = 0.f;
    }
    for (int64_t g = 0; g < G; ++g)
      for (int64_t i = b; i < b + nb; ++i) {
        const int8_t* piece = a.w + i * G * Q8B + g * Q8B;
        float* y = a.y + i * NB;
        const int64_t ncols = std::min(NB, a.n - i * NB);
        if (pf) {
#pragma GCC unroll 4
          for (int line = 0; line < int(Q8B / 64); ++line)
            _mm_prefetch(reinterpret_cast<const char*>(piece) + pf + 64 * line, _MM_HINT_T0);
        }
        int64_t m = 0;
        for (; m + 4 <= M; m += 4) group_q8_rows_avx2<4, 2, VNNI>(a, m, g, piece, y, ncols);
        switch (M - m) {
          case 3: group_q8_rows_avx2<3, 2, VNNI>(a, m, g, piece, y, ncols); break;
          case 2: group_q8_rows_avx2<2, 4, VNNI>(a, m, g, piece, y, ncols); break;
          case 1: group_q8_rows_avx2<1, 8, VNNI>(a, m, g, piece, y, ncols); break;
          default: break;
        }
      }
    for (int64_t i = b; i < b + nb; ++i) {
      float* y = a.y + i * NB;
      const int64_t ncols = std::min(NB, a.n - i * NB);
      for (int64_t r = 0; r < M; ++r)
        for (int64_t o = 0; o < ncols; o += 8) {
          const int64_t left = ncols - o;
          float* yr = y + r * ld + o;
          const __m256 s = load_left(a.scale + i * NB + o, left);
          const __m256 bv = a.bias ? load_left(a.bias + i * NB + o, left) : _mm256_setzero_ps();
          store_left(yr, _mm256_fmadd_ps(load_left(yr, left), s, bv), left);
        }
    }
  }
}

// AVX-VNNI where the CPU has it and vnni_allowed; maddubs + madd elsewhere.
void q8_avx2(const Q8Args& a, int64_t b0, int64_t b1) {
  if (cpu_avx_vnni() && vnni_allowed.load(std::memory_order_relaxed)) return q8_avx2_blocks<true>(a, b0, b1);
  q8_avx2_blocks<false>(a, b0, b1);
}
#endif  // QD_X86

#if QD_ARM
// NEON: four lanes; sdot (the dot-product extension, where vnni_allowed: as int4's dot4x4, in
// assembly so the rest keeps the base instruction set) or vmull_s8 + pairwise add + vpadal.
template <bool DOT>
inline int32x4_t q8_dot4(int32x4_t acc, int8x16_t w, int8x16_t a) {
  if constexpr (DOT) {
    asm(".arch armv8.2-a+dotprod\n\tsdot %0.4s, %1.16b, %2.16b" : "+w"(acc) : "w"(w), "w"(a));
    return acc;
  }
  const int16x8_t p0 = vmull_s8(vget_low_s8(w), vget_low_s8(a)), p1 = vmull_high_s8(w, a);
  return vpadalq_s16(acc, vpaddq_s16(p0, p1));
}

bool q8_arm_dotprod() {
#if defined(__APPLE__)
  return true;
#elif defined(__linux__)
  static const bool yes = (getauxval(AT_HWCAP) & (1ul << 20)) != 0;  // HWCAP_ASIMDDP
  return yes;
#else
  return false;
#endif
}

// One group of one block: MR rows x V vectors of 4 outputs from vector v0; sums in registers
// (MR * V), the running float sums in y.
template <int MR, int V, bool DOT>
void group_q8_neon(const Q8Act& x, int64_t g, const int8_t* piece, int v0, float* y, int64_t ldy, int64_t ncols) {
  int32x4_t acc[MR][V];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = vdupq_n_s32(0);
#pragma GCC unroll 8
  for (int c = 0; c < 8; ++c) {
    int8x16_t av[MR];
    for (int r = 0; r < MR; ++r) av[r] = vreinterpretq_s8_s32(vdupq_n_s32(quad_at(x.q + r * x.ldq + g * QG + 4 * c)));
#pragma GCC unroll 16
    for (int v = 0; v < V; ++v) {
      const int8x16_t w = vld1q_s8(piece + 256 * c + 16 * (v0 + v));
      for (int r = 0; r < MR; ++r) acc[r][v] = q8_dot4<DOT>(acc[r][v], w, av[r]);
    }
  }
  for (int v = 0; v < V; ++v) {
    const int64_t o = 4 * (v0 + v);
    if (o >= ncols) break;
    const int64_t left = ncols - o;
    for (int r = 0; r < MR; ++r) {
      float* yr = y + r * ldy + o;
      const float32x4_t t = vcvtq_f32_s32(acc[r][v]), dv = vdupq_n_f32(x.d[r * x.G + g]);
      if (left >= 4) {
        vst1q_f32(yr, vfmaq_f32(vld1q_f32(yr), t, dv));
      } else {
        float tt[4];
        vst1q_f32(tt, t);
        for (int64_t i = 0; i < left; ++i) yr[i] = std::fma(tt[i], x.d[r * x.G + g], yr[i]);
      }
    }
  }
}

template <int MR, int V, bool DOT>
void group_q8_rows_neon(const Q8Args& a, int64_t m, int64_t g, const int8_t* piece, float* y, int64_t ncols) {
  const Q8Act xm = a.x.rows_from(m);
  for (int v0 = 0; v0 < 16 && 4 * v0 < ncols; v0 += V) group_q8_neon<MR, V, DOT>(xm, g, piece, v0, y + m * a.n, a.n, ncols);
}

// Blocks [b0, b1), group after group: four rows over 16 outputs at a time (16 sums), the three,
// two or one rows left over 16, 32 or 64.
template <bool DOT>
void q8_neon_blocks(const Q8Args& a, int64_t b0, int64_t b1) {
  const int64_t M = a.M, G = a.x.G, ld = a.n;
  for (int64_t b = b0; b < b1; ++b) {
    const int8_t* wb = a.w + b * G * Q8B;
    float* y = a.y + b * NB;
    const int64_t ncols = std::min(NB, a.n - b * NB);
    for (int64_t r = 0; r < M; ++r)
      for (int64_t c = 0; c < ncols; ++c) y[r * ld + c] = 0.f;
    for (int64_t g = 0; g < G; ++g) {
      const int8_t* piece = wb + g * Q8B;
      for (int line = 0; line < int(Q8B / 64); ++line) __builtin_prefetch(piece + PF + 64 * line);
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) group_q8_rows_neon<4, 4, DOT>(a, m, g, piece, y, ncols);
      switch (M - m) {
        case 3: group_q8_rows_neon<3, 4, DOT>(a, m, g, piece, y, ncols); break;
        case 2: group_q8_rows_neon<2, 8, DOT>(a, m, g, piece, y, ncols); break;
        case 1: group_q8_rows_neon<1, 16, DOT>(a, m, g, piece, y, ncols); break;
        default: break;
      }
    }
    for (int64_t r = 0; r < M; ++r)
      for (int64_t c = 0; c < ncols; ++c) {
        const int64_t o = b * NB + c;
        y[r * ld + c] = std::fma(y[r * ld + c], a.scale[o], a.bias ? a.bias[o] : 0.f);
      }
  }
}

void q8_neon(const Q8Args& a, int64_t b0, int64_t b1) {
  if (q8_arm_dotprod() && vnni_allowed.load(std::memory_order_relaxed)) return q8_neon_blocks<true>(a, b0, b1);
  q8_neon_blocks<false>(a, b0, b1);
}
#endif  // QD_ARM

// ---- Attention over the cache for a few query rows (decode and verify steps) -----------------
// out (B, H, T, D) = softmax(q k^T * scale, keys where mask is true) v, per head; query head h
// reads kv head h / (H / H_kv) (grouped-query attention). q (B, H, T, D), k and v (B, H_kv, L, D)
// (views of the cache: any strides but the last), mask (B or 1, 1, T, L) bool. The result has
// the memory order (B, T, H, D), so the output projection reads it without a copy.
//
// Why: PyTorch's CPU flash attention runs a one-query step as BLAS calls of one row over 512-key
// blocks, reading the cache at 8-16 GB/s on this machine's 2 GHz cores; here each kv head's keys
// and values are read once for all the query rows of a pass: one query row 0.46-0.63x PyTorch's time, 12
// rows 0.75-0.95x (benchmarks/results/attention_cpu.json).
//
// Numerics, per query row, the same on every path: the score of key j is 16 FMA chains over d
// (chain l: d = l, l + 16, ..., as 16-float vector lanes), then one fixed tree of adds
// (key_score16), times nothing (q is scaled first); the softmax's max, exponentials (one
// polynomial, within 2 ulp, exp_nonpos) and sum (16 lane sums in key order, a key's lane its rank
// among the keys the row sees, then sum_lanes16's fixed order: ranked_total), and the weighted
// sum of v run in key order (an unseen key's weight is 0: it adds nothing). A token tree's node
// whose key sits in a later slot than its position gets a chain's bits. A row's result
// depends on its own query, its mask row and the keys only, however the rows are grouped and on
// any thread count (row-invariant): a verify step attends for a token as a decode step does.
// Any number of query rows (a long chain, a token tree of any size, a prefill), a pass of up to
// RC (portable, NEON) or RC_X86 (AVX-512, AVX2) rows at a time: a row's bits are those of a
// one-row call, so an exported step (one call of all its rows) and an eager one agree. The x86
// passes go over the keys in blocks of ~32 KB, every row of the pass over a block before the
// next (scores, then after the softmax the weighted sums of v), so a prefill chunk deep in a
// long prompt reads each key and value from memory once per 16 rows, not once per 4; on
// AVX-512, passes of 12 rows or more score 16 rows at once (a row per lane: scores16_avx512).
// Per (row x key) at 4,000 keys and 60 rows per kv head: about PyTorch's time on AVX-512
// (benchmarks/results/attention_rows_cpu.json).
constexpr int RC = 4;       // query rows per pass over a kv head's keys (portable, NEON)
constexpr int RC_X86 = 16;  // the AVX-512 and AVX2 paths: key-blocked passes over up to 16 rows
constexpr int RC_MAX = 16;  // the most rows a pass holds (any path)
constexpr int WIDE_ROWS = 12;  // AVX-512: from this many rows a pass scores 16 rows at once (scores16_avx512)

#if QD_X86
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

#endif  // QD_X86

// The fixed orders of the attention's two reductions (every path): a key's score from its 16
// lane sums, in sum16's tree; a row's total weight from its 16 lane sums (s_l + s_l+8, then
// + 4 lanes apart, then (g0 + g2) + (g1 + g3): the order of GCC's _mm512_reduce_add_ps, which
// the AVX-512 path used before it was written out).
inline float key_score16(const float* a) {
  float S[4];
  for (int q = 0; q < 4; ++q) S[q] = (a[4 * q] + a[4 * q + 2]) + (a[4 * q + 1] + a[4 * q + 3]);
  return (S[0] + S[2]) + (S[1] + S[3]);
}

inline float sum_lanes16(const float* s) {
  float h[8], g[4];
  for (int l = 0; l < 8; ++l) h[l] = s[l + 8] + s[l];
  for (int l = 0; l < 4; ++l) g[l] = h[l + 4] + h[l];
  return (g[0] + g[2]) + (g[1] + g[3]);
}

// exp_nonpos's operations one float at a time (the portable path).
inline float exp_nonpos1(float x) {
  x = x > -87.f ? x : -87.f;  // (max_ps: -87 for a NaN too)
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = std::fma(-n, 0.693359375f, x);
  r = std::fma(-n, -2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  p = std::fma(p, r * r, r + 1.f);
  const uint32_t bits = uint32_t(int32_t(n) + 127) << 23;  // 2^n, n in [-126, 0]: exact, so p 2^n rounds once as scalef
  float two_n;
  std::memcpy(&two_n, &bits, 4);
  return p * two_n;
}

// The element types of the keys and values attend reads: float32, or a 16-bit cache (float16,
// bfloat16) widened to float32 as it is loaded. The widening is exact, so a row's result is the one
// the float32 copies of the same keys and values give, on every path; half the bytes to read.
enum KvType : int { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 };
inline float to_float(F16 h) { return half_to_float(reinterpret_cast<const uint8_t*>(&h.bits)); }
inline int64_t kv_bytes(int kv) { return kv == KV_F32 ? 4 : 2; }

struct AttendArgs {
  const float* q;
  int64_t qs0, qs1, qs2;  // strides of q (B, H, T, D)
  const void *k, *v;      // elements of type kv (strides in elements)
  int64_t ks0, ks1, ks2, vs0, vs1, vs2;
  const bool* mask;
  int64_t ms0, ms2, ms3;  // strides of mask (B, 1, T, L); 0 where broadcast
  float* out;             // (B, T, H, D) contiguous
  int64_t H, T, D, G, L;
  float scale;
  int kv = KV_F32;
};

// A pass's parts (AttendPass::part): a path does its whole pass in one call, or one part per call
// when attend_tasks splits a kv head's work over threads (attend_split).
enum AttendPart : int { PART_SCORES = 1, PART_SOFTMAX = 2, PART_PV = 4, PART_ALL = 7 };
constexpr int64_t EVERY = int64_t(1) << 40;  // a part's key or output range's end: to the last

// One pass of a path: query rows [0, rc) of one kv head, prepared by prepare_pass.
struct AttendPass {
  int rc;
  int64_t D, Lp, last;  // keys [0, last) hold every key a row of this pass sees; Lp: the scores' row stride
  const float* qs;      // rc x D: the scaled queries
  float* s;             // rc x Lp: scores, then weights
  const bool* mrow[RC_MAX];
  int64_t ms3;
  const void *kb, *vb;  // the kv head's keys and values (elements of type kv), rows ks / vs apart
  int64_t ks, vs;
  int kv;
  float* out[RC_MAX];  // each row's D outputs
  float* qt;           // D x 16 floats of scratch (the AVX-512 path's transposed queries)
  float* kt;           // 4 x D floats of scratch: four 16-bit keys widened
  float* inv;          // rc floats: each row's 1 / (its total weight), from the softmax to the weighted sums
  // The part of the pass a call does: all of it, or (x86 paths, a split pass: attend_split) the
  // scores of keys [k0, k1) (multiples of 16 apart, k1 past the last key: to the end), row `row`'s
  // softmax, or the weighted sums of output vectors [c0, c1) of 16 (over every key, in key order).
  int part = PART_ALL;
  int64_t k0 = 0, k1 = EVERY, c0 = 0, c1 = EVERY;
  int row = 0;
};

// The rows a call's softmax covers: all of them, or the one row a split pass's call names.
inline int softmax_first(const AttendPass& p) { return p.part == PART_ALL ? 0 : p.row; }
inline int softmax_end(const AttendPass& p) { return p.part == PART_ALL ? p.rc : p.row + 1; }


// Row r's scores past `last` as -inf (the softmax reads whole groups of 16).
inline void pad_scores(const AttendPass& p, int r) {
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t j = p.last; j < p.Lp; ++j) p.s[r * p.Lp + j] = ninf;
}
inline void pad_scores(const AttendPass& p) {
  for (int r = 0; r < p.rc; ++r) pad_scores(p, r);
}

inline bool key_seen(const AttendPass& p, int r, int64_t j) { return j < p.last && p.mrow[r][j * p.ms3]; }

// Row r's total weight: its 16 lane sums, a key's lane its rank among the keys the row sees (not
// its slot), then sum_lanes16. A token tree's node whose own key sits past its position (its
// siblings' slots between) thus gets the bits of the same token in a chain or a decode step. The
// vector paths add whole groups of 16 seen keys as vectors (rank = slot there) into `lanes`, up to
// the first group with an unseen key (jb; < 0: none), then rank the keys [jb, end) here
// (`end`: past the last group with a seen key). e: the row's weights.
inline float ranked_total(const AttendPass& p, int r, float* lanes, const float* e, int64_t jb, int64_t end) {
  if (jb >= 0)
    for (int64_t j = jb, n = jb; j < end; ++j)
      if (key_seen(p, r, j)) lanes[n++ & 15] += e[j];
  return sum_lanes16(lanes);
}

#if QD_X86
// Keys per block of the key-blocked passes: about 32 KB of keys (or values), so a block stays in
// L1 while every row of the pass goes over it (a multiple of 16).
inline int64_t key_block(int64_t D) { return std::max<int64_t>(16, 8192 / D / 16 * 16); }

// The running sums of sum_j p_r[j] v_j over keys [j0, j1), for R rows and CW vectors of 16 outputs
// (compile-time, so the R x CW sums stay in registers), in key order, starting from zero (j0 = 0)
// or from the sums a previous block left in out (the same chain of FMAs as one pass over all keys:
// a float kept in memory is the float in the register).
template <int R, int CW, typename KV>
__attribute__((target("avx512f"))) void attend_pv(const KV* vb, int64_t vs, const float* p, int64_t ldp,
                                                  int64_t j0, int64_t j1, float* const* out) {
  __m512 acc[R][CW];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CW; ++c) acc[r][c] = j0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(out[r] + 16 * c);
  for (int64_t j = j0; j < j1; ++j) {
    __m512 vv[CW];
    for (int c = 0; c < CW; ++c) vv[c] = load16(vb + j * vs + 16 * c);
    for (int r = 0; r < R; ++r) {
      const __m512 w = _mm512_set1_ps(p[r * ldp + j]);
      for (int c = 0; c < CW; ++c) acc[r][c] = _mm512_fmadd_ps(w, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CW; ++c) _mm512_storeu_ps(out[r] + 16 * c, acc[r][c]);
}

template <int R, typename KV>
void attend_pv_rows(int cw, const KV* vb, int64_t vs, const float* p, int64_t ldp, int64_t j0, int64_t j1,
                    float* const* out) {
  switch (cw) {
    case 1: return attend_pv<R, 1>(vb, vs, p, ldp, j0, j1, out);
    case 2: return attend_pv<R, 2>(vb, vs, p, ldp, j0, j1, out);
    case 3: return attend_pv<R, 3>(vb, vs, p, ldp, j0, j1, out);
    default: return attend_pv<R, 4>(vb, vs, p, ldp, j0, j1, out);
  }
}

template <typename KV>
void attend_pv_dispatch(int rc, int cw, const KV* vb, int64_t vs, const float* p, int64_t ldp, int64_t j0,
                        int64_t j1, float* const* out) {
  switch (rc) {
    case 1: return attend_pv_rows<1>(cw, vb, vs, p, ldp, j0, j1, out);
    case 2: return attend_pv_rows<2>(cw, vb, vs, p, ldp, j0, j1, out);
    case 3: return attend_pv_rows<3>(cw, vb, vs, p, ldp, j0, j1, out);
    default: return attend_pv_rows<4>(cw, vb, vs, p, ldp, j0, j1, out);
  }
}

// Row r's scores of keys [j0, j1), 16 keys at a time: per key, D/16 FMAs into one vector of
// partial sums; then the 16 vectors are summed across lanes together (sum16): ~3 instructions a
// key instead of ~9. Keys past `last` in the final group read key 0 again (always present) and
// are dropped.
template <typename KV>
__attribute__((target("avx512f"))) void scores1_avx512(const AttendPass& p, int r, int64_t j0, int64_t j1) {
  const int64_t D = p.D, last = p.last, nv = D / 16;
  const float* qr = p.qs + r * D;
  const KV* kb = static_cast<const KV*>(p.kb);
  for (int64_t j = j0; j < j1; j += 16) {
    const KV* kj[16];
    for (int u = 0; u < 16; ++u) kj[u] = kb + (j + u < last ? j + u : 0) * p.ks;
    __m512 acc[16];
    const __m512 q0 = _mm512_loadu_ps(qr);
#pragma GCC unroll 16
    for (int u = 0; u < 16; ++u) acc[u] = _mm512_mul_ps(q0, load16(kj[u]));
    for (int64_t c = 1; c < nv; ++c) {
      const __m512 qc = _mm512_loadu_ps(qr + 16 * c);
#pragma GCC unroll 16
      for (int u = 0; u < 16; ++u) acc[u] = _mm512_fmadd_ps(qc, load16(kj[u] + 16 * c), acc[u]);
    }
    __mmask16 seen = 0;
    if (p.ms3 == 1 && j + 16 <= last) {  // 16 mask bytes (0 or 1) to 16 bits
      const __m512i m = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.mrow[r] + j)));
      seen = (__mmask16)_mm512_test_epi32_mask(m, m);
    } else {
      for (int u = 0; u < 16; ++u)
        if (key_seen(p, r, j + u)) seen |= (__mmask16)(1u << u);
    }
    _mm512_storeu_ps(p.s + r * p.Lp + j,
                     _mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), seen, sum16(acc)));
  }
}

// Rows r and r + 1's scores of keys [j0, j1), 8 keys at a time: each key vector loaded feeds both
// rows, and sum16 sums the 16 vectors (8 keys of row r, then the same 8 of row r + 1) in the
// tree it uses for 16 keys of one row (lane u of its result is vector u's sum, whatever the
// vectors are): the bits of scores1_avx512.
template <typename KV>
__attribute__((target("avx512f"))) void scores2_avx512(const AttendPass& p, int r, int64_t j0, int64_t j1) {
  const int64_t D = p.D, last = p.last, nv = D / 16, Lp = p.Lp;
  const float *qa = p.qs + r * D, *qb = qa + D;
  const KV* kb = static_cast<const KV*>(p.kb);
  for (int64_t j = j0; j < j1; j += 8) {
    const KV* kj[8];
    for (int u = 0; u < 8; ++u) kj[u] = kb + (j + u < last ? j + u : 0) * p.ks;
    __m512 acc[16];
    {
      const __m512 q0 = _mm512_loadu_ps(qa), q1 = _mm512_loadu_ps(qb);
#pragma GCC unroll 8
      for (int u = 0; u < 8; ++u) {
        const __m512 k = load16(kj[u]);
        acc[u] = _mm512_mul_ps(q0, k);
        acc[8 + u] = _mm512_mul_ps(q1, k);
      }
    }
    for (int64_t c = 1; c < nv; ++c) {
      const __m512 q0 = _mm512_loadu_ps(qa + 16 * c), q1 = _mm512_loadu_ps(qb + 16 * c);
#pragma GCC unroll 8
      for (int u = 0; u < 8; ++u) {
        const __m512 k = load16(kj[u] + 16 * c);
        acc[u] = _mm512_fmadd_ps(q0, k, acc[u]);
        acc[8 + u] = _mm512_fmadd_ps(q1, k, acc[8 + u]);
      }
    }
    __mmask16 seen = 0;
    if (p.ms3 == 1 && j + 8 <= last) {  // 8 mask bytes of each row to 16 bits
      uint64_t m0, m1;
      std::memcpy(&m0, p.mrow[r] + j, 8);
      std::memcpy(&m1, p.mrow[r + 1] + j, 8);
      const __m512i m = _mm512_cvtepu8_epi32(_mm_set_epi64x((long long)m1, (long long)m0));
      seen = (__mmask16)_mm512_test_epi32_mask(m, m);
    } else {
      for (int u = 0; u < 8; ++u) {
        if (key_seen(p, r, j + u)) seen |= (__mmask16)(1u << u);
        if (key_seen(p, r + 1, j + u)) seen |= (__mmask16)(1u << (8 + u));
      }
    }
    const __m512 sc = _mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), seen, sum16(acc));
    _mm512_mask_storeu_ps(p.s + r * Lp + j, 0x00FF, sc);
    _mm512_mask_storeu_ps(p.s + (r + 1) * Lp + j - 8, 0xFF00, sc);  // (lanes 8-15 only: no byte before the row)
  }
}

// (r_0 ... r_15) -> their transpose: lane u of r_i becomes lane i of r_u (unpacks within 128-bit
// quarters, then quarter shuffles). Moves floats only.
__attribute__((target("avx512f"))) inline void transpose16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // quarter Q of r[4i + e]: rows 4i .. 4i + 3, lane 4Q + e
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 1]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
  }
  __m512 o[16];
  for (int e = 0; e < 4; ++e) {
    const __m512 a = _mm512_shuffle_f32x4(r[e], r[4 + e], 0x88), b = _mm512_shuffle_f32x4(r[e], r[4 + e], 0xDD);
    const __m512 c = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0x88), d = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0xDD);
    o[e] = _mm512_shuffle_f32x4(a, c, 0x88);
    o[8 + e] = _mm512_shuffle_f32x4(a, c, 0xDD);
    o[4 + e] = _mm512_shuffle_f32x4(b, d, 0x88);
    o[12 + e] = _mm512_shuffle_f32x4(b, d, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = o[i];
}

// For four keys kj[0..3] and 16 rows in lanes (qt: the queries transposed, lane r of qt + 16 d is
// row r's q_d): chains la and lb of each key (chain l: q_l k_l, then + q_(l+16c) k_(l+16c) by FMA,
// c = 1 .. nv - 1), added: sum[u] = P_la(u) + P_lb(u). Each query vector loaded feeds the 4 keys.
template <int NV>  // D / 16 (0: read from nv)
__attribute__((target("avx512f"))) inline void chains2(const float* qt, int64_t nv, const float* const* kj, int la,
                                                       int lb, __m512* sum) {
  if (NV) nv = NV;
  __m512 pa[4], pb[4];
  {
    const __m512 qa = _mm512_loadu_ps(qt + 16 * la), qb = _mm512_loadu_ps(qt + 16 * lb);
    for (int u = 0; u < 4; ++u) {
      pa[u] = _mm512_mul_ps(qa, _mm512_set1_ps(kj[u][la]));
      pb[u] = _mm512_mul_ps(qb, _mm512_set1_ps(kj[u][lb]));
    }
  }
#pragma GCC unroll 8
  for (int64_t c = 1; c < nv; ++c) {
    const __m512 qa = _mm512_loadu_ps(qt + 16 * (la + 16 * c)), qb = _mm512_loadu_ps(qt + 16 * (lb + 16 * c));
    for (int u = 0; u < 4; ++u) {
      pa[u] = _mm512_fmadd_ps(qa, _mm512_set1_ps(kj[u][la + 16 * c]), pa[u]);
      pb[u] = _mm512_fmadd_ps(qb, _mm512_set1_ps(kj[u][lb + 16 * c]), pb[u]);
    }
  }
  for (int u = 0; u < 4; ++u) sum[u] = _mm512_add_ps(pa[u], pb[u]);
}

// Quarter Q's sum of four keys: S_Q = (P_4Q + P_4Q+2) + (P_4Q+1 + P_4Q+3) (key_score16's first level).
template <int NV>
__attribute__((target("avx512f"))) inline void quarter4(const float* qt, int64_t nv, const float* const* kj, int Q,
                                                        __m512* s) {
  __m512 a[4], b[4];
  chains2<NV>(qt, nv, kj, 4 * Q, 4 * Q + 2, a);
  chains2<NV>(qt, nv, kj, 4 * Q + 1, 4 * Q + 3, b);
  for (int u = 0; u < 4; ++u) s[u] = _mm512_add_ps(a[u], b[u]);
}

// Rows [0, rc) of a pass (rc <= 16, one per lane of the transposed queries p.qt) scored over keys
// [j0, j1), 16 keys at a time: each key element is broadcast once for the 16 rows and the 16 chains
// of a key's score are summed by plain vector adds in key_score16's tree ((S0 + S2) + (S1 + S3)),
// where scores1_avx512 sums across lanes with shuffles (sum16: the same tree); the 16 keys' scores
// (one vector per key, a row per lane) are then transposed to a vector of 16 keys per row. The bits
// of scores1_avx512; about half its vector instructions per score, so it pays from ~12 rows on.
template <int NV, typename KV>
__attribute__((target("avx512f"))) void scores16_avx512(const AttendPass& p, int64_t j0, int64_t j1) {
  const int64_t nv = p.D / 16, last = p.last;
  const KV* kb = static_cast<const KV*>(p.kb);
  for (int64_t j = j0; j < j1; j += 16) {
    __m512 sc[16];
    for (int g = 0; g < 4; ++g) {
      const float* kj[4];  // (a 16-bit cache's four keys widened into p.kt: each element is broadcast, not loaded)
      for (int u = 0; u < 4; ++u) {
        const KV* src = kb + (j + 4 * g + u < last ? j + 4 * g + u : 0) * p.ks;
        if constexpr (std::is_same<KV, float>::value) {
          kj[u] = src;
        } else {
          for (int64_t c = 0; c < nv; ++c) _mm512_storeu_ps(p.kt + u * p.D + 16 * c, load16(src + 16 * c));
          kj[u] = p.kt + u * p.D;
        }
      }
      __m512 s0[4], s2[4], s1[4];
      quarter4<NV>(p.qt, nv, kj, 0, s0);
      quarter4<NV>(p.qt, nv, kj, 2, s2);
      for (int u = 0; u < 4; ++u) s0[u] = _mm512_add_ps(s0[u], s2[u]);
      quarter4<NV>(p.qt, nv, kj, 1, s1);
      quarter4<NV>(p.qt, nv, kj, 3, s2);
      for (int u = 0; u < 4; ++u) sc[4 * g + u] = _mm512_add_ps(s0[u], _mm512_add_ps(s1[u], s2[u]));
    }
    transpose16(sc);
    for (int r = 0; r < p.rc; ++r) {
      __mmask16 seen = 0;
      if (p.ms3 == 1 && j + 16 <= last) {
        const __m512i m = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.mrow[r] + j)));
        seen = (__mmask16)_mm512_test_epi32_mask(m, m);
      } else {
        for (int u = 0; u < 16; ++u)
          if (key_seen(p, r, j + u)) seen |= (__mmask16)(1u << u);
      }
      _mm512_storeu_ps(p.s + r * p.Lp + j,
                       _mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), seen, sc[r]));
    }
  }
}

// Up to RC_X86 rows of one kv head: the scores of every row over a block of keys (so the block is
// read from memory once for all rows), block after block; each row's softmax; then the weighted
// sums of v, again block after block for all rows (4 rows x 64 outputs in registers at a time).
template <typename KV>
__attribute__((target("avx512f"))) void attend_avx512_kv(AttendPass& p) {
  const int64_t D = p.D, Lp = p.Lp, last = p.last, nv = D / 16, KB = key_block(D);
  const int rc = p.rc;
  float* s = p.s;
  const float ninf = -std::numeric_limits<float>::infinity();
  if (p.part & PART_SCORES) {
    const bool wide = rc >= WIDE_ROWS;
    if (wide)
      for (int64_t d = 0; d < D; ++d)
        for (int r = 0; r < 16; ++r) p.qt[16 * d + r] = r < rc ? p.qs[r * D + d] : 0.f;
    const int64_t k1 = std::min(last, p.k1);
    for (int64_t j0 = p.k0; j0 < k1; j0 += KB) {
      const int64_t j1 = std::min(k1, j0 + KB);
      if (wide) {
        switch (nv) {  // the chains' length known at compile time for the usual head sizes
          case 4: scores16_avx512<4, KV>(p, j0, j1); break;
          case 8: scores16_avx512<8, KV>(p, j0, j1); break;
          default: scores16_avx512<0, KV>(p, j0, j1); break;
        }
        continue;
      }
      int r = 0;
      for (; r + 2 <= rc; r += 2) scores2_avx512<KV>(p, r, j0, j1);
      if (r < rc) scores1_avx512<KV>(p, r, j0, j1);
    }
  }
  if (p.part & PART_SOFTMAX)
    for (int r = softmax_first(p); r < softmax_end(p); ++r) {
      pad_scores(p, r);
      float* sr = s + r * Lp;
      __m512 mx = _mm512_set1_ps(ninf);
      for (int64_t j = 0; j < last; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sr + j));
      const float m = _mm512_reduce_max_ps(mx);
      __m512 sum = _mm512_setzero_ps();
      const __m512 mv = _mm512_set1_ps(m == ninf ? 0.f : m);
      int64_t jb = -1, jl = 0;  // (ranked_total)
      for (int64_t j = 0; j < last; j += 16) {
        const __m512 x = _mm512_loadu_ps(sr + j);
        const __mmask16 seen = _mm512_cmp_ps_mask(x, _mm512_set1_ps(ninf), _CMP_NEQ_OQ);
        const __m512 e = _mm512_maskz_mov_ps(seen, exp_nonpos(_mm512_sub_ps(x, mv)));
        _mm512_storeu_ps(sr + j, e);
        if (jb < 0 && seen == 0xFFFF) sum = _mm512_add_ps(sum, e);
        else if (jb < 0) jb = j;
        if (seen) jl = j + 16;
      }
      float lanes[16];
      _mm512_storeu_ps(lanes, sum);
      const float l = ranked_total(p, r, lanes, sr, jb, std::min(jl, last));
      p.inv[r] = l > 0.f ? 1.f / l : 0.f;  // a row that sees no key gets zeros
    }
  if (!(p.part & PART_PV)) return;
  const int64_t c1 = std::min(nv, p.c1);
  for (int64_t j0 = 0; j0 < last; j0 += KB) {
    const int64_t j1 = std::min(last, j0 + KB);
    for (int r0 = 0; r0 < rc; r0 += 4)
      for (int64_t c0 = p.c0; c0 < c1; c0 += 4) {  // 64 outputs at a time: 4 x 4 sums in registers
        const int cw = (int)std::min<int64_t>(4, c1 - c0);
        float* o[4];
        for (int r = 0; r < 4 && r0 + r < rc; ++r) o[r] = p.out[r0 + r] + 16 * c0;
        attend_pv_dispatch(std::min(4, rc - r0), cw, static_cast<const KV*>(p.vb) + 16 * c0, p.vs, s + r0 * Lp, Lp,
                           j0, j1, o);
      }
  }
  for (int r = 0; r < rc; ++r)  // (a row whose keys are all masked: last may be 0, and its sums zeros)
    for (int64_t c = p.c0; c < c1; ++c) {
      float* o = p.out[r] + 16 * c;
      _mm512_storeu_ps(o, last ? _mm512_mul_ps(_mm512_loadu_ps(o), _mm512_set1_ps(p.inv[r])) : _mm512_setzero_ps());
    }
}

void attend_avx512(AttendPass& p) {
  if (p.kv == KV_F16) return attend_avx512_kv<F16>(p);
  if (p.kv == KV_BF16) return attend_avx512_kv<Bf16>(p);
  attend_avx512_kv<float>(p);
}

// ---- attention on AVX2: the same numbers with 8-float vectors ----

// exp_nonpos on 8 lanes (2^n built from its bits where AVX-512 has scalef: both round p 2^n once).
__attribute__((target("avx2,fma"))) inline __m256 exp_nonpos8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// Four keys' scores from their lane sums, lanes 0-7 (lo) and 8-15 (hi) of each: sum16's tree
// (within 4-lane quarters, then quarters 0 + 2 and 1 + 3, then those two).
// (the quarter sums of four keys: quarter q (of the key's 16 lanes or 8 of them) of key u at lane
// 4 (q % 2) + u)
__attribute__((target("avx2,fma"))) inline __m256 quarters(const __m256* a) {
  const __m256 t0 = _mm256_add_ps(_mm256_unpacklo_ps(a[0], a[1]), _mm256_unpackhi_ps(a[0], a[1]));
  const __m256 t1 = _mm256_add_ps(_mm256_unpacklo_ps(a[2], a[3]), _mm256_unpackhi_ps(a[2], a[3]));
  return _mm256_add_ps(_mm256_shuffle_ps(t0, t1, 0x44), _mm256_shuffle_ps(t0, t1, 0xEE));
}

__attribute__((target("avx2,fma"))) inline __m128 score4(const __m256* lo, const __m256* hi) {
  const __m256 both = _mm256_add_ps(quarters(lo), quarters(hi));  // [S0 + S2 | S1 + S3] of keys 0..3
  return _mm_add_ps(_mm256_castps256_ps128(both), _mm256_extractf128_ps(both, 1));
}

// The running sums of sum_j p_r[j] v_j over keys [j0, j1) for R rows, 16 outputs (two vectors) at
// a time, in key order, from zero (j0 = 0) or from the sums a previous block left in out (as the
// AVX-512 path's attend_pv).
template <int R, typename KV>
__attribute__((target("avx2,fma,f16c"))) void attend_pv_avx2(const AttendPass& p, int r0, int64_t j0, int64_t j1) {
  const KV* vb = static_cast<const KV*>(p.vb);
  for (int64_t c = 16 * p.c0, c1 = std::min(p.D, 16 * p.c1); c < c1; c += 16) {
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h)
        acc[r][h] = j0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(p.out[r0 + r] + c + 8 * h);
    for (int64_t j = j0; j < j1; ++j) {
      const __m256 v0 = load8(vb + j * p.vs + c), v1 = load8(vb + j * p.vs + c + 8);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256 w = _mm256_set1_ps(p.s[(r0 + r) * p.Lp + j]);
        acc[r][0] = _mm256_fmadd_ps(w, v0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(w, v1, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(p.out[r0 + r] + c + 8 * h, acc[r][h]);
  }
}

// Every row's scores, four keys at a time (8 vectors of lane sums), the four keys for all rows
// before the next four (they stay in L1: measured faster here than blocks of 128 keys a row at a
// time); keys past `last` read key 0 and are dropped. The keys KV_AHEAD ahead are prefetched
// into L1 and their values into L2, for the weighted sums after the softmax: a step's cache comes
// from DRAM (the weights streamed through since this layer last ran), and with the hardware's
// prefetchers alone attention waited on it. SmolLM2's steps at a 400-token context, AMD EPYC
// Zen 3, 1 thread: attention per step 0.61-0.92x (int4 weights, medians 0.86x at 1 query row,
// 0.84x at 6; float32 0.84x, 0.85x: benchmarks/results/attend_prefetch_zen3_cpu.md); 24 keys
// ahead measured no better than 16.
constexpr int64_t KV_AHEAD = 16;

// A 16-bit cache's four keys are widened into p.kt once for all rows.
template <typename KV>
__attribute__((target("avx2,fma,f16c"))) void scores_avx2(const AttendPass& p) {
  const int64_t D = p.D, last = std::min(p.last, p.k1), nv = D / 16;  // (keys [k0, last) of the pass's)
  const float ninf = -std::numeric_limits<float>::infinity();
  const KV *kb = static_cast<const KV*>(p.kb), *vb = static_cast<const KV*>(p.vb);
  constexpr int64_t line = 64 / sizeof(KV);  // elements per cache line
  for (int64_t j = p.k0; j < last; j += 4) {
    const float* kj[4];
    for (int u = 0; u < 4; ++u) {
      const KV* src = kb + (j + u < last ? j + u : 0) * p.ks;
      if constexpr (std::is_same<KV, float>::value) {
        kj[u] = src;
      } else {
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(p.kt + u * D + d, load8(src + d));
        kj[u] = p.kt + u * D;
      }
    }
    for (int u = 0; u < 4; ++u)
      if (j + KV_AHEAD + u < last)
        for (int64_t d = 0; d < D; d += line) {
          _mm_prefetch(reinterpret_cast<const char*>(kb + (j + KV_AHEAD + u) * p.ks + d), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(vb + (j + KV_AHEAD + u) * p.vs + d), _MM_HINT_T1);
        }
    for (int r = 0; r < p.rc; ++r) {
    const float* qr = p.qs + r * D;
    __m256 lo[4], hi[4];
    const __m256 q0 = _mm256_loadu_ps(qr), q1 = _mm256_loadu_ps(qr + 8);
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) {
      lo[u] = _mm256_mul_ps(q0, _mm256_loadu_ps(kj[u]));
      hi[u] = _mm256_mul_ps(q1, _mm256_loadu_ps(kj[u] + 8));
    }
    for (int64_t c = 1; c < nv; ++c) {
      const __m256 qa = _mm256_loadu_ps(qr + 16 * c), qb = _mm256_loadu_ps(qr + 16 * c + 8);
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) {
        lo[u] = _mm256_fmadd_ps(qa, _mm256_loadu_ps(kj[u] + 16 * c), lo[u]);
        hi[u] = _mm256_fmadd_ps(qb, _mm256_loadu_ps(kj[u] + 16 * c + 8), hi[u]);
      }
    }
    float sc[4];
    _mm_storeu_ps(sc, score4(lo, hi));
    for (int u = 0; u < 4; ++u) p.s[r * p.Lp + j + u] = key_seen(p, r, j + u) ? sc[u] : ninf;
    }
  }
}

// Up to RC_X86 rows of one kv head; the weighted sums key-blocked as attend_avx512's.
template <typename KV>
__attribute__((target("avx2,fma,f16c"))) void attend_avx2_kv(AttendPass& p) {
  const int64_t D = p.D, Lp = p.Lp, last = p.last, KB = key_block(D);
  const float ninf = -std::numeric_limits<float>::infinity();
  if (p.part & PART_SCORES) scores_avx2<KV>(p);
  if (p.part & PART_SOFTMAX)
    for (int r = softmax_first(p); r < softmax_end(p); ++r) {
      pad_scores(p, r);
      float* sr = p.s + r * Lp;
      __m256 mx = _mm256_set1_ps(ninf);
      for (int64_t j = 0; j < last; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sr + j));
      float m8[8];
      _mm256_storeu_ps(m8, mx);
      float m = ninf;
      for (int l = 0; l < 8; ++l) m = std::max(m, m8[l]);
      const __m256 mv = _mm256_set1_ps(m == ninf ? 0.f : m);
      __m256 sum[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};  // lanes 0-7 and 8-15 of AVX-512's sum
      int64_t jb = -1, jl = 0;  // (ranked_total)
      for (int64_t j = 0; j < last; j += 16) {
        __m256 e[2];
        int seen = 0;
        for (int h = 0; h < 2; ++h) {
          const __m256 x = _mm256_loadu_ps(sr + j + 8 * h);
          const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(ninf), _CMP_NEQ_OQ);
          e[h] = _mm256_and_ps(keep, exp_nonpos8(_mm256_sub_ps(x, mv)));
          _mm256_storeu_ps(sr + j + 8 * h, e[h]);
          seen |= _mm256_movemask_ps(keep) << (8 * h);
        }
        if (jb < 0 && seen == 0xFFFF)
          for (int h = 0; h < 2; ++h) sum[h] = _mm256_add_ps(sum[h], e[h]);
        else if (jb < 0)
          jb = j;
        if (seen) jl = j + 16;
      }
      float lanes[16];
      _mm256_storeu_ps(lanes, sum[0]);
      _mm256_storeu_ps(lanes + 8, sum[1]);
      const float l = ranked_total(p, r, lanes, sr, jb, std::min(jl, last));
      p.inv[r] = l > 0.f ? 1.f / l : 0.f;
    }
  if (!(p.part & PART_PV)) return;
  for (int64_t j0 = 0; j0 < last; j0 += KB) {
    const int64_t j1 = std::min(last, j0 + KB);
    for (int r0 = 0; r0 < p.rc; r0 += 4) switch (std::min(4, p.rc - r0)) {
        case 1: attend_pv_avx2<1, KV>(p, r0, j0, j1); break;
        case 2: attend_pv_avx2<2, KV>(p, r0, j0, j1); break;
        case 3: attend_pv_avx2<3, KV>(p, r0, j0, j1); break;
        default: attend_pv_avx2<4, KV>(p, r0, j0, j1); break;
      }
  }
  for (int r = 0; r < p.rc; ++r)  // (last 0: every row sees no key, zeros)
    for (int64_t c = 16 * p.c0, c1 = std::min(D, 16 * p.c1); c < c1; c += 8) {
      float* o = p.out[r] + c;
      _mm256_storeu_ps(o, last ? _mm256_mul_ps(_mm256_loadu_ps(o), _mm256_set1_ps(p.inv[r])) : _mm256_setzero_ps());
    }
}

void attend_avx2(AttendPass& p) {
  if (p.kv == KV_F16) return attend_avx2_kv<F16>(p);
  if (p.kv == KV_BF16) return attend_avx2_kv<Bf16>(p);
  attend_avx2_kv<float>(p);
}

#endif  // QD_X86

// ---- attention, portable: the same operations one float at a time ----
template <typename KV>
void attend_portable_kv(AttendPass& p) {
  const int64_t D = p.D, Lp = p.Lp, last = p.last;
  const float ninf = -std::numeric_limits<float>::infinity();
  const KV *kb = static_cast<const KV*>(p.kb), *vb = static_cast<const KV*>(p.vb);
  for (int r = 0; r < p.rc; ++r) {
    const float* qr = p.qs + r * D;
    float* sr = p.s + r * Lp;
    for (int64_t j = 0; j < last; ++j) {
      const KV* kj = kb + j * p.ks;
      float lanes[16];
      for (int l = 0; l < 16; ++l) lanes[l] = qr[l] * to_float(kj[l]);
      for (int64_t c = 16; c < D; c += 16)
        for (int l = 0; l < 16; ++l) lanes[l] = std::fma(qr[c + l], to_float(kj[c + l]), lanes[l]);
      sr[j] = key_seen(p, r, j) ? key_score16(lanes) : ninf;
    }
  }
  pad_scores(p);
  for (int r = 0; r < p.rc; ++r) {
    float* sr = p.s + r * Lp;
    float m = ninf;
    for (int64_t j = 0; j < last; ++j) m = std::max(m, sr[j]);
    const float mv = m == ninf ? 0.f : m;
    float lanes[16] = {0.f};
    for (int64_t j = 0; j < last; ++j) {
      const float x = sr[j];
      sr[j] = (x != ninf && x == x) ? exp_nonpos1(x - mv) : 0.f;
    }
    const float l = ranked_total(p, r, lanes, sr, 0, last);  // every key ranked
    const float inv = l > 0.f ? 1.f / l : 0.f;
    for (int64_t d = 0; d < D; ++d) {
      float acc = 0.f;
      for (int64_t j = 0; j < last; ++j) acc = std::fma(sr[j], to_float(vb[j * p.vs + d]), acc);
      p.out[r][d] = acc * inv;
    }
  }
}

void attend_portable(AttendPass& p) {
  if (p.kv == KV_F16) return attend_portable_kv<F16>(p);
  if (p.kv == KV_BF16) return attend_portable_kv<Bf16>(p);
  attend_portable_kv<float>(p);
}

// Rows [0, n) of D 16-bit elements, `stride` apart, as float32 rows in `out` (D apart).
template <typename KV>
void widened_rows(const void* src, int64_t stride, int64_t n, int64_t D, float* out) {
  const KV* s = static_cast<const KV*>(src);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d = 0; d < D; ++d) out[j * D + d] = to_float(s[j * stride + d]);
}

// The floats a pass's buffer holds (prepare_pass).
inline int64_t pass_floats(const AttendArgs& a, bool kv16) {
  const int64_t Lp = (a.L + 15) / 16 * 16;
  return RC_MAX * (a.D + Lp + 1) + 20 * a.D + (a.kv != KV_F32 && !kv16 ? 2 * a.L * a.D : 0);
}

// The pass of query rows [i0, i0 + rc) of kv head hk of batch row b (row i is query head hk * G +
// i / T at query position i % T) in `buf` (pass_floats of it): the scaled queries, the keys any row
// sees.
AttendPass prepare_pass(const AttendArgs& a, int64_t b, int64_t hk, int64_t i0, int rc, float* buf, bool kv16) {
  const int64_t D = a.D, L = a.L, T = a.T;
  const int64_t Lp = (L + 15) / 16 * 16;
  const bool widen = a.kv != KV_F32 && !kv16;
  AttendPass p;
  p.rc = rc;
  p.D = D;
  p.Lp = Lp;
  p.last = 0;
  float* qs = buf;
  p.qs = qs;
  p.s = buf + RC_MAX * D;
  p.inv = buf + RC_MAX * (D + Lp);
  p.qt = p.inv + RC_MAX;
  p.kt = p.qt + 16 * D;
  p.ms3 = a.ms3;
  for (int r = 0; r < rc; ++r) {
    const int64_t i = i0 + r, h = hk * a.G + i / T, t = i % T;
    const float* qp = a.q + b * a.qs0 + h * a.qs1 + t * a.qs2;
    for (int64_t d = 0; d < D; ++d) qs[r * D + d] = qp[d] * a.scale;
    p.mrow[r] = a.mask + b * a.ms0 + t * a.ms2;
    int64_t j = L;
    while (j > p.last && !p.mrow[r][(j - 1) * a.ms3]) --j;
    p.last = std::max(p.last, j);
    p.out[r] = a.out + ((b * T + t) * a.H + h) * D;
  }
  const int64_t es = kv_bytes(a.kv);
  p.kb = static_cast<const char*>(a.k) + (b * a.ks0 + hk * a.ks1) * es;
  p.vb = static_cast<const char*>(a.v) + (b * a.vs0 + hk * a.vs1) * es;
  p.ks = a.ks2;
  p.vs = a.vs2;
  p.kv = a.kv;
  if (widen) {
    float* kw = p.kt + 4 * D;
    float* vw = kw + L * D;
    const auto rows = a.kv == KV_F16 ? widened_rows<F16> : widened_rows<Bf16>;
    rows(p.kb, p.ks, p.last, D, kw);
    rows(p.vb, p.vs, p.last, D, vw);
    p.kb = kw;
    p.vb = vw;
    p.ks = p.vs = D;
    p.kv = KV_F32;
  }
  return p;
}

// A path that reads float32 keys and values only (`kv16` false: NEON) gets a 16-bit cache's keys
// and values [0, last) widened into buf first (the same floats the other paths widen as they load).
void attend_rows(const AttendArgs& a, int64_t b, int64_t hk, int64_t i0, int rc, std::vector<float>& buf,
                 void (*path)(AttendPass&), bool kv16) {
  buf.resize(pass_floats(a, kv16));
  AttendPass p = prepare_pass(a, b, hk, i0, rc, buf.data(), kv16);
  path(p);
}

// ---- ARM NEON (AArch64): 4-float vectors, 32 registers ----
// The same sums as the other paths: vfmaq_f32(a, b, c) is a + b * c rounded once (std::fma(b, c, a)),
// in the same k (key) order; reductions through the shared scalar trees (key_score16, sum_lanes16).
#if QD_ARM

// Eight weights of a block row as two 4-float vectors (bfloat16 widened exactly).
inline void load8_neon(const float* p, float32x4_t& a, float32x4_t& b) {
  a = vld1q_f32(p);
  b = vld1q_f32(p + 4);
}
inline void load8_neon(const Bf16* p, float32x4_t& a, float32x4_t& b) {
  const uint16x8_t u = vld1q_u16(reinterpret_cast<const uint16_t*>(p));
  a = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(u), 16));
  b = vreinterpretq_f32_u32(vshll_n_u16(vget_high_u16(u), 16));
}

// Four floats at p, of which `left` are real (the rest neither read nor written; zeros read).
inline float32x4_t load4_left(const float* p, int64_t left) {
  if (left >= 4) return vld1q_f32(p);
  float t[4] = {0.f, 0.f, 0.f, 0.f};
  for (int64_t i = 0; i < left; ++i) t[i] = p[i];
  return vld1q_f32(t);
}
inline void store4_left(float* p, float32x4_t v, int64_t left) {
  if (left >= 4) {
    vst1q_f32(p, v);
    return;
  }
  float t[4];
  vst1q_f32(t, v);
  for (int64_t i = 0; i < left; ++i) p[i] = t[i];
}

// MR rows x outputs [c0, c0 + 4V) of one block (V even), as block_rows_avx2: MR * V sums in registers.
template <typename W, int MR, int V>
void block_rows_neon(const float* x, int64_t ldx, const W* wb, int64_t K, int64_t c0, const float* bias, float* y,
                     int64_t ldy, int64_t ncols, bool prefetch) {
  float32x4_t acc[MR][V];
  for (int j = 0; j < V; ++j) {
    const int64_t o = c0 + 4 * j;
    const float32x4_t b = bias ? load4_left(bias + o, ncols - o) : vdupq_n_f32(0.f);
    for (int r = 0; r < MR; ++r) acc[r][j] = b;
  }
  for (int64_t k = 0; k < K; ++k) {
    const W* src = wb + k * NB + c0;
    if (prefetch) {
      const char* ahead = reinterpret_cast<const char*>(wb + k * NB) + PF;
      for (int line = 0; line < int(NB * sizeof(W)); line += 64) __builtin_prefetch(ahead + line);
    }
    float32x4_t xv[MR];
    for (int r = 0; r < MR; ++r) xv[r] = vdupq_n_f32(x[r * ldx + k]);
#pragma GCC unroll 8
    for (int j = 0; j < V; j += 2) {
      float32x4_t w0, w1;
      load8_neon(src + 4 * j, w0, w1);
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) {
        acc[r][j] = vfmaq_f32(acc[r][j], xv[r], w0);
        acc[r][j + 1] = vfmaq_f32(acc[r][j + 1], xv[r], w1);
      }
    }
  }
  for (int j = 0; j < V; ++j) {
    const int64_t o = c0 + 4 * j, left = ncols - o;
    if (left <= 0) break;
    for (int r = 0; r < MR; ++r) store4_left(y + r * ldy + o, acc[r][j], left);
  }
}

// Blocks [b0, b1): one row takes the whole block row (16 sums); more rows take it in halves of 32
// outputs, three rows at a time (24 sums), then two, then one.
template <typename W>
void blocks_neon(const MatArgs<W>& a, int64_t b0, int64_t b1) {
  const int64_t M = a.M, ld = a.n;
  for (int64_t b = b0; b < b1; ++b) {
    const W* wb = a.w + b * a.K * NB;
    const float* bias = a.bias ? a.bias + b * NB : nullptr;
    float* y = a.y + b * NB;
    const int64_t ncols = std::min(NB, a.n - b * NB);
    if (M == 1) {
      block_rows_neon<W, 1, 16>(a.x, a.ldx, wb, a.K, 0, bias, y, ld, ncols, true);
      continue;
    }
    for (int64_t c0 = 0; c0 < ncols; c0 += 32) {
      int64_t m = 0;
      for (; m + 3 <= M; m += 3)
        block_rows_neon<W, 3, 8>(a.x + m * a.ldx, a.ldx, wb, a.K, c0, bias, y + m * ld, ld, ncols, c0 == 0 && m == 0);
      for (; m + 2 <= M; m += 2)
        block_rows_neon<W, 2, 8>(a.x + m * a.ldx, a.ldx, wb, a.K, c0, bias, y + m * ld, ld, ncols, c0 == 0 && m == 0);
      if (m < M)
        block_rows_neon<W, 1, 8>(a.x + m * a.ldx, a.ldx, wb, a.K, c0, bias, y + m * ld, ld, ncols, c0 == 0 && m == 0);
    }
  }
}

// int4 on NEON: each 16-byte quarter-chunk of a quad holds 4 lanes (4 outputs x 4 inputs) of low
// nibbles and 4 of high ones. The four-product sums: vmull_s8 on each half (int16 products), a
// pairwise add (pairs of products: at most 2 * 15 * 127, no overflow), then vpadalq_s16 adds the
// pairs of pairs into the int32 sums: exact, as vpdpbusd's.
// With the dot-product extension (Armv8.2 DotProd: Apple M1 on, Graviton 2 on, Cortex-A55 / A76 on),
// sdot does it in one instruction (where vnni_allowed: the switch of the x86 paths' dot products);
// written as assembly so the compiled code keeps the base instruction set (a target attribute
// would let the compiler use Armv8.2 instructions anywhere in the function; the .arch directive
// only lets the assembler accept sdot).
template <bool DOT>
inline int32x4_t dot4x4(int32x4_t acc, int8x16_t w, int8x16_t a) {
  if constexpr (DOT) {
    asm(".arch armv8.2-a+dotprod\n\tsdot %0.4s, %1.16b, %2.16b" : "+w"(acc) : "w"(w), "w"(a));
    return acc;
  }
  const int16x8_t p0 = vmull_s8(vget_low_s8(w), vget_low_s8(a)), p1 = vmull_high_s8(w, a);
  return vpadalq_s16(acc, vpaddq_s16(p0, p1));
}

bool cpu_arm_dotprod() {
#if defined(__APPLE__)
  return true;  // every Apple M-series CPU
#elif defined(__linux__)
  static const bool yes = (getauxval(AT_HWCAP) & (1ul << 20)) != 0;  // HWCAP_ASIMDDP
  return yes;
#else
  return false;
#endif
}

// One group of one block: MR rows x NS quarter-chunks from s0 (quarter-chunk s: 16 bytes at
// 64 (s / 4) + 16 (s % 4) of each quad; low nibbles outputs 32 (s / 4) + 4 (s % 4) .. + 3, high
// ones 16 further). The group's integer sums in registers (MR * 2NS), the running sums in y.
// Outputs o .. o + 3's scales and offsets in group g (piece: its piece in the block at wb), layout gb.
inline void q4_scales4(const uint8_t* wb, int64_t gb, int64_t g, const uint8_t* piece, int64_t o, float32x4_t& sc,
                       float32x4_t& of) {
  if (gb == QSB) {
    const uint8_t* h = q4_header(wb, g);
    uint32_t cs, co;
    std::memcpy(&cs, piece + q4_code_at(o), 4);
    std::memcpy(&co, piece + q4_code_at(o) + 32, 4);
    const uint32x4_t us = vmovl_u16(vget_low_u16(vmovl_u8(vcreate_u8(cs))));
    const int32x4_t os = vmovl_s16(vget_low_s16(vmovl_s8(vcreate_s8(co))));
    sc = vmulq_f32(vcvtq_f32_u32(us), vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t*>(h + 2 * o)))));
    of = vmulq_f32(vcvtq_f32_s32(os), vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t*>(h + 128 + 2 * o)))));
    return;
  }
  sc = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t*>(piece + 1024 + 2 * o))));
  of = gb == QGB_SYM ? vmulq_f32(sc, vdupq_n_f32(-8.f))
                     : vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t*>(piece + 1152 + 2 * o))));
}

template <int MR, int NS, bool DOT>
void group_q4_neon(const Q4Act& x, int64_t g, const uint8_t* wb, int64_t gb, const uint8_t* piece, int s0, float* y,
                   int64_t ldy, int64_t ncols) {
  int32x4_t acc[MR][2 * NS];
  for (int v = 0; v < 2 * NS; ++v)
    for (int r = 0; r < MR; ++r) acc[r][v] = vdupq_n_s32(0);
  const uint8x16_t low = vdupq_n_u8(15);
#pragma GCC unroll 8
  for (int c = 0; c < 8; ++c) {
    int8x16_t av[MR];
    for (int r = 0; r < MR; ++r) av[r] = vreinterpretq_s8_s32(vdupq_n_s32(quad_at(x.q + r * x.ldq + g * QG + 4 * c)));
#pragma GCC unroll 8
    for (int s = 0; s < NS; ++s) {
      const uint8x16_t v = vld1q_u8(piece + 128 * c + 16 * (s0 + s));
      const int8x16_t lo = vreinterpretq_s8_u8(vandq_u8(v, low)), hi = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));
      for (int r = 0; r < MR; ++r) {
        acc[r][2 * s] = dot4x4<DOT>(acc[r][2 * s], lo, av[r]);
        acc[r][2 * s + 1] = dot4x4<DOT>(acc[r][2 * s + 1], hi, av[r]);
      }
    }
  }
  for (int v = 0; v < 2 * NS; ++v) {
    const int s = s0 + v / 2;
    const int64_t o = 32 * (s / 4) + 4 * (s % 4) + 16 * (v % 2);
    if (o >= ncols) continue;
    const int64_t left = ncols - o;
    float32x4_t sc, of;
    q4_scales4(wb, gb, g, piece, o, sc, of);
    for (int r = 0; r < MR; ++r) {
      float* yr = y + r * ldy + o;
      const float32x4_t t = vmulq_f32(vcvtq_f32_s32(acc[r][v]), vdupq_n_f32(x.d[r * x.G + g]));
      const float32x4_t yv = vfmaq_f32(load4_left(yr, left), t, sc);
      store4_left(yr, vfmaq_f32(yv, vdupq_n_f32(x.xs[r * x.G + g]), of), left);
    }
  }
}

// Rows [m, m + MR) of one group of one block, NS quarter-chunks (8 NS outputs) at a time.
template <int MR, int NS, bool DOT>
void group_q4_rows_neon(const Q4Args& a, int64_t m, int64_t g, const uint8_t* wb, const uint8_t* piece, float* y,
                        int64_t ncols) {
  const Q4Act xm{a.x.q + m * a.x.ldq, a.x.ldq, a.x.d + m * a.G, a.x.xs + m * a.G, a.G};
  for (int s0 = 0; s0 < 8; s0 += NS)
    if (32 * (s0 / 4) + 4 * (s0 % 4) < ncols)
      group_q4_neon<MR, NS, DOT>(xm, g, wb, a.gb, piece, s0, y + m * a.n, a.n, ncols);
}

// Blocks [b0, b1), group after group, as q4_avx2: four rows at once over two quarter-chunks (16
// sums), the three, two or one rows left over 2, 4 or 8.
template <bool DOT>
void q4_neon_blocks(const Q4Args& a, int64_t b0, int64_t b1) {
  const int64_t M = a.M, G = a.G, ld = a.n;
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* wb = a.w + b * q4_block_bytes(a.gb, G);
    float* y = a.y + b * NB;
    const int64_t ncols = std::min(NB, a.n - b * NB);
    for (int64_t r = 0; r < M; ++r)  // the running sums start from the bias
      for (int64_t c = 0; c < ncols; ++c) y[r * ld + c] = a.bias ? a.bias[b * NB + c] : 0.f;
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* piece = q4_piece(wb, a.gb, g);
      for (int line = 0; line < int(q4_piece_bytes(a.gb) / 64); ++line) __builtin_prefetch(piece + PF + 64 * line);
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) group_q4_rows_neon<4, 2, DOT>(a, m, g, wb, piece, y, ncols);
      switch (M - m) {
        case 3: group_q4_rows_neon<3, 2, DOT>(a, m, g, wb, piece, y, ncols); break;
        case 2: group_q4_rows_neon<2, 4, DOT>(a, m, g, wb, piece, y, ncols); break;
        case 1: group_q4_rows_neon<1, 8, DOT>(a, m, g, wb, piece, y, ncols); break;
        default: break;
      }
    }
  }
}

void q4_neon(const Q4Args& a, int64_t b0, int64_t b1) {
  if (cpu_arm_dotprod() && vnni_allowed.load(std::memory_order_relaxed)) return q4_neon_blocks<true>(a, b0, b1);
  q4_neon_blocks<false>(a, b0, b1);
}

// q4_quantize's formula on 4-float vectors (as quantize_avx2: the same operations per element, an
// exact maximum across lanes, the same bits).
void quantize_neon(const float* x, int64_t ldx, int64_t M, int64_t G, int8_t* q, float* d, float* xs,
                   int32_t* sums) {
  const float32x4_t fmax = vdupq_n_f32(std::numeric_limits<float>::max());
  const float32x4_t round_magic = vdupq_n_f32(12582912.f), hi = vdupq_n_f32(127.f), lo = vdupq_n_f32(-127.f);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t g = 0; g < G; ++g) {
      const float* xg = x + r * ldx + g * QG;
      int8_t* qg = q + r * G * QG + g * QG;
      float32x4_t v[8], m = vdupq_n_f32(0.f);
      uint32x4_t ok = vdupq_n_u32(~0u);
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        v[i] = vld1q_f32(xg + 4 * i);
        const float32x4_t a = vabsq_f32(v[i]);
        ok = vandq_u32(ok, vcleq_f32(a, fmax));  // (false for NaN too)
        m = vmaxq_f32(m, a);
      }
      const int64_t at = r * G + g;
      if (vminvq_u32(ok) == 0) {
        std::memset(qg, 0, QG);
        d[at] = xs[at] = std::numeric_limits<float>::quiet_NaN();
        if (sums) sums[at] = 0;
        continue;
      }
      const float dg = vmaxvq_f32(m) / 127.f;
      const float32x4_t id = vdupq_n_f32(dg >= std::numeric_limits<float>::min() ? 1.f / dg : 0.f);
      int32x4_t total = vdupq_n_s32(0);
#pragma GCC unroll 4
      for (int i = 0; i < 8; i += 2) {
        int32x4_t n[2];
        for (int j = 0; j < 2; ++j) {
          const float32x4_t t = vsubq_f32(vaddq_f32(vmulq_f32(v[i + j], id), round_magic), round_magic);
          n[j] = vcvtq_s32_f32(vminq_f32(vmaxq_f32(t, lo), hi));  // (an integer already: exact)
          total = vaddq_s32(total, n[j]);
        }
        vst1_s8(qg + 4 * i, vqmovn_s16(vcombine_s16(vqmovn_s32(n[0]), vqmovn_s32(n[1]))));
      }
      const int32_t sum = vaddvq_s32(total);
      d[at] = dg;
      xs[at] = dg * float(sum);
      if (sums) sums[at] = sum;
    }
}

// exp_nonpos on 4 lanes: exp_nonpos1's operations (vfmsq_f32(x, n, c) = fma(-n, c, x); 2^n from its bits).
inline float32x4_t exp_nonpos4(float32x4_t x) {
  x = vmaxq_f32(x, vdupq_n_f32(-87.f));
  const float32x4_t n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504088896341f)));
  float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(0.693359375f));
  r = vfmsq_f32(r, n, vdupq_n_f32(-2.12194440e-4f));
  float32x4_t p = vdupq_n_f32(1.9875691500e-4f);
  p = vfmaq_f32(vdupq_n_f32(1.3981999507e-3f), p, r);
  p = vfmaq_f32(vdupq_n_f32(8.3334519073e-3f), p, r);
  p = vfmaq_f32(vdupq_n_f32(4.1665795894e-2f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.6666665459e-1f), p, r);
  p = vfmaq_f32(vdupq_n_f32(5.0000001201e-1f), p, r);
  p = vfmaq_f32(vaddq_f32(r, vdupq_n_f32(1.f)), p, vmulq_f32(r, r));
  const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
  return vmulq_f32(p, vreinterpretq_f32_s32(e));
}

// out_r = inv_r * sum_j p_r[j] v_j for R rows, 16 outputs (four vectors) at a time, in key order.
template <int R>
void attend_pv_neon(const AttendPass& p, const float* inv) {
  for (int64_t c = 0; c < p.D; c += 16) {
    float32x4_t acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < 4; ++u) acc[r][u] = vdupq_n_f32(0.f);
    for (int64_t j = 0; j < p.last; ++j) {
      const float* vj = static_cast<const float*>(p.vb) + j * p.vs + c;
      const float32x4_t v[4] = {vld1q_f32(vj), vld1q_f32(vj + 4), vld1q_f32(vj + 8), vld1q_f32(vj + 12)};
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const float32x4_t w = vdupq_n_f32(p.s[r * p.Lp + j]);
#pragma GCC unroll 4
        for (int u = 0; u < 4; ++u) acc[r][u] = vfmaq_f32(acc[r][u], w, v[u]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < 4; ++u) vst1q_f32(p.out[r] + c + 4 * u, vmulq_f32(acc[r][u], vdupq_n_f32(inv[r])));
  }
}

void attend_neon(AttendPass& p) {
  const int64_t D = p.D, Lp = p.Lp, last = p.last;
  const float ninf = -std::numeric_limits<float>::infinity();
  // Scores: per key, 16 lane chains over d (four vectors), then key_score16's tree.
  for (int64_t j = 0; j < last; ++j) {
    const float* kj = static_cast<const float*>(p.kb) + j * p.ks;
    const float32x4_t k0 = vld1q_f32(kj), k1 = vld1q_f32(kj + 4), k2 = vld1q_f32(kj + 8), k3 = vld1q_f32(kj + 12);
    for (int r = 0; r < p.rc; ++r) {
      if (!key_seen(p, r, j)) {
        p.s[r * Lp + j] = ninf;
        continue;
      }
      const float* qr = p.qs + r * D;
      float32x4_t a0 = vmulq_f32(vld1q_f32(qr), k0), a1 = vmulq_f32(vld1q_f32(qr + 4), k1);
      float32x4_t a2 = vmulq_f32(vld1q_f32(qr + 8), k2), a3 = vmulq_f32(vld1q_f32(qr + 12), k3);
      for (int64_t c = 16; c < D; c += 16) {
        a0 = vfmaq_f32(a0, vld1q_f32(qr + c), vld1q_f32(kj + c));
        a1 = vfmaq_f32(a1, vld1q_f32(qr + c + 4), vld1q_f32(kj + c + 4));
        a2 = vfmaq_f32(a2, vld1q_f32(qr + c + 8), vld1q_f32(kj + c + 8));
        a3 = vfmaq_f32(a3, vld1q_f32(qr + c + 12), vld1q_f32(kj + c + 12));
      }
      float lanes[16];
      vst1q_f32(lanes, a0);
      vst1q_f32(lanes + 4, a1);
      vst1q_f32(lanes + 8, a2);
      vst1q_f32(lanes + 12, a3);
      p.s[r * Lp + j] = key_score16(lanes);
    }
  }
  pad_scores(p);
  float inv[RC];
  const float32x4_t vninf = vdupq_n_f32(ninf);
  for (int r = 0; r < p.rc; ++r) {
    float* sr = p.s + r * Lp;
    float32x4_t mx = vninf;
    for (int64_t j = 0; j < last; j += 4) mx = vmaxq_f32(mx, vld1q_f32(sr + j));
    const float m = vmaxvq_f32(mx);
    const float32x4_t mv = vdupq_n_f32(m == ninf ? 0.f : m);
    float32x4_t sum[4] = {vdupq_n_f32(0.f), vdupq_n_f32(0.f), vdupq_n_f32(0.f), vdupq_n_f32(0.f)};
    int64_t jb = -1, jl = 0;  // (ranked_total)
    for (int64_t j = 0; j < last; j += 16) {
      float32x4_t e[4];
      uint32x4_t all = vdupq_n_u32(~0u), any = vdupq_n_u32(0u);
      for (int h = 0; h < 4; ++h) {
        const float32x4_t x = vld1q_f32(sr + j + 4 * h);
        // a key's weight where its score is neither -inf nor NaN (an ordered "not equal")
        const uint32x4_t keep = vandq_u32(vmvnq_u32(vceqq_f32(x, vninf)), vceqq_f32(x, x));
        e[h] = vreinterpretq_f32_u32(vandq_u32(keep, vreinterpretq_u32_f32(exp_nonpos4(vsubq_f32(x, mv)))));
        vst1q_f32(sr + j + 4 * h, e[h]);
        all = vandq_u32(all, keep);
        any = vorrq_u32(any, keep);
      }
      if (jb < 0 && vminvq_u32(all) != 0u)
        for (int h = 0; h < 4; ++h) sum[h] = vaddq_f32(sum[h], e[h]);
      else if (jb < 0)
        jb = j;
      if (vmaxvq_u32(any) != 0u) jl = j + 16;
    }
    float lanes[16];
    for (int h = 0; h < 4; ++h) vst1q_f32(lanes + 4 * h, sum[h]);
    const float l = ranked_total(p, r, lanes, sr, jb, std::min(jl, last));
    inv[r] = l > 0.f ? 1.f / l : 0.f;
  }
  switch (p.rc) {
    case 1: return attend_pv_neon<1>(p, inv);
    case 2: return attend_pv_neon<2>(p, inv);
    case 3: return attend_pv_neon<3>(p, inv);
    default: return attend_pv_neon<4>(p, inv);
  }
}

#endif  // QD_ARM

// ---- RMSNorm: y = (x * r) * w per row, r = 1 / sqrt(mean(x^2) + eps) ----
// One call for what PyTorch's CPU rms_norm does in several operations (measured 16-26 us for one
// 576-float row, against ~2 us for an add: 61 of them in a SmolLM2 decode step). Numerics, per
// row of K floats, the same on every path: 16 running sums, lane l = fma(x_k, x_k, lane l) for
// k = l, l + 16, ... (in k order; zeros past K add nothing); their total in sum_lanes16's fixed
// order; r = 1 / sqrt(total / K + eps) (float32, each operation rounded once); y_k = (x_k * r) * w_k.
// A row's bits depend on that row alone: any row count, thread count and path give the same.
struct NormArgs {
  const float* x;
  int64_t ldx;
  const float* w;
  float* y;
  int64_t ldy, K;
  float eps;
};

inline float norm_scale(const float* lanes, int64_t K, float eps) {
  return 1.f / std::sqrt(sum_lanes16(lanes) / float(K) + eps);
}

// Rows [r0, r1), one float at a time (the portable path; NEON runs it too: a norm is ~1% of a step).
void norm_portable(const NormArgs& a, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* x = a.x + r * a.ldx;
    float* y = a.y + r * a.ldy;
    float s[16] = {0.f};
    for (int64_t k = 0; k < a.K; ++k) s[k % 16] = std::fma(x[k], x[k], s[k % 16]);
    const float inv = norm_scale(s, a.K, a.eps);
    for (int64_t k = 0; k < a.K; ++k) y[k] = (x[k] * inv) * a.w[k];
  }
}

#if QD_X86
// AVX2: lanes 0-7 and 8-15 as two vectors.
__attribute__((target("avx2,fma"))) void norm_avx2(const NormArgs& a, int64_t r0, int64_t r1) {
  const int64_t K = a.K, K16 = K / 16 * 16;
  for (int64_t r = r0; r < r1; ++r) {
    const float* x = a.x + r * a.ldx;
    float* y = a.y + r * a.ldy;
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (int64_t k = 0; k < K16; k += 16) {
      const __m256 u = _mm256_loadu_ps(x + k), v = _mm256_loadu_ps(x + k + 8);
      lo = _mm256_fmadd_ps(u, u, lo);
      hi = _mm256_fmadd_ps(v, v, hi);
    }
    alignas(32) float s[16];
    _mm256_store_ps(s, lo);
    _mm256_store_ps(s + 8, hi);
    for (int64_t k = K16; k < K; ++k) s[k % 16] = std::fma(x[k], x[k], s[k % 16]);
    const float inv = norm_scale(s, K, a.eps);
    const __m256 iv = _mm256_set1_ps(inv);
    int64_t k = 0;
    for (; k + 8 <= K; k += 8)
      _mm256_storeu_ps(y + k, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + k), iv), _mm256_loadu_ps(a.w + k)));
    for (; k < K; ++k) y[k] = (x[k] * inv) * a.w[k];
  }
}

__attribute__((target("avx512f"))) void norm_avx512(const NormArgs& a, int64_t r0, int64_t r1) {
  const int64_t K = a.K, K16 = K / 16 * 16;
  for (int64_t r = r0; r < r1; ++r) {
    const float* x = a.x + r * a.ldx;
    float* y = a.y + r * a.ldy;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t k = 0; k < K16; k += 16) {
      const __m512 u = _mm512_loadu_ps(x + k);
      acc = _mm512_fmadd_ps(u, u, acc);
    }
    alignas(64) float s[16];
    _mm512_store_ps(s, acc);
    for (int64_t k = K16; k < K; ++k) s[k % 16] = std::fma(x[k], x[k], s[k % 16]);
    const float inv = norm_scale(s, K, a.eps);
    const __m512 iv = _mm512_set1_ps(inv);
    for (int64_t k = 0; k < K; k += 16) {
      const __mmask16 m = tail_mask(K - k);
      _mm512_mask_storeu_ps(y + k, m, _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + k), iv),
                                                    _mm512_maskz_loadu_ps(m, a.w + k)));
    }
  }
}
#endif  // QD_X86

// ---- the paths: every kernel per instruction set (the one place that dispatches) ----
struct Paths {
  void (*f32)(const MatArgs<float>&, int64_t, int64_t);
  void (*i8)(const Q8Args&, int64_t, int64_t);
  void (*bf16)(const MatArgs<Bf16>&, int64_t, int64_t);
  void (*q4)(const Q4Args&, int64_t, int64_t);
  void (*attend)(AttendPass&);
  void (*norm)(const NormArgs&, int64_t, int64_t);
  QuantizeFn quant;  // the int8 / int4 activations (q4_quantize's bits)
  int attend_rows;  // the most query rows attend's path takes in one pass (at most RC_MAX)
  bool attend_kv16;  // attend's path reads a 16-bit cache as it is (else attend_rows widens it first)
  bool attend_parts;  // attend's path does a pass's parts one call each (AttendPass::part: attend_split)
};

// By enum Isa; a path this architecture cannot have is empty (cpu_has is false for it: never chosen).
const Paths PATHS[ISA_COUNT] = {
    {blocks_portable<float>, q8_portable, blocks_portable<Bf16>, q4_portable, attend_portable, norm_portable, quantize_portable, RC, true, false},
#if QD_X86
    {blocks_avx2<float>, q8_avx2, blocks_avx2<Bf16>, q4_avx2, attend_avx2, norm_avx2, quantize_avx2, RC_X86, true, true},
    {blocks_avx512<float>, q8_avx512, blocks_avx512<Bf16>, q4_avx512, attend_avx512, norm_avx512, quantize_avx2, RC_X86, true, true},
#else
    {}, {},
#endif
#if QD_ARM
    {blocks_neon<float>, q8_neon, blocks_neon<Bf16>, q4_neon, attend_neon, norm_portable, quantize_neon, RC, false, false},
#else
    {},
#endif
};

const Paths& active_paths() { return PATHS[chosen_isa.load(std::memory_order_relaxed)]; }

template <typename W>
auto path_of(const Paths& p) {
  if constexpr (std::is_same<W, float>::value) return p.f32;
  else return p.bf16;
}

// ---- the drivers' torch-free parts (blocked_mm.cpp adds the checks and PyTorch's threads) ----
// `parallel_for(begin, end, f)` calls f(b0, b1) on pieces of [begin, end), in any order, on any
// threads: every piece's results are independent of the split.

template <typename W, typename For>
void matmul(const Paths& paths, const MatArgs<W>& a, int64_t nblk, For&& parallel_for) {
  const auto path = path_of<W>(paths);
  parallel_for(0, nblk, [&](int64_t b0, int64_t b1) { path(a, b0, b1); });
}

// The integer kernels' calls of many rows (a prefill's chunk) in tiles of ROW_TILE rows: a task
// per (block, tile), a block's tiles consecutive (its weights stay in cache across them; a tile's
// running sums, 48 x 64 floats, stay in L1 across the groups). Threads then split the tasks, not
// whole blocks: SmolLM2's 576-output matrices are 9 blocks, 5 : 4 on two threads. A row's bits do
// not depend on its tile (rows are independent). Calls of up to ROW_TILE rows (decode and verify
// steps) split blocks as before, each block streamed once for all their rows.
constexpr int64_t ROW_TILE = 48;

inline Q8Args rows_of(const Q8Args& a, int64_t r0, int64_t r1) {
  Q8Args t = a;
  t.x = a.x.rows_from(r0);
  t.M = r1 - r0;
  t.y = a.y + r0 * a.n;
  return t;
}

inline Q4Args rows_of(const Q4Args& a, int64_t r0, int64_t r1) {
  Q4Args t = a;
  t.x = {a.x.q + r0 * a.x.ldq, a.x.ldq, a.x.d + r0 * a.x.G, a.x.xs + r0 * a.x.G, a.x.G};
  t.M = r1 - r0;
  t.y = a.y + r0 * a.n;
  return t;
}

template <typename A, typename Run, typename For>
void row_tiled(const A& a, int64_t nblk, Run run, For&& parallel_for) {
  if (a.M <= ROW_TILE) return parallel_for(0, nblk, [&](int64_t b0, int64_t b1) { run(a, b0, b1); });
  const int64_t tiles = (a.M + ROW_TILE - 1) / ROW_TILE;
  parallel_for(0, nblk * tiles, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / tiles, r0 = (t % tiles) * ROW_TILE;
      run(rows_of(a, r0, std::min(a.M, r0 + ROW_TILE)), b, b + 1);
    }
  });
}

template <typename For>
void matmul_q8(const Paths& paths, const Q8Args& a, int64_t nblk, For&& parallel_for) {
  row_tiled(a, nblk, paths.i8, parallel_for);
}

template <typename For>
void matmul_q4(const Paths& paths, const Q4Args& a, int64_t nblk, For&& parallel_for) {
  row_tiled(a, nblk, paths.q4, parallel_for);
}

// Attention split over the threads by keys and outputs (attend_split): off (0), where a call's passes
// are too few for the threads and its keys many (1, the default), or for every call of a path that
// does parts, one thread too (2: tests). The bits are the same either way.
std::atomic<int> attend_split_mode{1};
// Keys from which a call with too few passes is split: SmolLM2 decoding one sequence on 2 threads
// (Intel Xeon, AVX-512 and AVX2 paths) measured the split neutral at 1,000 keys (0.98-1.01x) and
// 1.04-1.11x from 2,000 to 4,000 (benchmarks/results/attend_split_*); with fewer keys the two
// extra parallel regions cost what the even share saves.
constexpr int64_t SPLIT_KEYS = 1024;

// Key segments (and output ranges) per pass for attend_split; 1: the passes run whole.
inline int64_t split_parts(const Paths& paths, const AttendArgs& a, int64_t tasks, int threads) {
  const int mode = attend_split_mode.load(std::memory_order_relaxed);
  if (!paths.attend_parts || mode == 0) return 1;
  const int64_t t = std::max(threads, 1), g = std::gcd(tasks, t);
  if (mode == 2) return std::max<int64_t>(2, t / g);
  if (t < 2 || a.L < SPLIT_KEYS) return 1;
  const int64_t busiest = (tasks + t - 1) / t;  // passes of the busiest thread
  if (4 * busiest * t < 5 * tasks) return 1;   // within 1.25x of an even share: whole passes
  return t / g;  // tasks x parts items: a multiple of the threads
}

// The passes of a call, each in three parts with every thread busy: the scores of a segment of its
// keys (`parts` segments, multiples of 16 keys), then each row's softmax, then the weighted sums of
// a range of its outputs (min(parts, D / 16) ranges of 16-float vectors, each over every key in key
// order). Each part computes exactly what the whole pass does, in the same order per number (a
// key's score is its own; a row's max, exponentials and ranked total are the whole pass's; an
// output's sum runs over the keys in order), so a row's bits are those of a whole pass.
template <typename For>
void attend_split(const Paths& paths, const AttendArgs& a, int64_t B, int64_t Hkv, int64_t n, int64_t rc,
                  int64_t parts, For&& parallel_for) {
  const int64_t rows = a.G * a.T, tasks = B * Hkv * n, floats = pass_floats(a, paths.attend_kv16);
  thread_local std::vector<float> bufs;  // (the calling thread's; the workers write into it)
  bufs.resize(tasks * floats);
  std::vector<AttendPass> passes(tasks);
  for (int64_t task = 0; task < tasks; ++task) {
    const int64_t c = task % n, bh = task / n, i0 = c * rc;
    passes[task] = prepare_pass(a, bh / Hkv, bh % Hkv, i0, (int)std::min<int64_t>(rc, rows - i0),
                                bufs.data() + task * floats, paths.attend_kv16);
  }
  const auto path = paths.attend;
  parallel_for(0, tasks * parts, [&](int64_t i0, int64_t i1) {
    thread_local std::vector<float> scratch;  // this thread's transposed queries and widened keys
    scratch.resize(20 * a.D);
    for (int64_t i = i0; i < i1; ++i) {
      AttendPass p = passes[i / parts];
      const int64_t seg = i % parts, len = (p.last + 16 * parts - 1) / (16 * parts) * 16;
      p.part = PART_SCORES;
      p.k0 = seg * len;
      p.k1 = std::min(p.last, p.k0 + len);
      p.qt = scratch.data();
      p.kt = p.qt + 16 * a.D;
      if (p.k0 < p.k1) path(p);
    }
  });
  parallel_for(0, tasks * rc, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      AttendPass p = passes[i / rc];
      p.part = PART_SOFTMAX;
      p.row = (int)(i % rc);
      if (p.row < p.rc) path(p);
    }
  });
  const int64_t nv = a.D / 16, groups = std::min(parts, nv);
  parallel_for(0, tasks * groups, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      AttendPass p = passes[i / groups];
      const int64_t g = i % groups;
      p.part = PART_PV;
      p.c0 = nv * g / groups;
      p.c1 = nv * (g + 1) / groups;
      path(p);
    }
  });
}

// Attention's tasks: (batch row, kv head, chunk of query rows): chunks as even as the path's
// rows per pass allow (an even count where it can: the AVX-512 path scores rows in pairs). (Smaller
// chunks to even out 3 kv heads over 2 threads were measured slower: each extra chunk reads its
// head's keys again, and the reads are the cost.) Too few tasks for the threads over many keys
// (one sequence of a model with 3 kv heads on 2 threads) are split by keys and outputs instead
// (attend_split). A row's bits do not depend on its chunk or the split. Only for float32,
// D % 16 == 0, T >= 1, L > 0 (the caller checks). `threads`: the ones parallel_for runs on.
template <typename For>
void attend_tasks(const Paths& paths, const AttendArgs& a, int64_t B, int64_t Hkv, For&& parallel_for,
                  int threads = 1) {
  const int64_t rows = a.G * a.T, most = paths.attend_rows;
  const int64_t chunks = (rows + most - 1) / most;
  int64_t rc = (rows + chunks - 1) / chunks;
  if (rc % 2 && rc < most && rc < rows) ++rc;
  const int64_t n = (rows + rc - 1) / rc;
  const int64_t parts = split_parts(paths, a, B * Hkv * n, threads);
  if (parts > 1) return attend_split(paths, a, B, Hkv, n, rc, parts, parallel_for);
  const auto path = paths.attend;
  parallel_for(0, B * Hkv * n, [&](int64_t t0, int64_t t1) {
    thread_local std::vector<float> buf;
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t c = task % n, bh = task / n;
      const int64_t i0 = c * rc;
      attend_rows(a, bh / Hkv, bh % Hkv, i0, (int)std::min<int64_t>(rc, rows - i0), buf, path, paths.attend_kv16);
    }
  });
}

// RMSNorm's rows (independent: any split).
template <typename For>
void rms_norm_rows(const Paths& paths, const NormArgs& a, int64_t M, For&& parallel_for) {
  parallel_for(0, M, [&](int64_t r0, int64_t r1) { paths.norm(a, r0, r1); });
}

}  // namespace
