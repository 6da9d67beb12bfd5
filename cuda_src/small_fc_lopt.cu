// small_fc_lopt, fused: the same phases as lopt/reference/small_fc_lopt.py for every tensor of every
// parameter group in a constant number of launches (lopt/fused/small_fc_lopt.py drives them):
//
//   accumulate   adafactor_axis_partials, adafactor_finalize, adafactor_factor_tables   (accumulators.cuh)
//   statistics   small_fc_lopt_feature_stats   per_element_features of the updated accumulators -> sums of
//                squares per chunk; the check phase's non-finite test of every gradient element
//   control      small_fc_lopt_fold            normalise_features and time_features folded into the first
//                layer; a kept step's new R and C written to the state
//   apply        small_fc_lopt_apply           update_accumulators + per_element_features + mlp + apply_update
//
// The statistics pass recomputes the updated accumulators without storing them; the apply pass
// recomputes them with the same code and stores them, so both passes see identical features.
// Nothing is written to parameters or state before the apply pass knows the step is kept.
#include "common.cuh"
#include "accumulators.cuh"
#include "split_mma.cuh"

#define SFC_NUM_FEATURES 28
#define SFC_NUM_TIME_FEATURES 11
#define SFC_INPUTS (SFC_NUM_FEATURES + SFC_NUM_TIME_FEATURES)

// The network is data: its geometry, and where each layer lies in the packed buffer, come from the
// weights' own config (lopt.network.MLPGeometry.cuda_defines, passed by the engine: kernel traits as
// NVRTC defines). SFC_MLP_HIDDEN units in each of 1 + SFC_MLP_HIDDEN_LAYERS hidden layers; layer i
// (0 the input layer ... SFC_MLP_HIDDEN_LAYERS + 1 the output layer) at SFC_MLP_W<i>, SFC_MLP_B<i>
// (PyTorch's out x in layout); the hidden-to-hidden layers also as SFC_MLP_LINEAR_W/_B plus
// SFC_MLP_LINEAR_STRIDE per layer, and the output layer as SFC_MLP_OUTPUT_W/_B.
#ifndef SFC_MLP_HIDDEN
#error "build small_fc_lopt.cu with its network's geometry: lopt.fused.small_fc_lopt.kernel_defines"
#endif
static_assert(SFC_MLP_INPUTS == SFC_INPUTS && SFC_MLP_OUTPUTS == 2,
              "small_fc_lopt's MLP takes 28 features and 11 time features and gives direction and magnitude");
#define SFC_HIDDEN SFC_MLP_HIDDEN
#define SFC_W1 SFC_MLP_W0
#define SFC_B1 SFC_MLP_B0
// The published geometry, 39 -> 32 -> 32 -> 2, runs its layers on tensor cores (the apply pass below);
// any other runs them in float32 on the CUDA cores (generic_mlp), whatever the precision.
#define SFC_TENSOR_CORES (SFC_MLP_HIDDEN == 32 && SFC_MLP_HIDDEN_LAYERS == 1)
#if SFC_TENSOR_CORES
#define SFC_W2 SFC_MLP_W1
#define SFC_B2 SFC_MLP_B1
#define SFC_W3 SFC_MLP_W2
#define SFC_B3 SFC_MLP_B2
#endif

// The MLP's 32 x 32 layers run on tensor cores (split_mma.cuh; in the exact mode with float32 accuracy:
// layer 1 a TF32 product plus one BF16 product for the correction terms, layer 2 three FP16 products);
// their weights are kept as B operands in the layout split_mma.cuh's layers expect (at most
// SFC_OPERAND_32x32 floats each).
#define SFC_OPERAND_32x32 LOPT_SPLIT_OPERAND_FLOATS
#define SFC_K 32                                          // 28 features, 2 bias inputs, padded to 4 k-steps
// Per tensor: the folded first layer as a B operand: W1' = W1 scaled per feature, and b1' (time
// features folded in) as the weights of two constant inputs (first_layer_input's order)
// (The generic MLP's: W1' as [unit][feature] floats, then b1'.)
#if SFC_TENSOR_CORES
#define SFC_FOLDED_SHARED SFC_OPERAND_32x32             // and W1' of the 6 shared inputs, [input][unit]
#define SFC_FOLDED_SHIFTS (SFC_FOLDED_SHARED + 6 * SFC_HIDDEN)  // and the shifts of the shiftable features
#else
#define SFC_FOLDED_W1 0
#define SFC_FOLDED_B1 (SFC_HIDDEN * SFC_NUM_FEATURES)
#define SFC_FOLDED_SHIFTS (SFC_FOLDED_B1 + SFC_HIDDEN)
#endif
#define SFC_FOLDED (SFC_FOLDED_SHIFTS + 8)
// The statistics pass is bound by memory: each thread takes its elements in pairs, asks L2 for the
// next pair ahead of use, and the register bound keeps 24 warps per SM with loads in flight.
constexpr int STATS_UNROLL = 1;    // pairs of elements per iteration
constexpr int STATS_PREFETCH = 1;  // pairs requested into L2 ahead
#define SFC_STATS_MIN_BLOCKS 3
// Shared by all tensors: layer 2 as a B operand, its bias, and layer 3 (float32).
#define SFC_SHARED_L2 0
#define SFC_SHARED_B2 SFC_OPERAND_32x32
#define SFC_SHARED_W3 (SFC_SHARED_B2 + SFC_HIDDEN)
#define SFC_SHARED_B3 (SFC_SHARED_W3 + 2 * SFC_HIDDEN)
#define SFC_SHARED_FRAGS (SFC_SHARED_B3 + 2)

#define SFC_APPLY_WARPS 4
#define SFC_APPLY_THREADS (32 * SFC_APPLY_WARPS)
#define SFC_APPLY_CHUNK SFC_APPLY_THREADS  // one element per thread per chunk

__constant__ float SFC_TIMESCALES[SFC_NUM_TIME_FEATURES] = {1.f, 3.f, 10.f, 30.f, 100.f, 300.f, 1000.f,
                                                          3000.f, 10000.f, 30000.f, 100000.f};

// reference: per_element_features (§3.5), the 28 features in input order.
LOPT_DEVICE void per_element_features(float x[SFC_NUM_FEATURES], float grad, float param, const ElementState& s,
                                      bool factored, const FactorEntry& row, const FactorEntry& col) {
  const float rsqrt_rms = rsqrtf(__fadd_rn(s.rms, 1e-6f));
  x[0] = grad;
  x[1] = param;
  moment_features(x + 2, s, rsqrt_rms);
  factored_gradient(x + 10, grad, s, factored, row, col);
  adafactor_features(x + 13, s, factored, row, col, 1e-6f);
}

// Features 13..24 of a factored tensor are its factor-table features (accumulators.cuh): the
// statistics pass leaves their sums of squares to the fold.
#define SFC_TABLE_FEATURES_FIRST 13
#define SFC_TABLE_FEATURES_END (SFC_TABLE_FEATURES_FIRST + LOPT_TABLE_FEATURES)
LOPT_DEVICE constexpr bool is_table_feature(int k) { return k >= SFC_TABLE_FEATURES_FIRST && k < SFC_TABLE_FEATURES_END; }

// The features that are accumulators of g² (rms, 5; R_k and C_k, or V_k twice, 13 ... 18) reach
// float32's largest values for gradients near 2^64, and their normaliser scales fall below 2^-60. Folded
// into W1 as they are, such a scale makes weights whose split parts lie below float32's normal range,
// which the tensor cores drop (the update errors grew to ~6e-4 at |g| ~ 1.8e19). Like the reference
// (normalise_by_square_sums), the fold then takes the feature as (x · 2^-64) · (s · 2^64): the weights
// get s · 2^64, and the values 2^-64 (feature_shifts; exact powers of two), in the factor tables for
// R and C (the fold rescales them) and in the apply pass for rms and V.
#define SFC_RMS_FEATURE 5
#define SFC_ACCUMULATOR_FEATURES 6  // R_k then C_k, from SFC_TABLE_FEATURES_FIRST
#define SFC_SHIFTABLE_FEATURES (1 + SFC_ACCUMULATOR_FEATURES)
LOPT_DEVICE constexpr int shiftable_feature(int i) { return i == 0 ? SFC_RMS_FEATURE : SFC_TABLE_FEATURES_FIRST + i - 1; }
LOPT_DEVICE constexpr bool is_shiftable_feature(int k) {
  return k == SFC_RMS_FEATURE || (k >= SFC_TABLE_FEATURES_FIRST && k < SFC_TABLE_FEATURES_FIRST + SFC_ACCUMULATOR_FEATURES);
}

// Where an element's factor-table values come from: the whole entries (every feature), or only the
// compact factors (the statistics pass, which leaves the table features to the fold).
struct TableInputs {
  const float* row_table;
  const float* col_table;
  const float4* row_factors;
  const float4* col_factors;
};

// An element's features from its loaded values: updates its accumulators (in `s`) and computes the
// 28 features. `grad` becomes the gradient the math uses: the unscaled one clipped by the tensor's
// max_grad_norm factor (1: none). read_entries(row, col) gives a factored tensor's two table entries
// (called for a factored tensor only: one branch on it).
template <typename ReadEntries>
LOPT_DEVICE void features_of_loaded(const TensorMeta& t, const Decays& decays, float clip_factor, float unclipped_grad,
                                    float param, ElementState& s, float x[SFC_NUM_FEATURES], float& grad,
                                    ReadEntries read_entries) {
  grad = __fmul_rn(unclipped_grad, clip_factor);  // (exact for a factor of 1)
  const bool factored = t.factored != 0;
  update_accumulators(s, grad, decays, factored);
  if (factored) {
    FactorEntry row, col;
    read_entries(row, col);
    per_element_features(x, grad, param, s, true, row, col);
  } else {  // (no table entries: the features' code reads none, and nothing is zeroed to merge with them)
    per_element_features(x, grad, param, s, false, FactorEntry{}, FactorEntry{});
  }
}

// features_of_loaded with R's and C's entries at `f`, the element's factor index (FactorsOnly: their
// compact factors alone, the table features left at zero).
template <bool FactorsOnly = false>
LOPT_DEVICE void loaded_element_features(const TensorMeta& t, const FactorIndex& f, const Decays& decays,
                                         float clip_factor, const TableInputs& tables, float unclipped_grad,
                                         float param, ElementState& s, float x[SFC_NUM_FEATURES], float& grad) {
  features_of_loaded(t, decays, clip_factor, unclipped_grad, param, s, x, grad, [&](FactorEntry& row, FactorEntry& col) {
    if (FactorsOnly) load_factors(t, f, tables.row_factors, tables.col_factors, row, col);
    else load_factor_entries(t, f, tables.row_table, tables.col_table, row, col);
  });
}

// Loads one element's inputs and computes its features (loaded_element_features); returns the
// unclipped gradient, which the check phase tests.
template <bool FactorsOnly = false, bool Streamed = false>
LOPT_DEVICE float element_features(const TensorMeta& t, i64 e, const Decays& decays, float inverse_scale,
                                   float clip_factor, const TableInputs& tables, float x[SFC_NUM_FEATURES],
                                   ElementState& s, float& grad, float& param) {
  const float unclipped_grad = load_element<Streamed>(t, e, inverse_scale, param, s);
  const FactorIndex f = t.factored ? factor_index(t, e) : FactorIndex{0, 0};
  loaded_element_features<FactorsOnly>(t, f, decays, clip_factor, tables, unclipped_grad, param, s, x, grad);
  return unclipped_grad;
}

// ------------------------------------------------------------------------------------------
// Statistics pass (statistics_pass in accumulators.cuh): per chunk of LOPT_STATS_CHUNK elements, the 28
// sums of squared features; for factored tensors the table features' sums are left at zero here and
// formed by the fold. Also the check phase's test of every gradient.
// ------------------------------------------------------------------------------------------
struct FeatureStatistics {
  static constexpr int kSums = SFC_NUM_FEATURES;
  static constexpr int kUnroll = STATS_UNROLL;
  static constexpr int kPrefetch = STATS_PREFETCH;
  static constexpr bool kSomeOnlyChecked = false;
  struct Inputs {
    const float4* row_factors;
    const float4* col_factors;
    const float* clip_factors;
  };
  const TensorMeta& t;
  Decays decays;
  float clip_factor;
  TableInputs tables;

  LOPT_DEVICE FeatureStatistics(const TensorMeta& tensor_meta, int tensor, const Decays& group_decays,
                                const Inputs& inputs)
      : t(tensor_meta), decays(group_decays), clip_factor(tensor_clip_factor(inputs.clip_factors, tensor)),
        tables{nullptr, nullptr, inputs.row_factors, inputs.col_factors} {}

  // per_element_features of the updated accumulators (their compact factors only), squared and added
  template <bool Factored>
  LOPT_DEVICE void add(float raw_grad, float param, ElementState& s, const FactorIndex& f,
                       float (&squares)[kSums]) const {
    float x[SFC_NUM_FEATURES], grad;
    loaded_element_features<Factored>(t, f, decays, clip_factor, tables, raw_grad, param, s, x, grad);
#pragma unroll
    for (int j = 0; j < SFC_NUM_FEATURES; ++j)
      // (a non-finite feature, of a non-finite parameter or state element, is left out: finite_part)
      if (!(Factored && is_table_feature(j)) && is_finite(x[j])) squares[j] = fmaf(x[j], x[j], squares[j]);
  }
};

extern "C" __global__ void __launch_bounds__(LOPT_STATS_THREADS, SFC_STATS_MIN_BLOCKS)
small_fc_lopt_feature_stats(const TensorMeta* __restrict__ tensors, const i64* __restrict__ gradients, int num_tensors,
                            const GroupMeta* __restrict__ groups,
                            const float4* __restrict__ row_factors, const float4* __restrict__ col_factors,
                            const float* __restrict__ clip_factors, const float* grad_scale, const float* found_inf,
                            int* status, double* __restrict__ stats_partials) {
  statistics_pass<FeatureStatistics>(tensors, gradients, num_tensors, groups, StepFlags{grad_scale, found_inf, status},
                                     FeatureStatistics::Inputs{row_factors, col_factors, clip_factors}, stats_partials);
}

#if SFC_TENSOR_CORES
// The first layer's inputs, in the order the MMA takes them (the fold lays W1's columns out to match):
//
//   0 ... 12   the features 0 ... 12 (gradient, parameter, momenta, rms, ..., the factored gradient)
//   13 ... 15  features 25 ... 27 (the momenta preconditioned by the factors)
//   16 ... 21  the per-element factor entry's accumulators and their rsqrt (three each)
//   22, 23     constant ones carrying the bias b1' (below)
//   24 ... 29  the shared factor entry's accumulators and their rsqrt
//   30, 31     zeros
//
// A factored tensor's element has two factor-table entries, R's and C's: the one indexed by its
// position without axis b (the shared entry: in a tensor laid out (outer, a, mid, b) every run of
// consecutive elements along b shares it; R's where d0 is b, C's where d0 is a) and the other (the
// per-element entry, indexed without axis a). Features 13 ... 24 are R's and C's values, so which of
// them inputs 16 ... 21 and 24 ... 29 take depends on the tensor (input_feature). With the shared
// entry's six inputs last, the exact mode adds their share of layer 1 for a whole warp of elements
// sharing that entry as one vector, and multiplies only inputs 0 ... 23 (apply pass, below). (A
// non-factored tensor's features 13 ... 24 are V's, the same for "R" and "C".)
//
// The bias b1' rides on inputs 22 and 23: constant ones, with weights b1' and the rest
// b1' - split_effective(b1'), so the products carry b1' to float32 accuracy, the layer needs no
// addend, and b1' is never read per chunk (in precision "fast" this measured faster, docs/performance.md
// §3; the exact mode saves the register copies of an addend).
#define SFC_BIAS_INPUT_HI 22
#define SFC_BIAS_INPUT_LO 23
#define SFC_SHARED_INPUTS_FIRST 24
#define SFC_SHARED_INPUTS 6
// The feature input k is: 0 ... 27, or -1 for a bias input or padding. `shared_is_col`: the tensor's
// shared entry is C's (d0_is_a). Features 13 ... 15 are R's accumulators, 16 ... 18 C's, 19 ... 21 the
// rsqrt of R's, 22 ... 24 of C's.
LOPT_DEVICE constexpr int input_feature(int k, bool shared_is_col) {
  return k < 13 ? k
       : k < 16 ? k + 12
       : k < 19 ? (shared_is_col ? k - 3 : k)              // per-element accumulators
       : k < 22 ? (shared_is_col ? k : k + 3)              // per-element rsqrt
       : k < 24 ? -1
       : k < 27 ? (shared_is_col ? k - 8 : k - 11)         // shared accumulators
       : k < 30 ? (shared_is_col ? k - 5 : k - 8)          // shared rsqrt
       : -1;
}
// Input k of the first layer as the MMA takes it, from the features in the apply pass's order: x as
// per_element_features computes them from the (shared, per-element) entries in the places of (R, C)
// (apply_element_features), so x[13 ...] hold the shared entry's values whatever the tensor.
LOPT_DEVICE float first_layer_input(const float x[SFC_NUM_FEATURES], int k) {
  if (k == SFC_BIAS_INPUT_HI || k == SFC_BIAS_INPUT_LO) return 1.f;
  const int feature = input_feature(k, false);
  return feature >= 0 ? x[feature] : 0.f;
}

// ------------------------------------------------------------------------------------------
// Precision traits. LOPT_SPLIT_MODE is the optimizer's precision (split_mma.cuh): 0 "exact", 2
// "fast". Everything below that differs between the two follows from it here, and nowhere else.
//
//   SFC_LAYER2_FP16      exact: layer 2 takes its inputs' high parts in FP16 (half_split_layer_32x32)
//   SFC_OUTPUT_MMA       fast: layer 3 on tensor cores with FP16 inputs (output_layer_mma); exact keeps
//                        it in float32 on the CUDA cores (output_layer)
//   SFC_PACKED_ENTRIES   fast: the factor tables also hold each entry's table features as packed BF16
//                        inputs, copied straight into the feature tile
//   SFC_SHARED_VECTORS   exact: a warp whose elements all read one shared entry adds that entry's share of
//                        layer 1 as one vector (one k-step fewer)
//   SFC_L2_IN_REGISTERS  fast: layer 2's B operand is held in registers (it fits in the fast build's budget)
//   SFC_CHUNK_META       fast: the tensor's metadata is copied out of shared memory once per chunk (the
//                        fast pass runs its L1 pipe near its limit; the exact one would spill)
//   SFC_APPLY_MIN_BLOCKS blocks per SM the apply pass's registers must allow (exact 96 registers, fast 72)
// ------------------------------------------------------------------------------------------
#define SFC_EXACT (LOPT_SPLIT_MODE == 0)
#define SFC_FAST (LOPT_SPLIT_MODE == 2)
#if !SFC_EXACT && !SFC_FAST
#error "LOPT_SPLIT_MODE must be 0 (precision exact) or 2 (precision fast)"
#endif
#define SFC_LAYER2_FP16 SFC_EXACT
#define SFC_OUTPUT_MMA SFC_FAST
#define SFC_PACKED_ENTRIES SFC_FAST
#define SFC_SHARED_VECTORS SFC_EXACT
#define SFC_L2_IN_REGISTERS SFC_FAST
#define SFC_CHUNK_META SFC_FAST
#define SFC_APPLY_MIN_BLOCKS (SFC_FAST ? 7 : 5)
// Floats of layer 2's B operand in the apply pass's shared memory.
#define SFC_L2_OPERAND_FLOATS (SFC_LAYER2_FP16 ? LOPT_HALF_SPLIT_OPERAND_FLOATS : SFC_OPERAND_32x32)

// 2^e as a float (|e| < 127).
LOPT_DEVICE float exp2_of(int e) { return __int_as_float((127 + e) << 23); }

// The layer whose inputs go to FP16 is scaled by 2^e and the one before it by 2^-e (powers of two:
// exact), so that those inputs stay below FP16's 65504; e (the fold's fp16_exponent, 0 but for very
// large tensors or weights) comes from the host: lopt.fused.small_fc_lopt.layer2_exponent for the
// exact mode, whose layer 2 takes its inputs' high parts in FP16 (split_mma.cuh), layer3_exponent for
// precision "fast", whose layer 3 takes FP16 inputs (output_layer_mma).

// Precision "fast" (mode 2): the hidden unit that input k of layer 2 is (the weights of layer 2 are laid
// out to match; the exact mode's FP16 layer 2 takes its units in natural order).
// Layer 2's A fragments are read straight from layer 1's accumulators: a thread's fragment of
// n-tile j holds columns 8j + 2t and 8j + 2t + 1, and k-step j's A fragment wants k = 8j + t and
// k = 8j + t + 4, so those are units 8j + 2t and 8j + 2t + 1; no data moves between threads.
LOPT_DEVICE int layer2_input_unit(int k) { return 8 * (k / 8) + 2 * (k % 4) + (k % 8) / 4; }
#endif  // SFC_TENSOR_CORES

// ------------------------------------------------------------------------------------------
// Fold: one block per tensor. normalise_features' scales go into the columns of W1 and the 11
// time features (constant over the tensor) into its bias: h1 = relu(W1' x_raw + b1'). One extra block
// lays out layers 2 and 3 for the tensor cores; the blocks after it write a kept step's new R and C
// to the state (commit_factored_accumulators, spread over them by table entry).
// ------------------------------------------------------------------------------------------
#define SFC_FOLD_THREADS 256
#define SFC_FOLD_LANES 8  // partial sums per feature
// Blocks per SM (80 registers): all of GPT-2 medium's 293 in one wave, where 165 registers allowed one
// per SM. (The fold's time measured the same at 1, 2 or 3 blocks per SM, and with its loops over chunk
// partials and table entries unrolled to keep more loads in flight: docs/performance.md §6.)
#define SFC_FOLD_MIN_BLOCKS 3

// Sums of squared features far beyond float32 (features above ~1e18, from gradients near 2^64)
// overflow the statistics pass's per-thread float sums: the fold then sums that tensor again, in
// float64 throughout (slow, and only ever for such a tensor). Not inlined, and given the tables rather
// than the fold's copies: its registers (and the spills the fold's block count makes of them) stay out
// of the common path.
__device__ __noinline__ void sum_squared_features_float64(const TensorMeta* tensors, const i64* gradients, int tensor,
                                                          const GroupMeta* groups, float inverse_scale,
                                                          const float* clip_factors, const float* row_table,
                                                          const float* col_table, double (*scratch)[SFC_NUM_FEATURES],
                                                          double* sums) {
  const TensorMeta t = tensor_row(tensors, gradients, tensor);
  const Decays decays = group_decays(groups, t);
  const float clip_factor = tensor_clip_factor(clip_factors, tensor);
  double partial[SFC_NUM_FEATURES] = {};
  for (i64 e = threadIdx.x; e < t.numel; e += SFC_FOLD_THREADS) {
    float x[SFC_NUM_FEATURES], grad, param;
    ElementState s;
    element_features(t, e, decays, inverse_scale, clip_factor, TableInputs{row_table, col_table, nullptr, nullptr}, x, s,
                     grad, param);
#pragma unroll
    for (int j = 0; j < SFC_NUM_FEATURES; ++j)
      if (is_finite(x[j])) partial[j] += static_cast<double>(x[j]) * static_cast<double>(x[j]);
  }
  block_sums<SFC_NUM_FEATURES, SFC_FOLD_THREADS>(partial, scratch, sums);
}

// `phase` 0: the whole fold. Where tensors are split among processes their sums are partial: phase 1
// writes each tensor's sums to tensor_sums, the caller sums them over the processes, and phase 2
// folds from the totals.
extern "C" __global__ void __launch_bounds__(SFC_FOLD_THREADS, SFC_FOLD_MIN_BLOCKS)
small_fc_lopt_fold(const TensorMeta* __restrict__ tensors, const i64* __restrict__ gradients, int num_tensors,
                   const GroupMeta* __restrict__ groups,
                   const double* __restrict__ stats_partials, float* __restrict__ row_table,
                   float* __restrict__ col_table, const float* __restrict__ network,
                   const float* __restrict__ clip_factors, const float* grad_scale, const float* found_inf,
                   int* status, float* __restrict__ folded, float* __restrict__ shared_frags, int phase,
                   double* __restrict__ tensor_sums, int fp16_exponent, i64 total_row_entries,
                   i64 total_col_entries, uint4* __restrict__ row_packed, uint4* __restrict__ col_packed) {
  // Blocks 0 ... num_tensors - 1 fold one tensor each; block num_tensors lays out layers 2 and 3.
  const StepFlags flags{grad_scale, found_inf, status};
  const int tid = threadIdx.x;
  const float* w1 = network + SFC_W1;
  if (blockIdx.x > num_tensors) {  // the blocks after layer 2's: a kept step's new R and C to the state
    if (phase != 1 && !step_is_skipped(flags))
      commit_factored_accumulators(tensors, num_tensors, row_table, col_table, total_row_entries, total_col_entries,
                                   blockIdx.x - num_tensors - 1, gridDim.x - num_tensors - 1, tid, SFC_FOLD_THREADS);
    return;
  }
  if (blockIdx.x == num_tensors) {
#if SFC_TENSOR_CORES
    if (phase == 1) return;
    const float* w2 = network + SFC_W2;
    const float* w3 = network + SFC_W3;
#if SFC_LAYER2_FP16
    const float up = exp2_of(fp16_exponent);  // layer 1 comes scaled by 2^-e
    write_half_split_operand(shared_frags + SFC_SHARED_L2,
                             [&](int k, int n) { return __fmul_rn(w2[n * SFC_HIDDEN + k], up); }, tid, SFC_FOLD_THREADS);
    const float layer2_scale = 1.f, layer3_scale = 1.f;
#else
    // (With FP16 products in layer 3: layer 2 scaled by 2^-e, layer 3 by 2^e.)
    const float layer2_scale = SFC_OUTPUT_MMA ? exp2_of(-fp16_exponent) : 1.f;
    const float layer3_scale = SFC_OUTPUT_MMA ? exp2_of(fp16_exponent) : 1.f;
    write_split_operand(shared_frags + SFC_SHARED_L2,
                        [&](int k, int n) { return __fmul_rn(w2[n * SFC_HIDDEN + layer2_input_unit(k)], layer2_scale); },
                        tid, SFC_FOLD_THREADS);
#endif
    if (tid < 2 * SFC_HIDDEN) shared_frags[SFC_SHARED_W3 + tid] = __fmul_rn(w3[tid], layer3_scale);
    if (tid < SFC_HIDDEN) shared_frags[SFC_SHARED_B2 + tid] = __fmul_rn(network[SFC_B2 + tid], layer2_scale);
    if (tid < 2) shared_frags[SFC_SHARED_B3 + tid] = network[SFC_B3 + tid];
#endif
    return;  // (the generic MLP reads its later layers from the network buffer itself)
  }
  const int tensor = static_cast<int>(blockIdx.x);
  const TensorMeta t = tensor_row(tensors, gradients, tensor);  // (its gradient: the float64 fallback's)
  const bool skipped = step_is_skipped(flags);
  __shared__ double lane_sums[SFC_NUM_FEATURES][SFC_FOLD_LANES];
  __shared__ double table_scratch[SFC_FOLD_THREADS / 32][LOPT_TABLE_FEATURES];
  __shared__ double table_sums[LOPT_TABLE_FEATURES];
  __shared__ double sums[SFC_NUM_FEATURES];
  __shared__ double scratch[SFC_FOLD_THREADS / 32][SFC_NUM_FEATURES];
  __shared__ float scale[SFC_NUM_FEATURES];
  __shared__ float time[SFC_NUM_TIME_FEATURES];
  __shared__ int overflowed;
  if (tid == 0) overflowed = 0;
  if (tid < SFC_NUM_TIME_FEATURES && phase != 1) {
    // time_features: tanh(tau / T_i - 1), tau = steps taken before this one.
    const float tau = static_cast<float>(*pointer<const i64>(groups[t.group].step));
    time[tid] = tanhf(__fsub_rn(__fdiv_rn(tau, SFC_TIMESCALES[tid]), 1.0f));
  }
  double* split_sums = tensor_sums + static_cast<i64>(tensor) * SFC_NUM_FEATURES;
  phase_statistics_sums<SFC_NUM_FEATURES, SFC_FOLD_THREADS, SFC_FOLD_LANES>(
      phase, split_sums, t, stats_partials, row_table, col_table, SFC_TABLE_FEATURES_FIRST, lane_sums, table_scratch,
      table_sums, sums);
  if (phase != 2) {
    if (tid < SFC_NUM_FEATURES && !is_finite(static_cast<float>(sums[tid] / static_cast<double>(t.count))))
      atomicExch(&overflowed, 1);
    __syncthreads();
    if (overflowed && !skipped)
      sum_squared_features_float64(tensors, gradients, tensor, groups, inverse_grad_scale(flags), clip_factors,
                                   row_table, col_table, scratch, sums);
    if (phase == 1) {
      if (tid < SFC_NUM_FEATURES) split_sums[tid] = sums[tid];
      return;
    }
  }
  __shared__ float shift[SFC_NUM_FEATURES];  // the feature values' factor: 2^-64 for a shifted feature, else 1
  if (tid < SFC_NUM_FEATURES) {
    const float s = normaliser_scale(sums[tid], t.count);
    const bool shifted = is_shiftable_feature(tid) && s < 0x1p-60f;  // (the reference's test)
    // (s · 2^64 formed in float64 and rounded once, as the reference: s itself may be subnormal.)
    scale[tid] = shifted ? static_cast<float>(0x1p64 / sqrt(1e-5 + sums[tid] / static_cast<double>(t.count))) : s;
    shift[tid] = shifted ? 0x1p-64f : 1.f;
  }
  __shared__ float bias[SFC_HIDDEN];  // b1', for the weights of the bias inputs
  float* out = folded + static_cast<i64>(tensor) * SFC_FOLDED;
  if (tid < SFC_HIDDEN) {
    float b = network[SFC_B1 + tid];
    for (int j = 0; j < SFC_NUM_TIME_FEATURES; ++j) b = fmaf(w1[tid * SFC_INPUTS + SFC_NUM_FEATURES + j], time[j], b);
    bias[tid] = b;
  }
  __syncthreads();
  if (tid < SFC_SHIFTABLE_FEATURES) out[SFC_FOLDED_SHIFTS + tid] = shift[shiftable_feature(tid)];
  const float* accumulator_shift = shift + SFC_TABLE_FEATURES_FIRST;  // R's three, then C's
  const auto tables_shifted = [&] {  // (R's and C's values are read from the tables)
#pragma unroll
    for (int k = 0; k < SFC_ACCUMULATOR_FEATURES; ++k)
      if (accumulator_shift[k] != 1.f) return true;
    return false;
  };
  if (t.factored && tables_shifted())
    scale_table_accumulators(t, row_table, col_table, row_packed, col_packed, accumulator_shift, accumulator_shift + 3,
                             tid, SFC_FOLD_THREADS);
#if SFC_TENSOR_CORES
  // The whole layer scaled by 2^-e in the exact mode, so that layer 2's FP16 inputs stay in range
  // (fp16_exponent; a build whose layer 2 has no FP16 parts leaves both layers unscaled).
  const float down = SFC_LAYER2_FP16 ? exp2_of(-fp16_exponent) : 1.f;
  const bool shared_is_col = t.d0_is_a != 0;
  const auto folded_weight = [&](int k, int n) {  // W1' of input k, unit n
    const int feature = input_feature(k, shared_is_col);
    if (feature >= 0) return __fmul_rn(__fmul_rn(w1[n * SFC_INPUTS + feature], scale[feature]), down);
    const float b = __fmul_rn(bias[n], down);
    if (k == SFC_BIAS_INPUT_HI) return b;
    if (k == SFC_BIAS_INPUT_LO) return __fsub_rn(b, split_effective(b));
    return 0.f;
  };
  write_split_operand(out, folded_weight, tid, SFC_FOLD_THREADS);
  // The shared inputs' weights once more, whole: the apply pass forms their share of layer 1 per entry.
  for (int i = tid; i < SFC_SHARED_INPUTS * SFC_HIDDEN; i += SFC_FOLD_THREADS)
    out[SFC_FOLDED_SHARED + i] = folded_weight(SFC_SHARED_INPUTS_FIRST + i / SFC_HIDDEN, i % SFC_HIDDEN);
#else
  // The generic MLP's first layer: W1' = W1 scaled per feature, b1' with the time features folded in.
  for (int i = tid; i < SFC_HIDDEN * SFC_NUM_FEATURES; i += SFC_FOLD_THREADS) {
    const int n = i / SFC_NUM_FEATURES, k = i % SFC_NUM_FEATURES;
    out[SFC_FOLDED_W1 + i] = __fmul_rn(w1[n * SFC_INPUTS + k], scale[k]);
  }
  for (int n = tid; n < SFC_HIDDEN; n += SFC_FOLD_THREADS) out[SFC_FOLDED_B1 + n] = bias[n];
#endif
}

// update_from_mlp: u = direction · exp(exp_mult · magnitude) · step_mult.
LOPT_DEVICE float update_from_mlp(float2 mlp_output, const ApplyScalars& a) {
  return __fmul_rn(__fmul_rn(mlp_output.x, expf(__fmul_rn(mlp_output.y, a.exp_mult))), a.step_mult);
}

// The apply pass reads and writes each element once: its loads and stores are evict-first (kStreamed)
// so they do not push the factor tables and weights out of L2.
constexpr bool kStreamed = true;

#if SFC_TENSOR_CORES
// ------------------------------------------------------------------------------------------
// Apply: a block (4 warps) takes 128 elements at a time, one per thread. Every thread computes its
// element's 28 features (as the statistics pass did); mlp_chunk runs the MLP for each warp's 32
// rows on tensor cores and hands each thread its element's two outputs; the thread applies the update.
// Blocks take contiguous ranges of chunks and reload the first layer only when the tensor changes.
// ------------------------------------------------------------------------------------------

// Layer 3 (2 outputs) on the CUDA cores, in float32: each thread takes the 8 hidden units of its
// accumulator fragments, for the 4 rows they hold (g and g + 8 of both m-tiles); the quad (4 threads)
// then sums its partials by halves (a reduce-scatter: 6 shuffles and adds, where summing all 8 in every
// thread took 16): lane t ends with (direction, magnitude) of row output_layer_row(lane).
LOPT_DEVICE int output_layer_row(int lane) { return 16 * ((lane % 4) / 2) + lane / 4 + 8 * (lane % 2); }
LOPT_DEVICE float2 output_layer(const float h2[2][4][4], const float* w3, const float* b3, int t) {
  float partial[2][4] = {};  // [m]: direction(g), magnitude(g), direction(g+8), magnitude(g+8)
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int c = 0; c < 4; ++c)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int unit = 8 * c + 2 * t + half;
        const float h_g = fmaxf(h2[m][c][half], 0.f), h_g8 = fmaxf(h2[m][c][2 + half], 0.f);
        partial[m][0] = fmaf(w3[unit], h_g, partial[m][0]);
        partial[m][1] = fmaf(w3[SFC_HIDDEN + unit], h_g, partial[m][1]);
        partial[m][2] = fmaf(w3[unit], h_g8, partial[m][2]);
        partial[m][3] = fmaf(w3[SFC_HIDDEN + unit], h_g8, partial[m][3]);
      }
  // Lanes t = 2, 3 keep m-tile 1 and hand m-tile 0 to their partner t ^ 2; then odd lanes keep row g + 8.
  const bool upper = (t & 2) != 0, odd = (t & 1) != 0;
  float row_pair[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float given = upper ? partial[0][i] : partial[1][i], kept = upper ? partial[1][i] : partial[0][i];
    row_pair[i] = __fadd_rn(kept, __shfl_xor_sync(0xffffffffu, given, 2));
  }
  float sums[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float given = odd ? row_pair[i] : row_pair[2 + i], kept = odd ? row_pair[2 + i] : row_pair[i];
    sums[i] = __fadd_rn(kept, __shfl_xor_sync(0xffffffffu, given, 1));
  }
  return make_float2(__fadd_rn(sums[0], b3[0]), __fadd_rn(sums[1], b3[1]));
}

// The B operand of layer 3 on tensor cores, W3's two rows as columns 0 and 1 (lanes g >= 2 hold
// zeros), per 16-deep k-step p = 0, 1 and lane a uint2: {f16x2 W3[g][16p + 2t, +1], f16x2 W3[g][16p +
// 2t + 8, +9]}, W3 scaled by 2^e beforehand (the fold's fp16_exponent) and rounded to nearest.
LOPT_DEVICE void write_output_operand(uint2* w3_operand, const float* w3, int thread, int num_threads) {
  for (int slot = thread; slot < 2 * 32; slot += num_threads) {
    const int lane = slot % 32, step = slot / 32, g = lane / 4, t = lane % 4;
    const float* row = w3 + g * SFC_HIDDEN;
    const int k = 16 * step + 2 * t;
    w3_operand[slot] = g < 2 ? make_uint2(pack_f16x2_satfinite(row[k], row[k + 1]),
                                          pack_f16x2_satfinite(row[k + 8], row[k + 9]))
                             : make_uint2(0u, 0u);
  }
}
// Layer 3 as tensor-core products: per m-tile and 16-deep k-step one FP16 MMA with
// write_output_operand's B; the A fragments are layer 2's accumulators after the ReLU, rounded to
// nearest inside a conversion that also applies the ReLU (one instruction per pair) and saturates at
// 65504, which the fold keeps them below by scaling layer 2 by 2^-e (fp16_exponent; W3 by 2^e).
// out[m]: lanes t == 0 hold (direction, magnitude) of rows g and g + 8.
LOPT_DEVICE void output_layer_mma(const float h2[2][4][4], const uint2* w3_operand, const float* b3, int lane,
                                  float out[2][4]) {
  const bool holds_outputs = lane % 4 == 0;  // columns 0 and 1 of the product
  const float bias_direction = holds_outputs ? b3[0] : 0.f, bias_magnitude = holds_outputs ? b3[1] : 0.f;
#pragma unroll
  for (int m = 0; m < 2; ++m) {
    out[m][0] = bias_direction; out[m][1] = bias_magnitude;
    out[m][2] = bias_direction; out[m][3] = bias_magnitude;
  }
#pragma unroll
  for (int step = 0; step < 2; ++step) {
    const uint2 b = w3_operand[step * 32 + lane];
#pragma unroll
    for (int m = 0; m < 2; ++m) {
      const float(&low)[4] = h2[m][2 * step], (&high)[4] = h2[m][2 * step + 1];  // units 16 step + 0 ... 7, 8 ... 15
      const unsigned a[4] = {pack_f16x2_relu_satfinite(low[0], low[1]), pack_f16x2_relu_satfinite(low[2], low[3]),
                             pack_f16x2_relu_satfinite(high[0], high[1]), pack_f16x2_relu_satfinite(high[2], high[3])};
      mma_f16_m16n8k16(out[m], a, b.x, b.y, out[m]);
    }
  }
}

// Each warp runs its own 32 elements as two 16-row m-tiles, through a feature tile of its own: each
// thread writes its element's row, then reads the A fragments of the rows the MMA gives it.
#define SFC_FEATURE_STRIDE 36  // row stride of the feature tiles: conflict-free float4 access
#if LOPT_SPLIT_MODE == 2
#define SFC_TILE_ROW_FLOATS 20  // a row's 32 features as BF16 pairs, and 4 words of padding
#else
#define SFC_TILE_ROW_FLOATS SFC_FEATURE_STRIDE
#endif

#if LOPT_SPLIT_MODE == 2
// Mode 2 (precision="fast"): a row holds its features as BF16 in the MMA's column order, 16 words: the
// uint4 of k-step j holds, for t = 0 ... 3, the pair (k = 8j + t, 8j + t + 4) (bf16_layer_32x32's
// order), so ldmatrix hands every thread its A fragments in place. Rows are 20 words apart: any 8
// consecutive rows' uint4s of one k-step then fall in distinct banks (20 r mod 32 = 0, 20, 8, 28, 16,
// 4, 24, 12), so the row writes and ldmatrix's 8-row reads are conflict-free, and every address is a
// lane's row plus a constant (a row swizzle instead costs address arithmetic in every chunk:
// docs/performance.md §3).
#define SFC_TILE_ROW_CHUNKS (SFC_TILE_ROW_FLOATS / 4)

// A tile row's k-step j (inputs 8j ... 8j + 7) from the features.
LOPT_DEVICE uint4 input_step_words(const float x[SFC_NUM_FEATURES], int j) {
  unsigned words[4];
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    const int k = 8 * j + t;
    words[t] = pack_bf16x2(first_layer_input(x, k), first_layer_input(x, k + 4));
  }
  return make_uint4(words[0], words[1], words[2], words[3]);
}

// Layer 1: h1 = W1' x + b1' (before the ReLU; b1' from the bias inputs) for the warp's 32 elements.
// The row's k-steps are packed from the features x here, but for k-step 2 where per_element_words_in_tile
// (apply_element_features copied the per-element entry's packed inputs there).
LOPT_DEVICE void first_layer(float h1[2][4][4], const float x[SFC_NUM_FEATURES], float* tile, const float* l1,
                             bool, const float4*, bool per_element_words_in_tile, int lane) {  // (always all 32 inputs)
  uint4* rows = reinterpret_cast<uint4*>(tile);  // SFC_TILE_ROW_CHUNKS uint4 per row
#pragma unroll
  for (int j = 0; j < 4; ++j)
    if (j != 2 || !per_element_words_in_tile) rows[SFC_TILE_ROW_CHUNKS * lane + j] = input_step_words(x, j);
  __syncwarp();
  // Matrices of k-step pair p for m-tile m: rows 16m ... 16m + 7 and 16m + 8 ... 16m + 15 of k-step 2p,
  // then the same rows of k-step 2p + 1: the A fragment {row g, row g + 8} x {2p, 2p + 1}.
  const int matrix_row = 8 * ((lane / 8) % 2) + lane % 8, matrix_half = lane / 16;
  bf16_layer_32x32(h1, [&](int p, unsigned f[2][4]) {
#pragma unroll
    for (int m = 0; m < 2; ++m) {
      const int row = 16 * m + matrix_row;
      load_matrices_x4(f[m], rows + SFC_TILE_ROW_CHUNKS * row + 2 * p + matrix_half);
    }
  }, l1, nullptr, lane);
}
#else
// Column of input k in a feature-tile row: k itself (rows SFC_FEATURE_STRIDE = 36 words apart, so
// ldmatrix's 8-row reads of 16 bytes fall in distinct banks).
LOPT_DEVICE constexpr int feature_column(int k) { return k; }

// Layer 1: h1 = W1' x + b1' (before the ReLU; b1' from the bias inputs) for the warp's 32 elements.
// use_quads: the warp's 32 elements all read one shared entry, and shared_quads hold its share of the layer
// (BiasQuads layout): the layer then multiplies inputs 0 ... 23 only; else all 32.
LOPT_DEVICE void first_layer(float h1[2][4][4], const float x[SFC_NUM_FEATURES], float* tile, const float* l1,
                             bool use_quads, const float4* shared_quads, bool, int lane) {
  float row[SFC_K];
#pragma unroll
  for (int k = 0; k < SFC_K; ++k) row[feature_column(k)] = first_layer_input(x, k);
#pragma unroll
  for (int q = 0; q < SFC_K / 4; ++q)
    reinterpret_cast<float4*>(tile + lane * SFC_FEATURE_STRIDE)[q] =
        make_float4(row[4 * q], row[4 * q + 1], row[4 * q + 2], row[4 * q + 3]);
  __syncwarp();
  // The A fragment of k-step j in m-tile m, {(g, 8j + t), (g + 8, 8j + t), (g, 8j + t + 4), (g + 8, 8j + t + 4)},
  // is four 8 x 4 blocks of 32-bit values (rows 16m ... +7 and +8 ... +15, columns 8j ... +3 and +4 ... +7):
  // ldmatrix of them as 8 x 8 blocks of 16-bit values hands each thread its four in place.
  const int matrix = lane / 8, matrix_row = 8 * (matrix % 2) + lane % 8, matrix_column = 4 * (matrix / 2);
  const auto load_fragments = [&](int j, SplitFragment f[2]) {
#pragma unroll
    for (int m = 0; m < 2; ++m) {
      unsigned a[4];
      load_matrices_x4(a, tile + (16 * m + matrix_row) * SFC_FEATURE_STRIDE + 8 * j + matrix_column);
      f[m] = truncated_split_fragment(a);
    }
  };
  if (use_quads) split_layer_32x32<SFC_SHARED_INPUTS_FIRST / 8>(h1, load_fragments, l1, BiasQuads{shared_quads}, lane);
  else split_layer_32x32(h1, load_fragments, l1, nullptr, lane);
}
#endif

// The MLP for the thread's element (features x); every lane of the warp calls it together.
// tile: the warp's 32 x SFC_TILE_ROW_FLOATS floats; outputs: the warp's 32 (direction, magnitude); l2:
// layer 2's B operand in shared memory, or (mode 2) a RegisterOperand; b2: its bias as quads (BiasQuads;
// with the first layer's bias on its inputs, no register copies of an addend: fewer instructions per
// chunk, docs/performance.md §2);
// use_quads, shared_quads, per_element_words_in_tile: first_layer's.
template <typename Layer2Operand>
LOPT_DEVICE float2 mlp_chunk(const float x[SFC_NUM_FEATURES], float* tile, float2* outputs, const float* l1,
                             bool use_quads, const float4* shared_quads, bool per_element_words_in_tile,
                             const Layer2Operand& l2, BiasQuads b2, const float* w3, const uint2* w3_operand,
                             const float* b3) {
  const int lane = threadIdx.x % 32, t = lane % 4;
  __syncwarp();  // the previous chunk's reads of this warp's tile and outputs are done
  float h1[2][4][4];
  first_layer(h1, x, tile, l1, use_quads, shared_quads, per_element_words_in_tile, lane);
  // Layer 2: its A fragments are layer 1's accumulators after the ReLU.
  float h2[2][4][4];
  // (Read straight from the registers: parking them in the tile instead saves registers but measured
  // slower, docs/performance.md §6.)
#if LOPT_SPLIT_MODE == 2
  // (The ReLU inside the BF16 conversion: one instruction per pair.)
  bf16_layer_32x32(h2, [&](int p, unsigned f[2][4]) {
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int j = 2 * p + half;
        f[m][2 * half] = pack_bf16x2_relu(h1[m][j][0], h1[m][j][1]);      // row g
        f[m][2 * half + 1] = pack_bf16x2_relu(h1[m][j][2], h1[m][j][3]);  // row g + 8
      }
  }, l2, b2, lane);
#else
  half_split_layer_32x32(h2, h1, l2, b2, lane);  // (FP16 high parts, natural unit order)
#endif
#if SFC_OUTPUT_MMA
  float out[2][4];
  output_layer_mma(h2, w3_operand, b3, lane, out);
  const int g = lane / 4;
  if (t == 0) {
#pragma unroll
    for (int m = 0; m < 2; ++m) {
      outputs[16 * m + g] = make_float2(out[m][0], out[m][1]);
      outputs[16 * m + g + 8] = make_float2(out[m][2], out[m][3]);
    }
  }
  __syncwarp();
  return outputs[lane];
#else
  // Row r's outputs are in the lane whose output_layer_row is r: 4 (r % 8) + 2 (r / 16) + (r / 8) % 2.
  const float2 held = output_layer(h2, w3, b3, t);
  const int source = 4 * (lane % 8) + 2 * (lane / 16) + (lane / 8) % 2;
  return make_float2(__shfl_sync(0xffffffffu, held.x, source), __shfl_sync(0xffffffffu, held.y, source));
#endif
}


// Where a factored tensor's elements read their table entries, by role (TensorMeta's entry offsets
// into the tables): the whole entries, and for the per-element one (SFC_PACKED_ENTRIES) its compact factors
// and packed table features.
struct TensorEntries {
  const float* shared;
  const float* per_element;
  const float4* per_element_factors;
  const uint4* per_element_packed;
};
struct FactorTables {
  const float* row_table;
  const float* col_table;
  const float4* row_factors;
  const float4* col_factors;
  const uint4* row_packed;
  const uint4* col_packed;
};
LOPT_DEVICE TensorEntries tensor_entries(const TensorMeta& t, const FactorTables& tables) {
  const float* row = tables.row_table + t.row_table * LOPT_TABLE_FLOATS;
  const float* col = tables.col_table + t.col_table * LOPT_TABLE_FLOATS;
  if (t.d0_is_a) return TensorEntries{col, row, tables.row_factors + t.row_table, tables.row_packed + t.row_table};
  return TensorEntries{row, col, tables.col_factors + t.col_table, tables.col_packed + t.col_table};
}


// The apply pass's element features: element_features's, with a factored tensor's two entries read
// by role (shared: indexed by the position without axis b; per-element: without axis a) and handed to
// per_element_features in the places of (R, C), so that x[13 ...] hold the shared entry's values
// whatever the tensor (first_layer_input's order); the factors keep their R and C roles, so the
// factored features' products stay in the reference's order. entries: the tensor's first entry of
// each role (TensorEntries). shared_entry: the index of the element's shared entry (-1 where the
// tensor is not factored). shifts: the tensor's feature shifts (SFC_FOLDED_SHIFTS), applied to the
// values of rms and V (the tables' R and C values come shifted). tile_row (mode 2): the thread's row of
// its warp's feature tile: for a factored tensor (SFC_PACKED_ENTRIES), its k-step 2 (inputs 16 ... 23)
// is the per-element entry's packed_entry_inputs, copied here (x[16 ... 18] and x[22 ... 24], its values as
// floats, are then zeros that nothing reads).
// (Held in registers until first_layer, packed words made the pass spill; the warp's reads of the
// previous chunk's tile are done, as mlp_chunk ends past a __syncwarp.)
template <bool Streamed>
LOPT_DEVICE void apply_element_features(const TensorMeta& t, i64 e, const Decays& decays, float inverse_scale,
                                        float clip_factor, const TensorEntries& entries, const float* shifts,
                                        float x[SFC_NUM_FEATURES], ElementState& s, float& param, i64& shared_entry,
                                        uint4* tile_row) {
  IssuedElement issued = issue_element_loads<Streamed>(t, e);
#if SFC_PACKED_ENTRIES
  // The per-element entry's reads (from L2) go out while the element's (from DRAM) are in flight, ahead of
  // any use of them: else the first use waits out the DRAM latency and the entry's L2 latency follows.
  i64 without_a = 0, without_b = 0;
  float4 per_element_factors = make_float4(0.f, 0.f, 0.f, 0.f);
  uint4 per_element_words = make_uint4(0u, 0u, 0u, 0u);
  if (t.factored) {
    split_factored_index(t, e, without_a, without_b);
    per_element_factors = __ldg(entries.per_element_factors + without_a);
    per_element_words = __ldg(entries.per_element_packed + without_a);
  }
  hold_uses_until_here(issued);
#endif
  const float unclipped_grad = finish_element(t, issued, inverse_scale, param, s);
  shared_entry = -1;
  float grad;
  features_of_loaded(t, decays, clip_factor, unclipped_grad, param, s, x, grad, [&](FactorEntry& row, FactorEntry& col) {
#if !SFC_PACKED_ENTRIES
    i64 without_a, without_b;
    split_factored_index(t, e, without_a, without_b);
#endif
    shared_entry = without_b;
    const bool shared_is_col = t.d0_is_a != 0;  // R drops axis d0: R's index is the one without b where d0 is b
    const FactorEntry shared = read_factor_entry(entries.shared, without_b);  // (a warp mostly shares it)
#if SFC_PACKED_ENTRIES
    // Only the per-element entry's factors as floats; its features straight into the tile, packed.
    tile_row[2] = per_element_words;
    FactorEntry per_element{};
    per_element.factor[0] = per_element_factors.x;
    per_element.factor[1] = per_element_factors.y;
    per_element.factor[2] = per_element_factors.z;
#else
    const FactorEntry per_element = read_factor_entry(entries.per_element, without_a);
#endif
    row = shared;
    col = per_element;
#pragma unroll
    for (int k = 0; k < 3; ++k) {
      row.factor[k] = shared_is_col ? per_element.factor[k] : shared.factor[k];
      col.factor[k] = shared_is_col ? shared.factor[k] : per_element.factor[k];
    }
  });
  x[SFC_RMS_FEATURE] = __fmul_rn(x[SFC_RMS_FEATURE], shifts[0]);
  if (!t.factored) {
#pragma unroll
    for (int i = 1; i < SFC_SHIFTABLE_FEATURES; ++i) x[shiftable_feature(i)] = __fmul_rn(x[shiftable_feature(i)], shifts[i]);
  }
}

// The exact mode's first layer for a warp whose 32 elements all read one shared entry: the shared inputs'
// share of the layer, W1'[:, 24 ... 29] times the entry's values, is the same vector for all 32, formed
// once per entry (lane n: unit n, six float32 products) into the warp's quads (BiasQuads layout),
// which the layer then takes as its addend in place of inputs 24 ... 31 (one k-step fewer: 112 -> 96
// MMAs per 32 elements). A warp's 32 elements (32 consecutive ones from a multiple of 32) share it
// in every tensor laid out (outer, a, mid, b) with b a multiple of 32 (warps_share_entries: linear
// layers' weights, embeddings); other tensors multiply all 32 inputs.
LOPT_DEVICE bool warps_share_entries(const TensorMeta& t) { return t.factored && t.inner == 1 && t.b % 32 == 0; }
LOPT_DEVICE void write_shared_quads(float4* quads, const float* shared_input_weights, const float x[SFC_NUM_FEATURES],
                                    int lane) {
  float v = 0.f;
#pragma unroll
  for (int i = 0; i < SFC_SHARED_INPUTS; ++i)
    v = fmaf(shared_input_weights[i * SFC_HIDDEN + lane], first_layer_input(x, SFC_SHARED_INPUTS_FIRST + i), v);
  float* q = reinterpret_cast<float*>(quads);
  const int quad = 4 * (lane / 8) + (lane % 8) / 2, component = lane % 2;  // unit lane = 8c + 2t + component
  q[4 * quad + component] = v;
  q[4 * quad + component + 2] = v;
  __syncwarp();
}

// (The element loads stay where they are used. Taking their DRAM latency off the warp's path did not
// pay: copying the next chunk's elements into shared memory by cp.async and loading them a chunk ahead
// into registers made the step slower, and asking L2 for them ahead gained nothing; the other warps
// already cover that latency: docs/performance.md §6.)
// The common tensor: a factored matrix (plain_index) whose parameter and gradient are float32. Its
// chunks run a copy of the chunk's code compiled with those fields as constants (as_common_tensor),
// so the per-element tests of dtype, factoring and index form fold away (about a fifth fewer
// instructions per element on the path most elements of a transformer take).
LOPT_DEVICE bool is_common_tensor(const TensorMeta& t) {
  return t.plain_index && t.factored && t.param_dtype == LOPT_F32 && t.grad_dtype == LOPT_F32;
}
LOPT_DEVICE TensorMeta as_common_tensor(const TensorMeta& t) {
  TensorMeta c = t;
  c.plain_index = 1; c.factored = 1; c.param_dtype = LOPT_F32; c.grad_dtype = LOPT_F32;
  return c;
}
extern "C" __global__ void __launch_bounds__(SFC_APPLY_THREADS, SFC_APPLY_MIN_BLOCKS)
small_fc_lopt_apply(const TensorMeta* __restrict__ tensors, const i64* __restrict__ gradients, int num_tensors,
                    const GroupMeta* __restrict__ groups,
                    int num_groups, i64 total_chunks, const float* __restrict__ folded,
                    const float* __restrict__ later_layers, const float* __restrict__ row_table,
                    const float* __restrict__ col_table, const float4* __restrict__ row_factors,
                    const float4* __restrict__ col_factors, const uint4* __restrict__ row_packed,
                    const uint4* __restrict__ col_packed, const float* __restrict__ clip_factors,
                    const float* grad_scale, const float* found_inf, int* status, i64* skipped_steps) {
  const StepFlags flags{grad_scale, found_inf, status};
  const bool skipped = step_is_skipped(flags);
  // Every block has read the counters it needs (every fold read the time features before this launch).
  if (blockIdx.x == 0 && threadIdx.x == 0) finish_step(groups, num_groups, skipped, flags, skipped_steps);
  if (skipped) return;  // nothing is written
  __shared__ __align__(16) float l1[SFC_OPERAND_32x32];
  __shared__ __align__(16) float l2[SFC_L2_OPERAND_FLOATS];
  __shared__ float4 b2[16];  // layer 2's bias (BiasQuads)
  __shared__ float w3[2 * SFC_HIDDEN], b3[2];
#if SFC_OUTPUT_MMA
  __shared__ uint2 w3_operand[4 * 32];
#else
  uint2* const w3_operand = nullptr;
#endif
  __shared__ __align__(16) float feature_tiles[SFC_APPLY_WARPS][32][SFC_TILE_ROW_FLOATS];
#if SFC_SHARED_VECTORS
  __shared__ float shared_input_weights[SFC_SHARED_INPUTS * SFC_HIDDEN];  // the tensor's W1' of the shared inputs
  __shared__ float4 shared_quads[SFC_APPLY_WARPS][16];                   // each warp's current shared vector
  __shared__ bool shared_vectors;                                        // warps_share_entries
  i64 quads_entry = -1;  // the shared entry this warp's quads hold (the same in every lane)
#endif
  __shared__ TensorEntries entries;
  __shared__ float feature_shifts[SFC_SHIFTABLE_FEATURES];
  __shared__ float2 mlp_outputs[SFC_APPLY_WARPS][32];
  __shared__ TensorMeta meta;
  __shared__ ApplyScalars group;  // in shared memory, not ~20 registers held through the whole kernel
  __shared__ float clip_factor;
  for (int k = threadIdx.x; k < SFC_L2_OPERAND_FLOATS; k += SFC_APPLY_THREADS) l2[k] = later_layers[SFC_SHARED_L2 + k];
  if (threadIdx.x < 2 * SFC_HIDDEN) w3[threadIdx.x] = later_layers[SFC_SHARED_W3 + threadIdx.x];
  write_bias_quads(b2, later_layers + SFC_SHARED_B2, threadIdx.x, SFC_APPLY_THREADS);
  if (threadIdx.x < 2) b3[threadIdx.x] = later_layers[SFC_SHARED_B3 + threadIdx.x];
  // (In shared memory: held in a register through the loop, it was spilled and reloaded every chunk.
  // Read after the first chunk's __syncthreads.)
  __shared__ float inverse_scale;
  if (threadIdx.x == 0) inverse_scale = inverse_grad_scale(flags);
#if SFC_OUTPUT_MMA
  __syncthreads();
  write_output_operand(w3_operand, w3, threadIdx.x, SFC_APPLY_THREADS);
#endif
#if SFC_L2_IN_REGISTERS
  __syncthreads();
  RegisterOperand l2_operand;  // layer 2's B operand, the same for every tensor
  l2_operand.load(l2, threadIdx.x % 32);
#else
  const float* const l2_operand = l2;  // (read from shared memory at each use: the exact mode's registers are full)
#endif

  const i64 chunk_begin = total_chunks * blockIdx.x / gridDim.x;
  const i64 chunk_end = total_chunks * (blockIdx.x + 1) / gridDim.x;
  // Chunks ascend, so the tensor changes only where the current one's chunks end: the search (a
  // chain of dependent loads) runs once per tensor a block meets, not once per chunk.
  i64 current_end = -1;  // first chunk after the current tensor's
  for (i64 chunk = chunk_begin; chunk < chunk_end; ++chunk) {
    if (chunk >= current_end) {
      const int tensor = find_row<LOPT_TENSORMETA_FIRST_APPLY_CHUNK>(tensors, num_tensors, chunk);
      __syncthreads();  // everyone is done with the previous tensor's first layer and metadata
      const float* f = folded + static_cast<i64>(tensor) * SFC_FOLDED;
      for (int k = threadIdx.x; k < SFC_OPERAND_32x32; k += SFC_APPLY_THREADS) l1[k] = f[k];
      if (threadIdx.x < SFC_SHIFTABLE_FEATURES) feature_shifts[threadIdx.x] = f[SFC_FOLDED_SHIFTS + threadIdx.x];
#if SFC_SHARED_VECTORS
      for (int k = threadIdx.x; k < SFC_SHARED_INPUTS * SFC_HIDDEN; k += SFC_APPLY_THREADS)
        shared_input_weights[k] = f[SFC_FOLDED_SHARED + k];
      quads_entry = -1;
#endif
      if (threadIdx.x == 0) {
        meta = tensor_row(tensors, gradients, tensor);
        group = read_apply_scalars(groups[meta.group]);
        clip_factor = tensor_clip_factor(clip_factors, tensor);
        entries = tensor_entries(meta, FactorTables{row_table, col_table, row_factors, col_factors, row_packed, col_packed});
#if SFC_SHARED_VECTORS
        shared_vectors = warps_share_entries(meta);
#endif
      }
      __syncthreads();
      current_end = meta.first_apply_chunk + meta.num_apply_chunks;
    }
    // The chunk's work, for its tensor's metadata chunk_meta (a copy or the shared row: SFC_CHUNK_META).
    const auto apply_chunk = [&](const TensorMeta& chunk_meta) {
      const i64 index = (chunk - chunk_meta.first_apply_chunk) * SFC_APPLY_CHUNK + threadIdx.x;
      const bool valid = index < chunk_meta.numel;
      // A lane past the tensor's end computes the features of its last element (every lane takes part in
      // the warp's MLP) and writes nothing: no branch, and no zeroed features to merge.
      float x[SFC_NUM_FEATURES], param;
      ElementState state;
      i64 shared_entry;
      const int warp = threadIdx.x / 32;
      uint4* const tile_row = reinterpret_cast<uint4*>(&feature_tiles[warp][threadIdx.x % 32][0]);  // (mode 2)
      apply_element_features<kStreamed>(chunk_meta, valid ? index : chunk_meta.numel - 1, group.decays, inverse_scale,
                                                 clip_factor, entries, feature_shifts, x, state, param, shared_entry,
                                                 tile_row);
      if (valid) store_element_state<kStreamed>(chunk_meta, index, state);  // (they do not depend on the MLP)
#if SFC_SHARED_VECTORS
      // (Both tests give every lane of the warp the same answer: shared_vectors is the block's, and the
      // warp's elements have the same shared_entry.)
      if (shared_vectors && shared_entry != quads_entry) {
        write_shared_quads(shared_quads[warp], shared_input_weights, x, threadIdx.x % 32);
        quads_entry = shared_entry;
      }
      const float4* const warp_quads = shared_quads[warp];
      const bool use_quads = shared_vectors;
#else
      const float4* const warp_quads = nullptr;
      const bool use_quads = false;
#endif
      const float2 mlp_output = mlp_chunk(x, &feature_tiles[warp][0][0], mlp_outputs[warp], l1, use_quads, warp_quads,
                                          SFC_PACKED_ENTRIES && chunk_meta.factored, l2_operand, BiasQuads{b2}, w3, w3_operand,
                                          b3);
      if (valid) apply_update<kStreamed>(chunk_meta, index, param, update_from_mlp(mlp_output, group), group);
    };
#if SFC_CHUNK_META
    const TensorMeta chunk_meta = meta;
#else
    const TensorMeta& chunk_meta = meta;
#endif
    if (is_common_tensor(chunk_meta)) {
      apply_chunk(as_common_tensor(chunk_meta));
      continue;
    }
    apply_chunk(chunk_meta);
  }
}
#else  // SFC_TENSOR_CORES
// ------------------------------------------------------------------------------------------
// Apply, any other geometry: a thread per element, the MLP in float32 on the CUDA cores. The first
// layer is the fold's W1' and b1' (normalisation and time features folded in); the later layers are
// read from the network buffer (the same address in every lane: one broadcast load each, cached).
// ------------------------------------------------------------------------------------------
LOPT_DEVICE float2 generic_mlp(const float x[SFC_NUM_FEATURES], const float* folded, const float* network) {
  float h[SFC_HIDDEN];
#pragma unroll 4
  for (int n = 0; n < SFC_HIDDEN; ++n) {
    float a = folded[SFC_FOLDED_B1 + n];
#pragma unroll
    for (int k = 0; k < SFC_NUM_FEATURES; ++k) a = fmaf(folded[SFC_FOLDED_W1 + n * SFC_NUM_FEATURES + k], x[k], a);
    h[n] = fmaxf(a, 0.f);
  }
#pragma unroll
  for (int layer = 0; layer < SFC_MLP_HIDDEN_LAYERS; ++layer) {
    const float* w = network + SFC_MLP_LINEAR_W + layer * SFC_MLP_LINEAR_STRIDE;
    const float* b = network + SFC_MLP_LINEAR_B + layer * SFC_MLP_LINEAR_STRIDE;
    float next[SFC_HIDDEN];
#pragma unroll 4
    for (int n = 0; n < SFC_HIDDEN; ++n) {
      float a = __ldg(b + n);
#pragma unroll
      for (int k = 0; k < SFC_HIDDEN; ++k) a = fmaf(__ldg(w + n * SFC_HIDDEN + k), h[k], a);
      next[n] = fmaxf(a, 0.f);
    }
#pragma unroll
    for (int n = 0; n < SFC_HIDDEN; ++n) h[n] = next[n];
  }
  const float* w = network + SFC_MLP_OUTPUT_W;
  const float* b = network + SFC_MLP_OUTPUT_B;
  float out[2];
#pragma unroll
  for (int o = 0; o < 2; ++o) {
    float a = __ldg(b + o);
#pragma unroll
    for (int k = 0; k < SFC_HIDDEN; ++k) a = fmaf(__ldg(w + o * SFC_HIDDEN + k), h[k], a);
    out[o] = a;
  }
  return make_float2(out[0], out[1]);
}

// The apply pass's functor (apply_pass in accumulators.cuh): per chunk, each thread's element: its
// features (the accumulators updated and stored), the fold's feature shifts, the MLP, the update.
struct GenericApply {
  const float* folded;
  const float* network;
  TableInputs tables;
  const float* clip_factors;

  LOPT_DEVICE bool skipped(const StepFlags& flags) const { return step_is_skipped(flags); }
  LOPT_DEVICE void finish(bool) const {}
  LOPT_DEVICE void begin_tensor(int) const {}

  LOPT_DEVICE void chunks(const TensorMeta& meta, const ApplyScalars& group, int tensor, i64 chunk, i64 end,
                          float inverse_scale) const {
    const float clip_factor = tensor_clip_factor(clip_factors, tensor);
    const float* f = folded + static_cast<i64>(tensor) * SFC_FOLDED;
    for (; chunk < end; ++chunk) {
      const i64 index = (chunk - meta.first_apply_chunk) * SFC_APPLY_CHUNK + threadIdx.x;
      if (index >= meta.numel) continue;
      float x[SFC_NUM_FEATURES], grad, param;
      ElementState state;
      element_features<false, kStreamed>(meta, index, group.decays, inverse_scale, clip_factor, tables, x, state, grad,
                                         param);
      store_element_state<kStreamed>(meta, index, state);
      // The feature shifts (the fold's): rms's always; V's for a tensor that is not factored (R's and C's
      // come shifted in the tables).
      x[SFC_RMS_FEATURE] = __fmul_rn(x[SFC_RMS_FEATURE], f[SFC_FOLDED_SHIFTS]);
      if (!meta.factored) {
#pragma unroll
        for (int i = 1; i < SFC_SHIFTABLE_FEATURES; ++i)
          x[shiftable_feature(i)] = __fmul_rn(x[shiftable_feature(i)], f[SFC_FOLDED_SHIFTS + i]);
      }
      apply_update<kStreamed>(meta, index, param, update_from_mlp(generic_mlp(x, f, network), group), group);
    }
  }
};

// The same arguments as the tensor-core apply pass (the engine launches either alike): later_layers is
// the network buffer here (there the fold's layout of layers 2 and 3), and no packed entries are read.
extern "C" __global__ void __launch_bounds__(SFC_APPLY_THREADS)
small_fc_lopt_apply(const TensorMeta* __restrict__ tensors, const i64* __restrict__ gradients, int num_tensors,
                    const GroupMeta* __restrict__ groups,
                    int num_groups, i64 total_chunks, const float* __restrict__ folded,
                    const float* __restrict__ later_layers, const float* __restrict__ row_table,
                    const float* __restrict__ col_table, const float4* __restrict__ row_factors,
                    const float4* __restrict__ col_factors, const uint4* __restrict__ row_packed,
                    const uint4* __restrict__ col_packed, const float* __restrict__ clip_factors,
                    const float* grad_scale, const float* found_inf, int* status, i64* skipped_steps) {
  const GenericApply apply{folded, later_layers, TableInputs{row_table, col_table, nullptr, nullptr}, clip_factors};
  apply_pass(tensors, gradients, num_tensors, groups, num_groups, total_chunks, StepFlags{grad_scale, found_inf, status},
             skipped_steps, apply);
}
#endif  // SFC_TENSOR_CORES
