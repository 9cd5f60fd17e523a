// edgemtp::rms_norm.out and edgemtp::add_rms_norm.out: Gemma's RMSNorms of a few rows, and the
// residual add around them, as plain kernels between edgemtp's linear and attention kernels.
//
// In a decode step every norm sits between two of edgemtp's kernels, so lowered to XNNPACK each
// group of them is a delegate call of its own (four per layer: the input norm, the q/k/v norms
// and RoPE, the post-attention and pre-feedforward norms, the post-feedforward norm), and a
// delegate call costs its set-up however few elements it computes. These are one loop each.
//
//   rms_norm(x, weight?, eps)                  x * rsqrt(mean(x^2) + eps) [* weight]
//   add_rms_norm(h, y, weight, scale?, eps)    (h + rms_norm(y, weight, eps)) [* scale]
// over the last dimension; float32, contiguous; weight [dim], scale [1] (Gemma's layer scalar).
// edgemtp::head_norm_rope.out is the q, k or v heads of a projection's rows, each normed and
// rotated, in the layout the attention kernel and the cache read:
//   head_norm_rope(x, first_head, heads, kv_heads, head_dim, weight?, cos?, sin?, eps)
//   x    [rows, >= (first_head + heads) * head_dim]  (e.g. the fused Q/K/V product's rows)
//   cos, sin [rows, 1, head_dim] or none            RoPE, rotate-half form
//   out  [kv_heads, heads / kv_heads * rows, head_dim]: head h of row t at h * rows + t
// The mean of squares is summed in float in 16 interleaved partial sums.

#include <cmath>
#include <cstdint>

#include <executorch/extension/kernel_util/make_boxed_from_unboxed_functor.h>
#include <executorch/runtime/kernel/kernel_includes.h>

namespace edgemtp {
namespace {

using executorch::aten::optional;
using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::runtime::KernelRuntimeContext;

constexpr int64_t kLanes = 16;  // partial sums: a vector register's worth, summed at the end

inline float inverse_rms(const float* x, int64_t dim, float eps) {
  float partial[kLanes] = {};
  int64_t d = 0;
  for (; d + kLanes <= dim; d += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) partial[j] += x[d + j] * x[d + j];
  }
  for (; d < dim; ++d) partial[d % kLanes] += x[d] * x[d];
  float sum = 0;
  for (float p : partial) sum += p;
  return 1.0f / std::sqrt(sum / static_cast<float>(dim) + eps);
}

bool float_contiguous(const Tensor& t) {
  return t.scalar_type() == ScalarType::Float && executorch::runtime::tensor_is_contiguous(t);
}

// The checks both kernels share; out takes x's shape. Rows of `dim` = x's last size.
bool prepare(KernelRuntimeContext& ctx, const Tensor& x, const optional<Tensor>& weight,
             Tensor& out) {
  ET_KERNEL_CHECK(ctx, x.dim() >= 1 && float_contiguous(x), InvalidArgument, false);
  const int64_t dim = x.size(x.dim() - 1);
  if (weight.has_value()) {
    ET_KERNEL_CHECK(ctx, float_contiguous(*weight) && weight->numel() == dim, InvalidArgument,
                    false);
  }
  ET_KERNEL_CHECK(ctx, executorch::runtime::resize_tensor(out, x.sizes()) ==
                           executorch::runtime::Error::Ok,
                  InvalidArgument, false);
  return true;
}

}  // namespace

Tensor& rms_norm_out(KernelRuntimeContext& ctx, const Tensor& x, const optional<Tensor>& weight,
                     double eps, Tensor& out) {
  if (!prepare(ctx, x, weight, out)) return out;
  const int64_t dim = x.size(x.dim() - 1), rows = dim ? x.numel() / dim : 0;
  const float* xd = x.const_data_ptr<float>();
  const float* w = weight.has_value() ? weight->const_data_ptr<float>() : nullptr;
  float* od = out.mutable_data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = xd + r * dim;
    float* o = od + r * dim;
    const float inv = inverse_rms(xr, dim, static_cast<float>(eps));
    if (w) {
      for (int64_t d = 0; d < dim; ++d) o[d] = xr[d] * inv * w[d];
    } else {
      for (int64_t d = 0; d < dim; ++d) o[d] = xr[d] * inv;
    }
  }
  return out;
}

Tensor& add_rms_norm_out(KernelRuntimeContext& ctx, const Tensor& h, const Tensor& y,
                         const Tensor& weight, const optional<Tensor>& scale, double eps,
                         Tensor& out) {
  if (!prepare(ctx, y, weight, out)) return out;
  ET_KERNEL_CHECK(ctx, float_contiguous(h) && h.numel() == y.numel(), InvalidArgument, out);
  if (scale.has_value()) {
    ET_KERNEL_CHECK(ctx, float_contiguous(*scale) && scale->numel() == 1, InvalidArgument, out);
  }
  const int64_t dim = y.size(y.dim() - 1), rows = dim ? y.numel() / dim : 0;
  const float* hd = h.const_data_ptr<float>();
  const float* yd = y.const_data_ptr<float>();
  const float* w = weight.const_data_ptr<float>();
  const float s = scale.has_value() ? scale->const_data_ptr<float>()[0] : 1.0f;
  const bool scaled = scale.has_value();
  float* od = out.mutable_data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* yr = yd + r * dim;
    const float* hr = hd + r * dim;
    float* o = od + r * dim;
    const float inv = inverse_rms(yr, dim, static_cast<float>(eps));
    if (scaled) {
      for (int64_t d = 0; d < dim; ++d) o[d] = (hr[d] + yr[d] * inv * w[d]) * s;
    } else {
      for (int64_t d = 0; d < dim; ++d) o[d] = hr[d] + yr[d] * inv * w[d];
    }
  }
  return out;
}

Tensor& head_norm_rope_out(KernelRuntimeContext& ctx, const Tensor& x, int64_t first_head,
                           int64_t heads, int64_t kv_heads, int64_t head_dim,
                           const optional<Tensor>& weight, const optional<Tensor>& cos,
                           const optional<Tensor>& sin, double eps, Tensor& out) {
  ET_KERNEL_CHECK(ctx, x.dim() == 2 && float_contiguous(x), InvalidArgument, out);
  const int64_t rows = x.size(0), width = x.size(1), dim = head_dim;
  ET_KERNEL_CHECK(ctx,
                  first_head >= 0 && heads > 0 && kv_heads > 0 && heads % kv_heads == 0 &&
                      dim > 0 && dim % 2 == 0 && (first_head + heads) * dim <= width,
                  InvalidArgument, out);
  ET_KERNEL_CHECK(ctx, cos.has_value() == sin.has_value(), InvalidArgument, out);
  if (weight.has_value()) {
    ET_KERNEL_CHECK(ctx, float_contiguous(*weight) && weight->numel() == dim, InvalidArgument,
                    out);
  }
  for (const optional<Tensor>* t : {&cos, &sin}) {
    if (t->has_value()) {
      ET_KERNEL_CHECK(ctx, float_contiguous(**t) && (*t)->numel() == rows * dim,
                      InvalidArgument, out);
    }
  }
  const executorch::aten::SizesType sizes[3] = {
      static_cast<executorch::aten::SizesType>(kv_heads),
      static_cast<executorch::aten::SizesType>(heads / kv_heads * rows),
      static_cast<executorch::aten::SizesType>(dim)};
  ET_KERNEL_CHECK(ctx, executorch::runtime::resize_tensor(out, {sizes, 3}) ==
                           executorch::runtime::Error::Ok,
                  InvalidArgument, out);
  const float* xd = x.const_data_ptr<float>();
  const float* w = weight.has_value() ? weight->const_data_ptr<float>() : nullptr;
  const float* c = cos.has_value() ? cos->const_data_ptr<float>() : nullptr;
  const float* s = sin.has_value() ? sin->const_data_ptr<float>() : nullptr;
  float* od = out.mutable_data_ptr<float>();
  const int64_t half = dim / 2;
  float normed[1024];
  ET_KERNEL_CHECK(ctx, dim <= 1024, InvalidArgument, out);
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      const float* xr = xd + t * width + (first_head + h) * dim;
      float* o = od + (h * rows + t) * dim;
      const float inv = inverse_rms(xr, dim, static_cast<float>(eps));
      float* y = c ? normed : o;  // rotated from a copy: out[d] reads y[d +- half]
      for (int64_t d = 0; d < dim; ++d) y[d] = w ? xr[d] * inv * w[d] : xr[d] * inv;
      if (!c) continue;
      const float* ct = c + t * dim;
      const float* st = s + t * dim;
      for (int64_t d = 0; d < half; ++d) o[d] = y[d] * ct[d] - y[d + half] * st[d];
      for (int64_t d = half; d < dim; ++d) o[d] = y[d] * ct[d] + y[d - half] * st[d];
    }
  }
  return out;
}

}  // namespace edgemtp

EXECUTORCH_LIBRARY(edgemtp, "rms_norm.out", edgemtp::rms_norm_out);
EXECUTORCH_LIBRARY(edgemtp, "add_rms_norm.out", edgemtp::add_rms_norm_out);
EXECUTORCH_LIBRARY(edgemtp, "head_norm_rope.out", edgemtp::head_norm_rope_out);
