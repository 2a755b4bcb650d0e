// Decode attention over kvcake's paged KV pool, reading K/V in place through the block tables
// (no gathered copy). One query token per sequence; GQA; fp32 accumulation for every dtype.
//
// Built on first use by kvcake/engine/paged_attention.py with the system C++ compiler against the
// installed torch headers; registered as torch.ops.kvcake.paged_decode_attention. Work is split
// over (sequence, KV head) items: on torch's threads for a long context, else on the calling
// thread (see decode_kernel).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "fast_exp.h"

namespace {

// Context positions x KV heads from which a call is split over torch's threads (see below).
constexpr int64_t kParallelMinWork = 4096;

template <typename T>
inline float dot(const float* q, const T* k, int64_t d) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < d; ++i) acc += q[i] * static_cast<float>(k[i]);
  return acc;
}

template <typename T>
inline void axpy(float a, const T* v, float* out, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) out[i] += a * static_cast<float>(v[i]);
}

template <typename T>
void decode_kernel(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& tables,
                   const at::Tensor& lens, double scale, at::Tensor& out) {
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = kv.size(2), num_kv_heads = kv.size(3);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = tables.size(1);
  const T* q_ptr = q.data_ptr<T>();
  const T* kv_ptr = kv.data_ptr<T>();
  const int64_t* tab = tables.data_ptr<int64_t>();
  const int64_t* len_ptr = lens.data_ptr<int64_t>();
  T* out_ptr = out.data_ptr<T>();
  // Strides of the layer tensor [num_blocks, 2 (K, V), block_size, num_kv_heads, head_dim].
  const int64_t s_tok = num_kv_heads * head_dim, s_kv = block_size * s_tok, s_blk = 2 * s_kv;

  auto run = [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t ctx = len_ptr[b];
      const T* qb = q_ptr + (b * num_heads + h * group) * head_dim;
      for (int64_t i = 0; i < group * head_dim; ++i) qf[i] = static_cast<float>(qb[i]) * scale;
      scores.assign(group * ctx, 0.f);
      std::vector<float> row_max(group, -std::numeric_limits<float>::infinity());
      for (int64_t p = 0; p < ctx; ++p) {  // pass 1: scores q.k over the context, in place
        const int64_t blk = tab[b * max_blocks + p / block_size];
        const T* k = kv_ptr + blk * s_blk + (p % block_size) * s_tok + h * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float s = dot(qf.data() + g * head_dim, k, head_dim);
          scores[g * ctx + p] = s;
          row_max[g] = std::max(row_max[g], s);
        }
      }
      std::vector<float> denom(group, 0.f);
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * ctx;
        const float m = row_max[g];
        int64_t p = 0;
        for (; p + kvcake::VLEN <= ctx; p += kvcake::VLEN)  // vexp: vectorised for certain
          kvcake::vstore(sg + p, kvcake::vexp(kvcake::vload(sg + p) - m));
        for (; p < ctx; ++p) sg[p] = kvcake::fast_exp(sg[p] - m);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t p = 0; p < ctx; ++p) sum += sg[p];
        denom[g] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t p = 0; p < ctx; ++p) {  // pass 2: probabilities x V, in place
        const int64_t blk = tab[b * max_blocks + p / block_size];
        const T* v = kv_ptr + blk * s_blk + s_kv + (p % block_size) * s_tok + h * head_dim;
        for (int64_t g = 0; g < group; ++g)
          axpy(scores[g * ctx + p], v, acc.data() + g * head_dim, head_dim);
      }
      T* ob = out_ptr + (b * num_heads + h * group) * head_dim;
      for (int64_t g = 0; g < group; ++g) {
        const float inv = denom[g] > 0.f ? 1.f / denom[g] : 0.f;
        for (int64_t i = 0; i < head_dim; ++i)
          ob[g * head_dim + i] = static_cast<T>(acc[g * head_dim + i] * inv);
      }
    }
  };
  // Split over torch's threads only when the call reads enough KV to pay for waking them: on a
  // quiet 2-core machine a 2,048-token context with 2 KV heads took 143-214 us on two threads
  // against 265-268 us on one, 4,096 tokens 329-351 against 563-595 us. A short context stays on
  // the calling thread (a parallel region costs more than it saves there; under contention a
  // descheduled second thread delays every region, which the GEMMs pay as well).
  int64_t work = 0;  // context positions x KV heads: what the call reads
  for (int64_t b = 0; b < batch; ++b) work += len_ptr[b] * num_kv_heads;
  const int64_t items = batch * num_kv_heads;
  if (work >= kParallelMinWork && items > 1)
    at::parallel_for(0, items, 1, run);
  else
    run(0, items);
}

// q [B, Hq, D]; kv one layer [num_blocks, 2, block_size, Hkv, D]; block_tables [B, max_blocks]
// int64 (entries past a sequence's context are ignored); context_lens [B] int64 (>= 1).
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens,
                                  double scale) {
  TORCH_CHECK(q.device().is_cpu() && kv.device().is_cpu(), "paged_decode_attention: CPU only");
  TORCH_CHECK(q.dim() == 3 && kv.dim() == 5, "paged_decode_attention: q [B,H,D], kv 5-d");
  TORCH_CHECK(q.scalar_type() == kv.scalar_type(), "paged_decode_attention: dtypes differ");
  TORCH_CHECK(kv.is_contiguous(), "paged_decode_attention: kv must be contiguous");
  TORCH_CHECK(kv.size(1) == 2 && kv.size(4) == q.size(2), "paged_decode_attention: kv shape");
  TORCH_CHECK(q.size(1) % kv.size(3) == 0, "paged_decode_attention: heads % kv heads != 0");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "paged_decode_attention: block tables and lengths are int64");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) &&
                  context_lens.numel() == q.size(0),
              "paged_decode_attention: one table row and one length per query");
  const at::Tensor qc = q.contiguous(), tc = block_tables.contiguous(),
                   lc = context_lens.contiguous();
  const int64_t* lp = lc.data_ptr<int64_t>();
  const int64_t* tp = tc.data_ptr<int64_t>();
  for (int64_t b = 0; b < qc.size(0); ++b) {  // bounds: a bad table must not read wild memory
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= tc.size(1) * kv.size(2),
                "paged_decode_attention: context length out of range of its block table");
    for (int64_t j = 0; j < (lp[b] + kv.size(2) - 1) / kv.size(2); ++j)
      TORCH_CHECK(tp[b * tc.size(1) + j] >= 0 && tp[b * tc.size(1) + j] < kv.size(0),
                  "paged_decode_attention: block id out of range of the pool");
  }
  at::Tensor out = at::empty_like(qc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qc.scalar_type(), "paged_decode", [&] {
    decode_kernel<scalar_t>(qc, kv, tc, lc, scale, out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(kvcake, m) {
  m.def("paged_decode_attention(Tensor q, Tensor kv, Tensor block_tables, Tensor context_lens, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvcake, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
