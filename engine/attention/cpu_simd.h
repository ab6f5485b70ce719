// Shared by FlowPrefill's CPU kernels (cpu_flash.cpp: attention; cpu_rows.cpp: row kernels): the
// base-2 exponential and the loads and stores of 16 fp32 or bf16 values. Compiled with AVX-512F/BW/DQ/VL
// (engine/attention/cpu.py; FLOWPREFILL_BF16=1 adds AVX-512 BF16).
#pragma once

// Only what is used: ATen/ATen.h (every operator's header) was a fifth of each file's build time.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#ifndef FLOWPREFILL_BF16
#define FLOWPREFILL_BF16 0  // built with -mavx512bf16 -DFLOWPREFILL_BF16=1 where the CPU has AVX-512 BF16
#endif

namespace flowprefill {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// 2^x for x <= 0: x = n + f with n an integer and f in [-1/2, 1/2], 2^f by its Taylor polynomial,
// scaled by 2^n with scalef. Degree 6 errs by 1.2e-7 relative (fp32's epsilon), degree 4 by 4e-5
// (for probabilities rounded to bf16 next, whose epsilon is 4e-3). Below -125 the result is at most
// 2^-125 of the row's largest term, which no fp32 sum can see (and stays a normal number).
template <int DEG>
inline __m512 exp2_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-125.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p;
  if constexpr (DEG >= 6) {
    p = _mm512_set1_ps(1.5403530393381606e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  } else {
    p = _mm512_set1_ps(9.6181291076284772e-3f);
  }
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Per element type: how keys and values are packed, and the two dot-product loops.
//   bf16: K as [key chunk of 16][d/2][16 keys][2 dims] (a vector: 16 keys x one pair of dims),
//         V as [key pair][d][2 keys] (a vector: 16 output dims x two keys).
//   fp32: K as [key chunk of 16][d][16 keys], V as [key][d] (row-major, padded).

inline __m512 load16(const float* p, int n) { return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p); }
inline __m512 load16(const at::BFloat16* p, int n) {
  const __m256i h = _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void store16(float* p, __m512 v, int n) { _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), v); }
// fp32 -> bf16, round to nearest even (NaN stays NaN): what c10::BFloat16's constructor does.
inline __m256i to_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7fff));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(r);
}
inline void store16(at::BFloat16* p, __m512 v, int n) {
  _mm256_mask_storeu_epi16(p, static_cast<__mmask16>((1u << n) - 1), to_bf16(v));
}
// What a value becomes once stored as T (and read back): rounding to T's precision.
inline __m512 round_as(__m512 v, const float*) { return v; }
inline __m512 round_as(__m512 v, const at::BFloat16*) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(v)), 16));
}

// f(std::integral_constant<int, D>{}) for the head size D == d the kernels are built for (engine/attention/
// cpu.py's HEAD_DIMS), else `op`'s error naming them.
template <typename F>
inline void with_head_dim(int64_t d, const char* op, F&& f) {
  switch (d) {
    case 16: return f(std::integral_constant<int, 16>{});
    case 32: return f(std::integral_constant<int, 32>{});
    case 64: return f(std::integral_constant<int, 64>{});
    case 96: return f(std::integral_constant<int, 96>{});
    case 128: return f(std::integral_constant<int, 128>{});
    case 256: return f(std::integral_constant<int, 256>{});
    default: TORCH_CHECK(false, op, ": head size ", d, " is not built (16, 32, 64, 96, 128, 256)");
  }
}

}  // namespace flowprefill
