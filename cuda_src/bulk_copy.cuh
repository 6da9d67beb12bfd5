// Bulk copies from global to shared memory (Hopper's TMA unit, cp.async.bulk) and the mbarriers that
// say when they have landed. One thread issues a copy of any size (a multiple of 16 bytes, both
// addresses 16-byte aligned); the copy needs no registers and no instructions of the other threads,
// so a warp can have the next chunks' loads in flight while it computes on this one.
//
// Available from sm_90 (LOPT_BULK_COPY); older GPUs keep their direct loads.
#pragma once
#include "common.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define LOPT_BULK_COPY 1
#else
#define LOPT_BULK_COPY 0
#endif

#define LOPT_BULK_ALIGNMENT 16

LOPT_DEVICE unsigned shared_address(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }

#if LOPT_BULK_COPY
// An mbarrier (8 bytes of shared memory) that completes a phase when `arrivals` threads have arrived
// and the bytes they announced have landed.
LOPT_DEVICE void mbarrier_init(unsigned long long* barrier, unsigned arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(barrier)), "r"(arrivals) : "memory");
}

// Makes initialised mbarriers visible to the copy unit (after mbarrier_init, before the first copy).
LOPT_DEVICE void fence_barrier_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

// Orders this thread's earlier reads and writes of shared memory before later bulk copies into it: a
// buffer that was read with ordinary loads may then be overwritten by a copy.
LOPT_DEVICE void fence_before_bulk_copy() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Arrives on the barrier and announces `bytes` more to land in its current phase.
LOPT_DEVICE void mbarrier_arrive_expect_bytes(unsigned long long* barrier, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(barrier)), "r"(bytes)
               : "memory");
}

// Whether the barrier's phase of this parity (0, 1, 0, ...: its 1st, 2nd, 3rd ... phase) has completed.
LOPT_DEVICE bool mbarrier_phase_done(const unsigned long long* barrier, unsigned parity) {
  unsigned done;
  asm volatile(
      "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
      : "=r"(done) : "r"(shared_address(barrier)), "r"(parity) : "memory");
  return done != 0;
}
LOPT_DEVICE void mbarrier_wait(const unsigned long long* barrier, unsigned parity) {
  while (!mbarrier_phase_done(barrier, parity)) {
  }
}

// An L2 policy for data read once (the bulk-copy counterpart of evict-first loads).
LOPT_DEVICE unsigned long long evict_first_policy() {
  unsigned long long policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

// Copies `bytes` (a multiple of 16) from global `source` to shared `destination` (both 16-byte
// aligned); the barrier's phase counts them (mbarrier_arrive_expect_bytes).
LOPT_DEVICE void bulk_copy(void* destination, const void* source, unsigned bytes, unsigned long long* barrier,
                           unsigned long long policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
      ::"r"(shared_address(destination)), "l"(source), "r"(bytes), "r"(shared_address(barrier)), "l"(policy)
      : "memory");
}
#endif
