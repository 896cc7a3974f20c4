// Routed-expert tile kernels, compiled once per instruction set.
//
// Included by experts_cpu.cpp inside a namespace under a `#pragma GCC target(...)` region
// with MOE_W (fp32 lanes per vector) defined: the same source becomes the AVX-512, AVX2+FMA
// and baseline variants, and the dispatcher picks one at run time from cpuid, so a cached
// build never executes instructions the CPU lacks.
//
// Packed weight layout (built once in Python, moe/kernels/__init__.py): column blocks of 16
// output channels, the reduction dimension K outermost inside a block: block[k][16] for fp32 and
// int8 (with one fp32 scale per output channel); bf16 (raw uint16) in k pairs, block[k/2][16][2]
// (the order AVX512-BF16's dot product reads; K even). For the gate/up projection a block holds
// 8 gate channels then the same 8 up channels, so one tile produces both halves of SwiGLU.

// Per-ISA vector ops (defined before this file is included): vf, vzero(), vload(const T*) for
// float / bf16 (uint16_t) / int8 (8 or 16 fp32 lanes), vload_pair(const uint16_t*, vf& k0, vf& k1)
// for MOE_W columns of a bf16 k pair, vbroadcast(const float*), vfma(a, b, c) = a * b + c, vadd,
// vmax (lane-wise), vhsum (sum of the lanes), vstore(float*, vf).
constexpr int NV = 16 / MOE_W;  // vectors per 16-column block
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 2048
#endif

// Independent partial sums per accumulator in an R-row tile: enough chains (R x NV x sets >= 8)
// to cover the FMA latency on two pipes, as few as that takes (registers).
template <int R>
constexpr int partial_sums() {
  return 8 / (R * NV) >= 1 ? 8 / (R * NV) : 1;
}

// out[r * 16 : + 16] = the sum of a tile's KS partial-sum sets acc[s][r] (set 0 first).
template <int KS, int R>
static inline void sum_and_store(vf (&acc)[KS][R][NV], float* __restrict out) {
#pragma GCC unroll 8
  for (int s = 1; s < KS; ++s)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[0][r][v] = vadd(acc[0][r][v], acc[s][r][v]);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) vstore(out + r * 16 + v * MOE_W, acc[0][r][v]);
}

// acc[r][0:16] = sum_k x[r * ldx + k] * w[k][0:16] for R rows (R * NV accumulators live in
// registers; the weight block is read once per tile). Few rows give short FMA dependency
// chains, so 1-2 row tiles keep KS independent partial sums over interleaved k. The loops over
// the sets unroll fully (KS is 8 for AVX-512's one-row tile): unrolled by 4 only, GCC kept the
// eight one-row accumulators in a stack array, each FMA a load and a store (int8 experts at one
// row per expert ran at ~15 GB/s on Zen 4, and the small checkpoint's int8 decode step at batch 1
// took 1.1-1.2x the time it takes with them in registers; the same bits).
template <int R, typename WT>
static inline void tile(const float* __restrict x, int64_t ldx, const WT* __restrict w, int64_t K,
                        float* __restrict out) {
  constexpr int KS = partial_sums<R>();
  vf acc[KS][R][NV];
#pragma GCC unroll 8
  for (int s = 0; s < KS; ++s)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[s][r][v] = vzero();
  int64_t k = 0;
  for (; k + KS <= K; k += KS) {
    // the block streams once from memory: ask for it 2 KB ahead so the loads overlap the FMAs
    // (Zen 3, bf16, 48 experts x 2-4 rows: 1.3-1.5x over no prefetch; 512 B ahead was slower)
#pragma GCC unroll 4
    for (int line = 0; line < static_cast<int>(KS * 16 * sizeof(WT)); line += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(w + k * 16) + PREFETCH_BYTES + line);
#pragma GCC unroll 8
    for (int s = 0; s < KS; ++s) {
      vf wv[NV];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) wv[v] = vload(w + (k + s) * 16 + v * MOE_W);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const vf xb = vbroadcast(x + r * ldx + k + s);
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) acc[s][r][v] = vfma(xb, wv[v], acc[s][r][v]);
      }
    }
  }
  for (; k < K; ++k) {
    vf wv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) wv[v] = vload(w + k * 16 + v * MOE_W);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const vf xb = vbroadcast(x + r * ldx + k);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[0][r][v] = vfma(xb, wv[v], acc[0][r][v]);
    }
  }
  sum_and_store<KS, R>(acc, out);
}

// The same for bf16 weights in k pairs (block[k/2][16][2], K even): a pair widens to its two fp32
// k rows (a shift and a mask), which feed separate partial sums when there are two or more.
template <int R>
static inline void tile(const float* __restrict x, int64_t ldx, const uint16_t* __restrict w, int64_t K,
                        float* __restrict out) {
  constexpr int KS = partial_sums<R>() >= 2 ? partial_sums<R>() / 2 * 2 : 1;  // sets: even, odd, ...
  constexpr int PP = KS >= 2 ? KS / 2 : 1;                                     // pairs per step
  vf acc[KS][R][NV];
#pragma GCC unroll 8
  for (int s = 0; s < KS; ++s)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[s][r][v] = vzero();
  const int64_t pairs = K / 2;
  int64_t p = 0;
  for (; p + PP <= pairs; p += PP) {
#pragma GCC unroll 4
    for (int line = 0; line < PP * 64; line += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(w + p * 32) + PREFETCH_BYTES + line);
#pragma GCC unroll 4
    for (int j = 0; j < PP; ++j) {
      constexpr int odd_set = KS >= 2 ? 1 : 0;
      vf w0[NV], w1[NV];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) vload_pair(w + (p + j) * 32 + v * 2 * MOE_W, w0[v], w1[v]);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const float* xr = x + r * ldx + 2 * (p + j);
        const vf x0 = vbroadcast(xr), x1 = vbroadcast(xr + 1);
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) {
          acc[2 * j * odd_set][r][v] = vfma(x0, w0[v], acc[2 * j * odd_set][r][v]);
          acc[2 * j * odd_set + odd_set][r][v] = vfma(x1, w1[v], acc[2 * j * odd_set + odd_set][r][v]);
        }
      }
    }
  }
  for (; p < pairs; ++p) {
    vf w0[NV], w1[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) vload_pair(w + p * 32 + v * 2 * MOE_W, w0[v], w1[v]);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const vf x0 = vbroadcast(x + r * ldx + 2 * p), x1 = vbroadcast(x + r * ldx + 2 * p + 1);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[0][r][v] = vfma(x1, w1[v], vfma(x0, w0[v], acc[0][r][v]));
    }
  }
  sum_and_store<KS, R>(acc, out);
}

// Rows per register tile, by weight type. AVX2 has 16 vector registers: fp32 and int8 weights take
// 6 rows x 16 columns = 12 accumulators + 2 weight vectors + 1 broadcast; a bf16 k pair widens to 4
// weight vectors and takes 2 broadcasts, so 6 rows would spill accumulators to the stack and chain
// the FMAs through store-to-load forwarding: 5 rows = 10 + 4 + 2. AVX-512: 8 rows of 32 registers.
template <typename WT>
constexpr int tile_rows_of() {
  return MOE_W == 16 ? 8 : sizeof(WT) == 2 ? 5 : 6;
}

template <typename WT>
static void tile_rows(int64_t rows, const float* x, int64_t ldx, const WT* w, int64_t K, float* out) {
  with_row_count<tile_rows_of<WT>()>(rows, [&](auto r) { tile<decltype(r)::value>(x, ldx, w, K, out); });
}

// Two neighbouring column blocks per tile (w and w + w_stride), for AVX-512's 32 registers: each
// broadcast row element feeds both blocks' FMAs, so a tile issues half the loads per FMA of the
// one-block tile and keeps 2R accumulator chains (the one-block 8-row tile's 8 chains, each taking
// a k pair's two FMAs in turn, just cover two FMA pipes of latency 4, with a broadcast load per
// FMA). Each accumulator sums over k in the one-block tile's order (its 8-row tile has a
// single partial sum), so the two give the same values.
constexpr bool PAIR_TILES = MOE_W == 16;
constexpr int PAIR_TILE_ROWS = 12;  // 24 accumulators + 4 weight vectors + the pair mask

// The prefetches that go with loading the line at element ``at`` of blocks w and w + w_stride:
// PREFETCH_BYTES further along into L1, or with NEXT the same line of the two blocks at ``next``
// into L2 (see tiles_over_rows_nb).
template <bool NEXT, typename WT>
static inline void prefetch_two_blocks(const WT* w, const WT* next, int64_t w_stride, int64_t at) {
  if constexpr (NEXT) {
    __builtin_prefetch(next + at, 0, 2);
    __builtin_prefetch(next + w_stride + at, 0, 2);
  } else {
    __builtin_prefetch(reinterpret_cast<const char*>(w + at) + PREFETCH_BYTES);
    __builtin_prefetch(reinterpret_cast<const char*>(w + w_stride + at) + PREFETCH_BYTES);
  }
}

template <int R, bool NEXT = false>
static inline void tile2(const float* __restrict x, int64_t ldx, const uint16_t* __restrict w, int64_t w_stride,
                         int64_t K, float* __restrict out, const uint16_t* next = nullptr) {
  vf acc[R][2];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vzero();
  const uint16_t* __restrict w1 = w + w_stride;
  const int64_t pairs = K / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    prefetch_two_blocks<NEXT>(w, next, w_stride, p * 32);
    vf a0, a1, b0, b1;
    vload_pair(w + p * 32, a0, a1);
    vload_pair(w1 + p * 32, b0, b1);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * ldx + 2 * p;
      const vf x0 = vbroadcast(xr), x1 = vbroadcast(xr + 1);
      acc[r][0] = vfma(x1, a1, vfma(x0, a0, acc[r][0]));
      acc[r][1] = vfma(x1, b1, vfma(x0, b0, acc[r][1]));
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) vstore(out + r * 32, acc[r][0]), vstore(out + r * 32 + 16, acc[r][1]);
}

template <int R, bool NEXT = false, typename WT>  // fp32 and int8 weights: block[k][16]
static inline void tile2(const float* __restrict x, int64_t ldx, const WT* __restrict w, int64_t w_stride, int64_t K,
                         float* __restrict out, const WT* next = nullptr) {
  vf acc[R][2];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vzero();
  const WT* __restrict w1 = w + w_stride;
  for (int64_t k = 0; k < K; ++k) {
    if ((k * 16 * sizeof(WT)) % 64 == 0) prefetch_two_blocks<NEXT>(w, next, w_stride, k * 16);
    const vf a = vload(w + k * 16), b = vload(w1 + k * 16);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const vf xb = vbroadcast(x + r * ldx + k);
      acc[r][0] = vfma(xb, a, acc[r][0]);
      acc[r][1] = vfma(xb, b, acc[r][1]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) vstore(out + r * 32, acc[r][0]), vstore(out + r * 32 + 16, acc[r][1]);
}

static inline float silu(float g) { return g / (1.f + std::exp(-g)); }

// Rows of the next register tile of at most tr rows when `left` rows remain: the last two tiles
// split their rows evenly (8 rows at 6 per tile: 4 + 4, not 6 + 2), as a tile of few rows streams
// the whole block for little work.
static inline int64_t next_tile_rows(int64_t left, int64_t tr) {
  return left <= tr ? left : left < 2 * tr ? (left + 1) / 2 : tr;
}

// Rows of the next one-block register tile: next_tile_rows's, except that with 8-lane vectors a tile
// takes 3 rows only where 3 rows are all there are (6 rows: 4 + 2, not 3 + 3; 7: 5 + 2, not 4 + 3).
// A 3-row tile keeps 6 accumulator chains, each taking a bf16 k pair's two FMAs in turn (fp32 and
// int8: one FMA a k, but two FMA pipes of latency 4 still want 8 chains): latency-bound at ~3/4 of
// the FMA rate, where a 2-row tile keeps two partial sums a row. A row's sums follow its tile's
// partial sums, so a row's bits depend on its tile's rows, as they did before. Zen 3 (AVX2), bf16
// linear of K 1024 over warm weights, GFLOP/s at 6 / 7 / 11 / 16 rows: 69-70 / 74-80 / 79-81 / 83-85
// before, 84 / 86 / 88-89 / 90 after.
static inline int64_t next_block_tile_rows(int64_t left, int64_t tr) {
  // next_tile_rows makes a 3 only of 5-7 rows past one tile (5 = 3 + 2 has no better split)
  if (MOE_W == 8 && (left == 6 || left == 7) && tr < left && left - 2 <= tr) return left - 2;
  return next_tile_rows(left, tr);
}

// Runs the register tiles over rows [0, n) of x ([n, K] fp32) against one [K][16] block and hands
// each row's 16 accumulated columns to the work item's epilogue: epilogue(row, acc[16]);
// before(row0, rows, j) runs ahead of each tile (NoTileStart).
template <typename WT, typename Epilogue, typename Before = NoTileStart>
static inline void tiles_over_rows(const float* x, int64_t n, int64_t K, const WT* w, Epilogue&& epilogue,
                                   int j = 0, Before&& before = Before{}) {
  constexpr int64_t TR = tile_rows_of<WT>();
  alignas(64) float buf[TR * 16];
  for (int64_t r0 = 0, rows; r0 < n; r0 += rows) {
    rows = next_block_tile_rows(n - r0, TR);
    before(r0, rows, j);
    tile_rows(rows, x + r0 * K, K, w, K, buf);
    for (int64_t r = 0; r < rows; ++r) epilogue(r0 + r, buf + r * 16);
  }
}

// tiles_over_rows for nb (1 or 2) blocks w, w + w_stride: epilogue(row, block j, acc[16]). Two
// blocks take the two-block tiles where the ISA has them (rows split as tiles_over_rows splits them),
// else each block its own tiles. As on the dot tiles (dot_tiles_over_rows), the second two-block
// tile prefetches the two blocks that follow into L2, for the next work item's first tile.
template <typename WT, typename Epilogue, typename Before = NoTileStart>
static inline void tiles_over_rows_nb(const float* x, int64_t n, int64_t K, const WT* w, int nb, int64_t w_stride,
                                      Epilogue&& epilogue, Before&& before = Before{}) {
  if constexpr (PAIR_TILES) {
    if (nb == 2) {
      constexpr int64_t TR = PAIR_TILE_ROWS;
      alignas(64) float buf[TR * 32];
      const WT* next = w + 2 * w_stride;
      for (int64_t r0 = 0, rows, tile = 0; r0 < n; r0 += rows, ++tile) {
        rows = next_tile_rows(n - r0, TR);
        before(r0, rows, 0), before(r0, rows, 1);
        with_row_count<PAIR_TILE_ROWS>(rows, [&](auto r) {
          if (tile == 1) tile2<decltype(r)::value, true>(x + r0 * K, K, w, w_stride, K, buf, next);
          else tile2<decltype(r)::value>(x + r0 * K, K, w, w_stride, K, buf);
        });
        for (int64_t r = 0; r < rows; ++r) epilogue(r0 + r, 0, buf + r * 32), epilogue(r0 + r, 1, buf + r * 32 + 16);
      }
      return;
    }
  }
  for (int j = 0; j < nb; ++j)
    tiles_over_rows(
        x, n, K, w + j * w_stride, [&](int64_t row, const float* acc) { epilogue(row, j, acc); }, j, before);
}

// One (expert, gate/up column blocks) work item: act[row, 8b:8b+8] = silu(gate) * up for rows
// [0, n) of the expert and nb (1 or 2) blocks from b (w_stride elements apart; act 8 columns on).
// x: [n, D] fp32 rows; w: [D][16] block; scale: 16 fp32 per block or null.
template <typename WT>
static void gate_up_block(const float* x, int64_t n, int64_t D, const WT* w, int nb, int64_t w_stride,
                          const float* scale, float* act, int64_t ld_act) {
  tiles_over_rows_nb(x, n, D, w, nb, w_stride, [&](int64_t row, int j, const float* acc) {
    float* dst = act + row * ld_act + 8 * j;
    const float* sc = scale ? scale + 16 * j : nullptr;
#ifdef MOE_EXP8
    __m256 g = _mm256_loadu_ps(acc), u = _mm256_loadu_ps(acc + 8);
    if (sc) g = _mm256_mul_ps(g, _mm256_loadu_ps(sc)), u = _mm256_mul_ps(u, _mm256_loadu_ps(sc + 8));
    _mm256_storeu_ps(dst, silu_mul8(g, u));
#else
    for (int c = 0; c < 8; ++c) {
      float g = acc[c], u = acc[8 + c];
      if (sc) g *= sc[c], u *= sc[8 + c];
      dst[c] = silu(g) * u;
    }
#endif
  });
}

// One (expert, down column blocks) work item: out[row, 16b:16b+16] = row_weight[row] *
// (act[row] @ block) for rows [0, n), nb blocks from b as above. act: [n, I] fp32; w: [I][16];
// out: fp32 or bf16 rows.
template <typename WT, typename OT>
static void down_block(const float* act, int64_t n, int64_t I, const WT* w, int nb, int64_t w_stride,
                       const float* scale, const float* row_weight, OT* out, int64_t ld_out) {
  tiles_over_rows_nb(act, n, I, w, nb, w_stride, [&](int64_t row, int j, const float* acc) {
    const float rw = row_weight ? row_weight[row] : 1.f;
    OT* dst = out + row * ld_out + 16 * j;
    const float* sc = scale ? scale + 16 * j : nullptr;
    for (int c = 0; c < 16; ++c) store_value(dst + c, acc[c] * (sc ? sc[c] : 1.f) * rw);
  });
}

// down_block with each row's product added into an fp32 output row instead: out[out_rows[row],
// 16b:16b+16] += row_weight[row] * (act[row] @ block), the product rounded to fp32 before the add
// (add_rounded16), so the sums are those of writing the rows out and adding them afterwards.
template <typename WT>
static void down_add_block(const float* act, int64_t n, int64_t I, const WT* w, int nb, int64_t w_stride,
                           const float* scale, const float* row_weight, const int64_t* out_rows, float* out,
                           int64_t ld_out) {
  tiles_over_rows_nb(act, n, I, w, nb, w_stride, [&](int64_t row, int j, const float* acc) {
    const float rw = row_weight ? row_weight[row] : 1.f;
    const float* sc = scale ? scale + 16 * j : nullptr;
    alignas(64) float v[16];
    for (int c = 0; c < 16; ++c) v[c] = acc[c] * (sc ? sc[c] : 1.f) * rw;
    add_rounded16(out + out_rows[row] * ld_out + 16 * j, v);
  }, OutRowPrefetch{out_rows, out, ld_out});
}

// One (group, output column blocks) work item of a plain linear: out[row, 0:ncols] = x[row] @ blocks
// (+ bias) for rows [0, n) and nb (1 or 2) blocks w, w + w_stride (16 columns each; ncols <= 16 nb
// of them are real, the rest zero padding). x: [n, K] fp32; bias: ncols fp32 or null; out: fp32 or
// bf16 rows.
template <typename WT, typename OT>
static void linear_block(const float* x, int64_t n, int64_t K, const WT* w, int nb, int64_t w_stride,
                         const float* bias, int64_t ncols, OT* out, int64_t ld_out) {
  tiles_over_rows_nb(x, n, K, w, nb, w_stride, [&](int64_t row, int j, const float* acc) {
    OT* dst = out + row * ld_out + 16 * j;
    const float* bj = bias ? bias + 16 * j : nullptr;
    for (int64_t c = 0, cols = std::min<int64_t>(16, ncols - 16 * j); c < cols; ++c)
      store_value(dst + c, acc[c] + (bj ? bj[c] : 0.f));
  });
}

struct Kernels {
  static constexpr bool pair_tiles = PAIR_TILES;
  // nb (1 or 2) neighbouring blocks from w, w_stride elements apart
  static void gate_up(int wt, const float* x, int64_t n, int64_t D, const void* w, int nb, int64_t w_stride,
                      const float* scale, float* act, int64_t ld_act) {
    if (wt == W_F32) gate_up_block(x, n, D, static_cast<const float*>(w), nb, w_stride, scale, act, ld_act);
    else if (wt == W_BF16) gate_up_block(x, n, D, static_cast<const uint16_t*>(w), nb, w_stride, scale, act, ld_act);
    else gate_up_block(x, n, D, static_cast<const int8_t*>(w), nb, w_stride, scale, act, ld_act);
  }
  template <typename OT>
  static void down(int wt, const float* act, int64_t n, int64_t I, const void* w, int nb, int64_t w_stride,
                   const float* scale, const float* row_weight, OT* out, int64_t ld_out) {
    if (wt == W_F32) down_block(act, n, I, static_cast<const float*>(w), nb, w_stride, scale, row_weight, out, ld_out);
    else if (wt == W_BF16)
      down_block(act, n, I, static_cast<const uint16_t*>(w), nb, w_stride, scale, row_weight, out, ld_out);
    else down_block(act, n, I, static_cast<const int8_t*>(w), nb, w_stride, scale, row_weight, out, ld_out);
  }
  static void down_add(int wt, const float* act, int64_t n, int64_t I, const void* w, int nb, int64_t w_stride,
                       const float* scale, const float* row_weight, const int64_t* out_rows, float* out,
                       int64_t ld_out) {
    if (wt == W_F32)
      down_add_block(act, n, I, static_cast<const float*>(w), nb, w_stride, scale, row_weight, out_rows, out, ld_out);
    else if (wt == W_BF16)
      down_add_block(act, n, I, static_cast<const uint16_t*>(w), nb, w_stride, scale, row_weight, out_rows, out,
                     ld_out);
    else
      down_add_block(act, n, I, static_cast<const int8_t*>(w), nb, w_stride, scale, row_weight, out_rows, out,
                     ld_out);
  }
  template <typename OT>
  static void linear(int wt, const float* x, int64_t n, int64_t K, const void* w, int nb, int64_t w_stride,
                     const float* bias, int64_t ncols, OT* out, int64_t ld_out) {
    if (wt == W_F32) linear_block(x, n, K, static_cast<const float*>(w), nb, w_stride, bias, ncols, out, ld_out);
    else linear_block(x, n, K, static_cast<const uint16_t*>(w), nb, w_stride, bias, ncols, out, ld_out);
  }
};
