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
// Two implementations of the same layer, chosen at compile time:
//   * mma.sync (sm_80+): each warp multiplies its own two 16-row m-tiles; B operands in shared
//     memory in "fragment order" (one float4 per lane, k-step and n-tile).
//   * wgmma (sm_90a): the 4 warps of a warpgroup issue each product together (64 rows, one m-tile of
//     each warp); B operands in shared memory in the canonical no-swizzle K-major layout, read by
//     the tensor cores directly. Needs the kernel's block to be one warpgroup.
// Either way a layer's B operand takes LOPT_SPLIT_OPERAND_FLOATS floats (8 KiB), and the rows and
// accumulators a warp holds have the same layout, so callers do not see which one runs.
#pragma once
#include "lopt_common.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL) && !defined(LOPT_NO_WGMMA)
#define LOPT_SPLIT_WGMMA 1
#else
#define LOPT_SPLIT_WGMMA 0
#endif

#define LOPT_SPLIT_OPERAND_FLOATS (4 * 4 * 32 * 4)  // a 32 x 32 B operand, either layout

LOPT_DEVICE unsigned to_tf32(float x) {
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}

// Two floats rounded to BF16 and packed: `first` in the low half (the lower k index of a fragment).
LOPT_DEVICE unsigned pack_bf16x2(float first, float second) {
  unsigned packed;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(second), "f"(first));
  return packed;
}

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

// k index (0..7, within the k-step) that column c (0..15) of the correction product multiplies:
// columns 2t and 2t + 1 are k = t and t + 4 (a_lo against b_hi), columns 8.. repeat with a_hi, b_lo.
LOPT_DEVICE constexpr int correction_k(int c) { return (c % 8) / 2 + 4 * (c % 2); }

#if !LOPT_SPLIT_WGMMA
// ------------------------------------------------------------------------------------------
// mma.sync
// ------------------------------------------------------------------------------------------
LOPT_DEVICE void mma_tf32_m16n8k8(float d[4], const unsigned a[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

LOPT_DEVICE void mma_bf16_m16n8k16(float d[4], const unsigned a[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// B (k < 32, n < 32, given by weight(k, n)) in fragment order: for k-step j, n-tile c and lane,
// one float4 {tf32 b_hi(8j + t), tf32 b_hi(8j + t + 4), bf16x2 b_hi(those two), bf16x2 b_lo(those two)}
// of column n = 8c + g.
template <typename Weight>
LOPT_DEVICE void write_split_operand(float* out, Weight weight, int thread, int num_threads) {
  for (int slot = thread; slot < 4 * 4 * 32; slot += num_threads) {
    const int lane = slot % 32, tile = slot / 32, j = tile / 4, c = tile % 4;
    const int g = lane / 4, t = lane % 4;
    const SplitValue b0 = split(weight(8 * j + t, 8 * c + g)), b1 = split(weight(8 * j + t + 4, 8 * c + g));
    reinterpret_cast<uint4*>(out)[slot] = make_uint4(__float_as_uint(b0.hi), __float_as_uint(b1.hi),
                                                     pack_bf16x2(b0.hi, b1.hi), pack_bf16x2(b0.lo, b1.lo));
  }
}

LOPT_DEVICE void split_operand_stores_done() {}

// acc[m][c] += A_m B over 32 k for a warp's two m-tiles; load_a(j, a) gives the thread's A values
// of k-step j for both m-tiles. Each B fragment is read from shared memory once for both m-tiles.
template <typename LoadA>
LOPT_DEVICE void split_layer_32x32(float acc[2][4][4], LoadA load_a, const float* operand, int lane) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    float a[2][4];
    load_a(j, a);
    SplitFragment f[2];
#pragma unroll
    for (int m = 0; m < 2; ++m) f[m] = split_fragment(a[m]);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const uint4 b = reinterpret_cast<const uint4*>(operand)[(j * 4 + c) * 32 + lane];
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        mma_bf16_m16n8k16(acc[m][c], f[m].correction, b.z, b.w);  // the small terms first
        mma_tf32_m16n8k8(acc[m][c], f[m].hi, b.x, b.y);
      }
    }
  }
}

#else
// ------------------------------------------------------------------------------------------
// wgmma (sm_90a)
// ------------------------------------------------------------------------------------------
// Products into one accumulator are ordered by the hardware only when they have the same shape;
// a TF32 (k8) and a BF16 (k16) product into the same registers would be serialised. So either all
// three products are TF32 (LOPT_WGMMA_BF16_CORRECTION 0: a_lo b_hi + a_hi b_lo + a_hi b_hi, one
// accumulator, also more accurate), or the BF16 corrections go into an accumulator of their own,
// added at the end (1: fewer tensor-core cycles, 32 more registers).
#ifndef LOPT_WGMMA_BF16_CORRECTION
#define LOPT_WGMMA_BF16_CORRECTION 0
#endif
// Operand layout, per k-step j (2 KiB): TF32 B_hi (32 n x 8 k), then the correction operand:
// TF32 B_lo (32 n x 8 k), or the BF16 [B_hi ; B_lo] (32 n x 16 k). Each K-major without swizzle:
// 8 x 16-byte "core matrices" (8 n-rows of 16 bytes); the core matrix of n-group q and 16-byte
// k-slice h sits at (2q + h) * 128 bytes.
#define LOPT_WGMMA_LEADING_BYTES 128  // between the two k-slices of an n-group
#define LOPT_WGMMA_STRIDE_BYTES 256   // between n-groups

template <typename Weight>
LOPT_DEVICE void write_split_operand(float* out, Weight weight, int thread, int num_threads) {
  for (int slot = thread; slot < 4 * 4 * 32; slot += num_threads) {  // one 16-byte core-matrix row each
    const int j = slot / 128, within = slot % 128, correction = within / 64;
    const int core = (within % 64) / 8, q = core / 2, h = core % 2, n = 8 * q + within % 8;
    unsigned packed[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      if (!correction) {  // k = 8j + 4h + u
        packed[u] = to_tf32(weight(8 * j + 4 * h + u, n));
      } else if (!LOPT_WGMMA_BF16_CORRECTION) {
        packed[u] = to_tf32(split(weight(8 * j + 4 * h + u, n)).lo);
      } else {  // columns 8h + 2u, 8h + 2u + 1 of the correction product: b_hi for h = 0, b_lo for h = 1
        const SplitValue first = split(weight(8 * j + correction_k(2 * u), n));
        const SplitValue second = split(weight(8 * j + correction_k(2 * u + 1), n));
        packed[u] = h == 0 ? pack_bf16x2(first.hi, second.hi) : pack_bf16x2(first.lo, second.lo);
      }
    }
    reinterpret_cast<uint4*>(out)[slot] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  }
}

// Shared memory written by ordinary stores is read by the tensor cores through the async proxy:
// each writing thread fences before the barrier that publishes the operand.
LOPT_DEVICE void split_operand_stores_done() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

LOPT_DEVICE unsigned long long operand_descriptor(const void* shared) {
  const unsigned long long address = static_cast<unsigned long long>(__cvta_generic_to_shared(shared));
  return ((address & 0x3FFFF) >> 4) | (static_cast<unsigned long long>(LOPT_WGMMA_LEADING_BYTES >> 4) << 16) |
         (static_cast<unsigned long long>(LOPT_WGMMA_STRIDE_BYTES >> 4) << 32);  // swizzle bits 62-63: none
}

// Keeps the compiler from moving accumulator reads or writes across the asynchronous MMAs.
LOPT_DEVICE void pin_accumulators(float acc[4][4]) {
#pragma unroll
  for (int c = 0; c < 4; ++c)
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+f"(acc[c][i])::"memory");
}

#define LOPT_WGMMA_D16(acc)                                                                                        \
  "+f"(acc[0][0]), "+f"(acc[0][1]), "+f"(acc[0][2]), "+f"(acc[0][3]), "+f"(acc[1][0]), "+f"(acc[1][1]),          \
      "+f"(acc[1][2]), "+f"(acc[1][3]), "+f"(acc[2][0]), "+f"(acc[2][1]), "+f"(acc[2][2]), "+f"(acc[2][3]),      \
      "+f"(acc[3][0]), "+f"(acc[3][1]), "+f"(acc[3][2]), "+f"(acc[3][3])

// acc (this warp's 16 rows x 32 columns, as four m16n8 accumulator tiles) += A B, k = 8.
LOPT_DEVICE void wgmma_tf32_m64n32k8(float acc[4][4], const unsigned a[4], unsigned long long b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n32k8.f32.tf32.tf32 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20, 1, 1, 1;\n"
      : LOPT_WGMMA_D16(acc)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// The same with BF16 operands, k = 16 (B K-major: not transposed).
LOPT_DEVICE void wgmma_bf16_m64n32k16(float acc[4][4], const unsigned a[4], unsigned long long b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20, 1, 1, 1, 0;\n"
      : LOPT_WGMMA_D16(acc)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// acc[m] += A_m B over 32 k. Called by all 128 threads of the warpgroup together. Each k-step's
// products go out as one group while the next k-step's A fragments are formed; at most two
// groups are in flight, so only two k-steps' fragments are held in registers.
template <typename LoadA>
LOPT_DEVICE void split_layer_32x32(float acc[2][4][4], LoadA load_a, const float* operand, int /*lane*/) {
  const unsigned long long base = operand_descriptor(operand);
#if LOPT_WGMMA_BF16_CORRECTION
  float correction[2][4][4];
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int c = 0; c < 4; ++c)
#pragma unroll
      for (int i = 0; i < 4; ++i) correction[m][c][i] = 0.f;
#pragma unroll
  for (int m = 0; m < 2; ++m) pin_accumulators(correction[m]);
#endif
#pragma unroll
  for (int m = 0; m < 2; ++m) pin_accumulators(acc[m]);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    float a[2][4];
    load_a(j, a);
    // Descriptor addresses count 16-byte units: k-step j's operands start j * 2048 and j * 2048 + 1024 bytes in.
    const unsigned long long b_hi = base + (j * 2048 >> 4), b_correction = base + ((j * 2048 + 1024) >> 4);
#if LOPT_WGMMA_BF16_CORRECTION
    SplitFragment f[2];
#pragma unroll
    for (int m = 0; m < 2; ++m) f[m] = split_fragment(a[m]);
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");  // this k-step's A fragments are written
#pragma unroll
    for (int m = 0; m < 2; ++m) {
      wgmma_bf16_m64n32k16(correction[m], f[m].correction, b_correction);
      wgmma_tf32_m64n32k8(acc[m], f[m].hi, b_hi);
    }
#else
    unsigned hi[2][4], lo[2][4];
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const SplitValue v = split(a[m][i]);
        hi[m][i] = __float_as_uint(v.hi);
        lo[m][i] = to_tf32(v.lo);
      }
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");  // this k-step's A fragments are written
#pragma unroll
    for (int m = 0; m < 2; ++m) {  // the small terms first
      wgmma_tf32_m64n32k8(acc[m], lo[m], b_hi);
      wgmma_tf32_m64n32k8(acc[m], hi[m], b_correction);
      wgmma_tf32_m64n32k8(acc[m], hi[m], b_hi);
    }
#endif
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");  // the previous k-step is done
  }
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#pragma unroll
  for (int m = 0; m < 2; ++m) pin_accumulators(acc[m]);
#if LOPT_WGMMA_BF16_CORRECTION
#pragma unroll
  for (int m = 0; m < 2; ++m) {
    pin_accumulators(correction[m]);
#pragma unroll
    for (int c = 0; c < 4; ++c)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[m][c][i] = __fadd_rn(acc[m][c][i], correction[m][c][i]);
  }
#endif
}
#endif
