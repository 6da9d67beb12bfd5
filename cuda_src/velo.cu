// VeLO, fused: the same phases as lopt/reference/velo.py for every tensor of every parameter group in a
// constant number of launches (lopt/fused/velo.py drives them):
//
//   accumulate   adafactor_axis_partials, adafactor_finalize, adafactor_factor_tables   (accumulators.cuh;
//                VeLO's gradient clipped to ±1000)
//   statistics   velo_statistics      per chunk: the 30 feature sums of squares (updated accumulators) and the
//                                     LSTM sums of the pre-update parameter and the old momentum and rms;
//                                     the check phase's test of every gradient element
//   control      velo_tensor_control  per tensor: normalisation scales, the 30 LSTM inputs (loss buffer,
//                                     fraction of training, statistics, rank); a kept step's new R and C
//                velo_mix             mixing layers: the max over every tensor's row couples them
//                velo_lstm            one LSTM step for all tensors (float64, gates fused into the product)
//                velo_heads           control vector, step multiplier λ, weight generation, the tensor's MLP
//                                     with its normalisation folded into the first layer; a kept step's LSTM state
//                velo_table_contributions  the factor-table features' share of the first layer, per table entry
//   apply        velo_apply           update_accumulators + per_element_features + per_element_mlp + update
//
// As in the reference, the controller runs in float64 (its products are exact, its sums do not depend
// on the order) and its outputs are rounded to float32; the per-element work is float32.
#include "common.cuh"
#include "accumulators.cuh"

// VeLO's network, from the build's -D values (lopt.fused.velo.network_defines: lopt.reference.velo and the
// registered architecture), never spelled here:
//   VELO_NUM_FEATURES, VELO_TABLE_FEATURES_FIRST   the per-element features; R, C, rsqrt R, rsqrt C's first
//   VELO_GRADIENT_CLIP, VELO_GRADIENT_FEATURE_CLIP  float literals
//   VELO_LSTM_INPUTS, VELO_HIDDEN, VELO_CONTROLS    the LSTM's inputs and width, the candidate MLPs
//   VELO_WEIGHT_GENERATION_SCALE                    the generated weights' factor (a double literal)
//   VELO_LOSS_TIMESCALES, VELO_LOSS_FEATURES, VELO_FRACTION_FEATURES, VELO_RANK_CLASSES
//   VELO_FRACTION_TIMESCALES_EACH(X)                X(t) for each fraction timescale t (float literals)
//   VELO_LSTM_LOSS_FIRST, _MEAN_RMS, _RANK_FIRST, _VARIANCES_FIRST   positions in the LSTM's input row
//   VELO_GEN_*                                      the generated MLP (lopt.network.MLPGeometry.cuda_defines)
#ifndef VELO_GEN_INPUTS
#error "build with lopt.fused.velo.network_defines (VeLO's network: VELO_NUM_FEATURES ... VELO_GEN_*)"
#endif
// The kernels below are written for the published shapes; these say which they are.
static_assert(VELO_GEN_INPUTS == VELO_NUM_FEATURES, "the generated MLP reads the per-element features");
static_assert(VELO_GEN_HIDDEN == 4 && VELO_GEN_HIDDEN_LAYERS == 1 && VELO_GEN_OUTPUTS == 3,
              "per_element_mlp holds a hidden layer in a float4: a 30-4-4-3 generated MLP");
static_assert(VELO_LSTM_LOSS_FIRST == VELO_FRACTION_FEATURES && VELO_LSTM_MEAN_RMS == VELO_LSTM_LOSS_FIRST + VELO_LOSS_FEATURES &&
              VELO_LSTM_RANK_FIRST == VELO_LSTM_MEAN_RMS + 1 && VELO_LSTM_VARIANCES_FIRST == VELO_LSTM_RANK_FIRST + VELO_RANK_CLASSES &&
              VELO_LSTM_VARIANCES_FIRST + 6 == VELO_LSTM_INPUTS, "velo_tensor_control writes the LSTM inputs in this order");
#define VELO_FF VELO_GEN_HIDDEN  // hidden units of the generated MLP

// Statistics partials per chunk: the 30 feature sums of squares, then the LSTM sums of the old state
// over its finite elements (shifted by the tensor's first element s where that is finite, else 0, so
// that variances do not cancel), at these offsets (LOPT_VELO_LSTM_SUMS of them, the contract's):
#define VELO_SUM_PARAM 0     // Σp²
#define VELO_SUM_MOM 1       // Σ(m_k − s_k), k = 0..2
#define VELO_SUM_MOM_SQ 4    // Σ(m_k − s_k)²
#define VELO_COUNT_MOM 7     // how many m_k are finite
#define VELO_SUM_RMS 10      // Σ(v − s_v)
#define VELO_SUM_RMS_SQ 11   // Σ(v − s_v)²
#define VELO_COUNT_RMS 12    // how many v are finite
#define VELO_LSTM_SUMS LOPT_VELO_LSTM_SUMS
static_assert(VELO_COUNT_RMS + 1 == VELO_LSTM_SUMS, "the LSTM sums fill the contract's count");
#define VELO_STATS (VELO_NUM_FEATURES + VELO_LSTM_SUMS)

// A tensor's record for the apply pass (float32): the first layer with the normalisation folded in,
// stored by input (W0'ᵀ: one float4 holds an input's weights to the 4 hidden units), the other layers
// (direction and magnitude outputs only), λ and param_scale.
#define VELO_RECORD_W0 0                                   // (30, 4)
#define VELO_RECORD_B0 (VELO_NUM_FEATURES * VELO_FF)
#define VELO_RECORD_W1 (VELO_RECORD_B0 + VELO_FF)          // (4, 4)
#define VELO_RECORD_B1 (VELO_RECORD_W1 + VELO_FF * VELO_FF)
#define VELO_RECORD_W2 (VELO_RECORD_B1 + VELO_FF)          // (2, 4)
#define VELO_RECORD_B2 (VELO_RECORD_W2 + 2 * VELO_FF)      // (2,)
#define VELO_RECORD_LR_MULT (VELO_RECORD_B2 + 2)
#define VELO_RECORD_PARAM_SCALE (VELO_RECORD_LR_MULT + 1)
#define VELO_RECORD_FLOATS (VELO_RECORD_PARAM_SCALE + 1)
// velo_heads copies b0 .. W2's first two rows from the generated weights as they lie
static_assert(VELO_RECORD_B0 == VELO_GEN_B0 && VELO_RECORD_W1 == VELO_GEN_W1 && VELO_RECORD_B1 == VELO_GEN_B1 &&
              VELO_RECORD_W2 == VELO_GEN_W2, "the record's b0, W1, b1, W2 where the generated MLP has them");
static_assert(VELO_RECORD_B0 % 4 == 0 && VELO_RECORD_W1 % 4 == 0 && VELO_RECORD_W2 % 4 == 0, "float4 loads");

#define VELO_LIST_ITEM(value) value,
__constant__ float VELO_FRACTION_TIMESCALES[VELO_FRACTION_FEATURES] = {VELO_FRACTION_TIMESCALES_EACH(VELO_LIST_ITEM)};

// ------------------------------------------------------------------------------------------
// The loss and the loss buffer (reference: update_loss_buffer, loss_features)
// ------------------------------------------------------------------------------------------

// This step's loss: a value passed by the host, or read on the device (a user's loss tensor, or the
// sum of the losses handed to accumulate_loss, divided by their count).
struct StepLoss {
  const void* tensor;
  int dtype;
  float value, count;
};

LOPT_DEVICE float step_loss(const StepLoss& loss) {
  return loss.tensor != nullptr ? __fdiv_rn(load_as_float(loss.tensor, 0, loss.dtype), loss.count) : loss.value;
}

// The loss buffer after this step's loss (means, running minima; the count becomes count + 1).
struct LossBuffer {
  float means[VELO_LOSS_TIMESCALES], running_min[VELO_LOSS_TIMESCALES];
  int count;
};

LOPT_DEVICE LossBuffer update_loss_buffer(const float* means, const float* running_min, const int* count,
                                          const float* decays, float loss) {
  LossBuffer updated;
  const int n = *count;
  float bias_correction[VELO_LOSS_TIMESCALES];
  float approx_max = LOPT_NEGATIVE_INFINITY;
#pragma unroll
  for (int j = 0; j < VELO_LOSS_TIMESCALES; ++j) {
    bias_correction[j] = __fsub_rn(1.0f, powf(decays[j], static_cast<float>(n + 1)));
    approx_max = fmaxf(approx_max, __fdiv_rn(means[j], bias_correction[j]));
  }
  if (n == 0) approx_max = loss;
  const float clipped_loss = fminf(__fmul_rn(fabsf(approx_max), 2.0f), loss);  // spikes clipped from above
#pragma unroll
  for (int j = 0; j < VELO_LOSS_TIMESCALES; ++j) {
    updated.means[j] = __fadd_rn(__fmul_rn(means[j], decays[j]), __fmul_rn(clipped_loss, __fsub_rn(1.0f, decays[j])));
    updated.running_min[j] = fminf(running_min[j], __fdiv_rn(updated.means[j], bias_correction[j]));
  }
  updated.count = n + 1;
  return updated;
}

// f_j = clip((a_j − ρ_j) / max(1e-8, a_{j+1} − ρ_j) − 1, −1, 1), a = bias-corrected means; zero while n <= 2.
LOPT_DEVICE void loss_features(const LossBuffer& buffer, const float* decays, float features[VELO_LOSS_FEATURES]) {
  float corrected[VELO_LOSS_TIMESCALES];
#pragma unroll
  for (int j = 0; j < VELO_LOSS_TIMESCALES; ++j)
    corrected[j] = __fdiv_rn(buffer.means[j], __fsub_rn(1.0f, powf(decays[j], static_cast<float>(buffer.count))));
#pragma unroll
  for (int j = 0; j < VELO_LOSS_FEATURES; ++j) {
    const float spread = fmaxf(__fsub_rn(corrected[j + 1], buffer.running_min[j]), 1e-8f);
    const float f = __fsub_rn(__fdiv_rn(__fsub_rn(corrected[j], buffer.running_min[j]), spread), 1.0f);
    features[j] = buffer.count <= 2 ? 0.0f : fminf(fmaxf(f, -1.0f), 1.0f);
  }
}

// VeLO's step is also skipped for a non-finite loss.
LOPT_DEVICE bool velo_step_is_skipped(const StepFlags& flags, float loss) {
  return step_is_skipped(flags) || !is_finite(loss);
}

// ------------------------------------------------------------------------------------------
// Per-element features (reference: per_element_features), the 30 in input order
// ------------------------------------------------------------------------------------------
LOPT_DEVICE void per_element_features(float x[VELO_NUM_FEATURES], float grad, float param, const ElementState& s,
                                      bool factored, const FactorEntry& row, const FactorEntry& col) {
  gradient_moment_features(x, grad, param, s, factored, row, col, 1e-6f, VELO_GRADIENT_FEATURE_CLIP);
  adafactor_features(x + VELO_TABLE_FEATURES_FIRST, s, factored, row, col, 0.0f);  // no epsilon (unlike small_fc)
}

LOPT_DEVICE constexpr bool is_table_feature(int k) {
  return k >= VELO_TABLE_FEATURES_FIRST && k < VELO_TABLE_FEATURES_FIRST + LOPT_TABLE_FEATURES;
}

// clip_gradient: ĝ = clip(g, −1000, 1000), the only gradient VeLO looks at.
LOPT_DEVICE float clip_gradient(float g) { return fminf(fmaxf(g, -VELO_GRADIENT_CLIP), VELO_GRADIENT_CLIP); }

// ------------------------------------------------------------------------------------------
// Statistics pass
// ------------------------------------------------------------------------------------------
// The statistics pass is bound by memory: each thread takes its elements in pairs and asks L2 for the
// next pair ahead of use; the register bound keeps 24 warps per SM with loads in flight.
#define VELO_STATS_MIN_BLOCKS 3
constexpr int STATS_UNROLL = 1;    // pairs of elements per iteration
constexpr int STATS_PREFETCH = 1;  // pairs requested into L2 ahead

// Per thread, sums in float32 (over at most LOPT_STATS_PER_THREAD elements; the block adds them in
// float64). The old momentum and rms enter shifted by the tensor's first element's, so that their
// variances (E[d²] − E[d]² of the shifted values) do not cancel, and are exactly zero for a constant tensor.
// A non-finite parameter, momentum or rms element (state loaded or edited from outside) is left out of
// its sums and counts (finite_part in the reference): it stays in its element instead of reaching the
// LSTM row, and through the controller's max every tensor's.
LOPT_DEVICE float finite_or_zero(float x) { return is_finite(x) ? x : 0.f; }

// The shifts of the old momentum and rms: the tensor's first element's where finite, else 0 (the
// statistics pass and the control kernel must take the same ones).
struct MomentShifts {
  float mom[3] = {0.f, 0.f, 0.f};
  float rms = 0.f;
};

LOPT_DEVICE MomentShifts moment_shifts(const TensorMeta& t) {
  MomentShifts shifts;
  const float* mom0 = pointer<const float>(t.mom);
#pragma unroll
  for (int k = 0; k < 3; ++k) shifts.mom[k] = finite_or_zero(mom0[k]);
  shifts.rms = finite_or_zero(pointer<const float>(t.rms)[0]);
  return shifts;
}

// The statistics pass's functor (statistics_pass in accumulators.cuh).
struct VeloStatistics {
  static constexpr int kSums = VELO_STATS;  // the 30 features' sums of squares, then the LSTM sums
  static constexpr int kUnroll = STATS_UNROLL;
  static constexpr int kPrefetch = STATS_PREFETCH;
  static constexpr bool kSomeOnlyChecked = false;
  struct Inputs {
    const float4* row_factors;
    const float4* col_factors;
  };
  const TensorMeta& t;
  Decays decays;
  Inputs tables;
  MomentShifts shift;

  LOPT_DEVICE VeloStatistics(const TensorMeta& tensor_meta, int, const Decays& group_decays, const Inputs& inputs)
      : t(tensor_meta), decays(group_decays), tables(inputs), shift(moment_shifts(tensor_meta)) {}

  template <bool Factored>
  LOPT_DEVICE void add(float raw_grad, float param, ElementState& s, const FactorIndex& f, float (&sums)[kSums]) const {
    float* lstm = sums + VELO_NUM_FEATURES;
    const float grad = clip_gradient(raw_grad);
    // tensor_statistics: the pre-update parameter and the old accumulators, their finite elements
    // (below, a non-finite feature is left out of its sum the same way).
    if (is_finite(param)) lstm[VELO_SUM_PARAM] = fmaf(param, param, lstm[VELO_SUM_PARAM]);
#pragma unroll
    for (int k = 0; k < 3; ++k) {
      if (!is_finite(s.mom[k])) continue;
      const float d = __fsub_rn(s.mom[k], shift.mom[k]);
      lstm[VELO_SUM_MOM + k] += d;
      lstm[VELO_SUM_MOM_SQ + k] = fmaf(d, d, lstm[VELO_SUM_MOM_SQ + k]);
      lstm[VELO_COUNT_MOM + k] += 1.f;
    }
    if (is_finite(s.rms)) {
      const float d = __fsub_rn(s.rms, shift.rms);
      lstm[VELO_SUM_RMS] += d;
      lstm[VELO_SUM_RMS_SQ] = fmaf(d, d, lstm[VELO_SUM_RMS_SQ]);
      lstm[VELO_COUNT_RMS] += 1.f;
    }
    // per_element_features: the updated accumulators.
    update_accumulators(s, grad, decays, Factored);
    FactorEntry row = {}, col = {};
    if (Factored) load_factors(t, f, tables.row_factors, tables.col_factors, row, col);
    float x[VELO_NUM_FEATURES];
    per_element_features(x, grad, param, s, Factored, row, col);
#pragma unroll
    for (int j = 0; j < VELO_NUM_FEATURES; ++j)
      if (!(Factored && is_table_feature(j)) && is_finite(x[j])) sums[j] = fmaf(x[j], x[j], sums[j]);
  }
};

extern "C" __global__ void __launch_bounds__(LOPT_STATS_THREADS, VELO_STATS_MIN_BLOCKS)
velo_statistics(const TensorMeta* __restrict__ tensors, const i64* __restrict__ gradients, int num_tensors,
                const GroupMeta* __restrict__ groups,
                const float4* __restrict__ row_factors, const float4* __restrict__ col_factors, const float* grad_scale,
                const float* found_inf, int* status, double* __restrict__ stats_partials) {
  statistics_pass<VeloStatistics>(tensors, gradients, num_tensors, groups, StepFlags{grad_scale, found_inf, status},
                                  VeloStatistics::Inputs{row_factors, col_factors}, stats_partials);
}

// ------------------------------------------------------------------------------------------
// Control phase, per tensor: normalisation scales and the LSTM input row (reference: tensor_statistics,
// clip_log_abs, fraction_features, lstm_input_features)
// ------------------------------------------------------------------------------------------
#define VELO_CONTROL_THREADS 256
#define VELO_CONTROL_LANES 5  // partial sums per statistic (43 x 5 <= 256 threads)

// L(x) = 0.5 · clip(ln(1e-8 + |10·x|), −5, 5)
LOPT_DEVICE float clip_log_abs(float x) {
  return __fmul_rn(fminf(fmaxf(logf(__fadd_rn(1e-8f, fabsf(__fmul_rn(x, 10.0f)))), -5.0f), 5.0f), 0.5f);
}

// `phase` 0: the whole control step of each tensor. Where tensors are split among processes (FSDP2)
// their sums are partial: phase 1 writes each tensor's sums to tensor_sums, the caller sums them over
// the processes, and phase 2 goes on from the totals (dividing by the whole tensor's count).
extern "C" __global__ void __launch_bounds__(VELO_CONTROL_THREADS)
velo_tensor_control(const TensorMeta* __restrict__ tensors, const VeloTensor* __restrict__ velo_tensors,
                    int num_tensors, const GroupMeta* __restrict__ groups, const double* __restrict__ stats_partials,
                    const float* __restrict__ row_table, const float* __restrict__ col_table, const float* grad_scale,
                    const float* found_inf, int* status, const float* __restrict__ loss_means,
                    const float* __restrict__ loss_running_min, const int* __restrict__ loss_count,
                    const float* __restrict__ loss_decays, const void* loss_tensor, int loss_dtype, float loss_value,
                    float loss_divisor, i64 num_steps, float* __restrict__ feature_scales,
                    double* __restrict__ lstm_inputs, float* __restrict__ param_scales,
                    unsigned long long* __restrict__ mixed_max, int phase, double* __restrict__ tensor_sums,
                    i64 total_row_entries, i64 total_col_entries) {
  const StepFlags flags{grad_scale, found_inf, status};
  const int tid = threadIdx.x;
  const int r = blockIdx.x;
  if (r >= num_tensors) {  // the blocks after the tensors': a kept step's new R and C to the state
    if (phase != 1 && !velo_step_is_skipped(flags, step_loss(StepLoss{loss_tensor, loss_dtype, loss_value, loss_divisor})))
      commit_factored_accumulators(tensors, num_tensors, row_table, col_table, total_row_entries, total_col_entries,
                                   r - num_tensors, gridDim.x - num_tensors, tid, VELO_CONTROL_THREADS);
    return;
  }
  const TensorMeta t = tensors[r];
  __shared__ double lane_sums[VELO_STATS][VELO_CONTROL_LANES];
  __shared__ double table_scratch[VELO_CONTROL_THREADS / 32][LOPT_TABLE_FEATURES];
  __shared__ double table_sums[LOPT_TABLE_FEATURES];
  __shared__ double sums[VELO_STATS];
  double* split_sums = tensor_sums + static_cast<i64>(r) * VELO_STATS;
  // The statistics pass's shifts of the old momentum and rms: this process's first element (none in
  // an empty shard). Sums from several processes have different shifts: phase 1 removes them.
  MomentShifts shift;  // (zeros in phase 2, whose sums are plain, and in an empty shard)
  if (t.numel > 0 && phase != 2) shift = moment_shifts(t);
  phase_statistics_sums<VELO_STATS, VELO_CONTROL_THREADS, VELO_CONTROL_LANES>(
      phase, split_sums, t, stats_partials, row_table, col_table, VELO_TABLE_FEATURES_FIRST, lane_sums, table_scratch,
      table_sums, sums);
  if (phase == 1) {
    // This process's sums, the momentum and rms ones as plain Σx and Σx² (float64; what the
    // variances then lose to cancellation, ~1e-16 of the squared mean, is far below the resolution
    // of clip_log_abs, whose argument is floored at e^-5 / 10).
    if (tid < VELO_NUM_FEATURES + 1) {
      split_sums[tid] = sums[tid];
    } else if (tid < VELO_NUM_FEATURES + 5) {
      const int k = tid - VELO_NUM_FEATURES - 1;  // 0..2: momenta, 3: rms
      const int sum = k < 3 ? VELO_SUM_MOM + k : VELO_SUM_RMS, square = k < 3 ? VELO_SUM_MOM_SQ + k : VELO_SUM_RMS_SQ;
      const int count = k < 3 ? VELO_COUNT_MOM + k : VELO_COUNT_RMS;
      const double shift_k = k < 3 ? shift.mom[k] : shift.rms;
      const double* lstm = sums + VELO_NUM_FEATURES;
      const double offsets = lstm[sum], squares = lstm[square], finite_count = lstm[count];
      double* out = split_sums + VELO_NUM_FEATURES;
      out[sum] = offsets + finite_count * shift_k;
      out[square] = squares + 2.0 * shift_k * offsets + finite_count * shift_k * shift_k;
      out[count] = finite_count;
    }
    return;
  }
  const float loss = step_loss(StepLoss{loss_tensor, loss_dtype, loss_value, loss_divisor});
  const bool skipped = velo_step_is_skipped(flags, loss);
  if (r == 0)
    for (int j = tid; j < VELO_HIDDEN; j += VELO_CONTROL_THREADS) mixed_max[j] = 0ull;  // +0.0: velo_mix maxes into it
  const double n = static_cast<double>(t.count);
  if (tid < VELO_NUM_FEATURES)  // normalise_features
    feature_scales[static_cast<i64>(r) * VELO_NUM_FEATURES + tid] = normaliser_scale(sums[tid], t.count);
  if (tid != 0) return;
  // One thread: the tensor's statistics and LSTM input row.
  const double* lstm = sums + VELO_NUM_FEATURES;
  const float mean_square_param = static_cast<float>(lstm[VELO_SUM_PARAM] / n);
  param_scales[r] = sqrtf(__fadd_rn(mean_square_param, 1e-9f));
  const double nu = rsqrtf(fmaxf(mean_square_param, 1e-9f));  // ν, float32 as in the reference
  // Over the finite elements only (F of the n; the means still divide by n, as the reference's
  // finite_part adds 0 for the others): with d = x − s, Σ_F x = Σd + F·s, and around a value μ,
  // Σ_F (x − μ)² = Σd² − 2b·Σd + F·b², b = μ − s.
  const double rms_sum = lstm[VELO_SUM_RMS], rms_square = lstm[VELO_SUM_RMS_SQ], rms_count = lstm[VELO_COUNT_RMS];
  float statistics[7];  // μ_v, var_m (3), var_v (3)
  statistics[0] = static_cast<float>(nu * ((rms_sum + rms_count * shift.rms) / n));
#pragma unroll
  for (int k = 0; k < 3; ++k) {
    const double sum = lstm[VELO_SUM_MOM + k], square = lstm[VELO_SUM_MOM_SQ + k], count = lstm[VELO_COUNT_MOM + k];
    const double mean = (sum + count * static_cast<double>(shift.mom[k])) / n;  // mean m_k (finite terms)
    const double b = mean - static_cast<double>(shift.mom[k]);
    const double mean_mom = nu * mean;  // μ_m,k of m̃ = ν·m
    statistics[1 + k] = static_cast<float>(fmax(nu * nu * ((square - 2.0 * b * sum + count * b * b) / n), 0.0));
    // var_v,k = mean over the finite v of (ν·v − μ_m,k)² = (ν²·Σe² + 2ν·c·Σe + F_v·c²) / n with e = v − s_v and
    // c = ν·s_v − μ_m,k (the momentum mean: the reference's bug, kept)
    const double c = nu * shift.rms - mean_mom;
    statistics[4 + k] = static_cast<float>(
        fmax((nu * nu * rms_square + 2.0 * nu * c * rms_sum + rms_count * c * c) / n, 0.0));
  }
  const LossBuffer buffer = update_loss_buffer(loss_means, loss_running_min, loss_count, loss_decays, loss);
  float loss_feats[VELO_LOSS_FEATURES];
  loss_features(buffer, loss_decays, loss_feats);
  // fraction_features: tanh(10·(t/N − s_i)), t/N divided in float64 (as the reference's Python division)
  const float fraction = static_cast<float>(static_cast<double>(*pointer<const i64>(groups[t.group].step)) /
                                            static_cast<double>(num_steps));
  double* row = lstm_inputs + static_cast<i64>(r) * VELO_LSTM_INPUTS;  // order of LSTM_FEATURE_NAMES
  for (int i = 0; i < VELO_FRACTION_FEATURES; ++i)
    row[i] = tanhf(__fmul_rn(__fsub_rn(fraction, VELO_FRACTION_TIMESCALES[i]), 10.0f));
  for (int j = 0; j < VELO_LOSS_FEATURES; ++j) row[VELO_LSTM_LOSS_FIRST + j] = loss_feats[j];
  row[VELO_LSTM_MEAN_RMS] = clip_log_abs(statistics[0]);
  const int rank_class = static_cast<int>(velo_tensors[r].rank_class);
  for (int k = 0; k < VELO_RANK_CLASSES; ++k) row[VELO_LSTM_RANK_FIRST + k] = k == rank_class ? 1.0 : 0.0;
  for (int k = 0; k < 6; ++k) row[VELO_LSTM_VARIANCES_FIRST + k] = clip_log_abs(statistics[1 + k]);
}

// ------------------------------------------------------------------------------------------
// Control phase, batched over tensors (float64): mixing, LSTM, heads and weight generation
// (reference: mix_tensor_inputs, lstm_cell, controller_heads, generate_mlp_weights)
// ------------------------------------------------------------------------------------------

// A block per tensor row, a thread per unit: U = relu(X A2ᵀ + a2), maxed over every row into
// mixed_max (non-negative doubles order as their bit patterns: the max is exact and order-free);
// and X A3ᵀ + a3, to which velo_lstm adds the max.
extern "C" __global__ void __launch_bounds__(VELO_HIDDEN)
velo_mix(const double* __restrict__ lstm_inputs, const float* __restrict__ mix_weight, const float* __restrict__ mix_bias,
         const float* __restrict__ final_weight, const float* __restrict__ final_bias,
         unsigned long long* __restrict__ mixed_max, double* __restrict__ mix_partial) {
  __shared__ double x[VELO_LSTM_INPUTS];
  const int r = blockIdx.x, j = threadIdx.x;
  if (j < VELO_LSTM_INPUTS) x[j] = lstm_inputs[static_cast<i64>(r) * VELO_LSTM_INPUTS + j];
  __syncthreads();
  double mixed = 0.0, final_mix = 0.0;
  for (int i = 0; i < VELO_LSTM_INPUTS; ++i) {
    mixed += x[i] * static_cast<double>(mix_weight[j * VELO_LSTM_INPUTS + i]);
    final_mix += x[i] * static_cast<double>(final_weight[j * VELO_LSTM_INPUTS + i]);
  }
  mixed += static_cast<double>(mix_bias[j]);
  const double relu = mixed > 0.0 ? mixed : 0.0;  // (+0.0, never -0.0)
  atomicMax(mixed_max + j, static_cast<unsigned long long>(__double_as_longlong(relu)));
  mix_partial[static_cast<i64>(r) * VELO_HIDDEN + j] = final_mix + static_cast<double>(final_bias[j]);
}

// z = [x̂, h] Wᵀ + b for all tensors (x̂ = mix_partial + max), gates i, g, f, o; c' = σ(z_f + 1)·c +
// σ(z_i)·tanh(z_g), h' = σ(z_o)·tanh(c'). A block computes VELO_LSTM_ROWS rows x VELO_LSTM_UNITS units
// (all four gates of each unit), over k in shared-memory tiles of 32 (the weights converted to float64
// as they are stored); a thread keeps 4 rows x 4 gates, so each weight it reads from shared memory
// serves 4 rows. (With a row per thread the shared-memory reads, not the products, were the cost:
// docs/performance.md §4.) Each sum runs over k in order.
// The next tile's values are loaded into registers, all at once, while the products of this one run:
// the block's 32 tiles are a chain, and loading each tile only when it was needed left the kernel
// waiting on memory, whatever the tiling and the number of tensors (docs/performance.md §4).
#define VELO_LSTM_ROWS LOPT_VELO_LSTM_ROWS
#define VELO_LSTM_UNITS LOPT_VELO_LSTM_UNITS
#define VELO_LSTM_THREADS LOPT_VELO_LSTM_THREADS
#define VELO_LSTM_ROWS_PER_THREAD (VELO_LSTM_ROWS * VELO_LSTM_UNITS / VELO_LSTM_THREADS)
#define VELO_LSTM_K 32
#define VELO_LSTM_INPUT_LOADS (VELO_LSTM_ROWS * VELO_LSTM_K / VELO_LSTM_THREADS)       // a tile's inputs, per thread
#define VELO_LSTM_WEIGHT_LOADS (4 * VELO_LSTM_UNITS * VELO_LSTM_K / VELO_LSTM_THREADS)  // a tile's weights, per thread
static_assert(VELO_LSTM_ROWS_PER_THREAD * VELO_LSTM_THREADS == VELO_LSTM_ROWS * VELO_LSTM_UNITS &&
              VELO_LSTM_THREADS % VELO_LSTM_UNITS == 0 && VELO_HIDDEN % VELO_LSTM_UNITS == 0 &&
              VELO_LSTM_INPUT_LOADS * VELO_LSTM_THREADS == VELO_LSTM_ROWS * VELO_LSTM_K &&
              VELO_LSTM_WEIGHT_LOADS * VELO_LSTM_THREADS == 4 * VELO_LSTM_UNITS * VELO_LSTM_K, "velo_lstm's tiling");

LOPT_DEVICE double sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }

// Two blocks per SM (at most 128 registers): with the tile in registers the kernel needed more, and
// GPT-2 medium's 160 blocks then took two waves of an H100's 132 SMs (docs/performance.md §4).
#define VELO_LSTM_MIN_BLOCKS 2
extern "C" __global__ void __launch_bounds__(VELO_LSTM_THREADS, VELO_LSTM_MIN_BLOCKS)
velo_lstm(const VeloTensor* __restrict__ velo_tensors, int num_tensors, const double* __restrict__ mix_partial,
          const unsigned long long* __restrict__ mixed_max, const float* __restrict__ lstm_weight,
          const float* __restrict__ lstm_bias, double* __restrict__ hidden_new, double* __restrict__ cell_new) {
  __shared__ double inputs[VELO_LSTM_ROWS][VELO_LSTM_K];
  __shared__ double weights[4][VELO_LSTM_UNITS][VELO_LSTM_K + 1];  // +1: conflict-free column reads
  const int tid = threadIdx.x, unit = tid % VELO_LSTM_UNITS;
  const int first_row = (tid / VELO_LSTM_UNITS) * VELO_LSTM_ROWS_PER_THREAD;  // (the same in a warp: broadcasts)
  const int j = blockIdx.y * VELO_LSTM_UNITS + unit;
  double acc[VELO_LSTM_ROWS_PER_THREAD][4] = {};
  // A tile's values as this thread loads them: input slot tid + i·THREADS is (row, k) = (slot / K, slot % K);
  // weight slot tid + i·THREADS is (gate, unit, k), k fastest.
  double tile_inputs[VELO_LSTM_INPUT_LOADS];
  float tile_weights[VELO_LSTM_WEIGHT_LOADS];
  const auto load_tile = [&](int k0) {
#pragma unroll
    for (int i = 0; i < VELO_LSTM_INPUT_LOADS; ++i) {
      const int slot = tid + i * VELO_LSTM_THREADS;
      const int row = slot / VELO_LSTM_K, k = k0 + slot % VELO_LSTM_K, r = blockIdx.x * VELO_LSTM_ROWS + row;
      double value = 0.0;
      if (r < num_tensors)
        value = k < VELO_HIDDEN ? mix_partial[static_cast<i64>(r) * VELO_HIDDEN + k] + __longlong_as_double(mixed_max[k])
                                : static_cast<double>(pointer<const float>(velo_tensors[r].lstm_hidden)[k - VELO_HIDDEN]);
      tile_inputs[i] = value;
    }
#pragma unroll
    for (int i = 0; i < VELO_LSTM_WEIGHT_LOADS; ++i) {
      const int slot = tid + i * VELO_LSTM_THREADS;
      const int gate = slot / (VELO_LSTM_UNITS * VELO_LSTM_K), rest = slot % (VELO_LSTM_UNITS * VELO_LSTM_K);
      const int u = rest / VELO_LSTM_K, k = rest % VELO_LSTM_K;
      tile_weights[i] =
          lstm_weight[static_cast<i64>(gate * VELO_HIDDEN + blockIdx.y * VELO_LSTM_UNITS + u) * (2 * VELO_HIDDEN) + k0 + k];
    }
  };
  load_tile(0);
  for (int k0 = 0; k0 < 2 * VELO_HIDDEN; k0 += VELO_LSTM_K) {
#pragma unroll
    for (int i = 0; i < VELO_LSTM_INPUT_LOADS; ++i) {
      const int slot = tid + i * VELO_LSTM_THREADS;
      inputs[slot / VELO_LSTM_K][slot % VELO_LSTM_K] = tile_inputs[i];
    }
#pragma unroll
    for (int i = 0; i < VELO_LSTM_WEIGHT_LOADS; ++i) {
      const int slot = tid + i * VELO_LSTM_THREADS;
      const int gate = slot / (VELO_LSTM_UNITS * VELO_LSTM_K), rest = slot % (VELO_LSTM_UNITS * VELO_LSTM_K);
      weights[gate][rest / VELO_LSTM_K][rest % VELO_LSTM_K] = static_cast<double>(tile_weights[i]);
    }
    __syncthreads();
    if (k0 + VELO_LSTM_K < 2 * VELO_HIDDEN) load_tile(k0 + VELO_LSTM_K);  // (in flight during the products below)
#pragma unroll 4
    for (int k = 0; k < VELO_LSTM_K; ++k) {
      double w[4];
#pragma unroll
      for (int gate = 0; gate < 4; ++gate) w[gate] = weights[gate][unit][k];
#pragma unroll
      for (int i = 0; i < VELO_LSTM_ROWS_PER_THREAD; ++i) {
        const double x = inputs[first_row + i][k];
#pragma unroll
        for (int gate = 0; gate < 4; ++gate) acc[i][gate] += x * w[gate];
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < VELO_LSTM_ROWS_PER_THREAD; ++i) {
    const int r = blockIdx.x * VELO_LSTM_ROWS + first_row + i;
    if (r >= num_tensors) break;
    const double z_input = acc[i][0] + lstm_bias[j], z_candidate = acc[i][1] + lstm_bias[VELO_HIDDEN + j];
    const double z_forget = acc[i][2] + lstm_bias[2 * VELO_HIDDEN + j], z_output = acc[i][3] + lstm_bias[3 * VELO_HIDDEN + j];
    const double cell = pointer<const float>(velo_tensors[r].lstm_cell)[j];
    const double new_cell = sigmoid(z_forget + 1.0) * cell + sigmoid(z_input) * tanh(z_candidate);
    cell_new[static_cast<i64>(r) * VELO_HIDDEN + j] = new_cell;
    hidden_new[static_cast<i64>(r) * VELO_HIDDEN + j] = sigmoid(z_output) * tanh(new_cell);
  }
}

// A block per tensor: controls = h' Wcᵀ + bc (256), λ = h' wsᵀ + bs, the generated MLP
// W = 100 · (1/256) Σ_k c_k W^(k) (float64, then float32), and the tensor's apply record with the
// normalisation scales folded into the first layer. A kept step's LSTM state is written here.
#define VELO_HEADS_THREADS 256
extern "C" __global__ void __launch_bounds__(VELO_HEADS_THREADS)
velo_heads(const VeloTensor* __restrict__ velo_tensors, const double* __restrict__ hidden_new,
           const double* __restrict__ cell_new, const float* __restrict__ controls_weight,
           const float* __restrict__ controls_bias, const float* __restrict__ step_size_weight,
           const float* __restrict__ step_size_bias, const float* __restrict__ candidates,
           const float* __restrict__ feature_scales, const float* __restrict__ param_scales, const float* grad_scale,
           const float* found_inf, int* status, const void* loss_tensor, int loss_dtype, float loss_value,
           float loss_divisor, float* __restrict__ records) {
  const StepFlags flags{grad_scale, found_inf, status};
  __shared__ double h[VELO_HIDDEN];
  __shared__ double controls[VELO_CONTROLS];
  __shared__ double lr_mult;
  __shared__ float generated[VELO_GEN_FLOATS];
  const int r = blockIdx.x, tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  for (int k = tid; k < VELO_HIDDEN; k += VELO_HEADS_THREADS) h[k] = hidden_new[static_cast<i64>(r) * VELO_HIDDEN + k];
  __syncthreads();
  // Heads: a warp per output, lanes over k (coalesced rows), fixed-order warp sums.
  for (int c = warp; c <= VELO_CONTROLS; c += VELO_HEADS_THREADS / 32) {
    const float* w = c < VELO_CONTROLS ? controls_weight + static_cast<i64>(c) * VELO_HIDDEN : step_size_weight;
    double s = 0.0;
    for (int k = lane; k < VELO_HIDDEN; k += 32) s += h[k] * static_cast<double>(w[k]);
    s = warp_sum(s);
    if (lane == 0) {
      if (c < VELO_CONTROLS) controls[c] = s + static_cast<double>(controls_bias[c]);
      else lr_mult = s + static_cast<double>(step_size_bias[0]);
    }
  }
  __syncthreads();
  // Weight generation: the mean over the candidates, then x100.
  if (tid < VELO_GEN_FLOATS) {
    double s = 0.0;
    for (int c = 0; c < VELO_CONTROLS; ++c) s += controls[c] * static_cast<double>(candidates[c * VELO_GEN_FLOATS + tid]);
    generated[tid] = static_cast<float>(s / VELO_CONTROLS * VELO_WEIGHT_GENERATION_SCALE);
  }
  const float loss = step_loss(StepLoss{loss_tensor, loss_dtype, loss_value, loss_divisor});
  if (!velo_step_is_skipped(flags, loss)) {
    float* hidden_state = pointer<float>(velo_tensors[r].lstm_hidden);
    float* cell_state = pointer<float>(velo_tensors[r].lstm_cell);
    for (int k = tid; k < VELO_HIDDEN; k += VELO_HEADS_THREADS) {
      hidden_state[k] = static_cast<float>(h[k]);
      cell_state[k] = static_cast<float>(cell_new[static_cast<i64>(r) * VELO_HIDDEN + k]);
    }
  }
  __syncthreads();
  float* record = records + static_cast<i64>(r) * VELO_RECORD_FLOATS;
  const float* scales = feature_scales + static_cast<i64>(r) * VELO_NUM_FEATURES;
  if (tid < VELO_NUM_FEATURES * VELO_FF) {  // W0'ᵀ[j][u] = W0[u][j] · scale_j
    const int j = tid / VELO_FF, u = tid % VELO_FF;
    record[VELO_RECORD_W0 + tid] = __fmul_rn(generated[VELO_GEN_W0 + u * VELO_NUM_FEATURES + j], scales[j]);
  } else if (tid < VELO_RECORD_W2 + 2 * VELO_FF) {  // b0, W1, b1 and the direction/magnitude rows of W2 as generated
    record[tid] = generated[tid];
  } else if (tid < VELO_RECORD_B2 + 2) {
    record[tid] = generated[VELO_GEN_B2 + tid - VELO_RECORD_B2];
  } else if (tid == VELO_RECORD_LR_MULT) {
    record[VELO_RECORD_LR_MULT] = static_cast<float>(lr_mult);
    record[VELO_RECORD_PARAM_SCALE] = param_scales[r];
  }
}

// The table features' share of the first layer, per factor-table entry: for an R entry
// Σ_k W0'[15 + k]·R_k + W0'[21 + k]·rsqrt(R_k + 1e-8), for a C entry the same with features 18 and
// 24. The same for every element sharing the entry, so the apply pass reads these four sums (one
// float4) instead of the entry's twelve values and their weights. A thread per entry.
#define VELO_CONTRIBUTION_THREADS 256
extern "C" __global__ void __launch_bounds__(VELO_CONTRIBUTION_THREADS)
velo_table_contributions(const TensorMeta* __restrict__ tensors, int num_tensors, const float* __restrict__ records,
                         const float* __restrict__ row_table, const float* __restrict__ col_table, i64 total_row_entries,
                         i64 total_col_entries, float4* __restrict__ row_contributions,
                         float4* __restrict__ col_contributions) {
  const i64 gid = static_cast<i64>(blockIdx.x) * VELO_CONTRIBUTION_THREADS + threadIdx.x;
  const bool is_row = gid < total_row_entries;
  const i64 entry = is_row ? gid : gid - total_row_entries;
  if (!is_row && entry >= total_col_entries) return;
  const int tensor = is_row ? find_row<LOPT_TENSORMETA_ROW_TABLE>(tensors, num_tensors, entry)
                            : find_row<LOPT_TENSORMETA_COL_TABLE>(tensors, num_tensors, entry);
  const float* w0 = records + static_cast<i64>(tensor) * VELO_RECORD_FLOATS + VELO_RECORD_W0;
  const FactorEntry f = read_factor_entry(is_row ? row_table : col_table, entry);
  const int acc_feature = is_row ? 15 : 18, rsqrt_feature = is_row ? 21 : 24;
  float sums[VELO_FF] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int k = 0; k < 3; ++k)
#pragma unroll
    for (int u = 0; u < VELO_FF; ++u) {
      sums[u] = fmaf(w0[(acc_feature + k) * VELO_FF + u], f.acc[k], sums[u]);
      sums[u] = fmaf(w0[(rsqrt_feature + k) * VELO_FF + u], f.rsqrt_acc[k], sums[u]);
    }
  (is_row ? row_contributions : col_contributions)[entry] = make_float4(sums[0], sums[1], sums[2], sums[3]);
}

// ------------------------------------------------------------------------------------------
// Apply pass (reference: apply_stage): a block takes 256 elements at a time, one per thread; blocks
// take contiguous ranges of chunks and reload the tensor's record only when the tensor changes.
// ------------------------------------------------------------------------------------------
#define VELO_APPLY_THREADS 256
#define VELO_APPLY_CHUNK VELO_APPLY_THREADS
#define VELO_APPLY_MIN_BLOCKS 4
// The apply pass's element loads and stores are plain ones, not evict-first (element_load): unlike
// small_fc_lopt's apply pass, this one measured slower with them (docs/performance.md §4).
constexpr bool kStreamed = false;

// per_element_mlp, the direction and magnitude outputs: o = W2 relu(W1 relu(W0' x + b0) + b1) + b2,
// for N elements at once (each weight read from shared memory serves all N).
// For a factored tensor the table features' share of the first layer comes precomputed per entry
// (`table_share`, from velo_table_contributions) and features 15..26 are not read.
template <bool Factored, int N>
LOPT_DEVICE void per_element_mlp(const float (&x)[N][VELO_NUM_FEATURES], const float* record,
                                 const float4 (&table_share)[N], float2 (&out)[N]) {
  const float4* w0 = reinterpret_cast<const float4*>(record + VELO_RECORD_W0);
  float h1[N][VELO_FF];
#pragma unroll
  for (int n = 0; n < N; ++n) {
    h1[n][0] = table_share[n].x; h1[n][1] = table_share[n].y; h1[n][2] = table_share[n].z; h1[n][3] = table_share[n].w;
  }
#pragma unroll
  for (int j = 0; j < VELO_NUM_FEATURES; ++j) {
    if (Factored && is_table_feature(j)) continue;
    const float4 w = w0[j];
#pragma unroll
    for (int n = 0; n < N; ++n) {
      h1[n][0] = fmaf(w.x, x[n][j], h1[n][0]);
      h1[n][1] = fmaf(w.y, x[n][j], h1[n][1]);
      h1[n][2] = fmaf(w.z, x[n][j], h1[n][2]);
      h1[n][3] = fmaf(w.w, x[n][j], h1[n][3]);
    }
  }
  const float4 b0 = *reinterpret_cast<const float4*>(record + VELO_RECORD_B0);
#pragma unroll
  for (int n = 0; n < N; ++n) {
    h1[n][0] = fmaxf(__fadd_rn(h1[n][0], b0.x), 0.f);
    h1[n][1] = fmaxf(__fadd_rn(h1[n][1], b0.y), 0.f);
    h1[n][2] = fmaxf(__fadd_rn(h1[n][2], b0.z), 0.f);
    h1[n][3] = fmaxf(__fadd_rn(h1[n][3], b0.w), 0.f);
  }
  float h2[N][VELO_FF];
#pragma unroll
  for (int u = 0; u < VELO_FF; ++u) {
    const float4 w = *reinterpret_cast<const float4*>(record + VELO_RECORD_W1 + u * VELO_FF);
    const float bias = record[VELO_RECORD_B1 + u];
#pragma unroll
    for (int n = 0; n < N; ++n) {
      const float acc = fmaf(w.w, h1[n][3], fmaf(w.z, h1[n][2], fmaf(w.y, h1[n][1], w.x * h1[n][0])));
      h2[n][u] = fmaxf(__fadd_rn(acc, bias), 0.f);
    }
  }
  float o[N][2];
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const float4 w = *reinterpret_cast<const float4*>(record + VELO_RECORD_W2 + k * VELO_FF);
    const float bias = record[VELO_RECORD_B2 + k];
#pragma unroll
    for (int n = 0; n < N; ++n)
      o[n][k] = __fadd_rn(fmaf(w.w, h2[n][3], fmaf(w.z, h2[n][2], fmaf(w.y, h2[n][1], w.x * h2[n][0]))), bias);
  }
#pragma unroll
  for (int n = 0; n < N; ++n) out[n] = make_float2(o[n][0], o[n][1]);
}

// What the apply pass reads of one element before computing anything: its gradient (clipped),
// parameter and accumulators, and for a factored tensor its factors and table share.
struct ElementInputs {
  float grad, param;
  ElementState state;
  float4 row_factor, col_factor, table_share;
};

template <bool Factored>
LOPT_DEVICE ElementInputs load_element_inputs(const TensorMeta& t, i64 e, const float4* row_factors,
                                              const float4* col_factors, const float4* row_contributions,
                                              const float4* col_contributions, float inverse_scale) {
  ElementInputs in;
  in.grad = clip_gradient(load_element<kStreamed>(t, e, inverse_scale, in.param, in.state));
  in.row_factor = in.col_factor = in.table_share = make_float4(0.f, 0.f, 0.f, 0.f);
  if (Factored) {
    const FactorIndex f = factor_index(t, e);
    in.row_factor = __ldg(row_factors + t.row_table + f.row);
    in.col_factor = __ldg(col_factors + t.col_table + f.col);
    const float4 r = __ldg(row_contributions + t.row_table + f.row), c = __ldg(col_contributions + t.col_table + f.col);
    in.table_share = make_float4(__fadd_rn(r.x, c.x), __fadd_rn(r.y, c.y), __fadd_rn(r.z, c.z), __fadd_rn(r.w, c.w));
  }
  return in;
}

// Elements e[0..N) of a tensor, from their loaded inputs.
template <bool Factored, int N>
LOPT_DEVICE void apply_elements(const TensorMeta& t, const ApplyScalars& a, const i64 (&e)[N], ElementInputs (&in)[N],
                                const float* record) {
  float x[N][VELO_NUM_FEATURES];
  float4 table_share[N];
#pragma unroll
  for (int n = 0; n < N; ++n) {
    ElementState& s = in[n].state;
    update_accumulators(s, in[n].grad, a.decays, Factored);
    store_element_state<kStreamed>(t, e[n], s);
    FactorEntry row = {}, col = {};
    if (Factored) {
      row.factor[0] = in[n].row_factor.x; row.factor[1] = in[n].row_factor.y; row.factor[2] = in[n].row_factor.z;
      col.factor[0] = in[n].col_factor.x; col.factor[1] = in[n].col_factor.y; col.factor[2] = in[n].col_factor.z;
    }
    per_element_features(x[n], in[n].grad, in[n].param, s, Factored, row, col);  // (factored: 15..26 unused)
    table_share[n] = in[n].table_share;
  }
  float2 output[N];
  per_element_mlp<Factored, N>(x, record, table_share, output);
#pragma unroll
  for (int n = 0; n < N; ++n) {
    // velo_update: u = λ·(param_scale·(d·exp(exp_mult·μ)·step_mult)), then apply_update.
    const float update = __fmul_rn(record[VELO_RECORD_LR_MULT],
                                   __fmul_rn(record[VELO_RECORD_PARAM_SCALE],
                                             __fmul_rn(__fmul_rn(output[n].x, expf(__fmul_rn(output[n].y, a.exp_mult))),
                                                       a.step_mult)));
    apply_update<kStreamed>(t, e[n], in[n].param, update, a);
  }
}

// Elements per thread at a time (chunks in groups of N, then one by one): each weight read from shared
// memory serves N; two measured faster than one (docs/performance.md §4).
#define VELO_APPLY_ELEMENTS 2

// The chunks [chunk, end) of one tensor. Its metadata and group scalars are this function's locals, so
// they stay in registers through the loop instead of being re-read (from shared memory) per element.
template <bool Factored>
LOPT_DEVICE void apply_chunks(const TensorMeta t, const ApplyScalars a, i64 chunk, i64 end, const float* record,
                              const float4* row_factors, const float4* col_factors, const float4* row_contributions,
                              const float4* col_contributions, float inverse_scale) {
  i64 e = (chunk - t.first_apply_chunk) * VELO_APPLY_CHUNK + threadIdx.x;
  constexpr int N = VELO_APPLY_ELEMENTS;
  for (; chunk + (N - 1) < end && e + (N - 1) * VELO_APPLY_CHUNK < t.numel; chunk += N, e += N * VELO_APPLY_CHUNK) {
    i64 elements[N];
    ElementInputs in[N];
#pragma unroll
    for (int n = 0; n < N; ++n) {
      elements[n] = e + n * VELO_APPLY_CHUNK;
      in[n] = load_element_inputs<Factored>(t, elements[n], row_factors, col_factors, row_contributions,
                                            col_contributions, inverse_scale);
    }
    apply_elements<Factored, N>(t, a, elements, in, record);
  }
  for (; chunk < end && e < t.numel; ++chunk, e += VELO_APPLY_CHUNK) {
    const i64 one[1] = {e};
    ElementInputs in[1] = {load_element_inputs<Factored>(t, e, row_factors, col_factors, row_contributions,
                                                         col_contributions, inverse_scale)};
    apply_elements<Factored, 1>(t, a, one, in, record);
  }
}

// The apply pass's functor (apply_pass in accumulators.cuh): the tensor's record in shared memory, its
// chunks a pair of elements per thread at a time (apply_chunks), and the loss buffer advanced with the
// step counters.
struct VeloApply {
  float* record;  // (shared)
  const float* records;
  const float4* row_factors;
  const float4* col_factors;
  const float4* row_contributions;
  const float4* col_contributions;
  float* loss_means;
  float* loss_running_min;
  int* loss_count;
  const float* loss_decays;
  float loss;

  LOPT_DEVICE bool skipped(const StepFlags& flags) const { return velo_step_is_skipped(flags, loss); }

  LOPT_DEVICE void finish(bool skipped) const {
    if (skipped || threadIdx.x != 0) return;
    const LossBuffer buffer = update_loss_buffer(loss_means, loss_running_min, loss_count, loss_decays, loss);
    for (int j = 0; j < VELO_LOSS_TIMESCALES; ++j) {
      loss_means[j] = buffer.means[j];
      loss_running_min[j] = buffer.running_min[j];
    }
    *loss_count = buffer.count;
  }

  LOPT_DEVICE void begin_tensor(int tensor) const {
    __syncthreads();  // everyone is done with the previous tensor's record
    for (int k = threadIdx.x; k < VELO_RECORD_FLOATS; k += VELO_APPLY_THREADS)
      record[k] = records[static_cast<i64>(tensor) * VELO_RECORD_FLOATS + k];
    __syncthreads();
  }

  LOPT_DEVICE void chunks(const TensorMeta& t, const ApplyScalars& a, int, i64 chunk, i64 end, float inverse_scale) const {
    if (t.factored) {
      apply_chunks<true>(t, a, chunk, end, record, row_factors, col_factors, row_contributions, col_contributions, inverse_scale);
    } else {
      apply_chunks<false>(t, a, chunk, end, record, row_factors, col_factors, row_contributions, col_contributions, inverse_scale);
    }
  }
};

extern "C" __global__ void __launch_bounds__(VELO_APPLY_THREADS, VELO_APPLY_MIN_BLOCKS)
velo_apply(const TensorMeta* __restrict__ tensors, const i64* __restrict__ gradients, int num_tensors,
           const GroupMeta* __restrict__ groups, int num_groups,
           i64 total_chunks, const float* __restrict__ records, const float4* __restrict__ row_factors,
           const float4* __restrict__ col_factors, const float4* __restrict__ row_contributions,
           const float4* __restrict__ col_contributions, const float* grad_scale, const float* found_inf, int* status,
           i64* skipped_steps, float* loss_means, float* loss_running_min, int* loss_count,
           const float* __restrict__ loss_decays, const void* loss_tensor, int loss_dtype, float loss_value,
           float loss_divisor) {
  __shared__ __align__(16) float record[VELO_RECORD_FLOATS];
  const VeloApply apply{record, records, row_factors, col_factors, row_contributions, col_contributions, loss_means,
                        loss_running_min, loss_count, loss_decays,
                        step_loss(StepLoss{loss_tensor, loss_dtype, loss_value, loss_divisor})};
  apply_pass(tensors, gradients, num_tensors, groups, num_groups, total_chunks, StepFlags{grad_scale, found_inf, status},
             skipped_steps, apply);
}
