// Decode attention over the paged cache (MLA's absorbed latent, or GQA's k/v heads), and prefill
// attention (causal rows of several new tokens per sequence; the "Prefill" section below), compiled
// once per instruction set (included by experts_cpu.cpp after experts_body.h, inside the same
// per-ISA namespace).
//
// One work item is (sequence, kv head, group of its query heads); GQA caches of two or more kv
// heads take items of a sequence's kv heads instead ("GQA items of several kv heads" below). It
// reads the sequence's cache blocks straight from the pool through its block table (no gathered
// copy), converts each block
// to fp32 once for all the item's heads, and keeps the item's scores [heads, L] and output
// [heads, dv] in fp32 scratch:
//   pass 1: s[h][t] = q[h] . key[t]                (MLA: over C + R, the latent plus the rope key)
//   pass 2: p[h] = softmax(round(s[h]) * scale)    (round: to bf16 when the inputs are bf16,
//           then p rounded to bf16, where the library's bf16 GEMM and transformers round)
//   pass 3: o[h] = sum_t p[h][t] value[t]          (MLA: the first C latent columns)
// An MLA bf16 or fp8 sequence of up to MLA_KEEP_BYTES in fp32 is converted once for both passes;
// the heads-in-lanes items below, and the GQA items of kv heads on the row path, read a bf16 cache's
// rows in place instead.
// Register tiles: 3 tokens x 4 heads of dot products (the k and q vectors each feed several FMAs; with
// 8-lane vectors tokens by heads, attn_dot_rows); 6 heads x 2 vectors of output columns for the value
// products.

// out[h * ldo + t] = dot(q[h * ldq : + n], k[t * ldk : + n]) for TT tokens x HH heads. Keys KT: fp32
// rows, or bf16 rows widened in place (the same fp32 values, so the same bits).
template <int TT, int HH, typename KT = float>
static inline void attn_dot_tile(const float* __restrict q, int64_t ldq, const KT* __restrict k, int64_t ldk,
                                int64_t n, float* __restrict out, int64_t ldo) {
  vf acc[TT][HH];
#pragma GCC unroll 4
  for (int t = 0; t < TT; ++t)
#pragma GCC unroll 4
    for (int h = 0; h < HH; ++h) acc[t][h] = vzero();
  int64_t c = 0;
  for (; c + MOE_W <= n; c += MOE_W) {
    vf kv[TT];
#pragma GCC unroll 4
    for (int t = 0; t < TT; ++t) kv[t] = vload(k + t * ldk + c);
#pragma GCC unroll 4
    for (int h = 0; h < HH; ++h) {
      const vf qv = vload(q + h * ldq + c);
#pragma GCC unroll 4
      for (int t = 0; t < TT; ++t) acc[t][h] = vfma(qv, kv[t], acc[t][h]);
    }
  }
  // each accumulator's lanes summed (vhsum's order): eight at a time where the lanes are 8 (vhsum8)
  constexpr int N = TT * HH, N8 = MOE_W == 8 ? N / 8 * 8 : 0;
  alignas(32) float sums[N];
#pragma GCC unroll 4
  for (int i = 0; i < N8; i += 8)
    vstore(sums + i, vhsum8(acc[i / HH][i % HH], acc[(i + 1) / HH][(i + 1) % HH], acc[(i + 2) / HH][(i + 2) % HH],
                            acc[(i + 3) / HH][(i + 3) % HH], acc[(i + 4) / HH][(i + 4) % HH],
                            acc[(i + 5) / HH][(i + 5) % HH], acc[(i + 6) / HH][(i + 6) % HH],
                            acc[(i + 7) / HH][(i + 7) % HH]));
#pragma GCC unroll 8
  for (int i = N8; i < N; ++i) sums[i] = vhsum(acc[i / HH][i % HH]);
  for (int t = 0; t < TT; ++t)
    for (int h = 0; h < HH; ++h) {
      float s = sums[t * HH + h];
      for (int64_t cc = c; cc < n; ++cc) s += q[h * ldq + cc] * to_float(k[t * ldk + cc]);
      out[h * ldo + t] = s;
    }
}

template <int TT, typename KT = float>
static inline void attn_dot_heads(int64_t hh, const float* q, int64_t ldq, const KT* k, int64_t ldk, int64_t n,
                                 float* out, int64_t ldo) {
  int64_t h = 0;
  for (; h + 4 <= hh; h += 4) attn_dot_tile<TT, 4>(q + h * ldq, ldq, k, ldk, n, out + h * ldo, ldo);
  switch (hh - h) {
    case 1: attn_dot_tile<TT, 1>(q + h * ldq, ldq, k, ldk, n, out + h * ldo, ldo); break;
    case 2: attn_dot_tile<TT, 2>(q + h * ldq, ldq, k, ldk, n, out + h * ldo, ldo); break;
    case 3: attn_dot_tile<TT, 3>(q + h * ldq, ldq, k, ldk, n, out + h * ldo, ldo); break;
    default: break;
  }
}

// Tokens a dot tile of HH heads takes with 8-lane vectors: 2 and 4 heads 8 accumulators (one vhsum8); 3
// heads 9; one head (MHA) 3, as before: 8 of them (8 key rows, 8 accumulators, 17 registers) took the op
// 1.06-1.25x the time (32 x 2,048 tokens, 8 kv heads of 64, 4 of 128; 16 x 2,048, 16 of 64).
template <int HH>
constexpr int dot_tile_tokens() {
  return HH == 2 ? 4 : HH == 4 ? 2 : 3;
}

// attn_dot_tile over key rows [0, rows) (row t at k + t * ldk) for heads [0, hh): out[h * ldo + t]. With
// 8-lane vectors each chunk of up to 4 heads takes its rows in tiles of dot_tile_tokens (then one at a
// time), its accumulators summed eight at a time: at 2 query heads a kv head (3 rows a tile before, 6
// accumulators each summed alone) the op took 0.86-0.90x the time on rows in L3 (4 x 2,048 tokens, 4 kv
// heads of 64, Zen 3), 0.96-0.99x on cold rows (32 x 2,048). Elsewhere 3 rows a tile, every head of a row
// before the next rows. A score's value does not depend on its tile (each accumulator is summed alone,
// in vhsum's order).
template <typename KT = float>
static inline void attn_dot_rows(int64_t hh, const float* q, int64_t ldq, const KT* k, int64_t ldk, int64_t n,
                                 int64_t rows, float* out, int64_t ldo) {
  if constexpr (MOE_W != 8) {
    int64_t t = 0;
    for (; t + 3 <= rows; t += 3) attn_dot_heads<3>(hh, q, ldq, k + t * ldk, ldk, n, out + t, ldo);
    for (; t < rows; ++t) attn_dot_heads<1>(hh, q, ldq, k + t * ldk, ldk, n, out + t, ldo);
  } else {
    const auto heads = [&](int64_t h, auto hc) __attribute__((always_inline)) {
      constexpr int HH = decltype(hc)::value, TT = dot_tile_tokens<HH>();
      int64_t t = 0;
      for (; t + TT <= rows; t += TT)
        attn_dot_tile<TT, HH>(q + h * ldq, ldq, k + t * ldk, ldk, n, out + h * ldo + t, ldo);
      for (; t < rows; ++t) attn_dot_tile<1, HH>(q + h * ldq, ldq, k + t * ldk, ldk, n, out + h * ldo + t, ldo);
    };
    int64_t h = 0;
    for (; h + 4 <= hh; h += 4) heads(h, std::integral_constant<int, 4>{});
    switch (hh - h) {
      case 1: heads(h, std::integral_constant<int, 1>{}); break;
      case 2: heads(h, std::integral_constant<int, 2>{}); break;
      case 3: heads(h, std::integral_constant<int, 3>{}); break;
      default: break;
    }
  }
}

// o[h * ldo + c] += sum_{t < T} p[h * ldp + t] * v[t * ldv + c] for HH heads and columns [c0, c0 + NC * MOE_W).
// Values VT: fp32 rows, or bf16 rows widened in place.
template <int HH, int NC, typename VT = float>
static inline void attn_pv_tile(const float* __restrict p, int64_t ldp, int64_t T, const VT* __restrict v,
                               int64_t ldv, int64_t c0, float* __restrict o, int64_t ldo) {
  vf acc[HH][NC];
#pragma GCC unroll 8
  for (int h = 0; h < HH; ++h)
#pragma GCC unroll 2
    for (int j = 0; j < NC; ++j) acc[h][j] = vload(o + h * ldo + c0 + j * MOE_W);
  for (int64_t t = 0; t < T; ++t) {
    vf vv[NC];
#pragma GCC unroll 2
    for (int j = 0; j < NC; ++j) vv[j] = vload(v + t * ldv + c0 + j * MOE_W);
#pragma GCC unroll 8
    for (int h = 0; h < HH; ++h) {
      const vf pb = vbroadcast(p + h * ldp + t);
#pragma GCC unroll 2
      for (int j = 0; j < NC; ++j) acc[h][j] = vfma(pb, vv[j], acc[h][j]);
    }
  }
#pragma GCC unroll 8
  for (int h = 0; h < HH; ++h)
#pragma GCC unroll 2
    for (int j = 0; j < NC; ++j) vstore(o + h * ldo + c0 + j * MOE_W, acc[h][j]);
}

template <int HH, typename VT = float>
static inline void attn_pv_columns(const float* p, int64_t ldp, int64_t T, const VT* v, int64_t ldv, int64_t C,
                                  float* o, int64_t ldo) {
  int64_t c = 0;
  for (; c + 2 * MOE_W <= C; c += 2 * MOE_W) attn_pv_tile<HH, 2>(p, ldp, T, v, ldv, c, o, ldo);
  for (; c + MOE_W <= C; c += MOE_W) attn_pv_tile<HH, 1>(p, ldp, T, v, ldv, c, o, ldo);
  for (; c < C; ++c)
    for (int h = 0; h < HH; ++h) {
      float s = o[h * ldo + c];
      for (int64_t t = 0; t < T; ++t) s = sfma(p[h * ldp + t], to_float(v[t * ldv + c]), s);  // vfma's arithmetic
      o[h * ldo + c] = s;
    }
}

// o[h * dv + c] += sum_{t < T} p[h * ldp + t] * v[t * ldv + c] for heads [0, hh), in tiles of 6 heads
template <typename VT = float>
static inline void attn_pv_heads(int64_t hh, const float* p, int64_t ldp, int64_t T, const VT* v, int64_t ldv,
                                 int64_t dv, float* o) {
  int64_t h = 0;
  for (; h + 6 <= hh; h += 6) attn_pv_columns<6>(p + h * ldp, ldp, T, v, ldv, dv, o + h * dv, dv);
  switch (hh - h) {
    case 1: attn_pv_columns<1>(p + h * ldp, ldp, T, v, ldv, dv, o + h * dv, dv); break;
    case 2: attn_pv_columns<2>(p + h * ldp, ldp, T, v, ldv, dv, o + h * dv, dv); break;
    case 3: attn_pv_columns<3>(p + h * ldp, ldp, T, v, ldv, dv, o + h * dv, dv); break;
    case 4: attn_pv_columns<4>(p + h * ldp, ldp, T, v, ldv, dv, o + h * dv, dv); break;
    case 5: attn_pv_columns<5>(p + h * ldp, ldp, T, v, ldv, dv, o + h * dv, dv); break;
    default: break;
  }
}

// exp(x) for x <= 0 (scores minus their max): 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], p the
// degree-6 Taylor polynomial (relative error ~1e-7); below -87 it returns exp(-87) ~ 1.6e-38, nothing
// next to the max term's 1. Written once for GCC vector types of any width (T = float: one lane).
typedef float vxf __attribute__((vector_size(MOE_W * 4)));
typedef int32_t vxi __attribute__((vector_size(MOE_W * 4)));
template <typename F, typename I>
static inline F exp_nonpositive_t(F x) {
  const F lo = x - x - 87.f;  // -87 in every lane
  x = x > lo ? x : lo;
  const float magic = 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  const F n = (x * 1.44269504f + magic) - magic;
  F r = x - n * 0.693145751953125f;
  r = r - n * 1.428606765330187e-06f;
  F p = r * (1.f / 720.f) + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  I bits;
  if constexpr (sizeof(F) == 4) bits = (static_cast<I>(n) + 127) << 23;
  else bits = (__builtin_convertvector(n, I) + 127) << 23;
  F two_n;
  std::memcpy(&two_n, &bits, sizeof(F));
  return p * two_n;
}
static inline vxf exp_nonpositive_v(vxf x) { return exp_nonpositive_t<vxf, vxi>(x); }
static inline float exp_nonpositive(float x) { return exp_nonpositive_t<float, int32_t>(x); }

// bf16 rounding (nearest even) of every entry of s[0:n), NaN kept NaN; branch-free.
static inline void round_bf16_inplace(float* s, int64_t n) {
  for (int64_t t = 0; t < n; ++t) {
    uint32_t u;
    std::memcpy(&u, s + t, 4);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    const uint32_t r = (u & 0x7fffffffu) > 0x7f800000u ? 0x7fc00000u : rounded;
    std::memcpy(s + t, &r, 4);
  }
}

// s[0:L) <- softmax(round(s) * scale) in fp32, then rounded to bf16 when round_half.
static inline void attn_softmax(float* s, int64_t L, float scale, bool round_half) {
  if (round_half) round_bf16_inplace(s, L);
  vf mv = vbroadcast(s);
  int64_t t = 0;
  for (; t + MOE_W <= L; t += MOE_W) mv = vmax(mv, vload(s + t));
  alignas(64) float lanes[MOE_W];
  vstore(lanes, mv);
  float m = lanes[0];
  for (int i = 1; i < MOE_W; ++i) m = std::max(m, lanes[i]);
  for (; t < L; ++t) m = std::max(m, s[t]);
  m *= scale;  // scale > 0: the max of the scaled scores
  for (t = 0; t + MOE_W <= L; t += MOE_W) {
    vxf x;
    std::memcpy(&x, s + t, sizeof(x));
    x = exp_nonpositive_v(x * scale - m);
    std::memcpy(s + t, &x, sizeof(x));
  }
  for (; t < L; ++t) s[t] = exp_nonpositive(s[t] * scale - m);
  vf sv = vzero();
  for (t = 0; t + MOE_W <= L; t += MOE_W) sv = vadd(sv, vload(s + t));
  vstore(lanes, sv);
  float sum = 0.f;
  for (int i = 0; i < MOE_W; ++i) sum += lanes[i];
  for (; t < L; ++t) sum += s[t];
  const float inv = 1.f / sum;
  for (t = 0; t < L; ++t) s[t] *= inv;
  if (round_half) round_bf16_inplace(s, L);
}

// dst[r * width : + width] = fp32 copy of row r (at src + r * stride) for rows [0, rows).
template <typename PT>
static inline void rows_into(const PT* src, int64_t rows, int64_t width, int64_t stride, float* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    const PT* s = src + r * stride;
    float* d = dst + r * width;
    if constexpr (sizeof(PT) == 4) {
      std::memcpy(d, s, width * sizeof(float));
    } else {
      int64_t i = 0;
      for (; i + MOE_W <= width; i += MOE_W) vstore(d + i, vload(s + i));
      for (; i < width; ++i) d[i] = to_float(s[i]);
    }
  }
}

// dst[0:width) = row src[0:width) as fp32: a bf16 row widened, an fp8 row's bytes as rd says
// (e4m3_row_f32)
__attribute__((always_inline)) static inline void row_f32(const uint16_t* src, int64_t width, float* dst,
                                                         const Fp8Read*) {
  rows_into(src, 1, width, 0, dst);
}
__attribute__((always_inline)) static inline void row_f32(const uint8_t* src, int64_t width, float* dst,
                                                         const Fp8Read* rd) {
  e4m3_row_f32(src, width, dst, *rd);
}

// Rows [0, rows) of a block (row r at src + r * stride, width wide) as fp32: the rows in place for
// an fp32 pool (returns their stride), else converted into buf by row_f32 (returns width).
static inline int64_t rows_f32(const float* src, int64_t, int64_t, int64_t stride, float*, const float** out,
                               const Fp8Read* = nullptr) {
  *out = src;
  return stride;
}
template <typename PT>  // bf16 or fp8
static inline int64_t rows_f32(const PT* src, int64_t rows, int64_t width, int64_t stride, float* buf,
                               const float** out, const Fp8Read* rd = nullptr) {
  for (int64_t r = 0; r < rows; ++r) row_f32(src + r * stride, width, buf + r * width, rd);
  *out = buf;
  return width;
}

// Asks for rows [0, rows) of the next block (row r at src + r * stride, width wide) while the
// current one is computed: blocks sit wherever the block table puts them, so the hardware
// prefetcher cannot run ahead across them (GQA rows are also strided by the other heads).
template <typename PT>
static inline void prefetch_rows(const PT* src, int64_t rows, int64_t width, int64_t stride) {
  const int64_t bytes = width * static_cast<int64_t>(sizeof(PT));
  for (int64_t r = 0; r < rows; ++r) {
    const char* p = reinterpret_cast<const char*>(src + r * stride);
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b);
  }
}

// The next work item's query rows asked for into L1 (see NextItem).
static inline void prefetch_next_query(const NextItem& next) { prefetch_rows(next.q, 1, next.q_bytes, 0); }

// fn(first token of the segment, rows) for share i of n of the next work item's first `len` rows
// (its rows [i len / n, (i + 1) len / n)), one call per block segment.
template <typename PT, typename Fn>
static inline void for_next_share(const PT* pool, int64_t S, const NextItem& next, int64_t len, int64_t i, int64_t n,
                                  Fn&& fn) {
  for (int64_t t = i * len / n, to = (i + 1) * len / n, rows; t < to; t += rows) {
    rows = std::min(to - t, S - t % S);  // the share's rows in t's block
    fn(pool + (next.table[t / S] * S + t % S) * next.head.token_stride, rows);
  }
}

// The cache lines a score pass asks for into L1 while it computes (its own rows ahead and a share
// of the next work item's), spread over its steps: asked for all at once (~200 lines of MLA rows a
// score tile, or a block), they filled the core's miss buffers, and the pass's own loads queued
// behind them. Spread, the dot path's score pass of MLA decode steps on Zen 5 took 0.4-0.55x the
// time at batch 32 and 0.55-0.65x at batch 1 (rdtsc in situ: between two layers' attention the
// routed experts evict the cache rows); called back to back on rows that stay in L3, ~1.4x. The
// FMA lanes path's pass (one line per score column) on the same batch of cold rows, timed alone:
// 0.8-0.94x; on rows in L3, 1.08-1.17x.
struct TileLines {
  static constexpr int64_t CAPACITY = 1024;
  const char* line[CAPACITY];
  int64_t n = 0;
  // rows [0, rows) of `bytes` each, at src and stride_bytes apart (lines past CAPACITY are left out)
  void add_rows(const void* src, int64_t rows, int64_t bytes, int64_t stride_bytes) {
    int64_t m = n;  // a local count: n itself would carry each store through memory
    for (int64_t r = 0; r < rows; ++r) {
      const char* row = static_cast<const char*>(src) + r * stride_bytes;
      for (int64_t b = 0, e = std::min(bytes, (CAPACITY - m) * 64); b < e; b += 64) line[m++] = row + b;
    }
    n = m;
  }
  // share i of n of the next work item's first L rows (all of them when it is no longer than the
  // current item's L; for_next_share): its keys, and its values where they sit apart (GQA)
  template <typename PT>
  void add_next_share(const PT* pool, int64_t S, const NextItem& next, int64_t L, int64_t i, int64_t n_shares) {
    const PagedHead& nh = next.head;
    const int64_t elem = sizeof(PT);
    for_next_share(pool, S, next, std::min(next.L, L), i, n_shares, [&](const PT* tok, int64_t rows) {
      add_rows(tok + nh.k_off, rows, nh.dk * elem, nh.token_stride * elem);
      if (nh.v_off != nh.k_off) add_rows(tok + nh.v_off, rows, nh.dv * elem, nh.token_stride * elem);
    });
  }
};

// Share i of n of the next work item's rows asked for into L1: its keys, and its values where they
// sit apart (GQA). On Zen 5, asked for into L1 the next item's score pass took 0.6-0.7x the time
// (batch-32 MLA decode steps, rdtsc in situ); into L2 (prefetcht1) it was no faster than without
// (the same pass on cache-cold rows, timed alone).
template <typename PT>
static inline void prefetch_next_share(const PT* pool, int64_t S, const NextItem& next, int64_t i, int64_t n) {
  const PagedHead& head = next.head;
  for_next_share(pool, S, next, next.L, i, n, [&](const PT* tok, int64_t rows) {
    prefetch_rows(tok + head.k_off, rows, head.dk, head.token_stride);
    if (head.v_off != head.k_off) prefetch_rows(tok + head.v_off, rows, head.dv, head.token_stride);
  });
}

// Whether an item converts its sequence's rows once for both passes: a bf16 or fp8 MLA cache (the values
// are the key rows) of at most MLA_KEEP_BYTES in fp32.
template <typename PT>
static inline bool keeps_rows(const PagedHead& head, int64_t L) {
  return sizeof(PT) <= 2 && head.v_off == head.k_off &&
         L * head.dk * static_cast<int64_t>(sizeof(float)) <= MLA_KEEP_BYTES;
}

// The key rows of the block after blk (if the sequence has one) asked for: at once, or added to
// `ask` for the caller to spread.
template <typename PT>
static inline void ask_next_keys(const PT* pool, int64_t S, const PagedHead& head, const int64_t* table, int64_t L,
                                 int64_t blk, TileLines* ask) {
  if ((blk + 1) * S >= L) return;
  const int64_t stride = head.token_stride, dk = head.dk;
  const PT* next_keys = pool + table[blk + 1] * S * stride + head.k_off;
  const int64_t next_rows = std::min(S, L - (blk + 1) * S);
  if (ask) ask->add_rows(next_keys, next_rows, dk * sizeof(PT), stride * sizeof(PT));
  else prefetch_rows(next_keys, next_rows, dk, stride);
}

// Block blk's key rows as fp32, with the next block's asked for first (ask_next_keys): converted
// into kbuf at the block's place when keep, else at kbuf's start (an fp32 pool's rows are used in
// place). Returns their stride; *k the rows.
template <typename PT>
static inline int64_t key_block(const PT* pool, int64_t S, const PagedHead& head, const int64_t* table, int64_t L,
                                int64_t blk, bool keep, float* kbuf, const float** k, const Fp8Read* rd,
                                TileLines* ask = nullptr) {
  const int64_t stride = head.token_stride, dk = head.dk;
  ask_next_keys(pool, S, head, table, L, blk, ask);
  return rows_f32(pool + table[blk] * S * stride + head.k_off, std::min(S, L - blk * S), dk, stride,
                  keep ? kbuf + blk * S * dk : kbuf, k, rd);
}

// Block blk's value rows as fp32: the kept key rows, else converted into vbuf with the next
// block's asked for first. Returns their stride; *v the rows.
template <typename PT>
static inline int64_t value_block(const PT* pool, int64_t S, const PagedHead& head, const int64_t* table, int64_t L,
                                  int64_t blk, bool keep, const float* kbuf, float* vbuf, const float** v,
                                  const Fp8Read* rd) {
  const int64_t stride = head.token_stride, dv = head.dv;
  if (keep) {
    *v = kbuf + blk * S * head.dk;
    return head.dk;
  }
  if ((blk + 1) * S < L)
    prefetch_rows(pool + table[blk + 1] * S * stride + head.v_off, std::min(S, L - (blk + 1) * S), dv, stride);
  return rows_f32(pool + table[blk] * S * stride + head.v_off, std::min(S, L - blk * S), dv, stride, vbuf, v, rd);
}

// One work item: query heads [0, hh) of one sequence against one kv head. q: [hh, dk] fp32 rows;
// pool: one layer's cache, S tokens per block (PT uint8_t: fp8 bytes, converted as rd says); table:
// the sequence's block ids; L: its context length. scores: [hh, L]; kbuf: [max(S, L'), dk] fp32
// scratch (L' = L rounded up to S when the sequence is kept whole: values are the key rows and fit
// MLA_KEEP_BYTES); vbuf: [S, dv]; o: [hh, dv] fp32 output. round_half: round scores and
// probabilities to bf16.
template <typename PT>
static void paged_decode_item(const float* q, int64_t hh, const PT* pool, int64_t S, const PagedHead& head,
                              const int64_t* table, int64_t L, float scale, bool round_half, float* scores,
                              float* kbuf, float* vbuf, float* o, const NextItem& next, const Fp8Read* rd) {
  const int64_t nblocks = (L + S - 1) / S, dk = head.dk, dv = head.dv;
  const bool keep = keeps_rows<PT>(head, L);
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    const int64_t rows = std::min(S, L - blk * S);
    prefetch_next_share(pool, S, next, blk, nblocks);
    const float* k;
    const int64_t ldk = key_block(pool, S, head, table, L, blk, keep, kbuf, &k, rd);
    attn_dot_rows(hh, q, dk, k, ldk, dk, rows, scores + blk * S, L);
  }
  prefetch_next_query(next);
  for (int64_t h = 0; h < hh; ++h) attn_softmax(scores + h * L, L, scale, round_half);
  std::fill(o, o + hh * dv, 0.f);
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    const int64_t rows = std::min(S, L - blk * S);
    const float* v;
    const int64_t ldv = value_block(pool, S, head, table, L, blk, keep, kbuf, vbuf, &v, rd);
    attn_pv_heads(hh, scores + blk * S, L, rows, v, ldv, dv, o);
  }
}

// ---- Heads in lanes: an item of hh >= MOE_W / 2 query heads takes them MOE_W at a time, one head
// per vector lane (the heads share every key row: MLA's latent, a GQA group). Same three passes,
// each lane-wise, so nothing is summed across lanes:
//   pass 1: s[t][lane] = sum_c qt[c][lane] * key[t][c]: each key element is broadcast into one FMA
//     that adds to every head (qt: the chunk's queries transposed once, [dk][MOE_W]);
//   pass 2: the softmax of attn_softmax per lane, over the tokens;
//   pass 3: ot[c][lane] = sum_t p[t][lane] * value[t][c], each value element broadcast likewise;
//     ot is transposed into o at the end.
// Values equal the row path's up to the order of the fp32 sums. A bf16 cache's rows are read in place
// by both passes (two columns a 32-bit broadcast, widened by a shift and a mask): converting them to
// fp32 first (once per sequence, or per block for long ones) took ~1/9 of the op's time, and its
// fp32 copy twice the cache's bytes in L2. With the chunk pairs below and transposes a square of lanes
// at a time (the output's element-wise gather took ~1/10), MLA op, 16 heads, bf16, Zen 3 (AVX2), cold:
// 32 x 181 tokens 1.91-1.98 -> 1.57-1.66 ms, 8 x 1,024 2.53-2.64 -> 2.28-2.46 ms.
// Register tiles: a tile of CH chunks (CH x MOE_W heads) broadcasts each key or value element once
// for the CH chunks' FMAs (an item of more than MOE_W heads, MLA's 16 or 128, takes its chunks in
// pairs): half the broadcasts and half the passes over the rows a pair of chunks took one at a time.
// bf16 rows read in place (B) hold two more registers a tile (the second column of a broadcast, and
// the mask that takes it out); AVX2's 16 registers then fit 8 accumulators for two chunks (12 spilled
// one, and its store-to-load chain held the loop to ~1/3 of its rate).
template <int CH, bool B = false>
constexpr int64_t lane_score_tokens() {  // tokens a score tile: >= 8 FMA chains in the registers left
  return MOE_W == 16 ? 12 : CH == 1 ? 8 : B ? 4 : 6;
}
template <int CH, bool B = false>
constexpr int64_t lane_pv_columns() {  // value columns a tile
  return MOE_W == 16 ? (CH == 1 ? 16 : 12) : CH == 1 ? 8 : B ? 4 : 6;
}

// s[ch * sstride + t * MOE_W : + MOE_W] = sum_c qt[ch * qstride + c * MOE_W : + MOE_W] * k[t * ldk + c]
// for TT key rows and chunks ch < CH. Lines [0, nl) of `lines` are asked for into L1, one per column
// from the first (those past dk at once). Keys KT: fp32 rows, or bf16 rows read in place (G = 1),
// two columns a 32-bit broadcast.
// G = 2: the key rows of two kv heads interleaved (k[t * ldk + 2 c + u]: kv head u's column c), each
// column's pair broadcast over the lanes (lane 2 h + u: kv head u's query head h); each lane sums the
// same products in the same order as with G = 1 (and whatever CH or KT).
template <int TT, int G = 1, int CH = 1, typename KT = float>
static inline void lanes_scores_tile(const float* __restrict qt, int64_t qstride, const KT* __restrict k,
                                     int64_t ldk, int64_t dk, float* __restrict s, int64_t sstride,
                                     const char* const* lines, int64_t nl) {
  static_assert(sizeof(KT) == 4 || G == 1, "bf16 keys are read in place one kv head at a time");
  vf acc[CH][TT];
#pragma GCC unroll 2
  for (int h = 0; h < CH; ++h)
#pragma GCC unroll 16
    for (int t = 0; t < TT; ++t) acc[h][t] = vzero();
  for (int64_t i = dk; i < nl; ++i) __builtin_prefetch(lines[i]);
  auto column = [&](int64_t c) __attribute__((always_inline)) {
    vf qv[CH];
#pragma GCC unroll 2
    for (int h = 0; h < CH; ++h) qv[h] = vload(qt + h * qstride + c * MOE_W);
#pragma GCC unroll 16
    for (int t = 0; t < TT; ++t) {
      vf kb;
      if constexpr (sizeof(KT) == 4) {
        kb = vbroadcast_n<G>(k + t * ldk + c * G);
      } else {
        const float f = to_float(k[t * ldk + c]);
        kb = vbroadcast(&f);
      }
#pragma GCC unroll 2
      for (int h = 0; h < CH; ++h) acc[h][t] = vfma(kb, qv[h], acc[h][t]);
    }
  };
  const int64_t asking = std::min(dk, nl);
  int64_t c = 0;
  if constexpr (sizeof(KT) == 2) {  // columns c and c + 1 from one load, summed in column order
    for (; c + 2 <= dk; c += 2) {
      if (c < asking) __builtin_prefetch(lines[c]);
      if (c + 1 < asking) __builtin_prefetch(lines[c + 1]);
      vf q0[CH], q1[CH];
#pragma GCC unroll 2
      for (int h = 0; h < CH; ++h) {
        q0[h] = vload(qt + h * qstride + c * MOE_W);
        q1[h] = vload(qt + h * qstride + (c + 1) * MOE_W);
      }
#pragma GCC unroll 16
      for (int t = 0; t < TT; ++t) {
        vf lo, hi;
        vbroadcast_pair(k + t * ldk + c, lo, hi);
#pragma GCC unroll 2
        for (int h = 0; h < CH; ++h) acc[h][t] = vfma(hi, q1[h], vfma(lo, q0[h], acc[h][t]));
      }
    }
  }
  for (; c < asking; ++c) {
    __builtin_prefetch(lines[c]);
    column(c);
  }
  for (; c < dk; ++c) column(c);
#pragma GCC unroll 2
  for (int h = 0; h < CH; ++h)
#pragma GCC unroll 16
    for (int t = 0; t < TT; ++t) vstore(s + h * sstride + t * MOE_W, acc[h][t]);
}

// Scores of key rows [0, n) (row t at k + t * ldk) into s [n][MOE_W] for CH chunks (chunk ch's
// queries at qt + ch * qstride, its scores at s + ch * sstride), in register tiles; lines [0, nl) of
// `lines` are asked for along the way, a share per tile.
template <int G = 1, int CH = 1, typename KT = float>
static inline void lanes_scores(const float* qt, int64_t qstride, const KT* k, int64_t ldk, int64_t dk, int64_t n,
                                float* s, int64_t sstride, const char* const* lines, int64_t nl) {
  constexpr int64_t TT = lane_score_tokens<CH, sizeof(KT) == 2>();
  const int64_t tiles = (n + TT - 1) / TT;
  const int64_t per_tile = (nl + tiles - 1) / tiles;
  for (int64_t t = 0, rows, first = 0; t < n; t += rows, first += per_tile) {
    rows = next_tile_rows(n - t, TT);
    const int64_t share = std::max<int64_t>(0, std::min(per_tile, nl - first));
    with_row_count<TT>(rows, [&](auto r) {
      lanes_scores_tile<decltype(r)::value, G, CH>(qt, qstride, k + t * ldk, ldk, dk, s + t * MOE_W, sstride,
                                                   lines + first, share);
    });
  }
}

// fn(first chunk, std::integral_constant<int, CH>) over chunks [0, n): in pairs (CH = 2), the last
// of an odd count alone (CH = 1).
template <typename Fn>
__attribute__((always_inline)) static inline void each_chunk_tile(int64_t n, Fn&& fn) {
  int64_t c = 0;
  for (; c + 2 <= n; c += 2) fn(c, std::integral_constant<int, 2>{});
  if (c < n) fn(c, std::integral_constant<int, 1>{});
}

typedef uint32_t vxu __attribute__((vector_size(MOE_W * 4)));

// round_bf16_inplace's arithmetic on every lane.
static inline vxf round_bf16_v(vxf x) {
  vxu u;
  std::memcpy(&u, &x, sizeof(u));
  const vxu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  const vxu nan = (vxu)((u & 0x7fffffffu) > 0x7f800000u);  // all ones where NaN
  const vxu r = (rounded & ~nan) | (nan & 0x7fc00000u);
  std::memcpy(&x, &r, sizeof(x));
  return x;
}

// s [L][MOE_W] -> per lane, exp(round(s) * scale - the lane's max) in place (round: to bf16 when
// round_half), attn_softmax's first two passes. Returns 1 / each lane's sum of the exponentials.
static inline vxf lanes_exp(float* s, int64_t L, float scale, bool round_half) {
  vxf x, mv;
  std::memcpy(&mv, s, sizeof(mv));
  if (round_half) mv = round_bf16_v(mv);
  for (int64_t t = 0; t < L; ++t) {
    std::memcpy(&x, s + t * MOE_W, sizeof(x));
    if (round_half) x = round_bf16_v(x), std::memcpy(s + t * MOE_W, &x, sizeof(x));
    mv = x > mv ? x : mv;
  }
  const vxf m = mv * scale;
  vxf sum = m - m;
  for (int64_t t = 0; t < L; ++t) {
    std::memcpy(&x, s + t * MOE_W, sizeof(x));
    x = exp_nonpositive_v(x * scale - m);
    std::memcpy(s + t * MOE_W, &x, sizeof(x));
    sum += x;
  }
  return 1.f / sum;
}

// s [L][MOE_W] -> per lane, attn_softmax over the L tokens (bf16 roundings when round_half).
static inline void lanes_softmax(float* s, int64_t L, float scale, bool round_half) {
  const vxf inv = lanes_exp(s, L, scale, round_half);
  vxf x;
  for (int64_t t = 0; t < L; ++t) {
    std::memcpy(&x, s + t * MOE_W, sizeof(x));
    x *= inv;
    if (round_half) x = round_bf16_v(x);
    std::memcpy(s + t * MOE_W, &x, sizeof(x));
  }
}

// A sequence's rows (keys or values) where they sit: row t at base + (table[t / S] S + t % S) stride, or
// at base + t stride without a table.
template <typename T>
struct PagedRows {
  const T* base;
  const int64_t* table;
  int64_t S, stride;
  const T* block(int64_t blk) const { return base + (table ? table[blk] : blk) * S * stride; }
};

// ot[ch * ostride + c * MOE_W : + MOE_W] += sum_{t0 <= t < t1} p[ch * pstride + t * MOE_W : + MOE_W] * v[t][c]
// for the NC columns [c0, c0 + NC) and chunks ch < CH, v[t] row t of `rows` (t0 a multiple of its S).
// Values VT: fp32, or bf16 read in place (G = 1), two columns a 32-bit broadcast. G = 2: the value
// rows of two kv heads interleaved, as lanes_scores_tile's keys.
template <int NC, int G = 1, int CH = 1, typename VT = float>
static inline void lanes_pv_tile(const float* __restrict p, int64_t pstride, int64_t t0, int64_t t1,
                                 const PagedRows<VT>& rows, int64_t c0, float* __restrict ot, int64_t ostride) {
  static_assert(sizeof(VT) == 4 || G == 1, "bf16 values are read in place one kv head at a time");
  vf acc[CH][NC];
#pragma GCC unroll 2
  for (int h = 0; h < CH; ++h)
#pragma GCC unroll 16
    for (int j = 0; j < NC; ++j) acc[h][j] = vload(ot + h * ostride + (c0 + j) * MOE_W);
  for (int64_t b = t0; b < t1; b += rows.S) {
    const VT* __restrict v = rows.block(b / rows.S) + c0 * G;
    for (int64_t t = b, end = std::min(t1, b + rows.S); t < end; ++t, v += rows.stride) {
      vf pv[CH];
#pragma GCC unroll 2
      for (int h = 0; h < CH; ++h) pv[h] = vload(p + h * pstride + t * MOE_W);
      int j = 0;
      if constexpr (sizeof(VT) == 2) {
#pragma GCC unroll 8
        for (; j + 2 <= NC; j += 2) {
          vf lo, hi;
          vbroadcast_pair(v + j, lo, hi);
#pragma GCC unroll 2
          for (int h = 0; h < CH; ++h) {
            acc[h][j] = vfma(lo, pv[h], acc[h][j]);
            acc[h][j + 1] = vfma(hi, pv[h], acc[h][j + 1]);
          }
        }
      }
#pragma GCC unroll 16
      for (; j < NC; ++j) {
        vf vb;
        if constexpr (sizeof(VT) == 4) {
          vb = vbroadcast_n<G>(v + j * G);
        } else {
          const float f = to_float(v[j]);
          vb = vbroadcast(&f);
        }
#pragma GCC unroll 2
        for (int h = 0; h < CH; ++h) acc[h][j] = vfma(vb, pv[h], acc[h][j]);
      }
    }
  }
#pragma GCC unroll 2
  for (int h = 0; h < CH; ++h)
#pragma GCC unroll 16
    for (int j = 0; j < NC; ++j) vstore(ot + h * ostride + (c0 + j) * MOE_W, acc[h][j]);
}

// lanes_pv_tile over every column [0, dv), for CH chunks and tokens [t0, t1).
template <int G = 1, int CH = 1, typename VT = float>
static inline void lanes_pv(const float* p, int64_t pstride, int64_t t0, int64_t t1, const PagedRows<VT>& rows,
                            int64_t dv, float* ot, int64_t ostride) {
  constexpr int64_t NC = lane_pv_columns<CH, sizeof(VT) == 2>();
  int64_t c = 0;
  for (; c + NC <= dv; c += NC) lanes_pv_tile<NC, G, CH>(p, pstride, t0, t1, rows, c, ot, ostride);
  for (; c + 4 <= dv; c += 4) lanes_pv_tile<4, G, CH>(p, pstride, t0, t1, rows, c, ot, ostride);
  for (; c < dv; ++c) lanes_pv_tile<1, G, CH>(p, pstride, t0, t1, rows, c, ot, ostride);
}
// The same over T contiguous fp32 rows (row t at v + t * ldv).
template <int G = 1, int CH = 1>
static inline void lanes_pv(const float* p, int64_t pstride, int64_t T, const float* v, int64_t ldv, int64_t dv,
                            float* ot, int64_t ostride) {
  lanes_pv<G, CH>(p, pstride, 0, T, PagedRows<float>{v, nullptr, std::max<int64_t>(T, 1), ldv}, dv, ot, ostride);
}

// dst[c * ldd + h] = src[h * lds + c] for h < rows (<= MOE_W), c < cols: rows of a chunk's heads into
// its lanes (the transposed queries), whole squares of lanes at a time where all MOE_W rows are there.
static inline void transpose_lanes(const float* src, int64_t lds, int64_t rows, int64_t cols, float* dst, int64_t ldd) {
  int64_t c = 0;
  if (rows == MOE_W)
    for (; c + MOE_W <= cols; c += MOE_W) vtranspose(src + c, lds, dst + c * ldd, ldd);
  for (int64_t h = 0; h < rows; ++h)
    for (int64_t i = c; i < cols; ++i) dst[i * ldd + h] = src[h * lds + i];
}
// The way back: dst[h * ldd + c] = src[c * lds + h] for h < rows (<= MOE_W), c < cols.
static inline void transposed_lanes(const float* src, int64_t lds, int64_t rows, int64_t cols, float* dst,
                                    int64_t ldd) {
  int64_t c = 0;
  if (rows == MOE_W)
    for (; c + MOE_W <= cols; c += MOE_W) vtranspose(src + c * lds, lds, dst + c, ldd);
  for (int64_t h = 0; h < rows; ++h)
    for (int64_t i = c; i < cols; ++i) dst[h * ldd + i] = src[i * lds + h];
}

// A chunk's hc (<= MOE_W) query heads q [hc][dk] into its lanes: qt [dk][MOE_W] (lanes past hc zero),
// and the rest of its per_chunk floats (the transposed outputs, after dk * MOE_W) zeroed.
static inline void queries_into_lanes(const float* q, int64_t hc, int64_t dk, float* qt, int64_t per_chunk) {
  std::fill(qt + (hc == MOE_W ? dk * MOE_W : 0), qt + per_chunk, 0.f);
  transpose_lanes(q, dk, hc, dk, qt, MOE_W);
}

// Tokens a bf16 value pass takes at a time: a column tile's walk over them touches one line a row, and
// the next tiles find those lines in L1.
constexpr int64_t LANE_PV_SEGMENT = 128;

// paged_decode_item with the heads in lanes (hh >= MOE_W / 2). Scratch: scores [chunks][L][MOE_W]
// (chunks = hh rounded up to MOE_W, / MOE_W); lanes [chunks][dk + dv][MOE_W] (the transposed
// queries, then the transposed outputs); kbuf and vbuf as paged_decode_item's.
template <typename PT>
static void paged_decode_lanes(const float* q, int64_t hh, const PT* pool, int64_t S, const PagedHead& head,
                               const int64_t* table, int64_t L, float scale, bool round_half, float* scores,
                               float* lanes, float* kbuf, float* vbuf, float* o, const NextItem& next,
                               const Fp8Read* rd) {
  const int64_t nblocks = (L + S - 1) / S, dk = head.dk, dv = head.dv;
  const int64_t chunks = (hh + MOE_W - 1) / MOE_W, per_chunk = (dk + dv) * MOE_W;
  const bool keep = sizeof(PT) != 2 && keeps_rows<PT>(head, L);  // (a bf16 cache is read in place)
  for (int64_t ch = 0; ch < chunks; ++ch)
    queries_into_lanes(q + ch * MOE_W * dk, std::min<int64_t>(MOE_W, hh - ch * MOE_W), dk, lanes + ch * per_chunk,
                       per_chunk);
  // pass 1, block by block while the next block's keys and a share of the next item's first L rows
  // are asked for (spread over the first chunk's score tiles): a bf16 block's rows read in place, an
  // fp8 one's converted once for every chunk
  const int64_t stride = head.token_stride;
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    const int64_t rows = std::min(S, L - blk * S);
    TileLines ask;
    auto scores_of = [&](const auto* k, int64_t ldk) {
      ask.add_next_share(pool, S, next, L, blk, nblocks);
      each_chunk_tile(chunks, [&](int64_t ch, auto n) {  // the later chunks ask for nothing
        lanes_scores<1, decltype(n)::value>(lanes + ch * per_chunk, per_chunk, k, ldk, dk, rows,
                                            scores + (ch * L + blk * S) * MOE_W, L * MOE_W, ask.line, ch ? 0 : ask.n);
      });
    };
    if constexpr (sizeof(PT) == 2) {
      ask_next_keys(pool, S, head, table, L, blk, &ask);
      scores_of(PagedRows<PT>{pool + head.k_off, table, S, stride}.block(blk), stride);
    } else {
      const float* k;
      const int64_t ldk = key_block(pool, S, head, table, L, blk, keep, kbuf, &k, rd, &ask);
      scores_of(k, ldk);
    }
  }
  prefetch_next_query(next);
  for (int64_t ch = 0; ch < chunks; ++ch) lanes_softmax(scores + ch * L * MOE_W, L, scale, round_half);
  // pass 3
  if constexpr (sizeof(PT) == 2) {  // LANE_PV_SEGMENT tokens at a time, each column tile's rows staying in L1
    const PagedRows<PT> values{pool + head.v_off, table, S, stride};
    const int64_t segment = std::max(S, LANE_PV_SEGMENT / S * S);
    for (int64_t t0 = 0; t0 < L; t0 += segment)
      each_chunk_tile(chunks, [&](int64_t ch, auto n) {
        lanes_pv<1, decltype(n)::value>(scores + ch * L * MOE_W, L * MOE_W, t0, std::min(L, t0 + segment), values, dv,
                                        lanes + ch * per_chunk + dk * MOE_W, per_chunk);
      });
  } else if (keep) {
    each_chunk_tile(chunks, [&](int64_t ch, auto n) {
      lanes_pv<1, decltype(n)::value>(scores + ch * L * MOE_W, L * MOE_W, L, kbuf, dk, dv,
                                      lanes + ch * per_chunk + dk * MOE_W, per_chunk);
    });
  } else {
    for (int64_t blk = 0; blk < nblocks; ++blk) {
      const int64_t rows = std::min(S, L - blk * S);
      const float* v;
      const int64_t ldv = value_block(pool, S, head, table, L, blk, false, kbuf, vbuf, &v, rd);
      each_chunk_tile(chunks, [&](int64_t ch, auto n) {
        lanes_pv<1, decltype(n)::value>(scores + (ch * L + blk * S) * MOE_W, L * MOE_W, rows, v, ldv, dv,
                                        lanes + ch * per_chunk + dk * MOE_W, per_chunk);
      });
    }
  }
  for (int64_t ch = 0; ch < chunks; ++ch) {
    const float* ot = lanes + ch * per_chunk + dk * MOE_W;
    const int64_t hc = std::min<int64_t>(MOE_W, hh - ch * MOE_W);
    transposed_lanes(ot, MOE_W, hc, dv, o + ch * MOE_W * dv, dv);
  }
}

// Kv heads serving at least this many query heads take the lanes (fewer leave most lanes idle: the
// row path's full-width dot products win there). Decided by the kv head's query heads, not by an
// item's share of them (which follows the thread count): the two paths sum in different orders, and a
// head's values must not depend on how many threads ran the step.
constexpr int64_t LANE_MIN_HEADS = MOE_W / 2;

// ---- GQA items of several kv heads. A GQA key (value) row holds every kv head's key (value): an item
// per kv head read a quarter of each row's lines (4 kv heads), at the row's stride, and most of its
// time on cold rows went to the loads of its block conversions. An item here takes kv heads [0, groups)
// of one sequence, block by block: each block's part of every kv head in turn (converted to fp32 a kv
// head at a time, which stays in L1), while the next block's rows are asked for into L2, spread over
// the conversions. Each kv head's query heads run the per-kv-head item's tiles (the row path, or the
// lanes from LANE_MIN_HEADS heads a kv head) on its part, in the same order: the same bits as one item
// per kv head. The row path reads a bf16 pool's rows in place (its tiles widen them): cold, AVX2 (Zen
// 3), 32 sequences x 2,048 tokens, 4 kv heads of 64, the op took 0.90-0.95x the time at 2 query heads a
// kv head and 0.88-0.96x at 3; 0.67-0.85x at one (8 x 2,048, 8 kv heads). The lanes keep converting:
// read in place, one chunk of heads (5-8 query heads a kv head on AVX2) spends a shift and a mask per
// two FMAs, and took 0.78-1.03x the time, 1.02-1.06x in whole steps.
// What bounded these items on long sequences was the pool's layout while each token row held its keys,
// then its values ([N, S, 2, Hkv, hd]): each pass read half of every row. A scratch C program on the same
// core read 67 MB of such rows (random 16 KB blocks, huge pages) in 8.2-8.8 ms as two half-row passes,
// in 5.7-6.1 ms had each block held its keys, then its values, contiguously (the pool's layout since:
// PagedHead), in 5.2-5.6 ms as one pass over whole rows. With that layout the passes read each block's
// keys, then its values, as contiguous runs: the op took 0.81-0.89x the time at 2-4 query heads a kv head
// (32 x 2,048 tokens, 4 kv heads of 64), asking 16 tokens ahead (one block of 16) in both passes: at 4
// query heads a kv head 9.9-10.2 ms, against 10.2-11.2 asking 32-128 tokens ahead and 12.5-12.9 asking
// for the block being read. MHA with rows of 768 B to 1 KB (6 or 8 kv heads of 64, 4 of 128) took
// 1.01-1.16x, for reasons not found; with rows of 512 B, 2 KB or 4 KB 0.84-1.00x (docs/benchmarks.md, "a
// GQA cache block holds its keys, then its values").
constexpr int64_t KV_HEADS_ROWS_AHEAD = 16;  // tokens ahead whose rows the score pass asks for
constexpr int64_t KV_HEADS_VALUES_AHEAD = 16;  // tokens ahead whose values the value pass asks for

// Share `part` of `parts` of the lines of rows [0, rows) (row r at src + r * stride, `bytes` from
// there) asked for into L2.
template <typename PT>
static inline void ask_share_l2(const PT* src, int64_t rows, int64_t stride, int64_t bytes, int64_t part,
                                int64_t parts) {
  const int64_t lines = (bytes + 63) / 64, l0 = part * lines / parts, l1 = (part + 1) * lines / parts;
  for (int64_t r = 0; r < rows; ++r) {
    const char* p = reinterpret_cast<const char*>(src + r * stride);
    for (int64_t l = l0; l < l1; ++l) __builtin_prefetch(p + 64 * l, 0, 2);
  }
}

// fn(r) for rows [0, rows), with share part of parts of rows [0, ask_rows) at ask (ask_bytes each,
// stride apart) asked for into L2 along the way: one row's share before each fn, the rest after.
template <typename PT, typename Fn>
__attribute__((always_inline)) static inline void each_row_asking(int64_t rows, int64_t stride, const PT* ask,
                                                                  int64_t ask_rows, int64_t ask_bytes, int64_t part,
                                                                  int64_t parts, Fn&& fn) {
  for (int64_t r = 0; r < rows; ++r) {
    if (r < ask_rows) ask_share_l2(ask + r * stride, 1, 0, ask_bytes, part, parts);
    fn(r);
  }
  if (ask_rows > rows) ask_share_l2(ask + rows * stride, ask_rows - rows, stride, ask_bytes, part, parts);
}

// Rows [0, rows) of a block's part (row r at src + r * stride, width wide) as fp32, as rows_f32, with
// share part of parts of rows [0, ask_rows) at ask (ask_bytes each) asked for into L2 along the way,
// one row's share per row converted (row_f32: an fp8 pool's as rd says).
template <typename PT>
static inline int64_t rows_f32_asking(const PT* src, int64_t rows, int64_t width, int64_t stride, float* buf,
                                      const float** out, const PT* ask, int64_t ask_rows, int64_t ask_bytes,
                                      int64_t part, int64_t parts, const Fp8Read* rd) {
  if constexpr (sizeof(PT) == 4) {
    ask_share_l2(ask, ask_rows, stride, ask_bytes, part, parts);
    return rows_f32(src, rows, width, stride, buf, out);
  } else {
    each_row_asking(rows, stride, ask, ask_rows, ask_bytes, part, parts,
                    [&](int64_t r) { row_f32(src + r * stride, width, buf + r * width, rd); });
    *out = buf;
    return width;
  }
}

// Rows [0, rows) of two kv heads' parts (row r at a + r * stride and b + r * stride, width wide) as
// fp32 pairs, dst[(r * width + c) * 2 + u] = column c of part u, with share part of parts of rows [0,
// ask_rows) at ask (ask_bytes each) asked for into L2 along the way (rows_f32_asking's asks). An fp8
// pool's two rows convert (as rd says) FP8_PAIR_COLUMNS columns at a time, then pair.
constexpr int64_t FP8_PAIR_COLUMNS = 256;
template <typename PT>
static inline void rows_paired_asking(const PT* a, const PT* b, int64_t rows, int64_t width, int64_t stride,
                                      float* dst, const PT* ask, int64_t ask_rows, int64_t ask_bytes, int64_t part,
                                      int64_t parts, const Fp8Read* rd) {
  vxi lo, hi;  // interleave masks: lanes j of a and b into lanes 2 j, 2 j + 1
  for (int j = 0; j < MOE_W; ++j) {
    lo[j] = j / 2 + (j % 2) * MOE_W;
    hi[j] = MOE_W / 2 + j / 2 + (j % 2) * MOE_W;
  }
  const auto pair = [&](const auto* ra, const auto* rb, int64_t n, float* d) {  // n columns
    int64_t c = 0;
    for (; c + MOE_W <= n; c += MOE_W) {
      const vf va = vload(ra + c), vb = vload(rb + c);
      vxf xa, xb;
      std::memcpy(&xa, &va, sizeof(xa));
      std::memcpy(&xb, &vb, sizeof(xb));
      const vxf l = __builtin_shuffle(xa, xb, lo), h = __builtin_shuffle(xa, xb, hi);
      std::memcpy(d + 2 * c, &l, sizeof(l));
      std::memcpy(d + 2 * c + MOE_W, &h, sizeof(h));
    }
    for (; c < n; ++c) d[2 * c] = to_float(ra[c]), d[2 * c + 1] = to_float(rb[c]);
  };
  each_row_asking(rows, stride, ask, ask_rows, ask_bytes, part, parts, [&](int64_t r) __attribute__((always_inline)) {
    float* d = dst + r * width * 2;
    if constexpr (std::is_same_v<PT, uint8_t>) {
      alignas(64) float fa[FP8_PAIR_COLUMNS], fb[FP8_PAIR_COLUMNS];
      for (int64_t c0 = 0; c0 < width; c0 += FP8_PAIR_COLUMNS) {
        const int64_t n = std::min(FP8_PAIR_COLUMNS, width - c0);
        e4m3_row_f32(a + r * stride + c0, n, fa, *rd);
        e4m3_row_f32(b + r * stride + c0, n, fb, *rd);
        pair(fa, fb, n, d + 2 * c0);
      }
    } else {
      pair(a + r * stride, b + r * stride, width, d);
    }
  });
}

// Where the kv-heads items' rows lie: kv heads [0, groups) of a sequence of L tokens (table: its
// blocks of S), and the spans they ask for into L2: in the score pass whole rows while the sequence's
// rows fit KV_HEADS_WHOLE_ROWS_BYTES (the values then wait in L2 for the value pass): a token row's span
// from the keys' or values' start to the end of the other's, or where the values sit in their own rows
// (a GQA pool: a block's S value rows follow its key rows) the spans of the block's key rows and the
// value rows after them (score_extra = S rows more an ask); else the keys' span only (the values would be
// gone from L2 before the value pass came to them, and asked for again); the values' span in the value
// pass.
constexpr int64_t KV_HEADS_WHOLE_ROWS_BYTES = 512 << 10;
template <typename PT>
struct KvHeadRows {
  const PT* pool;
  const int64_t* table;
  int64_t S, L, stride, nblocks, score_lo, score_bytes, score_extra, value_bytes;
  KvHeadRows(const PT* pool_, int64_t S_, const PagedHead& head, int64_t kv_stride, int64_t groups,
             const int64_t* table_, int64_t L_)
      : pool(pool_), table(table_), S(S_), L(L_), stride(head.token_stride), nblocks((L_ + S_ - 1) / S_) {
    const int64_t elem = sizeof(PT), span = (groups - 1) * kv_stride;
    const bool apart = head.blocks > 1;  // values S rows after their keys, at their offset (PagedHead)
    const int64_t row_lo = apart ? head.k_off : std::min(head.k_off, head.v_off);
    const int64_t row_bytes =
        apart ? (span + std::max(head.dk, head.dv)) * elem
              : (std::max(head.k_off + span + head.dk, head.v_off + span + head.dv) - row_lo) * elem;
    const bool whole = L * row_bytes * (apart ? 2 : 1) <= KV_HEADS_WHOLE_ROWS_BYTES;
    score_lo = whole ? row_lo : head.k_off;
    score_bytes = whole ? row_bytes : (span + head.dk) * elem;
    score_extra = whole && apart ? S_ : 0;
    value_bytes = (span + head.dv) * elem;
  }
  const PT* block(int64_t blk) const { return pool + table[blk] * S * stride; }
  int64_t rows(int64_t blk) const { return blk < nblocks ? std::min(S, L - blk * S) : int64_t{0}; }
  // A pass over the blocks: the first blocks' spans (off, bytes from each row's start; `extra` rows past
  // each block's) `tokens` ahead asked for at once, then fn(blk, block rows, ask, ask_rows) for each
  // block, where block blk + ahead's ask_rows spans start at ask (null past the last block) for fn to ask
  // for while it reads block blk.
  template <typename Fn>
  void each_block(int64_t tokens, int64_t off, int64_t bytes, int64_t extra, Fn&& fn) const {
    const int64_t ahead = (tokens + S - 1) / S;
    for (int64_t blk = 0; blk < std::min(ahead, nblocks); ++blk)
      ask_share_l2(block(blk) + off, rows(blk) + extra, stride, bytes, 0, 1);
    for (int64_t blk = 0; blk < nblocks; ++blk) {
      const int64_t ask_rows = rows(blk + ahead);
      fn(blk, rows(blk), ask_rows ? block(blk + ahead) + off : nullptr, ask_rows ? ask_rows + extra : 0);
    }
  }
};

// The kv-heads items' lanes (rep >= LANE_MIN_HEADS query heads a kv head): each vector holds G kv
// heads' query heads, lane h G + u taking kv head u's query head h of the vector's head chunk. G = 1:
// a kv head's heads MOE_W at a time, its rows converted to fp32 (rows_f32_asking); G = 2, for rep =
// MOE_W / 2 (8 on AVX-512, 4 on AVX2), where one kv head would leave half of each vector idle: two kv
// heads' rows converted into pairs (rows_paired_asking; an odd count's last pair reads its one kv head
// twice, the second's queries zero and its outputs dropped). Each lane sums the same products in the
// same order whatever G: the bits of one kv head a vector. Arguments and scratch as
// paged_decode_kv_heads'.
template <int G, typename PT>
static void paged_decode_kv_lanes(const float* q, int64_t groups, int64_t rep, const PT* pool, int64_t S,
                                  const PagedHead& head, int64_t kv_stride, const int64_t* table, int64_t L,
                                  float scale, bool round_half, float* scores, float* lanes, float* kbuf, float* vbuf,
                                  float* o, const Fp8Read* rd) {
  const KvHeadRows<PT> r(pool, S, head, kv_stride, groups, table, L);
  const int64_t dk = head.dk, dv = head.dv, stride = head.token_stride, per_unit = (dk + dv) * MOE_W;
  constexpr int64_t HEADS = MOE_W / G;  // query heads of one kv head a vector
  const int64_t sets = (groups + G - 1) / G, chunks = (rep + HEADS - 1) / HEADS, units = sets * chunks;
  // unit c: kv heads [G (c / chunks), + G) and their query heads [(c % chunks) HEADS, + HEADS)
  auto kv_head = [&](int64_t c, int64_t u) { return std::min(G * (c / chunks) + u, groups - 1); };
  auto real = [&](int64_t c, int64_t u) { return G * (c / chunks) + u < groups; };
  auto chunk_heads = [&](int64_t c) { return std::min(HEADS, rep - c % chunks * HEADS); };
  for (int64_t c = 0; c < units; ++c) {  // qt [dk][MOE_W], zero past the unit's heads; ot zeroed
    float* qt = lanes + c * per_unit;
    if constexpr (G == 1) {
      queries_into_lanes(q + (kv_head(c, 0) * rep + c % chunks * HEADS) * dk, chunk_heads(c), dk, qt, per_unit);
      continue;
    }
    std::fill(qt, qt + per_unit, 0.f);
    for (int64_t u = 0; u < G && real(c, u); ++u)
      for (int64_t h = 0; h < chunk_heads(c); ++h)
        for (int64_t i = 0; i < dk; ++i)
          qt[i * MOE_W + h * G + u] = q[(kv_head(c, u) * rep + c % chunks * HEADS + h) * dk + i];
  }
  // set s's rows of the block at part (keys or values, width wide) as fp32 (G = 2: pairs) with its share
  // of the asks; returns their stride
  auto convert = [&](const PT* part, int64_t rows, int64_t width, int64_t s, float* buf, const float** out,
                     const PT* ask, int64_t ask_rows, int64_t ask_bytes) -> int64_t {
    if constexpr (G == 1) {
      return rows_f32_asking(part + s * kv_stride, rows, width, stride, buf, out, ask, ask_rows, ask_bytes, s, sets,
                             rd);
    } else {
      rows_paired_asking(part + kv_head(s * chunks, 0) * kv_stride, part + kv_head(s * chunks, 1) * kv_stride, rows,
                         width, stride, buf, ask, ask_rows, ask_bytes, s, sets, rd);
      *out = buf;
      return 2 * width;
    }
  };
  r.each_block(KV_HEADS_ROWS_AHEAD, r.score_lo, r.score_bytes, r.score_extra,
               [&](int64_t blk, int64_t rows, const PT* ask, int64_t ask_rows) {
    for (int64_t s = 0; s < sets; ++s) {
      const float* k;
      const int64_t ldk = convert(r.block(blk) + head.k_off, rows, dk, s, kbuf, &k, ask, ask_rows, r.score_bytes);
      each_chunk_tile(chunks, [&](int64_t c, auto n) {
        lanes_scores<G, decltype(n)::value>(lanes + (s * chunks + c) * per_unit, per_unit, k, ldk, dk, rows,
                                            scores + ((s * chunks + c) * L + blk * S) * MOE_W, L * MOE_W, nullptr, 0);
      });
    }
  });
  for (int64_t c = 0; c < units; ++c) lanes_softmax(scores + c * L * MOE_W, L, scale, round_half);
  r.each_block(KV_HEADS_VALUES_AHEAD, head.v_off, r.value_bytes, 0,
               [&](int64_t blk, int64_t rows, const PT* ask, int64_t ask_rows) {
    for (int64_t s = 0; s < sets; ++s) {
      const float* v;
      const int64_t ldv = convert(r.block(blk) + head.v_off, rows, dv, s, vbuf, &v, ask, ask_rows, r.value_bytes);
      each_chunk_tile(chunks, [&](int64_t c, auto n) {
        lanes_pv<G, decltype(n)::value>(scores + ((s * chunks + c) * L + blk * S) * MOE_W, L * MOE_W, rows, v, ldv,
                                        dv, lanes + (s * chunks + c) * per_unit + dk * MOE_W, per_unit);
      });
    }
  });
  for (int64_t c = 0; c < units; ++c) {
    const float* ot = lanes + c * per_unit + dk * MOE_W;
    if constexpr (G == 1) {
      transposed_lanes(ot, MOE_W, chunk_heads(c), dv, o + (kv_head(c, 0) * rep + c % chunks * HEADS) * dv, dv);
      continue;
    }
    for (int64_t u = 0; u < G && real(c, u); ++u)
      for (int64_t h = 0; h < chunk_heads(c); ++h)
        for (int64_t i = 0; i < dv; ++i)
          o[(kv_head(c, u) * rep + c % chunks * HEADS + h) * dv + i] = ot[i * MOE_W + h * G + u];
  }
}

// q: [groups * rep, dk] fp32 rows (kv head g's query heads at rows g * rep ...); kv head g's key and
// value at head's offsets + g * kv_stride; pool / S / table / L / scale / round_half as
// paged_decode_item's. Scratch: scores [groups * rep, L] (lanes: [units][L][MOE_W], units = kv heads
// a vector's worth at a time times their head chunks: at most groups x (rep rounded up to MOE_W) /
// MOE_W); lanes [units][dk + dv][MOE_W] (the lanes only); kbuf [S, dk, 2]; vbuf [S, dv, 2]. o: [groups
// * rep, dv] fp32 output. Fewer than LANE_MIN_HEADS heads a kv head take the row path's tiles.
template <typename PT>
static void paged_decode_kv_heads(const float* q, int64_t groups, int64_t rep, const PT* pool, int64_t S,
                                  const PagedHead& head, int64_t kv_stride, const int64_t* table, int64_t L,
                                  float scale, bool round_half, float* scores, float* lanes, float* kbuf, float* vbuf,
                                  float* o, const Fp8Read* rd) {
  if (rep >= LANE_MIN_HEADS) {
    if (rep == MOE_W / 2)
      paged_decode_kv_lanes<2>(q, groups, rep, pool, S, head, kv_stride, table, L, scale, round_half, scores, lanes,
                               kbuf, vbuf, o, rd);
    else
      paged_decode_kv_lanes<1>(q, groups, rep, pool, S, head, kv_stride, table, L, scale, round_half, scores, lanes,
                               kbuf, vbuf, o, rd);
    return;
  }
  const KvHeadRows<PT> r(pool, S, head, kv_stride, groups, table, L);
  const int64_t dk = head.dk, dv = head.dv, stride = head.token_stride;
  // fn(g, kv head g's rows of the block at part (keys or values, width wide), their stride) for every kv
  // head g, with share g of the asks: a bf16 pool's rows read in place (the tiles widen them), others
  // converted to fp32 into buf
  auto each_head = [&](const PT* part, int64_t rows, int64_t width, float* buf, const PT* ask, int64_t ask_rows,
                       int64_t ask_bytes, auto&& fn) __attribute__((always_inline)) {
    for (int64_t g = 0; g < groups; ++g) {
      if constexpr (std::is_same_v<PT, uint16_t>) {
        ask_share_l2(ask, ask_rows, stride, ask_bytes, g, groups);
        fn(g, part + g * kv_stride, stride);
      } else {
        const float* f;
        const int64_t ld = rows_f32_asking(part + g * kv_stride, rows, width, stride, buf, &f, ask, ask_rows,
                                           ask_bytes, g, groups, rd);
        fn(g, f, ld);
      }
    }
  };
  r.each_block(KV_HEADS_ROWS_AHEAD, r.score_lo, r.score_bytes, r.score_extra,
               [&](int64_t blk, int64_t rows, const PT* ask, int64_t ask_rows) {
    each_head(r.block(blk) + head.k_off, rows, dk, kbuf, ask, ask_rows, r.score_bytes,
              [&](int64_t g, const auto* k, int64_t ldk) {
                const float* qg = q + g * rep * dk;
                float* sg = scores + g * rep * L + blk * S;
                attn_dot_rows(rep, qg, dk, k, ldk, dk, rows, sg, L);
              });
  });
  for (int64_t h = 0; h < groups * rep; ++h) attn_softmax(scores + h * L, L, scale, round_half);
  std::fill(o, o + groups * rep * dv, 0.f);
  r.each_block(KV_HEADS_VALUES_AHEAD, head.v_off, r.value_bytes, 0,
               [&](int64_t blk, int64_t rows, const PT* ask, int64_t ask_rows) {
    each_head(r.block(blk) + head.v_off, rows, dv, vbuf, ask, ask_rows, r.value_bytes,
              [&](int64_t g, const auto* v, int64_t ldv) {
                attn_pv_heads(rep, scores + g * rep * L + blk * S, L, rows, v, ldv, dv, o + g * rep * dv);
              });
  });
}

// ---- Prefill (several new rows of one sequence, causal). An item is one kv head of one sequence
// and a group of its query heads. Its keys are converted to fp32 once, transposed (kt [dk][L +
// MOE_W]: one row per key column, zero past L), and its values row by row (vbuf [L][dv]). Each tile
// of PREFILL_TILE query rows of each head then makes three passes:
//   scores s[r][t] = q[r] . key[t], the keys in vector lanes: each query element is broadcast into
//     one FMA per MOE_W keys, and a key column load serves all the tile's rows;
//   per row, attn_softmax over exactly the keys the row sees (t <= its position and, with a window
//     w > 0, t > position - w); the tile's other keys get probability 0;
//   o[r] = sum_t p[r][t] value[t], the value columns in lanes (prefill_pv).
// Values equal the masked sdpa's up to the order of the fp32 sums.
constexpr int PREFILL_ROWS = MOE_W == 16 ? 6 : 3;  // a register tile: rows x vectors of accumulators
constexpr int PREFILL_VECS = MOE_W == 16 ? 4 : 3;
constexpr int64_t PREFILL_TILE = 4 * PREFILL_ROWS;  // query rows per tile: every key chunk loaded serves them all
static_assert(MOE_W <= PREFILL_MAX_LANES && PREFILL_TILE <= PREFILL_MAX_TILE,
              "paged_prefill sizes each item's scratch for at most PREFILL_MAX_LANES lanes and PREFILL_MAX_TILE rows");

// kt[c * ldt + t0 + r] = column c of row r (at src + r * stride), fp32, for rows [0, rows).
template <typename PT>
static inline void rows_transposed(const PT* src, int64_t rows, int64_t width, int64_t stride, float* kt,
                                   int64_t ldt, int64_t t0) {
  for (int64_t c = 0; c < width; ++c) {
    float* d = kt + c * ldt + t0;
    for (int64_t r = 0; r < rows; ++r) d[r] = to_float(src[r * stride + c]);
  }
}

// The register tile both prefill passes run: acc[r][j] = sum_{i < steps} row(i, r) * vec(i, j) over
// RR broadcast row values and NC vectors per step, in step order.
template <int RR, int NC, typename Row, typename Vec>
__attribute__((always_inline)) static inline void rows_by_vectors(int64_t steps, Row&& row, Vec&& vec,
                                                                  vf (&acc)[RR][NC]) {
#pragma GCC unroll 8
  for (int r = 0; r < RR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NC; ++j) acc[r][j] = vzero();
  for (int64_t i = 0; i < steps; ++i) {
    vf vv[NC];
#pragma GCC unroll 4
    for (int j = 0; j < NC; ++j) vv[j] = vec(i, j);
#pragma GCC unroll 8
    for (int r = 0; r < RR; ++r) {
      const vf rb = row(i, r);
#pragma GCC unroll 4
      for (int j = 0; j < NC; ++j) acc[r][j] = vfma(rb, vv[j], acc[r][j]);
    }
  }
}

// s[r * lds + j] = sum_c q[r * dk + c] * kt[c * ldt + j] for RR rows and keys j in [0, NC * MOE_W).
template <int RR, int NC>
static inline void prefill_scores_tile(const float* __restrict q, int64_t dk, const float* __restrict kt, int64_t ldt,
                                       float* __restrict s, int64_t lds) {
  vf acc[RR][NC];
  rows_by_vectors<RR, NC>(
      dk, [&](int64_t c, int r) { return vbroadcast(q + r * dk + c); },
      [&](int64_t c, int j) { return vload(kt + c * ldt + j * MOE_W); }, acc);
#pragma GCC unroll 8
  for (int r = 0; r < RR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NC; ++j) vstore(s + r * lds + j * MOE_W, acc[r][j]);
}

// Scores of rows [0, nr) against keys [0, n) rounded up to MOE_W (kt's columns exist there): key
// chunks outermost, so a chunk's key columns stay in L1 for every row group of the tile.
static inline void prefill_scores(const float* q, int64_t nr, int64_t dk, const float* kt, int64_t ldt, int64_t n,
                                  float* s, int64_t lds) {
  for (int64_t t = 0, width; t < n; t += width) {
    width = t + PREFILL_VECS * MOE_W <= n ? PREFILL_VECS * MOE_W : MOE_W;
    for (int64_t r = 0, rows; r < nr; r += rows) {
      rows = std::min<int64_t>(PREFILL_ROWS, nr - r);
      with_row_count<PREFILL_ROWS>(rows, [&](auto rr) {
        constexpr int RR = decltype(rr)::value;
        if (width == MOE_W) prefill_scores_tile<RR, 1>(q + r * dk, dk, kt + t, ldt, s + r * lds + t, lds);
        else prefill_scores_tile<RR, PREFILL_VECS>(q + r * dk, dk, kt + t, ldt, s + r * lds + t, lds);
      });
    }
  }
}

template <typename PT>
static inline void store_row(PT* o, const vf& x) {
  alignas(64) float tmp[MOE_W];
  vstore(tmp, x);
  for (int i = 0; i < MOE_W; ++i) store_value(o + i, tmp[i]);
}

// o[r * ldo + j] = sum_{t < n} p[r * lds + t] * v[t * ldv + j] for RR rows and columns j in [0, NC *
// MOE_W), written in PT (bf16 rounded): each value row is read whole and in order.
template <int RR, int NC, typename PT>
static inline void prefill_pv_tile(const float* __restrict p, int64_t lds, int64_t n, const float* __restrict v,
                                   int64_t ldv, PT* __restrict o, int64_t ldo) {
  vf acc[RR][NC];
  rows_by_vectors<RR, NC>(
      n, [&](int64_t t, int r) { return vbroadcast(p + r * lds + t); },
      [&](int64_t t, int j) { return vload(v + t * ldv + j * MOE_W); }, acc);
  for (int r = 0; r < RR; ++r)
    for (int j = 0; j < NC; ++j) store_row(o + r * ldo + j * MOE_W, acc[r][j]);
}

// The tile's outputs over all dv columns (pass 3); columns past the last whole vector one by one.
template <int RR, typename PT>
static inline void prefill_pv(const float* p, int64_t lds, int64_t n, const float* v, int64_t ldv, int64_t dv, PT* o,
                              int64_t ldo) {
  int64_t c = 0;
  for (; c + PREFILL_VECS * MOE_W <= dv; c += PREFILL_VECS * MOE_W)
    prefill_pv_tile<RR, PREFILL_VECS>(p, lds, n, v + c, ldv, o + c, ldo);
  for (; c + MOE_W <= dv; c += MOE_W) prefill_pv_tile<RR, 1>(p, lds, n, v + c, ldv, o + c, ldo);
  for (; c < dv; ++c)
    for (int r = 0; r < RR; ++r) {
      float sum = 0.f;
      for (int64_t t = 0; t < n; ++t) sum = sfma(p[r * lds + t], v[t * ldv + c], sum);  // vfma's arithmetic
      store_value(o + r * ldo + c, sum);
    }
}

// q: row i of head h at q + i * ldq + h * dk, for heads [0, hh) and rows [0, nq); output o likewise
// at o + i * ldo + h * dv, both in the pool's element type (fp32, or bf16 rounded to nearest even).
// pool / S / head / table / L as paged_decode_item's, the keys' last shared.dim columns from
// shared.pool (SharedKeyPart). Scratch: kt [dk][L + MOE_W], vbuf [L'][dv] (L' = L rounded up to S),
// scores [PREFILL_TILE][L + MOE_W], qbuf [PREFILL_TILE][dk].
template <typename PT>
static void paged_prefill_item(const PT* q, int64_t ldq, int64_t hh, int64_t nq, int64_t pos0, const PT* pool,
                               int64_t S, const PagedHead& head, const SharedKeyPart& shared, const int64_t* table,
                               int64_t L, int64_t window, float scale, bool round_half, float* kt, float* vbuf,
                               float* scores, float* qbuf, PT* o, int64_t ldo) {
  const int64_t dk = head.dk, dv = head.dv, stride = head.token_stride, ldt = L + MOE_W, lds = L + MOE_W;
  const int64_t own = dk - shared.dim;  // the key columns in the head's pool
  const PT* part = static_cast<const PT*>(shared.pool);
  for (int64_t blk = (window > 0 ? std::max<int64_t>(0, pos0 - window + 1) : 0) / S; blk * S < L; ++blk) {
    const int64_t rows = std::min(S, L - blk * S);
    const PT* base = pool + table[blk] * S * stride;
    if (blk * S + S < L) {  // the next block's rows asked for first
      const PT* next = pool + table[blk + 1] * S * stride;
      prefetch_rows(next + head.k_off, std::min(S, L - blk * S - S), own, stride);
      prefetch_rows(next + head.v_off, std::min(S, L - blk * S - S), dv, stride);
    }
    rows_transposed(base + head.k_off, rows, own, stride, kt, ldt, blk * S);
    if (shared.dim > 0)
      rows_transposed(part + table[blk] * S * shared.dim, rows, shared.dim, shared.dim, kt + own * ldt, ldt, blk * S);
    rows_into(base + head.v_off, rows, dv, stride, vbuf + blk * S * dv);
  }
  for (int64_t c = 0; c < dk; ++c) std::fill(kt + c * ldt + L, kt + (c + 1) * ldt, 0.f);
  for (int64_t h = 0; h < hh; ++h)
    for (int64_t r0 = 0; r0 < nq; r0 += PREFILL_TILE) {
      const int64_t nr = std::min<int64_t>(PREFILL_TILE, nq - r0), p0 = pos0 + r0;
      const int64_t lo = window > 0 ? std::max<int64_t>(0, p0 - window + 1) : 0, n = p0 + nr - lo;
      // the next tile's query rows asked for first: rows of one head sit H * dk apart, beyond what
      // the hardware prefetcher follows
      if (r0 + PREFILL_TILE < nq)
        prefetch_rows(q + (r0 + PREFILL_TILE) * ldq + h * dk, std::min<int64_t>(PREFILL_TILE, nq - r0 - PREFILL_TILE),
                      dk, ldq);
      else if (h + 1 < hh)
        prefetch_rows(q + (h + 1) * dk, std::min<int64_t>(PREFILL_TILE, nq), dk, ldq);
      rows_into(q + r0 * ldq + h * dk, nr, dk, ldq, qbuf);
      prefill_scores(qbuf, nr, dk, kt + lo, ldt, n, scores, lds);
      for (int64_t r = 0; r < nr; ++r) {  // row r sees keys [a, b)
        const int64_t b = p0 + r + 1, a = window > 0 ? std::max<int64_t>(lo, b - window) : lo;
        float* sr = scores + r * lds - lo;  // sr[t] for key t
        attn_softmax(sr + a, b - a, scale, round_half);
        std::fill(sr + lo, sr + a, 0.f);
        std::fill(sr + b, sr + lo + n, 0.f);
      }
      for (int64_t r = 0, rows; r < nr; r += rows) {
        rows = std::min<int64_t>(PREFILL_ROWS, nr - r);
        with_row_count<PREFILL_ROWS>(rows, [&](auto rr) {
          prefill_pv<decltype(rr)::value>(scores + r * lds, lds, n, vbuf + lo * dv, dv, dv,
                                          o + (r0 + r) * ldo + h * dv, ldo);
        });
      }
    }
}

struct AttentionKernels {
  static constexpr int64_t lane_min_heads = LANE_MIN_HEADS;
  // rd set: the pool holds fp8 bytes, read as rd says
  static void decode(bool bf16_pool, const float* q, int64_t hh, int64_t group_heads, const void* pool, int64_t S,
                     const PagedHead& head, const int64_t* table, int64_t L, float scale, bool round_half,
                     float* scores, float* lanes, float* kbuf, float* vbuf, float* o, const NextItem& next,
                     const Fp8Read* rd) {
    const auto run = [&](const auto* typed) {
      if (group_heads >= LANE_MIN_HEADS)
        paged_decode_lanes(q, hh, typed, S, head, table, L, scale, round_half, scores, lanes, kbuf, vbuf, o, next,
                           rd);
      else
        paged_decode_item(q, hh, typed, S, head, table, L, scale, round_half, scores, kbuf, vbuf, o, next, rd);
    };
    if (rd != nullptr) run(static_cast<const uint8_t*>(pool));
    else if (bf16_pool) run(static_cast<const uint16_t*>(pool));
    else run(static_cast<const float*>(pool));
  }
  // GQA items of kv heads [0, groups) (paged_decode_kv_heads), each of rep query heads; rd set: the
  // pool holds fp8 bytes, read as rd says
  static void decode_kv_heads(bool bf16_pool, const Fp8Read* rd, const float* q, int64_t groups, int64_t rep,
                              const void* pool, int64_t S, const PagedHead& head, int64_t kv_stride,
                              const int64_t* table, int64_t L, float scale, bool round_half, float* scores,
                              float* lanes, float* kbuf, float* vbuf, float* o) {
    const auto run = [&](const auto* typed) {
      paged_decode_kv_heads(q, groups, rep, typed, S, head, kv_stride, table, L, scale, round_half, scores, lanes,
                            kbuf, vbuf, o, rd);
    };
    if (rd != nullptr) run(static_cast<const uint8_t*>(pool));
    else if (bf16_pool) run(static_cast<const uint16_t*>(pool));
    else run(static_cast<const float*>(pool));
  }
  // q, pool and o all bf16 or all fp32
  static void prefill(bool bf16, const void* q, int64_t ldq, int64_t hh, int64_t nq, int64_t pos0, const void* pool,
                      int64_t S, const PagedHead& head, const SharedKeyPart& shared, const int64_t* table, int64_t L,
                      int64_t window, float scale, float* kt, float* vbuf, float* scores, float* qbuf, void* o,
                      int64_t ldo) {
    if (bf16)
      paged_prefill_item(static_cast<const uint16_t*>(q), ldq, hh, nq, pos0, static_cast<const uint16_t*>(pool), S,
                         head, shared, table, L, window, scale, true, kt, vbuf, scores, qbuf,
                         static_cast<uint16_t*>(o), ldo);
    else
      paged_prefill_item(static_cast<const float*>(q), ldq, hh, nq, pos0, static_cast<const float*>(pool), S, head,
                         shared, table, L, window, scale, false, kt, vbuf, scores, qbuf, static_cast<float*>(o),
                         ldo);
  }
};
