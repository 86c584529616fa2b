// A Llama-shaped decoder stack for one row, as one call: the direct decoder's loop (decoder.py) in C++.
//
// Why: on a CPU a small model's step is a few hundred tiny operators besides its products, and
// calling each from Python costs more than the operator. This loop makes the very calls the
// Python loop makes — the same ATen operators on the same views and weights, the row kernel's
// products — in the same order, so every bit is the same (layerloop.py checks it at start), with
// the interpreter left out. The keys and values of the block are written into the cache's room
// after its `length` entries; the caller moves the entries' end.
#include <torch/extension.h>

#include <vector>

torch::Tensor linear(const torch::Tensor& input, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias);

namespace {

// input norm; q/k/v joined, its bias; o, its bias; post-attention norm; gate/up joined, its bias; down, its bias
constexpr size_t kPerLayer = 10;

// Llama's rotation as decoder._rotate computes it: x * cos + (x rolled by half a head) * the half-negated sine.
torch::Tensor rotate(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& signed_sin) {
  return x * cos + x.roll({x.size(-1) / 2}, {-1}) * signed_sin;
}

}  // namespace

torch::Tensor decoder_layers(torch::Tensor hidden, const torch::Tensor& cos, const torch::Tensor& signed_sin,
                             const c10::optional<torch::Tensor>& mask,
                             const std::vector<c10::optional<torch::Tensor>>& params,
                             const std::vector<torch::Tensor>& key_rooms, const std::vector<torch::Tensor>& value_rooms,
                             int64_t length, double eps, double scaling, int64_t heads, int64_t kv_heads,
                             int64_t head_dim) {
  const size_t layers = key_rooms.size();
  TORCH_CHECK(params.size() == layers * kPerLayer && value_rooms.size() == layers, "one set of weights per layer");
  TORCH_CHECK(hidden.dim() == 3 && hidden.size(0) == 1, "one row: (1, tokens, hidden)");
  const int64_t width = hidden.size(1), features = hidden.size(2);
  const std::vector<int64_t> heads_shape{1, width, -1, head_dim}, flat{1, width, -1};
  const std::vector<int64_t> qkv_sizes{heads * head_dim, kv_heads * head_dim, kv_heads * head_dim};
  for (size_t l = 0; l < layers; ++l) {
    const auto* p = &params[l * kPerLayer];
    auto normed = at::rms_norm(hidden, {features}, p[0], eps);
    auto qkv = ::linear(normed, *p[1], p[2]).split_with_sizes(qkv_sizes, -1);
    auto query = rotate(qkv[0].view(heads_shape).transpose(1, 2), cos, signed_sin);
    auto key = rotate(qkv[1].view(heads_shape).transpose(1, 2), cos, signed_sin);
    auto value = qkv[2].view(heads_shape).transpose(1, 2);
    key_rooms[l].narrow(-2, length, width).copy_(key);
    value_rooms[l].narrow(-2, length, width).copy_(value);
    auto attended = at::scaled_dot_product_attention(
        query, key_rooms[l].narrow(-2, 0, length + width), value_rooms[l].narrow(-2, 0, length + width), mask, 0.0,
        false, scaling, heads != kv_heads);
    hidden = hidden + ::linear(attended.transpose(1, 2).reshape(flat).contiguous(), *p[3], p[4]);
    normed = at::rms_norm(hidden, {features}, p[5], eps);
    auto gate_up = ::linear(normed, *p[6], p[7]);
    auto halves = gate_up.split(gate_up.size(-1) / 2, -1);
    hidden = hidden + ::linear(at::silu(halves[0]) * halves[1], *p[8], p[9]);
  }
  return hidden;
}
