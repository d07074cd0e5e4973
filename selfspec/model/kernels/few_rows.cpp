// x @ Wᵀ for a few rows of x (a decode step, a verification of k + 1 positions), streaming W once.
//
// Decoding at batch 1 is bound by reading the weights. MKL's one-row product (sgemv) keeps to one
// core here, and its several-row product (sgemm) repacks W first; this kernel reads each row of W
// once, from both cores (the rows split between the threads of torch's own pool), and multiplies it
// with all m rows of x, which sit in L1 (a chunk of K at a time on long rows: `chunked_block`). bf16 weights
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
//
// These are the model's passes. The decoding calls built on them (the drafts, η, the verification, the
// n-gram copies and the fused rounds) are selfspec/backends/cpu_rounds/rounds.cpp, compiled into the same
// extension, which defines its module; few_rows.h is what they use of this file.

#include "few_rows.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <type_traits>
#include <vector>

namespace {

// out[r] = hsum(acc[r]) for 8 vectors at once: the same additions in the same pairs as `hsum` (lane i
// plus lane i + 4, then those of lanes 0, 2 and 1, 3, then the two), on the 8 side by side in 13
// shuffles and additions where 8 `hsum`s take 40.
inline void hsum8(const __m256* acc, float* out) {
  __m256 halves[4];  // halves[i] = [acc[2i]'s lo + hi | acc[2i+1]'s lo + hi]
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)
    halves[i] = _mm256_add_ps(_mm256_permute2f128_ps(acc[2 * i], acc[2 * i + 1], 0x20),
                              _mm256_permute2f128_ps(acc[2 * i], acc[2 * i + 1], 0x31));
  // pairs[i] = [s0 + s2, s1 + s3 of acc[4i], of acc[4i + 2] | of acc[4i + 1], of acc[4i + 3]]
  __m256 pairs[2];
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i)
    pairs[i] = _mm256_add_ps(_mm256_shuffle_ps(halves[2 * i], halves[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(halves[2 * i], halves[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // [acc 0, 2, 4, 6 | 1, 3, 5, 7]: the even ones' pair sums, then the odd ones'
  const __m256 sums = _mm256_add_ps(_mm256_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm256_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(3, 1, 3, 1)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, sums);
  for (int r = 0; r < 4; ++r) {
    out[2 * r] = lanes[r];
    out[2 * r + 1] = lanes[4 + r];
  }
}

// out[j] = a · b_j for the `count` rows b_j = b + j·n: 8-lane FMAs, then the lanes, then the tail, the
// order `rows_block` uses (b widened exactly). Eight rows at a time give the FMA units independent
// chains (a head of 32 dims is 4 FMAs a row: one row's chain alone waits on the FMA's latency); each
// row's sum keeps its own order.
template <typename T>
inline void dots(const float* a, const T* b, int64_t n, int64_t count, float* out) {
  const int64_t n8 = n - n % 8;
  int64_t j = 0;
  for (; j + 8 <= count; j += 8) {
    __m256 acc[8];
#pragma GCC unroll 8
    for (int r = 0; r < 8; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t c = 0; c < n8; c += 8) {
      const __m256 av = _mm256_loadu_ps(a + c);
#pragma GCC unroll 8
      for (int r = 0; r < 8; ++r) acc[r] = _mm256_fmadd_ps(load8(b + (j + r) * n + c), av, acc[r]);
    }
    hsum8(acc, out + j);
    if (n8 < n) {
      for (int r = 0; r < 8; ++r) {  // K's tail as `rows_block` adds it
        float total = out[j + r];
        for (int64_t c = n8; c < n; ++c) total += static_cast<float>(b[(j + r) * n + c]) * a[c];
        out[j + r] = total;
      }
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

// A mask value at or below this hides its key: -inf, or the dtype's lowest value (fp32's and bf16's
// are -3.4e38), which the engine's masks use; a visible key's score is never near it.
constexpr float kHiddenKey = -1e38f;

// One query of an (row, kv head)'s attention: its scores, then its softmax weights in place.
struct Query {
  const float* q;     // (hd) fp32
  const float* mask;  // (S) additive
  float* out_acc;     // (hd) Σ_j p[j]·v[j] so far
  float* p;           // (S rounded up to 8): scores, then exp(score − best)
  int64_t used;       // keys up to the query's last visible one: the rest weigh exactly 0 and are not read
  float total;        // Σ_j p[j], in the softmax's 8 lanes
};

// acc[d0, d0 + 8R) of Q queries (1 or 2) += Σ_{j in [from, to)} p[j]·v[j, d0 + ...], in key order, one
// fused multiply-add per key and dimension (written out, so that no compiler's choice to contract a
// product and a sum changes the bits). Each (query, dimension) is one chain in key order whatever the
// grouping: two queries side by side share each v load and give the FMA units 2R chains where one
// query's R would wait on the FMA's latency (R = 4: a head of 32 dims).
template <int R, int Q, typename T>
inline void accumulate(Query* const* queries, const T* v, int64_t hd, int64_t d0, int64_t from, int64_t to) {
  __m256 sums[Q][R];
#pragma GCC unroll 8
  for (int a = 0; a < Q; ++a)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) sums[a][r] = _mm256_loadu_ps(queries[a]->out_acc + d0 + 8 * r);
  for (int64_t j = from; j < to; ++j) {
    const T* vj = v + j * hd + d0;
    __m256 vv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) vv[r] = load8(vj + 8 * r);
#pragma GCC unroll 2
    for (int a = 0; a < Q; ++a) {
      const __m256 pj = _mm256_set1_ps(queries[a]->p[j]);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) sums[a][r] = _mm256_fmadd_ps(pj, vv[r], sums[a][r]);
    }
  }
#pragma GCC unroll 8
  for (int a = 0; a < Q; ++a)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(queries[a]->out_acc + d0 + 8 * r, sums[a][r]);
}

// Σ_j p[j]·v[j] over keys [from, to) ∩ each query's own for one query, or two side by side over the keys
// both use and then the longer one's rest alone (a key past a query's `used` may hold anything: a free
// slot). Called tile after tile in key order, so each (query, dimension) stays one chain in key order.
template <typename T>
void weigh_values(Query* first, Query* second, const T* v, int64_t hd, int64_t from, int64_t to) {
  const int64_t hd8 = hd - hd % 8;
  Query* longer = first;
  int64_t shared = from;  // keys [from, shared) are weighed for both queries together
  if (second) {
    Query* pair[2] = {first, second};
    shared = std::clamp(std::min(first->used, second->used), from, to);
    longer = first->used > second->used ? first : second;
    int64_t d0 = 0;
    for (; d0 + 32 <= hd8; d0 += 32) accumulate<4, 2>(pair, v, hd, d0, from, shared);
    for (; d0 < hd8; d0 += 8) accumulate<1, 2>(pair, v, hd, d0, from, shared);
  }
  const int64_t end = std::min(longer->used, to);
  if (shared < end) {
    int64_t d0 = 0;
    for (; d0 + 64 <= hd8; d0 += 64) accumulate<8, 1>(&longer, v, hd, d0, shared, end);
    for (; d0 + 32 <= hd8; d0 += 32) accumulate<4, 1>(&longer, v, hd, d0, shared, end);
    for (; d0 < hd8; d0 += 8) accumulate<1, 1>(&longer, v, hd, d0, shared, end);
  }
  for (Query* query : {first, second}) {
    if (!query || hd8 == hd) continue;
    for (int64_t j = from; j < std::min(query->used, to); ++j)
      for (int64_t d = hd8; d < hd; ++d)
        query->out_acc[d] = std::fma(query->p[j], static_cast<float>(v[j * hd + d]), query->out_acc[d]);
  }
}

// How many keys make a tile: the queries of a kv head read a tile of keys (then of values) in turn,
// so that it comes from L1 (16 KiB) for all but the first; read from L2 or L3 once per query, a long
// context's keys made a verification cost its positions' count of single steps.
template <typename T>
constexpr int64_t tile_keys(int64_t hd) {
  return std::max<int64_t>(8, 16384 / (hd * static_cast<int64_t>(sizeof(T))) / 8 * 8);
}

// How many keys the query reads: up to its last visible one (the keys hidden after it, a causal
// prefill's later positions or a cache's free slots, weigh exactly 0 in `softmax_weights`: they are
// not read, which changes no sum).
inline int64_t keys_used(const float* mask, int64_t s_len) {
  int64_t used = s_len;
  while (used > 1 && mask[used - 1] <= kHiddenKey) --used;
  return used;
}

// A query's softmax weights in place, from its scores p[j] = q·k_j (j < used): p[j] = exp(s_j − best)
// with s_j = p[j]·scale + mask_j, 0 up to `used` rounded to 8, and the weights' sum in the softmax's 8
// lanes (key j in lane j % 8, the keys past `used` weighing 0, so a query's sums are the same whatever
// the number of keys hidden after its own).
inline void softmax_weights(Query& query, int64_t hd, float scale) {
  const float* mi = query.mask;
  float* pi = query.p;
  const int64_t used = query.used, padded = (used + 7) / 8 * 8, used8 = used - used % 8;
  // a product, then a sum, as the scalar steps round them (the build contracts no products)
  const __m256 scale8 = _mm256_set1_ps(scale);
  __m256 best8 = _mm256_set1_ps(-INFINITY);
  for (int64_t j = 0; j < used8; j += 8) {
    const __m256 s = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(pi + j), scale8), _mm256_loadu_ps(mi + j));
    _mm256_storeu_ps(pi + j, s);
    best8 = _mm256_max_ps(best8, s);
  }
  alignas(32) float lanes8[8];
  _mm256_store_ps(lanes8, best8);
  float best = *std::max_element(lanes8, lanes8 + 8);
  for (int64_t j = used8; j < used; ++j) {
    pi[j] = pi[j] * scale + mi[j];
    best = std::max(best, pi[j]);
  }
  for (int64_t j = used; j < padded; ++j) pi[j] = -INFINITY;
  __m256 lanes = _mm256_setzero_ps();
  for (int64_t j = 0; j < padded; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(pi + j), _mm256_set1_ps(best)));
    _mm256_storeu_ps(pi + j, e);
    lanes = _mm256_add_ps(lanes, e);
  }
  query.total = hsum(lanes);
  std::fill(query.out_acc, query.out_acc + hd, 0.f);
}

// Attention of the queries of one row and kv head (the m positions of one or two of the heads that
// share it), each alone, over S keys, in fp32 throughout: `outs[i]` gets query i's result (hd values).
// p holds a row of S rounded up to 8 floats per query, acc hd floats per query. The keys, then the
// values, are read a tile at a time for every query (`tile_keys`), the values weighed two queries at a
// time (`weigh_values`): each query's result is the same bits alone, paired or tiled.
template <typename T>
void attend_kv_head(std::vector<Query>& queries, const std::vector<T*>& outs, const T* k, const T* v,
                    int64_t s_len, int64_t hd, float scale, float* p, float* acc) {
  const int64_t stride = (s_len + 7) / 8 * 8, count = static_cast<int64_t>(queries.size());
  int64_t longest = 0;
  for (int64_t i = 0; i < count; ++i) {
    queries[i].p = p + i * stride;
    queries[i].out_acc = acc + i * hd;
    queries[i].used = keys_used(queries[i].mask, s_len);
    longest = std::max(longest, queries[i].used);
  }
  const int64_t tile = tile_keys<T>(hd);
  for (int64_t from = 0; from < longest; from += tile)
    for (Query& query : queries)
      if (from < query.used) dots(query.q, k + from * hd, hd, std::min(tile, query.used - from), query.p + from);
  for (Query& query : queries) softmax_weights(query, hd, scale);
  for (int64_t from = 0; from < longest; from += tile)
    for (int64_t i = 0; i < count; i += 2)
      weigh_values(&queries[i], i + 1 < count ? &queries[i + 1] : nullptr, v, hd, from, from + tile);
  for (int64_t i = 0; i < count; ++i)
    for (int64_t d = 0; d < hd; ++d) outs[i][d] = static_cast<T>(queries[i].out_acc[d] / queries[i].total);
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
  // A unit of work: one row's heads [h0, h0 + 2) that share a kv head (one, where the group is odd),
  // so that even a single position's queries pair up in `weigh_values`.
  const int64_t pairs = (group + 1) / 2, units = batch * kv_heads * pairs;
  auto run = [&](auto* kp, auto* vp, auto* op) {
    using T = std::remove_pointer_t<decltype(kp)>;
    at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> p(2 * m * ((s_len + 7) / 8 * 8)), acc(2 * m * hd);
      std::vector<Query> queries;
      std::vector<T*> outs;
      for (int64_t unit = begin; unit < end; ++unit) {
        const int64_t b = unit / (kv_heads * pairs), g = unit / pairs % kv_heads;
        const int64_t h0 = g * group + unit % pairs * 2, h1 = std::min(h0 + 2, (g + 1) * group);
        queries.clear();
        outs.clear();
        for (int64_t i = 0; i < m; ++i)
          for (int64_t h = h0; h < h1; ++h) {
            queries.push_back({qp + ((b * heads + h) * m + i) * hd, mp + (b * m + i) * s_len, nullptr, nullptr, 0, 0.f});
            outs.push_back(op + (b * m + i) * heads * hd + h * hd);
          }
        attend_kv_head<T>(queries, outs, kp + b * k.stride(0) + g * k.stride(1), vp + b * v.stride(0) + g * v.stride(1),
                          s_len, hd, static_cast<float>(scale), p.data(), acc.data());
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

// fn(begin, end) over the rows [0, m) of a block's small steps (norms, rotary, residuals, SwiGLU): in
// the calling thread up to kSerialRows rows (a decode step, a verification: waking the other thread
// costs more than the loop), split between the threads beyond (a prefill, where one thread's loops left
// the other waiting). Each row is computed alike either way.
constexpr int64_t kSerialRows = 16;

template <typename F>
void over_rows(int64_t m, const F& fn) {
  at::parallel_for(0, m, kSerialRows, fn);
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

// The model's passes in the extension's module (whose PYBIND11_MODULE is in rounds.cpp).
void bind_passes(pybind11::module_& module) {
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
}
