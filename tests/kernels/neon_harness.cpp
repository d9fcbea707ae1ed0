// Runs one of quickdraft's kernels (quickdraft/kernels/blocked_core.h) without PyTorch, on a chosen
// path, so tests/kernels/test_neon.py can run the NEON path on an AArch64 build of it under
// qemu-user, and the x86 paths on a native build, and compare the outputs bit for bit with the
// x86 library's (torch.ops.quickdraft).
//
//   neon_harness PATH KERNEL IN OUT
//
// PATH: portable | avx2 | avx512 | neon (an error where this build or CPU lacks it), with
// "-novnni" after it: int8 and int4 without the integer dot-product instructions. KERNEL: f32,
// bf16, int8, int4, attend, attend-f16 or attend-bf16. IN: 8 little-endian int64 dims, one float64, then the operands
// (float32 unless said, C order):
//   f32 / bf16: dims M, K, N, has_bias, pieces; x (M, K), packed (ceil(N/64), K, 64) of
//     float32 / bfloat16, [bias (N)]
//   int8: dims M, K, N, has_bias, pieces; x (M, K), packed int8 (ceil(N/64), 8 ceil(K/32), 256),
//     scale (N), [bias (N)]
//   int4: dims M, K, N, has_bias, pieces, layout (0: float16 scales and offsets, 1: symmetric, 2:
//     super-block); x (M, K), packed uint8 (ceil(N/64), K/32, 1280; 1152 where symmetric: no
//     offsets; (ceil(N/64), K/256, 9472) in the super-block layout), [bias (N)]
//   attend: dims B, H, Hkv, T, L, D, mask_rows (B or 1), pieces; the float64: scale; q (B, H, T, D),
//     k and v (B, Hkv, L, D), mask bytes (mask_rows, T, L); attend-f16 / attend-bf16: k and v as
//     float16 / bfloat16 (a 16-bit KV cache)
// `pieces`: the blocks (tasks) are split into that many pieces, run last piece first (the result
// must not depend on the split). OUT: the float32 result ((M, N); attend: (B, T, H, D)).
// Build with -ffp-contract=off, as the library is.
#include "quickdraft/kernels/blocked_core.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>

namespace {

struct Reader {
  std::vector<char> bytes;
  size_t at = 0;
  template <typename T>
  const T* take(size_t count) {
    const size_t size = count * sizeof(T);
    if (at + size > bytes.size()) throw std::runtime_error("the input file is too short");
    const T* p = reinterpret_cast<const T*>(bytes.data() + at);
    at += size;
    return p;
  }
};

// `pieces` pieces of [begin, end), the last first.
struct Pieces {
  int64_t pieces;
  template <typename F>
  void operator()(int64_t begin, int64_t end, F&& f) const {
    const int64_t n = end - begin, p = std::max<int64_t>(1, std::min(pieces, n));
    for (int64_t i = p - 1; i >= 0; --i) {
      const int64_t b0 = begin + n * i / p, b1 = begin + n * (i + 1) / p;
      if (b1 > b0) f(b0, b1);
    }
  }
};

template <typename W>
std::vector<float> run_matmul(Reader& in, const int64_t* d, const Paths& paths) {
  const int64_t M = d[0], K = d[1], N = d[2], nblk = (N + NB - 1) / NB;
  const float* x = in.take<float>(M * K);
  const W* w = in.take<W>(nblk * K * NB);
  const float* bias = d[3] ? in.take<float>(N) : nullptr;
  std::vector<float> y(M * N);
  const MatArgs<W> a{x, K, M, w, K, bias, y.data(), N};
  matmul(paths, a, nblk, Pieces{d[4]});
  return y;
}

std::vector<float> run_int8(Reader& in, const int64_t* d, const Paths& paths) {
  const int64_t M = d[0], K = d[1], N = d[2], nblk = (N + NB - 1) / NB, G = (K + QG - 1) / QG;
  const float* x = in.take<float>(M * K);
  const int8_t* w = in.take<int8_t>(nblk * G * Q8B);
  const float* scale = in.take<float>(N);
  const float* bias = d[3] ? in.take<float>(N) : nullptr;
  std::vector<int8_t> xq(M * G * QG);
  std::vector<float> dx(2 * M * G), pad(G * QG), y(M * N);
  std::vector<int32_t> asum(M * G);
  q8_quantize(x, K, M, K, G, xq.data(), dx.data(), asum.data(), dx.data() + M * G, pad.data(), paths.quant);
  const Q8Args a{{xq.data(), G * QG, dx.data(), asum.data(), G}, M, w, scale, bias, y.data(), N};
  matmul_q8(paths, a, nblk, Pieces{d[4]});
  return y;
}

std::vector<float> run_int4(Reader& in, const int64_t* d, const Paths& paths) {
  const int64_t M = d[0], K = d[1], N = d[2], nblk = (N + NB - 1) / NB, G = K / QG;
  if (K % QG) throw std::runtime_error("int4: K must be a multiple of 32");
  const float* x = in.take<float>(M * K);
  const int64_t gb = q4_size(int(d[5]));
  if (gb == QSB && G % QSG) throw std::runtime_error("int4: the super-block layout needs K a multiple of 256");
  const uint8_t* w = in.take<uint8_t>(nblk * q4_block_bytes(gb, G));
  const float* bias = d[3] ? in.take<float>(N) : nullptr;
  std::vector<int8_t> xq(M * K);
  std::vector<float> dx(2 * M * G), y(M * N);
  paths.quant(x, K, M, G, xq.data(), dx.data(), dx.data() + M * G, nullptr);
  const Q4Args a{{xq.data(), K, dx.data(), dx.data() + M * G, G}, M, G, w, bias, y.data(), N, gb};
  matmul_q4(paths, a, nblk, Pieces{d[4]});
  return y;
}

template <typename KV>
std::vector<float> run_attend(Reader& in, const int64_t* d, double scale, const Paths& paths, int kv) {
  const int64_t B = d[0], H = d[1], Hkv = d[2], T = d[3], L = d[4], D = d[5], Bm = d[6];
  if (D % 16 || T < 1 || L < 1 || Hkv < 1 || H % Hkv || (Bm != 1 && Bm != B))
    throw std::runtime_error("attend: not a shape the kernel takes (D % 16, T >= 1, L >= 1, H % Hkv)");
  const float* q = in.take<float>(B * H * T * D);
  const KV* k = in.take<KV>(B * Hkv * L * D);
  const KV* v = in.take<KV>(B * Hkv * L * D);
  const bool* mask = in.take<bool>(Bm * T * L);
  std::vector<float> out(B * T * H * D);
  const AttendArgs a{q, H * T * D, T * D, D, k, v, Hkv * L * D, L * D, D, Hkv * L * D, L * D, D,
                     mask, Bm == 1 ? 0 : T * L, L, 1, out.data(), H, T, D, H / Hkv, L, (float)scale, kv};
  attend_tasks(paths, a, B, Hkv, Pieces{d[7]});
  return out;
}

// PATH may end in "-novnni": int8 and int4 without the integer dot-product instructions (maddubs + madd).
int path_index(std::string name) {
  const std::string suffix = "-novnni";
  if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
    vnni_allowed.store(false);
    name.resize(name.size() - suffix.size());
  }
  const char* names[ISA_COUNT] = {"portable", "avx2", "avx512", "neon"};  // enum Isa's order
  for (int i = 0; i < ISA_COUNT; ++i)
    if (name == names[i]) return i;
  throw std::runtime_error("unknown path " + name + " (portable, avx2, avx512, neon)");
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc != 5) throw std::runtime_error("usage: neon_harness PATH KERNEL IN OUT");
    const int isa = path_index(argv[1]);
    if (!cpu_has(isa)) throw std::runtime_error(std::string("this build or CPU has no ") + argv[1] + " path");
    const Paths& paths = PATHS[isa];
    const std::string kernel = argv[2];
    Reader in;
    std::ifstream f(argv[3], std::ios::binary);
    if (!f) throw std::runtime_error(std::string("cannot read ") + argv[3]);
    in.bytes.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
    const int64_t* d = in.take<int64_t>(8);
    const double scale = *in.take<double>(1);
    std::vector<float> y;
    if (kernel == "f32") y = run_matmul<float>(in, d, paths);
    else if (kernel == "bf16") y = run_matmul<Bf16>(in, d, paths);
    else if (kernel == "int8") y = run_int8(in, d, paths);
    else if (kernel == "int4") y = run_int4(in, d, paths);
    else if (kernel == "attend") y = run_attend<float>(in, d, scale, paths, KV_F32);
    else if (kernel == "attend-f16") y = run_attend<F16>(in, d, scale, paths, KV_F16);
    else if (kernel == "attend-bf16") y = run_attend<Bf16>(in, d, scale, paths, KV_BF16);
    else throw std::runtime_error("unknown kernel " + kernel + " (f32, bf16, int8, int4, attend, attend-f16, attend-bf16)");
    if (in.at != in.bytes.size()) throw std::runtime_error("the input file is longer than its dims say");
    std::ofstream out(argv[4], std::ios::binary);
    out.write(reinterpret_cast<const char*>(y.data()), std::streamsize(y.size() * sizeof(float)));
    if (!out) throw std::runtime_error(std::string("cannot write ") + argv[4]);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "neon_harness: %s\n", e.what());
    return 2;
  }
}
