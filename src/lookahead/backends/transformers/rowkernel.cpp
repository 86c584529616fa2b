// y = x · wᵀ (+ bias) in float32 for a few rows of x, reading each row of w once for all of them.
//
// Why: a decoding step multiplies 1 to a few dozen rows by every weight of the model, and on a CPU
// the price is reading the weights. The BLAS's one-row path reads them at the memory's speed, but
// from a few rows on it switches to kernels that read them slower; this loop keeps a few of w's rows
// in the first-level cache while every row of x is multiplied by them, and prefetches the weights
// far enough ahead that the multiply-adds do not stall the stream.
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
// Tiles of weight rows x rows of x, accumulators of 32 registers: where x has few rows, 2 x 8 (each weight
// row's products done sooner: the stream keeps its pace), else 4 x 6 (fewer loads a multiply-add).
struct Few { static constexpr int kWeightRows = 2, kRowsAtOnce = 8; };
struct Many { static constexpr int kWeightRows = 4, kRowsAtOnce = 6; };
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
struct Few { static constexpr int kWeightRows = 2, kRowsAtOnce = 4; };  // 2 x 4 accumulators of 16 registers
using Many = Few;
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

constexpr int64_t kPrefetch = 2048;  // floats ahead of the weight being read: the distance measured fastest (NOTES)
constexpr int64_t kTilesPerTask = 8;

// Rows 0..M-1 of x times weight rows n..n+T-1, each product summed as the header says.
template <int M, int T>
void block(const float* x, const float* w, const float* bias, float* y, int64_t K, int64_t N, int64_t n,
           bool prefetch) {
  const int64_t whole = K / kLanes * kLanes;
  Vec acc[T][M];
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) acc[t][m] = zero();
  for (int64_t k = 0; k < whole; k += kLanes) {
    Vec v[T];
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) {
      const float* row = w + (n + t) * K + k;
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetch), _MM_HINT_T0);
      v[t] = load(row);
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const Vec xv = load(x + m * K + k);
#pragma GCC unroll 8
      for (int t = 0; t < T; ++t) acc[t][m] = fma(v[t], xv, acc[t][m]);
    }
  }
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t) {
    const float* row = w + (n + t) * K;
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      float sum = lanes_sum(acc[t][m]);
      for (int64_t k = whole; k < K; ++k) sum += row[k] * x[m * K + k];
      if (bias) sum += bias[n + t];
      y[m * N + n + t] = sum;
    }
  }
}

// All M rows of x times weight rows n..n+T-1, C rows of x at a time (the weight rows stay cached).
template <int T, int C>
void tile(int64_t M, const float* x, const float* w, const float* bias, float* y, int64_t K, int64_t N, int64_t n) {
  for (int64_t m0 = 0; m0 < M; m0 += C) {
    const float* xs = x + m0 * K;
    float* ys = y + m0 * N;
    const bool prefetch = m0 == 0;
    switch (std::min<int64_t>(C, M - m0)) {
#define ROWS_CASE(R)                                                   \
  case R:                                                              \
    block<(R < C ? R : C), T>(xs, w, bias, ys, K, N, n, prefetch);     \
    break;
      ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7)
#undef ROWS_CASE
      default: block<C, T>(xs, w, bias, ys, K, N, n, prefetch);
    }
  }
}

// Every row of x times every weight row, in tiles of Shape, the tiles shared among torch's threads.
template <typename Shape>
void product(int64_t M, const float* x, const float* w, const float* bias, float* y, int64_t K, int64_t N) {
  constexpr int T = Shape::kWeightRows, C = Shape::kRowsAtOnce;
  at::parallel_for(0, (N + T - 1) / T, kTilesPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n = p * T;
      if (n + T <= N) {
        tile<T, C>(M, x, w, bias, y, K, N, n);
      } else {
        for (int64_t last = n; last < N; ++last) tile<1, C>(M, x, w, bias, y, K, N, last);
      }
    }
  });
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
  if (M <= Few::kRowsAtOnce) {
    product<Few>(M, xp, wp, bp, yp, K, N);
  } else {
    product<Many>(M, xp, wp, bp, yp, K, N);
  }
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.back() = N;
  return y.view(shape);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("linear", &linear, "x times the weight's transpose (+ bias), float32, a few rows at a time");
}
