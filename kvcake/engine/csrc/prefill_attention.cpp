// Causal prompt attention over kvcake's paged KV pool (fp32), read in place through the block
// table: no gathered copy of a cached prefix, no mask tensor, no padding.
//
// A chunk of q_len query tokens at positions ctx_len - q_len .. ctx_len - 1 attends to positions
// 0 .. its own of one sequence, whose K/V (the chunk's own included: the layer wrote them before
// attending) sit in the pool layer [num_blocks, 2 (K, V), block_size, Hkv, D].
//
// Flash-style, in one parallel region over torch's threads. Work items (one KV head x a tile of
// query positions, the `group` query heads that share the KV head stacked as rows) go to the
// threads through a shared counter, heaviest (latest query tile) first. K is read as transposed
// tiles of NK positions ([D][NK]), each packed once per call through the block table by the first
// thread that needs it and shared by every query tile of its head (a chunk of one query tile
// packs each into its reader's own buffer). Per KV tile and per block of
// RB rows, in registers: the RB x NK scores (a micro-GEMM against the packed tile), the online
// softmax in the exp2 domain (scale * log2(e) folded into Q once; a row's maximum moves lazily),
// then P x V (a micro-GEMM over the tile's V rows, straight from the pool) into the block's
// output rows. A row block stops at its own last position (the causal diagonal); only a tile
// that crosses it is masked, and P x V skips its masked tail.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "fast_exp.h"

namespace {

using kvcake::VLEN;
using kvcake::vload;
using kvcake::vstore;
typedef kvcake::vfloat vec;
typedef kvcake::vint vint;
// Register blocking: RB rows x NKV vectors of scores per micro-GEMM (plus NKV K vectors), and
// P x V over at most PVW vectors of the head at a time (RB x PVW accumulators).
#ifndef PA_RB
#if defined(__AVX512F__)
#define PA_RB 4
#else
#define PA_RB 2
#endif
#endif
#ifndef PA_NKV
#define PA_NKV 4
#endif
constexpr int64_t RB = PA_RB;
constexpr int NKV = PA_NKV;
constexpr int PVW = RB <= 4 ? 4 : 2;
static_assert(NKV >= 1 && NKV <= 4, "1 to 4 vectors of scores per row");
constexpr int64_t NK = NKV * VLEN;  // KV positions per tile
constexpr int64_t ROWS = 128;     // target query rows (positions x group) per work item
constexpr float LOG2E = 1.44269504088896341f;

inline vec vmax(vec a, vec b) { return a > b ? a : b; }

inline float hmax(vec v) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps((__m512)v);
#elif defined(__AVX2__)
  __m256 x = (__m256)v;
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
#else
  float r = v[0];
  for (int64_t x = 1; x < VLEN; ++x) r = std::max(r, v[x]);
  return r;
#endif
}

inline float hsum(vec v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps((__m512)v);
#elif defined(__AVX2__)
  __m256 x = (__m256)v;
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
#else
  float r = 0.f;
  for (int64_t x = 0; x < VLEN; ++x) r += v[x];
  return r;
#endif
}

inline bool any_above(vec v, float t) {
#if defined(__AVX512F__)
  return _mm512_cmp_ps_mask((__m512)v, _mm512_set1_ps(t), _CMP_GT_OQ) != 0;
#elif defined(__AVX2__)
  return _mm256_movemask_ps(_mm256_cmp_ps((__m256)v, _mm256_set1_ps(t), _CMP_GT_OQ)) != 0;
#else
  return hmax(v) > t;
#endif
}

// 2^x for x <= 0 (scores minus their running maximum) as 2^n * 2^f, n = round(x), |f| <= 1/2,
// 2^f from Cephes' exp2f polynomial (relative error ~2e-7). AVX-512 rounds and scales in one
// instruction each (scalef: 2^n of a very negative n is exactly 0); elsewhere x is clamped at
// -126 first (2^-126 for anything below; a masked score's lane is zeroed by the caller).
inline vec vexp2(vec x) {
#if defined(__AVX512F__)
  const vec n = (vec)_mm512_roundscale_ps((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  const vec lo = vec{} - 126.f;
  x = x < lo ? lo : x;
#if defined(__AVX2__)
  const vec n = (vec)_mm256_round_ps((__m256)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  const vec fx = x + 0.5f;
  vint fl = __builtin_convertvector(fx, vint);
  fl += (__builtin_convertvector(fl, vec) > fx);  // floor: true lanes are -1
  const vec n = __builtin_convertvector(fl, vec);
#endif
#endif
  const vec f = x - n;
  vec y = vec{} + 1.535336188319500e-4f;
  y = y * f + 1.339887440266574e-3f;
  y = y * f + 9.618437357674640e-3f;
  y = y * f + 5.550332471162809e-2f;
  y = y * f + 2.402264791363012e-1f;
  y = y * f + 6.931472028550421e-1f;
  y = y * f + 1.f;
#if defined(__AVX512F__)
  return (vec)_mm512_scalef_ps((__m512)y, (__m512)n);
#else
  const vint bits = (__builtin_convertvector(n, vint) + 127) << 23;
  vec scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
#endif
}

inline float exp2_scalar(float x) {
  const vec v = vexp2(vec{} + x);
  return v[0];
}

// A row's running maximum moves only when a tile's scores exceed it by more than this (log2
// domain): until then the terms are at most 2^LAZY_MAX and the row's sum and output need no
// rescaling, which most tiles after the first few never do.
constexpr float LAZY_MAX = 8.f;
// The running maximum before any score: finite, so that 2^(start - m) is 0, not NaN.
constexpr float NO_MAX = -1e30f;

// Per-thread state of one work item: its rows' scaled queries, running maxima, lane-wise partial
// sums (VLEN per row, added up at the end) and output accumulators; P of the current row block.
struct Item {
  std::vector<float> qp, o, mx, l, p;
  std::vector<int64_t> limit;
  explicit Item(int64_t m_pad, int64_t d)
      : qp(m_pad * d), o(m_pad * d), mx(m_pad), l(m_pad * VLEN), p(RB * NK), limit(m_pad) {}
};

// o[r][c .. c + NV VLEN) = o[r][..] (* alpha[r] if RESCALE) + sum_{j < cnt} p[r][j] *
// vrows[j][c ..], r < RB.
template <int NV, bool RESCALE>
inline void pv_block(const float* p, const float* const* vrows, int64_t cnt, const float* alpha,
                     int64_t d, int64_t c, float* o) {
  vec acc[RB][NV];
#pragma GCC unroll 8
  for (int64_t r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      acc[r][v] = vload(o + r * d + c + v * VLEN);
      if (RESCALE) acc[r][v] *= alpha[r];
    }
  for (int64_t j = 0; j < cnt; ++j) {
    const float* vr = vrows[j] + c;
    vec vv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) vv[v] = vload(vr + v * VLEN);
#pragma GCC unroll 8
    for (int64_t r = 0; r < RB; ++r) {
      const float w = p[r * NK + j];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] += vv[v] * w;
    }
  }
#pragma GCC unroll 8
  for (int64_t r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) vstore(o + r * d + c + v * VLEN, acc[r][v]);
}

template <bool RESCALE>
inline void pv(const float* p, const float* const* vrows, int64_t cnt, const float* alpha,
               int64_t d, float* o) {
  int64_t c = 0;
  for (; c + PVW * VLEN <= d; c += PVW * VLEN)
    pv_block<PVW, RESCALE>(p, vrows, cnt, alpha, d, c, o);
  switch ((d - c) / VLEN) {
    case 3: pv_block<3, RESCALE>(p, vrows, cnt, alpha, d, c, o); break;
    case 2: pv_block<2, RESCALE>(p, vrows, cnt, alpha, d, c, o); break;
    case 1: pv_block<1, RESCALE>(p, vrows, cnt, alpha, d, c, o); break;
    default: break;
  }
}

// One row block (RB rows from `qp`, `o`, `mx`, `l`, `limit`) against one KV tile at j0 of which
// cnt positions exist: scores, online softmax, P x V.
inline void row_block_tile(const float* qp, const float* kt, const float* const* vrows,
                           int64_t j0, int64_t cnt, int64_t d, const int64_t* limit, float* mx,
                           float* l, float* o, float* p) {
  vec acc[RB][NKV];
#pragma GCC unroll 8
  for (int64_t r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NKV; ++v) acc[r][v] = vec{};
  for (int64_t i = 0; i < d; ++i) {
    const float* k = kt + i * NK;
    // Named vectors pinned in registers: folded into each FMA as a memory operand they are
    // loaded RB times, and the loads, not the FMAs, bound the loop (an array in the asm
    // operands is spilled to the stack instead).
    vec k0 = vload(k), k1 = NKV > 1 ? vload(k + VLEN) : vec{}, k2 = NKV > 2 ? vload(k + 2 * VLEN) : vec{},
        k3 = NKV > 3 ? vload(k + 3 * VLEN) : vec{};
#if defined(__x86_64__) && defined(__AVX__)
    if constexpr (NKV == 4) asm("" : "+v"(k0), "+v"(k1), "+v"(k2), "+v"(k3));
    if constexpr (NKV == 3) asm("" : "+v"(k0), "+v"(k1), "+v"(k2));
    if constexpr (NKV == 2) asm("" : "+v"(k0), "+v"(k1));
    if constexpr (NKV == 1) asm("" : "+v"(k0));
#endif
#pragma GCC unroll 8
    for (int64_t r = 0; r < RB; ++r) {
      const float q = qp[r * d + i];
      acc[r][0] += k0 * q;
      if constexpr (NKV > 1) acc[r][1] += k1 * q;
      if constexpr (NKV > 2) acc[r][2] += k2 * q;
      if constexpr (NKV > 3) acc[r][3] += k3 * q;
    }
  }
  int64_t lim_min = limit[0], lim_max = limit[0];
  for (int64_t r = 1; r < RB; ++r) {
    lim_min = std::min(lim_min, limit[r]);
    lim_max = std::max(lim_max, limit[r]);
  }
  // Some row of the block ends inside the tile (lanes past cnt are past every row's end).
  const bool masked = j0 + NK - 1 > lim_min;
  const int64_t used = std::min(cnt, lim_max - j0 + 1);  // columns any row of the block needs
  vint iota;
  for (int64_t x = 0; x < VLEN; ++x) iota[x] = static_cast<int32_t>(x);
  float alpha[RB];
  bool rescale = false;
#pragma GCC unroll 8
  for (int64_t r = 0; r < RB; ++r) {
    vec s[NKV];
#pragma GCC unroll 4
    for (int v = 0; v < NKV; ++v) s[v] = acc[r][v];
    vint keep[NKV];
    if (masked) {
      const int32_t last = static_cast<int32_t>(std::min(limit[r], j0 + NK) - j0);
#pragma GCC unroll 4
      for (int v = 0; v < NKV; ++v) {
        keep[v] = (iota + static_cast<int32_t>(v * VLEN)) <= last;
        s[v] = keep[v] ? s[v] : vec{} + NO_MAX;
      }
    }
    vec vm = s[0];
#pragma GCC unroll 4
    for (int v = 1; v < NKV; ++v) vm = vmax(vm, s[v]);
    float m = mx[r];
    alpha[r] = 1.f;
    vec lv = vload(l + r * VLEN);
    if (__builtin_expect(any_above(vm, m + LAZY_MAX), 0)) {
      const float m_new = hmax(vm);
      alpha[r] = exp2_scalar(m - m_new);  // 0 on the first tile
      lv *= alpha[r];
      mx[r] = m = m_new;
      rescale = true;
    }
    vec sum = vec{};
#pragma GCC unroll 4
    for (int v = 0; v < NKV; ++v) {
      vec e = vexp2(s[v] - m);
      if (masked) e = keep[v] ? e : vec{};
      vstore(p + r * NK + v * VLEN, e);
      sum += e;
    }
    vstore(l + r * VLEN, lv + sum);
  }
  if (rescale) {
    pv<true>(p, vrows, used, alpha, d, o);
  } else {
    pv<false>(p, vrows, used, alpha, d, o);
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
  const int64_t qt = std::max<int64_t>(1, ROWS / group);  // query positions per item
  const int64_t m_pad = (qt * group + RB - 1) / RB * RB;  // rows per item, padded
  const int64_t num_tiles = (q_len + qt - 1) / qt;
  const int64_t num_items = num_tiles * num_kv_heads;
  const int64_t first_pos = ctx_len - q_len;
  const int64_t s_tok = num_kv_heads * d, s_kv = block_size * s_tok, s_blk = 2 * s_kv;
  const float* pool = kv.data_ptr<float>();
  const float* qbase = q.data_ptr<float>();
  const int64_t q_s0 = q.stride(0), q_s1 = q.stride(1);
  at::Tensor out = at::empty({q_len, num_heads, d}, q.options());
  float* obase = out.data_ptr<float>();
  const float qscale = static_cast<float>(scale) * LOG2E;  // scores in the exp2 domain
  auto row_of = [&](int64_t pos) { return pool + tab[pos / block_size] * s_blk +
                                          (pos % block_size) * s_tok; };

  // K^T tiles of every KV head ([Hkv][tile][D][NK], zero past ctx_len), packed on first use
  // by whichever thread needs the tile first; a thread that finds it being packed packs its
  // own copy rather than wait (the packer may have lost its core).
  // With a single query tile (a short chunk) every K tile has one reader: it is packed into
  // the reader's own buffer, and nothing the size of the context's K is allocated.
  const int64_t num_kv_tiles = (ctx_len + NK - 1) / NK;
  const int64_t tile_floats = d * NK;
  const bool share = num_tiles > 1;
  const int64_t num_shared = share ? num_kv_heads * num_kv_tiles : 0;
  std::unique_ptr<float[]> kt_all(new float[num_shared * tile_floats]);
  std::unique_ptr<std::atomic<int>[]> kt_state(new std::atomic<int>[num_shared]);
  for (int64_t t = 0; t < num_shared; ++t) kt_state[t].store(0);
  enum { UNPACKED = 0, PACKING = 1, PACKED = 2 };
  auto pack = [&](int64_t h, int64_t jt, float* kt) {
    for (int64_t j = 0; j < NK; ++j) {
      const int64_t pos = jt * NK + j;
      if (pos < ctx_len) {
        const float* row = row_of(pos) + h * d;
        for (int64_t x = 0; x < d; ++x) kt[x * NK + j] = row[x];
      } else {
        for (int64_t x = 0; x < d; ++x) kt[x * NK + j] = 0.f;
      }
    }
  };
  auto packed_tile = [&](int64_t h, int64_t jt, float* own) -> const float* {
    if (!share) {
      pack(h, jt, own);
      return own;
    }
    const int64_t t = h * num_kv_tiles + jt;
    float* shared = kt_all.get() + t * tile_floats;
    int state = kt_state[t].load(std::memory_order_acquire);
    if (state == PACKED) return shared;
    if (state == UNPACKED && kt_state[t].compare_exchange_strong(state, PACKING)) {
      pack(h, jt, shared);
      kt_state[t].store(PACKED, std::memory_order_release);
      return shared;
    }
    if (kt_state[t].load(std::memory_order_acquire) == PACKED) return shared;
    pack(h, jt, own);
    return own;
  };

  // The work items.
  std::atomic<int64_t> next{0};
  auto worker = [&]() {
    Item it(m_pad, d);
    std::vector<const float*> vrows(NK);
    std::vector<float> own_kt(tile_floats);
    for (int64_t item = next++; item < num_items; item = next++) {
      const int64_t tile = num_tiles - 1 - item / num_kv_heads;  // heaviest first
      const int64_t h = item % num_kv_heads;
      const int64_t i0 = tile * qt, i1 = std::min(q_len, i0 + qt);
      const int64_t rows = (i1 - i0) * group;
      const int64_t m_rows = (rows + RB - 1) / RB * RB;
      for (int64_t i = i0; i < i1; ++i)
        for (int64_t g = 0; g < group; ++g) {
          const float* src = qbase + i * q_s0 + (h * group + g) * q_s1;
          float* dst = it.qp.data() + ((i - i0) * group + g) * d;
#pragma omp simd
          for (int64_t x = 0; x < d; ++x) dst[x] = src[x] * qscale;
        }
      // Padding rows (zero queries) see what the item's last row sees: finite, discarded.
      std::fill(it.qp.begin() + rows * d, it.qp.begin() + m_rows * d, 0.f);
      for (int64_t m = 0; m < m_rows; ++m)
        it.limit[m] = first_pos + i0 + std::min(m, rows - 1) / group;
      std::fill(it.o.begin(), it.o.begin() + m_rows * d, 0.f);
      std::fill(it.mx.begin(), it.mx.begin() + m_rows, NO_MAX);
      std::fill(it.l.begin(), it.l.begin() + m_rows * VLEN, 0.f);
      const int64_t kv_end = first_pos + i1;  // positions [0, kv_end) are seen by some row
      for (int64_t j0 = 0; j0 < kv_end; j0 += NK) {
        const int64_t cnt = std::min(NK, kv_end - j0);
        for (int64_t j = 0; j < cnt; ++j) vrows[j] = row_of(j0 + j) + h * d + s_kv;
        const float* kt = packed_tile(h, j0 / NK, own_kt.data());
        // Row blocks in order of position: the first whose rows all end before j0 ends it.
        for (int64_t m0 = 0; m0 < m_rows; m0 += RB) {
          const int64_t* lim = it.limit.data() + m0;
          int64_t lim_max = lim[0];
          for (int64_t r = 1; r < RB; ++r) lim_max = std::max(lim_max, lim[r]);
          if (lim_max < j0) continue;
          row_block_tile(it.qp.data() + m0 * d, kt, vrows.data(), j0, cnt, d, lim,
                         it.mx.data() + m0, it.l.data() + m0 * VLEN, it.o.data() + m0 * d,
                         it.p.data());
        }
      }
      for (int64_t m = 0; m < rows; ++m) {
        const int64_t i = i0 + m / group, g = m % group;
        const float inv = 1.f / hsum(vload(it.l.data() + m * VLEN));
        float* dst = obase + (i * num_heads + h * group + g) * d;
        const float* src = it.o.data() + m * d;
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
