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

__attribute__((target("avx2,fma"))) inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 32 signed x 32 signed int8 -> 8 int32 partial sums (llama.cpp's sign trick: |w| is unsigned).
__attribute__((target("avx2,fma"))) inline __m256i dot_s8(__m256i w, __m256i x) {
  const __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
  return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
}

// 32 unsigned (0..15) x 32 signed int8 -> 8 int32 partial sums (no int16 overflow: 2 x 15 x 127).
__attribute__((target("avx2,fma"))) inline __m256i dot_u4(__m256i w, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
}

constexpr int64_t kRowTile = 4;  // activation rows sharing each loaded weight block

__attribute__((target("avx2,fma"))) void q8_avx2(const Acts& a, const int8_t* w, const float* ws,
                                                 int64_t G, int64_t bpg, const float* bias,
                                                 float* y, int64_t M, int64_t N, int64_t Kp,
                                                 int64_t n0, int64_t n1) {
  const int64_t nb = Kp / kBlock;
  const int8_t* xq = a.codes.data_ptr<int8_t>();
  const float* xd = a.scale.data_ptr<float>();
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wr = w + n * Kp;
    for (int64_t m0 = 0; m0 < M; m0 += kRowTile) {
      const int64_t rows = std::min(kRowTile, M - m0);
      __m256 acc[kRowTile] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                              _mm256_setzero_ps()};
      for (int64_t b = 0; b < nb; ++b) {
        const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + b * kBlock));
        const float s = ws[n * G + b / bpg];
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t m = m0 + r;
          const __m256i xv =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * Kp + b * kBlock));
          const __m256 f = _mm256_cvtepi32_ps(dot_s8(wv, xv));
          acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(s * xd[m * nb + b]), f, acc[r]);
        }
      }
      for (int64_t r = 0; r < rows; ++r)
        y[(m0 + r) * N + n] = hsum8(acc[r]) + (bias ? bias[n] : 0.f);
    }
  }
}

__attribute__((target("avx2,fma"))) void q4_avx2(const Acts& a, const uint8_t* w, const float* ws,
                                                 const float* wz, int64_t G, int64_t bpg,
                                                 const float* bias, float* y, int64_t M, int64_t N,
                                                 int64_t Kp, int64_t n0, int64_t n1) {
  const int64_t nb = Kp / kBlock;
  const int8_t* xq = a.codes.data_ptr<int8_t>();
  const float* xd = a.scale.data_ptr<float>();
  const int32_t* xs = a.sum.data_ptr<int32_t>();
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * (Kp / 2);
    for (int64_t m0 = 0; m0 < M; m0 += kRowTile) {
      const int64_t rows = std::min(kRowTile, M - m0);
      __m256 acc[kRowTile] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                              _mm256_setzero_ps()};
      float corr[kRowTile] = {0.f, 0.f, 0.f, 0.f};  // sum over blocks of s d z sum(x codes)
      for (int64_t b = 0; b < nb; ++b) {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + b * 16));
        const __m256i wv =
            _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low4);
        const int64_t g = n * G + b / bpg;
        const float s = ws[g], z = wz[g];
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t m = m0 + r;
          const __m256i xv =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * Kp + b * kBlock));
          const float sd = s * xd[m * nb + b];
          acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(sd), _mm256_cvtepi32_ps(dot_u4(wv, xv)), acc[r]);
          corr[r] += sd * z * float(xs[m * nb + b]);
        }
      }
      for (int64_t r = 0; r < rows; ++r)
        y[(m0 + r) * N + n] = hsum8(acc[r]) - corr[r] + (bias ? bias[n] : 0.f);
    }
  }
}

// Output columns per parallel task: enough to amortise the task, small enough to balance 2-16 threads.
int64_t column_grain(int64_t N) { return std::max<int64_t>(16, N / 64); }

void check_inputs(const at::Tensor& x, const at::Tensor& scales, int64_t N,
                  const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "kvq: x must be a contiguous fp32 [M, K] tensor");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.size(0) == N,
              "kvq: scales must be contiguous fp32 [N, G]");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->numel() == N &&
                        bias->is_contiguous()),
              "kvq: bias must be contiguous fp32 [N]");
}

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                     int64_t bpg, const std::optional<at::Tensor>& bias, int64_t act_mode) {
  const int64_t M = x.size(0), N = w.size(0), Kp = w.size(1), G = scales.size(1);
  check_inputs(x, scales, N, bias);
  TORCH_CHECK(w.scalar_type() == at::kChar && Kp % kBlock == 0 && x.size(1) <= Kp,
              "kvq: int8 weight must be [N, Kp], Kp a multiple of 32 and >= K");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const Acts a = quantize_acts(x, Kp, act_mode);
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  const int isa = cpu_isa();
  at::parallel_for(0, N, column_grain(N), [&](int64_t n0, int64_t n1) {
    if (isa >= 2)
      q8_avx2(a, w.data_ptr<int8_t>(), scales.data_ptr<float>(), G, bpg, bp, y.data_ptr<float>(),
              M, N, Kp, n0, n1);
    else
      q8_scalar(a, w.data_ptr<int8_t>(), scales.data_ptr<float>(), G, bpg, bp,
                y.data_ptr<float>(), M, N, Kp, n0, n1);
  });
  return y;
}

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                     const at::Tensor& zeros, int64_t bpg, const std::optional<at::Tensor>& bias,
                     int64_t act_mode) {
  const int64_t M = x.size(0), N = w.size(0), Kp = 2 * w.size(1), G = scales.size(1);
  check_inputs(x, scales, N, bias);
  TORCH_CHECK(w.scalar_type() == at::kByte && Kp % kBlock == 0 && x.size(1) <= Kp,
              "kvq: int4 weight must be uint8 [N, Kp / 2], Kp a multiple of 32 and >= K");
  TORCH_CHECK(zeros.sizes() == scales.sizes() && zeros.scalar_type() == at::kFloat &&
                  zeros.is_contiguous(),
              "kvq: zeros must be contiguous fp32 shaped like scales");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const Acts a = quantize_acts(x, Kp, act_mode);
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  const int isa = cpu_isa();
  at::parallel_for(0, N, column_grain(N), [&](int64_t n0, int64_t n1) {
    if (isa >= 2)
      q4_avx2(a, w.data_ptr<uint8_t>(), scales.data_ptr<float>(), zeros.data_ptr<float>(), G, bpg,
              bp, y.data_ptr<float>(), M, N, Kp, n0, n1);
    else
      q4_scalar(a, w.data_ptr<uint8_t>(), scales.data_ptr<float>(), zeros.data_ptr<float>(), G,
                bpg, bp, y.data_ptr<float>(), M, N, Kp, n0, n1);
  });
  return y;
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
