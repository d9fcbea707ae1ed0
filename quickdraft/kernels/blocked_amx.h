// AMX (Intel's tile multiply unit, since Sapphire Rapids): the int8 and int4 kernels' calls of
// several rows as tile multiplies. A part of blocked_core.h (included inside its namespace, x86
// only, after the int8 section): the same integer sums, exact, and the same float epilogue in
// the same order as the other paths, so a row has the same bits here as on every path, at any
// row count (blocked_core.h's int4 and int8 sections write the formulas out).
//
// One tile multiply per block, group of 32 inputs and 16 outputs: C (rows x 16 int32) =
// A (rows x 32 activation bytes, one group of each row) . B (8 quads x 16 outputs x 4 inputs),
// a column of 16 outputs at a time over all groups (its rows' float sums in registers).
// The int8 layout is B's (VNNI) layout already: B is 8 rows of 64 bytes, 256 bytes apart, read
// straight from the packed block. int4's nibbles are unpacked once per block into an int8 buffer
// in that layout (0..15 as signed bytes), shared by every tile of rows. tdpbssd multiplies signed
// by signed bytes: no xor 0x80 and no correction. Each group's C tile is stored and applied to
// the float32 sums (the group scale makes a tile per group: a K = 64 tile would add two groups'
// sums), group g's epilogue running while group g + 1's multiply does (two sets of tiles).
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

// AMX off (0: the AVX-512 kernels, the same bits), on from the row counts below (1, the default),
// or on for every call, one row too (2: tests and benchmarks); quickdraft_set_amx, QUICKDRAFT_AMX=0.
std::atomic<int> amx_mode{1};

// The row counts from which AMX runs a call (below: the AVX-512 VNNI kernels, faster there).
// A tile multiply costs about the same at 1 row as at 16 (and K = 32 uses half of it), and each
// group's C tile goes through memory: on SmolLM2-135M's qkv, down and gate_up shapes (Intel Xeon,
// Emerald Rapids, one thread) int8 on AMX took 1.3-1.7x VNNI's time at 4 rows, 0.7-1.0x at 8
// and 0.6-0.8x at 16; int4, which also unpacks its nibbles, 1.0-1.4x at 8-12 rows, 0.9-1.0x at
// 16 and 0.7-0.9x at 32. SmolLM2's lm_head (576 x 49,152) in int8 took 1.2-1.4x VNNI's time at
// 8-12 rows and 1.04x at 16 (a re-run, load 5): verify steps (k + 1 <= 16 rows) keep VNNI for
// both formats, prefills take AMX (benchmarks/blocked_rows.py --amx every,off; docs/cpu.md).
// A verify-sized int4 kernel tried on an Intel Xeon with AMX (Sapphire Rapids class, 1 thread, a
// 2048 x 512 matrix from L2): a block's halves in turn, each group's half unpacked into a 1 KB
// buffer, its two multiplies, and the group before's epilogue while they ran: 100-120 ns per block
// and group at 1-8 rows, against VNNI's 29 (1 row), 84 (6) and 120 (8). Without the unpacking (wrong
// sums, timing only) 53-87 ns, without unpacking or epilogue 45-61: a K = 32 multiply and a C tile
// stored per group and 16 outputs (the per-group scales) cost more than six rows of vpdpbusd.
constexpr int64_t AMX_ROWS_Q8 = 17, AMX_ROWS_Q4 = 17;

// Whether a call of `rows` rows of int4 (else int8) runs on AMX.
bool amx_takes(int64_t rows, bool int4) {
  const int mode = amx_mode.load(std::memory_order_relaxed);
  return mode != 0 && (mode == 2 || rows >= (int4 ? AMX_ROWS_Q4 : AMX_ROWS_Q8)) && cpu_amx();
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
// two sets, for groups in turn (a group's multiply need not wait for the last one's store):
// tmm0 / tmm1 A (rows x 32 bytes), tmm2 / tmm3 B (8 x 64), tmm4 / tmm5 C (rows x 64: 16 int32).
struct Tiles {
  struct alignas(64) Config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  };
  QD_AMX explicit Tiles(int rows) {
    Config c{};
    c.palette = 1;
    for (int t = 0; t < 2; ++t) {
      c.colsb[t] = QG, c.rows[t] = uint8_t(rows);
      c.colsb[t + 2] = 64, c.rows[t + 2] = QG / 4;
      c.colsb[t + 4] = 64, c.rows[t + 4] = uint8_t(rows);
    }
    __asm__ volatile("ldtilecfg %0" ::"m"(c));  // (GCC's _tile_loadconfig names 8 bytes of it: the rest were dropped)
  }
  QD_AMX ~Tiles() { __asm__ volatile("tilerelease" ::: "memory"); }
};

// One group's sums for one column of 16 outputs, on tile set S: C = A (a, rows lda bytes apart)
// . B (b, 8 rows 256 bytes apart), stored to c (16 int32 a row).
template <int S>
QD_AMX inline void group_tile(const int8_t* a, int64_t lda, const int8_t* b, int32_t* c) {
  if constexpr (S == 0) {
    QD_TILE_LOAD(0, a, lda);
    QD_TILE_LOAD(2, b, 4 * NB);
    QD_TILE_ZERO(4);
    QD_TILE_DP(4, 0, 2);
    QD_TILE_STORE(4, c, 64);
  } else {
    QD_TILE_LOAD(1, a, lda);
    QD_TILE_LOAD(3, b, 4 * NB);
    QD_TILE_ZERO(5);
    QD_TILE_DP(5, 1, 3);
    QD_TILE_STORE(5, c, 64);
  }
}

// The first row of each tile of min(M, 16) rows: 0, 16, ..., the last M - 16 (overlapping).
template <typename F>
void row_tiles(int64_t M, F&& f) {
  const int rows = int(std::min<int64_t>(M, 16));
  for (int64_t m = 0; m < M; m += rows) f(std::min(m, M - rows));
}

// f(MT, first row) per tile of rows, MT (the tile's rows, 1..16) as a std::integral_constant: the
// float sums of a column's MT rows stay in registers.
template <typename F>
void row_tiles_mt(int64_t M, F&& f) {
  using std::integral_constant;
  row_tiles(M, [&](int64_t m) {
    switch (std::min<int64_t>(M, 16)) {
#define QD_MT(n) case n: f(integral_constant<int, n>{}, m); break;
      QD_MT(1) QD_MT(2) QD_MT(3) QD_MT(4) QD_MT(5) QD_MT(6) QD_MT(7) QD_MT(8)
      QD_MT(9) QD_MT(10) QD_MT(11) QD_MT(12) QD_MT(13) QD_MT(14) QD_MT(15) QD_MT(16)
#undef QD_MT
      default: break;
    }
  });
}

// ---- int8 ----

// Rows [0, MT) of one block (weights wb, in B's layout), a column of 16 outputs at a time, all
// groups: the column's float sums in registers, acc = fma(float(I_g), d_g, acc) from 0 on each
// group's stored sums (group g's while g + 1's multiply runs), then y = fma(acc, s, bias).
template <int MT>
QD_AMX void block_rows_q8_amx(const Q8Act& x, const int8_t* wb, const float* scale, const float* bias, float* y,
                              int64_t ldy, int64_t ncols) {
  alignas(64) int32_t c[2][16 * 16];
  const int64_t G = x.G;
  for (int j = 0; j < 4 && 16 * j < ncols; ++j) {
    __m512 acc[MT];
#pragma GCC unroll 16
    for (int r = 0; r < MT; ++r) acc[r] = _mm512_setzero_ps();
    const int8_t* col = wb + 64 * j;
    for (int64_t g = 0; g <= G; ++g) {
      if (g < G) {
        if (j == 0) {  // the group's 32 lines (all columns), PF bytes ahead
          const char* ahead = reinterpret_cast<const char*>(wb + g * Q8B) + PF;
#pragma GCC unroll 32
          for (int line = 0; line < 32; ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
        }
        if (g & 1) group_tile<1>(x.q + g * QG, x.ldq, col + g * Q8B, c[1]);
        else group_tile<0>(x.q + g * QG, x.ldq, col + g * Q8B, c[0]);
      }
      if (g > 0) {
        const int32_t* cg = c[(g - 1) & 1];
#pragma GCC unroll 16
        for (int r = 0; r < MT; ++r)
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cg + 16 * r)), _mm512_set1_ps(x.d[r * G + g - 1]),
                                   acc[r]);
      }
    }
    const __mmask16 mask = tail_mask(ncols - 16 * j);
    const __m512 s = _mm512_maskz_loadu_ps(mask, scale + 16 * j);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * j) : _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int r = 0; r < MT; ++r) _mm512_mask_storeu_ps(y + r * ldy + 16 * j, mask, _mm512_fmadd_ps(acc[r], s, b));
  }
}

QD_AMX void q8_amx(const Q8Args& a, int64_t b0, int64_t b1) {
  const int64_t stride = a.x.G * Q8B;
  Tiles tiles(int(std::min<int64_t>(a.M, 16)));
  for (int64_t b = b0; b < b1; ++b)
    row_tiles_mt(a.M, [&](auto mt, int64_t m) {
      block_rows_q8_amx<decltype(mt)::value>(a.x.rows_from(m), a.w + b * stride, a.scale + b * NB,
                                             a.bias ? a.bias + b * NB : nullptr, a.y + m * a.n + b * NB, a.n,
                                             std::min(NB, a.n - b * NB));
    });
}

// ---- int4 ----

// A block's nibbles as int8 in the int8 layout (B's): group g's quad c at u + 2048 g + 256 c, its
// column j (outputs 16 j .. 16 j + 15) 64 bytes at + 64 j. (Chunk h of quad c: its low nibbles
// are column 2h, its high ones column 2h + 1: blocked_core.h's int4 layout.)
QD_AMX void unpack_q4_block(const uint8_t* wb, int64_t G, int64_t gb, int8_t* u) {
  const __m512i low = _mm512_set1_epi8(15);
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* piece = wb + g * gb;
    int8_t* ug = u + g * Q8B;
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

// Rows [0, MT) of one block from its unpacked nibbles u, a column at a time: per group,
// t = float(I_g) * d_g, y = fma(t, s_g, y), y = fma(X_g, o_g, y), from y = bias (or 0).
template <int MT>
QD_AMX void block_rows_q4_amx(const Q4Act& x, const int8_t* u, const uint8_t* wb, int64_t gb, const float* bias,
                              float* y, int64_t ldy, int64_t ncols) {
  alignas(64) int32_t c[2][16 * 16];
  const int64_t G = x.G;
  for (int j = 0; j < 4 && 16 * j < ncols; ++j) {
    const __mmask16 mask = tail_mask(ncols - 16 * j);
    __m512 acc[MT];
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * j) : _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int r = 0; r < MT; ++r) acc[r] = b;
    const int8_t* col = u + 64 * j;
    for (int64_t g = 0; g <= G; ++g) {
      if (g < G) {
        if (g & 1) group_tile<1>(x.q + g * QG, x.ldq, col + g * Q8B, c[1]);
        else group_tile<0>(x.q + g * QG, x.ldq, col + g * Q8B, c[0]);
      }
      if (g > 0) {
        const int32_t* cg = c[(g - 1) & 1];
        const uint8_t* piece = wb + (g - 1) * gb;
        const __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(piece + 1024 + 32 * j)));
        const __m512 of = gb == QGB_SYM ? _mm512_mul_ps(sc, _mm512_set1_ps(-8.f))
                                        : _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(piece + 1152 + 32 * j)));
#pragma GCC unroll 16
        for (int r = 0; r < MT; ++r) {
          const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cg + 16 * r)), _mm512_set1_ps(x.d[r * G + g - 1]));
          acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x.xs[r * G + g - 1]), of, _mm512_fmadd_ps(t, sc, acc[r]));
        }
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < MT; ++r) _mm512_mask_storeu_ps(y + r * ldy + 16 * j, mask, acc[r]);
  }
}

QD_AMX void q4_amx(const Q4Args& a, int64_t b0, int64_t b1) {
  const int64_t stride = a.G * a.gb;
  thread_local std::vector<int8_t> unpacked;  // one block's nibbles as bytes (2 KB a group), 64-byte aligned
  if ((int64_t)unpacked.size() < a.G * Q8B + 64) unpacked.resize(a.G * Q8B + 64);
  int8_t* u = unpacked.data() + (-reinterpret_cast<uintptr_t>(unpacked.data()) & 63);
  Tiles tiles(int(std::min<int64_t>(a.M, 16)));
  for (int64_t b = b0; b < b1; ++b) {
    unpack_q4_block(a.w + b * stride, a.G, a.gb, u);  // (once per block, for every tile of rows)
    row_tiles_mt(a.M, [&](auto mt, int64_t m) {
      const Q4Act xm{a.x.q + m * a.x.ldq, a.x.ldq, a.x.d + m * a.G, a.x.xs + m * a.G, a.G};
      block_rows_q4_amx<decltype(mt)::value>(xm, u, a.w + b * stride, a.gb, a.bias ? a.bias + b * NB : nullptr,
                                             a.y + m * a.n + b * NB, a.n, std::min(NB, a.n - b * NB));
    });
  }
}

#undef QD_TILE_LOAD
#undef QD_TILE_STORE
#undef QD_TILE_ZERO
#undef QD_TILE_DP
