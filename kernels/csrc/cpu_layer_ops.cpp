// The elementwise parts of a decoder layer as single passes over memory, beside their torch
// references in kernels/torch_layer_ops.py: RMSNorm (with the residual add folded in), SiLU-and-mul
// of a packed gate/up projection, and rotary embeddings applied in place to query and key.
// Each reads its input once and writes its output once, with no temporaries.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "cpu_vec.h"

namespace kvserve {
namespace {

// Rows per parallel task: enough work per task to amortise the hand-off.
constexpr int64_t kRowGrain = 16;

// x * rsqrt(mean(x^2) + eps) in float32, rounded to the model dtype, then times the weight (in the
// model dtype), as HF's RMSNorm does.
template <typename scalar_t>
void norm_row(const float* x, const scalar_t* weight, scalar_t* out, int64_t size, float eps) {
  FloatVec squares = {};
  int64_t i = 0;
  for (; i + kLanes <= size; i += kLanes) squares += load(x + i) * load(x + i);
  float sum = horizontal_sum(squares);
  for (; i < size; ++i) sum += x[i] * x[i];
  const float inv_rms = 1.0f / std::sqrt(sum / static_cast<float>(size) + eps);
  for (int64_t j = 0; j < size; ++j) {
    const scalar_t normed = static_cast<scalar_t>(x[j] * inv_rms);
    out[j] = static_cast<scalar_t>(to_float(weight[j]) * to_float(normed));
  }
}

template <typename scalar_t>
void widen(const scalar_t* in, float* out, int64_t size) {
  for (int64_t j = 0; j < size; ++j) out[j] = to_float(in[j]);
}

// out[r] = norm(x[r]) for each row of x [rows, size] (any row stride).
void rms_norm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.is_contiguous(), "rms_norm: x [rows, size] with unit stride");
  const int64_t size = x.size(1);
  KVSERVE_DISPATCH_MODEL_DTYPES(x.scalar_type(), "rms_norm", [&] {
    const scalar_t* in = x.data_ptr<scalar_t>();
    at::parallel_for(0, x.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
      std::vector<float> row(size);
      for (int64_t r = begin; r < end; ++r) {
        widen(in + r * x.stride(0), row.data(), size);
        norm_row(row.data(), weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>() + r * size, size, float(eps));
      }
    });
  });
}

// residual += x, then x = norm(residual): both in place, so a layer's output and the residual
// stream need no new tensors.
void add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && x.sizes() == residual.sizes(), "add_rms_norm: shapes");
  const int64_t size = x.size(-1);
  KVSERVE_DISPATCH_MODEL_DTYPES(x.scalar_type(), "add_rms_norm", [&] {
    scalar_t* hidden = x.data_ptr<scalar_t>();
    scalar_t* stream = residual.data_ptr<scalar_t>();
    at::parallel_for(0, x.numel() / size, kRowGrain, [&](int64_t begin, int64_t end) {
      std::vector<float> row(size);
      for (int64_t r = begin; r < end; ++r) {
        for (int64_t j = 0; j < size; ++j) {
          const scalar_t sum = static_cast<scalar_t>(to_float(hidden[r * size + j]) + to_float(stream[r * size + j]));
          stream[r * size + j] = sum;
          row[j] = to_float(sum);
        }
        norm_row(row.data(), weight.data_ptr<scalar_t>(), hidden + r * size, size, float(eps));
      }
    });
  });
}

// silu(g) = g / (1 + exp(-g)), through exp of a non-positive argument: e = exp(-|g|), then
// g / (1 + e) for g >= 0 and g e / (1 + e) for g < 0.
inline FloatVec silu(FloatVec g) {
  const FloatVec e = exp_nonpositive(g < 0 ? g : -g);
  return (g < 0 ? g * e : g) / (1.0f + e);
}

// out [rows, n] = silu(x[:, :n]) * x[:, n:] for the packed gate/up output x [rows, 2n].
void silu_and_mul(const at::Tensor& out, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.is_contiguous(), "silu_and_mul: contiguous [rows, 2n]");
  const int64_t n = x.size(1) / 2;
  KVSERVE_DISPATCH_MODEL_DTYPES(x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* in = x.data_ptr<scalar_t>();
    scalar_t* result = out.data_ptr<scalar_t>();
    at::parallel_for(0, x.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* gate = in + r * 2 * n;
        const scalar_t* up = gate + n;
        scalar_t* row = result + r * n;
        int64_t j = 0;
        for (; j + kLanes <= n; j += kLanes) {
          // Rounded to the model dtype between the two, as silu(gate) * up is in torch.
          FloatVec activated = silu(load(gate + j));
          if constexpr (!std::is_same_v<scalar_t, float>) {
            scalar_t rounded[kLanes];
            store(rounded, activated);
            activated = load(rounded);
          }
          store(row + j, activated * load(up + j));
        }
        for (; j < n; ++j) {
          const float g = to_float(gate[j]);
          const scalar_t activated = static_cast<scalar_t>(g / (1.0f + std::exp(-g)));
          row[j] = static_cast<scalar_t>(to_float(activated) * to_float(up[j]));
        }
      }
    });
  });
}

// x = x * cos + rotate_half(x) * sin for each head of x [tokens, heads, head_dim] (any token and
// head strides), with cos/sin [max_positions, head_dim] looked up by each token's position.
template <typename scalar_t>
void rotate(const at::Tensor& x, const int64_t* positions, const float* cos, const float* sin) {
  const int64_t num_heads = x.size(1), head_dim = x.size(2), half = head_dim / 2;
  scalar_t* base = x.data_ptr<scalar_t>();
  at::parallel_for(0, x.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + positions[t] * head_dim;
      const float* s = sin + positions[t] * head_dim;
      for (int64_t h = 0; h < num_heads; ++h) {
        scalar_t* row = base + t * x.stride(0) + h * x.stride(1);
        for (int64_t j = 0; j < half; ++j) {
          const float first = to_float(row[j]), second = to_float(row[j + half]);
          row[j] = static_cast<scalar_t>(first * c[j] - second * s[j]);
          row[j + half] = static_cast<scalar_t>(second * c[j + half] + first * s[j + half]);
        }
      }
    }
  });
}

void rotary_embedding(const at::Tensor& positions, const at::Tensor& query, const at::Tensor& key,
                      const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(), "int64 positions");
  TORCH_CHECK(query.stride(2) == 1 && key.stride(2) == 1, "rotary_embedding: heads must be contiguous rows");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous(), "fp32 tables");
  KVSERVE_DISPATCH_MODEL_DTYPES(query.scalar_type(), "rotary_embedding", [&] {
    rotate<scalar_t>(query, positions.data_ptr<int64_t>(), cos.data_ptr<float>(), sin.data_ptr<float>());
    rotate<scalar_t>(key, positions.data_ptr<int64_t>(), cos.data_ptr<float>(), sin.data_ptr<float>());
  });
}

}  // namespace
}  // namespace kvserve

TORCH_LIBRARY_FRAGMENT(kvserve_cpu, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!) key, Tensor cos, Tensor sin) -> ()");
}

TORCH_LIBRARY_IMPL(kvserve_cpu, CPU, m) {
  m.impl("rms_norm", &kvserve::rms_norm);
  m.impl("add_rms_norm", &kvserve::add_rms_norm);
  m.impl("silu_and_mul", &kvserve::silu_and_mul);
  m.impl("rotary_embedding", &kvserve::rotary_embedding);
}
