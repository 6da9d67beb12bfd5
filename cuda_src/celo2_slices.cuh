// CELO2's sliced tensors (celo2.cu's pass 8): the learned tensors of rank >= 3 whose small slices of their last two
// axes (a conv kernel's kh x kw) celo2_slices steps a slice per thread. Part of celo2.cu, included after its apply
// section: a slice's element runs the same element functions (features, the MLP's layers, the update) as the
// passes over matrices.

// ------------------------------------------------------------------------------------------
// Sliced tensors
// ------------------------------------------------------------------------------------------

#define C2_SLICE_THREADS 128
#define C2_SLICE_MAX LOPT_CELO2_SLICE_MAX

// The SliceWalk row whose slices include `slice`: the last with first_slice <= slice (rows ascend).
LOPT_DEVICE int slice_row(const SliceWalk* walk, int rows, i64 slice) {
  int low = 0, high = rows - 1;
  while (low < high) {
    const int mid = (low + high + 1) / 2;
    if (walk[mid].first_slice <= slice) low = mid;
    else high = mid - 1;
  }
  return low;
}

// reference: per_element_features of a sliced tensor's element, all 30 inputs in input order: the element's own
// (element_features) and its R and C entries' table features (R_k, C_k, rsqrt(R_k + 1e-8), rsqrt(C_k + 1e-8)).
LOPT_DEVICE void slice_element_features(const TensorMeta& t, i64 e, float grad, float param, const ElementState& s,
                                        const float* row_table, const float* col_table, float (&x)[C2_FEATURES]) {
  const FactorIndex f = factor_index(t, e);
  const FactorEntry row = read_factor_entry(row_table, t.row_table + f.row);
  const FactorEntry col = read_factor_entry(col_table, t.col_table + f.col);
  float own[C2_ELEMENT_FEATURES];
  element_features(grad, param, s, true, row, col, own);
#pragma unroll
  for (int i = 0; i < C2_ELEMENT_FEATURES; ++i) x[element_input(i)] = own[i];
#pragma unroll
  for (int k = 0; k < 3; ++k) {
    x[C2_TABLE_FIRST + k] = row.acc[k];
    x[C2_TABLE_FIRST + 3 + k] = col.acc[k];
    x[C2_TABLE_FIRST + 6 + k] = row.rsqrt_acc[k];
    x[C2_TABLE_FIRST + 9 + k] = col.rsqrt_acc[k];
  }
}

// One element of a sliced tensor: its gradient (clipped, clamped), its updated accumulators and its 30 features.
LOPT_DEVICE float slice_element(const TensorMeta& t, i64 e, float inverse_scale, float2 transform, const Decays& d,
                                const float* row_table, const float* col_table, float& param, ElementState& s,
                                float (&x)[C2_FEATURES]) {
  const float grad = step_gradient(load_element(t, e, inverse_scale, param, s), transform);
  update_accumulators(s, grad, d, true);
  slice_element_features(t, e, grad, param, s, row_table, col_table, x);
  return grad;
}

// A slice's shape: kRows x kCols where the kernel is built for one (the loops unrolled and the slice's arrays in
// registers), else (SliceShape<0, 0>) the walk row's, of at most C2_SLICE_MAX elements (the arrays in local memory).
template <int kRows, int kCols>
struct SliceShape {
  static constexpr bool kFixed = kRows > 0;
  static constexpr int kMax = kFixed ? kRows * kCols : C2_SLICE_MAX;  // (the arrays' length)
  static constexpr int kUnroll = kFixed ? kMax : 1;
  int rows, cols;
  LOPT_DEVICE SliceShape(i64 walk_rows, i64 walk_cols)
      : rows(kFixed ? kRows : static_cast<int>(walk_rows)), cols(kFixed ? kCols : static_cast<int>(walk_cols)) {}
  LOPT_DEVICE int count() const { return rows * cols; }
};

// out(i, j, Σ_k left(i, k)·right(k, j)) for the rows x cols result, each sum in index order (fmaf from 0): a slice's
// product as the reference's float32 products round; unrolled where the sizes are known at compile time.
template <class Left, class Right, class Out>
LOPT_DEVICE void index_order_product(int rows, int cols, int inner, Left left, Right right, Out out) {
#pragma unroll
  for (int i = 0; i < rows; ++i)
#pragma unroll
    for (int j = 0; j < cols; ++j) {
      float sum = 0.f;
#pragma unroll
      for (int k = 0; k < inner; ++k) sum = fmaf(left(i, k), right(k, j), sum);
      out(i, j, sum);
    }
}

// reference: newton_schulz of one matrix, `x` its rows x cols values in row-major order (already divided by its
// norm plus eps, a non-finite value as 0), in float32 as the reference's products round: a matrix with more rows
// than columns is iterated as its transpose; A = X Xᵀ, P = b·A + c·(A A), X ← a·X + P X, each product's sum in
// index order.
template <class Shape>
LOPT_DEVICE void slice_newton_schulz(float (&x)[Shape::kMax], const Shape shape, const double* values) {
  const int rows = shape.rows, cols = shape.cols;
  const bool transposed = rows > cols;
  const int m = transposed ? cols : rows, n = transposed ? rows : cols;  // (the wide orientation: m <= n)
  const float a = static_cast<float>(values[LOPT_CELO2_GROUP_NS_A]), b = static_cast<float>(values[LOPT_CELO2_GROUP_NS_B]);
  const float c = static_cast<float>(values[LOPT_CELO2_GROUP_NS_C]);
  const int steps = static_cast<int>(values[LOPT_CELO2_GROUP_NS_STEPS]);
  // X[i][j] of the wide orientation lies at x[i·cols + j], or at x[j·cols + i] for a transposed one
  auto at = [&](int i, int j) { return transposed ? j * cols + i : i * cols + j; };
  float gram[Shape::kMax], poly[Shape::kMax], next[Shape::kMax];  // (m x m <= kMax: m² <= m·n)
  for (int step = 0; step < steps; ++step) {
    index_order_product(m, m, n, [&](int i, int j) { return x[at(i, j)]; }, [&](int j, int l) { return x[at(l, j)]; },
                        [&](int i, int l, float sum) { gram[i * m + l] = sum; });
    index_order_product(m, m, m, [&](int i, int k) { return gram[i * m + k]; },
                        [&](int k, int l) { return gram[k * m + l]; }, [&](int i, int l, float sum) {
                          poly[i * m + l] = __fadd_rn(__fmul_rn(b, gram[i * m + l]), __fmul_rn(c, sum));
                        });
    index_order_product(m, n, m, [&](int i, int k) { return poly[i * m + k]; }, [&](int k, int j) { return x[at(k, j)]; },
                        [&](int i, int j, float sum) { next[at(i, j)] = __fadd_rn(__fmul_rn(a, x[at(i, j)]), sum); });
#pragma unroll
    for (int e = 0; e < Shape::kMax; ++e)
      if (e < m * n) x[e] = next[e];
  }
}

// One slice per thread of CELO2's sliced tensors (SliceWalk), a tensor of rank >= 3 whose slices of its last two
// axes (a conv kernel's kh x kw) are small and contiguous: every normalisation and Newton–Schulz runs per slice
// (reference learned_update over the last two axes), so a thread steps its slice whole, after the control phase
// (the factor tables, param_scale). Three walks over the slice's elements: the features' per-slice sums of
// squares (float64, finite values); the normalised features, the MLP (float32, inputs in input order) and the
// proposed step, the accumulators stored for a kept step; then Newton–Schulz (where the group orthogonalises: the
// slice divided by its norm plus ns_eps, non-finite values as 0 and keeping their own value), finish_step's
// normalisation, · rms_mult, and p ← p − lr·(u + weight_decay·p). R and C are committed by celo2_control.
// A slice of one element (a 1 x 1 conv's) is one walk: its features normalised by their own squares.
template <int kRows, int kCols>
LOPT_DEVICE void step_slices(const TensorMeta* __restrict__ tensors, const i64* __restrict__ gradients,
                             const GroupMeta* __restrict__ groups, const double* __restrict__ celo2_groups,
                             const float2* __restrict__ gradient_transforms, const float* __restrict__ row_table,
                             const float* __restrict__ col_table, const float* __restrict__ param_scales,
                             const Celo2Network& network, const SliceWalk* __restrict__ walk, int walk_rows,
                             i64 total_slices, const float* grad_scale, const float* found_inf, int* status) {
  using Shape = SliceShape<kRows, kCols>;
  constexpr bool kOneElement = Shape::kMax == 1;
  const i64 slice = static_cast<i64>(blockIdx.x) * C2_SLICE_THREADS + threadIdx.x;
  if (slice >= total_slices) return;
  const SliceWalk w = walk[slice_row(walk, walk_rows, slice)];
  const Shape shape(w.rows, w.cols);
  const int tensor = static_cast<int>(w.tensor), cols = shape.cols, count = shape.count();
  const TensorMeta t = tensor_row(tensors, gradients, tensor);
  const i64 s = slice - w.first_slice;
  const i64 base = (s / w.inner) * w.outer_stride + (s % w.inner) * w.inner_stride;
  // (element i = r·cols + c of the slice, at its memory index)
  auto element = [&](int i) { return base + (i / cols) * w.row_stride + (i % cols) * w.col_stride; };
  const StepFlags flags{grad_scale, found_inf, status};
  const bool keep = !step_is_skipped(flags);
  const float inverse_scale = inverse_grad_scale(flags);
  const float2 transform = gradient_transforms[tensor];
  const ApplyScalars group = read_apply_scalars(groups[t.group]);
  const double* values = group_values(celo2_groups, t.group);
  const bool param_scale_mult = values[LOPT_CELO2_GROUP_PARAM_SCALE_MULT] != 0.0;
  const float param_scale = param_scales[tensor];
  // the normalised features through the MLP: the proposed step
  auto proposed_step = [&](float (&x)[C2_FEATURES]) {
    float h[C2_HIDDEN];
    dense_layer<C2_FEATURES, C2_HIDDEN, true>(network.w, C2_MLP_W0, C2_MLP_B0, x, h);
    const float2 out = mlp_after_first_layer(h, network);
    float factor = expf(__fmul_rn(out.y, group.exp_mult));
    if (param_scale_mult) factor = __fmul_rn(param_scale, factor);
    return __fmul_rn(out.x, factor);
  };
  float step[Shape::kMax];
  float first_param;  // (a slice of one element: its parameter, read once)
  if constexpr (kOneElement) {
    // 1.–2. in one walk: each feature's sum of squares over the slice is its own square
    float x[C2_FEATURES];
    ElementState state;
    slice_element(t, element(0), inverse_scale, transform, group.decays, row_table, col_table, first_param, state, x);
    if (keep) store_element_state(t, element(0), state);
#pragma unroll
    for (int j = 0; j < C2_FEATURES; ++j) {
      const double square = is_finite(x[j]) ? static_cast<double>(x[j]) * static_cast<double>(x[j]) : 0.0;
      x[j] = normalised(x[j], square_sum_factors(square, 1));
    }
    step[0] = proposed_step(x);
  } else {
    // 1. the features' sums of squares over the slice, in shared memory (registers go to the element's features
    // and state), then in their place the features' factors
    __shared__ double slice_sums[C2_FEATURES][C2_SLICE_THREADS];
#pragma unroll
    for (int j = 0; j < C2_FEATURES; ++j) slice_sums[j][threadIdx.x] = 0.0;
#pragma unroll 1
    for (int i = 0; i < count; ++i) {  // (a walk not unrolled: its loads are the element's state)
      float param, x[C2_FEATURES];
      ElementState state;
      slice_element(t, element(i), inverse_scale, transform, group.decays, row_table, col_table, param, state, x);
#pragma unroll
      for (int j = 0; j < C2_FEATURES; ++j)
        if (is_finite(x[j]))
          slice_sums[j][threadIdx.x] = fma(static_cast<double>(x[j]), static_cast<double>(x[j]), slice_sums[j][threadIdx.x]);
    }
    float2* slice_factors = reinterpret_cast<float2*>(&slice_sums[0][0]);  // (factor j at slice_sums[j][thread])
#pragma unroll
    for (int j = 0; j < C2_FEATURES; ++j)
      slice_factors[j * C2_SLICE_THREADS + threadIdx.x] = square_sum_factors(slice_sums[j][threadIdx.x], count);
    // 2. the MLP and the proposed step
#pragma unroll 1
    for (int i = 0; i < count; ++i) {
      float param, x[C2_FEATURES];
      ElementState state;
      slice_element(t, element(i), inverse_scale, transform, group.decays, row_table, col_table, param, state, x);
      if (keep) store_element_state(t, element(i), state);
#pragma unroll
      for (int j = 0; j < C2_FEATURES; ++j) x[j] = normalised(x[j], slice_factors[j * C2_SLICE_THREADS + threadIdx.x]);
      step[i] = proposed_step(x);
    }
  }
  // 3. Newton–Schulz, finish_step, apply
  float u[Shape::kMax];
#pragma unroll Shape::kUnroll
  for (int i = 0; i < count; ++i) u[i] = step[i];
  if (values[LOPT_CELO2_GROUP_ORTHOGONALIZE] != 0.0) {
    double sum = 0.0;
#pragma unroll Shape::kUnroll
    for (int i = 0; i < count; ++i)
      if (is_finite(step[i])) sum = fma(static_cast<double>(step[i]), static_cast<double>(step[i]), sum);
    const float divisor = __fadd_rn(static_cast<float>(sqrt(sum)), static_cast<float>(values[LOPT_CELO2_GROUP_NS_EPS]));
#pragma unroll Shape::kUnroll
    for (int i = 0; i < count; ++i) u[i] = is_finite(step[i]) ? __fdiv_rn(step[i], divisor) : 0.f;
    slice_newton_schulz(u, shape, values);
#pragma unroll Shape::kUnroll
    for (int i = 0; i < count; ++i)
      if (!is_finite(step[i])) u[i] = step[i];
  }
  double sum = 0.0;
#pragma unroll Shape::kUnroll
  for (int i = 0; i < count; ++i)
    if (is_finite(u[i])) sum = fma(static_cast<double>(u[i]), static_cast<double>(u[i]), sum);
  const float2 scale = square_sum_factors(sum, count);
  const float rms_mult = static_cast<float>(values[LOPT_CELO2_GROUP_RMS_MULT]);
  if (!keep) return;
  const int param_dtype = static_cast<int>(t.param_dtype);
#pragma unroll Shape::kUnroll
  for (int i = 0; i < count; ++i) {
    const float param = kOneElement ? first_param : load_as_float(pointer<const void>(t.param), element(i), param_dtype);
    store_from_float(pointer<void>(t.param), element(i), param_dtype,
                     updated_param(param, __fmul_rn(normalised(u[i], scale), rms_mult), group));
  }
}

// celo2_slices for the slices of any shape (at most C2_SLICE_MAX elements); celo2_slices_1x1 and _3x3 for those of
// a 1 x 1 and a 3 x 3 conv kernel (lopt.fused.celo2.SLICE_KERNELS: which kernel takes which slices).
#define C2_SLICE_PARAMETERS                                                                                       \
  const TensorMeta* __restrict__ tensors, const i64* __restrict__ gradients, const GroupMeta* __restrict__ groups, \
      const double* __restrict__ celo2_groups, const float2* __restrict__ gradient_transforms,                   \
      const float* __restrict__ row_table, const float* __restrict__ col_table,                                  \
      const float* __restrict__ param_scales, const Celo2Network network, const SliceWalk* __restrict__ walk,    \
      int walk_rows, i64 total_slices, const float* grad_scale, const float* found_inf, int* status
#define C2_SLICE_ARGUMENTS                                                                                     \
  tensors, gradients, groups, celo2_groups, gradient_transforms, row_table, col_table, param_scales, network, \
      walk, walk_rows, total_slices, grad_scale, found_inf, status

extern "C" __global__ void __launch_bounds__(C2_SLICE_THREADS) celo2_slices(C2_SLICE_PARAMETERS) {
  step_slices<0, 0>(C2_SLICE_ARGUMENTS);
}
extern "C" __global__ void __launch_bounds__(C2_SLICE_THREADS) celo2_slices_1x1(C2_SLICE_PARAMETERS) {
  step_slices<1, 1>(C2_SLICE_ARGUMENTS);
}
extern "C" __global__ void __launch_bounds__(C2_SLICE_THREADS, 4) celo2_slices_3x3(C2_SLICE_PARAMETERS) {
  step_slices<3, 3>(C2_SLICE_ARGUMENTS);
}
