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
// Two implementations, chosen at compile time:
//   * mma.sync (sm_80+): each warp multiplies its own 32 rows (two 16-row m-tiles), A fragments
//     from registers; B operands in shared memory in "fragment order" (a float4 per lane, k-step
//     and n-tile); TF32 + BF16 products as above.
//   * wgmma (sm_90a): the block (one warpgroup of 4 warps) multiplies its 128 rows with A and B in
//     shared memory in the tensor cores' own layout; three TF32 products (see that section).
// Either way a layer's B operand takes LOPT_SPLIT_OPERAND_FLOATS floats (8 KiB) and the
// accumulators are m16n8 tiles of float32.
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
// wgmma (sm_90a): both operands in shared memory, the block's 128 rows as two 64-row m-tiles.
// ------------------------------------------------------------------------------------------
// Products into one accumulator are ordered by the hardware only when they have the same shape (a
// TF32 k8 and a BF16 k16 product into the same registers would be serialised), and waiting for
// products is what costs here, not the products themselves; so this path uses three TF32 products
// per k-step (a_lo b_hi + a_hi b_lo + a_hi b_hi: the lo parts rounded to TF32, about 2^-21 of
// sum |a_k b_k|), and a whole layer (24 products) is issued as one group and waited for once.
//
// Layouts: K-major without swizzle, made of "core matrices" of 8 rows x 16 bytes (4 TF32 values of
// k); the core matrix of row group q and k-slice h (of a k-step's two) sits at (2q + h) * 128 bytes.
//   B operand (per layer, 8 KiB): per k-step j, B_hi (32 n-rows) then B_lo, 1 KiB each.
//   A tile (per block, 32 KiB): per m-tile (64 rows) and k-step, A_hi then A_lo, 2 KiB each.
#define LOPT_WGMMA_LEADING_BYTES 128  // between the two k-slices of a row group
#define LOPT_WGMMA_STRIDE_BYTES 256   // between row groups
#define LOPT_SPLIT_A_TILE_BYTES (2 * 4 * 2 * 2048)

template <typename Weight>
LOPT_DEVICE void write_split_operand(float* out, Weight weight, int thread, int num_threads) {
  for (int slot = thread; slot < 4 * 4 * 32; slot += num_threads) {  // one 16-byte core-matrix row each
    const int j = slot / 128, within = slot % 128, low_part = within / 64;
    const int core = (within % 64) / 8, q = core / 2, h = core % 2, n = 8 * q + within % 8;
    unsigned packed[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {  // k = 8j + 4h + u
      const SplitValue v = split(weight(8 * j + 4 * h + u, n));
      packed[u] = low_part ? to_tf32(v.lo) : __float_as_uint(v.hi);
    }
    reinterpret_cast<uint4*>(out)[slot] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  }
}

// Byte offset in the A tile of row `row` (0..127), input k, part (0: hi, 1: lo).
LOPT_DEVICE int a_tile_offset(int row, int k, int part) {
  const int m_tile = row / 64, r = row % 64, j = k / 8, h = (k % 8) / 4;
  return ((m_tile * 4 + j) * 2 + part) * 2048 + ((r / 8) * 2 + h) * 128 + (r % 8) * 16 + (k % 4) * 4;
}

// Stores n (2 or 4) consecutive inputs k, k + 1, ... of a row, split into their hi and lo parts.
template <int N>
LOPT_DEVICE void store_split_inputs(unsigned char* a_tile, int row, int k, const float* values) {
  unsigned hi[N], lo[N];
#pragma unroll
  for (int u = 0; u < N; ++u) {
    const SplitValue v = split(values[u]);
    hi[u] = __float_as_uint(v.hi);
    lo[u] = to_tf32(v.lo);
  }
  if constexpr (N == 4) {
    *reinterpret_cast<uint4*>(a_tile + a_tile_offset(row, k, 0)) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
    *reinterpret_cast<uint4*>(a_tile + a_tile_offset(row, k, 1)) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
  } else {
    *reinterpret_cast<uint2*>(a_tile + a_tile_offset(row, k, 0)) = make_uint2(hi[0], hi[1]);
    *reinterpret_cast<uint2*>(a_tile + a_tile_offset(row, k, 1)) = make_uint2(lo[0], lo[1]);
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

// acc (this warp's 16 rows of the m-tile x 32 columns, as four m16n8 accumulator tiles) += A B, k = 8.
LOPT_DEVICE void wgmma_tf32_m64n32k8(float acc[4][4], unsigned long long a, unsigned long long b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n32k8.f32.tf32.tf32 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, 1, 1, 1;\n"
      : "+f"(acc[0][0]), "+f"(acc[0][1]), "+f"(acc[0][2]), "+f"(acc[0][3]), "+f"(acc[1][0]), "+f"(acc[1][1]),
        "+f"(acc[1][2]), "+f"(acc[1][3]), "+f"(acc[2][0]), "+f"(acc[2][1]), "+f"(acc[2][2]), "+f"(acc[2][3]),
        "+f"(acc[3][0]), "+f"(acc[3][1]), "+f"(acc[3][2]), "+f"(acc[3][3])
      : "l"(a), "l"(b));
}

// acc[m] += A_m B over 32 k, A_m being rows 64m .. 64m + 63 of the A tile (this warp's accumulators:
// rows 64m + 16 warp + g and + 8). All 128 threads of the warpgroup call it together, after the A
// tile and the B operand were published (split_operand_stores_done, then a barrier).
LOPT_DEVICE void split_layer_32x32(float acc[2][4][4], const unsigned char* a_tile, const float* operand) {
  const unsigned long long a = operand_descriptor(a_tile), b = operand_descriptor(operand);
#pragma unroll
  for (int m = 0; m < 2; ++m) pin_accumulators(acc[m]);
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    // Descriptor addresses count 16-byte units.
    const unsigned long long b_hi = b + (j * 2048 >> 4), b_lo = b + ((j * 2048 + 1024) >> 4);
#pragma unroll
    for (int m = 0; m < 2; ++m) {
      const unsigned long long a_hi = a + (((m * 4 + j) * 2) * 2048 >> 4), a_lo = a_hi + (2048 >> 4);
      wgmma_tf32_m64n32k8(acc[m], a_lo, b_hi);  // the small terms first
      wgmma_tf32_m64n32k8(acc[m], a_hi, b_lo);
      wgmma_tf32_m64n32k8(acc[m], a_hi, b_hi);
    }
  }
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#pragma unroll
  for (int m = 0; m < 2; ++m) pin_accumulators(acc[m]);
}
#endif
