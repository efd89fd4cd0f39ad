// Native CPU kernels for eagle-jax, registered with XLA through jax.ffi.
//
// Decoding on CPU is bound by reading the weights (and, at long contexts, the
// KV cache). XLA:CPU runs a single row through its own GEMV but sends 2..32
// rows to a library GEMM that repacks the weight on every call, so verifying
// k+1 draft tokens costs 1.6-3x a plain step. These kernels stream each weight
// once for all rows of a call, straight from its stored layout:
//
//   eagle_matmul     y[M, N] (f32) = x[M, K] (f32) @ W, W f32 or bf16, stored
//                    [K, N] ("kn") or [N, K] ("nk", e.g. a tied embedding).
//   eagle_attention  grouped-query attention of T new tokens over the
//                    committed slots of one layer of the KV cache, plus the T
//                    new keys under a [T, T] mask; reads only the live slots.
//
// Determinism: every output element is reduced in an order that depends on
// neither M (matmul) nor on whether a key sits in the cache or among the new
// tokens (attention: one sequential pass over the visible keys in order), so
// verifying M tokens gives bit-for-bit the rows of M single-token steps. That
// makes greedy speculative decoding exactly equal to plain decoding.
//
// Portable C++17 with GCC/Clang vector extensions (AVX-512 when the compiler
// targets it, AVX2 or NEON otherwise); work is split over XLA's intra-op
// thread pool, and the calling thread takes whatever tasks the pool has not
// started, so a busy or single-thread pool never blocks a call.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
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

// Runs fn(i) for i in [0, n) on the pool and the calling thread. Tasks claim
// indices from a shared counter; the caller claims too and then waits only
// for indices that were claimed, so tasks the pool never starts cost nothing
// (they find the counter exhausted and touch no buffer).
template <typename F>
void parallel_for(ffi::ThreadPool& pool, int64_t n, F fn) {
  if (n <= 0) return;
  int64_t workers = std::min<int64_t>(pool.num_threads(), n - 1);
  if (workers <= 0) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> finished{0};
  };
  auto state = std::make_shared<State>();
  auto fn_ptr = std::make_shared<F>(fn);
  auto drain = [state, fn_ptr, n]() {
    for (;;) {
      int64_t i = state->next.fetch_add(1);
      if (i >= n) return;
      (*fn_ptr)(i);
      state->finished.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t w = 0; w < workers; ++w) {
    auto task = drain;
    pool.Schedule(std::move(task));
  }
  drain();
  while (state->finished.load(std::memory_order_acquire) < n) {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
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
constexpr int kCols = 64;    // columns per tile (4 vectors)

// f32: acc[m] += x[m, k] * W[k, tile], k in order.
template <int MT>
void tile_f32(const float* x, const float* w, float* out, int64_t K) {
  vf acc[MT][4] = {};
  for (int64_t k = 0; k < K; ++k) {
    const float* row = w + k * kCols;
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
void tile_bf16(const uint32_t* x, const uint16_t* w, float* out, int64_t K2) {
  vf acc[MT][4] = {};
  for (int64_t i = 0; i < K2; ++i) {
    const uint16_t* row = w + i * 2 * kCols;
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
void tile(const X* x, const W* w, float* out, int64_t kx) {
  if constexpr (std::is_same_v<W, float>) tile_f32<MT>(x, w, out, kx);
  else tile_bf16<MT>(x, w, out, kx);
}

// y[:, tile t] for all M rows. kx: the row length of x in X units (K or K/2).
template <typename X, typename W>
void column_tile(const X* x, const W* w, float* y, int64_t M, int64_t kx, int64_t N, int64_t t) {
  const W* wt = w + t * kx * (std::is_same_v<W, float> ? 1 : 2) * kCols;
  const int64_t n0 = t * kCols, width = std::min<int64_t>(kCols, N - n0);
  float buf[kMaxRows * kCols];
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
    const X* xm = x + m0 * kx;
    const int64_t rows = std::min<int64_t>(kMaxRows, M - m0);
    switch (rows) {
      case 1: tile<1>(xm, wt, buf, kx); break;
      case 2: tile<2>(xm, wt, buf, kx); break;
      case 3: tile<3>(xm, wt, buf, kx); break;
      case 4: tile<4>(xm, wt, buf, kx); break;
      case 5: tile<5>(xm, wt, buf, kx); break;
      default: tile<6>(xm, wt, buf, kx); break;
    }
    for (int64_t m = 0; m < rows; ++m)
      std::memcpy(y + (m0 + m) * N + n0, buf + m * kCols, width * sizeof(float));
  }
}

template <typename X, typename W>
void matmul(ffi::ThreadPool& pool, const X* x, const W* w, float* y, int64_t M, int64_t kx, int64_t N) {
  const int64_t tiles = (N + kCols - 1) / kCols;
  // Several tiles per task, so that a task streams >= ~128 KiB of W.
  const int64_t tile_bytes = kx * kCols * sizeof(X);
  const int64_t per_task = std::max<int64_t>(1, (128 << 10) / std::max<int64_t>(1, tile_bytes));
  const int64_t tasks = (tiles + per_task - 1) / per_task;
  parallel_for(pool, tasks, [&](int64_t task) {
    for (int64_t t = task * per_task; t < std::min(tiles, (task + 1) * per_task); ++t)
      column_tile(x, w, y, M, kx, N, t);
  });
}

ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                      ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  auto yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || xd[0] != yd[0])
    return ffi::Error::InvalidArgument("eagle_matmul: x must be [M, K] and y [M, N]");
  const int64_t M = xd[0], N = yd[1], tiles = (N + kCols - 1) / kCols;
  float* out = y->typed_data();
  if (x.element_type() == ffi::F32 && w.element_type() == ffi::F32) {
    const int64_t K = xd[1];
    if (wd.size() != 3 || wd[0] != tiles || wd[1] != K || wd[2] != kCols)
      return ffi::Error::InvalidArgument("eagle_matmul: f32 w must be packed [ceil(N/64), K, 64]");
    matmul(pool, static_cast<const float*>(x.untyped_data()), static_cast<const float*>(w.untyped_data()),
           out, M, K, N);
  } else if (x.element_type() == ffi::BF16 && w.element_type() == ffi::BF16) {
    if (xd[1] % 2) return ffi::Error::InvalidArgument("eagle_matmul: bf16 x needs an even K");
    const int64_t K2 = xd[1] / 2;
    if (wd.size() != 4 || wd[0] != tiles || wd[1] != K2 || wd[2] != kCols || wd[3] != 2)
      return ffi::Error::InvalidArgument("eagle_matmul: bf16 w must be packed [ceil(N/64), K/2, 64, 2]");
    matmul(pool, static_cast<const uint32_t*>(x.untyped_data()),
           static_cast<const uint16_t*>(w.untyped_data()), out, M, K2, N);
  } else {
    return ffi::Error::InvalidArgument("eagle_matmul: x and w must both be float32 or both bfloat16");
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// Attention
// ---------------------------------------------------------------------------

inline float dot64(const float* q, const float* k, int64_t D) {
  vf acc = load(q) * load(k);
  for (int64_t d = kLanes; d < D; d += kLanes) acc += load(q + d) * load(k + d);
  return hsum(acc);
}
inline float dot64(const float* q, const uint16_t* k, int64_t D) {
  vf acc = load(q) * load(k);
  for (int64_t d = kLanes; d < D; d += kLanes) acc += load(q + d) * load(k + d);
  return hsum(acc);
}

template <typename C>
inline void axpy(float p, const C* v, float* acc, int64_t D) {
  vf s = splat(p);
  for (int64_t d = 0; d < D; d += kLanes) store(acc + d, load(acc + d) + s * load(v + d));
}

struct AttnShape {
  int64_t B, T, Hq, Hkv, D, S, G;
  int64_t layer;
  float scale;
};

// One task: query rows [r0, r1) of kv head h in batch row b; a query row r is
// (t = r % T, group member g = r / T), i.e. query head h * G + g.
template <typename C>
void attend_rows(const AttnShape& s, const float* q, const C* kc, const C* vc, const int32_t* lengths,
                 const float* kn, const float* vn, const bool* mask, float* out, int64_t b, int64_t h,
                 int64_t r0, int64_t r1) {
  const int64_t len = std::clamp<int64_t>(lengths[b], 0, s.S);
  const int64_t nk = len + s.T;  // visible-key candidates: cache slots, then new tokens
  const int64_t rows = r1 - r0;
  const int64_t D = s.D;
  const int64_t stride_nk = nk + kLanes;  // room for a padded vector tail
  std::vector<float> scores(rows * stride_nk);
  std::vector<float> acc(rows * D, 0.0f);
  const size_t cache_off = (((s.layer * s.B + b) * s.Hkv + h) * s.S) * D;
  const C* kb = kc + cache_off;
  const C* vb = vc + cache_off;
  auto qrow = [&](int64_t r) {
    int64_t t = r % s.T, g = r / s.T;
    return q + ((b * s.T + t) * s.Hq + h * s.G + g) * D;
  };
  auto new_kv = [&](const float* base, int64_t u) { return base + ((b * s.T + u) * s.Hkv + h) * D; };
  const float neg_inf = -INFINITY;
  // Scores, keys in order; K is read once for all rows.
  for (int64_t j = 0; j < len; ++j)
    for (int64_t r = r0; r < r1; ++r) scores[(r - r0) * stride_nk + j] = dot64(qrow(r), kb + j * D, D) * s.scale;
  for (int64_t u = 0; u < s.T; ++u)
    for (int64_t r = r0; r < r1; ++r) {
      int64_t t = r % s.T;
      bool visible = mask[(b * s.T + t) * s.T + u];
      scores[(r - r0) * stride_nk + len + u] = visible ? dot64(qrow(r), new_kv(kn, u), D) * s.scale : neg_inf;
    }
  // Softmax weights per row: max, exp, sequential sum.
  std::vector<float> denom(rows);
  for (int64_t i = 0; i < rows; ++i) {
    float* sc = scores.data() + i * stride_nk;
    float mx = neg_inf;
    for (int64_t j = 0; j < nk; ++j) mx = std::max(mx, sc[j]);
    if (!std::isfinite(mx)) mx = 0.0f;
    for (int64_t j = nk; j < nk + kLanes; ++j) sc[j] = neg_inf;
    for (int64_t j = 0; j < nk; j += kLanes) store(sc + j, exp_nonpositive(load(sc + j) - mx));
    float sum = 0.0f;
    for (int64_t j = 0; j < nk; ++j) sum += sc[j];
    denom[i] = sum;
  }
  // Weighted values, keys in order; V is read once for all rows.
  for (int64_t j = 0; j < len; ++j)
    for (int64_t i = 0; i < rows; ++i) axpy(scores[i * stride_nk + j], vb + j * D, acc.data() + i * D, D);
  for (int64_t u = 0; u < s.T; ++u)
    for (int64_t i = 0; i < rows; ++i)
      axpy(scores[i * stride_nk + len + u], new_kv(vn, u), acc.data() + i * D, D);
  for (int64_t r = r0; r < r1; ++r) {
    int64_t i = r - r0, t = r % s.T, g = r / s.T;
    float inv = denom[i] > 0.0f ? 1.0f / denom[i] : 0.0f;
    float* o = out + ((b * s.T + t) * s.Hq + h * s.G + g) * D;
    for (int64_t d = 0; d < D; ++d) o[d] = acc[i * D + d] * inv;
  }
}

ffi::Error AttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_cache,
                         ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> layer,
                         ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::F32> k_new,
                         ffi::Buffer<ffi::F32> v_new, ffi::Buffer<ffi::PRED> mask,
                         ffi::ResultBuffer<ffi::F32> out, float scale) {
  auto qd = q.dimensions();
  auto cd = k_cache.dimensions();
  if (qd.size() != 4 || cd.size() != 5)
    return ffi::Error::InvalidArgument("eagle_attention: q must be [B,T,Hq,D], the cache [L,B,Hkv,S,D]");
  AttnShape s{qd[0], qd[1], qd[2], cd[2], qd[3], cd[3], 0, 0, scale};
  if (s.D % kLanes || cd[4] != s.D || cd[1] != s.B || s.Hq % s.Hkv)
    return ffi::Error::InvalidArgument("eagle_attention: head_dim must be a multiple of 16 and shapes agree");
  if (k_cache.element_type() != v_cache.element_type())
    return ffi::Error::InvalidArgument("eagle_attention: k and v caches differ in dtype");
  s.G = s.Hq / s.Hkv;
  s.layer = std::clamp<int64_t>(layer.typed_data()[0], 0, cd[0] - 1);
  const int64_t R = s.G * s.T;
  // Split each (b, h) into row chunks so that both threads have work at batch 1.
  const int64_t units = s.B * s.Hkv;
  const int64_t want = 4 * std::max<int64_t>(1, pool.num_threads());
  const int64_t chunks = std::min<int64_t>(R, std::max<int64_t>(1, (want + units - 1) / units));
  const int64_t rows_per = (R + chunks - 1) / chunks;
  const bool* m = reinterpret_cast<const bool*>(mask.typed_data());
  float* o = out->typed_data();
  auto run = [&](auto* kc, auto* vc) {
    parallel_for(pool, units * chunks, [&](int64_t i) {
      int64_t unit = i / chunks, c = i % chunks;
      int64_t r0 = c * rows_per, r1 = std::min(R, r0 + rows_per);
      if (r0 >= r1) return;
      attend_rows(s, q.typed_data(), kc, vc, lengths.typed_data(), k_new.typed_data(),
                  v_new.typed_data(), m, o, unit / s.Hkv, unit % s.Hkv, r0, r1);
    });
  };
  switch (k_cache.element_type()) {
    case ffi::F32:
      run(static_cast<const float*>(k_cache.untyped_data()), static_cast<const float*>(v_cache.untyped_data()));
      break;
    case ffi::BF16:
      run(static_cast<const uint16_t*>(k_cache.untyped_data()),
          static_cast<const uint16_t*>(v_cache.untyped_data()));
      break;
    default:
      return ffi::Error::InvalidArgument("eagle_attention: the cache must be float32 or bfloat16");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EagleMatmul, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(EagleAttention, AttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));
