// quickdraft's CPU kernels as PyTorch ops (quickdraft issues 19 and 36): the checks, PyTorch's
// threads, the op registrations and the C entry points for AOTInductor packages. The kernels
// themselves, their layouts and their numerics are in blocked_core.h (no PyTorch there, so a
// harness can run them alone: tests/kernels/neon_harness.cpp).
#include <ATen/ATen.h>
#include <algorithm>
#include <cmath>
#include <tuple>
#include <utility>
#include <vector>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "blocked_core.h"

namespace {

// ---- the drivers: checks, then the blocks split over PyTorch's threads ----

// at::parallel_for in the shape blocked_core.h's drivers take (one block or task at least a piece).
const auto torch_threads = [](int64_t begin, int64_t end, auto&& f) { at::parallel_for(begin, end, 1, f); };

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
at::Tensor run(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, int64_t n,
               const char* name) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == NB, name, ": packed must be a (N/64, K, 64) tensor");
  const Checked c = check(x, packed, packed.size(1), c10::nullopt, bias, n, name);
  const int64_t M = c.M, K = c.K, nblk = c.nblk;
  const float* bptr = data_or_null(bias);
  at::Tensor y = at::empty({M, n}, x.options());
  if (M == 0) return y;
  const MatArgs<W> a{c.x.data_ptr<float>(), c.x.stride(0), M, static_cast<const W*>(packed.const_data_ptr()), K, bptr,
                     y.data_ptr<float>(), n};
  matmul(active_paths(), a, nblk, torch_threads);  // one path for the whole call
  return y;
}

at::Tensor blocked_mm(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                      int64_t n) {
  TORCH_CHECK(packed.scalar_type() == at::kFloat, "blocked_mm: packed must be float32");
  return run<float>(x, packed, bias, n, "blocked_mm");
}

// int8 weights on int8 activations (blocked_core.h's int8 section): the activations quantised
// once (q4_quantize's formula, per row and group of 32, the row zero-padded to whole groups),
// shared by every block.
at::Tensor blocked_mm_int8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                           const c10::optional<at::Tensor>& bias, int64_t n) {
  const char* name = "blocked_mm_int8";
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 3 && packed.size(2) == 4 * NB &&
                  packed.size(1) % 8 == 0, name, ": packed must be an int8 (N/64, 8 ceil(K/32), 256) tensor");
  TORCH_CHECK(x.dim() == 2, name, ": x must be a 2-D float32 tensor");
  const int64_t G = packed.size(1) / 8, K = x.size(1);
  // (K's groups must be the packed ones: named as the weight's K where they are not)
  const int64_t k_packed = (K + QG - 1) / QG == G ? K : G * QG;
  const Checked c = check(x, packed, k_packed, scale, bias, n, name);
  TORCH_CHECK(scale.defined(), name, ": scale is required");
  const int64_t M = c.M, nblk = c.nblk;
  at::Tensor y = at::empty({M, n}, x.options());
  if (M == 0) return y;
  // the quantised rows in this thread's scratch (no allocation per call: a decode step makes ~100 of
  // these calls of a few us each): q (M, G * 32), d and X (2, M, G), asum (M, G)
  const Paths& paths = active_paths();  // (once: the quantiser and the matmul on one path)
  thread_local std::vector<int8_t> q_scratch;
  thread_local std::vector<float> d_scratch;
  thread_local std::vector<int32_t> sum_scratch;
  if ((int64_t)q_scratch.size() < M * G * QG) q_scratch.resize(M * G * QG);
  if ((int64_t)d_scratch.size() < 2 * M * G) d_scratch.resize(2 * M * G);
  if ((int64_t)sum_scratch.size() < M * G) sum_scratch.resize(M * G);
  int8_t* qp = q_scratch.data();
  float* d = d_scratch.data();
  int32_t* as = sum_scratch.data();
  const float* xp = c.x.data_ptr<float>();
  const int64_t ldx = c.x.stride(0);
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {  // (rows are independent: any split)
    std::vector<float> pad(K == G * QG ? 0 : G * QG);
    q8_quantize(xp + r0 * ldx, ldx, r1 - r0, K, G, qp + r0 * G * QG, d + r0 * G, as + r0 * G, d + M * G + r0 * G,
                pad.data(), paths.quant);
  });
  const Q8Args a{{qp, G * QG, d, as, G}, M, packed.data_ptr<int8_t>(), scale.data_ptr<float>(), data_or_null(bias),
                 y.data_ptr<float>(), n};
  matmul_q8(paths, a, nblk, torch_threads);
  return y;
}

// bfloat16 weights widened to float32 in registers: the float32 kernel's sums on the widened
// weights, bit for bit, at half its bytes.
at::Tensor blocked_mm_bf16(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                           int64_t n) {
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16, "blocked_mm_bf16: packed must be bfloat16");
  return run<Bf16>(x, packed, bias, n, "blocked_mm_bf16");
}

at::Tensor blocked_mm_int4(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                           int64_t n) {
  const char* name = "blocked_mm_int4";
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 &&
                  (packed.size(2) == QGB || packed.size(2) == QGB_SYM || packed.size(2) == QSB),
              name, ": packed must be a uint8 (N/64, K/32, ", QGB, " or ", QGB_SYM, ") or (N/64, K/256, ", QSB,
              ") tensor");
  const int64_t G = packed.size(1) * (packed.size(2) == QSB ? QSG : 1);  // groups of 32 inputs
  const Checked c = check(x, packed, G * QG, c10::nullopt, bias, n, name);
  const int64_t M = c.M, nblk = c.nblk;
  const float* bptr = data_or_null(bias);
  at::Tensor y = at::empty({M, n}, x.options());
  if (M == 0) return y;
  // the activations quantised once (q4_quantize: blocked_core.h's int4 section), shared by every block,
  // in this thread's scratch (as int8's: no allocation per call): q (M, G * 32), d and X (2, M, G)
  const Paths& paths = active_paths();  // (once: the quantiser and the matmul on one path)
  thread_local std::vector<int8_t> q_scratch;
  thread_local std::vector<float> d_scratch;
  if ((int64_t)q_scratch.size() < M * G * QG) q_scratch.resize(M * G * QG);
  if ((int64_t)d_scratch.size() < 2 * M * G) d_scratch.resize(2 * M * G);
  int8_t* qp = q_scratch.data();
  float* d = d_scratch.data();
  const float* xp = c.x.data_ptr<float>();
  const int64_t ldx = c.x.stride(0);
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {  // (rows are independent: any split)
    paths.quant(xp + r0 * ldx, ldx, r1 - r0, G, qp + r0 * G * QG, d + r0 * G, d + M * G + r0 * G, nullptr);
  });
  const Q4Args a{{qp, G * QG, d, d + M * G, G}, M, G, packed.data_ptr<uint8_t>(), bptr,
                 y.data_ptr<float>(), n, packed.size(2)};
  matmul_q4(paths, a, nblk, torch_threads);
  return y;
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
  // the keys and values: float32, or a 16-bit cache (float16, bfloat16) widened as they are read
  const auto kt = k.scalar_type();
  const int kv = kt == at::kFloat ? KV_F32 : kt == at::kHalf ? KV_F16 : kt == at::kBFloat16 ? KV_BF16 : -1;
  const bool ours = q.scalar_type() == at::kFloat && kv >= 0 && v.scalar_type() == kt && D % 16 == 0 && L > 0;
  if (!ours) {  // another dtype or head size: PyTorch's attention
    out.transpose(1, 2).copy_(at::scaled_dot_product_attention(q, k.to(q.scalar_type()), v.to(q.scalar_type()), mask,
                                                               0.0, false, scale, Hkv != H));
    return out.transpose(1, 2);
  }
  const at::Tensor qc = q.stride(3) == 1 ? q : q.contiguous();
  const at::Tensor kc = k.stride(3) == 1 ? k : k.contiguous();
  const at::Tensor vc = v.stride(3) == 1 ? v : v.contiguous();
  AttendArgs a{qc.data_ptr<float>(), qc.stride(0), qc.stride(1), qc.stride(2),
               kc.data_ptr(), vc.data_ptr(), kc.stride(0), kc.stride(1), kc.stride(2),
               vc.stride(0), vc.stride(1), vc.stride(2), mask.data_ptr<bool>(),
               mask.size(0) == 1 ? 0 : mask.stride(0), mask.stride(2), mask.stride(3),
               out.data_ptr<float>(), H, T, D, H / Hkv, L, (float)scale, kv};
  attend_tasks(active_paths(), a, B, Hkv, torch_threads, at::get_num_threads());
  return out.transpose(1, 2);
}

// RMSNorm over the last dimension (blocked_core.h's norm section): x (..., K) float32, weight (K,).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && x.dim() >= 1,
              "rms_norm: x and weight must be float32");
  const int64_t K = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == K && K > 0, "rms_norm: weight must be (", K, ",)");
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor y = at::empty_like(xc);
  const int64_t M = xc.numel() / K;
  if (M == 0) return y;
  const NormArgs a{xc.data_ptr<float>(), K, wc.data_ptr<float>(), y.data_ptr<float>(), K, K, (float)eps};
  // (rows are independent: any split; a decode step's one row runs inline)
  rms_norm_rows(active_paths(), a, M, [](int64_t b, int64_t e, auto&& f) { at::parallel_for(b, e, 64, f); });
  return y;
}

// ---- sampling: one token a row by inverting the running sum (quickdraft.sampling.draw) ----
// weights (..., V) float32 >= 0, not necessarily normalised; u (...) float64 in [0, 1): the index i of
// weight i where u x total falls in its running sum, in float64 and in two levels as sampling.draw says:
// DRAW_BLOCK-weight block sums (each in one fixed order: 8 partial sums combined pairwise, the same
// bits on every ISA and compiler), whose running sum picks a block, then the block's own running sum
// the index. The threshold is held below the total, an index past the block's own sum (the two sums
// round apart) falls back to the block's last positive weight, and weights without a positive
// finite total give 0. One pass over the row and a few scalar steps, where the tensor version takes
// ~25 small ops (~0.1 ms a call at batch 1, several calls a sampled speculative step).
constexpr int64_t DRAW_BLOCK = 256;

// The float64 sum of n floats in one fixed order (8 partial sums, combined pairwise): a plain loop
// the compiler vectorises, the same bits on every ISA.
double sum_fixed(const float* p, int64_t n) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += (double)p[i + j];
  for (int j = 0; i < n; ++i, ++j) acc[j] += (double)p[i];
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

int64_t draw_row(const float* w, int64_t V, double u, double* ends) {
  const int64_t nb = (V + DRAW_BLOCK - 1) / DRAW_BLOCK;
  double run = 0.0;
  for (int64_t b = 0; b < nb; ++b) {
    run += sum_fixed(w + b * DRAW_BLOCK, std::min(DRAW_BLOCK, V - b * DRAW_BLOCK));
    ends[b] = run;
  }
  const double total = ends[nb - 1];
  if (!(total > 0.0) || !std::isfinite(total)) return 0;
  const double x = std::min(u * total, std::nextafter(total, 0.0));
  int64_t b = std::upper_bound(ends, ends + nb, x) - ends;  // the first block whose running sum passes x
  b = std::min(b, nb - 1);
  const double y = x - (b > 0 ? ends[b - 1] : 0.0);
  const float* p = w + b * DRAW_BLOCK;
  const int64_t n = std::min(DRAW_BLOCK, V - b * DRAW_BLOCK);
  int64_t j = n, last = -1;
  double c = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    c += (double)p[i];
    if (p[i] > 0.0f) last = i;
    if (c > y && j == n) j = i;
  }
  return b * DRAW_BLOCK + std::max<int64_t>(std::min(j, last), 0);
}

at::Tensor draw(const at::Tensor& weights, const at::Tensor& u) {
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.dim() >= 1 && weights.size(-1) > 0,
              "draw: weights must be float32 (..., V), V > 0");
  TORCH_CHECK(u.scalar_type() == at::kDouble && u.sizes() == weights.sizes().slice(0, weights.dim() - 1),
              "draw: u must be float64 with the weights' leading shape");
  const at::Tensor wc = weights.contiguous(), uc = u.contiguous();
  const int64_t V = wc.size(-1), R = uc.numel();
  at::Tensor out = at::empty(uc.sizes(), uc.options().dtype(at::kLong));
  const float* w = wc.data_ptr<float>();
  const double* us = uc.data_ptr<double>();
  int64_t* o = out.data_ptr<int64_t>();
  // rows are independent: a few rows of a vocabulary run inline, many in parallel
  at::parallel_for(0, R, std::max<int64_t>(1, (1 << 17) / V), [&](int64_t begin, int64_t end) {
    std::vector<double> ends((V + DRAW_BLOCK - 1) / DRAW_BLOCK);
    for (int64_t r = begin; r < end; ++r) o[r] = draw_row(w + r * V, V, us[r], ends.data());
  });
  return out;
}

// max(r - q, 0) into res; where q is null (a deterministic token x, q = one-hot(x)), r with r(x) = 0
// (the same for probabilities, which never exceed 1).
void residual(const float* r, const float* q, int64_t x, int64_t V, float* res) {
  if (q == nullptr) {
    std::copy(r, r + V, res);
    res[x] = 0.0f;
    return;
  }
  for (int64_t k = 0; k < V; ++k) {
    const float d = r[k] - q[k];
    res[k] = d < 0.0f ? 0.0f : d;
  }
}

// Recursive rejection sampling over one row's token tree (quickdraft.verify.tree_rejection_sample's
// rule, its loop over levels and children here instead of ~20 tensor ops per child): from the root
// with r = p(root), try the children of the current node in index order; a child x is accepted with
// probability r(x) / q(x) (u q(x) < r(x); q = 1 for deterministic candidates), and becomes the node
// (r = p(child)); a rejected child leaves r = max(r - q, 0) (deterministic: r with r(x) = 0)
// normalised, unless that has no mass (rounding: r == q), which keeps r. When no child is accepted
// the last token is drawn from r (draw_row). The residual's mass is summed in float64 (8 partial
// sums in one fixed order), the normalised residual stored in float32. Returns the accepted node
// (-1: none) and the last token.
std::pair<int64_t, int64_t> tree_rejection_row(const int64_t* tokens, const int64_t* parents, int64_t N,
                                               const float* p, const float* q, const float* u, double final,
                                               int64_t V, float* r, float* res, double* ends) {
  std::copy(p, p + V, r);
  int64_t cur = 0, accepted = -1;  // 0: the root; 1 + i: node i
  for (bool moved = true; moved;) {
    moved = false;
    for (int64_t c = 0; c < N && !moved; ++c) {
      if (tokens[c] < 0 || parents[c] + 1 != cur) continue;  // (an invalid node is no one's child)
      const int64_t x = tokens[c];
      const float* qc = q == nullptr ? nullptr : q + c * V;
      const float q_x = qc == nullptr ? 1.0f : qc[x];
      if (u[c] * q_x < r[x]) {
        cur = c + 1, accepted = c, moved = true;
        std::copy(p + cur * V, p + (cur + 1) * V, r);
        break;
      }
      // the residual (deterministic: r with r(x) = 0; sampled: max(r - q, 0)) in res, its mass, then r =
      // res / mass: plain loops the compiler vectorises
      residual(r, qc, x, V, res);
      const float m = (float)sum_fixed(res, V);
      if (!(m > 0.0f)) continue;  // a massless residual (rounding: r == q): keep r
      for (int64_t k = 0; k < V; ++k) r[k] = res[k] / m;
    }
  }
  return {accepted, draw_row(r, V, final, ends)};
}

// Exact speculative sampling over one row's chain (quickdraft.verify.rejection_sample's rule and its
// float32 arithmetic): the first n tokens pass u q(x) < p(x) (q = 1 for deterministic tokens; -1 ends
// the chain), then the last token is drawn (draw_row) from max(p - q, 0) after them, or from p where
// all k passed, the chain ended or that residual has no mass. emitted: the n tokens, the last, then -1.
void rejection_row(const int64_t* tokens, int64_t k, const float* p, const float* q, const float* u, double final,
                   int64_t V, float* res, double* ends, int64_t* emitted, int64_t* num_accepted) {
  int64_t n = 0;
  while (n < k && tokens[n] >= 0 && u[n] * (q == nullptr ? 1.0f : q[n * V + tokens[n]]) < p[n * V + tokens[n]]) ++n;
  const float* pn = p + n * V;
  const float* weights = pn;
  if (n < k && tokens[n] >= 0) {
    bool mass = false;
    residual(pn, q == nullptr ? nullptr : q + n * V, tokens[n], V, res);
    for (int64_t v = 0; v < V && !mass; ++v) mass = res[v] > 0.0f;
    if (mass) weights = res;
  }
  for (int64_t i = 0; i <= k; ++i) emitted[i] = i < n ? tokens[i] : -1;
  emitted[n] = draw_row(weights, V, final, ends);
  *num_accepted = n;
}

// The operands rejection_sample and tree_rejection_sample share, checked: tokens (B, n) int64 (n:
// the draft's k, or a tree's N nodes), target_probs (B, n + 1, V) float32, draft_probs (B, n, V)
// float32 or none, uniform float32 shaped as tokens, final (B,) float64, every token below V.
// Returns V.
int64_t check_rejection_args(const char* op, const char* n, const at::Tensor& tokens, const at::Tensor& target_probs,
                             const c10::optional<at::Tensor>& draft_probs, const at::Tensor& uniform,
                             const at::Tensor& final) {
  TORCH_CHECK(tokens.dim() == 2 && tokens.scalar_type() == at::kLong, op, ": tokens must be (B, ", n, ") int64");
  const int64_t B = tokens.size(0), k = tokens.size(1);
  TORCH_CHECK(target_probs.dim() == 3 && target_probs.scalar_type() == at::kFloat && target_probs.size(0) == B &&
                  target_probs.size(1) == k + 1 && target_probs.size(2) > 0,
              op, ": target_probs must be (B, ", n, " + 1, V) float32");
  const int64_t V = target_probs.size(2);
  TORCH_CHECK(!draft_probs.has_value() || (draft_probs->scalar_type() == at::kFloat && draft_probs->dim() == 3 &&
                                           draft_probs->size(0) == B && draft_probs->size(1) == k &&
                                           draft_probs->size(2) == V),
              op, ": draft_probs must be (B, ", n, ", V) float32");
  TORCH_CHECK(uniform.scalar_type() == at::kFloat && uniform.sizes() == tokens.sizes() &&
                  final.scalar_type() == at::kDouble && final.dim() == 1 && final.size(0) == B,
              op, ": uniform must be (B, ", n, ") float32, final (B,) float64");
  const at::Tensor tc = tokens.contiguous();
  for (int64_t i = 0; i < tc.numel(); ++i) TORCH_CHECK(tc.data_ptr<int64_t>()[i] < V, op, ": a token past the vocabulary");
  return V;
}

std::tuple<at::Tensor, at::Tensor> rejection_sample(const at::Tensor& tokens, const at::Tensor& target_probs,
                                                    const c10::optional<at::Tensor>& draft_probs,
                                                    const at::Tensor& uniform, const at::Tensor& final) {
  const int64_t V = check_rejection_args("rejection_sample", "k", tokens, target_probs, draft_probs, uniform, final);
  const int64_t B = tokens.size(0), k = tokens.size(1);
  const at::Tensor tc = tokens.contiguous(), tp = target_probs.contiguous(), uc = uniform.contiguous(),
                   fc = final.contiguous();
  const at::Tensor dp = draft_probs.has_value() ? draft_probs->contiguous() : at::Tensor();
  at::Tensor emitted = at::empty({B, k + 1}, tc.options()), accepted = at::empty({B}, tc.options());
  const int64_t* t = tc.data_ptr<int64_t>();
  const float *p = tp.data_ptr<float>(), *q = dp.defined() ? dp.data_ptr<float>() : nullptr, *u = uc.data_ptr<float>();
  const double* f = fc.data_ptr<double>();
  int64_t *e = emitted.data_ptr<int64_t>(), *a = accepted.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> res(V);
    std::vector<double> ends((V + DRAW_BLOCK - 1) / DRAW_BLOCK);
    for (int64_t b = begin; b < end; ++b)
      rejection_row(t + b * k, k, p + b * (k + 1) * V, q == nullptr ? nullptr : q + b * k * V, u + b * k, f[b], V,
                    res.data(), ends.data(), e + b * (k + 1), a + b);
  });
  return {emitted, accepted};
}

std::tuple<at::Tensor, at::Tensor> tree_rejection_sample(const at::Tensor& tokens, const at::Tensor& parents,
                                                         const at::Tensor& target_probs,
                                                         const c10::optional<at::Tensor>& draft_probs,
                                                         const at::Tensor& uniform, const at::Tensor& final) {
  const int64_t V = check_rejection_args("tree_rejection_sample", "N", tokens, target_probs, draft_probs, uniform, final);
  TORCH_CHECK(parents.sizes() == tokens.sizes() && parents.scalar_type() == at::kLong,
              "tree_rejection_sample: parents must be (B, N) int64, as tokens");
  const int64_t B = tokens.size(0), N = tokens.size(1);
  const at::Tensor tc = tokens.contiguous(), pc = parents.contiguous(), tp = target_probs.contiguous(),
                   uc = uniform.contiguous(), fc = final.contiguous();
  const at::Tensor dp = draft_probs.has_value() ? draft_probs->contiguous() : at::Tensor();
  at::Tensor accepted = at::empty({B}, tc.options()), last = at::empty({B}, tc.options());
  const int64_t *t = tc.data_ptr<int64_t>(), *pa = pc.data_ptr<int64_t>();
  const float *p = tp.data_ptr<float>(), *q = dp.defined() ? dp.data_ptr<float>() : nullptr, *u = uc.data_ptr<float>();
  const double* f = fc.data_ptr<double>();
  int64_t *a = accepted.data_ptr<int64_t>(), *l = last.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> r(V), res(V);
    std::vector<double> ends((V + DRAW_BLOCK - 1) / DRAW_BLOCK);
    for (int64_t b = begin; b < end; ++b) {
      const auto out = tree_rejection_row(t + b * N, pa + b * N, N, p + b * (N + 1) * V,
                                          q == nullptr ? nullptr : q + b * N * V, u + b * N, f[b], V, r.data(),
                                          res.data(), ends.data());
      a[b] = out.first, l[b] = out.second;
    }
  });
  return {accepted, last};
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

extern "C" __attribute__((visibility("default"))) int32_t aoti_torch_cpu_blocked_mm_bf16(void* x, void* packed,
                                                                                         void** bias, int64_t n,
                                                                                         void** ret0) {
  return shim_call([&] {
    *ret0 = new at::Tensor(blocked_mm_bf16(*static_cast<at::Tensor*>(x), *static_cast<at::Tensor*>(packed), opt(bias), n));
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

extern "C" __attribute__((visibility("default"))) int32_t aoti_torch_cpu_rms_norm(void* x, void* weight, double eps,
                                                                                  void** ret0) {
  return shim_call([&] {
    *ret0 = new at::Tensor(rms_norm(*static_cast<at::Tensor*>(x), *static_cast<at::Tensor*>(weight), eps));
  });
}

// The instruction-set switch, for quickdraft/kernels/__init__.py (ctypes): 0 portable, 1 AVX2 +
// FMA, 2 AVX-512, 3 NEON. quickdraft_set_isa returns 0, or -1 where the CPU lacks that ISA (unchanged).
extern "C" __attribute__((visibility("default"))) int32_t quickdraft_isa() { return chosen_isa.load(); }
extern "C" __attribute__((visibility("default"))) int32_t quickdraft_cpu_has(int32_t isa) { return cpu_has(isa); }
// int8's and int4's integer dot-product instructions (AVX-512 VNNI, AVX-VNNI, NEON's sdot) on (1,
// where the CPU has them) or off (0: maddubs + madd, vmull: the same bits); returns the previous setting.
extern "C" __attribute__((visibility("default"))) int32_t quickdraft_set_vnni(int32_t on) {
  return vnni_allowed.exchange(on != 0);
}
// Whether the chosen path's int4 (and int8) kernel runs vpdpbusd / sdot (1) or not (0).
extern "C" __attribute__((visibility("default"))) int32_t quickdraft_int4_vnni() {
  if (!vnni_allowed.load()) return 0;
#if QD_X86
  if (chosen_isa.load() == ISA_AVX512) return cpu_avx512_vnni();
  if (chosen_isa.load() == ISA_AVX2) return cpu_avx_vnni();
#endif
#if QD_ARM
  if (chosen_isa.load() == ISA_NEON) return cpu_arm_dotprod();
#endif
  return 0;
}
// AMX for the int8 and int4 kernels (blocked_amx.h), where the CPU has it and Linux lends this process
// the tiles: off (0: the AVX-512 kernels, the same bits), on for calls of several rows (1), on for
// every call (2); returns the previous setting.
extern "C" __attribute__((visibility("default"))) int32_t quickdraft_set_amx(int32_t mode) {
#if QD_X86
  return amx_mode.exchange(mode < 0 || mode > 2 ? 1 : mode);
#else
  return 0;
#endif
}
// attend's split over the threads by keys and outputs (blocked_core.h's attend_split): off (0), where a
// call's passes are too few for the threads (1, the default), every call (2); returns the previous setting.
extern "C" __attribute__((visibility("default"))) int32_t quickdraft_set_attend_split(int32_t mode) {
  return attend_split_mode.exchange(mode < 0 || mode > 2 ? 1 : mode);
}
// The smallest int8 (int4 = 0) or int4 (1) call, in rows, that runs on AMX here now; 0 where none does.
extern "C" __attribute__((visibility("default"))) int32_t quickdraft_amx_rows(int32_t int4) {
#if QD_X86
  const int mode = amx_mode.load();
  if (chosen_isa.load() != ISA_AVX512 || mode == 0 || !cpu_amx()) return 0;
  return mode == 2 ? 1 : int32_t(int4 ? AMX_ROWS_Q4 : AMX_ROWS_Q8);
#else
  return 0;
#endif
}
extern "C" __attribute__((visibility("default"))) int32_t quickdraft_set_isa(int32_t isa) {
  if (!cpu_has(isa)) return -1;
  chosen_isa.store(isa);
  return 0;
}

TORCH_LIBRARY(quickdraft, m) {
  m.def("blocked_mm(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
  m.def("blocked_mm_int8(Tensor x, Tensor packed, Tensor scale, Tensor? bias, int n) -> Tensor");
  m.def("blocked_mm_int4(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
  m.def("blocked_mm_bf16(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
  m.def("attend(Tensor q, Tensor k, Tensor v, Tensor mask, float scale) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("draw(Tensor weights, Tensor u) -> Tensor");
  m.def("rejection_sample(Tensor tokens, Tensor target_probs, Tensor? draft_probs, Tensor uniform, Tensor final) -> (Tensor, Tensor)");
  m.def("tree_rejection_sample(Tensor tokens, Tensor parents, Tensor target_probs, Tensor? draft_probs, Tensor uniform, Tensor final) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(quickdraft, CPU, m) {
  m.impl("blocked_mm", &blocked_mm);
  m.impl("blocked_mm_int8", &blocked_mm_int8);
  m.impl("blocked_mm_int4", &blocked_mm_int4);
  m.impl("blocked_mm_bf16", &blocked_mm_bf16);
  m.impl("attend", &attend);
  m.impl("rms_norm", &rms_norm);
  m.impl("draw", &draw);
  m.impl("rejection_sample", &rejection_sample);
  m.impl("tree_rejection_sample", &tree_rejection_sample);
}
