// Fused routed-expert forward for CPU: torch.ops.moe_kernels.experts_forward, and a plain (batched)
// linear on the same packed tiles, torch.ops.moe_kernels.linear_forward, for the other weights of
// a model (attention projections, lm_head, MLA's absorbed per-head products).
//
// y[n] = row_weight[n] * W2_e (silu(W1_e x[n]) * W3_e x[n]) for the rows n of each local
// expert slot e (rows grouped by slot, as moe.experts.grouped_expert_forward takes them).
// Two parallel phases over (expert, column block) work items: gate/up with SiLU fused into
// the tile epilogue -> fp32 activations [N, I]; then down with the routing weight (and the
// int8 channel scale) applied in the epilogue. Rows per expert pick the register tile: 1-5
// rows (decode) run a vector-matrix tile that streams each weight block once; more rows run
// 6-row (AVX2) / 8-row (AVX-512) tiles over a block that stays in L1/L2 (prefill).
//
// Instruction sets: the tile source (experts_body.h) is compiled three times under
// per-function target pragmas (AVX-512F/BW, AVX2+FMA+F16C, baseline) and chosen from cpuid at
// first use; no -march flag applies to the whole file. On AVX512-BF16 ("avx512bf16": the AVX-512
// kernels plus dot_body.h) bf16 rows against bf16 weights run on vdpbf16ps instead, with bf16
// activations between the two projections; on AMX ("amx": amx_body.h) the same ops' products run on
// tdpbf16ps tiles.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <algorithm>
#include <numeric>
#include <optional>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <new>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#endif
#if defined(__linux__)
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

// Compilers with AMX's intrinsics (GCC 11, clang 12 on): elsewhere the build leaves the amx
// instruction set out (and never offers it) instead of failing as a whole.
#if defined(__x86_64__) && ((defined(__clang__) && __clang_major__ >= 12) || \
                            (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define MOE_HAVE_AMX 1
#endif

namespace moe_kernels {

enum WeightType { W_F32 = 0, W_BF16 = 1, W_I8 = 2 };

// A std::vector whose data starts on a cache line, for the scratch rows the kernels read with tile
// loads and 512-bit vectors. glibc's malloc aligns to 16 bytes only (a gather scratch began 16 bytes
// past a line in some processes, on a line in others), and off a line every 64-byte tile row or
// vector spans two lines. DeepSeek-style layer, T = 4096, AMX box, calls alternating in one process:
// the gathered rows 16 bytes past a line took 1.079x (1.075-1.082) the layer's time, its gate/up
// 33.3-34.3 ms against 28.4-29.3 by the phase's cycle count.
template <typename T>
struct LineAllocator {
  using value_type = T;
  static constexpr std::align_val_t line{64};
  LineAllocator() = default;
  template <typename U>
  LineAllocator(const LineAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), line)); }
  void deallocate(T* p, size_t) { ::operator delete(p, line); }
  template <typename U>
  bool operator==(const LineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const LineAllocator<U>&) const { return false; }
};
template <typename T>
using LineVector = std::vector<T, LineAllocator<T>>;

// Paged decode attention (attention_body.h): when values are the key rows (MLA's latent), a bf16 or
// fp8 sequence whose fp32 rows fit this many bytes is converted once and kept (in L2) for both passes;
// longer ones convert each block again for the value pass (items of heads in lanes read a bf16
// cache in place).
constexpr int64_t MLA_KEEP_BYTES = 256 * 1024;
// query heads the dot-product decode attention keeps in the lanes of one vector (fp32 scores)
constexpr int64_t DOT_HEAD_LANES = 16;
// Prefill attention scratch (paged_prefill, for attention_body.h's paged_prefill_item): keys and
// score rows padded by up to this many lanes, a tile of up to this many query rows; each ISA's
// prefill tile is checked against them where it is defined.
constexpr int64_t PREFILL_MAX_LANES = 16, PREFILL_MAX_TILE = 24;

// Where one kv head's keys and values sit in a layer's pool (attention_body.h), the pool read as row
// blocks of S rows: token t of row block b at pool + (b * S + t) * token_stride, its key at + k_off (dk
// wide), its value at + v_off (dv wide). A block table's entry names `blocks` row blocks in a row, the
// first one the kernels' tables name (the ops multiply a caller's tables by it).
// MLA ([N, S, W]): one row block a block; one head, key = the whole latent row, value = its first C
// columns (v_off == k_off).
// GQA ([N, 2, S, Hkv, hd]: a block's S keys, then its S values; read as [2N, S, Hkv hd]): two row blocks a
// block; head g's key at g * hd of its key row, its value S rows on: v_off = S Hkv hd + g * hd. Each
// decode pass (keys, then values) reads a block's run of whole lines; with each token's key and value
// side by side ([N, S, 2, Hkv, hd]) a pass read half of every row, which the hardware prefetchers follow
// poorly (attention_body.h, the kv-heads items).
struct PagedHead {
  int64_t token_stride, k_off, v_off, dk, dv;
  int64_t blocks = 1;
};
// What an fp8 (e4m3) conversion gives (Isa::e4m3_rows): fp32, bf16 rounded to nearest even, or bf16
// where every product is exact (e4m3_exact_scale): the rounding is a truncation
enum E4m3Out : int { E4M3_F32 = 0, E4M3_BF16 = 1, E4M3_BF16_EXACT = 2 };
// Whether every finite e4m3 value times scale is a bf16 value (no rounding): zero, or a power of two
// 2^k with the products between 2^-9 * 2^k >= 2^-126 (normal) and 448 * 2^k < 2^128
static inline bool e4m3_exact_scale(float scale) {
  int e = 0;
  const float m = std::frexp(std::fabs(scale), &e);  // scale = m * 2^e, m in [0.5, 1)
  return scale == 0.0f || (m == 0.5f && e - 1 >= -117 && e - 1 <= 119);
}
// How the FMA path's decode items (GQA, MLA, MQA) read an fp8 cache's rows straight from its pool
// (fp8_body.h's e4m3_row_f32): each row converted to fp32 as an item reads it, into the values
// Fp8Cache's scratch would hold, widened: the products (fp8 x scale) in fp32, or for bf16 queries
// rounded to bf16.
struct Fp8Read {
  const float* lut;  // [256]: each code's value as read (where the conversion is not arithmetic)
  float scale256;    // scale * 2^8, the arithmetic conversion's multiplier
  bool arith;        // through F16C (Isa::e4m3_rows set and scale256 finite)
  int out;           // E4M3_F32, or what bf16 queries round to: E4M3_BF16 or E4M3_BF16_EXACT
};
// Rows a decode item loads as it goes (an fp8 cache's long sequences: Fp8Ring): the item's pool is
// a ring of `chunk` tokens, and fill(this, t0, part) puts tokens [t0, t0 + chunk)'s keys (part 0) or
// values (part 1) there before a pass reads them. chunk is a multiple of the block size and of 32.
struct RowRefill {
  void (*fill)(const RowRefill*, int64_t, int) = nullptr;
  int64_t chunk = 0;
};
// Prefill keys whose last `dim` columns come from a second pool shared by every head (MLA's rope
// key: [N, S, dim], token t of block b at pool + (b * S + t) * dim); the first dk - dim from the
// head's own. dim == 0: none (the whole key from the head's pool).
struct SharedKeyPart {
  const void* pool = nullptr;
  int64_t dim = 0;
};

// The decode work item a thread takes after the current one: its query rows (q_bytes from q) and
// its key / value rows (table, L and head as the current item's; L == 0: no next item). The current
// item asks for them into L1 while it computes, a share of the rows per step of its score pass
// (TileLines::add_next_share; prefetch_next_share on the FMA item path) and the queries before its
// softmax: between two layers' attention the routed experts' weights stream through every cache
// level, so both come back from DRAM, and an item that asks for its own rows only a few tiles ahead
// waits on that latency at its start.
struct NextItem {
  const char* q = nullptr;
  int64_t q_bytes = 0;
  const int64_t* table = nullptr;
  int64_t L = 0;
  PagedHead head{};
};

static inline float to_float(float v) { return v; }
static inline float to_float(uint16_t h) {  // bf16 -> fp32
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float v;
  std::memcpy(&v, &u, 4);
  return v;
}
static inline void store_value(float* p, float v) { *p = v; }
// 16 floats as one vector: inlined into a kernel, its ops take that kernel's vector width (one
// AVX-512 add; a plain loop here stayed 16 scalar adds).
typedef float f32x16 __attribute__((vector_size(64), aligned(4)));
// dst[0:16) += v[0:16), v's products already rounded to fp32: the compiler sees v only through
// memory, so it cannot fuse the products into the adds (the sums a separate combine pass makes).
static inline void add_rounded16(float* __restrict dst, float* v) {
  asm volatile("" : : "r"(v) : "memory");
  f32x16 a, b;
  std::memcpy(&a, dst, sizeof(a));
  std::memcpy(&b, v, sizeof(b));
  a += b;
  std::memcpy(dst, &a, sizeof(a));
}
// Whether a row loop's epilogue also takes a row's two neighbouring blocks at once: e.pair(row, block j,
// acc[32]) with block j's 16 columns then block j + 1's (the row loops call it where a tile covers both).
template <typename E, typename = void>
struct HasPairEpilogue : std::false_type {};
template <typename E>
struct HasPairEpilogue<E, std::void_t<decltype(std::declval<const E&>().pair(int64_t{}, 0, static_cast<const float*>(nullptr)))>>
    : std::true_type {};
// What the row loops (tiles_over_rows and the dot tiles') run before a register tile's products:
// before(row0, rows, block j) for each block of the tile. Nothing by default.
struct NoTileStart {
  void operator()(int64_t, int64_t, int) const {}
  void into_l2(int64_t, int64_t, int) const {}
};
// gate/up's tile start on an expert's first row panel (the one that brings its weights from L3 or
// DRAM): nothing per tile, but on the AMX tiles each pass also asks for its share of the next block
// pair's weights into L2 (see AmxTiles::over_rows).
struct StreamNextBlocks : NoTileStart {};
// The down_add tiles' tile start: asks for the tile's fp32 output lines (one 64-byte line per row
// and 16-column block j, row r at out + out_rows[r] * ld_out) while it computes. Prefill-size output
// rows are spread over megabytes (L3 or DRAM) and each add read-modify-writes them: without it the
// adds waited on those misses. DeepSeek-style layer, T = 4096, Zen 5, perf samples of the adds over
// the tiles': 0.34-0.45 without, 0.16-0.18 with, 0.06 with padded output rows as well
// (experts_forward_topk); asking one tile ahead instead gave 0.36-0.38 with or without padding.
struct OutRowPrefetch {
  const int64_t* out_rows;
  float* out;
  int64_t ld_out;
  void operator()(int64_t row0, int64_t rows, int j) const {
    for (int64_t r = row0; r < row0 + rows; ++r) __builtin_prefetch(out + out_rows[r] * ld_out + 16 * j, 1, 3);
  }
  // The same lines asked for into L2 only: the AMX passes' form, after the pass's products are issued
  // (see AmxTiles::over_rows).
  void into_l2(int64_t row0, int64_t rows, int j) const {
    for (int64_t r = row0; r < row0 + rows; ++r) __builtin_prefetch(out + out_rows[r] * ld_out + 16 * j, 1, 2);
  }
};
// down_final's tile start: the tile's lines of the fp32 sums it adds (row r at sums + r * ld), as
// OutRowPrefetch asks for the output rows.
struct SumRowPrefetch {
  const float* sums;
  int64_t ld;
  void operator()(int64_t row0, int64_t rows, int j) const {
    for (int64_t r = row0; r < row0 + rows; ++r) __builtin_prefetch(sums + r * ld + 16 * j, 0, 3);
  }
  void into_l2(int64_t row0, int64_t rows, int j) const {
    for (int64_t r = row0; r < row0 + rows; ++r) __builtin_prefetch(sums + r * ld + 16 * j, 0, 2);
  }
};
static inline void store_value(uint16_t* p, float v) {  // fp32 -> bf16, round to nearest even
  uint32_t u;
  std::memcpy(&u, &v, 4);
  if (std::isnan(v)) {
    *p = 0x7fc0;
    return;
  }
  u += 0x7fff + ((u >> 16) & 1);
  *p = static_cast<uint16_t>(u >> 16);
}

// Tensors up to this many elements (a decode step's rows) are converted by the loops below: at::Tensor::to
// and a TensorIterator add spend ~5-10 us of dispatch and setup per call, more than such a conversion.
constexpr int64_t SMALL_ELEMENTS = int64_t{1} << 16;

// Copies x (up to 4 dims, any strides, uint16_t elements: bf16) into d in row-major order, each
// element through convert.
template <typename Out, typename Convert>
static void copy_strided(const at::Tensor& x, Out* d, Convert&& convert) {
  const uint16_t* src = reinterpret_cast<const uint16_t*>(x.data_ptr());
  int64_t size[4] = {1, 1, 1, 1}, st[4] = {0, 0, 0, 0};
  for (int64_t i = 0, off = 4 - x.dim(); i < x.dim(); ++i) size[off + i] = x.size(i), st[off + i] = x.stride(i);
  for (int64_t a = 0; a < size[0]; ++a)
    for (int64_t b = 0; b < size[1]; ++b)
      for (int64_t c = 0; c < size[2]; ++c)
        for (int64_t e = 0; e < size[3]; ++e) *d++ = convert(src[a * st[0] + b * st[1] + c * st[2] + e * st[3]]);
}

// x (bfloat16, up to 4 dims, any strides) as a contiguous tensor: x itself when it already is one, else
// a copy made by the loop below for decode-size tensors (at::Tensor::contiguous costs more there).
static at::Tensor bf16_contiguous(const at::Tensor& x) {
  if (x.is_contiguous() || x.numel() > SMALL_ELEMENTS || x.dim() > 4) return x.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  copy_strided(x, reinterpret_cast<uint16_t*>(out.data_ptr()), [](uint16_t h) { return h; });
  return out;
}

// x (float32 or bfloat16, up to 4 dims, any strides) as a contiguous float32 tensor: x itself when it
// already is one, else a copy (bf16 -> fp32 is exact, so the values are those of x.to(at::kFloat)).
static at::Tensor float32_contiguous(const at::Tensor& x) {
  if (x.scalar_type() != at::kBFloat16 || x.numel() > SMALL_ELEMENTS || x.dim() > 4)
    return x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  float* d = out.data_ptr<float>();
  if (x.is_contiguous()) {
    const uint16_t* src = reinterpret_cast<const uint16_t*>(x.data_ptr());
    for (int64_t i = 0, n = x.numel(); i < n; ++i) d[i] = to_float(src[i]);
    return out;
  }
  copy_strided(x, d, [](uint16_t h) { return to_float(h); });
  return out;
}

// How dot tiles stream their weights from DRAM (dot_body.h's stream_tile), measured per CPU for each
// class of row counts (one row, two, three or four, five or more) and for block pairs and single
// blocks apart (tile_mode_seconds, kernels.agree_tile_modes), set by set_tile_mode: bits of
constexpr int TILE_PREFETCH = 1;     // ask for the weight lines ahead in software, into L1
constexpr int TILE_ONE_STREAM = 2;   // a block pair one block after the other (else side by side)
constexpr int TILE_PREFETCH_L2 = 4;  // with TILE_PREFETCH: into L2 instead
constexpr int TILE_MODE_COUNT = (TILE_PREFETCH | TILE_ONE_STREAM | TILE_PREFETCH_L2) + 1;
// the modes the probe times, in the order of its answer (TILE_PREFETCH_L2 needs TILE_PREFETCH): block
// pairs in every mode, then single blocks in the modes that differ for them (no order to choose)
constexpr int TILE_PROBED_PAIR_MODES[] = {0, 1, 2, 3, 5, 7};
constexpr int TILE_PROBED_BLOCK_MODES[] = {0, 1, 5};
constexpr int TILE_ROW_CLASSES = 4;
// the most rows a dot tile takes (dot_body.h's DOT_TILE_ROWS, in the x86 namespaces: checked there)
constexpr int64_t DOT_TILE_MAX_ROWS = 12;
static inline int tile_row_class(int64_t rows) {
  return rows <= 2 ? static_cast<int>(std::max<int64_t>(rows, 1)) - 1 : rows <= 4 ? 2 : 3;
}
// the mode of `rows`-row tiles over nb (1 or 2) blocks
static int& tile_mode_slot(int64_t rows, int nb) {
  static int modes[TILE_ROW_CLASSES][2] = {{TILE_PREFETCH, TILE_PREFETCH}, {TILE_PREFETCH, TILE_PREFETCH},
                                           {TILE_PREFETCH, TILE_PREFETCH}, {TILE_PREFETCH, TILE_PREFETCH}};
  return modes[tile_row_class(rows)][nb >= 2 ? 1 : 0];
}

// How the dot path's decode attention asks for its key rows ahead of its score tiles (dot_body.h's
// AttentionDotKernels::decode), measured per CPU (kernels.agree_attention_asks), set by
// set_attention_asks: ATTENTION_ASKS_L1 into L1 two tiles ahead (the default), ATTENTION_ASKS_L2
// into L2 eight tiles ahead.
constexpr int ATTENTION_ASKS_L1 = 0;
constexpr int ATTENTION_ASKS_L2 = 1;
static int& attention_asks_slot() {
  static int mode = ATTENTION_ASKS_L1;
  return mode;
}

// f(std::integral_constant<int, R>{}) for R == rows in [1, MAX] (nothing outside): a row count known
// at run time picks the register tile compiled for it. always_inline, so it takes the caller's ISA.
template <int MAX, int R = 1, typename F>
__attribute__((always_inline)) static inline void with_row_count(int64_t rows, F&& f) {
  if constexpr (R <= MAX) {
    if (rows == R) f(std::integral_constant<int, R>{});
    else with_row_count<MAX, R + 1>(rows, f);
  }
}

// dst[i * ldd + j] = src[j * lds + i] for i, j < W, element by element (the ISAs' vtranspose where
// they have no shuffles for it)
template <int W>
static inline void transpose_square(const float* src, int64_t lds, float* dst, int64_t ldd) {
  for (int i = 0; i < W; ++i)
    for (int j = 0; j < W; ++j) dst[i * ldd + j] = src[j * lds + i];
}

namespace generic {  // GCC vector extensions at the baseline ISA (SSE2 on x86-64, NEON on arm64)
#define MOE_W 8
typedef float vf __attribute__((vector_size(32)));
typedef uint32_t vu __attribute__((vector_size(32)));
typedef uint16_t vh __attribute__((vector_size(16)));
typedef int8_t vb __attribute__((vector_size(8)));
static inline vf vzero() { return vf{}; }
static inline vf vload(const float* p) { vf v; std::memcpy(&v, p, sizeof(v)); return v; }
static inline vf vload(const uint16_t* p) {
  vh h;
  std::memcpy(&h, p, sizeof(h));
  return (vf)(__builtin_convertvector(h, vu) << 16);  // bf16 -> fp32 is a 16-bit shift
}
static inline vf vload(const int8_t* p) { vb b; std::memcpy(&b, p, sizeof(b)); return __builtin_convertvector(b, vf); }
static inline void vload_pair(const uint16_t* p, vf& k0, vf& k1) {  // 8 columns x (k, k + 1), bf16
  vu u;
  std::memcpy(&u, p, sizeof(u));
  k0 = (vf)(u << 16);
  k1 = (vf)(u & 0xffff0000u);
}
static inline vf vbroadcast(const float* p) { return vf{} + *p; }
// bf16 p[0] and p[1] as fp32, each over the lanes (one 32-bit load: a shift, a mask)
static inline void vbroadcast_pair(const uint16_t* p, vf& lo, vf& hi) {
  uint32_t u;
  std::memcpy(&u, p, sizeof(u));
  const vu b = vu{} + u;
  lo = (vf)(b << 16);
  hi = (vf)(b & 0xffff0000u);
}
// p[0 : G) repeated over the lanes (G = 1 or 2)
template <int G>
static inline vf vbroadcast_n(const float* p) {
  vf v;
  for (int i = 0; i < MOE_W; ++i) v[i] = p[i % G];
  return v;
}
static inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
// The scalar twin of vfma for columns past the last whole vector: no FMA instruction at this ISA.
static inline float sfma(float a, float b, float c) { return a * b + c; }
static inline vf vadd(vf a, vf b) { return a + b; }
static inline vf vmax(vf a, vf b) { return a > b ? a : b; }
static inline float vhsum(vf v) {
  float s = 0.f;
  for (int i = 0; i < MOE_W; ++i) s += v[i];
  return s;
}
// lane i: vhsum(a_i) (avx2's in vectors)
static inline vf vhsum8(vf a0, vf a1, vf a2, vf a3, vf a4, vf a5, vf a6, vf a7) {
  const vf a[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
  vf r = a0;
  for (int i = 0; i < 8; ++i) r[i % MOE_W] = vhsum(a[i]);
  return r;
}
static inline void vstore(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }
// dst[i * ldd + j] = src[j * lds + i] for i, j < MOE_W (a square of lanes transposed)
static inline void vtranspose(const float* src, int64_t lds, float* dst, int64_t ldd) {
  transpose_square<MOE_W>(src, lds, dst, ldd);
}
#include "experts_body.h"
#include "fp8_body.h"
#include "attention_body.h"
#include "norm_body.h"
#undef MOE_W
}  // namespace generic

#if defined(__x86_64__) || defined(__i386__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
#define MOE_W 8
using vf = __m256;
static inline vf vzero() { return _mm256_setzero_ps(); }
static inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
static inline vf vload(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline vf vload(const int8_t* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}
static inline void vload_pair(const uint16_t* p, vf& k0, vf& k1) {  // 8 columns x (k, k + 1), bf16
  const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  k0 = _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
  k1 = _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}
static inline vf vbroadcast(const float* p) { return _mm256_broadcast_ss(p); }
static inline void vbroadcast_pair(const uint16_t* p, vf& lo, vf& hi) {  // as generic's: one broadcast load
  const vf b = _mm256_broadcast_ss(reinterpret_cast<const float*>(p));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(b), 16));
  hi = _mm256_and_ps(b, _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}
// p[0 : G) repeated over the lanes (G = 1 or 2): one broadcast load
template <int G>
static inline vf vbroadcast_n(const float* p) {
  if constexpr (G == 1) return _mm256_broadcast_ss(p);
  else return _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(p)));
}
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
// Fused like vfma whatever the compiler makes of the loop around it (a row's values must not depend
// on how many rows share its tile).
static inline float sfma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline float vhsum(vf v) {  // (lo + hi) then pairwise within 128 bits
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// Lane i: vhsum(a_i), the same sums in the same order (x = lo + hi, then (x0 + x2) + (x1 + x3)) for eight
// vectors at once: 14 shuffles and 7 adds where eight vhsum take 40 instructions, and one store.
static inline vf vhsum8(vf a0, vf a1, vf a2, vf a3, vf a4, vf a5, vf a6, vf a7) {
  const auto halves = [](vf a, vf b) {  // [a lo + a hi | b lo + b hi]
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  };
  const auto pairs = [](vf x, vf y) {  // [x0 + x2, y0 + y2, x1 + x3, y1 + y3] in each 128-bit half
    return _mm256_add_ps(_mm256_unpacklo_ps(x, y), _mm256_unpackhi_ps(x, y));
  };
  const vf ae = halves(a0, a4), bf = halves(a1, a5), cg = halves(a2, a6), dh = halves(a3, a7);
  const vf m1 = pairs(ae, bf), m2 = pairs(cg, dh);  // [a b a b | e f e f], [c d c d | g h g h]
  return _mm256_add_ps(_mm256_shuffle_ps(m1, m2, 0x44), _mm256_shuffle_ps(m1, m2, 0xee));
}
static inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
static inline void vtranspose(const float* src, int64_t lds, float* dst, int64_t ldd) {  // as generic's
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * lds);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {  // t[i], t[i + 2]: rows (i, i + 1) and (i + 2, i + 3) interleaved
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44), r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44), r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}
#include "exp_body.h"
#include "experts_body.h"
#define MOE_F16C
#include "fp8_body.h"
#undef MOE_F16C
#include "attention_body.h"
#include "norm_body.h"
#undef MOE_W
#undef MOE_EXP8
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
namespace avx512 {
#define MOE_W 16
using vf = __m512;
static inline vf vzero() { return _mm512_setzero_ps(); }
static inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
static inline vf vload(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline vf vload(const int8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
}
static inline void vload_pair(const uint16_t* p, vf& k0, vf& k1) {  // 16 columns x (k, k + 1), bf16
  const __m512i u = _mm512_loadu_si512(p);
  k0 = _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
  k1 = _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
static inline vf vbroadcast(const float* p) { return _mm512_set1_ps(*p); }
static inline void vbroadcast_pair(const uint16_t* p, vf& lo, vf& hi) {  // as generic's
  int32_t u;
  std::memcpy(&u, p, sizeof(u));
  const __m512i b = _mm512_set1_epi32(u);
  lo = _mm512_castsi512_ps(_mm512_slli_epi32(b, 16));
  hi = _mm512_castsi512_ps(_mm512_and_si512(b, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
// p[0 : G) repeated over the lanes (G = 1 or 2): one broadcast load
template <int G>
static inline vf vbroadcast_n(const float* p) {
  if constexpr (G == 1) {
    return _mm512_set1_ps(*p);
  } else {
    double d;
    std::memcpy(&d, p, sizeof(d));
    return _mm512_castpd_ps(_mm512_set1_pd(d));
  }
}
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline float sfma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }  // as avx2's
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline float vhsum(vf v) { return _mm512_reduce_add_ps(v); }
static inline vf vhsum8(vf a0, vf a1, vf a2, vf a3, vf a4, vf a5, vf a6, vf a7) {  // lanes 0-7 as generic's
  const vf a[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
  vf r = a0;
  for (int i = 0; i < 8; ++i) r[i] = vhsum(a[i]);
  return r;
}
static inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
static inline void vtranspose(const float* src, int64_t lds, float* dst, int64_t ldd) {  // as generic's
  transpose_square<MOE_W>(src, lds, dst, ldd);
}
#include "exp_body.h"
#include "experts_body.h"
#define MOE_F16C
#include "fp8_body.h"
#undef MOE_F16C
#include "attention_body.h"
#include "norm_body.h"
#undef MOE_W
#undef MOE_EXP8
// dst[r * ld + i] = lut[src[r * ld + i]] for r < rows, i < n: bytes through a 256-entry table of 16-bit
// values, 32 at a time (each of the four 64-entry quarters in two registers, picked by the byte's top
// two bits); rows of n at a stride of ld elements in both (ld unused for one row)
static void lut16_rows(const uint8_t* src, int64_t rows, int64_t n, int64_t ld, const uint16_t* lut, uint16_t* dst) {
  __m512i t[8];
  for (int i = 0; i < 8; ++i) t[i] = _mm512_loadu_si512(lut + 32 * i);
  const __m512i bit6 = _mm512_set1_epi16(0x40), bit7 = _mm512_set1_epi16(0x80);
  for (int64_t r = 0; r < rows; ++r, src += ld, dst += ld)
    for (int64_t i = 0; i < n; i += 32) {
      const __mmask32 m = n - i >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((uint64_t{1} << (n - i)) - 1);
      const __m512i x = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(m, src + i));
      const __mmask32 hi = _mm512_test_epi16_mask(x, bit6), neg = _mm512_test_epi16_mask(x, bit7);
      const __m512i a = _mm512_mask_mov_epi16(_mm512_permutex2var_epi16(t[0], x, t[1]), hi,
                                              _mm512_permutex2var_epi16(t[2], x, t[3]));
      const __m512i b = _mm512_mask_mov_epi16(_mm512_permutex2var_epi16(t[4], x, t[5]), hi,
                                              _mm512_permutex2var_epi16(t[6], x, t[7]));
      _mm512_mask_storeu_epi16(dst + i, m, _mm512_mask_mov_epi16(a, neg, b));
    }
}
}  // namespace avx512
#pragma GCC pop_options

// AVX-512 with the BF16 dot product: the AVX-512 kernels, plus bf16 x bf16 tiles on vdpbf16ps
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")
namespace avx512bf16 {
#define MOE_LANES16 1
#include "exp_body.h"
#undef MOE_LANES16
#include "dot_body.h"
#undef MOE_EXP8
}  // namespace avx512bf16
#pragma GCC pop_options

#endif
#if defined(MOE_HAVE_AMX)
// AMX: the AVX512-BF16 kernels, with the bf16 x bf16 ops' products on AMX tiles (amx_body.h)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16,avx2,fma,f16c")
namespace amx {
#include "amx_body.h"
}  // namespace amx
#pragma GCC pop_options
#endif

using GateUpFn = void (*)(int, const float*, int64_t, int64_t, const void*, int, int64_t, const float*, float*,
                          int64_t);
using DownF32Fn = void (*)(int, const float*, int64_t, int64_t, const void*, int, int64_t, const float*, const float*,
                           float*, int64_t);
using DownBf16Fn = void (*)(int, const float*, int64_t, int64_t, const void*, int, int64_t, const float*,
                            const float*, uint16_t*, int64_t);
using DownAddFn = void (*)(int, const float*, int64_t, int64_t, const void*, int, int64_t, const float*, const float*,
                           const int64_t*, float*, int64_t);
template <typename OT>
using LinearFn = void (*)(int, const float*, int64_t, int64_t, const void*, int, int64_t, const float*, int64_t, OT*,
                          int64_t);
using RmsNormFn = void (*)(bool, const void*, int64_t, const void*, void*, int64_t, int64_t, int64_t, float);
using AddRmsNormFn = void (*)(bool, const void*, const void*, const void*, void*, void*, int64_t, int64_t, float);
// rope of n vectors: (bf16, x, ldx, n, cos, sin, R, interleave, out, ldo)
using RopeFn = void (*)(bool, const void*, int64_t, int64_t, const float*, const float*, int64_t, bool, void*, int64_t);
// out = a (fp32 rows lda apart) + b (null: nothing) rounded to out's dtype: (bf16, a, lda, b, out, rows, D)
using AddRoundFn = void (*)(bool, const float*, int64_t, const void*, void*, int64_t, int64_t);
// one token's router scores: (sigmoid (else softmax), logits [E], E, scores [E])
using RouteScoresFn = void (*)(bool, const float*, int64_t, float*);
// the top k of one token's selection scores, highest first, ties to the lower id: (sel [E], E, k, ids [k])
using RouteTopFn = void (*)(const float*, int64_t, int64_t, int64_t*);
using RouterLogitsFn = void (*)(bool, const void*, int64_t, int64_t, const float*, int64_t, int64_t, float*);
// bf16 rows against the router weight's bf16 parts: (x, t_begin, t_end, parts, number of parts, E, D, out)
using RouterSplitFn = void (*)(const uint16_t*, int64_t, int64_t, const uint16_t*, int, int64_t, int64_t, float*);
// (bf16 pool, q, the item's heads, its kv head's query heads, pool, S, head, table, L, scale, round_half,
// scratch..., next, fp8 read or null)
using PagedDecodeFn = void (*)(bool, const float*, int64_t, int64_t, const void*, int64_t, const PagedHead&,
                               const int64_t*, int64_t, float, bool, float*, float*, float*, float*, float*,
                               const NextItem&, const Fp8Read*);
// (bf16 pool, fp8 read or null, q, kv heads, query heads a kv head, pool, S, head, kv_stride, table, L,
// scale, round_half, scratch..., o)
using PagedDecodeKvHeadsFn = void (*)(bool, const Fp8Read*, const float*, int64_t, int64_t, const void*, int64_t,
                                      const PagedHead&, int64_t, const int64_t*, int64_t, float, bool, float*, float*,
                                      float*, float*, float*);
using PagedPrefillFn = void (*)(bool, const void*, int64_t, int64_t, int64_t, int64_t, const void*, int64_t,
                                const PagedHead&, const SharedKeyPart&, const int64_t*, int64_t, int64_t, float,
                                float*, float*, float*, float*, void*, int64_t);
// bf16 x bf16 ops: (rows, n, K, the rows' stride, blocks w, nb, w_stride, ...)
using GateUpDotFn = void (*)(const uint16_t*, int64_t, int64_t, int64_t, const uint16_t*, int, int64_t, uint16_t*,
                             int64_t, bool);
template <typename OT>
using DownDotFn = void (*)(const uint16_t*, int64_t, int64_t, int64_t, const uint16_t*, int, int64_t, const float*,
                           OT*, int64_t);
using DownAddDotFn = void (*)(const uint16_t*, int64_t, int64_t, int64_t, const uint16_t*, int, int64_t,
                              const float*, const int64_t*, float*, int64_t, const uint8_t*);
using DownFinalDotFn = void (*)(const uint16_t*, int64_t, int64_t, int64_t, const uint16_t*, int, int64_t,
                                const float*, int64_t, uint16_t*, int64_t);
template <typename OT>
using LinearDotFn = void (*)(const uint16_t*, int64_t, int64_t, int64_t, const uint16_t*, int, const float*, int64_t,
                             OT*, int64_t);

using PagedDecodeDotFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, const PagedHead&,
                                 const int64_t*, int64_t, float, float*, uint16_t*, const uint16_t**,
                                 const uint16_t*, uint16_t*, const NextItem&);
// (hp, q, groups, rep, pool, S, head, kv_stride, table, L, scale, scores, pbuf, acc, rows, o): the dot
// product's small-group decode at hp lanes a head (dot_body.h's decode_groups)
using PagedDecodeGroupsFn = void (*)(int, const uint16_t*, int64_t, int64_t, const uint16_t*, int64_t,
                                     const PagedHead&, int64_t, const int64_t*, int64_t, float, float*, uint32_t*,
                                     float*, const uint16_t**, uint16_t*, const RowRefill*);

// bf16 x bf16 tiles (null where the ISA has no bf16 dot product): bf16 rows against bf16 weights
struct DotIsa {
  GateUpDotFn gate_up = nullptr;
  DownDotFn<float> down_f32 = nullptr;
  DownDotFn<uint16_t> down_bf16 = nullptr;
  DownAddDotFn down_add = nullptr;
  LinearDotFn<float> linear_f32 = nullptr;
  LinearDotFn<uint16_t> linear_bf16 = nullptr;
  PagedDecodeDotFn paged_decode = nullptr;  // bf16 queries over a bf16 cache
  DownFinalDotFn down_final = nullptr;  // down_bf16's rows added to fp32 sums and rounded (see moe_ffn)
  // (q, scale, nb, K, out): int8 expert blocks as the bf16 blocks the ops above read (dequant_int8_blocks)
  void (*dequant_int8)(const int8_t*, const float*, int64_t, int64_t, uint16_t*) = nullptr;
  // whether paged_decode takes heads of these (dk, dv) with this many query heads per kv head (null:
  // any); the others run the FMA path
  bool (*paged_decode_applies)(int64_t, int64_t, int64_t) = nullptr;
  // kv heads of at most 8 query heads each, every kv head of a sequence in one item (null: none);
  // group_lanes: which (query heads a kv head, dk) it takes (0: none)
  PagedDecodeGroupsFn paged_decode_groups = nullptr;
  int (*group_lanes)(int64_t, int64_t) = nullptr;
};

struct Isa {
  std::string name;
  GateUpFn gate_up;
  DownF32Fn down_f32;
  DownBf16Fn down_bf16;
  DownAddFn down_add;  // down_f32's rows added into fp32 output rows they name
  LinearFn<float> linear_f32;
  LinearFn<uint16_t> linear_bf16;
  PagedDecodeFn paged_decode;
  PagedDecodeKvHeadsFn paged_decode_kv_heads;  // GQA items of several kv heads (the FMA path)
  PagedPrefillFn paged_prefill;  // causal rows of prefill chunks (keys, then value columns, in lanes; AMX: tiles)
  RmsNormFn rms_norm;
  AddRmsNormFn add_rms_norm;  // the residual add, then RMSNorm of the sum
  RouterLogitsFn router_logits;  // fp32 x @ w^T for the router, batch-invariant
  RopeFn rope;  // rotary embedding of rows sharing one cos/sin (bit-equal to rope.apply_rotary)
  AddRoundFn add_round;  // fp32 rows + rows of the output dtype, rounded once
  RouteScoresFn route_scores;  // sigmoid or softmax of one token's router logits
  RouteTopFn route_top;  // the top k of one token's selection scores
  DotIsa dot;
  bool pair_tiles;  // the FMA tiles have a two-block tile (gate_up / down with nb == 2)
  int64_t lane_min_heads;  // the FMA path's decode takes a kv head's query heads in lanes from this many
  bool wide_panels = false;  // experts too large for L2 take WIDE_ROW_PANEL rows per panel (see there)
  RouterSplitFn router_split = nullptr;  // bf16 rows' router logits on the weight's bf16 parts (router_logits)
  // (src, rows, n, ld, lut, dst): dst[r ld + i] = lut[src[r ld + i]], 16-bit entries (null: a scalar
  // loop, Fp8Cache::convert16), for fp8 caches
  void (*lut16_rows)(const uint8_t*, int64_t, int64_t, int64_t, const uint16_t*, uint16_t*) = nullptr;
  // (src, rows, n, ld, scale * 2^8, out, dst): dst[r ld + i] = e4m3(src[r ld + i]) * scale as out (E4m3Out)
  // says, arithmetic (F16C), for fp8 caches where lut16_rows is null or the rows are fp32 (null: the tables)
  void (*e4m3_rows)(const uint8_t*, int64_t, int64_t, int64_t, float, int, void*) = nullptr;
  // bf16 weights meeting bf16 rows run the dot tiles (else rows widen to fp32 for the FMA tiles)
  bool dot_bf16(int wt, at::ScalarType x_type) const {
    return dot.gate_up != nullptr && wt == W_BF16 && x_type == at::kBFloat16;
  }
};

template <typename K, typename M, typename N>
static Isa make_isa(const char* name) {
  return Isa{name, &K::gate_up, &K::template down<float>, &K::template down<uint16_t>, &K::down_add,
             &K::template linear<float>, &K::template linear<uint16_t>, &M::decode, &M::decode_kv_heads,
             &M::prefill, &N::rms_norm, &N::add_rms_norm, &N::router_logits, &N::rope, &N::add_round,
             &N::route_scores, &N::route_top, DotIsa{}, K::pair_tiles, M::lane_min_heads};
}

// Whether this process may run AMX's bf16 tiles: cpuid's AMX-TILE and AMX-BF16 bits (leaf 7, EDX
// bits 24 and 22), and Linux's permission for the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM
// for XTILEDATA, asked once per process; a kernel or hypervisor without it refuses, and the tiles
// would fault).
static bool amx_usable() {
#if defined(__linux__) && defined(MOE_HAVE_AMX)
  static const bool usable = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!(d & (1u << 24)) || !(d & (1u << 22))) return false;
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return usable;
#else
  return false;
#endif
}

// F16C (half <-> float): every AVX2 CPU made has it, but it is a CPUID bit of its own (leaf 1, ECX bit 29)
static bool f16c_usable() {
#if defined(__x86_64__) || defined(__i386__)
  unsigned a, b, c, d;
  return __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29)) != 0;
#else
  return false;
#endif
}

static bool cpu_has(const std::string& name) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (name == "avx512") return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                               __builtin_cpu_supports("avx512vl");
  if (name == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (name == "avx512bf16") return cpu_has("avx512") && __builtin_cpu_supports("avx512bf16");
  if (name == "amx") return cpu_has("avx512bf16") && amx_usable();
#endif
  return name == "generic";
}

// The bf16 dot product's flop rate over the fp32 FMA's on this core: probed on first use
// (dot_body.h) unless set_bf16_dot_rate gave one; 0 where the CPU has no AVX512-BF16.
static double& dot_rate_slot() {
  static double rate = -1.0;  // < 0: not known yet
  return rate;
}

double bf16_dot_rate() {
  double& rate = dot_rate_slot();
  if (rate < 0) {
#if defined(__x86_64__) || defined(__i386__)
    rate = cpu_has("avx512bf16") ? avx512bf16::dot_to_fma_rate() : 0.0;
#else
    rate = 0.0;
#endif
  }
  return rate;
}

// Uses `rate` (one probed earlier on this CPU, so that every process of a machine picks the same
// tiles) instead of probing; a negative rate forgets it (the next use probes). Returns the rate now
// in force (0 where the CPU has no AVX512-BF16; -1 when forgotten). Call before the instruction set
// is picked.
double set_bf16_dot_rate(double rate) {
  return dot_rate_slot() = rate < 0 ? -1.0 : cpu_has("avx512bf16") ? rate : 0.0;
}

// Seconds of passes of `rows`-row dot tiles over `bytes` of weights in DRAM: block pairs in each mode
// of TILE_PROBED_PAIR_MODES, then single blocks in each of TILE_PROBED_BLOCK_MODES (dot_body.h's
// tile_mode_seconds); empty where the CPU has no AVX512-BF16 (no dot tiles).
std::vector<double> tile_mode_seconds(int64_t rows, int64_t bytes) {
  TORCH_CHECK(rows >= 1 && rows <= DOT_TILE_MAX_ROWS, "moe_kernels: tile_mode_seconds takes 1-", DOT_TILE_MAX_ROWS,
              " rows (a dot tile's most), not ", rows);
#if defined(__x86_64__) || defined(__i386__)
  if (cpu_has("avx512bf16")) return avx512bf16::tile_mode_seconds(rows, bytes);
#endif
  (void)bytes;
  return {};
}

static bool valid_tile_mode(int64_t mode) {
  return mode >= 0 && mode < TILE_MODE_COUNT && (!(mode & TILE_PREFETCH_L2) || (mode & TILE_PREFETCH));
}

static void check_tile_class(int64_t rows, int64_t nb) {
  TORCH_CHECK(rows >= 1, "moe_kernels: tile rows must be positive, not ", rows);
  TORCH_CHECK(nb == 1 || nb == 2, "moe_kernels: tile blocks must be 1 (single blocks) or 2 (block pairs), not ", nb);
}

// The mode (TILE_* bits) of tiles of `rows` rows (every row count of its class) over nb blocks (1: single
// blocks, no order to choose: 0, 1, 5; 2: block pairs) from now on; returns it.
int64_t set_tile_mode(int64_t rows, int64_t nb, int64_t mode) {
  check_tile_class(rows, nb);
  TORCH_CHECK(valid_tile_mode(mode), "moe_kernels: tile mode ", mode, " is not one of 0, 1, 2, 3, 5, 7");
  TORCH_CHECK(nb == 2 || !(mode & TILE_ONE_STREAM), "moe_kernels: single blocks take tile mode 0, 1 or 5, not ",
              mode);
  return tile_mode_slot(rows, static_cast<int>(nb)) = static_cast<int>(mode);
}

int64_t tile_mode(int64_t rows, int64_t nb) {
  check_tile_class(rows, nb);
  return tile_mode_slot(rows, static_cast<int>(nb));
}

// The decode attention's ask mode (ATTENTION_ASKS_*) from now on; returns it.
int64_t set_attention_asks(int64_t mode) {
  TORCH_CHECK(mode == ATTENTION_ASKS_L1 || mode == ATTENTION_ASKS_L2, "moe_kernels: attention ask mode ", mode,
              " is not 0 (into L1) or 1 (into L2)");
  return attention_asks_slot() = static_cast<int>(mode);
}

int64_t attention_asks() {
  return attention_asks_slot();
}

// The fastest instruction set this CPU runs: the dot tiles only where the dot product out-runs the
// FMA (where it runs at half the FMA's rate, the FMA tiles widening bf16 weights are faster).
static std::string best_isa() {
  if (cpu_has("amx")) return "amx";
  if (cpu_has("avx512bf16") && bf16_dot_rate() >= 1.0) return "avx512bf16";
  for (const char* name : {"avx512", "avx2"})
    if (cpu_has(name)) return name;
  return "generic";
}

static Isa isa_by_name_base(const std::string& name);

static Isa isa_by_name(const std::string& name) {
  Isa isa = isa_by_name_base(name);
#if defined(__x86_64__) || defined(__i386__)
  if (name == "avx512" || name == "avx512bf16" || name == "amx") isa.lut16_rows = &avx512::lut16_rows;
  if (name != "generic" && f16c_usable()) isa.e4m3_rows = &avx2::e4m3_rows;
#endif
  return isa;
}

static Isa isa_by_name_base(const std::string& name) {
  TORCH_CHECK(name == "generic" || name == "avx2" || name == "avx512" || name == "avx512bf16" || name == "amx",
              "moe_kernels: unknown ISA '", name, "' (expected generic, avx2, avx512, avx512bf16 or amx)");
  TORCH_CHECK(cpu_has(name), "moe_kernels: this CPU does not support ", name);
#if defined(MOE_HAVE_AMX)
  if (name == "amx") {  // bf16 prefill and decode attention on the tiles (decode heads of other sizes, and
                        // fp32, on the FMA path: the dot product's rate is ~0.5x the FMA's on these cores)
    Isa isa = make_isa<avx512::Kernels, avx512::AttentionKernels, avx512::NormKernels>("amx");
    using A = amx::AmxKernels;
    isa.wide_panels = true;
    isa.router_split = &amx::router_logits_split;
    isa.paged_prefill = &amx::paged_prefill;
    isa.dot = DotIsa{&A::gate_up, &A::down<float>, &A::down<uint16_t>, &A::down_add, &A::linear<float>,
                     &A::linear<uint16_t>, &amx::paged_decode_tiles, &A::down_final, &avx512bf16::dequant_int8_blocks,
                     &amx::decode_tiles_apply};
    return isa;
  }
#endif
#if defined(__x86_64__) || defined(__i386__)
  if (name == "avx512bf16") {
    Isa isa = make_isa<avx512::Kernels, avx512::AttentionKernels, avx512::NormKernels>("avx512bf16");
    using D = avx512bf16::DotKernels;
    isa.dot = DotIsa{&D::gate_up, &D::down<float>, &D::down<uint16_t>, &D::down_add, &D::linear<float>,
                     &D::linear<uint16_t>, &avx512bf16::AttentionDotKernels::decode, &D::down_final,
                     &avx512bf16::dequant_int8_blocks, nullptr,
                     &avx512bf16::AttentionDotKernels::decode_groups_any, &avx512bf16::group_lanes};
    return isa;
  }
  if (name == "avx512") return make_isa<avx512::Kernels, avx512::AttentionKernels, avx512::NormKernels>("avx512");
  if (name == "avx2") return make_isa<avx2::Kernels, avx2::AttentionKernels, avx2::NormKernels>("avx2");
#endif
  return make_isa<generic::Kernels, generic::AttentionKernels, generic::NormKernels>("generic");
}

static Isa& current_isa() {
  static Isa isa = isa_by_name(best_isa());
  return isa;
}

std::string isa_name() { return current_isa().name; }

std::string select_isa(const std::string& name) {
  std::string wanted = name;
  if (wanted == "auto") wanted = best_isa();
  current_isa() = isa_by_name(wanted);
  return current_isa().name;
}

static int weight_type(const at::Tensor& w) {
  switch (w.scalar_type()) {
    case at::kFloat: return W_F32;
    case at::kBFloat16: return W_BF16;
    case at::kChar: return W_I8;
    default: TORCH_CHECK(false, "moe_kernels: packed weights must be float32, bfloat16 or int8, got ", w.scalar_type());
  }
  return W_F32;
}

struct Item {
  int64_t expert, block, row0, rows, blocks = 1;  // blocks: neighbouring column blocks from block on
};

// Runs worker(claim) once on each of torch's threads (inline on one). claim(begin, end) hands
// out the next unclaimed contiguous range of item indices from one shared counter (false: none
// left), guided: each range is a share of what is left, so ranges start long (a thread streams
// neighbouring weight blocks, which its prefetches and the hardware's expect) and end short.
// Items of unequal cost (experts with more rows, longer sequences) thus even out over the
// threads, where at::parallel_for's static split gives each thread one fixed half.
template <typename Worker>
static void for_each_claimed(int64_t num_items, Worker&& worker) {
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), num_items);
  auto claim = [&next, num_items, threads](int64_t& begin, int64_t& end) {
    int64_t cur = next.load(std::memory_order_relaxed);
    do {
      if (cur >= num_items) return false;
      end = cur + std::max<int64_t>(1, (num_items - cur) / (2 * threads));
    } while (!next.compare_exchange_weak(cur, end, std::memory_order_relaxed));
    begin = cur;
    return true;
  };
  if (threads <= 1 || at::in_parallel_region()) {
    worker(claim);
    return;
  }
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) worker(claim);
  });
}

// body(item) for every item of ``items``, the items claimed as for_each_claimed hands them out.
template <typename Body>
static void for_each_item(const std::vector<Item>& items, Body&& body) {
  const int64_t n = static_cast<int64_t>(items.size());
  for_each_claimed(n, [&](auto& claim) {
    for (int64_t begin, end; claim(begin, end);)
      for (int64_t i = begin; i < end; ++i) body(items[i]);
  });
}

// Rows a work item covers: a panel that stays in L2 while a thread walks consecutive column
// blocks (a multiple of the 6- and 8-row register tiles). Without it a prefill-size expert
// re-streams all its rows from L3 once per column block.
constexpr int64_t ROW_PANEL = 96;

// Rows from which a work item covers two neighbouring column blocks. Each row broadcast then feeds
// two dot products or FMAs (fewer loads per product; dot tiles 1.1x at 64-384 rows per expert on
// Zen 5), and the item reads two weight streams at once, which one core fetches faster than one: on
// the Intel box (no AMX) a read prefetched 2-8 KB ahead ran at 10.8-12.0 GB/s from one stream and
// 13.8-15.2 GB/s from two or four, and Mixtral-style batch-32 decode steps (~8 rows per expert)
// took 0.75-0.81x the time with two-block items from 8 rows on the FMA tiles. The packed linears
// take the same thresholds. The dot tiles keep 16: two streams were 1.2x slower at 4 rows on Zen 5;
// MLA's decode linears (q_a, q_b, kv_a, o_proj) at 16-64 rows took 0.8-0.9x the time with
// two-block items there, and the batch-32 attention op ~0.93x; at 8 and 12 rows the linears were
// faster only with warm weights: decode steps (cold weights) at batch 8 and 12 gave the attention
// op 4.67-7.62 ms per step with a threshold of 8 against 4.58-6.82 with 16.
constexpr int64_t PAIR_BLOCK_MIN_ROWS = 8;
constexpr int64_t DOT_PAIR_BLOCK_MIN_ROWS = 16;

// Work items (expert, row panel, column blocks), column blocks innermost; panels of pair_min_rows
// rows or more (0: none) take two neighbouring blocks per item (one at the end), or with whole_panels
// all num_blocks in one item (the dot tiles' ops take any block count, two per pass). One call over a
// panel's blocks keeps the AMX passes' pipeline (each pass's epilogue under the next pass's products,
// amx_body.h) going from one block pair to the next instead of draining at every pair: AMX box, one
// thread, calls alternating in one process, the same bits: the DeepSeek-style MoE layer at T = 4096
// and 512 0.97x the time, the Mixtral-style layer at T = 4096 0.97x; bf16 linears of 512 to 4096
// rows (K 1024-2816) 0.93-0.97x.
static std::vector<Item> work_items(const std::vector<int64_t>& offsets, int64_t num_blocks,
                                    int64_t pair_min_rows = 0, bool whole_panels = false,
                                    int64_t panel = ROW_PANEL) {
  std::vector<Item> items;
  for (size_t e = 0; e + 1 < offsets.size(); ++e) {
    const int64_t n = offsets[e + 1] - offsets[e];
    for (int64_t r0 = 0; r0 < n; r0 += panel) {
      const int64_t rows = std::min(panel, n - r0);
      const int64_t per_item = pair_min_rows > 0 && rows >= pair_min_rows ? 2 : 1;
      if (whole_panels && per_item == 2) {
        items.push_back({static_cast<int64_t>(e), 0, offsets[e] + r0, rows, num_blocks});
        continue;
      }
      for (int64_t b = 0; b < num_blocks; b += per_item)
        items.push_back({static_cast<int64_t>(e), b, offsets[e] + r0, rows, std::min(per_item, num_blocks - b)});
    }
  }
  return items;
}

// (slot, row panel)s of rows grouped by slot (offsets: P + 1 row offsets), panels of ``panel`` rows.
static int64_t panel_count(const std::vector<int64_t>& offsets, int64_t panel) {
  int64_t panels = 0;
  for (size_t e = 0; e + 1 < offsets.size(); ++e) panels += (offsets[e + 1] - offsets[e] + panel - 1) / panel;
  return panels;
}

// Whether a step has four row panels a thread or more: enough to hand whole panels (all their column
// blocks, or gathered gate/up panels) to the threads; fewer spread better as (panel, block) items.
static bool panels_fill_threads(int64_t panels) { return panels >= 4 * at::get_num_threads(); }

// Rows per expert panel on ISAs with wide_panels (AMX) when one expert's packed gate/up weight is
// larger than WIDE_PANEL_MIN_BYTES (the 2 MB L2 of those cores): each panel streams the expert's
// weights from L3 or DRAM once per column block, so twice the rows halve that traffic. Mixtral-style
// layer (D 1024, I 2048: an 8 MB gate/up weight), AMX box, one thread, calls alternating in one
// process: T = 4096 0.90-0.93x the time with 192 rows against 96, T = 512 0.80-0.86x (128 rows an
// expert: one panel instead of two); 384 rows no better. The DeepSeek-style layer (1 MB, in L2)
// keeps 96 (192: 1.01x), and so do the FMA and vdpbf16ps tiles (Mixtral on avx512bf16: 0.99-1.01x).
constexpr int64_t WIDE_ROW_PANEL = 192;
constexpr int64_t WIDE_PANEL_MIN_BYTES = int64_t{2} << 20;
static int64_t expert_panel_rows(const Isa& isa, bool dot, const at::Tensor& w13p) {
  // int8 experts on the dot tiles are read as their bf16 copies (run_experts)
  const int64_t esize = dot && w13p.scalar_type() == at::kChar ? 2 : w13p.element_size();
  const int64_t per_expert = w13p.size(0) > 0 ? w13p.numel() / w13p.size(0) * esize : 0;
  return dot && isa.wide_panels && per_expert > WIDE_PANEL_MIN_BYTES ? WIDE_ROW_PANEL : ROW_PANEL;
}

// Checks x and the packed expert weights against each other.
static void check_experts(const at::Tensor& x, const at::Tensor& w13p, const at::Tensor& s13, const at::Tensor& w2p,
                          const at::Tensor& s2) {
  TORCH_CHECK(x.device().is_cpu() && w13p.device().is_cpu() && w2p.device().is_cpu(), "moe_kernels: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && w13p.dim() == 4 && w2p.dim() == 4, "moe_kernels: x [N, D], w13p [P, I/8, D, 16], "
              "w2p [P, D/16, I, 16] expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "moe_kernels: x must be "
              "float32 or bfloat16");
  const int64_t D = x.size(1), P = w13p.size(0), I = w13p.size(1) * 8, nb2 = w2p.size(1);
  TORCH_CHECK(w13p.size(2) == D && w13p.size(3) == 16 && w2p.size(0) == P && nb2 * 16 == D && w2p.size(2) == I &&
              w2p.size(3) == 16, "moe_kernels: packed weight shapes do not match x");
  TORCH_CHECK(w13p.scalar_type() == w2p.scalar_type(), "moe_kernels: w13p and w2p dtypes differ");
  const bool quantized = w13p.scalar_type() == at::kChar;
  TORCH_CHECK(!quantized || (s13.numel() == P * I * 2 && s2.numel() == P * D), "moe_kernels: int8 weights need scales");
}

// Row stride (elements) of the bf16 row buffers the dot tiles read that the ops allocate (gathered
// rows, activations): K plus one cache line. With rows a multiple of 4 KB apart (K = 1024, 2048 ...)
// a 16-row AMX tile's lines, and a register tile's rows, all fall in one or two L1 sets and evict each
// other; one line more spreads them over the sets. AMX (Intel, family 6 model 167 guest), a 32 x 32
// tile pass over K = 1024 and 2048 in a microbenchmark: 595 -> 674 and 548 -> 698 GFLOP/s.
static inline int64_t dot_row_stride(int64_t k) { return k + 32; }

// Routed rows (T x K assignments) from which the dot tiles' gate/up gathers each (expert, row panel)
// into a thread's L2 scratch as it reaches it, instead of every row into one [M, D] copy first. At
// T = 4096 (DeepSeek-style layer, AMX box) that copy wrote 50 MB, ~8 ms of the layer by perf, and
// gate/up then read it back from L3. Decode-size steps keep the copy and the (expert, block) items,
// which spread few rows over the threads, and so do steps with fewer than four panels per thread.
constexpr int64_t GATHER_MIN_ROWS = 1024;

// Mean rows per non-empty slot from which bf16 rows meet int8 experts on the dot tiles, through the
// experts' bf16 values (dequant_int8: q * scale rounded to bf16, as the PyTorch path multiplies them)
// made once per call, instead of widening both to fp32 on the FMA tiles. DeepSeek-style experts (D
// 1024, I 256, 64 slots, top-6), AMX box, one thread, CPU ms per call FMA / dot: 6 rows 5.1 / 7.0,
// 12 rows 9.3 / 9.4, 24 rows 17.1 / 8.1, 48 rows 34 / 11.6, 384 rows 300 / 49; the call's choice
// (like the Python side's library GEMM) follows its mean rows, so a row's values depend on it.
constexpr int64_t INT8_DOT_MIN_ROWS = 16;

// Whether a routed-expert call of rows grouped by `offsets` (P + 1 row offsets) runs the dot tiles:
// bf16 weights and rows where the ISA has them, int8 weights from INT8_DOT_MIN_ROWS rows per slot.
static bool experts_on_dot(const Isa& isa, int wt, at::ScalarType x_type, const std::vector<int64_t>& offsets) {
  if (isa.dot_bf16(wt, x_type)) return true;
  if (wt != W_I8 || isa.dot.dequant_int8 == nullptr || x_type != at::kBFloat16) return false;
  int64_t busy = 0;
  for (size_t e = 0; e + 1 < offsets.size(); ++e) busy += offsets[e + 1] > offsets[e] ? 1 : 0;
  return busy > 0 && offsets.back() >= INT8_DOT_MIN_ROWS * busy;
}

// int8 experts on the dot tiles: blocks [block, block + blocks) of one projection (which: 0 gate/up,
// 1 down) as bf16 (dequant_int8) in the calling thread's scratch, made once per (run_experts call,
// projection, blocks): the items of one expert's row panels that follow each other on a thread
// reuse it. Returns the copy (blocks K * 16 elements apart, as the bf16 layout's).
struct DequantScratch {
  uint64_t call = 0;
  int64_t block = -1, blocks = 0;
  LineVector<uint16_t> buf;
};
static std::atomic<uint64_t> dequant_calls{0};
static const uint16_t* dequantized(const Isa& isa, int which, uint64_t call, const int8_t* q, const float* scale,
                                   int64_t block, int64_t blocks, int64_t K) {
  thread_local DequantScratch scratch[2];
  DequantScratch& c = scratch[which];
  if (c.call != call || c.block != block || c.blocks != blocks) {
    c.buf.resize(blocks * K * 16);
    isa.dot.dequant_int8(q + block * K * 16, scale + block * 16, blocks, K, c.buf.data());
    c.call = call, c.block = block, c.blocks = blocks;
  }
  return c.buf.data();
}

// The two phases over rows xs [N, D] grouped by slot (offsets: P + 1 row offsets): gate/up + SiLU
// into activations, then down with the routing weight rw[n] (null: 1) and the int8 scale in the
// epilogue, into out [N, D] (bf16 when bf16_out, else fp32); or, given out_rows ([N] row ids), each
// row n added into fp32 row out_rows[n] of out (rows ld_out floats apart; 0: D), every output
// element summing its rows in row order (each thread owns whole column ranges). xs and the
// activations are bf16 on the dot tiles (dot: experts_on_dot holds; int8 weights are then read
// through their bf16 copies, the scales in them, not in the epilogue), else fp32. xs's rows are ldx
// elements apart (0: D); on the dot tiles the activations' rows are dot_row_stride(I) apart.
//
// Given first_rows ([N] flags, dot tiles with out_rows only), a flagged row is the first added into its
// output row (in slot order): stored, not added, so out need not be zeroed (see DotKernelsOf::down_add).
// Given gather (dot tiles with out_rows only), xs is not the grouped rows but the tokens' rows: row n is
// row out_rows[n] of xs (bf16, rows D apart), and gate/up runs items (expert, row panel), each
// gathering its panel into a thread's scratch (dot_row_stride(D) apart, in L2) before it walks every
// column block (the same panels, block pairs and tiles as items (expert, panel, blocks) give, so the
// same values). See GATHER_MIN_ROWS.
// Given sums (dot tiles with bf16_out and no out_rows: fp32 rows ld_sums apart, one per row of out),
// out's rows are bf16(sums + the bf16 output), the down projection's epilogue adding and rounding
// (DotKernelsOf::down_final).
static void run_experts(const void* xs, bool dot, const std::vector<int64_t>& offsets, int64_t D,
                        const at::Tensor& w13p, const at::Tensor& s13, const at::Tensor& w2p, const at::Tensor& s2,
                        const float* rw_ptr, bool bf16_out, void* out, const int64_t* out_rows = nullptr,
                        int64_t ld_out = 0, int64_t ldx = 0, bool gather = false,
                        const uint8_t* first_rows = nullptr, const float* sums = nullptr, int64_t ld_sums = 0) {
  if (ld_out == 0) ld_out = D;
  if (ldx == 0) ldx = D;
  const int64_t N = offsets.back(), nb13 = w13p.size(1), I = nb13 * 8, nb2 = w2p.size(1);
  const int64_t ld_act = dot ? dot_row_stride(I) : I;
  const bool quantized = w13p.scalar_type() == at::kChar;
  const at::Tensor w13c = w13p.contiguous(), w2c = w2p.contiguous();
  const at::Tensor s13c = quantized ? s13.to(at::kFloat).contiguous() : s13;
  const at::Tensor s2c = quantized ? s2.to(at::kFloat).contiguous() : s2;
  at::Tensor act = at::empty({N, ld_act}, at::TensorOptions().dtype(dot ? at::kBFloat16 : at::kFloat));

  const Isa& isa = current_isa();
  const int wt = weight_type(w13c);
  const int64_t esize = w13c.element_size();
  const int64_t panel = expert_panel_rows(isa, dot, w13c);
  const char* w13_ptr = static_cast<const char*>(w13c.data_ptr());
  const char* w2_ptr = static_cast<const char*>(w2c.data_ptr());
  const float* s13_ptr = quantized ? s13c.data_ptr<float>() : nullptr;
  const float* s2_ptr = quantized ? s2c.data_ptr<float>() : nullptr;
  const float* xf = static_cast<const float*>(xs);
  const uint16_t* xb = static_cast<const uint16_t*>(xs);
  float* act_f = dot ? nullptr : act.data_ptr<float>();
  uint16_t* act_b = dot ? reinterpret_cast<uint16_t*>(act.data_ptr()) : nullptr;
  // the dot tiles' weights: blocks [block, block + blocks) of gate/up (D) or down (I) as bf16 blocks;
  // int8 ones through their bf16 copies (experts_on_dot)
  const uint64_t call = dot && quantized ? ++dequant_calls : 0;
  auto dot_w13 = [&](int64_t block, int64_t blocks) -> const uint16_t* {
    if (call == 0) return reinterpret_cast<const uint16_t*>(w13_ptr + block * D * 16 * esize);
    return dequantized(isa, 0, call, reinterpret_cast<const int8_t*>(w13_ptr), s13_ptr, block, blocks, D);
  };
  auto dot_w2 = [&](int64_t block, int64_t blocks) -> const uint16_t* {
    if (call == 0) return reinterpret_cast<const uint16_t*>(w2_ptr + block * I * 16 * esize);
    return dequantized(isa, 1, call, reinterpret_cast<const int8_t*>(w2_ptr), s2_ptr, block, blocks, I);
  };

  // Phase 1: gate/up + SiLU, items (expert, 16-wide block of 8 gate + 8 up channels).
  const int64_t pairs = dot ? DOT_PAIR_BLOCK_MIN_ROWS : isa.pair_tiles ? PAIR_BLOCK_MIN_ROWS : 0;
  if (gather) {
    TORCH_CHECK(dot && out_rows, "moe_kernels: gathered panels need the dot tiles and the rows' tokens");
    const std::vector<Item> panels = work_items(offsets, 1, 0, false, panel);  // (expert, panel) once each
    const int64_t ldr = dot_row_stride(D);
    for_each_claimed(static_cast<int64_t>(panels.size()), [&](auto& claim) {
      LineVector<uint16_t> scratch(panel * ldr);
      for (int64_t begin, end; claim(begin, end);)
        for (int64_t i = begin; i < end; ++i) {
          const Item& it = panels[i];
          for (int64_t r = 0; r < it.rows; ++r)
            std::memcpy(scratch.data() + r * ldr, xb + out_rows[it.row0 + r] * D, D * sizeof(uint16_t));
          const uint16_t* w = dot_w13(it.expert * nb13, nb13);
          if (it.rows >= pairs) {  // block pairs, all in one call (see work_items)
            isa.dot.gate_up(scratch.data(), it.rows, D, ldr, w, static_cast<int>(nb13), D * 16,
                            act_b + it.row0 * ld_act, ld_act, it.row0 == offsets[it.expert]);
            continue;
          }
          for (int64_t b = 0; b < nb13; ++b)  // fewer rows than a pair takes: one block per call
            isa.dot.gate_up(scratch.data(), it.rows, D, ldr, w + b * D * 16, 1, D * 16,
                            act_b + it.row0 * ld_act + b * 8, ld_act, false);
        }
    });
  }
  // on the dot tiles with four panels a thread or more, a panel of pair rows is one item over all its
  // column blocks (see work_items)
  const bool whole = dot && panels_fill_threads(panel_count(offsets, panel));
  const std::vector<Item> up_items = gather ? std::vector<Item>{} : work_items(offsets, nb13, pairs, whole, panel);
  for_each_item(up_items, [&](const Item& it) {
    const int64_t block = it.expert * nb13 + it.block;
    const char* w = w13_ptr + block * D * 16 * esize;
    if (dot)
      isa.dot.gate_up(xb + it.row0 * ldx, it.rows, D, ldx, dot_w13(block, it.blocks), it.blocks, D * 16,
                      act_b + it.row0 * ld_act + it.block * 8, ld_act, it.row0 == offsets[it.expert]);
    else
      isa.gate_up(wt, xf + it.row0 * D, it.rows, D, w, it.blocks, D * 16, s13_ptr ? s13_ptr + block * 16 : nullptr,
                  act_f + it.row0 * I + it.block * 8, I);
  });
  // Phase 2: down projection, items (expert, 16 output channels); routing weight in the epilogue.
  const std::vector<Item> down_items = work_items(offsets, nb2, pairs, whole && !out_rows, panel);
  char* out_ptr = static_cast<char*>(out);
  auto down_item = [&](const Item& it) {
    const int64_t block = it.expert * nb2 + it.block;
    const void* w = w2_ptr + block * I * 16 * esize;
    const float* sc = s2_ptr ? s2_ptr + block * 16 : nullptr;
    const float* rw = rw_ptr ? rw_ptr + it.row0 : nullptr;
    if (out_rows) {
      float* col = reinterpret_cast<float*>(out_ptr) + it.block * 16;
      if (dot)
        isa.dot.down_add(act_b + it.row0 * ld_act, it.rows, I, ld_act, dot_w2(block, it.blocks), it.blocks,
                         I * 16, rw, out_rows + it.row0, col, ld_out, first_rows ? first_rows + it.row0 : nullptr);
      else
        isa.down_add(wt, act_f + it.row0 * I, it.rows, I, w, it.blocks, I * 16, sc, rw, out_rows + it.row0, col,
                     ld_out);
      return;
    }
    const int64_t first = it.row0 * D + it.block * 16;
    uint16_t* ob = reinterpret_cast<uint16_t*>(out_ptr) + first;
    float* of = reinterpret_cast<float*>(out_ptr) + first;
    if (dot) {
      const uint16_t* a = act_b + it.row0 * ld_act;
      const uint16_t* wb = dot_w2(block, it.blocks);
      if (sums)
        isa.dot.down_final(a, it.rows, I, ld_act, wb, it.blocks, I * 16, sums + it.row0 * ld_sums + it.block * 16,
                           ld_sums, ob, D);
      else if (bf16_out) isa.dot.down_bf16(a, it.rows, I, ld_act, wb, it.blocks, I * 16, rw, ob, D);
      else isa.dot.down_f32(a, it.rows, I, ld_act, wb, it.blocks, I * 16, rw, of, D);
    } else if (bf16_out) {
      isa.down_bf16(wt, act_f + it.row0 * I, it.rows, I, w, it.blocks, I * 16, sc, rw, ob, D);
    } else {
      isa.down_f32(wt, act_f + it.row0 * I, it.rows, I, w, it.blocks, I * 16, sc, rw, of, D);
    }
  };
  if (!out_rows) {
    for_each_item(down_items, down_item);
    return;
  }
  // rows added into shared output rows: thread t takes the items of its own range of column block
  // pairs, in item order (slot order for every output element), so no two threads touch one element
  const int64_t units = (nb2 + 1) / 2, threads = std::min<int64_t>(at::get_num_threads(), units);
  auto run_columns = [&](int64_t t, int64_t nt) {
    const int64_t b0 = 2 * (units * t / nt), b1 = std::min(nb2, 2 * (units * (t + 1) / nt));
    // on the dot tiles a panel's block pairs in the range go in one call (see work_items): the same
    // passes in the same order as one call per item
    const size_t count = down_items.size();
    for (size_t i = 0; i < count;) {
      const Item& it = down_items[i++];
      if (it.block < b0 || it.block >= b1) continue;
      Item run = it;
      if (dot && it.blocks == 2)
        for (; i < count && down_items[i].expert == it.expert && down_items[i].row0 == it.row0 &&
               down_items[i].block < b1; ++i)
          run.blocks += down_items[i].blocks;
      down_item(run);
    }
  };
  if (threads <= 1 || at::in_parallel_region()) {
    run_columns(0, 1);
    return;
  }
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) run_columns(t, threads);
  });
}

// x: [N, D] float32 or bfloat16, rows grouped by slot; counts: P ints summing to N.
// w13p: [P, I/8, D, 16] (8 gate + 8 up channels per block); s13: [P, I/8, 16] fp32 or empty.
// w2p: [P, D/16, I, 16]; s2: [P, D/16, 16] fp32 or empty. row_weights: [N] fp32 or empty.
// Returns [N, D] in x's dtype, or fp32 when out_fp32.
at::Tensor experts_forward(const at::Tensor& x, at::IntArrayRef counts, const at::Tensor& w13p,
                           const at::Tensor& s13, const at::Tensor& w2p, const at::Tensor& s2,
                           const at::Tensor& row_weights, bool out_fp32) {
  check_experts(x, w13p, s13, w2p, s2);
  const int64_t N = x.size(0), D = x.size(1), P = w13p.size(0);
  TORCH_CHECK(static_cast<int64_t>(counts.size()) == P, "moe_kernels: counts has ", counts.size(), " entries for ",
              P, " slots");
  TORCH_CHECK(row_weights.numel() == 0 || row_weights.numel() == N, "moe_kernels: row_weights must have N entries");
  std::vector<int64_t> offsets(P + 1, 0);
  for (int64_t e = 0; e < P; ++e) {
    TORCH_CHECK(counts[e] >= 0, "moe_kernels: negative count");
    offsets[e + 1] = offsets[e] + counts[e];
  }
  TORCH_CHECK(offsets[P] == N, "moe_kernels: counts sum to ", offsets[P], ", x has ", N, " rows");
  const auto out_dtype = out_fp32 ? at::kFloat : x.scalar_type();
  at::Tensor out = at::empty({N, D}, x.options().dtype(out_dtype));
  if (N == 0) return out;
  const bool dot = experts_on_dot(current_isa(), weight_type(w13p), x.scalar_type(), offsets);
  const at::Tensor xr = dot ? x.contiguous() : float32_contiguous(x);
  const at::Tensor rwc = row_weights.numel() ? row_weights.to(at::kFloat).contiguous() : row_weights;
  run_experts(xr.data_ptr(), dot, offsets, D, w13p, s13, w2p, s2, rwc.numel() ? rwc.data_ptr<float>() : nullptr,
              out_dtype == at::kBFloat16, out.data_ptr());
  return out;
}

// Rows token[0..N) of x [T, D] (float32 or bfloat16; rows any stride apart, columns contiguous) gathered
// in that order: bf16 copies dot_row_stride(D) apart for the dot tiles, else fp32 rows D apart (bf16 ones
// widened). [N, ldr].
static at::Tensor gather_rows(const at::Tensor& x, const std::vector<int64_t>& token, bool dot) {
  const int64_t N = static_cast<int64_t>(token.size()), D = x.size(1), xs0 = x.stride(0);
  const int64_t ldr = dot ? dot_row_stride(D) : D;
  at::Tensor rows = at::empty({N, ldr}, at::TensorOptions().dtype(dot ? at::kBFloat16 : at::kFloat));
  const bool widen = x.scalar_type() == at::kBFloat16 && !dot;
  const int64_t esize = x.element_size(), row_bytes = D * esize;
  const char* xp = static_cast<const char*>(x.data_ptr());
  char* rp = static_cast<char*>(rows.data_ptr());
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const char* src = xp + token[r] * xs0 * esize;
      if (widen) {
        const uint16_t* h = reinterpret_cast<const uint16_t*>(src);
        float* dst = rows.data_ptr<float>() + r * D;
        for (int64_t c = 0; c < D; ++c) dst[c] = to_float(h[c]);
      } else {  // same dtype as x
        std::memcpy(rp + r * ldr * esize, src, row_bytes);
      }
    }
  });
  return rows;
}

// The whole routed-expert step from the router's output: x [T, D] float32 or bfloat16; slot_ids
// [T, K] int64 local slots (-1: dropped / not here); weights [T, K] routing weights. Groups the
// (token, k) assignments by slot (row-major order within a slot), gathers their rows, runs the
// experts with each row's weight in the epilogue and sums every token's rows in that same order.
// Returns [T, D] float32: sum over kept k of weights[t, k] * expert_{slot[t, k]}(x[t]), the values
// of compute_local_routing + experts_forward + index_add_ (same arithmetic, same order).
// experts_topk_rows: the same sums as a [T, D] view whose rows may lie padded in memory (see the
// padding below), for callers that read the sums once more anyway (moe_ffn): no contiguous copy.
static at::Tensor experts_topk_rows(const at::Tensor& x, const at::Tensor& slot_ids, const at::Tensor& weights,
                                    const at::Tensor& w13p, const at::Tensor& s13, const at::Tensor& w2p,
                                    const at::Tensor& s2) {
  check_experts(x, w13p, s13, w2p, s2);
  const int64_t T = x.size(0), D = x.size(1), P = w13p.size(0);
  TORCH_CHECK(slot_ids.dim() == 2 && slot_ids.size(0) == T && slot_ids.scalar_type() == at::kLong,
              "moe_kernels: slot_ids must be [T, K] int64");
  TORCH_CHECK(weights.sizes() == slot_ids.sizes(), "moe_kernels: weights must be [T, K] like slot_ids");
  const int64_t K = slot_ids.size(1);
  const at::Tensor ids = slot_ids.contiguous(), wts = weights.to(at::kFloat).contiguous();
  const int64_t* idp = ids.data_ptr<int64_t>();
  const float* wp = wts.data_ptr<float>();
  std::vector<int64_t> offsets(P + 1, 0);
  for (int64_t i = 0; i < T * K; ++i) {
    TORCH_CHECK(idp[i] < P, "moe_kernels: slot id ", idp[i], " outside the ", P, " local slots");
    if (idp[i] >= 0) ++offsets[idp[i] + 1];
  }
  for (int64_t e = 0; e < P; ++e) offsets[e + 1] += offsets[e];
  const int64_t M = offsets[P];
  // Prefill-size outputs get 16 floats of padding per row while the rows are added into them: with
  // rows D * 4 bytes apart (a multiple of 4 KB for D = 1024, 2048, 7168 ...) a tile's output lines all
  // fall in one L1 set (a 48 KB, 12-way L1 on Zen 5) and evicted each other before the adds came (DeepSeek-style
  // layer, T = 4096, Zen 5: the adds' misses were ~0.17 of the products' time, 0.06 padded); copying
  // the result out contiguously costs less than that (experts 102-115 ms padded against 118-126).
  const int64_t ld = T * D > SMALL_ELEMENTS ? D + 16 : D;
  const bool dot = experts_on_dot(current_isa(), weight_type(w13p), x.scalar_type(), offsets);
  if (M == 0) return at::zeros({T, ld}, x.options().dtype(at::kFloat)).narrow(1, 0, D);
  // on the dot tiles each token's first row (in slot order) is stored into its output row, the rest
  // added, and only the rows of tokens with no kept row zeroed (at T = 4096, D = 1024: 16 MB of zeros
  // written, then read back by the first adds, ~2 ms); elsewhere every row is added into zeros
  at::Tensor acc = dot ? at::empty({T, ld}, x.options().dtype(at::kFloat))
                       : at::zeros({T, ld}, x.options().dtype(at::kFloat));
  std::vector<int64_t> fill(offsets.begin(), offsets.end() - 1), token(M);
  at::Tensor row_w = at::empty({M}, at::TensorOptions().dtype(at::kFloat));
  float* rw = row_w.data_ptr<float>();
  for (int64_t i = 0; i < T * K; ++i)
    if (idp[i] >= 0) {
      const int64_t r = fill[idp[i]]++;
      token[r] = i / K;
      rw[r] = wp[i];
    }
  std::vector<uint8_t> first;
  if (dot) {
    first.assign(M, 0);
    std::vector<uint8_t> seen(T, 0);
    for (int64_t r = 0; r < M; ++r)
      if (!seen[token[r]]) seen[token[r]] = 1, first[r] = 1;
    float* ap = acc.data_ptr<float>();
    for (int64_t t = 0; t < T; ++t)
      if (!seen[t]) std::memset(ap + t * ld, 0, D * sizeof(float));
  }
  const at::Tensor xc = x.contiguous();
  // panels gathered as gate/up goes (see GATHER_MIN_ROWS)
  if (dot && M >= GATHER_MIN_ROWS &&
      panels_fill_threads(panel_count(offsets, expert_panel_rows(current_isa(), dot, w13p)))) {
    run_experts(xc.data_ptr(), dot, offsets, D, w13p, s13, w2p, s2, rw, false, acc.data_ptr(), token.data(), ld,
                0, true, first.data());
    return acc.narrow(1, 0, D);
  }
  const int64_t ldr = dot ? dot_row_stride(D) : D;
  const at::Tensor rows = gather_rows(xc, token, dot);
  // the down projection adds each row into its token's output row (slot order per element)
  run_experts(rows.data_ptr(), dot, offsets, D, w13p, s13, w2p, s2, rw, false, acc.data_ptr(), token.data(), ld, ldr,
              false, dot ? first.data() : nullptr);
  return acc.narrow(1, 0, D);
}

// bf16 of an fp32 value, ties away from zero: how torch.embedding_bag rounds its fp32 sums of bf16 rows
// on CPU (round to nearest-even elsewhere in this file).
static inline uint16_t bf16_ties_away(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN stays NaN
  return static_cast<uint16_t>((u + 0x8000u) >> 16);
}

// The routed experts of an expert-parallel destination over the rows it received, in one op. x [M, D]
// float32 or bfloat16 (rows any stride apart, columns contiguous: a view into the receive buffer);
// slot_ids [M, K] int32 or int64 physical slots (any row stride), slot s being local slot s - first_slot
// where that lies in [0, P) and hosted elsewhere (or dropped, -1) otherwise; weights [M, K] float32 (any
// row stride). Returns [M, D] in x's dtype: per row, over k ascending, the fp32 sum of weights[m, k] *
// expert(x[m]) each rounded to x's dtype, rounded once more to x's dtype (bf16: ties away from zero) --
// the values of Experts.forward_rows' tensor ops (localize_slots, compute_local_routing, experts_forward,
// embedding_bag). Returns an empty [0] tensor, computing nothing, where the rows per busy slot reach
// library_min_rows (where the caller runs library GEMMs instead).
at::Tensor experts_forward_rows(const at::Tensor& x, const at::Tensor& slot_ids, const at::Tensor& weights,
                                int64_t first_slot, const at::Tensor& w13p, const at::Tensor& s13,
                                const at::Tensor& w2p, const at::Tensor& s2, double library_min_rows) {
  check_experts(x, w13p, s13, w2p, s2);
  const int64_t M = x.size(0), D = x.size(1), P = w13p.size(0);
  TORCH_CHECK(x.stride(1) == 1 || D <= 1, "moe_kernels: experts_forward_rows needs x's columns contiguous");
  TORCH_CHECK(slot_ids.dim() == 2 && slot_ids.size(0) == M &&
              (slot_ids.scalar_type() == at::kLong || slot_ids.scalar_type() == at::kInt) &&
              (slot_ids.stride(1) == 1 || slot_ids.size(1) <= 1),
              "moe_kernels: experts_forward_rows takes slot_ids [M, K] int32 or int64 with contiguous columns");
  TORCH_CHECK(weights.sizes() == slot_ids.sizes() && weights.scalar_type() == at::kFloat &&
              (weights.stride(1) == 1 || weights.size(1) <= 1),
              "moe_kernels: experts_forward_rows takes weights [M, K] float32 like slot_ids");
  const int64_t K = slot_ids.size(1);
  const bool ids64 = slot_ids.scalar_type() == at::kLong;
  const int64_t is0 = slot_ids.stride(0), ws0 = weights.stride(0);
  const int64_t* id64 = ids64 ? slot_ids.data_ptr<int64_t>() : nullptr;
  const int32_t* id32 = ids64 ? nullptr : slot_ids.data_ptr<int32_t>();
  const float* wsrc = weights.data_ptr<float>();
  std::vector<int64_t> local(M * K), offsets(P + 1, 0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) {
      const int64_t s = ids64 ? id64[m * is0 + k] : id32[m * is0 + k];
      const int64_t l = s - first_slot;
      const int64_t slot = s >= 0 && l >= 0 && l < P ? l : -1;
      local[m * K + k] = slot;
      if (slot >= 0) ++offsets[slot + 1];
    }
  int64_t busy = 0;
  for (int64_t e = 0; e < P; ++e) busy += offsets[e + 1] > 0, offsets[e + 1] += offsets[e];
  const int64_t N = offsets[P];
  if (N > 0 && static_cast<double>(N) / static_cast<double>(busy) >= library_min_rows)
    return at::empty({0}, x.options());
  at::Tensor out = at::empty({M, D}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (N == 0) return out.zero_();
  // the assignments grouped by slot, row-major within a slot (compute_local_routing's order)
  std::vector<int64_t> fill(offsets.begin(), offsets.end() - 1), token(N), pos(M * K, -1);
  std::vector<float> rw(N);
  for (int64_t i = 0; i < M * K; ++i)
    if (local[i] >= 0) {
      const int64_t r = fill[local[i]]++;
      token[r] = i / K;
      rw[r] = wsrc[(i / K) * ws0 + i % K];
      pos[i] = r;
    }
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const bool dot = experts_on_dot(current_isa(), weight_type(w13p), x.scalar_type(), offsets);
  const int64_t ldr = dot ? dot_row_stride(D) : D;
  const at::Tensor rows = gather_rows(x, token, dot);
  at::Tensor y = at::empty({N, D}, x.options().memory_format(at::MemoryFormat::Contiguous));
  run_experts(rows.data_ptr(), dot, offsets, D, w13p, s13, w2p, s2, rw.data(), bf16, y.data_ptr(), nullptr, 0, ldr);
  // each row's sum over its k, in k order, as embedding_bag sums a bag
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(D);
    for (int64_t m = begin; m < end; ++m) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t k = 0; k < K; ++k) {
        const int64_t r = pos[m * K + k];
        if (r < 0) continue;
        if (bf16) {
          const uint16_t* yr = reinterpret_cast<const uint16_t*>(y.data_ptr()) + r * D;
          for (int64_t c = 0; c < D; ++c) acc[c] += to_float(yr[c]);
        } else {
          const float* yr = y.data_ptr<float>() + r * D;
          for (int64_t c = 0; c < D; ++c) acc[c] += yr[c];
        }
      }
      if (bf16) {
        uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr()) + m * D;
        for (int64_t c = 0; c < D; ++c) o[c] = bf16_ties_away(acc[c]);
      } else {
        std::memcpy(out.data_ptr<float>() + m * D, acc.data(), D * sizeof(float));
      }
    }
  });
  return out;
}

// Capacity with policy "position" and overflow "drop", no renormalisation (moe.capacity.apply_capacity,
// and apply_slot_limits for the global scope's per-slot shares): of each slot's assignments in row-major
// order (token, then k), the first `capacity` (or limits[slot] when limits is given) are kept and the
// rest get slot -1 and weight 0, in place. Assignments already at -1 get weight 0 and are not counted.
// slots, weights: n contiguous entries; slots below P. Returns how many were dropped.
static int64_t drop_over_capacity(int64_t* slots, float* weights, int64_t n, int64_t P, int64_t capacity,
                                  const int64_t* limits = nullptr) {
  std::vector<int64_t> kept(P, 0);
  int64_t dropped = 0;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t s = slots[j];
    if (s < 0) {
      weights[j] = 0.0f;
      continue;
    }
    TORCH_CHECK(s < P, "moe_kernels: slot id ", s, " outside ", P, " slots");
    if (kept[s] < (limits ? limits[s] : capacity)) {
      ++kept[s];
    } else {
      slots[j] = -1;
      weights[j] = 0.0f;
      ++dropped;
    }
  }
  return dropped;
}

// slot_ids [T, K] int64 (-1: already dropped) and weights [T, K] (any float dtype) -> (slot ids [T, K]
// int64, weights [T, K] float32, dropped: a 0-dim int64) after drop_over_capacity, in new tensors.
// limits: [num_slots] int64 per-slot limits, or empty for `capacity` on every slot.
std::tuple<at::Tensor, at::Tensor, at::Tensor> capacity_drop(const at::Tensor& slot_ids, const at::Tensor& weights,
                                                             int64_t num_slots, int64_t capacity,
                                                             const at::Tensor& limits) {
  TORCH_CHECK(slot_ids.dim() == 2 && slot_ids.scalar_type() == at::kLong && weights.sizes() == slot_ids.sizes(),
              "moe_kernels: capacity_drop takes slot_ids [T, K] int64 and weights [T, K]");
  TORCH_CHECK(num_slots >= 1 && capacity >= 0, "moe_kernels: capacity_drop needs num_slots >= 1 and capacity >= 0");
  TORCH_CHECK(limits.numel() == 0 || (limits.numel() == num_slots && limits.scalar_type() == at::kLong),
              "moe_kernels: capacity_drop's limits must be [num_slots] int64 or empty");
  const at::Tensor lim = limits.contiguous();
  at::Tensor ids = slot_ids.contiguous().clone(at::MemoryFormat::Contiguous);
  at::Tensor w = weights.to(at::kFloat).contiguous().clone(at::MemoryFormat::Contiguous);
  const int64_t dropped = drop_over_capacity(ids.data_ptr<int64_t>(), w.data_ptr<float>(), ids.numel(), num_slots,
                                             capacity, lim.numel() ? lim.data_ptr<int64_t>() : nullptr);
  return {ids, w, at::scalar_tensor(dropped, at::TensorOptions().dtype(at::kLong))};
}

// The expert-parallel dispatch's plan and send buffer in one pass: the values of parallel.dispatch.plan's
// destination_mask, plan_from_mask and pack_rows. x: [T, D] (any dtype); slot_ids: [T, K] int64 or int32
// physical slots (-1 dropped), slot p on rank p / num_local; weights: [T, K] float32. Each token goes
// once to every rank that hosts one of its slots, rows rank-major, tokens ascending inside a rank.
// The rows go into send's first N rows: send [>= N, row_bytes] uint8 contiguous (a reused buffer; N is at
// most T x min(K, R)), each [hidden, padded to 8 bytes | K int32 slots | K float32 weights]. Returns
// (pair_token [N] int64, send_counts [R] int64, combine_index [N] int64: the rows token-major,
// combine_offsets [T] int64: where each token's rows start in it).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> dispatch_plan(
    const at::Tensor& x, const at::Tensor& slot_ids, const at::Tensor& weights, int64_t num_local,
    int64_t num_ranks, at::Tensor send) {
  TORCH_CHECK(x.dim() == 2 && slot_ids.dim() == 2 && slot_ids.size(0) == x.size(0) &&
              weights.sizes() == slot_ids.sizes(), "moe_kernels: dispatch_plan takes x [T, D], slot_ids and "
              "weights [T, K]");
  TORCH_CHECK(num_local >= 1 && num_ranks >= 1, "moe_kernels: dispatch_plan needs num_local, num_ranks >= 1");
  const int64_t T = x.size(0), K = slot_ids.size(1), R = num_ranks, P = num_local * num_ranks;
  const at::Tensor xc = x.contiguous(), ids = slot_ids.to(at::kLong).contiguous();
  const at::Tensor w = weights.to(at::kFloat).contiguous();
  const int64_t* ip = ids.data_ptr<int64_t>();
  const float* wp = w.data_ptr<float>();
  std::vector<int64_t> row(R * T, -1);  // [R, T]: the send row of (rank, token), -1 none
  for (int64_t i = 0; i < T * K; ++i) {
    const int64_t s = ip[i];
    TORCH_CHECK_VALUE(s >= -1 && s < P, "slot id ", s, " out of range: ", R, " ranks x ", num_local, " local slots");
    if (s >= 0) row[(s / num_local) * T + i / K] = 0;
  }
  const auto opts = at::TensorOptions().dtype(at::kLong);
  at::Tensor counts = at::zeros({R}, opts), offsets = at::empty({T}, opts);
  int64_t* cp = counts.data_ptr<int64_t>();
  int64_t N = 0;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t t = 0; t < T; ++t)
      if (row[r * T + t] == 0) row[r * T + t] = N++, ++cp[r];
      else row[r * T + t] = -1;
  at::Tensor pair_token = at::empty({N}, opts), combine_index = at::empty({N}, opts);
  int64_t* pt = pair_token.data_ptr<int64_t>();
  int64_t* ci = combine_index.data_ptr<int64_t>();
  int64_t* co = offsets.data_ptr<int64_t>();
  for (int64_t r = 0, n = 0; r < R; ++r)
    for (int64_t t = 0; t < T; ++t)
      if (row[r * T + t] >= 0) pt[n++] = t;
  for (int64_t t = 0, j = 0; t < T; ++t) {
    co[t] = j;
    for (int64_t r = 0; r < R; ++r)
      if (row[r * T + t] >= 0) ci[j++] = row[r * T + t];
  }
  const int64_t nbytes = x.size(1) * x.element_size(), hidden_bytes = (nbytes + 7) / 8 * 8;
  const int64_t row_bytes = hidden_bytes + 8 * K;
  TORCH_CHECK(send.scalar_type() == at::kByte && send.is_contiguous() && send.dim() == 2 && send.size(1) == row_bytes &&
              send.size(0) >= N, "moe_kernels: dispatch_plan's send buffer must be [>= ", N, ", ", row_bytes,
              "] uint8 contiguous");
  uint8_t* sp = send.data_ptr<uint8_t>();
  const uint8_t* xp = static_cast<const uint8_t*>(xc.data_ptr());
  for (int64_t n = 0; n < N; ++n) {
    uint8_t* dst = sp + n * row_bytes;
    const int64_t t = pt[n];
    std::memcpy(dst, xp + t * nbytes, nbytes);
    int32_t* meta = reinterpret_cast<int32_t*>(dst + hidden_bytes);
    for (int64_t k = 0; k < K; ++k) meta[k] = static_cast<int32_t>(ip[t * K + k]);
    std::memcpy(meta + K, wp + t * K, K * sizeof(float));
  }
  return {pair_token, counts, combine_index, offsets};
}

at::Tensor experts_forward_topk(const at::Tensor& x, const at::Tensor& slot_ids, const at::Tensor& weights,
                                const at::Tensor& w13p, const at::Tensor& s13, const at::Tensor& w2p,
                                const at::Tensor& s2) {
  return experts_topk_rows(x, slot_ids, weights, w13p, s13, w2p, s2).contiguous();
}

// out[g] = x[g] @ W[g]^T + bias[g] written into out [G, N, C] (any strides, its columns contiguous;
// float32 or bfloat16): x [G, N, K] float32 or bfloat16 (any strides); wp [G, Cp/16, K, 16] float32 or
// bfloat16 (Cp = C rounded up to 16, zero padded), W[g] the [C, K] weight packed into wp[g]; bias
// [G, C] float32 or empty. On the dot tiles x's rows are read where they lie when its columns are
// contiguous (a permuted view costs no copy), else x is made contiguous first.
static void linear_into(const at::Tensor& x, const at::Tensor& wp, const at::Tensor& bias, int64_t C,
                        const at::Tensor& out) {
  TORCH_CHECK(x.device().is_cpu() && wp.device().is_cpu(), "moe_kernels: CPU tensors only");
  TORCH_CHECK(x.dim() == 3 && wp.dim() == 4, "moe_kernels: x [G, N, K], wp [G, Cp/16, K, 16] expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "moe_kernels: x must be "
              "float32 or bfloat16");
  const int wt = weight_type(wp);
  TORCH_CHECK(wt != W_I8, "moe_kernels: linear weights must be float32 or bfloat16");
  const int64_t G = x.size(0), N = x.size(1), K = x.size(2), nb = wp.size(1);
  TORCH_CHECK(wp.size(0) == G && wp.size(2) == K && wp.size(3) == 16 && C > 0 && C <= nb * 16 && C > (nb - 1) * 16,
              "moe_kernels: packed linear weight shape does not match x / out_features");
  TORCH_CHECK(bias.numel() == 0 || bias.numel() == G * C, "moe_kernels: bias must have G * C entries");
  TORCH_CHECK(out.dim() == 3 && out.size(0) == G && out.size(1) == N && out.size(2) == C && out.stride(2) == 1 &&
              (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              "moe_kernels: linear output must be a [G, N, C] float32 or bfloat16 view with contiguous columns");
  if (N == 0) return;
  const Isa& isa = current_isa();
  const bool dot = isa.dot_bf16(wt, x.scalar_type());
  const at::Tensor xr = dot ? (x.stride(2) == 1 ? x : bf16_contiguous(x)) : float32_contiguous(x);
  const int64_t xs0 = dot ? xr.stride(0) : N * K, xs1 = dot ? xr.stride(1) : K;
  const int64_t os0 = out.stride(0), os1 = out.stride(1);
  const at::Tensor wc = wp.contiguous();
  const at::Tensor bc = bias.numel() ? bias.to(at::kFloat).contiguous() : bias;
  const int64_t esize = wc.element_size();
  const char* w_ptr = static_cast<const char*>(wc.data_ptr());
  const float* xs = dot ? nullptr : xr.data_ptr<float>();
  const uint16_t* xb = dot ? reinterpret_cast<const uint16_t*>(xr.data_ptr()) : nullptr;
  const float* b_ptr = bc.numel() ? bc.data_ptr<float>() : nullptr;
  const bool bf16_out = out.scalar_type() == at::kBFloat16;
  char* out_ptr = static_cast<char*>(out.data_ptr());
  const int64_t panels = (N + ROW_PANEL - 1) / ROW_PANEL;
  // two neighbouring column blocks per item from PAIR_BLOCK_MIN_ROWS rows (DOT_PAIR_BLOCK_MIN_ROWS on
  // the dot tiles; the FMA tiles where they have two-block tiles); the last item of an odd count
  // takes one
  const int64_t per_item = std::min(N, ROW_PANEL) >= (dot ? DOT_PAIR_BLOCK_MIN_ROWS : PAIR_BLOCK_MIN_ROWS) &&
                           (dot || isa.pair_tiles) ? 2 : 1;
  // on the dot tiles with four (group, panel)s a thread or more, an item covers a panel's every block
  // (one call, see work_items)
  const bool whole = dot && per_item == 2 && panels_fill_threads(G * panels);
  const int64_t step = whole ? nb : per_item;  // blocks per item
  const int64_t nbi = (nb + step - 1) / step;  // items per (group, panel)
  // items (group, row panel, column blocks), column blocks innermost: a thread's consecutive items
  // reuse one panel of x from cache while the weight streams
  at::parallel_for(0, G * panels * nbi, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t g = i / (panels * nbi), p = (i / nbi) % panels, b = (i % nbi) * step;
      const int blocks = static_cast<int>(std::min(step, nb - b));
      const int64_t r0 = p * ROW_PANEL, rows = std::min(ROW_PANEL, N - r0);
      const int64_t ncols = std::min<int64_t>(16 * blocks, C - b * 16);
      const void* w = w_ptr + ((g * nb + b) * K * 16) * esize;
      const float* bp = b_ptr ? b_ptr + g * C + b * 16 : nullptr;
      const int64_t first = g * os0 + r0 * os1 + b * 16;
      uint16_t* ob = reinterpret_cast<uint16_t*>(out_ptr) + first;
      float* of = reinterpret_cast<float*>(out_ptr) + first;
      if (dot) {
        const uint16_t* x_rows = xb + g * xs0 + r0 * xs1;
        const uint16_t* wb = static_cast<const uint16_t*>(w);
        if (bf16_out) isa.dot.linear_bf16(x_rows, rows, K, xs1, wb, blocks, bp, ncols, ob, os1);
        else isa.dot.linear_f32(x_rows, rows, K, xs1, wb, blocks, bp, ncols, of, os1);
      } else if (bf16_out) {
        isa.linear_bf16(wt, xs + g * xs0 + r0 * xs1, rows, K, w, blocks, K * 16, bp, ncols, ob, os1);
      } else {
        isa.linear_f32(wt, xs + g * xs0 + r0 * xs1, rows, K, w, blocks, K * 16, bp, ncols, of, os1);
      }
    }
  });
}

// x: [G, N, K] float32 or bfloat16; wp: [G, Cp/16, K, 16] float32 or bfloat16 (Cp = C rounded up
// to 16, zero padded); bias: [G, C] float32 or empty. Returns [G, N, C] in x's dtype (fp32 when
// out_fp32): out[g] = x[g] @ W[g]^T + bias[g], W[g] the [C, K] weight packed into wp[g].
at::Tensor linear_forward(const at::Tensor& x, const at::Tensor& wp, const at::Tensor& bias, int64_t C,
                          bool out_fp32) {
  TORCH_CHECK(x.dim() == 3, "moe_kernels: x [G, N, K], wp [G, Cp/16, K, 16] expected");  // before its sizes
  at::Tensor out = at::empty({x.size(0), x.size(1), C}, x.options().dtype(out_fp32 ? at::kFloat : x.scalar_type()));
  linear_into(x, wp, bias, C, out);
  return out;
}

// The blocks of sequence b's first len tokens (row b of [B, nb] block tables, S tokens per block)
// lie inside a pool of N blocks.
static void check_blocks(const int64_t* tp, int64_t nb, int64_t b, int64_t len, int64_t S, int64_t N) {
  for (int64_t j = 0; j < (len + S - 1) / S; ++j)
    TORCH_CHECK(tp[b * nb + j] >= 0 && tp[b * nb + j] < N, "moe_kernels: block id ", tp[b * nb + j],
                " outside the pool of ", N);
}

// The work items of the paged attention ops: (sequence, kv head, group of its query heads), with
// enough groups that every thread gets work. Item i covers query heads [h0, h0 + hh) of sequence b
// against kv head g, whose key and value sit at head0's offsets + g * kv_stride (head()).
struct HeadItems {
  struct One {
    int64_t b, g, h0, hh;
  };
  int64_t num_kv_heads, rep, groups, per_group, count;
  // lanes_pass: the items' heads share one score pass (the dot path's decode, 16 heads in the lanes
  // of each dot product or the AMX tiles; the FMA path's lanes, one head a lane; each head's values
  // independent of the others in its item):
  // each item runs the score pass over all the rows again, so a kv head's query heads are split only
  // as far as every thread gets one item (two items of 8 heads at batch 1 took twice the score pass of
  // one; at two threads, items of 8 heads instead of 4: batch 1 / 2 at 2,048 tokens of context 0.91x /
  // 0.93x the step, the same at 128 and 512). Elsewhere an item's head count picks the tiles (and the
  // order of their sums), so the grouping does not depend on that, and two items a thread balance them.
  HeadItems(int64_t B, int64_t H, int64_t kv_heads, bool lanes_pass = false)
      : num_kv_heads(kv_heads), rep(H / kv_heads) {
    const int64_t items_wanted = (lanes_pass ? 1 : 2) * at::get_num_threads();
    groups = std::min<int64_t>(rep, std::max<int64_t>(1, (items_wanted + B * num_kv_heads - 1) / (B * num_kv_heads)));
    per_group = (rep + groups - 1) / groups;
    groups = (rep + per_group - 1) / per_group;
    count = B * num_kv_heads * groups;
  }
  One operator[](int64_t i) const {
    const int64_t g = (i / groups) % num_kv_heads, h0 = g * rep + (i % groups) * per_group;
    return One{i / (num_kv_heads * groups), g, h0, std::min(per_group, (g + 1) * rep - h0)};
  }
  static PagedHead head(const PagedHead& head0, int64_t g, int64_t kv_stride) {
    return PagedHead{head0.token_stride, head0.k_off + g * kv_stride, head0.v_off + g * kv_stride, head0.dk, head0.dv,
                     head0.blocks};
  }
};

// Items of a sequence's kv heads [g0, g0 + per) (the group and kv-heads decode paths): all of a
// sequence's kv heads in one item, split over items only when sequences are fewer than threads.
struct KvHeadRanges {
  struct One {
    int64_t b, g0, groups;
  };
  int64_t num_kv_heads, per, ranges, count;
  KvHeadRanges(int64_t B, int64_t kv_heads) : num_kv_heads(kv_heads) {
    const int64_t splits = std::min(kv_heads, std::max<int64_t>(1, (at::get_num_threads() + B - 1) / B));
    per = (kv_heads + splits - 1) / splits;
    ranges = (kv_heads + per - 1) / per;
    count = B * ranges;
  }
  One operator[](int64_t i) const {
    const int64_t g0 = i % ranges * per;
    return One{i / ranges, g0, std::min(per, num_kv_heads - g0)};
  }
};

// out[first : first + n) = o[0 : n), rounded to bf16 (store_value) when bf16, else fp32
static void store_rows(bool bf16, void* out, int64_t first, const float* o, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    if (bf16) store_value(static_cast<uint16_t*>(out) + first + j, o[j]);
    else static_cast<float*>(out)[first + j] = o[j];
  }
}

// The two column ranges of a token's row a GQA item of kv heads [g0, g0 + groups) reads (head: kv head
// g0's offsets): its keys (0) and its values (1), first element and count
struct ItemCols {
  int64_t lo[2], n[2];
  ItemCols(const PagedHead& head, int64_t groups, int64_t kv_stride)
      : lo{head.k_off, head.v_off}, n{(groups - 1) * kv_stride + head.dk, (groups - 1) * kv_stride + head.dv} {}
};

// An fp8 (e4m3) cache read by the decode items of q's dtype. An item's sequence goes, whole blocks in
// its block table's order, through a 256-entry table into its thread's scratch: entry x is fp8 value x
// times the cache's scale, rounded to q's dtype (what KVLayerView.gather dequantizes to), so the items,
// reading the scratch as their pool (blocks 0, 1, ... : `identity`), give the bits of the same op over
// the dequantized cache. A step thus reads the cache's fp8 bytes from memory, half a bf16 cache's;
// the scratch (a sequence's rows in q's dtype) stays in L2 / L3 for the item's passes. (Items on the
// FMA path need no scratch: they convert each block's rows to fp32 as they read them, and read() tells
// them how. Long sequences on the group path go through a ring instead: Fp8Ring.)
struct Fp8Cache {
  const uint8_t* pool;
  int64_t S, block_elems, span;  // span: row blocks a table entry names (PagedHead::blocks)
  bool bf16;
  void (*rows16)(const uint8_t*, int64_t, int64_t, int64_t, const uint16_t*, uint16_t*);
  void (*e4m3)(const uint8_t*, int64_t, int64_t, int64_t, float, int, void*);  // null where scale * 2^8 overflows
  float scale256;
  int out16;  // E4M3_BF16, or E4M3_BF16_EXACT for a power-of-two scale
  uint64_t call;
  std::vector<int64_t> identity;  // [nb]: 0, span, 2 span, ...
  uint16_t lut16[256];
  float lut32[256];
  float lut16f[256];  // lut16's values in fp32

  // pool_: the cache read as row blocks [N', S, ...] (PagedHead), `span` of them a table entry
  Fp8Cache(const at::Tensor& pool_, bool bf16_, double scale, int64_t nb, const Isa& isa, int64_t span_ = 1)
      : pool(static_cast<const uint8_t*>(pool_.data_ptr())), S(pool_.size(1)),
        block_elems(pool_.numel() / std::max<int64_t>(1, pool_.size(0))), span(span_), bf16(bf16_),
        rows16(isa.lut16_rows),
        e4m3(std::isfinite(static_cast<float>(scale) * 256.0f) ? isa.e4m3_rows : nullptr),
        scale256(static_cast<float>(scale) * 256.0f),
        out16(e4m3_exact_scale(static_cast<float>(scale)) ? E4M3_BF16_EXACT : E4M3_BF16), call(next_call()),
        identity(nb) {
    for (int64_t j = 0; j < nb; ++j) identity[j] = j * span;
    const float sc = static_cast<float>(scale);
    for (int x = 0; x < 256; ++x) {
      lut32[x] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(x), c10::Float8_e4m3fn::from_bits())) * sc;
      lut16[x] = c10::BFloat16(lut32[x]).x;
      lut16f[x] = to_float(lut16[x]);
    }
  }
  // How an item reading the pool's rows itself converts them (Fp8Read): to the values its scratch holds
  Fp8Read read() const { return Fp8Read{bf16 ? lut16f : lut32, scale256, e4m3 != nullptr, bf16 ? out16 : E4M3_F32}; }
  static uint64_t next_call() {
    static std::atomic<uint64_t> calls{0};
    return ++calls;
  }
  // dst[r * ld + i] = lut16[src[r * ld + i]] for r < rows, i < n (rows16 or e4m3 where the ISA has them)
  void convert16(const uint8_t* src, int64_t rows, int64_t n, int64_t ld, uint16_t* dst) const {
    if (rows16 != nullptr) return rows16(src, rows, n, ld, lut16, dst);
    if (e4m3 != nullptr) return e4m3(src, rows, n, ld, scale256, out16, dst);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < n; ++i) dst[r * ld + i] = lut16[src[r * ld + i]];
  }
  // dst[r * ld + i] = lut32[src[r * ld + i]] for r < rows, i < n (e4m3 where the ISA has it)
  void convert32(const uint8_t* src, int64_t rows, int64_t n, int64_t ld, float* dst) const {
    if (e4m3 != nullptr) return e4m3(src, rows, n, ld, scale256, E4M3_F32, dst);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < n; ++i) dst[r * ld + i] = lut32[src[r * ld + i]];
  }
  // Part `part` of cols of a block's first `rows` token rows (src, `stride` elements apart) into dst (the
  // block's rows in q's dtype), after asking for that part of the next block's first next_rows rows
  // (next null: none)
  void convert_part(const ItemCols& cols, int part, const uint8_t* src, int64_t rows, const uint8_t* next,
                    int64_t next_rows, int64_t stride, void* dst) const {
    const int64_t lo = cols.lo[part], n = cols.n[part];
    if (next != nullptr)
      for (int64_t t = 0; t < next_rows; ++t)
        for (int64_t off = 0; off < n; off += 64) __builtin_prefetch(next + t * stride + lo + off, 0, 2);
    if (bf16) convert16(src + lo, rows, n, stride, static_cast<uint16_t*>(dst) + lo);
    else convert32(src + lo, rows, n, stride, static_cast<float*>(dst) + lo);
  }
  // The first L tokens' blocks of a sequence (its block table `table`, in row blocks: each entry's span
  // row blocks from there) in the calling thread's scratch, entry j's at row block j span, converted
  // unless this call's previous item on the thread was the same sequence's.
  const void* rows(const int64_t* table, int64_t L) const {
    thread_local LineVector<uint16_t> buf;
    thread_local uint64_t seen_call = 0;
    thread_local const int64_t* seen_table = nullptr;
    thread_local int64_t seen_len = 0;
    if (seen_call == call && seen_table == table && seen_len == L) return buf.data();
    const int64_t blocks = (L + S - 1) / S, unit = bf16 ? 1 : 2, elems = span * block_elems;
    if (static_cast<int64_t>(buf.size()) < blocks * elems * unit) buf.resize(blocks * elems * unit);
    for (int64_t j = 0; j < blocks; ++j) {
      // blocks sit wherever the table puts them: the next one's lines asked for
      if (j + 1 < blocks) {
        const uint8_t* next = pool + table[j + 1] * block_elems;
        for (int64_t off = 0; off < elems; off += 64) __builtin_prefetch(next + off, 0, 2);
      }
      const uint8_t* src = pool + table[j] * block_elems;
      uint16_t* dst = buf.data() + j * elems * unit;
      if (bf16) convert16(src, 1, elems, 0, dst);
      else convert32(src, 1, elems, 0, reinterpret_cast<float*>(dst));
    }
    seen_call = call, seen_table = table, seen_len = L;
    return buf.data();
  }
};

// An fp8 (e4m3) tensor x (any shape) times scale, in float32 or bfloat16: the bits of
// (x.float() * scale).to(dtype) (KVLayerView.gather's dequantization), converted as the decode
// kernels convert an fp8 cache's rows (Fp8Cache), in chunks over the threads.
at::Tensor fp8_dequantize(const at::Tensor& x, double scale, bool bf16) {
  TORCH_CHECK(x.scalar_type() == at::kFloat8_e4m3fn && x.device().is_cpu(), "moe_kernels: fp8_dequantize takes a "
              "CPU float8_e4m3fn tensor, not ", x.scalar_type(), " on ", x.device());
  const at::Tensor src = x.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  const int64_t n = src.numel();
  if (n == 0) return out;
  const Fp8Cache c(src.view({1, 1, n}), bf16, scale, 1, current_isa());
  const auto* in = static_cast<const uint8_t*>(src.data_ptr());
  at::parallel_for(0, n, 1 << 16, [&](int64_t lo, int64_t hi) {
    if (bf16) c.convert16(in + lo, 1, hi - lo, 0, static_cast<uint16_t*>(out.data_ptr()) + lo);
    else c.convert32(in + lo, 1, hi - lo, 0, out.data_ptr<float>() + lo);
  });
  return out;
}

// A sequence's pool and block table as the kernels read them: the cache's own (f8 null), or an fp8
// cache's rows in the calling thread's scratch (Fp8Cache::rows) with the identity table
struct SeqRows {
  const void* pool;
  const int64_t* table;
};
static SeqRows seq_rows(const Fp8Cache* f8, const void* pool, const int64_t* table, int64_t L) {
  return f8 != nullptr ? SeqRows{f8->rows(table, L), f8->identity.data()} : SeqRows{pool, table};
}

// A sequence of an fp8 cache on the group path, longer than a ring: converted whole, its rows in q's
// dtype would leave L2 (and past ~16k tokens of a qwen3-style model, the L3), and the passes would
// read them back from there. Instead the item's pool is a ring of `chunk` tokens (FP8_RING_BYTES of
// rows) in the thread's scratch, its block table `ring_table` (block j in ring block j % (chunk / S), at
// row block (j % (chunk / S)) span: a block's keys, then its values, as in the pool);
// before the score pass reaches a chunk, its tokens' keys (only the item's kv heads') go through the
// table into the ring, and before the value pass reaches it, their values: each byte the item reads is
// converted once. (On Zen 4, one sequence of 32,768 tokens: 0.89-0.97x a bf16 cache's time, against
// 1.48-1.49x converted whole; 8 of 2,048: 1.04-1.07x against 1.15-1.22x.)
constexpr int64_t FP8_RING_BYTES = 256 << 10;
struct Fp8Ring : RowRefill {
  const Fp8Cache& c;
  const int64_t* table;  // the sequence's, in row blocks (c.span of them an entry)
  int64_t L, S, stride, ring_blocks;
  ItemCols cols;  // the item's keys (part 0) and values (part 1)
  uint16_t* ring;

  // tokens a ring holds for token rows of `stride` elements in blocks of S (a multiple of S and 32), or 0
  // where no sequence of up to max_len tokens would be longer (stride: every row block's row of a token)
  static int64_t tokens(int64_t stride, int64_t S, int64_t max_len) {
    const int64_t unit = std::lcm<int64_t>(S, 32);
    const int64_t ring = std::max<int64_t>(1, FP8_RING_BYTES / (stride * 2) / unit) * unit;
    return max_len > ring ? ring : 0;
  }
  Fp8Ring(const Fp8Cache& c_, const int64_t* table_, int64_t L_, int64_t S_, int64_t stride_, const ItemCols& cols_,
          int64_t chunk_, uint16_t* ring_)
      : c(c_), table(table_), L(L_), S(S_), stride(stride_), ring_blocks(chunk_ / S_), cols(cols_), ring(ring_) {
    fill = &load;
    chunk = chunk_;
  }
  static void load(const RowRefill* self, int64_t t0, int part) {
    const Fp8Ring& r = *static_cast<const Fp8Ring*>(self);
    const int64_t t1 = std::min(r.L, t0 + r.chunk), block = r.S * r.stride;
    for (int64_t j = t0 / r.S; j * r.S < t1; ++j) {
      const uint8_t* next = (j + 1) * r.S < t1 ? r.c.pool + r.table[j + 1] * block : nullptr;
      r.c.convert_part(r.cols, part, r.c.pool + r.table[j] * block, std::min(r.S, r.L - j * r.S), next, r.S,
                       r.stride, r.ring + j % r.ring_blocks * r.c.span * block);
    }
  }
};

// Decode attention straight from a paged cache: q [B, H, dk] (one query per sequence, at position
// context_len - 1, seeing all its keys); kv head g (of num_kv_heads) serves query heads
// [g * H / num_kv_heads, (g + 1) * H / num_kv_heads) and sits at head0's offsets + g * kv_stride.
// Returns [B, H, dv] in q's dtype. bf16 inputs round scores and probabilities to bf16 where a bf16
// GEMM path does. Checks the tables against the pool's N blocks of S tokens. A float8_e4m3fn pool
// holds values / kv_scale (Fp8Cache).
static at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& pool, const at::Tensor& block_tables,
                               const at::Tensor& context_lens, int64_t num_kv_heads, const PagedHead& head0,
                               int64_t kv_stride, double scale, double kv_scale) {
  TORCH_CHECK(block_tables.dim() == 2 && context_lens.dim() == 1 && block_tables.scalar_type() == at::kLong &&
              context_lens.scalar_type() == at::kLong, "moe_kernels: block_tables [B, nb] and context_lens [B] "
              "int64 expected");
  const bool fp8 = pool.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK((q.scalar_type() == pool.scalar_type() || fp8) &&
              (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "moe_kernels: q and pool must both be float32 or both bfloat16 (or the pool float8_e4m3fn)");
  const int64_t B = q.size(0), H = q.size(1), N = pool.size(0), S = pool.size(1), nb = block_tables.size(1);
  const int64_t dk = head0.dk, dv = head0.dv;
  TORCH_CHECK(block_tables.size(0) == B && context_lens.size(0) == B, "moe_kernels: one block table and context "
              "length per sequence expected");
  TORCH_CHECK(num_kv_heads >= 1 && H % num_kv_heads == 0, "moe_kernels: ", H, " query heads do not share ",
              num_kv_heads, " kv heads evenly");
  const int64_t span = head0.blocks;
  const at::Tensor tables = block_tables.contiguous(), lens = context_lens.contiguous();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  int64_t max_len = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= nb * S, "moe_kernels: context length ", lp[b], " of sequence ", b,
                " is outside [1, ", nb * S, "]");
    check_blocks(tp, nb, b, lp[b], S, N / span);
    max_len = std::max(max_len, lp[b]);
  }
  const at::Tensor row_tables = span == 1 ? tables : tables * span;  // in row blocks (PagedHead)
  tp = row_tables.data_ptr<int64_t>();
  at::Tensor out = at::empty({B, H, dv}, q.options());
  if (B == 0 || H == 0) return out;
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  const Isa& isa = current_isa();
  // bf16 queries and cache on the dot product (or the AMX tiles)
  const bool dot = bf16 && isa.dot.paged_decode != nullptr &&
                   (isa.dot.paged_decode_applies == nullptr || isa.dot.paged_decode_applies(dk, dv, H / num_kv_heads));
  const at::Tensor qf = dot ? bf16_contiguous(q) : float32_contiguous(q);
  const at::Tensor pc = pool.contiguous();
  const std::unique_ptr<const Fp8Cache> f8 =
      fp8 ? std::make_unique<const Fp8Cache>(pc, bf16, kv_scale, nb, isa, span) : nullptr;
  // sequence b's pool and block table: the cache's, or its rows in the thread's scratch (the dot and
  // group paths); the FMA path's items read an fp8 cache's bytes themselves, each block's rows converted
  // to fp32 as they convert a bf16 cache's (Fp8Read)
  auto seq = [&](int64_t b) { return seq_rows(f8.get(), pc.data_ptr(), tp + b * nb, lp[b]); };
  const Fp8Read read = f8 ? f8->read() : Fp8Read{};
  const Fp8Read* fma_read = f8 && !dot ? &read : nullptr;
  const int64_t rep = H / num_kv_heads;
  const int hp = dot && isa.dot.paged_decode_groups != nullptr ? isa.dot.group_lanes(rep, dk) : 0;
  if (hp != 0) {
    const KvHeadRanges items(B, num_kv_heads);
    const int64_t per = items.per, padded = max_len + 16;
    const uint16_t* qb = reinterpret_cast<const uint16_t*>(qf.data_ptr());
    uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
    // an fp8 cache's sequences longer than a ring go through one (Fp8Ring); shorter ones whole
    const int64_t ring_tokens = f8 ? Fp8Ring::tokens(head0.token_stride * span, S, max_len) : 0;
    for_each_claimed(items.count, [&](auto& claim) {
      LineVector<float> scores(per * padded * hp), acc(per * rep * (dv + 32));
      LineVector<uint32_t> pbuf(per * (dk / 2 * hp + padded * hp / 2 + 16));
      std::vector<const uint16_t*> rows(2 * (max_len + 1));
      LineVector<uint16_t> ring(ring_tokens * head0.token_stride * span);
      std::vector<int64_t> ring_table(ring_tokens ? nb : 0);
      for (int64_t j = 0; j < static_cast<int64_t>(ring_table.size()); ++j)
        ring_table[j] = j % (ring_tokens / S) * span;
      for (int64_t begin, end; claim(begin, end);)
        for (int64_t i = begin; i < end; ++i) {
          const auto [b, g0, groups] = items[i];
          const PagedHead head = HeadItems::head(head0, g0, kv_stride);
          std::optional<Fp8Ring> refill;
          SeqRows r{ring.data(), ring_table.data()};
          if (ring_tokens != 0 && lp[b] > ring_tokens)
            refill.emplace(*f8, tp + b * nb, lp[b], S, head.token_stride, ItemCols(head, groups, kv_stride), ring_tokens,
                           ring.data());
          else
            r = seq(b);
          isa.dot.paged_decode_groups(hp, qb + (b * H + g0 * rep) * dk, groups, rep,
                                      static_cast<const uint16_t*>(r.pool), S, head, kv_stride, r.table, lp[b],
                                      static_cast<float>(scale), scores.data(), pbuf.data(), acc.data(), rows.data(),
                                      op + (b * H + g0 * rep) * dv, refill ? &*refill : nullptr);
        }
    });
    return out;
  }
  if (!dot && num_kv_heads > 1) {
    // GQA on the FMA path: items of a sequence's kv heads, as the group path's
    const KvHeadRanges items(B, num_kv_heads);
    const int64_t per = items.per;
    const int64_t chunks = (rep + DOT_HEAD_LANES - 1) / DOT_HEAD_LANES;
    const int64_t lanes_per = chunks * (dk + dv) * DOT_HEAD_LANES;
    const float* qs = qf.data_ptr<float>();
    void* out_ptr = out.data_ptr();
    for_each_claimed(items.count, [&](auto& claim) {
      LineVector<float> scores(per * std::max(rep, chunks * DOT_HEAD_LANES) * max_len), lanes(per * lanes_per),
          kbuf(2 * S * dk), vbuf(2 * S * dv), o(per * rep * dv);
      for (int64_t begin, end; claim(begin, end);)
        for (int64_t i = begin; i < end; ++i) {
          const auto [b, g0, groups] = items[i];
          const PagedHead head = HeadItems::head(head0, g0, kv_stride);
          isa.paged_decode_kv_heads(bf16, fma_read, qs + (b * H + g0 * rep) * dk, groups, rep,
                                    pc.data_ptr(), S, head, kv_stride, tp + b * nb, lp[b], static_cast<float>(scale),
                                    bf16, scores.data(), lanes.data(), kbuf.data(), vbuf.data(), o.data());
          store_rows(bf16, out_ptr, (b * H + g0 * rep) * dv, o.data(), groups * rep * dv);
        }
    });
    return out;
  }
  const HeadItems items(B, H, num_kv_heads, dot || H / num_kv_heads >= isa.lane_min_heads);
  const int64_t per_group = items.per_group;
  const float* qs = dot ? nullptr : qf.data_ptr<float>();
  const uint16_t* qb = dot ? reinterpret_cast<const uint16_t*>(qf.data_ptr()) : nullptr;
  const std::vector<uint16_t> zero_row(dot ? dv : 0, 0);
  char* out_ptr = static_cast<char*>(out.data_ptr());
  const float sc = static_cast<float>(scale);
  // items claimed in guided ranges (for_each_claimed): their cost follows the sequence's context length
  for_each_claimed(items.count, [&](auto& claim) {
    // scratch: kbuf holds the longest sequence an item keeps whole (MLA_KEEP_BYTES), at least a block;
    // scores [L] per head, in lane chunks of up to 16 heads ([chunks][L][lanes]), and the chunks'
    // transposed queries and outputs (lanes: [chunks][dk + dv][lanes]); the dot path instead keeps
    // scores [L, DOT_HEAD_LANES], the query pairs and bf16 probability pairs ([(dk + 1) / 2 + (L + 1)
    // / 2, DOT_HEAD_LANES] pairs) and the key / value row pointers
    const int64_t keep_len = std::min(max_len, MLA_KEEP_BYTES / (dk * static_cast<int64_t>(sizeof(float))));
    const int64_t lane_heads = (per_group + DOT_HEAD_LANES - 1) / DOT_HEAD_LANES * DOT_HEAD_LANES;
    LineVector<float> scores((dot ? DOT_HEAD_LANES : lane_heads) * max_len),
        lanes(dot ? 0 : lane_heads * (dk + dv)), kbuf(dot ? 0 : std::max(S, (keep_len + S - 1) / S * S) * dk),
        vbuf(dot ? 0 : S * dv), o(dot ? 0 : per_group * dv);
    LineVector<uint16_t> pbuf(dot ? DOT_HEAD_LANES * (dk + max_len + 3) : 0);
    std::vector<const uint16_t*> rows(dot ? 2 * (max_len + 1) : 0);
    for (int64_t begin, end; claim(begin, end);)
      for (int64_t i = begin; i < end; ++i) {
        const auto [b, g, h0, hh] = items[i];
        const PagedHead head = HeadItems::head(head0, g, kv_stride);
        NextItem next;
        if (i + 1 < end && (!f8 || fma_read)) {  // (scratch of an fp8 cache: asked for as its blocks convert)
          const auto following = items[i + 1];
          const int64_t q0 = (following.b * H + following.h0) * dk;
          next = NextItem{dot ? reinterpret_cast<const char*>(qb + q0) : reinterpret_cast<const char*>(qs + q0),
                          following.hh * dk * (dot ? 2 : 4), tp + following.b * nb, lp[following.b],
                          HeadItems::head(head0, following.g, kv_stride)};
        }
        const int64_t first = (b * H + h0) * dv;
        const SeqRows r = fma_read ? SeqRows{pc.data_ptr(), tp + b * nb} : seq(b);
        if (dot) {  // writes its bf16 rows [hh, dv] itself
          isa.dot.paged_decode(qb + (b * H + h0) * dk, hh, static_cast<const uint16_t*>(r.pool), S, head,
                               r.table, lp[b], sc, scores.data(), pbuf.data(), rows.data(), zero_row.data(),
                               reinterpret_cast<uint16_t*>(out_ptr) + first, next);
          continue;
        }
        isa.paged_decode(bf16, qs + (b * H + h0) * dk, hh, items.rep, r.pool, S, head, r.table, lp[b], sc,
                         bf16, scores.data(), lanes.data(), kbuf.data(), vbuf.data(), o.data(), next, fma_read);
        store_rows(bf16, out_ptr, first, o.data(), hh * dv);
      }
  });
  return out;
}

// q: [B, H, W] float32 or bfloat16 (W = C + R: the absorbed query, then its rope part); pool:
// [N, S, W] in q's dtype, or float8_e4m3fn holding values / kv_scale (Fp8Cache; one layer's latent
// cache); block_tables: [B, nb] int64; context_lens: [B] int64. Returns [B, H, C] in q's dtype:
// softmax(q k^T * scale) v over the latent, values = its first C columns.
at::Tensor mla_decode(const at::Tensor& q, const at::Tensor& pool, const at::Tensor& block_tables,
                      const at::Tensor& context_lens, int64_t C, double scale, double kv_scale) {
  TORCH_CHECK(q.device().is_cpu() && pool.device().is_cpu(), "moe_kernels: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && pool.dim() == 3, "moe_kernels: q [B, H, W], pool [N, S, W], block_tables [B, nb], "
              "context_lens [B] expected");
  const int64_t W = q.size(2);
  TORCH_CHECK(pool.size(2) == W && C > 0 && C <= W, "moe_kernels: pool width ", pool.size(2), " / value width ",
              C, " do not match q width ", W);
  return paged_decode(q, pool, block_tables, context_lens, 1, PagedHead{W, 0, 0, W, C}, 0, scale, kv_scale);
}

// A GQA pool [N, 2, S, Hkv, hd] as the paged ops read it: row blocks [2N, S, Hkv hd] (block b's keys in
// row block 2b, its values in 2b + 1) and kv head 0's place in them (PagedHead); kv head g at + g hd.
static std::pair<at::Tensor, PagedHead> gqa_rows(const at::Tensor& pool) {
  const int64_t S = pool.size(2), hkv = pool.size(3), hd = pool.size(4), row = hkv * hd;
  return {pool.reshape({2 * pool.size(0), S, row}), PagedHead{row, 0, S * row, hd, hd, 2}};
}

// q: [B, H, hd] float32 or bfloat16; pool: [N, 2, S, Hkv, hd] in q's dtype, or float8_e4m3fn holding
// values / kv_scale (one layer's GQA cache: each block's keys, then its values); block_tables: [B, nb]
// int64; context_lens: [B] int64. Query head h uses kv head h / (H / Hkv). Returns [B, H, hd] in q's
// dtype: softmax(q k^T * scale) v.
at::Tensor gqa_decode(const at::Tensor& q, const at::Tensor& pool, const at::Tensor& block_tables,
                      const at::Tensor& context_lens, double scale, double kv_scale) {
  TORCH_CHECK(q.device().is_cpu() && pool.device().is_cpu(), "moe_kernels: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && pool.dim() == 5 && pool.size(1) == 2, "moe_kernels: q [B, H, hd], pool [N, 2, S, "
              "Hkv, hd], block_tables [B, nb], context_lens [B] expected");
  const int64_t hkv = pool.size(3), hd = pool.size(4);
  TORCH_CHECK(q.size(2) == hd, "moe_kernels: q head dim ", q.size(2), " does not match the cache's ", hd);
  const auto [rows, head] = gqa_rows(pool);
  return paged_decode(q, rows, block_tables, context_lens, hkv, head, hd, scale, kv_scale);
}

// Prefill attention straight from a paged cache: q [T, H, dk] holds the new rows of B sequences,
// sequence b's at [query_starts[b], query_starts[b + 1]): its last positions of context_lens[b],
// each seeing the keys at or before it (and, with window > 0, after its position - window). Heads
// and tables as paged_decode's. Returns [T, H, dv] in q's dtype, with paged_decode's fp32 softmax
// and bf16 roundings.
static at::Tensor paged_prefill(const at::Tensor& q, const at::Tensor& pool, const at::Tensor& block_tables,
                                const at::Tensor& context_lens, const at::Tensor& query_starts, int64_t num_kv_heads,
                                const PagedHead& head0, int64_t kv_stride, int64_t window, double scale,
                                double kv_scale, const SharedKeyPart& shared = SharedKeyPart{}) {
  TORCH_CHECK(block_tables.dim() == 2 && context_lens.dim() == 1 && query_starts.dim() == 1 &&
              block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong &&
              query_starts.scalar_type() == at::kLong, "moe_kernels: block_tables [B, nb], context_lens [B] and "
              "query_starts [B + 1] int64 expected");
  const bool fp8 = pool.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK((q.scalar_type() == pool.scalar_type() || fp8) &&
              (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "moe_kernels: q and pool must both be float32 or both bfloat16 (or the pool float8_e4m3fn)");
  TORCH_CHECK(window >= 0, "moe_kernels: window must be >= 0 (0: none), got ", window);
  TORCH_CHECK(!fp8 || shared.pool == nullptr, "moe_kernels: a shared key part needs a pool in q's dtype");
  const int64_t B = context_lens.size(0), T = q.size(0), H = q.size(1), N = pool.size(0), S = pool.size(1);
  const int64_t nb = block_tables.size(1), dk = head0.dk, dv = head0.dv;
  TORCH_CHECK(q.size(2) == dk, "moe_kernels: q head dim ", q.size(2), " does not match the keys' ", dk);
  TORCH_CHECK(block_tables.size(0) == B && query_starts.size(0) == B + 1, "moe_kernels: one block table, context "
              "length and query start per sequence (and the end) expected");
  TORCH_CHECK(num_kv_heads >= 1 && H % num_kv_heads == 0, "moe_kernels: ", H, " query heads do not share ",
              num_kv_heads, " kv heads evenly");
  const at::Tensor tables = block_tables.contiguous(), lens = context_lens.contiguous(),
                   starts = query_starts.contiguous();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* qs = starts.data_ptr<int64_t>();
  TORCH_CHECK(qs[0] == 0 && qs[B] == T, "moe_kernels: query_starts must run from 0 to the ", T, " rows of q");
  const int64_t span = head0.blocks;
  int64_t max_len = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t qlen = qs[b + 1] - qs[b];
    TORCH_CHECK(qlen >= 1 && qlen <= lp[b] && lp[b] <= nb * S, "moe_kernels: sequence ", b, " has ", qlen,
                " new rows and context length ", lp[b], " (need 1 <= rows <= context length <= ", nb * S, ")");
    check_blocks(tp, nb, b, lp[b], S, N / span);
    max_len = std::max(max_len, lp[b]);
  }
  const at::Tensor row_tables = span == 1 ? tables : tables * span;  // in row blocks (PagedHead)
  tp = row_tables.data_ptr<int64_t>();
  at::Tensor out = at::empty({T, H, dv}, q.options());
  if (B == 0 || H == 0) return out;
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  const Isa& isa = current_isa();
  const at::Tensor qc = q.contiguous(), pc = pool.contiguous();
  const HeadItems items(B, H, num_kv_heads);
  const int64_t esize = q.element_size();
  const char* qp = static_cast<const char*>(qc.data_ptr());
  char* op = static_cast<char*>(out.data_ptr());
  // an fp8 cache: each sequence's rows in the thread's scratch, in q's dtype, as paged_decode reads them
  const std::unique_ptr<const Fp8Cache> f8 =
      fp8 ? std::make_unique<const Fp8Cache>(pc, bf16, kv_scale, nb, isa, span) : nullptr;
  const float sc = static_cast<float>(scale);
  const int64_t padded = (max_len + S - 1) / S * S;
  for_each_claimed(items.count, [&](auto& claim) {
    // scratch: transposed keys, value rows, a tile's scores and query rows
    LineVector<float> kt((max_len + PREFILL_MAX_LANES) * dk), vbuf(padded * dv),
        scores(PREFILL_MAX_TILE * (max_len + PREFILL_MAX_LANES)), qbuf(PREFILL_MAX_TILE * dk);
    for (int64_t begin, end; claim(begin, end);)
      for (int64_t i = begin; i < end; ++i) {
        const auto [b, g, h0, hh] = items[i];
        const PagedHead head = HeadItems::head(head0, g, kv_stride);
        const int64_t qlen = qs[b + 1] - qs[b];
        const SeqRows r = seq_rows(f8.get(), pc.data_ptr(), tp + b * nb, lp[b]);
        isa.paged_prefill(bf16, qp + (qs[b] * H + h0) * dk * esize, H * dk, hh, qlen, lp[b] - qlen, r.pool, S, head,
                          shared, r.table, lp[b], window, sc, kt.data(), vbuf.data(), scores.data(), qbuf.data(),
                          op + (qs[b] * H + h0) * dv * esize, H * dv);
      }
  });
  return out;
}

// Prefill over per-head keys and values (MLA's naive path: c_kv expanded by kv_b_proj): q [T, H,
// dk]; kv [N, S, H, dk' + dv] in q's dtype, head h's key (or its first dk' = dk - R columns) then
// value; k_pe: empty, or [N, S, R] in q's dtype, the keys' last R columns shared by every head (MLA's
// rope key: no copy of it per head); the rest as paged_prefill's. Returns [T, H, dv].
at::Tensor mla_prefill(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& k_pe,
                       const at::Tensor& block_tables, const at::Tensor& context_lens,
                       const at::Tensor& query_starts, int64_t dv, double scale) {
  TORCH_CHECK(q.device().is_cpu() && kv.device().is_cpu() && k_pe.device().is_cpu(), "moe_kernels: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && kv.dim() == 4, "moe_kernels: q [T, H, dk], kv [N, S, H, dk + dv] expected");
  const int64_t H = q.size(1), dk = q.size(2), R = k_pe.numel() ? k_pe.size(-1) : 0, own = dk - R;
  TORCH_CHECK(k_pe.numel() == 0 || (k_pe.dim() == 3 && k_pe.size(0) == kv.size(0) && k_pe.size(1) == kv.size(1) &&
                                    R < dk && k_pe.scalar_type() == kv.scalar_type()),
              "moe_kernels: k_pe must be empty or [N, S, R] like kv's blocks, R < dk, in kv's dtype");
  TORCH_CHECK(kv.size(2) == H && dv > 0 && kv.size(3) == own + dv, "moe_kernels: kv [N, S, ", kv.size(2), ", ",
              kv.size(3), "] does not hold ", H, " heads of ", own, " + ", dv, " columns");
  const at::Tensor pe = k_pe.contiguous();
  return paged_prefill(q, kv, block_tables, context_lens, query_starts, H, PagedHead{H * (own + dv), 0, own, dk, dv},
                       own + dv, 0, scale, 1.0, SharedKeyPart{R ? pe.data_ptr() : nullptr, R});
}

// Prefill over a GQA cache: q [T, H, hd]; pool [N, 2, S, Hkv, hd] as gqa_decode's (fp8 too); window > 0:
// a sliding window of that many positions. Returns [T, H, hd].
at::Tensor gqa_prefill(const at::Tensor& q, const at::Tensor& pool, const at::Tensor& block_tables,
                       const at::Tensor& context_lens, const at::Tensor& query_starts, int64_t window, double scale,
                       double kv_scale) {
  TORCH_CHECK(q.device().is_cpu() && pool.device().is_cpu(), "moe_kernels: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && pool.dim() == 5 && pool.size(1) == 2, "moe_kernels: q [T, H, hd], pool [N, 2, S, "
              "Hkv, hd] expected");
  const int64_t hkv = pool.size(3), hd = pool.size(4);
  TORCH_CHECK(q.size(2) == hd, "moe_kernels: q head dim ", q.size(2), " does not match the cache's ", hd);
  const auto [rows, head] = gqa_rows(pool);
  return paged_prefill(q, rows, block_tables, context_lens, query_starts, hkv, head, hd, window, scale, kv_scale);
}

// x: [T, D] float32 or bfloat16 (rows contiguous); weight: [D] in x's dtype. Returns [T, D]:
// weight * (x / sqrt(mean(x^2) + eps)) with the statistics in fp32 (see norm_body.h).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "moe_kernels: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1), "moe_kernels: x [T, D] and "
              "weight [D] expected");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() &&
              (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "moe_kernels: x and weight must both be float32 or both bfloat16");
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor out = at::empty_like(xc);
  const int64_t T = xc.size(0), D = xc.size(1);
  if (T == 0 || D == 0) return out;
  const Isa& isa = current_isa();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const int64_t esize = xc.element_size();
  const char* xp = static_cast<const char*>(xc.data_ptr());
  char* op = static_cast<char*>(out.data_ptr());
  const float e = static_cast<float>(eps);
  // rows in chunks of at least ~32K elements per thread: one decode row is not worth a thread
  const int64_t grain = std::max<int64_t>(1, 32768 / D);
  at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
    isa.rms_norm(bf16, xp + begin * D * esize, D, wc.data_ptr(), op + begin * D * esize, D, end - begin, D, e);
  });
  return out;
}

// h, r: [T, D] in one dtype, float32 or bfloat16 (rows contiguous); weight: [D] in it. Returns
// (s, y): s = h + r rounded to the dtype as PyTorch's add, y = rms_norm(s, weight, eps) (the
// residual add and the norm after it, one op: vLLM's fused_add_rms_norm, out of place).
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& h, const at::Tensor& r, const at::Tensor& weight,
                                                double eps) {
  TORCH_CHECK(h.device().is_cpu() && r.device().is_cpu() && weight.device().is_cpu(), "moe_kernels: CPU tensors only");
  TORCH_CHECK(h.dim() == 2 && r.sizes() == h.sizes() && weight.dim() == 1 && weight.size(0) == h.size(1),
              "moe_kernels: h [T, D], r [T, D] and weight [D] expected");
  TORCH_CHECK(h.scalar_type() == r.scalar_type() && h.scalar_type() == weight.scalar_type() &&
              (h.scalar_type() == at::kFloat || h.scalar_type() == at::kBFloat16),
              "moe_kernels: h, r and weight must all be float32 or all bfloat16");
  const at::Tensor hc = h.contiguous(), rc = r.contiguous(), wc = weight.contiguous();
  at::Tensor s = at::empty_like(hc), out = at::empty_like(hc);
  const int64_t T = hc.size(0), D = hc.size(1);
  if (T == 0 || D == 0) return {s, out};
  const Isa& isa = current_isa();
  const bool bf16 = h.scalar_type() == at::kBFloat16;
  const int64_t step = D * hc.element_size();
  const char *hp = static_cast<const char*>(hc.data_ptr()), *rp = static_cast<const char*>(rc.data_ptr());
  char *sp = static_cast<char*>(s.data_ptr()), *op = static_cast<char*>(out.data_ptr());
  const float e = static_cast<float>(eps);
  const int64_t grain = std::max<int64_t>(1, 32768 / D);  // as rms_norm
  at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
    isa.add_rms_norm(bf16, hp + begin * step, rp + begin * step, wc.data_ptr(), sp + begin * step, op + begin * step,
                     end - begin, D, e);
  });
  return {s, out};
}

// The router weight w [E, D] float32 as bf16 parts in the tiles' packed order: [S, ceil(E / 16),
// D / 2, 16, 2] bfloat16 (S = 1 to 3: the trailing parts that are all zero left out), part p's
// element (b, i, n, c) = w_p[16 b + n][2 i + c] (0 past E), where
// w_0 = bf16(w), w_1 = bf16(w - w_0), w_2 = w - w_0 - w_1 (round to nearest even; each difference is
// exact in fp32 and the last fits bf16's 8 bits), so w = w_0 + w_1 + w_2 exactly for finite w.
at::Tensor router_split(const at::Tensor& w) {
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && w.scalar_type() == at::kFloat,
              "moe_kernels: router_split takes an [E, D] float32 CPU weight");
  TORCH_CHECK(w.size(1) % 2 == 0, "moe_kernels: router_split needs an even D, got ", w.size(1));
  const at::Tensor wc = w.contiguous();
  const int64_t E = wc.size(0), D = wc.size(1), nb = (E + 15) / 16;
  at::Tensor parts = at::zeros({3, nb, D / 2, 16, 2}, wc.options().dtype(at::kBFloat16));
  const float* wp = wc.data_ptr<float>();
  uint16_t* pp = reinterpret_cast<uint16_t*>(parts.data_ptr());
  const int64_t part = nb * D * 16;
  int64_t used = 1;  // parts up to the last one with a nonzero value
  for (int64_t e = 0; e < E; ++e)
    for (int64_t k = 0; k < D; ++k) {
      float rest = wp[e * D + k];
      uint16_t* dst = pp + (e / 16) * D * 16 + (k / 2) * 32 + (e % 16) * 2 + k % 2;
      for (int p = 0; p < 3; ++p) {
        store_value(dst + p * part, rest);
        rest -= to_float(dst[p * part]);
        if (p > 0 && (dst[p * part] & 0x7fff) != 0) used = std::max<int64_t>(used, p + 1);
      }
    }
  // a weight that bf16 holds exactly (a router read from a bf16 checkpoint) needs part 0 alone: its
  // logits then cost a third of the tile products (the others' products would all be zero)
  return used == 3 ? parts : parts.narrow(0, 0, used).contiguous();
}

// Whether router_logits reads the weight's bf16 parts for rows of this dtype and D (the ISA has the
// tiles, bf16 rows, D a multiple of 32): then a caller keeping router_split(w) saves making it per call.
bool router_split_applies(bool bf16_rows, int64_t D) {
  return bf16_rows && current_isa().router_split != nullptr && D % 32 == 0;
}

// x: [T, D] float32 or bfloat16 (made fp32); w: [E, D] float32; parts: router_split(w), or empty
// (made here when used). Returns x @ w^T [T, E] float32: the router's logits, each row's the same
// bits whatever the batch. bf16 rows meet w's bf16 parts on the AMX tiles when D is a multiple
// of 32 (amx_body.h's router_logits_split: T = 4096, E 64, D 1024 in ~1.3 ms against the FMA
// kernels' 5.2); otherwise, and on the other ISAs, the FMA kernels (norm_body.h's
// router_logits_rows). The choice follows the ISA, x's dtype and D, never T.
// PyTorch's fp32 GEMM (MKL) ran a [32, 1024] x [1024, 64] product in ~50 us hot and ~106 us with
// the weight in DRAM on Zen 5 (a batch-32 decode step's nine MoE layers: ~1 ms).
at::Tensor router_logits(const at::Tensor& x, const at::Tensor& w, const at::Tensor& parts) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "moe_kernels: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && w.size(1) == x.size(1), "moe_kernels: x [T, D] and w [E, D] expected");
  TORCH_CHECK(w.scalar_type() == at::kFloat && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "moe_kernels: router weight must be float32 and x float32 or bfloat16");
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();  // bf16 rows: widened by router_logits_rows
  const int64_t T = xc.size(0), D = xc.size(1), E = wc.size(0);
  at::Tensor out = at::empty({T, E}, xc.options().dtype(at::kFloat));
  if (T == 0 || E == 0) return out;
  const Isa& isa = current_isa();
  const bool bf16 = xc.scalar_type() == at::kBFloat16;
  const void* xp = xc.data_ptr();
  float* op = out.data_ptr<float>();
  const int64_t nb = (E + 15) / 16;
  TORCH_CHECK(parts.numel() == 0 || (parts.scalar_type() == at::kBFloat16 && parts.is_contiguous() &&
                                     parts.dim() == 5 && parts.size(0) >= 1 && parts.size(0) <= 3 &&
                                     parts.sizes().slice(1) == at::IntArrayRef({nb, D / 2, 16, 2})),
              "moe_kernels: router weight parts must be router_split(w): [1-3, ", nb, ", ", D / 2,
              ", 16, 2] bfloat16, got ", parts.sizes(), " ", parts.scalar_type());
  if (router_split_applies(bf16, D)) {
    const at::Tensor made = parts.numel() ? parts : router_split(wc);
    const uint16_t* pp = reinterpret_cast<const uint16_t*>(made.data_ptr());
    const uint16_t* xb = static_cast<const uint16_t*>(xp);
    const int num_parts = static_cast<int>(made.size(0));
    at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
      isa.router_split(xb, begin, end, pp, num_parts, E, D, op);
    });
    return out;
  }
  const float* wp = wc.data_ptr<float>();
  // rows in chunks of 64 or more (~4M multiply-adds at E * D = 64K): a decode step stays on one thread
  const int64_t grain = std::max<int64_t>(64, (int64_t{1} << 22) / std::max<int64_t>(1, E * D));
  at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
    isa.router_logits(bf16, xp, begin, end, wp, E, D, op);
  });
  return out;
}

// slot_mapping [T] int64 checked against a pool's num_slots (N blocks x S; a cache write lands in each);
// returned contiguous.
static at::Tensor checked_slots(const at::Tensor& slot_mapping, int64_t T, int64_t num_slots) {
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == T && slot_mapping.scalar_type() == at::kLong,
              "moe_kernels: slot_mapping must be [T] int64");
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "moe_kernels: slot ", sp[t], " outside the pool of ", num_slots);
  return slots;
}

// The row of part p (of `parts`) of slot s in a pool of blocks of S slots whose blocks hold each part's S
// rows in a run (GQA: keys, then values): (s / S * parts + p) * S + s % S; one part: row s.
static inline int64_t part_row(int64_t s, int64_t S, int64_t parts, int64_t p) {
  return (s / S * parts + p) * S + s % S;
}

// An fp8 (e4m3) cache's writes: rows [T, E] of the compute dtype (staged entries, fp32 or bf16) into
// the pool's slots sp[t] (blocks of S slots), quantized as KVLayerView.write quantizes: fp32 value /
// kv_scale, clamped to +-448, rounded to e4m3 (a NaN stays one). An entry in `parts` parts of E / parts
// (GQA: key, value) puts part p of slot s in the part's run of its block, as the pool holds them: at
// part_row of E / parts elements.
static void write_fp8_rows(const at::Tensor& rows, const at::Tensor& pool, int64_t S, int64_t parts, const int64_t* sp,
                           double kv_scale) {
  const int64_t T = rows.size(0), E = rows.numel() / std::max<int64_t>(1, T), P = E / parts;
  TORCH_CHECK(pool.numel() / std::max<int64_t>(1, pool.size(0) * S) == E && P * parts == E, "moe_kernels: ", E,
              "-element cache entries do not match the pool's");
  const float sc = static_cast<float>(kv_scale);
  uint8_t* dst = static_cast<uint8_t*>(pool.data_ptr());
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < E; ++i) {
      const float v = rows.scalar_type() == at::kBFloat16
                          ? to_float(reinterpret_cast<const uint16_t*>(rows.data_ptr())[t * E + i])
                          : rows.data_ptr<float>()[t * E + i];
      const float c = std::min(std::max(v / sc, -448.0f), 448.0f);  // NaN passes through both
      const int64_t p = i / P;
      dst[part_row(sp[t], S, parts, p) * P + i - p * P] = c10::Float8_e4m3fn(c).x;
    }
}

// x [N, K] @ one packed linear (+ bias) -> [N, cols] in x's dtype: linear_forward with G = 1.
static at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& wp, const at::Tensor& bias, int64_t cols) {
  return linear_forward(x.unsqueeze(0), wp, bias, cols, false).select(0, 0);
}

// Rows [begin, end) of mla_rope_cache: query row (t, h)'s rotated rope part written at rope_out +
// (t * H + h) * rope_ld, its nope part copied to q_out + (t * H + h) * (nope + R) unless q_out is null.
template <typename T>
static void mla_rope_cache_rows(const T* q, int64_t H, int64_t nope, const T* latent, const T* norm_w, float eps,
                                const float* cos, const float* sin, bool interleave, T* pool, const int64_t* slots,
                                int64_t C, int64_t R, T* q_out, T* rope_out, int64_t rope_ld, int64_t begin,
                                int64_t end) {
  const Isa& isa = current_isa();
  const bool bf16 = sizeof(T) == 2;
  const int64_t W = C + R, Q = nope + R;
  for (int64_t t = begin; t < end; ++t) {
    const float* c = cos + t * (R / 2);
    const float* s = sin + t * (R / 2);
    if (q_out)
      for (int64_t h = 0; h < H; ++h) std::memcpy(q_out + (t * H + h) * Q, q + (t * H + h) * Q, nope * sizeof(T));
    isa.rope(bf16, q + t * H * Q + nope, Q, H, c, s, R, interleave, rope_out + t * H * rope_ld, rope_ld);
    T* entry = pool + slots[t] * W;
    isa.rms_norm(bf16, latent + t * W, W, norm_w, entry, W, 1, C, eps);
    isa.rope(bf16, latent + t * W + C, W, 1, c, s, R, interleave, entry + C, W);
  }
}

// mla_rope_cache's checks and rows: q [T, H, Nn + R] contiguous; the rotated rope parts written at
// rope_out ([T, H] rows rope_ld apart), the nope parts copied into q_out ([T, H, Nn + R]) unless it is
// null; the cache entries written to pool.
static void mla_rope_cache_into(const at::Tensor& qc, const at::Tensor& latent, const at::Tensor& norm_weight,
                                double eps, const at::Tensor& cos, const at::Tensor& sin, bool interleave,
                                const at::Tensor& pool, const at::Tensor& slot_mapping, void* q_out, void* rope_out,
                                int64_t rope_ld) {
  TORCH_CHECK(qc.device().is_cpu() && latent.device().is_cpu() && pool.device().is_cpu(), "moe_kernels: CPU tensors only");
  TORCH_CHECK(qc.dim() == 3 && latent.dim() == 2 && pool.dim() == 3 && norm_weight.dim() == 1 && cos.dim() == 2 &&
              slot_mapping.dim() == 1, "moe_kernels: q [T, H, Nn + R], latent [T, C + R], norm_weight [C], "
              "cos/sin [T, R/2], pool [N, S, C + R], slot_mapping [T] expected");
  const auto dt = qc.scalar_type();
  TORCH_CHECK((dt == at::kFloat || dt == at::kBFloat16) && latent.scalar_type() == dt &&
              norm_weight.scalar_type() == dt && pool.scalar_type() == dt,
              "moe_kernels: q, latent, norm_weight and pool must share one dtype, float32 or bfloat16");
  const int64_t T = qc.size(0), H = qc.size(1), C = norm_weight.size(0), W = latent.size(1), R = W - C;
  const int64_t nope = qc.size(2) - R;
  TORCH_CHECK(latent.size(0) == T && R > 0 && R % 2 == 0 && nope >= 0 && pool.size(2) == W,
              "moe_kernels: latent / pool width ", W, " does not split into C = ", C, " and an even rope width");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == T && cos.size(1) == R / 2 &&
              cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "moe_kernels: cos and sin must be [T, R/2] float32");
  TORCH_CHECK(pool.is_contiguous() && qc.is_contiguous(), "moe_kernels: the cache pool and q must be contiguous");
  const at::Tensor lc = latent.contiguous(), wc = norm_weight.contiguous();
  const at::Tensor cc = cos.contiguous(), sc = sin.contiguous();
  const at::Tensor slots = checked_slots(slot_mapping, T, pool.size(0) * pool.size(1));
  const int64_t* sp = slots.data_ptr<int64_t>();
  if (T == 0) return;
  const float e = static_cast<float>(eps);
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    if (dt == at::kBFloat16)
      mla_rope_cache_rows(reinterpret_cast<const uint16_t*>(qc.data_ptr()), H, nope,
                          reinterpret_cast<const uint16_t*>(lc.data_ptr()), reinterpret_cast<const uint16_t*>(wc.data_ptr()),
                          e, cc.data_ptr<float>(), sc.data_ptr<float>(), interleave,
                          reinterpret_cast<uint16_t*>(pool.data_ptr()), sp, C, R, static_cast<uint16_t*>(q_out),
                          static_cast<uint16_t*>(rope_out), rope_ld, begin, end);
    else
      mla_rope_cache_rows(qc.data_ptr<float>(), H, nope, lc.data_ptr<float>(), wc.data_ptr<float>(), e,
                          cc.data_ptr<float>(), sc.data_ptr<float>(), interleave, pool.data_ptr<float>(), sp, C, R,
                          static_cast<float*>(q_out), static_cast<float*>(rope_out), rope_ld, begin, end);
  });
}

// MLA's step before attention, in one op: q [T, H, Nn + R] -> q with its rope part rotated
// (returned); the cache entry of token t, [rmsnorm(latent[t, :C]) | rope(latent[t, C:])], written to
// pool [N, S, C + R] at flat slot slot_mapping[t]. latent: [T, C + R] (kv_a_proj_with_mqa's output);
// norm_weight: [C]; cos, sin: [T, R/2] float32. q, latent, norm_weight and pool share one dtype
// (float32 or bfloat16).
at::Tensor mla_rope_cache(const at::Tensor& q, const at::Tensor& latent, const at::Tensor& norm_weight, double eps,
                          const at::Tensor& cos, const at::Tensor& sin, bool interleave, const at::Tensor& pool,
                          const at::Tensor& slot_mapping) {
  TORCH_CHECK(q.dim() == 3 && latent.dim() == 2, "moe_kernels: q [T, H, Nn + R], latent [T, C + R], norm_weight [C], "
              "cos/sin [T, R/2], pool [N, S, C + R], slot_mapping [T] expected");
  const at::Tensor qc = q.contiguous();
  at::Tensor q_out = at::empty_like(qc);
  const int64_t R = latent.size(1) - norm_weight.size(0), nope = qc.size(2) - R;
  char* base = static_cast<char*>(q_out.data_ptr());
  mla_rope_cache_into(qc, latent, norm_weight, eps, cos, sin, interleave, pool, slot_mapping, base,
                      base + nope * q_out.element_size(), qc.size(2));
  return q_out;
}

// MLA's whole attention for a step whose rows are all decode rows (row b = sequence b's one new token),
// in one op: the same ops in the same order as moe.layers.mla.MLAAttention.forward's kernel path, so
// the result is bit-equal to it, without a Python round trip per op.
// x: [B, D]; weights (packed as kernels.pack_linear packs them; biases float32 or empty):
//   q_a_wp / q_a_bias / q_a_norm: q_a_proj and q_a_layernorm, or all empty without a q LoRA;
//   q_wp / q_bias: q_b_proj (q_proj without a q LoRA), H * (Nn + R) columns;
//   kv_a_wp / kv_a_bias: kv_a_proj_with_mqa, C + R columns; kv_norm: kv_a_layernorm [C];
//   wuk_wp: W_UK^T [H, C, Nn] packed; wuv_wp: W_UV [H, Vd, C] packed; o_wp / o_bias: o_proj.
// cos, sin: [B, R/2] float32; pool: [N, S, C + R] this layer's latent cache (written at
// slot_mapping [B]) in x's dtype, or float8_e4m3fn holding values / kv_scale (write_fp8_rows);
// block_tables: [B, nb] int64; context_lens: [B] int64.
// dims: (H, Nn, Vd, q_a columns or 0, q columns, D). Returns o_proj's output [B, D] in x's dtype.
at::Tensor mla_decode_attention(const at::Tensor& x, const at::Tensor& q_a_wp, const at::Tensor& q_a_bias,
                                const at::Tensor& q_a_norm, double q_a_eps, const at::Tensor& q_wp,
                                const at::Tensor& q_bias, const at::Tensor& kv_a_wp, const at::Tensor& kv_a_bias,
                                const at::Tensor& kv_norm, double kv_eps, const at::Tensor& wuk_wp,
                                const at::Tensor& wuv_wp, const at::Tensor& o_wp, const at::Tensor& o_bias,
                                at::IntArrayRef dims, const at::Tensor& cos, const at::Tensor& sin, bool interleave,
                                const at::Tensor& pool, const at::Tensor& slot_mapping,
                                const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                                double kv_scale) {
  TORCH_CHECK(x.dim() == 2 && dims.size() == 6, "moe_kernels: x [B, D] and dims (H, Nn, Vd, q_a columns, "
              "q columns, D) expected");
  const int64_t H = dims[0], nope = dims[1], vd = dims[2], q_a_cols = dims[3], q_cols = dims[4], D = dims[5];
  const int64_t B = x.size(0), C = kv_norm.size(0), W = pool.size(2), R = W - C;
  TORCH_CHECK(H > 0 && q_cols == H * (nope + R) && R > 0, "moe_kernels: ", q_cols, " query columns do not split "
              "into ", H, " heads of ", nope, " + ", R);
  const at::Tensor no_bias = at::empty({0}, x.options().dtype(at::kFloat));
  at::Tensor q = q_a_cols ? linear_rows(rms_norm(linear_rows(x, q_a_wp, q_a_bias, q_a_cols), q_a_norm, q_a_eps), q_wp,
                                        q_bias, q_cols)
                          : linear_rows(x, q_wp, q_bias, q_cols);
  q = q.view({B, H, nope + R});
  const at::Tensor latent = linear_rows(x, kv_a_wp, kv_a_bias, W);  // [B, C + R]
  // absorbed query [B, H, C + R]: the rope part rotated into its last R columns (with the cache
  // write), then q_nope W_UK per head (the [H]-batched linear over [H, B, Nn] views of q) into the first C
  const at::Tensor q_full = at::empty({B, H, C + R}, q.options());
  char* rope_out = static_cast<char*>(q_full.data_ptr()) + C * q_full.element_size();
  if (pool.scalar_type() == at::kFloat8_e4m3fn) {  // entries staged in x's dtype, then quantized into the pool
    TORCH_CHECK(pool.dim() == 3 && pool.size(2) == W && pool.is_contiguous(), "moe_kernels: the fp8 cache pool "
                "must be a contiguous [N, S, ", W, "] tensor");
    const at::Tensor stage = at::empty({B, 1, W}, x.options());
    mla_rope_cache_into(q, latent, kv_norm, kv_eps, cos, sin, interleave, stage, at::arange(B, slot_mapping.options()),
                        nullptr, rope_out, C + R);
    const at::Tensor slots = checked_slots(slot_mapping, B, pool.size(0) * pool.size(1));
    write_fp8_rows(stage, pool, pool.size(1), 1, slots.data_ptr<int64_t>(), kv_scale);
  } else {
    mla_rope_cache_into(q, latent, kv_norm, kv_eps, cos, sin, interleave, pool, slot_mapping, nullptr, rope_out,
                        C + R);
  }
  linear_into(q.slice(2, 0, nope).permute({1, 0, 2}), wuk_wp, no_bias, C, q_full.slice(2, 0, C).permute({1, 0, 2}));
  const at::Tensor o_lat = mla_decode(q_full, pool, block_tables, context_lens, C, scale, kv_scale);  // [B, H, C]
  const at::Tensor o = at::empty({B, H * vd}, q.options());  // [B, H * Vd]: o_lat W_UV per head
  linear_into(o_lat.permute({1, 0, 2}), wuv_wp, no_bias, vd, o.view({B, H, vd}).permute({1, 0, 2}));
  return linear_rows(o, o_wp, o_bias, D);
}

// GQA's whole attention for a step whose rows are all decode rows (row b = sequence b's one new token),
// in one op: the same ops in the same order as moe.layers.gqa.GQAAttention.forward's kernel path, so
// the result is bit-equal to it, without a Python round trip per op.
// x: [B, D]; q_wp / k_wp / v_wp / o_wp: q_proj, k_proj, v_proj, o_proj packed as kernels.pack_linear
// packs them, each with its bias (or empty); q_norm / k_norm: the per-head RMSNorm weights [hd]
// (Qwen3) or both empty, with their eps; cos, sin: [B, hd/2] float32; pool: [N, 2, S, Hkv, hd] this
// layer's cache in x's dtype or fp8 as mla_decode_attention's (this step's roped keys and values are
// written at slot_mapping [B]); block_tables: [B, nb] int64; context_lens: [B] int64; dims: (H, Hkv, hd,
// D).
// Returns o_proj's output [B, D] in x's dtype.
at::Tensor gqa_decode_attention(const at::Tensor& x, const at::Tensor& q_wp, const at::Tensor& q_bias,
                                const at::Tensor& k_wp, const at::Tensor& k_bias, const at::Tensor& v_wp,
                                const at::Tensor& v_bias, const at::Tensor& q_norm, const at::Tensor& k_norm,
                                double q_eps, double k_eps, const at::Tensor& o_wp, const at::Tensor& o_bias,
                                at::IntArrayRef dims, const at::Tensor& cos, const at::Tensor& sin, bool interleave,
                                const at::Tensor& pool, const at::Tensor& slot_mapping,
                                const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                                double kv_scale) {
  TORCH_CHECK(x.device().is_cpu() && pool.device().is_cpu(), "moe_kernels: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && dims.size() == 4, "moe_kernels: x [B, D] and dims (H, Hkv, hd, D) expected");
  const int64_t H = dims[0], Hkv = dims[1], hd = dims[2], D = dims[3], B = x.size(0);
  TORCH_CHECK(H > 0 && Hkv > 0 && H % Hkv == 0 && hd > 0 && hd % 2 == 0, "moe_kernels: ", H, " query heads, ",
              Hkv, " kv heads of ", hd, " do not make grouped-query attention with an even head dim");
  TORCH_CHECK(pool.dim() == 5 && pool.size(1) == 2 && pool.size(3) == Hkv && pool.size(4) == hd &&
              (pool.scalar_type() == x.scalar_type() || pool.scalar_type() == at::kFloat8_e4m3fn) &&
              pool.is_contiguous(),
              "moe_kernels: the cache pool must be a contiguous [N, 2, S, ", Hkv, ", ", hd, "] tensor in x's dtype "
              "or float8_e4m3fn");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == B && cos.size(1) * 2 == hd &&
              cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "moe_kernels: cos and sin must be [B, hd/2] float32 (rope over the whole head)");
  TORCH_CHECK(q_norm.numel() == k_norm.numel() && (q_norm.numel() == 0 || q_norm.numel() == hd),
              "moe_kernels: q_norm and k_norm must both be [hd] or both empty");
  const int64_t S = pool.size(2), row = Hkv * hd;
  const at::Tensor slots = checked_slots(slot_mapping, B, pool.size(0) * S);
  const int64_t* sp = slots.data_ptr<int64_t>();
  at::Tensor q = linear_rows(x, q_wp, q_bias, H * hd);
  at::Tensor k = linear_rows(x, k_wp, k_bias, Hkv * hd);
  const at::Tensor v = linear_rows(x, v_wp, v_bias, Hkv * hd).contiguous();
  if (q_norm.numel()) {  // per-head RMSNorm of q and k (Qwen3), as RMSNorm.forward runs it on [T * heads, hd]
    q = rms_norm(q.reshape({B * H, hd}), q_norm, q_eps);
    k = rms_norm(k.reshape({B * Hkv, hd}), k_norm, k_eps);
  }
  q = q.contiguous();
  k = k.contiguous();
  at::Tensor q_rot = at::empty({B, H, hd}, q.options());
  const at::Tensor cc = cos.contiguous(), sc = sin.contiguous();
  const Isa& isa = current_isa();
  // an fp8 cache's entries are staged in x's dtype (row t at slot t), then quantized into the pool
  const bool fp8 = pool.scalar_type() == at::kFloat8_e4m3fn;
  const at::Tensor stage = fp8 ? at::empty({B, 2, Hkv, hd}, x.options()) : pool;
  auto rope_and_write = [&](auto* qp, auto* kp, auto* vp, auto* qo, auto* pp) {
    const int64_t half = hd / 2;
    const bool bf16 = sizeof(*qp) == 2;
    for (int64_t t = 0; t < B; ++t) {
      const float* c = cc.data_ptr<float>() + t * half;
      const float* s = sc.data_ptr<float>() + t * half;
      isa.rope(bf16, qp + t * H * hd, hd, H, c, s, hd, interleave, qo + t * H * hd, hd);
      // roped keys [Hkv, hd] at the slot's key row, values at its value row S rows on (the stage: [2, Hkv, hd])
      auto* key = pp + (fp8 ? 2 * t : part_row(sp[t], S, 2, 0)) * row;
      isa.rope(bf16, kp + t * row, hd, Hkv, c, s, hd, interleave, key, hd);
      std::memcpy(key + (fp8 ? 1 : S) * row, vp + t * row, row * sizeof(*vp));
    }
  };
  if (x.scalar_type() == at::kBFloat16) {
    auto u16 = [](const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); };
    rope_and_write(u16(q), u16(k), u16(v), u16(q_rot), u16(stage));
  } else {
    rope_and_write(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), q_rot.data_ptr<float>(),
                   stage.data_ptr<float>());
  }
  if (fp8) write_fp8_rows(stage, pool, S, 2, sp, kv_scale);
  const at::Tensor o = gqa_decode(q_rot, pool, block_tables, context_lens, scale, kv_scale);  // [B, H, hd]
  return linear_rows(o.view({B, H * hd}), o_wp, o_bias, D);
}

// x > y ? x : y and x < y ? x : y (a NaN on either side gives y), without a branch on x86: maxss and
// minss compute exactly these, while GCC turns the plain ternaries into branches, which the router's
// values (which way a comparison goes is random from token to token) mispredict.
static inline float select_above(float x, float y) {
#ifdef __SSE2__
  return _mm_cvtss_f32(_mm_max_ss(_mm_set_ss(x), _mm_set_ss(y)));
#else
  return x > y ? x : y;
#endif
}
static inline float select_below(float x, float y) {
#ifdef __SSE2__
  return _mm_cvtss_f32(_mm_min_ss(_mm_set_ss(x), _mm_set_ss(y)));
#else
  return x < y ? x : y;
#endif
}

// Router selection after the gate's logits, per token (moe.router.Router.route's arithmetic):
// scores = softmax or sigmoid of logits [T, E] (fp32); selection on scores (+ bias for noaux_tc)
// restricted to the topk_group best of n_group groups (group score: max for group_limited_greedy,
// sum of the top two biased scores for noaux_tc; experts outside score -inf, or 0 for
// group_limited_greedy like transformers' masked_fill); the top_k by selection, highest first (ties:
// lower expert id); weights = the unbiased scores (group_limited_greedy: the masked ones),
// renormalised when norm_topk_prob (+1e-20 for noaux_tc), times scaling.
// method: 0 greedy, 1 group_limited_greedy, 2 noaux_tc; sigmoid: else softmax.
// Returns (ids [T, top_k] int64, weights [T, top_k] float32).
std::tuple<at::Tensor, at::Tensor> route_topk(const at::Tensor& logits, const at::Tensor& bias, bool sigmoid,
                                              int64_t method, int64_t n_group, int64_t topk_group, int64_t top_k,
                                              bool norm_topk_prob, double scaling) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.scalar_type() == at::kFloat,
              "moe_kernels: logits must be a [T, E] float32 CPU tensor");
  const int64_t T = logits.size(0), E = logits.size(1);
  TORCH_CHECK(method >= 0 && method <= 2, "moe_kernels: unknown routing method ", method);
  TORCH_CHECK(top_k >= 1 && top_k <= E, "moe_kernels: top_k ", top_k, " outside [1, ", E, "]");
  TORCH_CHECK(method == 0 || (n_group >= 1 && E % n_group == 0 && topk_group >= 1 && topk_group <= n_group),
              "moe_kernels: ", E, " experts do not split into ", n_group, " groups with ", topk_group, " kept");
  TORCH_CHECK(method != 2 || (bias.numel() == E && bias.scalar_type() == at::kFloat),
              "moe_kernels: noaux_tc needs an [E] float32 bias");
  TORCH_CHECK(method != 2 || E / n_group >= 2, "moe_kernels: noaux_tc needs at least 2 experts per group");
  at::Tensor ids = at::empty({T, top_k}, logits.options().dtype(at::kLong));
  at::Tensor weights = at::empty({T, top_k}, logits.options());
  if (T == 0) return {ids, weights};
  const at::Tensor lc = logits.contiguous();
  const at::Tensor bc = method == 2 ? bias.contiguous() : bias;
  const float* lp = lc.data_ptr<float>();
  const float* bp = method == 2 ? bc.data_ptr<float>() : nullptr;
  int64_t* ip = ids.data_ptr<int64_t>();
  float* wp = weights.data_ptr<float>();
  const bool grouped = method != 0 && topk_group < n_group;  // every group kept: no group step
  const int64_t per_group = grouped ? E / n_group : E;
  const float scale = static_cast<float>(scaling);
  const Isa& isa = current_isa();
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(E), sel(E), group_score(grouped ? n_group : 0);
    std::vector<char> keep(grouped ? n_group : 0);
    std::vector<int64_t> top(top_k);
    for (int64_t t = begin; t < end; ++t) {
      const float* l = lp + t * E;
      isa.route_scores(sigmoid, l, E, scores.data());
      for (int64_t e = 0; e < E; ++e) sel[e] = bp ? scores[e] + bp[e] : scores[e];
      if (grouped) {
        // branch-free (see select_above): route_topk at T = 4096, E 64, 8 groups keep 4, one thread,
        // AMX box, builds alternated: 2.00-2.06 ms with the branches, 1.50-1.51 without (one group,
        // no group step: 0.81-0.86)
        for (int64_t g = 0; g < n_group; ++g) {
          const float* v = sel.data() + g * per_group;
          if (method == 1) {  // the max, as std::max_element compares
            float m = v[0];
            for (int64_t j = 1; j < per_group; ++j) m = select_above(v[j], m);
            group_score[g] = m;
          } else {  // sum of the two largest: x > a makes x the largest and a the second, else
            // x > b makes x the second; a NaN x changes neither
            float a = -INFINITY, b = -INFINITY;
            for (int64_t j = 0; j < per_group; ++j) {
              const float x = v[j];
              b = select_above(select_below(a, x), b);  // a when x > a, else x; then the max with b
              a = select_above(x, a);
            }
            group_score[g] = a + b;
          }
          keep[g] = 0;
        }
        for (int64_t n = 0; n < topk_group; ++n) {  // the best groups, ties to the lower group id
          int64_t best = 0;
          float best_score = 0.f;
          bool have = false;
          for (int64_t g = 0; g < n_group; ++g) {
            const bool take = (keep[g] == 0) & (!have | (group_score[g] > best_score));
            best = take ? g : best;
            best_score = take ? group_score[g] : best_score;
            have = have | take;
          }
          keep[best] = 1;
        }
        const float fill = method == 1 ? 0.f : -INFINITY;
        for (int64_t g = 0; g < n_group; ++g) {
          float* v = sel.data() + g * per_group;
          const bool kept = keep[g] != 0;
          for (int64_t j = 0; j < per_group; ++j) v[j] = kept ? v[j] : fill;
        }
      }
      int64_t* row_ids = ip + t * top_k;
      float* row_w = wp + t * top_k;
      isa.route_top(sel.data(), E, top_k, top.data());  // highest selection first, ties to the lower id
      for (int64_t k = 0; k < top_k; ++k) {
        row_ids[k] = top[k];
        row_w[k] = method == 1 ? sel[top[k]] : scores[top[k]];
      }
      if (norm_topk_prob) {
        float sum = 0.f;
        for (int64_t k = 0; k < top_k; ++k) sum += row_w[k];
        const float denom = sum + (method == 2 ? 1e-20f : 0.f);
        for (int64_t k = 0; k < top_k; ++k) row_w[k] /= denom;
      }
      for (int64_t k = 0; k < top_k; ++k) row_w[k] *= scale;
    }
  });
  return {ids, weights};
}

// The physical slot of each of n logical expert ids (ids[j] in [0, E)): the n-th assignment of expert e
// (in j order) goes to replica (n + rank) % logcnt[e] of log2phy [E, R] int64 (-1 padded), logcnt [E]
// int64 -- moe.moe_layer.choose_replicas -- written to slots, each counted into load [P] (+= 1).
static void assign_slots(const int64_t* ids, int64_t n, const at::Tensor& log2phy, const at::Tensor& logcnt,
                         int64_t rank, int64_t* slots, int64_t* load, int64_t P) {
  const at::Tensor table = log2phy.contiguous(), counts = logcnt.contiguous();
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* cp = counts.data_ptr<int64_t>();
  const int64_t E = table.size(0), R = table.size(1);
  std::vector<int64_t> seen(R > 1 ? E : 0, 0);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t e = ids[j];
    TORCH_CHECK(e >= 0 && e < E, "moe_kernels: expert id ", e, " outside ", E, " experts");
    const int64_t replica = R > 1 ? (seen[e]++ + rank) % cp[e] : 0;
    const int64_t slot = tp[e * R + replica];
    TORCH_CHECK(slot >= 0 && slot < P, "moe_kernels: expert ", e, " maps to slot ", slot, " outside ", P, " slots");
    slots[j] = slot;
    ++load[slot];
  }
}

// topk_ids [T, K] int64 logical experts -> their physical slots [T, K] int64 (assign_slots: replica
// (n + rank) % logcnt[e] for the n-th assignment of expert e, row-major), each counted into slot_load
// [P] int64 in place: moe.moe_layer.choose_replicas and the layer's slot-load count in one pass.
at::Tensor choose_slots(const at::Tensor& topk_ids, const at::Tensor& log2phy, const at::Tensor& logcnt, int64_t rank,
                        at::Tensor slot_load) {
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.scalar_type() == at::kLong, "moe_kernels: topk_ids [T, K] int64 expected");
  TORCH_CHECK(log2phy.dim() == 2 && log2phy.scalar_type() == at::kLong && logcnt.scalar_type() == at::kLong &&
              logcnt.numel() == log2phy.size(0) && slot_load.scalar_type() == at::kLong && slot_load.dim() == 1 &&
              slot_load.is_contiguous(), "moe_kernels: log2phy [E, R], logcnt [E] and slot_load [P] int64 expected");
  const at::Tensor ids = topk_ids.contiguous();
  at::Tensor slots = at::empty_like(ids);
  assign_slots(ids.data_ptr<int64_t>(), ids.numel(), log2phy, logcnt, rank, slots.data_ptr<int64_t>(),
               slot_load.data_ptr<int64_t>(), slot_load.size(0));
  return slots;
}

// The MoE feed-forward of a rank that hosts every physical slot (no dispatch, no capacity), in one
// op: the same calls in the same order as moe.moe_layer.MoELayer.forward's kernel path, so bit-equal
// to it. x: [T, D] float32 or bfloat16; gate_w: [E, D] float32 (logits = x in fp32 @ gate_w^T) and
// gate_parts as router_logits takes them; bias and the routing arguments as route_topk takes them;
// log2phy: [E, R] int64 replicas of each expert (-1 padded), logcnt: [E] int64, rank: the replica
// offset (the n-th assignment of expert e in the batch, row-major, goes to replica (n + rank) %
// logcnt[e]); slot_load: [P] int64, += the assignments per slot; routed experts packed as
// experts_forward_topk takes them (P slots); the shared experts as a one-slot experts_forward weight,
// or sh_w13p empty without shared experts; capacity >= 0: local capacity enforced on the slots as
// moe.capacity.apply_capacity does with policy "position", overflow "drop" and no renormalisation
// (after slot_load counted the demand), with the number dropped written to dropped [1] int64.
// Returns [T, D] in x's dtype: (routed sum in fp32 + shared output) rounded once.
at::Tensor moe_ffn(const at::Tensor& x, const at::Tensor& gate_w, const at::Tensor& gate_parts, const at::Tensor& bias,
                   bool sigmoid, int64_t method, int64_t n_group, int64_t topk_group, int64_t top_k,
                   bool norm_topk_prob, double scaling, const at::Tensor& log2phy, const at::Tensor& logcnt,
                   int64_t rank, at::Tensor slot_load, const at::Tensor& w13p, const at::Tensor& s13,
                   const at::Tensor& w2p, const at::Tensor& s2, const at::Tensor& sh_w13p, const at::Tensor& sh_s13,
                   const at::Tensor& sh_w2p, const at::Tensor& sh_s2, int64_t capacity, at::Tensor dropped) {
  TORCH_CHECK(x.dim() == 2 && gate_w.dim() == 2 && gate_w.size(1) == x.size(1), "moe_kernels: x [T, D] and "
              "gate_w [E, D] expected");
  const int64_t T = x.size(0), E = gate_w.size(0), P = slot_load.size(0);
  TORCH_CHECK(log2phy.dim() == 2 && log2phy.size(0) == E && logcnt.numel() == E && log2phy.scalar_type() == at::kLong &&
              logcnt.scalar_type() == at::kLong && slot_load.scalar_type() == at::kLong && slot_load.is_contiguous(),
              "moe_kernels: log2phy [E, R], logcnt [E] and slot_load [P] int64 expected");
  const at::Tensor logits = router_logits(x, gate_w.to(at::kFloat), gate_parts);  // [T, E]
  auto [ids, weights] = route_topk(logits, bias, sigmoid, method, n_group, topk_group, top_k, norm_topk_prob, scaling);
  const int64_t n = ids.numel();
  at::Tensor slots = at::empty_like(ids);
  int64_t* sp = slots.data_ptr<int64_t>();
  assign_slots(ids.data_ptr<int64_t>(), n, log2phy, logcnt, rank, sp, slot_load.data_ptr<int64_t>(), P);
  if (capacity >= 0) {
    TORCH_CHECK(dropped.numel() == 1 && dropped.scalar_type() == at::kLong, "moe_kernels: dropped [1] int64 expected");
    TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.is_contiguous(), "moe_kernels: route_topk's weights");
    dropped.data_ptr<int64_t>()[0] = drop_over_capacity(sp, weights.data_ptr<float>(), n, P, capacity);
  }
  at::Tensor out = experts_topk_rows(x, slots, weights, w13p, s13, w2p, s2);  // [T, D] fp32, rows maybe padded
  const Isa& isa = current_isa();
  if (sh_w13p.numel() && T > 0 && x.scalar_type() == at::kBFloat16 && isa.dot.down_final &&
      isa.dot_bf16(weight_type(sh_w13p), x.scalar_type())) {
    // the shared expert's down projection adds its bf16 output to the routed sums and rounds, in its
    // epilogue: the values of the add_round pass below without it (nor the shared expert's bf16 rows).
    // DeepSeek-style layer, AMX box, calls alternating in one process, the same bits: T = 4096 0.978x
    // the time (0.972-0.984), two threads 0.969x, T = 32 and 512 1.00x. The epilogue's reads of the
    // sums need their tile start (SumRowPrefetch): without it, 1.010x.
    const at::Tensor xc = x.contiguous();
    check_experts(xc, sh_w13p, sh_s13, sh_w2p, sh_s2);
    at::Tensor result = at::empty(out.sizes(), x.options());
    const std::vector<int64_t> offsets{0, T};
    run_experts(xc.data_ptr(), true, offsets, x.size(1), sh_w13p, sh_s13, sh_w2p, sh_s2, nullptr, true,
                result.data_ptr(), nullptr, 0, 0, false, nullptr, out.data_ptr<float>(), out.stride(0));
    return result;
  }
  at::Tensor shared;
  if (sh_w13p.numel()) {
    const int64_t rows[1] = {T};
    shared = experts_forward(x.contiguous(), at::IntArrayRef(rows, 1), sh_w13p, sh_s13, sh_w2p, sh_s2,
                             at::empty({0}, x.options().dtype(at::kFloat)), false);  // [T, D] in x's dtype
  }
  // (routed sums in fp32 + shared output widened) rounded once to x's dtype, row by row over the
  // (maybe padded) sums: the values of (out + shared.to(fp32)).to(dtype). PyTorch's add_out into a bf16
  // result took ~9 ms at T = 4096, D = 1024 by perf (an fp32 add, then a rounding copy); this pass ~2.5.
  at::Tensor result = at::empty(out.sizes(), x.options());  // contiguous, not a view of the padded rows
  const int64_t rows = out.size(0), D = out.size(1);
  if (rows == 0 || D == 0) return result;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const float* o = out.data_ptr<float>();
  const int64_t lda = out.stride(0);
  const char* sh = shared.defined() ? static_cast<const char*>(shared.data_ptr()) : nullptr;
  char* r = static_cast<char*>(result.data_ptr());
  const int64_t row_bytes = D * result.element_size();
  const int64_t grain = std::max<int64_t>(1, SMALL_ELEMENTS / D);  // a decode step's rows on one thread
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    isa.add_round(bf16, o + begin * lda, lda, sh ? sh + begin * row_bytes : nullptr, r + begin * row_bytes,
                  end - begin, D);
  });
  return result;
}

// The parameters a decode plan bound, watched for in-place writes and new storage: their versions and
// data addresses recorded at construction, compared by changed() in one loop (moe.plan_watch). Holds
// the tensors, so an address cannot be reused by another tensor while the watch lives.
struct TensorWatch {
  std::vector<at::Tensor> tensors;
  std::vector<int64_t> versions;
  std::vector<const void*> addresses;
  explicit TensorWatch(std::vector<at::Tensor> ts) : tensors(std::move(ts)) {
    for (const at::Tensor& t : tensors) {
      TORCH_CHECK(t.defined(), "moe_kernels: a tensor watch takes defined tensors");
      versions.push_back(static_cast<int64_t>(t._version()));
      addresses.push_back(t.const_data_ptr());
    }
  }
  // whether any tensor's version or data address differs from the recorded one. A decode step's
  // weight stream has evicted every TensorImpl, version counter and StorageImpl, so each is asked for
  // first, one level at a time across all the tensors: the misses of a level overlap instead of
  // queuing behind each tensor's chain.
  bool changed() const {
    for (const at::Tensor& t : tensors) {
      const char* impl = reinterpret_cast<const char*>(t.unsafeGetTensorImpl());
      for (size_t b = 0; b < sizeof(c10::TensorImpl); b += 64) __builtin_prefetch(impl + b);
    }
    for (const at::Tensor& t : tensors) {
      const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
      // c10::VariableVersion holds one pointer, to its shared counter (a wrong guess only wastes a prefetch)
      __builtin_prefetch(*reinterpret_cast<const void* const*>(&impl->version_counter()));
      if (impl->has_storage()) __builtin_prefetch(impl->storage().unsafeGetStorageImpl());
    }
    bool any = false;  // no early exit: every tensor is compared
    for (size_t i = 0; i < tensors.size(); ++i)
      any |= (static_cast<int64_t>(tensors[i]._version()) != versions[i]) | (tensors[i].const_data_ptr() != addresses[i]);
    return any;
  }
};

// Watches by handle (a plain op call: a TorchScript class's method call cost ~45 us cold against ~9
// for an op on Zen 5, decode steps). Handles are indexes into this registry, checked on every call.
static std::mutex watch_mutex;
static std::vector<std::unique_ptr<TensorWatch>> watches;

static TensorWatch& watch_at(int64_t handle) {
  TORCH_CHECK(handle >= 0 && handle < static_cast<int64_t>(watches.size()) && watches[handle],
              "moe_kernels: no tensor watch ", handle);
  return *watches[handle];
}

int64_t tensor_watch_make(std::vector<at::Tensor> tensors) {
  auto watch = std::make_unique<TensorWatch>(std::move(tensors));
  std::lock_guard<std::mutex> lock(watch_mutex);
  for (size_t i = 0; i < watches.size(); ++i)
    if (!watches[i]) {
      watches[i] = std::move(watch);
      return static_cast<int64_t>(i);
    }
  watches.push_back(std::move(watch));
  return static_cast<int64_t>(watches.size()) - 1;
}

bool tensor_watch_changed(int64_t handle) {
  std::lock_guard<std::mutex> lock(watch_mutex);
  return watch_at(handle).changed();
}

int64_t tensor_watch_size(int64_t handle) {
  std::lock_guard<std::mutex> lock(watch_mutex);
  return static_cast<int64_t>(watch_at(handle).tensors.size());
}

void tensor_watch_drop(int64_t handle) {
  std::unique_ptr<TensorWatch> dropped;  // released outside the lock
  std::lock_guard<std::mutex> lock(watch_mutex);
  watch_at(handle);
  dropped = std::move(watches[handle]);
}

}  // namespace moe_kernels

TORCH_LIBRARY(moe_kernels, m) {
  m.def("tensor_watch_make(Tensor[] tensors) -> int", &moe_kernels::tensor_watch_make);
  m.def("tensor_watch_changed(int handle) -> bool", &moe_kernels::tensor_watch_changed);
  m.def("tensor_watch_size(int handle) -> int", &moe_kernels::tensor_watch_size);
  m.def("tensor_watch_drop(int handle) -> ()", &moe_kernels::tensor_watch_drop);
  m.def("experts_forward(Tensor x, int[] counts, Tensor w13p, Tensor s13, Tensor w2p, Tensor s2, "
        "Tensor row_weights, bool out_fp32) -> Tensor");
  m.def("experts_forward_topk(Tensor x, Tensor slot_ids, Tensor weights, Tensor w13p, Tensor s13, Tensor w2p, "
        "Tensor s2) -> Tensor");
  m.def("linear_forward(Tensor x, Tensor wp, Tensor bias, int out_features, bool out_fp32) -> Tensor");
  m.def("mla_decode(Tensor q, Tensor pool, Tensor block_tables, Tensor context_lens, int value_dim, "
        "float scale, float kv_scale=1.0) -> Tensor");
  m.def("gqa_decode(Tensor q, Tensor pool, Tensor block_tables, Tensor context_lens, float scale, "
        "float kv_scale=1.0) -> Tensor");
  m.def("mla_prefill(Tensor q, Tensor kv, Tensor k_pe, Tensor block_tables, Tensor context_lens, "
        "Tensor query_starts, int value_dim, float scale) -> Tensor");
  m.def("gqa_prefill(Tensor q, Tensor pool, Tensor block_tables, Tensor context_lens, Tensor query_starts, "
        "int window, float scale, float kv_scale=1.0) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fp8_dequantize(Tensor x, float scale, bool bf16) -> Tensor");
  m.def("add_rms_norm(Tensor h, Tensor r, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("router_logits(Tensor x, Tensor w, Tensor parts) -> Tensor");
  m.def("router_split(Tensor w) -> Tensor");
  m.def("router_split_applies(bool bf16_rows, int D) -> bool", &moe_kernels::router_split_applies);
  m.def("route_topk(Tensor logits, Tensor bias, bool sigmoid, int method, int n_group, int topk_group, int top_k, "
        "bool norm_topk_prob, float scaling) -> (Tensor, Tensor)");
  m.def("mla_rope_cache(Tensor q, Tensor latent, Tensor norm_weight, float eps, Tensor cos, Tensor sin, "
        "bool interleave, Tensor(a!) pool, Tensor slot_mapping) -> Tensor");
  m.def("mla_decode_attention(Tensor x, Tensor q_a_wp, Tensor q_a_bias, Tensor q_a_norm, float q_a_eps, "
        "Tensor q_wp, Tensor q_bias, Tensor kv_a_wp, Tensor kv_a_bias, Tensor kv_norm, float kv_eps, "
        "Tensor wuk_wp, Tensor wuv_wp, Tensor o_wp, Tensor o_bias, int[] dims, Tensor cos, Tensor sin, "
        "bool interleave, Tensor(a!) pool, Tensor slot_mapping, Tensor block_tables, Tensor context_lens, "
        "float scale, float kv_scale=1.0) -> Tensor");
  m.def("gqa_decode_attention(Tensor x, Tensor q_wp, Tensor q_bias, Tensor k_wp, Tensor k_bias, Tensor v_wp, "
        "Tensor v_bias, Tensor q_norm, Tensor k_norm, float q_eps, float k_eps, Tensor o_wp, Tensor o_bias, "
        "int[] dims, Tensor cos, Tensor sin, bool interleave, Tensor(a!) pool, Tensor slot_mapping, "
        "Tensor block_tables, Tensor context_lens, float scale, float kv_scale=1.0) -> Tensor");
  m.def("moe_ffn(Tensor x, Tensor gate_w, Tensor gate_parts, Tensor bias, bool sigmoid, int method, int n_group, "
        "int topk_group, int top_k, bool norm_topk_prob, float scaling, Tensor log2phy, Tensor logcnt, int rank, "
        "Tensor(a!) slot_load, Tensor w13p, Tensor s13, Tensor w2p, Tensor s2, Tensor sh_w13p, Tensor sh_s13, "
        "Tensor sh_w2p, Tensor sh_s2, int capacity, Tensor(b!) dropped) -> Tensor");
  m.def("choose_slots(Tensor topk_ids, Tensor log2phy, Tensor logcnt, int rank, Tensor(a!) slot_load) -> Tensor");
  m.def("experts_forward_rows(Tensor x, Tensor slot_ids, Tensor weights, int first_slot, Tensor w13p, Tensor s13, "
        "Tensor w2p, Tensor s2, float library_min_rows) -> Tensor");
  m.def("dispatch_plan(Tensor x, Tensor slot_ids, Tensor weights, int num_local, int num_ranks, Tensor(a!) send) "
        "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def("capacity_drop(Tensor slot_ids, Tensor weights, int num_slots, int capacity, Tensor limits) -> "
        "(Tensor, Tensor, Tensor)");
  m.def("isa_name() -> str", &moe_kernels::isa_name);
  m.def("select_isa(str name) -> str", &moe_kernels::select_isa);
  m.def("bf16_dot_rate() -> float", &moe_kernels::bf16_dot_rate);
  m.def("set_bf16_dot_rate(float rate) -> float", &moe_kernels::set_bf16_dot_rate);
  m.def("tile_mode_seconds(int rows, int bytes) -> float[]", &moe_kernels::tile_mode_seconds);
  m.def("set_tile_mode(int rows, int nb, int mode) -> int", &moe_kernels::set_tile_mode);
  m.def("tile_mode(int rows, int nb) -> int", &moe_kernels::tile_mode);
  m.def("set_attention_asks(int mode) -> int", &moe_kernels::set_attention_asks);
  m.def("attention_asks() -> int", &moe_kernels::attention_asks);
}

TORCH_LIBRARY_IMPL(moe_kernels, CPU, m) {
  m.impl("experts_forward", &moe_kernels::experts_forward);
  m.impl("experts_forward_topk", &moe_kernels::experts_forward_topk);
  m.impl("linear_forward", &moe_kernels::linear_forward);
  m.impl("mla_decode", &moe_kernels::mla_decode);
  m.impl("gqa_decode", &moe_kernels::gqa_decode);
  m.impl("mla_prefill", &moe_kernels::mla_prefill);
  m.impl("gqa_prefill", &moe_kernels::gqa_prefill);
  m.impl("rms_norm", &moe_kernels::rms_norm);
  m.impl("fp8_dequantize", &moe_kernels::fp8_dequantize);
  m.impl("add_rms_norm", &moe_kernels::add_rms_norm);
  m.impl("router_logits", &moe_kernels::router_logits);
  m.impl("router_split", &moe_kernels::router_split);
  m.impl("route_topk", &moe_kernels::route_topk);
  m.impl("mla_rope_cache", &moe_kernels::mla_rope_cache);
  m.impl("mla_decode_attention", &moe_kernels::mla_decode_attention);
  m.impl("gqa_decode_attention", &moe_kernels::gqa_decode_attention);
  m.impl("moe_ffn", &moe_kernels::moe_ffn);
  m.impl("capacity_drop", &moe_kernels::capacity_drop);
  m.impl("dispatch_plan", &moe_kernels::dispatch_plan);
  m.impl("experts_forward_rows", &moe_kernels::experts_forward_rows);
  m.impl("choose_slots", &moe_kernels::choose_slots);
}
