// Native CPU kernels for eagle-jax, registered with XLA through jax.ffi.
//
// Decoding on CPU is bound by reading the weights (and, at long contexts, the
// KV cache). XLA:CPU runs a single row through its own GEMV but sends 2..32
// rows to a library GEMM that repacks the weight on every call, so verifying
// k+1 draft tokens costs 1.6-3x a plain step. These kernels stream each weight
// once for all rows of a call, from a layout packed once at load time:
//
//   eagle_matmul     y[M, N] (f32 or bf16) = x[M, K] @ W, x and W both f32 or
//                    both bf16 (on AMX tiles where the CPU has them and the
//                    caller asks), W packed by eagle_jax.kernels.cpu.pack_weight;
//                    optionally an RMSNorm of x first and a residual add or
//                    SwiGLU after, so a decoder layer's elementwise work runs
//                    inside its projections; eagle_matmul_into: the same into
//                    a preset (test) buffer.
//   eagle_attention  grouped-query attention of T new tokens over the
//                    committed slots of one layer of the KV cache, plus the T
//                    new keys under a [T, T] mask; takes the fused q/k/v
//                    projection and rotates q and k itself (RoPE, after
//                    Qwen3's per-head norms when given), reads only the live
//                    slots (the committed ones, plus those an optional
//                    per-query slot mask shows; masked slots score -inf) and
//                    stores the new K/V of that layer in place.
//   eagle_cache_write, eagle_cache_compact
//                    the cache's slot writes, in place.
//                    The cache kernels work on the call's B rows (lengths [B])
//                    as the first B rows of a cache that may hold more, so a
//                    step over the first rows of a batch reads no other row.
//   eagle_embed      rows of an embedding table (XLA:CPU gathers a bf16 row
//                    from an f32 copy of the whole table).
//   eagle_transpose  a 2-D transpose that XLA cannot fold into a dot (training's
//                    bf16 backward dots, eagle_jax.kernels.cpu.transpose).
//   eagle_argmax     the first maximal index of each f32 row (greedy tokens).
//   eagle_kth_largest, eagle_top_p_cut
//                    the thresholds of the top-k and top-p sampling filters:
//                    the XLA path's bisection, each step one vectorised pass.
//
// Determinism: every output element is reduced in an order that depends on
// neither M (matmul) nor on whether a key sits in the cache or among the new
// tokens (attention: scores of 16-key blocks by key index, each one chain over
// D; values in key order, bf16 keys in fixed pairs (2i, 2i + 1)), so
// verifying M tokens gives bit-for-bit the rows of M single-token steps. That
// makes greedy speculative decoding exactly equal to plain decoding.
//
// Portable C++17 with GCC/Clang vector extensions (AVX-512 when the compiler
// targets it, AVX2 or NEON otherwise; AMX intrinsics for bf16 matmuls when it
// targets a CPU that has them); work is split over this library's
// worker threads (as many as XLA's intra-op pool has, less the caller; they
// spin briefly between calls) or, when those are busy, XLA's pool, and the
// calling thread takes whatever tasks are left, so a busy or single-thread
// pool never blocks a call.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <condition_variable>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define EAGLE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 16;
typedef float vf __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));
typedef float vf8 __attribute__((vector_size(32)));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline vf load(const uint16_t* p) {  // 16 bf16 -> f32
  vh h;
  std::memcpy(&h, p, sizeof h);
  vu u = __builtin_convertvector(h, vu) << 16;
  vf f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float scalar(float v) { return v; }
inline float scalar(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

inline vf splat(float s) { return vf{} + s; }

inline void store_elem(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void store_elem(uint16_t* dst, const float* src, int64_t n) {  // f32 -> bf16, round to nearest even
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, src + i, sizeof u);
    u += 0x7fffu + ((u >> 16) & 1u);
    dst[i] = uint16_t(u >> 16);
  }
}

// If XLA did not alias a result to its operand, start from a copy.
void adopt(const ffi::AnyBuffer& in, ffi::Result<ffi::AnyBuffer>& out) {
  if (out->untyped_data() != in.untyped_data())
    std::memcpy(out->untyped_data(), in.untyped_data(), in.size_bytes());
}

// A fixed pairwise tree over the 16 lanes.
inline float hsum(vf v) {
  vf8 lo = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  vf8 hi = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  vf8 s = lo + hi;
  float a = (s[0] + s[4]) + (s[2] + s[6]);
  float b = (s[1] + s[5]) + (s[3] + s[7]);
  return a + b;
}

// exp for x <= 0 (softmax after subtracting the row max); x = -inf gives 0.
inline vf exp_nonpositive(vf x) {
  const vf lo = splat(-87.0f);
  vi dead = x < lo;
  x = x < lo ? lo : x;
  vi ni = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, vi);  // ~round, x <= 0
  vf n = __builtin_convertvector(ni, vf);
  vf r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  vi e = (ni + 127) << 23;
  vf scale;
  std::memcpy(&scale, &e, sizeof scale);
  vf y = p * scale;
  vu bits;
  std::memcpy(&bits, &y, sizeof bits);
  bits &= ~(vu)dead;
  std::memcpy(&y, &bits, sizeof y);
  return y;
}

inline void cpu_relax() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
}

// Indices [0, n) of one parallel call, claimed from a shared counter by every
// thread that joins it.
struct Job {
  std::atomic<int64_t> next{0}, finished{0};
  int64_t n = 0;
  void (*call)(const void* fn, int64_t i) = nullptr;
  const void* fn = nullptr;
  void drain() {
    for (int64_t i; (i = next.fetch_add(1)) < n;) {
      call(fn, i);
      finished.fetch_add(1, std::memory_order_release);
    }
  }
};

// Worker threads of this library that stay awake between the kernel calls of
// a decoding step. Measured (bf16 decode, 2-core EPYC): a task scheduled on
// XLA's pool started a mean 26-31 us after the call began, on each of the
// ~150 calls of a step, while the caller streamed the weights alone. A
// worker here spins for kSpin after its last job and then sleeps on a
// condition variable, so an idle process uses no CPU. One job runs at a time;
// a call that finds the workers busy (another XLA thread's kernel) uses XLA's
// pool instead.
class Workers {
 public:
  static Workers* get(int64_t count) {
    static Workers* w = new Workers(count);  // never destroyed: threads may outlive main
    return w;
  }
  // Runs job on the workers and the calling thread; false (nothing run) when busy.
  bool run(Job& job) {
    std::unique_lock<std::mutex> submit(submit_, std::try_to_lock);
    if (!submit.owns_lock() || threads_.empty()) return false;
    job_.store(&job);
    generation_.fetch_add(1);
    if (sleeping_.load() > 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      wake_.notify_all();
    }
    job.drain();
    while (job.finished.load(std::memory_order_acquire) < job.n) cpu_relax();
    job_.store(nullptr);
    while (active_.load() > 0) cpu_relax();  // workers still holding &job have let go
    return true;
  }

 private:
  static constexpr auto kSpin = std::chrono::microseconds(200);

  explicit Workers(int64_t count) {
    for (int64_t i = 0; i < count; ++i) threads_.emplace_back([this] { loop(); });
    for (auto& t : threads_) t.detach();
  }

  void loop() {
    uint64_t seen = generation_.load();
    for (;;) {
      auto start = std::chrono::steady_clock::now();
      int polls = 0;
      while (generation_.load() == seen) {
        cpu_relax();
        if (++polls % 256 == 0 && std::chrono::steady_clock::now() - start > kSpin) {
          std::unique_lock<std::mutex> lock(mutex_);
          sleeping_.fetch_add(1);
          wake_.wait(lock, [&] { return generation_.load() != seen; });
          sleeping_.fetch_sub(1);
        }
      }
      seen = generation_.load();
      active_.fetch_add(1);
      if (Job* job = job_.load()) job->drain();
      active_.fetch_sub(1);
    }
  }

  std::vector<std::thread> threads_;
  std::mutex submit_, mutex_;
  std::condition_variable wake_;
  std::atomic<Job*> job_{nullptr};
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> sleeping_{0}, active_{0};
};

// Runs fn(i) for i in [0, n) on this library's workers (or, when they are
// busy, XLA's pool) and the calling thread. Tasks claim indices from a shared
// counter and the caller claims too, so a task that starts late finds the
// counter exhausted and touches no buffer, and a busy or single-thread pool
// never blocks a call.
template <typename F>
void parallel_for(ffi::ThreadPool& pool, int64_t n, F fn) {
  if (n <= 0) return;
  const int64_t threads = pool.num_threads();
  if (threads <= 1 || n == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  auto state = std::make_shared<Job>();
  state->n = n;
  state->call = [](const void* f, int64_t i) { (*static_cast<const F*>(f))(i); };
  state->fn = &fn;
  if (Workers::get(threads - 1)->run(*state)) return;
  const int64_t helpers = std::min<int64_t>(threads - 1, n - 1);
  for (int64_t w = 0; w < helpers; ++w) pool.Schedule([state] { state->drain(); });
  state->drain();
  while (state->finished.load(std::memory_order_acquire) < n) cpu_relax();
}

// ---------------------------------------------------------------------------
// Matmul over a packed weight
// ---------------------------------------------------------------------------
//
// W [K, N] is packed once (eagle_jax.kernels.cpu.pack_weight) into column
// tiles of 64, each tile's rows contiguous, N zero-padded to a multiple of 64:
//   f32:  [N/64, K, 64]
//   bf16: [N/64, K/2, 64, 2] (K padded to even): the pairs (W[2i, n],
//         W[2i+1, n]) are adjacent, as AVX512-BF16's dot instruction takes them;
//         x comes as bf16 too, and products are exact in f32.
// A tile is then one contiguous stream, read once per block of 6 rows of x
// (from L2 after the first block).

constexpr int kMaxRows = 6;  // rows of x per register tile
constexpr int64_t kSplitBlocks = 8;  // from this many row blocks on, tasks split a tile's rows
constexpr int kCols = 64;    // columns per tile (4 vectors)

// While a later pass over a tile computes from cache, memory would idle: so
// every pass of a multi-pass tile also fetches part of the task's next tile
// into L2, a share of its lines in proportion to the pass's rows (`Prefetch`:
// `rate` lines per k step in 16.16 fixed point). A tile is 4 cache lines per
// k step (f32: 64 floats of one row of W; bf16: 64 pairs).
struct Prefetch {
  const char* next = nullptr;  // the next line to fetch; nullptr: none
  int64_t rate = 0, frac = 0;
  void step() {
    if (next == nullptr) return;
    for (frac += rate; frac >= (int64_t(1) << 16); frac -= int64_t(1) << 16, next += 64)
      __builtin_prefetch(next, 0, 2);
  }
};

// f32: acc[m] += x[m, k] * W[k, tile], k in order.
template <int MT>
void tile_f32(const float* x, const float* w, float* out, int64_t K, Prefetch pf) {
  vf acc[MT][4] = {};
  for (int64_t k = 0; k < K; ++k) {
    const float* row = w + k * kCols;
    pf.step();
    vf w0 = load(row), w1 = load(row + 16), w2 = load(row + 32), w3 = load(row + 48);
    for (int m = 0; m < MT; ++m) {
      vf b = splat(x[m * K + k]);
      acc[m][0] += b * w0;
      acc[m][1] += b * w1;
      acc[m][2] += b * w2;
      acc[m][3] += b * w3;
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < 4; ++j) store(out + m * kCols + 16 * j, acc[m][j]);
}

// bf16 pairs: acc += x[2i+1] * W[2i+1] then += x[2i] * W[2i] (VDPBF16PS order).
#if defined(__AVX512BF16__)
inline vf dot_pairs(vf acc, uint32_t xpair, const uint16_t* wp) {
  __m512i wv = _mm512_loadu_si512(wp);
  return (vf)_mm512_dpbf16_ps((__m512)acc, (__m512bh)_mm512_set1_epi32(int(xpair)), (__m512bh)wv);
}
#else
inline vf dot_pairs(vf acc, uint32_t xpair, const uint16_t* wp) {
  vu u;
  std::memcpy(&u, wp, sizeof u);
  vu lo = u << 16, hi = u & 0xffff0000u;
  vf w_even, w_odd;
  std::memcpy(&w_even, &lo, sizeof lo);
  std::memcpy(&w_odd, &hi, sizeof hi);
  float x_even = scalar(uint16_t(xpair & 0xffff)), x_odd = scalar(uint16_t(xpair >> 16));
  acc += splat(x_odd) * w_odd;
  acc += splat(x_even) * w_even;
  return acc;
}
#endif

template <int MT>
void tile_bf16(const uint32_t* x, const uint16_t* w, float* out, int64_t K2, Prefetch pf) {
  vf acc[MT][4] = {};
  for (int64_t i = 0; i < K2; ++i) {
    const uint16_t* row = w + i * 2 * kCols;
    pf.step();
    for (int m = 0; m < MT; ++m) {
      uint32_t xp = x[m * K2 + i];
      acc[m][0] = dot_pairs(acc[m][0], xp, row);
      acc[m][1] = dot_pairs(acc[m][1], xp, row + 32);
      acc[m][2] = dot_pairs(acc[m][2], xp, row + 64);
      acc[m][3] = dot_pairs(acc[m][3], xp, row + 96);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < 4; ++j) store(out + m * kCols + 16 * j, acc[m][j]);
}

template <int MT, typename X, typename W>
void tile(const X* x, const W* w, float* out, int64_t kx, Prefetch pf) {
  if constexpr (std::is_same_v<W, float>) tile_f32<MT>(x, w, out, kx, pf);
  else tile_bf16<MT>(x, w, out, kx, pf);
}

// What a call does around the product, per output element (acc: the f32
// accumulator; round(): to the output dtype, as a separate XLA op would):
//   plain     y = round(acc)
//   residual  y = round(round(acc) + res)            (h + x @ W)
//   swiglu    y = round(silu(round(g)) * round(u))   with g, u the accumulators
//             of column n and n + N/2 (W = [gate | up], N/2 a multiple of 64)
enum Epilogue : int32_t { kPlain = 0, kResidual = 1, kSwiglu = 2 };

inline vf round_as(vf v, const float*) { return v; }
inline vf round_as(vf v, const uint16_t*) {  // to bf16 and back, nearest even
  vu u;
  std::memcpy(&u, &v, sizeof u);
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

inline vf sigmoid(vf g) {
  vf e = exp_nonpositive(g < 0 ? g : -g);  // exp(-|g|)
  vf r = 1.0f / (1.0f + e);
  return g < 0 ? e * r : r;
}

template <typename Y>
struct Outputs {
  Y* y;
  const Y* res;  // kResidual: [M, N]
  int64_t N;     // columns of y
  Epilogue kind;
};

// The finished [rows, 64] block at column n0 (width valid columns): acc and,
// for swiglu, the up-projection accumulators.
template <typename Y>
void finish(const Outputs<Y>& o, const float* acc, const float* up, int64_t m0, int64_t rows, int64_t n0,
            int64_t width) {
  const Y* tag = nullptr;
  for (int64_t m = 0; m < rows; ++m) {
    alignas(64) float v[kCols], r[kCols] = {};
    if (o.kind == kResidual)
      for (int64_t c = 0; c < width; ++c) r[c] = scalar(o.res[(m0 + m) * o.N + n0 + c]);
    for (int j = 0; j < 4; ++j) {
      vf a = round_as(load(acc + m * kCols + 16 * j), tag);
      if (o.kind == kResidual) {
        a = round_as(a + load(r + 16 * j), tag);
      } else if (o.kind == kSwiglu) {
        vf u = round_as(load(up + m * kCols + 16 * j), tag);
        a = round_as(a * sigmoid(a) * u, tag);
      }
      store(v + 16 * j, a);
    }
    store_elem(o.y + (m0 + m) * o.N + n0, v, width);
  }
}

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// AVX2 has 16 registers of 8 floats, and the tiles above, written for
// 512-bit vectors, keep their accumulators on the stack there (measured on a
// Zen 2 EPYC: M=1 at 17 GB/s, M=12 at 1 GB/s). Here one row takes the whole
// 64-column tile (8 accumulators); more rows (up to 6, the block `column_tile`
// hands over) go together over a part of the tile (2 rows: half of it, 4
// vectors; 3 to 6 rows: a quarter, 2 vectors; 6 to 12 accumulators, chains
// that hide most of the FMA latency: with a quarter for 2 rows, M = 2 cost
// as much as M = 3), the part's weights loaded and widened once for all rows,
// k in chunks of 64 rows (16 KB, in L1 for the later parts; the first part
// prefetches the chunk's other three cache lines). For
// bf16, the rows of x are widened to f32 once per tile (even and odd halves
// apart), so each row's multiplier is one broadcast load. Every output is one
// chain of FMAs over k in order (bf16: each pair's odd k, then its even k),
// whatever the grouping, so M rows give bit for bit the rows of M one-row
// calls. No prefetch of the next tile (tuned on AVX-512 only).
inline __m256 bf16_even(__m256i u) { return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16)); }
inline __m256 bf16_odd(__m256i u) { return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32(-65536))); }
inline __m256 bf16_splat(uint32_t h) { return _mm256_castsi256_ps(_mm256_set1_epi32(int(h << 16))); }

constexpr int64_t kChunkAvx2 = 64;  // k rows (f32) or pairs (bf16) per chunk: 16 KB of a tile

// The R x C accumulators of a block at columns 8 c0..: zeros, or the sums so far in out when k0 > 0.
template <int R, int C>
inline void start_acc(__m256 (&acc)[R][C], const float* out, int c0, int64_t k0) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      acc[r][c] = k0 ? _mm256_loadu_ps(out + r * kCols + 8 * (c0 + c)) : _mm256_setzero_ps();
}

template <int R, int C>
inline void store_acc(const __m256 (&acc)[R][C], float* out, int c0) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(out + r * kCols + 8 * (c0 + c), acc[r][c]);
}

inline void fetch_quarters(const void* row) {  // the other three cache lines of a tile's k row
  for (int l = 1; l < 4; ++l) _mm_prefetch(static_cast<const char*>(row) + 64 * l, _MM_HINT_T0);
}

// out[r, 8 c0 .. 8 (c0 + C)) (+)= x[r, k0:k1] @ W[k0:k1, those columns], R rows,
// continuing the sums in out unless k0 == 0. x [R, K], W rows of 64 floats.
template <int R, int C, bool kFetch>
void block_avx2(const float* x, const float* w, float* out, int64_t K, int c0, int64_t k0, int64_t k1) {
  __m256 acc[R][C];
  start_acc(acc, out, c0, k0);
  for (int64_t k = k0; k < k1; ++k) {
    const float* row = w + k * kCols;
    if constexpr (kFetch) fetch_quarters(row);
    __m256 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = _mm256_loadu_ps(row + 8 * (c0 + c));
    for (int r = 0; r < R; ++r) {
      const __m256 b = _mm256_broadcast_ss(x + r * K + k);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(b, wv[c], acc[r][c]);
    }
  }
  store_acc(acc, out, c0);
}

// bf16, one row over the whole tile: x [K/2] pairs, W rows of 64 pairs, each vector widened as it is used.
void row_avx2(const uint32_t* x, const uint16_t* w, float* out, int64_t K2) {
  __m256 acc[1][8];
  start_acc(acc, out, 0, 0);
  for (int64_t i = 0; i < K2; ++i) {
    const uint16_t* row = w + i * kCols * 2;
    const __m256 xo = bf16_splat(x[i] >> 16), xe = bf16_splat(x[i] & 0xffffu);
    for (int c = 0; c < 8; ++c) {
      const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16 * c));
      acc[0][c] = _mm256_fmadd_ps(xe, bf16_even(u), _mm256_fmadd_ps(xo, bf16_odd(u), acc[0][c]));
    }
  }
  store_acc(acc, out, 0);
}

// bf16, R rows over C vectors at column vector c0: xf [R, 2 K2] f32, each row
// its even k then its odd k (`widen_rows`); W rows of 64 pairs. Each sum
// takes the odd k, then the even k, as `row_avx2` does (rows are the same
// whatever the block).
template <int R, int C, bool kFetch>
void block_pairs_avx2(const float* xf, const uint16_t* w, float* out, int64_t K2, int c0, int64_t k0, int64_t k1) {
  __m256 acc[R][C];
  start_acc(acc, out, c0, k0);
  for (int64_t i = k0; i < k1; ++i) {
    const uint16_t* row = w + i * kCols * 2;
    if constexpr (kFetch) fetch_quarters(row);
    const __m256i* u = reinterpret_cast<const __m256i*>(row + 16 * c0);
    __m256 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = bf16_odd(_mm256_loadu_si256(u + c));
    for (int r = 0; r < R; ++r) {
      const __m256 b = _mm256_broadcast_ss(xf + r * 2 * K2 + K2 + i);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(b, wv[c], acc[r][c]);
    }
    for (int c = 0; c < C; ++c) wv[c] = bf16_even(_mm256_loadu_si256(u + c));
    for (int r = 0; r < R; ++r) {
      const __m256 b = _mm256_broadcast_ss(xf + r * 2 * K2 + i);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(b, wv[c], acc[r][c]);
    }
  }
  store_acc(acc, out, c0);
}

// xf [rows, 2 K2]: each row of bf16 pairs x [rows, K2] as f32, the even k first, then the odd k.
inline void widen_rows(const uint32_t* x, float* xf, int64_t rows, int64_t K2) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint32_t* src = x + r * K2;
    float* even = xf + r * 2 * K2;
    float* odd = even + K2;
    int64_t i = 0;
    for (; i + 8 <= K2; i += 8) {
      const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
      _mm256_storeu_ps(even + i, bf16_even(u));
      _mm256_storeu_ps(odd + i, bf16_odd(u));
    }
    for (; i < K2; ++i) {
      const uint32_t e = src[i] << 16, o = src[i] & 0xffff0000u;
      std::memcpy(even + i, &e, 4);
      std::memcpy(odd + i, &o, 4);
    }
  }
}

// Column vectors per block for R rows: enough independent sums (R x C of
// them, each a chain of dependent FMAs) to cover the FMA latency, within the
// 16 vector registers (R x C sums + C weight vectors + a broadcast). Measured
// (SmolLM2 forward, bf16): 2 rows over 4 vectors 20.4 -> 17.4 ms; 3 rows over
// 4 vectors no faster than over 2 (registers spill).
template <int R>
constexpr int kBlockCols = R == 2 ? 4 : 2;

template <int R, bool kFetch>
inline void block_any(const float* x, const float* w, float* out, int64_t K, int c0, int64_t k0, int64_t k1) {
  block_avx2<R, kBlockCols<R>, kFetch>(x, w, out, K, c0, k0, k1);
}
template <int R, bool kFetch>
inline void block_any(const float* xf, const uint16_t* w, float* out, int64_t K2, int c0, int64_t k0, int64_t k1) {
  block_pairs_avx2<R, kBlockCols<R>, kFetch>(xf, w, out, K2, c0, k0, k1);
}

// R rows over a whole tile, in blocks of kBlockCols<R> column vectors.
template <int R, typename W>
void parts_avx2(const float* x, const W* w, float* out, int64_t kx, int64_t k0, int64_t k1) {
  block_any<R, true>(x, w, out, kx, 0, k0, k1);
  for (int c0 = kBlockCols<R>; c0 < 8; c0 += kBlockCols<R>) block_any<R, false>(x, w, out, kx, c0, k0, k1);
}

template <typename W>
void rows_avx2(const float* x, const W* w, float* out, int64_t rows, int64_t kx) {
  for (int64_t k0 = 0; k0 < kx; k0 += kChunkAvx2) {
    const int64_t k1 = std::min(kx, k0 + kChunkAvx2);
    switch (rows) {
      case 2: parts_avx2<2>(x, w, out, kx, k0, k1); break;
      case 3: parts_avx2<3>(x, w, out, kx, k0, k1); break;
      case 4: parts_avx2<4>(x, w, out, kx, k0, k1); break;
      case 5: parts_avx2<5>(x, w, out, kx, k0, k1); break;
      default: parts_avx2<6>(x, w, out, kx, k0, k1); break;
    }
  }
}

static_assert(kMaxRows == 6, "the AVX2 blocks take at most 6 rows");

inline void tile_rows(const float* x, const float* w, float* out, int64_t rows, int64_t K, Prefetch) {
  if (rows == 1) return block_avx2<1, 8, false>(x, w, out, K, 0, 0, K);
  rows_avx2(x, w, out, rows, K);
}

inline void tile_rows(const uint32_t* x, const uint16_t* w, float* out, int64_t rows, int64_t K2, Prefetch) {
  if (rows == 1) return row_avx2(x, w, out, K2);
  thread_local std::vector<float> xf;
  xf.resize(rows * 2 * K2);
  widen_rows(x, xf.data(), rows, K2);
  rows_avx2(xf.data(), w, out, rows, K2);
}
#else
template <typename X, typename W>
void tile_rows(const X* x, const W* w, float* out, int64_t rows, int64_t kx, Prefetch pf) {
  switch (rows) {
    case 1: tile<1>(x, w, out, kx, pf); break;
    case 2: tile<2>(x, w, out, kx, pf); break;
    case 3: tile<3>(x, w, out, kx, pf); break;
    case 4: tile<4>(x, w, out, kx, pf); break;
    case 5: tile<5>(x, w, out, kx, pf); break;
    default: tile<6>(x, w, out, kx, pf); break;
  }
}
#endif

// AMX (Intel Sapphire Rapids and later), bf16 only: a [16, 64] block of the
// product per call, on tiles: C0..C3 (16 rows x 16 f32 columns each) +=
// A (16 rows of x, 16 pairs of K) . B (16 pair-rows of one 16-column quarter
// of the packed tile, read at its 256-byte row stride), K2 in steps of 16
// pairs, then the pairs past the last whole step on vectors. Each row of x
// goes through the same instructions whatever the other rows hold, so the
// rows of a verify step still equal single-token steps bit for bit; but the
// sums round differently from the vector path, so a process asks for one or
// the other in every call (the `amx` attribute: eagle_jax.kernels.cpu.amx()).
// The tiles' 16 rows read x in blocks of 16: MatmulImpl pads x with zero
// rows to a whole block.
constexpr int kAmxRows = 16;

#if defined(EAGLE_AMX)
// Whether this process may use AMX tiles: the CPU has them and Linux grants
// the tile state (arch_prctl, from kernel 5.16). Asked once per process.
bool amx_available() {
  static const bool granted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// A task's tiles, configured before its first product and released after its
// last: every tile 16 rows of 64 bytes (C0..C3 f32 [16, 16], A (4) and B (5..7)
// bf16 pairs [16, 16]).
struct AmxTask {
  explicit AmxTask(bool on) : on(on) {
    if (!on) return;
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
  }
  ~AmxTask() {
    if (on) _tile_release();
  }
  bool on;
};

// out[16, 64] = x[16, K2 pairs] @ w (one packed bf16 tile, K2 pair-rows of 64 columns x 2).
void tile_amx(const uint32_t* x, const uint16_t* w, float* out, int64_t K2) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t whole = K2 / 16 * 16;
  for (int64_t i = 0; i < whole; i += 16) {  // three B loads ahead of the products (1.35x faster at M = 1)
    const uint16_t* b = w + i * 2 * kCols;
    _tile_loadd(5, b, 4 * kCols);
    _tile_loadd(6, b + 32, 4 * kCols);
    _tile_loadd(7, b + 64, 4 * kCols);
    _tile_loadd(4, x + i, K2 * 4);
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 6);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, b + 96, 4 * kCols);
    _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, out, kCols * 4);
  _tile_stored(1, out + 16, kCols * 4);
  _tile_stored(2, out + 32, kCols * 4);
  _tile_stored(3, out + 48, kCols * 4);
  for (int64_t i = whole; i < K2; ++i) {
    const uint16_t* row = w + i * 2 * kCols;
    for (int m = 0; m < kAmxRows; ++m)
      for (int j = 0; j < 4; ++j)
        store(out + m * kCols + 16 * j, dot_pairs(load(out + m * kCols + 16 * j), x[m * K2 + i], row + 32 * j));
  }
}
#else
bool amx_available() { return false; }
struct AmxTask {
  explicit AmxTask(bool) {}
};
#endif

// Output column tile t for rows [m_begin, m_end). kx: the row length of x in
// X units (K or K/2). For swiglu, tile t pairs weight tiles t (gate) and
// t + tiles (up). prefetch_next: fetch tile t + 1 (of the same task) into L2
// during the passes; `matmul` asks for it from two full passes on.
template <typename X, typename W, typename Y>
void column_tile(const X* x, const W* w, const Outputs<Y>& o, int64_t m_begin, int64_t m_end, int64_t kx,
                 int64_t t, int64_t tiles, bool prefetch_next, bool amx) {
  const int64_t tile_elems = kx * (std::is_same_v<W, float> ? 1 : 2) * kCols;
  const W* wt = w + t * tile_elems;
  const int64_t n0 = t * kCols, width = std::min<int64_t>(kCols, o.N - n0);
  const bool fetch = prefetch_next && kx > 0;
  const int64_t M = m_end - m_begin;
  alignas(64) float buf[kAmxRows * kCols], up[kAmxRows * kCols];
#if defined(EAGLE_AMX)
  if constexpr (std::is_same_v<W, uint16_t>) {
    if (amx) {  // x padded to whole blocks of 16 rows (MatmulImpl); tiles configured (AmxTask)
      for (int64_t m0 = m_begin; m0 < m_end; m0 += kAmxRows) {
        tile_amx(x + m0 * kx, wt, buf, kx);
        if (o.kind == kSwiglu) tile_amx(x + m0 * kx, wt + tiles * tile_elems, up, kx);
        finish(o, buf, up, m0, std::min<int64_t>(kAmxRows, m_end - m0), n0, width);
      }
      return;
    }
  }
#endif
  for (int64_t m0 = m_begin; m0 < m_end; m0 += kMaxRows) {
    const X* xm = x + m0 * kx;
    const int64_t rows = std::min<int64_t>(kMaxRows, m_end - m0), i = m0 - m_begin;
    Prefetch pf;
    if (fetch) {  // lines [4 kx i / M, 4 kx (i + rows) / M) of the next tile
      pf.next = reinterpret_cast<const char*>(wt + tile_elems) + 4 * kx * i / M * 64;
      pf.rate = (((4 * kx * (i + rows) / M) - (4 * kx * i / M)) << 16) / kx;
    }
    tile_rows(xm, wt, buf, rows, kx, pf);
    if (o.kind == kSwiglu) {
      if (fetch) pf.next += tiles * tile_elems * sizeof(W);
      tile_rows(xm, wt + tiles * tile_elems, up, rows, kx, pf);
    }
    finish(o, buf, up, m0, rows, n0, width);
  }
}

template <typename X, typename W, typename Y>
void matmul(ffi::ThreadPool& pool, const X* x, const W* w, const Outputs<Y>& o, int64_t M, int64_t kx, bool amx) {
  const int64_t tiles = (o.N + kCols - 1) / kCols;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  if ((M + kMaxRows - 1) / kMaxRows >= kSplitBlocks) {
    // Many rows (a prefill): tasks of one tile and 24 or 32 rows (4 blocks of
    // 6, 2 of 16), claimed in turn, so threads finish together whatever the
    // tile count (runs of whole tiles left one of two threads idle for a
    // fifth of a 9-tile call).
    const int64_t task_rows = amx ? 2 * kAmxRows : 4 * kMaxRows;
    const int64_t parts = (M + task_rows - 1) / task_rows;
    parallel_for(pool, tiles * parts, [&](int64_t task) {
      const AmxTask tiles_on(amx);
      const int64_t t = task / parts, m0 = task % parts * task_rows;
      column_tile(x, w, o, m0, std::min(M, m0 + task_rows), kx, t, tiles, false, amx);
    });
    return;
  }
  // Contiguous runs of tiles per task: one run per thread for small weights
  // (the best split of their few tiles anyway), runs of 8 to 15 tiles for
  // large ones (measured against one-tile tasks: 0-15% faster at M = 1). With
  // two or more full passes per tile, each pass also fetches part of the
  // task's next tile (measured: that paid from M = 12 on, and cost at M = 8).
  const int64_t tasks = std::min(tiles, threads * std::max<int64_t>(1, tiles / (8 * threads)));
  const bool fetch = !amx && M >= 2 * kMaxRows;
  parallel_for(pool, tasks, [&](int64_t task) {
    const AmxTask tiles_on(amx);
    const int64_t t0 = task * tiles / tasks, t1 = (task + 1) * tiles / tasks;
    for (int64_t t = t0; t < t1; ++t) column_tile(x, w, o, 0, M, kx, t, tiles, fetch && t + 1 < t1, amx);
  });
}

// RMSNorm of each segment of each row of x [M, K] (K = segments * ks) as the
// XLA path computes it: f32 mean of squares (16-lane partial sums, the hsum
// tree, then the tail in order), n = round(x * rsqrt(mean + eps)),
// out = round(n * gamma), round() to x's dtype.
template <typename E>
void rms_norm_rows(const E* x, const E* gamma, E* out, int64_t M, int64_t K, int64_t segments, float eps) {
  const E* tag = nullptr;
  const int64_t ks = K / segments;
  for (int64_t m = 0; m < M * segments; ++m) {
    const E* row = x + m * ks;
    const E* g = gamma + (m % segments) * ks;
    vf acc{};
    int64_t k = 0;
    for (; k + kLanes <= ks; k += kLanes) {
      vf v = load(row + k);
      acc += v * v;
    }
    float ss = hsum(acc);
    for (; k < ks; ++k) ss += scalar(row[k]) * scalar(row[k]);
    const float r = 1.0f / std::sqrt(ss / float(ks) + eps);
    for (int64_t c = 0; c < ks; c += kLanes) {
      alignas(64) float xs[kLanes] = {}, gs[kLanes] = {};
      const int64_t n = std::min<int64_t>(kLanes, ks - c);
      for (int64_t i = 0; i < n; ++i) xs[i] = scalar(row[c + i]), gs[i] = scalar(g[c + i]);
      vf v = round_as(round_as(load(xs) * r, tag) * load(gs), tag);
      store(xs, v);
      store_elem(out + m * ks + c, xs, n);
    }
  }
}

// x [M, K], w packed, gamma [K] or empty (no norm), res [M, N] or empty; y [M, N].
ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer gamma,
                      ffi::AnyBuffer res, ffi::Result<ffi::AnyBuffer> y, float eps, int32_t epilogue,
                      int32_t segments, int32_t amx) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  auto yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || xd[0] != yd[0])
    return ffi::Error::InvalidArgument("eagle_matmul: x must be [M, K] and y [M, N]");
  if (y->element_type() != ffi::F32 && y->element_type() != ffi::BF16)
    return ffi::Error::InvalidArgument("eagle_matmul: y must be float32 or bfloat16");
  const int64_t M = xd[0], K = xd[1], N = yd[1];
  const bool norm = gamma.element_count() > 0;
  if (epilogue < kPlain || epilogue > kSwiglu || (epilogue == kResidual) != (res.element_count() > 0))
    return ffi::Error::InvalidArgument("eagle_matmul: unknown epilogue, or a residual given without it");
  const Epilogue kind = Epilogue(epilogue);
  if (norm && (gamma.element_type() != x.element_type() || int64_t(gamma.element_count()) != K ||
               segments < 1 || K % segments))
    return ffi::Error::InvalidArgument("eagle_matmul: gamma must be [K] in x's dtype, K a multiple of segments");
  if (kind == kResidual && (res.element_type() != y->element_type() || int64_t(res.element_count()) != M * N))
    return ffi::Error::InvalidArgument("eagle_matmul: the residual must be [M, N] in y's dtype");
  if (kind == kSwiglu && N % kCols)
    return ffi::Error::InvalidArgument("eagle_matmul: swiglu needs N/2 (the output width) a multiple of 64");
  const int64_t tiles = (N * (kind == kSwiglu ? 2 : 1) + kCols - 1) / kCols;
  const bool bf16 = x.element_type() == ffi::BF16;
  if (x.element_type() != w.element_type() || (!bf16 && x.element_type() != ffi::F32))
    return ffi::Error::InvalidArgument("eagle_matmul: x and w must both be float32 or both bfloat16");
  if (bf16 ? (K % 2 || wd.size() != 4 || wd[0] != tiles || wd[1] != K / 2 || wd[2] != kCols || wd[3] != 2)
           : (wd.size() != 3 || wd[0] != tiles || wd[1] != K || wd[2] != kCols))
    return ffi::Error::InvalidArgument(
        "eagle_matmul: w must be packed [ceil(N/64), K, 64] (f32) or [ceil(N/64), K/2, 64, 2] (bf16, K even)");
  if (amx && (!bf16 || !amx_available()))
    return ffi::Error::InvalidArgument("eagle_matmul: AMX tiles asked for, but they take bf16 and this process has none");
  auto run = [&](auto etag, auto ytag) {
    using E = decltype(etag);
    using Y = decltype(ytag);
    const E* xs = static_cast<const E*>(x.untyped_data());
    std::vector<E> normed;
    const bool pad = amx && M % kAmxRows;
    if (norm || pad) {  // AMX reads x in blocks of 16 rows: zero rows up to a whole block
      normed.assign((pad ? (M + kAmxRows - 1) / kAmxRows * kAmxRows : M) * K, E(0));
      if (norm)
        rms_norm_rows(xs, static_cast<const E*>(gamma.untyped_data()), normed.data(), M, K, segments, eps);
      else
        std::memcpy(normed.data(), xs, M * K * sizeof(E));
      xs = normed.data();
    }
    Outputs<Y> o{static_cast<Y*>(y->untyped_data()), static_cast<const Y*>(res.untyped_data()), N, kind};
    if constexpr (std::is_same_v<E, float>)
      matmul(pool, xs, static_cast<const float*>(w.untyped_data()), o, M, K, false);
    else
      matmul(pool, reinterpret_cast<const uint32_t*>(xs), static_cast<const uint16_t*>(w.untyped_data()), o, M,
             K / 2, amx != 0);
  };
  const bool ybf16 = y->element_type() == ffi::BF16;
  if (bf16) ybf16 ? run(uint16_t{}, uint16_t{}) : run(uint16_t{}, float{});
  else ybf16 ? run(float{}, uint16_t{}) : run(float{}, float{});
  return ffi::Error::Success();
}

// The same with a preset output buffer aliased to y (tests poison it with NaN,
// so that an element the kernel fails to write shows).
ffi::Error MatmulIntoImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer gamma,
                          ffi::AnyBuffer res, ffi::AnyBuffer /*preset*/, ffi::Result<ffi::AnyBuffer> y, float eps,
                          int32_t epilogue, int32_t segments, int32_t amx) {
  return MatmulImpl(pool, x, w, gamma, res, y, eps, epilogue, segments, amx);
}

// ---------------------------------------------------------------------------
// Attention
// ---------------------------------------------------------------------------
//
// Per query row: scores of every visible key in key order (cache slots
// 0..len-1, then the new tokens its mask row allows), softmax weights
// exp(s - max), their sum by lanes of key index, then the weighted sum of V
// with the normalised weights, keys in order.
// Keys are scored 16 at a time by key index, whether a key sits in the cache
// or among the new tokens: the block is transposed so that lane l holds key
// l, and each score is one chain over D (`score_rows`: f32 FMAs, or bf16
// pair dots for a bf16 cache). A token thus gets the same score, weight and
// share of the output as a new key as it does later from the cache, so a
// verify step equals plain steps.
// The call also writes the new K/V into its layer of the cache (aliased), so
// the cache passes from layer to layer without XLA copies.

// acc + the 16 pair dots of a and b (AVX512-BF16 order: odd halves, then even).
inline vf dot_pair_registers(vf acc, vu a, vu b) {
#if defined(__AVX512BF16__)
  return (vf)_mm512_dpbf16_ps((__m512)acc, (__m512bh)a, (__m512bh)b);
#else
  vu a_lo = a << 16, a_hi = a & 0xffff0000u, b_lo = b << 16, b_hi = b & 0xffff0000u;
  vf fa_lo, fa_hi, fb_lo, fb_hi;
  std::memcpy(&fa_lo, &a_lo, sizeof fa_lo);
  std::memcpy(&fa_hi, &a_hi, sizeof fa_hi);
  std::memcpy(&fb_lo, &b_lo, sizeof fb_lo);
  std::memcpy(&fb_hi, &b_hi, sizeof fb_hi);
  acc += fa_hi * fb_hi;
  acc += fa_lo * fb_lo;
  return acc;
#endif
}

// One stage of a 16 x 16 transpose of 32-bit units: rows i and i + S swap
// their S-wide off-diagonal blocks.
template <int S>
inline void transpose_stage(vu* r) {
#define EAGLE_LO(l) ((l) & S ? 16 + (l) - S : (l))
#define EAGLE_HI(l) ((l) & S ? 16 + (l) : (l) + S)
  for (int i = 0; i < 16; ++i) {
    if (i & S) continue;
    const vu a = r[i], b = r[i + S];
    r[i] = __builtin_shufflevector(a, b, EAGLE_LO(0), EAGLE_LO(1), EAGLE_LO(2), EAGLE_LO(3), EAGLE_LO(4),
                                   EAGLE_LO(5), EAGLE_LO(6), EAGLE_LO(7), EAGLE_LO(8), EAGLE_LO(9), EAGLE_LO(10),
                                   EAGLE_LO(11), EAGLE_LO(12), EAGLE_LO(13), EAGLE_LO(14), EAGLE_LO(15));
    r[i + S] = __builtin_shufflevector(a, b, EAGLE_HI(0), EAGLE_HI(1), EAGLE_HI(2), EAGLE_HI(3), EAGLE_HI(4),
                                       EAGLE_HI(5), EAGLE_HI(6), EAGLE_HI(7), EAGLE_HI(8), EAGLE_HI(9),
                                       EAGLE_HI(10), EAGLE_HI(11), EAGLE_HI(12), EAGLE_HI(13), EAGLE_HI(14),
                                       EAGLE_HI(15));
  }
#undef EAGLE_LO
#undef EAGLE_HI
}

// 16 keys (key l at keys[l], U 32-bit units each: f32 values or bf16 pairs)
// -> t[u] with lane l = unit u of key l.
template <int U>
inline void transpose_keys(const void* const* keys, vu* t) {
  for (int u0 = 0; u0 < U; u0 += 16) {
    vu r[16];
    for (int l = 0; l < 16; ++l) std::memcpy(&r[l], static_cast<const uint32_t*>(keys[l]) + u0, sizeof(vu));
    transpose_stage<8>(r);
    transpose_stage<4>(r);
    transpose_stage<2>(r);
    transpose_stage<1>(r);
    for (int l = 0; l < 16; ++l) t[u0 + l] = r[l];
  }
}

// acc (lane l: key l) + q . k over unit u: f32 q[u] * k[u]; bf16 the pair
// dot of q's pair u with k's.
inline vf add_unit(vf acc, const float* q, int u, vu kt) {
  vf k;
  std::memcpy(&k, &kt, sizeof k);
  return acc + splat(q[u]) * k;
}

inline vf add_unit(vf acc, const uint16_t* q, int u, vu kt) {
  uint32_t pair;
  std::memcpy(&pair, q + 2 * u, sizeof pair);
  return dot_pair_registers(acc, vu{} + pair, kt);
}

// Scores of RN query rows against a transposed block of 16 keys, summed over
// the units in order: lane l of out[i] = (q_i . k_l) * scale.
template <int RN, int U, typename C>
inline void score_rows(const C* const* q, const vu* kt, float scale, float* const* out) {
  vf acc[RN] = {};
  for (int u = 0; u < U; ++u)
    for (int i = 0; i < RN; ++i) acc[i] = add_unit(acc[i], q[i], u, kt[u]);
  for (int i = 0; i < RN; ++i) store(out[i], acc[i] * scale);
}

struct AttnShape {
  int64_t B, T, Hq, Hkv, D, S, G, L;
  int64_t Bc;  // rows of the cache (>= B: the call's rows are its first B)
  int64_t layer;
  float scale;
};

constexpr int kRowGroup = 16;  // accumulator vectors per PV row group

typedef uint16_t vw __attribute__((vector_size(64)));  // 32 bf16

// Weighted values of GN query rows, acc[i] = sum_j w[i, j] V[j] over keys
// [0, nk) in key order, with w the normalised softmax weights (row stride
// `stride`, zero-padded past nk) and value(j) key j's V row. f32: one FMA per
// key. bf16: the weights are bf16 (as the XLA path rounds them before its
// product with V) and keys go in pairs (2i, 2i + 1), their V rows interleaved
// so that one AVX512-BF16 dot adds both products for 16 dims.
template <int GN, int NV, typename Value>
void weighted_values(const float* w, int64_t stride, int64_t nk, Value value, float* out) {
  vf acc[GN][NV] = {};
  for (int64_t j = 0; j < nk; ++j) {
    const float* vr = value(j);
    vf v[NV];
    for (int c = 0; c < NV; ++c) v[c] = load(vr + 16 * c);
    for (int i = 0; i < GN; ++i) {
      const vf wi = splat(w[i * stride + j]);
      for (int c = 0; c < NV; ++c) acc[i][c] += wi * v[c];
    }
  }
  for (int i = 0; i < GN; ++i)
    for (int c = 0; c < NV; ++c) store(out + (i * NV + c) * 16, acc[i][c]);
}

template <int GN, int NV, typename Value>
void weighted_values(const uint16_t* w, int64_t stride, int64_t nk, Value value, float* out) {
  vf acc[GN][NV] = {};
  static const uint16_t zeros[16 * NV] = {};
  for (int64_t j = 0; j < nk; j += 2) {
    const uint16_t* a = value(j);
    const uint16_t* b = j + 1 < nk ? value(j + 1) : zeros;
    vu pairs[NV];  // pairs[c] lane l: (V[j, 16c + l], V[j + 1, 16c + l])
    for (int c = 0; c < NV / 2; ++c) {
      vw va, vb;
      std::memcpy(&va, a + 32 * c, sizeof va);
      std::memcpy(&vb, b + 32 * c, sizeof vb);
      vw lo = __builtin_shufflevector(va, vb, 0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39, 8, 40, 9, 41,
                                      10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47);
      vw hi = __builtin_shufflevector(va, vb, 16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55, 24,
                                      56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63);
      std::memcpy(&pairs[2 * c], &lo, sizeof lo);
      std::memcpy(&pairs[2 * c + 1], &hi, sizeof hi);
    }
    for (int i = 0; i < GN; ++i) {
      uint32_t wp;
      std::memcpy(&wp, w + i * stride + j, sizeof wp);
      const vu wv = vu{} + wp;
      for (int c = 0; c < NV; ++c) acc[i][c] = dot_pair_registers(acc[i][c], wv, pairs[c]);
    }
  }
  for (int i = 0; i < GN; ++i)
    for (int c = 0; c < NV; ++c) store(out + (i * NV + c) * 16, acc[i][c]);
}

// GN rows of a task: weighted values, rounded once to the type `dst(i)` points to.
template <int GN, int NV, typename W, typename Value, typename Dst>
void value_group(const W* w, int64_t stride, int64_t nk, Value value, Dst dst) {
  alignas(64) float o[GN * 16 * NV];
  weighted_values<GN, NV>(w, stride, nk, value, o);
  for (int i = 0; i < GN; ++i) store_elem(dst(i), o + i * 16 * NV, 16 * NV);
}

// One task: query rows [r0, r1) of kv head h in batch row b; a query row r is
// (t = r % T, group member g = r / T), i.e. query head h * G + g.
template <int NV, typename C>
void attend_rows(const AttnShape& s, const C* q, const C* kc, const C* vc, int64_t len, const bool* slot_mask,
                 const C* kn, const C* vn, const bool* mask, C* out, int64_t b, int64_t h,
                 int64_t r0, int64_t r1) {
  constexpr int D = NV * kLanes;
  const int64_t nk = len + s.T;  // key candidates: cache slots, then new tokens
  const int64_t rows = r1 - r0;
  const int64_t stride = (nk + 2 * kLanes) & ~int64_t(kLanes - 1);
  std::vector<float> scores(rows * stride);
  const size_t cache_off = (((s.layer * s.Bc + b) * s.Hkv + h) * s.S) * D;
  const C* kb = kc + cache_off;
  const C* vb = vc + cache_off;
  auto qrow = [&](int64_t r) { return q + ((b * s.T + r % s.T) * s.Hq + h * s.G + r / s.T) * D; };
  auto new_kv = [&](const C* base, int64_t u) { return base + ((b * s.T + u) * s.Hkv + h) * D; };
  const float neg_inf = -INFINITY;
  // Scores, 16 keys at a time (a partial block's missing keys read zeros).
  static const C zeros[D] = {};
  auto key = [&](int64_t j) -> const C* { return j < len ? kb + j * D : j < nk ? new_kv(kn, j - len) : zeros; };
  constexpr int U = std::is_same_v<C, float> ? D : D / 2;  // 32-bit units per key
  constexpr int RN = 8;                                     // query rows per score pass
  // Keys [0, seen[i]) hold every key row i may see: its mask hides the new
  // tokens after them (a causal prefill, a tree), so their score blocks and
  // values are skipped; their weights would be exact zeros, so sums are the same.
  std::vector<int64_t> seen(rows);
  for (int64_t i = 0; i < rows; ++i) {
    const bool* row = mask + (b * s.T + (r0 + i) % s.T) * s.T;
    int64_t u = s.T;
    while (u > 0 && !row[u - 1]) --u;
    seen[i] = len + u;
  }
  auto seen_by = [&](int64_t i0, int64_t n) {  // keys rows [i0, i0 + n) see, in whole 16-key blocks
    const int64_t most = *std::max_element(seen.begin() + i0, seen.begin() + i0 + n);
    return std::min(nk, (most + kLanes - 1) & ~int64_t(kLanes - 1));
  };
  const int64_t scored = seen_by(0, rows);
  for (int64_t j0 = 0; j0 < scored; j0 += kLanes) {
    const void* keys[kLanes];
    for (int64_t l = 0; l < kLanes; ++l) keys[l] = key(j0 + l);
    vu kt[U];
    transpose_keys<U>(keys, kt);
    for (int64_t i0 = 0; i0 < rows; i0 += RN) {
      const C* qs[RN];
      float* outs[RN];
      const int64_t n = std::min<int64_t>(RN, rows - i0);
      if (j0 >= seen_by(i0, n)) continue;  // scores stay zero, masked to -inf below
      for (int64_t i = 0; i < RN; ++i) {
        const int64_t r = i0 + std::min<int64_t>(i, n - 1);  // a short pass repeats its last row
        qs[i] = qrow(r0 + r);
        outs[i] = scores.data() + r * stride + j0;
      }
      switch (n) {
        case 1: score_rows<1, U>(qs, kt, s.scale, outs); break;
        case 2: score_rows<2, U>(qs, kt, s.scale, outs); break;
        case 3: score_rows<3, U>(qs, kt, s.scale, outs); break;
        case 4: score_rows<4, U>(qs, kt, s.scale, outs); break;
        case 5: case 6: score_rows<6, U>(qs, kt, s.scale, outs); break;
        default: score_rows<RN, U>(qs, kt, s.scale, outs); break;
      }
    }
  }
  // Keys a query may not see score -inf (an exact zero weight): slots its
  // slot-mask row hides, new tokens its mask row hides.
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t t = (r0 + i) % s.T;
    float* sc = scores.data() + i * stride;
    if (slot_mask != nullptr) {
      const bool* row = slot_mask + (b * s.T + t) * s.S;
      for (int64_t j = 0; j < len; ++j)
        if (!row[j]) sc[j] = neg_inf;
    }
    for (int64_t u = 0; u < s.T; ++u)
      if (!mask[(b * s.T + t) * s.T + u]) sc[len + u] = neg_inf;
  }
  // Softmax weights: max, exp, and their sum with key j in lane j % 16 (a
  // masked key adds an exact zero to its lane), then the hsum tree; the
  // weights normalised (w = e / sum, as e * (1 / sum)) into C.
  std::vector<C> weights(rows * stride);
  for (int64_t i = 0; i < rows; ++i) {
    float* sc = scores.data() + i * stride;
    for (int64_t j = nk; j < stride; ++j) sc[j] = neg_inf;
    vf vmx = splat(neg_inf);
    for (int64_t j = 0; j < nk; j += kLanes) {
      vf v = load(sc + j);
      vmx = v > vmx ? v : vmx;
    }
    float mx = neg_inf;
    for (int l = 0; l < kLanes; ++l) mx = std::max(mx, vmx[l]);
    if (!std::isfinite(mx)) mx = 0.0f;
    vf acc{};
    for (int64_t j = 0; j < stride; j += kLanes) {
      vf e = exp_nonpositive(load(sc + j) - mx);
      store(sc + j, e);
      acc += e;
    }
    const float sum = hsum(acc);
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    for (int64_t j = 0; j < stride; j += kLanes) store(sc + j, load(sc + j) * inv);
    store_elem(weights.data() + i * stride, sc, stride);
  }
  // Weighted values: rows in groups whose accumulators stay in registers.
  auto value = [&](int64_t j) { return j < len ? vb + j * D : new_kv(vn, j - len); };
  constexpr int G = std::max(1, kRowGroup / NV);
  for (int64_t g0 = 0; g0 < rows; g0 += G) {
    const C* w = weights.data() + g0 * stride;
    auto dst = [&](int64_t i) {
      const int64_t r = r0 + g0 + i;
      return out + ((b * s.T + r % s.T) * s.Hq + h * s.G + r / s.T) * D;
    };
    const int64_t gn = std::min<int64_t>(G, rows - g0), keys = seen_by(g0, gn);
    switch (gn) {
      case 1: value_group<1, NV>(w, stride, keys, value, dst); break;
      case 2: value_group<std::min(2, G), NV>(w, stride, keys, value, dst); break;
      case 3: value_group<std::min(3, G), NV>(w, stride, keys, value, dst); break;
      default: value_group<G, NV>(w, stride, keys, value, dst); break;
    }
  }
}

inline void store_as(float* p, vf v) { store(p, v); }
inline void store_as(uint16_t* p, vf v) {  // v already rounded to bf16 (round_as): keep the high halves
  vu u;
  std::memcpy(&u, &v, sizeof u);
  vh h = __builtin_convertvector(u >> 16, vh);
  std::memcpy(p, &h, sizeof h);
}

// One head vector x [D = 16 NV] -> dst [D], both in C: Qwen3's per-head
// RMSNorm first when `gain` is given (rounded where models/layers.py rounds),
// then RoPE: x * cos + rotate_half(x) * sin in f32, rounded to C.
template <int NV, typename C>
void rotate_head(const C* x, const float* cos, const float* sin, const C* gain, float eps, C* dst) {
  const C* tag = nullptr;  // selects round_as for C
  vf v[NV];
  for (int c = 0; c < NV; ++c) v[c] = load(x + 16 * c);
  if (gain != nullptr) {
    vf ss{};
    for (int c = 0; c < NV; ++c) ss += v[c] * v[c];
    const float inv = 1.0f / std::sqrt(hsum(ss) / float(16 * NV) + eps);
    for (int c = 0; c < NV; ++c) v[c] = round_as(load(gain + 16 * c) * round_as(v[c] * inv, tag), tag);
  }
  constexpr int H = NV / 2;
  for (int c = 0; c < NV; ++c) {
    const vf r = c < H ? -v[c + H] : v[c - H];
    store_as(dst + 16 * c, round_as(v[c] * load(cos + 16 * c) + r * load(sin + 16 * c), tag));
  }
}

// qkv [B, T, (Hq + 2 Hkv) D] -> q [B, T, Hq, D], k and v [B, T, Hkv, D], q and k rotated.
template <int NV, typename C>
void split_rotate(const AttnShape& s, const C* qkv, const float* cos, const float* sin, const C* q_gain,
                  const C* k_gain, float eps, C* q, C* k, C* v) {
  const int64_t D = s.D, width = (s.Hq + 2 * s.Hkv) * D;
  for (int64_t bt = 0; bt < s.B * s.T; ++bt) {
    const C* row = qkv + bt * width;
    const float *c = cos + bt * D, *sn = sin + bt * D;
    for (int64_t h = 0; h < s.Hq; ++h) rotate_head<NV>(row + h * D, c, sn, q_gain, eps, q + (bt * s.Hq + h) * D);
    for (int64_t h = 0; h < s.Hkv; ++h) {
      rotate_head<NV>(row + (s.Hq + h) * D, c, sn, k_gain, eps, k + (bt * s.Hkv + h) * D);
      std::memcpy(v + (bt * s.Hkv + h) * D, row + (s.Hq + s.Hkv + h) * D, D * sizeof(C));
    }
  }
}

ffi::Error AttentionImpl(ffi::ThreadPool pool, ffi::AnyBuffer qkv, ffi::Buffer<ffi::F32> cos,
                         ffi::Buffer<ffi::F32> sin, ffi::AnyBuffer q_gain, ffi::AnyBuffer k_gain,
                         ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> layer,
                         ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::PRED> slot_mask,
                         ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> k_out,
                         ffi::Result<ffi::AnyBuffer> v_out, float scale, int32_t num_heads, int32_t qk_norm,
                         float eps, int32_t slot_masked) {
  auto xd = qkv.dimensions();
  auto cd = k_cache.dimensions();
  if (xd.size() != 3 || cd.size() != 5)
    return ffi::Error::InvalidArgument("eagle_attention: qkv must be [B,T,(Hq+2Hkv)D], the cache [L,B,Hkv,S,D]");
  AttnShape s{xd[0], xd[1], num_heads, cd[2], cd[4], cd[3], 0, cd[0], cd[1], 0, scale};
  if ((s.D != 64 && s.D != 128) || cd[1] < s.B || s.Hq <= 0 || s.Hq % s.Hkv || xd[2] != (s.Hq + 2 * s.Hkv) * s.D ||
      lengths.element_count() != size_t(s.B) || mask.element_count() != size_t(s.B * s.T * s.T))
    return ffi::Error::InvalidArgument(
        "eagle_attention: head_dim must be 64 or 128 and the shapes agree (qkv's B rows are the cache's first B)");
  if (cos.element_count() != size_t(s.B * s.T * s.D) || sin.element_count() != cos.element_count())
    return ffi::Error::InvalidArgument("eagle_attention: cos and sin must be [B, T, D]");
  const auto dt = k_cache.element_type();
  if (v_cache.element_type() != dt || qkv.element_type() != dt || out->element_type() != dt ||
      (qk_norm && (q_gain.element_type() != dt || k_gain.element_type() != dt)) ||
      (dt != ffi::F32 && dt != ffi::BF16))
    return ffi::Error::InvalidArgument("eagle_attention: qkv, q/k norms, caches and out must share one dtype (f32 or bf16)");
  if (qk_norm && (q_gain.element_count() != size_t(s.D) || k_gain.element_count() != size_t(s.D)))
    return ffi::Error::InvalidArgument("eagle_attention: the q/k norm weights must be [D]");
  if (slot_masked && slot_mask.element_count() != size_t(s.B * s.T * s.S))
    return ffi::Error::InvalidArgument("eagle_attention: the slot mask must be [B, T, S]");
  adopt(k_cache, k_out);
  adopt(v_cache, v_out);
  s.G = s.Hq / s.Hkv;
  s.layer = std::clamp<int64_t>(layer.typed_data()[0], 0, s.L - 1);
  const int64_t R = s.G * s.T;
  // Each task streams its head's K and V once. With few rows (decode) that
  // stream is the cost, so heads are not split; with many rows (verify) the
  // scores are, and each head's rows are split so that every thread has work.
  const int64_t units = s.B * s.Hkv;
  const int64_t want = 2 * std::max<int64_t>(1, pool.num_threads());
  const int64_t chunks =
      R <= 8 ? 1 : std::min<int64_t>(R / 4, std::max<int64_t>(1, (want + units - 1) / units));
  const int64_t rows_per = (R + chunks - 1) / chunks;
  const bool* m = reinterpret_cast<const bool*>(mask.typed_data());
  const bool* sm = slot_masked ? reinterpret_cast<const bool*>(slot_mask.typed_data()) : nullptr;
  // Cache slots read per row: the committed ones, and with a slot mask also
  // those up to the last one some query of the row may see. Never fewer than
  // the committed ones: new key u then sits at index lengths + u, the lane
  // of the slot it is written to (the softmax sums by lanes of key index).
  std::vector<int64_t> visible(s.B);
  for (int64_t b = 0; b < s.B; ++b) {
    visible[b] = std::clamp<int64_t>(lengths.typed_data()[b], 0, s.S);
    if (sm == nullptr) continue;
    int64_t hi = visible[b];
    for (int64_t t = 0; t < s.T; ++t)
      for (int64_t j = s.S; j > hi; --j)
        if (sm[(b * s.T + t) * s.S + j - 1]) {
          hi = j;
          break;
        }
    visible[b] = hi;
  }
  auto run = [&](auto tag) {
    using C = decltype(tag);
    auto cast = [](auto& buf) { return static_cast<const C*>(buf.untyped_data()); };
    std::vector<C> q_rot(s.B * s.T * s.Hq * s.D), k_rot(s.B * s.T * s.Hkv * s.D), v_new(k_rot.size());
    auto rotate = s.D == 64 ? split_rotate<4, C> : split_rotate<8, C>;
    rotate(s, cast(qkv), cos.typed_data(), sin.typed_data(), qk_norm ? cast(q_gain) : nullptr,
           qk_norm ? cast(k_gain) : nullptr, eps, q_rot.data(), k_rot.data(), v_new.data());
    const C *qp = q_rot.data(), *kc = cast(k_cache), *vc = cast(v_cache), *kn = k_rot.data(), *vn = v_new.data();
    C* o = static_cast<C*>(out->untyped_data());
    parallel_for(pool, units * chunks, [&](int64_t i) {
      int64_t unit = i / chunks, c = i % chunks;
      int64_t r0 = c * rows_per, r1 = std::min(R, r0 + rows_per);
      if (r0 >= r1) return;
      auto f = s.D == 64 ? attend_rows<4, C> : attend_rows<8, C>;
      const int64_t b = unit / s.Hkv;
      f(s, qp, kc, vc, visible[b], sm, kn, vn, m, o, b, unit % s.Hkv, r0, r1);
    });
    // Then store the new K/V into this layer's slots lengths[b] + t.
    auto* kd = static_cast<C*>(k_out->untyped_data());
    auto* vd = static_cast<C*>(v_out->untyped_data());
    for (int64_t b = 0; b < s.B; ++b)
      for (int64_t t = 0; t < s.T; ++t) {
        const int64_t slot = int64_t(lengths.typed_data()[b]) + t;
        if (slot < 0 || slot >= s.S) continue;
        for (int64_t h = 0; h < s.Hkv; ++h) {
          const size_t dst = (((s.layer * s.Bc + b) * s.Hkv + h) * s.S + slot) * s.D;
          const size_t src = ((b * s.T + t) * s.Hkv + h) * s.D;
          std::memcpy(kd + dst, kn + src, s.D * sizeof(C));
          std::memcpy(vd + dst, vn + src, s.D * sizeof(C));
        }
      }
  };
  if (dt == ffi::F32) run(float{});
  else run(uint16_t{});
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// KV cache writes, in place (the cache operands are aliased to the results)
// ---------------------------------------------------------------------------
//
// XLA:CPU runs a bf16 scatter in f32: it converts the whole cache to f32 and
// back around every write. These copy just the slots that change.

struct CacheGeom {
  int64_t L, B, H, S, D, elem;
  size_t slot(int64_t l, int64_t b, int64_t h, int64_t s) const {
    return ((((l * B + b) * H + h) * S + s) * D) * elem;
  }
};

ffi::Error check_cache(const ffi::AnyBuffer& k, const ffi::AnyBuffer& v, CacheGeom* g) {
  auto d = k.dimensions();
  if (d.size() != 5) return ffi::Error::InvalidArgument("cache must be [L, B, Hkv, S, D]");
  if (k.element_type() != v.element_type() || k.element_count() != v.element_count())
    return ffi::Error::InvalidArgument("k and v caches differ in dtype or shape");
  *g = CacheGeom{d[0], d[1], d[2], d[3], d[4], int64_t(k.size_bytes() / std::max<size_t>(1, k.element_count()))};
  return ffi::Error::Success();
}


// k_new/v_new [L', B, T, Hkv, D] in the cache dtype go to slots lengths[b] + t (past the end: dropped)
// of layers first .. first + L' - 1 of the cache.
ffi::Error CacheWriteImpl(ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::S32> lengths,
                          ffi::Buffer<ffi::S32> first_layer, ffi::AnyBuffer k_new, ffi::AnyBuffer v_new,
                          ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out) {
  CacheGeom g;
  if (auto e = check_cache(k, v, &g); e.failure()) return e;
  auto nd = k_new.dimensions();
  const int64_t first = first_layer.element_count() == 1 ? first_layer.typed_data()[0] : -1;
  if (nd.size() != 5 || first < 0 || first + nd[0] > g.L || nd[1] > g.B || nd[3] != g.H || nd[4] != g.D ||
      k_new.element_type() != k.element_type() || lengths.element_count() != size_t(nd[1]))
    return ffi::Error::InvalidArgument(
        "eagle_cache_write: new K/V must be [L', B, T, Hkv, D] in the cache dtype for layers first .. first + L' - 1 "
        "of the cache, B <= the cache's rows, lengths [B]");
  adopt(k, k_out);
  adopt(v, v_out);
  const int64_t T = nd[2], B = nd[1], L = nd[0];
  const size_t row = g.D * g.elem;
  auto* kd = static_cast<char*>(k_out->untyped_data());
  auto* vd = static_cast<char*>(v_out->untyped_data());
  auto* kn = static_cast<const char*>(k_new.untyped_data());
  auto* vn = static_cast<const char*>(v_new.untyped_data());
  for (int64_t l = 0; l < L; ++l)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t) {
        const int64_t slot = int64_t(lengths.typed_data()[b]) + t;
        if (slot < 0 || slot >= g.S) continue;
        for (int64_t h = 0; h < g.H; ++h) {
          const size_t src = ((((l * B + b) * T + t) * g.H + h) * g.D) * g.elem;
          std::memcpy(kd + g.slot(first + l, b, h, slot), kn + src, row);
          std::memcpy(vd + g.slot(first + l, b, h, slot), vn + src, row);
        }
      }
  return ffi::Error::Success();
}

// For j < n[b]: slot lengths[b] + src[b, j] -> slot lengths[b] + j (an accepted tree path).
ffi::Error CacheCompactImpl(ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::S32> lengths,
                            ffi::Buffer<ffi::S32> src, ffi::Buffer<ffi::S32> n,
                            ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out) {
  CacheGeom g;
  if (auto e = check_cache(k, v, &g); e.failure()) return e;
  auto sd = src.dimensions();
  if (sd.size() != 2 || sd[0] > g.B || lengths.element_count() != size_t(sd[0]) || n.element_count() != size_t(sd[0]))
    return ffi::Error::InvalidArgument("eagle_cache_compact: src must be [B, A], lengths and n [B], B <= the cache's rows");
  adopt(k, k_out);
  adopt(v, v_out);
  const int64_t A = sd[1], B = sd[0];
  const size_t row = g.D * g.elem;
  std::vector<char> tmp(A * row);
  for (char* base : {static_cast<char*>(k_out->untyped_data()), static_cast<char*>(v_out->untyped_data())})
    for (int64_t b = 0; b < B; ++b) {
      const int64_t len = lengths.typed_data()[b];
      const int64_t count = std::clamp<int64_t>(n.typed_data()[b], 0, A);
      for (int64_t l = 0; l < g.L; ++l)
        for (int64_t h = 0; h < g.H; ++h) {
          for (int64_t j = 0; j < count; ++j) {  // read every source before writing any slot
            const int64_t s = std::clamp<int64_t>(len + src.typed_data()[b * A + j], 0, g.S - 1);
            std::memcpy(tmp.data() + j * row, base + g.slot(l, b, h, s), row);
          }
          for (int64_t j = 0; j < count; ++j)
            if (len + j >= 0 && len + j < g.S) std::memcpy(base + g.slot(l, b, h, len + j), tmp.data() + j * row, row);
        }
    }
  return ffi::Error::Success();
}

// out[i] = table[clamp(ids[i], 0, V - 1)], rows copied as bytes.
ffi::Error EmbedImpl(ffi::AnyBuffer table, ffi::Buffer<ffi::S32> ids, ffi::Result<ffi::AnyBuffer> out) {
  auto d = table.dimensions();
  if (d.size() != 2 || d[0] < 1 || out->element_type() != table.element_type() ||
      out->element_count() != ids.element_count() * size_t(d[1]))
    return ffi::Error::InvalidArgument("eagle_embed: table must be [V, H] and out [..., H] in its dtype");
  const size_t row = table.size_bytes() / size_t(d[0]);
  const auto* src = static_cast<const char*>(table.untyped_data());
  auto* dst = static_cast<char*>(out->untyped_data());
  for (size_t i = 0; i < ids.element_count(); ++i) {
    const int64_t id = std::clamp<int64_t>(ids.typed_data()[i], 0, d[0] - 1);
    std::memcpy(dst + i * row, src + id * row, row);
  }
  return ffi::Error::Success();
}

// out[C, R] = x[R, C]^T for 2- or 4-byte elements, in 32 x 32 blocks (each
// block's rows of x and of out span a few cache lines). XLA:CPU folds a
// transpose into the dot that reads it, and its bf16 dot with a transposed
// operand runs as an f32 dot at a quarter of the speed (see
// eagle_jax.kernels.cpu.transpose): a transpose it cannot see stays a copy.
template <typename T>
void transpose_blocks(ffi::ThreadPool& pool, const T* x, T* out, int64_t R, int64_t C) {
  constexpr int64_t kB = 32;
  const int64_t row_blocks = (R + kB - 1) / kB;
  parallel_for(pool, row_blocks, [&](int64_t rb) {
    const int64_t r0 = rb * kB, r1 = std::min(R, r0 + kB);
    for (int64_t c0 = 0; c0 < C; c0 += kB) {
      const int64_t c1 = std::min(C, c0 + kB);
      for (int64_t c = c0; c < c1; ++c)
        for (int64_t r = r0; r < r1; ++r) out[c * R + r] = x[r * C + c];
    }
  });
}

ffi::Error TransposeImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out) {
  auto d = x.dimensions();
  if (d.size() != 2 || out->element_type() != x.element_type() || out->size_bytes() != x.size_bytes())
    return ffi::Error::InvalidArgument("eagle_transpose: x must be [R, C] and out [C, R] in its dtype");
  if (d[0] * d[1] == 0) return ffi::Error::Success();
  const size_t elem = x.size_bytes() / size_t(d[0] * d[1]);
  if (elem != 2 && elem != 4)
    return ffi::Error::InvalidArgument("eagle_transpose: elements must be 2 or 4 bytes");
  if (elem == 2)
    transpose_blocks(pool, static_cast<const uint16_t*>(x.untyped_data()), static_cast<uint16_t*>(out->untyped_data()),
                     d[0], d[1]);
  else
    transpose_blocks(pool, static_cast<const uint32_t*>(x.untyped_data()), static_cast<uint32_t*>(out->untyped_data()),
                     d[0], d[1]);
  return ffi::Error::Success();
}

// out[r] = the first index of row r's maximum; a row holding a NaN gives V - 1
// (as the XLA path, whose max is then NaN and matches no element).
ffi::Error ArgmaxImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Result<ffi::Buffer<ffi::S32>> out) {
  auto d = x.dimensions();
  if (d.size() == 0 || d.back() < 1 || out->element_count() * size_t(d.back()) != x.element_count())
    return ffi::Error::InvalidArgument("eagle_argmax: x must be [..., V] and out [...]");
  const int64_t V = d.back(), rows = int64_t(out->element_count());
  const float* xp = x.typed_data();
  int32_t* op = out->typed_data();
  parallel_for(pool, rows, [&](int64_t r) {
    const float* row = xp + r * V;
    vf vmx = splat(-INFINITY);
    vi nan{};
    int64_t j = 0;
    for (; j + kLanes <= V; j += kLanes) {
      vf v = load(row + j);
      nan |= v != v;
      vmx = v > vmx ? v : vmx;
    }
    float mx = -INFINITY;
    bool has_nan = false;
    for (int l = 0; l < kLanes; ++l) {
      mx = std::max(mx, vmx[l]);
      has_nan |= nan[l] != 0;
    }
    for (int64_t t = j; t < V; ++t) {
      has_nan |= row[t] != row[t];
      mx = std::max(mx, row[t]);
    }
    int64_t first = V - 1;
    if (!has_nan)
      for (int64_t t = 0; t < V; ++t)
        if (row[t] == mx) {
          first = t;
          break;
        }
    op[r] = int32_t(first);
  });
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// Sampling filter thresholds
// ---------------------------------------------------------------------------
//
// Both return, per row, an order key (the float's bits mapped so that
// unsigned order is float order, as eagle_jax.spec.sampling._ordered does);
// the caller keeps the elements whose key is at or above it. Each runs the
// XLA path's bisection over the keys, with the same predicate (top-p's mass
// summed in another order, so a token within rounding of p may go either
// way), every step a vectorised pass over the row's keys, which stay in L2
// between steps: 5-9x faster than XLA:CPU's reductions at the target's
// vocabulary (python -m eagle_jax.benchmarks.filters).

inline uint32_t order_key(float v) {
  uint32_t b;
  std::memcpy(&b, &v, 4);
  return b ^ (uint32_t(int32_t(b) >> 31) | 0x80000000u);
}

// keys[i] = order_key(row[i]) for i < V, padded with 0 (below every key) to a whole vector.
void order_keys(const float* row, int64_t V, std::vector<uint32_t>& keys) {
  keys.assign(size_t((V + kLanes - 1) / kLanes * kLanes), 0u);
  for (int64_t i = 0; i < V; ++i) keys[i] = order_key(row[i]);
}

// The smallest t in (lo, hi] with ok(t), for ok false at lo, true at hi and monotone.
template <typename Ok>
uint32_t bisect(uint32_t lo, uint32_t hi, Ok ok) {
  while (hi - lo > 1) {
    const uint32_t mid = lo + (hi - lo) / 2;
    if (ok(mid)) hi = mid; else lo = mid;
  }
  return hi;
}

// The number of keys >= t (t >= 1: the padding keys are 0).
int64_t count_at_least(const std::vector<uint32_t>& keys, uint32_t t) {
  vi acc{};
  const vu vt = vu{} + t;
  for (size_t i = 0; i < keys.size(); i += kLanes) {
    vu k;
    std::memcpy(&k, keys.data() + i, sizeof(k));
    acc -= (vi)(k >= vt);
  }
  int64_t n = 0;
  for (int l = 0; l < kLanes; ++l) n += acc[l];
  return n;
}

// The mass of the values whose key is > t (padding: keys 0, never above t).
float mass_above(const std::vector<uint32_t>& keys, const float* probs, int64_t V, uint32_t t) {
  vf acc{};
  const vu vt = vu{} + t;
  int64_t i = 0;
  for (; i + kLanes <= V; i += kLanes) {
    vu k;
    std::memcpy(&k, keys.data() + i, sizeof(k));
    acc += (vf)((vi)load(probs + i) & (vi)(k > vt));
  }
  float m = 0.0f;
  for (int l = 0; l < kLanes; ++l) m += acc[l];
  for (; i < V; ++i) m += keys[i] > t ? probs[i] : 0.0f;
  return m;
}

uint32_t max_key(const std::vector<uint32_t>& keys) {
  return *std::max_element(keys.begin(), keys.end());
}

// The key of the k-th largest value of row[0, V), for 1 <= k < V.
uint32_t kth_largest_key(const float* row, int64_t V, int64_t k, std::vector<uint32_t>& keys) {
  order_keys(row, V, keys);
  // One above the k-th largest key: the smallest t with fewer than k keys >= t.
  return bisect(0u, max_key(keys) + 1u, [&](uint32_t t) { return count_at_least(keys, t) < k; }) - 1u;
}

// The key t of the smallest probability kept by top-p: the smallest t whose
// mass above (of the keys > t) is below p; tied values are kept or dropped together.
uint32_t top_p_cut_key(const float* probs, int64_t V, float p, std::vector<uint32_t>& keys) {
  order_keys(probs, V, keys);
  return bisect(order_key(0.0f), max_key(keys), [&](uint32_t t) { return mass_above(keys, probs, V, t) < p; });
}

// out[r] = threshold(row r of x [..., V], V, setting[r], keys) for every row, rows in parallel.
template <typename Setting, typename Threshold>
ffi::Error row_thresholds(ffi::ThreadPool& pool, const ffi::Buffer<ffi::F32>& x, const Setting* setting,
                          size_t settings, ffi::Result<ffi::Buffer<ffi::U32>>& out, const char* shapes_error,
                          Threshold threshold) {
  auto d = x.dimensions();
  if (d.size() == 0 || d.back() < 1 || settings != out->element_count() ||
      out->element_count() * size_t(d.back()) != x.element_count())
    return ffi::Error::InvalidArgument(shapes_error);
  const int64_t V = d.back();
  const float* xp = x.typed_data();
  uint32_t* op = out->typed_data();
  parallel_for(pool, int64_t(out->element_count()), [&](int64_t r) {
    thread_local std::vector<uint32_t> keys;
    op[r] = threshold(xp + r * V, V, setting[r], keys);
  });
  return ffi::Error::Success();
}

// out[r] = the key of row r's k[r]-th largest value; 0 (below every key) where
// k[r] <= 0 or k[r] >= V.
ffi::Error KthLargestImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> k,
                          ffi::Result<ffi::Buffer<ffi::U32>> out) {
  return row_thresholds(pool, x, k.typed_data(), k.element_count(), out,
                        "eagle_kth_largest: x must be [..., V], k and out [...]",
                        [](const float* row, int64_t V, int32_t k, std::vector<uint32_t>& keys) {
                          return (k <= 0 || k >= V) ? 0u : kth_largest_key(row, V, k, keys);
                        });
}

// out[r] = the top-p cut key of row r of probabilities (top_p_cut_key); 0 (keep all) where p[r] >= 1.
ffi::Error TopPCutImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> probs, ffi::Buffer<ffi::F32> p,
                       ffi::Result<ffi::Buffer<ffi::U32>> out) {
  return row_thresholds(pool, probs, p.typed_data(), p.element_count(), out,
                        "eagle_top_p_cut: probs must be [..., V], p and out [...]",
                        [](const float* row, int64_t V, float p, std::vector<uint32_t>& keys) {
                          return p >= 1.0f ? 0u : top_p_cut_key(row, V, p, keys);
                        });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EagleArgmax, ArgmaxImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(EagleTranspose, TransposeImpl,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(EagleEmbed, EmbedImpl,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Arg<ffi::Buffer<ffi::S32>>().Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(EagleMatmul, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("eps")
                                  .Attr<int32_t>("epilogue")
                                  .Attr<int32_t>("segments")
                                  .Attr<int32_t>("amx"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(EagleMatmulInto, MatmulIntoImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("eps")
                                  .Attr<int32_t>("epilogue")
                                  .Attr<int32_t>("segments")
                                  .Attr<int32_t>("amx"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(EagleAttention, AttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("num_heads")
                                  .Attr<int32_t>("qk_norm")
                                  .Attr<float>("eps")
                                  .Attr<int32_t>("slot_masked"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(EagleCacheWrite, CacheWriteImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(EagleCacheCompact, CacheCompactImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(EagleKthLargest, KthLargestImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::U32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(EagleTopPCut, TopPCutImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::U32>>());

// 1 when this process may run bf16 matmuls on AMX tiles (eagle_jax.kernels.cpu.amx()).
extern "C" int EagleAmxAvailable() { return amx_available() ? 1 : 0; }
