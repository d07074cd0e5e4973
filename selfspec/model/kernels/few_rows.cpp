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

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr int64_t kMaxRows = 8;

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

// out[r, j] for j in [begin, end): M rows of x (fp32, (M, k)) against W rows [begin, end).
// Each W row is read once; W_ROWS rows at a time give the FMA units independent chains.
template <int M, int W_ROWS, typename T>
void rows_block(const float* x, const T* w, T* out, int64_t n, int64_t k, int64_t begin, int64_t end) {
  const int64_t k8 = k - k % 8;
  int64_t j = begin;
  for (; j + W_ROWS <= end; j += W_ROWS) {
    __m256 acc[W_ROWS][M];
    for (int a = 0; a < W_ROWS; ++a)
      for (int r = 0; r < M; ++r) acc[a][r] = _mm256_setzero_ps();
    for (int64_t c = 0; c < k8; c += 8) {
      for (int a = 0; a < W_ROWS; ++a) {
        const __m256 wv = load8(w + (j + a) * k + c);
        for (int r = 0; r < M; ++r) acc[a][r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + r * k + c), acc[a][r]);
      }
    }
    for (int a = 0; a < W_ROWS; ++a) {
      for (int r = 0; r < M; ++r) {
        float total = hsum(acc[a][r]);
        for (int64_t c = k8; c < k; ++c) total += static_cast<float>(w[(j + a) * k + c]) * x[r * k + c];
        out[r * n + j + a] = static_cast<T>(total);
      }
    }
  }
  if (j < end) rows_block<M, 1, T>(x, w, out, n, k, j, end);  // the rows left over, one at a time
}

template <int M, typename T>
void rows_all(const float* x, const T* w, T* out, int64_t n, int64_t k) {
  // Threads split W's rows in chunks of at least ~32 KiB: below that, waking a thread costs more
  const int64_t grain = std::max<int64_t>(1, (32 << 10) / (k * static_cast<int64_t>(sizeof(T))));
  constexpr int W_ROWS = M == 1 ? 4 : (M == 2 ? 2 : 1);
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    rows_block<M, W_ROWS, T>(x, w, out, n, k, begin, end);
  });
}

template <typename T>
void dispatch(int64_t m, const float* x, const T* w, T* out, int64_t n, int64_t k) {
  switch (m) {
    case 1: return rows_all<1>(x, w, out, n, k);
    case 2: return rows_all<2>(x, w, out, n, k);
    case 3: return rows_all<3>(x, w, out, n, k);
    case 4: return rows_all<4>(x, w, out, n, k);
    case 5: return rows_all<5>(x, w, out, n, k);
    case 6: return rows_all<6>(x, w, out, n, k);
    case 7: return rows_all<7>(x, w, out, n, k);
    default: return rows_all<8>(x, w, out, n, k);
  }
}

}  // namespace

// x (m, K), 1 <= m <= 8, and weight (N, K): both contiguous, on CPU, float32 or bfloat16 (the same)
// -> (m, N) in that dtype, with fp32 accumulation.
torch::Tensor few_rows_linear(const torch::Tensor& x, const torch::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "shapes (m, K) and (N, K)");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "1 to 8 rows");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "one dtype");
  TORCH_CHECK(weight.size(1) > 0, "K >= 1");
  const int64_t m = x.size(0), n = weight.size(0), k = weight.size(1);
  auto out = torch::empty({m, n}, weight.options());
  // x in fp32, once (m·K floats, a few KiB): every W row meets it in L1
  const auto xf = x.to(torch::kFloat32).contiguous();
  if (weight.scalar_type() == torch::kFloat32) {
    dispatch<float>(m, xf.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), n, k);
  } else {
    TORCH_CHECK(weight.scalar_type() == torch::kBFloat16, "float32 or bfloat16");
    dispatch<at::BFloat16>(m, xf.data_ptr<float>(), weight.data_ptr<at::BFloat16>(),
                           out.data_ptr<at::BFloat16>(), n, k);
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  // Tensors only, no Python objects: other Python threads may run meanwhile
  module.def("few_rows_linear", &few_rows_linear, "x (m <= 8, K) @ weight (N, K)^T, streaming weight once",
             pybind11::call_guard<pybind11::gil_scoped_release>());
}
