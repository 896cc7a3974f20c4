// fp8 (e4m3) cache entries as the kernels read them, compiled once per instruction set.
//
// Included by experts_cpu.cpp inside an ISA namespace, before attention_body.h (whose decode items on
// the FMA path read an fp8 pool's rows through e4m3_row_f32). With MOE_F16C defined (the x86
// namespaces, whose targets take F16C) bytes convert arithmetically where the caller says so (an
// Fp8Read's `arith`, a conversion's caller checking f16c_usable and a finite scale * 2^8); else, and
// in the baseline namespace, through a 256-entry table.

#ifdef MOE_F16C
// Sixteen fp8 bytes s[0:16) times a scale through F16C: byte x's bits moved into a half, ((x & 0x7f)
// << 7) with its sign at bit 15, are e4m3's value times 2^-8 (e4m3's exponent bias is 7, a half's 15,
// and e4m3's subnormals land on the half's), exactly; times sc = scale * 2^8 (finite: the caller
// checks) that is the product c10's value times scale rounds to. NaN bytes (x & 0x7f == 0x7f) become
// half NaNs, which widen to c10's NaN bits (sign | 0x7ff00000). The products of bytes 0-7 go to a, of
// 8-15 to b; returns which bytes are NaNs (16-bit lanes, all ones).
static inline __m256i e4m3_products16(const uint8_t* s, __m256 sc, __m256& a, __m256& b) {
  const __m256i low7 = _mm256_set1_epi16(0x7f), bit14 = _mm256_set1_epi16(0x4000),
                half_nan = _mm256_set1_epi16(0x7c00);
  const __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
  const __m256i nan = _mm256_cmpeq_epi16(_mm256_and_si256(x, low7), low7);
  __m256i h = _mm256_slli_epi16(x, 7);  // the sign lands on bit 14: adding bit 14 to itself moves it to 15
  h = _mm256_or_si256(_mm256_add_epi16(h, _mm256_and_si256(h, bit14)), _mm256_and_si256(nan, half_nan));
  a = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), sc);
  b = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), sc);
  return nan;
}

// c10's round to nearest even of fp32 lanes to bf16, as fp32 lanes whose low 16 bits are zero (NaNs
// aside); a power-of-two scale's products (E4M3_BF16_EXACT) are bf16 values already
template <int Out>
static inline __m256i bf16_rounded8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  if constexpr (Out == E4M3_BF16_EXACT) return u;
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  return _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(u, odd), _mm256_set1_epi32(0x7fff)),
                          _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
}

// fp8 (e4m3) bytes times a scale, in fp32 or rounded to bf16 as c10's conversions round them:
// dst[r * ld + i] = e4m3(src[r * ld + i]) * scale for r < rows, i < n (ld unused for one row), sixteen
// at a time (e4m3_products16). In bf16, NaNs are 0x7fc0 as c10 rounds every NaN. Wide: the bf16 values
// widened back to fp32 (what a decode item reads, e4m3_row_f32), dst fp32.
template <int Out, bool Wide = false>
__attribute__((always_inline)) static inline void e4m3_rows_as(const uint8_t* src, int64_t rows, int64_t n,
                                                              int64_t ld, float scale256, void* dst) {
  const __m256 sc = _mm256_set1_ps(scale256);
  const auto sixteen = [&](const uint8_t* s, void* d) {
    __m256 a, b;
    const __m256i nan = e4m3_products16(s, sc, a, b);
    float* df = static_cast<float*>(d);
    if constexpr (Out == E4M3_F32) {
      _mm256_storeu_ps(df, a), _mm256_storeu_ps(df + 8, b);
    } else if constexpr (Wide) {
      a = _mm256_castsi256_ps(bf16_rounded8<Out>(a)), b = _mm256_castsi256_ps(bf16_rounded8<Out>(b));
      if (!_mm256_testz_si256(nan, nan)) {  // (none in a cache a model wrote)
        const __m256 bf16_nan = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000));
        a = _mm256_blendv_ps(a, bf16_nan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
        b = _mm256_blendv_ps(b, bf16_nan, _mm256_cmp_ps(b, b, _CMP_UNORD_Q));
      }
      _mm256_storeu_ps(df, a), _mm256_storeu_ps(df + 8, b);
    } else {
      const __m256i lo = _mm256_srli_epi32(bf16_rounded8<Out>(a), 16);
      const __m256i hi = _mm256_srli_epi32(bf16_rounded8<Out>(b), 16);
      const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xd8);
      _mm256_storeu_si256(static_cast<__m256i*>(d), _mm256_blendv_epi8(p, _mm256_set1_epi16(0x7fc0), nan));
    }
  };
  constexpr int64_t unit = Out == E4M3_F32 || Wide ? 4 : 2;
  for (int64_t r = 0; r < rows; ++r, src += ld) {
    char* d = static_cast<char*>(dst) + r * ld * unit;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) sixteen(src + i, d + i * unit);
    if (i < n) {  // the last n - i bytes through a zero-padded block of 16
      alignas(32) uint8_t s[16] = {};
      alignas(32) float o[16];
      std::memcpy(s, src + i, n - i);
      sixteen(s, o);
      std::memcpy(d + i * unit, o, (n - i) * unit);
    }
  }
}
static void e4m3_rows(const uint8_t* src, int64_t rows, int64_t n, int64_t ld, float scale256, int out, void* dst) {
  if (out == E4M3_F32) e4m3_rows_as<E4M3_F32>(src, rows, n, ld, scale256, dst);
  else if (out == E4M3_BF16) e4m3_rows_as<E4M3_BF16>(src, rows, n, ld, scale256, dst);
  else e4m3_rows_as<E4M3_BF16_EXACT>(src, rows, n, ld, scale256, dst);
}
#endif

// dst[0:n) = the fp32 values an item reads for fp8 bytes src[0:n) (Fp8Read): through F16C where rd
// says so, else rd's table
__attribute__((always_inline)) static inline void e4m3_row_f32(const uint8_t* src, int64_t n, float* dst,
                                                              const Fp8Read& rd) {
#ifdef MOE_F16C
  if (rd.arith) {
    if (rd.out == E4M3_F32) e4m3_rows_as<E4M3_F32>(src, 1, n, 0, rd.scale256, dst);
    else if (rd.out == E4M3_BF16) e4m3_rows_as<E4M3_BF16, true>(src, 1, n, 0, rd.scale256, dst);
    else e4m3_rows_as<E4M3_BF16_EXACT, true>(src, 1, n, 0, rd.scale256, dst);
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) dst[i] = rd.lut[src[i]];
}
