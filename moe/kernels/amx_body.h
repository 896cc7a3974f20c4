// Routed-expert and linear tiles on AMX (tdpbf16ps on 16 x 16 fp32 tiles), compiled once inside
// experts_cpu.cpp's amx namespace (target amx-tile and amx-bf16 on top of AVX512-BF16): the row
// loop under dot_body.h's DotKernelsOf, so the ops and their epilogues are the vdpbf16ps ops'.
//
// The packed bf16 block ([K/2][16][2]: k pairs, 16 output channels) is exactly the B operand a
// tdpbf16ps reads, 32 k values (16 pair rows of 64 bytes) per tile load, so the weights stream
// from where they lie, as packed. A row tile is up to 16 bf16 rows x 32 k values (64 bytes of each
// row, any row stride). One pass covers up to two row tiles x two column blocks: four fp32
// accumulator tiles (tmm0-3), two row tiles (tmm4-5) and two weight tiles (tmm6-7), every
// accumulator summing over k in 32-value steps, in order. Each output row goes through the same
// instructions whatever the other rows are (a row's values do not depend on the row count, the
// tile it lands in or the thread count).
//
// Weights whose K is not a multiple of 32 run the vdpbf16ps tiles instead (a tile's k extent is
// fixed by its configuration); the choice follows the weight's shape, never the row count.
//
// The tile configuration is per thread and other code (oneDNN's AMX GEMMs) changes it, so every
// call reads it back (~8 ns) and loads its own only when it differs (~60 ns). The tiles stay
// configured after a call (a release would make every later call load again).

// Tile shapes (LDTILECFG's 64-byte operand, palette 1): tmm[2r + j] accumulates row tile r x
// block j; tmm4 + r holds row tile r; tmm6 + j block j's 32 k values.
struct alignas(64) AmxTileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Configures row tiles of m0 and m1 (0: unused) rows and nb (1 or 2) column blocks.
static inline void amx_configure(int m0, int m1, int nb) {
  AmxTileConfig c;
  for (int j = 0; j < nb; ++j) {
    c.rows[j] = static_cast<uint8_t>(m0), c.colsb[j] = 64;  // accumulators of row tile 0
    c.rows[6 + j] = 16, c.colsb[6 + j] = 64;                  // the blocks' 16 k pairs
    if (m1 > 0) c.rows[2 + j] = static_cast<uint8_t>(m1), c.colsb[2 + j] = 64;
  }
  c.rows[4] = static_cast<uint8_t>(m0), c.colsb[4] = 64;
  if (m1 > 0) c.rows[5] = static_cast<uint8_t>(m1), c.colsb[5] = 64;
  AmxTileConfig now;
  _tile_storeconfig(&now);
  if (std::memcmp(&now, &c, sizeof(c)) != 0) _tile_loadconfig(&c);
}

// The accumulators (tmm0-3) = x's RT row tiles (rows ldx elements apart) times NB blocks (w_stride
// elements apart) over K (a multiple of 32); amx_store then writes them out. With S > 1 the weight
// is S packed parts split_stride elements apart, summed into the same accumulators: each 32-value k
// step's row tiles meet part 0's blocks, then part 1's, ... (router_logits_split's fp32 weight as
// three bf16 parts).
template <int RT, int NB, int S = 1>
static inline void amx_pass(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t w_stride, int64_t K,
                            int64_t split_stride = 0) {
  const int64_t sx = ldx * static_cast<int64_t>(sizeof(uint16_t));
  _tile_zero(0);
  if constexpr (NB == 2) _tile_zero(1);
  if constexpr (RT == 2) {
    _tile_zero(2);
    if constexpr (NB == 2) _tile_zero(3);
  }
  for (int64_t k = 0; k < K; k += 32) {
    // the blocks' lines two steps on into L1 (a 32 x 32 pass over L2-resident operands in a
    // microbenchmark: 1.10-1.15x the products per second; decode-size items streaming the weights,
    // DeepSeek-style shape at 32 tokens: 0.82-0.87x the time)
    const char* ahead = reinterpret_cast<const char*>(w + (k + 64) * 16);
    for (int l = 0; l < 16; ++l) {
      _mm_prefetch(ahead + 64 * l, _MM_HINT_T0);
      if constexpr (NB == 2) _mm_prefetch(ahead + 2 * w_stride + 64 * l, _MM_HINT_T0);
    }
    _tile_loadd(6, w + k * 16, 64);  // pair rows k/2 .. k/2 + 15 of block 0
    if constexpr (NB == 2) _tile_loadd(7, w + w_stride + k * 16, 64);
    _tile_loadd(4, x + k, sx);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NB == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (RT == 2) {
      _tile_loadd(5, x + 16 * ldx + k, sx);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NB == 2) _tile_dpbf16ps(3, 5, 7);
    }
    for (int s = 1; s < S; ++s) {  // the other parts against the same row tiles
      const uint16_t* ws = w + s * split_stride + k * 16;
      _tile_loadd(6, ws, 64);
      if constexpr (NB == 2) _tile_loadd(7, ws + w_stride, 64);
      _tile_dpbf16ps(0, 4, 6);
      if constexpr (NB == 2) _tile_dpbf16ps(1, 4, 7);
      if constexpr (RT == 2) {
        _tile_dpbf16ps(2, 5, 6);
        if constexpr (NB == 2) _tile_dpbf16ps(3, 5, 7);
      }
    }
  }
}

// buf [RT * 16][NB * 16] (row r of row tile t at row 16 t + r, block j at column 16 j) = the
// accumulators of an amx_pass<RT, NB>.
template <int RT, int NB>
static inline void amx_store(float* buf) {
  constexpr int64_t ld = NB * 16 * sizeof(float);
  _tile_stored(0, buf, ld);
  if constexpr (NB == 2) _tile_stored(1, buf + 16, ld);
  if constexpr (RT == 2) {
    _tile_stored(2, buf + 16 * NB * 16, ld);
    if constexpr (NB == 2) _tile_stored(3, buf + 16 * NB * 16 + 16, ld);
  }
}

// The most weight bytes (the blocks of one over_rows call) for which a tile-start op walks row groups
// outside the block pairs (see AmxTiles::over_rows): half the 2 MB L2 of the AMX cores.
constexpr int64_t ROWS_OUTER_MAX_BYTES = int64_t{1} << 20;

struct AmxTiles {
  // dot_tiles_over_rows' contract: epilogue(row, block j, acc[16]) once for each row of [0, n) of x
  // ([n, K] bf16, rows ldx elements apart: K unless given) and each of nb blocks w + j * w_stride
  // (passes of up to 32 rows and two blocks, the last block alone when nb is odd; which comes first,
  // rows or blocks, see below); before.into_l2(row0, rows, j) once each pass's products are issued
  // (the tile start's lines asked for into L2 there: DeepSeek-style layer, T = 4096, calls alternating
  // in one process, 0.981x the time of asking into L1 ahead of the products; into L2 ahead 0.985x,
  // into L1 after 0.985-0.989x; Mixtral-style 0.989x). S > 1: the weight is S parts split_stride
  // elements apart, summed (amx_pass; K a multiple of 32 then).
  template <int S = 1, typename Epilogue, typename Before = NoTileStart>
  static void over_rows(const uint16_t* x, int64_t n, int64_t K, const uint16_t* w, int nb, int64_t w_stride,
                        Epilogue&& epilogue, Before&& before = Before{}, int64_t ldx = 0, int64_t split_stride = 0) {
    if (ldx == 0) ldx = K;
    if constexpr (S == 1) {
      if (K % 32 != 0) {
        avx512bf16::VdpTiles::over_rows(x, n, K, w, nb, w_stride, epilogue, before, ldx);
        return;
      }
    }
    // Each pass's epilogue runs while the next pass's products run: its instructions come after
    // that pass's tdpbf16ps and before its tile stores (which wait for them), so the core works
    // through them instead of waiting; two buffers. The epilogues still run pass by pass, in order,
    // and the chain goes on from one block pair to the next (one call over many blocks leaves only
    // its last pass's epilogue unoverlapped).
    alignas(64) float buf[2][32 * 32];
    int m0_now = -1, m1_now = -1, nb_now = -1;
    int64_t prev_r0 = 0, prev_rows = 0;
    int prev_j0 = 0, prev_nb = 0;
    auto finish = [&](const float* b, int64_t r0, int64_t rows, int j0, int pnb) {
      for (int64_t r = 0; r < rows; ++r)
        for (int j = 0; j < pnb; ++j) epilogue(r0 + r, j0 + j, b + (r * pnb + j) * 16);
    };
    int cur = 0;
    auto pass = [&](int64_t r0, int j0) {
      const int pnb = std::min(2, nb - j0);
      const uint16_t* wj = w + j0 * w_stride;
      const int64_t rows = std::min<int64_t>(32, n - r0);
      const int m0 = static_cast<int>(std::min<int64_t>(16, rows)), m1 = static_cast<int>(rows - m0);
      if (m0 != m0_now || m1 != m1_now || pnb != nb_now) {
        amx_configure(m0, m1, pnb);
        m0_now = m0, m1_now = m1, nb_now = pnb;
      }
      const uint16_t* xr = x + r0 * ldx;
      float* b = buf[cur];
      if (m1 > 0) {
        if (pnb == 2) amx_pass<2, 2, S>(xr, ldx, wj, w_stride, K, split_stride);
        else amx_pass<2, 1, S>(xr, ldx, wj, w_stride, K, split_stride);
      } else {
        if (pnb == 2) amx_pass<1, 2, S>(xr, ldx, wj, w_stride, K, split_stride);
        else amx_pass<1, 1, S>(xr, ldx, wj, w_stride, K, split_stride);
      }
      for (int j = 0; j < pnb; ++j) before.into_l2(r0, rows, j0 + j);
      if (prev_rows > 0) finish(buf[cur ^ 1], prev_r0, prev_rows, prev_j0, prev_nb);
      if (m1 > 0) {
        if (pnb == 2) amx_store<2, 2>(b);
        else amx_store<2, 1>(b);
      } else {
        if (pnb == 2) amx_store<1, 2>(b);
        else amx_store<1, 1>(b);
      }
      prev_r0 = r0, prev_rows = rows, prev_j0 = j0, prev_nb = pnb, cur ^= 1;
    };
    // Ops with a tile start (down_add: each pass adds into output rows spread over L3) walk a group of
    // 32 rows through every block pair before the next group when the blocks' weights stay in L2: a
    // row's output lines then come in order (and their prefetches with them) while the weights are
    // re-read from L2. DeepSeek-style layer (the down weight 512 KB) at T = 4096, AMX box, calls
    // alternating in one process: 0.98x the time; Mixtral-style (4 MB, re-read from L3) 1.09x, so
    // those keep the block pairs outside. Without a tile start (gate/up, stores) it was no faster.
    constexpr bool plain = std::is_same_v<std::decay_t<Before>, NoTileStart>;
    const bool rows_outer = !plain && nb * w_stride * static_cast<int64_t>(sizeof(uint16_t)) <= ROWS_OUTER_MAX_BYTES;
    if (rows_outer) {
      for (int64_t r0 = 0; r0 < n; r0 += 32)
        for (int j0 = 0; j0 < nb; j0 += 2) pass(r0, j0);
    } else {
      for (int j0 = 0; j0 < nb; j0 += 2)
        for (int64_t r0 = 0; r0 < n; r0 += 32) pass(r0, j0);
    }
    if (prev_rows > 0) finish(buf[cur ^ 1], prev_r0, prev_rows, prev_j0, prev_nb);
  }
};

using AmxKernels = avx512bf16::DotKernelsOf<AmxTiles>;

// Router logits of bf16 rows on the tiles: out[t][e] = sum_k x[t][k] w[e][k] for rows [t_begin,
// t_end) of x [T, D] (D a multiple of 32) and the fp32 weight w [E, D] as router_split packs it:
// ws [3][nb = ceil(E / 16)][D / 2][16][2] bf16, w = part 0 + part 1 + part 2 exactly (each part the
// bf16 rounding of what the parts before it leave). Every product of a bf16 x and a bf16 part is
// exact in fp32, and each expert's accumulator sums them in one fixed order (per 32-value k step:
// part 0's, part 1's, part 2's), so a row's logits are the same bits whatever the batch, within fp32
// rounding of the fp32 product (another order than the FMA kernels': these are not their bits). Rows
// go in chunks of 256 (512 KB at D = 1024) that stay in L2 while each pair of expert blocks (its
// three parts: 192 KB) passes over them.
static void router_logits_split(const uint16_t* x, int64_t t_begin, int64_t t_end, const uint16_t* ws, int64_t E,
                                int64_t D, float* out) {
  const int64_t nb = (E + 15) / 16, block = D * 16;
  constexpr int64_t CHUNK = 256;
  for (int64_t c0 = t_begin; c0 < t_end; c0 += CHUNK) {
    const int64_t rows = std::min(CHUNK, t_end - c0);
    AmxTiles::over_rows<3>(x + c0 * D, rows, D, ws, static_cast<int>(nb), block,
                           [&](int64_t r, int j, const float* acc) {
      const int64_t cols = std::min<int64_t>(16, E - 16 * j);
      std::memcpy(out + (c0 + r) * E + 16 * j, acc, cols * sizeof(float));
    }, NoTileStart{}, D, nb * block);
  }
}
