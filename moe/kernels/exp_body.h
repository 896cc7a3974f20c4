// e^x and SwiGLU's silu(g) * u on fp32 lanes with AVX2 + FMA, included inside each x86 namespace
// that has them (avx2, avx512, avx512bf16); defines MOE_EXP8 for the bodies included after it.
#define MOE_EXP8 1

// Lane ops on 8 fp32 lanes (AVX2 + FMA), and with MOE_LANES16 defined before this file (AVX-512
// namespaces) on 16: exp_lanes and silu_mul_lanes below are written once over them, so the 8- and
// 16-lane versions are the same operations lane for lane (the same bits).
static inline __m256 lanes_splat(__m256, float c) { return _mm256_set1_ps(c); }
static inline __m256 lanes_min(__m256 a, __m256 b) { return _mm256_min_ps(a, b); }
static inline __m256 lanes_max(__m256 a, __m256 b) { return _mm256_max_ps(a, b); }
static inline __m256 lanes_add(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
static inline __m256 lanes_sub(__m256 a, __m256 b) { return _mm256_sub_ps(a, b); }
static inline __m256 lanes_mul(__m256 a, __m256 b) { return _mm256_mul_ps(a, b); }
static inline __m256 lanes_div(__m256 a, __m256 b) { return _mm256_div_ps(a, b); }
static inline __m256 lanes_fmadd(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
static inline __m256 lanes_fnmadd(__m256 a, __m256 b, __m256 c) { return _mm256_fnmadd_ps(a, b, c); }
static inline __m256 lanes_round(__m256 x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// 2^n for integral n (fp32 lanes) built in the exponent bits
static inline __m256 lanes_pow2(__m256 n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
#ifdef MOE_LANES16
static inline __m512 lanes_splat(__m512, float c) { return _mm512_set1_ps(c); }
static inline __m512 lanes_min(__m512 a, __m512 b) { return _mm512_min_ps(a, b); }
static inline __m512 lanes_max(__m512 a, __m512 b) { return _mm512_max_ps(a, b); }
static inline __m512 lanes_add(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
static inline __m512 lanes_sub(__m512 a, __m512 b) { return _mm512_sub_ps(a, b); }
static inline __m512 lanes_mul(__m512 a, __m512 b) { return _mm512_mul_ps(a, b); }
static inline __m512 lanes_div(__m512 a, __m512 b) { return _mm512_div_ps(a, b); }
static inline __m512 lanes_fmadd(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
static inline __m512 lanes_fnmadd(__m512 a, __m512 b, __m512 c) { return _mm512_fnmadd_ps(a, b, c); }
static inline __m512 lanes_round(__m512 x) {
  return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
static inline __m512 lanes_pow2(__m512 n) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
#endif

// e^x: Cephes' expf (x = n ln2 + r with ln2 in two parts, a degree-6 polynomial in r, then 2^n
// built in the exponent bits), within 2 ulp of std::exp; x clamped to [-87.3, 88] (2^n normal).
template <typename V>
static inline V exp_lanes(V x) {
  x = lanes_min(lanes_max(x, lanes_splat(x, -87.3f)), lanes_splat(x, 88.f));
  const V n = lanes_round(lanes_mul(x, lanes_splat(x, 1.44269504088896341f)));
  V r = lanes_fnmadd(n, lanes_splat(x, 0.693359375f), x);
  r = lanes_fnmadd(n, lanes_splat(x, -2.12194440e-4f), r);
  V p = lanes_splat(x, 1.9875691500e-4f);
  p = lanes_fmadd(p, r, lanes_splat(x, 1.3981999507e-3f));
  p = lanes_fmadd(p, r, lanes_splat(x, 8.3334519073e-3f));
  p = lanes_fmadd(p, r, lanes_splat(x, 4.1665795894e-2f));
  p = lanes_fmadd(p, r, lanes_splat(x, 1.6666665459e-1f));
  p = lanes_fmadd(p, r, lanes_splat(x, 5.0000001201e-1f));
  p = lanes_fmadd(lanes_mul(p, r), r, lanes_add(r, lanes_splat(x, 1.f)));
  return lanes_mul(p, lanes_pow2(n));
}

// silu(g) * u = g / (1 + e^-g) * u, lane-wise
template <typename V>
static inline V silu_mul_lanes(V g, V u) {
  const V e = exp_lanes(lanes_sub(lanes_splat(g, 0.f), g));
  return lanes_mul(lanes_div(g, lanes_add(lanes_splat(g, 1.f), e)), u);
}
static inline __m256 exp8(__m256 x) { return exp_lanes(x); }
static inline __m256 silu_mul8(__m256 g, __m256 u) { return silu_mul_lanes(g, u); }
