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
  switch (rows) {
    case 1: dot_tile<1, NB>(x, ldx, w, w_stride, K, out); break;
    case 2: dot_tile<2, NB>(x, ldx, w, w_stride, K, out); break;
    case 3: dot_tile<3, NB>(x, ldx, w, w_stride, K, out); break;
    case 4: dot_tile<4, NB>(x, ldx, w, w_stride, K, out); break;
    case 5: dot_tile<5, NB>(x, ldx, w, w_stride, K, out); break;
    case 6: dot_tile<6, NB>(x, ldx, w, w_stride, K, out); break;
    case 7: dot_tile<7, NB>(x, ldx, w, w_stride, K, out); break;
    case 8: dot_tile<8, NB>(x, ldx, w, w_stride, K, out); break;
    case 9: dot_tile<9, NB>(x, ldx, w, w_stride, K, out); break;
    case 10: dot_tile<10, NB>(x, ldx, w, w_stride, K, out); break;
    case 11: dot_tile<11, NB>(x, ldx, w, w_stride, K, out); break;
    case 12: dot_tile<12, NB>(x, ldx, w, w_stride, K, out); break;
    default: break;
  }
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
