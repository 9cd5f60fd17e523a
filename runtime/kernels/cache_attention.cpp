// edgemtp::cache_attention.out and edgemtp::cache_attention_rows.out: the ExecuTorch operators
// over cache_attention.h's arithmetic (the shapes, and which cache slots it reads, are described
// there): argument checks, the output's size, the cache's storage type. And
// edgemtp::quantize_kv_rows.out: K or V rows as an int8 cache stores them. And the static
// programs' slot bookkeeping (model/primitives.py's `truncated` and `ring_positions`), one
// pass over a context bucket's slots each, where the same in standard ops ran as portable
// kernels at several nanoseconds an element, most of what a wider bucket cost a decode step.

#include <executorch/extension/kernel_util/make_boxed_from_unboxed_functor.h>
#include <executorch/runtime/kernel/kernel_includes.h>

#include "cache_attention.h"

namespace edgemtp {
namespace {

using executorch::aten::ScalarType;
using executorch::aten::optional;
using executorch::aten::Tensor;
using executorch::runtime::KernelRuntimeContext;

Tensor& checked_attention(KernelRuntimeContext& ctx, const Tensor& q, const Tensor& k_cache,
                          const Tensor& v_cache, const optional<Tensor>& k_new,
                          const optional<Tensor>& v_new, const Tensor& mask, Tensor& out,
                          bool by_rows) {
  ET_KERNEL_CHECK(ctx, q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, InvalidArgument,
                  out);
  ET_KERNEL_CHECK(ctx, k_new.has_value() == v_new.has_value() && mask.dim() == 2, InvalidArgument,
                  out);
  const int64_t fresh = k_new.has_value() ? k_new->size(1) : 0;
  const ScalarType cache_type = k_cache.scalar_type();
  ET_KERNEL_CHECK(ctx,
                  q.scalar_type() == ScalarType::Float && mask.scalar_type() == ScalarType::Float &&
                      (cache_type == ScalarType::Float || cache_type == ScalarType::Half ||
                       cache_type == ScalarType::Char) &&
                      v_cache.scalar_type() == cache_type,
                  InvalidArgument, out);
  const int64_t kv_heads = q.size(0), q_rows = q.size(1), dim = q.size(2);
  const int64_t rows = mask.size(0), keys = mask.size(1), cached = keys - fresh;
  const int64_t slots = k_cache.size(1);
  ET_KERNEL_CHECK(ctx, rows > 0 && q_rows % rows == 0 && cached >= 0 && cached <= slots,
                  InvalidArgument, out);
  const int64_t width = cache_type == ScalarType::Char ? dim + attention::kScaleBytes : dim;
  ET_KERNEL_CHECK(ctx,
                  k_cache.size(0) == kv_heads && v_cache.size(0) == kv_heads &&
                      v_cache.size(1) == slots && k_cache.size(2) == width &&
                      v_cache.size(2) == width,
                  InvalidArgument, out);
  for (const optional<Tensor>* t : {&k_new, &v_new}) {
    if (!t->has_value()) continue;
    const Tensor& x = **t;
    ET_KERNEL_CHECK(ctx,
                    x.dim() == 3 && x.scalar_type() == ScalarType::Float &&
                        x.size(0) == kv_heads && x.size(1) == fresh && x.size(2) == dim,
                    InvalidArgument, out);
  }
  const executorch::aten::SizesType row_sizes[2] = {
      static_cast<executorch::aten::SizesType>(rows),
      static_cast<executorch::aten::SizesType>(kv_heads * q_rows / rows * dim)};
  ET_KERNEL_CHECK(ctx,
                  (by_rows ? executorch::runtime::resize_tensor(out, {row_sizes, 2})
                           : executorch::runtime::resize_tensor(out, q.sizes())) ==
                      executorch::runtime::Error::Ok,
                  InvalidArgument, out);

  const float* kn = fresh ? k_new->const_data_ptr<float>() : nullptr;
  const float* vn = fresh ? v_new->const_data_ptr<float>() : nullptr;
  const float* qd = q.const_data_ptr<float>();
  const float* md = mask.const_data_ptr<float>();
  float* od = out.mutable_data_ptr<float>();
  if (cache_type == ScalarType::Char) {
    attention::cache_attention(qd, k_cache.const_data_ptr<int8_t>(),
                               v_cache.const_data_ptr<int8_t>(), kn, vn, md, kv_heads, q_rows,
                               dim, rows, keys, fresh, slots, od, by_rows);
  } else if (cache_type == ScalarType::Half) {
    using executorch::aten::Half;  // IEEE binary16 storage, as Float16
    using attention::Float16;
    attention::cache_attention(qd, reinterpret_cast<const Float16*>(k_cache.const_data_ptr<Half>()),
                               reinterpret_cast<const Float16*>(v_cache.const_data_ptr<Half>()),
                               kn, vn, md, kv_heads, q_rows, dim, rows, keys, fresh, slots, od,
                               by_rows);
  } else {
    attention::cache_attention(qd, k_cache.const_data_ptr<float>(),
                               v_cache.const_data_ptr<float>(), kn, vn, md, kv_heads, q_rows, dim,
                               rows, keys, fresh, slots, od, by_rows);
  }
  return out;
}

}  // namespace

Tensor& cache_attention_out(KernelRuntimeContext& ctx, const Tensor& q, const Tensor& k_cache,
                            const Tensor& v_cache, const optional<Tensor>& k_new,
                            const optional<Tensor>& v_new, const Tensor& mask, Tensor& out) {
  return checked_attention(ctx, q, k_cache, v_cache, k_new, v_new, mask, out, false);
}

Tensor& cache_attention_rows_out(KernelRuntimeContext& ctx, const Tensor& q,
                                 const Tensor& k_cache, const Tensor& v_cache,
                                 const optional<Tensor>& k_new, const optional<Tensor>& v_new,
                                 const Tensor& mask, Tensor& out) {
  return checked_attention(ctx, q, k_cache, v_cache, k_new, v_new, mask, out, true);
}

Tensor& quantize_kv_rows_out(KernelRuntimeContext& ctx, const Tensor& x, Tensor& out) {
  ET_KERNEL_CHECK(ctx, x.dim() == 3 && x.scalar_type() == ScalarType::Float, InvalidArgument,
                  out);
  const int64_t dim = x.size(2), rows = x.size(0) * x.size(1);
  const executorch::aten::SizesType sizes[3] = {
      static_cast<executorch::aten::SizesType>(x.size(0)),
      static_cast<executorch::aten::SizesType>(x.size(1)),
      static_cast<executorch::aten::SizesType>(dim + attention::kScaleBytes)};
  ET_KERNEL_CHECK(ctx,
                  out.scalar_type() == ScalarType::Char &&
                      executorch::runtime::resize_tensor(out, {sizes, 3}) ==
                          executorch::runtime::Error::Ok,
                  InvalidArgument, out);
  const float* xd = x.const_data_ptr<float>();
  int8_t* od = out.mutable_data_ptr<int8_t>();
  for (int64_t r = 0; r < rows; ++r) {
    attention::quantize_row(xd + r * dim, dim, od + r * (dim + attention::kScaleBytes));
  }
  return out;
}

bool positions_out(KernelRuntimeContext& ctx, const Tensor& like, Tensor& out) {
  const bool ok = like.dim() == 1 && like.scalar_type() == ScalarType::Long &&
                  out.scalar_type() == ScalarType::Long &&
                  executorch::runtime::resize_tensor(out, like.sizes()) ==
                      executorch::runtime::Error::Ok;
  ET_KERNEL_CHECK(ctx, ok, InvalidArgument, false);
  return true;
}

// Slot positions at or past `at` (the call's first position: rejected drafts) read as empty.
Tensor& truncate_positions_out(KernelRuntimeContext& ctx, const Tensor& slot_pos, const Tensor& at,
                               Tensor& out) {
  ET_KERNEL_CHECK(ctx, at.numel() == 1 && at.scalar_type() == ScalarType::Long, InvalidArgument,
                  out);
  if (!positions_out(ctx, slot_pos, out)) return out;
  const int64_t first = at.const_data_ptr<int64_t>()[0];
  const int64_t* p = slot_pos.const_data_ptr<int64_t>();
  int64_t* o = out.mutable_data_ptr<int64_t>();
  for (int64_t s = 0; s < slot_pos.numel(); ++s) o[s] = p[s] >= first ? -1 : p[s];
  return out;
}

// The slot positions after a call writes rows at `positions` (consecutive, ending at the last
// row; pads before) into a ring of `slots`: each slot holds the newest position up to the last
// row's that lands in it, where that is not before the first row's, else what it `kept`.
Tensor& ring_positions_out(KernelRuntimeContext& ctx, const Tensor& kept, const Tensor& positions,
                           int64_t slots, Tensor& out) {
  ET_KERNEL_CHECK(ctx,
                  positions.dim() == 1 && positions.numel() > 0 &&
                      positions.scalar_type() == ScalarType::Long && slots > 0,
                  InvalidArgument, out);
  if (!positions_out(ctx, kept, out)) return out;
  const int64_t* rows = positions.const_data_ptr<int64_t>();
  const int64_t last = rows[positions.numel() - 1];
  const int64_t first = *std::min_element(rows, rows + positions.numel());
  const int64_t* k = kept.const_data_ptr<int64_t>();
  int64_t* o = out.mutable_data_ptr<int64_t>();
  for (int64_t s = 0; s < kept.numel(); ++s) {
    int64_t back = (last - s) % slots;  // Python's %: never negative
    if (back < 0) back += slots;
    const int64_t newest = last - back;
    o[s] = newest >= first && s < slots ? newest : k[s];
  }
  return out;
}

}  // namespace edgemtp

EXECUTORCH_LIBRARY(edgemtp, "cache_attention.out", edgemtp::cache_attention_out);
EXECUTORCH_LIBRARY(edgemtp, "cache_attention_rows.out", edgemtp::cache_attention_rows_out);
EXECUTORCH_LIBRARY(edgemtp, "quantize_kv_rows.out", edgemtp::quantize_kv_rows_out);
EXECUTORCH_LIBRARY(edgemtp, "truncate_positions.out", edgemtp::truncate_positions_out);
EXECUTORCH_LIBRARY(edgemtp, "ring_positions.out", edgemtp::ring_positions_out);
