// AMX (Intel's tile multiply unit, since Sapphire Rapids): the int8 and int4 kernels' calls of
// several rows as tile multiplies. A part of blocked_core.h (included inside its namespace, x86
// only, after the int8 section): the same integer sums, exact, and the same float epilogue in
// the same order as the other paths, so a row has the same bits here as on every path, at any
// row count (blocked_core.h's int4 and int8 sections write the formulas out).
//
// One tile multiply per block, group of 32 inputs and 16 outputs: C (rows x 16 int32) =
// A (rows x 32 activation bytes, one group of each row) . B (8 quads x 16 outputs x 4 inputs).
// The int8 layout is B's (VNNI) layout already: B is 8 rows of 64 bytes, 256 bytes apart, read
// straight from the packed block. int4's nibbles are unpacked once per block into an int8 buffer
// in that layout (0..15 as signed bytes), shared by every tile of rows. tdpbssd multiplies signed
// by signed bytes: no xor 0x80 and no correction. Each group's C tiles are stored and applied to
// float32 sums kept in a small buffer (the group scale makes a tile per group: a K = 64 tile would
// add two groups' sums), group g's epilogue running while group g + 1's multiplies do.
// Rows go 16 at a time (A and C tiles of min(M, 16) rows, configured once per call and thread);
// a last tile of fewer rows is the last 16 rows, overlapping the one before: those rows are
// computed twice, to the same bits, so one tile configuration serves the call.
//
// Linux lends the tile registers only to a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM,
// since 5.16): cpu_amx asks once; where the CPU lacks AMX-INT8, the OS does not enable the tile
// state (XCR0) or the request is refused, AMX is not used and the AVX-512 kernels run.

// Whether AMX-TILE and AMX-INT8 run here (the CPU has them, the OS saves their state, and Linux
// granted this process the tile data).
bool cpu_amx() {
  static const bool yes = [] {
#if defined(__x86_64__) && defined(__linux__)
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 24) & 1) || !((d >> 25) & 1)) return false;  // TILE, INT8
    if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1)) return false;  // OSXSAVE: xgetbv runs
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if (((lo >> 17) & 3) != 3) return false;  // XCR0: XTILECFG and XTILEDATA enabled
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
    return false;
#endif
  }();
  return yes;
}

// AMX on (where the CPU has it) or off (the AVX-512 kernels: the same bits); quickdraft_set_amx,
// QUICKDRAFT_AMX=0.
std::atomic<bool> amx_allowed{true};

// The row counts from which AMX runs a call (below: the AVX-512 VNNI kernels, faster there).
// Measured with benchmarks/blocked_rows.py --amx on SmolLM2-135M's shapes, the Intel Xeon
// (Emerald Rapids), one thread: see docs/cpu.md.
constexpr int64_t AMX_ROWS_Q8 = 4, AMX_ROWS_Q4 = 4;

// Whether a call of `rows` rows of int4 (else int8) runs on AMX.
bool amx_takes(int64_t rows, bool int4) {
  return rows >= (int4 ? AMX_ROWS_Q4 : AMX_ROWS_Q8) && amx_allowed.load(std::memory_order_relaxed) && cpu_amx();
}

#define QD_AMX __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,f16c")))
// Tile loads and stores with a memory clobber (GCC's _tile_loadd has none: a buffer written just
// before, int4's unpacked weights, must be in memory when the tile reads it).
#define QD_TILE_LOAD(t, p, stride) \
  __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"((const void*)(p)), "r"((int64_t)(stride)) : "memory")
#define QD_TILE_STORE(t, p, stride) \
  __asm__ volatile("tilestored %%tmm" #t ", (%0,%1,1)" ::"r"((void*)(p)), "r"((int64_t)(stride)) : "memory")
#define QD_TILE_ZERO(t) __asm__ volatile("tilezero %%tmm" #t ::)
#define QD_TILE_DP(c, a, b) __asm__ volatile("tdpbssd %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)

// This thread's tiles for a call of `rows` (<= 16) rows, released at the end of the scope (the
// thread's tile state back to its initial one, so a context switch does not save 8 KB of it):
// tmm0 A (rows x 32 bytes), tmm1-3 B (8 x 64), tmm4-7 C (rows x 64: 16 int32).
struct Tiles {
  struct alignas(64) Config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  };
  QD_AMX explicit Tiles(int rows) {
    Config c{};
    c.palette = 1;
    c.colsb[0] = QG, c.rows[0] = uint8_t(rows);
    for (int t = 1; t < 4; ++t) c.colsb[t] = 64, c.rows[t] = QG / 4;
    for (int t = 4; t < 8; ++t) c.colsb[t] = 64, c.rows[t] = uint8_t(rows);
    __asm__ volatile("ldtilecfg %0" ::"m"(c));  // (GCC's _tile_loadconfig names 8 bytes of it: the rest were dropped)
  }
  QD_AMX ~Tiles() { __asm__ volatile("tilerelease" ::: "memory"); }
};

// One group's sums: C tiles of the four 16-output columns of B (B column j at b + 64 j, rows
// `ldb` bytes apart) times A (a, rows `lda` apart), stored to c (column j at c + 256 j, 16 int32
// a row).
QD_AMX inline void group_tiles(const int8_t* a, int64_t lda, const int8_t* b, int64_t ldb, int32_t* c) {
  QD_TILE_LOAD(0, a, lda);
  QD_TILE_LOAD(1, b, ldb);
  QD_TILE_ZERO(4);
  QD_TILE_DP(4, 0, 1);
  QD_TILE_LOAD(2, b + 64, ldb);
  QD_TILE_ZERO(5);
  QD_TILE_DP(5, 0, 2);
  QD_TILE_LOAD(3, b + 128, ldb);
  QD_TILE_ZERO(6);
  QD_TILE_DP(6, 0, 3);
  QD_TILE_LOAD(1, b + 192, ldb);
  QD_TILE_ZERO(7);
  QD_TILE_DP(7, 0, 1);
  QD_TILE_STORE(4, c, 64);
  QD_TILE_STORE(5, c + 256, 64);
  QD_TILE_STORE(6, c + 512, 64);
  QD_TILE_STORE(7, c + 768, 64);
}

// ---- int8 ----

// Rows [0, rows) (rows: the configured tile rows) of one block, all groups: per group,
// acc = fma(float(I_g), d_g, acc) on the stored sums (acc from 0), then y = fma(acc, s, bias).
QD_AMX void block_rows_q8_amx(const Q8Act& x, int rows, const int8_t* wb, const float* scale, const float* bias,
                              float* y, int64_t ldy, int64_t ncols) {
  alignas(64) int32_t c[2][4 * 16 * 16];  // (two groups': one stored while the other is applied)
  alignas(64) float acc[16 * NB];
  for (int i = 0; i < rows * NB; i += 16) _mm512_store_ps(acc + i, _mm512_setzero_ps());
  const int64_t G = x.G;
  for (int64_t g = 0; g <= G; ++g) {
    if (g < G) {
      const int8_t* piece = wb + g * Q8B;
      const char* ahead = reinterpret_cast<const char*>(piece) + PF;  // the piece's 32 lines, PF bytes ahead
#pragma GCC unroll 32
      for (int line = 0; line < 32; ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
      group_tiles(x.q + g * QG, x.ldq, piece, 4 * NB, c[g & 1]);
    }
    if (g > 0) {
      const int32_t* cg = c[(g - 1) & 1];
      for (int r = 0; r < rows; ++r) {
        const __m512 d = _mm512_set1_ps(x.d[r * G + g - 1]);
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
          float* a = acc + r * NB + 16 * j;
          _mm512_store_ps(a, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cg + 256 * j + 16 * r)), d,
                                             _mm512_load_ps(a)));
        }
      }
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    const __mmask16 mask = tail_mask(ncols - 16 * j);
    const __m512 s = _mm512_maskz_loadu_ps(mask, scale + 16 * j);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * j) : _mm512_setzero_ps();
    for (int r = 0; r < rows; ++r)
      _mm512_mask_storeu_ps(y + r * ldy + 16 * j, mask, _mm512_fmadd_ps(_mm512_load_ps(acc + r * NB + 16 * j), s, b));
  }
}

// The first row of each tile of min(M, 16) rows: 0, 16, ..., the last M - 16 (overlapping).
template <typename F>
void row_tiles(int64_t M, F&& f) {
  const int rows = int(std::min<int64_t>(M, 16));
  for (int64_t m = 0; m < M; m += rows) f(std::min(m, M - rows));
}

QD_AMX void q8_amx(const Q8Args& a, int64_t b0, int64_t b1) {
  const int64_t stride = a.x.G * Q8B;
  const int rows = int(std::min<int64_t>(a.M, 16));
  Tiles tiles(rows);
  for (int64_t b = b0; b < b1; ++b)
    row_tiles(a.M, [&](int64_t m) {
      block_rows_q8_amx(a.x.rows_from(m), rows, a.w + b * stride, a.scale + b * NB, a.bias ? a.bias + b * NB : nullptr,
                        a.y + m * a.n + b * NB, a.n, std::min(NB, a.n - b * NB));
    });
}

// ---- int4 ----

// A block's nibbles as int8 in the int8 layout (B's): group g's quad c at u + 2048 g + 256 c, its
// column j (outputs 16 j .. 16 j + 15) 64 bytes at + 64 j. (Chunk h of quad c: its low nibbles
// are column 2h, its high ones column 2h + 1: blocked_core.h's int4 layout.)
QD_AMX void unpack_q4_block(const uint8_t* wb, int64_t G, int8_t* u) {
  const __m512i low = _mm512_set1_epi8(15);
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* piece = wb + g * QGB;
    int8_t* ug = u + g * 2048;
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c)
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m512i v = _mm512_loadu_si512(piece + 128 * c + 64 * h);
        _mm512_store_si512(ug + 256 * c + 64 * (2 * h), _mm512_and_si512(v, low));
        _mm512_store_si512(ug + 256 * c + 64 * (2 * h + 1), _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
      }
  }
}

// Rows [0, rows) of one block from its unpacked nibbles u: per group, t = float(I_g) * d_g,
// y = fma(t, s_g, y), y = fma(X_g, o_g, y), from y = bias (or 0).
QD_AMX void block_rows_q4_amx(const Q4Act& x, int rows, const int8_t* u, const uint8_t* wb, const float* bias, float* y,
                              int64_t ldy, int64_t ncols) {
  alignas(64) int32_t c[2][4 * 16 * 16];
  alignas(64) float acc[16 * NB];
  for (int j = 0; j < 4; ++j) {
    const __m512 b = bias ? _mm512_maskz_loadu_ps(tail_mask(ncols - 16 * j), bias + 16 * j) : _mm512_setzero_ps();
    for (int r = 0; r < rows; ++r) _mm512_store_ps(acc + r * NB + 16 * j, b);
  }
  const int64_t G = x.G;
  for (int64_t g = 0; g <= G; ++g) {
    if (g < G) group_tiles(x.q + g * QG, x.ldq, u + g * Q8B, 4 * NB, c[g & 1]);
    if (g > 0) {
      const int32_t* cg = c[(g - 1) & 1];
      const uint8_t* piece = wb + (g - 1) * QGB;
      __m512 sc[4], of[4];
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        sc[j] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(piece + 1024 + 32 * j)));
        of[j] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(piece + 1152 + 32 * j)));
      }
      for (int r = 0; r < rows; ++r) {
        const __m512 d = _mm512_set1_ps(x.d[r * G + g - 1]), xs = _mm512_set1_ps(x.xs[r * G + g - 1]);
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
          float* a = acc + r * NB + 16 * j;
          const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cg + 256 * j + 16 * r)), d);
          _mm512_store_ps(a, _mm512_fmadd_ps(xs, of[j], _mm512_fmadd_ps(t, sc[j], _mm512_load_ps(a))));
        }
      }
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    const __mmask16 mask = tail_mask(ncols - 16 * j);
    for (int r = 0; r < rows; ++r) _mm512_mask_storeu_ps(y + r * ldy + 16 * j, mask, _mm512_load_ps(acc + r * NB + 16 * j));
  }
}

QD_AMX void q4_amx(const Q4Args& a, int64_t b0, int64_t b1) {
  const int64_t stride = a.G * QGB;
  const int rows = int(std::min<int64_t>(a.M, 16));
  thread_local std::vector<int8_t> unpacked;  // one block's nibbles as bytes (2 KB a group), 64-byte aligned
  if ((int64_t)unpacked.size() < a.G * 2048 + 64) unpacked.resize(a.G * 2048 + 64);
  int8_t* u = unpacked.data() + (-reinterpret_cast<uintptr_t>(unpacked.data()) & 63);
  Tiles tiles(rows);
  for (int64_t b = b0; b < b1; ++b) {
    unpack_q4_block(a.w + b * stride, a.G, u);
    row_tiles(a.M, [&](int64_t m) {
      const Q4Act xm{a.x.q + m * a.x.ldq, a.x.ldq, a.x.d + m * a.G, a.x.xs + m * a.G, a.G};
      block_rows_q4_amx(xm, rows, u, a.w + b * stride, a.bias ? a.bias + b * NB : nullptr, a.y + m * a.n + b * NB,
                        a.n, std::min(NB, a.n - b * NB));
    });
  }
}

#undef QD_TILE_LOAD
#undef QD_TILE_STORE
#undef QD_TILE_ZERO
#undef QD_TILE_DP
