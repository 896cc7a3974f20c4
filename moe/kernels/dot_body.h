// Routed-expert and linear tiles on AVX512-BF16's dot product (vdpbf16ps), compiled once, inside
// experts_cpu.cpp's avx512bf16 namespace (target avx512bf16 on top of AVX-512F/BW/VL), with
// PREFETCH_BYTES from the AVX-512 tiles (experts_body.h).
//
// bf16 rows against bf16 weights in k pairs, one vdpbf16ps per (row, pair) adds both
// products of the pair into fp32 (no widening of the weight). Activations enter as bf16: the rows
// of a bf16 model are bf16 already; the SwiGLU activations are rounded once to bf16 between the
// two projections, as the bf16 PyTorch path rounds them.
// acc[r][16j:16j+16] = sum_k x[r * ldx + k] * w_j[k][0:16] for bf16 x rows and NB bf16 pair blocks
// w_j = w + j * w_stride: each broadcast row pair feeds NB dot products (fewer loads per dot).
template <int R, int NB>
static inline void dot_tile(const uint16_t* __restrict x, int64_t ldx, const uint16_t* __restrict w, int64_t w_stride,
                            int64_t K, float* __restrict out) {
  constexpr int KS = R * NB >= 8 ? 1 : 8 / (R * NB);  // >= 8 chains over the dot latency
  __m512 acc[KS][R][NB];
#pragma GCC unroll 8
  for (int s = 0; s < KS; ++s)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
      for (int j = 0; j < NB; ++j) acc[s][r][j] = _mm512_setzero_ps();
  const int64_t pairs = K / 2;
  int64_t p = 0;
  for (; p + KS <= pairs; p += KS) {
#pragma GCC unroll 8
    for (int s = 0; s < KS; ++s) {
      __m512i wv[NB];
#pragma GCC unroll 2
      for (int j = 0; j < NB; ++j) {
        __builtin_prefetch(reinterpret_cast<const char*>(w + j * w_stride + (p + s) * 32) + PREFETCH_BYTES);
        wv[j] = _mm512_loadu_si512(w + j * w_stride + (p + s) * 32);
      }
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, x + r * ldx + 2 * (p + s), 4);
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 2
        for (int j = 0; j < NB; ++j) acc[s][r][j] = _mm512_dpbf16_ps(acc[s][r][j], xb, (__m512bh)wv[j]);
      }
    }
  }
  for (; p < pairs; ++p) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * ldx + 2 * p, 4);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 2
      for (int j = 0; j < NB; ++j)
        acc[0][r][j] = _mm512_dpbf16_ps(acc[0][r][j], xb, (__m512bh)_mm512_loadu_si512(w + j * w_stride + p * 32));
    }
  }
#pragma GCC unroll 8
  for (int s = 1; s < KS; ++s)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
      for (int j = 0; j < NB; ++j) acc[0][r][j] = _mm512_add_ps(acc[0][r][j], acc[s][r][j]);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int j = 0; j < NB; ++j) _mm512_storeu_ps(out + (r * NB + j) * 16, acc[0][r][j]);
}

// Rows per tile: 12 x 2 accumulators + two weights and a broadcast fit AVX-512's 32 registers.
constexpr int DOT_TILE_ROWS = 12;

template <int NB>
static void dot_tile_rows(int64_t rows, const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t w_stride,
                          int64_t K, float* out) {
  with_row_count<DOT_TILE_ROWS>(rows, [&](auto r) { dot_tile<decltype(r)::value, NB>(x, ldx, w, w_stride, K, out); });
}

// tiles_over_rows for bf16 rows and nb (1 or 2) blocks w, w + w_stride: epilogue(row, block j,
// acc[16]) for rows [0, n) of x ([n, K] bf16).
template <typename Epilogue>
static inline void dot_tiles_over_rows(const uint16_t* x, int64_t n, int64_t K, const uint16_t* w, int nb,
                                       int64_t w_stride, Epilogue&& epilogue) {
  alignas(64) float buf[DOT_TILE_ROWS * 2 * 16];
  for (int64_t r0 = 0; r0 < n; r0 += DOT_TILE_ROWS) {
    const int64_t rows = std::min<int64_t>(DOT_TILE_ROWS, n - r0);
    if (nb == 2) dot_tile_rows<2>(rows, x + r0 * K, K, w, w_stride, K, buf);
    else dot_tile_rows<1>(rows, x + r0 * K, K, w, w_stride, K, buf);
    for (int64_t r = 0; r < rows; ++r)
      for (int j = 0; j < nb; ++j) epilogue(r0 + r, j, buf + (r * nb + j) * 16);
  }
}

// e^x for 8 fp32 lanes: Cephes' expf (x = n ln2 + r with ln2 in two parts, a degree-6 polynomial in
// r, then 2^n by scalef), within 2 ulp of std::exp; x clamped to [-88, 88].
static inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.f)), _mm256_set1_ps(88.f));
  const __m256 n = _mm256_roundscale_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  return _mm256_scalef_ps(p, n);
}

// 8 fp32 -> 8 bf16 (round to nearest even) at dst
static inline void store_bf16x8(uint16_t* dst, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), (__m128i)_mm256_cvtneps_pbh(v));
}

// Each op covers nb (1 or 2) neighbouring column blocks, w_stride elements apart.
struct DotKernels {
  // act[row, 8b:8b+8] = bf16(silu(gate) * up) for rows [0, n) and blocks b, b + 1 (nb == 2; act
  // columns 8 further): x [n, D] bf16, w the [D/2][16][2] block.
  static void gate_up(const uint16_t* x, int64_t n, int64_t D, const uint16_t* w, int nb, int64_t w_stride,
                      uint16_t* act, int64_t ld_act) {
    dot_tiles_over_rows(x, n, D, w, nb, w_stride, [&](int64_t row, int j, const float* acc) {
      const __m256 g = _mm256_loadu_ps(acc), u = _mm256_loadu_ps(acc + 8);
      const __m256 one = _mm256_set1_ps(1.f);
      const __m256 silu_g = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
      store_bf16x8(act + row * ld_act + 8 * j, _mm256_mul_ps(silu_g, u));
    });
  }
  // out[row, 16b:16b+16] = row_weight[row] * (act[row] @ block) (and block b + 1 at 16 columns on):
  // act [n, I] bf16.
  template <typename OT>
  static void down(const uint16_t* act, int64_t n, int64_t I, const uint16_t* w, int nb, int64_t w_stride,
                   const float* row_weight, OT* out, int64_t ld_out) {
    dot_tiles_over_rows(act, n, I, w, nb, w_stride, [&](int64_t row, int j, const float* acc) {
      const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(acc), _mm512_set1_ps(row_weight ? row_weight[row] : 1.f));
      OT* dst = out + row * ld_out + 16 * j;
      if constexpr (sizeof(OT) == 2)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(v));
      else
        _mm512_storeu_ps(reinterpret_cast<float*>(dst), v);
    });
  }
  // out[row, 0:ncols] = x[row] @ block (+ bias): x [n, K] bf16; one block.
  template <typename OT>
  static void linear(const uint16_t* x, int64_t n, int64_t K, const uint16_t* w, const float* bias, int64_t ncols,
                     OT* out, int64_t ld_out) {
    dot_tiles_over_rows(x, n, K, w, 1, 0, [&](int64_t row, int, const float* acc) {
      OT* dst = out + row * ld_out;
      for (int64_t c = 0; c < ncols; ++c) store_value(dst + c, acc[c] + (bias ? bias[c] : 0.f));
    });
  }
};

// Paged decode attention on the dot product (attention_body.h's passes, bf16 cache and queries):
// scores q . key over dk in 32-wide bf16 steps (tail lanes masked to zero), the AVX-512 softmax with
// its bf16 roundings, then o = p v over token pairs: two value rows interleaved into (t, t + 1)
// pairs per column (vpermt2w) feed every head's dot product. Values equal to those of the FMA
// path up to the order of the fp32 sums.

// s[h * lds + t] = q[h] . key[t] for TT tokens (rows k[t]) x HH heads over dk columns.
template <int TT, int HH>
static inline void attn_dot_tile_bf16(const uint16_t* __restrict q, int64_t ldq, const uint16_t* const* k, int64_t dk,
                                      float* __restrict out, int64_t ldo) {
  __m512 acc[TT][HH];
#pragma GCC unroll 4
  for (int t = 0; t < TT; ++t)
#pragma GCC unroll 4
    for (int h = 0; h < HH; ++h) acc[t][h] = _mm512_setzero_ps();
  for (int64_t c = 0; c < dk; c += 32) {
    const __mmask32 m = dk - c >= 32 ? ~__mmask32{0} : (__mmask32{1} << (dk - c)) - 1;
    __m512i kv[TT];
#pragma GCC unroll 4
    for (int t = 0; t < TT; ++t) kv[t] = _mm512_maskz_loadu_epi16(m, k[t] + c);
#pragma GCC unroll 4
    for (int h = 0; h < HH; ++h) {
      const __m512bh qv = (__m512bh)_mm512_maskz_loadu_epi16(m, q + h * ldq + c);
#pragma GCC unroll 4
      for (int t = 0; t < TT; ++t) acc[t][h] = _mm512_dpbf16_ps(acc[t][h], qv, (__m512bh)kv[t]);
    }
  }
  for (int t = 0; t < TT; ++t)
    for (int h = 0; h < HH; ++h) out[h * ldo + t] = _mm512_reduce_add_ps(acc[t][h]);
}

template <int TT>
static inline void attn_dot_heads_bf16(int64_t hh, const uint16_t* q, int64_t ldq, const uint16_t* const* k,
                                       int64_t dk, float* out, int64_t ldo) {
  int64_t h = 0;
  for (; h + 4 <= hh; h += 4) attn_dot_tile_bf16<TT, 4>(q + h * ldq, ldq, k, dk, out + h * ldo, ldo);
  switch (hh - h) {
    case 1: attn_dot_tile_bf16<TT, 1>(q + h * ldq, ldq, k, dk, out + h * ldo, ldo); break;
    case 2: attn_dot_tile_bf16<TT, 2>(q + h * ldq, ldq, k, dk, out + h * ldo, ldo); break;
    case 3: attn_dot_tile_bf16<TT, 3>(q + h * ldq, ldq, k, dk, out + h * ldo, ldo); break;
    default: break;
  }
}

// o[h * ldo + c0 : + 32] = sum over token pairs of p pairs [h][pair] (bf16, 32 bits each) x the
// interleaved value pairs, for HH heads; v[t] the value rows (v[L] a zero row when L is odd).
template <int HH>
static inline void attn_pv_tile_bf16(const uint32_t* __restrict p, int64_t ldp, int64_t pairs,
                                     const uint16_t* const* v, int64_t c0, int64_t dv, float* __restrict o,
                                     int64_t ldo) {
  const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                          37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
  const __mmask32 m = dv - c0 >= 32 ? ~__mmask32{0} : (__mmask32{1} << (dv - c0)) - 1;
  __m512 acc[HH][2];
#pragma GCC unroll 12
  for (int h = 0; h < HH; ++h) acc[h][0] = acc[h][1] = _mm512_setzero_ps();
  for (int64_t j = 0; j < pairs; ++j) {
    const __m512i a = _mm512_maskz_loadu_epi16(m, v[2 * j] + c0), b = _mm512_maskz_loadu_epi16(m, v[2 * j + 1] + c0);
    const __m512bh lo = (__m512bh)_mm512_permutex2var_epi16(a, lo_idx, b);  // columns c0..c0+15, (t, t+1)
    const __m512bh hi = (__m512bh)_mm512_permutex2var_epi16(a, hi_idx, b);  // columns c0+16..c0+31
#pragma GCC unroll 12
    for (int h = 0; h < HH; ++h) {
      const __m512bh pb = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(p[h * ldp + j]));
      acc[h][0] = _mm512_dpbf16_ps(acc[h][0], pb, lo);
      acc[h][1] = _mm512_dpbf16_ps(acc[h][1], pb, hi);
    }
  }
  const int64_t n = std::min<int64_t>(32, dv - c0);
#pragma GCC unroll 12
  for (int h = 0; h < HH; ++h) {
    if (n == 32) {
      _mm512_storeu_ps(o + h * ldo + c0, acc[h][0]);
      _mm512_storeu_ps(o + h * ldo + c0 + 16, acc[h][1]);
    } else {
      alignas(64) float buf[32];
      _mm512_store_ps(buf, acc[h][0]);
      _mm512_store_ps(buf + 16, acc[h][1]);
      std::memcpy(o + h * ldo + c0, buf, n * sizeof(float));
    }
  }
}

template <int HH>
static inline void attn_pv_heads_bf16(const uint32_t* p, int64_t ldp, int64_t pairs, const uint16_t* const* v,
                                      int64_t dv, float* o, int64_t ldo) {
  for (int64_t c0 = 0; c0 < dv; c0 += 32) attn_pv_tile_bf16<HH>(p, ldp, pairs, v, c0, dv, o, ldo);
}

struct AttentionDotKernels {
  // One (sequence, kv head, query heads [0, hh)) item on a bf16 cache: q [hh, dk] bf16 rows; scores
  // [hh, L] fp32 scratch; pbuf [hh, L + 1] bf16 scratch; rows [2 (L + 1)] row pointers scratch; zero
  // a row of dv zeros; o [hh, dv] fp32 output. Scores and probabilities rounded to bf16.
  static void decode(const uint16_t* q, int64_t hh, const uint16_t* pool, int64_t S, const PagedHead& head,
                     const int64_t* table, int64_t L, float scale, float* scores, uint16_t* pbuf,
                     const uint16_t** rows, const uint16_t* zero, float* o) {
    const int64_t dk = head.dk, dv = head.dv, stride = head.token_stride;
    const uint16_t** krow = rows;
    const uint16_t** vrow = rows + L + 1;
    for (int64_t t = 0; t < L; ++t) {
      const uint16_t* tok = pool + (table[t / S] * S + t % S) * stride;
      krow[t] = tok + head.k_off;
      vrow[t] = tok + head.v_off;
    }
    vrow[L] = zero;  // the odd token's partner (probability 0)
    // rows a few tokens ahead are asked for while these are computed: blocks sit wherever the block
    // table puts them, so the hardware prefetcher cannot run ahead across them
    constexpr int64_t AHEAD = 6;
    const int64_t row_bytes = dk * static_cast<int64_t>(sizeof(uint16_t));
    for (int64_t t = 0; t < std::min(AHEAD, L); ++t)
      for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(reinterpret_cast<const char*>(krow[t]) + b);
    int64_t t = 0;
    for (; t + 3 <= L; t += 3) {
      for (int64_t a = t + AHEAD; a < std::min(t + AHEAD + 3, L); ++a)
        for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(reinterpret_cast<const char*>(krow[a]) + b);
      attn_dot_heads_bf16<3>(hh, q, dk, krow + t, dk, scores + t, L);
    }
    for (; t < L; ++t) attn_dot_heads_bf16<1>(hh, q, dk, krow + t, dk, scores + t, L);
    const int64_t pairs = (L + 1) / 2, ldp = 2 * pairs;
    for (int64_t h = 0; h < hh; ++h) {
      float* s = scores + h * L;
      avx512::attn_softmax(s, L, scale, true);  // probabilities rounded to bf16: the top halves are exact
      uint16_t* ph = pbuf + h * ldp;
      for (int64_t i = 0; i < L; ++i) {
        uint32_t u;
        std::memcpy(&u, s + i, 4);
        ph[i] = static_cast<uint16_t>(u >> 16);
      }
      if (L % 2) ph[L] = 0;
    }
    const uint32_t* pp = reinterpret_cast<const uint32_t*>(pbuf);
    int64_t h = 0;
    for (; h + 12 <= hh; h += 12) attn_pv_heads_bf16<12>(pp + h * pairs, pairs, pairs, vrow, dv, o + h * dv, dv);
    for (; h + 4 <= hh; h += 4) attn_pv_heads_bf16<4>(pp + h * pairs, pairs, pairs, vrow, dv, o + h * dv, dv);
    for (; h < hh; ++h) attn_pv_heads_bf16<1>(pp + h * pairs, pairs, pairs, vrow, dv, o + h * dv, dv);
  }
};
