// What selfspec's decoding calls (selfspec/backends/cpu_rounds/rounds.cpp, compiled into the same extension)
// use of the model's passes (few_rows.cpp): the tensors of a block (`Block`), a range of blocks' pass with
// its cache writes (`blocks_pass`) and what it checks, the target's head (`final_norm`, `head_logits`),
// and the few-row products, exp and RMSNorm of one row that the draft head's choice and a grammar's
// narrow rows compute in place (`products`, `rows_block`, `exp8`, `rms_norm_row`, `held`). Those
// primitives are defined here, in an unnamed namespace: each file that includes this one compiles its own
// copy, inlined where the file's functions call them, so a function computes the same bits whichever
// file it sits in.

#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
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

// 2-8 rows of x over W rows of at least this many bytes (an MLP's down projection, SmolLM2's 1536 floats)
// are multiplied a chunk of K at a time (`chunked_block`): x's chunk stays in L1 while W streams; on
// shorter rows (576, 128 floats) the chunks' extra sums cost more (docs/performance.md, "Long W rows a
// chunk of K at a time").
constexpr int64_t kLongRowBytes = 4096;

// Products of the same x (m, k), x @ W_iᵀ -> out_i (m, n_i), as one range of W rows split between the
// threads: one parallel region for several weights (a block's q/k/v, its gate/up) instead of one per
// weight, the threads' shares balanced over all of them. More than kMaxRows rows of x (a prefill, a
// wide verification, a server's batch of rounds) meet each tile of a thread's W rows group after group
// of kTileRows while the tile sits in L2 (`pairs_block`), so W streams from memory once whatever m (a
// parallel region per chunk read all of W again for every 8 rows); 2-8 rows on W rows of kLongRowBytes
// or more go a chunk of K at a time (`chunked_block`). Each output is still the dot product `rows_block`
// computes.
template <typename T>
void products(int64_t m, const float* x, const std::vector<Product<T>>& products, int64_t k) {
  int64_t total = 0;
  for (const auto& p : products) total += p.n;
  const int64_t row_bytes = k * static_cast<int64_t>(sizeof(T));
  // Threads split the rows in chunks of at least ~32 KiB of weights: below that, waking a thread costs more
  const int64_t grain = std::max<int64_t>(1, (32 << 10) / row_bytes);
  // 2-8 rows of x whose rows (fp32) take kLongRowBytes or more: `chunked_block`
  const bool chunked = k * static_cast<int64_t>(sizeof(float)) >= kLongRowBytes && m >= 2 && m <= kMaxRows;
  const bool wide = m > kMaxRows;
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

// A value as the dtype T holds it (bf16: rounded to nearest even, as torch rounds), back in fp32.
template <typename T>
inline float held(float x) { return static_cast<float>(static_cast<T>(x)); }

// Hugging Face's RMSNorm of one row, op for op: statistics in fp32, the normalised row rounded to T,
// then scaled by the weight in T. `x` holds values of T; `out` gets values of T.
template <typename T>
void rms_norm_row(const float* x, const T* weight, float eps, float* out, int64_t d) {
  float squares = 0.f;
  for (int64_t i = 0; i < d; ++i) squares += x[i] * x[i];
  const float inv = 1.f / std::sqrt(squares / static_cast<float>(d) + eps);
  for (int64_t i = 0; i < d; ++i) out[i] = held<T>(static_cast<float>(weight[i]) * held<T>(x[i] * inv));
}

}  // namespace

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

// Each row's first slot (row_starts or `start`), or an empty vector where a row's writes would not fit
std::vector<int64_t> first_slots(int64_t batch, int64_t length, int64_t start, int64_t kv_length,
                                 const c10::optional<torch::Tensor>& row_starts);

// The additive causal mask (B, T, S) of rows whose queries sit at slots firsts[b] ..
torch::Tensor causal_mask(const std::vector<int64_t>& firsts, int64_t length, int64_t slots, double mask_value);

// Whether the blocks' tensors and their key and value buffers suit the kernels in `dtype`
bool blocks_fit(const std::vector<const Block*>& blocks, const std::vector<torch::Tensor>& keys,
                const std::vector<torch::Tensor>& values, int64_t batch, int64_t kv_length, at::ScalarType dtype);

// Blocks of a decoding pass, their cache writes, in one call; none where they do not suit the kernels
c10::optional<torch::Tensor> blocks_pass(const std::vector<const Block*>& blocks, torch::Tensor hidden,
                                         const std::vector<torch::Tensor>& keys,
                                         const std::vector<torch::Tensor>& values, int64_t start,
                                         int64_t kv_length, const c10::optional<torch::Tensor>& mask,
                                         const torch::Tensor& cos, const torch::Tensor& sin,
                                         const c10::optional<torch::Tensor>& row_starts);

// The final norm of states h (n, D), and the target's logits on them (the final norm and the LM head)
torch::Tensor final_norm(const torch::Tensor& h, const torch::Tensor& norm, double eps);
torch::Tensor head_logits(const torch::Tensor& h, const torch::Tensor& norm, double eps, const torch::Tensor& head,
                          const c10::optional<torch::Tensor>& bias);

// Defines the model's passes (and `Block`) in the extension's module, which rounds.cpp declares
void bind_passes(pybind11::module_& module);
