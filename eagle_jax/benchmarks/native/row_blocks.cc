// Does a 12-row register tile beat two passes of the 6-row one for the bf16
// matmul of kernels/cpu/eagle_cpu.cc? A stand-alone probe on one core, weights
// streamed from memory (75 MB, SmolLM2-like tiles: K = 576, 64 columns).
//
//   g++ -O3 -march=native -std=c++17 benchmarks/native/row_blocks.cc -o /tmp/row_blocks
//   taskset -c 0 /tmp/row_blocks
//
// Prints the peak rate of VDPBF16PS (registers only), then ms per pass over the
// weights for: 6 rows x 64 columns (one pass), 12 rows as two 6-row passes over
// each tile (the second from L2, as the kernel does), and 12 rows x 32 columns
// over chunks of 64 pair rows with the tile's halves laid out contiguously
// (one pass over memory). Results on the 2-core AMD EPYC are in
// benchmarks/results/analysis.md ("Native CPU kernels, third pass").
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

typedef float vf __attribute__((vector_size(64)));

static vf dot_pairs(vf acc, uint32_t xpair, const uint16_t* wp) {
  __m512i wv = _mm512_loadu_si512(wp);
  return (vf)_mm512_dpbf16_ps((__m512)acc, (__m512bh)_mm512_set1_epi32(int(xpair)), (__m512bh)wv);
}

// Pair rows [i0, i1) of x [MT, K2] against NV vectors of W rows (stride in uint16).
template <int MT, int NV>
__attribute__((noinline)) void tile(const uint32_t* x, const uint16_t* w, float* out, long K2, long i0, long i1,
                                    long stride) {
  vf acc[MT][NV];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NV; ++j) std::memcpy(&acc[m][j], out + m * 64 + 16 * j, 64);
  for (long i = i0; i < i1; ++i) {
    const uint16_t* row = w + (i - i0) * stride;
    for (int m = 0; m < MT; ++m) {
      uint32_t xp = x[m * K2 + i];
      for (int j = 0; j < NV; ++j) acc[m][j] = dot_pairs(acc[m][j], xp, row + 32 * j);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NV; ++j) std::memcpy(out + m * 64 + 16 * j, &acc[m][j], 64);
}

static double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

static void peak() {
  vf a[12] = {};
  __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80);
  const long n = 100000000;
  auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < n; ++i) {
    for (int j = 0; j < 12; ++j) a[j] = (vf)_mm512_dpbf16_ps((__m512)a[j], x, x);
    __asm__ volatile("" : "+v"(x));
  }
  double s = seconds_since(t0);
  float sink = 0;
  for (auto& v : a) sink += v[0];
  std::printf("peak: %.2f G VDPBF16PS/s (%.0f GFLOP/s) [%g]\n", n * 12 / s / 1e9, n * 12 * 64 / s / 1e9, sink);
}

int main() {
  peak();
  const long K2 = 288, tiles = 1024, tile_elems = K2 * 128, chunk = 64;
  std::vector<uint16_t> w(tiles * tile_elems, 0x3f80);
  std::vector<uint32_t> x(12 * K2, 0x3f803f80);
  alignas(64) float out[12 * 64] = {};
  const char* names[] = {"6 rows x 64 cols, one pass", "12 rows as two 6-row passes per tile",
                         "12 rows x 32 cols, chunked contiguous halves"};
  for (int mode = 0; mode < 3; ++mode) {
    double best = 1e9;
    for (int rep = 0; rep < 5; ++rep) {
      auto t0 = std::chrono::steady_clock::now();
      for (long t = 0; t < tiles; ++t) {
        const uint16_t* wt = w.data() + t * tile_elems;
        if (mode == 0) {
          tile<6, 4>(x.data(), wt, out, K2, 0, K2, 128);
        } else if (mode == 1) {
          tile<6, 4>(x.data(), wt, out, K2, 0, K2, 128);
          tile<6, 4>(x.data() + 6 * K2, wt, out, K2, 0, K2, 128);
        } else {
          for (long c = 0; c < K2; c += chunk) {
            const long e = std::min(K2, c + chunk), n = e - c;
            tile<12, 2>(x.data(), wt + c * 128, out, K2, c, e, 64);
            tile<12, 2>(x.data(), wt + c * 128 + n * 64, out, K2, c, e, 64);
          }
        }
      }
      best = std::min(best, seconds_since(t0));
    }
    std::printf("%-46s %.2f ms (%.1f GB/s of weights)\n", names[mode], best * 1e3, tiles * tile_elems * 2 / best / 1e9);
  }
}
