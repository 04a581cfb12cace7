// Integer GEMM kernels for quantised linears on CPU (docs/quantization.md, "kernels").
//
// y[m, n] = sum_k x[m, k] w[n, k] + bias[n], with W stored as integer codes and fp32 copies of the fp16
// scales. The activation rows are rounded to int8 first (llama.cpp's Q8_0 x Q4_0 scheme): per block of
// 32 inputs (mode 0: near weight-only accuracy), per row (mode 1: W8A8 per token) or one scale for the
// whole input (mode 2: W8A8 per tensor). Each block of 32 is then an integer dot product.
//
// Layouts, K padded with zeros to Kp = a multiple of 32 (nb = Kp / 32 blocks):
//   int8 weights: int8 [N, Kp]; the value is scale[n, b / bpg] * code.
//   int4 weights: uint8 [N, Kp / 2]; in block b the byte j holds element j (low nibble) and element
//     j + 16 (high nibble); codes are unsigned, value = scale[n, g] * (code - zero[n, g]) (symmetric
//     int4 is stored with zero 8).
//   bpg = blocks per scale group (a group of 128 inputs: 4; per channel: nb).
//
// The AVX2 path is compiled with a target attribute and chosen at run time, so the same build runs
// (through the scalar path) on a CPU without AVX2.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;
int g_max_isa = 2;  // 2: AVX2 allowed, 0: scalar only (tests force the fallback)

int cpu_isa() {
  static const int isa =
      (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) ? 2 : 0;
  return std::min(isa, g_max_isa);
}

struct Acts {
  at::Tensor codes;  // int8 [M, Kp]
  at::Tensor scale;  // fp32 [M, nb]
  at::Tensor sum;    // int32 [M, nb]: sum of the block's codes (for zero-points)
};

// Rounds x [M, K] to int8 codes, padded to Kp, with one scale per block, per row or per tensor.
Acts quantize_acts(const at::Tensor& x, int64_t Kp, int64_t mode) {
  const int64_t M = x.size(0), K = x.size(1), nb = Kp / kBlock;
  Acts a{at::zeros({M, Kp}, x.options().dtype(at::kChar)), at::empty({M, nb}, x.options()),
         at::empty({M, nb}, x.options().dtype(at::kInt))};
  const float* xp = x.data_ptr<float>();
  int8_t* qp = a.codes.data_ptr<int8_t>();
  float* dp = a.scale.data_ptr<float>();
  int32_t* sp = a.sum.data_ptr<int32_t>();
  float tensor_max = 0.f;
  if (mode == 2) {
    for (int64_t i = 0; i < M * K; ++i) tensor_max = std::max(tensor_max, std::fabs(xp[i]));
  }
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* row = xp + m * K;
      float row_max = tensor_max;
      if (mode == 1) {
        row_max = 0.f;
        for (int64_t k = 0; k < K; ++k) row_max = std::max(row_max, std::fabs(row[k]));
      }
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t k0 = b * kBlock, k1 = std::min(K, k0 + kBlock);
        float amax = row_max;
        if (mode == 0) {
          amax = 0.f;
          for (int64_t k = k0; k < k1; ++k) amax = std::max(amax, std::fabs(row[k]));
        }
        const float d = amax / 127.f;
        const float inv = d > 0.f ? 1.f / d : 0.f;
        int32_t s = 0;
        for (int64_t k = k0; k < k1; ++k) {
          const int32_t q = static_cast<int32_t>(std::nearbyint(row[k] * inv));
          qp[m * Kp + k] = static_cast<int8_t>(std::clamp(q, -127, 127));
          s += qp[m * Kp + k];
        }
        dp[m * nb + b] = d;
        sp[m * nb + b] = s;
      }
    }
  });
  return a;
}

// ---- scalar reference paths ----------------------------------------------------------------------

void q8_scalar(const Acts& a, const int8_t* w, const float* ws, int64_t G, int64_t bpg,
               const float* bias, float* y, int64_t M, int64_t N, int64_t Kp, int64_t n0,
               int64_t n1) {
  const int64_t nb = Kp / kBlock;
  const int8_t* xq = a.codes.data_ptr<int8_t>();
  const float* xd = a.scale.data_ptr<float>();
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t m = 0; m < M; ++m) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t isum = 0;
        for (int64_t j = 0; j < kBlock; ++j)
          isum += int32_t(w[n * Kp + b * kBlock + j]) * xq[m * Kp + b * kBlock + j];
        acc += ws[n * G + b / bpg] * xd[m * nb + b] * float(isum);
      }
      y[m * N + n] = acc + (bias ? bias[n] : 0.f);
    }
  }
}

void q4_scalar(const Acts& a, const uint8_t* w, const float* ws, const float* wz, int64_t G,
               int64_t bpg, const float* bias, float* y, int64_t M, int64_t N, int64_t Kp,
               int64_t n0, int64_t n1) {
  const int64_t nb = Kp / kBlock;
  const int8_t* xq = a.codes.data_ptr<int8_t>();
  const float* xd = a.scale.data_ptr<float>();
  const int32_t* xs = a.sum.data_ptr<int32_t>();
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t m = 0; m < M; ++m) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* wb = w + n * (Kp / 2) + b * 16;
        const int8_t* xb = xq + m * Kp + b * kBlock;
        int32_t isum = 0;
        for (int64_t j = 0; j < 16; ++j)
          isum += int32_t(wb[j] & 0x0F) * xb[j] + int32_t(wb[j] >> 4) * xb[j + 16];
        const int64_t g = n * G + b / bpg;
        acc += ws[g] * xd[m * nb + b] * (float(isum) - wz[g] * float(xs[m * nb + b]));
      }
      y[m * N + n] = acc + (bias ? bias[n] : 0.f);
    }
  }
}

// ---- AVX2 paths ------------------------------------------------------------------------------------
//
// Register tiles of R activation rows x C weight columns: each loaded weight block serves R rows and
// each activation block C columns. Per-channel weight scales are applied once at the end; per-group
// ones per block. With one activation scale per row (W8A8) an int8 tile accumulates in int32.

#define KVQ_AVX2 __attribute__((target("avx2,fma")))

KVQ_AVX2 inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

KVQ_AVX2 inline int32_t hsum8i(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

struct Tile {
  const int8_t* xq;  // activation codes [M, Kp]
  const float* xd;   // activation scales [M, nb]
  const float* xg;   // int4 only: sum over a group's blocks of scale x code sum, [M, G]
  const float* ws;   // weight scales [N, G]
  const float* wz;   // int4 zero-points [N, G]
  const float* bias;
  float* y;          // [M, N]
  int64_t Kp, nb, G, bpg, N;
};

constexpr int kMaxRows = 4, kMaxCols = 2;

template <int R, int C, bool kIntAcc>
KVQ_AVX2 void q8_tile(const Tile& t, const int8_t* w, int64_t m0, int64_t n0) {
  const bool per_channel = t.G == 1;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][C];
  __m256i iacc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps(), iacc[r][c] = _mm256_setzero_si256();
  for (int64_t b = 0; b < t.nb; ++b) {
    __m256i wv[C], aw[C];
    __m256 sv[C];
    for (int c = 0; c < C; ++c) {
      wv[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (n0 + c) * t.Kp + b * kBlock));
      aw[c] = _mm256_sign_epi8(wv[c], wv[c]);
      if (!per_channel) sv[c] = _mm256_set1_ps(t.ws[(n0 + c) * t.G + b / t.bpg]);
    }
    for (int r = 0; r < R; ++r) {
      const __m256i xv = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(t.xq + (m0 + r) * t.Kp + b * kBlock));
      const __m256 d = _mm256_broadcast_ss(t.xd + (m0 + r) * t.nb + b);
      for (int c = 0; c < C; ++c) {
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw[c], _mm256_sign_epi8(xv, wv[c])), ones);
        if (kIntAcc) {
          iacc[r][c] = _mm256_add_epi32(iacc[r][c], p);
        } else {
          const __m256 f = _mm256_cvtepi32_ps(p);
          acc[r][c] = _mm256_fmadd_ps(per_channel ? d : _mm256_mul_ps(d, sv[c]), f, acc[r][c]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      const int64_t m = m0 + r, n = n0 + c;
      float v = kIntAcc ? float(hsum8i(iacc[r][c])) * t.xd[m * t.nb] : hsum8(acc[r][c]);
      if (per_channel) v *= t.ws[n];
      t.y[m * t.N + n] = v + (t.bias ? t.bias[n] : 0.f);
    }
}

template <int R, int C>
KVQ_AVX2 void q4_tile(const Tile& t, const uint8_t* w, int64_t m0, int64_t n0) {
  const bool per_channel = t.G == 1;
  const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(0x0F);
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t b = 0; b < t.nb; ++b) {
    __m256i wv[C];
    __m256 sv[C];
    for (int c = 0; c < C; ++c) {
      const __m128i raw =
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (n0 + c) * (t.Kp / 2) + b * 16));
      wv[c] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low4);
      if (!per_channel) sv[c] = _mm256_set1_ps(t.ws[(n0 + c) * t.G + b / t.bpg]);
    }
    for (int r = 0; r < R; ++r) {
      const __m256i xv = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(t.xq + (m0 + r) * t.Kp + b * kBlock));
      const __m256 d = _mm256_broadcast_ss(t.xd + (m0 + r) * t.nb + b);
      for (int c = 0; c < C; ++c) {
        const __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(wv[c], xv), ones));
        acc[r][c] = _mm256_fmadd_ps(per_channel ? d : _mm256_mul_ps(d, sv[c]), f, acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      const int64_t m = m0 + r, n = n0 + c;
      float corr = 0.f;  // sum_g s z sum_{b in g} d_b sum(x codes of b)
      for (int64_t g = 0; g < t.G; ++g) corr += t.ws[n * t.G + g] * t.wz[n * t.G + g] * t.xg[m * t.G + g];
      const float v = hsum8(acc[r][c]) * (per_channel ? t.ws[n] : 1.f) - corr;
      t.y[m * t.N + n] = v + (t.bias ? t.bias[n] : 0.f);
    }
}

// Dispatch a remainder tile (rows < 4 or one column) to its instantiation.
template <typename F4, typename F3, typename F2, typename F1>
inline void by_rows(int64_t rows, F4 f4, F3 f3, F2 f2, F1 f1) {
  if (rows == 4) f4(); else if (rows == 3) f3(); else if (rows == 2) f2(); else f1();
}

template <int C, bool kIntAcc>
KVQ_AVX2 void q8_cols(const Tile& t, const int8_t* w, int64_t M, int64_t n) {
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
    by_rows(std::min<int64_t>(kMaxRows, M - m0), [&] { q8_tile<4, C, kIntAcc>(t, w, m0, n); },
            [&] { q8_tile<3, C, kIntAcc>(t, w, m0, n); }, [&] { q8_tile<2, C, kIntAcc>(t, w, m0, n); },
            [&] { q8_tile<1, C, kIntAcc>(t, w, m0, n); });
  }
}

template <int C>
KVQ_AVX2 void q4_cols(const Tile& t, const uint8_t* w, int64_t M, int64_t n) {
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
    by_rows(std::min<int64_t>(kMaxRows, M - m0), [&] { q4_tile<4, C>(t, w, m0, n); },
            [&] { q4_tile<3, C>(t, w, m0, n); }, [&] { q4_tile<2, C>(t, w, m0, n); },
            [&] { q4_tile<1, C>(t, w, m0, n); });
  }
}

KVQ_AVX2 void q8_avx2(const Tile& t, const int8_t* w, int64_t M, int64_t n0, int64_t n1, bool int_acc) {
  int64_t n = n0;
  for (; n + kMaxCols <= n1; n += kMaxCols)
    int_acc ? q8_cols<kMaxCols, true>(t, w, M, n) : q8_cols<kMaxCols, false>(t, w, M, n);
  for (; n < n1; ++n) int_acc ? q8_cols<1, true>(t, w, M, n) : q8_cols<1, false>(t, w, M, n);
}

KVQ_AVX2 void q4_avx2(const Tile& t, const uint8_t* w, int64_t M, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + kMaxCols <= n1; n += kMaxCols) q4_cols<kMaxCols>(t, w, M, n);
  for (; n < n1; ++n) q4_cols<1>(t, w, M, n);
}

// Output columns per parallel task: enough to amortise the task, small enough to balance 2-16 threads.
int64_t column_grain(int64_t N) { return std::max<int64_t>(16, N / 64); }

// x [..., K] of any float dtype and strides -> contiguous fp32 [M, K] (no copy when it already is).
at::Tensor as_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1, "kvq: x must have an input dimension");
  return x.reshape({-1, x.size(-1)}).to(at::kFloat).contiguous();
}

// y [M, N] fp32 -> x's leading dims and dtype.
at::Tensor as_output(const at::Tensor& y, const at::Tensor& x) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = y.size(1);
  return y.view(shape).to(x.scalar_type());
}

void check_inputs(const at::Tensor& x, const at::Tensor& scales, int64_t N,
                  const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.size(0) == N,
              "kvq: scales must be contiguous fp32 [N, G]");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->numel() == N &&
                        bias->is_contiguous()),
              "kvq: bias must be contiguous fp32 [N]");
}

at::Tensor q8_linear(const at::Tensor& x_in, const at::Tensor& w, const at::Tensor& scales,
                     int64_t bpg, const std::optional<at::Tensor>& bias, int64_t act_mode) {
  const at::Tensor x = as_rows(x_in);
  const int64_t M = x.size(0), N = w.size(0), Kp = w.size(1), G = scales.size(1);
  check_inputs(x, scales, N, bias);
  TORCH_CHECK(w.scalar_type() == at::kChar && Kp % kBlock == 0 && x.size(1) <= Kp,
              "kvq: int8 weight must be [N, Kp], Kp a multiple of 32 and >= K");
  TORCH_CHECK(x.size(1) > Kp - kBlock, "kvq: x has ", x.size(1), " inputs, the weight ", Kp);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return as_output(y, x_in);
  const Acts a = quantize_acts(x, Kp, act_mode);
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  const int isa = cpu_isa();
  const Tile t{a.codes.data_ptr<int8_t>(), a.scale.data_ptr<float>(), nullptr,
               scales.data_ptr<float>(), nullptr, bp, y.data_ptr<float>(), Kp, Kp / kBlock, G, bpg, N};
  const bool int_acc = act_mode != 0 && G == 1;  // one activation and one weight scale per row
  at::parallel_for(0, N, column_grain(N), [&](int64_t n0, int64_t n1) {
    if (isa >= 2)
      q8_avx2(t, w.data_ptr<int8_t>(), M, n0, n1, int_acc);
    else
      q8_scalar(a, w.data_ptr<int8_t>(), scales.data_ptr<float>(), G, bpg, bp,
                y.data_ptr<float>(), M, N, Kp, n0, n1);
  });
  return as_output(y, x_in);
}

at::Tensor q4_linear(const at::Tensor& x_in, const at::Tensor& w, const at::Tensor& scales,
                     const at::Tensor& zeros, int64_t bpg, const std::optional<at::Tensor>& bias,
                     int64_t act_mode) {
  const at::Tensor x = as_rows(x_in);
  const int64_t M = x.size(0), N = w.size(0), Kp = 2 * w.size(1), G = scales.size(1);
  check_inputs(x, scales, N, bias);
  TORCH_CHECK(w.scalar_type() == at::kByte && Kp % kBlock == 0 && x.size(1) <= Kp,
              "kvq: int4 weight must be uint8 [N, Kp / 2], Kp a multiple of 32 and >= K");
  TORCH_CHECK(x.size(1) > Kp - kBlock, "kvq: x has ", x.size(1), " inputs, the weight ", Kp);
  TORCH_CHECK(zeros.sizes() == scales.sizes() && zeros.scalar_type() == at::kFloat &&
                  zeros.is_contiguous(),
              "kvq: zeros must be contiguous fp32 shaped like scales");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return as_output(y, x_in);
  const Acts a = quantize_acts(x, Kp, act_mode);
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  const int isa = cpu_isa();
  // xg[m, g] = sum over the blocks of group g of (activation scale x sum of activation codes)
  const int64_t nb = Kp / kBlock;
  at::Tensor xg = at::zeros({M, G}, x.options());
  {
    const float* xd = a.scale.data_ptr<float>();
    const int32_t* xs = a.sum.data_ptr<int32_t>();
    float* xgp = xg.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t b = 0; b < nb; ++b) xgp[m * G + b / bpg] += xd[m * nb + b] * float(xs[m * nb + b]);
  }
  const Tile t{a.codes.data_ptr<int8_t>(), a.scale.data_ptr<float>(), xg.data_ptr<float>(),
               scales.data_ptr<float>(), zeros.data_ptr<float>(), bp, y.data_ptr<float>(),
               Kp, nb, G, bpg, N};
  at::parallel_for(0, N, column_grain(N), [&](int64_t n0, int64_t n1) {
    if (isa >= 2)
      q4_avx2(t, w.data_ptr<uint8_t>(), M, n0, n1);
    else
      q4_scalar(a, w.data_ptr<uint8_t>(), scales.data_ptr<float>(), zeros.data_ptr<float>(), G,
                bpg, bp, y.data_ptr<float>(), M, N, Kp, n0, n1);
  });
  return as_output(y, x_in);
}

int64_t isa() { return cpu_isa(); }
void set_max_isa(int64_t level) { g_max_isa = static_cast<int>(level); }

}  // namespace

TORCH_LIBRARY(kvq, m) {
  m.def("q8_linear(Tensor x, Tensor w, Tensor scales, int bpg, Tensor? bias, int act_mode) -> Tensor");
  m.def(
      "q4_linear(Tensor x, Tensor w, Tensor scales, Tensor zeros, int bpg, Tensor? bias, "
      "int act_mode) -> Tensor");
  m.def("isa() -> int");
  m.def("set_max_isa(int level) -> ()");
}

TORCH_LIBRARY_IMPL(kvq, CPU, m) {
  m.impl("q8_linear", q8_linear);
  m.impl("q4_linear", q4_linear);
}

TORCH_LIBRARY_IMPL(kvq, CatchAll, m) {
  m.impl("isa", isa);
  m.impl("set_max_isa", set_max_isa);
}
