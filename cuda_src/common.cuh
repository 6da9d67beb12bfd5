// Shared device code of lopt's fused learned optimizers: the metadata tables, loads and stores by
// dtype, the gradient as the math sees it (AMP-unscaled), the step's skip decision, fixed-order sums.
//
// Compiled at run time by NVRTC and, in the CPU tests, by nvcc: no standard headers, no fast-math
// intrinsics. Every floating-point step that mirrors a PyTorch op of the reference uses the
// explicitly rounded intrinsics (__fmul_rn, __fadd_rn, ...) so that the compiler cannot contract it
// into an FMA with a different rounding from the reference.
#pragma once
#include "lopt_contract.cuh"  // TensorMeta, AxisJob, GroupMeta and the block sizes (lopt/fused/contract.py)

typedef long long i64;

#define LOPT_DEVICE __device__ __forceinline__

// Parameter and gradient dtypes (lopt.fused.launcher.DTYPE_CODES).
enum LoptDType { LOPT_F32 = 0, LOPT_BF16 = 1, LOPT_F16 = 2 };

// Two floats converted by `conversion` (a cvt to .bf16x2 or .f16x2 from .f32) and packed: `first` in the
// low half (the lower k index of a fragment).
#define LOPT_PACK_X2(name, conversion)                                                  \
  LOPT_DEVICE unsigned name(float first, float second) {                                \
    unsigned packed;                                                                    \
    asm(conversion " %0, %1, %2;" : "=r"(packed) : "f"(second), "f"(first));           \
    return packed;                                                                      \
  }
LOPT_PACK_X2(pack_bf16x2, "cvt.rn.bf16x2.f32")                  // to BF16, to nearest
LOPT_PACK_X2(pack_f16x2, "cvt.rn.f16x2.f32")                    // to FP16, to nearest (as cvt.rn.f16.f32 each)
LOPT_PACK_X2(pack_bf16x2_relu, "cvt.rn.relu.bf16x2.f32")        // max(x, 0) to BF16: the ReLU inside the conversion
LOPT_PACK_X2(pack_f16x2_satfinite, "cvt.rn.satfinite.f16x2.f32")  // to FP16, to nearest, saturating at +-65504
LOPT_PACK_X2(pack_f16x2_relu_satfinite, "cvt.rn.satfinite.relu.f16x2.f32")  // max(x, 0) the same
LOPT_PACK_X2(pack_f16x2_relu_toward_zero, "cvt.rz.satfinite.relu.f16x2.f32")  // max(x, 0) to FP16, toward zero

// A bfloat16 or float16 value's bits as float (exact).
LOPT_DEVICE float sixteen_bits_to_float(unsigned short bits, int dtype) {
  if (dtype == LOPT_BF16) return __uint_as_float(static_cast<unsigned int>(bits) << 16);
  float value;
  asm("{ .reg .b16 h; mov.b16 h, %1; cvt.f32.f16 %0, h; }" : "=f"(value) : "h"(bits));
  return value;
}

// Loads and stores of the per-element arrays (gradients, parameters, state). `Streamed`: evict-first
// (.cs), for passes that touch each element once while the arrays together far exceed L2, so that
// the caches keep what is reused (factor tables, weights). Which passes stream was decided by
// measurement (docs/performance.md §4): the statistics passes and small_fc_lopt's apply pass gain,
// velo_apply and the Adafactor axis sums (whose second read of a gradient hits L2) lose.
template <bool Streamed, typename T>
LOPT_DEVICE T element_load(const T* p) { return Streamed ? __ldcs(p) : *p; }
template <bool Streamed, typename T>
LOPT_DEVICE void element_store(T* p, T v) {
  if (Streamed) __stcs(p, v); else *p = v;
}

// A value's bits as loaded (a 16-bit value in the low half), and those bits as float. Split so that a
// pass can issue all of an element's loads before it converts any: a use of a loaded value between
// two loads makes the warp wait for the first before it issues the second (load_element).
template <bool Streamed = false>
LOPT_DEVICE unsigned int load_bits(const void* base, i64 index, int dtype) {
  if (dtype == LOPT_F32) return __float_as_uint(element_load<Streamed>(static_cast<const float*>(base) + index));
  return element_load<Streamed>(static_cast<const unsigned short*>(base) + index);
}
LOPT_DEVICE float bits_as_float(unsigned int bits, int dtype) {
  return dtype == LOPT_F32 ? __uint_as_float(bits) : sixteen_bits_to_float(static_cast<unsigned short>(bits), dtype);
}

template <bool Streamed = false>
LOPT_DEVICE float load_as_float(const void* base, i64 index, int dtype) {
  return bits_as_float(load_bits<Streamed>(base, index, dtype), dtype);
}

// Values index and index + 1 as float. `vector`: base + index is aligned to two values (the caller
// knows), so one load (8 bytes, or 4 for 16-bit values) reads both.
template <bool Streamed = false>
LOPT_DEVICE float2 load_pair_as_float(const void* base, i64 index, int dtype, bool vector) {
  if (!vector)
    return make_float2(load_as_float<Streamed>(base, index, dtype), load_as_float<Streamed>(base, index + 1, dtype));
  if (dtype == LOPT_F32)
    return element_load<Streamed>(reinterpret_cast<const float2*>(static_cast<const float*>(base) + index));
  const unsigned int bits = __float_as_uint(  // (two 16-bit values, loaded as one 4-byte word)
      element_load<Streamed>(reinterpret_cast<const float*>(static_cast<const unsigned short*>(base) + index)));
  return make_float2(sixteen_bits_to_float(static_cast<unsigned short>(bits & 0xffffu), dtype),
                     sixteen_bits_to_float(static_cast<unsigned short>(bits >> 16), dtype));
}

// Round to nearest even, as torch's .to(bfloat16 / float16) does.
template <bool Streamed = false>
LOPT_DEVICE void store_from_float(void* base, i64 index, int dtype, float value) {
  if (dtype == LOPT_F32) { element_store<Streamed>(static_cast<float*>(base) + index, value); return; }
  unsigned short bits;
  if (dtype == LOPT_BF16) {
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(bits) : "f"(value));
  } else {
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(value));
  }
  element_store<Streamed>(static_cast<unsigned short*>(base) + index, bits);
}

template <typename T>
LOPT_DEVICE T* pointer(i64 address) { return reinterpret_cast<T*>(address); }

LOPT_DEVICE int dtype_bytes(int dtype) { return dtype == LOPT_F32 ? 4 : 2; }

// Whether an array at `address` of `dtype` values can be read and written four values at a time from any
// index that is a multiple of 4 (load_quad_as_float, store_quad_from_float).
LOPT_DEVICE bool quad_aligned(i64 address, int dtype) { return address % (4 * dtype_bytes(dtype)) == 0; }

// Values index ... index + 3 as float, in one load (16 bytes, or 8 for 16-bit values): a pass that reads
// a value per element from several arrays keeps more bytes in flight per instruction (and per register)
// than with four loads. base + index is quad_aligned (the caller checks).
template <bool Streamed = false>
LOPT_DEVICE float4 load_quad_as_float(const void* base, i64 index, int dtype) {
  if (dtype == LOPT_F32)
    return element_load<Streamed>(reinterpret_cast<const float4*>(static_cast<const float*>(base) + index));
  const uint2 bits = element_load<Streamed>(reinterpret_cast<const uint2*>(static_cast<const unsigned short*>(base) + index));
  return make_float4(sixteen_bits_to_float(static_cast<unsigned short>(bits.x & 0xffffu), dtype),
                     sixteen_bits_to_float(static_cast<unsigned short>(bits.x >> 16), dtype),
                     sixteen_bits_to_float(static_cast<unsigned short>(bits.y & 0xffffu), dtype),
                     sixteen_bits_to_float(static_cast<unsigned short>(bits.y >> 16), dtype));
}

// store_from_float of four values at index ... index + 3 (quad_aligned), in one store; each value rounded
// as store_from_float rounds it.
template <bool Streamed = false>
LOPT_DEVICE void store_quad_from_float(void* base, i64 index, int dtype, float4 values) {
  if (dtype == LOPT_F32) {
    element_store<Streamed>(reinterpret_cast<float4*>(static_cast<float*>(base) + index), values);
    return;
  }
  const bool bf16 = dtype == LOPT_BF16;
  const uint2 bits = make_uint2(bf16 ? pack_bf16x2(values.x, values.y) : pack_f16x2(values.x, values.y),
                                bf16 ? pack_bf16x2(values.z, values.w) : pack_f16x2(values.z, values.w));
  element_store<Streamed>(reinterpret_cast<uint2*>(static_cast<unsigned short*>(base) + index), bits);
}

// A float4's values by index (0 ... 3: x, y, z, w), for loops over a quad's elements that the compiler unrolls.
LOPT_DEVICE float& quad_value(float4& q, int k) { return k == 0 ? q.x : k == 1 ? q.y : k == 2 ? q.z : q.w; }
LOPT_DEVICE float quad_value(const float4& q, int k) { return k == 0 ? q.x : k == 1 ? q.y : k == 2 ? q.z : q.w; }

// Asks L2 for the line holding `address` and moves on (no result to wait for). The statistics passes
// issue it for the elements they load next, so that their DRAM latency overlaps the current elements'
// work; only addresses of elements that exist are passed. (The apply passes gained nothing from it:
// docs/performance.md §6.)
LOPT_DEVICE void prefetch_l2(const void* address) { asm volatile("prefetch.global.L2 [%0];" ::"l"(address)); }

// Finite (not NaN, not ±inf), without math.h (NVRTC has none).
LOPT_DEVICE bool is_finite(float x) { return fabsf(x) <= 3.40282347e38f; }
// A learning rate or weight decay the step can use: a finite number >= 0 (NaN fails both tests).
LOPT_DEVICE bool usable_hyperparameter(float x) { return x >= 0.f && x <= 3.40282347e38f; }
#define LOPT_NEGATIVE_INFINITY __int_as_float(0xff800000)

// ------------------------------------------------------------------------------------------
// The step's inputs from GradScaler and the skip decision
// ------------------------------------------------------------------------------------------

// What every pass of a step needs besides its tables: GradScaler's scale and overflow flag (null
// when it does not drive the step) and the step's status flags (LOPT_STATUS_*). Kernels take the
// three pointers as arguments (grad_scale, found_inf, status) and build this.
struct StepFlags {
  const float* grad_scale;
  const float* found_inf;
  int* status;
};

// 1 / grad_scale as GradScaler's unscale_ forms it (exact for its power-of-two scales), else 1.
LOPT_DEVICE float inverse_grad_scale(const StepFlags& flags) {
  return flags.grad_scale != nullptr ? __frcp_rn(*flags.grad_scale) : 1.0f;
}

// A gradient element as the reference's check phase hands it to the math: loaded in float32 and
// unscaled (g * (1/scale), as GradScaler.unscale_ computes it).
LOPT_DEVICE float unscale_gradient(float g, float inverse_scale) {
  return inverse_scale == 1.0f ? g : __fmul_rn(g, inverse_scale);
}

// The check phase's test of one gradient element: NaN, ±inf, or |g| >= 2^64 (its square overflows
// float32, which the second-moment state cannot hold) makes the whole step a no-op.
LOPT_DEVICE bool gradient_unusable(float g) { return !(fabsf(g) < 18446744073709551616.0f); }

// Called by every thread of a warp that checked gradients; one store per warp that saw a bad element.
LOPT_DEVICE void report_unusable_gradients(bool unusable, int* status) {
  if (__any_sync(0xffffffffu, unusable) && (threadIdx.x & 31) == 0)
    atomicExch(status + LOPT_STATUS_NONFINITE, 1);
}

// GradScaler saw an overflow (its step to skip and count, not lopt's).
LOPT_DEVICE bool amp_overflow(const StepFlags& flags) { return flags.found_inf != nullptr && *flags.found_inf != 0.0f; }

// The statistics pass saw an unusable gradient. Valid in every launch after the statistics pass.
LOPT_DEVICE bool unusable_gradients(const StepFlags& flags) {
  return *(volatile const int*)(flags.status + LOPT_STATUS_NONFINITE) != 0;
}

// The step leaves everything untouched when a gradient was unusable or GradScaler saw an overflow.
LOPT_DEVICE bool step_is_skipped(const StepFlags& flags) { return amp_overflow(flags) || unusable_gradients(flags); }

// The last launch of a step: advances every group's step counter, or, for a skipped step, counts it
// in skipped_steps (unless GradScaler's overflow explains it). One thread calls it.
LOPT_DEVICE void finish_step(const GroupMeta* groups, int num_groups, bool skipped, const StepFlags& flags,
                             i64* skipped_steps) {
  if (skipped) {
    if (!amp_overflow(flags)) *skipped_steps += 1;
    return;
  }
  for (int g = 0; g < num_groups; ++g) *pointer<i64>(groups[g].step) += 1;
}

// ------------------------------------------------------------------------------------------
// Table lookups
// ------------------------------------------------------------------------------------------

// The row of a metadata table whose range starting at int64 field `FirstField` holds `index`
// (rows are sorted by that field; a binary search, so one launch covers any number of tensors).
template <int FirstField, typename Row>
LOPT_DEVICE int find_row(const Row* rows, int num_rows, i64 index) {
  int lo = 0, hi = num_rows - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) >> 1;
    i64 first = reinterpret_cast<const i64*>(rows + mid)[FirstField];
    if (first <= index) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Row `tensor` of the tensor table with this step's gradient address in its `grad` field. The
// gradients are new tensors at new addresses every step (PyTorch frees them in zero_grad), so their
// addresses come from an array of their own, one int64 per row (8 bytes a tensor uploaded per step,
// where the table's rows are 272 bytes and change only with the plan).
LOPT_DEVICE TensorMeta tensor_row(const TensorMeta* tensors, const i64* gradients, int tensor) {
  TensorMeta t = tensors[tensor];
  t.grad = gradients[tensor];
  return t;
}

// Indices of an element's Adafactor row (R) and column (C) accumulator entries.
struct FactorIndex { i64 row, col; };

// n / d for n < 2^32 and 1 <= d < 2^32, from reciprocal = ceil(2^64 / d) as int64 bits (0 for d = 1;
// lopt.fused.plan.division_reciprocal): the high 64 bits of n · reciprocal, exact because they exceed
// n / d by less than n / 2^64 < 1 / d. Two multiplications, where a division by a value known only at
// run time takes about twenty instructions.
LOPT_DEVICE unsigned divide_by_reciprocal(unsigned n, i64 reciprocal) {
  const unsigned long long r = static_cast<unsigned long long>(reciprocal);
  if (r == 0) return n;
  const unsigned long long high = static_cast<unsigned long long>(n) * (r >> 32) + __umulhi(n, static_cast<unsigned>(r));
  return static_cast<unsigned>(high >> 32);
}

// Index type I: 32-bit division is several times cheaper than 64-bit, so it is used whenever
// the tensor's element count allows.
template <typename I>
LOPT_DEVICE void split_factored_index(const TensorMeta& t, i64 element, i64& without_a, i64& without_b) {
  const I e = static_cast<I>(element);
  if (t.outer == 1 && t.mid == 1 && t.inner == 1) {  // plain matrix
    const I a = e / static_cast<I>(t.b);
    without_a = static_cast<i64>(e - a * static_cast<I>(t.b));
    without_b = static_cast<i64>(a);
    return;
  }
  const I inner = static_cast<I>(t.inner), len_b = static_cast<I>(t.b), mid = static_cast<I>(t.mid),
          len_a = static_cast<I>(t.a);
  I rest = e / inner;
  const I i = e - rest * inner;
  I next = rest / len_b;
  const I b = rest - next * len_b;
  rest = next / mid;
  const I m = next - rest * mid;
  const I o = rest / len_a;
  const I a = rest - o * len_a;
  without_a = static_cast<i64>(((o * mid + m) * len_b + b) * inner + i);
  without_b = static_cast<i64>(((o * len_a + a) * mid + m) * inner + i);
}

// R drops axis d0, C drops axis d1.
LOPT_DEVICE FactorIndex factor_index_from(const TensorMeta& t, i64 without_a, i64 without_b) {
  return t.d0_is_a ? FactorIndex{without_a, without_b} : FactorIndex{without_b, without_a};
}

LOPT_DEVICE void split_factored_index(const TensorMeta& t, i64 e, i64& without_a, i64& without_b) {
  if (t.plain_index) {  // the common case: one test, and the division by b as two multiplications
    const unsigned q = divide_by_reciprocal(static_cast<unsigned>(e), t.b_reciprocal);
    without_a = static_cast<i64>(static_cast<unsigned>(e) - q * static_cast<unsigned>(t.b));
    without_b = static_cast<i64>(q);
    return;
  }
  if (t.numel <= 0xffffffffLL) {
    split_factored_index<unsigned int>(t, e, without_a, without_b);
  } else {
    split_factored_index<unsigned long long>(t, e, without_a, without_b);
  }
}

LOPT_DEVICE FactorIndex factor_index(const TensorMeta& t, i64 e) {
  i64 without_a, without_b;
  split_factored_index(t, e, without_a, without_b);
  return factor_index_from(t, without_a, without_b);
}

// The indices of elements e and e + 1. In a plain matrix (the common case) e + 1 is the next column
// of e's row, or the first of the next row: one division for the two.
LOPT_DEVICE void factor_index_pair(const TensorMeta& t, i64 e, FactorIndex (&f)[2]) {
  i64 without_a, without_b;
  split_factored_index(t, e, without_a, without_b);
  f[0] = factor_index_from(t, without_a, without_b);
  if (t.outer == 1 && t.mid == 1 && t.inner == 1) {  // without_a: e's column, without_b: its row
    const bool next_row = without_a + 1 == t.b;
    f[1] = factor_index_from(t, next_row ? 0 : without_a + 1, next_row ? without_b + 1 : without_b);
  } else {
    f[1] = factor_index(t, e + 1);
  }
}

// ------------------------------------------------------------------------------------------
// Deterministic sums (fixed xor butterfly within a warp; callers combine warps in a fixed order)
// ------------------------------------------------------------------------------------------
LOPT_DEVICE double warp_sum(double x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}
LOPT_DEVICE float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// Sums `Count` per-thread values over a block of `Threads` threads, in a fixed order; the result is
// valid in `out` (shared) after the call for every thread. `scratch` holds Threads/32 x Count doubles.
template <int Count, int Threads>
LOPT_DEVICE void block_sums(const double (&values)[Count], double (*scratch)[Count], double* out) {
#pragma unroll
  for (int j = 0; j < Count; ++j) {
    const double s = warp_sum(values[j]);
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5][j] = s;
  }
  __syncthreads();
  if (threadIdx.x < Count) {
    double s = 0.0;
    for (int w = 0; w < Threads / 32; ++w) s += scratch[w][threadIdx.x];
    out[threadIdx.x] = s;
  }
  __syncthreads();
}

// A grid's last block to finish (a ticket): thread 0 stores the block's `partial` at `slot`, makes it visible and
// counts the block on `ticket`; true in every thread of the last of `blocks` blocks, which then sees every block's
// partial (read with __ldcg) and resets the ticket for the next launch.
LOPT_DEVICE bool store_partial_and_finish_last(double* slot, double partial, unsigned int* ticket,
                                               unsigned int blocks) {
  __shared__ bool last;
  if (threadIdx.x == 0) {
    *slot = partial;
    __threadfence();  // (the partial is visible before the ticket counts this block)
    last = atomicAdd(ticket, 1u) == blocks - 1;
  }
  __syncthreads();
  if (last) __threadfence();
  return last;
}
