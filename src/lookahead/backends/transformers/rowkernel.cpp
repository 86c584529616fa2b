// y = x · wᵀ (+ bias) in float32 for a few rows of x, reading each row of w once for all of them.
//
// Why: a decoding step multiplies 1 to a few dozen rows by every weight of the model, and on a CPU
// the price is reading the weights. The BLAS's one-row path reads them at the memory's speed, but
// from a few rows on it switches to kernels that read them slower; this loop keeps each pair of w's
// rows in the first-level cache while every row of x is multiplied by them, and prefetches the
// weights far enough ahead that the multiply-adds do not stall the stream.
//
// Every output y[m, n] is summed the same way whatever the number of rows and threads: lane j of a
// vector sums the products at k ≡ j (mod lanes) in order of k, the lanes are added in one fixed
// tree, then the leftover k in order, then the bias. So a token's row in a block of drafts gets the
// bits of its one-token product.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>

namespace {

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int kLanes = 16;
constexpr int kRowsAtOnce = 8;  // 2 weight rows x 8 rows of x = 16 accumulators of 32 registers
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float lanes_sum(Vec v) {
  __m256 half = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  __m128 quarter = _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
  quarter = _mm_add_ps(quarter, _mm_movehl_ps(quarter, quarter));
  return _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
}
#elif defined(__AVX2__) && defined(__FMA__)
using Vec = __m256;
constexpr int kLanes = 8;
constexpr int kRowsAtOnce = 4;  // 2 x 4 accumulators of 16 registers
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float lanes_sum(Vec v) {
  __m128 quarter = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  quarter = _mm_add_ps(quarter, _mm_movehl_ps(quarter, quarter));
  return _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
}
#else
#error "the row kernel needs AVX2 with FMA, or AVX-512"
#endif

constexpr int64_t kPrefetch = 2048;  // floats ahead of the weight being read (8 KiB): fastest of 256-8192 measured
constexpr int64_t kPairsPerTask = 16;

// Rows m0..m0+M-1 of x times weight rows n (and n + 1 when `pair`), each product summed as the header says.
template <int M, bool pair>
void block(const float* x, const float* w, const float* bias, float* y, int64_t K, int64_t N, int64_t n,
           bool prefetch) {
  const int64_t whole = K / kLanes * kLanes;
  const float* w0 = w + n * K;
  const float* w1 = pair ? w0 + K : w0;
  Vec a0[M], a1[M];
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) a0[m] = a1[m] = zero();
  for (int64_t k = 0; k < whole; k += kLanes) {
    if (prefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(w0 + k + kPrefetch), _MM_HINT_T0);
      if (pair) _mm_prefetch(reinterpret_cast<const char*>(w1 + k + kPrefetch), _MM_HINT_T0);
    }
    const Vec v0 = load(w0 + k);
    const Vec v1 = pair ? load(w1 + k) : v0;
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const Vec xv = load(x + m * K + k);
      a0[m] = fma(v0, xv, a0[m]);
      if (pair) a1[m] = fma(v1, xv, a1[m]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) {
    const float* xm = x + m * K;
    float s0 = lanes_sum(a0[m]);
    for (int64_t k = whole; k < K; ++k) s0 += w0[k] * xm[k];
    if (bias) s0 += bias[n];
    y[m * N + n] = s0;
    if (pair) {
      float s1 = lanes_sum(a1[m]);
      for (int64_t k = whole; k < K; ++k) s1 += w1[k] * xm[k];
      if (bias) s1 += bias[n + 1];
      y[m * N + n + 1] = s1;
    }
  }
}

template <bool pair>
void rows_of(int64_t rows, const float* x, const float* w, const float* bias, float* y, int64_t K, int64_t N,
             int64_t n, bool prefetch) {
  switch (rows) {
#define ROWS_CASE(R) \
  case R: return block<(R <= kRowsAtOnce ? R : kRowsAtOnce), pair>(x, w, bias, y, K, N, n, prefetch);
    ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7)
#undef ROWS_CASE
    default: return block<kRowsAtOnce, pair>(x, w, bias, y, K, N, n, prefetch);
  }
}

}  // namespace

torch::Tensor linear(const torch::Tensor& input, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(input.scalar_type() == torch::kFloat32 && weight.scalar_type() == torch::kFloat32,
              "the row kernel multiplies float32 only");
  TORCH_CHECK(input.device().is_cpu() && weight.device().is_cpu(), "the row kernel runs on the CPU");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "the row kernel takes a contiguous (out, in) weight");
  const int64_t K = weight.size(1), N = weight.size(0);
  TORCH_CHECK(input.size(-1) == K, "input features ", input.size(-1), " do not match the weight's ", K);
  const torch::Tensor x = input.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == torch::kFloat32 && b.numel() == N, "the bias must be float32 of ", N, " values");
  }
  torch::Tensor y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t pairs = N / 2;
  at::parallel_for(0, pairs + (N % 2), kPairsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n = 2 * p;
      for (int64_t m0 = 0; m0 < M; m0 += kRowsAtOnce) {  // the pair's weight rows stay cached across x's rows
        const int64_t rows = std::min<int64_t>(kRowsAtOnce, M - m0);
        if (p < pairs) {
          rows_of<true>(rows, xp + m0 * K, wp, bp, yp + m0 * N, K, N, n, m0 == 0);
        } else {
          rows_of<false>(rows, xp + m0 * K, wp, bp, yp + m0 * N, K, N, n, m0 == 0);
        }
      }
    }
  });
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.back() = N;
  return y.view(shape);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("linear", &linear, "x times the weight's transpose (+ bias), float32, a few rows at a time");
}
