// Adafactor accumulators of factored tensors, shared by small_fc_lopt and VeLO
// (reference: lopt/reference/accumulators.py, update_adafactor and adafactor_factors).
//
// R_k <- beta_k R_k + (1 - beta_k) mean_{d0}(g^2 + 1e-30),  C_k <- ... mean_{d1}(...), then
// row_factor_k = safe_rsqrt(R_k / (mean of R_k over the d1 axis + 1e-9)), col_factor_k = safe_rsqrt(C_k).
//
// Three launches for all factored tensors of a group, deterministic (fixed-order two-level sums,
// no atomics):
//   adafactor_axis_partials  sums of g^2 + 1e-30 over chunks of one axis        (reads g once per axis)
//   adafactor_finalize       sums the partials in order, updates R and C; advances the step counter
//   adafactor_factor_tables  row_col_mean per slab of R, then the per-entry factor tables
#pragma once
#include "lopt_common.cuh"

// One reduction job: out[q*I + i] = sum_x in[(q*X + x)*I + i], over chunks of x.
// mode 0 ("strided", I > 1): a thread per output column, a block covers 256 columns x one x-chunk.
// mode 1 ("contiguous", I == 1): a warp per (q, x-chunk), 8 per block.
struct AxisJob {
  i64 src, dtype, q, x, i, mode, first_block, num_xchunks, xchunk, partial_offset, dest, num_outputs,
      first_output, num_col_blocks;
};
#define LOPT_AXIS_FIELD_FIRST_BLOCK 6
#define LOPT_AXIS_FIELD_FIRST_OUTPUT 12
#define LOPT_AXIS_THREADS 256

LOPT_DEVICE float adafactor_square(float g) { return __fadd_rn(__fmul_rn(g, g), 1e-30f); }

extern "C" __global__ void __launch_bounds__(LOPT_AXIS_THREADS)
adafactor_axis_partials(const AxisJob* __restrict__ jobs, int num_jobs, float* __restrict__ partials) {
  const AxisJob job = jobs[find_row<LOPT_AXIS_FIELD_FIRST_BLOCK>(jobs, num_jobs, blockIdx.x)];
  const i64 local_block = blockIdx.x - job.first_block;
  const void* src = reinterpret_cast<const void*>(job.src);
  const int dtype = static_cast<int>(job.dtype);
  if (job.mode == 0) {
    const i64 col_block = local_block % job.num_col_blocks, chunk = local_block / job.num_col_blocks;
    const i64 out = col_block * LOPT_AXIS_THREADS + threadIdx.x;
    if (out >= job.num_outputs) return;
    const i64 q = out / job.i, i = out - q * job.i;
    const i64 x0 = chunk * job.xchunk, x1 = min(x0 + job.xchunk, job.x);
    float sum = 0.f;
    for (i64 x = x0; x < x1; ++x) sum += adafactor_square(load_as_float(src, (q * job.x + x) * job.i + i, dtype));
    partials[job.partial_offset + chunk * job.num_outputs + out] = sum;
  } else {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const i64 item = local_block * (LOPT_AXIS_THREADS / 32) + warp;
    if (item >= job.q * job.num_xchunks) return;
    const i64 q = item / job.num_xchunks, chunk = item - q * job.num_xchunks;
    const i64 x0 = chunk * job.xchunk, x1 = min(x0 + job.xchunk, job.x);
    float sum = 0.f;
    for (i64 x = x0 + lane; x < x1; x += 32) sum += adafactor_square(load_as_float(src, q * job.x + x, dtype));
    sum = warp_sum(sum);
    if (lane == 0) partials[job.partial_offset + chunk * job.num_outputs + q] = sum;
  }
}

// A thread per R or C entry: mean = (sum of its partials, in chunk order) / X, then the EMA.
// Thread 0 also advances the group's step counter (nothing in this launch reads it; every
// later launch of the step sees the new value).
extern "C" __global__ void adafactor_finalize(const AxisJob* __restrict__ jobs, int num_jobs, i64 total_outputs,
                                             const float* __restrict__ partials, const float* __restrict__ constants,
                                             i64* step_counter) {
  const i64 gid = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (gid == 0 && step_counter != nullptr) *step_counter += 1;
  if (gid >= total_outputs || num_jobs == 0) return;
  const AxisJob job = jobs[find_row<LOPT_AXIS_FIELD_FIRST_OUTPUT>(jobs, num_jobs, gid)];
  const i64 out = gid - job.first_output;
  double sum = 0.0;
  for (i64 c = 0; c < job.num_xchunks; ++c) sum += partials[job.partial_offset + c * job.num_outputs + out];
  const float mean = static_cast<float>(sum / static_cast<double>(job.x));
  const Decays decays = read_decays(constants);
  float* acc = reinterpret_cast<float*>(job.dest) + out * 3;
#pragma unroll
  for (int k = 0; k < 3; ++k) acc[k] = ema(acc[k], decays.adafactor[k], decays.adafactor_mix[k], mean);
}

// Blocks [0, total_slabs): one slab of R each (the entries sharing everything but the d1
// coordinate): row_col_mean_k over the slab, then the slab's row-table entries.
// Blocks after that: a thread per C entry, the column-table entries.
#define LOPT_TABLE_THREADS 256
extern "C" __global__ void __launch_bounds__(LOPT_TABLE_THREADS)
adafactor_factor_tables(const TensorMeta* __restrict__ tensors, int num_tensors, i64 total_slabs,
                        i64 total_col_entries, float* __restrict__ row_table, float* __restrict__ col_table) {
  if (blockIdx.x < total_slabs) {
    const TensorMeta t = tensors[find_row<LOPT_FIELD_FIRST_SLAB>(tensors, num_tensors, blockIdx.x)];
    const i64 slab = blockIdx.x - t.first_slab;
    // R as (Q', X', I') with X' the d1 axis: d0 = A leaves (o, m, b, i); d0 = B leaves (o, a, m, i).
    const i64 x_len = t.d0_is_a ? t.b : t.a;
    const i64 i_len = t.d0_is_a ? t.inner : t.mid * t.inner;
    const i64 q = slab / i_len, i = slab - q * i_len;
    const float* row = reinterpret_cast<const float*>(t.fac_row);
    double partial[3] = {0.0, 0.0, 0.0};
    for (i64 x = threadIdx.x; x < x_len; x += LOPT_TABLE_THREADS) {
      const i64 entry = (q * x_len + x) * i_len + i;
#pragma unroll
      for (int k = 0; k < 3; ++k) partial[k] += row[entry * 3 + k];
    }
    __shared__ double warp_sums[LOPT_TABLE_THREADS / 32][3];
    __shared__ float row_col_mean[3];
#pragma unroll
    for (int k = 0; k < 3; ++k) {
      const double s = warp_sum(partial[k]);
      if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5][k] = s;
    }
    __syncthreads();
    if (threadIdx.x < 3) {
      double s = 0.0;
      for (int w = 0; w < LOPT_TABLE_THREADS / 32; ++w) s += warp_sums[w][threadIdx.x];
      row_col_mean[threadIdx.x] = static_cast<float>(s / static_cast<double>(x_len));
    }
    __syncthreads();
    for (i64 x = threadIdx.x; x < x_len; x += LOPT_TABLE_THREADS) {
      const i64 entry = (q * x_len + x) * i_len + i;
      float acc[3], factor[3];
#pragma unroll
      for (int k = 0; k < 3; ++k) {
        acc[k] = row[entry * 3 + k];
        factor[k] = safe_rsqrt(__fdiv_rn(acc[k], __fadd_rn(row_col_mean[k], 1e-9f)));
      }
      write_factor_entry(row_table, t.row_table + entry, acc, factor);
    }
  } else {
    const i64 gid = (static_cast<i64>(blockIdx.x) - total_slabs) * LOPT_TABLE_THREADS + threadIdx.x;
    if (gid >= total_col_entries) return;
    const TensorMeta t = tensors[find_row<LOPT_FIELD_FIRST_COL_ENTRY>(tensors, num_tensors, gid)];
    const i64 entry = gid - t.first_col_entry;
    const float* col = reinterpret_cast<const float*>(t.fac_col);
    float acc[3], factor[3];
#pragma unroll
    for (int k = 0; k < 3; ++k) {
      acc[k] = col[entry * 3 + k];
      factor[k] = safe_rsqrt(acc[k]);
    }
    write_factor_entry(col_table, t.col_table + entry, acc, factor);
  }
}
