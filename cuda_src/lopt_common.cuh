// Shared device code for lopt's fused learned optimizers.
//
// Compiled at run time by NVRTC (through CuPy) and, in CI, by nvcc: no standard headers, no
// fast-math intrinsics. Every floating-point step that mirrors a PyTorch op of the reference uses
// the explicitly rounded intrinsics (__fmul_rn, __fadd_rn, ...) so that the compiler cannot
// contract it into an FMA with a different rounding from the reference.
#pragma once

typedef long long i64;

#define LOPT_DEVICE __device__ __forceinline__

// Parameter and gradient dtypes (lopt.fused.launcher.DTYPE_CODES).
enum LoptDType { LOPT_F32 = 0, LOPT_BF16 = 1, LOPT_F16 = 2 };

LOPT_DEVICE float load_as_float(const void* base, i64 index, int dtype) {
  if (dtype == LOPT_F32) return static_cast<const float*>(base)[index];
  unsigned short bits = static_cast<const unsigned short*>(base)[index];
  if (dtype == LOPT_BF16) return __uint_as_float(static_cast<unsigned int>(bits) << 16);
  float value;
  asm("{ .reg .b16 h; mov.b16 h, %1; cvt.f32.f16 %0, h; }" : "=f"(value) : "h"(bits));
  return value;
}

// Round to nearest even, as torch's .to(bfloat16 / float16) does.
LOPT_DEVICE void store_from_float(void* base, i64 index, int dtype, float value) {
  if (dtype == LOPT_F32) { static_cast<float*>(base)[index] = value; return; }
  unsigned short bits;
  if (dtype == LOPT_BF16) {
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(bits) : "f"(value));
  } else {
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(value));
  }
  static_cast<unsigned short*>(base)[index] = bits;
}

LOPT_DEVICE float safe_rsqrt(float x) { return rsqrtf(fmaxf(x, 1e-9f)); }

// beta * acc + (1 - beta) * x, rounded op by op as torch's acc.mul_(beta).add_((1 - beta) * x).
LOPT_DEVICE float ema(float acc, float beta, float one_minus_beta, float x) {
  return __fadd_rn(__fmul_rn(acc, beta), __fmul_rn(one_minus_beta, x));
}

// Decays and their complements, computed once on the host in float32 exactly as the reference
// does, laid out at the start of the constants buffer (lopt.fused.launcher.pack_decays).
struct Decays {
  float momentum[3], momentum_mix[3];
  float rms, rms_mix;
  float adafactor[3], adafactor_mix[3];
};
#define LOPT_DECAYS_FLOATS 16

LOPT_DEVICE Decays read_decays(const float* constants) {
  Decays d;
#pragma unroll
  for (int k = 0; k < 3; ++k) {
    d.momentum[k] = constants[k];
    d.momentum_mix[k] = constants[3 + k];
    d.adafactor[k] = constants[8 + k];
    d.adafactor_mix[k] = constants[11 + k];
  }
  d.rms = constants[6];
  d.rms_mix = constants[7];
  return d;
}

// ------------------------------------------------------------------------------------------
// Per-tensor metadata, one row of int64 fields per tensor (lopt.fused.launcher.TENSOR_FIELDS).
// A factored tensor (rank >= 2) is viewed as (outer, A, mid, B, inner), where A and B are its
// two factored axes in positional order; d0 (the larger) is A when d0_is_a.
// ------------------------------------------------------------------------------------------
struct TensorMeta {
  i64 param, grad, mom, rms, fac_row, fac_col, fac_full;  // device pointers
  i64 numel, outer, a, mid, b, inner, d0_is_a, factored, param_dtype, grad_dtype;
  i64 first_stats_chunk, num_stats_chunks;   // statistics pass: chunks of LOPT_STATS_CHUNK elements
  i64 first_slab, num_slabs;                 // factor tables: slabs of R (one row_col_mean each)
  i64 first_col_entry, num_col_entries;      // factor tables: entries of C
  i64 row_table, col_table;                  // offsets (entries) into the factor tables
  i64 first_apply_chunk, num_apply_chunks;   // apply pass
};

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
#define LOPT_FIELD_FIRST_STATS_CHUNK 17
#define LOPT_FIELD_FIRST_SLAB 19
#define LOPT_FIELD_FIRST_COL_ENTRY 21
#define LOPT_FIELD_FIRST_APPLY_CHUNK 25

// Indices of an element's Adafactor row (R) and column (C) accumulator entries.
struct FactorIndex { i64 row, col; };

// Index type I: 32-bit division is several times cheaper than 64-bit, so it is used whenever
// the tensor's element count allows.
template <typename I>
LOPT_DEVICE void split_factored_index(const TensorMeta& t, i64 element, i64& without_a, i64& without_b) {
  const I e = static_cast<I>(element);
  if (t.outer == 1 && t.mid == 1 && t.inner == 1) {  // plain matrix: the common case
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

LOPT_DEVICE FactorIndex factor_index(const TensorMeta& t, i64 e) {
  i64 without_a, without_b;
  if (t.numel <= 0xffffffffLL) {
    split_factored_index<unsigned int>(t, e, without_a, without_b);
  } else {
    split_factored_index<unsigned long long>(t, e, without_a, without_b);
  }
  FactorIndex f;
  // R drops axis d0, C drops axis d1.
  f.row = t.d0_is_a ? without_a : without_b;
  f.col = t.d0_is_a ? without_b : without_a;
  return f;
}

// Factor tables: per R entry {R_k, row_factor_k, rsqrt(R_k + 1e-8)}, per C entry {C_k, col_factor_k,
// rsqrt(C_k + 1e-8)}, each padded to three float4s.
#define LOPT_TABLE_FLOATS 12
struct FactorEntry { float acc[3], factor[3], rsqrt_acc[3]; };

LOPT_DEVICE FactorEntry read_factor_entry(const float* table, i64 entry) {
  const float4* p = reinterpret_cast<const float4*>(table + entry * LOPT_TABLE_FLOATS);
  float4 x = __ldg(p), y = __ldg(p + 1), z = __ldg(p + 2);
  FactorEntry f;
  f.acc[0] = x.x; f.acc[1] = x.y; f.acc[2] = x.z;
  f.factor[0] = y.x; f.factor[1] = y.y; f.factor[2] = y.z;
  f.rsqrt_acc[0] = z.x; f.rsqrt_acc[1] = z.y; f.rsqrt_acc[2] = z.z;
  return f;
}

// Only the factors of an entry (acc and rsqrt_acc left at zero): one float4 load instead of three.
LOPT_DEVICE FactorEntry read_factor_entry_factors(const float* table, i64 entry) {
  const float4 y = __ldg(reinterpret_cast<const float4*>(table + entry * LOPT_TABLE_FLOATS) + 1);
  FactorEntry f = {};
  f.factor[0] = y.x; f.factor[1] = y.y; f.factor[2] = y.z;
  return f;
}

LOPT_DEVICE void write_factor_entry(float* table, i64 entry, const float acc[3], const float factor[3]) {
  float4* p = reinterpret_cast<float4*>(table + entry * LOPT_TABLE_FLOATS);
  p[0] = make_float4(acc[0], acc[1], acc[2], 0.f);
  p[1] = make_float4(factor[0], factor[1], factor[2], 0.f);
  p[2] = make_float4(rsqrtf(__fadd_rn(acc[0], 1e-8f)), rsqrtf(__fadd_rn(acc[1], 1e-8f)), rsqrtf(__fadd_rn(acc[2], 1e-8f)), 0.f);
}

// Deterministic warp sum (fixed xor butterfly).
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
