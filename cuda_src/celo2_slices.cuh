// CELO2's sliced tensors (celo2.cu's pass 8): the learned tensors of rank >= 3 whose small slices of their last two
// axes (a conv kernel's kh x kw) the slice kernels step whole: a slice per thread (celo2_slices_1x1, _3x3), a slice per
// warp (celo2_slices, any other shape). Part of celo2.cu, included after its apply
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

// The normalised features through the MLP: the proposed step (direction · exp(exp_mult · magnitude), · param_scale
// where the group multiplies by it).
LOPT_DEVICE float slice_proposed_step(float (&x)[C2_FEATURES], const Celo2Network& network, float exp_mult,
                                      bool param_scale_mult, float param_scale) {
  float h[C2_HIDDEN];
  dense_layer<C2_FEATURES, C2_HIDDEN, true>(network.w, C2_MLP_W0, C2_MLP_B0, x, h);
  const float2 out = mlp_after_first_layer(h, network);
  float factor = expf(__fmul_rn(out.y, exp_mult));
  if (param_scale_mult) factor = __fmul_rn(param_scale, factor);
  return __fmul_rn(out.x, factor);
}

// Each finite feature's square added to its float64 sum, sum(j).
template <class Sum>
LOPT_DEVICE void add_feature_squares(const float (&x)[C2_FEATURES], Sum sum) {
#pragma unroll
  for (int j = 0; j < C2_FEATURES; ++j) add_finite_square(sum(j), x[j]);
}

// The slice kernels' parameters (celo2_slices, _1x1, _3x3 and the functions they run).
#define C2_SLICE_PARAMETERS                                                                                       \
  const TensorMeta* __restrict__ tensors, const i64* __restrict__ gradients, const GroupMeta* __restrict__ groups, \
      const double* __restrict__ celo2_groups, const float2* __restrict__ gradient_transforms,                   \
      const float* __restrict__ row_table, const float* __restrict__ col_table,                                  \
      const float* __restrict__ param_scales, const Celo2Network network, const SliceWalk* __restrict__ walk,    \
      int walk_rows, i64 total_slices, const float* grad_scale, const float* found_inf, int* status
#define C2_SLICE_ARGUMENTS                                                                                     \
  tensors, gradients, groups, celo2_groups, gradient_transforms, row_table, col_table, param_scales, network, \
      walk, walk_rows, total_slices, grad_scale, found_inf, status

// What stepping one slice reads once: its walk row and tensor, where its first element lies, the step's flags and
// its group's scalars.
struct SliceContext {
  SliceWalk w;
  int tensor;
  TensorMeta t;
  i64 base;
  bool keep;
  float inverse_scale;
  float2 transform;
  ApplyScalars group;
  const double* values;
  bool param_scale_mult;
  float param_scale;
  LOPT_DEVICE SliceContext(const TensorMeta* tensors, const i64* gradients, const GroupMeta* groups,
                           const double* celo2_groups, const float2* gradient_transforms, const float* param_scales,
                           const SliceWalk* walk, int walk_rows, i64 slice, const StepFlags& flags)
      : w(walk[slice_row(walk, walk_rows, slice)]), tensor(static_cast<int>(w.tensor)),
        t(tensor_row(tensors, gradients, tensor)),
        base(((slice - w.first_slice) / w.inner) * w.outer_stride + ((slice - w.first_slice) % w.inner) * w.inner_stride),
        keep(!step_is_skipped(flags)), inverse_scale(inverse_grad_scale(flags)), transform(gradient_transforms[tensor]),
        group(read_apply_scalars(groups[t.group])), values(group_values(celo2_groups, t.group)),
        param_scale_mult(values[LOPT_CELO2_GROUP_PARAM_SCALE_MULT] != 0.0), param_scale(param_scales[tensor]) {}
  // element i = r·cols + c of the slice, at its memory index
  LOPT_DEVICE i64 element(int i, int cols) const { return base + (i / cols) * w.row_stride + (i % cols) * w.col_stride; }
  // element e's gradient, updated accumulators and 30 features (slice_element)
  LOPT_DEVICE void features(i64 e, const float* row_table, const float* col_table, float& param, ElementState& s,
                            float (&x)[C2_FEATURES]) const {
    slice_element(t, e, inverse_scale, transform, group.decays, row_table, col_table, param, s, x);
  }
  LOPT_DEVICE float proposed_step(float (&x)[C2_FEATURES], const Celo2Network& network) const {
    return slice_proposed_step(x, network, group.exp_mult, param_scale_mult, param_scale);
  }
};

// A slice's shape, kRows x kCols, known at compile time: the loops unrolled and the slice's arrays in registers
// (celo2_slices_1x1, _3x3; the other shapes go to step_slice_by_warp).
template <int kRows, int kCols>
struct SliceShape {
  static constexpr int kMax = kRows * kCols;  // (the arrays' length)
  static constexpr int kUnroll = kMax;
  int rows = kRows, cols = kCols;
  LOPT_DEVICE int count() const { return kMax; }
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

// newton_schulz_steps' `product`s (function objects: NVRTC compiles no lambda with `auto` parameters as device code).
// A thread's slice: index_order_product on its own arrays.
struct ThreadProduct {
  template <class Left, class Right, class Out>
  LOPT_DEVICE void operator()(int rows, int cols, int inner, Left left, Right right, Out out) const {
    index_order_product(rows, cols, inner, left, right, out);
  }
};

// A warp's slice in shared memory: entry e = lane, lane + 32, ... of the result, each sum over k in index order.
struct WarpProduct {
  int lane;
  template <class Left, class Right, class Out>
  LOPT_DEVICE void operator()(int rows, int cols, int inner, Left left, Right right, Out out) const {
    for (int e = lane; e < rows * cols; e += 32) {
      const int i = e / cols, j = e % cols;
      float sum = 0.f;
      for (int k = 0; k < inner; ++k) sum = fmaf(left(i, k), right(k, j), sum);
      out(i, j, sum);
    }
    __syncwarp();
  }
};

// reference: newton_schulz's iterations on one matrix, `x` its rows x cols values in row-major order (already divided
// by its norm plus eps, a non-finite value as 0), in float32 as the reference's products round: a matrix with more
// rows than columns is iterated as its transpose; A = X Xᵀ, P = b·A + c·(A A), X ← a·X + P X. `gram`, `poly` and
// `next` hold m x m, m x m and m x n values; `product` forms each product (index_order_product's contract: each
// entry's sum in index order) and `copy_next` moves `next` into `x`: a thread's arrays, or a warp's shared ones.
template <class Values, class Product, class CopyNext>
LOPT_DEVICE void newton_schulz_steps(Values& x, Values& gram, Values& poly, Values& next, int rows, int cols,
                                     const double* values, Product product, CopyNext copy_next) {
  const bool transposed = rows > cols;
  const int m = transposed ? cols : rows, n = transposed ? rows : cols;  // (the wide orientation: m <= n)
  const float a = static_cast<float>(values[LOPT_CELO2_GROUP_NS_A]), b = static_cast<float>(values[LOPT_CELO2_GROUP_NS_B]);
  const float c = static_cast<float>(values[LOPT_CELO2_GROUP_NS_C]);
  const int steps = static_cast<int>(values[LOPT_CELO2_GROUP_NS_STEPS]);
  // X[i][j] of the wide orientation lies at x[i·cols + j], or at x[j·cols + i] for a transposed one
  auto at = [&](int i, int j) { return transposed ? j * cols + i : i * cols + j; };
  for (int step = 0; step < steps; ++step) {
    product(m, m, n, [&](int i, int j) { return x[at(i, j)]; }, [&](int j, int l) { return x[at(l, j)]; },
            [&](int i, int l, float sum) { gram[i * m + l] = sum; });
    product(m, m, m, [&](int i, int k) { return gram[i * m + k]; }, [&](int k, int l) { return gram[k * m + l]; },
            [&](int i, int l, float sum) { poly[i * m + l] = __fadd_rn(__fmul_rn(b, gram[i * m + l]), __fmul_rn(c, sum)); });
    product(m, n, m, [&](int i, int k) { return poly[i * m + k]; }, [&](int k, int j) { return x[at(k, j)]; },
            [&](int i, int j, float sum) { next[at(i, j)] = __fadd_rn(__fmul_rn(a, x[at(i, j)]), sum); });
    copy_next();
  }
}

// A thread's slice of a compile-time shape: newton_schulz_steps on its arrays, the loops unrolled.
template <class Shape>
LOPT_DEVICE void slice_newton_schulz(float (&x)[Shape::kMax], const Shape shape, const double* values) {
  float gram[Shape::kMax], poly[Shape::kMax], next[Shape::kMax];  // (m x m <= kMax: m² <= m·n)
  newton_schulz_steps(x, gram, poly, next, shape.rows, shape.cols, values, ThreadProduct{}, [&] {
#pragma unroll
    for (int e = 0; e < Shape::kMax; ++e) x[e] = next[e];
  });
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
LOPT_DEVICE void step_slices(C2_SLICE_PARAMETERS) {
  using Shape = SliceShape<kRows, kCols>;
  constexpr bool kOneElement = Shape::kMax == 1;
  const i64 slice = static_cast<i64>(blockIdx.x) * C2_SLICE_THREADS + threadIdx.x;
  if (slice >= total_slices) return;
  const Shape shape;
  const int cols = shape.cols, count = shape.count();
  const SliceContext c(tensors, gradients, groups, celo2_groups, gradient_transforms, param_scales, walk, walk_rows,
                       slice, StepFlags{grad_scale, found_inf, status});
  const TensorMeta& t = c.t;
  const ApplyScalars& group = c.group;
  const double* values = c.values;
  const bool keep = c.keep;
  auto element = [&](int i) { return c.element(i, cols); };
  auto proposed_step = [&](float (&x)[C2_FEATURES]) { return c.proposed_step(x, network); };
  float step[Shape::kMax];
  float first_param;  // (a slice of one element: its parameter, read once)
  if constexpr (kOneElement) {
    // 1.–2. in one walk: each feature's sum of squares over the slice is its own square
    float x[C2_FEATURES];
    ElementState state;
    c.features(element(0), row_table, col_table, first_param, state, x);
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
      c.features(element(i), row_table, col_table, param, state, x);
      add_feature_squares(x, [&](int j) -> double& { return slice_sums[j][threadIdx.x]; });
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
      c.features(element(i), row_table, col_table, param, state, x);
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
      add_finite_square(sum, step[i]);
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
    add_finite_square(sum, u[i]);
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

// The slices of any other shape (at most C2_SLICE_MAX elements: a 5 x 5 or 7 x 7 kernel's, a 3-d tensor's) are few
// and long, so a warp steps each: lane l takes the slice's elements l and l + 32. The features' float64 sums are
// the lanes' sums added across the warp (a tree, not index order: float64 rounding only); the proposed step, the
// slice for Newton–Schulz and its products lie in shared memory, each product's entries dealt to the lanes and each
// entry's sum in index order, as the thread-per-slice kernels form them; the divisor and finish_step's sum, in
// index order, every lane alike.
#define C2_SLICE_WARPS (C2_SLICE_THREADS / 32)
LOPT_DEVICE void step_slice_by_warp(C2_SLICE_PARAMETERS) {
  __shared__ float slice_step[C2_SLICE_WARPS][C2_SLICE_MAX], slice_x[C2_SLICE_WARPS][C2_SLICE_MAX];
  __shared__ float slice_gram[C2_SLICE_WARPS][C2_SLICE_MAX], slice_poly[C2_SLICE_WARPS][C2_SLICE_MAX];
  __shared__ float slice_next[C2_SLICE_WARPS][C2_SLICE_MAX];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const i64 slice = static_cast<i64>(blockIdx.x) * C2_SLICE_WARPS + warp;
  if (slice >= total_slices) return;  // (the whole warp)
  const SliceContext c(tensors, gradients, groups, celo2_groups, gradient_transforms, param_scales, walk, walk_rows,
                       slice, StepFlags{grad_scale, found_inf, status});
  const int rows = static_cast<int>(c.w.rows), cols = static_cast<int>(c.w.cols), count = rows * cols;
  const TensorMeta& t = c.t;
  const ApplyScalars& group = c.group;
  const double* values = c.values;
  const bool keep = c.keep;
  auto element = [&](int i) { return c.element(i, cols); };
  float* step = slice_step[warp];
  float* x = slice_x[warp];
  // 1. the features' sums of squares: each lane's elements, then across the warp
  double sums[C2_FEATURES];
#pragma unroll
  for (int j = 0; j < C2_FEATURES; ++j) sums[j] = 0.0;
  for (int i = lane; i < count; i += 32) {
    float param, features[C2_FEATURES];
    ElementState state;
    c.features(element(i), row_table, col_table, param, state, features);
    add_feature_squares(features, [&](int j) -> double& { return sums[j]; });
  }
  float2 factors[C2_FEATURES];
#pragma unroll
  for (int j = 0; j < C2_FEATURES; ++j) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) sums[j] += __shfl_xor_sync(0xffffffffu, sums[j], offset);
    factors[j] = square_sum_factors(sums[j], count);
  }
  // 2. the MLP and the proposed step
  for (int i = lane; i < count; i += 32) {
    float param, features[C2_FEATURES];
    ElementState state;
    c.features(element(i), row_table, col_table, param, state, features);
    if (keep) store_element_state(t, element(i), state);
#pragma unroll
    for (int j = 0; j < C2_FEATURES; ++j) features[j] = normalised(features[j], factors[j]);
    step[i] = c.proposed_step(features, network);
  }
  __syncwarp();
  // 3. Newton–Schulz (its products' entries dealt to the lanes), finish_step, apply
  for (int i = lane; i < count; i += 32) x[i] = step[i];
  __syncwarp();
  if (values[LOPT_CELO2_GROUP_ORTHOGONALIZE] != 0.0) {
    double sum = 0.0;
    for (int i = 0; i < count; ++i)
      add_finite_square(sum, step[i]);
    const float divisor = __fadd_rn(static_cast<float>(sqrt(sum)), static_cast<float>(values[LOPT_CELO2_GROUP_NS_EPS]));
    for (int i = lane; i < count; i += 32) x[i] = is_finite(step[i]) ? __fdiv_rn(step[i], divisor) : 0.f;
    float* gram = slice_gram[warp];
    float* poly = slice_poly[warp];
    float* next = slice_next[warp];
    __syncwarp();
    newton_schulz_steps(x, gram, poly, next, rows, cols, values, WarpProduct{lane}, [&] {
      for (int e = lane; e < count; e += 32) x[e] = next[e];
      __syncwarp();
    });
    for (int i = lane; i < count; i += 32)
      if (!is_finite(step[i])) x[i] = step[i];
    __syncwarp();
  }
  double sum = 0.0;
  for (int i = 0; i < count; ++i)
    add_finite_square(sum, x[i]);
  const float2 scale = square_sum_factors(sum, count);
  const float rms_mult = static_cast<float>(values[LOPT_CELO2_GROUP_RMS_MULT]);
  if (!keep) return;
  const int param_dtype = static_cast<int>(t.param_dtype);
  for (int i = lane; i < count; i += 32) {
    const float param = load_as_float(pointer<const void>(t.param), element(i), param_dtype);
    store_from_float(pointer<void>(t.param), element(i), param_dtype,
                     updated_param(param, __fmul_rn(normalised(x[i], scale), rms_mult), group));
  }
}

// celo2_slices for the slices of any shape (at most C2_SLICE_MAX elements); celo2_slices_1x1 and _3x3 for those of
// a 1 x 1 and a 3 x 3 conv kernel (lopt.fused.celo2.SLICE_KERNELS: which kernel takes which slices).
extern "C" __global__ void __launch_bounds__(C2_SLICE_THREADS) celo2_slices(C2_SLICE_PARAMETERS) {
  step_slice_by_warp(C2_SLICE_ARGUMENTS);
}
extern "C" __global__ void __launch_bounds__(C2_SLICE_THREADS) celo2_slices_1x1(C2_SLICE_PARAMETERS) {
  step_slices<1, 1>(C2_SLICE_ARGUMENTS);
}
extern "C" __global__ void __launch_bounds__(C2_SLICE_THREADS, 4) celo2_slices_3x3(C2_SLICE_PARAMETERS) {
  step_slices<3, 3>(C2_SLICE_ARGUMENTS);
}
