// GeLU and its derivative, in the compute type T (float, or double on the CPU).
// Shared by the C++ scalar tail loops and the CUDA kernels so both use one formula.
#pragma once

#include <math.h>

#if defined(__CUDACC__)
#define TPK_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define TPK_HOST_DEVICE inline
#endif

namespace tpkernels {
namespace gelu_const {
// 1/sqrt(2): exact GeLU is z * Phi(z) with Phi(z) = 0.5 * (1 + erf(z / sqrt(2))).
constexpr double kInvSqrt2 = 0.70710678118654752440;
// 1/sqrt(2*pi): the standard normal density phi(z) = exp(-z^2/2) / sqrt(2*pi) = dPhi/dz.
constexpr double kInvSqrt2Pi = 0.39894228040143267794;
// sqrt(2/pi) and 0.044715: the tanh approximation of Hendrycks & Gimpel (2016),
// Phi(z) ~ 0.5 * (1 + tanh(sqrt(2/pi) * (z + 0.044715 z^3))), as in Megatron/GPT-2.
constexpr double kSqrt2OverPi = 0.79788456080286535588;
constexpr double kTanhCubic = 0.044715;
}  // namespace gelu_const

// Overloads that name the float functions explicitly: device code must not fall back to the
// double versions (10-30x slower on GPUs), and host code gets the same choice.
TPK_HOST_DEVICE float tpk_erf(float x) { return ::erff(x); }
TPK_HOST_DEVICE double tpk_erf(double x) { return ::erf(x); }
TPK_HOST_DEVICE float tpk_tanh(float x) { return ::tanhf(x); }
TPK_HOST_DEVICE double tpk_tanh(double x) { return ::tanh(x); }
TPK_HOST_DEVICE float tpk_exp(float x) { return ::expf(x); }
TPK_HOST_DEVICE double tpk_exp(double x) { return ::exp(x); }

template <typename T>
TPK_HOST_DEVICE T gelu_fwd_scalar(T z, bool tanh_approx) {
  using namespace gelu_const;
  if (tanh_approx) {
    const T u = T(kSqrt2OverPi) * (z + T(kTanhCubic) * z * z * z);
    return T(0.5) * z * (T(1) + tpk_tanh(u));
  }
  return T(0.5) * z * (T(1) + tpk_erf(z * T(kInvSqrt2)));
}

// d gelu(z) / dz
template <typename T>
TPK_HOST_DEVICE T gelu_grad_scalar(T z, bool tanh_approx) {
  using namespace gelu_const;
  if (tanh_approx) {
    const T z2 = z * z;
    const T t = tpk_tanh(T(kSqrt2OverPi) * (z + T(kTanhCubic) * z2 * z));
    // d/dz [0.5 z (1 + t)] = 0.5 (1 + t) + 0.5 z (1 - t^2) * sqrt(2/pi) (1 + 3 * 0.044715 z^2)
    return T(0.5) * (T(1) + t) +
           T(0.5) * z * (T(1) - t * t) * T(kSqrt2OverPi) * (T(1) + T(3 * kTanhCubic) * z2);
  }
  // d/dz [z Phi(z)] = Phi(z) + z phi(z)
  return T(0.5) * (T(1) + tpk_erf(z * T(kInvSqrt2))) + z * T(kInvSqrt2Pi) * tpk_exp(T(-0.5) * z * z);
}

}  // namespace tpkernels
