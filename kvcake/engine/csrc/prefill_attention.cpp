// Causal prompt attention over kvcake's paged KV pool (fp32), read in place through the block
// table: no gathered copy of a cached prefix, no mask tensor, no padding.
//
// A chunk of q_len query tokens at positions ctx_len - q_len .. ctx_len - 1 attends to positions
// 0 .. its own of one sequence, whose K/V (the chunk's own included: the layer wrote them before
// attending) sit in the pool layer [num_blocks, 2 (K, V), block_size, Hkv, D]. Flash-style: per
// work item (one KV head, a tile of query positions with the `group` query heads that share that
// KV head stacked as rows) the scores of a tile of KV positions are one register-blocked
// micro-GEMM against a transposed copy of that K tile, then an online softmax, then P x V straight
// from the pool rows. Work items go to torch's threads through a shared counter, heaviest (latest
// query tile) first, so a thread that lost its core takes fewer of them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "fast_exp.h"

namespace {

using kvcake::VLEN;
using kvcake::vexp;
using kvcake::vload;
using kvcake::vstore;
typedef kvcake::vfloat vec;
#if defined(__AVX512F__)
constexpr int64_t RB = 4;  // rows per register block (RB x 4 accumulators)
#else
constexpr int64_t RB = 2;
#endif
constexpr int64_t NK = 4 * VLEN;  // KV positions per tile (4 vectors of scores per row)
constexpr int64_t ROWS = 128;     // target query rows (positions x group) per work item

inline vec vmax(vec a, vec b) { return a > b ? a : b; }

// s[m][0..NK) = qp[m][0..d) . kt[0..d)[0..NK) for m in [0, rows), rows a multiple of RB.
void qk_tile(const float* qp, const float* kt, int64_t rows, int64_t d, float* s) {
  for (int64_t m0 = 0; m0 < rows; m0 += RB) {
    vec acc[RB][4];
#pragma GCC unroll 8
    for (int64_t r = 0; r < RB; ++r)
      for (int v = 0; v < 4; ++v) acc[r][v] = vec{} ;
    for (int64_t i = 0; i < d; ++i) {
      const float* k = kt + i * NK;
      vec k0 = vload(k), k1 = vload(k + VLEN), k2 = vload(k + 2 * VLEN), k3 = vload(k + 3 * VLEN);
      // Keep the K vectors in registers: folded into each FMA as a memory operand they are
      // loaded RB times, and the loads, not the FMAs, bound the loop.
#if defined(__x86_64__) && defined(__AVX__)
      asm("" : "+v"(k0), "+v"(k1), "+v"(k2), "+v"(k3));
#endif
#pragma GCC unroll 8
      for (int64_t r = 0; r < RB; ++r) {
        const float q = qp[(m0 + r) * d + i];
        acc[r][0] += k0 * q;
        acc[r][1] += k1 * q;
        acc[r][2] += k2 * q;
        acc[r][3] += k3 * q;
      }
    }
#pragma GCC unroll 8
    for (int64_t r = 0; r < RB; ++r)
      for (int v = 0; v < 4; ++v) vstore(s + (m0 + r) * NK + v * VLEN, acc[r][v]);
  }
}

// o[m][c..c + NV VLEN) += sum_j p[m][j] * vrows[j][c..], j < cnt, m in [0, rows).
template <int NV>
void pv_chunk(const float* p, const float* const* vrows, int64_t cnt, int64_t rows, int64_t d,
              int64_t c, float* o) {
  for (int64_t m0 = 0; m0 < rows; m0 += RB) {
    vec acc[RB][NV];
#pragma GCC unroll 8
    for (int64_t r = 0; r < RB; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = vload(o + (m0 + r) * d + c + v * VLEN);
    for (int64_t j = 0; j < cnt; ++j) {
      const float* vr = vrows[j] + c;
      vec vv[NV];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) vv[v] = vload(vr + v * VLEN);
#pragma GCC unroll 8
      for (int64_t r = 0; r < RB; ++r) {
        const float w = p[(m0 + r) * NK + j];
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) acc[r][v] += vv[v] * w;
      }
    }
#pragma GCC unroll 8
    for (int64_t r = 0; r < RB; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) vstore(o + (m0 + r) * d + c + v * VLEN, acc[r][v]);
  }
}

// o[m][0..d) += sum_j p[m][j] * vrows[j][0..d) for j < cnt, m in [0, rows); d % VLEN == 0.
void pv_tile(const float* p, const float* const* vrows, int64_t cnt, int64_t rows, int64_t d,
             float* o) {
  int64_t c = 0;
  for (; c + 4 * VLEN <= d; c += 4 * VLEN) pv_chunk<4>(p, vrows, cnt, rows, d, c, o);
  switch ((d - c) / VLEN) {
    case 3: pv_chunk<3>(p, vrows, cnt, rows, d, c, o); break;
    case 2: pv_chunk<2>(p, vrows, cnt, rows, d, c, o); break;
    case 1: pv_chunk<1>(p, vrows, cnt, rows, d, c, o); break;
    default: break;
  }
}

// q [q_len, Hq, D] (rows may be strided, D contiguous); kv one layer [num_blocks, 2, block_size,
// Hkv, D] contiguous; block_table [>= ceil(ctx_len / block_size)] int64 -> out [q_len, Hq, D].
at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& kv,
                                   const at::Tensor& block_table, int64_t ctx_len, double scale) {
  TORCH_CHECK(q.device().is_cpu() && kv.device().is_cpu(), "paged_prefill_attention: CPU only");
  TORCH_CHECK(q.scalar_type() == at::kFloat && kv.scalar_type() == at::kFloat,
              "paged_prefill_attention: float32 only");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "paged_prefill_attention: q [n, H, D]");
  TORCH_CHECK(kv.dim() == 5 && kv.is_contiguous() && kv.size(1) == 2 && kv.size(4) == q.size(2),
              "paged_prefill_attention: kv [num_blocks, 2, block_size, Hkv, D] contiguous");
  const int64_t q_len = q.size(0), num_heads = q.size(1), d = q.size(2);
  const int64_t block_size = kv.size(2), num_kv_heads = kv.size(3);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "paged_prefill_attention: heads % kv heads != 0");
  TORCH_CHECK(d % VLEN == 0, "paged_prefill_attention: head size must be a multiple of ", VLEN);
  TORCH_CHECK(q_len >= 1 && ctx_len >= q_len, "paged_prefill_attention: need 1 <= q_len <= ctx_len");
  const at::Tensor table = block_table.contiguous();
  TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 1 &&
                  table.numel() * block_size >= ctx_len,
              "paged_prefill_attention: an int64 block table covering the context");
  const int64_t* tab = table.data_ptr<int64_t>();
  const int64_t num_ctx_blocks = (ctx_len + block_size - 1) / block_size;
  for (int64_t j = 0; j < num_ctx_blocks; ++j)  // a bad table must not read wild memory
    TORCH_CHECK(tab[j] >= 0 && tab[j] < kv.size(0),
                "paged_prefill_attention: block id out of range of the pool");

  const int64_t group = num_heads / num_kv_heads;
  const int64_t qt = std::max<int64_t>(1, ROWS / group);   // query positions per item
  const int64_t m_pad = (qt * group + RB - 1) / RB * RB;   // rows per item, padded
  const int64_t num_tiles = (q_len + qt - 1) / qt;
  const int64_t num_items = num_tiles * num_kv_heads;
  const int64_t first_pos = ctx_len - q_len;
  const int64_t s_tok = num_kv_heads * d, s_kv = block_size * s_tok, s_blk = 2 * s_kv;
  const float* pool = kv.data_ptr<float>();
  const float* qbase = q.data_ptr<float>();
  const int64_t q_s0 = q.stride(0), q_s1 = q.stride(1);
  at::Tensor out = at::empty({q_len, num_heads, d}, q.options());
  float* obase = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  std::atomic<int64_t> next{0};

  auto worker = [&]() {
    std::vector<float> qp(m_pad * d), kt(d * NK), s(m_pad * NK), o(m_pad * d), mx(m_pad), l(m_pad);
    std::vector<int64_t> limit(m_pad);
    std::vector<const float*> vrows(NK);
    for (int64_t item = next++; item < num_items; item = next++) {
      const int64_t tile = num_tiles - 1 - item / num_kv_heads;  // heaviest first
      const int64_t h = item % num_kv_heads;
      const int64_t i0 = tile * qt, i1 = std::min(q_len, i0 + qt);
      const int64_t rows = (i1 - i0) * group;
      const int64_t m_rows = (rows + RB - 1) / RB * RB;
      std::fill(qp.begin(), qp.begin() + m_rows * d, 0.f);
      for (int64_t i = i0; i < i1; ++i)
        for (int64_t g = 0; g < group; ++g) {
          const float* src = qbase + i * q_s0 + (h * group + g) * q_s1;
          float* dst = qp.data() + ((i - i0) * group + g) * d;
#pragma omp simd
          for (int64_t x = 0; x < d; ++x) dst[x] = src[x] * fscale;
        }
      for (int64_t m = 0; m < m_rows; ++m) limit[m] = m < rows ? first_pos + i0 + m / group : -1;
      std::fill(o.begin(), o.begin() + m_rows * d, 0.f);
      std::fill(mx.begin(), mx.begin() + m_rows, -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.begin() + m_rows, 0.f);
      const int64_t kv_end = first_pos + i1;  // positions [0, kv_end) are seen by some row
      for (int64_t j0 = 0; j0 < kv_end; j0 += NK) {
        const int64_t cnt = std::min(NK, kv_end - j0);
        for (int64_t j = 0; j < NK; ++j) {  // pack K^T of the tile, point at its V rows
          if (j < cnt) {
            const int64_t pos = j0 + j;
            const float* row = pool + tab[pos / block_size] * s_blk + (pos % block_size) * s_tok +
                               h * d;
            for (int64_t x = 0; x < d; ++x) kt[x * NK + j] = row[x];
            vrows[j] = row + s_kv;
          } else {
            for (int64_t x = 0; x < d; ++x) kt[x * NK + j] = 0.f;
          }
        }
        qk_tile(qp.data(), kt.data(), m_rows, d, s.data());
        for (int64_t m = 0; m < m_rows; ++m) {  // online softmax, row by row
          float* sr = s.data() + m * NK;
          const int64_t valid = std::min(cnt, limit[m] - j0 + 1);
          if (valid <= 0) {
            std::fill(sr, sr + NK, 0.f);
            continue;
          }
          for (int64_t j = valid; j < NK; ++j) sr[j] = -std::numeric_limits<float>::infinity();
          const vec s0 = vload(sr), s1 = vload(sr + VLEN), s2 = vload(sr + 2 * VLEN),
                    s3 = vload(sr + 3 * VLEN);
          const vec vm = vmax(vmax(s0, s1), vmax(s2, s3));
          float tile_max = vm[0];
          for (int64_t x = 1; x < VLEN; ++x) tile_max = std::max(tile_max, vm[x]);
          const float m_new = std::max(mx[m], tile_max);
          const float alpha = mx[m] == -std::numeric_limits<float>::infinity()
                                  ? 0.f
                                  : kvcake::fast_exp(mx[m] - m_new);
          const vec e0 = vexp(s0 - m_new), e1 = vexp(s1 - m_new), e2 = vexp(s2 - m_new),
                    e3 = vexp(s3 - m_new);
          vstore(sr, e0);
          vstore(sr + VLEN, e1);
          vstore(sr + 2 * VLEN, e2);
          vstore(sr + 3 * VLEN, e3);
          for (int64_t j = valid; j < NK; ++j) sr[j] = 0.f;  // masked: exactly nothing
          const vec es = valid == NK ? (e0 + e1) + (e2 + e3)
                                     : (vload(sr) + vload(sr + VLEN)) +
                                           (vload(sr + 2 * VLEN) + vload(sr + 3 * VLEN));
          float sum = 0.f;
          for (int64_t x = 0; x < VLEN; ++x) sum += es[x];
          mx[m] = m_new;
          l[m] = l[m] * alpha + sum;
          if (alpha != 1.f) {
            float* orow = o.data() + m * d;
#pragma omp simd
            for (int64_t x = 0; x < d; ++x) orow[x] *= alpha;
          }
        }
        pv_tile(s.data(), vrows.data(), cnt, m_rows, d, o.data());
      }
      for (int64_t m = 0; m < rows; ++m) {
        const int64_t i = i0 + m / group, g = m % group;
        const float inv = l[m] > 0.f ? 1.f / l[m] : 0.f;
        float* dst = obase + (i * num_heads + h * group + g) * d;
        const float* src = o.data() + m * d;
#pragma omp simd
        for (int64_t x = 0; x < d; ++x) dst[x] = src[x] * inv;
      }
    }
  };
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), num_items);
  if (threads <= 1) {
    worker();
  } else {
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { worker(); });
  }
  return out;
}

int64_t prefill_attention_head_multiple() { return VLEN; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvcake, m) {
  m.def("paged_prefill_attention(Tensor q, Tensor kv, Tensor block_table, int ctx_len, "
        "float scale) -> Tensor");
  m.def("prefill_attention_head_multiple() -> int", &prefill_attention_head_multiple);
}

TORCH_LIBRARY_IMPL(kvcake, CPU, m) { m.impl("paged_prefill_attention", &paged_prefill_attention); }
