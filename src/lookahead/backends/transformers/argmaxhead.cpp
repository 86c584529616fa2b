// Greedy choices of the output layer without its whole float32 product: each row's first largest logit, found from
// logits of bfloat16 products (half the weight to read, and the matrix units where the CPU has them) with a bound on
// how far each can be from its float32 logit, then the few tokens within reach made exactly (argmaxhead.py).
//
// For row r and token n, |approximate − float32 logit| ≤ scale[r] · norm[n] + relative · |approximate| + absolute[r]
// (scale[r]: the row's length and the rounding of both products; norm[n]: the weight row's length; absolute[r]: what
// values flushed to zero may lose). The float32 largest logit's token m has approximate[m] + bound[m] ≥ its logit ≥
// every other logit ≥ approximate[n] − bound[n], so it is among the tokens whose upper end reaches the highest lower
// end; those are multiplied by the row kernel, whose bits for an output do not depend on which others it computes,
// and the first largest of them is the row's choice.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

torch::Tensor linear(const torch::Tensor& input, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias);

namespace {

// Each row's choice (rows, ) int64, or None (an undefined tensor) where more than `most` candidates (all rows
// together) would be made exactly, or a value is not finite: the caller then makes the whole product.
torch::Tensor head_argmax(const torch::Tensor& hidden, const torch::Tensor& weight, const torch::Tensor& approximate,
                          const torch::Tensor& scales, const torch::Tensor& absolutes, const torch::Tensor& norms,
                          double relative, int64_t most) {
  TORCH_CHECK(hidden.dim() == 2 && approximate.dim() == 2 && approximate.size(0) == hidden.size(0), "(rows, ...)");
  TORCH_CHECK(approximate.scalar_type() == torch::kFloat32 && scales.scalar_type() == torch::kFloat32 &&
                  absolutes.scalar_type() == torch::kFloat32 && norms.scalar_type() == torch::kFloat32,
              "float32 approximations and bounds");
  const int64_t rows = hidden.size(0), vocab = approximate.size(1);
  TORCH_CHECK(norms.numel() == vocab && scales.numel() == rows && absolutes.numel() == rows && weight.size(0) == vocab,
              "one norm per token, one scale per row");
  const auto logits = approximate.contiguous();
  const float* norm = norms.data_ptr<float>();
  const float* scale = scales.data_ptr<float>();
  const float* absolute = absolutes.data_ptr<float>();
  const float rel = static_cast<float>(relative);
  std::vector<std::vector<int64_t>> reach(rows);  // per row, the tokens within reach, ascending
  std::vector<char> finite(rows, 1);
  at::parallel_for(0, rows, 1, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const float* row = logits.data_ptr<float>() + r * vocab;
      const float s = scale[r], a = absolute[r];
      auto low = [&](int64_t n) { return row[n] - (s * norm[n] + rel * std::fabs(row[n]) + a); };
      auto reaches = [&](int64_t n, float lower) {
        return row[n] + (s * norm[n] + rel * std::fabs(row[n]) + a) >= lower;
      };
      // in lanes of 16 (written so the compiler makes vectors of them): the highest lower end, and whether all are
      // finite (|x| ≤ the largest float fails for infinities and NaN)
      constexpr int64_t kLanes = 16;
      const int64_t whole = vocab / kLanes * kLanes;
      float lanes[kLanes];
      int inside[kLanes];
      for (int64_t j = 0; j < kLanes; ++j) lanes[j] = -std::numeric_limits<float>::infinity(), inside[j] = 1;
      for (int64_t n = 0; n < whole; n += kLanes) {
        for (int64_t j = 0; j < kLanes; ++j) {
          const float value = low(n + j);
          lanes[j] = value > lanes[j] ? value : lanes[j];
          inside[j] &= std::fabs(row[n + j]) <= std::numeric_limits<float>::max();
        }
      }
      float lower = -std::numeric_limits<float>::infinity();
      bool all_finite = true;
      for (int64_t j = 0; j < kLanes; ++j) lower = std::max(lower, lanes[j]), all_finite &= inside[j] != 0;
      for (int64_t n = whole; n < vocab; ++n)
        lower = std::max(lower, low(n)), all_finite &= std::fabs(row[n]) <= std::numeric_limits<float>::max();
      if (!all_finite || !std::isfinite(lower)) {  // (a bound not finite leaves no sound lower end)
        finite[r] = 0;
        continue;
      }
      for (int64_t n = 0; n < whole; n += kLanes) {
        int hit = 0;
        for (int64_t j = 0; j < kLanes; ++j) hit |= reaches(n + j, lower);
        if (hit)
          for (int64_t j = 0; j < kLanes; ++j)
            if (reaches(n + j, lower)) reach[r].push_back(n + j);
      }
      for (int64_t n = whole; n < vocab; ++n)
        if (reaches(n, lower)) reach[r].push_back(n);
    }
  });
  int64_t candidates = 0;
  for (int64_t r = 0; r < rows; ++r) {
    if (!finite[r] || reach[r].empty()) return torch::Tensor();
    candidates += static_cast<int64_t>(reach[r].size());
  }
  if (candidates > most) return torch::Tensor();
  auto choices = torch::empty({rows}, torch::kLong);
  int64_t* chosen = choices.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    const auto index = torch::tensor(reach[r], torch::kLong);
    const auto exact = ::linear(hidden.narrow(0, r, 1), weight.index_select(0, index), c10::nullopt).contiguous();
    const float* made = exact.data_ptr<float>();
    int64_t best = 0;
    for (int64_t i = 0; i < index.numel(); ++i) {  // ascending tokens: the first of equal logits is kept
      if (!std::isfinite(made[i])) return torch::Tensor();
      if (made[i] > made[best]) best = i;
    }
    chosen[r] = reach[r][best];
  }
  return choices;
}

}  // namespace

void register_argmax_head(pybind11::module_& module) {
  module.def("head_argmax", &head_argmax, "each row's greedy choice from bounded approximate logits",
             pybind11::call_guard<pybind11::gil_scoped_release>());
}
