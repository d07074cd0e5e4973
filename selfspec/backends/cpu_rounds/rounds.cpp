// The decoding algorithm's compiled calls on the CPU: greedy early-exit drafts (`draft_choice`,
// `draft_loop`, `draft_step`) with η's stopping rule (`sure`), the greedy verification (`verify_greedy`,
// under a grammar's masks `masked_target`), the n-gram copies (`NGramSearch`), the same rounds with each
// row sampled by its own settings (`draft_loop_sampled`, `verify_sampled`: selfspec/sampling.py's rules one
// row at a time, `row_probs`, `draw`, `accept_row`) and one row's rounds in one call (`greedy_rounds`,
// greedy or sampled). Each greedy call is the engine's operations in the same order, so the same bits,
// without the Python between them; `selfspec/backends/cpu_kernels.py` (`CpuKernelsBackend`) calls them.
//
// They run the model's passes (selfspec/model/kernels/few_rows.cpp, through few_rows.h), compiled with
// this file into one extension (`selfspec.model.kernels.build`), whose module this file defines: the
// model's passes, then these.

#include "../../model/kernels/few_rows.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <type_traits>
#include <utility>
#include <vector>

// -- the typed state every call takes ----------------------------------------------------------------------
// A range of the model's blocks as a call runs them: the blocks, their key and value buffers (B, Hkv,
// capacity, hd) each, the embedding table (V, D), the rotary rows of the call's positions (cos, sin:
// (B, T, hd) for a pass; the whole table (L, hd) for `greedy_rounds`, which takes each round's rows with
// `at`), the value of the additive mask beyond a query's slots (the engine's mask's: its dtype's lowest),
// and, where rows sit at different slots, each row's first slot (`row_starts` (B,); none: every row at the
// call's `start`).
struct Passes {
  std::vector<const Block*> blocks;
  std::vector<torch::Tensor> keys, values;
  torch::Tensor embed, cos, sin;
  double mask_value = 0.0;
  c10::optional<torch::Tensor> row_starts;

  // blocks [first, last) with their buffers
  Passes range(int64_t first, int64_t last) const {
    return {{blocks.begin() + first, blocks.begin() + last}, {keys.begin() + first, keys.begin() + last},
            {values.begin() + first, values.begin() + last}, embed, cos, sin, mask_value, row_starts};
  }

  // the same blocks at the rotary rows of `count` slots from `first` of the table (L, hd): (1, count, hd),
  // as the engine's calls get them for one row
  Passes at(int64_t first, int64_t count) const {
    Passes out = *this;
    out.cos = cos.narrow(0, first, count).unsqueeze(0).contiguous();
    out.sin = sin.narrow(0, first, count).unsqueeze(0).contiguous();
    return out;
  }
};

// A head on exit or final states: the final norm (`norm`, `eps`), the head (V', D) `weight` + `bias`, a
// trimmed head's token ids `ids` (V'; none: V' = V), V = `vocab`, and η (`stop_below`, the early exit's
// stopping rule; 0: never stop, as for the target's head), all in the states' dtype.
struct Head {
  torch::Tensor norm;
  double eps = 0.0;
  torch::Tensor weight;
  c10::optional<torch::Tensor> bias, ids;
  int64_t vocab = 0;
  double stop_below = 0.0;
};

// One row's rounds (`greedy_rounds`): the pending `token` at slot `start`, k early-exit drafts a round (0:
// none), the eos ids `eos` (n,) int64, at most `max_tokens` kept tokens and `max_rounds` rounds; copies from
// the row's `history` (its tokens so far, the pending one last; none: no copies) after suffixes of
// min_ngram..max_ngram tokens, up to `copy_limit` a round; `overlap`; the row's `sampling`
// (`RowSampling.tensors()`; empty: greedy).
struct Rounds {
  int64_t start = 0, token = 0, k = 0;
  torch::Tensor eos;
  int64_t max_tokens = 0, max_rounds = 0;
  c10::optional<torch::Tensor> history;
  int64_t min_ngram = 1, max_ngram = 0, copy_limit = 0;
  bool overlap = false;
  std::vector<torch::Tensor> sampling;
};

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
// (`CpuKernelsBackend.draft_choice` in selfspec/backends/cpu_kernels.py for the step from Python), and
// they all draft alike.
// The draft head's products on exit states h (B, D): the final norm (`rms_norm_row`), then each of the
// head's V' rows (`rows_block`'s dot products, rounded to the dtype): (B, V') values of T.
template <typename T>
std::unique_ptr<T[]> head_rows(const T* h, int64_t batch, int64_t d, const T* norm, float eps, const T* head,
                               int64_t rows) {
  std::vector<float> normed(batch * d), row(d);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < d; ++i) row[i] = static_cast<float>(h[b * d + i]);
    rms_norm_row<T>(row.data(), norm, eps, normed.data() + b * d, d);
  }
  std::unique_ptr<T[]> logits(new T[batch * rows]);  // (B, V'), written before read
  products<T>(batch, normed.data(), {{head, logits.get(), rows}}, d);
  return logits;
}

template <typename T>
void choose_drafts(const T* h, int64_t batch, int64_t d, const Head& draft, const int64_t* ids, const bool* allowed,
                   int64_t* token, float* top) {
  const int64_t rows = draft.weight.size(0), vocab = ids ? draft.vocab : rows;
  const T* bias = draft.bias.has_value() ? draft.bias->data_ptr<T>() : nullptr;
  const auto logits = head_rows<T>(h, batch, d, draft.norm.data_ptr<T>(), static_cast<float>(draft.eps),
                                   draft.weight.data_ptr<T>(), rows);
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

// The draft logits of exit states h (B, D), as `choose_drafts` reads them (each head row's product + bias
// in the dtype): `out` (B, V') floats, row `order[i]` of the head at column i (a trimmed head's rows in
// the order of their token ids; none: the head's order).
template <typename T>
void draft_logits(const T* h, int64_t batch, int64_t d, const Head& draft, const int64_t* order, float* out) {
  const int64_t rows = draft.weight.size(0);
  const T* bias = draft.bias.has_value() ? draft.bias->data_ptr<T>() : nullptr;
  const auto logits = head_rows<T>(h, batch, d, draft.norm.data_ptr<T>(), static_cast<float>(draft.eps),
                                   draft.weight.data_ptr<T>(), rows);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t j = order ? order[i] : i;
      float v = static_cast<float>(logits[b * rows + j]);
      if (bias) v = held<T>(v + static_cast<float>(bias[j]));
      out[b * rows + i] = v;
    }
}

// `choose_drafts` on exit states h (B, D) with the draft head `draft` and a grammar's masks `allowed` (B, V)
// bool or none. Returns {draft (B,) int64, top (B,) fp32: each draft's probability, zeros where η is 0
// (not computed)}.
std::vector<torch::Tensor> draft_choice(const torch::Tensor& h, const Head& draft,
                                        const c10::optional<torch::Tensor>& allowed) {
  const auto &norm = draft.norm, &head = draft.weight;
  const auto &bias = draft.bias, &ids = draft.ids;
  const double stop_below = draft.stop_below;
  const int64_t vocab = draft.vocab;
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
    choose_drafts<T>(hp, batch, d, draft, ids.has_value() ? held_ids.data_ptr<int64_t>() : nullptr,
                     allowed.has_value() ? mask.data_ptr<bool>() : nullptr, token.data_ptr<int64_t>(),
                     stop_below > 0 ? top.data_ptr<float>() : nullptr);
  };
  if (h.scalar_type() == torch::kFloat32) {
    run(h.data_ptr<float>());
  } else {
    TORCH_CHECK(h.scalar_type() == torch::kBFloat16, "float32 or bfloat16");
    run(h.data_ptr<at::BFloat16>());
  }
  return {token, top};
}

// Whether some row's draft puts stop_below on its top token (`top` (B,) from `draft_choice`): the engine's
// `RoundPasses.unsure` negated (a NaN is not below stop_below); always for stop_below <= 0.
bool sure(const torch::Tensor& top, double stop_below) {
  if (stop_below <= 0) return true;
  const float* p = top.data_ptr<float>();
  for (int64_t b = 0; b < top.numel(); ++b)
    if (!(p[b] < stop_below)) return true;
  return false;
}

// -- sampling: selfspec/sampling.py's rules, one row at a time -------------------------------------------
// The engine's sampled rounds process logits (`RowSampling.probs`), draw (`sample`) and accept
// (`accept_sampled`) with tensor operations over the batch; the compiled calls below do the same for one
// row at a time in a few passes over its V logits: no sort of the vocabulary (top-k by a selection, top-p
// among the tokens that can be in its nucleus), the random numbers from the same hash and the draw by the
// same race (`draw`). The probabilities' sums run in another order than torch's (and std::log may round
// otherwise than torch's), so a draw can differ from the engine's only where two tokens' race scores lie
// within that rounding.

// Streams of random numbers (`sampling.DRAFT`, `ACCEPT`, `TARGET`)
constexpr int kDraftStream = 0, kAcceptStream = 1, kTargetStream = 2;

// `sampling._mix32`: Wellons' lowbias32
inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}

// `sampling.uniforms` for one key: a uniform number in [0, 1) from (seed, position, stream)
inline double uniform(int64_t seed, int64_t position, int stream) {
  const uint64_t bits = static_cast<uint64_t>(seed);
  uint32_t h = mix32(static_cast<uint32_t>(bits) ^ 0x9E3779B9u);
  h = mix32(h ^ static_cast<uint32_t>(bits >> 32) ^ 0x85EBCA6Bu);
  h = mix32(h ^ static_cast<uint32_t>(static_cast<uint64_t>(position)));
  h = mix32(h ^ (0xC2B2AE35u + static_cast<uint32_t>(stream)));
  return static_cast<double>(h) * 0x1p-32;
}

// One row's `sampling.RowSampling`: temperature (1 on a greedy row), top_k (0 off), top_p (1 off), greedy,
// the seed of its random numbers.
struct RowSampling {
  float temperature = 1.f;
  int64_t top_k = 0;
  float top_p = 1.f;
  bool greedy = true;
  int64_t seed = 0;
};

// The rows' settings from `RowSampling.tensors()` (temperature, top_k, top_p, greedy, seeds: (B,) each);
// none (every row greedy) from an empty list.
std::vector<RowSampling> row_sampling(const std::vector<torch::Tensor>& tensors) {
  std::vector<RowSampling> rows;
  if (tensors.empty()) return rows;
  TORCH_CHECK(tensors.size() == 5, "sampling: (temperature, top_k, top_p, greedy, seeds)");
  const auto temperature = tensors[0].to(torch::kFloat32).contiguous(), top_k = tensors[1].to(torch::kLong).contiguous(),
             top_p = tensors[2].to(torch::kFloat32).contiguous(), greedy = tensors[3].to(torch::kBool).contiguous(),
             seeds = tensors[4].to(torch::kLong).contiguous();
  for (int64_t b = 0; b < temperature.numel(); ++b)
    rows.push_back({temperature.data_ptr<float>()[b], top_k.data_ptr<int64_t>()[b], top_p.data_ptr<float>()[b],
                    greedy.data_ptr<bool>()[b], seeds.data_ptr<int64_t>()[b]});
  return rows;
}

bool all_greedy(const std::vector<RowSampling>& rows) {
  return std::all_of(rows.begin(), rows.end(), [](const RowSampling& s) { return s.greedy; });
}

// argmax's choice over n values: the first NaN, else the first maximum
int64_t first_max(const float* x, int64_t n) {
  int64_t best = 0;
  for (int64_t j = 0; j < n; ++j) {
    if (std::isnan(x[j])) return j;
    if (x[j] > x[best]) best = j;
  }
  return best;
}

// Σ exp(x - shift) over n floats in 8 lanes (entries at -inf add 0); `out`, where given, gets each term
float exp_sum(const float* x, int64_t n, float shift, float* out) {
  __m256 sum = _mm256_setzero_ps();
  const __m256 by = _mm256_set1_ps(shift);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + j), by));
    if (out) _mm256_storeu_ps(out + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  float total = hsum(sum);
  for (; j < n; ++j) {
    float tail[8] = {x[j] - shift, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
    float e[8];
    _mm256_storeu_ps(e, exp8(_mm256_loadu_ps(tail)));
    if (out) out[j] = e[0];
    total += e[0];
  }
  return total;
}

// The biased exponent of a non-negative float (0 for 0 and subnormals): the power of two it lies in.
inline int exponent(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return static_cast<int>((bits >> 23) & 0xFF);
}

// The logit at which top-p cuts: sorted by logit, most likely first, the logit of the token whose probability
// brings the mass of those before it and itself to `top_p` (tokens with the same logit count together).
// A selection by mass (quickselect's partitions, each side's mass summed), so only the last few candidates
// are sorted. `nucleus`: (logit, probability) pairs, reordered.
float nucleus_cut(std::vector<std::pair<float, float>>& nucleus, float top_p) {
  float need = top_p;
  auto lo = nucleus.begin(), hi = nucleus.end();
  while (hi - lo > 32) {
    const float pivot = (lo + (hi - lo) / 2)->first;
    auto mid = std::partition(lo, hi, [&](const auto& t) { return t.first > pivot; });
    float mass = 0.f;
    for (auto it = lo; it != mid; ++it) mass += it->second;
    if (mass >= need) {  // the cut is above the pivot
      hi = mid;
      continue;
    }
    need -= mass;  // everything above the pivot is kept; then the pivot's own logit
    auto tied = std::partition(mid, hi, [&](const auto& t) { return t.first == pivot; });
    float ties = 0.f;
    for (auto it = mid; it != tied; ++it) ties += it->second;
    if (ties >= need || tied == hi) return pivot;
    need -= ties;
    lo = tied;
  }
  std::sort(lo, hi, [](const auto& a, const auto& b) { return a.first > b.first; });
  float before = 0.f;
  for (auto it = lo; it != hi; ++it) {
    before += it->second;
    if (before >= need) return it->first;
  }
  return hi == lo ? nucleus.front().first : (hi - 1)->first;
}

// `RowSampling.probs` of one row: its V logits -> probabilities (V). A greedy row's is one-hot at its
// argmax; a sampled row's logits are divided by its temperature, then top-k keeps the k largest (ties with
// the k-th included) and top-p the most likely tokens until the mass before a token reaches top_p (by the
// distribution after top-k; the first always stays), then the softmax. Only the candidates for the nucleus
// are sorted (`nucleus_cut`): the tokens down to the power of two of probability at which the mass reaches
// top_p (below). Returns the largest probability (η's `top_probability` on a sampled row).
float row_probs(const float* logits, int64_t vocab, const RowSampling& s, float* probs) {
  constexpr float kNone = -std::numeric_limits<float>::infinity();
  if (s.greedy) {
    std::fill(probs, probs + vocab, 0.f);
    probs[first_max(logits, vocab)] = 1.f;
    return 1.f;
  }
  thread_local std::vector<float> x;  // the row's processed logits: a buffer per thread, kept
  x.assign(logits, logits + vocab);
  if (s.temperature != 1.f)
    for (auto& v : x) v /= s.temperature;
  int64_t kept = vocab;
  if (s.top_k > 0 && s.top_k < vocab) {  // the k-th largest logit stays with every one at or above it
    std::vector<float> order(x);
    std::nth_element(order.begin(), order.begin() + (s.top_k - 1), order.end(), std::greater<float>());
    const float kth = order[s.top_k - 1];
    kept = 0;
    for (auto& v : x) {
      if (v < kth) v = kNone;
      else ++kept;
    }
  }
  const float top = *std::max_element(x.begin(), x.end());
  if (s.top_p >= 1.f) {
    const float sum = exp_sum(x.data(), vocab, top, probs);
    for (int64_t j = 0; j < vocab; ++j) probs[j] /= sum;
    return 1.f / sum;  // the most likely token's: exp(0) / sum
  }
  // top-p: the nucleus lies among the most likely tokens down to the power of two (of exp(x - top), by its
  // float exponent) at which their mass reaches top_p: every token in a lower one is less likely than
  // every token above it, so the tokens above hold top_p or more without them
  const float mass = exp_sum(x.data(), vocab, top, probs);  // probs: exp(x - top) for now
  std::array<float, 256> by_exponent{};  // the mass of each float exponent
  for (int64_t j = 0; j < vocab; ++j) by_exponent[exponent(probs[j])] += probs[j];
  int floor = 255;
  for (float above = 0.f; floor > 0 && above < s.top_p * mass * 1.0001f; --floor) above += by_exponent[floor];
  std::vector<std::pair<float, float>> nucleus;  // (logit, probability) of each candidate
  for (int64_t j = 0; j < vocab; ++j)
    if (exponent(probs[j]) >= floor) nucleus.emplace_back(x[j], probs[j] / mass);
  const float cut = nucleus_cut(nucleus, s.top_p);
  float sum = 0.f;  // the softmax over the kept tokens (the others 0)
  for (int64_t j = 0; j < vocab; ++j) {
    if (x[j] < cut) probs[j] = 0.f;
    sum += probs[j];
  }
  for (int64_t j = 0; j < vocab; ++j) probs[j] /= sum;
  return 1.f / sum;
}

// `sampling.sample` for one row: the exponential race over `probs` (n, need not sum to 1), token j's number
// u_j = (mix32(u's bits ^ mix32(id ^ key)) + 1/2) / 2^32 by its token id (`ids[j]`, or j), the winner
// argmax p_j / -ln u_j (the first on a tie); never a zero-probability token. Since -ln x >= 1 - x, a token
// with p_j <= best · (1 - u_j) cannot win and skips its logarithm: most of a flat distribution's tokens.
int64_t draw(const float* probs, int64_t n, double u, const int64_t* ids = nullptr) {
  constexpr uint32_t kTokenKey = 0x27D4EB2Fu;  // `sampling._TOKEN_KEY`
  const auto bits = static_cast<uint32_t>(static_cast<uint64_t>(u * 0x1p32));  // u = 1: 0, as `sample`'s
  double best = -1.0;
  int64_t winner = -1;
  for (int64_t j = 0; j < n; ++j) {
    if (!(probs[j] > 0)) continue;
    const uint32_t id = static_cast<uint32_t>(ids ? ids[j] : j);
    const double v = (static_cast<double>(mix32(bits ^ mix32(id ^ kTokenKey))) + 0.5) * 0x1p-32;
    const double p = probs[j];
    if (winner >= 0 && p <= best * (1.0 - v)) continue;
    const double score = p / -std::log(v);
    if (score > best) best = score, winner = j;
  }
  return winner >= 0 ? winner : 0;  // no positive token: the first, as `sample`'s argmax
}

// `sampling.accept_sampled` for one sampled row: drafts d (k), their distributions q (k, V), `target(i)` the
// target's distribution p_i (V) at draft i's position (asked for in order, up to the first rejection),
// positions (k + 1) of the tokens decided (each slot's position + 1). Draft i is accepted with probability
// min(1, p_i(d)/q_i(d)) (u·q < p), the first rejected one replaced by a draw from max(0, p - q) normalised
// (p where that is all zero), a bonus from p_k after k acceptances. Writes tokens (k + 1: the accepted
// drafts, then the target's own) and returns the count.
int64_t accept_row(const int64_t* drafts, const float* q, const std::function<const float*(int64_t)>& target_at,
                   int64_t k, int64_t vocab, const int64_t* positions, int64_t seed, int64_t* tokens) {
  int64_t accepted = 0;
  const float* target = target_at(0);
  while (accepted < k) {
    const int64_t d = drafts[accepted];
    const double u = uniform(seed, positions[accepted], kAcceptStream);
    if (!(u * static_cast<double>(q[accepted * vocab + d]) < static_cast<double>(target[d]))) break;
    tokens[accepted] = d;
    target = target_at(++accepted);
  }
  const double u = uniform(seed, positions[accepted], kTargetStream);
  if (accepted == k) {
    tokens[accepted] = draw(target, vocab, u);
  } else {
    const float* drafted = q + accepted * vocab;
    std::vector<float> residual(vocab);
    float total = 0.f;
    for (int64_t j = 0; j < vocab; ++j) total += residual[j] = std::max(0.f, target[j] - drafted[j]);
    if (total > 0) {
      for (auto& r : residual) r /= total;  // as `residual_probs` normalises before the draw
      tokens[accepted] = draw(residual.data(), vocab, u);
    } else {  // p <= q everywhere: p itself
      tokens[accepted] = draw(target, vocab, u);
    }
  }
  for (int64_t i = accepted + 1; i <= k; ++i) tokens[i] = tokens[accepted];  // never emitted
  return accepted;
}

// A draft step's choice on the exit states (B, D) of its inputs, the loop's step i: {the drafts (B,), whether
// some row's draft puts η on its top token (`sure`)}. The loop below takes the greedy one (`greedy_drafts`)
// or the sampled one (`SampledDrafts`).
using DraftChoice = std::function<std::pair<torch::Tensor, bool>(const torch::Tensor& states, int64_t step)>;

// The greedy choice: `draft_choice`'s argmax with the draft head `draft` and its η.
DraftChoice greedy_drafts(const Head& draft) {
  return [draft](const torch::Tensor& states, int64_t) {
    const auto chosen = draft_choice(states, draft, c10::nullopt);
    return std::make_pair(chosen[0], sure(chosen[1], draft.stop_below));
  };
}

// Early-exit drafting in one call: the engine's draft loop (`selfspec/draft_loop.py`, which
// `EarlyExitProposer._loop` runs at a round's start through `CpuKernelsBackend.draft_loop` in
// selfspec/backends/cpu_kernels.py) without the Python between its steps; η stops it at the step the engine's
// loop run as written stops.
// Step i runs input i at slot start + i through blocks [0, E) (`low`: `blocks_pass`, the cache written;
// input 0 is `token` (B,), input i > 0 the draft of step i - 1), then, for i < k, `choose` on its exit
// states gives draft i + 1; a step where no row's draft puts η on its top token (`sure` false) drafts
// nothing and ends the loop. Every row sees every slot up to its own (no window): rows at the same slots
// with no mask, rows at their own (`row_starts` (B,): row b's input i at slot row_starts[b] + i) through
// `causal_mask`. low's cos, sin (B, k + 1, hd): the rotary of each row's k + 1 slots.
// Returns {drafts (B, s) int64, hidden (B, s + 1, D)}: s <= k drafts and the exit states of the s + 1
// inputs that ran (the last draft included, the verification's first position, unless stop_below stopped the
// loop before drafting it); an empty vector, nothing computed, where `blocks_pass` declines.
// `stop`, where given, is asked before each step after the first: true ends the loop at once and
// returns an empty vector (the caller no longer wants the drafts; see `greedy_rounds`' overlap).
std::vector<torch::Tensor> draft_loop_until(const Passes& low, const torch::Tensor& token, int64_t start, int64_t k,
                                            const DraftChoice& choose, const std::function<bool()>& stop) {
  const auto& blocks = low.blocks;
  const auto &keys = low.keys, &values = low.values;
  const auto &embed = low.embed, &cos = low.cos, &sin = low.sin;
  const auto& row_starts = low.row_starts;
  const double mask_value = low.mask_value;
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
    const auto [chosen, confident] = choose(out->select(1, 0).contiguous(), i);
    if (!confident) break;
    input = chosen;
    drafts.push_back(input.unsqueeze(1));
  }
  auto made = drafts.empty() ? torch::empty({token.size(0), 0}, token.options()) : torch::cat(drafts, 1);
  return {made, torch::cat(states, 1)};
}

// `draft_loop_until` greedily and without a stop: the engine's greedy draft loop.
std::vector<torch::Tensor> draft_loop(const Passes& low, const Head& draft, const torch::Tensor& token, int64_t start,
                                      int64_t k) {
  return draft_loop_until(low, token, start, k, greedy_drafts(draft), nullptr);
}

// The sampled choice of a draft loop (the engine's `draft_loop.pick` on the draft head's logits): each
// sampled row draws its draft from its processed distribution (`row_probs`) with its DRAFT number at the
// draft's position (its input's + 1), each greedy row takes its argmax; `q` keeps every draft's
// distribution (B, s, V), which the verification accepts against (one-hot on greedy rows). η reads the
// processed distribution's top probability on a sampled row, the softmax's on a greedy one
// (`RowSampling.top_probability`). The draft head `draft` (`Head`): a trimmed head's token ids (V'; the other
// tokens' logits -inf, so probability 0). A trimmed head's V' logits are processed and drawn from alone, in the
// order of their token ids (`order`; the race keys each by its id, `draw`'s `ids`, as over all V), and
// scattered into q.
struct SampledDrafts {
  std::vector<RowSampling> rows;
  torch::Tensor positions;  // (B, k + 1) int64: the inputs' positions
  Head draft;
  std::vector<int64_t> order, tokens;  // a trimmed head's rows by token id, and those ids; empty: all V
  torch::Tensor q;  // (B, k, V) float32: each draft's distribution, made on the first step
  int64_t made = 0;  // the drafts q holds
  std::vector<float> logits, probs;  // (B, V'): a step's choice's, kept for the next

  // the draft head's logits (B, V') of the exit states (B, D) into `logits`, `probs` sized alike
  void head(const torch::Tensor& states) {
    const int64_t batch = states.size(0), d = states.size(1), width = draft.weight.size(0);
    logits.resize(batch * width);
    probs.resize(batch * width);
    auto run = [&](const auto* h) {
      using T = std::remove_const_t<std::remove_pointer_t<decltype(h)>>;
      draft_logits<T>(h, batch, d, draft, order.empty() ? nullptr : order.data(), logits.data());
    };
    if (states.scalar_type() == torch::kFloat32) {
      run(states.data_ptr<float>());
    } else {
      TORCH_CHECK(states.scalar_type() == torch::kBFloat16, "float32 or bfloat16");
      run(states.data_ptr<at::BFloat16>());
    }
  }

  // One sampled row's guess of the target's token at `position` from the exit state (1, D) of its input:
  // its processed draft distribution raced with the target's own number there (TARGET), which gives the
  // target's draw with probability near the two distributions' overlap (`sampling.sample`). Returns {the
  // guess, the processed distribution's top probability (η's)}.
  std::pair<int64_t, float> target_guess(const torch::Tensor& state, int64_t position) {
    TORCH_CHECK(state.size(0) == 1 && rows.size() == 1 && !rows[0].greedy, "one sampled row");
    head(state);
    const int64_t width = draft.weight.size(0);
    const float top = row_probs(logits.data(), width, rows[0], probs.data());
    const int64_t i = draw(probs.data(), width, uniform(rows[0].seed, position, kTargetStream),
                           tokens.empty() ? nullptr : tokens.data());
    return {tokens.empty() ? i : tokens[i], top};
  }

  std::pair<torch::Tensor, bool> operator()(const torch::Tensor& states, int64_t step) {
    const int64_t batch = states.size(0), width = draft.weight.size(0), vocab = draft.vocab;
    if (!q.defined()) q = torch::zeros({batch, positions.size(1) - 1, vocab}, torch::kFloat32);
    head(states);
    auto token = torch::empty({batch}, torch::kLong);
    float* drafted = q.data_ptr<float>() + step * vocab;  // row b's at b · k · V
    const int64_t* position = positions.data_ptr<int64_t>();
    std::vector<float> tops(batch);
    at::parallel_for(0, batch, 1, [&](int64_t first, int64_t last) {  // each row alone
      for (int64_t b = first; b < last; ++b) {
        const float* row = logits.data() + b * width;
        float* p = probs.data() + b * width;
        const float top = row_probs(row, width, rows[b], p);
        const int64_t at = position[b * positions.size(1) + step] + 1;
        const int64_t i = rows[b].greedy ? first_max(row, width)
                                         : draw(p, width, uniform(rows[b].seed, at, kDraftStream),
                                                tokens.empty() ? nullptr : tokens.data());
        token.data_ptr<int64_t>()[b] = tokens.empty() ? i : tokens[i];
        float* q_row = drafted + b * q.size(1) * vocab;
        for (int64_t c = 0; c < width; ++c) q_row[tokens.empty() ? c : tokens[c]] = p[c];
        // a greedy row's top probability: its softmax's, 1 / Σ exp(l - max)
        tops[b] = rows[b].greedy ? 1.f / exp_sum(row, width, row[first_max(row, width)], nullptr) : top;
      }
    });
    const double stop_below = draft.stop_below;
    const bool confident = stop_below <= 0 || std::any_of(tops.begin(), tops.end(), [&](float t) { return !(t < stop_below); });
    if (confident) made = step + 1;
    return {token, confident};
  }
};

// `SampledDrafts` of the rows' `sampling` (`RowSampling.tensors()`) at the inputs' `positions` (B, k + 1),
// with the draft head `draft` and its η.
SampledDrafts sampled_drafts(const std::vector<torch::Tensor>& sampling, const torch::Tensor& positions,
                             const Head& draft) {
  const auto &norm = draft.norm, &head = draft.weight;
  const auto &bias = draft.bias, &ids = draft.ids;
  TORCH_CHECK(head.is_contiguous() && norm.is_contiguous() && (!bias.has_value() || bias->is_contiguous()),
              "contiguous norm, head and bias");
  std::vector<int64_t> order, tokens;
  if (ids.has_value()) {  // the trimmed head's rows in the order of their token ids
    const auto held = ids->to(torch::kLong).contiguous();
    const int64_t* id = held.data_ptr<int64_t>();
    order.resize(held.numel());
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return id[a] < id[b]; });
    for (const int64_t j : order) tokens.push_back(id[j]);
  }
  return {row_sampling(sampling), positions.to(torch::kLong).contiguous(), draft, order, tokens, {}, 0, {}, {}};
}

// A sampled draft loop's result: {drafts (B, s), q (B, s, V), hidden (B, s + 1, D)} from `draft_loop_until`'s
// {drafts, hidden} and the choice's q; empty where the loop returned nothing.
std::vector<torch::Tensor> with_q(const std::vector<torch::Tensor>& out, const SampledDrafts& drafts) {
  if (out.empty()) return {};
  const auto q = drafts.q.defined() ? drafts.q.narrow(1, 0, drafts.made)
                                    : torch::empty({out[0].size(0), 0, drafts.draft.vocab}, torch::kFloat32);
  return {out[0], q, out[1]};
}

// Sampled early-exit drafting in one call (`CpuKernelsBackend.draft_loop` on sampled rows): `draft_loop` with
// `SampledDrafts`' choice; `sampling`: `RowSampling.tensors()`, `positions` (B, k + 1) the inputs'.
// Returns {drafts (B, s), q (B, s, V) float32, hidden (B, s + 1, D)}, or an empty vector.
std::vector<torch::Tensor> draft_loop_sampled(const Passes& low, const Head& draft, const torch::Tensor& token,
                                              int64_t start, int64_t k, const std::vector<torch::Tensor>& sampling,
                                              const torch::Tensor& positions) {
  auto drafts = sampled_drafts(sampling, positions, draft);
  TORCH_CHECK(static_cast<int64_t>(drafts.rows.size()) == token.size(0), "sampling: one setting per row");
  return with_q(draft_loop_until(low, token, start, k, std::ref(drafts), nullptr), drafts);
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
// slots start .. start + T - 1 (row b at low's row_starts[b] .. where rows sit at different slots) through
// blocks [0, E) (`low`, the cache written; query t sees slots up to its own), then through the exit
// blocks `extra` on block E's output (each writing its own cache layer), then the final norm, the draft
// head `draft`, a grammar's mask `allowed` (B, V) bool where given and the argmax on the last input's
// state (`draft_choice`). The same calls in the same order as the engine's Python step, so the same bits.
// Returns {draft (B,) int64, hidden (B, T, D) after block E (the verification's input there), sure
// (1,) bool: some row's draft puts η on its top token (`sure`)}; with `choose` false the pass only,
// {hidden, the exit states (B, T, D) the draft head reads} (a verification's tail behind an exit block,
// which needs no draft); or an empty vector, nothing computed, where `blocks_pass` declines.
std::vector<torch::Tensor> draft_step(const Passes& low, const Passes& extra, const Head& draft,
                                      const torch::Tensor& tokens, int64_t start,
                                      const c10::optional<torch::Tensor>& allowed, bool choose) {
  TORCH_CHECK(tokens.dim() == 2 && tokens.scalar_type() == torch::kLong, "tokens (B, T) int64");
  TORCH_CHECK(low.keys.size() == low.blocks.size() && low.values.size() == low.keys.size() &&
                  extra.keys.size() == extra.blocks.size() && extra.values.size() == extra.keys.size(),
              "a key and a value buffer per block");
  const int64_t batch = tokens.size(0), length = tokens.size(1);
  const auto [kv_length, mask] = pass_mask(batch, length, start, low.row_starts, low.mask_value);
  if (!blocks_fit(extra.blocks, extra.keys, extra.values, batch, kv_length, low.embed.scalar_type())) return {};
  const auto input = low.embed.index_select(0, tokens.reshape(-1)).view({batch, length, -1});
  const auto hidden = blocks_pass(low.blocks, input, low.keys, low.values, start, kv_length, mask, low.cos, low.sin,
                                  low.row_starts);
  if (!hidden.has_value()) return {};
  auto features = *hidden;
  if (!extra.blocks.empty()) {
    const auto out = blocks_pass(extra.blocks, features, extra.keys, extra.values, start, kv_length, mask, low.cos,
                                 low.sin, low.row_starts);
    TORCH_CHECK(out.has_value(), "the exit blocks declined after blocks [0, E) ran");  // checked above
    features = *out;
  }
  if (!choose) return {*hidden, features};
  const auto chosen = draft_choice(features.select(1, length - 1).contiguous(), draft, allowed);  // {draft, top}
  return {chosen[0], *hidden, torch::full({1}, sure(chosen[1], draft.stop_below), torch::kBool)};
}

// The greedy target of each row of h (n, D) under a grammar's masks `allowed` (n, V) bool: the argmax of
// `head_logits` after `apply_allowed`, bf16 widened first. A row whose mask allows at most V / 8 tokens (a
// forced token, a digit, the end of a value: about half of a JSON reply's positions) computes only the logits
// of its allowed tokens, each the dot product `rows_block` computes (the same order, rounded to the dtype,
// the bias added as torch adds it), and takes the first maximum among them as argmax does; the others run the
// whole head together. So the same tokens, without reading or multiplying the head's refused rows: a plain
// step under a grammar whose next token is forced skips the head's read.
torch::Tensor masked_target(const torch::Tensor& h, const Head& target, const torch::Tensor& allowed) {
  const auto &norm = target.norm, &head = target.weight;
  const auto& bias = target.bias;
  const double eps = target.eps;
  const int64_t rows = h.size(0), vocab = head.size(0), k = head.size(1);
  TORCH_CHECK(allowed.dim() == 2 && allowed.size(0) == rows && allowed.size(1) == vocab, "allowed (n, V)");
  const auto mask = allowed.to(torch::kBool).contiguous();
  const auto counts = mask.sum(-1).to(torch::kLong);
  const int64_t* count = counts.data_ptr<int64_t>();
  std::vector<int64_t> wide, narrow;
  for (int64_t r = 0; r < rows; ++r) (count[r] > 0 && count[r] * 8 <= vocab ? narrow : wide).push_back(r);
  auto chosen_tokens = torch::empty({rows}, torch::kLong);
  int64_t* out = chosen_tokens.data_ptr<int64_t>();
  if (!wide.empty()) {
    const auto index = torch::tensor(wide, torch::kLong);
    auto logits = apply_allowed(head_logits(h.index_select(0, index), norm, eps, head, bias),
                                mask.index_select(0, index));
    if (logits.scalar_type() != torch::kFloat32) logits = logits.to(torch::kFloat32);
    const auto best = logits.argmax(-1).contiguous();
    const int64_t* chosen = best.data_ptr<int64_t>();
    for (size_t i = 0; i < wide.size(); ++i) out[wide[i]] = chosen[i];
  }
  if (narrow.empty()) return chosen_tokens;
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
  return chosen_tokens;
}

// A verification's pass: p's blocks on T positions at slots start .. start + T - 1 (row b at
// row_starts[b] .. where rows sit at different slots; query t sees slots up to its own: `causal_mask`; one
// position of aligned rows sees every slot, with no mask). The input: `hidden` (B, T, D), or the embedding
// rows of `tokens` (B, T) (a plain step: blocks [0, N)). Returns the states (B, T, D), or nothing where `blocks_pass` declines.
c10::optional<torch::Tensor> verify_pass(const Passes& p, const c10::optional<torch::Tensor>& hidden,
                                         const c10::optional<torch::Tensor>& tokens, int64_t start) {
  TORCH_CHECK(hidden.has_value() != tokens.has_value(), "hidden or tokens, one of them");
  const torch::Tensor input = hidden.has_value() ? *hidden : p.embed.index_select(0, tokens->reshape(-1))
                                                                 .view({tokens->size(0), tokens->size(1), -1});
  const int64_t batch = input.size(0), length = input.size(1);
  const auto [kv_length, mask] = pass_mask(batch, length, start, p.row_starts, p.mask_value);
  return blocks_pass(p.blocks, input, p.keys, p.values, start, kv_length, mask, p.cos, p.sin, p.row_starts);
}

// Greedy verification in one call: the target's pass (`verify_pass`), the final norm and LM head
// (`head_logits`), a grammar's masks `allowed` (B, T, V) bool where given (as `grammar.apply_mask`: refused
// tokens at -inf, a row left with nothing finite uniform over the allowed ones), the argmax (bf16 widened
// first) and the accepted prefix: the leading run of drafts equal to the target's argmax, as
// `sampling.accept_greedy` computes it. drafts (B, T - 1) int64; cos, sin (B, T, hd). Returns {decided
// (B, T + 1) int64: the tokens (B, T), then each row's accepted count}, one tensor for the engine's one host
// read a round, or an empty vector, nothing computed, where `blocks_pass` declines.
std::vector<torch::Tensor> verify_greedy(const Passes& p, const Head& target,
                                         const c10::optional<torch::Tensor>& hidden,
                                         const c10::optional<torch::Tensor>& tokens, int64_t start,
                                         const torch::Tensor& drafts, const c10::optional<torch::Tensor>& allowed) {
  const auto out = verify_pass(p, hidden, tokens, start);
  if (!out.has_value()) return {};
  const int64_t batch = out->size(0), length = out->size(1);
  TORCH_CHECK(drafts.dim() == 2 && drafts.size(0) == batch && drafts.size(1) == length - 1, "drafts (B, T - 1)");
  torch::Tensor argmax;  // (B, T): the target's tokens
  if (allowed.has_value()) {
    argmax = masked_target(out->reshape({batch * length, -1}), target, allowed->reshape({batch * length, -1}))
                 .view({batch, length});
  } else {
    auto logits = head_logits(out->reshape({batch * length, -1}), target.norm, target.eps, target.weight,
                              target.bias);
    if (logits.scalar_type() != torch::kFloat32) logits = logits.to(torch::kFloat32);
    argmax = logits.argmax(-1).view({batch, length});
  }
  const auto accepted = drafts.eq(argmax.narrow(1, 0, length - 1)).to(torch::kInt).cumprod(1).sum(1);
  return {torch::cat({argmax, accepted.to(torch::kLong).unsqueeze(1)}, 1)};
}

// Sampled verification in one call (`CpuKernelsBackend.verify_sampled`): `verify_greedy`'s pass and head,
// then each row's acceptance by its own settings (`sampling`: `RowSampling.tensors()`): a greedy row's
// leading run of drafts equal to the target's argmax, the argmax its tokens (what `accept_sampled` makes
// of one-hot p and q); a sampled row's `accept_row` against its drafts' distributions q (B, T - 1, V)
// with its numbers at the decided tokens' positions (`positions` (B, T) the inputs', + 1). Returns
// {decided (B, T + 1)}, or an empty vector where `blocks_pass` declines.
std::vector<torch::Tensor> verify_sampled(const Passes& p, const Head& target,
                                          const c10::optional<torch::Tensor>& hidden,
                                          const c10::optional<torch::Tensor>& tokens, int64_t start,
                                          const torch::Tensor& drafts, const torch::Tensor& q,
                                          const std::vector<torch::Tensor>& sampling, const torch::Tensor& positions) {
  const auto out = verify_pass(p, hidden, tokens, start);
  if (!out.has_value()) return {};
  const int64_t batch = out->size(0), length = out->size(1), k = length - 1;
  const auto rows = row_sampling(sampling);
  TORCH_CHECK(static_cast<int64_t>(rows.size()) == batch, "sampling: one setting per row");
  TORCH_CHECK(drafts.dim() == 2 && drafts.size(0) == batch && drafts.size(1) == k, "drafts (B, T - 1)");
  const auto logits = head_logits(out->reshape({batch * length, -1}), target.norm, target.eps, target.weight,
                                  target.bias).to(torch::kFloat32).contiguous();  // (B·T, V)
  const int64_t vocab = logits.size(1);
  TORCH_CHECK(q.dim() == 3 && q.size(0) == batch && q.size(1) == k && q.size(2) == vocab, "q (B, T - 1, V)");
  const auto held_q = q.to(torch::kFloat32).contiguous();
  const auto held_drafts = drafts.to(torch::kLong).contiguous();
  const auto held_positions = positions.to(torch::kLong).contiguous();
  auto decided = torch::empty({batch, length + 1}, torch::kLong);
  at::parallel_for(0, batch, 1, [&](int64_t first, int64_t last) {  // each row alone
    std::vector<float> p(length * vocab);
    std::vector<int64_t> at(length);
    for (int64_t b = first; b < last; ++b) {
      const float* row = logits.data_ptr<float>() + b * length * vocab;
      const int64_t* d = held_drafts.data_ptr<int64_t>() + b * k;
      int64_t* out_tokens = decided.data_ptr<int64_t>() + b * (length + 1);
      int64_t accepted = 0;
      if (rows[b].greedy) {
        for (int64_t t = 0; t < length; ++t) out_tokens[t] = first_max(row + t * vocab, vocab);
        while (accepted < k && d[accepted] == out_tokens[accepted]) ++accepted;
      } else {
        for (int64_t t = 0; t < length; ++t) at[t] = held_positions.data_ptr<int64_t>()[b * length + t] + 1;
        // p at a position only once the drafts before it were accepted
        const auto target = [&](int64_t t) {
          row_probs(row + t * vocab, vocab, rows[b], p.data() + t * vocab);
          return p.data() + t * vocab;
        };
        accepted = accept_row(d, held_q.data_ptr<float>() + b * k * vocab, target, k, vocab, at.data(), rows[b].seed,
                              out_tokens);
      }
      out_tokens[length] = accepted;
    }
  });
  return {decided};
}

// A row's copy drafter, `ngram.NGramIndex` on tokens: the row's token sequence, searched from its end for
// the latest earlier occurrence of its longest suffix of min_ngram..max_ngram tokens. (The index's text
// matches, which only constrained decoding makes, are not here: the rounds in one call run without a
// grammar.) `greedy_rounds` copies with it. A search reads the sequence once, from the end, mostly one
// comparison a position: tables of every n-gram, built anew each call, cost a long context's row far
// more (a map entry per position and n) than the few searches a call's rounds make.
struct NGramSearch {
  int64_t min_ngram = 1, max_ngram = 0;
  std::vector<int64_t> seq;

  NGramSearch() = default;
  NGramSearch(int64_t min_ngram, int64_t max_ngram) : min_ngram(min_ngram), max_ngram(max_ngram) {}

  void extend(const int64_t* tokens, int64_t count) { seq.insert(seq.end(), tokens, tokens + count); }

  // `NGramIndex.propose`: the longest suffix of the sequence followed by `extra` (drafts not yet
  // accepted) first, the copy of `limit` tokens from the sequence and `extra`, around the period; none
  // where no suffix of min_ngram tokens or more occurred before. An occurrence is an n-gram of the
  // sequence itself, seq[follow − n, follow) with follow < its length, the latest one of the longest n.
  std::vector<int64_t> propose(int64_t limit, const std::vector<int64_t>& extra) const {
    std::vector<int64_t> copy, joined;
    if (!extra.empty()) {
      joined = seq;
      joined.insert(joined.end(), extra.begin(), extra.end());
    }
    const auto& text = extra.empty() ? seq : joined;
    const auto length = static_cast<int64_t>(text.size());
    const int64_t longest = std::min(max_ngram, length - 1);
    int64_t best = min_ngram - 1, found = -1;  // the longest match so far, and its latest follow
    for (int64_t follow = static_cast<int64_t>(seq.size()) - 1; follow >= 1 && best < longest; --follow) {
      int64_t n = 0;  // how many tokens before `follow` equal the text's last ones
      const int64_t most = std::min(longest, follow);
      while (n < most && seq[follow - 1 - n] == text[length - 1 - n]) ++n;
      if (n > best) best = n, found = follow;
    }
    if (found >= 0) {
      const int64_t period = length - found;
      for (int64_t i = 0; i < limit; ++i) copy.push_back(text[found + i % period]);
    }
    return copy;
  }
};

// Greedy decoding rounds of one row in one call: the engine's loop of rounds (`SelfSpecGenerator.generate` at a
// fixed k, or copies at a fixed copy length) without returning to Python between them. Between two passes the host
// has only this loop to run, not the Python of a round (some 200 calls, each slowed by caches that the pass before
// flushed with the weights). What to run is `request` (`Rounds`). A round from pending token `token` at slot n
// (`start` in the first): for k > 0, `draft_loop` over blocks [0, E) (E = `exit_layer`, drafts with the draft head
// `draft`, stopping below its η), then `verify_greedy` over blocks [E, N) on the exit states of its s + 1 inputs
// (the target's head `target`); for k = 0 a plain step, `verify_greedy` over blocks [0, N) on the token. The same
// calls as the engine's compiled rounds, so the same bits. With `history` (the row's tokens so far, the pending
// one last), a round first looks for a copy of up to `copy_limit` tokens that followed the longest suffix of
// min_ngram..max_ngram tokens seen before (`NGramSearch`, `ngram.NGramIndex.propose`'s lookup, over the history
// extended with every kept token), verified from the embedding over [0, N); without one, k = 0 (the `ngram`
// drafter) takes a plain step and k > 0 (the `hybrid`) drafts with the early exit, and when η did not stop those
// drafts, a copy that their tokens make possible follows them (the engine's `copy_after`), through blocks [0, E)
// before the verification over [E, N) of them all. The row keeps the accepted drafts and the target's next token,
// cut after an eos (`eos` (n_eos,) int64) and at `max_tokens` tokens in all; the last kept token is the next
// round's pending token at slot n + kept: the rollback is only that, the rejected slots are overwritten later.
// With `overlap`, a round whose k early-exit drafts ran (no copy after them) verifies on one thread while another
// drafts the next round ahead (see below): the drafts a fresh draft_loop would make from the same token at the
// same slot, each pass on one thread. Ends after an eos, at max_tokens or after `max_rounds` rounds. `model`: all
// N blocks and their buffers (1, Hkv, capacity, hd), its cos, sin (L, hd) the rotary table, rows by slot (L > the
// last slot written). Returns {tokens (t,) int64: every kept token, rounds (R, 5) int64: per round its early-exit
// drafts, copied drafts (after them), accepted count, kept tokens and whether its drafts were made ahead
// (`overlap`), seconds (R, 2) float64: per round its draft and verification seconds, drafts (d,) int64: every
// round's drafts in order, as many a round as it drafted}; an empty vector, nothing computed, where `blocks_pass`
// declines.
std::vector<torch::Tensor> greedy_rounds(const Passes& model, int64_t exit_layer, const Head& target,
                                         const Head& draft, const Rounds& request) {
  using Clock = std::chrono::steady_clock;
  const int64_t start = request.start, k = request.k;
  const int64_t max_tokens = request.max_tokens, max_rounds = request.max_rounds;
  const int64_t min_ngram = request.min_ngram, max_ngram = request.max_ngram, copy_limit = request.copy_limit;
  const auto& eos = request.eos;
  const auto& history = request.history;
  const auto& sampling = request.sampling;
  const bool copying = history.has_value();
  // a sampled row: its drafts drawn (`SampledDrafts`), its rounds verified by `verify_sampled`
  const bool sampled = !sampling.empty() && !all_greedy(row_sampling(sampling));
  TORCH_CHECK(!sampled || !copying, "sampled rounds draft with the early exit alone");
  const int64_t reach = k + (copying ? copy_limit : 0);  // the most drafts a round verifies
  const int64_t num_blocks = static_cast<int64_t>(model.blocks.size());
  TORCH_CHECK(model.keys.size() == model.blocks.size() && model.values.size() == model.blocks.size(),
              "a key and a value buffer a block");
  TORCH_CHECK(!model.row_starts.has_value(), "one row at its own slots: no row_starts");
  TORCH_CHECK(0 < exit_layer && exit_layer <= num_blocks && k >= 0, "0 < exit_layer <= N and k >= 0");
  TORCH_CHECK(!copying || (1 <= min_ngram && min_ngram <= max_ngram && copy_limit >= 1), "n-gram settings");
  const auto &cos = model.cos, &sin = model.sin;
  TORCH_CHECK(cos.dim() == 2 && sin.sizes() == cos.sizes() && cos.size(0) > start + max_tokens + reach,
              "cos and sin (L, hd), L past the last slot a round writes");
  const Passes low = model.range(0, exit_layer), high = model.range(exit_layer, num_blocks);
  const auto eos_held = eos.to(torch::kLong).contiguous();
  const int64_t* eos_ids = eos_held.data_ptr<int64_t>();
  const int64_t num_eos = eos_held.numel();
  const auto longs = torch::TensorOptions().dtype(torch::kLong);
  const auto since = [](Clock::time_point then) { return std::chrono::duration<double>(Clock::now() - then).count(); };
  // the copy drafter: the row's tokens, searched for copies (`NGramIndex`)
  NGramSearch ngrams = copying ? NGramSearch(min_ngram, max_ngram) : NGramSearch();
  const auto propose = [&](const std::vector<int64_t>& extra) { return ngrams.propose(copy_limit, extra); };
  if (copying) {
    const auto held = history->to(torch::kLong).contiguous();
    ngrams.extend(held.data_ptr<int64_t>(), held.numel());
    TORCH_CHECK(!ngrams.seq.empty() && ngrams.seq.back() == request.token, "history ends with the pending token");
  }
  std::vector<int64_t> kept, record, drafted_tokens;  // drafted_tokens: every round's drafts, in order
  std::vector<double> seconds;
  int64_t slot = start, token = request.token;
  const int64_t capacity = std::min(model.keys[0].size(2), cos.size(0));  // slots a pass may write below
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
    const auto positions = torch::arange(slot, slot + k + 1, longs).view({1, k + 1});  // one row: slots are positions
    std::vector<torch::Tensor> verified;
    int64_t early = 0, copied = 0, drafted = 0;  // early-exit drafts, then copied ones
    double draft_seconds = 0.0;
    auto copy = copying ? propose({}) : std::vector<int64_t>{};
    std::vector<int64_t> round_drafts;  // this round's drafts: early-exit ones, then copied ones
    if (copying && (k == 0 || !copy.empty())) {  // a copy (or a plain step), verified from the embedding
      copied = drafted = static_cast<int64_t>(copy.size());
      round_drafts = copy;
      draft_seconds = since(began);
      copy.insert(copy.begin(), token);
      const auto input = torch::tensor(copy, longs).view({1, drafted + 1});
      verified = verify_greedy(model.at(slot, drafted + 1), target, c10::nullopt, input, slot,
                               input.narrow(1, 1, drafted), c10::nullopt);
    } else if (k > 0) {
      // the drafts made ahead during the last round's verification, if it kept them all and its next token
      // was their guess (this round's pending token at the slot they start from)
      reused = !made_ahead.empty() && token == guess && slot == ahead_slot;
      const auto drafts = reused ? made_ahead
                          : sampled ? draft_loop_sampled(low.at(slot, k + 1), draft, pending, slot, k, sampling,
                                                         positions)
                                    : draft_loop(low.at(slot, k + 1), draft, pending, slot, k);
      if (drafts.empty()) {
        TORCH_CHECK(round == 0, "blocks_pass declined after the first round");
        return {};
      }
      early = drafted = drafts[0].size(1);
      torch::Tensor states = drafts.back(), tokens = drafts[0];  // (1, s + 1, D), (1, s)
      if (copying && early == k) {  // η did not stop the drafts: a copy their tokens make possible
        const auto held = tokens.contiguous();
        const auto tail = propose(std::vector<int64_t>(held.data_ptr<int64_t>(), held.data_ptr<int64_t>() + early));
        copied = static_cast<int64_t>(tail.size());
        if (copied) {  // its tokens through blocks [0, E), where the drafts' exit states come from
          const auto input = torch::tensor(tail, longs).view({1, copied});
          const int64_t first = slot + early + 1;
          const auto [kv_length, mask] = pass_mask(1, copied, first, c10::nullopt, model.mask_value);
          const auto at = low.at(first, copied);
          const auto out = blocks_pass(at.blocks, model.embed.index_select(0, input.view({-1})).unsqueeze(0), at.keys,
                                       at.values, first, kv_length, mask, at.cos, at.sin, c10::nullopt);
          TORCH_CHECK(out.has_value(), "blocks_pass declined a copy after the drafts");
          states = torch::cat({states, *out}, 1);
          tokens = torch::cat({tokens, input}, 1);
          drafted += copied;
        }
      }
      const auto held_tokens = tokens.contiguous();
      round_drafts.assign(held_tokens.data_ptr<int64_t>(), held_tokens.data_ptr<int64_t>() + drafted);
      draft_seconds = since(began);
      const auto verify = [&] {
        if (sampled)  // drafts[1]: their distributions q (1, s, V)
          return verify_sampled(high.at(slot, drafted + 1), target, states, c10::nullopt, slot, tokens, drafts[1],
                                sampling, positions.narrow(1, 0, drafted + 1));
        return verify_greedy(high.at(slot, drafted + 1), target, states, c10::nullopt, slot, tokens, c10::nullopt);
      };
      const int64_t next = slot + drafted + 1;  // the next round's slot if every draft is accepted
      if (request.overlap && early == k && !copied && next + k < capacity) {
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
            const auto state = states.select(1, early).contiguous();  // (1, D): the last draft's exit state
            const std::function<bool()> stop = [&] {
              const int v = verdict.load();
              return v == 0 || (v == 1 && bonus.load() != guess);
            };
            if (!sampled) {  // the guess: the exit's argmax
              const auto chosen = draft_choice(state, draft, c10::nullopt);
              if (!sure(chosen[1], draft.stop_below)) continue;
              guess = chosen[0].item<int64_t>();
              ahead = draft_loop_until(low.at(next, k + 1), chosen[0], next, k, greedy_drafts(draft), stop);
              continue;
            }
            // a sampled row: the guess is the exit's distribution raced with the target's number for the
            // token after the last draft (at position `next`), the drafts from it drawn as a fresh round's
            // would be, at the same positions
            auto from_guess = sampled_drafts(sampling, torch::arange(next, next + k + 1, longs).view({1, k + 1}),
                                             draft);
            const auto [guessed, top] = from_guess.target_guess(state, next);
            if (draft.stop_below > 0 && top < draft.stop_below) continue;  // η: not sure enough to draft
            guess = guessed;
            ahead = with_q(draft_loop_until(low.at(next, k + 1), torch::full({1}, guess, longs), next, k,
                                            std::ref(from_guess), stop),
                           from_guess);
          }
        });
      } else {
        verified = verify();
      }
    } else {
      const auto none = torch::empty({1, 0}, longs);
      verified = sampled ? verify_sampled(model.at(slot, 1), target, c10::nullopt, pending.view({1, 1}), slot, none,
                                          torch::empty({1, 0, target.weight.size(0)}), sampling, positions)
                         : verify_greedy(model.at(slot, 1), target, c10::nullopt, pending.view({1, 1}), slot, none,
                                         c10::nullopt);
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
    if (copying) ngrams.extend(tokens, keep);
    token = tokens[keep - 1];
    slot += keep;
    record.insert(record.end(), {early, copied, accepted, keep, reused});
    drafted_tokens.insert(drafted_tokens.end(), round_drafts.begin(), round_drafts.end());
    seconds.insert(seconds.end(), {draft_seconds, since(began) - draft_seconds});
    if (ended) break;
  }
  const auto count = static_cast<int64_t>(record.size()) / 5;
  return {torch::tensor(kept, longs), torch::tensor(record, longs).view({count, 5}),
          torch::tensor(seconds, torch::TensorOptions().dtype(torch::kDouble)).view({count, 2}),
          torch::tensor(drafted_tokens, longs)};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  bind_passes(module);
  // The typed state the calls take, made from Python by keyword
  pybind11::class_<Passes>(module, "Passes", pybind11::module_local())
      .def(pybind11::init([](std::vector<const Block*> blocks, std::vector<torch::Tensor> keys,
                             std::vector<torch::Tensor> values, torch::Tensor embed, torch::Tensor cos,
                             torch::Tensor sin, double mask_value, c10::optional<torch::Tensor> row_starts) {
             TORCH_CHECK(keys.size() == blocks.size() && values.size() == blocks.size(),
                         "a key and a value buffer a block");
             return Passes{std::move(blocks), std::move(keys), std::move(values), std::move(embed), std::move(cos),
                           std::move(sin), mask_value, std::move(row_starts)};
           }),
           pybind11::arg("blocks"), pybind11::arg("keys"), pybind11::arg("values"), pybind11::arg("embed"),
           pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("mask_value"),
           pybind11::arg("row_starts") = c10::nullopt, "blocks, their key and value buffers, embedding, rotary rows",
           pybind11::keep_alive<1, 2>());  // the blocks' objects live as long as the Passes that point at them
  pybind11::class_<Head>(module, "Head", pybind11::module_local())
      .def(pybind11::init([](torch::Tensor norm, double eps, torch::Tensor weight, c10::optional<torch::Tensor> bias,
                             c10::optional<torch::Tensor> ids, int64_t vocab, double stop_below) {
             return Head{std::move(norm), eps, std::move(weight), std::move(bias), std::move(ids), vocab, stop_below};
           }),
           pybind11::arg("norm"), pybind11::arg("eps"), pybind11::arg("weight"), pybind11::arg("bias") = c10::nullopt,
           pybind11::arg("ids") = c10::nullopt, pybind11::arg("vocab"), pybind11::arg("stop_below") = 0.0,
           "a final norm and a (trimmed) head, with η");
  pybind11::class_<Rounds>(module, "Rounds", pybind11::module_local())
      .def(pybind11::init([](int64_t start, int64_t token, int64_t k, torch::Tensor eos, int64_t max_tokens,
                             int64_t max_rounds, c10::optional<torch::Tensor> history, int64_t min_ngram,
                             int64_t max_ngram, int64_t copy_limit, bool overlap,
                             std::vector<torch::Tensor> sampling) {
             return Rounds{start, token, k, std::move(eos), max_tokens, max_rounds, std::move(history), min_ngram,
                           max_ngram, copy_limit, overlap, std::move(sampling)};
           }),
           pybind11::arg("start"), pybind11::arg("token"), pybind11::arg("k"), pybind11::arg("eos"),
           pybind11::arg("max_tokens"), pybind11::arg("max_rounds"), pybind11::arg("history") = c10::nullopt,
           pybind11::arg("min_ngram") = 1, pybind11::arg("max_ngram") = 0, pybind11::arg("copy_limit") = 0,
           pybind11::arg("overlap") = false, pybind11::arg("sampling") = std::vector<torch::Tensor>{},
           "one row's rounds: what greedy_rounds runs");
  // Tensors and the typed state only, no Python objects: other Python threads may run meanwhile
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
  module.def("draft_loop_sampled", &draft_loop_sampled,
             "early-exit drafts, each row by its own sampling: k steps of blocks [0, E), head, draw or argmax",
             pybind11::call_guard<pybind11::gil_scoped_release>());
  module.def("verify_sampled", &verify_sampled,
             "verification, each row by its own sampling: the pass, the head, the speculative sampling rule",
             pybind11::call_guard<pybind11::gil_scoped_release>());
  // the sampling rules alone, for the tests that hold them to selfspec/sampling.py
  module.def("row_probs", [](const torch::Tensor& logits, const std::vector<torch::Tensor>& sampling) {
    const auto rows = row_sampling(sampling);
    const auto held = logits.to(torch::kFloat32).contiguous();
    TORCH_CHECK(held.dim() == 2 && held.size(0) == static_cast<int64_t>(rows.size()), "logits (B, V), a setting a row");
    auto probs = torch::empty_like(held);
    for (int64_t b = 0; b < held.size(0); ++b)
      row_probs(held.data_ptr<float>() + b * held.size(1), held.size(1), rows[b], probs.data_ptr<float>() + b * held.size(1));
    return probs;
  }, "`RowSampling.probs` row by row");
  module.def("uniform", &uniform, "`sampling.uniforms` for one key (seed, position, stream)");
  module.def("draw", [](const torch::Tensor& probs, double u) {
    const auto held = probs.to(torch::kFloat32).contiguous();
    TORCH_CHECK(held.dim() == 1, "probs (V,)");
    return draw(held.data_ptr<float>(), held.numel(), u);
  }, "`sampling.sample` for one row: the exponential race over probs (V,) with the number u");
  module.def("greedy_rounds", &greedy_rounds, "greedy rounds of one row: drafts, verification, what it keeps",
             pybind11::call_guard<pybind11::gil_scoped_release>());
  // `greedy_rounds`' copy drafter on its own, for the test that holds it to `ngram.NGramIndex`
  pybind11::class_<NGramSearch>(module, "NGramSearch", pybind11::module_local())
      .def(pybind11::init([](const std::vector<int64_t>& tokens, int64_t min_ngram, int64_t max_ngram) {
             TORCH_CHECK(1 <= min_ngram && min_ngram <= max_ngram, "1 <= min_ngram <= max_ngram");
             NGramSearch search(min_ngram, max_ngram);
             search.extend(tokens.data(), static_cast<int64_t>(tokens.size()));
             return search;
           }),
           "a sequence of tokens to copy from after suffixes of min_ngram..max_ngram tokens")
      .def("extend", [](NGramSearch& self, const std::vector<int64_t>& tokens) {
             self.extend(tokens.data(), static_cast<int64_t>(tokens.size()));
           }, "append tokens")
      .def("propose", &NGramSearch::propose, "up to `limit` tokens copied after the longest matching suffix",
           pybind11::arg("limit"), pybind11::arg("extra") = std::vector<int64_t>{});
}
