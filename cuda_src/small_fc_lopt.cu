// small_fc_lopt, fused: the same steps as lopt/reference/small_fc_lopt.py, for every tensor of a
// parameter group in a constant number of launches (lopt/fused/small_fc_lopt.py drives them):
//
//   adafactor_axis_partials, adafactor_finalize, adafactor_factor_tables   (adafactor.cuh)
//   small_fc_lopt_feature_stats   update_accumulators + per_element_features, sums of squares per chunk
//   small_fc_lopt_fold            normalise_features and time_features folded into the first layer
//   small_fc_lopt_apply<E>        update_accumulators + per_element_features + mlp + apply_update
//
// The statistics pass recomputes the updated accumulators without storing them; the apply pass
// recomputes them with the same code and stores them, so both passes see identical features.
#include "lopt_common.cuh"
#include "adafactor.cuh"

#define SFC_NUM_FEATURES 28
#define SFC_NUM_TIME_FEATURES 11
#define SFC_INPUTS 39
#define SFC_HIDDEN 32

// Constants buffer (lopt.fused.small_fc_lopt.pack_constants): decays, then the network.
#define SFC_W1 LOPT_DECAYS_FLOATS                        // (32, 39) out x in
#define SFC_B1 (SFC_W1 + SFC_HIDDEN * SFC_INPUTS)        // (32,)
#define SFC_W2 (SFC_B1 + SFC_HIDDEN)                     // (32, 32)
#define SFC_B2 (SFC_W2 + SFC_HIDDEN * SFC_HIDDEN)        // (32,)
#define SFC_W3 (SFC_B2 + SFC_HIDDEN)                     // (2, 32)
#define SFC_B3 (SFC_W3 + 2 * SFC_HIDDEN)                 // (2,)
#define SFC_CONSTANTS (SFC_B3 + 2)

// Folded first layer per tensor: W1' transposed (feature-major, 28 x 32) then b1' (32).
#define SFC_FOLDED (SFC_NUM_FEATURES * SFC_HIDDEN + SFC_HIDDEN)

#define LOPT_STATS_THREADS 256
#define LOPT_STATS_PER_THREAD 32
#define LOPT_STATS_CHUNK (LOPT_STATS_THREADS * LOPT_STATS_PER_THREAD)
#ifndef SFC_APPLY_THREADS
#define SFC_APPLY_THREADS 128
#endif

__constant__ float SFC_TIMESCALES[SFC_NUM_TIME_FEATURES] = {1.f, 3.f, 10.f, 30.f, 100.f, 300.f, 1000.f,
                                                          3000.f, 10000.f, 30000.f, 100000.f};

// Per-element accumulator state, as loaded from and stored to the state tensors.
struct ElementState {
  float mom[3];
  float rms;
  float full[3];  // non-factored Adafactor accumulator V (unused for factored tensors)
};

LOPT_DEVICE ElementState load_element_state(const TensorMeta& t, i64 e) {
  ElementState s;
  const float* mom = reinterpret_cast<const float*>(t.mom) + e * 3;
  s.mom[0] = mom[0]; s.mom[1] = mom[1]; s.mom[2] = mom[2];
  s.rms = reinterpret_cast<const float*>(t.rms)[e];
  if (!t.factored) {
    const float* full = reinterpret_cast<const float*>(t.fac_full) + e * 3;
    s.full[0] = full[0]; s.full[1] = full[1]; s.full[2] = full[2];
  } else {
    s.full[0] = s.full[1] = s.full[2] = 0.f;
  }
  return s;
}

LOPT_DEVICE void store_element_state(const TensorMeta& t, i64 e, const ElementState& s) {
  float* mom = reinterpret_cast<float*>(t.mom) + e * 3;
  mom[0] = s.mom[0]; mom[1] = s.mom[1]; mom[2] = s.mom[2];
  reinterpret_cast<float*>(t.rms)[e] = s.rms;
  if (!t.factored) {
    float* full = reinterpret_cast<float*>(t.fac_full) + e * 3;
    full[0] = s.full[0]; full[1] = s.full[1]; full[2] = s.full[2];
  }
}

// reference: update_accumulators (momentum, rms; V for non-factored tensors; R and C were
// updated by adafactor_finalize).
LOPT_DEVICE void update_accumulators(ElementState& s, float grad, const Decays& d, bool factored) {
#pragma unroll
  for (int k = 0; k < 3; ++k) s.mom[k] = ema(s.mom[k], d.momentum[k], d.momentum_mix[k], grad);
  s.rms = ema(s.rms, d.rms, d.rms_mix, __fmul_rn(grad, grad));
  if (!factored) {
#pragma unroll
    for (int k = 0; k < 3; ++k) s.full[k] = ema(s.full[k], d.adafactor[k], d.adafactor_mix[k], adafactor_square(grad));
  }
}

// reference: per_element_features (§3.5), the 28 features in input order.
LOPT_DEVICE void per_element_features(float x[SFC_NUM_FEATURES], float grad, float param, const ElementState& s,
                                      bool factored, const FactorEntry& row, const FactorEntry& col) {
  const float rsqrt_rms = rsqrtf(__fadd_rn(s.rms, 1e-6f));
  x[0] = grad;
  x[1] = param;
#pragma unroll
  for (int k = 0; k < 3; ++k) {
    x[2 + k] = s.mom[k];
    x[6 + k] = __fmul_rn(s.mom[k], rsqrt_rms);
  }
  x[5] = s.rms;
  x[9] = rsqrt_rms;
  if (factored) {
#pragma unroll
    for (int k = 0; k < 3; ++k) {
      x[10 + k] = __fmul_rn(__fmul_rn(grad, row.factor[k]), col.factor[k]);  // factored_grad
      x[13 + k] = row.acc[k];
      x[16 + k] = col.acc[k];
      x[19 + k] = row.rsqrt_acc[k];
      x[22 + k] = col.rsqrt_acc[k];
      x[25 + k] = __fmul_rn(__fmul_rn(s.mom[k], row.factor[k]), col.factor[k]);  // factored_momentum
    }
  } else {
#pragma unroll
    for (int k = 0; k < 3; ++k) {
      const float rsqrt_full = rsqrtf(__fadd_rn(s.full[k], 1e-8f));
      x[10 + k] = __fmul_rn(grad, safe_rsqrt(__fadd_rn(s.full[k], 1e-9f)));
      x[13 + k] = s.full[k];
      x[16 + k] = s.full[k];
      x[19 + k] = rsqrt_full;
      x[22 + k] = rsqrt_full;
      x[25 + k] = __fmul_rn(s.mom[k], rsqrtf(__fadd_rn(s.full[k], 1e-6f)));
    }
  }
}

// Loads one element's inputs, updates its accumulators (in `s`) and computes its features.
LOPT_DEVICE void element_features(const TensorMeta& t, i64 e, const Decays& decays, const float* row_table,
                                  const float* col_table, float x[SFC_NUM_FEATURES], ElementState& s, float& param) {
  const float grad = load_as_float(reinterpret_cast<const void*>(t.grad), e, static_cast<int>(t.grad_dtype));
  param = load_as_float(reinterpret_cast<const void*>(t.param), e, static_cast<int>(t.param_dtype));
  s = load_element_state(t, e);
  const bool factored = t.factored != 0;
  update_accumulators(s, grad, decays, factored);
  FactorEntry row, col;
  if (factored) {
    const FactorIndex f = factor_index(t, e);
    row = read_factor_entry(row_table, t.row_table + f.row);
    col = read_factor_entry(col_table, t.col_table + f.col);
  }
  per_element_features(x, grad, param, s, factored, row, col);
}

// ------------------------------------------------------------------------------------------
// Statistics pass: per chunk of LOPT_STATS_CHUNK elements, the 28 sums of squared features
// (float per thread, double across threads, fixed order).
// ------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(LOPT_STATS_THREADS)
small_fc_lopt_feature_stats(const TensorMeta* __restrict__ tensors, int num_tensors, const float* __restrict__ constants,
                            const float* __restrict__ row_table, const float* __restrict__ col_table,
                            double* __restrict__ stats_partials) {
  const TensorMeta t = tensors[find_row<LOPT_FIELD_FIRST_STATS_CHUNK>(tensors, num_tensors, blockIdx.x)];
  const i64 chunk = blockIdx.x - t.first_stats_chunk;
  const Decays decays = read_decays(constants);
  float squares[SFC_NUM_FEATURES];
#pragma unroll
  for (int j = 0; j < SFC_NUM_FEATURES; ++j) squares[j] = 0.f;
  for (int r = 0; r < LOPT_STATS_PER_THREAD; ++r) {
    const i64 e = chunk * LOPT_STATS_CHUNK + r * LOPT_STATS_THREADS + threadIdx.x;
    if (e >= t.numel) break;
    float x[SFC_NUM_FEATURES], param;
    ElementState s;
    element_features(t, e, decays, row_table, col_table, x, s, param);
#pragma unroll
    for (int j = 0; j < SFC_NUM_FEATURES; ++j) squares[j] = fmaf(x[j], x[j], squares[j]);
  }
  __shared__ double warp_sums[LOPT_STATS_THREADS / 32][SFC_NUM_FEATURES];
#pragma unroll
  for (int j = 0; j < SFC_NUM_FEATURES; ++j) {
    const double s = warp_sum(static_cast<double>(squares[j]));
    if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5][j] = s;
  }
  __syncthreads();
  if (threadIdx.x < SFC_NUM_FEATURES) {
    double s = 0.0;
    for (int w = 0; w < LOPT_STATS_THREADS / 32; ++w) s += warp_sums[w][threadIdx.x];
    stats_partials[static_cast<i64>(blockIdx.x) * SFC_NUM_FEATURES + threadIdx.x] = s;
  }
}

// ------------------------------------------------------------------------------------------
// Fold: one block per tensor. normalise_features' scales go into the columns of W1 and the 11
// time features (constant over the tensor) into its bias: h1 = relu(W1' x_raw + b1').
// ------------------------------------------------------------------------------------------
#define SFC_FOLD_THREADS 256
#define SFC_FOLD_LANES 8  // partial sums per feature
extern "C" __global__ void __launch_bounds__(SFC_FOLD_THREADS)
small_fc_lopt_fold(const TensorMeta* __restrict__ tensors, const double* __restrict__ stats_partials,
                   const float* __restrict__ constants, const i64* __restrict__ step_counter, float* __restrict__ folded) {
  const TensorMeta t = tensors[blockIdx.x];
  __shared__ double lane_sums[SFC_NUM_FEATURES][SFC_FOLD_LANES];
  __shared__ float scale[SFC_NUM_FEATURES];
  __shared__ float time[SFC_NUM_TIME_FEATURES];
  const int tid = threadIdx.x;
  if (tid < SFC_NUM_FEATURES * SFC_FOLD_LANES) {
    const int feature = tid / SFC_FOLD_LANES, lane = tid % SFC_FOLD_LANES;
    double s = 0.0;
    for (i64 c = lane; c < t.num_stats_chunks; c += SFC_FOLD_LANES)
      s += stats_partials[(t.first_stats_chunk + c) * SFC_NUM_FEATURES + feature];
    lane_sums[feature][lane] = s;
  }
  if (tid < SFC_NUM_TIME_FEATURES) {
    // time_features: tanh(tau / T_i - 1), tau = steps taken before this one.
    const float tau = static_cast<float>(*step_counter - 1);
    time[tid] = tanhf(__fsub_rn(__fdiv_rn(tau, SFC_TIMESCALES[tid]), 1.0f));
  }
  __syncthreads();
  if (tid < SFC_NUM_FEATURES) {
    double s = 0.0;
    for (int lane = 0; lane < SFC_FOLD_LANES; ++lane) s += lane_sums[tid][lane];
    const float mean_square = static_cast<float>(s / static_cast<double>(t.numel));
    scale[tid] = rsqrtf(__fadd_rn(1e-5f, mean_square));
  }
  __syncthreads();
  float* out = folded + static_cast<i64>(blockIdx.x) * SFC_FOLDED;
  const float* w1 = constants + SFC_W1;
  for (int k = tid; k < SFC_NUM_FEATURES * SFC_HIDDEN; k += SFC_FOLD_THREADS) {
    const int feature = k / SFC_HIDDEN, hidden = k % SFC_HIDDEN;
    out[k] = __fmul_rn(w1[hidden * SFC_INPUTS + feature], scale[feature]);
  }
  if (tid < SFC_HIDDEN) {
    float bias = constants[SFC_B1 + tid];
    for (int j = 0; j < SFC_NUM_TIME_FEATURES; ++j) bias = fmaf(w1[tid * SFC_INPUTS + SFC_NUM_FEATURES + j], time[j], bias);
    out[SFC_NUM_FEATURES * SFC_HIDDEN + tid] = bias;
  }
}

// ------------------------------------------------------------------------------------------
// Apply: each thread runs the MLP for E elements at once, so every weight read from shared
// memory (a broadcast float4) feeds 4*E fused multiply-adds. Blocks take contiguous ranges of
// chunks and reload the folded first layer only when they cross into another tensor.
// ------------------------------------------------------------------------------------------
template <int E>
__global__ void __launch_bounds__(SFC_APPLY_THREADS)
small_fc_lopt_apply(const TensorMeta* __restrict__ tensors, int num_tensors, i64 total_chunks,
                    const float* __restrict__ constants, const float* __restrict__ folded,
                    const float* __restrict__ row_table, const float* __restrict__ col_table,
                    float neg_lr, float neg_weight_decay_lr, float exp_mult, float step_mult) {
  __shared__ __align__(16) float w1t[SFC_NUM_FEATURES * SFC_HIDDEN];
  __shared__ __align__(16) float b1[SFC_HIDDEN];
  __shared__ __align__(16) float w2[SFC_HIDDEN * SFC_HIDDEN];
  __shared__ float b2[SFC_HIDDEN], w3[2 * SFC_HIDDEN], b3[2];
  __shared__ TensorMeta meta;
  for (int k = threadIdx.x; k < SFC_HIDDEN * SFC_HIDDEN; k += SFC_APPLY_THREADS) w2[k] = constants[SFC_W2 + k];
  for (int k = threadIdx.x; k < 2 * SFC_HIDDEN; k += SFC_APPLY_THREADS) w3[k] = constants[SFC_W3 + k];
  if (threadIdx.x < SFC_HIDDEN) b2[threadIdx.x] = constants[SFC_B2 + threadIdx.x];
  if (threadIdx.x < 2) b3[threadIdx.x] = constants[SFC_B3 + threadIdx.x];
  const Decays decays = read_decays(constants);

  const i64 chunk_begin = total_chunks * blockIdx.x / gridDim.x;
  const i64 chunk_end = total_chunks * (blockIdx.x + 1) / gridDim.x;
  int current = -1;
  for (i64 chunk = chunk_begin; chunk < chunk_end; ++chunk) {
    const int tensor = find_row<LOPT_FIELD_FIRST_APPLY_CHUNK>(tensors, num_tensors, chunk);
    if (tensor != current) {
      __syncthreads();  // everyone is done with the previous tensor's weights
      const float* f = folded + static_cast<i64>(tensor) * SFC_FOLDED;
      for (int k = threadIdx.x; k < SFC_NUM_FEATURES * SFC_HIDDEN; k += SFC_APPLY_THREADS) w1t[k] = f[k];
      if (threadIdx.x < SFC_HIDDEN) b1[threadIdx.x] = f[SFC_NUM_FEATURES * SFC_HIDDEN + threadIdx.x];
      if (threadIdx.x == 0) meta = tensors[tensor];
      __syncthreads();
      current = tensor;
    }
    const i64 base = (chunk - meta.first_apply_chunk) * (SFC_APPLY_THREADS * E) + threadIdx.x;

    float x[E][SFC_NUM_FEATURES];
    float param[E];
    ElementState state[E];
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const i64 index = base + e * SFC_APPLY_THREADS;
      if (index < meta.numel) {
        element_features(meta, index, decays, row_table, col_table, x[e], state[e], param[e]);
      } else {
#pragma unroll
        for (int j = 0; j < SFC_NUM_FEATURES; ++j) x[e][j] = 0.f;
        param[e] = 0.f;
      }
    }

    // mlp, layer 1: h1 = relu(W1' x + b1'), as outer products over the features.
    float h1[SFC_HIDDEN][E];
#pragma unroll
    for (int i = 0; i < SFC_HIDDEN; ++i)
#pragma unroll
      for (int e = 0; e < E; ++e) h1[i][e] = b1[i];
#pragma unroll
    for (int j = 0; j < SFC_NUM_FEATURES; ++j) {
#pragma unroll
      for (int i4 = 0; i4 < SFC_HIDDEN / 4; ++i4) {
        const float4 w = *reinterpret_cast<const float4*>(&w1t[j * SFC_HIDDEN + i4 * 4]);
#pragma unroll
        for (int e = 0; e < E; ++e) {
          h1[i4 * 4 + 0][e] = fmaf(w.x, x[e][j], h1[i4 * 4 + 0][e]);
          h1[i4 * 4 + 1][e] = fmaf(w.y, x[e][j], h1[i4 * 4 + 1][e]);
          h1[i4 * 4 + 2][e] = fmaf(w.z, x[e][j], h1[i4 * 4 + 2][e]);
          h1[i4 * 4 + 3][e] = fmaf(w.w, x[e][j], h1[i4 * 4 + 3][e]);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < SFC_HIDDEN; ++i)
#pragma unroll
      for (int e = 0; e < E; ++e) h1[i][e] = fmaxf(h1[i][e], 0.f);

    // layers 2 and 3 together: each hidden unit of layer 2 goes straight into the two outputs.
    float direction[E], magnitude[E];
#pragma unroll
    for (int e = 0; e < E; ++e) { direction[e] = 0.f; magnitude[e] = 0.f; }
#pragma unroll 4
    for (int n = 0; n < SFC_HIDDEN; ++n) {
      float acc[E];
#pragma unroll
      for (int e = 0; e < E; ++e) acc[e] = b2[n];
#pragma unroll
      for (int i4 = 0; i4 < SFC_HIDDEN / 4; ++i4) {
        const float4 w = *reinterpret_cast<const float4*>(&w2[n * SFC_HIDDEN + i4 * 4]);
#pragma unroll
        for (int e = 0; e < E; ++e) {
          acc[e] = fmaf(w.x, h1[i4 * 4 + 0][e], acc[e]);
          acc[e] = fmaf(w.y, h1[i4 * 4 + 1][e], acc[e]);
          acc[e] = fmaf(w.z, h1[i4 * 4 + 2][e], acc[e]);
          acc[e] = fmaf(w.w, h1[i4 * 4 + 3][e], acc[e]);
        }
      }
      const float w_direction = w3[n], w_magnitude = w3[SFC_HIDDEN + n];
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const float h2 = fmaxf(acc[e], 0.f);
        direction[e] = fmaf(w_direction, h2, direction[e]);
        magnitude[e] = fmaf(w_magnitude, h2, magnitude[e]);
      }
    }

    // update_from_mlp and apply_update.
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const i64 index = base + e * SFC_APPLY_THREADS;
      if (index >= meta.numel) continue;
      const float d = __fadd_rn(direction[e], b3[0]);
      const float m = __fadd_rn(magnitude[e], b3[1]);
      const float update = __fmul_rn(__fmul_rn(d, expf(__fmul_rn(m, exp_mult))), step_mult);
      float new_param = __fadd_rn(param[e], __fmul_rn(neg_lr, update));
      if (neg_weight_decay_lr != 0.f) new_param = __fadd_rn(new_param, __fmul_rn(neg_weight_decay_lr, new_param));
      store_from_float(reinterpret_cast<void*>(meta.param), index, static_cast<int>(meta.param_dtype), new_param);
      store_element_state(meta, index, state[e]);
    }
  }
}

// The elements-per-thread variants the launcher may pick (lopt.fused.small_fc_lopt.APPLY_VARIANTS).
template __global__ void small_fc_lopt_apply<1>(const TensorMeta*, int, i64, const float*, const float*, const float*,
                                                const float*, float, float, float, float);
template __global__ void small_fc_lopt_apply<2>(const TensorMeta*, int, i64, const float*, const float*, const float*,
                                                const float*, float, float, float, float);
template __global__ void small_fc_lopt_apply<4>(const TensorMeta*, int, i64, const float*, const float*, const float*,
                                                const float*, float, float, float, float);
