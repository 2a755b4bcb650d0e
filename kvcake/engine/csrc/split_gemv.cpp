// A one-row product x [1, K] @ W^T over torch's threads, with MKL's packed GEMV doing each part.
//
// MKL's GEMV on a weight packed for one row (`mkl::_mkl_linear`) is the fastest one-row product
// here, but it runs on the calling thread only: a decode step's lm_head (32,000 x 512 fp32,
// 66 MB) is read by one core while the other waits. The weight's rows are split into parts, each
// packed by MKL on its own (linear.py), and the parts are multiplied in one parallel region, each
// on its own thread, into their slice of the output: two cores read the weight together
// (min 1.75 ms vs 2.92 ms for the lm_head on this 2-core machine, benchmarks in docs).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <vector>

namespace {

using MklLinear = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const std::optional<at::Tensor>&, int64_t);

at::Tensor split_gemv(const at::Tensor& x, at::TensorList packed, at::TensorList weights,
                      const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1, "split_gemv: x must be [1, K]");
  TORCH_CHECK(!packed.empty() && packed.size() == weights.size(),
              "split_gemv: one packed form per weight part");
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("mkl::_mkl_linear", "")
                             .typed<MklLinear>();
  const int64_t parts = static_cast<int64_t>(packed.size());
  std::vector<int64_t> offset(parts + 1, 0);
  for (int64_t i = 0; i < parts; ++i) offset[i + 1] = offset[i] + weights[i].size(0);
  at::Tensor out = at::empty({1, offset[parts]}, x.options());
  const at::Tensor xc = x.contiguous();
  const at::ThreadLocalState caller;  // inference mode etc. on the pool's threads too
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    const at::ThreadLocalStateGuard guard(caller);
    for (int64_t i = begin; i < end; ++i) {
      out.narrow(1, offset[i], offset[i + 1] - offset[i])
          .copy_(op.call(xc, packed[i], weights[i], std::nullopt, 1));
    }
  });
  if (bias.has_value()) out.add_(*bias);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvcake, m) {
  m.def("split_gemv(Tensor x, Tensor[] packed, Tensor[] weights, Tensor? bias) -> Tensor");
}

// MKL's packed weights are MkldnnCPU tensors, which decide the dispatch key.
TORCH_LIBRARY_IMPL(kvcake, CPU, m) { m.impl("split_gemv", &split_gemv); }
TORCH_LIBRARY_IMPL(kvcake, MkldnnCPU, m) { m.impl("split_gemv", &split_gemv); }
