// FlowPrefill's CPU attention tile: flash attention (online softmax) for one sequence's block of
// queries against a block of its keys, with grouped-query heads, a bottom-right causal mask and the
// log-sum-exp; or one key tile of a split prefill's query block, its online softmax carried from the
// block's earlier tiles (attention_tile). engine/attention/cpu.py says why the kernel exists.
//
// bf16: scores and P.V run on AVX-512 BF16's dot-product instruction (two multiply-adds per lane,
// fp32 accumulation); the probabilities are rounded to bf16 before P.V, as torch's and vLLM's CPU
// kernels round them. fp32: plain AVX-512 FMA. The softmax is a base-2 exponential (a degree-6
// polynomial on [-1/2, 1/2] and a scalef), so its error is below fp32's epsilon.
//
// Layout: q [nq, hq, d], k and v [nk, hkv, d] (tokens first, the innermost dimension contiguous);
// out [nq, hq, d] in q's dtype, lse [nq, hq] fp32 (natural log). The keys of each KV head are first
// packed for the dot products (a copy of O(nk d), against O(nq nk d) work), then work items (a KV
// head x a block of 64 query positions, all the head's query heads) run in parallel, ordered so that
// each thread's share of a causal tile's triangle is even.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu_simd.h"

namespace {

using namespace flowprefill;

constexpr int64_t kBlockQ = 64;  // query positions per work item
// Keys per inner block (a multiple of 32): 128 ran about 15 % faster than 64 (bf16, 4K tokens); 256 no faster.
constexpr int64_t kBlockK = 128;
// Query rows per micro-kernel: 8 at head size 32 (12 and 6 were slower), 6 above (registers).
constexpr int micro_rows(int d) { return d <= 32 ? 8 : 6; }

// Key rows are packed 16 at a time: full chunks by gathers (one vector per pair of dims, or per dim
// in fp32), the last partial one padded with zeros; value rows are interleaved (bf16) or copied.
inline __m512i gather_rows32(const void* base, int64_t row_bytes, int64_t rows) {
  const __m512i idx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                         _mm512_set1_epi32(static_cast<int32_t>(row_bytes)));
  const __mmask16 live = static_cast<__mmask16>(rows >= 16 ? 0xffff : rows <= 0 ? 0 : (1u << rows) - 1);
  return _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, idx, base, 1);
}

struct Bf16 {
  using T = at::BFloat16;
  using P = uint16_t;  // probabilities as bf16 bits

  static void pack_k(const T* k, int64_t stride, int64_t nk, int64_t nk_pad, int64_t d, uint16_t* out) {
    for (int64_t c = 0; c < nk_pad / 16; ++c)
      for (int64_t j = 0; j < d / 2; ++j)
        _mm512_storeu_si512(out + (c * (d / 2) + j) * 32,
                            gather_rows32(k + c * 16 * stride + 2 * j, stride * 2, nk - c * 16));
  }
  static void pack_v(const T* v, int64_t stride, int64_t nk, int64_t nk_pad, int64_t d, uint16_t* out) {
    for (int64_t p = 0; p < nk_pad / 2; ++p) {
      const int64_t a = 2 * p, b = 2 * p + 1;
      for (int64_t e = 0; e < d; e += 16) {
        const __m512i lo = a < nk ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                        reinterpret_cast<const __m256i*>(v + a * stride + e))) : _mm512_setzero_si512();
        const __m512i hi = b < nk ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                        reinterpret_cast<const __m256i*>(v + b * stride + e))) : _mm512_setzero_si512();
        _mm512_storeu_si512(out + (p * d + e) * 2, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
      }
    }
  }
  static size_t packed_elems(int64_t nk_pad, int64_t d) { return static_cast<size_t>(nk_pad * d); }
};

struct Fp32 {
  using T = float;
  using P = float;

  static void pack_k(const T* k, int64_t stride, int64_t nk, int64_t nk_pad, int64_t d, float* out) {
    for (int64_t c = 0; c < nk_pad / 16; ++c)
      for (int64_t e = 0; e < d; ++e)
        _mm512_storeu_si512(out + (c * d + e) * 16, gather_rows32(k + c * 16 * stride + e, stride * 4, nk - c * 16));
  }
  static void pack_v(const T* v, int64_t stride, int64_t nk, int64_t nk_pad, int64_t d, float* out) {
    for (int64_t key = 0; key < nk_pad; ++key) {
      if (key < nk)
        std::memcpy(out + key * d, v + key * stride, d * sizeof(float));
      else
        std::memset(out + key * d, 0, d * sizeof(float));
    }
  }
  static size_t packed_elems(int64_t nk_pad, int64_t d) { return static_cast<size_t>(nk_pad * d); }
};

// Output dims of P.V in slices of at most 4 vectors (64 dims) that divide the head's: MR x 4
// accumulators and the slice's 4 values fit the 32 vector registers.
constexpr int slice_vectors(int v) { return v % 4 == 0 ? 4 : v % 3 == 0 ? 3 : v % 2 == 0 ? 2 : 1; }

#if FLOWPREFILL_BF16
// Scores of MR query rows against the 16c-th chunk of 16 keys, for c in [0, kBlockK / 16).
template <int D, int MR>
inline void scores_bf16(
    const uint16_t* const* q, const uint16_t* kp, float* s) {
  for (int c = 0; c < kBlockK / 16; ++c) {
    __m512 acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
    const uint16_t* kc = kp + static_cast<int64_t>(c) * (D / 2) * 32;
    for (int j = 0; j < D / 2; ++j) {
      const __m512bh kv = (__m512bh)_mm512_loadu_si512(kc + j * 32);
      for (int r = 0; r < MR; ++r) {
        int32_t pair;
        std::memcpy(&pair, q[r] + 2 * j, 4);
        acc[r] = _mm512_dpbf16_ps(acc[r], kv, (__m512bh)_mm512_set1_epi32(pair));
      }
    }
    for (int r = 0; r < MR; ++r) _mm512_storeu_ps(s + r * kBlockK + c * 16, acc[r]);
  }
}

// o[r] = o[r] * alpha[r] + P[r] . V over the block's keys (o: MR rows of D fp32).
template <int D, int MR>
inline void pv_bf16(
    const uint16_t* p, const uint16_t* vp, const float* alpha, float* o) {
  constexpr int V = D / 16;
  constexpr int W = slice_vectors(V);
  for (int v0 = 0; v0 < V; v0 += W) {
    __m512 acc[MR][W];
    for (int r = 0; r < MR; ++r) {
      const __m512 a = _mm512_set1_ps(alpha[r]);
      for (int w = 0; w < W; ++w) acc[r][w] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + (v0 + w) * 16), a);
    }
    for (int t = 0; t < kBlockK / 2; ++t) {
      __m512bh vv[W];
      for (int w = 0; w < W; ++w)
        vv[w] = (__m512bh)_mm512_loadu_si512(vp + (static_cast<int64_t>(t) * D + (v0 + w) * 16) * 2);
      for (int r = 0; r < MR; ++r) {
        int32_t pair;
        std::memcpy(&pair, p + r * kBlockK + 2 * t, 4);
        const __m512bh b = (__m512bh)_mm512_set1_epi32(pair);
        for (int w = 0; w < W; ++w) acc[r][w] = _mm512_dpbf16_ps(acc[r][w], vv[w], b);
      }
    }
    for (int r = 0; r < MR; ++r)
      for (int w = 0; w < W; ++w) _mm512_storeu_ps(o + r * D + (v0 + w) * 16, acc[r][w]);
  }
}

#endif

template <int D, int MR>
inline void scores_fp32(const float* const* q, const float* kp, float* s) {
  for (int c = 0; c < kBlockK / 16; ++c) {
    __m512 acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
    const float* kc = kp + static_cast<int64_t>(c) * D * 16;
    for (int e = 0; e < D; ++e) {
      const __m512 kv = _mm512_loadu_ps(kc + e * 16);
      for (int r = 0; r < MR; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r][e]), kv, acc[r]);
    }
    for (int r = 0; r < MR; ++r) _mm512_storeu_ps(s + r * kBlockK + c * 16, acc[r]);
  }
}

template <int D, int MR>
inline void pv_fp32(const float* p, const float* vp, const float* alpha, float* o) {
  constexpr int V = D / 16;
  constexpr int W = slice_vectors(V);
  for (int v0 = 0; v0 < V; v0 += W) {
    __m512 acc[MR][W];
    for (int r = 0; r < MR; ++r) {
      const __m512 a = _mm512_set1_ps(alpha[r]);
      for (int w = 0; w < W; ++w) acc[r][w] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + (v0 + w) * 16), a);
    }
    for (int t = 0; t < kBlockK; ++t) {
      __m512 vv[W];
      for (int w = 0; w < W; ++w) vv[w] = _mm512_loadu_ps(vp + static_cast<int64_t>(t) * D + (v0 + w) * 16);
      for (int r = 0; r < MR; ++r) {
        const __m512 b = _mm512_set1_ps(p[r * kBlockK + t]);
        for (int w = 0; w < W; ++w) acc[r][w] = _mm512_fmadd_ps(b, vv[w], acc[r][w]);
      }
    }
    for (int r = 0; r < MR; ++r)
      for (int w = 0; w < W; ++w) _mm512_storeu_ps(o + r * D + (v0 + w) * 16, acc[r][w]);
  }
}

// The online softmax of one row's block of scores s (raw dot products): masks keys past `limit` (the
// row's last visible key, block-relative), updates the row's running max m (in log2 units of the
// scaled score) and sum l, writes the probabilities p and returns the factor the row's output is
// rescaled by.
template <typename Prob>
inline float softmax_row(const float* s, int64_t limit, float scale2, float& m, float& l, Prob* p) {
  constexpr int C = kBlockK / 16;
  constexpr int DEG = sizeof(Prob) == 2 ? 4 : 6;
  __m512 x[C];
  __mmask16 live[C];
  __m512 mx = _mm512_set1_ps(kNegInf);
  for (int c = 0; c < C; ++c) {
    const int64_t valid = std::clamp<int64_t>(limit + 1 - c * 16, 0, 16);
    live[c] = static_cast<__mmask16>(valid == 16 ? 0xffff : (1u << valid) - 1);
    x[c] = _mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), live[c], _mm512_loadu_ps(s + c * 16));
    mx = _mm512_max_ps(mx, x[c]);
  }
  const float block_max = _mm512_reduce_max_ps(mx);
  const float m_new = block_max == kNegInf ? m : std::max(m, block_max * scale2);
  if (m_new == kNegInf) {  // nothing visible yet: the row's state stays empty
    for (int t = 0; t < kBlockK; ++t) p[t] = 0;
    return 1.0f;
  }
  const float alpha = m == kNegInf ? 0.0f : std::exp2(m - m_new);
  const __m512 scale = _mm512_set1_ps(scale2), shift = _mm512_set1_ps(-m_new);
  __m512 sum = _mm512_setzero_ps();
  for (int c = 0; c < C; ++c) {
    __m512 e = exp2_ps<DEG>(_mm512_fmadd_ps(x[c], scale, shift));
    if (live[c] != 0xffff) e = _mm512_maskz_mov_ps(live[c], e);
    if constexpr (sizeof(Prob) == 2) {
      // Rounded to bf16 first, and summed as rounded: the weights P.V uses are the ones normalised.
#if FLOWPREFILL_BF16
      const __m256i h = (__m256i)_mm512_cvtneps_pbh(e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + c * 16), h);
      sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
#endif
    } else {
      _mm512_storeu_ps(reinterpret_cast<float*>(p) + c * 16, e);
      sum = _mm512_add_ps(sum, e);
    }
  }
  l = l * alpha + _mm512_reduce_add_ps(sum);
  m = m_new;
  return alpha;
}

struct Shape {
  int64_t nq, nk, hq, hkv, group, nk_pad;
  bool causal;
  float scale2;  // softmax scale in log2 units
};

// A query block's online softmax carried from one call to the next (a split prefill's key tiles of
// one block of queries): o unnormalised fp32 [nq, hq, D], m (log2 units of the scaled score) and l
// [nq, hq]. Carried exactly, so tiles on 128-key boundaries give the unsplit call's result bit for bit,
// and no tile writes a normalised output for a merge to read again (SmolLM2 fp32 at 8K tokens: 899
// merges took 1.2 of 49 s).
struct Running {
  float* o;
  float* m;
  float* l;
  bool first;  // o, m and l hold nothing yet
  bool last;   // finish: write out and lse instead of the state
};

// A work item's rows of the carried state into its scratch (load) or back (store); scratch rows are
// grouped by query head (g * rows + i), the state's by position (i * hq + head).
template <int D>
void carry(const Shape& sh, int64_t h, int64_t q0, int64_t rows, const Running* running, float* o, float* m,
           float* l, bool load) {
  for (int64_t g = 0; g < sh.group; ++g) {
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t row = g * rows + i, at = (q0 + i) * sh.hq + h * sh.group + g;
      if (load) {
        std::memcpy(o + row * D, running->o + at * D, D * sizeof(float));
        m[row] = running->m[at];
        l[row] = running->l[at];
      } else {
        std::memcpy(running->o + at * D, o + row * D, D * sizeof(float));
        running->m[at] = m[row];
        running->l[at] = l[row];
      }
    }
  }
}

// One work item: query positions [q0, q1) of every query head of KV head h.
template <typename E, int D, int MR>
void attend_block(const Shape& sh, const typename E::T* q, int64_t q_stride0, int64_t q_stride1,
                  const typename E::T* kp, const typename E::T* vp, int64_t h, int64_t q0, int64_t q1,
                  typename E::T* out, float* lse, const Running* running, std::vector<float>& scratch) {
  using T = typename E::T;
  using Prob = typename E::P;
  const int64_t rows = q1 - q0;
  const int64_t offset = sh.nk - sh.nq;  // bottom-right causal: query i sees keys <= i + offset
  const int64_t n_rows = sh.group * rows;
  scratch.assign(static_cast<size_t>(n_rows * (D + 2) + MR * kBlockK * 2), 0.0f);
  float* o = scratch.data();
  float* m = o + n_rows * D;
  float* l = m + n_rows;
  float* s = l + n_rows;
  Prob* p = reinterpret_cast<Prob*>(s + MR * kBlockK);
  std::fill(m, m + n_rows, kNegInf);
  if (running != nullptr && !running->first) carry<D>(sh, h, q0, rows, running, o, m, l, true);
  const int64_t last_key = sh.causal ? std::min(sh.nk, q1 + offset) : sh.nk;  // exclusive
  const size_t k_elems_per_block = E::packed_elems(kBlockK, D);
  for (int64_t kb = 0; kb * kBlockK < last_key; ++kb) {
    const T* kblk = kp + kb * k_elems_per_block;
    const T* vblk = vp + kb * k_elems_per_block;
    const int64_t k0 = kb * kBlockK;
    for (int64_t g = 0; g < sh.group; ++g) {
      const int64_t head = h * sh.group + g;
      for (int64_t r0 = 0; r0 < rows; r0 += MR) {
        const int64_t nr = std::min<int64_t>(MR, rows - r0);
        // The micro-block's last row sees the most keys; skip a block none of its rows sees.
        if (sh.causal && k0 > q0 + r0 + nr - 1 + offset) continue;
        const T* qrow[MR];
        for (int r = 0; r < MR; ++r)
          qrow[r] = q + (q0 + r0 + std::min<int64_t>(r, nr - 1)) * q_stride0 + head * q_stride1;
#if FLOWPREFILL_BF16
        if constexpr (sizeof(T) == 2)
          scores_bf16<D, MR>(reinterpret_cast<const uint16_t* const*>(qrow),
                             reinterpret_cast<const uint16_t*>(kblk), s);
        else
#endif
          scores_fp32<D, MR>(reinterpret_cast<const float* const*>(qrow), reinterpret_cast<const float*>(kblk), s);
        float alpha[MR];
        const int64_t row = g * rows + r0;
        for (int r = 0; r < MR; ++r) {
          if (r >= nr) {  // a padding row: weights 0, its (unused) output untouched
            std::fill(p + r * kBlockK, p + (r + 1) * kBlockK, Prob(0));
            alpha[r] = 1.0f;
            continue;
          }
          const int64_t visible = std::min(sh.nk, sh.causal ? q0 + r0 + r + offset + 1 : sh.nk);
          alpha[r] = softmax_row<Prob>(s + r * kBlockK, visible - 1 - k0, sh.scale2, m[row + r], l[row + r],
                                       p + r * kBlockK);
        }
        float* orow = o + row * D;
        float o_pad[MR * D] = {};
        float* target = orow;
        if (nr < MR) {  // rows past the block's end: compute into a scratch copy
          std::copy(orow, orow + nr * D, o_pad);
          target = o_pad;
        }
#if FLOWPREFILL_BF16
        if constexpr (sizeof(T) == 2)
          pv_bf16<D, MR>(reinterpret_cast<const uint16_t*>(p), reinterpret_cast<const uint16_t*>(vblk), alpha,
                         target);
        else
#endif
          pv_fp32<D, MR>(reinterpret_cast<const float*>(p), reinterpret_cast<const float*>(vblk), alpha, target);
        if (nr < MR) std::copy(o_pad, o_pad + nr * D, orow);
      }
    }
  }
  if (running != nullptr && !running->last) {
    carry<D>(sh, h, q0, rows, running, o, m, l, false);
    return;
  }
  for (int64_t g = 0; g < sh.group; ++g) {
    const int64_t head = h * sh.group + g;
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t row = g * rows + i;
      const float inv = l[row] > 0 ? 1.0f / l[row] : 0.0f;
      T* dst = out + ((q0 + i) * sh.hq + head) * D;
      for (int e = 0; e < D; ++e) dst[e] = static_cast<T>(o[row * D + e] * inv);
      lse[(q0 + i) * sh.hq + head] = l[row] > 0 ? (m[row] + std::log2(l[row])) * kLn2 : kNegInf;
    }
  }
}

template <typename E, int D>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, at::Tensor& out,
         at::Tensor& lse, const Running* running) {
  using T = typename E::T;
  constexpr int MR = micro_rows(D);
  Shape sh{};
  sh.nq = q.size(0);
  sh.nk = k.size(0);
  sh.hq = q.size(1);
  sh.hkv = k.size(1);
  sh.group = sh.hq / sh.hkv;
  sh.nk_pad = (sh.nk + kBlockK - 1) / kBlockK * kBlockK;
  sh.causal = causal;
  sh.scale2 = static_cast<float>(kLog2e / std::sqrt(static_cast<double>(D)));
  const size_t per_head = E::packed_elems(sh.nk_pad, D);
  // The packed keys and values, in buffers this thread keeps: the packing writes every element, and a
  // fresh zeroed vector per call cost a split prefill's hundreds of calls (SmolLM2 fp32, 2K tokens: 291
  // calls, attention 10 % slower than in 30 unsplit ones). They keep the longest prompt's size: one
  // layer's keys and values of it, a layer's share of the KV cache that prompt took.
  thread_local std::vector<T> kp_buf, vp_buf;
  if (kp_buf.size() < per_head * sh.hkv) {
    kp_buf.resize(per_head * sh.hkv);
    vp_buf.resize(per_head * sh.hkv);
  }
  T* const kp = kp_buf.data();
  T* const vp = vp_buf.data();
  const T* kd = k.data_ptr<T>();
  const T* vd = v.data_ptr<T>();
  at::parallel_for(0, sh.hkv, 1, [&](int64_t a, int64_t b) {
    for (int64_t h = a; h < b; ++h) {
      using Raw = std::conditional_t<sizeof(T) == 2, uint16_t, float>;
      E::pack_k(kd + h * k.stride(1), k.stride(0), sh.nk, sh.nk_pad, D, reinterpret_cast<Raw*>(kp + h * per_head));
      E::pack_v(vd + h * v.stride(1), v.stride(0), sh.nk, sh.nk_pad, D, reinterpret_cast<Raw*>(vp + h * per_head));
    }
  });
  const int64_t n_qb = (sh.nq + kBlockQ - 1) / kBlockQ;
  // Work items: query blocks in the order 0, last, 1, last - 1, ... (a causal triangle's light and
  // heavy blocks alternate, so parallel_for's contiguous shares cost about the same), x KV heads.
  std::vector<int64_t> order(n_qb);
  for (int64_t i = 0; i < n_qb; ++i) order[i] = i % 2 == 0 ? i / 2 : n_qb - 1 - i / 2;
  const T* qd = q.data_ptr<T>();
  T* od = out.data_ptr<T>();
  float* ld = lse.data_ptr<float>();
  at::parallel_for(0, n_qb * sh.hkv, 1, [&](int64_t a, int64_t b) {
    std::vector<float> scratch;
    for (int64_t item = a; item < b; ++item) {
      const int64_t qb = order[item / sh.hkv], h = item % sh.hkv;
      const int64_t q0 = qb * kBlockQ, q1 = std::min(sh.nq, q0 + kBlockQ);
      attend_block<E, D, MR>(sh, qd, q.stride(0), q.stride(1), kp + h * per_head, vp + h * per_head, h,
                             q0, q1, od, ld, running, scratch);
    }
  });
}

template <typename E>
void dispatch(int64_t d, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, at::Tensor& out,
              at::Tensor& lse, const Running* running) {
  with_head_dim(d, "flowprefill attention",
                [&](auto D) { run<E, decltype(D)::value>(q, k, v, causal, out, lse, running); });
}

void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be [tokens, heads, head_dim]");
  TORCH_CHECK(q.device().is_cpu(), "flowprefill attention runs on the CPU");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(), "q, k, v dtypes differ");
  TORCH_CHECK(k.sizes() == v.sizes(), "k and v shapes differ");
  TORCH_CHECK(q.size(2) == k.size(2), "q and k head sizes differ");
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(!causal || k.size(0) >= q.size(0), "causal needs at least as many keys as queries");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "head_dim must be contiguous");
}

void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, at::Tensor& out,
            at::Tensor& lse, const Running* running) {
#if FLOWPREFILL_BF16
  if (q.scalar_type() == at::kBFloat16)
    dispatch<Bf16>(q.size(2), q, k, v, causal, out, lse, running);
  else
#endif
  if (q.scalar_type() == at::kFloat)
    dispatch<Fp32>(q.size(2), q, k, v, causal, out, lse, running);
  else
    TORCH_CHECK(false, "flowprefill attention: dtype ", q.scalar_type(), " (bfloat16 and float32 only)");
}

std::tuple<at::Tensor, at::Tensor> attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                             bool causal) {
  check_qkv(q, k, v, causal);
  auto out = at::empty(q.sizes(), q.options());
  auto lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  if (q.size(0) == 0) return {out, lse};
  if (k.size(0) == 0) {
    out.zero_();
    lse.fill_(-std::numeric_limits<float>::infinity());
    return {out, lse};
  }
  attend(q, k, v, causal, out, lse, nullptr);
  return {out, lse};
}

// One key tile of a query block whose online softmax (o, m, l: struct Running) carries over from the
// block's earlier tiles (first: none yet). last: returns the block's out and lse; before it, empty
// tensors, the state updated in place.
std::tuple<at::Tensor, at::Tensor> attention_tile(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  bool causal, at::Tensor& o, at::Tensor& m, at::Tensor& l,
                                                  bool first, bool last) {
  check_qkv(q, k, v, causal);
  const auto rows = q.sizes().slice(0, 2);
  TORCH_CHECK(o.device().is_cpu() && m.device().is_cpu() && l.device().is_cpu(), "o, m and l must be on the CPU");
  TORCH_CHECK(o.scalar_type() == at::kFloat && o.is_contiguous() && o.sizes() == q.sizes(),
              "o must be contiguous fp32 of q's shape");
  TORCH_CHECK(m.scalar_type() == at::kFloat && m.is_contiguous() && m.sizes() == rows &&
                  l.scalar_type() == at::kFloat && l.is_contiguous() && l.sizes() == rows,
              "m and l must be contiguous fp32 [tokens, q_heads]");
  const Running running{o.data_ptr<float>(), m.data_ptr<float>(), l.data_ptr<float>(), first, last};
  auto out = last ? at::empty(q.sizes(), q.options()) : at::empty({0}, q.options());
  auto lse = at::empty(last ? rows : at::IntArrayRef{0}, q.options().dtype(at::kFloat));
  if (q.size(0) > 0) attend(q, k, v, causal, out, lse, &running);
  return {out, lse};
}

// How many threads one at::parallel_for over `n` items runs on: what the build's OpenMP gives the kernels
// (1 in a build without -fopenmp, whatever torch.set_num_threads says; engine/attention/cpu.py).
int64_t parallel_width(int64_t n) {
  std::vector<char> seen(static_cast<size_t>(std::max<int64_t>(1, at::get_num_threads())), 0);
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) {
    const int t = at::get_thread_num();
    if (t >= 0 && static_cast<size_t>(t) < seen.size()) seen[static_cast<size_t>(t)] = 1;
  });
  return std::count(seen.begin(), seen.end(), 1);
}

}  // namespace

// Every operator of the extension; the row kernels' implementations are cpu_rows.cpp's, decode's
// cpu_decode.cpp's.
TORCH_LIBRARY(flowprefill, m) {
  m.def("attention(Tensor q, Tensor k, Tensor v, bool causal) -> (Tensor, Tensor)");
  m.def("attention_tile(Tensor q, Tensor k, Tensor v, bool causal, Tensor(a!) o, Tensor(b!) m, Tensor(c!) l, "
        "bool first, bool last) -> (Tensor, Tensor)");
  m.def("decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor lengths) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("rope(Tensor positions, Tensor q, Tensor k, int head_dim, Tensor cos_sin) -> (Tensor, Tensor)");
  m.def("parallel_width(int n) -> int", &parallel_width);
}

TORCH_LIBRARY_IMPL(flowprefill, CPU, m) {
  m.impl("attention", &attention);
  m.impl("attention_tile", &attention_tile);
}
