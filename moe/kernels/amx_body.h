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
                            int64_t split_stride = 0, const char* l2 = nullptr, int64_t l2_per_step = 0) {
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
    if (l2) {  // l2_per_step lines a step from l2 on into L2 (StreamNextBlocks)
      const char* at = l2 + (k / 32) * l2_per_step * 64;
      for (int64_t l = 0; l < l2_per_step; ++l) _mm_prefetch(at + 64 * l, _MM_HINT_T1);
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

// out [RT * 16][NB * 16] with rows ld floats apart (row r of row tile t at row 16 t + r, block j at
// column 16 j) = the accumulators of an amx_pass<RT, NB>.
template <int RT, int NB>
static inline void amx_store(float* out, int64_t ld = NB * 16) {
  const int64_t bytes = ld * static_cast<int64_t>(sizeof(float));
  _tile_stored(0, out, bytes);
  if constexpr (NB == 2) _tile_stored(1, out + 16, bytes);
  if constexpr (RT == 2) {
    _tile_stored(2, out + 16 * ld, bytes);
    if constexpr (NB == 2) _tile_stored(3, out + 16 * ld + 16, bytes);
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
    // StreamNextBlocks (an expert's first panel of gate/up, block pairs outer): each pass of a block
    // pair also asks for its share of the next pair's lines into L2, spread over its k steps, when
    // the pair has three row groups or more to spread them over. The hardware's prefetchers alone
    // leave a first panel's passes waiting on L3 or DRAM (DeepSeek-style layer, one 96-row panel
    // an expert at T = 1024: 0.90x the time; with one or two row groups, T <= 512, the requests cost
    // as much as they saved).
    const int64_t groups = (n + 31) / 32, next_lines = 2 * w_stride * static_cast<int64_t>(sizeof(uint16_t)) / 64;
    const bool stream = std::is_same_v<std::decay_t<Before>, StreamNextBlocks> && S == 1 && groups >= 3;
    int m0_now = -1, m1_now = -1, nb_now = -1;
    int64_t prev_r0 = 0, prev_rows = 0;
    int prev_j0 = 0, prev_nb = 0;
    auto finish = [&](const float* b, int64_t r0, int64_t rows, int j0, int pnb) {
      if constexpr (HasPairEpilogue<std::decay_t<Epilogue>>::value) {
        if (pnb == 2) {
          for (int64_t r = 0; r < rows; ++r) epilogue.pair(r0 + r, j0, b + r * 32);
          return;
        }
      }
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
      const char* l2 = nullptr;  // this pass's share of the next block pair's lines (StreamNextBlocks)
      int64_t l2_per_step = 0;
      if (stream) {
        const int64_t share = (next_lines + groups - 1) / groups;
        l2_per_step = (share + K / 32 - 1) / (K / 32);
        l2 = reinterpret_cast<const char*>(w + (j0 + 2) * w_stride) + (r0 / 32) * share * 64;
      }
      if (m1 > 0) {
        if (pnb == 2) amx_pass<2, 2, S>(xr, ldx, wj, w_stride, K, split_stride, l2, l2_per_step);
        else amx_pass<2, 1, S>(xr, ldx, wj, w_stride, K, split_stride, l2, l2_per_step);
      } else {
        if (pnb == 2) amx_pass<1, 2, S>(xr, ldx, wj, w_stride, K, split_stride, l2, l2_per_step);
        else amx_pass<1, 1, S>(xr, ldx, wj, w_stride, K, split_stride, l2, l2_per_step);
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
    constexpr bool plain = std::is_same_v<std::decay_t<Before>, NoTileStart> ||
                           std::is_same_v<std::decay_t<Before>, StreamNextBlocks>;
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
// ws [S][nb = ceil(E / 16)][D / 2][16][2] bf16 (S = 1 to 3), w = part 0 + part 1 + part 2 exactly
// (each part the bf16 rounding of what the parts before it leave; the parts past S all zero). Every
// product of a bf16 x and a bf16 part is exact in fp32, and each expert's accumulator sums them in one
// fixed order (per 32-value k step: part 0's, part 1's, part 2's), so a row's logits are the same bits
// whatever the batch, within fp32 rounding of the fp32 product (another order than the FMA kernels':
// these are not their bits). Rows go in chunks of 256 (512 KB at D = 1024) that stay in L2 while each
// pair of expert blocks (its S parts: up to 192 KB) passes over them.
template <int S>
static void router_logits_parts(const uint16_t* x, int64_t t_begin, int64_t t_end, const uint16_t* ws, int64_t E,
                                int64_t D, float* out) {
  const int64_t nb = (E + 15) / 16, block = D * 16;
  constexpr int64_t CHUNK = 256;
  for (int64_t c0 = t_begin; c0 < t_end; c0 += CHUNK) {
    const int64_t rows = std::min(CHUNK, t_end - c0);
    AmxTiles::over_rows<S>(x + c0 * D, rows, D, ws, static_cast<int>(nb), block,
                           [&](int64_t r, int j, const float* acc) {
      const int64_t cols = std::min<int64_t>(16, E - 16 * j);
      std::memcpy(out + (c0 + r) * E + 16 * j, acc, cols * sizeof(float));
    }, NoTileStart{}, D, nb * block);
  }
}
// num_parts: how many of the three parts ws holds (router_split leaves out trailing parts that are all
// zero: their products would add exact zeros). S == 1 runs the one-part passes (amx_pass<.., 1>),
// whose k steps are the same products in the same order.
static void router_logits_split(const uint16_t* x, int64_t t_begin, int64_t t_end, const uint16_t* ws,
                                int num_parts, int64_t E, int64_t D, float* out) {
  if (num_parts == 1) router_logits_parts<1>(x, t_begin, t_end, ws, E, D, out);
  else if (num_parts == 2) router_logits_parts<2>(x, t_begin, t_end, ws, E, D, out);
  else router_logits_parts<3>(x, t_begin, t_end, ws, E, D, out);
}

// p[0:n) = the bf16 probabilities of scores s[0:n) (overwritten): attn_softmax's arithmetic with
// round_half (scores rounded to bf16 by round_bf16_lanes, e^(x scale - max scale) by exp_nonpositive,
// the sum, the products by its inverse stored by store_bf16_lanes), in three passes over the row (the
// max, the powers and their sum, the probabilities), the last lanes masked; the sum in another order
// than attn_softmax's.
static inline void softmax_bf16_row(float* s, int64_t n, float scale, uint16_t* p) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  auto live = [&](int64_t t) {
    return n - t >= 16 ? __mmask16{0xffff} : static_cast<__mmask16>((uint32_t{1} << (n - t)) - 1);
  };
  __m512 mv = ninf;
  for (int64_t t = 0; t < n; t += 16) mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(ninf, live(t), s + t));
  // the max of the rounded scores: rounding keeps their order
  const float m = _mm512_reduce_max_ps(_mm512_castsi512_ps(avx512bf16::round_bf16_lanes(mv))) * scale;
  __m512 sv = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 k = live(t);
    avx512::vxf x;
    const __m512 rounded = _mm512_castsi512_ps(avx512bf16::round_bf16_lanes(_mm512_maskz_loadu_ps(k, s + t)));
    const __m512 a = _mm512_sub_ps(_mm512_mul_ps(rounded, _mm512_set1_ps(scale)), _mm512_set1_ps(m));
    std::memcpy(&x, &a, sizeof(x));
    x = avx512::exp_nonpositive_v(x);
    __m512 e;
    std::memcpy(&e, &x, sizeof(e));
    e = _mm512_maskz_mov_ps(k, e);
    _mm512_mask_storeu_ps(s + t, k, e);
    sv = _mm512_add_ps(sv, e);
  }
  const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sv));
  for (int64_t t = 0; t < n; t += 16)
    avx512bf16::store_bf16_lanes(p + t, _mm512_mul_ps(_mm512_maskz_loadu_ps(live(t), s + t), inv),
                                 std::min<int64_t>(16, n - t));
}

// Values into tdpbf16ps' B operand over token pairs: blocks of 16 columns, [L' / 2][16 columns][2]
// (vblock elements apart), token pair (t, t + 1)'s row at dst + (t / 2) * 32: the two tokens' columns
// interleaved. Tokens [t_lo, L) come from their pool rows (token u at pool + (table[u / S] * S + u % S)
// * stride), the rest of pairs [t_lo / 2, Lp / 2) are zeros; dv may end in a partial block (its missing
// columns zero).
static void pack_value_pairs(const uint16_t* pool, int64_t S, int64_t stride, const int64_t* table, int64_t t_lo,
                             int64_t L, int64_t Lp, int64_t dv, uint16_t* dst, int64_t vblock) {
  alignas(64) int16_t order[32];
  for (int c = 0; c < 16; ++c) order[2 * c] = static_cast<int16_t>(c), order[2 * c + 1] = static_cast<int16_t>(32 + c);
  const __m512i pairs = _mm512_load_si512(order);
  auto row = [&](int64_t u) { return u >= t_lo && u < L ? pool + (table[u / S] * S + u % S) * stride : nullptr; };
  for (int64_t t = t_lo / 2 * 2; t < Lp; t += 2) {
    const uint16_t* v0 = row(t);
    const uint16_t* v1 = row(t + 1);
    for (int64_t c = 0; c < dv; c += 16) {
      const __mmask16 live = dv - c >= 16 ? __mmask16{0xffff} : static_cast<__mmask16>((1u << (dv - c)) - 1);
      const __m512i a = v0 ? _mm512_castsi256_si512(_mm256_maskz_loadu_epi16(live, v0 + c)) : _mm512_setzero_si512();
      const __m512i b = v1 ? _mm512_castsi256_si512(_mm256_maskz_loadu_epi16(live, v1 + c)) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + (c / 16) * vblock + t * 16, _mm512_permutex2var_epi16(a, pairs, b));
    }
  }
}

// Prefill attention of bf16 rows on the tiles: paged_prefill_item's contract (attention_body.h) for a
// bf16 pool and queries, with the same roundings (scores rounded to bf16, the fp32 softmax of each
// row over exactly the keys it sees, probabilities rounded to bf16, outputs rounded once), the
// products on tdpbf16ps: every product of two bf16 values is exact in fp32, so the values are the
// FMA path's up to the order of the fp32 sums.
//
// The item's keys are packed once (for all its heads) into tdpbf16ps' B operand, blocks of 16 keys
// ([dk'/2][16 keys][2], dk' = dk rounded up to 32, zero padded), and its values into blocks of 16
// columns over token pairs ([L'/2][16][2], L' = L rounded up to 32, zero padded). A tile of up to 32
// query rows of one head then runs its scores against the key blocks its rows see, the softmax of
// each row, and its probabilities (bf16, zero outside the row's keys) against the value blocks.
// tdpbf16ps reads denormal bf16 inputs (below 1.2e-38) as zero.
//
// One layer's MLA prefill (16 heads, dk 96, dv 64; AMX box, one thread): 16 prompts of 256 tokens
// 24.6 ms against the FMA path's 45.4, one prompt of 4,000 tokens 148 ms against 431.
static void paged_prefill_tiles(const uint16_t* q, int64_t ldq, int64_t hh, int64_t nq, int64_t pos0,
                                const uint16_t* pool, int64_t S, const PagedHead& head, const SharedKeyPart& shared,
                                const int64_t* table, int64_t L, int64_t window, float scale, uint16_t* o,
                                int64_t ldo) {
  const int64_t dk = head.dk, dv = head.dv, stride = head.token_stride;
  const int64_t own = dk - shared.dim;  // the key columns in the head's pool
  const uint16_t* part = static_cast<const uint16_t*>(shared.pool);
  const int64_t dkp = (dk + 31) / 32 * 32, nkb = (L + 15) / 16, Lp = (L + 31) / 32 * 32, nvb = (dv + 15) / 16;
  const int64_t kblock = dkp * 16, vblock = Lp * 16, lds = nkb * 16 + 16;
  struct Scratch {
    LineVector<uint16_t> keys, values, queries, probs, key;
    LineVector<float> scores;
  };
  thread_local Scratch scratch;  // a thread's, kept between items (see the end)
  Scratch& held = scratch;
  held.keys.assign(nkb * kblock, 0);
  held.values.assign(nvb * vblock, 0);
  held.queries.assign(32 * dkp, 0);
  held.probs.resize(32 * (Lp + 32));
  held.scores.resize(32 * lds);
  held.key.resize(dk);
  uint16_t* const kp = held.keys.data();
  uint16_t* const vp = held.values.data();
  uint16_t* const qb = held.queries.data();
  uint16_t* const pb = held.probs.data();
  float* const sc = held.scores.data();
  // keys and values of the tokens any row sees ([first, L)), a pool block at a time, the next block's
  // rows asked for first (their rows lie token_stride apart, beyond what the hardware prefetcher follows)
  const int64_t first = window > 0 ? std::max<int64_t>(0, pos0 - window + 1) : 0;
  const __m512i kidx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(16));
  for (int64_t blk = first / S; blk * S < L; ++blk) {
    const int64_t t_begin = std::max(first, blk * S), t_end = std::min(L, blk * S + S);
    const uint16_t* base = pool + table[blk] * S * stride;
    if (t_end < L) {
      const uint16_t* next = pool + table[blk + 1] * S * stride;
      avx512::prefetch_rows(next + head.k_off, std::min(S, L - t_end), own, stride);
      avx512::prefetch_rows(next + head.v_off, std::min(S, L - t_end), dv, stride);
    }
    for (int64_t t = t_begin; t < t_end; ++t) {
      const uint16_t* row = base + (t - blk * S) * stride;
      const uint16_t* k = row + head.k_off;
      if (shared.dim > 0) {  // the key's two parts side by side
        std::memcpy(held.key.data(), k, own * sizeof(uint16_t));
        std::memcpy(held.key.data() + own, part + (table[blk] * S + t - blk * S) * shared.dim,
                    shared.dim * sizeof(uint16_t));
        k = held.key.data();
      }
      // key t's 32-value steps: their 16 pairs to pair rows 0..15 of its block's step, column t % 16
      uint32_t* kd = reinterpret_cast<uint32_t*>(kp + (t / 16) * kblock) + t % 16;
      for (int64_t s = 0; s < dkp; s += 32) {
        const int64_t left = std::min<int64_t>(32, dk - s);
        const __mmask32 live = left >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((uint64_t{1} << left) - 1);
        _mm512_i32scatter_epi32(kd + s * 8, kidx, _mm512_maskz_loadu_epi16(live, k + s), 4);
      }
    }
  }
  pack_value_pairs(pool + head.v_off, S, stride, table, first, L, Lp, dv, vp, vblock);
  for (int64_t h = 0; h < hh; ++h)
    for (int64_t r0 = 0; r0 < nq; r0 += 32) {
      const int64_t nr = std::min<int64_t>(32, nq - r0), p0 = pos0 + r0;
      const int64_t lo = window > 0 ? std::max<int64_t>(0, p0 - window + 1) : 0, end = p0 + nr;
      for (int64_t r = 0; r < nr; ++r) std::memcpy(qb + r * dkp, q + (r0 + r) * ldq + h * dk, dk * 2);
      // the next tile's query rows asked for (rows of one head lie H * dk apart)
      if (r0 + 32 < nq)
        avx512::prefetch_rows(q + (r0 + 32) * ldq + h * dk, std::min<int64_t>(32, nq - r0 - 32), dk, ldq);
      else if (h + 1 < hh)
        avx512::prefetch_rows(q + (h + 1) * dk, std::min<int64_t>(32, nq), dk, ldq);
      // scores against key blocks [kb0, kb1), stored from the tiles: sc[r * lds + t - 16 kb0] for key t
      const int64_t kb0 = lo / 16, kb1 = (end + 15) / 16;
      const int m0 = static_cast<int>(std::min<int64_t>(16, nr)), m1 = static_cast<int>(nr - m0);
      for (int64_t j = 0; j < kb1 - kb0; j += 2) {
        const int pnb = static_cast<int>(std::min<int64_t>(2, kb1 - kb0 - j));
        const uint16_t* w = kp + (kb0 + j) * kblock;
        float* out = sc + 16 * j;
        amx_configure(m0, m1, pnb);
        if (m1 > 0 && pnb == 2) amx_pass<2, 2>(qb, dkp, w, kblock, dkp), amx_store<2, 2>(out, lds);
        else if (m1 > 0) amx_pass<2, 1>(qb, dkp, w, kblock, dkp), amx_store<2, 1>(out, lds);
        else if (pnb == 2) amx_pass<1, 2>(qb, dkp, w, kblock, dkp), amx_store<1, 2>(out, lds);
        else amx_pass<1, 1>(qb, dkp, w, kblock, dkp), amx_store<1, 1>(out, lds);
      }
      // probabilities over tokens [t0, t1) (32-value steps), zero outside each row's keys [a, b); rows
      // 32 values longer than that, so that their stride is never a power of two
      const int64_t t0 = kb0 * 16 / 32 * 32, t1 = (end + 31) / 32 * 32, ldp = t1 - t0 + 32;
      for (int64_t r = 0; r < nr; ++r) {
        const int64_t b = p0 + r + 1, a = window > 0 ? std::max(lo, b - window) : lo;
        float* sr = sc + r * lds - kb0 * 16;  // sr[t] for key t
        uint16_t* pr = pb + r * ldp - t0;  // pr[t] for token t
        std::fill(pr + t0, pr + a, uint16_t{0});
        softmax_bf16_row(sr + a, b - a, scale, pr + a);
        std::fill(pr + b, pr + t1, uint16_t{0});
      }
      AmxTiles::over_rows(pb, nr, t1 - t0, vp + t0 * 16, static_cast<int>(nvb), vblock,
                          [&](int64_t r, int j, const float* acc) {
        avx512bf16::store_bf16_lanes(o + (r0 + r) * ldo + h * dv + 16 * j, _mm512_loadu_ps(acc),
                                     std::min<int64_t>(16, dv - 16 * j));
      }, NoTileStart{}, ldp);
    }
  // a long context's scratch (over 16 MB: some 30,000 tokens at DeepSeek's head sizes) is not kept
  // past its item
  const size_t kept = (held.keys.capacity() + held.values.capacity() + held.queries.capacity() +
                       held.probs.capacity()) * sizeof(uint16_t) + held.scores.capacity() * sizeof(float);
  if (kept > (size_t{16} << 20)) held = Scratch{};
}

// The amx instruction set's prefill attention: bf16 on the tiles, fp32 on the AVX-512 FMA path.
static void paged_prefill(bool bf16, const void* q, int64_t ldq, int64_t hh, int64_t nq, int64_t pos0,
                          const void* pool, int64_t S, const PagedHead& head, const SharedKeyPart& shared,
                          const int64_t* table, int64_t L, int64_t window, float scale, float* kt, float* vbuf,
                          float* scores, float* qbuf, void* o, int64_t ldo) {
  if (!bf16) {
    avx512::AttentionKernels::prefill(bf16, q, ldq, hh, nq, pos0, pool, S, head, shared, table, L, window, scale, kt,
                                      vbuf, scores, qbuf, o, ldo);
    return;
  }
  paged_prefill_tiles(static_cast<const uint16_t*>(q), ldq, hh, nq, pos0, static_cast<const uint16_t*>(pool), S,
                      head, shared, table, L, window, scale, static_cast<uint16_t*>(o), ldo);
}

// Decode attention of bf16 query heads over a bf16 cache on the tiles: AttentionDotKernels::decode's
// contract (one (sequence, kv head, query heads [0, hh)) item; q [hh, dk] bf16 rows; o [hh, dv] bf16
// rows, rounded as store_value rounds), with the FMA path's roundings: scores rounded to bf16, each
// head's fp32 softmax over its L keys (avx512::lanes_softmax), probabilities rounded to bf16. Every
// product of two bf16 values is exact in fp32, so the values are the FMA path's up to the order of the
// fp32 sums. Runs where decode_tiles_apply says; the other arguments of the dot path's signature (its
// scratch) are unused: the tiles keep their own per thread.
//
// Scores come out transposed, keys x heads: the key rows are the A operand straight from their pool
// blocks (16 or 32 rows a pass, token_stride apart), the queries the B operand (packed once per item,
// 16 heads a block), and each pass's accumulators are the [t][16 heads] rows the lanes softmax reads.
// The probabilities go back to [heads][tokens] bf16 rows (A), the values into 16-column blocks over
// token pairs (B, packed from the same rows: MLA's values are its keys' first dv columns).
//
// Against the FMA path (amx vs avx512 instruction sets on one AMX core, calls alternating, bf16, blocks of
// 16 tokens): MLA (16 heads, dk 288, dv 256) 2.5-4.3x faster at batch 1 and 32 of 128 tokens and at batch
// 1 of 2,048, 1.7-2.1x at batch 32 of 2,048 (its key rows' reads from DRAM the bound); GQA with hd 128 and 8
// query heads a kv head 1.4-2.3x, with 4 0.81-1.35x, with one (hd 64) 0.63-0.71x: a tile pass reads its
// key rows whatever the number of heads it serves. Hence from 8 heads a kv head, dk a multiple of 32
// (the A tiles' k steps) and dv of 16 (the value blocks).
static bool decode_tiles_apply(int64_t dk, int64_t dv, int64_t heads_per_kv) {
  return dk % 32 == 0 && dv % 16 == 0 && heads_per_kv >= 8;
}

static void paged_decode_tiles(const uint16_t* q, int64_t hh, const uint16_t* pool, int64_t S, const PagedHead& head,
                               const int64_t* table, int64_t L, float scale, float*, uint16_t*, const uint16_t**,
                               const uint16_t*, uint16_t* o, const NextItem& next) {
  const int64_t dk = head.dk, dv = head.dv, stride = head.token_stride;
  const int64_t nhb = (hh + 15) / 16, qblock = dk * 16;                  // query blocks of 16 heads
  const int64_t Lp = (L + 31) / 32 * 32, ldp = Lp + 32, vblock = Lp * 16;  // P rows never a power of two apart
  struct Scratch {
    LineVector<uint16_t> queries, values, probs;
    LineVector<float> scores;
  };
  thread_local Scratch scratch;
  Scratch& held = scratch;
  held.queries.assign(nhb * qblock, 0);
  held.values.resize((dv / 16) * vblock);
  held.probs.resize(hh * ldp);
  held.scores.resize(nhb * L * 16);
  uint16_t* const qp = held.queries.data();
  uint16_t* const vp = held.values.data();
  uint16_t* const pb = held.probs.data();
  float* const sc = held.scores.data();
  // queries -> B blocks [dk / 2][16 heads][2]: head h's pair (c, c + 1) at pair row c / 2, column h % 16
  for (int64_t h = 0; h < hh; ++h) {
    const uint32_t* src = reinterpret_cast<const uint32_t*>(q + h * dk);
    uint32_t* dst = reinterpret_cast<uint32_t*>(qp + (h / 16) * qblock) + h % 16;
    for (int64_t p = 0; p < dk / 2; ++p) dst[p * 16] = src[p];
  }
  // pass 1: scores [head block][t][16], block by block of the cache. No rows asked for ahead: the next
  // block's asked for at once (into L1 or L2), or two blocks on spread over a block's rows, were no faster
  // (batch 32 of 2,048-token contexts, blocks of 16 in a shuffled order: 6.5-7.7 ms without, 5.9-7.7 with).
  const int64_t nblocks = (L + S - 1) / S;
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    const int64_t t0 = blk * S, rows = std::min(S, L - t0);
    const uint16_t* keys = pool + table[blk] * S * stride + head.k_off;
    AmxTiles::over_rows(keys, rows, dk, qp, static_cast<int>(nhb), qblock, [&](int64_t r, int j, const float* acc) {
      std::memcpy(sc + (j * L + t0 + r) * 16, acc, 16 * sizeof(float));
    }, NoTileStart{}, stride);
  }
  avx512::prefetch_next_query(next);
  // pass 2: each head's softmax over its L keys, 16 heads in the lanes; probabilities -> P [hh][ldp] bf16
  for (int64_t j = 0; j < nhb; ++j) {
    float* s = sc + j * L * 16;
    avx512::lanes_softmax(s, L, scale, true);
    const int64_t hc = std::min<int64_t>(16, hh - 16 * j);
    for (int64_t t = 0; t < L; ++t)
      for (int64_t h = 0; h < hc; ++h) {
        uint32_t u;
        std::memcpy(&u, s + t * 16 + h, 4);
        pb[(16 * j + h) * ldp + t] = static_cast<uint16_t>(u >> 16);  // already a bf16 value
      }
  }
  for (int64_t h = 0; h < hh; ++h) std::fill(pb + h * ldp + L, pb + h * ldp + Lp, uint16_t{0});
  // values -> B blocks [Lp / 2][16 columns][2], zero past L
  pack_value_pairs(pool + head.v_off, S, stride, table, 0, L, Lp, dv, vp, vblock);
  // pass 3: o [hh][dv] = P [hh][Lp] x the value blocks
  AmxTiles::over_rows(pb, hh, Lp, vp, static_cast<int>(dv / 16), vblock, [&](int64_t r, int j, const float* acc) {
    avx512bf16::store_bf16_lanes(o + r * dv + 16 * j, _mm512_loadu_ps(acc), 16);
  }, NoTileStart{}, ldp);
  // a long context's scratch (over 16 MB) is not kept past its item
  const size_t kept = (held.queries.capacity() + held.values.capacity() + held.probs.capacity()) * sizeof(uint16_t) +
                      held.scores.capacity() * sizeof(float);
  if (kept > (size_t{16} << 20)) held = Scratch{};
}
