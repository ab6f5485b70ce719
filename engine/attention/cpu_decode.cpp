// FlowPrefill's CPU decode attention: one query token per sequence against its keys and values read in
// place from the paged KV cache, all sequences in one call (engine/attention/cpu.py says why).
//
// Layout: q [n, hq, d]; k_cache and v_cache one layer's [blocks, block_size, hkv, d]; tables [n, width]
// int64 (each sequence's blocks, padded); lengths [n] int64. out [n, hq, d] in q's dtype. Query head j
// reads KV head j / (hq / hkv). Work items (a sequence x a KV head, all the query heads sharing it) run
// in parallel. Scores in fp32, softmax scale 1/sqrt(d), a base-2 exponential of degree 6 (cpu_simd.h).

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "cpu_simd.h"

namespace {

using namespace flowprefill;

// The query heads h * G .. h * G + G - 1 of one sequence against KV head h: each key and value row is read
// once for all G heads (the rows come from memory; the heads' work is a few instructions each).
template <typename T, int D, int G>
void decode_item(const T* q, const T* kp, const T* vp, const int64_t* table, int64_t len, int64_t bs,
                 int64_t row_stride, float scale2, std::vector<float>& s, T* out) {
  constexpr int V = D / 16;  // vectors per head row (D is a multiple of 16)
  s.resize(static_cast<size_t>(G * len));
  __m512 qv[G][V];
  float mx[G];
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < V; ++c) qv[g][c] = _mm512_mul_ps(load16(q + g * D + c * 16, 16), _mm512_set1_ps(scale2));
    mx[g] = kNegInf;
  }
  for (int64_t t0 = 0; t0 < len; t0 += bs) {  // scores, in log2 units, a block at a time
    const T* kr = kp + table[t0 / bs] * bs * row_stride;
    for (int64_t t = t0; t < std::min(len, t0 + bs); ++t, kr += row_stride) {
      __m512 k[V];
      for (int c = 0; c < V; ++c) k[c] = load16(kr + c * 16, 16);
      for (int g = 0; g < G; ++g) {
        __m512 acc = _mm512_mul_ps(qv[g][0], k[0]);
        for (int c = 1; c < V; ++c) acc = _mm512_fmadd_ps(qv[g][c], k[c], acc);
        const float x = s[g * len + t] = _mm512_reduce_add_ps(acc);
        mx[g] = std::max(mx[g], x);
      }
    }
  }
  float total[G];
  for (int g = 0; g < G; ++g) {  // probabilities, unnormalised
    __m512 sum = _mm512_setzero_ps();
    float* sg = s.data() + g * len;
    for (int64_t t = 0; t < len; t += 16) {
      const int m = static_cast<int>(std::min<int64_t>(16, len - t));
      const __m512 e = _mm512_maskz_mov_ps(static_cast<__mmask16>((1u << m) - 1),
                                           exp2_ps<6>(_mm512_sub_ps(load16(sg + t, m), _mm512_set1_ps(mx[g]))));
      sum = _mm512_add_ps(sum, e);
      store16(sg + t, e, m);
    }
    total[g] = _mm512_reduce_add_ps(sum);
  }
  __m512 o[G][V];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < V; ++c) o[g][c] = _mm512_setzero_ps();
  for (int64_t t0 = 0; t0 < len; t0 += bs) {
    const T* vr = vp + table[t0 / bs] * bs * row_stride;
    for (int64_t t = t0; t < std::min(len, t0 + bs); ++t, vr += row_stride) {
      __m512 v[V];
      for (int c = 0; c < V; ++c) v[c] = load16(vr + c * 16, 16);
      for (int g = 0; g < G; ++g) {
        const __m512 p = _mm512_set1_ps(s[g * len + t]);
        for (int c = 0; c < V; ++c) o[g][c] = _mm512_fmadd_ps(p, v[c], o[g][c]);
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    const __m512 inv = _mm512_set1_ps(1.0f / total[g]);
    for (int c = 0; c < V; ++c) store16(out + g * D + c * 16, _mm512_mul_ps(o[g][c], inv), 16);
  }
}

template <typename T, int D, int G>
void decode_rows(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& tables,
                 const at::Tensor& lengths, at::Tensor& out) {
  const int64_t n = q.size(0), hq = q.size(1), bs = kc.size(1), hkv = kc.size(2), width = tables.size(1);
  const int64_t group = hq / hkv, chunks = group / G;  // G heads at a time
  const T* qp = q.data_ptr<T>();
  const T* kp = kc.data_ptr<T>();
  const T* vp = vc.data_ptr<T>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const float scale2 = static_cast<float>(kLog2e / std::sqrt(static_cast<double>(D)));
  at::parallel_for(0, n * hkv * chunks, 1, [&](int64_t a, int64_t b) {
    std::vector<float> s;  // the heads' scores, then their probabilities
    for (int64_t item = a; item < b; ++item) {
      const int64_t seq = item / (hkv * chunks), h = item / chunks % hkv, head = h * group + item % chunks * G;
      decode_item<T, D, G>(qp + (seq * hq + head) * D, kp + h * D, vp + h * D, tp + seq * width, lp[seq], bs,
                           hkv * D, scale2, s, op + (seq * hq + head) * D);
    }
  });
}

template <typename T, int D>
void decode_group(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& tables,
                  const at::Tensor& lengths, at::Tensor& out) {
  const int64_t group = q.size(1) / kc.size(2);
  if (group % 4 == 0) return decode_rows<T, D, 4>(q, kc, vc, tables, lengths, out);
  if (group % 3 == 0) return decode_rows<T, D, 3>(q, kc, vc, tables, lengths, out);
  if (group % 2 == 0) return decode_rows<T, D, 2>(q, kc, vc, tables, lengths, out);
  return decode_rows<T, D, 1>(q, kc, vc, tables, lengths, out);
}

template <typename T>
void decode_dispatch(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& tables,
                     const at::Tensor& lengths, at::Tensor& out) {
  with_head_dim(q.size(2), "flowprefill decode",
                [&](auto D) { decode_group<T, decltype(D)::value>(q, kc, vc, tables, lengths, out); });
}

at::Tensor decode(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& tables_in, const at::Tensor& lengths_in) {
  TORCH_CHECK(q_in.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "decode: q [n, hq, d], caches [blocks, block_size, hkv, d]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "decode: contiguous caches");
  TORCH_CHECK(k_cache.size(1) > 0 && k_cache.size(2) > 0, "decode: a cache of blocks of at least one token and KV head");
  TORCH_CHECK(q_in.size(2) == k_cache.size(3) && q_in.size(1) % k_cache.size(2) == 0,
              "decode: q's head size is the cache's, its heads a multiple of the cache's");
  TORCH_CHECK(q_in.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "decode: one dtype");
  const auto q = q_in.contiguous();
  const auto tables = tables_in.to(at::kLong).contiguous();
  const auto lengths = lengths_in.to(at::kLong).contiguous();
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == q.size(0) && lengths.numel() == q.size(0),
              "decode: a table row and a length per query");
  const int64_t* lp = lengths.data_ptr<int64_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t bs = k_cache.size(1), blocks = k_cache.size(0);
  for (int64_t i = 0; i < q.size(0); ++i) {  // nothing is read outside the cache
    TORCH_CHECK(lp[i] >= 1 && (lp[i] + bs - 1) / bs <= tables.size(1), "decode: length ", lp[i],
                " outside its table of ", tables.size(1), " blocks");
    for (int64_t j = 0; j < (lp[i] + bs - 1) / bs; ++j)
      TORCH_CHECK(tp[i * tables.size(1) + j] >= 0 && tp[i * tables.size(1) + j] < blocks, "decode: block out of range");
  }
  auto out = at::empty(q.sizes(), q.options());
  if (q.scalar_type() == at::kBFloat16)
    decode_dispatch<at::BFloat16>(q, k_cache, v_cache, tables, lengths, out);
  else if (q.scalar_type() == at::kFloat)
    decode_dispatch<float>(q, k_cache, v_cache, tables, lengths, out);
  else
    TORCH_CHECK(false, "flowprefill decode: dtype ", q.scalar_type(), " (bfloat16 and float32 only)");
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(flowprefill, CPU, m) { m.impl("decode", &decode); }
