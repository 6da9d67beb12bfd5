// Per-element accumulators shared by small_fc_lopt and VeLO (reference: lopt/reference/accumulators.py):
// the momentum and rms EMAs, Adafactor's row/column (or full) second moments and their factors, and
// the features both optimizers build from them.
//
// Adafactor of factored tensors takes three launches for every tensor of a step, deterministic
// (fixed-order two-level sums, no atomics), and writes no state: the new R and C live in the factor
// tables until the step is known to be kept (commit_factored_accumulators, in the control phase).
//   adafactor_axis_partials  sums of G = g² + 1e-30 over chunks of one axis      (reads g once per axis)
//   adafactor_finalize       sums the partials in order: the means of G; resets the step's status flags;
//                            max_grad_norm's clip factors (from the same partials, plus a sum over each
//                            clipped tensor that is not factored)
//   adafactor_factor_tables  R and C updated (EMAs), row_col_mean per slab of R, the per-entry tables (and
//                            compact copies of the factors, for the passes that read only those)
#pragma once
#include "common.cuh"

// Decays and their complements, computed once on the host in float32 exactly as the reference
// does, at the start of each group's value block (lopt.fused.engine.pack_decays).
struct Decays {
  float momentum[3], momentum_mix[3];
  float rms, rms_mix;
  float adafactor[3], adafactor_mix[3];
};
static_assert(sizeof(Decays) == 14 * 4 && LOPT_DECAYS_FLOATS >= 14, "Decays fits its slots");

LOPT_DEVICE Decays read_decays(const float* values) {
  Decays d;
#pragma unroll
  for (int k = 0; k < 3; ++k) {
    d.momentum[k] = values[LOPT_GROUP_DECAYS + k];
    d.momentum_mix[k] = values[LOPT_GROUP_DECAYS + 3 + k];
    d.adafactor[k] = values[LOPT_GROUP_DECAYS + 8 + k];
    d.adafactor_mix[k] = values[LOPT_GROUP_DECAYS + 11 + k];
  }
  d.rms = values[LOPT_GROUP_DECAYS + 6];
  d.rms_mix = values[LOPT_GROUP_DECAYS + 7];
  return d;
}

LOPT_DEVICE Decays group_decays(const GroupMeta* groups, const TensorMeta& t) {
  return read_decays(pointer<const float>(groups[t.group].values));
}

LOPT_DEVICE float safe_rsqrt(float x) { return rsqrtf(fmaxf(x, 1e-9f)); }

// beta * acc + (1 - beta) * x, rounded op by op as torch's acc.mul_(beta).add_((1 - beta) * x).
LOPT_DEVICE float ema(float acc, float beta, float one_minus_beta, float x) {
  return __fadd_rn(__fmul_rn(acc, beta), __fmul_rn(one_minus_beta, x));
}

LOPT_DEVICE float adafactor_square(float g) { return __fadd_rn(__fmul_rn(g, g), 1e-30f); }

// ------------------------------------------------------------------------------------------
// Per-element state: momentum (3), rms, and the full Adafactor accumulator V of non-factored tensors
// ------------------------------------------------------------------------------------------
struct ElementState {
  float mom[3];
  float rms;
  float full[3];  // V (unused for factored tensors)
};

template <bool Streamed = false>
LOPT_DEVICE ElementState load_element_state(const TensorMeta& t, i64 e) {
  ElementState s;
  const float* mom = pointer<const float>(t.mom) + e * 3;
  s.mom[0] = element_load<Streamed>(mom); s.mom[1] = element_load<Streamed>(mom + 1); s.mom[2] = element_load<Streamed>(mom + 2);
  s.rms = element_load<Streamed>(pointer<const float>(t.rms) + e);
  if (!t.factored) {
    const float* full = pointer<const float>(t.fac_full) + e * 3;
    s.full[0] = element_load<Streamed>(full); s.full[1] = element_load<Streamed>(full + 1);
    s.full[2] = element_load<Streamed>(full + 2);
  } else {
    s.full[0] = s.full[1] = s.full[2] = 0.f;
  }
  return s;
}

// Element e's per-element arrays (gradient, parameter, momentum, rms, V) requested into L2 ahead of
// their loads (prefetch_l2).
LOPT_DEVICE void prefetch_element(const TensorMeta& t, i64 e) {
  prefetch_l2(pointer<const char>(t.grad) + e * dtype_bytes(static_cast<int>(t.grad_dtype)));
  prefetch_l2(pointer<const char>(t.param) + e * dtype_bytes(static_cast<int>(t.param_dtype)));
  prefetch_l2(pointer<const float>(t.mom) + e * 3);
  prefetch_l2(pointer<const float>(t.rms) + e);
  if (!t.factored) prefetch_l2(pointer<const float>(t.fac_full) + e * 3);
}

template <bool Streamed = false>
LOPT_DEVICE void store_element_state(const TensorMeta& t, i64 e, const ElementState& s) {
  float* mom = pointer<float>(t.mom) + e * 3;
  element_store<Streamed>(mom, s.mom[0]); element_store<Streamed>(mom + 1, s.mom[1]); element_store<Streamed>(mom + 2, s.mom[2]);
  element_store<Streamed>(pointer<float>(t.rms) + e, s.rms);
  if (!t.factored) {
    float* full = pointer<float>(t.fac_full) + e * 3;
    element_store<Streamed>(full, s.full[0]); element_store<Streamed>(full + 1, s.full[1]);
    element_store<Streamed>(full + 2, s.full[2]);
  }
}

// A thread's pair of adjacent elements e, e + 1 (e even), as the statistics passes take them: where
// the tensor's arrays are 8-byte aligned (pairs_aligned) both elements' values come in one load per
// array (a parameter or gradient pair, the rms pair, the six momenta in three 8-byte loads), and
// their factor indices from one division (factor_index_pair). `second`: e + 1 < numel.
// (Both statistics passes measured faster with pairs. VeLO's apply pass measured slower with them: it
// keeps two elements a chunk apart instead, VELO_APPLY_ELEMENTS; docs/performance.md §4 and §6.)
struct ElementPair {
  float grad[2], param[2];  // the gradient unscaled (AMP), not yet clipped
  ElementState state[2];
  bool second;
};

// Whether the tensor's per-element arrays allow pair loads: PyTorch's allocations are aligned, a view
// at an odd offset may not be (V of a factored tensor is empty: a null pointer).
LOPT_DEVICE bool pairs_aligned(const TensorMeta& t) { return ((t.param | t.grad | t.mom | t.rms | t.fac_full) & 7) == 0; }

// Three floats per element (momentum, V) of elements e and e + 1, from three 8-byte loads.
template <bool Streamed>
LOPT_DEVICE void load_three_pair(const float* base, i64 e, float (&first)[3], float (&second)[3]) {
  const float2* p = reinterpret_cast<const float2*>(base + e * 3);
  const float2 x = element_load<Streamed>(p), y = element_load<Streamed>(p + 1), z = element_load<Streamed>(p + 2);
  first[0] = x.x; first[1] = x.y; first[2] = y.x;
  second[0] = y.y; second[1] = z.x; second[2] = z.y;
}

// One element's unscaled gradient (returned), parameter and accumulators, for the apply passes. Every
// load is issued before any loaded value is used: converting or unscaling the gradient before the
// parameter's and the state's loads were issued made a warp wait out the gradient's DRAM latency and
// then theirs, one after the other (it was the apply passes' largest stall; docs/performance.md §4).
// (The statistics passes load pairs, load_element_pair, which the L2 prefetch of the next pair already
// overlaps.) load_element is issue_element_loads then finish_element; a pass with more loads of its own
// to hide under the element's (small_fc_lopt's per-element entry) issues them in between and calls
// hold_uses_until_here before finish_element.
struct IssuedElement {  // an element's loads, issued and not yet used
  unsigned int grad_bits, param_bits;
  ElementState state;
};
template <bool Streamed = false>
LOPT_DEVICE IssuedElement issue_element_loads(const TensorMeta& t, i64 e) {
  IssuedElement in;
  in.grad_bits = load_bits<Streamed>(pointer<const void>(t.grad), e, static_cast<int>(t.grad_dtype));
  in.param_bits = load_bits<Streamed>(pointer<const void>(t.param), e, static_cast<int>(t.param_dtype));
  in.state = load_element_state<Streamed>(t, e);
  return in;
}
// No use of the loaded values moves above this point (each passes through an empty asm statement):
// what a pass issues between issue_element_loads and here overlaps their latency.
LOPT_DEVICE void hold_uses_until_here(IssuedElement& in) {
  ElementState& s = in.state;
  asm volatile("" : "+r"(in.grad_bits), "+r"(in.param_bits), "+f"(s.mom[0]), "+f"(s.mom[1]), "+f"(s.mom[2]),
               "+f"(s.rms), "+f"(s.full[0]), "+f"(s.full[1]), "+f"(s.full[2]));
}
// The loaded values as load_element returns them: the state, the parameter as float, the gradient
// as float and unscaled.
LOPT_DEVICE float finish_element(const TensorMeta& t, const IssuedElement& in, float inverse_scale, float& param,
                                 ElementState& s) {
  s = in.state;
  param = bits_as_float(in.param_bits, static_cast<int>(t.param_dtype));
  return unscale_gradient(bits_as_float(in.grad_bits, static_cast<int>(t.grad_dtype)), inverse_scale);
}
template <bool Streamed = false>
LOPT_DEVICE float load_element(const TensorMeta& t, i64 e, float inverse_scale, float& param, ElementState& s) {
  return finish_element(t, issue_element_loads<Streamed>(t, e), inverse_scale, param, s);
}

// Value e, and e + 1 where `second` (else 0).
template <bool Streamed>
LOPT_DEVICE float2 load_values(const void* base, i64 e, int dtype, bool second, bool vector) {
  return second ? load_pair_as_float<Streamed>(base, e, dtype, vector)
                : make_float2(load_as_float<Streamed>(base, e, dtype), 0.f);
}

template <bool Streamed>
LOPT_DEVICE ElementPair load_element_pair(const TensorMeta& t, i64 e, float inverse_scale, bool aligned) {
  ElementPair pair;
  pair.second = e + 1 < t.numel;
  const bool vector = aligned && pair.second;
  const float2 grad = load_values<Streamed>(pointer<const void>(t.grad), e, static_cast<int>(t.grad_dtype), pair.second, vector);
  const float2 param = load_values<Streamed>(pointer<const void>(t.param), e, static_cast<int>(t.param_dtype), pair.second, vector);
  pair.grad[0] = unscale_gradient(grad.x, inverse_scale);
  pair.grad[1] = unscale_gradient(grad.y, inverse_scale);
  pair.param[0] = param.x;
  pair.param[1] = param.y;
  if (vector) {
    ElementState& s0 = pair.state[0];
    ElementState& s1 = pair.state[1];
    load_three_pair<Streamed>(pointer<const float>(t.mom), e, s0.mom, s1.mom);
    const float2 rms = element_load<Streamed>(reinterpret_cast<const float2*>(pointer<const float>(t.rms) + e));
    s0.rms = rms.x;
    s1.rms = rms.y;
    if (!t.factored) {
      load_three_pair<Streamed>(pointer<const float>(t.fac_full), e, s0.full, s1.full);
    } else {
#pragma unroll
      for (int k = 0; k < 3; ++k) s0.full[k] = s1.full[k] = 0.f;
    }
  } else {
    pair.state[0] = load_element_state<Streamed>(t, e);
    pair.state[1] = pair.second ? load_element_state<Streamed>(t, e + 1) : ElementState{};
  }
  return pair;
}

// The statistics passes' walk over one chunk of LOPT_STATS_CHUNK elements of a tensor: each thread takes
// adjacent pairs, and visit(grad, param, state, factor_index) sees each element it holds (the gradient
// unscaled, the old accumulators; the factor index only for a Factored tensor). `Unroll`: pairs per
// unrolled iteration. `PrefetchPairs` > 0: each thread first requests the arrays of its pair that many
// iterations ahead into L2 (prefetch_element; it may lie in the next chunk, which exists). The loads
// are evict-first (element_load): the pass reads each element once, and both statistics passes
// measured faster with it (docs/performance.md §4).
template <bool Factored, int Unroll, int PrefetchPairs, typename Visit>
LOPT_DEVICE void for_each_chunk_element(const TensorMeta& t, i64 chunk, float inverse_scale, Visit visit) {
  const bool aligned = pairs_aligned(t);
#pragma unroll Unroll
  for (int r = 0; r < LOPT_STATS_PER_THREAD / 2; ++r) {
    const i64 e = chunk * LOPT_STATS_CHUNK + r * 2 * LOPT_STATS_THREADS + 2 * threadIdx.x;
    if (PrefetchPairs > 0 && e + PrefetchPairs * 2 * LOPT_STATS_THREADS < t.numel)
      prefetch_element(t, e + PrefetchPairs * 2 * LOPT_STATS_THREADS);
    if (e < t.numel) {
      ElementPair pair = load_element_pair<true>(t, e, inverse_scale, aligned);
      FactorIndex f[2] = {};
      if (Factored) factor_index_pair(t, e, f);
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        if (n == 1 && !pair.second) break;
        visit(pair.grad[n], pair.param[n], pair.state[n], f[n]);
      }
    }
  }
}

// The statistics pass of every engine, written once: block b takes chunk b − first_stats_chunk of the
// tensor whose chunks it falls in; each thread walks its elements (for_each_chunk_element), tests every
// gradient element for the check phase (gradient_unusable) and adds the optimizer's Stats::kSums statistics
// of it in float32; the block adds the threads' sums in float64 in a fixed order (block_sums) and writes
// them at partials[b · kSums ...], which the optimizer's control kernel sums per tensor in a fixed order.
// The optimizer supplies only its statistics, as a functor (apex's multi_tensor_apply + functor):
//
//   struct Stats {
//     static constexpr int kSums, kUnroll, kPrefetch;  // sums per element; for_each_chunk_element's tuning
//     static constexpr bool kSomeOnlyChecked;           // true: it has bool checked_only() and
//                                                       // bool param_squares_only(), kParamSquares (below)
//     struct Inputs { ... };                            // what its kernel passes through (tables, factors)
//     LOPT_DEVICE Stats(const TensorMeta& t, int tensor, const Decays& decays, const Inputs& inputs);
//     template <bool Factored>                          // one element (gradient unscaled, old state)
//     LOPT_DEVICE void add(float grad, float param, ElementState& s, const FactorIndex& f,
//                          float (&sums)[kSums]) const;
//   };
template <typename Stats, bool Factored>
LOPT_DEVICE bool add_chunk_statistics(const Stats& stats, const TensorMeta& t, i64 chunk, float inverse_scale,
                                      float (&sums)[Stats::kSums]) {
  bool unusable = false;
  for_each_chunk_element<Factored, Stats::kUnroll, Stats::kPrefetch>(t, chunk, inverse_scale, [&](float raw_grad,
                                                                      float param, ElementState& s, const FactorIndex& f) {
    unusable |= gradient_unusable(raw_grad);
    stats.template add<Factored>(raw_grad, param, s, f, sums);
  });
  return unusable;
}

// A chunk of a tensor whose elements the pass only checks (Stats::kSomeOnlyChecked): whether any of its
// gradient elements is unusable, from the gradient alone (its other arrays may not exist).
LOPT_DEVICE bool chunk_gradients_unusable(const TensorMeta& t, i64 chunk, float inverse_scale) {
  bool unusable = false;
  for (int r = 0; r < LOPT_STATS_PER_THREAD; ++r) {
    const i64 e = chunk * LOPT_STATS_CHUNK + r * LOPT_STATS_THREADS + threadIdx.x;
    if (e >= t.numel) break;
    unusable |= gradient_unusable(unscale_gradient(
        load_as_float<true>(pointer<const void>(t.grad), e, static_cast<int>(t.grad_dtype)), inverse_scale));
  }
  return unusable;
}

// A chunk of a tensor whose statistics are its parameters' Σ p² alone (Stats::kSomeOnlyChecked and
// stats.param_squares_only(): CELO2's sliced tensors, whose other statistics celo2_slices forms per slice):
// whether any of its gradient elements is unusable, and Σ p² of its finite parameters added to `sum`, the
// pairs in add_chunk_statistics' order (so the sums are the same), reading the gradient and the parameter only.
LOPT_DEVICE bool chunk_param_squares(const TensorMeta& t, i64 chunk, float inverse_scale, float& sum) {
  const bool aligned = pairs_aligned(t);
  bool unusable = false;
  for (int r = 0; r < LOPT_STATS_PER_THREAD / 2; ++r) {
    const i64 e = chunk * LOPT_STATS_CHUNK + r * 2 * LOPT_STATS_THREADS + 2 * threadIdx.x;
    if (e >= t.numel) break;
    const bool second = e + 1 < t.numel, vector = aligned && second;
    const float2 grad = load_values<true>(pointer<const void>(t.grad), e, static_cast<int>(t.grad_dtype), second, vector);
    const float2 param = load_values<true>(pointer<const void>(t.param), e, static_cast<int>(t.param_dtype), second, vector);
    unusable |= gradient_unusable(unscale_gradient(grad.x, inverse_scale));
    if (is_finite(param.x)) sum = fmaf(param.x, param.x, sum);
    if (second) {
      unusable |= gradient_unusable(unscale_gradient(grad.y, inverse_scale));
      if (is_finite(param.y)) sum = fmaf(param.y, param.y, sum);
    }
  }
  return unusable;
}

// Stats::kSomeOnlyChecked: the optimizer steps some tensors without statistics (CELO2's AdamW branch), whose
// chunks are only checked where stats.checked_only() says so (their sums stay 0), and some with Σ p² alone
// where stats.param_squares_only() says so (at sums[Stats::kParamSquares]; the others stay 0).
template <typename Stats>
LOPT_DEVICE void statistics_pass(const TensorMeta* tensors, const i64* gradients, int num_tensors,
                                 const GroupMeta* groups, const StepFlags& flags, const typename Stats::Inputs& inputs,
                                 double* partials) {
  const i64 block_chunk = blockIdx.x;
  const int tensor = find_row<LOPT_TENSORMETA_FIRST_STATS_CHUNK>(tensors, num_tensors, block_chunk);
  const TensorMeta t = tensor_row(tensors, gradients, tensor);
  const i64 chunk = block_chunk - t.first_stats_chunk;
  const Stats stats(t, tensor, group_decays(groups, t), inputs);
  const float inverse_scale = inverse_grad_scale(flags);
  float sums[Stats::kSums];
#pragma unroll
  for (int j = 0; j < Stats::kSums; ++j) sums[j] = 0.f;
  auto chunk_statistics = [&] {
    return t.factored ? add_chunk_statistics<Stats, true>(stats, t, chunk, inverse_scale, sums)
                      : add_chunk_statistics<Stats, false>(stats, t, chunk, inverse_scale, sums);
  };
  bool unusable;
  if constexpr (Stats::kSomeOnlyChecked) {
    unusable = stats.checked_only()         ? chunk_gradients_unusable(t, chunk, inverse_scale)
               : stats.param_squares_only() ? chunk_param_squares(t, chunk, inverse_scale, sums[Stats::kParamSquares])
                                            : chunk_statistics();
  } else {
    unusable = chunk_statistics();
  }
  report_unusable_gradients(unusable, flags.status);
  double values[Stats::kSums];
#pragma unroll
  for (int j = 0; j < Stats::kSums; ++j) values[j] = sums[j];
  __shared__ double scratch[LOPT_STATS_THREADS / 32][Stats::kSums];
  __shared__ double block[Stats::kSums];
  block_sums<Stats::kSums, LOPT_STATS_THREADS>(values, scratch, block);
  if (threadIdx.x < Stats::kSums) partials[block_chunk * Stats::kSums + threadIdx.x] = block[threadIdx.x];
}

// reference: update_accumulators (momentum, rms; V for non-factored tensors — R and C come from
// the factor tables).
LOPT_DEVICE void update_accumulators(ElementState& s, float grad, const Decays& d, bool factored) {
#pragma unroll
  for (int k = 0; k < 3; ++k) s.mom[k] = ema(s.mom[k], d.momentum[k], d.momentum_mix[k], grad);
  s.rms = ema(s.rms, d.rms, d.rms_mix, __fmul_rn(grad, grad));
  if (!factored) {
#pragma unroll
    for (int k = 0; k < 3; ++k) s.full[k] = ema(s.full[k], d.adafactor[k], d.adafactor_mix[k], adafactor_square(grad));
  }
}

// ------------------------------------------------------------------------------------------
// Factor tables: per R entry {R_k, row_factor_k, rsqrt(R_k + 1e-8)}, per C entry {C_k, col_factor_k,
// rsqrt(C_k + 1e-8)}, each padded to three float4s. The pads hold R_k (C_k) once more: the copy the
// control phase commits to the state, which stays as written where a control phase rescales the
// features' values (small_fc_lopt's feature shifts).
// ------------------------------------------------------------------------------------------
struct FactorEntry { float acc[3], factor[3], rsqrt_acc[3]; };

// A factored tensor's R entries: one per element position without axis d0.
LOPT_DEVICE i64 num_row_entries(const TensorMeta& t) { return t.numel / (t.d0_is_a ? t.a : t.b); }

LOPT_DEVICE FactorEntry read_factor_entry(const float* table, i64 entry) {
  const float4* p = reinterpret_cast<const float4*>(table + entry * LOPT_TABLE_FLOATS);
  float4 x = __ldg(p), y = __ldg(p + 1), z = __ldg(p + 2);
  FactorEntry f;
  f.acc[0] = x.x; f.acc[1] = x.y; f.acc[2] = x.z;
  f.factor[0] = y.x; f.factor[1] = y.y; f.factor[2] = y.z;
  f.rsqrt_acc[0] = z.x; f.rsqrt_acc[1] = z.y; f.rsqrt_acc[2] = z.z;
  return f;
}

// An entry's six table features and two constant ones as BF16 (rounded to nearest), laid out as one
// 8-input k-step of a 16-deep BF16 tensor-core product takes its inputs: word t holds inputs t and t + 4
// of (acc_0, acc_1, acc_2, rsqrt_acc_0, rsqrt_acc_1, rsqrt_acc_2, 1, 1). Precision "fast" of
// small_fc_lopt reads these 16 bytes for an element's per-element entry where the whole entry is 48 (its apply
// pass's first layer takes them as they are); the ones carry that layer's bias.
LOPT_DEVICE uint4 packed_entry_inputs(const float acc[3], const float rsqrt_acc[3]) {
  return make_uint4(pack_bf16x2(acc[0], rsqrt_acc[1]), pack_bf16x2(acc[1], rsqrt_acc[2]), pack_bf16x2(acc[2], 1.f),
                    pack_bf16x2(rsqrt_acc[0], 1.f));
}

// `packed`: where packed_entry_inputs go (nullptr: nowhere; only small_fc_lopt's precision "fast" reads them).
LOPT_DEVICE void write_factor_entry(float* table, float4* factors, uint4* packed, i64 entry, const float acc[3],
                                    const float factor[3]) {
  float4* p = reinterpret_cast<float4*>(table + entry * LOPT_TABLE_FLOATS);
  p[0] = make_float4(acc[0], acc[1], acc[2], acc[0]);
  p[1] = make_float4(factor[0], factor[1], factor[2], acc[1]);
  factors[entry] = make_float4(factor[0], factor[1], factor[2], 0.f);
  const float rsqrt_acc[3] = {rsqrtf(__fadd_rn(acc[0], 1e-8f)), rsqrtf(__fadd_rn(acc[1], 1e-8f)),
                              rsqrtf(__fadd_rn(acc[2], 1e-8f))};
  p[2] = make_float4(rsqrt_acc[0], rsqrt_acc[1], rsqrt_acc[2], acc[2]);
  if (packed != nullptr) packed[entry] = packed_entry_inputs(acc, rsqrt_acc);
}

// An element's R and C table entries, whole.
LOPT_DEVICE void load_factor_entries(const TensorMeta& t, const FactorIndex& f, const float* row_table,
                                     const float* col_table, FactorEntry& row, FactorEntry& col) {
  row = read_factor_entry(row_table, t.row_table + f.row);
  col = read_factor_entry(col_table, t.col_table + f.col);
}

// Only the factors of an element's R and C entries (acc and rsqrt_acc left at zero), from the compact
// copies adafactor_factor_tables also writes: one float4 per entry, so a warp's reads of neighbouring
// entries are contiguous (a third of the cache traffic of reading them out of the whole entries).
LOPT_DEVICE void load_factors(const TensorMeta& t, const FactorIndex& f, const float4* row_factors,
                              const float4* col_factors, FactorEntry& row, FactorEntry& col) {
  const float4 r = __ldg(row_factors + t.row_table + f.row), c = __ldg(col_factors + t.col_table + f.col);
  row = FactorEntry{};
  col = FactorEntry{};
  row.factor[0] = r.x; row.factor[1] = r.y; row.factor[2] = r.z;
  col.factor[0] = c.x; col.factor[1] = c.y; col.factor[2] = c.z;
}

// ------------------------------------------------------------------------------------------
// Features both optimizers build from the accumulators (same order as the reference)
// ------------------------------------------------------------------------------------------

// reference: factored_gradient — g preconditioned by the updated Adafactor accumulators (3 values).
LOPT_DEVICE void factored_gradient(float* x, float grad, const ElementState& s, bool factored, const FactorEntry& row,
                                   const FactorEntry& col) {
#pragma unroll
  for (int k = 0; k < 3; ++k)
    x[k] = factored ? __fmul_rn(__fmul_rn(grad, row.factor[k]), col.factor[k])
                    : __fmul_rn(grad, safe_rsqrt(__fadd_rn(s.full[k], 1e-9f)));
}

// reference: the momentum and RMS features every optimizer takes (MOMENTUM_RMS_FEATURE_NAMES): m_k, v,
// m_k·rsqrt(v + eps), rsqrt(v + eps), into x[0 ... 8), from rsqrt_rms = rsqrt(v + eps) (the caller's eps).
LOPT_DEVICE void moment_features(float* x, const ElementState& s, float rsqrt_rms) {
#pragma unroll
  for (int k = 0; k < 3; ++k) {
    x[k] = s.mom[k];
    x[4 + k] = __fmul_rn(s.mom[k], rsqrt_rms);
  }
  x[3] = s.rms;
  x[7] = rsqrt_rms;
}

// The first 15 features of VeLO and CELO2, in input order: grad, clamp(grad, ±clip), param, the moment
// features, the factored gradient (3), grad·rsqrt(v + eps). They differ in eps (VeLO 1e-6, CELO2 1e-8) and
// the clip (VeLO's constant, CELO2 0.1).
LOPT_DEVICE void gradient_moment_features(float* x, float grad, float param, const ElementState& s, bool factored,
                                          const FactorEntry& row, const FactorEntry& col, float rms_epsilon,
                                          float grad_clip) {
  const float rsqrt_rms = rsqrtf(__fadd_rn(s.rms, rms_epsilon));
  x[0] = grad;
  x[1] = fminf(fmaxf(grad, -grad_clip), grad_clip);
  x[2] = param;
  moment_features(x + 3, s, rsqrt_rms);
  factored_gradient(x + 11, grad, s, factored, row, col);
  x[14] = __fmul_rn(grad, rsqrt_rms);
}

// reference: adafactor_features — the 15 features both optimizers end with: R_k, C_k, rsqrt(R_k + 1e-8),
// rsqrt(C_k + 1e-8), m_k·rf_k·cf_k (non-factored: V_k twice, rsqrt(V_k + 1e-8) twice,
// m_k·(V_k + full_momentum_epsilon)^(-1/2)).
LOPT_DEVICE void adafactor_features(float* x, const ElementState& s, bool factored, const FactorEntry& row,
                                    const FactorEntry& col, float full_momentum_epsilon) {
#pragma unroll
  for (int k = 0; k < 3; ++k) {
    if (factored) {
      x[k] = row.acc[k];
      x[3 + k] = col.acc[k];
      x[6 + k] = row.rsqrt_acc[k];
      x[9 + k] = col.rsqrt_acc[k];
      x[12 + k] = __fmul_rn(__fmul_rn(s.mom[k], row.factor[k]), col.factor[k]);
    } else {
      const float rsqrt_full = rsqrtf(__fadd_rn(s.full[k], 1e-8f));
      x[k] = s.full[k];
      x[3 + k] = s.full[k];
      x[6 + k] = rsqrt_full;
      x[9 + k] = rsqrt_full;
      const float base = full_momentum_epsilon != 0.f ? __fadd_rn(s.full[k], full_momentum_epsilon) : s.full[k];
      x[12 + k] = __fmul_rn(s.mom[k], rsqrtf(base));
    }
  }
}

// The first 12 Adafactor features of a factored tensor are its R and C entries' accumulators and their
// rsqrt: the same value for every element sharing an entry, so the statistics pass leaves their sums of
// squares out and the control phase sums them over the factor tables, each entry counted once per
// element that uses it (an R entry by len(d0) elements, a C entry by len(d1)). This thread's share
// (entries tid, tid + threads, ...), feature order R (3), C (3), rsqrt R (3), rsqrt C (3).
#define LOPT_TABLE_FEATURES 12
LOPT_DEVICE void table_feature_square_sums(const TensorMeta& t, const float* row_table, const float* col_table,
                                           int tid, int threads, double sums[LOPT_TABLE_FEATURES]) {
  const i64 len_d0 = t.d0_is_a ? t.a : t.b, len_d1 = t.d0_is_a ? t.b : t.a;
  double row_sums[6] = {}, col_sums[6] = {};
  for (i64 entry = tid; entry < num_row_entries(t); entry += threads) {
    const FactorEntry r = read_factor_entry(row_table, t.row_table + entry);
#pragma unroll
    for (int k = 0; k < 3; ++k) {  // (non-finite values left out of every sum: finite_part in the reference)
      if (is_finite(r.acc[k])) row_sums[k] += static_cast<double>(__fmul_rn(r.acc[k], r.acc[k]));
      if (is_finite(r.rsqrt_acc[k])) row_sums[3 + k] += static_cast<double>(__fmul_rn(r.rsqrt_acc[k], r.rsqrt_acc[k]));
    }
  }
  for (i64 entry = tid; entry < t.num_col_entries; entry += threads) {
    const FactorEntry c = read_factor_entry(col_table, t.col_table + entry);
#pragma unroll
    for (int k = 0; k < 3; ++k) {
      if (is_finite(c.acc[k])) col_sums[k] += static_cast<double>(__fmul_rn(c.acc[k], c.acc[k]));
      if (is_finite(c.rsqrt_acc[k])) col_sums[3 + k] += static_cast<double>(__fmul_rn(c.rsqrt_acc[k], c.rsqrt_acc[k]));
    }
  }
#pragma unroll
  for (int k = 0; k < 3; ++k) {
    sums[k] = row_sums[k] * static_cast<double>(len_d0);
    sums[3 + k] = col_sums[k] * static_cast<double>(len_d1);
    sums[6 + k] = row_sums[3 + k] * static_cast<double>(len_d0);
    sums[9 + k] = col_sums[3 + k] * static_cast<double>(len_d1);
  }
}

// The control phase of a kept step writes the new R and C from the factor tables (their entries' pads) to
// the state, spread over blocks by entry rather than by tensor (with a block per tensor, a large
// tensor's block set the control phase's duration: docs/performance.md §4). Entries [first, end) of the
// R table (columns false) or the C table, a thread every `threads` entries; a thread finds its first
// entry's tensor by the tensors' first entries (ascending; a tensor without entries shares the next
// one's) and walks on.
template <bool Columns>
LOPT_DEVICE void commit_table_entries(const TensorMeta* tensors, int num_tensors, const float* table, i64 first,
                                      i64 end, int tid, int threads) {
  constexpr int field = Columns ? LOPT_TENSORMETA_COL_TABLE : LOPT_TENSORMETA_ROW_TABLE;
  const auto first_entry = [&](int tensor) {
    return tensor < num_tensors ? reinterpret_cast<const i64*>(tensors + tensor)[field] : i64{0x7fffffffffffffff};
  };
  i64 e = first + tid;
  if (e >= end) return;
  int tensor = find_row<field>(tensors, num_tensors, e);
  i64 base = first_entry(tensor), next = first_entry(tensor + 1);
  float* state = pointer<float>(Columns ? tensors[tensor].fac_col : tensors[tensor].fac_row);
  for (; e < end; e += threads) {
    while (e >= next) {
      ++tensor;
      base = next;
      next = first_entry(tensor + 1);
      state = pointer<float>(Columns ? tensors[tensor].fac_col : tensors[tensor].fac_row);
    }
    const float* entry = table + e * LOPT_TABLE_FLOATS;
    float* acc = state + (e - base) * 3;
    acc[0] = entry[3]; acc[1] = entry[7]; acc[2] = entry[11];
  }
}

// Block `block` of `blocks` commits its share of both tables (commit_table_entries).
LOPT_DEVICE void commit_factored_accumulators(const TensorMeta* tensors, int num_tensors, const float* row_table,
                                              const float* col_table, i64 total_row_entries,
                                              i64 total_col_entries, int block, int blocks, int tid, int threads) {
  commit_table_entries<false>(tensors, num_tensors, row_table, total_row_entries * block / blocks,
                              total_row_entries * (block + 1) / blocks, tid, threads);
  commit_table_entries<true>(tensors, num_tensors, col_table, total_col_entries * block / blocks,
                             total_col_entries * (block + 1) / blocks, tid, threads);
}

// A tensor's R and C values in the factor tables times per-decay factors (powers of two: the fold's
// feature shifts), once the control phase has read them; the factors and rsqrt values stay.
// (row_packed, col_packed: the packed_entry_inputs, formed again from the scaled values; or nullptr.)
LOPT_DEVICE void scale_table_accumulators(const TensorMeta& t, float* row_table, float* col_table, uint4* row_packed,
                                          uint4* col_packed, const float* row_shift, const float* col_shift, int tid,
                                          int threads) {
  const auto scale_entries = [&](float* table, uint4* packed, i64 first, i64 count, const float* shift) {
    for (i64 entry = tid; entry < count; entry += threads) {
      float* acc = table + (first + entry) * LOPT_TABLE_FLOATS;  // (not the pad: the commit reads it meanwhile)
#pragma unroll
      for (int k = 0; k < 3; ++k) acc[k] = __fmul_rn(acc[k], shift[k]);
      if (packed != nullptr) packed[first + entry] = packed_entry_inputs(acc, acc + 8);  // (rsqrt_acc: floats 8 ... 10)
    }
  };
  scale_entries(row_table, row_packed, t.row_table, num_row_entries(t), row_shift);
  scale_entries(col_table, col_packed, t.col_table, t.num_col_entries, col_shift);
}

// ------------------------------------------------------------------------------------------
// What every control and apply kernel shares
// ------------------------------------------------------------------------------------------

// A tensor's per-chunk partial sums of `Count` statistics (the statistics pass writes `Count` per chunk),
// added up in a fixed order by `Lanes` lanes per statistic, plus, for a factored tensor, the table
// features' sums (table_feature_square_sums) at [table_first, table_first + LOPT_TABLE_FEATURES). The
// result is in `sums` (shared) for every thread after the call. `lane_sums` and `table_scratch` are
// the caller's shared scratch.
template <int Count, int Threads, int Lanes>
LOPT_DEVICE void tensor_statistics_sums(const TensorMeta& t, const double* partials, const float* row_table,
                                        const float* col_table, int table_first, double (*lane_sums)[Lanes],
                                        double (*table_scratch)[LOPT_TABLE_FEATURES], double* table_sums,
                                        double* sums) {
  static_assert(Count * Lanes <= Threads, "a thread per (statistic, lane)");
  const int tid = threadIdx.x;
  if (tid < Count * Lanes) {
    const int stat = tid / Lanes, lane = tid % Lanes;
    double s = 0.0;
    for (i64 c = lane; c < t.num_stats_chunks; c += Lanes) s += partials[(t.first_stats_chunk + c) * Count + stat];
    lane_sums[stat][lane] = s;
  }
  if (t.factored) {
    double partial[LOPT_TABLE_FEATURES];
    table_feature_square_sums(t, row_table, col_table, tid, Threads, partial);
    block_sums<LOPT_TABLE_FEATURES, Threads>(partial, table_scratch, table_sums);  // (synchronises)
  }
  __syncthreads();
  if (tid < Count) {
    double s = 0.0;
    for (int lane = 0; lane < Lanes; ++lane) s += lane_sums[tid][lane];
    if (t.factored && tid >= table_first && tid < table_first + LOPT_TABLE_FEATURES) s += table_sums[tid - table_first];
    sums[tid] = s;
  }
  __syncthreads();
}

// The same sums in a control kernel that may run in phases (sharded tensors): from this process's
// partials in phase 0 (whole tensors) and phase 1 (partial sums, for the caller to reduce across
// processes); in phase 2 the reduced totals, read from `reduced` (the tensor's Count values).
template <int Count, int Threads, int Lanes>
LOPT_DEVICE void phase_statistics_sums(int phase, const double* reduced, const TensorMeta& t, const double* partials,
                                       const float* row_table, const float* col_table, int table_first,
                                       double (*lane_sums)[Lanes], double (*table_scratch)[LOPT_TABLE_FEATURES],
                                       double* table_sums, double* sums) {
  if (phase == 2) {
    if (threadIdx.x < Count) sums[threadIdx.x] = reduced[threadIdx.x];
    __syncthreads();
  } else {
    tensor_statistics_sums<Count, Threads, Lanes>(t, partials, row_table, col_table, table_first, lane_sums,
                                                  table_scratch, table_sums, sums);
  }
}

// normalise_features' scale of one feature: rsqrt(1e-5 + mean x²) in float32, as the reference; in
// float64 where the mean is beyond float32 (features of gradients near 2^64).
LOPT_DEVICE float normaliser_scale(double square_sum, i64 count) {
  const double mean = square_sum / static_cast<double>(count);
  const float mean_square = static_cast<float>(mean);
  return is_finite(mean_square) ? rsqrtf(__fadd_rn(1e-5f, mean_square)) : static_cast<float>(1.0 / sqrt(1e-5 + mean));
}

// What the apply pass needs of a tensor's group, read once per tensor a block reaches.
struct ApplyScalars {
  Decays decays;
  float neg_lr, neg_weight_decay_lr, weight_decay, exp_mult, step_mult;
};

LOPT_DEVICE ApplyScalars read_apply_scalars(const GroupMeta& g) {
  const float* values = pointer<const float>(g.values);
  const float lr = *pointer<const float>(g.lr), weight_decay = *pointer<const float>(g.weight_decay);
  return ApplyScalars{read_decays(values), -lr, -__fmul_rn(weight_decay, lr), weight_decay, values[LOPT_GROUP_EXP_MULT],
                      values[LOPT_GROUP_STEP_MULT]};
}

// The optimizer's update rule is a kernel trait (the engine's WEIGHT_DECAY_INSIDE_STEP, passed as a define).
#ifndef LOPT_WEIGHT_DECAY_INSIDE_STEP
#error "build with LOPT_WEIGHT_DECAY_INSIDE_STEP (lopt.fused.engine.FusedEngine.WEIGHT_DECAY_INSIDE_STEP)"
#endif

// reference: apply_update, written back in the parameter's dtype, each product and sum rounded.
//   small_fc_lopt, VeLO: p − lr·u, then p − (weight_decay·lr)·p (the updated value decays);
//   ELO (LOPT_WEIGHT_DECAY_INSIDE_STEP): p − lr·(u + weight_decay·p), the pre-update value inside the step.
LOPT_DEVICE float updated_param(float param, float update, const ApplyScalars& a) {
#if LOPT_WEIGHT_DECAY_INSIDE_STEP
  if (a.weight_decay != 0.f) update = __fadd_rn(update, __fmul_rn(a.weight_decay, param));
  return __fadd_rn(param, __fmul_rn(a.neg_lr, update));
#else
  const float new_param = __fadd_rn(param, __fmul_rn(a.neg_lr, update));
  return a.neg_weight_decay_lr != 0.f ? __fadd_rn(new_param, __fmul_rn(a.neg_weight_decay_lr, new_param)) : new_param;
#endif
}

template <bool Streamed = false>
LOPT_DEVICE void apply_update(const TensorMeta& t, i64 e, float param, float update, const ApplyScalars& a) {
  store_from_float<Streamed>(pointer<void>(t.param), e, static_cast<int>(t.param_dtype), updated_param(param, update, a));
}

// A persistent grid's walk over apply chunks, numbered 0 ... total_chunks − 1 in its own space: block b takes its
// contiguous range of them, tensor by tensor — the tensor lookup, its table row and its group's scalars once
// per tensor it reaches — and hands each tensor's share to visit.begin_tensor(tensor) and
// visit.chunks(t, scalars, tensor, chunk, end, inverse_scale), chunk and end in the tensor table's numbering.
// `find(chunk, first)` names the tensor whose chunks hold `chunk` and, where `OwnNumbering`, sets `first` to its
// first chunk in the walk's numbering (else the walk numbers every tensor's chunks as the tensor table does).
// Chunks ascend, so a block meets its tensors one after the other.
template <bool OwnNumbering, typename Find, typename Visit>
LOPT_DEVICE void walk_chunks(const TensorMeta* tensors, const i64* gradients, const GroupMeta* groups,
                             i64 total_chunks, float inverse_scale, const Find& find, const Visit& visit) {
  const i64 stop = total_chunks * (blockIdx.x + 1) / gridDim.x;
  for (i64 chunk = total_chunks * blockIdx.x / gridDim.x; chunk < stop;) {
    i64 walk_first = 0;
    const int tensor = find(chunk, walk_first);
    visit.begin_tensor(tensor);
    const TensorMeta t = tensor_row(tensors, gradients, tensor);
    const ApplyScalars a = read_apply_scalars(groups[t.group]);
    const i64 base = OwnNumbering ? walk_first : t.first_apply_chunk;
    const i64 end = min(stop, base + t.num_apply_chunks);
    const i64 first = t.first_apply_chunk + (chunk - base);
    visit.chunks(t, a, tensor, first, first + (end - chunk), inverse_scale);
    chunk = end;
  }
}

// walk_chunks over every tensor's apply chunks (apply_pass).
template <typename Visit>
LOPT_DEVICE void walk_apply_chunks(const TensorMeta* tensors, const i64* gradients, int num_tensors,
                                   const GroupMeta* groups, i64 total_chunks, float inverse_scale, const Visit& visit) {
  const auto find = [&](i64 chunk, i64&) {
    return find_row<LOPT_TENSORMETA_FIRST_APPLY_CHUNK>(tensors, num_tensors, chunk);
  };
  walk_chunks<false>(tensors, gradients, groups, total_chunks, inverse_scale, find, visit);
}

// walk_chunks over the chunks of some of the tensors only (`walk`: a ChunkWalk row per tensor, `rows` of them,
// in row order, numbered from 0 to `total_chunks`), so that a pass that steps some kinds of tensor only shares
// their work among all its blocks (over every tensor's chunks, the blocks whose range another kind's tensors
// held would idle while the others ran late).
template <typename Visit>
LOPT_DEVICE void walk_chunks_of(const TensorMeta* tensors, const i64* gradients, const GroupMeta* groups,
                                const ChunkWalk* walk, int rows, i64 total_chunks, float inverse_scale,
                                const Visit& visit) {
  const auto find = [&](i64 chunk, i64& first) {
    const ChunkWalk w = walk[find_row<LOPT_CHUNKWALK_FIRST_CHUNK>(walk, rows, chunk)];
    first = w.first_chunk;
    return static_cast<int>(w.tensor);
  };
  walk_chunks<true>(tensors, gradients, groups, total_chunks, inverse_scale, find, visit);
}

// The apply pass of the engines whose MLP runs one element per thread (VeLO's, small_fc_lopt's for any
// geometry but the tensor cores'), written once: the step's skip decision (nothing is written when it
// skips), the step counters (finish_step, by one thread), and the block's contiguous range of chunks on a
// persistent grid, walked tensor by tensor — the tensor lookup, its table row and its group's scalars
// once per tensor a block reaches. The optimizer's functor does the rest:
//
//   struct Apply {
//     LOPT_DEVICE bool skipped(const StepFlags& flags) const;  // the step's decision (VeLO adds its loss)
//     LOPT_DEVICE void finish(bool skipped) const;              // block 0's threads, before the counters advance
//     LOPT_DEVICE void begin_tensor(int tensor) const;          // every thread, before the tensor's chunks
//     LOPT_DEVICE void chunks(const TensorMeta& t, const ApplyScalars& a, int tensor, i64 chunk, i64 end,
//                             float inverse_scale) const;       // the elements of chunks [chunk, end)
//   };
// (apply_pass_goes_on: the decision and the counters alone, for a pass that walks its chunks its own way.)
template <typename Apply>
LOPT_DEVICE bool apply_pass_goes_on(const GroupMeta* groups, int num_groups, const StepFlags& flags,
                                    i64* skipped_steps, const Apply& apply) {
  const bool skipped = apply.skipped(flags);
  if (blockIdx.x == 0) {
    apply.finish(skipped);  // (every earlier launch has read what it advances)
    if (threadIdx.x == 0) finish_step(groups, num_groups, skipped, flags, skipped_steps);
  }
  return !skipped;  // (skipped: nothing is written)
}
template <typename Apply>
LOPT_DEVICE void apply_pass(const TensorMeta* tensors, const i64* gradients, int num_tensors, const GroupMeta* groups,
                            int num_groups, i64 total_chunks, const StepFlags& flags, i64* skipped_steps,
                            const Apply& apply) {
  if (apply_pass_goes_on(groups, num_groups, flags, skipped_steps, apply))
    walk_apply_chunks(tensors, gradients, num_tensors, groups, total_chunks, inverse_grad_scale(flags), apply);
}

// ------------------------------------------------------------------------------------------
// Adafactor kernels
// ------------------------------------------------------------------------------------------

// What the axis pass does to a gradient before it squares it, per tensor (an engine's
// `gradient_transforms`, a float2 per tensor row): g · factor, then clamped to ±clamp (clamp 0: none).
// CELO2 clips by the global norm before its element clamp (lopt.fused.celo2): the factor comes first.
struct GradientTransform { float factor, clamp; };

LOPT_DEVICE GradientTransform gradient_transform(const float2* transforms, i64 tensor, float gradient_clip) {
  if (transforms == nullptr) return GradientTransform{1.0f, gradient_clip};
  const float2 t = transforms[tensor];
  return GradientTransform{t.x, t.y};
}

// The gradient as Adafactor sees it, from its loaded bits: unscaled, times the transform's factor (exact
// for 1), then clamped (VeLO: ±gradient_clip; CELO2: ±grad_clip_value).
LOPT_DEVICE float adafactor_gradient(unsigned int bits, int dtype, float inverse_scale, const GradientTransform& t) {
  float g = unscale_gradient(bits_as_float(bits, dtype), inverse_scale);
  if (t.factor != 1.0f) g = __fmul_rn(g, t.factor);
  return t.clamp > 0.f ? fminf(fmaxf(g, -t.clamp), t.clamp) : g;
}

// Σ G over the gradient elements src[first + k·stride], k = 0 ... count − 1, added in that order in
// float64. (Loads issued further ahead than the compiler's unrolling made the pass slower: it is
// bound by memory, not by each thread's latency; docs/performance.md §6.)
LOPT_DEVICE double axis_square_sum(const void* src, i64 first, i64 stride, i64 count, int dtype, float inverse_scale,
                                   const GradientTransform& transform) {
  double sum = 0.0;
  for (i64 k = 0; k < count; ++k)
    sum += adafactor_square(adafactor_gradient(load_bits(src, first + k * stride, dtype), dtype, inverse_scale, transform));
  return sum;
}

// Whether an axis sum saw a gradient element that fails the check phase's test (gradient_unusable):
// unclipped (small_fc_lopt), G = g² + 1e-30 in float32 is finite exactly where |g| < 2^64 and g is not
// NaN, and the float64 sum of finite G cannot overflow, so the sum tells. (Testing every element in the
// loop kept the compiler from unrolling it, and the pass measured much slower: docs/performance.md §6.)
// VeLO clips g first, which hides a NaN: its statistics pass alone tests its gradients.
LOPT_DEVICE bool axis_sum_unusable(double sum, const GradientTransform& t) { return t.clamp == 0.f && !isfinite(sum); }

// A warp's report of unusable gradients seen by the axis pass (LOPT_STATUS_AXIS_NONFINITE): every
// element of a tensor with axis jobs is read there. adafactor_finalize moves this flag into the step's
// (LOPT_STATUS_NONFINITE), to which the statistics pass then adds its own test of every gradient
// element; the control and apply passes read the result.
LOPT_DEVICE void report_axis_unusable(bool unusable, int* status) {
  if (__any_sync(0xffffffffu, unusable) && (threadIdx.x & 31) == 0)
    atomicExch(status + LOPT_STATUS_AXIS_NONFINITE, 1);
}

// Partial sums of G in float64 (large finite gradients make G approach float32's largest value).
// Mode 0 (strided axis): a thread per output (q, i) and chunk of x. Mode 1 (contiguous axis): a warp
// per output q and chunk of x, its lanes 32 apart.
extern "C" __global__ void __launch_bounds__(LOPT_AXIS_THREADS)
adafactor_axis_partials(const AxisJob* __restrict__ jobs, int num_jobs, const i64* __restrict__ gradients,
                        double* __restrict__ partials, const float* grad_scale, float gradient_clip,
                        const float2* __restrict__ gradient_transforms, int* status) {
  const AxisJob job = jobs[find_row<LOPT_AXISJOB_FIRST_BLOCK>(jobs, num_jobs, blockIdx.x)];
  const i64 local_block = blockIdx.x - job.first_block;
  const GradientTransform transform = gradient_transform(gradient_transforms, job.tensor, gradient_clip);
  const void* src = pointer<const void>(gradients[job.tensor]);
  const int dtype = static_cast<int>(job.dtype);
  const float inverse_scale = grad_scale != nullptr ? __frcp_rn(*grad_scale) : 1.0f;
  if (job.mode == 0) {
    const i64 col_block = local_block % job.num_col_blocks, chunk = local_block / job.num_col_blocks;
    const i64 out = col_block * LOPT_AXIS_THREADS + threadIdx.x;
    const bool has_output = out < job.num_outputs;  // (every lane reaches the warp's report)
    bool unusable = false;
    if (has_output) {
      const i64 q = out / job.i, i = out - q * job.i;
      const i64 x0 = chunk * job.xchunk, x1 = min(x0 + job.xchunk, job.x);
      const double sum = axis_square_sum(src, (q * job.x + x0) * job.i + i, job.i, x1 - x0, dtype, inverse_scale,
                                         transform);
      partials[job.partial_offset + chunk * job.num_outputs + out] = sum;
      unusable = axis_sum_unusable(sum, transform);
    }
    report_axis_unusable(unusable, status);
  } else {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const i64 item = local_block * (LOPT_AXIS_THREADS / 32) + warp;
    if (item >= job.q * job.num_xchunks) return;
    const i64 q = item / job.num_xchunks, chunk = item - q * job.num_xchunks;
    const i64 x0 = chunk * job.xchunk, x1 = min(x0 + job.xchunk, job.x);
    const i64 count = x1 - x0 > lane ? (x1 - x0 - lane + 31) / 32 : 0;
    double sum = axis_square_sum(src, q * job.x + x0 + lane, 32, count, dtype, inverse_scale, transform);
    report_axis_unusable(axis_sum_unusable(sum, transform), status);
    sum = warp_sum(sum);
    if (lane == 0) partials[job.partial_offset + chunk * job.num_outputs + q] = sum;
  }
}

// Blocks of adafactor_finalize that compute means (at least one: it also resets the status flags);
// the blocks after them are max_grad_norm's, one per NormJob.
LOPT_DEVICE i64 finalize_mean_blocks(i64 total_outputs) {
  return total_outputs > 0 ? (total_outputs + LOPT_FINALIZE_THREADS - 1) / LOPT_FINALIZE_THREADS : 1;
}

// max_grad_norm's clip factor of a tensor (reference: clip_gradient_norm), from Σ g² in float64:
// min(1, (1 / (‖g‖ + 1e-6)) · max_norm) in float32, with ‖g‖ = sqrt(Σ g²) rounded to float32.
LOPT_DEVICE float gradient_clip_factor(double square_sum, float max_norm) {
  const float norm = static_cast<float>(__dsqrt_rn(fmax(square_sum, 0.0)));
  return fminf(__fmul_rn(__frcp_rn(__fadd_rn(norm, 1e-6f)), max_norm), 1.0f);
}

// The mean of G = (c·g)² + 1e-30 from the mean of g² + 1e-30, for a tensor whose gradient is clipped by
// c < 1 (c == 1: unchanged, bit for bit).
LOPT_DEVICE float clipped_square_mean(float mean, float clip_factor) {
  if (clip_factor == 1.0f) return mean;
  return __fadd_rn(__fmul_rn(__fmul_rn(clip_factor, clip_factor), __fsub_rn(mean, 1e-30f)), 1e-30f);
}

// The clip factor of tensor `tensor` (1 where no tensor is clipped).
LOPT_DEVICE float tensor_clip_factor(const float* clip_factors, int tensor) {
  return clip_factors != nullptr ? clip_factors[tensor] : 1.0f;
}

// Mean blocks: a thread per R or C entry: the mean of G (its partials summed in chunk order, / the
// job's divisor: X, or the whole axis's length where this process holds part of it, whose partial
// means the processes then sum), rounded to float32 as the reference's mean is. Thread 0 also resets
// the step's status flags: this launch comes before the statistics pass, the only one that sets them.
// Norm blocks (max_grad_norm), one per clipped tensor: its Σ g² (the job's partials in a fixed
// order, less the 1e-30 each element's G carries), and from it the tensor's clip factor; or, where
// the tensors are split among processes (norm_sums given), the partial Σ g², to be reduced first.
extern "C" __global__ void __launch_bounds__(LOPT_FINALIZE_THREADS)
adafactor_finalize(const AxisJob* __restrict__ jobs, int num_jobs, i64 total_outputs,
                   const double* __restrict__ partials, float* __restrict__ axis_means, int* status,
                   const NormJob* __restrict__ norm_jobs, const TensorMeta* __restrict__ tensors,
                   const GroupMeta* __restrict__ groups, int num_groups, float* __restrict__ clip_factors,
                   double* __restrict__ norm_sums) {
  const i64 mean_blocks = finalize_mean_blocks(total_outputs);
  if (blockIdx.x >= mean_blocks) {
    const NormJob job = norm_jobs[blockIdx.x - mean_blocks];
    double partial[1] = {0.0};
    for (i64 k = threadIdx.x; k < job.num_partials; k += LOPT_FINALIZE_THREADS) partial[0] += partials[job.partial_offset + k];
    __shared__ double scratch[LOPT_FINALIZE_THREADS / 32][1];
    __shared__ double square_sum[1];
    block_sums<1, LOPT_FINALIZE_THREADS>(partial, scratch, square_sum);
    if (threadIdx.x == 0) {
      const TensorMeta t = tensors[job.tensor];
      const float max_norm = pointer<const float>(groups[t.group].values)[LOPT_GROUP_MAX_GRAD_NORM];
      const double sum_of_tiny_terms = static_cast<double>(t.numel) * static_cast<double>(1e-30f);
      if (norm_sums != nullptr) norm_sums[blockIdx.x - mean_blocks] = square_sum[0] - sum_of_tiny_terms;
      else clip_factors[job.tensor] = gradient_clip_factor(square_sum[0] - sum_of_tiny_terms, max_norm);
    }
    return;
  }
  const i64 gid = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (gid == 0) {  // (the axis pass's flag becomes the step's, and is cleared for the next step's)
    const int axis_unusable = status[LOPT_STATUS_AXIS_NONFINITE];
#pragma unroll
    for (int k = 0; k < LOPT_STATUS_INTS; ++k) status[k] = 0;
    status[LOPT_STATUS_NONFINITE] = axis_unusable;
    // A group's lr or weight decay read on the device (a scheduler's tensor) that is NaN, ±inf or negative
    // makes the step unusable like a non-finite gradient: skipped (or raised) before anything is written.
    for (int g = 0; g < num_groups; ++g) {
      const float lr = *pointer<const float>(groups[g].lr), weight_decay = *pointer<const float>(groups[g].weight_decay);
      if (!usable_hyperparameter(lr) || !usable_hyperparameter(weight_decay)) status[LOPT_STATUS_NONFINITE] = 1;
    }
  }
  if (gid >= total_outputs || num_jobs == 0) return;
  const AxisJob job = jobs[find_row<LOPT_AXISJOB_FIRST_OUTPUT>(jobs, num_jobs, gid)];
  const i64 out = gid - job.first_output;
  double sum = 0.0;
  for (i64 c = 0; c < job.num_xchunks; ++c) sum += partials[job.partial_offset + c * job.num_outputs + out];
  axis_means[gid] = static_cast<float>(sum / static_cast<double>(job.divisor));
}

// Blocks [0, total_slabs): one slab of R each (the entries sharing everything but the d1
// coordinate): R updated, row_col_mean_k over the slab (float64), then the slab's row-table entries.
// Blocks after that: a thread per C entry: C updated, the column-table entries.
// Where axis d1 of a tensor is split among processes (t.row_col_sums >= 0), its slab sums are
// partial: `phase` 1 stops after writing them to slab_sums, the caller sums them over the processes,
// and `phase` 2 (the same grid; only those slabs work) forms the factors from the totals. Phase 0:
// one launch, nothing split.
extern "C" __global__ void __launch_bounds__(LOPT_TABLE_THREADS)
adafactor_factor_tables(const TensorMeta* __restrict__ tensors, int num_tensors, const GroupMeta* __restrict__ groups,
                        i64 total_slabs, i64 total_col_entries, const float* __restrict__ axis_means,
                        float* __restrict__ row_table, float* __restrict__ col_table, float4* __restrict__ row_factors,
                        float4* __restrict__ col_factors, uint4* __restrict__ row_packed,
                        uint4* __restrict__ col_packed, const float* __restrict__ clip_factors, int phase,
                        double* __restrict__ slab_sums) {
  if (phase == 2 && blockIdx.x >= total_slabs) return;
  if (blockIdx.x < total_slabs) {
    const int tensor = find_row<LOPT_TENSORMETA_FIRST_SLAB>(tensors, num_tensors, blockIdx.x);
    const TensorMeta t = tensors[tensor];
    const bool split_slab = t.row_col_sums >= 0;
    if (phase == 2 && !split_slab) return;
    const float clip_factor = tensor_clip_factor(clip_factors, tensor);
    const Decays decays = group_decays(groups, t);
    const i64 slab = blockIdx.x - t.first_slab;
    // R as (Q', X', I') with X' the d1 axis: d0 = A leaves (o, m, b, i); d0 = B leaves (o, a, m, i).
    const i64 x_len = t.d0_is_a ? t.b : t.a;
    const i64 i_len = t.d0_is_a ? t.inner : t.mid * t.inner;
    const i64 q = slab / i_len, i = slab - q * i_len;
    const float* old_row = pointer<const float>(t.fac_row);
    double partial[3] = {0.0, 0.0, 0.0};
    for (i64 x = threadIdx.x; x < x_len && phase != 2; x += LOPT_TABLE_THREADS) {
      const i64 entry = (q * x_len + x) * i_len + i;
      const float mean = clipped_square_mean(axis_means[t.row_means + entry], clip_factor);
      float acc[3];
#pragma unroll
      for (int k = 0; k < 3; ++k) {
        acc[k] = ema(old_row[entry * 3 + k], decays.adafactor[k], decays.adafactor_mix[k], mean);
        if (is_finite(acc[k])) partial[k] += acc[k];  // (a non-finite R entry, only from outside, stays in its row)
      }
      float4* slot = reinterpret_cast<float4*>(row_table + (t.row_table + entry) * LOPT_TABLE_FLOATS);
      slot[0] = make_float4(acc[0], acc[1], acc[2], 0.f);  // read back below by the same thread
    }
    __shared__ double warp_sums[LOPT_TABLE_THREADS / 32][3];
    __shared__ double slab_total[3];
    double* split_sums = split_slab ? slab_sums + t.row_col_sums + 3 * slab : nullptr;
    if (phase != 2) {
      block_sums<3, LOPT_TABLE_THREADS>(partial, warp_sums, slab_total);
      if (phase == 1 && split_slab) {
        if (threadIdx.x < 3) split_sums[threadIdx.x] = slab_total[threadIdx.x];
        return;
      }
    } else {
      if (threadIdx.x < 3) slab_total[threadIdx.x] = split_sums[threadIdx.x];
      __syncthreads();
    }
    float row_col_mean[3];
#pragma unroll
    for (int k = 0; k < 3; ++k) row_col_mean[k] = static_cast<float>(slab_total[k] / static_cast<double>(t.row_col_divisor));
    for (i64 x = threadIdx.x; x < x_len; x += LOPT_TABLE_THREADS) {
      const i64 entry = (q * x_len + x) * i_len + i;
      const float4 stored = reinterpret_cast<const float4*>(row_table + (t.row_table + entry) * LOPT_TABLE_FLOATS)[0];
      const float acc[3] = {stored.x, stored.y, stored.z};
      float factor[3];
#pragma unroll
      for (int k = 0; k < 3; ++k) factor[k] = safe_rsqrt(__fdiv_rn(acc[k], __fadd_rn(row_col_mean[k], 1e-9f)));
      write_factor_entry(row_table, row_factors, row_packed, t.row_table + entry, acc, factor);
    }
  } else {
    const i64 gid = (static_cast<i64>(blockIdx.x) - total_slabs) * LOPT_TABLE_THREADS + threadIdx.x;
    if (gid >= total_col_entries) return;
    const int tensor = find_row<LOPT_TENSORMETA_FIRST_COL_ENTRY>(tensors, num_tensors, gid);
    const TensorMeta t = tensors[tensor];
    const Decays decays = group_decays(groups, t);
    const i64 entry = gid - t.first_col_entry;
    const float mean = clipped_square_mean(axis_means[t.col_means + entry], tensor_clip_factor(clip_factors, tensor));
    const float* old_col = pointer<const float>(t.fac_col);
    float acc[3], factor[3];
#pragma unroll
    for (int k = 0; k < 3; ++k) {
      acc[k] = ema(old_col[entry * 3 + k], decays.adafactor[k], decays.adafactor_mix[k], mean);
      factor[k] = safe_rsqrt(acc[k]);
    }
    write_factor_entry(col_table, col_factors, col_packed, t.col_table + entry, acc, factor);
  }
}
