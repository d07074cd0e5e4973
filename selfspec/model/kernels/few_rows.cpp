// x @ Wᵀ for a few rows of x (a decode step, a verification of k + 1 positions), streaming W once.
//
// Decoding at batch 1 is bound by reading the weights. MKL's one-row product (sgemv) keeps to one
// core here, and its several-row product (sgemm) repacks W first; this kernel reads each row of W
// once, from both cores (the rows split between the threads of torch's own pool), and multiplies it
// with all m rows of x, which sit in L1 (L2 for the widest, 8 rows of K = 1536 floats). bf16 weights
// widen to fp32 in registers (a 16-bit shift), so a bf16 model reads half the bytes even on CPUs
// without bf16 arithmetic.
//
// Every output is one fp32 dot product of a W row and an x row, accumulated in the same order
// (8-lane FMAs over K, then the lanes, then K's tail) whatever m and whatever the threads' split: a
// position's result never depends on how many positions share the call, so a verification computes
// bit for bit what single steps compute, in bf16 as in fp32.
//
// Built on these: the attention of a few queries (each alone), and a whole Llama-family block for a
// few positions as two calls around the cache write (`block_front`, `block_back`). A decode step of
// SmolLM2 otherwise spends a fifth of its time outside the products: some 60 small tensor operations
// a block and the gaps between its seven product calls. In the block calls the products of q/k/v,
// and of gate/up, share one parallel region, and the small steps are loops over a few rows, rounded
// to the model's dtype wherever torch's operations round. `blocks_pass` runs a range of blocks, and
// their cache writes, in one call.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kMaxRows = 8;
// Rows of x a wide product's tile (`pairs_block`) multiplies at a time, see `products`
constexpr int64_t kTileRows = 4;

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const at::BFloat16* p) {
  // bf16 is the top half of an fp32: widen 8 of them to 32 bits and shift left by 16
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// How far ahead of its reads a product asks for W (into L2): with several rows of x, a 64-byte line of
// W takes longer to use than to fetch, and the hardware's prefetcher alone left the fetches waiting on
// the FMAs instead of running beside them (docs/performance.md, "Prefetching W into L2"). Prefetches
// never change a result.
constexpr int64_t kPrefetchBytes = 4096;
// Below this many rows of x the hardware's prefetcher keeps up, and the prefetches only cost.
constexpr int kPrefetchFromRows = 3;

inline void prefetch_ahead(const float* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T1);
}

// out[r, j] for j in [begin, end): M rows of x (fp32, (M, k)) against W rows [begin, end). Each W row
// is read once, end to end, against all M rows of x (M independent FMA chains). Reading rows one at
// a time, not several side by side, keeps the read a single stream the prefetchers follow (several
// streams at once read slower; docs/performance.md, "Kernel choices").
template <int M, typename T>
void rows_block(const float* x, const T* w, T* out, int64_t n, int64_t k, int64_t begin, int64_t end) {
  const int64_t k8 = k - k % 8;
  for (int64_t j = begin; j < end; ++j) {
    const T* row = w + j * k;
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      if (j + 2 < end) {
        const char* ahead = reinterpret_cast<const char*>(row + 2 * k);
        for (int64_t b = 0; b < k * static_cast<int64_t>(sizeof(T)); b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
      }
    }
    // every loop over the M rows unrolled, so that acc lives in registers (without it GCC kept the
    // array on the stack and stored each accumulator after every FMA)
    __m256 acc[M];
#pragma GCC unroll 8
    for (int r = 0; r < M; ++r) acc[r] = _mm256_setzero_ps();
    int64_t c = 0;
    if constexpr (std::is_same_v<T, float> && M >= kPrefetchFromRows) {
      // two 8-column steps a 64-byte line of W, the line kPrefetchBytes ahead asked for first
      for (; c + 16 <= k8; c += 16) {
        prefetch_ahead(row + c);
        const __m256 w0 = load8(row + c), w1 = load8(row + c + 8);
#pragma GCC unroll 8
        for (int r = 0; r < M; ++r) acc[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * k + c), acc[r]);
#pragma GCC unroll 8
        for (int r = 0; r < M; ++r) acc[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * k + c + 8), acc[r]);
      }
    }
    for (; c < k8; c += 8) {
      const __m256 wv = load8(row + c);
#pragma GCC unroll 8
      for (int r = 0; r < M; ++r) acc[r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + r * k + c), acc[r]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < M; ++r) {
      float total = hsum(acc[r]);
      for (int64_t c = k8; c < k; ++c) total += static_cast<float>(row[c]) * x[r * k + c];
      out[r * n + j] = static_cast<T>(total);
    }
  }
}

// Products of the same x, x @ W_iᵀ -> out_i (m, n_i), as one range of rows split between the threads:
// one parallel region for several weights (a block's q/k/v, its gate/up) instead of one per weight,
// the threads' shares balanced over all of them.
template <typename T>
struct Product {
  const T* w;
  T* out;
  int64_t n;
};

// out[r, j] for j in [begin, end) in pairs of W rows against R rows of x (R <= 4): a tile of 2R
// accumulators, so each 8-column step loads 2 + R vectors for 2R FMAs, where `rows_block` loads 1 + M
// for M. That pays where the W rows come from L1 or L2 (a wide product's tile, see `products`); read
// from L3 or memory the single stream of `rows_block` is faster (docs/performance.md, "Register tiles
// for wide products"). Every output is still `rows_block`'s dot product (8-lane FMAs over K, then the
// lanes, then K's tail), so the same bits.
template <int R, typename T>
void pairs_block(const float* x, const T* w, T* out, int64_t n, int64_t k, int64_t begin, int64_t end) {
  const int64_t k8 = k - k % 8;
  int64_t j = begin;
  for (; j + 2 <= end; j += 2) {
    const T* row0 = w + j * k;
    const T* row1 = row0 + k;
    __m256 acc[2 * R];
#pragma GCC unroll 8
    for (int i = 0; i < 2 * R; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t c = 0; c < k8; c += 8) {
      if constexpr (std::is_same_v<T, float>) {
        if (c % 16 == 0) {  // a line of each W row
          prefetch_ahead(row0 + c);
          prefetch_ahead(row1 + c);
        }
      }
      const __m256 w0 = load8(row0 + c), w1 = load8(row1 + c);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_loadu_ps(x + r * k + c);
        acc[2 * r] = _mm256_fmadd_ps(w0, xv, acc[2 * r]);
        acc[2 * r + 1] = _mm256_fmadd_ps(w1, xv, acc[2 * r + 1]);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      float total0 = hsum(acc[2 * r]), total1 = hsum(acc[2 * r + 1]);
      for (int64_t c = k8; c < k; ++c) {
        total0 += static_cast<float>(row0[c]) * x[r * k + c];
        total1 += static_cast<float>(row1[c]) * x[r * k + c];
      }
      out[r * n + j] = static_cast<T>(total0);
      out[r * n + j + 1] = static_cast<T>(total1);
    }
  }
  if (j < end) rows_block<R, T>(x, w, out, n, k, j, end);
}

// Long W rows (the down projection's K = 1536) against 2-8 rows of x. There m rows of x (fp32 whatever
// W's dtype) no longer sit in L1 beside the W rows streaming past them (5 rows of 1536 floats: 30 KiB
// of a 32 KiB L1), and `rows_block`'s loads of x from L2, not the read of W, set the pace (a
// verification of 5 positions multiplied the down projection at 0.6 of the other weights' rate, in
// bf16 at half of it). So a tile of W rows (contiguous, ~48 KiB) meets x a chunk of kChunk columns
// at a time: the chunk of x (at most 8 × 2 KiB) stays in L1 while each W row's part of the chunk
// streams past it, the accumulators wait in `parked` between chunks, and each 16-column step asks for
// the next tile's next 16 columns' bytes into L2. Each output is still `rows_block`'s dot product (one
// 8-lane accumulator over K in order, then the lanes, then K's tail): the same bits.
constexpr int64_t kChunk = 512;
constexpr int64_t kMaxChunkTile = 16;

template <int M, typename T>
void chunked_block(const float* x, const T* w, T* out, int64_t n, int64_t k, int64_t begin, int64_t end) {
  const int64_t k8 = k - k % 8;
  const int64_t tile = std::clamp<int64_t>((48 << 10) / (k * static_cast<int64_t>(sizeof(T))), 1, kMaxChunkTile);
  alignas(32) float parked[kMaxChunkTile][M][8];
  const char* const stop = reinterpret_cast<const char*>(w + end * k);
  for (int64_t j0 = begin; j0 < end; j0 += tile) {
    const int64_t j1 = std::min(end, j0 + tile);
    const char* next = reinterpret_cast<const char*>(w + j1 * k);
    for (int64_t j = j0; j < j1; ++j) {
#pragma GCC unroll 8
      for (int r = 0; r < M; ++r) _mm256_store_ps(parked[j - j0][r], _mm256_setzero_ps());
    }
    for (int64_t c0 = 0; c0 < k8; c0 += kChunk) {
      const int64_t c1 = std::min(k8, c0 + kChunk);
      for (int64_t j = j0; j < j1; ++j) {
        const T* row = w + j * k;
        // the loop over columns is `rows_block`'s, written out again: shared as an inlined helper taking
        // acc by reference, it measured 0.64-0.82× on passes of 5-8 positions (acc left registers)
        __m256 acc[M];
#pragma GCC unroll 8
        for (int r = 0; r < M; ++r) acc[r] = _mm256_load_ps(parked[j - j0][r]);
        int64_t c = c0;
        for (; c + 16 <= c1; c += 16) {
          if (next < stop) {
            _mm_prefetch(next, _MM_HINT_T1);
            next += 16 * sizeof(T);
          }
          const __m256 w0 = load8(row + c), w1 = load8(row + c + 8);
#pragma GCC unroll 8
          for (int r = 0; r < M; ++r) acc[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * k + c), acc[r]);
#pragma GCC unroll 8
          for (int r = 0; r < M; ++r) acc[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * k + c + 8), acc[r]);
        }
        for (; c < c1; c += 8) {
          const __m256 wv = load8(row + c);
#pragma GCC unroll 8
          for (int r = 0; r < M; ++r) acc[r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + r * k + c), acc[r]);
        }
#pragma GCC unroll 8
        for (int r = 0; r < M; ++r) _mm256_store_ps(parked[j - j0][r], acc[r]);
      }
    }
    for (int64_t j = j0; j < j1; ++j) {
      const T* row = w + j * k;
#pragma GCC unroll 8
      for (int r = 0; r < M; ++r) {
        float total = hsum(_mm256_load_ps(parked[j - j0][r]));
        for (int64_t c = k8; c < k; ++c) total += static_cast<float>(row[c]) * x[r * k + c];
        out[r * n + j] = static_cast<T>(total);
      }
    }
  }
}

// chunked_block for 2..kMaxRows rows of x on product p's W rows [lo, hi).
template <typename T>
void chunked_rows(int64_t m, const float* x, const Product<T>& p, int64_t k, int64_t lo, int64_t hi) {
  switch (m) {
    case 2: return chunked_block<2, T>(x, p.w, p.out, p.n, k, lo, hi);
    case 3: return chunked_block<3, T>(x, p.w, p.out, p.n, k, lo, hi);
    case 4: return chunked_block<4, T>(x, p.w, p.out, p.n, k, lo, hi);
    case 5: return chunked_block<5, T>(x, p.w, p.out, p.n, k, lo, hi);
    case 6: return chunked_block<6, T>(x, p.w, p.out, p.n, k, lo, hi);
    case 7: return chunked_block<7, T>(x, p.w, p.out, p.n, k, lo, hi);
    default: return chunked_block<8, T>(x, p.w, p.out, p.n, k, lo, hi);
  }
}

// rows_block for 1..kMaxRows rows of x on product p's W rows [lo, hi); with `tiles`, pairs_block for
// 1..kTileRows rows.
template <typename T>
void block_rows(int64_t m, const float* x, const Product<T>& p, int64_t k, int64_t lo, int64_t hi, bool tiles) {
  const auto run = [&](auto rows) {
    constexpr int M = decltype(rows)::value;
    if constexpr (M <= kTileRows) {
      if (tiles) return pairs_block<M, T>(x, p.w, p.out, p.n, k, lo, hi);
    }
    return rows_block<M, T>(x, p.w, p.out, p.n, k, lo, hi);
  };
  switch (m) {
    case 1: return run(std::integral_constant<int, 1>{});
    case 2: return run(std::integral_constant<int, 2>{});
    case 3: return run(std::integral_constant<int, 3>{});
    case 4: return run(std::integral_constant<int, 4>{});
    case 5: return run(std::integral_constant<int, 5>{});
    case 6: return run(std::integral_constant<int, 6>{});
    case 7: return run(std::integral_constant<int, 7>{});
    default: return run(std::integral_constant<int, 8>{});
  }
}

// From 5 rows of x, a W row of at least this many bytes (an MLP's down projection, SmolLM2's 1536 floats)
// is multiplied in tiles too: there 5-8 rows are bound by their FMAs, not by reading W, and
// `rows_block`'s M loads of x per W load held them back; on shorter rows (576, 128 floats) the tiles'
// second read of W and their sums cost more (docs/performance.md, "Register tiles for wide products").
constexpr int64_t kLongRowBytes = 4096;

// Products of the same x (m, k), x @ W_iᵀ -> out_i (m, n_i), as one range of W rows split between the
// threads: one parallel region for several weights (a block's q/k/v, its gate/up) instead of one per
// weight, the threads' shares balanced over all of them. More than kMaxRows rows of x (a prefill, a
// wide verification, a server's batch of rounds) meet each tile of a thread's W rows group after group
// of kTileRows while the tile sits in L2 (`pairs_block`), so W streams from memory once whatever m (a
// parallel region per chunk read all of W again for every 8 rows); so do 5-8 rows on W rows of
// kLongRowBytes or more. Each output is still the dot product `rows_block` computes.
template <typename T>
void products(int64_t m, const float* x, const std::vector<Product<T>>& products, int64_t k) {
  int64_t total = 0;
  for (const auto& p : products) total += p.n;
  const int64_t row_bytes = k * static_cast<int64_t>(sizeof(T));
  // Threads split the rows in chunks of at least ~32 KiB of weights: below that, waking a thread costs more
  const int64_t grain = std::max<int64_t>(1, (32 << 10) / row_bytes);
  // 2-8 rows of x whose rows (fp32) take kLongRowBytes or more: `chunked_block`
  const bool chunked = k * static_cast<int64_t>(sizeof(float)) >= kLongRowBytes && m >= 2 && m <= kMaxRows;
  const bool wide = m > kMaxRows || (!chunked && m > kTileRows && row_bytes >= kLongRowBytes);
  // W rows per tile: 64 KiB, a small part of a core's L2, beside the groups of x that pass over it
  const int64_t tile = wide ? std::max<int64_t>(2, (64 << 10) / row_bytes) : total;
  // the rows of x in groups of at most kTileRows, as even as they go (5 = 3 + 2, 9 = 3 + 3 + 3): a
  // group of one row would read the tile again for a single row's FMAs
  const int64_t groups = wide ? (m + kTileRows - 1) / kTileRows : 1;
  at::parallel_for(0, total, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t0 = begin; t0 < end; t0 += tile) {
      const int64_t t1 = std::min(end, t0 + tile);
      for (int64_t g = 0, first = 0; g < groups; ++g) {
        const int64_t rows = m / groups + (g < m % groups ? 1 : 0);
        int64_t offset = 0;  // the first row of the current product in the joint range
        for (const auto& p : products) {
          const int64_t lo = std::max(t0, offset), hi = std::min(t1, offset + p.n);
          if (lo < hi) {
            const Product<T> part{p.w, p.out + first * p.n, p.n};
            if (chunked) {
              chunked_rows<T>(rows, x + first * k, part, k, lo - offset, hi - offset);
            } else {
              block_rows<T>(rows, x + first * k, part, k, lo - offset, hi - offset, wide);
            }
          }
          offset += p.n;
        }
        first += rows;
      }
    }
  });
}

// out[j] = a · b_j for the `count` rows b_j = b + j·n: 8-lane FMAs, then the lanes, then the tail, the
// order `rows_block` uses (b widened exactly). Four rows at a time give the FMA units independent
// chains; each row's sum keeps its own order.
template <typename T>
inline void dots(const float* a, const T* b, int64_t n, int64_t count, float* out) {
  const int64_t n8 = n - n % 8;
  int64_t j = 0;
  for (; j + 4 <= count; j += 4) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t c = 0; c < n8; c += 8) {
      const __m256 av = _mm256_loadu_ps(a + c);
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) acc[r] = _mm256_fmadd_ps(load8(b + (j + r) * n + c), av, acc[r]);
    }
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
      float total = hsum(acc[r]);
      for (int64_t c = n8; c < n; ++c) total += static_cast<float>(b[(j + r) * n + c]) * a[c];
      out[j + r] = total;
    }
  }
  for (; j < count; ++j) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t c = 0; c < n8; c += 8) acc = _mm256_fmadd_ps(load8(b + j * n + c), _mm256_loadu_ps(a + c), acc);
    float total = hsum(acc);
    for (int64_t c = n8; c < n; ++c) total += static_cast<float>(b[j * n + c]) * a[c];
    out[j] = total;
  }
}

// e^x for 8 floats (Cephes' expf: x = n·ln 2 + r, a degree-5 polynomial in r, times 2^n), within
// 2 ulp of expf; 0 exactly below -87.3 (where expf leaves the normal range), so a hidden key (mask
// -inf or the dtype's min) weighs exactly 0. Vectorized because scalar expf made the softmax most of
// the attention's time.
inline __m256 exp8(__m256 x) {
  const __m256 hidden = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_LT_OQ);
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3f)), _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)),
                                   _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln 2 in two parts: r exact
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(hidden, _mm256_mul_ps(y, _mm256_castsi256_ps(two_n)));
}

// A mask value at or below this hides its key: -inf, or the dtype's lowest value (fp32's and bf16's
// are -3.4e38), which the engine's masks use; a visible key's score is never near it.
constexpr float kHiddenKey = -1e38f;

// Attention of one (row, head): m queries, each alone, over S keys, in fp32 throughout. p holds S
// rounded up to 8 floats: the softmax runs in 8 lanes, key j in lane j % 8, the keys past S weighing
// 0, so a query's sums are the same whatever the number of keys hidden after its own.
template <typename T>
void attend_head(const float* q, const T* k, const T* v, const float* mask, T* out, int64_t m, int64_t s_len,
                 int64_t hd, int64_t out_stride, float scale, float* p, float* acc) {
  for (int64_t i = 0; i < m; ++i) {
    const float* qi = q + i * hd;
    const float* mi = mask + i * s_len;
    // The keys hidden after the query's last visible one (a causal prefill's later positions, a
    // cache's free slots) weigh exactly 0 (`exp8`): they are not read, which changes no sum.
    int64_t used = s_len;
    while (used > 1 && mi[used - 1] <= kHiddenKey) --used;
    const int64_t padded = (used + 7) / 8 * 8;
    dots(qi, k, hd, used, p);
    float best = -INFINITY;
    for (int64_t j = 0; j < used; ++j) {
      p[j] = p[j] * scale + mi[j];
      best = std::max(best, p[j]);
    }
    for (int64_t j = used; j < padded; ++j) p[j] = -INFINITY;
    __m256 lanes = _mm256_setzero_ps();
    for (int64_t j = 0; j < padded; j += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + j), _mm256_set1_ps(best)));
      _mm256_storeu_ps(p + j, e);
      lanes = _mm256_add_ps(lanes, e);
    }
    const float total = hsum(lanes);
    // acc[d] = Σ_j p[j]·v[j, d] in key order, one fused multiply-add per key (written out, so that
    // no compiler's choice to contract a product and a sum changes the bits), 64 dims at a time in
    // 8 registers: kept in memory, acc took a load and a store per key and 8 dims
    int64_t d0 = 0;
    for (; d0 + 64 <= hd; d0 += 64) {
      __m256 sums[8];
#pragma GCC unroll 8
      for (int r = 0; r < 8; ++r) sums[r] = _mm256_setzero_ps();
      for (int64_t j = 0; j < used; ++j) {
        const __m256 pj = _mm256_set1_ps(p[j]);
        const T* vj = v + j * hd + d0;
#pragma GCC unroll 8
        for (int r = 0; r < 8; ++r) sums[r] = _mm256_fmadd_ps(pj, load8(vj + 8 * r), sums[r]);
      }
#pragma GCC unroll 8
      for (int r = 0; r < 8; ++r) _mm256_storeu_ps(acc + d0 + 8 * r, sums[r]);
    }
    for (int64_t d = d0; d < hd; ++d) acc[d] = 0.f;
    for (int64_t j = 0; j < used; ++j)
      for (int64_t d = d0; d < hd; ++d) acc[d] = std::fma(p[j], static_cast<float>(v[j * hd + d]), acc[d]);
    for (int64_t d = 0; d < hd; ++d) out[i * out_stride + d] = static_cast<T>(acc[d] / total);
  }
}

}  // namespace

// Scaled dot-product attention for a few queries (a decode step, a verification), every query
// computed alone in a fixed order, so its result never depends on how many queries share the call.
// q (B, H, m, hd) float32 contiguous; k, v (B, Hkv, S, hd) float32 or bfloat16 with contiguous
// (S, hd) slices per (row, head) (a slice of a longer cache is fine); mask (B, m, S) float32
// additive; H a multiple of Hkv (grouped-query heads share keys). Returns (B, m, H·hd) in k's dtype.
torch::Tensor few_queries_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                    const torch::Tensor& mask, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && mask.dim() == 3, "q, k, v 4-d and mask 3-d");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && q.is_contiguous(), "q float32 and contiguous");
  TORCH_CHECK(mask.scalar_type() == torch::kFloat32 && mask.is_contiguous(), "mask float32 and contiguous");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && k.sizes() == v.sizes(), "k and v alike");
  const int64_t batch = q.size(0), heads = q.size(1), m = q.size(2), hd = q.size(3);
  const int64_t kv_heads = k.size(1), s_len = k.size(2);
  TORCH_CHECK(k.size(0) == batch && k.size(3) == hd && heads % kv_heads == 0, "shapes of q and k");
  TORCH_CHECK(mask.size(0) == batch && mask.size(1) == m && mask.size(2) == s_len, "mask (B, m, S)");
  TORCH_CHECK(k.stride(3) == 1 && k.stride(2) == hd && v.stride(3) == 1 && v.stride(2) == hd,
              "k and v with contiguous (S, hd) slices");
  auto out = torch::empty({batch, m, heads * hd}, k.options());
  const int64_t group = heads / kv_heads;
  const float* qp = q.data_ptr<float>();
  const float* mp = mask.data_ptr<float>();
  auto run = [&](auto* kp, auto* vp, auto* op) {
    at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> p((s_len + 7) / 8 * 8), acc(hd);
      for (int64_t bh = begin; bh < end; ++bh) {
        const int64_t b = bh / heads, h = bh % heads, g = h / group;
        attend_head(qp + bh * m * hd, kp + b * k.stride(0) + g * k.stride(1), vp + b * v.stride(0) + g * v.stride(1),
                    mp + b * m * s_len, op + b * m * heads * hd + h * hd, m, s_len, hd, heads * hd,
                    static_cast<float>(scale), p.data(), acc.data());
      }
    });
  };
  if (k.scalar_type() == torch::kFloat32) {
    run(k.data_ptr<float>(), v.data_ptr<float>(), out.data_ptr<float>());
  } else {
    TORCH_CHECK(k.scalar_type() == torch::kBFloat16, "k, v float32 or bfloat16");
    run(k.data_ptr<at::BFloat16>(), v.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>());
  }
  return out;
}

// x (m, K) and weight (N, K): both contiguous, on CPU, float32 or bfloat16 (the same) -> (m, N) in that
// dtype, with fp32 accumulation. More than 8 rows run in chunks of 8 over each tile of W (`products`);
// each row is computed alone either way.
torch::Tensor few_rows_linear(const torch::Tensor& x, const torch::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "shapes (m, K) and (N, K)");
  TORCH_CHECK(x.size(0) >= 1, "at least one row");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "one dtype");
  TORCH_CHECK(weight.size(1) > 0, "K >= 1");
  const int64_t m = x.size(0), n = weight.size(0), k = weight.size(1);
  auto out = torch::empty({m, n}, weight.options());
  // x in fp32, once (m·K floats): every W row meets a chunk's 8 rows in L1 or L2
  const auto xf = x.to(torch::kFloat32).contiguous();
  auto run = [&](const auto* w, auto* o) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(w)>>;
    products<T>(m, xf.data_ptr<float>(), {{w, o, n}}, k);
  };
  if (weight.scalar_type() == torch::kFloat32) {
    run(weight.data_ptr<float>(), out.data_ptr<float>());
  } else {
    TORCH_CHECK(weight.scalar_type() == torch::kBFloat16, "float32 or bfloat16");
    run(weight.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>());
  }
  return out;
}

namespace {

// A value as the dtype T holds it (bf16: rounded to nearest even, as torch rounds), back in fp32.
template <typename T>
inline float held(float x) { return static_cast<float>(static_cast<T>(x)); }

// fn(begin, end) over the rows [0, m) of a block's small steps (norms, rotary, residuals, SwiGLU): in
// the calling thread up to kSerialRows rows (a decode step, a verification: waking the other thread
// costs more than the loop), split between the threads beyond (a prefill, where one thread's loops left
// the other waiting). Each row is computed alike either way.
constexpr int64_t kSerialRows = 16;

template <typename F>
void over_rows(int64_t m, const F& fn) {
  at::parallel_for(0, m, kSerialRows, fn);
}

// Hugging Face's RMSNorm of one row, op for op: statistics in fp32, the normalised row rounded to T,
// then scaled by the weight in T. `x` holds values of T; `out` gets values of T.
template <typename T>
void rms_norm_row(const float* x, const T* weight, float eps, float* out, int64_t d) {
  float squares = 0.f;
  for (int64_t i = 0; i < d; ++i) squares += x[i] * x[i];
  const float inv = 1.f / std::sqrt(squares / static_cast<float>(d) + eps);
  for (int64_t i = 0; i < d; ++i) out[i] = held<T>(static_cast<float>(weight[i]) * held<T>(x[i] * inv));
}

// x (m, K) fp32 holding values of T -> outs[i] (m, N_i) fp32 holding values of T: x @ W_iᵀ (+ bias_i,
// added in T after the product is rounded, as `fast.linear` adds it) for every weight W_i (all K wide),
// in one parallel region (`products`).
template <typename T>
void linear_rows(const float* x, const std::vector<const torch::Tensor*>& weights,
                 const std::vector<const c10::optional<torch::Tensor>*>& biases, const std::vector<float*>& outs,
                 int64_t m) {
  const int64_t k = weights[0]->size(1);
  std::vector<std::unique_ptr<T[]>> results;  // (m, N_i) each, written before read: not zeroed
  std::vector<Product<T>> jobs;
  for (const auto* weight : weights) {
    results.emplace_back(new T[m * weight->size(0)]);
    jobs.push_back({weight->data_ptr<T>(), results.back().get(), weight->size(0)});
  }
  products<T>(m, x, jobs, k);
  over_rows(m, [&](int64_t begin, int64_t end) {
    for (size_t i = 0; i < weights.size(); ++i) {
      const int64_t n = weights[i]->size(0);
      const T* b = biases[i]->has_value() ? (*biases[i])->data_ptr<T>() : nullptr;
      for (int64_t r = begin; r < end; ++r)
        for (int64_t j = 0; j < n; ++j) {
          const float value = static_cast<float>(results[i][r * n + j]);
          outs[i][r * n + j] = b ? held<T>(value + static_cast<float>(b[j])) : value;
        }
    }
  });
}

// Rotary embedding of one head's vector x (hd values of T), as `fast.apply_rotary` computes it in T:
// x·cos and rotate_half(x)·sin each rounded, then their sum.
template <typename T>
void rotate(const float* x, const T* cos, const T* sin, float* out, int64_t hd) {
  const int64_t half = hd / 2;
  for (int64_t i = 0; i < hd; ++i) {
    const float turned = i < half ? -x[i + half] : x[i - half];
    out[i] = held<T>(held<T>(x[i] * static_cast<float>(cos[i])) + held<T>(turned * static_cast<float>(sin[i])));
  }
}

template <typename T>
std::vector<float> widen(const torch::Tensor& t) {
  const T* p = t.data_ptr<T>();
  return std::vector<float>(p, p + t.numel());
}

// The cache's key and value buffers of one block (B, Hkv, capacity, hd), (S, hd) slices contiguous, and
// each row's first slot: where `front` writes a pass's keys and values itself (`blocks_pass`).
struct CacheSlots {
  const torch::Tensor& keys;
  const torch::Tensor& values;
  const std::vector<int64_t>& firsts;
};

template <typename T>
std::vector<torch::Tensor> front(const torch::Tensor& hidden, const torch::Tensor& norm, double eps,
                                 const torch::Tensor& wq, const c10::optional<torch::Tensor>& bq,
                                 const torch::Tensor& wk, const c10::optional<torch::Tensor>& bk,
                                 const torch::Tensor& wv, const c10::optional<torch::Tensor>& bv,
                                 const c10::optional<torch::Tensor>& q_norm, double q_eps,
                                 const c10::optional<torch::Tensor>& k_norm, double k_eps, const torch::Tensor& cos,
                                 const torch::Tensor& sin, int64_t hd, const CacheSlots* cache = nullptr) {
  const int64_t batch = hidden.size(0), length = hidden.size(1), d = hidden.size(2), m = batch * length;
  const int64_t heads = wq.size(0) / hd, kv_heads = wk.size(0) / hd;
  const std::vector<float> h = widen<T>(hidden);
  std::vector<float> x(m * d), q(m * heads * hd), k(m * kv_heads * hd), v(m * kv_heads * hd);
  over_rows(m, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      rms_norm_row<T>(h.data() + r * d, norm.data_ptr<T>(), eps, x.data() + r * d, d);
  });
  linear_rows<T>(x.data(), {&wq, &wk, &wv}, {&bq, &bk, &bv}, {q.data(), k.data(), v.data()}, m);
  auto q_out = torch::empty({batch, heads, length, hd}, hidden.options().dtype(torch::kFloat32));
  // keys and values straight into the cache's slots where given (the same values a copy would write,
  // without two tensors and two copy operations a block), else into tensors (B, Hkv, T, hd) returned
  torch::Tensor k_out, v_out;
  if (!cache) {
    k_out = torch::empty({batch, kv_heads, length, hd}, hidden.options());
    v_out = torch::empty({batch, kv_heads, length, hd}, hidden.options());
  }
  const auto slot = [&](int64_t b, int64_t head, int64_t t) -> int64_t {  // a (row, head, position)'s offset
    if (!cache) return ((b * kv_heads + head) * length + t) * hd;
    return b * cache->keys.stride(0) + head * cache->keys.stride(1) + (cache->firsts[b] + t) * hd;
  };
  float* qp = q_out.data_ptr<float>();
  T* kp = cache ? cache->keys.data_ptr<T>() : k_out.data_ptr<T>();
  T* vp = cache ? cache->values.data_ptr<T>() : v_out.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  over_rows(m, [&](int64_t begin, int64_t end) {
    std::vector<float> row(hd);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t b = r / length, t = r % length;
      for (int64_t head = 0; head < heads; ++head) {
        float* x_head = q.data() + (r * heads + head) * hd;
        if (q_norm.has_value()) rms_norm_row<T>(x_head, q_norm->data_ptr<T>(), q_eps, x_head, hd);
        rotate<T>(x_head, cp + r * hd, sp + r * hd, qp + ((b * heads + head) * length + t) * hd, hd);
      }
      for (int64_t head = 0; head < kv_heads; ++head) {
        float* k_head = k.data() + (r * kv_heads + head) * hd;
        if (k_norm.has_value()) rms_norm_row<T>(k_head, k_norm->data_ptr<T>(), k_eps, k_head, hd);
        rotate<T>(k_head, cp + r * hd, sp + r * hd, row.data(), hd);
        const int64_t at = slot(b, head, t);
        const float* v_head = v.data() + (r * kv_heads + head) * hd;
        for (int64_t i = 0; i < hd; ++i) {
          kp[at + i] = static_cast<T>(row[i]);
          vp[at + i] = static_cast<T>(v_head[i]);
        }
      }
    }
  });
  if (cache) return {q_out};
  return {q_out, k_out, v_out};
}

template <typename T>
torch::Tensor back(const torch::Tensor& hidden, const torch::Tensor& q, const torch::Tensor& keys,
                   const torch::Tensor& values, const c10::optional<torch::Tensor>& mask, double scale,
                   const torch::Tensor& wo, const c10::optional<torch::Tensor>& bo, const torch::Tensor& norm,
                   double eps, const torch::Tensor& w_gate, const c10::optional<torch::Tensor>& b_gate,
                   const torch::Tensor& w_up, const c10::optional<torch::Tensor>& b_up,
                   const torch::Tensor& w_down, const c10::optional<torch::Tensor>& b_down) {
  const int64_t batch = hidden.size(0), length = hidden.size(1), d = hidden.size(2), m = batch * length;
  const int64_t s_len = keys.size(2);
  // The additive mask in fp32, (B, T, S); none: every query sees every key
  auto additive = mask.has_value() ? mask->to(torch::kFloat32).contiguous()
                                   : torch::zeros({batch, length, s_len}, q.options());
  const torch::Tensor attended = few_queries_attention(q, keys, values, additive, scale);  // (B, T, H·hd) in T
  const std::vector<float> a = widen<T>(attended);
  std::vector<float> h = widen<T>(hidden);
  const int64_t inner = w_gate.size(0);
  std::vector<float> o(m * d), x(m * d), gate(m * inner), up(m * inner), down(m * d);
  linear_rows<T>(a.data(), {&wo}, {&bo}, {o.data()}, m);
  over_rows(m, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin * d; i < end * d; ++i) h[i] = held<T>(h[i] + o[i]);  // the residual, in T
    for (int64_t r = begin; r < end; ++r)
      rms_norm_row<T>(h.data() + r * d, norm.data_ptr<T>(), eps, x.data() + r * d, d);
  });
  linear_rows<T>(x.data(), {&w_gate, &w_up}, {&b_gate, &b_up}, {gate.data(), up.data()}, m);
  // SwiGLU: silu(gate) = gate / (1 + e^-gate) rounded, times up, rounded. The exp in 8 lanes (`exp8`),
  // which a block's back half with scalar expf spent a tenth of its time on; row by row, so that which
  // values take the scalar tail depends on the row's width alone, not on how many rows share the call.
  const int64_t inner8 = inner - inner % 8;
  over_rows(m, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* g_row = gate.data() + r * inner;
      const float* u_row = up.data() + r * inner;
      for (int64_t i = 0; i < inner8; i += 8) {
        const __m256 g = _mm256_loadu_ps(g_row + i);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
        _mm256_storeu_ps(g_row + i, _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e)));
      }
      for (int64_t i = inner8; i < inner; ++i) g_row[i] = g_row[i] / (1.f + std::exp(-g_row[i]));
      for (int64_t i = 0; i < inner; ++i) g_row[i] = held<T>(held<T>(g_row[i]) * u_row[i]);
    }
  });
  linear_rows<T>(gate.data(), {&w_down}, {&b_down}, {down.data()}, m);
  auto out = torch::empty_like(hidden);
  T* op = out.data_ptr<T>();
  over_rows(m, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin * d; i < end * d; ++i) op[i] = static_cast<T>(h[i] + down[i]);
  });
  return out;
}

}  // namespace

// The attention half's inputs of one Llama-family block for a few positions (a decode step, a
// verification): RMSNorm, the q/k/v products (+ biases, + Qwen3's per-head norms) and the rotary
// embedding, in the dtype of `hidden` (fp32 or bf16), every row computed alone. hidden (B, T, D) and
// cos, sin (B, T, hd) contiguous; returns q (B, H, T, hd) fp32 (holding values of the dtype, as the
// attention takes them), k and v (B, Hkv, T, hd) in the dtype, for the cache.
// With `cache`, the keys and values go straight into its slots and only q is returned (`blocks_pass`).
std::vector<torch::Tensor> checked_front(const torch::Tensor& hidden, const torch::Tensor& norm, double eps,
                                         const torch::Tensor& wq, const c10::optional<torch::Tensor>& bq,
                                         const torch::Tensor& wk, const c10::optional<torch::Tensor>& bk,
                                         const torch::Tensor& wv, const c10::optional<torch::Tensor>& bv,
                                         const c10::optional<torch::Tensor>& q_norm, double q_eps,
                                         const c10::optional<torch::Tensor>& k_norm, double k_eps,
                                         const torch::Tensor& cos, const torch::Tensor& sin, int64_t head_dim,
                                         const CacheSlots* cache) {
  TORCH_CHECK(hidden.dim() == 3 && hidden.is_contiguous() && cos.is_contiguous() && sin.is_contiguous(),
              "hidden (B, T, D), cos and sin (B, T, hd), contiguous");
  const int64_t d = hidden.size(2);
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0 && wq.size(0) % head_dim == 0 && wk.size(0) % head_dim == 0,
              "q and k widths in whole heads of an even head_dim");
  TORCH_CHECK((wq.size(0) / head_dim) % (wk.size(0) / head_dim) == 0, "query heads a multiple of key heads");
  TORCH_CHECK(wq.size(1) == d && wk.size(1) == d && wv.sizes() == wk.sizes() && norm.numel() == d,
              "q/k/v weights (N, D), v like k, norm (D)");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 3 && cos.size(0) == hidden.size(0) &&
              cos.size(1) == hidden.size(1) && cos.size(2) == head_dim, "cos and sin (B, T, head_dim)");
  for (const auto* norm_i : {&q_norm, &k_norm})
    TORCH_CHECK(!norm_i->has_value() || (*norm_i)->numel() == head_dim, "q/k norms (head_dim)");
  for (const auto& [bias, weight] : {std::pair{&bq, &wq}, std::pair{&bk, &wk}, std::pair{&bv, &wv}})
    TORCH_CHECK(!bias->has_value() || (*bias)->numel() == weight->size(0), "a bias per output");
  if (hidden.scalar_type() == torch::kFloat32)
    return front<float>(hidden, norm, eps, wq, bq, wk, bk, wv, bv, q_norm, q_eps, k_norm, k_eps, cos, sin, head_dim,
                        cache);
  TORCH_CHECK(hidden.scalar_type() == torch::kBFloat16, "float32 or bfloat16");
  return front<at::BFloat16>(hidden, norm, eps, wq, bq, wk, bk, wv, bv, q_norm, q_eps, k_norm, k_eps, cos, sin,
                             head_dim, cache);
}

// `checked_front` returning q, k and v for the caller's cache write (the block-by-block path from Python).
std::vector<torch::Tensor> block_front(const torch::Tensor& hidden, const torch::Tensor& norm, double eps,
                                       const torch::Tensor& wq, const c10::optional<torch::Tensor>& bq,
                                       const torch::Tensor& wk, const c10::optional<torch::Tensor>& bk,
                                       const torch::Tensor& wv, const c10::optional<torch::Tensor>& bv,
                                       const c10::optional<torch::Tensor>& q_norm, double q_eps,
                                       const c10::optional<torch::Tensor>& k_norm, double k_eps,
                                       const torch::Tensor& cos, const torch::Tensor& sin, int64_t head_dim) {
  return checked_front(hidden, norm, eps, wq, bq, wk, bk, wv, bv, q_norm, q_eps, k_norm, k_eps, cos, sin, head_dim,
                       nullptr);
}

// The rest of the block after the cache write: attention of q over keys/values (B, Hkv, S, hd) with an
// additive mask (B, T, S) or none, the o product, the residual, RMSNorm, the SwiGLU MLP and its
// residual. Returns the block's output (B, T, D) in hidden's dtype.
torch::Tensor block_back(const torch::Tensor& hidden, const torch::Tensor& q, const torch::Tensor& keys,
                         const torch::Tensor& values, const c10::optional<torch::Tensor>& mask, double scale,
                         const torch::Tensor& wo, const c10::optional<torch::Tensor>& bo, const torch::Tensor& norm,
                         double eps, const torch::Tensor& w_gate, const c10::optional<torch::Tensor>& b_gate,
                         const torch::Tensor& w_up, const c10::optional<torch::Tensor>& b_up,
                         const torch::Tensor& w_down, const c10::optional<torch::Tensor>& b_down) {
  TORCH_CHECK(hidden.dim() == 3 && hidden.is_contiguous(), "hidden (B, T, D) contiguous");
  const int64_t d = hidden.size(2);
  TORCH_CHECK(q.dim() == 4 && q.size(0) == hidden.size(0) && q.size(2) == hidden.size(1) &&
              wo.size(1) == q.size(1) * q.size(3) && wo.size(0) == d && norm.numel() == d,
              "q (B, H, T, hd), o (D, H·hd), norm (D)");
  TORCH_CHECK(w_gate.size(1) == d && w_up.sizes() == w_gate.sizes() && w_down.size(0) == d &&
              w_down.size(1) == w_gate.size(0), "gate and up (F, D), down (D, F)");
  for (const auto& [bias, weight] : {std::pair{&bo, &wo}, std::pair{&b_gate, &w_gate}, std::pair{&b_up, &w_up},
                                     std::pair{&b_down, &w_down}})
    TORCH_CHECK(!bias->has_value() || (*bias)->numel() == weight->size(0), "a bias per output");
  if (hidden.scalar_type() == torch::kFloat32)
    return back<float>(hidden, q, keys, values, mask, scale, wo, bo, norm, eps, w_gate, b_gate, w_up, b_up,
                       w_down, b_down);
  TORCH_CHECK(hidden.scalar_type() == torch::kBFloat16, "float32 or bfloat16");
  return back<at::BFloat16>(hidden, q, keys, values, mask, scale, wo, bo, norm, eps, w_gate, b_gate, w_up, b_up,
                            w_down, b_down);
}

// The tensors and constants of one Llama-family block, gathered once for `blocks_pass` (by
// `fast.FastLlamaBlocks`). The tensors are the modules' own: in-place updates stay visible.
struct Block {
  torch::Tensor norm1;
  double eps1;
  torch::Tensor wq;
  c10::optional<torch::Tensor> bq;
  torch::Tensor wk;
  c10::optional<torch::Tensor> bk;
  torch::Tensor wv;
  c10::optional<torch::Tensor> bv;
  c10::optional<torch::Tensor> q_norm;
  double q_eps;
  c10::optional<torch::Tensor> k_norm;
  double k_eps;
  int64_t head_dim;
  double scale;
  torch::Tensor wo;
  c10::optional<torch::Tensor> bo;
  torch::Tensor norm2;
  double eps2;
  torch::Tensor w_gate;
  c10::optional<torch::Tensor> b_gate;
  torch::Tensor w_up;
  c10::optional<torch::Tensor> b_up;
  torch::Tensor w_down;
  c10::optional<torch::Tensor> b_down;

  // Every tensor on the CPU, contiguous, in `dtype`: what the block halves read
  bool usable(at::ScalarType dtype) const {
    for (const auto* t : {&norm1, &wq, &wk, &wv, &wo, &norm2, &w_gate, &w_up, &w_down})
      if (!t->device().is_cpu() || t->scalar_type() != dtype || !t->is_contiguous()) return false;
    for (const auto* t : {&bq, &bk, &bv, &q_norm, &k_norm, &bo, &b_gate, &b_up, &b_down})
      if (t->has_value() && (!(*t)->device().is_cpu() || (*t)->scalar_type() != dtype || !(*t)->is_contiguous()))
        return false;
    return true;
  }
};

// Each row's first slot: row_starts (B,) int64 where rows sit at different slots, else `start` for all.
// An empty vector where a row's T writes would not fit below kv_length.
std::vector<int64_t> first_slots(int64_t batch, int64_t length, int64_t start, int64_t kv_length,
                                 const c10::optional<torch::Tensor>& row_starts) {
  std::vector<int64_t> firsts(batch, start);
  if (row_starts.has_value()) {
    TORCH_CHECK(row_starts->dim() == 1 && row_starts->size(0) == batch && row_starts->scalar_type() == torch::kLong &&
                row_starts->device().is_cpu(), "row_starts (B,) int64 on the CPU");
    const auto held = row_starts->contiguous();
    std::copy(held.data_ptr<int64_t>(), held.data_ptr<int64_t>() + batch, firsts.begin());
  }
  for (const int64_t first : firsts)
    if (first < 0 || first + length > kv_length) return {};
  return firsts;
}

// Additive mask (B, T, S) of rows whose T queries sit at slots first_b .. first_b + T - 1: query t of
// row b sees slots 0 .. first_b + t, `mask_value` beyond (as the engine's mask: its dtype's lowest).
torch::Tensor causal_mask(const std::vector<int64_t>& firsts, int64_t length, int64_t slots, double mask_value) {
  const auto options = torch::TensorOptions().dtype(torch::kLong);
  const auto lasts = torch::tensor(firsts, options).unsqueeze(1) + torch::arange(length, options).unsqueeze(0);
  return torch::zeros({static_cast<int64_t>(firsts.size()), length, slots}, torch::kFloat32)
      .masked_fill_(torch::arange(slots, options).view({1, 1, slots}) > lasts.unsqueeze(2), mask_value);
}

// Whether every block's tensors and its key and value buffers (B, Hkv, >= kv_length, hd) suit the kernels
// in `dtype` for a batch of `batch` rows.
bool blocks_fit(const std::vector<const Block*>& blocks, const std::vector<torch::Tensor>& keys,
                const std::vector<torch::Tensor>& values, int64_t batch, int64_t kv_length, at::ScalarType dtype) {
  for (size_t i = 0; i < blocks.size(); ++i) {
    const Block& b = *blocks[i];
    const torch::Tensor &k = keys[i], &v = values[i];
    if (!b.usable(dtype) || k.dim() != 4 || !k.device().is_cpu() || k.scalar_type() != dtype ||
        k.size(0) != batch || k.size(1) * b.head_dim != b.wk.size(0) || k.size(2) < kv_length ||
        k.size(3) != b.head_dim || k.stride(3) != 1 || k.stride(2) != b.head_dim || v.sizes() != k.sizes() ||
        v.strides() != k.strides() || v.scalar_type() != dtype || !v.device().is_cpu())
      return false;
  }
  return true;
}

// Blocks [first, last) of a decoding pass in one call: for each, `block_front` writing its keys and values
// straight into the cache's slots (`checked_front`), then `block_back`. hidden (B, T, D); keys[i], values[i]
// the cache's buffers of block i (B, Hkv, capacity, hd), the T new positions written at slots start .. start
// + T - 1 (row b at row_starts[b] .. when rows sit at different slots: then a mask is needed) and slots 0 ..
// kv_length - 1 attended (with `mask` (B, T, kv_length), additive; none: every slot); cos, sin (B, T, hd).
// The same calls as block by block, so the same bits; it saves the Python between blocks (checks, the cache's
// update, argument passing), a sizeable share of a small model's step (docs/performance.md). None, computing
// nothing, where a block's tensors or a buffer do not fit the kernels (the caller then runs block by block).
c10::optional<torch::Tensor> blocks_pass(const std::vector<const Block*>& blocks, torch::Tensor hidden,
                                         const std::vector<torch::Tensor>& keys,
                                         const std::vector<torch::Tensor>& values, int64_t start,
                                         int64_t kv_length, const c10::optional<torch::Tensor>& mask,
                                         const torch::Tensor& cos, const torch::Tensor& sin,
                                         const c10::optional<torch::Tensor>& row_starts) {
  TORCH_CHECK(keys.size() == blocks.size() && values.size() == blocks.size(), "a key and a value buffer a block");
  TORCH_CHECK(hidden.dim() == 3, "hidden (B, T, D)");
  const auto dtype = hidden.scalar_type();
  const int64_t batch = hidden.size(0), length = hidden.size(1);
  if (!hidden.device().is_cpu() || (dtype != torch::kFloat32 && dtype != torch::kBFloat16)) return c10::nullopt;
  const auto firsts = first_slots(batch, length, start, kv_length, row_starts);
  if (firsts.empty() || (row_starts.has_value() && !mask.has_value())) return c10::nullopt;
  if (!blocks_fit(blocks, keys, values, batch, kv_length, dtype)) return c10::nullopt;
  // the additive mask in fp32 once for all blocks (each block's half would convert it again)
  const torch::Tensor additive = mask.has_value() ? mask->to(torch::kFloat32).contiguous()
                                                  : torch::zeros({batch, length, kv_length},
                                                                 hidden.options().dtype(torch::kFloat32));
  hidden = hidden.contiguous();
  for (size_t i = 0; i < blocks.size(); ++i) {
    const Block& b = *blocks[i];
    const CacheSlots slots{keys[i], values[i], firsts};  // each row at its first slot (all at `start` aligned)
    const auto qkv = checked_front(hidden, b.norm1, b.eps1, b.wq, b.bq, b.wk, b.bk, b.wv, b.bv, b.q_norm, b.q_eps,
                                   b.k_norm, b.k_eps, cos, sin, b.head_dim, &slots);
    hidden = block_back(hidden, qkv[0], keys[i].narrow(2, 0, kv_length), values[i].narrow(2, 0, kv_length),
                        additive, b.scale, b.wo, b.bo, b.norm2, b.eps2, b.w_gate, b.b_gate, b.w_up, b.b_up,
                        b.w_down, b.b_down);
  }
  return hidden;
}

// The final norm of states h (n, D) op for op as `fast.rms_norm` (statistics in fp32, scaled in h's
// dtype): what the head multiplies.
torch::Tensor final_norm(const torch::Tensor& h, const torch::Tensor& norm, double eps) {
  auto x = h.to(torch::kFloat32);
  x = x * torch::rsqrt(x.pow(2).mean(-1, true) + eps);
  return (norm * x.to(h.scalar_type())).contiguous();
}

// The target's logits on states h (n, D): the final norm (`final_norm`) and the LM head's product
// (`few_rows_linear`, + bias), the same operations as the engine's Python head (`fast.FastLlamaBlocks
// .exit_logits`), so the same bits: plain decoding and every verification choose alike on either path.
torch::Tensor head_logits(const torch::Tensor& h, const torch::Tensor& norm, double eps, const torch::Tensor& head,
                          const c10::optional<torch::Tensor>& bias) {
  auto logits = few_rows_linear(final_norm(h, norm, eps), head);
  return bias.has_value() ? logits + *bias : logits;
}

// The greedy draft of each row of exit states h (B, D), in one pass over the draft head and no tensor
// operations: the final norm (`rms_norm_row`), the head's logits (`rows_block`'s dot products, rounded
// to the dtype, + bias in the dtype), a grammar's mask `allowed` (B, V) bool where given (refused
// tokens out; a row whose allowed tokens are all outside a trimmed head's ids falls back, as
// `apply_allowed` makes it, to the uniform distribution over the allowed tokens), and the first maximum
// by token id (argmax over the whole vocabulary, -inf outside the ids), instead of some twenty tensor
// operations (the norm's, the scatter into the whole vocabulary, softmax, max, argmax), each
// dispatched and allocated apart. `top` gets each row's probability of its draft (the softmax of its
// allowed logits at the maximum, 1 / Σ exp(l - max), summed in fp32): what η compares. The norm's and
// the sum's orders are not torch's, so every path that drafts greedily chooses with this function
// (`FastLlamaBlocks.draft_choice` for the step from Python), and they all draft alike.
template <typename T>
void choose_drafts(const T* h, int64_t batch, int64_t d, const T* norm, float eps, const T* head, const T* bias,
                   const int64_t* ids, int64_t rows, int64_t vocab, const bool* allowed, int64_t* token,
                   float* top) {
  std::vector<float> normed(batch * d), row(d);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < d; ++i) row[i] = static_cast<float>(h[b * d + i]);
    rms_norm_row<T>(row.data(), norm, eps, normed.data() + b * d, d);
  }
  std::unique_ptr<T[]> logits(new T[batch * rows]);  // (B, V'), written before read
  products<T>(batch, normed.data(), {{head, logits.get(), rows}}, d);
  constexpr float kNone = -std::numeric_limits<float>::infinity();
  std::vector<float> values((rows + 7) / 8 * 8, kNone);  // one row's logits, refused ones -inf, 8-lane padded
  for (int64_t b = 0; b < batch; ++b) {
    const bool* allow = allowed ? allowed + b * vocab : nullptr;
    int64_t choice = -1;
    float best = kNone;
    for (int64_t j = 0; j < rows; ++j) {
      const int64_t id = ids ? ids[j] : j;
      if (allow && !allow[id]) {
        values[j] = kNone;
        continue;
      }
      float v = static_cast<float>(logits[b * rows + j]);
      if (bias) v = held<T>(v + static_cast<float>(bias[j]));
      values[j] = v;
      // argmax's choice: the first NaN, else the first maximum, first by token id (a trimmed head's
      // rows are in frequency order)
      const bool better = std::isnan(best) ? std::isnan(v) && id < choice
                                           : std::isnan(v) || v > best || (v == best && v > kNone && id < choice);
      if (choice < 0 ? v > kNone || std::isnan(v) : better) {
        best = v;
        choice = id;
      }
    }
    if (choice < 0) {  // nothing finite: uniform over the allowed tokens (every token without a mask)
      int64_t count = 0;
      for (int64_t id = vocab - 1; id >= 0; --id)
        if (!allow || allow[id]) {
          choice = id;
          ++count;
        }
      token[b] = std::max<int64_t>(choice, 0);
      if (top) top[b] = count ? 1.f / static_cast<float>(count) : 0.f;
      continue;
    }
    token[b] = choice;
    if (!top) continue;
    if (std::isnan(best)) {
      top[b] = best;
      continue;
    }
    __m256 sum = _mm256_setzero_ps();  // Σ exp(l - max) in 8 lanes; refused and padded entries add 0
    const __m256 shift = _mm256_set1_ps(best);
    for (int64_t j = 0; j < rows; j += 8)
      sum = _mm256_add_ps(sum, exp8(_mm256_sub_ps(_mm256_loadu_ps(values.data() + j), shift)));
    top[b] = 1.f / hsum(sum);
  }
}

// `choose_drafts` on exit states h (B, D) with the final norm `norm` and the draft head `head` (V', D)
// (+ `bias`; `ids` (V',) the token ids of a trimmed head's rows, else V' = V), a grammar's masks
// `allowed` (B, V) bool or none, all in h's dtype. Returns {draft (B,) int64, top (B,) fp32: each
// draft's probability, zeros for eta <= 0 (not computed)}.
std::vector<torch::Tensor> draft_choice(const torch::Tensor& h, const torch::Tensor& norm, double eps,
                                        const torch::Tensor& head, const c10::optional<torch::Tensor>& bias,
                                        const c10::optional<torch::Tensor>& ids, int64_t vocab,
                                        const c10::optional<torch::Tensor>& allowed, double eta) {
  TORCH_CHECK(h.dim() == 2 && head.dim() == 2 && head.size(1) == h.size(1), "h (B, D) and head (V', D)");
  TORCH_CHECK(h.scalar_type() == head.scalar_type() && norm.scalar_type() == head.scalar_type() &&
                  (!bias.has_value() || bias->scalar_type() == head.scalar_type()),
              "h, norm, head and bias in one dtype");
  TORCH_CHECK(h.is_contiguous() && head.is_contiguous() && norm.is_contiguous(), "contiguous h, norm and head");
  const int64_t batch = h.size(0), rows = head.size(0), d = h.size(1);
  const int64_t full = ids.has_value() ? vocab : rows;
  TORCH_CHECK(!ids.has_value() || (ids->numel() == rows && ids->scalar_type() == torch::kLong), "ids (V',) int64");
  TORCH_CHECK(!allowed.has_value() || (allowed->dim() == 2 && allowed->size(0) == batch && allowed->size(1) == full),
              "allowed (B, V)");
  auto token = torch::empty({batch}, torch::kLong);
  auto top = torch::zeros({batch}, torch::kFloat32);
  const auto held_ids = ids.has_value() ? ids->contiguous() : torch::Tensor();
  const auto mask = allowed.has_value() ? allowed->to(torch::kBool).contiguous() : torch::Tensor();
  auto run = [&](const auto* hp) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(hp)>>;
    choose_drafts<T>(hp, batch, d, norm.data_ptr<T>(), static_cast<float>(eps), head.data_ptr<T>(),
                     bias.has_value() ? bias->data_ptr<T>() : nullptr,
                     ids.has_value() ? held_ids.data_ptr<int64_t>() : nullptr, rows, full,
                     allowed.has_value() ? mask.data_ptr<bool>() : nullptr, token.data_ptr<int64_t>(),
                     eta > 0 ? top.data_ptr<float>() : nullptr);
  };
  if (h.scalar_type() == torch::kFloat32) {
    run(h.data_ptr<float>());
  } else {
    TORCH_CHECK(h.scalar_type() == torch::kBFloat16, "float32 or bfloat16");
    run(h.data_ptr<at::BFloat16>());
  }
  return {token, top};
}

// Whether some row's draft puts eta on its top token (`top` (B,) from `draft_choice`): the engine's
// `_unsure` negated (a NaN is not below eta); always for eta <= 0.
bool sure(const torch::Tensor& top, double eta) {
  if (eta <= 0) return true;
  const float* p = top.data_ptr<float>();
  for (int64_t b = 0; b < top.numel(); ++b)
    if (!(p[b] < eta)) return true;
  return false;
}

// Greedy early-exit drafting in one call: the engine's draft loop (`fast.FastLlamaBlocks.draft_loop`)
// without the Python between its steps. Step i runs input i at slot start + i through blocks [0, E)
// (`blocks_pass`, the cache written; input 0 is `token` (B,), input i > 0 the draft of step i - 1), then,
// for i < k, the final norm, the draft head and the argmax on its exit state (`draft_choice`) give
// draft i + 1. With eta > 0, a step where no row's draft puts eta on its top token (`sure`) drafts
// nothing and ends the loop. Every row sees every slot up to its own (no window): rows at the same
// slots with no mask, rows at their own (`row_starts` (B,): row b's input i at slot row_starts[b] + i)
// through `causal_mask`.
// embed (V, D): the embedding table; cos, sin (B, k + 1, hd): the rotary of each row's k + 1 slots.
// Returns {drafts (B, s) int64, hidden (B, s + 1, D)}: s <= k drafts and the exit states of the s + 1
// inputs that ran (the last draft included, the verification's first position, unless eta stopped the
// loop before drafting it); an empty vector, nothing computed, where `blocks_pass` declines.
// `stop`, where given, is asked before each step after the first: true ends the loop at once and
// returns an empty vector (the caller no longer wants the drafts; see `greedy_rounds`' overlap).
std::vector<torch::Tensor> draft_loop_until(const std::vector<const Block*>& blocks, const torch::Tensor& embed,
                                            const torch::Tensor& token, const std::vector<torch::Tensor>& keys,
                                            const std::vector<torch::Tensor>& values, int64_t start,
                                            const torch::Tensor& cos, const torch::Tensor& sin,
                                            const torch::Tensor& norm, double eps, const torch::Tensor& head,
                                            const c10::optional<torch::Tensor>& bias,
                                            const c10::optional<torch::Tensor>& ids, int64_t vocab, int64_t k,
                                            double eta, const c10::optional<torch::Tensor>& row_starts,
                                            double mask_value, const std::function<bool()>& stop) {
  TORCH_CHECK(token.dim() == 1 && token.scalar_type() == torch::kLong, "token (B,) int64");
  TORCH_CHECK(cos.dim() == 3 && cos.size(0) == token.size(0) && cos.size(1) >= k + 1 && sin.sizes() == cos.sizes(),
              "cos and sin (B, k + 1, hd)");
  const int64_t batch = token.size(0);
  auto firsts = first_slots(batch, 1, start, std::numeric_limits<int64_t>::max() / 2, row_starts);
  TORCH_CHECK(!firsts.empty(), "row_starts >= 0");
  const int64_t last_first = *std::max_element(firsts.begin(), firsts.end());
  std::vector<torch::Tensor> drafts, states;
  torch::Tensor input = token;
  for (int64_t i = 0; i <= k; ++i) {
    if (i > 0 && stop && stop()) return {};
    const auto hidden = embed.index_select(0, input).unsqueeze(1);  // (B, 1, D)
    c10::optional<torch::Tensor> mask, step_starts;
    if (row_starts.has_value()) {  // (B, 1, S): each row up to its own slot
      mask = causal_mask(firsts, 1, last_first + i + 1, mask_value);
      step_starts = *row_starts + i;
    }
    const auto out = blocks_pass(blocks, hidden, keys, values, start + i,
                                 (row_starts.has_value() ? last_first : start) + i + 1, mask,
                                 cos.narrow(1, i, 1).contiguous(), sin.narrow(1, i, 1).contiguous(), step_starts);
    for (auto& first : firsts) ++first;
    if (!out.has_value()) {
      TORCH_CHECK(i == 0, "blocks_pass declined after its first step");
      return {};
    }
    states.push_back(*out);
    if (i == k) break;
    const auto chosen = draft_choice(out->select(1, 0).contiguous(), norm, eps, head, bias, ids, vocab,
                                     c10::nullopt, eta);  // {draft (B,), top (B,)}
    if (!sure(chosen[1], eta)) break;
    input = chosen[0];
    drafts.push_back(input.unsqueeze(1));
  }
  auto made = drafts.empty() ? torch::empty({token.size(0), 0}, token.options()) : torch::cat(drafts, 1);
  return {made, torch::cat(states, 1)};
}

// `draft_loop_until` without a stop: the engine's draft loop.
std::vector<torch::Tensor> draft_loop(const std::vector<const Block*>& blocks, const torch::Tensor& embed,
                                      const torch::Tensor& token, const std::vector<torch::Tensor>& keys,
                                      const std::vector<torch::Tensor>& values, int64_t start,
                                      const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& norm,
                                      double eps, const torch::Tensor& head, const c10::optional<torch::Tensor>& bias,
                                      const c10::optional<torch::Tensor>& ids, int64_t vocab, int64_t k,
                                      double eta, const c10::optional<torch::Tensor>& row_starts,
                                      double mask_value) {
  return draft_loop_until(blocks, embed, token, keys, values, start, cos, sin, norm, eps, head, bias, ids, vocab, k,
                          eta, row_starts, mask_value, nullptr);
}

// Where a pass of T = `length` positions writes and what it sees: kv_length (the slots attended: past
// the last row's last position) and the additive mask (B, T, kv_length) of rows at slots start .. (row b
// at row_starts[b] ..; query t sees slots up to its own, `causal_mask`), none for one position of
// aligned rows, which sees every slot.
std::pair<int64_t, c10::optional<torch::Tensor>> pass_mask(int64_t batch, int64_t length, int64_t start,
                                                          const c10::optional<torch::Tensor>& row_starts,
                                                          double mask_value) {
  const auto firsts = first_slots(batch, length, start, std::numeric_limits<int64_t>::max() / 2, row_starts);
  TORCH_CHECK(!firsts.empty(), "row_starts >= 0");
  const int64_t kv_length = *std::max_element(firsts.begin(), firsts.end()) + length;
  if (length == 1 && !row_starts.has_value()) return {kv_length, c10::nullopt};
  return {kv_length, causal_mask(firsts, length, kv_length, mask_value)};
}

// Logits (n, V) with every token a grammar's mask `allowed` (n, V) bool refuses at -inf, as
// `grammar.apply_mask`: a row left with nothing finite becomes uniform (0) over the allowed tokens.
torch::Tensor apply_allowed(const torch::Tensor& logits, const torch::Tensor& allowed) {
  const auto masked = logits.masked_fill(allowed.logical_not(), -std::numeric_limits<float>::infinity());
  const auto empty = torch::isfinite(masked).any(-1, true).logical_not();
  return torch::where(empty.logical_and(allowed), torch::zeros({}, logits.options()), masked);
}

// One greedy early-exit draft step in one call, for the rounds whose drafts need the host between
// steps (a grammar's mask, its forced tokens, copies) or an exit block: the T inputs `tokens` (B, T) at
// slots start .. start + T - 1 (row b at row_starts[b] .. where rows sit at different slots) through
// blocks [0, E) (`blocks`, the cache written; query t sees slots up to its own), then through the exit
// blocks `extra` on block E's output (each writing its own cache layer: `keys`/`values` hold the E
// blocks' buffers, then the extra blocks'), then the final norm, the draft head, a grammar's mask
// `allowed` (B, V) bool where given and the argmax on the last input's state (`draft_choice`). The same
// calls in the same order as the engine's Python step, so the same bits.
// Returns {draft (B,) int64, hidden (B, T, D) after block E (the verification's input there), sure
// (1,) bool: some row's draft puts `eta` on its top token (`sure`)}; with `choose` false the pass only,
// {hidden, the exit states (B, T, D) the draft head reads} (a verification's tail behind an exit block,
// which needs no draft); or an empty vector, nothing computed, where `blocks_pass` declines.
std::vector<torch::Tensor> draft_step(const std::vector<const Block*>& blocks, const std::vector<const Block*>& extra,
                                      const torch::Tensor& embed, const torch::Tensor& tokens,
                                      const std::vector<torch::Tensor>& keys, const std::vector<torch::Tensor>& values,
                                      int64_t start, const torch::Tensor& cos, const torch::Tensor& sin,
                                      double mask_value, const torch::Tensor& norm, double eps,
                                      const torch::Tensor& head, const c10::optional<torch::Tensor>& bias,
                                      const c10::optional<torch::Tensor>& ids, int64_t vocab,
                                      const c10::optional<torch::Tensor>& allowed, double eta,
                                      const c10::optional<torch::Tensor>& row_starts, bool choose) {
  TORCH_CHECK(tokens.dim() == 2 && tokens.scalar_type() == torch::kLong, "tokens (B, T) int64");
  const size_t depth = blocks.size();
  TORCH_CHECK(keys.size() == depth + extra.size() && values.size() == keys.size(),
              "a key and a value buffer per block, the exit blocks' last");
  const int64_t batch = tokens.size(0), length = tokens.size(1);
  const auto [kv_length, mask] = pass_mask(batch, length, start, row_starts, mask_value);
  const std::vector<torch::Tensor> block_keys(keys.begin(), keys.begin() + depth),
      block_values(values.begin(), values.begin() + depth), extra_keys(keys.begin() + depth, keys.end()),
      extra_values(values.begin() + depth, values.end());
  if (!blocks_fit(extra, extra_keys, extra_values, batch, kv_length, embed.scalar_type())) return {};
  const auto input = embed.index_select(0, tokens.reshape(-1)).view({batch, length, -1});
  const auto hidden = blocks_pass(blocks, input, block_keys, block_values, start, kv_length, mask, cos, sin,
                                  row_starts);
  if (!hidden.has_value()) return {};
  auto features = *hidden;
  if (!extra.empty()) {
    const auto out = blocks_pass(extra, features, extra_keys, extra_values, start, kv_length, mask, cos, sin,
                                 row_starts);
    TORCH_CHECK(out.has_value(), "the exit blocks declined after blocks [0, E) ran");  // checked above
    features = *out;
  }
  if (!choose) return {*hidden, features};
  const auto chosen = draft_choice(features.select(1, length - 1).contiguous(), norm, eps, head, bias, ids, vocab,
                                   allowed, eta);  // {draft (B,), top (B,)}
  return {chosen[0], *hidden, torch::full({1}, sure(chosen[1], eta), torch::kBool)};
}

// The greedy target of each row of h (n, D) under a grammar's masks `allowed` (n, V) bool: the argmax of
// `head_logits` after `apply_allowed`, bf16 widened first. A row whose mask allows at most V / 8 tokens (a
// forced token, a digit, the end of a value: about half of a JSON reply's positions) computes only the logits
// of its allowed tokens, each the dot product `rows_block` computes (the same order, rounded to the dtype,
// the bias added as torch adds it), and takes the first maximum among them as argmax does; the others run the
// whole head together. So the same tokens, without reading or multiplying the head's refused rows: a plain
// step under a grammar whose next token is forced skips the head's read.
torch::Tensor masked_target(const torch::Tensor& h, const torch::Tensor& norm, double eps, const torch::Tensor& head,
                            const c10::optional<torch::Tensor>& bias, const torch::Tensor& allowed) {
  const int64_t rows = h.size(0), vocab = head.size(0), k = head.size(1);
  TORCH_CHECK(allowed.dim() == 2 && allowed.size(0) == rows && allowed.size(1) == vocab, "allowed (n, V)");
  const auto mask = allowed.to(torch::kBool).contiguous();
  const auto counts = mask.sum(-1).to(torch::kLong);
  const int64_t* count = counts.data_ptr<int64_t>();
  std::vector<int64_t> wide, narrow;
  for (int64_t r = 0; r < rows; ++r) (count[r] > 0 && count[r] * 8 <= vocab ? narrow : wide).push_back(r);
  auto target = torch::empty({rows}, torch::kLong);
  int64_t* out = target.data_ptr<int64_t>();
  if (!wide.empty()) {
    const auto index = torch::tensor(wide, torch::kLong);
    auto logits = apply_allowed(head_logits(h.index_select(0, index), norm, eps, head, bias),
                                mask.index_select(0, index));
    if (logits.scalar_type() != torch::kFloat32) logits = logits.to(torch::kFloat32);
    const auto best = logits.argmax(-1).contiguous();
    const int64_t* chosen = best.data_ptr<int64_t>();
    for (size_t i = 0; i < wide.size(); ++i) out[wide[i]] = chosen[i];
  }
  if (narrow.empty()) return target;
  // the normalised rows as `head_logits` computes them, in fp32 as `few_rows_linear` reads them
  const auto normed = final_norm(h, norm, eps).to(torch::kFloat32).contiguous();
  const bool* allow = mask.data_ptr<bool>();
  auto run = [&](const auto* w) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(w)>>;
    const T* b = bias.has_value() ? bias->data_ptr<T>() : nullptr;
    for (const int64_t r : narrow) {
      float best = 0.f;
      int64_t choice = -1;
      bool finite = false, nan = false;
      for (int64_t j = 0; j < vocab; ++j) {
        if (!allow[r * vocab + j]) continue;
        T logit;
        rows_block<1, T>(normed.data_ptr<float>() + r * k, w + j * k, &logit, 1, k, 0, 1);
        float value = static_cast<float>(logit);
        if (b) value = static_cast<float>(static_cast<T>(value + static_cast<float>(b[j])));
        if (std::isnan(value)) {  // argmax takes the first NaN
          choice = j;
          nan = true;
          break;
        }
        finite = finite || std::isfinite(value);
        if (choice < 0 || value > best) {
          best = value;
          choice = j;
        }
      }
      // nothing finite: `apply_allowed` makes the row uniform (0) over the allowed tokens, the first wins
      if (!finite && !nan) {
        for (int64_t j = 0; j < vocab; ++j)
          if (allow[r * vocab + j]) {
            choice = j;
            break;
          }
      }
      out[r] = choice;
    }
  };
  if (head.scalar_type() == torch::kFloat32) {
    run(head.data_ptr<float>());
  } else {
    TORCH_CHECK(head.scalar_type() == torch::kBFloat16, "head float32 or bfloat16");
    run(head.data_ptr<at::BFloat16>());
  }
  return target;
}

// Greedy verification in one call: the target's pass over blocks [first, last) on T positions at slots start
// .. start + T - 1 (row b at row_starts[b] .. where rows sit at different slots; query t sees slots up to its
// own: `causal_mask`, whose `mask_value` beyond is the engine's mask's, its dtype's lowest value; one
// position of aligned rows sees every slot, with no mask), the final norm and LM head (`head_logits`), a
// grammar's masks `allowed` (B, T, V) bool where given (as `grammar.apply_mask`: refused tokens at -inf, a
// row left with nothing finite uniform over the allowed ones), the argmax (bf16 widened first) and the
// accepted prefix: the leading run of drafts equal to the target's argmax, as `sampling.accept_greedy`
// computes it. The pass's input: `hidden` (B, T, D), or the embedding rows of `tokens` (B, T) (a plain step:
// blocks [0, N)). drafts (B, T - 1) int64; cos, sin (B, T, hd). Returns {decided (B, T + 1) int64: the tokens
// (B, T), then each row's accepted count}, one tensor for the engine's one host read a round, or an empty
// vector, nothing computed, where `blocks_pass` declines.
std::vector<torch::Tensor> verify_greedy(const std::vector<const Block*>& blocks,
                                         const c10::optional<torch::Tensor>& hidden,
                                         const c10::optional<torch::Tensor>& tokens, const torch::Tensor& embed,
                                         const std::vector<torch::Tensor>& keys,
                                         const std::vector<torch::Tensor>& values, int64_t start,
                                         const torch::Tensor& cos, const torch::Tensor& sin, double mask_value,
                                         const torch::Tensor& norm, double eps, const torch::Tensor& head,
                                         const c10::optional<torch::Tensor>& bias, const torch::Tensor& drafts,
                                         const c10::optional<torch::Tensor>& allowed,
                                         const c10::optional<torch::Tensor>& row_starts) {
  TORCH_CHECK(hidden.has_value() != tokens.has_value(), "hidden or tokens, one of them");
  const torch::Tensor input = hidden.has_value() ? *hidden : embed.index_select(0, tokens->reshape(-1))
                                                                 .view({tokens->size(0), tokens->size(1), -1});
  const int64_t batch = input.size(0), length = input.size(1);
  TORCH_CHECK(drafts.dim() == 2 && drafts.size(0) == batch && drafts.size(1) == length - 1, "drafts (B, T - 1)");
  const auto [kv_length, mask] = pass_mask(batch, length, start, row_starts, mask_value);
  const auto out = blocks_pass(blocks, input, keys, values, start, kv_length, mask, cos, sin, row_starts);
  if (!out.has_value()) return {};
  torch::Tensor target;
  if (allowed.has_value()) {
    target = masked_target(out->reshape({batch * length, -1}), norm, eps, head, bias,
                           allowed->reshape({batch * length, -1})).view({batch, length});
  } else {
    auto logits = head_logits(out->reshape({batch * length, -1}), norm, eps, head, bias);
    if (logits.scalar_type() != torch::kFloat32) logits = logits.to(torch::kFloat32);
    target = logits.argmax(-1).view({batch, length});
  }
  const auto accepted = drafts.eq(target.narrow(1, 0, length - 1)).to(torch::kInt).cumprod(1).sum(1);
  return {torch::cat({target, accepted.to(torch::kLong).unsqueeze(1)}, 1)};
}

// Greedy decoding rounds of one row in one call: the engine's loop of rounds (`SelfSpecGenerator.generate`
// at a fixed k, or copies at a fixed copy length) without returning to Python between them. Between two
// passes the host has only this loop to run, not the Python of a round (some 200 calls, each slowed by
// caches that the pass before flushed with the weights). A round from pending token `token` at slot n
// (`start` in the first): for k > 0, `draft_loop` over blocks [0, E) (E = `exit_layer`, drafts with the
// draft head `draft_head`, `draft_bias`, `ids`, `vocab`, stopping below eta), then `verify_greedy` over
// blocks [E, N) on the exit states of its s + 1 inputs; for k = 0 a plain step, `verify_greedy` over
// blocks [0, N) on the token. The same calls as the engine's compiled rounds, so the same bits. With
// `history` (the row's tokens so far, the pending one last), a round first looks for a copy of up to
// `copy_limit` tokens that followed the longest suffix of min_ngram..max_ngram tokens seen before
// (`ngram.NGramIndex.propose`, its tables built here and extended with every kept token), verified from
// the embedding over [0, N); without one, k = 0 (the `ngram` drafter) takes a plain step and k > 0 (the
// `hybrid`) drafts with the early exit, and when η did not stop those drafts, a copy that their tokens
// make possible follows them (the engine's `copy_after`), through blocks [0, E) before the verification
// over [E, N) of them all. The row keeps the accepted drafts and
// the target's next token, cut after an eos (`eos` (n_eos,) int64) and at `max_tokens` tokens in all;
// the last kept token is the next round's pending token at slot n + kept: the rollback is only that,
// the rejected slots are overwritten later. With `overlap`, a round whose k early-exit drafts ran (no
// copy after them) verifies on one thread while another drafts the next round ahead (see below): the
// drafts a fresh draft_loop would make from the same token at the same slot, each pass on one thread.
// Ends after an eos, at max_tokens or after `max_rounds` rounds. blocks, keys, values: all N blocks and
// their buffers (1, Hkv, capacity, hd); cos, sin (L, hd): the rotary table, rows by slot (L > the last
// slot written). Returns {tokens (t,) int64: every kept token, rounds (R, 5) int64: per round its
// early-exit drafts, copied drafts (after them), accepted count, kept tokens and whether its drafts were
// made ahead (`overlap`), seconds (R, 2) float64: per round its draft and verification seconds}; an
// empty vector, nothing computed, where `blocks_pass` declines.
std::vector<torch::Tensor> greedy_rounds(const std::vector<const Block*>& blocks, int64_t exit_layer,
                                         const torch::Tensor& embed, const std::vector<torch::Tensor>& keys,
                                         const std::vector<torch::Tensor>& values, int64_t start, int64_t token,
                                         const torch::Tensor& cos, const torch::Tensor& sin, double mask_value,
                                         const torch::Tensor& norm, double eps, const torch::Tensor& head,
                                         const c10::optional<torch::Tensor>& bias, const torch::Tensor& draft_head,
                                         const c10::optional<torch::Tensor>& draft_bias,
                                         const c10::optional<torch::Tensor>& ids, int64_t vocab, int64_t k,
                                         double eta, const torch::Tensor& eos, int64_t max_tokens,
                                         int64_t max_rounds, const c10::optional<torch::Tensor>& history,
                                         int64_t min_ngram, int64_t max_ngram, int64_t copy_limit, bool overlap) {
  using Clock = std::chrono::steady_clock;
  const bool copying = history.has_value();
  const int64_t reach = k + (copying ? copy_limit : 0);  // the most drafts a round verifies
  const int64_t num_blocks = static_cast<int64_t>(blocks.size());
  TORCH_CHECK(keys.size() == blocks.size() && values.size() == blocks.size(), "a key and a value buffer a block");
  TORCH_CHECK(0 < exit_layer && exit_layer <= num_blocks && k >= 0, "0 < exit_layer <= N and k >= 0");
  TORCH_CHECK(!copying || (1 <= min_ngram && min_ngram <= max_ngram && copy_limit >= 1), "n-gram settings");
  TORCH_CHECK(cos.dim() == 2 && sin.sizes() == cos.sizes() && cos.size(0) > start + max_tokens + reach,
              "cos and sin (L, hd), L past the last slot a round writes");
  const std::vector<const Block*> low(blocks.begin(), blocks.begin() + exit_layer),
      high(blocks.begin() + exit_layer, blocks.end());
  const std::vector<torch::Tensor> low_keys(keys.begin(), keys.begin() + exit_layer),
      low_values(values.begin(), values.begin() + exit_layer), high_keys(keys.begin() + exit_layer, keys.end()),
      high_values(values.begin() + exit_layer, values.end());
  const auto eos_held = eos.to(torch::kLong).contiguous();
  const int64_t* eos_ids = eos_held.data_ptr<int64_t>();
  const int64_t num_eos = eos_held.numel();
  const auto longs = torch::TensorOptions().dtype(torch::kLong);
  // the rotary rows of `count` slots from `first`, (1, count, hd) as the engine's calls get them
  const auto rows = [](const torch::Tensor& table, int64_t first, int64_t count) {
    return table.narrow(0, first, count).unsqueeze(0).contiguous();
  };
  const auto since = [](Clock::time_point then) { return std::chrono::duration<double>(Clock::now() - then).count(); };
  // the copy drafter's sequence and, per n, each n-gram's latest following position (`NGramIndex`)
  std::vector<int64_t> seq;
  std::vector<std::map<std::vector<int64_t>, int64_t>> tables(copying ? max_ngram - min_ngram + 1 : 0);
  const auto index_from = [&](size_t first) {  // the n-grams that end just before each new position
    for (size_t follow = std::max<size_t>(first, 1); follow < seq.size(); ++follow)
      for (int64_t n = min_ngram; n <= max_ngram && n <= static_cast<int64_t>(follow); ++n)
        tables[n - min_ngram][std::vector<int64_t>(seq.begin() + follow - n, seq.begin() + follow)] =
            static_cast<int64_t>(follow);
  };
  // `NGramIndex.propose`: the longest suffix of the sequence followed by `extra` (drafts not yet
  // accepted) first, the copy from the sequence and `extra`, around the period
  const auto propose = [&](const std::vector<int64_t>& extra) {
    std::vector<int64_t> copy, joined;
    if (!extra.empty()) {
      joined = seq;
      joined.insert(joined.end(), extra.begin(), extra.end());
    }
    const auto& text = extra.empty() ? seq : joined;
    const auto length = static_cast<int64_t>(text.size());
    for (int64_t n = std::min(max_ngram, length - 1); n >= min_ngram; --n) {
      const auto& table = tables[n - min_ngram];
      const auto found = table.find(std::vector<int64_t>(text.end() - n, text.end()));
      if (found != table.end()) {
        const int64_t follow = found->second, period = length - follow;
        for (int64_t i = 0; i < copy_limit; ++i) copy.push_back(text[follow + i % period]);
        break;
      }
    }
    return copy;
  };
  if (copying) {
    const auto held = history->to(torch::kLong).contiguous();
    seq.assign(held.data_ptr<int64_t>(), held.data_ptr<int64_t>() + held.numel());
    TORCH_CHECK(!seq.empty() && seq.back() == token, "history ends with the pending token");
    index_from(0);
  }
  std::vector<int64_t> kept, record;
  std::vector<double> seconds;
  int64_t slot = start;
  const int64_t capacity = std::min(keys[0].size(2), cos.size(0));  // slots a pass may write below
  // the next round's drafts, made during this round's verification (`overlap`): {drafts (1, k), exit
  // states (1, k + 1, D)} from the exit's own guess of the target's next token, `guess`
  std::vector<torch::Tensor> ahead;
  int64_t guess = -1, ahead_slot = -1;
  for (int64_t round = 0; round < max_rounds && static_cast<int64_t>(kept.size()) < max_tokens; ++round) {
    const auto began = Clock::now();
    const auto made_ahead = std::move(ahead);
    ahead.clear();
    bool reused = false;
    const auto pending = torch::full({1}, token, longs);
    std::vector<torch::Tensor> verified;
    int64_t early = 0, copied = 0, drafted = 0;  // early-exit drafts, then copied ones
    double draft_seconds = 0.0;
    auto copy = copying ? propose({}) : std::vector<int64_t>{};
    if (copying && (k == 0 || !copy.empty())) {  // a copy (or a plain step), verified from the embedding
      copied = drafted = static_cast<int64_t>(copy.size());
      draft_seconds = since(began);
      copy.insert(copy.begin(), token);
      const auto input = torch::tensor(copy, longs).view({1, drafted + 1});
      verified = verify_greedy(blocks, c10::nullopt, input, embed, keys, values, slot, rows(cos, slot, drafted + 1),
                               rows(sin, slot, drafted + 1), mask_value, norm, eps, head, bias,
                               input.narrow(1, 1, drafted), c10::nullopt, c10::nullopt);
    } else if (k > 0) {
      // the drafts made ahead during the last round's verification, if it kept them all and its next token
      // was their guess (this round's pending token at the slot they start from)
      reused = !made_ahead.empty() && token == guess && slot == ahead_slot;
      const auto drafts = reused ? made_ahead
                                : draft_loop(low, embed, pending, low_keys, low_values, slot, rows(cos, slot, k + 1),
                                             rows(sin, slot, k + 1), norm, eps, draft_head, draft_bias, ids, vocab,
                                             k, eta, c10::nullopt, mask_value);
      if (drafts.empty()) {
        TORCH_CHECK(round == 0, "blocks_pass declined after the first round");
        return {};
      }
      early = drafted = drafts[0].size(1);
      torch::Tensor states = drafts[1], tokens = drafts[0];  // (1, s + 1, D), (1, s)
      if (copying && early == k) {  // η did not stop the drafts: a copy their tokens make possible
        const auto held = tokens.contiguous();
        const auto tail = propose(std::vector<int64_t>(held.data_ptr<int64_t>(), held.data_ptr<int64_t>() + early));
        copied = static_cast<int64_t>(tail.size());
        if (copied) {  // its tokens through blocks [0, E), where the drafts' exit states come from
          const auto input = torch::tensor(tail, longs).view({1, copied});
          const int64_t first = slot + early + 1;
          const auto [kv_length, mask] = pass_mask(1, copied, first, c10::nullopt, mask_value);
          const auto out = blocks_pass(low, embed.index_select(0, input.view({-1})).unsqueeze(0), low_keys,
                                       low_values, first, kv_length, mask, rows(cos, first, copied),
                                       rows(sin, first, copied), c10::nullopt);
          TORCH_CHECK(out.has_value(), "blocks_pass declined a copy after the drafts");
          states = torch::cat({states, *out}, 1);
          tokens = torch::cat({tokens, input}, 1);
          drafted += copied;
        }
      }
      draft_seconds = since(began);
      const auto verify = [&] {
        return verify_greedy(high, states, c10::nullopt, embed, high_keys, high_values, slot,
                             rows(cos, slot, drafted + 1), rows(sin, slot, drafted + 1), mask_value, norm, eps,
                             head, bias, tokens, c10::nullopt, c10::nullopt);
      };
      const int64_t next = slot + drafted + 1;  // the next round's slot if every draft is accepted
      if (overlap && early == k && !copied && next + k < capacity) {
        // The verification (blocks [E, N)) on one thread while the other drafts the next round (blocks
        // [0, E), slots from `next`) from the exit's guess of the target's token after the last draft:
        // the two write different blocks' caches, and ATen runs the `parallel_for`s nested in this pair
        // serially, so each pass runs on its task's thread (no second OpenMP team). The drafts are kept
        // when the target accepts every draft and its next token is the guess; the drafting stops as
        // soon as the verification says they will not be.
        std::atomic<int> verdict{-1};  // -1 while verifying; then whether every draft was accepted
        std::atomic<int64_t> bonus{-1};  // the target's token after the last draft, once verified
        guess = -1;
        ahead_slot = next;
        at::parallel_for(0, 2, 1, [&](int64_t first, int64_t last) {
          for (int64_t task = first; task < last; ++task) {
            if (task == 0) {
              verified = verify();
              if (verified.empty()) {
                verdict = 0;
                continue;
              }
              const int64_t* decided = verified[0].data_ptr<int64_t>();
              bonus = decided[drafted];
              verdict = decided[drafted + 1] == drafted ? 1 : 0;
              continue;
            }
            const auto chosen = draft_choice(states.select(1, early).contiguous(), norm, eps, draft_head, draft_bias,
                                             ids, vocab, c10::nullopt, eta);
            if (!sure(chosen[1], eta)) continue;
            guess = chosen[0].item<int64_t>();
            const std::function<bool()> stop = [&] {
              const int v = verdict.load();
              return v == 0 || (v == 1 && bonus.load() != guess);
            };
            ahead = draft_loop_until(low, embed, chosen[0], low_keys, low_values, next, rows(cos, next, k + 1),
                                     rows(sin, next, k + 1), norm, eps, draft_head, draft_bias, ids, vocab, k, eta,
                                     c10::nullopt, mask_value, stop);
          }
        });
      } else {
        verified = verify();
      }
    } else {
      verified = verify_greedy(blocks, c10::nullopt, pending.view({1, 1}), embed, keys, values, slot,
                               rows(cos, slot, 1), rows(sin, slot, 1), mask_value, norm, eps, head, bias,
                               torch::empty({1, 0}, longs), c10::nullopt, c10::nullopt);
    }
    if (verified.empty()) {
      TORCH_CHECK(round == 0 && (k == 0 || copying), "blocks_pass declined after the first pass");
      return {};
    }
    const auto decided = verified[0].contiguous();  // (1, s + 2): the target's s + 1 tokens, the accepted count
    const int64_t* tokens = decided.data_ptr<int64_t>();
    const int64_t accepted = tokens[drafted + 1];
    int64_t keep = std::min(accepted + 1, max_tokens - static_cast<int64_t>(kept.size()));
    bool ended = false;
    for (int64_t i = 0; i < keep && !ended; ++i) {
      if (std::find(eos_ids, eos_ids + num_eos, tokens[i]) != eos_ids + num_eos) {
        keep = i + 1;
        ended = true;
      }
    }
    kept.insert(kept.end(), tokens, tokens + keep);
    if (copying) {
      seq.insert(seq.end(), tokens, tokens + keep);
      index_from(seq.size() - keep);
    }
    token = tokens[keep - 1];
    slot += keep;
    record.insert(record.end(), {early, copied, accepted, keep, reused});
    seconds.insert(seconds.end(), {draft_seconds, since(began) - draft_seconds});
    if (ended) break;
  }
  const auto count = static_cast<int64_t>(record.size()) / 5;
  return {torch::tensor(kept, longs), torch::tensor(record, longs).view({count, 5}),
          torch::tensor(seconds, torch::TensorOptions().dtype(torch::kDouble)).view({count, 2})};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  // Tensors only, no Python objects: other Python threads may run meanwhile
  module.def("few_rows_linear", &few_rows_linear, "x (m <= 8, K) @ weight (N, K)^T, streaming weight once",
             pybind11::call_guard<pybind11::gil_scoped_release>());
  module.def("few_queries_attention", &few_queries_attention,
             "attention of a few queries, each alone in a fixed order: (B, m, H*hd)",
             pybind11::call_guard<pybind11::gil_scoped_release>());
  module.def("block_front", &block_front, "a block's norm, q/k/v products and rotary for a few positions",
             pybind11::call_guard<pybind11::gil_scoped_release>());
  module.def("block_back", &block_back, "a block's attention, o product, residuals and MLP for a few positions",
             pybind11::call_guard<pybind11::gil_scoped_release>());
  pybind11::class_<Block>(module, "Block", pybind11::module_local())
      .def(pybind11::init<torch::Tensor, double, torch::Tensor, c10::optional<torch::Tensor>, torch::Tensor,
                          c10::optional<torch::Tensor>, torch::Tensor, c10::optional<torch::Tensor>,
                          c10::optional<torch::Tensor>, double, c10::optional<torch::Tensor>, double, int64_t,
                          double, torch::Tensor, c10::optional<torch::Tensor>, torch::Tensor, double,
                          torch::Tensor, c10::optional<torch::Tensor>, torch::Tensor,
                          c10::optional<torch::Tensor>, torch::Tensor, c10::optional<torch::Tensor>>());
  module.def("blocks_pass", &blocks_pass, "blocks of a decoding pass, the cache written, in one call",
             pybind11::call_guard<pybind11::gil_scoped_release>());
  module.def("draft_loop", &draft_loop, "greedy early-exit drafts: k steps of blocks [0, E), head, argmax",
             pybind11::call_guard<pybind11::gil_scoped_release>());
  module.def("draft_choice", &draft_choice, "greedy drafts from exit states: final norm, draft head, mask, argmax",
             pybind11::call_guard<pybind11::gil_scoped_release>());
  module.def("draft_step", &draft_step, "one greedy draft step: blocks [0, E), exit blocks, head, mask, argmax",
             pybind11::call_guard<pybind11::gil_scoped_release>());
  module.def("masked_target", &masked_target, "the greedy target under a grammar's masks, narrow rows alone",
             pybind11::call_guard<pybind11::gil_scoped_release>());
  module.def("verify_greedy", &verify_greedy, "greedy verification: the pass, the head, the accepted prefix",
             pybind11::call_guard<pybind11::gil_scoped_release>());
  module.def("greedy_rounds", &greedy_rounds, "greedy rounds of one row: drafts, verification, what it keeps",
             pybind11::call_guard<pybind11::gil_scoped_release>());
}
