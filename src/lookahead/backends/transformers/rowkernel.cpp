// y = x · wᵀ (+ bias) in float32 for a few rows of x, reading each row of w once for all of them.
//
// Why: a decoding step multiplies 1 to a few dozen rows by every weight of the model, and on a CPU
// the price is reading the weights. The BLAS's one-row path reads them at the memory's speed, but
// from a few rows on it switches to kernels that read them slower; this loop keeps a tile of w's rows
// in the first-level cache while every row of x is multiplied by them, and asks for the weights
// early enough that the multiply-adds do not stall the stream: a tile read in one pass asks for the
// weights ahead of itself at two distances; a tile read in several passes over x (more rows than a pass
// holds) would leave the memory idle after its first, so every pass asks for a share of the tile
// two ahead.
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
constexpr int kWeightRows = 4, kRowsAtOnce = 6;  // a tile: 24 accumulators of the 32 registers
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float lanes_sum(Vec v) {
  __m256 half = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  __m128 quarter = _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
  quarter = _mm_add_ps(quarter, _mm_movehl_ps(quarter, quarter));
  return _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
}
// lanes_sum of four vectors at once, each in the same order (lane j + lane j+8, then j+4, j+2, j+1): the
// reductions are a share of a many-row product's work.
inline __m128 four_lanes_sums(Vec a, Vec b, Vec c, Vec d) {
  const Vec halves_ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  const Vec halves_cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  const Vec quarters =
      _mm512_add_ps(_mm512_shuffle_f32x4(halves_ab, halves_cd, 0x88), _mm512_shuffle_f32x4(halves_ab, halves_cd, 0xDD));
  const Vec pairs = _mm512_add_ps(quarters, _mm512_permute_ps(quarters, 0x4E));
  const Vec ones = _mm512_add_ps(pairs, _mm512_permute_ps(pairs, 0xB1));
  const __m512i firsts = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(firsts, ones));
}
#elif defined(__AVX2__) && defined(__FMA__)
using Vec = __m256;
constexpr int kLanes = 8;
constexpr int kWeightRows = 2, kRowsAtOnce = 4;  // a tile: 8 accumulators of the 16 registers
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

constexpr int64_t kPrefetch = 2048;      // floats ahead of the weight being read in one pass, into L1: measured fastest
constexpr int64_t kPrefetchFar = 8192;   // and this far ahead into L2, so more of the stream is on its way (NOTES)
constexpr int64_t kTilesAhead = 2;   // the tile whose share every pass of a several-pass tile asks for
constexpr int64_t kTilesPerTask = 8;

// Where a pass over a tile asks for weights: `near` a little ahead of those it reads (into the first-level
// cache) and further ahead (into the second), or rows first, first + step, ... of the tile at `ahead` (into the
// second).
struct Prefetch {
  bool near = false;
  const float* ahead = nullptr;
  int first = 0, step = 1;
};

// Rows 0..M-1 of x times weight rows n..n+T-1, each product summed as the header says.
template <int M, int T>
void block(const float* x, const float* w, const float* bias, float* y, int64_t K, int64_t N, int64_t n,
           const Prefetch& prefetch) {
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
      if (prefetch.near) {
        _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetch), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetchFar), _MM_HINT_T1);
      }
      v[t] = load(row);
    }
    if (prefetch.ahead)
      for (int t = prefetch.first; t < T; t += prefetch.step)
        _mm_prefetch(reinterpret_cast<const char*>(prefetch.ahead + t * K + k), _MM_HINT_T1);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const Vec xv = load(x + m * K + k);
#pragma GCC unroll 8
      for (int t = 0; t < T; ++t) acc[t][m] = fma(v[t], xv, acc[t][m]);
    }
  }
#if defined(__AVX512F__)
  if constexpr (T == 4) {
    if (whole == K) {
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        __m128 sums = four_lanes_sums(acc[0][m], acc[1][m], acc[2][m], acc[3][m]);
        if (bias) sums = _mm_add_ps(sums, _mm_loadu_ps(bias + n));
        _mm_storeu_ps(y + m * N + n, sums);
      }
      return;
    }
  }
#endif
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

// All M rows of x times weight rows n..n+T-1, C rows of x a pass (the weight rows stay cached).
template <int T, int C>
void tile(int64_t M, const float* x, const float* w, const float* bias, float* y, int64_t K, int64_t N, int64_t n) {
  const int64_t passes = (M + C - 1) / C;
  const bool ahead_exists = n + (kTilesAhead + 1) * T <= N;
  for (int64_t m0 = 0, pass = 0; m0 < M; m0 += C, ++pass) {
    const float* xs = x + m0 * K;
    float* ys = y + m0 * N;
    Prefetch prefetch;
    if (passes == 1) {
      prefetch.near = true;
    } else if (pass < T && ahead_exists) {
      prefetch = {false, w + (n + kTilesAhead * T) * K, static_cast<int>(pass), static_cast<int>(passes)};
    }
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

// Every row of x times every weight row, in tiles, the tiles shared among torch's threads.
void product(int64_t M, const float* x, const float* w, const float* bias, float* y, int64_t K, int64_t N) {
  constexpr int T = kWeightRows, C = kRowsAtOnce;
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
  product(M, xp, wp, bp, yp, K, N);
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.back() = N;
  return y.view(shape);
}

void register_layer_loop(pybind11::module_& module);   // layerloop.cpp, built with this file
void register_argmax_head(pybind11::module_& module);  // argmaxhead.cpp, too

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("linear", &linear, "x times the weight's transpose (+ bias), float32, a few rows at a time");
  register_layer_loop(module);
  register_argmax_head(module);
}
