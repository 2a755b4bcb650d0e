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
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX__)
#include <immintrin.h>
#endif

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

// The fp32 fast path for the common shapes: head_dim = NC vectors of VLEN floats, GQA group G,
// both compile-time, so a (sequence, KV head) item keeps the group's scaled queries and its
// output accumulators in vector registers across the whole context. Per context position: the
// K row loaded once as NC vectors, G independent dot products (NC FMAs each, then one lane sum
// per query head), and in the second pass G x NC FMAs of the V row into the accumulators. The
// generic loop (decode_kernel's `run`) did each of those G dots as one serial chain with its own
// reduction and each axpy through memory: ~165-350 ns per position per layer on this CPU for
// the serving model's shape (G 4, head_dim 64), latency-bound, not bandwidth-bound.
inline float lane_sum(kvcake::vfloat v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(v);
#elif defined(__AVX__)
  const __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_add_ps(lo, hi);
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
#else  // other CPUs: the compiler's lane extraction
  float s = 0.f;
  for (int64_t i = 0; i < kvcake::VLEN; ++i) s += v[i];
  return s;
#endif
}

template <int NC>
inline void prefetch_block(const float* base, int64_t rows, int64_t s_tok) {
  // This head's part of every row of a block (NC vectors of VLEN floats each, 64-byte lines).
  constexpr int64_t kLines = (NC * kvcake::VLEN * 4 + 63) / 64;
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t l = 0; l < kLines; ++l) __builtin_prefetch(base + t * s_tok + l * 16);
}

template <int G, int NC>
void decode_item_f32(const float* qb, const float* kv_ptr, const int64_t* tab, int64_t ctx,
                     int64_t block_size, int64_t s_tok, int64_t s_kv, int64_t s_blk,
                     int64_t h_off, float scale, std::vector<float>& scores, float* ob) {
  using kvcake::vfloat;
  using kvcake::VLEN;
  constexpr int64_t D = NC * VLEN;
  vfloat qv[G][NC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) qv[g][c] = kvcake::vload(qb + g * D + c * VLEN) * scale;
  scores.resize(G * ctx);
  float* sc = scores.data();
  float row_max[G];
  for (int g = 0; g < G; ++g) row_max[g] = -std::numeric_limits<float>::infinity();
  // the rows (K at offset 0, V at s_kv) of the block holding position p0, and a prefetch of the
  // next block's: scattered blocks defeat the hardware prefetcher
  auto rows_at = [&](int64_t p0, int64_t off) {
    if (p0 + block_size < ctx)
      prefetch_block<NC>(kv_ptr + tab[p0 / block_size + 1] * s_blk + off + h_off,
                         std::min(block_size, ctx - p0 - block_size), s_tok);
    return kv_ptr + tab[p0 / block_size] * s_blk + off + h_off;
  };
  for (int64_t p0 = 0; p0 < ctx; p0 += block_size) {  // pass 1: scores, block by block
    const float* kb = rows_at(p0, 0);
    const int64_t n = std::min(block_size, ctx - p0);
    for (int64_t t = 0; t < n; ++t) {
      const float* k = kb + t * s_tok;
      vfloat kc[NC];
      for (int c = 0; c < NC; ++c) kc[c] = kvcake::vload(k + c * VLEN);
      for (int g = 0; g < G; ++g) {
        vfloat s = qv[g][0] * kc[0];
        for (int c = 1; c < NC; ++c) s += qv[g][c] * kc[c];
        const float x = lane_sum(s);
        sc[g * ctx + p0 + t] = x;
        row_max[g] = std::max(row_max[g], x);
      }
    }
  }
  float inv[G];
  for (int g = 0; g < G; ++g) {
    float* sg = sc + g * ctx;
    const float m = row_max[g];
    int64_t p = 0;
    for (; p + VLEN <= ctx; p += VLEN)
      kvcake::vstore(sg + p, kvcake::vexp(kvcake::vload(sg + p) - m));
    for (; p < ctx; ++p) sg[p] = kvcake::fast_exp(sg[p] - m);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t p2 = 0; p2 < ctx; ++p2) sum += sg[p2];
    inv[g] = sum > 0.f ? 1.f / sum : 0.f;
  }
  vfloat acc[G][NC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) acc[g][c] = vfloat{};
  for (int64_t p0 = 0; p0 < ctx; p0 += block_size) {  // pass 2: probabilities x V
    const float* vb = rows_at(p0, s_kv);
    const int64_t n = std::min(block_size, ctx - p0);
    for (int64_t t = 0; t < n; ++t) {
      const float* v = vb + t * s_tok;
      vfloat vc[NC];
      for (int c = 0; c < NC; ++c) vc[c] = kvcake::vload(v + c * VLEN);
      for (int g = 0; g < G; ++g) {
        const float w = sc[g * ctx + p0 + t];
        for (int c = 0; c < NC; ++c) acc[g][c] += w * vc[c];
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) kvcake::vstore(ob + g * D + c * VLEN, acc[g][c] * inv[g]);
}

using FastItem = void (*)(const float*, const float*, const int64_t*, int64_t, int64_t, int64_t,
                          int64_t, int64_t, int64_t, float, std::vector<float>&, float*);

template <int G>
FastItem fast_item_nc(int64_t nc) {
  switch (nc) {
    case 2: return &decode_item_f32<G, 2>;
    case 4: return &decode_item_f32<G, 4>;
    case 8: return &decode_item_f32<G, 8>;
    default: return nullptr;
  }
}

// The fast path for this (group, head_dim), or nullptr (then the generic loop runs).
FastItem fast_item(int64_t group, int64_t head_dim) {
  if (head_dim % kvcake::VLEN != 0) return nullptr;
  const int64_t nc = head_dim / kvcake::VLEN;
  switch (group) {
    case 1: return fast_item_nc<1>(nc);
    case 2: return fast_item_nc<2>(nc);
    case 4: return fast_item_nc<4>(nc);
    case 8: return fast_item_nc<8>(nc);
    default: return nullptr;
  }
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

  FastItem fast = nullptr;
  if constexpr (std::is_same_v<T, float>) fast = fast_item(group, head_dim);
  auto run = [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t ctx = len_ptr[b];
      const T* qb = q_ptr + (b * num_heads + h * group) * head_dim;
      if constexpr (std::is_same_v<T, float>) {
        if (fast != nullptr) {
          fast(qb, kv_ptr, tab + b * max_blocks, ctx, block_size, s_tok, s_kv, s_blk,
               h * head_dim, static_cast<float>(scale), scores,
               out_ptr + (b * num_heads + h * group) * head_dim);
          continue;
        }
      }
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
