// One-pass AdamW on the host: each element's gradient, master and moments are read once and
// written once (and the compute-dtype parameter written in the same pass). Python side and the
// semantics: moezero/zero/hostadam.py. Built with -ffp-contract=off and no fast-math, so the
// vectorised body and the scalar tail round alike: an element's result never depends on where
// it lies in the tensor (every tier and stage slices the state differently).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cmath>
#include <cstdint>
#include <type_traits>

namespace {

struct Hyper {
  // inv_bias_i = 1 / (1 - beta_i ** step): one division and one square root per element.
  float grad_mul, beta1, one_minus_beta1, beta2, one_minus_beta2, inv_bias1, inv_bias2, eps, lr,
      decay;
};

constexpr int64_t kBlock = 2048;  // elements per block: a bf16/fp16 block's upcast stays in L1
constexpr int64_t kChunk = 64;    // elements per vectorised chunk: four cache lines of a stream
constexpr int64_t kAhead = 512;   // elements prefetched ahead of the chunk: 2 KiB of each stream

// The update of n elements from g[i] * grad_mul (g: fp32, read in this loop, or a block's
// upcast copy). p, m, v and g never overlap (``adamw_step_`` checks): restrict lets the loop
// vectorise.
inline void update_chunk(float* __restrict p, float* __restrict m, float* __restrict v,
                         const float* __restrict g, int64_t n, const Hyper& h) {
  const float b1 = h.beta1, c1 = h.one_minus_beta1, b2 = h.beta2, c2 = h.one_minus_beta2;
  const float inv1 = h.inv_bias1, inv2 = h.inv_bias2, eps = h.eps, lr = h.lr, decay = h.decay;
  const float mul = h.grad_mul;
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i] * mul;
    const float mi = b1 * m[i] + c1 * gi;
    const float vi = b2 * v[i] + c2 * (gi * gi);
    const float u = (mi * inv1) / (std::sqrt(vi * inv2) + eps) + decay * p[i];
    m[i] = mi;
    v[i] = vi;
    p[i] = p[i] - lr * u;
  }
}

// update_chunk over n elements, kChunk at a time, each chunk's lines of the master, moments (and
// of g when ``ahead_g``: an fp32 gradient in memory) requested kAhead elements early. One thread
// streams four arrays: the hardware prefetcher alone left it ~8% under this (hoststep series);
// a prefetch past the end of an array is a hint, never a fault. The results are unchanged.
inline void update(float* p, float* m, float* v, const float* g, int64_t n, const Hyper& h,
                   bool ahead_g) {
  int64_t i = 0;
  for (; i + kChunk <= n; i += kChunk) {
    for (int64_t k = kAhead; k < kAhead + kChunk; k += 16) {  // 16 floats: one 64-byte line
      __builtin_prefetch(p + i + k, 1);
      __builtin_prefetch(m + i + k, 1);
      __builtin_prefetch(v + i + k, 1);
      if (ahead_g) __builtin_prefetch(g + i + k);
    }
    update_chunk(p + i, m + i, v + i, g + i, kChunk, h);
  }
  update_chunk(p + i, m + i, v + i, g + i, n - i, h);
}

template <typename G, typename O>
void run(float* p, float* m, float* v, const G* g, O* out, int64_t numel, const Hyper& h) {
  at::parallel_for(0, (numel + kBlock - 1) / kBlock, 64, [&](int64_t b0, int64_t b1) {
    float g32[kBlock];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t lo = b * kBlock;
      const int64_t n = std::min(kBlock, numel - lo);
      if constexpr (std::is_same_v<G, float>) {
        update(p + lo, m + lo, v + lo, g + lo, n, h, true);
      } else {  // bf16/fp16: upcast the block first (exact), then the same loop
        for (int64_t i = 0; i < n; ++i) g32[i] = static_cast<float>(g[lo + i]);
        update(p + lo, m + lo, v + lo, g32, n, h, false);
      }
      if (out != nullptr) {  // may be the gradient's own storage: read above, written here
        for (int64_t i = 0; i < n; ++i) out[lo + i] = static_cast<O>(p[lo + i]);
      }
    }
  });
}

template <typename G>
void dispatch_out(float* p, float* m, float* v, const G* g, const c10::optional<at::Tensor>& out,
                  int64_t numel, const Hyper& h) {
  if (!out.has_value()) {
    run<G, float>(p, m, v, g, nullptr, numel, h);
  } else if (out->scalar_type() == at::kBFloat16) {
    run(p, m, v, g, out->data_ptr<c10::BFloat16>(), numel, h);
  } else if (out->scalar_type() == at::kHalf) {
    run(p, m, v, g, out->data_ptr<c10::Half>(), numel, h);
  } else {
    run(p, m, v, g, out->data_ptr<float>(), numel, h);
  }
}

void check(const at::Tensor& t, const char* what, int64_t numel) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), what, ": a contiguous CPU tensor");
  TORCH_CHECK(t.numel() == numel, what, ": ", t.numel(), " elements, the master has ", numel);
}

}  // namespace

void adamw_step(at::Tensor param, at::Tensor grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
                c10::optional<at::Tensor> out, double grad_mul, double lr, double beta1,
                double beta2, double eps, double weight_decay, double inv_bias1,
                double inv_bias2) {
  const int64_t numel = param.numel();
  for (auto [t, what] : {std::pair{param, "param"}, {exp_avg, "exp_avg"},
                         {exp_avg_sq, "exp_avg_sq"}}) {
    check(t, what, numel);
    TORCH_CHECK(t.scalar_type() == at::kFloat, what, ": fp32");
  }
  check(grad, "grad", numel);
  if (out.has_value()) check(*out, "out", numel);
  const Hyper h{static_cast<float>(grad_mul), static_cast<float>(beta1),
                static_cast<float>(1.0 - beta1), static_cast<float>(beta2),
                static_cast<float>(1.0 - beta2), static_cast<float>(inv_bias1),
                static_cast<float>(inv_bias2), static_cast<float>(eps), static_cast<float>(lr),
                static_cast<float>(weight_decay)};
  float* p = param.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  switch (grad.scalar_type()) {
    case at::kFloat: dispatch_out(p, m, v, grad.data_ptr<float>(), out, numel, h); break;
    case at::kBFloat16: dispatch_out(p, m, v, grad.data_ptr<c10::BFloat16>(), out, numel, h); break;
    case at::kHalf: dispatch_out(p, m, v, grad.data_ptr<c10::Half>(), out, numel, h); break;
    default: TORCH_CHECK(false, "grad: fp32, bf16 or fp16, got ", grad.scalar_type());
  }
}

template <typename G>
std::pair<double, int64_t> square_sum_of(const G* g, int64_t numel) {
  // Eight running fp64 sums (element i into sum i % 8), added in order at the end: the same
  // order for the same values wherever they lie, so every tier's norm is the same.
  double sums[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t bad = 0;
  int64_t i = 0;
  for (; i + 8 <= numel; i += 8) {
    for (int j = 0; j < 8; ++j) {
      const float x = static_cast<float>(g[i + j]);
      sums[j] += static_cast<double>(x * x);
      bad += !std::isfinite(x);
    }
  }
  for (int j = 0; i < numel; ++i, ++j) {
    const float x = static_cast<float>(g[i]);
    sums[j] += static_cast<double>(x * x);
    bad += !std::isfinite(x);
  }
  double total = 0;
  for (double s : sums) total += s;
  return {total, bad};
}

std::pair<double, int64_t> square_sum(at::Tensor grad) {
  TORCH_CHECK(grad.device().is_cpu() && grad.is_contiguous(), "grad: a contiguous CPU tensor");
  switch (grad.scalar_type()) {
    case at::kFloat: return square_sum_of(grad.data_ptr<float>(), grad.numel());
    case at::kBFloat16: return square_sum_of(grad.data_ptr<c10::BFloat16>(), grad.numel());
    case at::kHalf: return square_sum_of(grad.data_ptr<c10::Half>(), grad.numel());
    default: TORCH_CHECK(false, "grad: fp32, bf16 or fp16, got ", grad.scalar_type());
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("square_sum", &square_sum, "(fp64 sum of fp32 squares, non-finite count), one pass",
        py::call_guard<py::gil_scoped_release>());
  // Without the GIL: the swap files' I/O threads keep reading and writing while a window steps.
  m.def("adamw_step", &adamw_step, "One-pass AdamW on CPU tensors (moezero.zero.hostadam)",
        py::call_guard<py::gil_scoped_release>());
}
