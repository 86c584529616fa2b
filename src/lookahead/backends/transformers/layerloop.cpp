// A Llama-shaped decoder stack as one call: the direct decoder's loop (decoder.py) in C++, for one row or a packed batch.
//
// Why: on a CPU a small model's step is a few hundred tiny operators besides its products, and
// calling each from Python costs more than the operator. This loop makes the very calls the
// Python loop makes — the same ATen operators on the same views and weights, the row kernel's
// products — in the same order, so every bit is the same (capability.check_direct_decoder holds
// it to that), with the interpreter left out. One row's block is written into its cache's room
// after its `length` entries (the caller moves the entries' end); a packed batch's tokens into
// their slab rows and columns, and attended as attention.packed_sdpa_forward attends them (one
// padded call, or the roots' call and one per drafting row).
//
// The norms and the rotation are the exceptions: as ATen operators each is a dozen small calls on
// a few hundred floats, so here they are written out, rounding exactly as ATen's do — the squares
// summed in the order of torch's float sum (8 lanes, four of them interleaved, then the lanes in
// turn), every product and sum rounded alone (so no multiply-add contraction in this file).
#pragma GCC optimize("fp-contract=off")
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <vector>

torch::Tensor linear(const torch::Tensor& input, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias);

namespace {

// input norm; q/k/v joined, its bias; o, its bias; post-attention norm; gate/up joined, its bias; down, its bias
constexpr size_t kPerLayer = 10;

// torch's float sum of `n` values (its reduction kernel, as built for AVX2 and used on AVX-512 CPUs too): vectors of
// 8 lanes, taken four at a time into four accumulators that are folded into a cascade every 16 rounds, the vectors
// left over added to the first, the four added in turn; then the values past the last whole vector, then the lanes.
float torch_sum(const float* values, int64_t n) {
  constexpr int64_t kSumLanes = 8, kInterleave = 4, kLevels = 4, kPower = 4, kStep = int64_t{1} << kPower;
  using Lanes = std::array<float, kSumLanes>;
  const int64_t vectors = n / kSumLanes, rounds = vectors / kInterleave;
  TORCH_CHECK(rounds < (int64_t{1} << 19), "more values than torch sums with a level step of 16");
  auto add = [](Lanes& into, const float* from) {
    for (int64_t lane = 0; lane < kSumLanes; ++lane) into[lane] += from[lane];
  };
  Lanes zero{};
  std::array<std::array<Lanes, kInterleave>, kLevels> level;
  for (auto& accumulators : level) accumulators.fill(zero);
  int64_t round = 0;
  while (round + kStep <= rounds) {
    for (int64_t j = 0; j < kStep; ++j, ++round)
      for (int64_t k = 0; k < kInterleave; ++k) add(level[0][k], values + (round * kInterleave + k) * kSumLanes);
    for (int64_t j = 1; j < kLevels; ++j) {
      for (int64_t k = 0; k < kInterleave; ++k) {
        add(level[j][k], level[j - 1][k].data());
        level[j - 1][k] = zero;
      }
      if ((round & ((kStep - 1) << (j * kPower))) != 0) break;
    }
  }
  for (; round < rounds; ++round)
    for (int64_t k = 0; k < kInterleave; ++k) add(level[0][k], values + (round * kInterleave + k) * kSumLanes);
  for (int64_t j = 1; j < kLevels; ++j)
    for (int64_t k = 0; k < kInterleave; ++k) add(level[0][k], level[j][k].data());
  Lanes partial = level[0][0];
  for (int64_t vector = rounds * kInterleave; vector < vectors; ++vector) add(partial, values + vector * kSumLanes);
  for (int64_t k = 1; k < kInterleave; ++k) add(partial, level[0][k].data());
  float total = 0.0f;
  for (int64_t i = vectors * kSumLanes; i < n; ++i) total += values[i];
  for (float lane : partial) total += lane;
  return total;
}

// torch.rms_norm of float32 rows as ATen computes it: the mean of the squares, plus eps, its reciprocal square root,
// times each value, times the weight.
torch::Tensor rms_norm(const torch::Tensor& input, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(input.scalar_type() == torch::kFloat32 && weight.scalar_type() == torch::kFloat32, "float32 rows");
  const int64_t n = input.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n, "a weight per feature");
  // torch sums fewer than 8 values another way, and one long row's sum in pieces over its threads: its own call there
  if (n < 8 || (input.numel() == n && n >= 32768 && at::get_num_threads() > 1))
    return at::rms_norm(input, {n}, weight, eps);
  const auto x = input.contiguous();
  const auto w = weight.contiguous();
  auto out = at::empty_like(x);
  std::vector<float> squares(n);
  const float* wp = w.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t row = 0, rows = n ? x.numel() / n : 0; row < rows; ++row, xp += n, op += n) {
    for (int64_t i = 0; i < n; ++i) squares[i] = xp[i] * xp[i];
    const float mean = torch_sum(squares.data(), n) / static_cast<float>(n);
    const float scale = 1.0f / std::sqrt(mean + static_cast<float>(eps));
    for (int64_t i = 0; i < n; ++i) op[i] = (xp[i] * scale) * wp[i];
  }
  return out;
}

// Llama's rotation as decoder._rotate computes it, x * cos + (x rolled by half a head) * the half-negated sine, of
// (1, heads, tokens, dim) heads into `out` (any strides); cos and the sine hold (tokens, dim) values.
void rotate_into(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& signed_sin,
                 torch::Tensor& out) {
  TORCH_CHECK(x.dim() == 4 && x.size(0) == 1 && out.sizes() == x.sizes(), "(1, heads, tokens, dim) heads");
  const int64_t heads = x.size(1), tokens = x.size(2), dim = x.size(3), half = dim / 2;
  const auto c = cos.reshape({tokens, dim}).contiguous(), s = signed_sin.reshape({tokens, dim}).contiguous();
  const auto from = x.accessor<float, 4>();
  auto to = out.accessor<float, 4>();
  const auto cs = c.accessor<float, 2>(), ss = s.accessor<float, 2>();
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t d = 0; d < dim; ++d) {
        const float straight = from[0][h][t][d] * cs[t][d];
        const float rolled = from[0][h][t][d < half ? d + half : d - half] * ss[t][d];
        to[0][h][t][d] = straight + rolled;
      }
    }
  }
}

// The rotation into a new tensor laid out as ATen lays out `x * cos + ...` of a (tokens, heads, dim) block's heads.
torch::Tensor rotate(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& signed_sin) {
  auto out = at::empty({1, x.size(2), x.size(1), x.size(3)}, x.options()).transpose(1, 2);
  rotate_into(x, cos, signed_sin, out);
  return out;
}

// (batch, queries, heads, dim) of torch's SDPA as attention._torch_sdpa calls it: each group of query heads handed over
// as one head (`by_group`, with the mask laid out for that: attention._queries_by_group), or the groups read in place.
torch::Tensor attend(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                     const c10::optional<torch::Tensor>& mask, const c10::optional<torch::Tensor>& grouped_mask,
                     bool by_group, double scaling) {
  const int64_t heads = query.size(1), kv_heads = key.size(1);
  if (by_group) {
    const int64_t batch = query.size(0), queries = query.size(2), dim = query.size(3);
    auto output = at::scaled_dot_product_attention(query.reshape({batch, kv_heads, heads / kv_heads * queries, dim}),
                                                   key, value, grouped_mask, 0.0, false, scaling, false);
    return output.view({batch, heads, queries, dim}).transpose(1, 2);
  }
  return at::scaled_dot_product_attention(query, key, value, mask, 0.0, false, scaling, heads != kv_heads)
      .transpose(1, 2);
}

// Every layer of a (1, tokens, hidden) block; `attention(layer, query, key, value)` writes the layer's cache and gives
// its attention as (1, tokens, heads, dim).
template <typename Attention>
torch::Tensor run_layers(torch::Tensor hidden, const torch::Tensor& cos, const torch::Tensor& signed_sin,
                         const std::vector<c10::optional<torch::Tensor>>& params, size_t layers, double eps,
                         int64_t heads, int64_t kv_heads, int64_t head_dim, Attention&& attention) {
  TORCH_CHECK(params.size() == layers * kPerLayer, "one set of weights per layer");
  TORCH_CHECK(hidden.dim() == 3 && hidden.size(0) == 1, "one block: (1, tokens, hidden)");
  const int64_t width = hidden.size(1);
  const std::vector<int64_t> heads_shape{1, width, -1, head_dim}, flat{1, width, -1};
  const std::vector<int64_t> qkv_sizes{heads * head_dim, kv_heads * head_dim, kv_heads * head_dim};
  for (size_t l = 0; l < layers; ++l) {
    const auto* p = &params[l * kPerLayer];
    auto normed = rms_norm(hidden, *p[0], eps);
    auto qkv = ::linear(normed, *p[1], p[2]).split_with_sizes(qkv_sizes, -1);
    auto query = rotate(qkv[0].view(heads_shape).transpose(1, 2), cos, signed_sin);
    auto key = rotate(qkv[1].view(heads_shape).transpose(1, 2), cos, signed_sin);
    auto value = qkv[2].view(heads_shape).transpose(1, 2);
    auto attended = attention(l, query, key, value);
    hidden = hidden + ::linear(attended.reshape(flat).contiguous(), *p[3], p[4]);
    normed = rms_norm(hidden, *p[5], eps);
    auto gate_up = ::linear(normed, *p[6], p[7]);
    auto halves = gate_up.split(gate_up.size(-1) / 2, -1);
    hidden = hidden + ::linear(at::silu(halves[0]) * halves[1], *p[8], p[9]);
  }
  return hidden;
}

}  // namespace

// The loop's weights, kept here between passes (handed over on every call, as many tensors cost more than the pass's
// norms), with what they were made from: each weight or bias as its module held it (the parameter dictionary and
// name; a replacement there is seen), its version counter (bumped by any change in place) and address.
class LoopWeights {
 public:
  LoopWeights(std::vector<c10::optional<torch::Tensor>> params, std::vector<pybind11::dict> holders,
              std::vector<std::string> names)
      : params_(std::move(params)), holders_(std::move(holders)), names_(std::move(names)) {
    TORCH_CHECK(holders_.size() == names_.size(), "a name per parameter dictionary");
    for (size_t i = 0; i < holders_.size(); ++i) {
      held_.push_back(now(i));
      tensors_.push_back(held_.back().is_none() ? c10::nullopt
                                                : c10::optional<torch::Tensor>(held_.back().cast<torch::Tensor>()));
      stamps_.push_back(stamp(tensors_.back()));
    }
  }
  bool current() const {  // called with the interpreter's lock held: it reads the modules' dictionaries
    for (size_t i = 0; i < held_.size(); ++i)
      if (!now(i).is(held_[i]) || stamp(tensors_[i]) != stamps_[i]) return false;
    return true;
  }
  const std::vector<c10::optional<torch::Tensor>>& params() const { return params_; }

 private:
  pybind11::object now(size_t i) const {
    PyObject* item = PyDict_GetItemString(holders_[i].ptr(), names_[i].c_str());  // borrowed; null where absent
    return pybind11::reinterpret_borrow<pybind11::object>(item ? item : Py_None);
  }
  static std::pair<int64_t, const void*> stamp(const c10::optional<torch::Tensor>& tensor) {
    if (!tensor.has_value() || !tensor->defined()) return {-1, nullptr};
    return {static_cast<int64_t>(tensor->_version()), tensor->data_ptr()};
  }
  std::vector<c10::optional<torch::Tensor>> params_;
  std::vector<pybind11::dict> holders_;
  std::vector<std::string> names_;
  std::vector<pybind11::object> held_;
  std::vector<c10::optional<torch::Tensor>> tensors_;
  std::vector<std::pair<int64_t, const void*>> stamps_;
};

torch::Tensor decoder_layers(torch::Tensor hidden, const torch::Tensor& cos, const torch::Tensor& signed_sin,
                             const c10::optional<torch::Tensor>& mask, const LoopWeights& weights,
                             const std::vector<torch::Tensor>& key_rooms, const std::vector<torch::Tensor>& value_rooms,
                             int64_t length, double eps, double scaling, int64_t heads, int64_t kv_heads,
                             int64_t head_dim) {
  TORCH_CHECK(value_rooms.size() == key_rooms.size(), "a key room and a value room per layer");
  const int64_t width = hidden.size(1);
  return run_layers(hidden, cos, signed_sin, weights.params(), key_rooms.size(), eps, heads, kv_heads, head_dim,
                    [&](size_t l, const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value) {
                      key_rooms[l].narrow(-2, length, width).copy_(key);
                      value_rooms[l].narrow(-2, length, width).copy_(value);
                      return attend(query, key_rooms[l].narrow(-2, 0, length + width),
                                    value_rooms[l].narrow(-2, 0, length + width), mask, c10::nullopt, false, scaling);
                    });
}

torch::Tensor packed_decoder_layers(
    torch::Tensor hidden, const torch::Tensor& cos, const torch::Tensor& signed_sin,
    const LoopWeights& weights, const std::vector<torch::Tensor>& key_slabs,
    const std::vector<torch::Tensor>& value_slabs, const torch::Tensor& rows, const torch::Tensor& columns,
    int64_t end, double eps, double scaling, int64_t heads, int64_t kv_heads, int64_t head_dim,
    // one padded call (gather defined), else the roots' call and one per drafting row
    const c10::optional<torch::Tensor>& gather, const c10::optional<torch::Tensor>& scatter, int64_t call_width,
    const c10::optional<torch::Tensor>& call_mask, const c10::optional<torch::Tensor>& call_grouped_mask,
    bool call_by_group, const c10::optional<torch::Tensor>& roots, const c10::optional<torch::Tensor>& root_mask,
    const std::vector<int64_t>& draft_rows, const std::vector<int64_t>& draft_starts,
    const std::vector<int64_t>& draft_sizes, const std::vector<torch::Tensor>& draft_masks,
    const std::vector<c10::optional<torch::Tensor>>& draft_grouped_masks, const std::vector<bool>& draft_by_group) {
  using torch::indexing::Slice;
  TORCH_CHECK(value_slabs.size() == key_slabs.size(), "a key slab and a value slab per layer");
  TORCH_CHECK(gather.has_value() || roots.has_value(), "one padded call, or the roots' call");
  const size_t drafts = draft_rows.size();
  TORCH_CHECK(draft_starts.size() == drafts && draft_sizes.size() == drafts && draft_masks.size() == drafts &&
                  draft_grouped_masks.size() == drafts && draft_by_group.size() == drafts,
              "one start, size, mask and way per drafting row");
  return run_layers(
      hidden, cos, signed_sin, weights.params(), key_slabs.size(), eps, heads, kv_heads, head_dim,
      [&](size_t l, const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value) {
        torch::Tensor key_slab = key_slabs[l], value_slab = value_slabs[l];
        key_slab.index_put_({rows, Slice(), columns}, key[0].transpose(0, 1));
        value_slab.index_put_({rows, Slice(), columns}, value[0].transpose(0, 1));
        const auto keys = key_slab.narrow(-2, 0, end), values = value_slab.narrow(-2, 0, end);
        const auto flat = query[0].transpose(0, 1);  // (tokens, heads, dim)
        if (gather.has_value()) {
          auto padded = flat.index_select(0, *gather).view({-1, call_width, heads, head_dim}).transpose(1, 2);
          auto seen = attend(padded, keys, values, call_mask, call_grouped_mask, call_by_group, scaling);
          return seen.reshape({-1, heads, head_dim}).index_select(0, *scatter).unsqueeze(0);
        }
        auto output = at::empty_like(flat);
        auto root_queries = flat.index_select(0, *roots).unsqueeze(2);
        output.index_copy_(0, *roots,
                           attend(root_queries, keys, values, root_mask, c10::nullopt, false, scaling).select(1, 0));
        for (size_t d = 0; d < drafts; ++d) {
          const int64_t row = draft_rows[d], start = draft_starts[d], size = draft_sizes[d];
          const int64_t seen_keys = draft_masks[d].size(-1);
          auto nodes = flat.narrow(0, start, size).transpose(0, 1).unsqueeze(0);
          auto seen = attend(nodes, keys.narrow(0, row, 1).narrow(2, 0, seen_keys),
                             values.narrow(0, row, 1).narrow(2, 0, seen_keys), draft_masks[d], draft_grouped_masks[d],
                             draft_by_group[d], scaling);
          output.narrow(0, start, size).copy_(seen[0]);
        }
        return output.unsqueeze(0);
      });
}

void register_layer_loop(pybind11::module_& module) {
  pybind11::class_<LoopWeights>(module, "LoopWeights")
      .def(pybind11::init<std::vector<c10::optional<torch::Tensor>>, std::vector<pybind11::dict>,
                          std::vector<std::string>>(),
           "the loop's weights, and where what they were made from is held (parameter dictionaries and names)")
      .def("current", &LoopWeights::current, "whether no tensor they were made from changed since");
  module.def("rms_norm", &rms_norm, "torch.rms_norm of float32 rows, the same bits (tests hold it to that)");
  module.def("rotate", &rotate, "decoder._rotate of (1, heads, tokens, dim) heads, the same bits");
  module.def("decoder_layers", &decoder_layers, "one row's block through a Llama-shaped stack",
             pybind11::call_guard<pybind11::gil_scoped_release>());
  module.def("packed_decoder_layers", &packed_decoder_layers, "a packed batch's blocks through a Llama-shaped stack",
             pybind11::call_guard<pybind11::gil_scoped_release>());
}
