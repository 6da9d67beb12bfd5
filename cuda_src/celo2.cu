// CELO2 and ELO-CELO2, fused (reference: lopt/reference/celo2.py; the decisions: docs/celo2.md §8).
//
// One step, after the shared accumulate phase (adafactor_axis_partials with each tensor's gradient
// transform — the global clip factor, then the element clamp —, adafactor_finalize, adafactor_factor_tables):
//
//   celo2_gradient_norm  (only where a group clips) Σ g² per chunk of every gradient, for the global norm,
//                        and the check phase's test of every gradient element; before the accumulate phase,
//                        which needs the clip factor the engine forms from these sums
//   celo2_statistics     the learned tensors' per_element_features → Σ x² per feature (but the 12 table
//                        features'), and Σ p²; the check phase's test of every gradient element
//   celo2_control        per learned tensor the features' normaliser scales (the table features' sums over
//                        the R and C entries) and param_scale; per AdamW tensor
//                        its bias corrections; a kept step's new R and C written to the state
//   celo2_slices         the sliced tensors (conv kernels): each small slice of their last two axes stepped
//                        whole by one thread, features to the parameter's update
//   celo2_table_features per R and C entry of a learned matrix, its table features' share of the first layer
//                        (normalised, times their first-layer weights; R's with the first layer's bias)
//   celo2_mlp            features, normalisation, the MLP, the proposed step (direction · exp(exp_mult ·
//                        magnitude), · param_scale) written to its place in its Newton–Schulz stack (the
//                        tensor's matrix as it lies in memory), and per block and tensor Σ s² of them; the
//                        learned tensors' accumulators stored
//   celo2_normalise      per matrix to orthogonalise: its norm plus ns_eps from the MLP pass's segment sums, and
//                        the matrix divided by it, into Newton–Schulz's workspace (a matrix of one row or
//                        column: its whole iteration, a scalar recurrence); precision="fast": the MLP pass
//                        wrote the input undivided, and the first polynomial's coefficients are written instead
//   (torch)              Newton–Schulz's products on each stack of same-shaped matrices (fast: the first
//                        polynomial by celo2_first_polynomial, which divides by the norm)
//   celo2_matrix_sums    per learned tensor: Σ s² of its final step → its two scale factors
//   celo2_adamw          the AdamW branch (CELO2's own moments, ELO-CELO2's shared accumulators)
//   celo2_apply          u = rms_mult · s · scale, p ← p − lr·(u + weight_decay·p); the step counters
//
// The MLP, AdamW and apply passes each walk the chunks of the tensors they step only (walk_chunks_of), so that
// their persistent grids share that work evenly.
//
// Learned tensors of rank >= 3 with several slices of their last two axes (normalised per slice): where the
// slices are small and contiguous (a conv kernel's kh x kw), celo2_slices steps each slice whole, after the
// control phase (celo2_slices.cuh); the others are stepped by the reference functions on the device
// (lopt.fused.celo2, "elsewhere"): the kernels only check their gradients. Nothing is written to parameters or
// state before the step is known to be kept.
#include "common.cuh"
#include "accumulators.cuh"
#include "split_mma.cuh"

// The network is data (lopt.network.MLPGeometry.cuda_defines, prefix C2_MLP): 30 inputs, hidden layers of
// C2_MLP_HIDDEN units, 3 outputs (direction, magnitude, and one no update reads), PyTorch's out x in layout.
#ifndef C2_MLP_HIDDEN
#error "build celo2.cu with its network's geometry: lopt.fused.celo2.kernel_defines"
#endif
// The packed network passed by value (a kernel parameter, lopt.fused.celo2.NETWORK_PARAMETER_BYTES at most):
// kernel parameters lie in a constant bank, so each of the MLP's multiply-adds reads its weight as an operand,
// with no load instruction (a broadcast load per weight from global memory made the MLP pass issue-bound).
struct Celo2Network {
  float w[C2_MLP_FLOATS];
};
#define C2_FEATURES 30
static_assert(C2_MLP_INPUTS == C2_FEATURES && C2_MLP_OUTPUTS == 3, "CELO2's MLP takes 30 inputs and gives 3 outputs");
static_assert(LOPT_CELO2_SUMS == C2_FEATURES + 1, "the statistics: the features' sums of squares, then Σp²");
#define C2_HIDDEN C2_MLP_HIDDEN
#define C2_CONTROL_THREADS 256
#define C2_CONTROL_LANES 8  // lanes per statistic adding a tensor's statistics chunks' partials in celo2_control
#define C2_APPLY_THREADS 128
#define C2_APPLY_CHUNK C2_APPLY_THREADS  // one element per thread of a block (the engine reads it: the walks)
#define C2_APPLY_ELEMENTS 4  // chunks a thread of celo2_apply loads at once (a learned tensor's, element by element)
#define C2_NORMALISE_QUADS 2  // quads a thread of celo2_normalise loads at once
// Blocks of celo2_adamw per SM: a thread's quad of a shared-accumulator tensor holds up to 36 loaded values.
#define C2_ADAMW_BLOCKS 4
#define C2_APPLY_QUADS 2  // quads (4 consecutive elements) a thread of celo2_apply loads at once (a learned tensor's)
// Blocks of celo2_apply per SM (64 registers, a few spilled): the pass waits on DRAM, and the warps this
// occupancy adds hide more of that wait than the spills cost (docs/performance.md §8).
#define C2_APPLY_BLOCKS 8
#define C2_MLP_PREFETCH 2  // chunks ahead the MLP pass requests its next elements into L2
// precision="fast" (lopt.fused.celo2.kernel_defines): the MLP pass writes each matrix's proposed step straight
// into Newton–Schulz's bfloat16 workspace, not divided by its norm (which the pass cannot know yet); the first
// polynomial divides instead (celo2_normalise's coefficients, celo2_first_polynomial). docs/celo2.md §8.1.
#ifndef C2_DIRECT_WORK
#define C2_DIRECT_WORK 0
#endif
// Per learned tensor, the features' scales: (x · scale[j]) · unshift[j] (normalise_by_square_sums' two factors).
#define C2_SCALES 64  // (the engine reads it: the workspace)
#define C2_UNSHIFT 32
// A factored tensor's features from its R and C entries alone (groups 10–13: R_k, C_k, rsqrt(R_k + 1e-8),
// rsqrt(C_k + 1e-8)): inputs [C2_TABLE_FIRST, C2_TABLE_END), R's at C2_TABLE_FIRST + {0, 1, 2, 6, 7, 8}, C's at
// C2_TABLE_FIRST + {3, 4, 5, 9, 10, 11}. The element's own features: the rest (C2_ELEMENT_FEATURES of them).
#define C2_TABLE_FIRST 15
#define C2_TABLE_END 27
#define C2_ELEMENT_FEATURES (C2_FEATURES - (C2_TABLE_END - C2_TABLE_FIRST))
// Per R or C entry of a learned matrix (celo2_table_features): its share of the first layer's pre-activations
// (C2_HIDDEN floats), then its three Adafactor factors; C2_ENTRY_FLOATS (lopt.fused.celo2.entry_floats) a
// multiple of 4, read as float4s.
#ifndef C2_ENTRY_FLOATS
#error "build celo2.cu with its entry size: lopt.fused.celo2.kernel_defines"
#endif
static_assert(C2_ENTRY_FLOATS % 4 == 0 && C2_ENTRY_FLOATS >= C2_HIDDEN + 3, "an entry: the shares, then 3 factors");

// reference: clip_gradient — the unscaled gradient times the global clip factor (exact for 1), clamped
// to ±grad_clip_value. `transform`: the tensor's (factor, clamp), as the axis pass applied it.
LOPT_DEVICE float step_gradient(float unscaled, float2 transform) {
  const float g = transform.x != 1.0f ? __fmul_rn(unscaled, transform.x) : unscaled;
  return fminf(fmaxf(g, -transform.y), transform.y);
}

// A proposed step as Newton–Schulz's direct bfloat16 input takes it (C2_DIRECT_WORK, stored rounded to nearest
// even): a finite value beyond bfloat16's largest saturated to it (a finite step stays finite: only non-finite
// ones take celo2_normalise's repair), a non-finite one kept (±inf as itself, NaN as NaN).
#define C2_BF16_MAX 3.38953139e38f
LOPT_DEVICE float saturated_for_bf16(float x) {
  return is_finite(x) ? fminf(fmaxf(x, -C2_BF16_MAX), C2_BF16_MAX) : x;
}

LOPT_DEVICE const double* group_values(const double* celo2_groups, i64 group) {
  return celo2_groups + group * LOPT_CELO2_GROUP_DOUBLES;
}

// Input j of the MLP that an element's own feature i is (C2_ELEMENT_FEATURES of them: the table features left out).
LOPT_DEVICE constexpr int element_input(int i) { return i < C2_TABLE_FIRST ? i : i + (C2_TABLE_END - C2_TABLE_FIRST); }

// reference: per_element_features, less the table features (an element's R and C entries' values, which the
// control phase sums over the tables and celo2_table_features multiplies into the first layer once per entry):
// from the step's gradient, the pre-update parameter, the updated accumulators and the element's factors, groups
// grad, clamp(grad, ±0.1), param, m_k, v, m_k·rsqrt(v + 1e-8), rsqrt(v + 1e-8), the factored gradient (3),
// grad·rsqrt(v + 1e-8) (inputs 0–14), then for a factored tensor m_k·rf_k·cf_k (inputs 27–29; else 0).
LOPT_DEVICE void element_features(float grad, float param, const ElementState& s, bool factored,
                                  const FactorEntry& row, const FactorEntry& col, float (&x)[C2_ELEMENT_FEATURES]) {
  gradient_moment_features(x, grad, param, s, factored, row, col, 1e-8f, 0.1f);
#pragma unroll
  for (int k = 0; k < 3; ++k)
    x[C2_TABLE_FIRST + k] = factored ? __fmul_rn(__fmul_rn(s.mom[k], row.factor[k]), col.factor[k]) : 0.f;
}

// ------------------------------------------------------------------------------------------
// Check: the global norm's sums
// ------------------------------------------------------------------------------------------

// One thread's share of a stats chunk for the global norm: Σ g² of the unscaled gradient in float32, element by
// element in index order, and whether any element is unusable. Elements first + 4·(q·LOPT_STATS_THREADS + lane)
// + i (q < C2_NORM_QUADS, i < 4): each quad read in one load (quad_aligned gradients), all of a thread's loads
// issued before any is used — one 4-byte load in flight a thread at a time left the pass waiting on DRAM.
// `Dtype`: the gradient's, fixed at compile time so that no per-load branch orders the loads.
#define C2_NORM_QUADS (LOPT_STATS_PER_THREAD / 4)
static_assert(LOPT_STATS_PER_THREAD % 4 == 0, "a thread's share of a stats chunk: whole quads");
template <int Dtype>
LOPT_DEVICE float chunk_square_sum(const void* grad, i64 first, i64 numel, float inverse_scale, bool& unusable) {
  float4 x[C2_NORM_QUADS];
#pragma unroll
  for (int q = 0; q < C2_NORM_QUADS; ++q) {
    const i64 e = first + 4 * (q * LOPT_STATS_THREADS + threadIdx.x);
    if (e + 4 <= numel) x[q] = load_quad_as_float<true>(grad, e, Dtype);
  }
  float sum = 0.f;
#pragma unroll
  for (int q = 0; q < C2_NORM_QUADS; ++q) {
    const i64 e = first + 4 * (q * LOPT_STATS_THREADS + threadIdx.x);
    if (e + 4 <= numel) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float g = unscale_gradient(quad_value(x[q], i), inverse_scale);
        unusable |= gradient_unusable(g);
        sum = fmaf(g, g, sum);
      }
    } else {
      for (i64 i = e; i < numel; ++i) {  // (the tensor's last, partial quad)
        const float g = unscale_gradient(load_as_float<true>(grad, i, Dtype), inverse_scale);
        unusable |= gradient_unusable(g);
        sum = fmaf(g, g, sum);
      }
    }
  }
  return sum;
}

// Block b: stats chunk b of every tensor (all kinds): Σ g² of the unscaled gradient, float32 per thread,
// float64 per block in a fixed order; and the check phase's test of each element, reported as the axis
// pass reports it (adafactor_finalize, which runs after this, makes it the step's flag). The last block to
// finish (a ticket, as celo2_matrix_sums') adds every block's partial in a fixed order (the same sum every run)
// and forms the clip (reference global_norm, clip_scale): ‖g‖ = float32(√Σ), and for each tensor row whose
// group clips, max_norm / max(‖g‖, max_norm) (NaN where ‖g‖ is, as torch.maximum), else 1, into its gradient
// transform's factor. (In torch after this pass, the sum, the square root, the maximum, the division and the
// choice were seven more launches, ahead of the accumulate phase.)
extern "C" __global__ void __launch_bounds__(LOPT_STATS_THREADS)
celo2_gradient_norm(const TensorMeta* __restrict__ tensors, const i64* __restrict__ gradients, int num_tensors,
                    const float* grad_scale, int* status, double* __restrict__ norm_partials,
                    unsigned int* __restrict__ norm_ticket, const bool* __restrict__ clips,
                    const float* __restrict__ max_norms, float2* __restrict__ gradient_transforms) {
  const i64 block_chunk = blockIdx.x;
  const int tensor = find_row<LOPT_TENSORMETA_FIRST_STATS_CHUNK>(tensors, num_tensors, block_chunk);
  const TensorMeta t = tensor_row(tensors, gradients, tensor);
  const i64 chunk = block_chunk - t.first_stats_chunk;
  const float inverse_scale = grad_scale != nullptr ? __frcp_rn(*grad_scale) : 1.0f;
  const void* grad = pointer<const void>(t.grad);
  const int dtype = static_cast<int>(t.grad_dtype);
  float sum = 0.f;
  bool unusable = false;
  if (quad_aligned(t.grad, dtype)) {
    const i64 first = chunk * LOPT_STATS_CHUNK;
    sum = dtype == LOPT_F32    ? chunk_square_sum<LOPT_F32>(grad, first, t.numel, inverse_scale, unusable)
          : dtype == LOPT_BF16 ? chunk_square_sum<LOPT_BF16>(grad, first, t.numel, inverse_scale, unusable)
                               : chunk_square_sum<LOPT_F16>(grad, first, t.numel, inverse_scale, unusable);
  } else {  // (a gradient view not aligned to four elements: element by element)
    for (int r = 0; r < LOPT_STATS_PER_THREAD; ++r) {
      const i64 e = chunk * LOPT_STATS_CHUNK + r * LOPT_STATS_THREADS + threadIdx.x;
      if (e >= t.numel) break;
      const float g = unscale_gradient(load_as_float<true>(grad, e, dtype), inverse_scale);
      unusable |= gradient_unusable(g);
      sum = fmaf(g, g, sum);
    }
  }
  report_axis_unusable(unusable, status);
  double values[1] = {static_cast<double>(sum)};
  __shared__ double scratch[LOPT_STATS_THREADS / 32][1];
  __shared__ double total[1];
  block_sums<1, LOPT_STATS_THREADS>(values, scratch, total);
  if (!store_partial_and_finish_last(norm_partials + block_chunk, total[0], norm_ticket, gridDim.x)) return;
  double partial = 0.0;
  for (i64 k = threadIdx.x; k < gridDim.x; k += LOPT_STATS_THREADS) partial += __ldcg(norm_partials + k);
  values[0] = partial;
  block_sums<1, LOPT_STATS_THREADS>(values, scratch, total);
  const float norm = static_cast<float>(sqrt(total[0]));
  for (int row = threadIdx.x; row < num_tensors; row += LOPT_STATS_THREADS) {
    const float limit = max_norms[row];
    gradient_transforms[row].x = clips[row] ? __fdiv_rn(limit, isnan(norm) || norm > limit ? norm : limit) : 1.0f;
  }
  if (threadIdx.x == 0) *norm_ticket = 0u;
}

// ------------------------------------------------------------------------------------------
// Statistics
// ------------------------------------------------------------------------------------------

// The statistics pass (statistics_pass in accumulators.cuh), block b: stats chunk b. A learned tensor's elements:
// the accumulators updated (not stored), the features, and the sums of their squares (non-finite values, of a
// non-finite parameter or state element, left out: finite_part) and of the parameter's; a sliced tensor's: only
// Σ p² (param_scale's: its features' sums are per slice, celo2_slices'); an AdamW tensor's: only the check
// phase's test (checked_only). The table features' sums stay 0: celo2_control sums them over the
// tables. Each thread takes its elements in pairs and asks L2 for its next pair ahead of use (the shared walk,
// for_each_chunk_element), as small_fc_lopt's and VeLO's statistics passes do.
// Four blocks per SM (64 registers; at its natural ~114 only two fit): the pass waits on its loads, and twice the
// warps hide that latency better than the registers saved spills cost (docs/performance.md §8).
#define C2_STATS_BLOCKS 4
struct Celo2Statistics {
  static constexpr int kSums = LOPT_CELO2_SUMS;  // (feature j's Σ x² at j, then Σ p²)
  static constexpr int kUnroll = 1;              // pairs of elements per iteration
  static constexpr int kPrefetch = 1;            // pairs requested into L2 ahead
  static constexpr bool kSomeOnlyChecked = true;
  static constexpr int kParamSquares = C2_FEATURES;  // (a sliced tensor's only statistic: param_squares_only)
  struct Inputs {
    const Celo2Tensor* celo2_tensors;
    const float2* gradient_transforms;
    const float4* row_factors;
    const float4* col_factors;
  };
  const TensorMeta& t;
  Decays decays;
  float2 transform;
  bool learned, sliced;
  int inputs;
  const float4* row_factors;
  const float4* col_factors;

  LOPT_DEVICE Celo2Statistics(const TensorMeta& tensor_meta, int tensor, const Decays& group_decays,
                              const Inputs& in)
      : t(tensor_meta), decays(group_decays), transform(in.gradient_transforms[tensor]),
        learned(in.celo2_tensors[tensor].kind == LOPT_CELO2_LEARNED),
        sliced(in.celo2_tensors[tensor].kind == LOPT_CELO2_SLICED),
        inputs(static_cast<int>(in.celo2_tensors[tensor].inputs)), row_factors(in.row_factors),
        col_factors(in.col_factors) {}

  LOPT_DEVICE bool checked_only() const { return !learned && !sliced; }
  // (a sliced tensor's features are normalised per slice, in celo2_slices: here only its Σ p², for param_scale)
  LOPT_DEVICE bool param_squares_only() const { return sliced; }

  template <bool Factored>
  LOPT_DEVICE void add(float raw_grad, float param, ElementState& s, const FactorIndex& f,
                       float (&sums)[kSums]) const {
    const float grad = step_gradient(raw_grad, transform);
    update_accumulators(s, grad, decays, Factored);
    FactorEntry row = {}, col = {};
    if (Factored) load_factors(t, f, row_factors, col_factors, row, col);
    float x[C2_ELEMENT_FEATURES];
    element_features(grad, param, s, Factored, row, col, x);
#pragma unroll
    for (int i = 0; i < C2_ELEMENT_FEATURES; ++i)
      if (element_input(i) < inputs && is_finite(x[i])) sums[element_input(i)] = fmaf(x[i], x[i], sums[element_input(i)]);
    if (is_finite(param)) sums[kParamSquares] = fmaf(param, param, sums[kParamSquares]);
  }
};

extern "C" __global__ void __launch_bounds__(LOPT_STATS_THREADS, C2_STATS_BLOCKS)
celo2_statistics(const TensorMeta* __restrict__ tensors, const i64* __restrict__ gradients, int num_tensors,
                 const GroupMeta* __restrict__ groups, const Celo2Tensor* __restrict__ celo2_tensors,
                 const float2* __restrict__ gradient_transforms, const float4* __restrict__ row_factors,
                 const float4* __restrict__ col_factors, const float* grad_scale, const float* found_inf, int* status,
                 double* __restrict__ stats_partials) {
  statistics_pass<Celo2Statistics>(tensors, gradients, num_tensors, groups, StepFlags{grad_scale, found_inf, status},
                                   Celo2Statistics::Inputs{celo2_tensors, gradient_transforms, row_factors, col_factors},
                                   stats_partials);
}

// ------------------------------------------------------------------------------------------
// Control
// ------------------------------------------------------------------------------------------

// 1 − β^t in float64, rounded to float32 (reference: bias_correction, then the division by it in float32).
LOPT_DEVICE float bias_correction(double beta, i64 step) {
  return static_cast<float>(1.0 - pow(beta, static_cast<double>(step)));
}

// sum + x² in float64 where x is finite: the reference's sums of squares leave non-finite values out.
LOPT_DEVICE void add_finite_square(double& sum, float x) {
  if (is_finite(x)) sum = fma(static_cast<double>(x), static_cast<double>(x), sum);
}

// reference: normalise_by_square_sums' factors for `count` values whose finite ones' squares sum to `sum`:
// scale = 1/sqrt(1e-9 + sum/count) formed in float64, applied as (x · float(scale·shift)) · float(1/shift), shift
// 2^64 where scale < 2^-60 (1/shift is then 2^-64 exactly: a choice rather than a division).
LOPT_DEVICE float2 square_sum_factors(double sum, double count) {
  const double scale = 1.0 / sqrt(1e-9 + sum / count);
  const bool shifted = scale < 0x1p-60;
  return make_float2(static_cast<float>(shifted ? scale * 0x1p64 : scale), shifted ? 0x1p-64f : 1.f);
}

// Blocks [0, num_tensors): one tensor each. A learned tensor: its chunks' sums in a fixed order (float64) and,
// for a factored one, its table features' sums over its R and C entries (table_feature_square_sums), then per
// feature normalise_by_square_sums' factors — scale = rsqrt(1e-9 + Σx²/count) formed in float64,
// applied as (x · float(scale·shift)) · float(1/shift), shift 2^64 where scale < 2^-60 — and param_scale
// sqrt(float(Σp²/count) + 1e-9). An AdamW tensor: its bias corrections for this step (its own count of
// AdamW steps, CELO2; the group's, ELO-CELO2; this step included). The blocks after them commit a kept
// step's R and C (commit_factored_accumulators).
extern "C" __global__ void __launch_bounds__(C2_CONTROL_THREADS)
celo2_control(const TensorMeta* __restrict__ tensors, int num_tensors, const GroupMeta* __restrict__ groups,
              const Celo2Tensor* __restrict__ celo2_tensors, const double* __restrict__ celo2_groups,
              const double* __restrict__ stats_partials, const float* __restrict__ row_table,
              const float* __restrict__ col_table, i64 total_row_entries, i64 total_col_entries,
              const float* grad_scale, const float* found_inf, int* status, float* __restrict__ feature_scales,
              float* __restrict__ param_scales, float2* __restrict__ adam_corrections) {
  const StepFlags flags{grad_scale, found_inf, status};
  const int tid = threadIdx.x;
  if (blockIdx.x >= num_tensors) {
    if (!step_is_skipped(flags))
      commit_factored_accumulators(tensors, num_tensors, row_table, col_table, total_row_entries, total_col_entries,
                                   blockIdx.x - num_tensors, gridDim.x - num_tensors, tid, C2_CONTROL_THREADS);
    return;
  }
  const int tensor = blockIdx.x;
  const TensorMeta t = tensors[tensor];
  const Celo2Tensor c = celo2_tensors[tensor];
  if (c.kind == LOPT_CELO2_ADAM_OWN || c.kind == LOPT_CELO2_ADAM_SHARED) {
    if (tid == 0) {
      const double* values = group_values(celo2_groups, t.group);
      double beta1, beta2;
      i64 step;
      if (c.kind == LOPT_CELO2_ADAM_OWN) {
        beta1 = values[LOPT_CELO2_GROUP_ADAM_BETA1];
        beta2 = values[LOPT_CELO2_GROUP_ADAM_BETA2];
        step = *pointer<const i64>(c.adam_step) + 1;
      } else {  // (the first momentum decay and the RMS decay, float32 values, as the reference reads them)
        const Decays d = group_decays(groups, t);
        beta1 = static_cast<double>(d.momentum[0]);
        beta2 = static_cast<double>(d.rms);
        step = *pointer<const i64>(groups[t.group].step) + 1;
      }
      adam_corrections[tensor] = make_float2(bias_correction(beta1, step), bias_correction(beta2, step));
    }
    return;
  }
  if (c.kind != LOPT_CELO2_LEARNED && c.kind != LOPT_CELO2_SLICED) return;  // (a sliced tensor's: param_scale)
  __shared__ double lane_sums[LOPT_CELO2_SUMS][C2_CONTROL_LANES];
  __shared__ double table_scratch[C2_CONTROL_THREADS / 32][LOPT_TABLE_FEATURES];
  __shared__ double table_sums[LOPT_TABLE_FEATURES];
  __shared__ double sums[LOPT_CELO2_SUMS];
  static_assert(C2_TABLE_END - C2_TABLE_FIRST == LOPT_TABLE_FEATURES, "the table features: R, C, rsqrt R, rsqrt C");
  tensor_statistics_sums<LOPT_CELO2_SUMS, C2_CONTROL_THREADS, C2_CONTROL_LANES>(
      t, stats_partials, row_table, col_table, C2_TABLE_FIRST, lane_sums, table_scratch, table_sums, sums);
  const double count = static_cast<double>(t.count);
  float* out = feature_scales + static_cast<i64>(tensor) * C2_SCALES;
  if (tid < C2_FEATURES) {
    const float2 factors = square_sum_factors(sums[tid], count);
    out[tid] = factors.x;
    out[C2_UNSHIFT + tid] = factors.y;
  } else if (tid == C2_FEATURES) {
    param_scales[tensor] = __fsqrt_rn(__fadd_rn(static_cast<float>(sums[C2_FEATURES] / count), 1e-9f));
  }
}

// ------------------------------------------------------------------------------------------
// The table features' share of the first layer
// ------------------------------------------------------------------------------------------

// reference: normalise_by_square_sums' product, with the tensor's two factors of input j (celo2_control).
LOPT_DEVICE float normalised(float x, float2 factors) { return __fmul_rn(__fmul_rn(x, factors.x), factors.y); }

// Threads [0, total_row_entries): the R entries, then the C entries. An entry of a learned tensor: its six table
// features normalised as an element's are, times their first-layer weights, accumulated in input order onto the
// first layer's bias (an R entry) or onto 0 (a C entry); then its three factors. Every element of a factored
// tensor shares its entries' values of these 12 of its 30 inputs, so the MLP pass starts its first layer from
// its R entry's share plus its C entry's instead of forming them (docs/celo2.md §8).
extern "C" __global__ void __launch_bounds__(C2_CONTROL_THREADS)
celo2_table_features(const TensorMeta* __restrict__ tensors, int num_tensors,
                     const Celo2Tensor* __restrict__ celo2_tensors, const float* __restrict__ row_table,
                     const float* __restrict__ col_table, i64 total_row_entries, i64 total_col_entries,
                     const float* __restrict__ feature_scales, const Celo2Network network,
                     float* __restrict__ row_entries, float* __restrict__ col_entries) {
  const i64 index = static_cast<i64>(blockIdx.x) * C2_CONTROL_THREADS + threadIdx.x;
  const bool columns = index >= total_row_entries;
  const i64 entry = columns ? index - total_row_entries : index;
  if (columns && entry >= total_col_entries) return;
  const int tensor = columns ? find_row<LOPT_TENSORMETA_COL_TABLE>(tensors, num_tensors, entry)
                             : find_row<LOPT_TENSORMETA_ROW_TABLE>(tensors, num_tensors, entry);
  if (celo2_tensors[tensor].kind != LOPT_CELO2_LEARNED) return;
  const FactorEntry f = read_factor_entry(columns ? col_table : row_table, entry);
  const float* scale = feature_scales + static_cast<i64>(tensor) * C2_SCALES;
  const int first = C2_TABLE_FIRST + (columns ? 3 : 0);  // acc_k at first + k, rsqrt(acc_k + 1e-8) at first + 6 + k
  int input[6];
  float x[6];
#pragma unroll
  for (int k = 0; k < 3; ++k) {
    input[k] = first + k;
    input[3 + k] = first + 6 + k;
    x[k] = normalised(f.acc[k], make_float2(scale[input[k]], scale[C2_UNSHIFT + input[k]]));
    x[3 + k] = normalised(f.rsqrt_acc[k], make_float2(scale[input[3 + k]], scale[C2_UNSHIFT + input[3 + k]]));
  }
  float* out = (columns ? col_entries : row_entries) + entry * C2_ENTRY_FLOATS;
#pragma unroll
  for (int n = 0; n < C2_HIDDEN; ++n) {
    float a = columns ? 0.f : network.w[C2_MLP_B0 + n];
#pragma unroll
    for (int i = 0; i < 6; ++i) a = fmaf(network.w[C2_MLP_W0 + n * C2_FEATURES + input[i]], x[i], a);
    out[n] = a;
  }
#pragma unroll
  for (int j = C2_HIDDEN; j < C2_ENTRY_FLOATS; ++j) out[j] = j < C2_HIDDEN + 3 ? f.factor[j - C2_HIDDEN] : 0.f;
}

// ------------------------------------------------------------------------------------------
// The MLP pass
// ------------------------------------------------------------------------------------------

// torch.relu: NaN stays NaN (fmaxf(NaN, 0) would be 0, and a non-finite element's step, which Newton–Schulz
// must leave out, would enter it as a finite value).
LOPT_DEVICE float relu(float a) { return a > 0.f || a != a ? a : 0.f; }

// One dense layer, out[n] = b[n] + Σ_k W[n, k]·in[k] (PyTorch's out x in layout, accumulated in k's order),
// ReLU'd where asked; `weights` and `biases`: the layer's offsets in the packed network. Unrolled, so each
// weight's index is a constant: an operand in the kernel's parameter bank.
template <int In, int Out, bool Relu>
LOPT_DEVICE void dense_layer(const float* w, int weights, int biases, const float (&in)[In], float (&out)[Out]) {
#pragma unroll
  for (int n = 0; n < Out; ++n) {
    float a = w[biases + n];
#pragma unroll
    for (int k = 0; k < In; ++k) a = fmaf(w[weights + n * In + k], in[k], a);
    out[n] = Relu ? relu(a) : a;
  }
}

// The MLP from its first layer's activations `h` on: the hidden layers (ReLU'd), then outputs 0 and 1 (direction,
// magnitude; the third output no update reads is not computed).
LOPT_DEVICE float2 mlp_after_first_layer(float (&h)[C2_HIDDEN], const Celo2Network& network) {
#pragma unroll
  for (int layer = 0; layer < C2_MLP_HIDDEN_LAYERS; ++layer) {
    float next[C2_HIDDEN];
    dense_layer<C2_HIDDEN, C2_HIDDEN, true>(network.w, C2_MLP_LINEAR_W + layer * C2_MLP_LINEAR_STRIDE,
                                             C2_MLP_LINEAR_B + layer * C2_MLP_LINEAR_STRIDE, h, next);
#pragma unroll
    for (int n = 0; n < C2_HIDDEN; ++n) h[n] = next[n];
  }
  float out[2];
  dense_layer<C2_HIDDEN, 2, false>(network.w, C2_MLP_OUTPUT_W, C2_MLP_OUTPUT_B, h, out);
  return make_float2(out[0], out[1]);
}

// reference: mlp — relu(x W0 + b0), the dense layers with ReLU between them; returns outputs 0 and 1
// (direction, magnitude; the third output no update reads is not computed). The first layer's pre-activations
// start from `start` (b0 plus the table features' share, celo2_table_features, or b0 alone for a tensor without
// tables) and add the element's own normalised features `x` in input order.
LOPT_DEVICE float2 celo2_mlp_outputs(const float (&x)[C2_ELEMENT_FEATURES], const float (&start)[C2_HIDDEN],
                                     const Celo2Network& network) {
  // Feature by feature into every hidden unit's sum (each unit's sum still in input order: the same values), so
  // that a feature's register is free once it has entered the sums.
  float h[C2_HIDDEN];
#pragma unroll
  for (int n = 0; n < C2_HIDDEN; ++n) h[n] = start[n];
#pragma unroll
  for (int i = 0; i < C2_ELEMENT_FEATURES; ++i) {
#pragma unroll
    for (int n = 0; n < C2_HIDDEN; ++n) h[n] = fmaf(network.w[C2_MLP_W0 + n * C2_FEATURES + element_input(i)], x[i], h[n]);
  }
#pragma unroll
  for (int n = 0; n < C2_HIDDEN; ++n) h[n] = relu(h[n]);
  return mlp_after_first_layer(h, network);
}

// precision="fast" (C2_FAST_MLP, lopt.fused.celo2.kernel_defines): the same MLP on tensor cores, BF16 operands
// and float32 accumulators (mma.sync). A warp runs its 32 elements as two 16-row m-tiles. The first layer's
// row of an element is 32 inputs: its normalised features (C2_ELEMENT_FEATURES, in element_input's order),
// then its start (b0 plus its entries' shares) through an identity, then zeros; each lane writes its
// element's row into the warp's tile, and ldmatrix hands every lane its A fragments. A layer's accumulators,
// ReLU'd and rounded to BF16, are the next layer's A fragments in place (the m16n8 accumulator's layout is
// the m16n8k8 A operand's). The output layer's 8 columns repeat (direction, magnitude), so that every lane of
// a row's quad holds both, and two shuffles hand each element's pair back to its lane.
#ifndef C2_FAST_MLP
#define C2_FAST_MLP 0
#endif
#if C2_FAST_MLP
static_assert(C2_HIDDEN <= 8 && C2_ELEMENT_FEATURES + C2_HIDDEN <= 32,
              "the tensor-core MLP: hidden layers of at most 8 units (one n-tile), a first layer of 32 inputs");
// A row: 32 BF16 inputs as 16 words, then 4 words of padding: any 8 consecutive rows' 16-byte pieces of one
// k-step then fall in distinct banks (20 r mod 32 = 0, 20, 8, 28, 16, 4, 24, 12), for the row writes and for
// ldmatrix's 8-row reads alike.
#define C2_TILE_ROW_WORDS 20
#define C2_TILE_ROW_PIECES (C2_TILE_ROW_WORDS / 4)
#define C2_HIDDEN_OPERANDS (C2_MLP_HIDDEN_LAYERS > 0 ? C2_MLP_HIDDEN_LAYERS : 1)

// Input k of an element's first-layer row: its normalised features, then its start, then 0.
LOPT_DEVICE float first_layer_row_input(const float (&x)[C2_ELEMENT_FEATURES], const float (&start)[C2_HIDDEN],
                                        int k) {
  return k < C2_ELEMENT_FEATURES ? x[k] : k < C2_ELEMENT_FEATURES + C2_HIDDEN ? start[k - C2_ELEMENT_FEATURES] : 0.f;
}

// Lane (g, t)'s B word of a BF16 product: weight(k0 + 2t, g) and weight(k0 + 2t + 1, g). weight(k, n) is
// called at constant k and n only (each a kernel-parameter read), and the lane's pair selected; once per thread.
template <typename Weight>
LOPT_DEVICE unsigned operand_word(int k0, const Weight& weight, int g, int t) {
  float first = 0.f, second = 0.f;
#pragma unroll
  for (int n = 0; n < 8; ++n)
#pragma unroll
    for (int q = 0; q < 4; ++q)
      if (n == g && q == t) {
        first = weight(k0 + 2 * q, n);
        second = weight(k0 + 2 * q + 1, n);
      }
  return pack_bf16x2(first, second);
}

// Lane t's pair of a layer's biases, (b[2t], b[2t + 1]) (0 past the layer's units), from the packed network.
LOPT_DEVICE float2 bias_pair(const Celo2Network& network, int biases, int units, int t) {
  float2 pair = make_float2(0.f, 0.f);
#pragma unroll
  for (int q = 0; q < 4; ++q)
    if (q == t) pair = make_float2(2 * q < units ? network.w[biases + 2 * q] : 0.f,
                                   2 * q + 1 < units ? network.w[biases + 2 * q + 1] : 0.f);
  return pair;
}

// A lane's operands of the whole MLP (its B words and bias pairs), formed once per thread.
struct FastMlpOperands {
  unsigned first[2][2];  // the first layer's 16-deep steps j: the words of inputs 16j + 2t (+1) and 16j + 8 + 2t (+1)
  unsigned hidden[C2_HIDDEN_OPERANDS];
  float2 hidden_bias[C2_HIDDEN_OPERANDS];
  unsigned output;  // columns 2c, 2c + 1: direction, magnitude (c = 0 ... 3)
  float2 output_bias;
};

LOPT_DEVICE FastMlpOperands fast_mlp_operands(const Celo2Network& network, int lane) {
  const int g = lane / 4, t = lane % 4;
  FastMlpOperands o;
  const auto first = [&](int k, int n) {
    if (n >= C2_HIDDEN) return 0.f;
    if (k < C2_ELEMENT_FEATURES) return network.w[C2_MLP_W0 + n * C2_FEATURES + element_input(k)];
    return k - C2_ELEMENT_FEATURES == n ? 1.f : 0.f;  // (the start, through an identity)
  };
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int half = 0; half < 2; ++half) o.first[j][half] = operand_word(16 * j + 8 * half, first, g, t);
#pragma unroll
  for (int layer = 0; layer < C2_HIDDEN_OPERANDS; ++layer) {
    const int weights = C2_MLP_LINEAR_W + layer * C2_MLP_LINEAR_STRIDE;
    const auto hidden = [&](int k, int n) {
      return layer < C2_MLP_HIDDEN_LAYERS && k < C2_HIDDEN && n < C2_HIDDEN ? network.w[weights + n * C2_HIDDEN + k]
                                                                             : 0.f;
    };
    o.hidden[layer] = operand_word(0, hidden, g, t);
    o.hidden_bias[layer] = layer < C2_MLP_HIDDEN_LAYERS
                               ? bias_pair(network, C2_MLP_LINEAR_B + layer * C2_MLP_LINEAR_STRIDE, C2_HIDDEN, t)
                               : make_float2(0.f, 0.f);
  }
  const auto output = [&](int k, int n) { return k < C2_HIDDEN ? network.w[C2_MLP_OUTPUT_W + (n % 2) * C2_HIDDEN + k] : 0.f; };
  o.output = operand_word(0, output, g, t);
  o.output_bias = make_float2(network.w[C2_MLP_OUTPUT_B], network.w[C2_MLP_OUTPUT_B + 1]);
  return o;
}

// One 8-deep layer of the warp's two m-tiles in place: h ← W relu(h) + b (relu keeps NaN, as the reference's).
LOPT_DEVICE void fast_dense_layer(float (&h)[2][4], unsigned weights, float2 bias) {
  const float c[4] = {bias.x, bias.y, bias.x, bias.y};
#pragma unroll
  for (int m = 0; m < 2; ++m) {
    const unsigned a[2] = {pack_bf16x2(relu(h[m][0]), relu(h[m][1])), pack_bf16x2(relu(h[m][2]), relu(h[m][3]))};
    mma_bf16_m16n8k8(h[m], a, weights, c);
  }
}

// The MLP's (direction, magnitude) for the lane's element: celo2_mlp_outputs' layers in BF16 products. Every
// lane of the warp calls it together; `tile`: the warp's 32 rows of C2_TILE_ROW_WORDS words.
LOPT_DEVICE float2 fast_mlp_outputs(const float (&x)[C2_ELEMENT_FEATURES], const float (&start)[C2_HIDDEN],
                                    const FastMlpOperands& o, uint4* tile, int lane) {
  __syncwarp();  // (the warp's reads of its previous rows are done)
#pragma unroll
  for (int piece = 0; piece < 4; ++piece) {  // inputs 8 piece ... 8 piece + 7
    unsigned words[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int k = 8 * piece + 2 * q;
      words[q] = pack_bf16x2(first_layer_row_input(x, start, k), first_layer_row_input(x, start, k + 1));
    }
    tile[C2_TILE_ROW_PIECES * lane + piece] = make_uint4(words[0], words[1], words[2], words[3]);
  }
  __syncwarp();
  // The A fragment of 16-deep step j in m-tile m is four 8 x 8 matrices: rows 16m ... +7 and +8 ... +15 of
  // pieces 2j and 2j + 1; lane l gives row 8 ((l / 8) % 2) + l % 8's address in piece 2j + l / 16.
  const int matrix_row = 8 * ((lane / 8) % 2) + lane % 8, matrix_piece = lane / 16;
  float h[2][4];
#pragma unroll
  for (int m = 0; m < 2; ++m) {
#pragma unroll
    for (int i = 0; i < 4; ++i) h[m][i] = 0.f;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      unsigned a[4];
      load_matrices_x4(a, tile + C2_TILE_ROW_PIECES * (16 * m + matrix_row) + 2 * j + matrix_piece);
      mma_bf16_m16n8k16(h[m], a, o.first[j][0], o.first[j][1], h[m]);
    }
  }
#pragma unroll
  for (int layer = 0; layer < C2_MLP_HIDDEN_LAYERS; ++layer) fast_dense_layer(h, o.hidden[layer], o.hidden_bias[layer]);
  fast_dense_layer(h, o.output, o.output_bias);
  // Row r of m-tile m is held by the lanes 4 (r % 8) + t: in h[m][0], h[m][1] for r < 8, else h[m][2], h[m][3].
  // Lane t of each quad passes m-tile t / 2's half t % 2, so the element of lane l (m-tile l / 16, row l % 16)
  // reads it from lane 4 (l % 8) + l / 8.
  const int t = lane % 4;
  const float direction = t == 0 ? h[0][0] : t == 1 ? h[0][2] : t == 2 ? h[1][0] : h[1][2];
  const float magnitude = t == 0 ? h[0][1] : t == 1 ? h[0][3] : t == 2 ? h[1][1] : h[1][3];
  const int source = 4 * (lane % 8) + lane / 8;
  return make_float2(__shfl_sync(0xffffffffu, direction, source), __shfl_sync(0xffffffffu, magnitude, source));
}
#endif

// An R or C entry of celo2_table_features: its share of the first layer's pre-activations and its factors.
LOPT_DEVICE void load_entry(const float* entries, i64 entry, float (&share)[C2_HIDDEN], float (&factor)[3]) {
  const float4* p = reinterpret_cast<const float4*>(entries + entry * C2_ENTRY_FLOATS);
  float v[C2_ENTRY_FLOATS];
#pragma unroll
  for (int q = 0; q < C2_ENTRY_FLOATS / 4; ++q) {
    const float4 a = __ldg(p + q);
    v[4 * q] = a.x; v[4 * q + 1] = a.y; v[4 * q + 2] = a.z; v[4 * q + 3] = a.w;
  }
#pragma unroll
  for (int n = 0; n < C2_HIDDEN; ++n) share[n] = v[n];
#pragma unroll
  for (int k = 0; k < 3; ++k) factor[k] = v[C2_HIDDEN + k];
}

// walk_chunks_of's visitor (the learned tensors' walk): each learned element's features (its accumulators updated
// and, for a kept step, stored), normalised, the MLP, and proposed_step: direction · exp(magnitude · exp_mult),
// times param_scale where the group asks (param_scale_mult), at its element's index in its stack.
struct Celo2MLP {
  const Celo2Tensor* celo2_tensors;
  const double* celo2_groups;
  const float2* gradient_transforms;
  const float* row_entries;  // celo2_table_features' entries
  const float* col_entries;
  const float* feature_scales;
  const float* param_scales;
  const Celo2Network& network;
  float* steps;
  double* segment_sums;  // per (block, tensor) segment: Σ s² of its finite proposed values, sign bit set where it has a non-finite one
  bool store_state;
#if C2_FAST_MLP
  const FastMlpOperands& operands;
  uint4* tile;  // the warp's rows (fast_mlp_outputs)
#endif

  LOPT_DEVICE void begin_tensor(int) const {}

  // The elements of chunks [chunk, end) of a tensor, factored or not as `Factored` (the tensor's own flag, made a
  // constant: each kind's loop carries neither the other's state nor its branches, which at the pass's 64
  // registers made the compiler spill and recompute).
  template <bool Factored>
  LOPT_DEVICE void elements(const TensorMeta& tensor_meta, const ApplyScalars& a, const Celo2Tensor& c, float2 transform,
                            const float (*scales)[32], bool shifted, bool param_scale_mult, float param_scale, i64 chunk,
                            i64 end, float inverse_scale, double& square_sum, bool& nonfinite) const {
    TensorMeta t = tensor_meta;
    t.factored = Factored;
    for (; chunk < end; ++chunk) {
      const i64 e = (chunk - t.first_apply_chunk) * C2_APPLY_CHUNK + threadIdx.x;
      // (The tensor-core MLP takes every lane of the warp: a lane past the tensor's end runs zeros through it.)
      const bool element = e < t.numel;
      if (!C2_FAST_MLP && !element) continue;
      float start[C2_HIDDEN];                // the first layer's start (celo2_mlp_outputs)
      float x[C2_ELEMENT_FEATURES] = {};     // (a tensor without tables: its inputs 27–29 are 0, and scaled by 0)
      if (element) {
        // The element this thread takes C2_MLP_PREFETCH chunks on, requested into L2 now: its DRAM latency is
        // paid while this element's MLP runs (no registers held).
        if (chunk + C2_MLP_PREFETCH < end && e + C2_MLP_PREFETCH * C2_APPLY_CHUNK < t.numel)
          prefetch_element(t, e + C2_MLP_PREFETCH * C2_APPLY_CHUNK);
        float param;
        ElementState s;
        // (evict-first: the pass reads each element's arrays once, and the R and C entries stay in L2)
        const float grad = step_gradient(load_element<true>(t, e, inverse_scale, param, s), transform);
        update_accumulators(s, grad, a.decays, t.factored);
        if (store_state) store_element_state<true>(t, e, s);
        // The start and the factors, from the element's R and C entries.
        FactorEntry row = {}, col = {};
        if (t.factored) {
          const FactorIndex f = factor_index(t, e);
          float col_share[C2_HIDDEN];
          load_entry(row_entries, t.row_table + f.row, start, row.factor);
          load_entry(col_entries, t.col_table + f.col, col_share, col.factor);
#pragma unroll
          for (int n = 0; n < C2_HIDDEN; ++n) start[n] = __fadd_rn(start[n], col_share[n]);
        } else {
#pragma unroll
          for (int n = 0; n < C2_HIDDEN; ++n) start[n] = network.w[C2_MLP_B0 + n];
        }
        element_features(grad, param, s, t.factored, row, col, x);
        if (shifted) {
          // (normalised()'s arithmetic, written out: through its float2 the exact build spilled 16 bytes more)
#pragma unroll
          for (int i = 0; i < C2_ELEMENT_FEATURES; ++i)
            x[i] = __fmul_rn(__fmul_rn(x[i], scales[0][element_input(i)]), scales[1][element_input(i)]);
        } else {
#pragma unroll
          for (int i = 0; i < C2_ELEMENT_FEATURES; ++i) x[i] = __fmul_rn(x[i], scales[0][element_input(i)]);
        }
      } else {
#pragma unroll
        for (int n = 0; n < C2_HIDDEN; ++n) start[n] = 0.f;
      }
#if C2_FAST_MLP
      const float2 out = fast_mlp_outputs(x, start, operands, tile, threadIdx.x % 32);
#else
      const float2 out = celo2_mlp_outputs(x, start, network);
#endif
      if (!element) continue;
      float factor = expf(__fmul_rn(out.y, a.exp_mult));
      if (param_scale_mult) factor = __fmul_rn(param_scale, factor);
      const float step = __fmul_rn(out.x, factor);
#if C2_DIRECT_WORK
      if (c.direct_work != 0)  // (the matrix's Newton–Schulz input, divided by its norm later: celo2_first_polynomial)
        store_from_float(pointer<void>(c.direct_work), e, LOPT_BF16, saturated_for_bf16(step));
      else
#endif
        steps[c.step_offset + e] = step;
      if (is_finite(step)) square_sum = fma(static_cast<double>(step), static_cast<double>(step), square_sum);
      else nonfinite = true;
    }
  }

  LOPT_DEVICE void chunks(const TensorMeta& t, const ApplyScalars& a, int tensor, i64 chunk, i64 end,
                          float inverse_scale) const {
    const Celo2Tensor c = celo2_tensors[tensor];
    if (c.kind != LOPT_CELO2_LEARNED) return;
    const float2 transform = gradient_transforms[tensor];
    // The tensor's normaliser factors, once per block in shared memory (every thread of the block walks the
    // same tensor here); 0 for the inputs it does not have.
    // (as two rows, the scales then the un-shifts, 16-byte aligned: an element reads four scales per load)
    __shared__ __align__(16) float scales[2][32];
    __syncthreads();  // (the block's previous tensor is done with them)
    bool shifted = false;
    if (threadIdx.x < C2_FEATURES) {
      const float* scale = feature_scales + static_cast<i64>(tensor) * C2_SCALES;
      const bool input = static_cast<i64>(threadIdx.x) < c.inputs;
      scales[0][threadIdx.x] = input ? scale[threadIdx.x] : 0.f;
      scales[1][threadIdx.x] = input ? scale[C2_UNSHIFT + threadIdx.x] : 0.f;
      shifted = input && scales[1][threadIdx.x] != 1.f;
    }
    // Whether any feature's scale was shifted (celo2_control: scale < 2^-60); where none was, each un-shift is 1
    // and its product exact, so it is left out (the same values, 18 multiplications fewer per element).
    shifted = __syncthreads_or(shifted) != 0;
    const bool param_scale_mult = group_values(celo2_groups, t.group)[LOPT_CELO2_GROUP_PARAM_SCALE_MULT] != 0.0;
    const float param_scale = param_scales[tensor];
    double square_sum = 0.0;  // (this thread's finite proposed values', float64: Newton–Schulz's divisor)
    bool nonfinite = false;
    if (t.factored) {
      elements<true>(t, a, c, transform, scales, shifted, param_scale_mult, param_scale, chunk, end, inverse_scale,
                     square_sum, nonfinite);
    } else {
      elements<false>(t, a, c, transform, scales, shifted, param_scale_mult, param_scale, chunk, end, inverse_scale,
                      square_sum, nonfinite);
    }
    // The segment's sum in a fixed order (the grid and the chunks' split are fixed: the same sum every run), at
    // segment index blockIdx.x + tensor (unique: a block's tensors ascend, and the next block starts at its last
    // tensor or after it); celo2_normalise adds a matrix's segments.
    __shared__ double scratch[C2_APPLY_THREADS / 32][1];
    __shared__ double total[1];
    const bool any_nonfinite = __syncthreads_or(nonfinite) != 0;
    const double values[1] = {square_sum};
    block_sums<1, C2_APPLY_THREADS>(values, scratch, total);
    if (threadIdx.x == 0) segment_sums[blockIdx.x + tensor] = any_nonfinite ? -total[0] : total[0];
  }
};

// Eight blocks per SM: the pass is latency-bound (each element's loads, then several hundred dependent
// instructions), and at its natural register count only four blocks fit (25% occupancy). Capped at 64 it spills
// to L1-resident local memory (36 bytes per thread; 56 in the tensor-core build) and still runs faster with twice
// the warps to hide latency
// (ten blocks measured slower; docs/performance.md §8); the arithmetic, and so the result, is the same.
extern "C" __global__ void __launch_bounds__(C2_APPLY_THREADS, 8)
celo2_mlp(const TensorMeta* __restrict__ tensors, const i64* __restrict__ gradients, const GroupMeta* __restrict__ groups,
          const ChunkWalk* __restrict__ walk, int walk_rows, i64 walk_chunks, const Celo2Tensor* __restrict__ celo2_tensors,
          const double* __restrict__ celo2_groups, const float2* __restrict__ gradient_transforms,
          const float* __restrict__ row_entries, const float* __restrict__ col_entries,
          const float* __restrict__ feature_scales, const float* __restrict__ param_scales,
          const Celo2Network network, const float* grad_scale, const float* found_inf, int* status,
          float* __restrict__ steps, double* __restrict__ segment_sums) {
  const StepFlags flags{grad_scale, found_inf, status};
#if C2_FAST_MLP
  __shared__ uint4 tiles[C2_APPLY_THREADS / 32][32 * C2_TILE_ROW_PIECES];
  const FastMlpOperands operands = fast_mlp_operands(network, threadIdx.x % 32);
  const Celo2MLP visit{celo2_tensors, celo2_groups, gradient_transforms, row_entries, col_entries, feature_scales,
                       param_scales, network, steps, segment_sums, !step_is_skipped(flags), operands,
                       tiles[threadIdx.x / 32]};
#else
  const Celo2MLP visit{celo2_tensors, celo2_groups, gradient_transforms, row_entries, col_entries, feature_scales,
                       param_scales, network, steps, segment_sums, !step_is_skipped(flags)};
#endif
  walk_chunks_of(tensors, gradients, groups, walk, walk_rows, walk_chunks, inverse_grad_scale(flags), visit);
}

// ------------------------------------------------------------------------------------------
// Newton–Schulz's norms, its input, and the final step's normalisation
// ------------------------------------------------------------------------------------------

#define C2_SUMS_THREADS 256
#define C2_SUMS_SPLITS 16  // blocks per matrix (the engine reads it: its grid, the partials)

// A learned element's final step: the orthogonalised (or, without Newton–Schulz, the proposed) value, except
// where the proposed step is not finite — there it keeps its own value (reference: orthogonalise).
// `proposed_nonfinite`: the tensor's flag from celo2_normalise; where it is 0 (every proposed value finite, or no
// Newton–Schulz: the result is the proposed step) the result is read alone, without the proposed step's load
// before it.
LOPT_DEVICE float final_step(const float* proposed, const Celo2Tensor& c, i64 e, int proposed_nonfinite) {
  if (proposed_nonfinite != 0) {
    const float value = proposed[e];
    if (!is_finite(value)) return value;
  }
  return load_as_float(pointer<const void>(c.result), e, static_cast<int>(c.result_dtype));
}

// Blocks (x, b): part x of learned tensor rows[b]'s final step; Σ over its finite values of s² in float64, each
// part's sum a partial, and the tensor's last block to finish adds the partials in order (fixed order: the same
// sum every run), resets its ticket and forms finish_step's normalisation as celo2_control's of a feature:
// scale = rsqrt(1e-9 + Σs²/count) in float64, applied as (s · float(scale·shift)) · float(1/shift), shift 2^64
// where scale < 2^-60.
extern "C" __global__ void __launch_bounds__(C2_SUMS_THREADS)
celo2_matrix_sums(const TensorMeta* __restrict__ tensors, const Celo2Tensor* __restrict__ celo2_tensors,
                  const int* __restrict__ rows, const float* __restrict__ steps, double* partials,
                  unsigned int* tickets, const int* __restrict__ proposed_nonfinite, float2* __restrict__ step_scales) {
  const int tensor = rows[blockIdx.y];
  const TensorMeta t = tensors[tensor];
  const Celo2Tensor c = celo2_tensors[tensor];
  const float* proposed = steps + c.step_offset;
  const int flag = proposed_nonfinite[tensor];
  const i64 begin = t.numel * blockIdx.x / C2_SUMS_SPLITS, end = t.numel * (blockIdx.x + 1) / C2_SUMS_SPLITS;
  double sum = 0.0;
  for (i64 e = begin + threadIdx.x; e < end; e += C2_SUMS_THREADS) {
    const float s = final_step(proposed, c, e, flag);
    add_finite_square(sum, s);
  }
  const double values[1] = {sum};
  __shared__ double scratch[C2_SUMS_THREADS / 32][1];
  __shared__ double total[1];
  block_sums<1, C2_SUMS_THREADS>(values, scratch, total);
  if (!store_partial_and_finish_last(partials + blockIdx.y * C2_SUMS_SPLITS + blockIdx.x, total[0],
                                     tickets + blockIdx.y, C2_SUMS_SPLITS) || threadIdx.x != 0)
    return;
  double tensor_sum = 0.0;
  for (int k = 0; k < C2_SUMS_SPLITS; ++k) tensor_sum += __ldcg(partials + blockIdx.y * C2_SUMS_SPLITS + k);
  tickets[blockIdx.y] = 0u;
  step_scales[tensor] = square_sum_factors(tensor_sum, static_cast<double>(t.numel));
}

// The MLP pass's block that walks chunk `chunk` of its walk (walk_chunks_of's split of `total_chunks` over `blocks`,
// at most one block per chunk: block b takes [total·b/blocks, total·(b+1)/blocks)), the last b whose range
// starts at or before it.
LOPT_DEVICE i64 mlp_block_of(i64 chunk, int blocks, i64 total_chunks) {
  return ((chunk + 1) * blocks - 1) / total_chunks;
}

// Blocks (x, b): the matrix of learned tensor rows[b]. Newton–Schulz's divisor (reference newton_schulz: the
// norm from a float64 sum of squares rounded to float32, plus ns_eps in float32) of its proposed step, its
// non-finite elements as 0 (finite_part), from the MLP pass's segment sums (celo2_mlp: one per block and
// tensor, at blockIdx + tensor, so a matrix's are those of the blocks that walked its chunks, added in block
// order); then x = s / divisor (a non-finite s as 0), stored as `work_dtype` (float32; bfloat16 for
// precision="fast") at the step's own index. Block 0 of each matrix also sets the tensor's proposed_nonfinite
// flag (final_step): 1 where a segment met a non-finite value. A tensor no launch takes keeps its flag: 0 as
// allocated (its result is its proposed step), or, had it been taken before, the last value, which final_step
// reads correctly either way.
// The first `scalar_rows` rows are matrices of one row or one column (a class token (1, 1, d)), whose Gram
// matrix is 1 × 1: Newton–Schulz is then a scalar recurrence on the squared norm s of x = s_proposed / divisor,
// each step X ← f·X with f = a + b·s + c·s², s ← f²·s (s from the segments' float64 sum: Σs²/divisor²;
// f and the product of the f in float64 from the coefficients in float32). Such a matrix is written as
// x · Πf into the buffer its steps end in (its `result`), and no product runs for it.
LOPT_DEVICE double scalar_newton_schulz(const double* values, double s) {
  const double a = values[LOPT_CELO2_GROUP_NS_A], b = values[LOPT_CELO2_GROUP_NS_B];
  const double c = values[LOPT_CELO2_GROUP_NS_C];
  const int steps = static_cast<int>(values[LOPT_CELO2_GROUP_NS_STEPS]);
  double product = 1.0;
  for (int k = 0; k < steps; ++k) {
    const double f = a + s * (b + c * s);
    product *= f;
    s *= f * f;
  }
  return product;
}

//
// A direct matrix (Celo2Tensor.direct_work: precision="fast", celo2_mlp wrote its proposed step s itself,
// saturated_for_bf16, as Newton–Schulz's input S) is not divided here: block 0 writes its first polynomial's
// coefficients (a/d, b/d³, c/d⁵) in float32 from float64 (celo2_first_polynomial: X₁ = P S), where d, the
// divisor, lies in [C2_DIRECT_MIN, C2_DIRECT_MAX]. Only a matrix that needs it is rewritten, in place: one with a
// non-finite value (each such value to the step buffer, where final_step reads it, every other element of the
// tensor's steps 0 there, and 0 in S), or one whose d lies outside (S divided by d, rounded again, and the
// coefficients a, b, c: its Gram matrices would leave bfloat16's range or its coefficients float32's).
#define C2_DIRECT_MIN 5.9604645e-8f  // 2^-24
#define C2_DIRECT_MAX 16777216.0f    // 2^24

LOPT_DEVICE void direct_repair(const TensorMeta& t, i64 offset, unsigned short* input, float* steps, bool nonfinite,
                               bool rescale, float divisor) {
  const i64 threads = static_cast<i64>(gridDim.x) * C2_APPLY_THREADS;
  for (i64 e = static_cast<i64>(blockIdx.x) * C2_APPLY_THREADS + threadIdx.x; e < t.numel; e += threads) {
    const float x = sixteen_bits_to_float(input[e], LOPT_BF16);
    if (!is_finite(x)) {
      steps[offset + e] = x;
      input[e] = 0;
      continue;
    }
    if (nonfinite) steps[offset + e] = 0.f;  // (no stale non-finite value of an earlier step left for final_step)
    if (rescale) store_from_float(input, e, LOPT_BF16, __fdiv_rn(x, divisor));
  }
}

extern "C" __global__ void __launch_bounds__(C2_APPLY_THREADS)
celo2_normalise(const TensorMeta* __restrict__ tensors, const Celo2Tensor* __restrict__ celo2_tensors,
                const double* __restrict__ celo2_groups, const int* __restrict__ rows, int scalar_rows,
                const double* __restrict__ segment_sums, int mlp_blocks, i64 mlp_chunks,
                float* __restrict__ steps, int* __restrict__ proposed_nonfinite, void* __restrict__ work,
                int work_dtype, float4* __restrict__ first_polynomials) {
  const int tensor = rows[blockIdx.y];
  const TensorMeta t = tensors[tensor];
  const Celo2Tensor c = celo2_tensors[tensor];
  const i64 offset = c.step_offset;
  const bool scalar = static_cast<int>(blockIdx.y) < scalar_rows;
  // (where x goes: the workspace at the step's own index, or a scalar matrix's result, already at that index)
  void* const out = scalar ? pointer<void>(c.result) : work;
  const i64 out_offset = scalar ? 0 : offset;
  __shared__ float shared_divisor, shared_factor;
  __shared__ bool shared_nonfinite, shared_rescale;
  if (threadIdx.x == 0) {
    const i64 first = mlp_block_of(c.mlp_chunk, mlp_blocks, mlp_chunks);  // (its first chunk in the MLP's walk)
    const i64 last = mlp_block_of(c.mlp_chunk + t.num_apply_chunks - 1, mlp_blocks, mlp_chunks);
    double sum = 0.0;
    bool nonfinite = false;
    for (i64 block = first; block <= last; ++block) {  // (each walked one chunk at least: blocks <= total_chunks)
      const double segment = segment_sums[block + tensor];
      nonfinite |= signbit(segment) != 0;
      sum += fabs(segment);
    }
    const double* values = group_values(celo2_groups, t.group);
    const float divisor = __fadd_rn(static_cast<float>(sqrt(sum)), static_cast<float>(values[LOPT_CELO2_GROUP_NS_EPS]));
    shared_divisor = divisor;
    shared_factor = scalar ? static_cast<float>(scalar_newton_schulz(
                                 values, sum / (static_cast<double>(divisor) * static_cast<double>(divisor))))
                           : 1.0f;
    const bool rescale = !(divisor >= C2_DIRECT_MIN && divisor <= C2_DIRECT_MAX);
    shared_nonfinite = nonfinite;
    shared_rescale = rescale;
    if (blockIdx.x == 0) {
      proposed_nonfinite[tensor] = nonfinite ? 1 : 0;
      if (c.direct_work != 0) {
        const double d = rescale ? 1.0 : static_cast<double>(divisor), cube = d * d * d;
        first_polynomials[c.ns_matrix] = make_float4(static_cast<float>(values[LOPT_CELO2_GROUP_NS_A] / d),
                                                     static_cast<float>(values[LOPT_CELO2_GROUP_NS_B] / cube),
                                                     static_cast<float>(values[LOPT_CELO2_GROUP_NS_C] / (cube * d * d)),
                                                     0.f);
      }
    }
  }
  __syncthreads();
  if (c.direct_work != 0) {
    if (shared_nonfinite || shared_rescale)
      direct_repair(t, offset, pointer<unsigned short>(c.direct_work), steps, shared_nonfinite, shared_rescale,
                    shared_divisor);
    return;
  }
  const float divisor = shared_divisor, factor = shared_factor;  // (factor 1: exact, x itself)
  const i64 threads = static_cast<i64>(gridDim.x) * C2_APPLY_THREADS;
  const i64 thread = static_cast<i64>(blockIdx.x) * C2_APPLY_THREADS + threadIdx.x;
  i64 begin = 0;  // (the first element left to the element-by-element loop)
  const i64 address = reinterpret_cast<i64>(out) + out_offset * dtype_bytes(work_dtype);
  if (quad_aligned(reinterpret_cast<i64>(steps + offset), LOPT_F32) && quad_aligned(address, work_dtype)) {
    // C2_NORMALISE_QUADS quads of four consecutive elements per thread at a time, every load issued before any
    // value is used: one 4-byte load per thread in flight left the pass waiting on DRAM latency, as celo2_apply
    // did (docs/performance.md §8).
    const i64 quads = t.numel / 4;
    for (i64 first = thread; first < quads; first += threads * C2_NORMALISE_QUADS) {
      float4 s[C2_NORMALISE_QUADS];
#pragma unroll
      for (int q = 0; q < C2_NORMALISE_QUADS; ++q)
        if (first + q * threads < quads)
          s[q] = load_quad_as_float(steps + offset, 4 * (first + q * threads), LOPT_F32);
#pragma unroll
      for (int q = 0; q < C2_NORMALISE_QUADS; ++q) {
        if (first + q * threads >= quads) continue;
        float4 x;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const float value = quad_value(s[q], k);
          quad_value(x, k) = is_finite(value) ? __fmul_rn(__fdiv_rn(value, divisor), factor) : 0.f;
        }
        store_quad_from_float(out, out_offset + 4 * (first + q * threads), work_dtype, x);
      }
    }
    begin = 4 * quads;  // (the matrix's last, partial quad)
  }
  for (i64 e = begin + thread; e < t.numel; e += threads) {
    const float s = steps[offset + e];
    store_from_float(out, out_offset + e, work_dtype, is_finite(s) ? __fmul_rn(__fdiv_rn(s, divisor), factor) : 0.f);
  }
}

// Newton–Schulz's first polynomial for a family of direct matrices (C2_DIRECT_WORK): `gram` holds each
// matrix's A = S Sᵀ (or SᵀS) and `polynomial` A A, both bfloat16 (the products'), for S the proposed step
// itself; each entry becomes P = kb·A + kc·A A, plus ka on the diagonal, in float32 and rounded once to
// bfloat16, with (ka, kb, kc) = (a/d, b/d³, c/d⁵) the matrix's row of `coefficients` (celo2_normalise). Then
// P S = (a·I + b·A' + c·A'A') X₀ for X₀ = S/d and A' = X₀X₀ᵀ: the fast iteration's first step on the divided
// matrix (lopt.fused.celo2.scaled_polynomial, its transcription in torch). `count` matrices of k × k.
// Blocks (x, m): matrix m, its entries in pairs (k even: a pair lies in one row) or one by one.
LOPT_DEVICE float first_polynomial_entry(float4 f, unsigned short gram, unsigned short square, bool diagonal) {
  const float p = __fadd_rn(__fmul_rn(f.y, sixteen_bits_to_float(gram, LOPT_BF16)),
                            __fmul_rn(f.z, sixteen_bits_to_float(square, LOPT_BF16)));
  return diagonal ? __fadd_rn(p, f.x) : p;
}

extern "C" __global__ void __launch_bounds__(C2_APPLY_THREADS)
celo2_first_polynomial(const unsigned short* __restrict__ gram, unsigned short* __restrict__ polynomial,
                       const float4* __restrict__ coefficients, int k) {
  const int entries = k * k;  // (below 2^31: larger Gram matrices take the torch form, lopt.fused.celo2)
  const float4 f = coefficients[blockIdx.y];
  const i64 base = static_cast<i64>(blockIdx.y) * entries;
  const int threads = gridDim.x * C2_APPLY_THREADS, thread = blockIdx.x * C2_APPLY_THREADS + threadIdx.x;
  if (k % 2 == 0) {
    const unsigned* a = reinterpret_cast<const unsigned*>(gram + base);
    unsigned* p = reinterpret_cast<unsigned*>(polynomial + base);
    for (int pair = thread; pair < entries / 2; pair += threads) {
      const int within = 2 * pair, diagonal = (within / k) * (k + 1);
      const unsigned x = a[pair], y = p[pair];
      p[pair] = pack_bf16x2(
          first_polynomial_entry(f, static_cast<unsigned short>(x & 0xffffu), static_cast<unsigned short>(y & 0xffffu),
                                 within == diagonal),
          first_polynomial_entry(f, static_cast<unsigned short>(x >> 16), static_cast<unsigned short>(y >> 16),
                                 within + 1 == diagonal));
    }
    return;
  }
  for (int within = thread; within < entries; within += threads)
    store_from_float(polynomial + base, within, LOPT_BF16,
                     first_polynomial_entry(f, gram[base + within], polynomial[base + within],
                                            within == (within / k) * (k + 1)));
}

// ------------------------------------------------------------------------------------------
// Apply
// ------------------------------------------------------------------------------------------

// reference: adam_direction — m̂ / (√v̂ + eps), m̂ = m / (1 − β1^t), v̂ = v / (1 − β2^t).
LOPT_DEVICE float adam_direction(float m, float v, float2 corrections, float eps) {
  return __fdiv_rn(__fdiv_rn(m, corrections.x), __fadd_rn(__fsqrt_rn(__fdiv_rn(v, corrections.y)), eps));
}

// The AdamW branch's values for one tensor: its group's scalars with adam_lr_mult · lr and adam_weight_decay,
// its gradient transform, bias corrections, betas (rounded once from the group's float64) and eps (ELO-CELO2's
// shared branch: 1e-8).
struct Celo2AdamScalars {
  ApplyScalars scalars;
  float2 transform, corrections;
  float b1, b1_mix, b2, b2_mix, eps;
};

LOPT_DEVICE Celo2AdamScalars celo2_adam_scalars(const Celo2Tensor& c, const double* values, const ApplyScalars& group,
                                                float2 transform, float2 corrections) {
  Celo2AdamScalars adam;
  adam.scalars = group;
  const float lr = values[LOPT_CELO2_GROUP_ADAM_LR_ON_DEVICE] != 0.0
                       ? __fmul_rn(static_cast<float>(values[LOPT_CELO2_GROUP_ADAM_LR_MULT]), -group.neg_lr)
                       : static_cast<float>(values[LOPT_CELO2_GROUP_ADAM_LR]);
  adam.scalars.neg_lr = -lr;
  adam.scalars.weight_decay = static_cast<float>(values[LOPT_CELO2_GROUP_ADAM_WEIGHT_DECAY]);
  adam.transform = transform;
  adam.corrections = corrections;
  const double beta1 = values[LOPT_CELO2_GROUP_ADAM_BETA1], beta2 = values[LOPT_CELO2_GROUP_ADAM_BETA2];
  adam.b1 = static_cast<float>(beta1);
  adam.b1_mix = static_cast<float>(1.0 - beta1);
  adam.b2 = static_cast<float>(beta2);
  adam.b2_mix = static_cast<float>(1.0 - beta2);
  adam.eps = c.kind == LOPT_CELO2_ADAM_OWN ? static_cast<float>(values[LOPT_CELO2_GROUP_ADAM_EPS]) : 1e-8f;
  return adam;
}

// celo2_apply's functor (apply_pass_goes_on, then walk_chunks_of over the learned tensors' walk): a learned
// element's u = rms_mult · normalised s (its final step, times its matrix's two factors), applied
// (p − lr·(u + weight_decay·p)). Its finish advances the CELO2 AdamW tensors' own step counts (celo2_adamw, before
// it, read their bias corrections from celo2_control).
struct Celo2Apply {
  const Celo2Tensor* celo2_tensors;
  int num_tensors;
  const double* celo2_groups;
  const float* steps;
  const int* proposed_nonfinite;  // (celo2_normalise's flags, final_step)
  const float2* step_scales;

  LOPT_DEVICE bool skipped(const StepFlags& flags) const { return step_is_skipped(flags); }
  LOPT_DEVICE void finish(bool skipped) const {
    if (skipped) return;
    // (block 0's threads share the tensors, so that block 0 starts on its share of the pass with the others)
    for (int i = threadIdx.x; i < num_tensors; i += blockDim.x) {
      const Celo2Tensor& c = celo2_tensors[i];
      if (c.kind == LOPT_CELO2_ADAM_OWN) *pointer<i64>(c.adam_step) += 1;
    }
  }
  LOPT_DEVICE void begin_tensor(int) const {}


  // A learned element's u = rms_mult · normalised s, applied.
  LOPT_DEVICE static float learned_param(float param, float s, float2 scale, float rms_mult, const ApplyScalars& group) {
    return updated_param(param, __fmul_rn(__fmul_rn(__fmul_rn(s, scale.x), scale.y), rms_mult), group);
  }

  LOPT_DEVICE void chunks(const TensorMeta& t, const ApplyScalars& group, int tensor, i64 chunk, i64 end,
                          float inverse_scale) const {
    const Celo2Tensor c = celo2_tensors[tensor];  // (a learned tensor: the apply pass walks those alone)
    const double* values = group_values(celo2_groups, t.group);
    // (the elements of chunks [chunk, end): chunks are C2_APPLY_CHUNK elements, and a tensor's first is whole)
    const i64 begin = (chunk - t.first_apply_chunk) * C2_APPLY_CHUNK;
    const i64 stop = min((end - t.first_apply_chunk) * C2_APPLY_CHUNK, t.numel);
    const int param_dtype = static_cast<int>(t.param_dtype);
    const float2 scale = step_scales[tensor];
    const int flag = proposed_nonfinite[tensor];
    const float rms_mult = static_cast<float>(values[LOPT_CELO2_GROUP_RMS_MULT]);
    const int result_dtype = static_cast<int>(c.result_dtype);
    if (flag == 0 && quad_aligned(t.param, param_dtype) && quad_aligned(c.result, result_dtype)) {
      // C2_APPLY_QUADS quads of four consecutive elements per thread at a time, every load issued before any
      // value is used: with an element per load the pass waited on DRAM latency (docs/performance.md §8).
      for (i64 first = begin; first < stop; first += 4 * C2_APPLY_THREADS * C2_APPLY_QUADS) {
        float4 param[C2_APPLY_QUADS], s[C2_APPLY_QUADS];
#pragma unroll
        for (int q = 0; q < C2_APPLY_QUADS; ++q) {
          const i64 e = first + 4 * (q * C2_APPLY_THREADS + threadIdx.x);
          if (e + 4 <= stop) {
            param[q] = load_quad_as_float(pointer<const void>(t.param), e, param_dtype);
            s[q] = load_quad_as_float(pointer<const void>(c.result), e, result_dtype);  // (final_step: flag 0)
          }
        }
#pragma unroll
        for (int q = 0; q < C2_APPLY_QUADS; ++q) {
          const i64 e = first + 4 * (q * C2_APPLY_THREADS + threadIdx.x);
          if (e + 4 <= stop) {
            float4 updated;
#pragma unroll
            for (int k = 0; k < 4; ++k)
              quad_value(updated, k) = learned_param(quad_value(param[q], k), quad_value(s[q], k), scale, rms_mult, group);
            store_quad_from_float(pointer<void>(t.param), e, param_dtype, updated);
          } else {
            for (i64 i = e; i < stop; ++i)  // (the tensor's last, partial quad)
              store_from_float(pointer<void>(t.param), i, param_dtype,
                               learned_param(load_as_float(pointer<const void>(t.param), i, param_dtype),
                                             load_as_float(pointer<const void>(c.result), i, result_dtype), scale,
                                             rms_mult, group));
          }
        }
      }
      return;
    }
    // Element by element (a parameter or step not aligned for quads, or a proposed step with a non-finite
    // element): C2_APPLY_ELEMENTS chunks at a time, every element's loads issued before any is used.
    for (; chunk < end; chunk += C2_APPLY_ELEMENTS) {
      float param[C2_APPLY_ELEMENTS], s[C2_APPLY_ELEMENTS];
#pragma unroll
      for (int k = 0; k < C2_APPLY_ELEMENTS; ++k) {
        const i64 e = (chunk + k - t.first_apply_chunk) * C2_APPLY_CHUNK + threadIdx.x;
        if (chunk + k < end && e < t.numel) {
          param[k] = load_as_float(pointer<const void>(t.param), e, param_dtype);
          s[k] = final_step(steps + c.step_offset, c, e, flag);
        }
      }
#pragma unroll
      for (int k = 0; k < C2_APPLY_ELEMENTS; ++k) {
        const i64 e = (chunk + k - t.first_apply_chunk) * C2_APPLY_CHUNK + threadIdx.x;
        if (chunk + k < end && e < t.numel)
          store_from_float(pointer<void>(t.param), e, param_dtype, learned_param(param[k], s[k], scale, rms_mult, group));
      }
    }
  }
};

// The AdamW branch, walk_chunks_of's visitor over the AdamW tensors' walk: CELO2's on each tensor's own moments
// (reference: update_adam_moments, adam_direction), ELO-CELO2's on the shared accumulators, updated as the learned
// tensors' are (reference: adamw_shared_step). A quad of four consecutive elements per thread at a time where
// every array allows (each array's values in one or three 16-byte loads, all issued before any is used), else
// element by element. Inside celo2_apply (64 registers) the shared branch could take only an element per thread
// at a time, whose DRAM latency each thread waited out in turn, and the blocks whose share of the apply pass's
// chunks was an AdamW tensor's ran last (docs/performance.md §8).
struct Celo2AdamW {
  const Celo2Tensor* celo2_tensors;
  const double* celo2_groups;
  const float2* gradient_transforms;
  const float2* adam_corrections;

  LOPT_DEVICE void begin_tensor(int) const {}

  // An own-moment AdamW element (reference: update_adam_moments on its own exp_avg, exp_avg_sq, then adam_direction):
  // m and v updated in place, the new parameter returned.
  LOPT_DEVICE static float adam_own_param(float raw_grad, float param, float& m, float& v, float inverse_scale,
                                          const Celo2AdamScalars& adam) {
    const float grad = step_gradient(unscale_gradient(raw_grad, inverse_scale), adam.transform);
    m = ema(m, adam.b1, adam.b1_mix, grad);
    v = ema(v, adam.b2, adam.b2_mix, __fmul_rn(grad, grad));
    return updated_param(param, adam_direction(m, v, adam.corrections, adam.eps), adam.scalars);
  }

  // A shared-accumulator AdamW element from its loaded values (the gradient unscaled): the accumulators updated, the new parameter
  // returned.
  LOPT_DEVICE static float element(float unscaled_grad, float param, ElementState& s, const Celo2AdamScalars& adam,
                                   const Decays& decays, bool factored) {
    const float grad = step_gradient(unscaled_grad, adam.transform);
    update_accumulators(s, grad, decays, factored);
    return updated_param(param, adam_direction(s.mom[0], s.rms, adam.corrections, adam.eps), adam.scalars);
  }

  LOPT_DEVICE void chunks(const TensorMeta& t, const ApplyScalars& group, int tensor, i64 chunk, i64 end,
                          float inverse_scale) const {
    const Celo2Tensor c = celo2_tensors[tensor];
    const Celo2AdamScalars adam = celo2_adam_scalars(c, group_values(celo2_groups, t.group), group,
                                                     gradient_transforms[tensor], adam_corrections[tensor]);
    const i64 begin = (chunk - t.first_apply_chunk) * C2_APPLY_CHUNK;  // (a multiple of 4)
    const i64 stop = min((end - t.first_apply_chunk) * C2_APPLY_CHUNK, t.numel);
    if (c.kind == LOPT_CELO2_ADAM_OWN)
      own_moments(t, c, adam, begin, stop, inverse_scale);
    else
      shared_accumulators(t, group, adam, begin, stop, inverse_scale);
  }

  LOPT_DEVICE void own_moments(const TensorMeta& t, const Celo2Tensor& c, const Celo2AdamScalars& adam, i64 begin,
                               i64 stop, float inverse_scale) const {
    const int param_dtype = static_cast<int>(t.param_dtype);
    float* exp_avg = pointer<float>(c.exp_avg);
    float* exp_avg_sq = pointer<float>(c.exp_avg_sq);
    const void* grad = pointer<const void>(t.grad);
    const int grad_dtype = static_cast<int>(t.grad_dtype);
    const bool quads = quad_aligned(t.grad, grad_dtype) && quad_aligned(t.param, param_dtype) &&
                       quad_aligned(c.exp_avg, LOPT_F32) && quad_aligned(c.exp_avg_sq, LOPT_F32);
    // (a quad of four consecutive elements per thread at a time where every array allows, else an element)
    const int per_thread = quads ? 4 : 1;
    for (i64 first = begin; first < stop; first += per_thread * C2_APPLY_THREADS) {
      const i64 e = first + per_thread * threadIdx.x;
      if (quads && e + 4 <= stop) {
        const float4 raw_grad = load_quad_as_float(grad, e, grad_dtype);
        const float4 param = load_quad_as_float(pointer<const void>(t.param), e, param_dtype);
        float4 m = *reinterpret_cast<const float4*>(exp_avg + e), v = *reinterpret_cast<const float4*>(exp_avg_sq + e);
        float4 updated;
#pragma unroll
        for (int k = 0; k < 4; ++k)
          quad_value(updated, k) = adam_own_param(quad_value(raw_grad, k), quad_value(param, k), quad_value(m, k),
                                                  quad_value(v, k), inverse_scale, adam);
        *reinterpret_cast<float4*>(exp_avg + e) = m;
        *reinterpret_cast<float4*>(exp_avg_sq + e) = v;
        store_quad_from_float(pointer<void>(t.param), e, param_dtype, updated);
        continue;
      }
      for (i64 i = e; i < min(e + per_thread, stop); ++i) {  // (element by element; a quad's tail)
        float m = exp_avg[i], v = exp_avg_sq[i];
        const float updated = adam_own_param(load_as_float(grad, i, grad_dtype),
                                             load_as_float(pointer<const void>(t.param), i, param_dtype), m, v,
                                             inverse_scale, adam);
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
        store_from_float(pointer<void>(t.param), i, param_dtype, updated);
      }
    }
  }

  LOPT_DEVICE void shared_accumulators(const TensorMeta& t, const ApplyScalars& group, const Celo2AdamScalars& adam,
                                       i64 begin, i64 stop, float inverse_scale) const {
    const int grad_dtype = static_cast<int>(t.grad_dtype), param_dtype = static_cast<int>(t.param_dtype);
    const bool quads = quad_aligned(t.grad, grad_dtype) && quad_aligned(t.param, param_dtype) &&
                       quad_aligned(t.mom, LOPT_F32) && quad_aligned(t.rms, LOPT_F32) &&
                       (t.factored || quad_aligned(t.fac_full, LOPT_F32));
    for (i64 e = begin + 4 * threadIdx.x; e < stop; e += 4 * C2_APPLY_THREADS) {
      if (quads && e + 4 <= stop) {
        const float4 raw_grad = load_quad_as_float(pointer<const void>(t.grad), e, grad_dtype);
        const float4 param = load_quad_as_float(pointer<const void>(t.param), e, param_dtype);
        float4* mom = reinterpret_cast<float4*>(pointer<float>(t.mom) + 3 * e);  // (the quad's 12 momenta)
        float4* full = reinterpret_cast<float4*>(pointer<float>(t.fac_full) + 3 * e);
        float4* rms = reinterpret_cast<float4*>(pointer<float>(t.rms) + e);
        float m[12], v[12];
        reinterpret_cast<float4*>(m)[0] = mom[0];
        reinterpret_cast<float4*>(m)[1] = mom[1];
        reinterpret_cast<float4*>(m)[2] = mom[2];
        float4 r = *rms;
        if (!t.factored) {
          reinterpret_cast<float4*>(v)[0] = full[0];
          reinterpret_cast<float4*>(v)[1] = full[1];
          reinterpret_cast<float4*>(v)[2] = full[2];
        }
        float4 updated;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          ElementState s;
#pragma unroll
          for (int j = 0; j < 3; ++j) {
            s.mom[j] = m[3 * k + j];
            s.full[j] = t.factored ? 0.f : v[3 * k + j];
          }
          s.rms = quad_value(r, k);
          quad_value(updated, k) = element(unscale_gradient(quad_value(raw_grad, k), inverse_scale), quad_value(param, k),
                                           s, adam, group.decays, t.factored);
#pragma unroll
          for (int j = 0; j < 3; ++j) {
            m[3 * k + j] = s.mom[j];
            v[3 * k + j] = s.full[j];
          }
          quad_value(r, k) = s.rms;
        }
        mom[0] = reinterpret_cast<float4*>(m)[0];
        mom[1] = reinterpret_cast<float4*>(m)[1];
        mom[2] = reinterpret_cast<float4*>(m)[2];
        *rms = r;
        if (!t.factored) {
          full[0] = reinterpret_cast<float4*>(v)[0];
          full[1] = reinterpret_cast<float4*>(v)[1];
          full[2] = reinterpret_cast<float4*>(v)[2];
        }
        store_quad_from_float(pointer<void>(t.param), e, param_dtype, updated);
        continue;
      }
      for (i64 i = e; i < min(e + 4, stop); ++i) {  // (element by element: unaligned arrays; a tensor's last quad)
        float param;
        ElementState s;
        const float grad = load_element(t, i, inverse_scale, param, s);
        const float updated = element(grad, param, s, adam, group.decays, t.factored);
        store_element_state(t, i, s);
        store_from_float(pointer<void>(t.param), i, param_dtype, updated);
      }
    }
  }
};

#include "celo2_slices.cuh"

// Block 0 advances the step counters (apply_pass_goes_on), so the pass launches with one block at least, also
// where its walk is empty.
extern "C" __global__ void __launch_bounds__(C2_APPLY_THREADS, C2_APPLY_BLOCKS)
celo2_apply(const TensorMeta* __restrict__ tensors, const i64* __restrict__ gradients, int num_tensors,
            const GroupMeta* __restrict__ groups, int num_groups, const ChunkWalk* __restrict__ walk, int walk_rows,
            i64 walk_chunks, const Celo2Tensor* __restrict__ celo2_tensors, const double* __restrict__ celo2_groups,
            const float* __restrict__ steps, const int* __restrict__ proposed_nonfinite,
            const float2* __restrict__ step_scales, const float* grad_scale, const float* found_inf, int* status,
            i64* skipped_steps) {
  const Celo2Apply apply{celo2_tensors, num_tensors, celo2_groups, steps, proposed_nonfinite, step_scales};
  const StepFlags flags{grad_scale, found_inf, status};
  if (apply_pass_goes_on(groups, num_groups, flags, skipped_steps, apply))
    walk_chunks_of(tensors, gradients, groups, walk, walk_rows, walk_chunks, inverse_grad_scale(flags), apply);
}

// The AdamW tensors (Celo2AdamW), before celo2_apply, which advances the step counters (this pass's bias
// corrections come from celo2_control).
extern "C" __global__ void __launch_bounds__(C2_APPLY_THREADS, C2_ADAMW_BLOCKS)
celo2_adamw(const TensorMeta* __restrict__ tensors, const i64* __restrict__ gradients,
            const GroupMeta* __restrict__ groups, const ChunkWalk* __restrict__ walk, int walk_rows, i64 walk_chunks,
            const Celo2Tensor* __restrict__ celo2_tensors, const double* __restrict__ celo2_groups,
            const float2* __restrict__ gradient_transforms, const float2* __restrict__ adam_corrections,
            const float* grad_scale, const float* found_inf, int* status) {
  const StepFlags flags{grad_scale, found_inf, status};
  if (step_is_skipped(flags)) return;  // (celo2_apply's decision: nothing is written)
  const Celo2AdamW visit{celo2_tensors, celo2_groups, gradient_transforms, adam_corrections};
  walk_chunks_of(tensors, gradients, groups, walk, walk_rows, walk_chunks, inverse_grad_scale(flags), visit);
}
