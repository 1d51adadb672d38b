// Host-side CUDA for webchat/kernels/cuda/emulator.py: force-included (-include) when a webchat/kernels/cuda/*.cu source is compiled as ordinary C++,
// so the kernels' own code runs on the CPU. Each CUDA thread of a block is a fiber with its own stack; blocks run one
// after another, so a function-static array is exactly one block's __shared__ memory. __syncthreads and
// __shfl_xor_sync are real barriers (all threads of the block, all 32 lanes of the warp), and a barrier that can never
// complete (a divergent __syncthreads, a shuffle with lanes missing) stops the launch with an error naming the warp.
// Not modelled: timing, the memory model between blocks, fused multiply-add contraction, approximate intrinsics.
#pragma once

#include <math.h>  // expf, fmaxf, ... in the global namespace, as on the device

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#define WEBCHAT_EMULATOR 1
#ifndef WEBCHAT_EMULATOR_SCAN  // the scan pass defines __global__ as a marker to find the entry points
#define __global__
#endif
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
#define __align__(n) alignas(n)

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};

// What the running fiber sees. External linkage on purpose: the compiler must reload them after every switch.
extern "C" {
dim3 threadIdx, blockIdx, blockDim, gridDim;
}

namespace webchat_emu {

enum class State : unsigned char { ready, warp_wait, block_wait, done, failed };

struct Fiber {
    void* sp = nullptr;
    State state = State::ready;
    unsigned long warp_syncs = 0, block_syncs = 0;  // barriers passed: every lane must meet at the same one ...
    const void* site = nullptr;                      // ... called from the same place in the code
};

constexpr size_t STACK_BYTES = 64 * 1024;
constexpr unsigned MAX_THREADS = 1024;

struct Scheduler {
    std::vector<Fiber> fibers;
    std::vector<char> stacks;
    void* sched_sp = nullptr;
    unsigned current = 0;
    void (*body)(void*) = nullptr;
    void* body_arg = nullptr;
    std::string error;
    std::mutex lock;  // one launch at a time in this module
    uint32_t shfl[2][MAX_THREADS / 32][32][2];  // two sets of one 64-bit slot per lane
};

inline Scheduler& sched() {
    static Scheduler s;
    return s;
}

}  // namespace webchat_emu

// ---- the context switch: save callee-saved registers on this stack, store sp in *save, load `to`, restore, return ----
#if defined(__x86_64__)
extern "C" void webchat_emu_switch(void** save, void* to);
__asm__(
    ".text\n"
    ".globl webchat_emu_switch\n"
    ".hidden webchat_emu_switch\n"
    ".type webchat_emu_switch,@function\n"
    "webchat_emu_switch:\n"
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  movq %rsp, (%rdi)\n"
    "  movq %rsi, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
    "  ret\n"
    ".size webchat_emu_switch, .-webchat_emu_switch\n");
#else
#error "webchat/kernels/cuda/emulator.h has a context switch for x86-64 only"
#endif

namespace webchat_emu {

[[noreturn]] inline void fiber_main() {
    Scheduler& s = sched();
    s.body(s.body_arg);
    s.fibers[s.current].state = State::done;
    webchat_emu_switch(&s.fibers[s.current].sp, s.sched_sp);
    std::abort();  // a finished fiber is never resumed
}

// A fresh stack whose first switch "returns" into fiber_main with the ABI's stack alignment.
inline void* fresh_stack(char* base) {
    uintptr_t top = (reinterpret_cast<uintptr_t>(base) + STACK_BYTES) & ~uintptr_t(15);
    void** sp = reinterpret_cast<void**>(top);
    *--sp = nullptr;                               // padding: the return slot below is 16-byte aligned
    *--sp = reinterpret_cast<void*>(&fiber_main);  // popped by ret
    for (int i = 0; i < 6; ++i) *--sp = nullptr;   // rbp rbx r12 r13 r14 r15
    return sp;
}

inline void set_thread(unsigned tid) {
    threadIdx.x = tid % blockDim.x;
    threadIdx.y = (tid / blockDim.x) % blockDim.y;
    threadIdx.z = tid / (blockDim.x * blockDim.y);
}

// Called on a fiber: park in `state` until the scheduler releases this barrier.
inline void wait(State state) {
    Scheduler& s = sched();
    Fiber& f = s.fibers[s.current];
    f.state = state;
    webchat_emu_switch(&f.sp, s.sched_sp);
}

inline void fail(const std::string& why) {
    Scheduler& s = sched();
    if (s.error.empty()) s.error = why;
    wait(State::failed);
    std::abort();  // a failed launch never resumes its fibers
}

inline std::string where() {
    char buf[160];
    std::snprintf(buf, sizeof buf, "block (%u, %u, %u) thread (%u, %u, %u)", blockIdx.x, blockIdx.y, blockIdx.z,
                  threadIdx.x, threadIdx.y, threadIdx.z);
    return buf;
}

// Releases the barriers that every participant has reached; false when none could be released.
inline bool release(unsigned n) {
    Scheduler& s = sched();
    bool any = false;
    for (unsigned w = 0; w * 32 < n; ++w) {
        const unsigned lo = w * 32, hi = lo + 32 < n ? lo + 32 : n;
        unsigned waiting = 0;
        for (unsigned i = lo; i < hi; ++i) waiting += s.fibers[i].state == State::warp_wait;
        if (waiting == 0 || waiting != hi - lo) continue;
        for (unsigned i = lo; i < hi; ++i) {
            if (s.fibers[i].warp_syncs != s.fibers[lo].warp_syncs || s.fibers[i].site != s.fibers[lo].site) {
                s.error = "warp " + std::to_string(w) + ": lanes met at different __shfl_xor_sync calls";
                return false;
            }
            s.fibers[i].state = State::ready;
        }
        any = true;
    }
    if (any) return true;
    unsigned live = 0, at_barrier = 0;
    for (unsigned i = 0; i < n; ++i) {
        live += s.fibers[i].state != State::done;
        at_barrier += s.fibers[i].state == State::block_wait;
    }
    if (live == 0 || at_barrier != live) return false;
    const Fiber* first = nullptr;
    for (unsigned i = 0; i < n; ++i) {
        Fiber& f = s.fibers[i];
        if (f.state != State::block_wait) continue;
        if (first == nullptr) first = &f;
        if (f.block_syncs != first->block_syncs || f.site != first->site) {
            s.error = "threads met at different __syncthreads calls";
            return false;
        }
        f.state = State::ready;
    }
    return true;
}

inline std::string stuck(unsigned n) {
    Scheduler& s = sched();
    std::string out;
    for (unsigned w = 0; w * 32 < n; ++w) {
        unsigned counts[5] = {0, 0, 0, 0, 0};
        for (unsigned i = w * 32; i < n && i < w * 32 + 32; ++i) ++counts[static_cast<int>(s.fibers[i].state)];
        out += "; warp " + std::to_string(w) + ": " + std::to_string(counts[1]) + " at __shfl_xor_sync, " +
               std::to_string(counts[2]) + " at __syncthreads, " + std::to_string(counts[3]) + " exited";
    }
    return out;
}

// Runs body(arg) on every thread of every block; returns 0, or 1 with the reason in sched().error.
inline int launch(const unsigned* dims, void (*body)(void*), void* arg, int reverse) {
    Scheduler& s = sched();
    std::lock_guard<std::mutex> guard(s.lock);
    s.error.clear();
    gridDim = dim3{dims[0], dims[1], dims[2]};
    blockDim = dim3{dims[3], dims[4], dims[5]};
    const unsigned long n_long = (unsigned long)dims[3] * dims[4] * dims[5];
    if (n_long == 0 || n_long > MAX_THREADS || (unsigned long)dims[0] * dims[1] * dims[2] == 0) {
        s.error = "invalid launch: grid (" + std::to_string(dims[0]) + ", " + std::to_string(dims[1]) + ", " +
                  std::to_string(dims[2]) + ") block (" + std::to_string(dims[3]) + ", " + std::to_string(dims[4]) +
                  ", " + std::to_string(dims[5]) + "); a block holds 1 to 1024 threads";
        return 1;
    }
    const unsigned n = (unsigned)n_long;
    s.body = body;
    s.body_arg = arg;
    s.fibers.assign(n, Fiber{});
    if (s.stacks.size() < n * STACK_BYTES) s.stacks.resize(n * STACK_BYTES);
    for (unsigned bz = 0; bz < gridDim.z; ++bz)
        for (unsigned by = 0; by < gridDim.y; ++by)
            for (unsigned bx = 0; bx < gridDim.x; ++bx) {
                blockIdx = dim3{bx, by, bz};
                for (unsigned i = 0; i < n; ++i) s.fibers[i] = Fiber{fresh_stack(&s.stacks[i * STACK_BYTES])};
                for (;;) {
                    for (unsigned k = 0; k < n; ++k) {  // run every ready thread up to its next barrier or its end
                        const unsigned i = reverse ? n - 1 - k : k;
                        if (s.fibers[i].state != State::ready) continue;
                        s.current = i;
                        set_thread(i);
                        webchat_emu_switch(&s.sched_sp, s.fibers[i].sp);
                        if (s.fibers[i].state == State::failed) return 1;
                    }
                    if (release(n)) continue;
                    bool all_done = true;
                    for (unsigned i = 0; i < n; ++i) all_done &= s.fibers[i].state == State::done;
                    if (all_done) break;
                    char head[96];
                    std::snprintf(head, sizeof head, "block (%u, %u, %u) cannot finish", bx, by, bz);
                    s.error = std::string(head) + (s.error.empty() ? "" : ": " + s.error) + stuck(n);
                    return 1;
                }
            }
    return 0;
}

}  // namespace webchat_emu

// ---- the CUDA device functions the kernels use ----

// Not inlined, so the return address tells one call site from another.
__attribute__((noinline)) void __syncthreads() {
    webchat_emu::Scheduler& s = webchat_emu::sched();
    s.fibers[s.current].site = __builtin_return_address(0);
    ++s.fibers[s.current].block_syncs;
    webchat_emu::wait(webchat_emu::State::block_wait);
}

template <typename T>
__attribute__((noinline)) T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    static_assert(sizeof(T) <= 8, "shuffles move at most 64 bits");
    webchat_emu::Scheduler& s = webchat_emu::sched();
    const unsigned tid = s.current, warp = tid / 32, lane = tid % 32;
    const unsigned n = blockDim.x * blockDim.y * blockDim.z;
    if (mask != 0xffffffffu || width != 32)
        webchat_emu::fail(webchat_emu::where() + ": only full-warp __shfl_xor_sync is emulated");
    if (warp * 32 + 32 > n)
        webchat_emu::fail(webchat_emu::where() + ": full-mask __shfl_xor_sync in warp " + std::to_string(warp) +
                          " of only " + std::to_string(n - warp * 32) + " threads (blockDim not a multiple of 32)");
    if (lane_mask < 0 || lane_mask > 31) webchat_emu::fail(webchat_emu::where() + ": lane mask out of range");
    // Two slot sets used in turn: a lane reaches the next shuffle on this set only after every lane has passed the
    // barrier of the shuffle in between, and so has read this one; one barrier per shuffle is enough.
    const unsigned set = s.fibers[tid].warp_syncs & 1u;
    std::memcpy(s.shfl[set][warp][lane], &v, sizeof(T));
    s.fibers[tid].site = __builtin_return_address(0);
    ++s.fibers[tid].warp_syncs;
    webchat_emu::wait(webchat_emu::State::warp_wait);  // every lane has written
    T out;
    std::memcpy(&out, s.shfl[set][warp][lane ^ (unsigned)lane_mask], sizeof(T));
    return out;
}

inline float atomicAdd(float* p, float v) {  // fibers never run at once, so a plain add is atomic
    const float old = *p;
    *p = old + v;
    return old;
}
inline int atomicAdd(int* p, int v) {
    const int old = *p;
    *p = old + v;
    return old;
}

inline float __uint_as_float(unsigned int u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline unsigned int __float_as_uint(float f) {
    unsigned int u;
    std::memcpy(&u, &f, 4);
    return u;
}
inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
inline float __fadd_rn(float a, float b) { return a + b; }  // compiled with -ffp-contract=off: no fused multiply-add
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }

// IEEE binary16 <-> float32, round to nearest even (what cvt.rn.f16.f32 / cvt.f32.f16 do)
inline float webchat_emu_half_to_float(unsigned short h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in float
        const float f = (float)mant * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    const uint32_t bits = exp == 31 ? sign | 0x7f800000u | (mant << 13) : sign | ((exp + 112u) << 23) | (mant << 13);
    return __uint_as_float(bits);
}
inline unsigned short webchat_emu_float_to_half(float f) {
    const uint32_t x = __float_as_uint(f), sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return (unsigned short)(sign | 0x7e00u);  // NaN
    if (ax >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);  // rounds past 65504: infinity
    if (ax < 0x38800000u)  // below 2^-14: a subnormal half, in units of 2^-24 (the scaling is exact)
        return (unsigned short)(sign | (uint32_t)std::nearbyint(__uint_as_float(ax) * 16777216.0f));
    uint32_t h = ((((ax >> 23) - 112u) << 10) | ((ax & 0x7fffffu) >> 13));
    const uint32_t rest = ax & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // a carry into the exponent is still correct
    return (unsigned short)(sign | h);
}
