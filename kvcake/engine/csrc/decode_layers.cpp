// A decode step's decoder layers in one call: the fused layer (model.py's `_forward_fused`) for
// every layer, in C++.
//
// The layer is eleven ops (two norms, four linear products, RoPE and the KV write, the SwiGLU
// gate, attention); called from Python, each pays the interpreter and the binding layer's
// argument parsing, a few microseconds apiece, ~45 calls a step for a 4-layer model: at batch 1
// that was ~10% of the step in the interpreter and libtorch_python (benchmarks/
// decode_host_share.py). This op makes the same calls, in the same order and with the same
// kernels, through the dispatcher: the results are bit-identical to the Python loop's.
//
// Each linear product runs on the backend linear.py chose for this step's row count, given as a
// code (see Backend) with the tensors it needs. Only a pure decode step comes here (one query
// per sequence, every row attended by paged_decode_attention); anything else, and any step with
// a layer hook, stays on the Python loop.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace {

// linear.py's BACKENDS, in its order.
enum Backend : int64_t { ATEN = 0, ATEN_T = 1, ONEDNN = 2, MKL_GEMV = 3, MKL_SPLIT = 4 };

using MklLinear = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const std::optional<at::Tensor>&, int64_t);
using SplitGemv = at::Tensor(const at::Tensor&, at::TensorList, at::TensorList,
                             const std::optional<at::Tensor>&);
using RmsNorm = at::Tensor(const at::Tensor&, const at::Tensor&, double);
using AddRmsNorm = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                      const at::Tensor&, double);
using SiluMul = at::Tensor(const at::Tensor&);
using RopeQkvStore = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor, const at::Tensor&,
    const at::Tensor&, int64_t, int64_t);
using PagedDecode = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, double);

c10::OperatorHandle find(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

// One linear product's operands: the backend and what it reads.
struct Product {
  int64_t backend;
  const at::Tensor& weight;
  const std::optional<at::Tensor>& bias;
  const std::optional<at::Tensor>& packed;  // oneDNN's or MKL's packed weight
  at::TensorList split_packed, split_weights;  // MKL_SPLIT's parts
};

at::Tensor linear(const at::Tensor& x, const Product& p) {
  switch (p.backend) {
    case ATEN:
      return at::linear(x, p.weight, p.bias);
    case ATEN_T: {
      at::Tensor out = at::mm(p.weight, x.t()).t().contiguous();
      return p.bias.has_value() ? out + *p.bias : out;
    }
    case ONEDNN: {
      static const auto op = find("mkldnn::_linear_pointwise");
      torch::jit::Stack stack{x, *p.packed, p.bias, std::string("none"),
                              c10::List<std::optional<at::Scalar>>(),
                              std::optional<std::string>()};
      op.callBoxed(&stack);
      return stack[0].toTensor();
    }
    case MKL_GEMV: {
      static const auto op = find("mkl::_mkl_linear").typed<MklLinear>();
      return op.call(x, *p.packed, p.weight, p.bias, 1);
    }
    case MKL_SPLIT: {
      static const auto op = find("kvcake::split_gemv").typed<SplitGemv>();
      return op.call(x, p.split_packed, p.split_weights, p.bias);
    }
  }
  TORCH_CHECK(false, "decode_layers: unknown linear backend ", p.backend);
}

// h [B, d] (the residual stream is h + pending when pending is given: a previous stage's or
// layer's last add, folded into the first norm); cos [B, D], sin_half [B, D/2]; per layer l:
// kv[l] [num_blocks, 2, block_size, Hkv, D] and kv_rows[l] (the same memory as rows
// [-1, Hkv, D]); k_slots / v_slots [B] where each row's K and V go; block_tables [B, max_blocks]
// and context_lens [B] for paged_decode_attention. norm_weights / norm_eps: two per layer (input,
// post-attention). Per layer four products (qkv, o, gate_up, down), 4 L entries in each of
// backends, weights, biases and packed; split_counts: the MKL_SPLIT parts each product takes, in
// order, from split_packed and split_weights. Returns (h, delta) of the last layer, as
// `_forward_fused` does.
std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& h_in, const std::optional<at::Tensor>& pending, const at::Tensor& cos,
    const at::Tensor& sin_half, at::TensorList kv, at::TensorList kv_rows,
    const at::Tensor& k_slots, const at::Tensor& v_slots, const at::Tensor& block_tables,
    const at::Tensor& context_lens, at::TensorList norm_weights, at::ArrayRef<double> norm_eps,
    at::IntArrayRef backends, at::TensorList weights,
    const c10::List<std::optional<at::Tensor>>& biases,
    const c10::List<std::optional<at::Tensor>>& packed, at::IntArrayRef split_counts,
    at::TensorList split_packed, at::TensorList split_weights, double scale, int64_t num_heads,
    int64_t num_kv_heads) {
  const int64_t layers = static_cast<int64_t>(kv.size());
  TORCH_CHECK(layers >= 1, "decode_layers: at least one layer");
  TORCH_CHECK(static_cast<int64_t>(kv_rows.size()) == layers &&
                  static_cast<int64_t>(norm_weights.size()) == 2 * layers &&
                  static_cast<int64_t>(norm_eps.size()) == 2 * layers,
              "decode_layers: one kv, kv rows and two norms per layer");
  const int64_t products = 4 * layers;
  TORCH_CHECK(static_cast<int64_t>(backends.size()) == products &&
                  static_cast<int64_t>(weights.size()) == products &&
                  static_cast<int64_t>(biases.size()) == products &&
                  static_cast<int64_t>(packed.size()) == products &&
                  static_cast<int64_t>(split_counts.size()) == products,
              "decode_layers: four products per layer, each with a backend, weight, bias, "
              "packed form and split count");
  int64_t split_total = 0;
  for (int64_t i = 0; i < products; ++i) {
    const int64_t b = backends[i];
    TORCH_CHECK(b >= ATEN && b <= MKL_SPLIT, "decode_layers: unknown linear backend ", b);
    TORCH_CHECK((b != ONEDNN && b != MKL_GEMV) || packed.get(i).has_value(),
                "decode_layers: product ", i, " has no packed weight for its backend");
    TORCH_CHECK(b != MKL_SPLIT || split_counts[i] >= 1,
                "decode_layers: product ", i, " has no split parts");
    split_total += split_counts[i];
  }
  TORCH_CHECK(static_cast<int64_t>(split_packed.size()) == split_total &&
                  static_cast<int64_t>(split_weights.size()) == split_total,
              "decode_layers: split parts do not add up to split_counts");

  static const auto rms_norm = find("kvcake::rms_norm").typed<RmsNorm>();
  static const auto add_rms_norm = find("kvcake::add_rms_norm").typed<AddRmsNorm>();
  static const auto silu_mul = find("kvcake::silu_mul").typed<SiluMul>();
  static const auto rope_qkv_store = find("kvcake::rope_qkv_store").typed<RopeQkvStore>();
  static const auto attend = find("kvcake::paged_decode_attention").typed<PagedDecode>();

  // The products' operands, built once (the lists' elements live as long as the call).
  std::vector<std::optional<at::Tensor>> bias(products), pack(products);
  std::vector<int64_t> split_at(products + 1, 0);
  for (int64_t i = 0; i < products; ++i) {
    bias[i] = biases.get(i);
    pack[i] = packed.get(i);
    split_at[i + 1] = split_at[i] + split_counts[i];
  }
  auto product = [&](int64_t i) {
    const int64_t count = split_counts[i];
    return Product{backends[i], weights[i], bias[i], pack[i],
                   split_packed.slice(split_at[i], count), split_weights.slice(split_at[i], count)};
  };

  const int64_t n = h_in.size(0);
  const int64_t q_size = num_heads * cos.size(1);
  at::Tensor h = h_in;
  std::optional<at::Tensor> delta = pending;
  for (int64_t l = 0; l < layers; ++l) {
    at::Tensor x;
    if (delta.has_value()) {
      std::tie(h, x) = add_rms_norm.call(h, *delta, norm_weights[2 * l], norm_eps[2 * l]);
    } else {
      x = rms_norm.call(h, norm_weights[2 * l], norm_eps[2 * l]);
    }
    auto [q, k, v] = rope_qkv_store.call(linear(x, product(4 * l)), cos, sin_half, kv_rows[l],
                                         k_slots, v_slots, num_heads, num_kv_heads);
    const at::Tensor attn = attend.call(q, kv[l], block_tables, context_lens, scale);
    std::tie(h, x) = add_rms_norm.call(h, linear(attn.view({n, q_size}), product(4 * l + 1)),
                                       norm_weights[2 * l + 1], norm_eps[2 * l + 1]);
    delta = linear(silu_mul.call(linear(x, product(4 * l + 2))), product(4 * l + 3));
  }
  return {h, *delta};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvcake, m) {
  m.def(
      "decode_layers(Tensor h, Tensor? pending, Tensor cos, Tensor sin_half, Tensor[] kv, "
      "Tensor(a!)[] kv_rows, Tensor k_slots, Tensor v_slots, Tensor block_tables, "
      "Tensor context_lens, Tensor[] norm_weights, float[] norm_eps, int[] backends, "
      "Tensor[] weights, Tensor?[] biases, Tensor?[] packed, int[] split_counts, "
      "Tensor[] split_packed, Tensor[] split_weights, float scale, int num_heads, "
      "int num_kv_heads) -> (Tensor, Tensor)");
}

// A packed weight (oneDNN's, MKL's) is a MkldnnCPU tensor, which may decide the dispatch key.
TORCH_LIBRARY_IMPL(kvcake, CPU, m) { m.impl("decode_layers", &decode_layers); }
TORCH_LIBRARY_IMPL(kvcake, MkldnnCPU, m) { m.impl("decode_layers", &decode_layers); }
