// Float32-accurate 32 x 32 layers on tensor cores, for per-element MLPs.
//
// Tensor cores multiply TF32 (11 significant bits) or BF16 (8) operands and accumulate in float32.
// Every operand x is split as x = hi + lo with hi = tf32(x) (round to nearest) and lo = x - hi
// (|lo| <= 2^-11 |x|, exact in float32), and
//
//     a . b  ~=  a_hi . b_hi  (TF32 product)  +  [a_lo | a_hi] . [b_hi ; b_lo]  (one BF16 product)
//
// The two correction terms are concatenated along k into a single BF16 MMA of twice the depth, so a
// k-step costs one TF32 and one BF16 instruction (3-product split TF32 needs three TF32 ones). The
// dropped a_lo b_lo term and the BF16 rounding of the small corrections leave an error of about
// 2^-19 of sum |a_k b_k|; BF16 keeps float32's exponent range, so no operand can overflow.
//
// Each warp multiplies its own 32 rows (two 16-row m-tiles) with mma.sync (sm_80 and newer), A
// fragments from registers, the B operand (the weights, LOPT_SPLIT_OPERAND_FLOATS floats = 8 KiB
// per layer, 2 KiB in mode 2) from shared memory in "fragment order": one float4 per lane, k-step and
// n-tile (mode 2: one uint2 per lane, n-tile and pair of k-steps).
// (Hopper's warpgroup MMA was tried for these 32-wide layers and was slower: docs/performance.md §2.)
#pragma once
#include "common.cuh"


// The precision the kernels are built for (the optimizer's `precision`, given by the engine as an NVRTC
// define): 0 "exact", the float32-accurate split above; 2 "fast", one BF16 product (a_hi, b_hi rounded
// to BF16, 16 k per instruction).
#ifndef LOPT_SPLIT_MODE
#define LOPT_SPLIT_MODE 0
#endif
#if LOPT_SPLIT_MODE != 0 && LOPT_SPLIT_MODE != 2
#error "LOPT_SPLIT_MODE is 0 (precision exact) or 2 (precision fast)"
#endif

// Floats of a 32 x 32 B operand: per k-step, n-tile and lane a float4 (the split's four words); in
// mode 2 per pair of k-steps, n-tile and lane the two BF16 pairs alone (a uint2), so that one
// conflict-free 64-bit load per n-tile feeds a 16-deep product (reading them out of the float4s
// cost four shared-memory wavefronts per 32-bit load).
#if LOPT_SPLIT_MODE == 2
#define LOPT_SPLIT_OPERAND_FLOATS (2 * 4 * 32 * 2)
#else
#define LOPT_SPLIT_OPERAND_FLOATS (4 * 4 * 32 * 4)
#endif
// Floats of half_split_layer_32x32's B operand (write_half_split_operand): per 16-deep step, n-tile and
// lane a uint4.
#define LOPT_HALF_SPLIT_OPERAND_FLOATS (2 * 4 * 32 * 4)

// x rounded to TF32 (10 explicit mantissa bits), to nearest with ties away from zero: what
// cvt.rna.tf32.f32 computes for every |x| < 2^128 (1 - 2^-12), in two integer instructions instead of
// that instruction's four (it also guards the overflow to infinity, which no input here comes near).
LOPT_DEVICE unsigned to_tf32(float x) { return (__float_as_uint(x) + 0x1000u) & 0xFFFFE000u; }

// x = hi + lo: hi rounded to TF32, lo the exact float32 remainder.
struct SplitValue {
  float hi, lo;
};
LOPT_DEVICE SplitValue split(float x) {
  const float hi = __uint_as_float(to_tf32(x));
  return SplitValue{hi, __fsub_rn(x, hi)};
}

// A thread's A fragment of one k-step (8 inputs) of a 16-row m-tile, from its four values
// a[0] = (g, t), a[1] = (g + 8, t), a[2] = (g, t + 4), a[3] = (g + 8, t + 4) (g = lane / 4,
// t = lane % 4): the TF32 fragment of a_hi, and the BF16 fragment of the 16-deep correction
// product, whose columns 2t, 2t + 1 hold a_lo at k = t, t + 4 and columns 2t + 8, 2t + 9 hold a_hi.
struct SplitFragment {
  unsigned hi[4];
  unsigned correction[4];
};
LOPT_DEVICE SplitFragment split_fragment(const float a[4]) {
  SplitValue v[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = split(a[i]);
  SplitFragment f;
#pragma unroll
  for (int i = 0; i < 4; ++i) f.hi[i] = __float_as_uint(v[i].hi);
  f.correction[0] = pack_bf16x2(v[0].lo, v[2].lo);  // row g
  f.correction[1] = pack_bf16x2(v[1].lo, v[3].lo);  // row g + 8
  f.correction[2] = pack_bf16x2(v[0].hi, v[2].hi);
  f.correction[3] = pack_bf16x2(v[1].hi, v[3].hi);
  return f;
}

// split_fragment of values as the MMA's A registers already hold them (x[i]: the float32 bits, in
// split_fragment's order): the TF32 product takes x itself, the tensor core dropping its low 13 bits (hi
// = x truncated to TF32), lo = x - hi is exact, |lo| < 2^-10 |x|, and the correction product's high
// words are x rounded to BF16. Against split_fragment, the rounding of hi costs no instructions (two
// fewer per value) and lo's BF16 error is at most 2^-19 of x instead of 2^-20.
LOPT_DEVICE SplitFragment truncated_split_fragment(const unsigned x[4]) {
  float lo[4], value[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    value[i] = __uint_as_float(x[i]);
    lo[i] = __fsub_rn(value[i], __uint_as_float(x[i] & 0xFFFFE000u));
  }
  SplitFragment f;
#pragma unroll
  for (int i = 0; i < 4; ++i) f.hi[i] = x[i];
  f.correction[0] = pack_bf16x2(lo[0], lo[2]);  // row g
  f.correction[1] = pack_bf16x2(lo[1], lo[3]);  // row g + 8
  f.correction[2] = pack_bf16x2(value[0], value[2]);
  f.correction[3] = pack_bf16x2(value[1], value[3]);
  return f;
}

// d = A B + c (c may be d itself) for one warp: mma.sync of the given shape and operand types, A and
// B fragments as 32-bit registers (4 and 2), float32 accumulators.
#define LOPT_MMA_F32(name, shape_and_types)                                                                     \
  LOPT_DEVICE void name(float d[4], const unsigned a[4], unsigned b0, unsigned b1, const float c[4]) {        \
    asm volatile("mma.sync.aligned." shape_and_types " {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};\n" \
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])                                            \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]),      \
                   "f"(c[2]), "f"(c[3]));                                                                     \
  }
LOPT_MMA_F32(mma_tf32_m16n8k8, "m16n8k8.row.col.f32.tf32.tf32.f32")
LOPT_MMA_F32(mma_bf16_m16n8k16, "m16n8k16.row.col.f32.bf16.bf16.f32")
LOPT_MMA_F32(mma_f16_m16n8k16, "m16n8k16.row.col.f32.f16.f16.f32")

// d = A B + c for one warp, 8 deep in BF16: A {row g, row g + 8} x k (2t, 2t + 1), B k (2t, 2t + 1) x column g.
LOPT_DEVICE void mma_bf16_m16n8k8(float d[4], const unsigned a[2], unsigned b, const float c[4]) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%8,%9,%10};\n"
               : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(b), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

// Four 8 x 8 matrices of 16-bit values from shared memory, in the MMA's fragment layout: lane l gives
// the address of row l % 8 of matrix l / 8, and receives in word i its row (l / 4) and columns
// 2 (l % 4), 2 (l % 4) + 1 of matrix i.
LOPT_DEVICE void load_matrices_x4(unsigned f[4], const void* row_address) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(row_address));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(f[0]), "=r"(f[1]), "=r"(f[2]), "=r"(f[3]) : "r"(address));
}

// The value a weight w stands for once write_split_operand has split it: tf32(w) + bf16(w - tf32(w))
// (mode 0), bf16(tf32(w)) (mode 2). A bias carried by constant-one inputs takes two:
// w, and the rest b - split_effective(b), which brings it to float32 accuracy.
LOPT_DEVICE float split_effective(float w) {
  const SplitValue v = split(w);
#if LOPT_SPLIT_MODE == 0
  return __fadd_rn(v.hi, __uint_as_float(pack_bf16x2(v.lo, 0.f) << 16));
#else
  return __uint_as_float(pack_bf16x2(v.hi, 0.f) << 16);
#endif
}

// B (k < 32, n < 32, given by weight(k, n)) in fragment order: for k-step j, n-tile c and lane,
// one float4 {tf32 b_hi(8j + t), tf32 b_hi(8j + t + 4), bf16x2 b_hi(those two), bf16x2 b_lo(those two)}
// of column n = 8c + g; in mode 2, for k-steps 2p and 2p + 1, n-tile c and lane, the uint2 of those
// two k-steps' bf16x2 b_hi (b_hi rounded to TF32, then to BF16, as the float4's third word).
template <typename Weight>
LOPT_DEVICE void write_split_operand(float* out, Weight weight, int thread, int num_threads) {
#if LOPT_SPLIT_MODE == 2
  for (int slot = thread; slot < 2 * 4 * 32; slot += num_threads) {
    const int lane = slot % 32, tile = slot / 32, p = tile / 4, c = tile % 4;
    const int g = lane / 4, t = lane % 4;
    unsigned pair[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int j = 2 * p + half;
      pair[half] = pack_bf16x2(split(weight(8 * j + t, 8 * c + g)).hi, split(weight(8 * j + t + 4, 8 * c + g)).hi);
    }
    reinterpret_cast<uint2*>(out)[slot] = make_uint2(pair[0], pair[1]);
  }
#else
  for (int slot = thread; slot < 4 * 4 * 32; slot += num_threads) {
    const int lane = slot % 32, tile = slot / 32, j = tile / 4, c = tile % 4;
    const int g = lane / 4, t = lane % 4;
    const SplitValue b0 = split(weight(8 * j + t, 8 * c + g)), b1 = split(weight(8 * j + t + 4, 8 * c + g));
    reinterpret_cast<uint4*>(out)[slot] = make_uint4(__float_as_uint(b0.hi), __float_as_uint(b1.hi),
                                                     pack_bf16x2(b0.hi, b1.hi), pack_bf16x2(b0.lo, b1.lo));
  }
#endif
}

// A layer's bias for the lane's columns 8c + 2t, 8c + 2t + 1, in the accumulator's order {row g, row g + 8}:
// the whole quad from a BiasQuads (no register copies: each m-tile's first product adds the same four
// registers), or zeros for a layer whose inputs carry its bias (nullptr: known when compiled, where a
// pointer to shared memory would be tested for null at run time).
struct BiasQuads {
  const float4* quads;  // [4c + t] = {b(8c + 2t), b(8c + 2t + 1), b(8c + 2t), b(8c + 2t + 1)}
};
// The quads of 32 biases, written by threads thread, thread + num_threads, ... of 16.
LOPT_DEVICE void write_bias_quads(float4* quads, const float* bias, int thread, int num_threads) {
  for (int i = thread; i < 16; i += num_threads) {
    const int c = i / 4, t = i % 4;
    const float first = bias[8 * c + 2 * t], second = bias[8 * c + 2 * t + 1];
    quads[i] = make_float4(first, second, first, second);
  }
}
LOPT_DEVICE float4 bias_fragment(BiasQuads bias, int c, int t) { return bias.quads[4 * c + t]; }
LOPT_DEVICE float4 bias_fragment(decltype(nullptr), int, int) { return make_float4(0.f, 0.f, 0.f, 0.f); }

#if LOPT_SPLIT_MODE == 2
// Mode 2's B operand as write_split_operand lays it out in shared memory: the lane's uint2 of n-tile
// c and k-step pair p, slot (4p + c) * 32 + lane. RegisterOperand holds the same in registers.
struct SharedOperand {
  const float* operand;
  int lane;
  LOPT_DEVICE uint2 operator()(int p, int c) const { return reinterpret_cast<const uint2*>(operand)[(p * 4 + c) * 32 + lane]; }
};
struct RegisterOperand {
  uint2 fragments[8];  // [4p + c]
  // (An opaque load: the compiler would otherwise re-read the shared copy at each use, as it may for
  // memory no thread writes again.)
  LOPT_DEVICE void load(const float* operand, int lane) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const unsigned address =
          static_cast<unsigned>(__cvta_generic_to_shared(reinterpret_cast<const uint2*>(operand) + i * 32 + lane));
      asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(fragments[i].x), "=r"(fragments[i].y) : "r"(address));
    }
  }
  LOPT_DEVICE uint2 operator()(int p, int c) const { return fragments[p * 4 + c]; }
};
LOPT_DEVICE SharedOperand operand_reader(const float* operand, int lane) { return SharedOperand{operand, lane}; }
LOPT_DEVICE const RegisterOperand& operand_reader(const RegisterOperand& operand, int) { return operand; }

// Mode 2's layer: acc[m][c] = bias + A_m B over 32 k as two 16-deep BF16 products (operand_source: the
// B operand, in shared memory or a RegisterOperand; bias: a BiasQuads, or nullptr (bias_fragment) for a
// layer whose inputs carry it, as the first layer's constant ones do); load_fragments(p, f) gives the
// thread's packed A fragments of k-steps 2p and 2p + 1 for both m-tiles: f[m] = {row g, row g + 8 of k-step
// 2p, then of k-step 2p + 1}, each word the pair (k = 8j + t, 8j + t + 4), the order of the B
// operand's uint2.
template <typename LoadFragments, typename Operand, typename Bias>
LOPT_DEVICE void bf16_layer_32x32(float acc[2][4][4], LoadFragments load_fragments, const Operand& operand_source,
                                  Bias bias, int lane) {
  const auto operand = operand_reader(operand_source, lane);
  const int t = lane % 4;
#pragma unroll
  for (int p = 0; p < 2; ++p) {
    unsigned f[2][4];
    load_fragments(p, f);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const uint2 b = operand(p, c);
      // (The bias as quads read at the first product measured the same as a pair read and copied in
      // registers: docs/performance.md §3.)
      const float4 quad = bias_fragment(bias, c, t);
      const float initial[4] = {quad.x, quad.y, quad.z, quad.w};
#pragma unroll
      for (int m = 0; m < 2; ++m) mma_bf16_m16n8k16(acc[m][c], f[m], b.x, b.y, p == 0 ? initial : acc[m][c]);
    }
  }
}
#endif

#if LOPT_SPLIT_MODE == 0
// ------------------------------------------------------------------------------------------
// A second float32-accurate split, for a layer whose inputs are the previous layer's accumulators:
// both parts in FP16 (11 significant bits each, 16 k per product where TF32 takes 8), so a 16-deep
// step costs three products where the TF32 split above takes four:
//
//     a . b  ~=  fp16(a_lo) . fp16(b_hi)  +  fp16(a_hi) . fp16(b_lo)  +  fp16(a_hi) . fp16(b_hi)
//
// (hi = fp16(x), lo = x - hi exact in float32, then rounded to FP16.) The error is about 2^-21 of
// sum |a_k b_k|: the dropped a_lo b_lo and the roundings of the remainders are each below 2^-22 of it
// (|a_lo| < 2^-10 |a|, the inputs' hi being rounded toward zero; |b_lo| <= 2^-12 |b|). Below FP16's
// normal range (2^-14) a value keeps an absolute error of at most 2^-25: a remainder does for inputs
// under ~2^-4 and weights under 2^-2, which is at most 2^-25 (sum |a_k| + sum |b_k|) per unit, a
// fraction of 2^-20 of the sums a layer of these sizes forms. (Against BF16 remainders, whose range
// is float32's, this split is more accurate on the tests' sequence, takes one conversion fewer per
// input pair and 16 bytes of B per lane and step instead of 24, and measured faster:
// docs/performance.md §2.) FP16's range is the price: an input must stay below 65504. The caller
// scales the layer's inputs by 2^-e and its weights by 2^e (exact) so that they do (small_fc_lopt's
// layer2_exponent); the conversions saturate rather than overflow. (The tensor cores multiply FP16
// subnormals as they are: zeroing them first measured the same.)
// ------------------------------------------------------------------------------------------

LOPT_DEVICE float2 unpack_f16x2(unsigned packed) {
  float2 v;
  asm("{.reg .f16 l, h; mov.b32 {l, h}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, h;}" : "=f"(v.x), "=f"(v.y) : "r"(packed));
  return v;
}

// One input pair (first, second) = (x(k), x(k + 1)) after the ReLU, as the three products take it.
struct HalfSplitPair {
  unsigned hi;  // f16x2 of hi (the factor of b_hi and of b_lo)
  unsigned lo;  // f16x2 of lo = x - hi
};
// The ReLU rides on the conversions: hi is rounded toward zero, so lo = x - hi >= 0 wherever x >= 0,
// and where x < 0 (hi = 0, lo = x) the conversion's ReLU zeroes lo (two instructions fewer per pair
// than a ReLU first and hi to nearest, and measured faster; the price, |lo| < 2^-10 |x| instead of
// 2^-11, made the update errors slightly larger: docs/performance.md §2).
LOPT_DEVICE HalfSplitPair half_split_relu(float first, float second) {
  const unsigned hi = pack_f16x2_relu_toward_zero(first, second);
  const float2 h = unpack_f16x2(hi);
  return HalfSplitPair{hi, pack_f16x2_relu_satfinite(__fsub_rn(first, h.x), __fsub_rn(second, h.y))};
}

// B (k < 32, n < 32, given by weight(k, n)) for half_split_layer_32x32: for 16-deep step p, n-tile c and
// lane (slot (4p + c) * 32 + lane), column n = 8c + g, rows k = 16p + 2t, +1 and 16p + 2t + 8, +9: a
// uint4 {f16x2 hi, f16x2 hi, f16x2 lo, f16x2 lo} (LOPT_HALF_SPLIT_OPERAND_FLOATS in all).
static_assert(LOPT_HALF_SPLIT_OPERAND_FLOATS <= LOPT_SPLIT_OPERAND_FLOATS, "fits a split operand's space");
template <typename Weight>
LOPT_DEVICE void write_half_split_operand(float* out, Weight weight, int thread, int num_threads) {
  for (int slot = thread; slot < 2 * 4 * 32; slot += num_threads) {
    const int lane = slot % 32, tile = slot / 32, p = tile / 4, c = tile % 4;
    const int g = lane / 4, t = lane % 4, n = 8 * c + g;
    unsigned hi[2], lo[2];
#pragma unroll
    for (int w = 0; w < 2; ++w) {
      const int k = 16 * p + 2 * t + 8 * w;
      const float b0 = weight(k, n), b1 = weight(k + 1, n);
      hi[w] = pack_f16x2_satfinite(b0, b1);
      const float2 h = unpack_f16x2(hi[w]);
      lo[w] = pack_f16x2_satfinite(__fsub_rn(b0, h.x), __fsub_rn(b1, h.y));
    }
    reinterpret_cast<uint4*>(out)[slot] = make_uint4(hi[0], hi[1], lo[0], lo[1]);
  }
}

// acc[m][c] = bias + relu(in_m) B over 32 k, in_m the accumulators of a previous 32 x 32 layer
// (in[m][c]: rows g, g + 8 at columns 8c + 2t, 8c + 2t + 1): the A fragment of 16-deep step p is
// columns 16p ... 16p + 15 of `in` in place (in[m][2p] and in[m][2p + 1]), no data moves between
// threads. Small terms first: a_lo b_hi, a_hi b_lo, then a_hi b_hi.
template <typename Bias>
LOPT_DEVICE void half_split_layer_32x32(float acc[2][4][4], const float in[2][4][4], const float* operand, Bias bias,
                                        int lane) {
  const int t = lane % 4;
  const uint4* parts = reinterpret_cast<const uint4*>(operand);
#pragma unroll
  for (int p = 0; p < 2; ++p) {
    unsigned hi[2][4], lo[2][4];
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // a0: row g of 2p, a1: row g + 8 of 2p, a2, a3: the same of 2p + 1
        const float* v = &in[m][2 * p + i / 2][2 * (i % 2)];
        const HalfSplitPair pair = half_split_relu(v[0], v[1]);
        hi[m][i] = pair.hi; lo[m][i] = pair.lo;
      }
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const uint4 b = parts[(p * 4 + c) * 32 + lane];  // {hi, hi, lo, lo}
      float4 quad = make_float4(0.f, 0.f, 0.f, 0.f);
      if (p == 0) quad = bias_fragment(bias, c, t);
      const float initial[4] = {quad.x, quad.y, quad.z, quad.w};
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        mma_f16_m16n8k16(acc[m][c], lo[m], b.x, b.y, p == 0 ? initial : acc[m][c]);
        mma_f16_m16n8k16(acc[m][c], hi[m], b.z, b.w, acc[m][c]);
        mma_f16_m16n8k16(acc[m][c], hi[m], b.x, b.y, acc[m][c]);
      }
    }
  }
}
#endif

// acc[m][c] = bias + A_m B over 32 k for a warp's two m-tiles (mode 0); load_fragments(j, f)
// gives the thread's split A fragments of k-step j for both m-tiles (truncated_split_fragment). The
// bias (bias_fragment: BiasQuads, or nullptr where the inputs carry it)
// enters as the first product's addend. Each B fragment is read from shared memory once for both m-tiles.
// (Steps < 4: only the first Steps k-steps, the rest of the inputs being carried by the bias.)
template <int Steps = 4, typename LoadFragments, typename Bias>
LOPT_DEVICE void split_layer_32x32(float acc[2][4][4], LoadFragments load_fragments, const float* operand, Bias bias,
                                   int lane) {
  const int t = lane % 4;
#pragma unroll
  for (int j = 0; j < Steps; ++j) {
    SplitFragment f[2];
    load_fragments(j, f);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const uint4 b = reinterpret_cast<const uint4*>(operand)[(j * 4 + c) * 32 + lane];
      float4 quad = make_float4(0.f, 0.f, 0.f, 0.f);
      if (j == 0) quad = bias_fragment(bias, c, t);
      const float initial[4] = {quad.x, quad.y, quad.z, quad.w};
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        mma_bf16_m16n8k16(acc[m][c], f[m].correction, b.z, b.w, j == 0 ? initial : acc[m][c]);  // small terms first
        mma_tf32_m16n8k8(acc[m][c], f[m].hi, b.x, b.y, acc[m][c]);
      }
    }
  }
}


