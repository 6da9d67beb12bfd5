// Per-element inputs of an apply pass staged in shared memory ahead of use: a warp's slice of 32
// consecutive elements (gradient, parameter, momentum, rms, V) arrives by bulk copies (bulk_copy.cuh)
// issued by one lane some chunks before the warp computes on it, so the DRAM latency of the next
// chunks overlaps this chunk's work without holding their values in registers.
//
// A slice is staged when all its elements exist and every array of the tensor is 16-byte aligned
// (PyTorch's allocations are; a view at an odd offset may not be); otherwise the warp loads it
// directly, as on GPUs without bulk copies. The issuing lane and the computing warp decide with the
// same function of the same metadata (slice_stageable), so they always agree.
#pragma once
#include "accumulators.cuh"
#include "bulk_copy.cuh"

#define LOPT_SLICE_ELEMENTS 32

// One slice in shared memory, each array as stored (16-bit gradients and parameters fill the first half
// of theirs); momentum and V hold three floats per element, as in global memory.
struct StagedSlice {
  float grad[LOPT_SLICE_ELEMENTS];
  float param[LOPT_SLICE_ELEMENTS];
  float mom[3 * LOPT_SLICE_ELEMENTS];
  float rms[LOPT_SLICE_ELEMENTS];
  float full[3 * LOPT_SLICE_ELEMENTS];
};
// (Each array is a multiple of 16 bytes long, so each starts 16-byte aligned.)
static_assert(LOPT_SLICE_ELEMENTS * sizeof(float) % LOPT_BULK_ALIGNMENT == 0, "every array of a slice is a bulk-copy destination");

// The arrays of the tensor a slice comes from (the issuing lane's copy of what it needs of a TensorMeta
// row), and the apply chunks [first_chunk, end_chunk) of that tensor.
struct SliceSource {
  i64 param, grad, mom, rms, full, numel, first_chunk, end_chunk;
  int param_dtype, grad_dtype;
};

LOPT_DEVICE bool slice_stageable(i64 start, i64 numel, i64 param, i64 grad, i64 mom, i64 rms, i64 full) {
  return start + LOPT_SLICE_ELEMENTS <= numel && ((param | grad | mom | rms | full) & (LOPT_BULK_ALIGNMENT - 1)) == 0;
}
LOPT_DEVICE bool slice_stageable(const TensorMeta& t, i64 start) {
  return LOPT_BULK_COPY && slice_stageable(start, t.numel, t.param, t.grad, t.mom, t.rms, t.fac_full);
}

// The tensor of apply chunk `chunk` (rows sorted by first_apply_chunk), read from the tables.
LOPT_DEVICE SliceSource slice_source(const TensorMeta* tensors, const i64* gradients, int num_tensors, i64 chunk) {
  const int tensor = find_row<LOPT_TENSORMETA_FIRST_APPLY_CHUNK>(tensors, num_tensors, chunk);
  const TensorMeta& t = tensors[tensor];
  SliceSource s;
  s.param = t.param; s.grad = gradients[tensor]; s.mom = t.mom; s.rms = t.rms; s.full = t.fac_full;
  s.numel = t.numel;
  s.first_chunk = t.first_apply_chunk;
  s.end_chunk = t.first_apply_chunk + t.num_apply_chunks;
  s.param_dtype = static_cast<int>(t.param_dtype);
  s.grad_dtype = static_cast<int>(t.grad_dtype);
  return s;
}

#if LOPT_BULK_COPY
// One lane: starts the copies of the slice of elements [start, start + 32) into `slice`; `landed`
// completes its next phase when all have arrived.
LOPT_DEVICE void stage_slice(StagedSlice& slice, unsigned long long* landed, const SliceSource& s, i64 start,
                             unsigned long long policy) {
  const unsigned grad_bytes = LOPT_SLICE_ELEMENTS * dtype_bytes(s.grad_dtype);
  const unsigned param_bytes = LOPT_SLICE_ELEMENTS * dtype_bytes(s.param_dtype);
  const unsigned triple_bytes = 3 * LOPT_SLICE_ELEMENTS * sizeof(float);
  const bool has_full = s.full != 0;  // (V: tensors that are not factored)
  mbarrier_arrive_expect_bytes(
      landed, grad_bytes + param_bytes + triple_bytes + LOPT_SLICE_ELEMENTS * sizeof(float) + (has_full ? triple_bytes : 0));
  bulk_copy(slice.grad, pointer<const char>(s.grad) + start * dtype_bytes(s.grad_dtype), grad_bytes, landed, policy);
  bulk_copy(slice.param, pointer<const char>(s.param) + start * dtype_bytes(s.param_dtype), param_bytes, landed, policy);
  bulk_copy(slice.mom, pointer<const float>(s.mom) + 3 * start, triple_bytes, landed, policy);
  bulk_copy(slice.rms, pointer<const float>(s.rms) + start, LOPT_SLICE_ELEMENTS * sizeof(float), landed, policy);
  if (has_full) bulk_copy(slice.full, pointer<const float>(s.full) + 3 * start, triple_bytes, landed, policy);
}
#endif

// Element `lane` of a landed slice of tensor t: the gradient unscaled (AMP), the parameter, and the
// accumulators before this step, as element_features' loads give them.
LOPT_DEVICE void read_staged_element(const StagedSlice& slice, int lane, const TensorMeta& t, float inverse_scale,
                                     float& grad, float& param, ElementState& s) {
  const int grad_dtype = static_cast<int>(t.grad_dtype), param_dtype = static_cast<int>(t.param_dtype);
  grad = unscale_gradient(grad_dtype == LOPT_F32 ? slice.grad[lane]
                                                 : sixteen_bits_to_float(reinterpret_cast<const unsigned short*>(slice.grad)[lane], grad_dtype),
                          inverse_scale);
  param = param_dtype == LOPT_F32 ? slice.param[lane]
                                  : sixteen_bits_to_float(reinterpret_cast<const unsigned short*>(slice.param)[lane], param_dtype);
#pragma unroll
  for (int k = 0; k < 3; ++k) s.mom[k] = slice.mom[3 * lane + k];
  s.rms = slice.rms[lane];
#pragma unroll
  for (int k = 0; k < 3; ++k) s.full[k] = t.factored ? 0.f : slice.full[3 * lane + k];
}
