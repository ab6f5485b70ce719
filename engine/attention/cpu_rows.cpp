// FlowPrefill's CPU row kernels (`--row-kernels cpu`, engine/model/kernels.py): RMSNorm, SiLU-and-mul
// and the rotate-half RoPE, one pass over their rows each, with torch's roundings.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "cpu_simd.h"

namespace {

using namespace flowprefill;

// transformers' RMSNorm: x in fp32 times rsqrt(mean(x^2) + eps), rounded to x's dtype, times weight
// (a product in that dtype).
template <typename T>
void rms_norm_rows(const T* x, int64_t x_stride, const T* w, T* y, int64_t n, int64_t h, float eps) {
  at::parallel_for(0, n, 16, [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) {
      const T* xr = x + r * x_stride;
      __m512 sq = _mm512_setzero_ps();
      for (int64_t e = 0; e < h; e += 16) {
        const __m512 v = load16(xr + e, static_cast<int>(std::min<int64_t>(16, h - e)));
        sq = _mm512_fmadd_ps(v, v, sq);
      }
      const __m512 scale = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(sq) / static_cast<float>(h) + eps));
      for (int64_t e = 0; e < h; e += 16) {
        const int m = static_cast<int>(std::min<int64_t>(16, h - e));
        const __m512 normed = round_as(_mm512_mul_ps(load16(xr + e, m), scale), xr);
        store16(y + r * h + e, _mm512_mul_ps(normed, load16(w + e, m)), m);
      }
    }
  });
}

// sigmoid(x) = 1 / (1 + e^-x), from e^-|x| <= 1 so that nothing overflows.
inline __m512 sigmoid_ps(__m512 x) {
  const __m512 ax = _mm512_abs_ps(x);
  const __m512 e = exp2_ps<6>(_mm512_mul_ps(ax, _mm512_set1_ps(-kLog2e)));
  const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_add_ps(_mm512_set1_ps(1.0f), e));
  const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
  return _mm512_mask_mul_ps(inv, neg, inv, e);
}

// torch's silu(gate) * up: silu rounded to the dtype, then the product.
template <typename T>
void silu_mul_rows(const T* gu, int64_t stride, T* out, int64_t n, int64_t inter) {
  at::parallel_for(0, n, 16, [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) {
      const T* g = gu + r * stride;
      const T* u = g + inter;
      for (int64_t e = 0; e < inter; e += 16) {
        const int m = static_cast<int>(std::min<int64_t>(16, inter - e));
        const __m512 gv = load16(g + e, m);
        const __m512 silu = round_as(_mm512_mul_ps(gv, sigmoid_ps(gv)), g);
        store16(out + r * inter + e, _mm512_mul_ps(silu, load16(u + e, m)), m);
      }
    }
  });
}

// Rotate-half RoPE of q and k rows (column slices of the fused projection) at `positions`, from a
// fp32 table of cos | sin halves per position (FlashInfer's layout and arithmetic: fp32, one rounding).
template <typename T>
void rope_rows(const int64_t* pos, const T* q, int64_t q_stride, const T* k, int64_t k_stride, int64_t n,
               int64_t hq, int64_t hkv, int64_t d, const float* table, T* q_out, T* k_out) {
  const int64_t half = d / 2;
  at::parallel_for(0, n, 16, [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) {
      const float* cs = table + pos[r] * d;
      for (int64_t which = 0; which < 2; ++which) {
        const int64_t heads = which ? hkv : hq;
        const T* src = which ? k + r * k_stride : q + r * q_stride;
        T* dst = which ? k_out + r * hkv * d : q_out + r * hq * d;
        for (int64_t hd = 0; hd < heads; ++hd)
          for (int64_t e = 0; e < half; e += 16) {
            const int m = static_cast<int>(std::min<int64_t>(16, half - e));
            const __m512 x1 = load16(src + hd * d + e, m), x2 = load16(src + hd * d + half + e, m);
            const __m512 c = load16(cs + e, m), sn = load16(cs + half + e, m);
            store16(dst + hd * d + e, _mm512_fmsub_ps(x1, c, _mm512_mul_ps(x2, sn)), m);
            store16(dst + hd * d + half + e, _mm512_fmadd_ps(x2, c, _mm512_mul_ps(x1, sn)), m);
          }
      }
    }
  });
}

template <template <typename> class F, typename... Args>
void by_dtype(at::ScalarType t, const char* what, Args&&... args) {
  if (t == at::kBFloat16)
    F<at::BFloat16>::run(std::forward<Args>(args)...);
  else if (t == at::kFloat)
    F<float>::run(std::forward<Args>(args)...);
  else
    TORCH_CHECK(false, "flowprefill ", what, ": dtype ", t, " (bfloat16 and float32 only)");
}

template <typename T>
struct RmsNorm {
  static void run(const at::Tensor& x, const at::Tensor& w, at::Tensor& y, double eps) {
    rms_norm_rows<T>(x.data_ptr<T>(), x.stride(0), w.data_ptr<T>(), y.data_ptr<T>(), x.size(0), x.size(1),
                     static_cast<float>(eps));
  }
};

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && w.dim() == 1 && w.size(0) == x.size(1) && w.is_contiguous() &&
                  w.scalar_type() == x.scalar_type(),
              "rms_norm: x [rows, hidden] (rows contiguous), weight [hidden] of x's dtype");
  auto y = at::empty(x.sizes(), x.options());
  by_dtype<RmsNorm>(x.scalar_type(), "rms_norm", x, w, y, eps);
  return y;
}

template <typename T>
struct SiluMul {
  static void run(const at::Tensor& gu, at::Tensor& out) {
    silu_mul_rows<T>(gu.data_ptr<T>(), gu.stride(0), out.data_ptr<T>(), gu.size(0), out.size(1));
  }
};

at::Tensor silu_and_mul(const at::Tensor& gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.stride(1) == 1 && gu.size(1) % 2 == 0, "silu_and_mul: [rows, 2 x width]");
  auto out = at::empty({gu.size(0), gu.size(1) / 2}, gu.options());
  by_dtype<SiluMul>(gu.scalar_type(), "silu_and_mul", gu, out);
  return out;
}

template <typename T>
struct Rope {
  static void run(const at::Tensor& pos, const at::Tensor& q, const at::Tensor& k, int64_t d, const at::Tensor& table,
                  at::Tensor& q_out, at::Tensor& k_out) {
    rope_rows<T>(pos.data_ptr<int64_t>(), q.data_ptr<T>(), q.stride(0), k.data_ptr<T>(), k.stride(0), q.size(0),
                 q.size(1) / d, k.size(1) / d, d, table.data_ptr<float>(), q_out.data_ptr<T>(), k_out.data_ptr<T>());
  }
};

std::tuple<at::Tensor, at::Tensor> rope(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k,
                                        int64_t head_dim, const at::Tensor& cos_sin) {
  TORCH_CHECK(q.dim() == 2 && k.dim() == 2 && q.stride(1) == 1 && k.stride(1) == 1 && q.size(0) == k.size(0) &&
                  q.size(1) % head_dim == 0 && k.size(1) % head_dim == 0 && head_dim % 2 == 0,
              "rope: q [rows, heads x head_dim] and k [rows, kv_heads x head_dim], rows contiguous");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.size(0) == q.size(0) &&
                  positions.is_contiguous(), "rope: positions [rows] int64");
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.dim() == 2 && cos_sin.size(1) == head_dim &&
                  cos_sin.is_contiguous(), "rope: cos_sin [positions, head_dim] fp32");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t r = 0; r < positions.size(0); ++r)
    TORCH_CHECK(pos[r] >= 0 && pos[r] < cos_sin.size(0), "rope: position ", pos[r], " is past the table");
  auto q_out = at::empty(q.sizes(), q.options()), k_out = at::empty(k.sizes(), k.options());
  by_dtype<Rope>(q.scalar_type(), "rope", positions, q, k, head_dim, cos_sin, q_out, k_out);
  return {q_out, k_out};
}

}  // namespace

TORCH_LIBRARY_IMPL(flowprefill, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rope", &rope);
}
