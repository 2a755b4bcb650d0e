// expf that the compiler vectorises (glibc's vector expf needs -ffast-math): the classic Cephes
// single-precision scheme, exp(x) = 2^n * exp(r) with |r| <= ln2/2 and a degree-5 polynomial for
// exp(r) - 1 - r; about 1-2 ulp over the clamped range. Used by the ops' softmax and SiLU;
// `vexp` below is the same arithmetic lane by lane.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace kvcake {

// exp(r) for r = x - n ln2 (|r| <= ln2/2, ln2 split in two for precision), on a float or a vector
// of floats alike (`V{} + c` is c, or c in every lane): the part fast_exp and vexp share.
template <typename V>
inline V exp_of_reduced(V x, V n) {
  V r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  const V z = r * r;
  V y = V{} + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  return y * z + r + 1.0f;
}

inline float fast_exp(float x) {
  x = x < -87.3f ? -87.3f : x;  // 2^n stays a normal float (ternaries and an integer floor:
  x = x > 88.3f ? 88.3f : x;    // std::fmin/fmax/floor keep gcc 12 from vectorising the loop)
  const float fx = x * 1.44269504088896341f + 0.5f;
  int32_t ni = static_cast<int32_t>(fx);
  ni -= static_cast<float>(ni) > fx ? 1 : 0;
  const float n = static_cast<float>(ni);
  const float y = exp_of_reduced(x, n);
  const int32_t bits = (ni + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

// The same function on a vector of floats (GCC vector extensions: AVX-512 lanes where the CPU
// has them, else AVX2), so that loops that need it are vectorised whatever the compiler decides.
#if defined(__AVX512F__)
constexpr int64_t VLEN = 16;
#else
constexpr int64_t VLEN = 8;
#endif
typedef float vfloat __attribute__((vector_size(VLEN * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(VLEN * sizeof(int32_t))));

inline vfloat vload(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void vstore(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }

inline vfloat vexp(vfloat x) {
  const vfloat lo = vfloat{} - 87.3f, hi = vfloat{} + 88.3f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const vfloat fx = x * 1.44269504088896341f + 0.5f;
  vint ni = __builtin_convertvector(fx, vint);
  ni += (__builtin_convertvector(ni, vfloat) > fx);  // floor: true lanes are -1
  const vfloat n = __builtin_convertvector(ni, vfloat);
  const vfloat y = exp_of_reduced(x, n);
  const vint bits = (ni + 127) << 23;
  vfloat scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

}  // namespace kvcake
