// A probe, not the library: int8 weights (per-output scale, a layout of 4 consecutive inputs per
// output in each 32-bit lane) times int8 activations (per row and group of 32, the int4 kernel's
// quantisation) with AVX-512 VNNI (weights flipped to unsigned by xor 0x80, the 128 * sum(a)
// this adds taken off by starting the sums from -128 * sum(a)), to see whether an integer int8
// path would beat the library's int8 kernel (float32 activations) before writing it on every
// path (issue 36, item 5). One thread; us per call, thread CPU time, median of 7, activation
// quantisation included; 6 rows go as two passes of 3 (the weights read twice).
//
//   g++ -O3 -std=c++17 -ffp-contract=off benchmarks/int8_vnni_probe.cpp -o /tmp/probe && /tmp/probe
// against the library on the same shapes: benchmarks/blocked_rows.py --format int8 --clock thread.
#include <immintrin.h>
#include <time.h>
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>
#include <random>

static double now() { timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }

// quantise (the int4 kernel's formula): q (M, K), d and asum (M, G)
static void quantize(const float* x, int64_t M, int64_t K, int8_t* q, float* d, int32_t* asum) {
  const int64_t G = K / 32;
  for (int64_t r = 0; r < M; ++r)
    for (int64_t g = 0; g < G; ++g) {
      const float* xg = x + r * K + g * 32;
      float amax = 0.f;
      for (int k = 0; k < 32; ++k) amax = std::max(amax, std::fabs(xg[k]));
      const float dg = amax / 127.f, id = dg > 0 ? 1.f / dg : 0.f;
      int32_t s = 0;
      for (int k = 0; k < 32; ++k) {
        float v = (xg[k] * id + 12582912.f) - 12582912.f;
        q[r * K + g * 32 + k] = (int8_t)(int)v;
        s += (int)v;
      }
      d[r * G + g] = dg;
      asum[r * G + g] = s;
    }
}

// one block of 64 outputs, MR rows: w (K/4, 64, 4) int8
template <int MR>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) static void block(const int8_t* q, const float* d, const int32_t* asum,
                                                                        int64_t K, const int8_t* w, const float* scale,
                                                                        float* y, int64_t ldy) {
  const int64_t G = K / 32;
  __m512 yf[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 4; ++j) yf[r][j] = _mm512_setzero_ps();
  const __m512i flip = _mm512_set1_epi8((char)0x80);
  for (int64_t g = 0; g < G; ++g) {
    __m512i acc[MR][4];
    for (int r = 0; r < MR; ++r) {
      const __m512i init = _mm512_set1_epi32(-128 * asum[r * G + g]);
      for (int j = 0; j < 4; ++j) acc[r][j] = init;
    }
    const int8_t* wg = w + g * 8 * 256;
    _mm_prefetch((const char*)wg + 4096, _MM_HINT_T0);
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      for (int l = 0; l < 4; ++l) _mm_prefetch((const char*)wg + 4096 + 256 * c + 64 * l, _MM_HINT_T0);
      __m512i wv[4];
      for (int j = 0; j < 4; ++j) wv[j] = _mm512_xor_si512(_mm512_loadu_si512(wg + 256 * c + 64 * j), flip);
      for (int r = 0; r < MR; ++r) {
        int32_t a4; std::memcpy(&a4, q + r * K + g * 32 + 4 * c, 4);
        const __m512i av = _mm512_set1_epi32(a4);
        for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], wv[j], av);
      }
    }
    for (int r = 0; r < MR; ++r) {
      const __m512 dv = _mm512_set1_ps(d[r * G + g]);
      for (int j = 0; j < 4; ++j) yf[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][j]), dv, yf[r][j]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(y + r * ldy + 16 * j, _mm512_mul_ps(yf[r][j], _mm512_loadu_ps(scale + 16 * j)));
}

int main(int argc, char** argv) {
  const int64_t shapes[][2] = {{576, 960}, {576, 3072}, {1536, 576}, {576, 49152}, {2048, 8192}, {8192, 2048}};
  std::mt19937 rng(0);
  for (auto& s : shapes) {
    const int64_t K = s[0], N = s[1], nblk = N / 64, G = K / 32;
    std::vector<int8_t> w(nblk * K * 64);
    for (auto& v : w) v = (int8_t)((int)(rng() % 255) - 127);
    std::vector<float> scale(N, 0.01f);
    double res[2];
    int rows[2] = {1, 6};
    for (int t = 0; t < 2; ++t) {
      const int M = rows[t];
      std::vector<float> x(M * K), y(M * N), d(M * G);
      std::vector<int8_t> q(M * K);
      std::vector<int32_t> asum(M * G);
      for (auto& v : x) v = (float)(rng() % 2001) / 1000.f - 1.f;
      std::vector<double> ts;
      for (int rep = 0; rep < 7; ++rep) {
        int calls = 0;
        const double t0 = now();
        while (now() - t0 < 0.1) {
          quantize(x.data(), M, K, q.data(), d.data(), asum.data());
          for (int64_t b = 0; b < nblk; ++b) {
            if (M == 1) block<1>(q.data(), d.data(), asum.data(), K, w.data() + b * K * 64, scale.data() + 64 * b, y.data() + 64 * b, N);
            else { block<3>(q.data(), d.data(), asum.data(), K, w.data() + b * K * 64, scale.data() + 64 * b, y.data() + 64 * b, N);
                   block<3>(q.data() + 3 * K, d.data() + 3 * G, asum.data() + 3 * G, K, w.data() + b * K * 64, scale.data() + 64 * b, y.data() + 3 * N + 64 * b, N); }
          }
          ++calls;
        }
        ts.push_back((now() - t0) / calls);
      }
      std::sort(ts.begin(), ts.end());
      res[t] = ts[3];
    }
    std::printf("int8 x int8 VNNI probe %lldx%lld: m=1 %.0fus %.1fGB/s  m=6 %.0fus  T6/T1=%.2f\n", (long long)K, (long long)N,
                res[0] * 1e6, K * N / res[0] / 1e9, res[1] * 1e6, res[1] / res[0]);
  }
}
