// e^x and SwiGLU's silu(g) * u on fp32 lanes with AVX2 + FMA, included inside each x86 namespace
// that has them (avx2, avx512, avx512bf16); defines MOE_EXP8 for the bodies included after it.
#define MOE_EXP8 1

// Lane ops on 8 fp32 lanes (AVX2 + FMA), and with MOE_LANES16 defined before this file (AVX-512
// namespaces) on 16: exp_lanes and silu_mul_lanes below are written once over them, so the 8- and
// 16-lane versions are the same operations lane for lane (the same bits). MOE_LANE_OPS makes one
// width's: V the fp32 vector, P the intrinsics' prefix, ROUND the round-to-nearest intrinsic, ALL the
// bit casts' width (256 or 512).
#define MOE_LANE_OPS(V, P, ROUND, ALL)                                                                  \
  static inline V lanes_splat(V, float c) { return P##_set1_ps(c); }                                   \
  static inline V lanes_min(V a, V b) { return P##_min_ps(a, b); }                                     \
  static inline V lanes_max(V a, V b) { return P##_max_ps(a, b); }                                     \
  static inline V lanes_add(V a, V b) { return P##_add_ps(a, b); }                                     \
  static inline V lanes_sub(V a, V b) { return P##_sub_ps(a, b); }                                     \
  static inline V lanes_mul(V a, V b) { return P##_mul_ps(a, b); }                                     \
  static inline V lanes_div(V a, V b) { return P##_div_ps(a, b); }                                     \
  static inline V lanes_fmadd(V a, V b, V c) { return P##_fmadd_ps(a, b, c); }                         \
  static inline V lanes_fnmadd(V a, V b, V c) { return P##_fnmadd_ps(a, b, c); }                       \
  static inline V lanes_round(V x) { return ROUND(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); } \
  /* 2^n for integral n, built in the exponent bits */                                                 \
  static inline V lanes_pow2(V n) {                                                                    \
    return P##_castsi##ALL##_ps(P##_slli_epi32(P##_add_epi32(P##_cvtps_epi32(n), P##_set1_epi32(127)), 23)); \
  }
MOE_LANE_OPS(__m256, _mm256, _mm256_round_ps, 256)
#ifdef MOE_LANES16
MOE_LANE_OPS(__m512, _mm512, _mm512_roundscale_ps, 512)
#endif
#undef MOE_LANE_OPS

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
