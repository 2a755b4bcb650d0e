// Fused fp32 element-wise steps of a Llama layer, on the calling thread.
//
// Eager torch runs RMSNorm as six kernels, RoPE and the KV write as eight, SwiGLU's gate as two;
// each is a dispatch and, on large inputs, a parallel region whose threads must all meet at its
// end. On a busy 2-core machine a region waits for whichever thread lost its core, so a prefill
// of ~120 such regions spent seconds waiting. Each op here is one pass over its rows on the
// calling thread, except silu_mul beyond PARALLEL_ROWS rows (a prompt chunk: its exp and
// division make it compute-bound, ~9 ms of one core for 2,048 x 1,408), split over torch's
// threads. The norms and RoPE stay on one thread: memory-bound passes of ~1 ms, which a
// parallel region made slower on a busy machine (2,048-token prefill profile at load ~5).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "fast_exp.h"

namespace {

constexpr int64_t PARALLEL_ROWS = 64;

template <typename F>
void on_this_thread(int64_t n, const F& f) {
  f(0, n);
}

// f(begin, end) over rows [0, n): one call on this thread for small n, else torch's threads.
template <typename F>
void for_rows(int64_t n, const F& f) {
  if (n <= PARALLEL_ROWS) {
    f(0, n);
  } else {
    at::parallel_for(0, n, PARALLEL_ROWS / 2, f);
  }
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, ": CPU float32 only");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, ": 2-d with contiguous rows");
}

inline void norm_row(const float* x, const float* w, float eps, int64_t d, float* out) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < d; ++i) ss += x[i] * x[i];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) out[i] = w[i] * (x[i] * inv);
}

// weight * x / sqrt(mean(x^2) + eps), per row.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm");
  const at::Tensor w = weight.contiguous();
  TORCH_CHECK(w.numel() == x.size(1), "rms_norm: weight size != row size");
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  const int64_t n = x.size(0), d = x.size(1);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0);
  on_this_thread(n, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(xp + r * xs, wp, eps, d, op + r * d);
  });
  return out;
}

// (h + delta, rms_norm(h + delta)): the residual add and the next norm in one pass.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& h, const at::Tensor& delta,
                                                const at::Tensor& weight, double eps) {
  check_rows(h, "add_rms_norm");
  check_rows(delta, "add_rms_norm");
  TORCH_CHECK(h.sizes() == delta.sizes(), "add_rms_norm: shapes differ");
  const at::Tensor w = weight.contiguous();
  TORCH_CHECK(w.numel() == h.size(1), "add_rms_norm: weight size != row size");
  const int64_t n = h.size(0), d = h.size(1);
  at::Tensor sum = at::empty({n, d}, h.options()), out = at::empty({n, d}, h.options());
  const float* hp = h.data_ptr<float>();
  const float* dp = delta.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* sp = sum.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t hs = h.stride(0), ds = delta.stride(0);
  on_this_thread(n, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* hr = hp + r * hs;
      const float* dr = dp + r * ds;
      float* sr = sp + r * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) sr[i] = hr[i] + dr[i];
      norm_row(sr, wp, eps, d, op + r * d);
    }
  });
  return {sum, out};
}

// gate_up [n, 2I] -> silu(gate) * up [n, I].
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_mul");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_mul: odd width");
  const int64_t n = gate_up.size(0), half = gate_up.size(1) / 2;
  at::Tensor out = at::empty({n, half}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t gs = gate_up.stride(0);
  for_rows(n, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = gp + r * gs;
      const float* u = g + half;
      float* o = op + r * half;
      int64_t i = 0;
      for (; i + kvcake::VLEN <= half; i += kvcake::VLEN) {  // vexp: vectorised for certain
        const kvcake::vfloat gv = kvcake::vload(g + i);
        kvcake::vstore(o + i, gv / (1.f + kvcake::vexp(-gv)) * kvcake::vload(u + i));
      }
      for (; i < half; ++i) o[i] = g[i] / (1.f + kvcake::fast_exp(-g[i])) * u[i];
    }
  });
  return out;
}

inline void rope_row(const float* x, const float* c, const float* s, int64_t half, float* out) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    out[i] = x[i] * c[i] - x[i + half] * s[i];
    out[i + half] = x[i + half] * c[i + half] + x[i] * s[i];
  }
}

// qkv [n, (Hq + 2 Hkv) D] -> (q, k, v) as [n, H, D] tensors with RoPE applied to q and k
// (cos [n, D], sin_half [n, D/2]: its halves are equal), and k, v written into the layer's pool
// rows [R, Hkv, D] at k_slots / v_slots [n].
std::tuple<at::Tensor, at::Tensor, at::Tensor> rope_qkv_store(
    const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin_half,
    at::Tensor pool_rows, const at::Tensor& k_slots, const at::Tensor& v_slots,
    int64_t num_heads, int64_t num_kv_heads) {
  check_rows(qkv, "rope_qkv_store");
  check_rows(cos, "rope_qkv_store cos");
  check_rows(sin_half, "rope_qkv_store sin");
  TORCH_CHECK(pool_rows.is_contiguous() && pool_rows.dim() == 3 &&
                  pool_rows.scalar_type() == at::kFloat,
              "rope_qkv_store: pool rows [R, Hkv, D] contiguous float32");
  const int64_t n = qkv.size(0), d = cos.size(1), half = d / 2;
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * d && sin_half.size(1) == half &&
                  cos.size(0) == n && sin_half.size(0) == n && pool_rows.size(1) == num_kv_heads &&
                  pool_rows.size(2) == d,
              "rope_qkv_store: shapes disagree");
  const at::Tensor ks = k_slots.contiguous(), vs = v_slots.contiguous();
  TORCH_CHECK(ks.scalar_type() == at::kLong && vs.scalar_type() == at::kLong &&
                  ks.numel() == n && vs.numel() == n,
              "rope_qkv_store: one int64 K slot and V slot per row");
  const int64_t* kp = ks.data_ptr<int64_t>();
  const int64_t* vp = vs.data_ptr<int64_t>();
  const int64_t rows = pool_rows.size(0);
  for (int64_t r = 0; r < n; ++r)
    TORCH_CHECK(kp[r] >= 0 && kp[r] < rows && vp[r] >= 0 && vp[r] < rows,
                "rope_qkv_store: slot out of range of the pool");
  auto opts = qkv.options();
  at::Tensor q = at::empty({n, num_heads, d}, opts), k = at::empty({n, num_kv_heads, d}, opts),
             v = at::empty({n, num_kv_heads, d}, opts);
  float* pool = pool_rows.data_ptr<float>();
  const int64_t kv_row = num_kv_heads * d;
  on_this_thread(n, [&](int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const float* src = qkv.data_ptr<float>() + r * qkv.stride(0);
    const float* c = cos.data_ptr<float>() + r * cos.stride(0);
    const float* s = sin_half.data_ptr<float>() + r * sin_half.stride(0);
    float* qr = q.data_ptr<float>() + r * num_heads * d;
    for (int64_t h = 0; h < num_heads; ++h) rope_row(src + h * d, c, s, half, qr + h * d);
    float* kr = k.data_ptr<float>() + r * kv_row;
    const float* ksrc = src + num_heads * d;
    for (int64_t h = 0; h < num_kv_heads; ++h) rope_row(ksrc + h * d, c, s, half, kr + h * d);
    float* vr = v.data_ptr<float>() + r * kv_row;
    const float* vsrc = ksrc + kv_row;
    for (int64_t i = 0; i < kv_row; ++i) vr[i] = vsrc[i];
    float* kdst = pool + kp[r] * kv_row;
    float* vdst = pool + vp[r] * kv_row;
    for (int64_t i = 0; i < kv_row; ++i) {
      kdst[i] = kr[i];
      vdst[i] = vr[i];
    }
  }
  });
  return {q, k, v};
}

// Greedy sampling's argmax of each row, as a list: the index of the first largest value, a NaN
// counting as the largest (torch.argmax's rule). A max over lanes the compiler vectorizes, then
// the first index holding it: one call in place of argmax + tolist, which took ~0.17 ms of a
// decode step on 32,000 logits (its row reduction is scalar), run right after the lm_head.
std::vector<int64_t> argmax_rows(const at::Tensor& logits) {
  check_rows(logits, "argmax_rows");
  const int64_t n = logits.size(0), width = logits.size(1);
  TORCH_CHECK(width > 0, "argmax_rows: rows must not be empty");
  constexpr int64_t L = 16;
  std::vector<int64_t> out(n);
  for (int64_t r = 0; r < n; ++r) {
    const float* x = logits.data_ptr<float>() + r * logits.stride(0);
    float lane[L];
    int nan[L];
    for (int64_t j = 0; j < L; ++j) {
      lane[j] = -INFINITY;
      nan[j] = 0;
    }
    int64_t i = 0;
    for (; i + L <= width; i += L)
      for (int64_t j = 0; j < L; ++j) {
        const float y = x[i + j];
        lane[j] = y > lane[j] ? y : lane[j];
        nan[j] |= y != y;
      }
    float best = -INFINITY;
    int any_nan = 0;
    for (int64_t j = 0; j < L; ++j) {
      best = lane[j] > best ? lane[j] : best;
      any_nan |= nan[j];
    }
    for (; i < width; ++i) {
      best = x[i] > best ? x[i] : best;
      any_nan |= x[i] != x[i];
    }
    int64_t at = 0;
    if (any_nan) {
      while (x[at] == x[at]) ++at;
    } else {
      while (x[at] != best) ++at;
    }
    out[r] = at;
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvcake, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor h, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("argmax_rows(Tensor logits) -> int[]");
  m.def("rope_qkv_store(Tensor qkv, Tensor cos, Tensor sin_half, Tensor(a!) pool_rows, "
        "Tensor k_slots, Tensor v_slots, int num_heads, int num_kv_heads) -> "
        "(Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvcake, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("rope_qkv_store", &rope_qkv_store);
}
