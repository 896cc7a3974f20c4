// Routed-expert and linear tiles on AVX512-BF16's dot product (vdpbf16ps), compiled once, inside
// experts_cpu.cpp's avx512bf16 namespace (target avx512bf16 on top of AVX-512F/BW/VL), with
// PREFETCH_BYTES from the AVX-512 tiles (experts_body.h) for one-row tiles.
//
// bf16 rows against bf16 weights in k pairs, one vdpbf16ps per (row, pair) adds both
// products of the pair into fp32 (no widening of the weight). Activations enter as bf16: the rows
// of a bf16 model are bf16 already; the SwiGLU activations are rounded once to bf16 between the
// two projections, as the bf16 PyTorch path rounds them.
// acc[r][16j:16j+16] = sum_k x[r * ldx + k] * w_j[k][0:16] for bf16 x rows and NB bf16 pair blocks
// w_j = w + j * w_stride: each broadcast row pair feeds NB dot products (fewer loads per dot).
// Each weight line loaded comes with one prefetch: dot_prefetch_bytes(R) further along w's blocks
// (PF: the prefetch's locality, 3 into L1, 2 into L2, 0 none), or with NEXT the same line of the
// blocks at ``next`` into L2 (see dot_tiles_over_rows).
//
// How far ahead: PREFETCH_BYTES (2 KB) for one-row tiles, 8 KB for tiles of two rows or more. Zen 5,
// the small DeepSeek-style checkpoint's decode steps, the distance switched step by step in one
// process (a scratch build; us per layer, medians): batch 32 routed experts 2624 -> 2385 (the
// gate/up phase ~1.2x faster), batch 8 the MLA attention op 480 -> 422 and the dense MLP 703 -> 532,
// while batch 1 (one-row tiles everywhere) took 2-3 % longer at 8 KB than at 2 KB; 16 KB was no
// better than 8 KB. Prefill-size experts and linears (T = 512, 4096) were unchanged or faster.
//
// Whether tiles that stream their weights from DRAM prefetch at all, into which cache, and whether
// they read a block pair side by side, is this CPU's, measured for each class of row counts, block
// pairs and single blocks apart (stream_tile's mode, from tile_mode_seconds' probe). On AMD Zen 4
// (EPYC, family 25 model 17) a block pair read side by side streams at 22-27 GB/s whatever the rows,
// one block after the other at 30-35 (one and two rows without prefetches, more rows prefetched into
// L2); single blocks of 5-12 rows (routed experts at batch 32) prefetching into L1 streamed at 12-21
// GB/s, into L2 at 16-27, and the small DeepSeek-style checkpoint's decode step took 0.74-0.77x the
// time at batch 1 without the one-row prefetches.
constexpr int64_t DOT_PREFETCH_BYTES_ROWS = 8192;
template <int R>
constexpr int64_t dot_prefetch_bytes() {
  return R == 1 ? PREFETCH_BYTES : DOT_PREFETCH_BYTES_ROWS;
}

// The partial sums per accumulator of an R-row tile over NB blocks: >= 8 chains over the dot latency.
template <int R, int NB>
constexpr int dot_partial_sums() {
  return R * NB >= 8 ? 1 : 8 / (R * NB);
}

// KS_: the partial sums per accumulator where not the default (dot_partial_sums); the sums' order, so
// the bits, follow KS alone: a one-block tile with KS_ = dot_partial_sums<R, 2>() gives each block the
// bits the two-block tile of R rows gives it.
// out: row r's NB blocks at out + r * ldo.
template <int R, int NB, bool NEXT = false, int PF = 3, int KS_ = 0>
static inline void dot_tile(const uint16_t* __restrict x, int64_t ldx, const uint16_t* __restrict w, int64_t w_stride,
                            int64_t K, float* __restrict out, const uint16_t* next = nullptr, int64_t ldo = NB * 16) {
  constexpr int KS = KS_ > 0 ? KS_ : dot_partial_sums<R, NB>();
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
        if constexpr (NEXT)
          __builtin_prefetch(next + j * w_stride + (p + s) * 32, 0, 2);
        else if constexpr (PF > 0)
          __builtin_prefetch(reinterpret_cast<const char*>(w + j * w_stride + (p + s) * 32) + dot_prefetch_bytes<R>(),
                             0, PF);
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
    for (int j = 0; j < NB; ++j) _mm512_storeu_ps(out + r * ldo + j * 16, acc[0][r][j]);
}

// Rows per tile: 12 x 2 accumulators + two weights and a broadcast fit AVX-512's 32 registers.
constexpr int DOT_TILE_ROWS = 12;
static_assert(DOT_TILE_ROWS == DOT_TILE_MAX_ROWS, "tile_mode_seconds' check takes DOT_TILE_MAX_ROWS rows");

// R rows against NB blocks as the tile ``mode`` runs them (TILE_* bits, experts_cpu.cpp): prefetched
// into L1, into L2 or not at all, and with TILE_ONE_STREAM a block pair one block after the other
// (one sequential stream of weights) instead of side by side. Each block in one stream keeps the
// pair tile's partial sums (dot_tile's KS_), so every mode gives the same bits.
template <int R, int NB, int PF>
static inline void stream_tile_pf(bool one_stream, const uint16_t* x, int64_t ldx, const uint16_t* w,
                                  int64_t w_stride, int64_t K, float* out) {
  if constexpr (NB == 2) {
    if (one_stream) {
      constexpr int KS = dot_partial_sums<R, 2>();
      dot_tile<R, 1, false, PF, KS>(x, ldx, w, 0, K, out, nullptr, 32);
      dot_tile<R, 1, false, PF, KS>(x, ldx, w + w_stride, 0, K, out + 16, nullptr, 32);
      return;
    }
  }
  dot_tile<R, NB, false, PF>(x, ldx, w, w_stride, K, out);
}

template <int R, int NB>
static inline void stream_tile(int mode, const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t w_stride,
                               int64_t K, float* out) {
  const bool one_stream = mode & TILE_ONE_STREAM;
  if (!(mode & TILE_PREFETCH)) stream_tile_pf<R, NB, 0>(one_stream, x, ldx, w, w_stride, K, out);
  else if (mode & TILE_PREFETCH_L2) stream_tile_pf<R, NB, 2>(one_stream, x, ldx, w, w_stride, K, out);
  else stream_tile_pf<R, NB, 3>(one_stream, x, ldx, w, w_stride, K, out);
}

// Rows' tiles against NB blocks. The tiles that stream the blocks from DRAM (not NEXT) run as their
// row count's mode says (tile_mode_slot); the default mode (side by side, prefetched into L1) is the
// tile as it was before the modes.
template <int NB, bool NEXT = false>
static void dot_tile_rows(int64_t rows, const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t w_stride,
                          int64_t K, float* out, const uint16_t* next = nullptr) {
  if constexpr (!NEXT) {
    const int mode = tile_mode_slot(rows, NB);
    if (mode != TILE_PREFETCH) {
      with_row_count<DOT_TILE_ROWS>(
          rows, [&](auto r) { stream_tile<decltype(r)::value, NB>(mode, x, ldx, w, w_stride, K, out); });
      return;
    }
  }
  with_row_count<DOT_TILE_ROWS>(
      rows, [&](auto r) { dot_tile<decltype(r)::value, NB, NEXT>(x, ldx, w, w_stride, K, out, next); });
}

// tiles_over_rows for bf16 rows and nb (1 or 2) blocks w, w + w_stride: epilogue(row, block j,
// acc[16]) for rows [0, n) of x ([n, K] bf16, rows ldx elements apart: K unless given);
// before(row0, rows, j) ahead of each tile.
//
// The first row tile streams the blocks from DRAM, the later ones find them in L2. The second tile
// therefore prefetches, line for line, the nb blocks that follow (w + nb * w_stride: the next work
// item's in the packed order, column blocks innermost, then the next expert's) into L2, so the next
// item's first tile starts on L2 instead of DRAM. Prefetching past a tensor's end is harmless.
template <typename Epilogue, typename Before = NoTileStart>
static inline void dot_tiles_over_rows(const uint16_t* x, int64_t n, int64_t K, const uint16_t* w, int nb,
                                       int64_t w_stride, Epilogue&& epilogue, Before&& before = Before{},
                                       int64_t ldx = 0) {
  alignas(64) float buf[DOT_TILE_ROWS * 2 * 16];
  const uint16_t* next = w + nb * w_stride;
  if (ldx == 0) ldx = K;
  for (int64_t r0 = 0; r0 < n; r0 += DOT_TILE_ROWS) {
    const int64_t rows = std::min<int64_t>(DOT_TILE_ROWS, n - r0);
    for (int j = 0; j < nb; ++j) before(r0, rows, j);
    const bool ahead = r0 == DOT_TILE_ROWS;
    if (nb == 2) {
      if (ahead) dot_tile_rows<2, true>(rows, x + r0 * ldx, ldx, w, w_stride, K, buf, next);
      else dot_tile_rows<2>(rows, x + r0 * ldx, ldx, w, w_stride, K, buf);
    } else {
      if (ahead) dot_tile_rows<1, true>(rows, x + r0 * ldx, ldx, w, w_stride, K, buf, next);
      else dot_tile_rows<1>(rows, x + r0 * ldx, ldx, w, w_stride, K, buf);
    }
    if constexpr (HasPairEpilogue<std::decay_t<Epilogue>>::value) {
      if (nb == 2) {
        for (int64_t r = 0; r < rows; ++r) epilogue.pair(r0 + r, 0, buf + r * 32);
        continue;
      }
    }
    for (int64_t r = 0; r < rows; ++r)
      for (int j = 0; j < nb; ++j) epilogue(r0 + r, j, buf + (r * nb + j) * 16);
  }
}

// 8 fp32 -> 8 bf16 (round to nearest even) at dst
static inline void store_bf16x8(uint16_t* dst, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), (__m128i)_mm256_cvtneps_pbh(v));
}

// bf16 rounding (nearest even) of 16 fp32 lanes, NaN kept NaN: the FMA path's round_bf16_v.
static inline __m512i round_bf16_lanes(__m512 x) {
  avx512::vxf v;
  std::memcpy(&v, &x, sizeof(v));
  v = avx512::round_bf16_v(v);
  __m512i r;
  std::memcpy(&r, &v, sizeof(r));
  return r;
}

// 16 fp32 lanes -> 16 bf16 at dst, rounded as store_value rounds (nearest even; NaN -> 0x7fc0), the
// first n <= 16 written.
static inline void store_bf16_lanes(uint16_t* dst, __m512 x, int64_t n) {
  const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_bf16_lanes(x), 16));
  if (n == 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), h);
  else _mm256_mask_storeu_epi16(dst, static_cast<__mmask16>((uint32_t{1} << n) - 1), h);
}

// bf16(q * scale) of nb int8 blocks (block[k][16], blocks K * 16 apart; scale: 16 fp32 per block, 16
// apart) in the bf16 block order (block[k/2][16][2], K even): the values kernels.dequantize_int8 gives
// in bf16 (the product in fp32, rounded to nearest even by vcvtne2ps2bf16, which also flushes products
// below 2^-126 to zero: only in channels whose weights are all that small), which int8 experts
// multiply on the bf16 tiles.
static void dequant_int8_blocks(const int8_t* q, const float* scale, int64_t nb, int64_t K, uint16_t* out) {
  alignas(64) int16_t order[32];  // [even k's 16 columns | odd k's] -> column pairs (even, odd)
  for (int c = 0; c < 16; ++c) order[2 * c] = static_cast<int16_t>(c), order[2 * c + 1] = static_cast<int16_t>(16 + c);
  const __m512i pairs = _mm512_load_si512(order);
  for (int64_t b = 0; b < nb; ++b) {
    const __m512 s = _mm512_loadu_ps(scale + 16 * b);
    const int8_t* qb = q + b * K * 16;
    uint16_t* ob = out + b * K * 16;
    auto row = [&](int64_t k) {  // 16 columns of k row, scaled
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qb + k * 16));
      return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)), s);
    };
    for (int64_t p = 0; p < K / 2; ++p) {
      const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(row(2 * p + 1), row(2 * p));
      _mm512_storeu_si512(ob + p * 32, _mm512_permutexvar_epi16(pairs, both));
    }
  }
}

// The vdpbf16ps register tiles as DotKernelsOf's row loop: nb blocks two at a time (the last alone
// when nb is odd), each pair over all the rows, as that many calls of nb <= 2 would run them.
struct VdpTiles {
  template <typename Epilogue, typename Before = NoTileStart>
  static void over_rows(const uint16_t* x, int64_t n, int64_t K, const uint16_t* w, int nb, int64_t w_stride,
                        Epilogue&& epilogue, Before&& before = Before{}, int64_t ldx = 0) {
    if (nb <= 2) {
      dot_tiles_over_rows(x, n, K, w, nb, w_stride, epilogue, before, ldx);
      return;
    }
    for (int jb = 0; jb < nb; jb += 2) {
      auto start = [&](int64_t r0, int64_t rows, int j) { before(r0, rows, jb + j); };
      if constexpr (HasPairEpilogue<std::decay_t<Epilogue>>::value)
        dot_tiles_over_rows(x, n, K, w + jb * w_stride, std::min(2, nb - jb), w_stride,
                            BlocksFrom<std::decay_t<Epilogue>>{epilogue, jb}, start, ldx);
      else
        dot_tiles_over_rows(x, n, K, w + jb * w_stride, std::min(2, nb - jb), w_stride,
                            [&](int64_t row, int j, const float* acc) { epilogue(row, jb + j, acc); }, start, ldx);
    }
  }
  // an epilogue with pair(), its blocks counted from jb
  template <typename E>
  struct BlocksFrom {
    const E& e;
    int jb;
    void operator()(int64_t row, int j, const float* acc) const { e(row, jb + j, acc); }
    void pair(int64_t row, int j, const float* acc) const { e.pair(row, jb + j, acc); }
  };
};

// gate_up's epilogue: act[row, 8j:8j+8] = bf16(silu(gate) * up) from a block's 16 accumulated columns
// (8 gate channels, then their 8 up channels); pair() takes blocks j and j + 1 of a row in one pass of
// 16 lanes (the same bits: half the instructions of two 8-lane passes, which ran beside the tile
// products in the issue slots those left free).
struct SwiGluRows {
  uint16_t* act;
  int64_t ld;
  void operator()(int64_t row, int j, const float* acc) const {
    store_bf16x8(act + row * ld + 8 * j, silu_mul8(_mm256_loadu_ps(acc), _mm256_loadu_ps(acc + 8)));
  }
  void pair(int64_t row, int j, const float* acc) const {
    const __m512 a = _mm512_loadu_ps(acc), b = _mm512_loadu_ps(acc + 16);  // [g_j u_j], [g_j+1 u_j+1]
    const __m512i gates = _mm512_set_epi32(23, 22, 21, 20, 19, 18, 17, 16, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i ups = _mm512_add_epi32(gates, _mm512_set1_epi32(8));
    const __m512 v = silu_mul_lanes(_mm512_permutex2var_ps(a, gates, b), _mm512_permutex2var_ps(a, ups, b));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(act + row * ld + 8 * j), (__m256i)_mm512_cvtneps_pbh(v));
  }
};

// The bf16 x bf16 ops on a row loop Tiles::over_rows (dot_tiles_over_rows' contract: epilogue(row,
// block j, acc[16]) for every row and block), with their epilogues: VdpTiles here, the AMX tiles
// (amx_body.h) on CPUs with AMX. Each op covers nb neighbouring column blocks, w_stride elements
// apart (more than two: two at a time, the last alone when nb is odd).
template <typename Tiles>
struct DotKernelsOf {
  // act[row, 8b:8b+8] = bf16(silu(gate) * up) for rows [0, n) and blocks b, b + 1 (nb == 2; act
  // columns 8 further): x [n, D] bf16 (rows ldx elements apart), w the [D/2][16][2] block.
  // first_panel: the expert's first rows, whose passes bring its weights in (StreamNextBlocks).
  static void gate_up(const uint16_t* x, int64_t n, int64_t D, int64_t ldx, const uint16_t* w, int nb,
                      int64_t w_stride, uint16_t* act, int64_t ld_act, bool first_panel) {
    if (first_panel) Tiles::over_rows(x, n, D, w, nb, w_stride, SwiGluRows{act, ld_act}, StreamNextBlocks{}, ldx);
    else Tiles::over_rows(x, n, D, w, nb, w_stride, SwiGluRows{act, ld_act}, NoTileStart{}, ldx);
  }
  // out[row, 16b:16b+16] = row_weight[row] * (act[row] @ block) (and block b + 1 at 16 columns on):
  // act [n, I] bf16, rows ld_act elements apart.
  template <typename OT>
  static void down(const uint16_t* act, int64_t n, int64_t I, int64_t ld_act, const uint16_t* w, int nb,
                   int64_t w_stride, const float* row_weight, OT* out, int64_t ld_out) {
    Tiles::over_rows(act, n, I, w, nb, w_stride, [&](int64_t row, int j, const float* acc) {
      const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(acc), _mm512_set1_ps(row_weight ? row_weight[row] : 1.f));
      OT* dst = out + row * ld_out + 16 * j;
      if constexpr (sizeof(OT) == 2)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(v));
      else
        _mm512_storeu_ps(reinterpret_cast<float*>(dst), v);
    }, NoTileStart{}, ld_act);
  }
  // down's rows added into fp32 output rows: out[out_rows[row], 16b:16b+16] += the product
  // (rounded to fp32 first, see add_rounded16). Rows with first[row] set (first: null for none) are
  // their output row's first: 0 + the product is stored without reading the row (the bits of adding
  // it to zeros: -0 becomes +0), so the output need not be zeroed first.
  static void down_add(const uint16_t* act, int64_t n, int64_t I, int64_t ld_act, const uint16_t* w, int nb,
                       int64_t w_stride, const float* row_weight, const int64_t* out_rows, float* out,
                       int64_t ld_out, const uint8_t* first) {
    Tiles::over_rows(act, n, I, w, nb, w_stride, AddRows{row_weight, out_rows, out, ld_out, first},
                     OutRowPrefetch{out_rows, out, ld_out}, ld_act);
  }
  // down_add's epilogue; pair() takes a row's blocks j and j + 1 (32 columns) at once
  struct AddRows {
    const float* row_weight;
    const int64_t* out_rows;
    float* out;
    int64_t ld_out;
    const uint8_t* first;
    template <int NB>
    void add(int64_t row, int j, const float* acc) const {
      const __m512 rw = _mm512_set1_ps(row_weight ? row_weight[row] : 1.f);
      alignas(64) float v[16 * NB];
      for (int b = 0; b < NB; ++b) _mm512_store_ps(v + 16 * b, _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * b), rw));
      float* dst = out + out_rows[row] * ld_out + 16 * j;
      if (first && first[row]) {  // 0 + v through add_rounded16 (v unfused with the product), then stored
        alignas(64) float sum[16 * NB] = {};
        for (int b = 0; b < NB; ++b) add_rounded16(sum + 16 * b, v + 16 * b);
        std::memcpy(dst, sum, sizeof(sum));
        return;
      }
      for (int b = 0; b < NB; ++b) add_rounded16(dst + 16 * b, v + 16 * b);
    }
    void operator()(int64_t row, int j, const float* acc) const { add<1>(row, j, acc); }
    void pair(int64_t row, int j, const float* acc) const { add<2>(row, j, acc); }
  };
  // The layer's last term and its rounding in one: out[row, 16b:16b+16] (bf16) = bf16(sums[row,
  // 16b:16b+16] + bf16(act[row] @ block)), the product rounded as down<uint16_t> rounds it (its
  // output widened exactly), the sum as add_round rounds it (store_value's rule): the values of
  // down_bf16's rows added to fp32 sums by add_round, without the bf16 rows in between. sums: fp32
  // rows ld_sums apart; out rows ld_out apart.
  static void down_final(const uint16_t* act, int64_t n, int64_t I, int64_t ld_act, const uint16_t* w, int nb,
                         int64_t w_stride, const float* sums, int64_t ld_sums, uint16_t* out, int64_t ld_out) {
    Tiles::over_rows(act, n, I, w, nb, w_stride, [&](int64_t row, int j, const float* acc) {
      const __m256i p = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(acc), _mm512_set1_ps(1.f)));
      const __m512 wide = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(p), 16));
      const __m512 v = _mm512_add_ps(_mm512_loadu_ps(sums + row * ld_sums + 16 * j), wide);
      store_bf16_lanes(out + row * ld_out + 16 * j, v, 16);
    }, SumRowPrefetch{sums, ld_sums}, ld_act);
  }
  // out[row, 0:ncols] = x[row] @ blocks (+ bias): x [n, K] bf16, rows ldx elements apart; nb
  // neighbouring [K/2][16][2] blocks (K * 16 elements apart), ncols <= 16 * nb of their columns.
  template <typename OT>
  static void linear(const uint16_t* x, int64_t n, int64_t K, int64_t ldx, const uint16_t* w, int nb,
                     const float* bias, int64_t ncols, OT* out, int64_t ld_out) {
    Tiles::over_rows(x, n, K, w, nb, K * 16, [&](int64_t row, int j, const float* acc) {
      OT* dst = out + row * ld_out + 16 * j;
      const int64_t cols = std::min<int64_t>(16, ncols - 16 * j);
      const __mmask16 live = static_cast<__mmask16>((uint32_t{1} << cols) - 1);
      // acc + bias (or + 0, as the scalar rule did: -0 becomes +0), rounded as store_value rounds
      const __m512 v = _mm512_add_ps(_mm512_loadu_ps(acc),
                                     bias ? _mm512_maskz_loadu_ps(live, bias + 16 * j) : _mm512_setzero_ps());
      if constexpr (sizeof(OT) == 2) store_bf16_lanes(reinterpret_cast<uint16_t*>(dst), v, cols);
      else _mm512_mask_storeu_ps(reinterpret_cast<float*>(dst), live, v);
    }, NoTileStart{}, ldx);
  }
};
using DotKernels = DotKernelsOf<VdpTiles>;

// Paged decode attention on the dot product (attention_body.h's passes, bf16 cache and queries),
// up to 16 query heads at a time in the 16 lanes of a vector:
//   scores: the heads' queries are laid out once in k pairs ([dk / 2][16 heads] pairs), and each key
//     row's pair (k, k + 1) is broadcast into one dot product that adds to all the heads at once;
//     no horizontal sums (the heads share every key row: MLA's latent, a GQA group);
//   softmax: per lane, so per head, over the tokens, with the FMA path's bf16 roundings;
//   o = p v over token pairs: two value rows interleaved into (t, t + 1) pairs per column
//     (vpermt2w) feed every head's dot product.
// Values equal to those of the FMA path up to the order of the fp32 sums.
constexpr int HEAD_LANES = DOT_HEAD_LANES;

// acc[t] += qp[p][0:16] . key[t][2p : 2p + 2] for TT tokens (rows k[t]): one k pair of a score tile.
// A score tile's key rows: k[t] a row of bf16 keys. PtrRows: one pointer per token (rows wherever the
// block table puts them); StridedRows: the tile's tokens at STRIDE elements apart in one block (an MLA
// cache row of a width known at compile time), so every row is one base register plus a constant.
// With a pointer per row the compiler kept most of a 12-row tile's pointers in vector registers and
// moved one into a general register before every broadcast (12 moves per 12 dot products); on AMD
// Zen 4 the MLA op on strided tiles of 16 rows took 0.84-0.87x the time (32 sequences of 140 to 2,048
// tokens, one of 2,048 or 8,192), with the same bits.
struct PtrRows {
  const uint16_t* const* k;
  const uint16_t* operator[](int t) const { return k[t]; }
};
template <int STRIDE>
struct StridedRows {
  const uint16_t* base;
  const uint16_t* operator[](int t) const { return base + t * STRIDE; }
};

template <int TT, typename Rows>
static inline __attribute__((always_inline)) void attn_score_pair(const uint32_t* __restrict qp,
                                                                  const Rows& k, int64_t p, __m512* acc) {
  const __m512bh qv = (__m512bh)_mm512_loadu_si512(qp + p * HEAD_LANES);
#pragma GCC unroll 16
  for (int t = 0; t < TT; ++t) {
    int32_t pair;
    std::memcpy(&pair, k[t] + 2 * p, 4);
    acc[t] = _mm512_dpbf16_ps(acc[t], (__m512bh)_mm512_set1_epi32(pair), qv);
  }
}

// A score tile's ask for one line: into L1, or into L2 with into_l2.
static inline __attribute__((always_inline)) void ask_line(const void* line, bool into_l2) {
  if (into_l2) __builtin_prefetch(line, 0, 2);
  else __builtin_prefetch(line);
}

// out[t][0:16] = sum over k pairs of qp[p][0:16] . key[t][2p : 2p + 2] for TT tokens (rows k[t]):
// qp [pairs][16] the heads' query pairs; an odd dk's last pair has a zero partner in qp. The lines
// in `ask` are asked for into L1 (into L2 with into_l2), two per k pair from the first (those past
// two per pair at once).
template <int TT, typename Rows>
static inline void attn_scores_lanes_tile(const uint32_t* __restrict qp, const Rows& k, int64_t dk,
                                          float* __restrict out, const avx512::TileLines& ask, bool into_l2 = false) {
  constexpr int KS = TT >= 8 ? 1 : 2;  // >= 8 chains over the dot latency where the tile allows
  __m512 acc[KS][TT];
#pragma GCC unroll 2
  for (int s = 0; s < KS; ++s)
#pragma GCC unroll 16
    for (int t = 0; t < TT; ++t) acc[s][t] = _mm512_setzero_ps();
  const int64_t pairs = dk / 2, steps = pairs / KS * KS;
  for (int64_t i = 2 * steps; i < ask.n; ++i) ask_line(ask.line[i], into_l2);
  // k pairs [0, asking) ask for two lines each (the odd count's last line twice)
  const int64_t asking = std::min(steps, (ask.n + 2 * KS - 1) / (2 * KS) * KS);
  int64_t p = 0;
  for (; p < asking; p += KS) {
#pragma GCC unroll 2
    for (int s = 0; s < KS; ++s) {
      ask_line(ask.line[std::min(2 * (p + s), ask.n - 1)], into_l2);
      ask_line(ask.line[std::min(2 * (p + s) + 1, ask.n - 1)], into_l2);
      attn_score_pair<TT>(qp, k, p + s, acc[s]);
    }
  }
  for (; p < steps; p += KS) {
#pragma GCC unroll 2
    for (int s = 0; s < KS; ++s) attn_score_pair<TT>(qp, k, p + s, acc[s]);
  }
  for (; p < (dk + 1) / 2; ++p) {  // KS's remainder, and an odd dk's last column (partner zero)
    const __m512bh qv = (__m512bh)_mm512_loadu_si512(qp + p * HEAD_LANES);
#pragma GCC unroll 16
    for (int t = 0; t < TT; ++t) {
      int32_t pair = k[t][2 * p];
      if (2 * p + 1 < dk) std::memcpy(&pair, k[t] + 2 * p, 4);
      acc[0][t] = _mm512_dpbf16_ps(acc[0][t], (__m512bh)_mm512_set1_epi32(pair), qv);
    }
  }
#pragma GCC unroll 16
  for (int t = 0; t < TT; ++t) {
    __m512 a = acc[0][t];
#pragma GCC unroll 2
    for (int s = 1; s < KS; ++s) a = _mm512_add_ps(a, acc[s][t]);
    _mm512_storeu_ps(out + t * HEAD_LANES, a);
  }
}

// Transposes the 16 x 16 32-bit words in r (row i = r[i]) in registers: r[i] becomes column i.
static inline void transpose16x16_epi32(__m512i r[16]) {
  __m512i t[16];
#pragma GCC unroll 8
  for (int i = 0; i < 16; i += 2) {  // 2 x 2 blocks of words
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 16; i += 4) {  // 4 x 4 blocks
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // r[4a + b] holds rows 4a..4a+3's words 4l + b (l: the 128-bit lane); lanes across row groups next
#pragma GCC unroll 4
  for (int b = 0; b < 4; ++b) {
    t[b] = _mm512_shuffle_i32x4(r[b], r[4 + b], 0x88);        // lanes 0, 2 of rows 0-3 | 4-7
    t[4 + b] = _mm512_shuffle_i32x4(r[b], r[4 + b], 0xdd);    // lanes 1, 3
    t[8 + b] = _mm512_shuffle_i32x4(r[8 + b], r[12 + b], 0x88);
    t[12 + b] = _mm512_shuffle_i32x4(r[8 + b], r[12 + b], 0xdd);
  }
#pragma GCC unroll 4
  for (int b = 0; b < 4; ++b) {
    r[b] = _mm512_shuffle_i32x4(t[b], t[8 + b], 0x88);        // words b: lane 0 of every row group
    r[8 + b] = _mm512_shuffle_i32x4(t[b], t[8 + b], 0xdd);    // words 8 + b (lane 2)
    r[4 + b] = _mm512_shuffle_i32x4(t[4 + b], t[12 + b], 0x88);  // words 4 + b (lane 1)
    r[12 + b] = _mm512_shuffle_i32x4(t[4 + b], t[12 + b], 0xdd);  // words 12 + b (lane 3)
  }
}

// qp[p][h] = (q[h][2p], q[h][2p + 1]) for the hc <= 16 query rows q [hc, dk] (bf16); lanes past
// hc and an odd dk's last partner are zero.
static inline void query_pairs(const uint16_t* q, int64_t hc, int64_t dk, uint32_t* qp) {
  const int64_t kpairs = (dk + 1) / 2;
  if (dk % 2 == 0) {  // row h's pairs are 32-bit words dk / 2 apart: 16 x 16 word blocks transposed
    const uint32_t* words = reinterpret_cast<const uint32_t*>(q);
    for (int64_t p0 = 0; p0 < kpairs; p0 += 16) {
      const int64_t n = std::min<int64_t>(16, kpairs - p0);
      const __mmask16 cols = static_cast<__mmask16>((uint32_t{1} << n) - 1);
      __m512i r[16];
#pragma GCC unroll 16
      for (int h = 0; h < 16; ++h)
        r[h] = h < hc ? _mm512_maskz_loadu_epi32(cols, words + h * kpairs + p0) : _mm512_setzero_si512();
      transpose16x16_epi32(r);
      for (int64_t i = 0; i < n; ++i) _mm512_storeu_si512(qp + (p0 + i) * HEAD_LANES, r[i]);
    }
    return;
  }
  std::fill(qp, qp + kpairs * HEAD_LANES, 0u);
  uint16_t* half = reinterpret_cast<uint16_t*>(qp);
  for (int64_t h = 0; h < hc; ++h)
    for (int64_t c = 0; c < dk; ++c) half[(c / 2 * HEAD_LANES + h) * 2 + c % 2] = q[h * dk + c];
}

// Scores tile rows: 12 accumulators, a query pair vector and a broadcast within 32 registers.
constexpr int SCORE_TILE_TOKENS = 12;
// Tiles of rows a block holds side by side (StridedRows): 16 accumulators, a query pair vector and a
// broadcast; tiles start at multiples of 16 tokens, so a block of 16k tokens holds each whole.
constexpr int STRIDED_TILE_TOKENS = 16;
// How far ahead a tile asks for its own key rows (~7 KB of MLA rows and ~0.25 us of dot products
// per tile). Rows come from DRAM (see NextItem): one tile ahead does not cover that latency; an
// item whose rows the previous item asked for finds them in L1 or L2 either way. Into L1 (Zen 5,
// the 2026-12-02 measurements) two tiles; into L2 (the other ask mode, attention_asks_slot) eight,
// which L2 holds and L1 does not: on AMD Zen 4 the MLA op on cold rows took 0.91x the time at 2,048
// tokens of context, 0.81x at 8,192 (one sequence), level at 140.
constexpr int64_t SCORE_TILES_AHEAD = 2;
constexpr int64_t SCORE_TILES_AHEAD_L2 = 8;

// s [L][16] (one row of 16 head lanes per token) -> the per-lane softmax of round(s) * scale (the
// FMA path's lanes_exp, then the normalisation), rounded to bf16 and written as token pairs: p
// [(L + 1) / 2][16] with token 2j in the low half of p[j][h] and token 2j + 1 (zero past L) in the
// high half.
static inline void attn_softmax_lanes(float* s, int64_t L, float scale, uint32_t* p) {
  const avx512::vxf inv_sums = avx512::lanes_exp(s, L, scale, true);
  __m512 inv;
  std::memcpy(&inv, &inv_sums, sizeof(inv));
  const __m512i hi_mask = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t j = 0; 2 * j < L; ++j) {
    const __m512i a = round_bf16_lanes(_mm512_mul_ps(_mm512_loadu_ps(s + 2 * j * HEAD_LANES), inv));
    const __m512i b = 2 * j + 1 < L
                          ? round_bf16_lanes(_mm512_mul_ps(_mm512_loadu_ps(s + (2 * j + 1) * HEAD_LANES), inv))
                          : _mm512_setzero_si512();
    _mm512_storeu_si512(p + j * HEAD_LANES, _mm512_or_si512(_mm512_srli_epi32(a, 16), _mm512_and_si512(b, hi_mask)));
  }
}

// acc [HH][32] += the probability pairs p [pair][pstride] (bf16, 32 bits each; HH heads) x the value
// pairs (two rows interleaved into (t, t + 1) pairs per column) of token pairs [j0, j1), columns [c0,
// c0 + 32) of the rows v[t] + off; token L (an odd count's partner) reads as zeros. With last, o[h *
// ldo + c0 :] = bf16(acc[h]) (columns past dv not written). Summed over the pairs in order, so passes
// over consecutive ranges give the bits of one.
template <int HH>
static inline void attn_pv_tile_bf16(const uint32_t* __restrict p, int64_t pstride, int64_t j0, int64_t j1,
                                     int64_t L, const uint16_t* const* v, int64_t off, int64_t c0, int64_t dv,
                                     float* __restrict acc_io, bool last, uint16_t* __restrict o, int64_t ldo) {
  const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                          37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
  const __mmask32 m = dv - c0 >= 32 ? ~__mmask32{0} : (__mmask32{1} << (dv - c0)) - 1;
  __m512 acc[HH][2];
#pragma GCC unroll 12
  for (int h = 0; h < HH; ++h) {
    acc[h][0] = _mm512_loadu_ps(acc_io + h * 32);
    acc[h][1] = _mm512_loadu_ps(acc_io + h * 32 + 16);
  }
  for (int64_t j = j0; j < j1; ++j) {
    const __m512i a = _mm512_maskz_loadu_epi16(m, v[2 * j] + off + c0);
    const __m512i b = 2 * j + 1 < L ? _mm512_maskz_loadu_epi16(m, v[2 * j + 1] + off + c0) : _mm512_setzero_si512();
    const __m512bh lo = (__m512bh)_mm512_permutex2var_epi16(a, lo_idx, b);
    const __m512bh hi = (__m512bh)_mm512_permutex2var_epi16(a, hi_idx, b);
#pragma GCC unroll 12
    for (int h = 0; h < HH; ++h) {
      const __m512bh pb = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(p[j * pstride + h]));
      acc[h][0] = _mm512_dpbf16_ps(acc[h][0], pb, lo);
      acc[h][1] = _mm512_dpbf16_ps(acc[h][1], pb, hi);
    }
  }
  if (!last) {
#pragma GCC unroll 12
    for (int h = 0; h < HH; ++h) {
      _mm512_storeu_ps(acc_io + h * 32, acc[h][0]);
      _mm512_storeu_ps(acc_io + h * 32 + 16, acc[h][1]);
    }
    return;
  }
  const int64_t n = std::min<int64_t>(32, dv - c0);
#pragma GCC unroll 12
  for (int h = 0; h < HH; ++h) {
    store_bf16_lanes(o + h * ldo + c0, acc[h][0], std::min<int64_t>(16, n));
    if (n > 16) store_bf16_lanes(o + h * ldo + c0 + 16, acc[h][1], n - 16);
  }
}

// o[h * ldo :] = bf16(p v) for HH heads over `pairs` token pairs: attn_pv_tile_bf16 over every 32
// columns of dv, p [pair][HEAD_LANES] (attn_softmax_lanes' rows), v[2 pairs - 1] a zero row when the
// tokens are odd
template <int HH>
static inline void attn_pv_heads_bf16(const uint32_t* p, int64_t pairs, const uint16_t* const* v, int64_t dv,
                                      uint16_t* o, int64_t ldo) {
  alignas(64) float zeros[HH * 32] = {};
  for (int64_t c0 = 0; c0 < dv; c0 += 32)
    attn_pv_tile_bf16<HH>(p, HEAD_LANES, 0, pairs, 2 * pairs, v, 0, c0, dv, zeros, true, o, ldo);
}

// Decode of a small group: a kv head serving at most 8 query heads (GQA's usual 1 to 8; MLA's heads
// split over many ranks). Heads in every lane (above) would leave 16 - hh of 16 lanes idle in every
// score product: 4 heads a kv head took 4x the dot products their scores need, and GQA decode read
// its cache at 4-8 GB/s. Here the heads, rounded up to a power of two HP, share a vector with
// J = 16 / HP of their k pairs each: lane h * J + j adds q[h] pair i J + j times the key's pair
// i J + j, the key's J pairs broadcast to every head (one 4J-byte broadcast per dot product), so a
// token's scores take kpairs / J dot products. A tile's sums over j are then folded in registers
// (log2 J rounds of even / odd lane sums across two vectors) into scores [t][HP], J tokens a vector.
// The softmax runs on those compact vectors (per-head maxima and sums folded across the lanes of
// one head), and the probabilities go to attn_pv_tile_bf16 as pairs of tokens in rows of HP.
// A head's sums run in an order set by HP alone (the op's heads a kv head, not the item's), so an
// item holding part of a kv head's heads gives those heads the bits of the whole.

// HP for `group` query heads a kv head and dk key columns: the least power of two >= group whose J
// divides the k pairs; 0 where none up to 8 does (odd dk, or group > 8: the lanes path)
static inline int group_lanes(int64_t group, int64_t dk) {
  if (dk % 2 || group > 8) return 0;
  for (int hp = 1; hp <= 8; hp *= 2)
    if (hp >= group && (dk / 2) % (16 / hp) == 0) return hp;
  return 0;
}

// J key pairs (4J bytes from k) in every J-lane group of a vector
template <int J>
static inline __m512i key_pairs(const uint16_t* k) {
  if constexpr (J == 16) return _mm512_loadu_si512(k);
  else if constexpr (J == 8) return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k)));
  else if constexpr (J == 4) return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k)));
  else {
    int64_t w;
    std::memcpy(&w, k, 8);
    return _mm512_set1_epi64(w);
  }
}

// One round of folding: lanes (2u, 2u + 1) of a, then of b, summed into lane u of the first, then
// the second, half of the result
static inline __m512 fold_pairs(__m512 a, __m512 b) {
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  return _mm512_add_ps(_mm512_permutex2var_ps(a, even, b), _mm512_permutex2var_ps(a, odd, b));
}

// out[t * HP + h] = sum over k pairs p of q[h] pair p . k[t] pair p for TT tokens (key rows k[t] + off);
// qv [steps][16] the query pairs in the group layout. TT a multiple of J: out takes TT / J vectors.
template <int HP, int TT>
static inline void group_scores_tile(const uint32_t* __restrict qv, int64_t steps, const uint16_t* const* k,
                                     int64_t off, float* __restrict out) {
  constexpr int J = 16 / HP;
  static_assert(TT % J == 0, "a tile folds into whole vectors");
  const uint16_t* row[TT];
#pragma GCC unroll 16
  for (int t = 0; t < TT; ++t) row[t] = k[t] + off;
  __m512 acc[TT];
#pragma GCC unroll 16
  for (int t = 0; t < TT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t i = 0; i < steps; ++i) {
    const __m512bh q = (__m512bh)_mm512_loadu_si512(qv + i * 16);
#pragma GCC unroll 16
    for (int t = 0; t < TT; ++t) acc[t] = _mm512_dpbf16_ps(acc[t], (__m512bh)key_pairs<J>(row[t] + i * 2 * J), q);
  }
  // log2 J rounds, each halving the vectors: tokens stay in order, a head's J lanes become one
#pragma GCC unroll 4
  for (int n = TT, width = J; width > 1; n /= 2, width /= 2)
#pragma GCC unroll 16
    for (int u = 0; u < n / 2; ++u) acc[u] = fold_pairs(acc[2 * u], acc[2 * u + 1]);
#pragma GCC unroll 16
  for (int u = 0; u < TT / J; ++u) _mm512_storeu_ps(out + u * 16, acc[u]);
}

// The lanes of vectors folded by xor with HP, 2 HP, ... (every lane of one head): max or sum
template <int HP, bool MAX>
static inline __m512 fold_heads(__m512 x) {
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
#pragma GCC unroll 4
  for (int s = HP; s < 16; s *= 2) {
    const __m512 y = _mm512_permutexvar_ps(_mm512_xor_si512(lane, _mm512_set1_epi32(s)), x);
    x = MAX ? _mm512_max_ps(x, y) : _mm512_add_ps(x, y);
  }
  return x;
}

// s [nv][16] (lane t' HP + h: token v J + t', head h) -> the per-head softmax over the L tokens of
// round(s) * scale (lanes_exp's roundings and exponential), rounded to bf16, as token pairs p
// [nv J / 2][HP] (token 2j low, 2j + 1 high); tokens past L weigh 0
template <int HP>
static inline void group_softmax(float* s, int64_t L, int64_t nv, float scale, uint32_t* p) {
  constexpr int J = 16 / HP;
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i token = _mm512_srli_epi32(lane, __builtin_ctz(HP));
  auto live = [&](int64_t v) {
    return _mm512_cmplt_epi32_mask(_mm512_add_epi32(token, _mm512_set1_epi32(static_cast<int>(v * J))),
                                   _mm512_set1_epi32(static_cast<int>(L)));
  };
  __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t v = 0; v < nv; ++v) {
    const __m512 x = _mm512_castsi512_ps(round_bf16_lanes(_mm512_loadu_ps(s + v * 16)));
    _mm512_storeu_ps(s + v * 16, x);
    mv = _mm512_mask_max_ps(mv, live(v), mv, x);
  }
  const __m512 m = _mm512_mul_ps(fold_heads<HP, true>(mv), _mm512_set1_ps(scale));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t v = 0; v < nv; ++v) {
    avx512::vxf x;
    const __m512 a = _mm512_fmsub_ps(_mm512_loadu_ps(s + v * 16), _mm512_set1_ps(scale), m);
    std::memcpy(&x, &a, sizeof(x));
    x = avx512::exp_nonpositive_v(x);
    __m512 e;
    std::memcpy(&e, &x, sizeof(e));
    e = _mm512_maskz_mov_ps(live(v), e);
    _mm512_storeu_ps(s + v * 16, e);
    sum = _mm512_add_ps(sum, e);
  }
  const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), fold_heads<HP, false>(sum));
  // token 2j's bits in the low half of its lane, 2j + 1's (HP lanes on) moved down beside them, then
  // the even tokens' lanes gathered into the first 8
  const __m512i hi_mask = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  __m512i gather;
  {
    alignas(64) int32_t idx[16];
    for (int w = 0, l = 0; l < 16; ++l)
      if ((l / HP) % 2 == 0) idx[w++] = l;
    for (int w = 8; w < 16; ++w) idx[w] = 0;
    gather = _mm512_load_si512(idx);
  }
  for (int64_t v = 0; v < nv; ++v) {
    const __m512i r = round_bf16_lanes(_mm512_mul_ps(_mm512_loadu_ps(s + v * 16), inv));
    const __m512i hi = _mm512_alignr_epi32(_mm512_setzero_si512(), _mm512_and_si512(r, hi_mask), HP);
    const __m512i w = _mm512_permutexvar_epi32(gather, _mm512_or_si512(_mm512_srli_epi32(r, 16), hi));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + v * 8), _mm512_castsi512_si256(w));
  }
}

// krow[t] / vrow[t]: token t's key and value rows (head's offsets) for the L tokens of a block table
static inline void row_pointers(const uint16_t* pool, int64_t S, const PagedHead& head, const int64_t* table,
                                int64_t L, const uint16_t** krow, const uint16_t** vrow) {
  for (int64_t t = 0; t < L; ++t) {
    const uint16_t* tok = pool + (table[t / S] * S + t % S) * head.token_stride;
    krow[t] = tok + head.k_off;
    vrow[t] = tok + head.v_off;
  }
}

struct AttentionDotKernels {
  // The group path asks for rows ahead into L2, all the item's kv heads' parts of a row at once: whole
  // rows (keys and values) GROUP_ROWS_AHEAD tokens ahead in the score pass; in the value pass, which
  // takes GROUP_PV_PAIRS token pairs for every kv head before the next pairs, the next pairs' values
  // again. Blocks sit wherever the block table puts them. On AMD Zen 4, 32 sequences of 2,048 tokens (4
  // kv heads of 4 query heads, hd 64, cold), when each token row held its keys and then its values and
  // each pass read half of every row: 12 GB/s against 7.6 with no asks for keys alone, and 0.80-0.88x
  // that time with whole rows (keys and values); asks into L1, or 32 pairs a pass, were slower.
  static constexpr int64_t GROUP_ROWS_AHEAD = 64;
  static constexpr int64_t GROUP_PV_PAIRS = 16;

  // One (sequence, kv heads [0, groups)) item of the group path (see group_lanes): q [groups * rep,
  // dk] bf16 (kv head g's query heads at rows g * rep ...); kv head g's rows at head's offsets + g *
  // kv_stride; the rest as decode's, with scratch: scores [groups][L + 16][HP] fp32, pbuf
  // [groups][(dk / 2) HP + (L + 16) HP / 2] 32-bit words, acc [groups * rep][dv + 32] fp32; o [groups *
  // rep, dv]. refill (null: none): the pool is its ring, loaded chunk by chunk in both passes.
  // Every tile of rows is read for all the kv heads at once: a GQA key (value) row holds every kv head's
  // key (value), so an item per kv head read a quarter of each row's lines (4 kv heads).
  template <int HP>
  static void decode_groups(const uint16_t* q, int64_t groups, int64_t rep, const uint16_t* pool, int64_t S,
                            const PagedHead& head, int64_t kv_stride, const int64_t* table, int64_t L, float scale,
                            float* scores, uint32_t* pbuf, float* acc, const uint16_t** rows, uint16_t* o,
                            const RowRefill* refill) {
    constexpr int J = 16 / HP, TT = J > 8 ? J : 8;
    const int64_t dk = head.dk, dv = head.dv, kpairs = dk / 2, steps = kpairs / J;
    const uint16_t** krow = rows;
    const uint16_t** vrow = rows + L + 1;
    row_pointers(pool, S, head, table, L, krow, vrow);
    const int64_t padded = (L + TT - 1) / TT * TT, qwords = steps * 16, pwords = padded / 2 * HP;
    uint32_t* qv = pbuf;  // [groups][steps][16]
    uint32_t* pp = pbuf + groups * qwords;  // [groups][padded / 2][HP]
    for (int64_t g = 0; g < groups; ++g) {
      const uint32_t* qw = reinterpret_cast<const uint32_t*>(q + g * rep * dk);  // head h's pair p: qw[h kpairs + p]
      for (int64_t i = 0; i < steps; ++i)
        for (int h = 0; h < HP; ++h)
          for (int j = 0; j < J; ++j)
            qv[g * qwords + i * 16 + h * J + j] = h < rep ? qw[h * kpairs + i * J + j] : 0u;
    }
    const int64_t kbytes = (groups - 1) * kv_stride * 2 + dk * 2, vbytes = (groups - 1) * kv_stride * 2 + dv * 2;
    auto ask = [](const uint16_t* row, int64_t bytes) { avx512::ask_share_l2(row, 1, 0, bytes, 0, 1); };  // into L2
    // the score pass asks for whole rows: the item's keys and values (the values are read later, by
    // then from L2 or L3); a GQA pool's values sit in their own rows (S rows after their keys'), asked
    // for apart
    const bool apart = head.blocks > 1;  // (PagedHead)
    const int64_t row_bytes = apart ? kbytes : std::max(kbytes, (head.v_off - head.k_off) * 2 + vbytes);
    auto ask_row = [&](int64_t t) {
      ask(krow[t], row_bytes);
      if (apart) ask(vrow[t], vbytes);
    };
    for (int64_t t = 0; t < std::min(GROUP_ROWS_AHEAD, L); ++t) ask_row(t);
    for (int64_t t0 = 0; t0 < padded; t0 += TT) {
      if (refill != nullptr && t0 % refill->chunk == 0) refill->fill(refill, t0, 0);  // (TT divides chunk)
      for (int64_t t = t0 + GROUP_ROWS_AHEAD; t < std::min(t0 + GROUP_ROWS_AHEAD + TT, L); ++t) ask_row(t);
      const uint16_t* k[TT];
#pragma GCC unroll 16
      for (int t = 0; t < TT; ++t) k[t] = krow[std::min(t0 + t, L - 1)];  // past L: any row (weighs 0)
      for (int64_t g = 0; g < groups; ++g)
        group_scores_tile<HP, TT>(qv + g * qwords, steps, k, g * kv_stride, scores + (g * padded + t0) * HP);
    }
    for (int64_t g = 0; g < groups; ++g)
      group_softmax<HP>(scores + g * padded * HP, L, padded / J, scale, pp + g * pwords);
    const int64_t pairs = (L + 1) / 2;
    for (int64_t t = 0; t < std::min(2 * GROUP_PV_PAIRS, L); ++t) ask(vrow[t], vbytes);
    for (int64_t j0 = 0; j0 < pairs; j0 += GROUP_PV_PAIRS) {
      if (refill != nullptr && 2 * j0 % refill->chunk == 0) refill->fill(refill, 2 * j0, 1);  // (32 divides chunk)
      const int64_t j1 = std::min(pairs, j0 + GROUP_PV_PAIRS);
      for (int64_t t = 2 * j1; t < std::min(2 * j1 + 2 * GROUP_PV_PAIRS, L); ++t) ask(vrow[t], vbytes);
      const bool first = j0 == 0, last = j1 == pairs;
      for (int64_t g = 0; g < groups; ++g) {
        const uint32_t* pg = pp + g * pwords;
        uint16_t* og = o + g * rep * dv;
        const int64_t off = g * kv_stride;
        // heads in runs of 8, 4, 2, 1; their accumulators [32 columns][run] per column tile
        auto run = [&](auto hh_c, int64_t h) {
          constexpr int HH = decltype(hh_c)::value;
          for (int64_t c0 = 0; c0 < dv; c0 += 32) {
            float* a = acc + ((g * rep + h) * ((dv + 31) / 32) + c0 / 32 * HH) * 32;
            if (first) std::fill(a, a + HH * 32, 0.0f);
            attn_pv_tile_bf16<HH>(pg + h, HP, j0, j1, L, vrow, off, c0, dv, a, last, og + h * dv, dv);
          }
        };
        int64_t h = 0;
        for (; h + 8 <= rep; h += 8) run(std::integral_constant<int, 8>{}, h);
        for (; h + 4 <= rep; h += 4) run(std::integral_constant<int, 4>{}, h);
        for (; h + 2 <= rep; h += 2) run(std::integral_constant<int, 2>{}, h);
        for (; h < rep; ++h) run(std::integral_constant<int, 1>{}, h);
      }
    }
  }

  // decode_groups at hp lanes a head: group_lanes(rep, dk), which the caller found not 0
  static void decode_groups_any(int hp, const uint16_t* q, int64_t groups, int64_t rep, const uint16_t* pool,
                                int64_t S, const PagedHead& head, int64_t kv_stride, const int64_t* table, int64_t L,
                                float scale, float* scores, uint32_t* pbuf, float* acc, const uint16_t** rows,
                                uint16_t* o, const RowRefill* refill) {
    auto run = [&](auto lanes) {
      decode_groups<decltype(lanes)::value>(q, groups, rep, pool, S, head, kv_stride, table, L, scale, scores, pbuf,
                                            acc, rows, o, refill);
    };
    switch (hp) {
      case 1: return run(std::integral_constant<int, 1>{});
      case 2: return run(std::integral_constant<int, 2>{});
      case 4: return run(std::integral_constant<int, 4>{});
      default: return run(std::integral_constant<int, 8>{});
    }
  }

  // One (sequence, kv head, query heads [0, hh)) item on a bf16 cache: q [hh, dk] bf16 rows; scores
  // [L, 16] fp32 scratch; pbuf [(dk + 1) / 2 + (L + 1) / 2, 16] pairs of bf16 scratch (the query
  // pairs, then the probability pairs); rows [2 (L + 1)] row pointers scratch; zero a row of dv zeros;
  // o [hh, dv] bf16 output (rounded as store_value rounds). Scores and probabilities rounded to bf16.
  static void decode(const uint16_t* q, int64_t hh, const uint16_t* pool, int64_t S, const PagedHead& head,
                     const int64_t* table, int64_t L, float scale, float* scores, uint16_t* pbuf,
                     const uint16_t** rows, const uint16_t* zero, uint16_t* o, const NextItem& next) {
    const int64_t dk = head.dk, dv = head.dv, stride = head.token_stride;
    const uint16_t** krow = rows;
    const uint16_t** vrow = rows + L + 1;
    row_pointers(pool, S, head, table, L, krow, vrow);
    vrow[L] = zero;  // the odd token's partner (probability 0)
    const int64_t kpairs = (dk + 1) / 2, pairs = (L + 1) / 2;
    uint32_t* qp = reinterpret_cast<uint32_t*>(pbuf);
    uint32_t* pp = qp + kpairs * HEAD_LANES;
    // rows SCORE_TILES_AHEAD (into L2: SCORE_TILES_AHEAD_L2) tiles ahead are asked for while these are
    // computed: blocks sit wherever the block table puts them, so the hardware prefetcher cannot run
    // ahead across them. The first tiles' rows are asked for at once (the previous item asked for
    // them too, see NextItem).
    const int64_t row_bytes = dk * static_cast<int64_t>(sizeof(uint16_t));
    const bool into_l2 = attention_asks_slot() == ATTENTION_ASKS_L2;
    // in tokens, whatever the tiles below: as many as that many 12-row tiles hold
    const int64_t ahead = (into_l2 ? SCORE_TILES_AHEAD_L2 : SCORE_TILES_AHEAD) * SCORE_TILE_TOKENS;
    // MLA rows of DeepSeek's widths in blocks of a multiple of 16 tokens: tiles of a block's 16 rows,
    // each row one base register plus a constant (StridedRows)
    const int strided = S % STRIDED_TILE_TOKENS || dk != stride ? 0 : stride == 288 ? 288 : stride == 576 ? 576 : 0;
    const int64_t tile_tokens = strided ? STRIDED_TILE_TOKENS : SCORE_TILE_TOKENS;
    const int64_t tiles = (L + tile_tokens - 1) / tile_tokens;
    for (int64_t h0 = 0; h0 < hh; h0 += HEAD_LANES) {
      const int64_t hc = std::min<int64_t>(HEAD_LANES, hh - h0);
      query_pairs(q + h0 * dk, hc, dk, qp);
      for (int64_t a = 0; a < std::min(ahead, L); ++a) avx512::prefetch_rows(krow[a], 1, dk, 0);
      for (int64_t t = 0; t < L; t += tile_tokens) {
        avx512::TileLines ask;
        for (int64_t a = t + ahead; a < std::min(t + ahead + tile_tokens, L); ++a)
          ask.add_rows(krow[a], 1, row_bytes, 0);
        if (h0 == 0) ask.add_next_share(pool, S, next, L, t / tile_tokens, tiles);  // a share per tile
        // one tile of up to max.value rows from t on, its key rows through `rows` (PtrRows or StridedRows)
        auto tile = [&](auto max, const auto& rows) {
          with_row_count<decltype(max)::value>(std::min<int64_t>(tile_tokens, L - t), [&](auto n) {
            attn_scores_lanes_tile<decltype(n)::value>(qp, rows, dk, scores + t * HEAD_LANES, ask, into_l2);
          });
        };
        constexpr std::integral_constant<int, STRIDED_TILE_TOKENS> strided_max;
        if (strided == 288) tile(strided_max, StridedRows<288>{krow[t]});
        else if (strided == 576) tile(strided_max, StridedRows<576>{krow[t]});
        else tile(std::integral_constant<int, SCORE_TILE_TOKENS>{}, PtrRows{krow + t});
      }
      if (h0 == 0) avx512::prefetch_next_query(next);
      attn_softmax_lanes(scores, L, scale, pp);
      const uint32_t* ph = pp;
      uint16_t* oh = o + h0 * dv;
      int64_t h = 0;
      if (hc == 16)  // two passes of 8 heads (16 accumulator chains each) instead of 12 + 4 (8 chains)
        for (; h < 16; h += 8) attn_pv_heads_bf16<8>(ph + h, pairs, vrow, dv, oh + h * dv, dv);
      for (; h + 12 <= hc; h += 12) attn_pv_heads_bf16<12>(ph + h, pairs, vrow, dv, oh + h * dv, dv);
      for (; h + 4 <= hc; h += 4) attn_pv_heads_bf16<4>(ph + h, pairs, vrow, dv, oh + h * dv, dv);
      for (; h < hc; ++h) attn_pv_heads_bf16<1>(ph + h, pairs, vrow, dv, oh + h * dv, dv);
    }
  }
};

// The dot product's fp32-equivalent rate against the FMA's on this core: seconds for `iters` rounds
// of 20 independent vdpbf16ps (64 flops each) or vfmadd231ps (32 flops each) on zeroed zmm
// registers, in asm so that every chain stays in a register. Some cores run the dot product at half
// the FMA's rate (Intel's AVX512-BF16 without AMX: 0.5x the fp32 flops there), others at twice it
// (AMD Zen 4 and 5), so which tiles are faster is measured, not read from cpuid.
#define MOE_ZERO(i) "vpxord %%zmm" #i ", %%zmm" #i ", %%zmm" #i "\n\t"
#define MOE_DOT(i) "vdpbf16ps %%zmm0, %%zmm1, %%zmm" #i "\n\t"
#define MOE_FMA(i) "vfmadd231ps %%zmm0, %%zmm1, %%zmm" #i "\n\t"
#define MOE_CHAINS(op) op(4) op(5) op(6) op(7) op(8) op(9) op(10) op(11) op(12) op(13) op(14) op(15) op(16) \
  op(17) op(18) op(19) op(20) op(21) op(22) op(23)
#define MOE_RATE_LOOP(op)                                                                              \
  asm volatile(MOE_ZERO(0) MOE_ZERO(1) MOE_CHAINS(MOE_ZERO) "1:\n\t" MOE_CHAINS(op) "dec %0\n\t"     \
               "jnz 1b"                                                                              \
               : "+r"(n)                                                                             \
               :                                                                                     \
               : "cc", "xmm0", "xmm1", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", \
                 "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", \
                 "xmm22", "xmm23")
static double dot_rate_seconds(int64_t iters, bool dot) {
  int64_t n = iters;
  const auto t0 = std::chrono::steady_clock::now();
  if (dot) MOE_RATE_LOOP(MOE_DOT);
  else MOE_RATE_LOOP(MOE_FMA);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
#undef MOE_RATE_LOOP
#undef MOE_CHAINS
#undef MOE_FMA
#undef MOE_DOT
#undef MOE_ZERO

// bf16 dot-product flops per second over fp32 FMA flops per second on this core: the best of seven
// alternating ~0.1 ms runs of each (a descheduled run only lengthens its own time).
static double dot_to_fma_rate() {
  constexpr int64_t iters = 4096;
  double dot = 1e30, fma = 1e30;
  dot_rate_seconds(iters, true), dot_rate_seconds(iters, false);  // warm up the wide units
  for (int rep = 0; rep < 7; ++rep) {
    dot = std::min(dot, dot_rate_seconds(iters, true));
    fma = std::min(fma, dot_rate_seconds(iters, false));
  }
  return (64.0 / dot) / (32.0 / fma);
}

// Seconds of passes of `rows`-row tiles (1 to DOT_TILE_ROWS) over `bytes` of bf16 weights in DRAM: a
// linear's packed blocks (K = 1024, on huge pages as the packed weights are) taken as block pairs in each
// mode of TILE_PROBED_PAIR_MODES, then one block at a time (as routed experts' decode-size items take
// them) in each mode of TILE_PROBED_BLOCK_MODES; every line flushed from the caches before each pass,
// so each pass reads DRAM whatever the size of the last-level cache. The best of seven rounds, the
// modes in turn within each round.
static std::vector<double> tile_mode_seconds(int64_t rows, int64_t bytes) {
  constexpr int64_t K = 1024, block = K * 16 * 2;
  constexpr size_t page = size_t{1} << 21;
  const int64_t pairs = std::max<int64_t>(1, bytes / (2 * block));
  const size_t size = (static_cast<size_t>(pairs * 2 * block) + page - 1) / page * page;
  std::unique_ptr<uint16_t, decltype(&std::free)> mem(static_cast<uint16_t*>(std::aligned_alloc(page, size)), &std::free);
  constexpr int pair_modes = sizeof(TILE_PROBED_PAIR_MODES) / sizeof(int);
  constexpr int modes = pair_modes + sizeof(TILE_PROBED_BLOCK_MODES) / sizeof(int);
  std::vector<double> best(modes, 1e30);
  if (!mem) return best;
  uint16_t* w = mem.get();
#if defined(__linux__)
  madvise(w, size, MADV_HUGEPAGE);
#endif
  std::fill(w, w + size / 2, uint16_t{0x3c00});  // 2^-7: sums stay finite
  std::vector<uint16_t> x(rows * K, uint16_t{0x3f80});
  alignas(64) float out[DOT_TILE_ROWS * 32];
  float sink = 0.0f;
  for (int rep = 0; rep < 7; ++rep)
    for (int m = 0; m < modes; ++m) {
      for (size_t at = 0; at < size; at += 64) _mm_clflush(reinterpret_cast<char*>(w) + at);
      _mm_mfence();
      const auto t0 = std::chrono::steady_clock::now();
      with_row_count<DOT_TILE_ROWS>(rows, [&](auto r) {
        constexpr int R = decltype(r)::value;
        if (m < pair_modes) {
          for (int64_t b = 0; b < pairs; ++b)
            stream_tile<R, 2>(TILE_PROBED_PAIR_MODES[m], x.data(), K, w + 2 * b * K * 16, K * 16, K, out);
        } else {
          for (int64_t b = 0; b < 2 * pairs; ++b)
            stream_tile<R, 1>(TILE_PROBED_BLOCK_MODES[m - pair_modes], x.data(), K, w + b * K * 16, 0, K, out);
        }
      });
      sink += out[rep & 31];
      best[m] = std::min(best[m], std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  if (sink != sink) best[0] = 1e30;  // reads sink: the passes are not optimised away
  return best;
}
