// RMSNorm over rows, compiled once per instruction set (included by experts_cpu.cpp inside each
// per-ISA namespace): out = weight * round(x / sqrt(mean(x^2) + eps)), the statistics in fp32 and
// round() the cast back to x's dtype, as transformers' LlamaRMSNorm / DeepseekV3RMSNorm compute it
// (for bf16 the product with the weight is rounded once more, like a bf16 multiply).

// x rows at stride ldx, out rows at stride ldo.
template <typename T>
static void rms_norm_rows(const T* x, int64_t ldx, const T* w, T* out, int64_t ldo, int64_t rows, int64_t D,
                          float eps) {
  alignas(64) float lanes[MOE_W];
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * ldx;
    vf a0 = vzero(), a1 = vzero();
    int64_t c = 0;
    for (; c + 2 * MOE_W <= D; c += 2 * MOE_W) {
      const vf v0 = vload(xr + c), v1 = vload(xr + c + MOE_W);
      a0 = vfma(v0, v0, a0);
      a1 = vfma(v1, v1, a1);
    }
    for (; c + MOE_W <= D; c += MOE_W) {
      const vf v0 = vload(xr + c);
      a0 = vfma(v0, v0, a0);
    }
    vstore(lanes, vadd(a0, a1));
    float ss = 0.f;
    for (int i = 0; i < MOE_W; ++i) ss += lanes[i];
    for (; c < D; ++c) {
      const float v = to_float(xr[c]);
      ss += v * v;
    }
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
    T* o = out + r * ldo;
    for (int64_t j = 0; j < D; ++j) {
      T h;
      store_value(&h, to_float(xr[j]) * inv);  // the cast back to x's dtype
      store_value(o + j, to_float(w[j]) * to_float(h));
    }
  }
}

// Rows of x and r (contiguous, D wide): s = x + r as PyTorch's add in T computes it (the fp32 sum
// rounded to T by store_value), then out = rms_norm_rows(s), row by row so the sum is normed while
// it is in L1.
template <typename T>
static void add_rms_norm_rows(const T* x, const T* r, const T* w, T* s, T* out, int64_t rows, int64_t D, float eps) {
  for (int64_t i = 0; i < rows; ++i) {
    const T *xi = x + i * D, *ri = r + i * D;
    T* si = s + i * D;
    for (int64_t j = 0; j < D; ++j) store_value(si + j, to_float(xi[j]) + to_float(ri[j]));
    rms_norm_rows(si, D, w, out + i * D, D, 1, D, eps);
  }
}

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")  // D's tail: each product rounded, then added, for fp32 and bf16 rows alike
template <typename T>
static void router_logits_chunk(const T* x, int64_t t_begin, int64_t t_end, const float* w, int64_t E, int64_t D,
                                float* out) {
  constexpr int TT = 4, TE = 4;
  for (int64_t e0 = 0; e0 < E; e0 += TE) {
    const float* we[TE];
    for (int j = 0; j < TE; ++j) we[j] = w + std::min<int64_t>(e0 + j, E - 1) * D;
    const float* next = e0 + TE < E ? w + (e0 + TE) * D : nullptr;
    const int64_t next_rows = next ? std::min<int64_t>(TE, E - e0 - TE) : 0;
    for (int64_t t0 = t_begin; t0 < t_end; t0 += TT) {
      const T* xt[TT];
      for (int i = 0; i < TT; ++i) xt[i] = x + std::min<int64_t>(t0 + i, t_end - 1) * D;
      vf acc[TT][TE];
      for (int i = 0; i < TT; ++i)
        for (int j = 0; j < TE; ++j) acc[i][j] = vzero();
      const bool ask = t0 == t_begin && next_rows > 0;
      int64_t k = 0;
      for (; k + MOE_W <= D; k += MOE_W) {
        if (ask && k % 16 == 0)
          for (int64_t j = 0; j < next_rows; ++j) __builtin_prefetch(next + j * D + k);
        vf wv[TE];
        for (int j = 0; j < TE; ++j) wv[j] = vload(we[j] + k);
        for (int i = 0; i < TT; ++i) {
          const vf xv = vload(xt[i] + k);
          for (int j = 0; j < TE; ++j) acc[i][j] = vfma(xv, wv[j], acc[i][j]);
        }
      }
      for (int64_t i = 0; i < TT && t0 + i < t_end; ++i)
        for (int64_t j = 0; j < TE && e0 + j < E; ++j) {
          float sum = vhsum(acc[i][j]);
          for (int64_t kk = k; kk < D; ++kk) sum += to_float(xt[i][kk]) * we[j][kk];  // rounded, then added
          out[(t0 + i) * E + e0 + j] = sum;
        }
    }
  }
}
#pragma GCC pop_options

// Router logits: out[t][e] = sum_k x[t][k] w[e][k] in fp32, x [T, D] (fp32, or bf16 widened exactly as
// it is read) and w [E, D] rows contiguous, out [T, E]. Register tiles of 4 rows x 4 experts; each
// (t, e) sums D in MOE_W-lane partial sums in chunk order, then its lanes (vhsum), then D's tail: the
// same bits whatever T, the chunk, the tile or the thread (a row's logits do not depend on the batch
// it came in). Edge tiles repeat their last row or expert (computed, not stored). While a chunk's
// first row tile runs, the next expert tile's weight lines are prefetched (its rows come from DRAM in
// a decode step). Rows go in chunks of ~128 KB that stay in L2 while every expert tile passes over
// them: one pass of the expert tiles over all T rows re-read x from L3 once per expert tile
// (DeepSeek-style layer, E 64, D 1024, T = 4096 on AMX: 12.4 ms, ~16x x's bytes).
// Prefill-size bf16 rows are widened into an fp32 copy a chunk at a time first (exact, so the same
// bits): widened as each vector is loaded, their shifts shared the FMA ports (T = 4096, E 64, D 1024 on
// the AMX box: 6.4-6.7 -> 5.9-6.3 ms; PyTorch's fp32 GEMM 5.4-5.7, at ~100 GFLOP/s the FMA rate
// there). A decode step's few rows are read as they are: the copy cost more than it saved at 32 rows.
template <typename T>
static void router_logits_rows(const T* x, int64_t t_begin, int64_t t_end, const float* w, int64_t E, int64_t D,
                               float* out) {
  const int64_t chunk = std::max<int64_t>(4, (int64_t{131072} / std::max<int64_t>(1, D * 4)) / 4 * 4);
  if constexpr (sizeof(T) == 2) {
    if (t_end - t_begin >= 4 * chunk) {
      thread_local LineVector<float> wide;
      wide.resize(chunk * D);
      for (int64_t c0 = t_begin; c0 < t_end; c0 += chunk) {
        const int64_t c1 = std::min(t_end, c0 + chunk);
        const T* src = x + c0 * D;
        for (int64_t i = 0; i < (c1 - c0) * D; ++i) wide[i] = to_float(src[i]);
        router_logits_chunk(wide.data() - c0 * D, c0, c1, w, E, D, out);
      }
      return;
    }
  }
  for (int64_t c0 = t_begin; c0 < t_end; c0 += chunk)
    router_logits_chunk(x, c0, std::min(t_end, c0 + chunk), w, E, D, out);
}

// Rotary embedding of n R-wide vectors (rows ldx apart in x, ldo apart in out) with one cos/sin
// [R/2] in fp32, as moe.layers.rope.apply_rotary computes it: x1, x2 = the even and odd entries
// (interleave) or the two halves; out = [x1 c - x2 s | x2 c + x1 s] rounded to T. Not contracted into
// FMAs (PyTorch rounds each product), 16 pairs at a time in GCC vector extensions (each ISA's
// width), the rest one by one: bit-equal to apply_rotary.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
typedef float rope_f32x16 __attribute__((vector_size(64)));
typedef uint32_t rope_u32x16 __attribute__((vector_size(64)));
typedef uint16_t rope_u16x16 __attribute__((vector_size(32)));
static inline rope_f32x16 rope_load(const float* p) {
  rope_f32x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
static inline rope_f32x16 rope_load(const uint16_t* p) {
  rope_u16x16 h;
  std::memcpy(&h, p, sizeof(h));
  return (rope_f32x16)(__builtin_convertvector(h, rope_u32x16) << 16);
}
// pairs (p[2i], p[2i + 1]) for i < 16 -> (evens, odds)
static inline void rope_load_pairs(const float* p, rope_f32x16& even, rope_f32x16& odd) {
  const rope_f32x16 a = rope_load(p), b = rope_load(p + 16);
  even = __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  odd = __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
static inline void rope_load_pairs(const uint16_t* p, rope_f32x16& even, rope_f32x16& odd) {
  rope_u32x16 w;  // word i = (p[2i + 1] << 16) | p[2i]
  std::memcpy(&w, p, sizeof(w));
  even = (rope_f32x16)(w << 16);
  odd = (rope_f32x16)(w & 0xffff0000u);
}
static inline void rope_store(float* p, rope_f32x16 v) { std::memcpy(p, &v, sizeof(v)); }
// store_value's bf16: attention_body.h's round_bf16_v on MOE_W lanes at a time, then the high halves
static inline void rope_store(uint16_t* p, rope_f32x16 v) {
  float* lanes = reinterpret_cast<float*>(&v);
  for (int c = 0; c < 16; c += MOE_W) {
    vxf part;
    std::memcpy(&part, lanes + c, sizeof(part));
    part = round_bf16_v(part);
    std::memcpy(lanes + c, &part, sizeof(part));
  }
  const rope_u16x16 h = __builtin_convertvector((rope_u32x16)v >> 16, rope_u16x16);
  std::memcpy(p, &h, sizeof(h));
}

template <typename T>
static void rope_rows(const T* x, int64_t ldx, int64_t n, const float* cos, const float* sin, int64_t R,
                      bool interleave, T* out, int64_t ldo) {
  const int64_t half = R / 2;
  for (int64_t r = 0; r < n; ++r) {
    const T* xr = x + r * ldx;
    T* o = out + r * ldo;
    int64_t i = 0;
    for (; i + 16 <= half; i += 16) {
      rope_f32x16 x1, x2;
      if (interleave) rope_load_pairs(xr + 2 * i, x1, x2);
      else x1 = rope_load(xr + i), x2 = rope_load(xr + half + i);
      const rope_f32x16 c = rope_load(cos + i), sn = rope_load(sin + i);
      const rope_f32x16 a = x1 * c, b = x2 * sn, cc = x2 * c, d = x1 * sn;
      rope_store(o + i, a - b);
      rope_store(o + half + i, cc + d);
    }
    for (; i < half; ++i) {
      const float x1 = to_float(interleave ? xr[2 * i] : xr[i]), x2 = to_float(interleave ? xr[2 * i + 1] : xr[half + i]);
      const float a = x1 * cos[i], b = x2 * sin[i], c = x2 * cos[i], d = x1 * sin[i];
      store_value(o + i, a - b);
      store_value(o + half + i, c + d);
    }
  }
}

// out[i] = a[i] (fp32, rows lda floats apart) + b[i] (T, rows D apart; null: + nothing) rounded to T as
// store_value rounds, out rows D apart: the fp32 sum, one rounding (the MoE FFN's routed sums plus the
// shared experts' output). 16 columns at a time, then one by one.
template <typename T>
static void add_round_rows(const float* a, int64_t lda, const T* b, T* out, int64_t rows, int64_t D) {
  for (int64_t i = 0; i < rows; ++i) {
    const float* ai = a + i * lda;
    const T* bi = b ? b + i * D : nullptr;
    T* oi = out + i * D;
    int64_t c = 0;
    for (; c + 16 <= D; c += 16) {
      rope_f32x16 v = rope_load(ai + c);
      if (bi) v += rope_load(bi + c);  // bf16 widened exactly
      rope_store(oi + c, v);
    }
    for (; c < D; ++c) store_value(oi + c, bi ? ai[c] + to_float(bi[c]) : ai[c]);
  }
}
#pragma GCC pop_options

// The router's scores of one token: scores[e] = sigmoid(l[e]) = 1 / (1 + e^-l[e]), or softmax over the
// E logits (e^(l[e] - max) / their sum, summed in expert order). e^x: exp_body.h's exp8 (within 2 ulp
// of std::exp) 8 lanes at a time where the ISA has it, std::exp for the rest: the same bits for a
// token whatever the batch.
static inline void route_scores_row(bool sigmoid, const float* l, int64_t E, float* scores) {
  int64_t e = 0;
  if (sigmoid) {
#ifdef MOE_EXP8
    for (; e + 8 <= E; e += 8) {
      const __m256 v = exp8(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_loadu_ps(l + e)));
      _mm256_storeu_ps(scores + e, _mm256_div_ps(_mm256_set1_ps(1.f), _mm256_add_ps(_mm256_set1_ps(1.f), v)));
    }
#endif
    for (; e < E; ++e) scores[e] = 1.f / (1.f + std::exp(-l[e]));
    return;
  }
  // the max in 8 lanes, each starting from l[0] and taking only a strictly larger value (as std::max's
  // chain does: a NaN never taken, a NaN l[0] kept), then across the lanes: the chain's value, up to
  // the sign of a zero max, which l[e] - m does not see. route_topk with softmax scores at T = 4096,
  // top-8, one thread, AMX box, builds alternated: E 64 1.50-1.54 -> 1.14-1.24 ms, E 128 2.60-2.63 ->
  // 1.92 (the one dependent chain of compares was the cost); E < 16 keeps the chain.
  typedef float route_f32x8 __attribute__((vector_size(32), aligned(4)));
  float m = l[0];
  int64_t i = 1;
  if (E >= 16) {
    route_f32x8 lanes = {l[0], l[0], l[0], l[0], l[0], l[0], l[0], l[0]};
    for (i = 0; i + 8 <= E; i += 8) {
      route_f32x8 v;
      std::memcpy(&v, l + i, sizeof(v));
      lanes = v > lanes ? v : lanes;
    }
    for (int j = 0; j < 8; ++j) m = lanes[j] > m ? lanes[j] : m;
  }
  for (; i < E; ++i) m = l[i] > m ? l[i] : m;
#ifdef MOE_EXP8
  for (; e + 8 <= E; e += 8)
    _mm256_storeu_ps(scores + e, exp8(_mm256_sub_ps(_mm256_loadu_ps(l + e), _mm256_set1_ps(m))));
#endif
  for (; e < E; ++e) scores[e] = std::exp(l[e] - m);
  float sum = 0.f;
  for (int64_t i = 0; i < E; ++i) sum += scores[i];
  for (int64_t i = 0; i < E; ++i) scores[i] /= sum;
}

// ids[0, k) = the k largest of sel[0, E), highest first, ties to the lower index (-0 equal to +0, NaN
// below every number). Each value becomes a 64-bit key, its order-preserving bits above ~index, so
// the keys are distinct and their order is that order; then k passes of a branch-free max over 8-lane
// vectors of keys, each clearing the key it took (an insertion pass over the values mispredicted its
// branches: ~500 ns a token at E 64, k 6 on the AMX box). E over 512 goes the scalar way, one pass per
// pick.
typedef uint64_t topk_u64x8 __attribute__((vector_size(64)));
static inline uint64_t topk_key(float v, int64_t e) {
  v += 0.f;  // -0 -> +0
  uint32_t u;
  std::memcpy(&u, &v, 4);
  u = std::isnan(v) ? 0u : (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (uint64_t{u} << 32) | (0xffffffffu - static_cast<uint32_t>(e));
}
static void route_top_ids(const float* sel, int64_t E, int64_t k, int64_t* ids) {
  constexpr int64_t MAX_VECTORS = 64;
  const int64_t nv = (E + 7) / 8;
  if (nv > MAX_VECTORS) {
    thread_local std::vector<uint64_t> keys;  // one allocation per thread, not per token
    keys.resize(E);
    for (int64_t e = 0; e < E; ++e) keys[e] = topk_key(sel[e], e);
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = 0;
      for (int64_t e = 1; e < E; ++e) best = keys[e] > keys[best] ? e : best;
      ids[j] = best;
      keys[best] = 0;
    }
    return;
  }
  topk_u64x8 v[MAX_VECTORS];
  uint64_t* lanes = reinterpret_cast<uint64_t*>(v);
  for (int64_t e = 0; e < E; ++e) lanes[e] = topk_key(sel[e], e);
  for (int64_t e = E; e < nv * 8; ++e) lanes[e] = 0;  // below every key (a key's low half is never 0)
  for (int64_t j = 0; j < k; ++j) {
    topk_u64x8 m = v[0];
    for (int64_t i = 1; i < nv; ++i) m = v[i] > m ? v[i] : m;
    topk_u64x8 s = __builtin_shufflevector(m, m, 4, 5, 6, 7, 0, 1, 2, 3);  // every lane: the max of all 8
    m = s > m ? s : m;
    s = __builtin_shufflevector(m, m, 2, 3, 0, 1, 6, 7, 4, 5);
    m = s > m ? s : m;
    s = __builtin_shufflevector(m, m, 1, 0, 3, 2, 5, 4, 7, 6);
    m = s > m ? s : m;
    ids[j] = static_cast<int64_t>(0xffffffffu - static_cast<uint32_t>(m[0]));
    for (int64_t i = 0; i < nv; ++i) v[i] = v[i] == m ? topk_u64x8{} : v[i];
  }
}

struct NormKernels {
  static void route_scores(bool sigmoid, const float* l, int64_t E, float* scores) {
    route_scores_row(sigmoid, l, E, scores);
  }
  static void route_top(const float* sel, int64_t E, int64_t k, int64_t* ids) { route_top_ids(sel, E, k, ids); }
  static void add_round(bool bf16, const float* a, int64_t lda, const void* b, void* out, int64_t rows, int64_t D) {
    if (bf16)
      add_round_rows(a, lda, static_cast<const uint16_t*>(b), static_cast<uint16_t*>(out), rows, D);
    else
      add_round_rows(a, lda, static_cast<const float*>(b), static_cast<float*>(out), rows, D);
  }
  static void rope(bool bf16, const void* x, int64_t ldx, int64_t n, const float* cos, const float* sin, int64_t R,
                   bool interleave, void* out, int64_t ldo) {
    if (bf16)
      rope_rows(static_cast<const uint16_t*>(x), ldx, n, cos, sin, R, interleave, static_cast<uint16_t*>(out), ldo);
    else
      rope_rows(static_cast<const float*>(x), ldx, n, cos, sin, R, interleave, static_cast<float*>(out), ldo);
  }
  static void router_logits(bool bf16, const void* x, int64_t t_begin, int64_t t_end, const float* w, int64_t E,
                            int64_t D, float* out) {
    if (bf16) router_logits_rows(static_cast<const uint16_t*>(x), t_begin, t_end, w, E, D, out);
    else router_logits_rows(static_cast<const float*>(x), t_begin, t_end, w, E, D, out);
  }
  static void add_rms_norm(bool bf16, const void* x, const void* r, const void* w, void* s, void* out, int64_t rows,
                           int64_t D, float eps) {
    if (bf16)
      add_rms_norm_rows(static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(r),
                        static_cast<const uint16_t*>(w), static_cast<uint16_t*>(s), static_cast<uint16_t*>(out), rows,
                        D, eps);
    else
      add_rms_norm_rows(static_cast<const float*>(x), static_cast<const float*>(r), static_cast<const float*>(w),
                        static_cast<float*>(s), static_cast<float*>(out), rows, D, eps);
  }
  static void rms_norm(bool bf16, const void* x, int64_t ldx, const void* w, void* out, int64_t ldo, int64_t rows,
                       int64_t D, float eps) {
    if (bf16)
      rms_norm_rows(static_cast<const uint16_t*>(x), ldx, static_cast<const uint16_t*>(w), static_cast<uint16_t*>(out),
                    ldo, rows, D, eps);
    else
      rms_norm_rows(static_cast<const float*>(x), ldx, static_cast<const float*>(w), static_cast<float*>(out), ldo, rows,
                    D, eps);
  }
};
