// The device side of lockstep's CUDA emulator: what a kernel source needs from CUDA C++ to
// compile with g++ and run on the CPU. The emulated NVRTC (nvrtc.cpp) puts this header in front
// of every kernel source. Each thread of a block is a fiber on the launching OS thread; the
// block's threads run in turn until each reaches a barrier (__syncthreads, a warp primitive), so
// shared memory, shuffles and votes behave as on the GPU for code that synchronizes as CUDA
// requires. Blocks run one after another, so atomics need no hardware atomics.
#pragma once
#include <algorithm>
#include <csetjmp>
#include <csignal>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sys/mman.h>
#include <type_traits>
#include <utility>
#include <vector>

#define __global__ __emu_global__
#ifndef EMU_SCAN
#define __emu_global__
#endif
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define __constant__ static const

struct uint3 { unsigned x, y, z; };
struct dim3 { unsigned x, y, z; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) int4 { int x, y, z, w; };
struct alignas(8) int2 { int x, y; };
struct alignas(16) double2 { double x, y; };
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline float2 make_float2(float x, float y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
inline int2 make_int2(int x, int y) { return {x, y}; }
inline double2 make_double2(double x, double y) { return {x, y}; }

namespace emu {

// ---- fibers ---------------------------------------------------------------------------------
// emu_switch(save, to): store this stack pointer in *save and continue the fiber whose stack
// pointer is `to` (callee-saved registers travel on each stack; kernels never change the
// floating-point control registers, so those are not switched).
extern "C" void emu_switch(void **save, void *to);
#if defined(__x86_64__)
asm(R"(
    .text
    .p2align 4
    .local emu_switch
    .type emu_switch, @function
emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_switch, .-emu_switch
)");
#else
#error "the CUDA emulator's fibers are written for x86-64"
#endif

constexpr size_t STACK = 256 * 1024;
constexpr unsigned MAX_THREADS = 1024;

struct Warp {
    unsigned valid = 0;    // lanes that exist in this block
    unsigned exited = 0;   // lanes whose thread has returned
    unsigned arrived = 0;  // lanes waiting at a warp barrier
    unsigned passed[32];   // per lane: warp barriers passed
    uint64_t slot[32];     // per lane: a shuffle's or vote's value
};

struct Fiber {
    void *sp;
    unsigned tid;
    uint3 idx; // threadIdx
    int stack; // -1 until started
    bool done;
};

struct State {
    uint3 thread, block;
    dim3 bdim, gdim;
    void *main_sp = nullptr;
    std::vector<Fiber> fibers;
    char *stacks = nullptr; // MAX_THREADS stacks, each above a guard page
    std::vector<int> free_stacks; // a finished thread's stack serves the next (it is cache-hot)
    unsigned cur = 0, nthreads = 0, exited = 0;
    unsigned bar_arrived = 0, bar_gen = 0;
    bool progress = false, failed = false;
    char why[256];
    Warp warps[MAX_THREADS / 32];
    void (*body)(void *) = nullptr;
    void *arg = nullptr;
};
inline State st;

inline void yield() {
    Fiber &f = st.fibers[st.cur];
    emu_switch(&f.sp, st.main_sp);
}

[[noreturn]] inline void fail(const char *what) {
    if (!st.failed) snprintf(st.why, sizeof st.why, "%s", what);
    st.failed = true;
    for (;;) yield(); // the scheduler never resumes a failed block
}

inline void entry() {
    st.body(st.arg);
    Fiber &f = st.fibers[st.cur];
    f.done = true;
    st.free_stacks.push_back(f.stack);
    st.exited++;
    st.warps[f.tid / 32].exited |= 1u << (f.tid & 31);
    st.progress = true;
    emu_switch(&f.sp, st.main_sp);
    __builtin_unreachable();
}

// A fresh fiber's stack: emu_switch's saved registers, then `entry` as its return address.
inline void *fresh_stack(unsigned i) {
    uintptr_t top = (uintptr_t)(st.stacks + (size_t)(i + 1) * (STACK + 4096));
    top &= ~(uintptr_t)15;
    uint64_t *sp = (uint64_t *)top;
    *--sp = 0;                    // entry's (absent) return address
    *--sp = (uint64_t)(void *)&entry;
    for (int r = 0; r < 6; r++) *--sp = 0; // rbp rbx r12-r15
    return sp;
}

inline void ensure_stacks() {
    if (st.stacks) return;
    size_t per = STACK + 4096;
    void *m = mmap(nullptr, per * MAX_THREADS + 4096, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) { perror("cuda-emu: fiber stacks"); abort(); }
    st.stacks = (char *)m;
    for (unsigned i = 0; i < MAX_THREADS; i++) mprotect(st.stacks + i * per, 4096, PROT_NONE);
}

// Runs one block to its end; false (with st.why) on a deadlock or a trap.
inline bool run_block() {
    unsigned n = st.nthreads;
    st.fibers.resize(n);
    st.exited = 0;
    st.bar_arrived = 0;
    for (unsigned w = 0; w < (n + 31) / 32; w++) {
        Warp &wp = st.warps[w];
        unsigned lanes = std::min(32u, n - w * 32);
        wp.valid = lanes == 32 ? ~0u : (1u << lanes) - 1;
        wp.exited = wp.arrived = 0;
        memset(wp.passed, 0, sizeof wp.passed);
    }
    st.free_stacks.clear();
    for (int i = (int)n - 1; i >= 0; i--) st.free_stacks.push_back(i);
    for (unsigned i = 0; i < n; i++) {
        uint3 idx{i % st.bdim.x, (i / st.bdim.x) % st.bdim.y, i / (st.bdim.x * st.bdim.y)};
        st.fibers[i] = Fiber{nullptr, i, idx, -1, false};
    }
    unsigned live = n;
    static const bool reverse = getenv("LOCKSTEP_CUDA_EMU_REVERSE") != nullptr;
    while (live) {
        st.progress = false;
        for (unsigned k = 0; k < n; k++) {
            unsigned i = reverse ? n - 1 - k : k;
            Fiber &f = st.fibers[i];
            if (f.done) continue;
            st.cur = i;
            if (f.stack < 0) {
                f.stack = st.free_stacks.back();
                st.free_stacks.pop_back();
                f.sp = fresh_stack((unsigned)f.stack);
            }
            st.thread = f.idx;
            emu_switch(&st.main_sp, f.sp);
            if (st.failed) return false;
            if (f.done) live--;
        }
        if (live && !st.progress) {
            snprintf(st.why, sizeof st.why,
                     "deadlock: %u of %u threads of block (%u,%u,%u) wait at a barrier the others never reach",
                     live, n, st.block.x, st.block.y, st.block.z);
            return false;
        }
    }
    return true;
}

// ---- barriers -------------------------------------------------------------------------------
inline unsigned my_tid() { return st.fibers[st.cur].tid; }

inline void syncthreads() {
    unsigned gen = st.bar_gen;
    st.bar_arrived++;
    st.progress = true;
    for (;;) {
        if (st.bar_gen != gen) return;
        if (st.bar_arrived + st.exited >= st.nthreads) {
            st.bar_arrived = 0;
            st.bar_gen++;
            return;
        }
        yield();
    }
}

// Waits until every lane of `mask` (that exists and has not returned) arrived.
inline void warp_sync(unsigned mask) {
    unsigned t = my_tid();
    Warp &w = st.warps[t / 32];
    unsigned lane = t & 31, bit = 1u << lane;
    if (!(mask & bit)) fail("a warp primitive's mask leaves out the calling lane");
    unsigned need = mask & w.valid, mine = w.passed[lane];
    w.arrived |= bit;
    st.progress = true;
    for (;;) {
        if (w.passed[lane] != mine) return;
        if (((w.arrived | w.exited) & need) == need) {
            for (unsigned l = 0; l < 32; l++)
                if (need & w.arrived & (1u << l)) w.passed[l]++;
            w.arrived &= ~need;
            return;
        }
        yield();
    }
}

template <class T> inline uint64_t to_bits(T v) {
    static_assert(sizeof(T) <= 8, "warp values are at most 8 bytes");
    uint64_t b = 0;
    memcpy(&b, &v, sizeof v);
    return b;
}
template <class T> inline T from_bits(uint64_t b) {
    T v;
    memcpy(&v, &b, sizeof v);
    return v;
}

// Each lane of `mask` publishes `v`; `f(slots, need)` reads them all; every lane sees the result.
template <class T, class F> inline auto exchange(unsigned mask, T v, F f) {
    unsigned t = my_tid();
    Warp &w = st.warps[t / 32];
    w.slot[t & 31] = to_bits(v);
    warp_sync(mask);
    auto r = f(w.slot, mask & w.valid & ~w.exited, t & 31);
    warp_sync(mask);
    return r;
}

} // namespace emu

#define threadIdx (emu::st.thread)
#define blockIdx (emu::st.block)
#define blockDim (emu::st.bdim)
#define gridDim (emu::st.gdim)
#define warpSize 32

inline void __syncthreads() { emu::syncthreads(); }
inline void __syncwarp(unsigned mask = 0xFFFFFFFFu) { emu::warp_sync(mask); }
inline void __threadfence() {}
inline void __threadfence_block() {}
[[noreturn]] inline void __trap() { emu::fail("__trap()"); }

template <class T> inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    return emu::exchange(mask, v, [&](const uint64_t *s, unsigned, unsigned lane) {
        unsigned base = lane & ~(unsigned)(width - 1);
        return emu::from_bits<T>(s[base + ((unsigned)src & (width - 1))]);
    });
}
template <class T> inline T __shfl_xor_sync(unsigned mask, T v, int m, int width = 32) {
    return emu::exchange(mask, v, [&](const uint64_t *s, unsigned, unsigned lane) {
        unsigned base = lane & ~(unsigned)(width - 1);
        unsigned src = lane ^ (unsigned)m;
        return emu::from_bits<T>(src < base + width ? s[src] : s[lane]);
    });
}
template <class T> inline T __shfl_down_sync(unsigned mask, T v, unsigned d, int width = 32) {
    return emu::exchange(mask, v, [&](const uint64_t *s, unsigned, unsigned lane) {
        unsigned base = lane & ~(unsigned)(width - 1);
        unsigned src = lane + d;
        return emu::from_bits<T>(src < base + width ? s[src] : s[lane]);
    });
}
template <class T> inline T __shfl_up_sync(unsigned mask, T v, unsigned d, int width = 32) {
    return emu::exchange(mask, v, [&](const uint64_t *s, unsigned, unsigned lane) {
        unsigned base = lane & ~(unsigned)(width - 1);
        return emu::from_bits<T>(lane >= base + d ? s[lane - d] : s[lane]);
    });
}
inline unsigned __ballot_sync(unsigned mask, int p) {
    return emu::exchange(mask, (uint64_t)(p != 0), [](const uint64_t *s, unsigned live, unsigned) {
        unsigned r = 0;
        for (unsigned l = 0; l < 32; l++)
            if ((live >> l & 1) && s[l]) r |= 1u << l;
        return r;
    });
}
inline int __all_sync(unsigned mask, int p) { return __ballot_sync(mask, p) == (__ballot_sync(mask, 1)); }
inline int __any_sync(unsigned mask, int p) { return __ballot_sync(mask, p) != 0; }
inline unsigned __reduce_max_sync(unsigned mask, unsigned v) {
    return emu::exchange(mask, v, [](const uint64_t *s, unsigned live, unsigned) {
        unsigned r = 0;
        for (unsigned l = 0; l < 32; l++)
            if (live >> l & 1) r = std::max(r, (unsigned)s[l]);
        return r;
    });
}
inline unsigned __reduce_add_sync(unsigned mask, unsigned v) {
    return emu::exchange(mask, v, [](const uint64_t *s, unsigned live, unsigned) {
        unsigned r = 0;
        for (unsigned l = 0; l < 32; l++)
            if (live >> l & 1) r += (unsigned)s[l];
        return r;
    });
}

// ---- atomics (blocks run one at a time: plain read-modify-write) -------------------------------
template <class T> inline T atomicAdd(T *p, T v) { T o = *p; *p = o + v; return o; }
template <class T> inline T atomicMax(T *p, T v) { T o = *p; *p = std::max(o, v); return o; }
template <class T> inline T atomicMin(T *p, T v) { T o = *p; *p = std::min(o, v); return o; }
template <class T> inline T atomicOr(T *p, T v) { T o = *p; *p = o | v; return o; }
template <class T> inline T atomicAnd(T *p, T v) { T o = *p; *p = o & v; return o; }
template <class T> inline T atomicExch(T *p, T v) { T o = *p; *p = v; return o; }
template <class T> inline T atomicCAS(T *p, T c, T v) { T o = *p; if (o == c) *p = v; return o; }

// ---- bits and arithmetic ----------------------------------------------------------------------
inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned i) { float f; memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; memcpy(&i, &f, 4); return i; }
inline unsigned __float_as_uint(float f) { unsigned i; memcpy(&i, &f, 4); return i; }
inline double __longlong_as_double(long long i) { double d; memcpy(&d, &i, 8); return d; }
inline long long __double_as_longlong(double d) { long long i; memcpy(&i, &d, 8); return i; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)x); }
inline unsigned __brev(unsigned x) {
    unsigned r = 0;
    for (int i = 0; i < 32; i++) r |= ((x >> i) & 1u) << (31 - i);
    return r;
}
inline size_t __cvta_generic_to_shared(const void *p) { return (size_t)p; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float x) { return std::sqrt(x); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __saturatef(float x) { return x != x ? 0.0f : std::min(std::max(x, 0.0f), 1.0f); }
using std::isfinite;
using std::isinf;
using std::isnan;

// CUDA's fminf/fmaxf return the other operand when one is any NaN, signalling ones included;
// glibc's (IEEE 754-2008 minNum/maxNum) return a NaN for a signalling NaN.
inline float emu_fmaxf(float a, float b) { return a != a ? b : b != b ? a : std::fmax(a, b); }
inline float emu_fminf(float a, float b) { return a != a ? b : b != b ? a : std::fmin(a, b); }
inline double emu_fmax(double a, double b) { return a != a ? b : b != b ? a : std::fmax(a, b); }
inline double emu_fmin(double a, double b) { return a != a ? b : b != b ? a : std::fmin(a, b); }
#define fmaxf emu_fmaxf
#define fminf emu_fminf
#define fmax emu_fmax
#define fmin emu_fmin

// CUDA's min and max: integer overloads by the usual conversions, fminf/fmaxf for floats.
template <class A, class B> inline auto min(A a, B b) {
    using T = std::common_type_t<A, B>;
    if constexpr (std::is_floating_point_v<T>) return (T)emu_fmin((T)a, (T)b);
    else return (T)a < (T)b ? (T)a : (T)b;
}
template <class A, class B> inline auto max(A a, B b) {
    using T = std::common_type_t<A, B>;
    if constexpr (std::is_floating_point_v<T>) return (T)emu_fmax((T)a, (T)b);
    else return (T)a > (T)b ? (T)a : (T)b;
}
inline unsigned umin(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned umax(unsigned a, unsigned b) { return a > b ? a : b; }

// PTX the emulated NVRTC rewrites inline assembly into (see nvrtc.cpp).
namespace emu {
// max.NaN.f32: the larger, or a canonical NaN if either is NaN.
inline float max_nan_f32(float a, float b) {
    if (a != a || b != b) return __int_as_float(0x7FFFFFFF);
    if (a == 0.0f && b == 0.0f) return std::signbit(a) ? b : a;
    return a > b ? a : b;
}
inline float min_nan_f32(float a, float b) {
    if (a != a || b != b) return __int_as_float(0x7FFFFFFF);
    if (a == 0.0f && b == 0.0f) return std::signbit(a) ? a : b;
    return a < b ? a : b;
}
[[noreturn]] inline void unsupported_asm(const char *what) {
    static char msg[200];
    snprintf(msg, sizeof msg, "inline PTX the emulator does not know: %.150s", what);
    fail(msg);
}

// ---- launch ---------------------------------------------------------------------------------
struct Launch {
    unsigned grid[3], block[3];
    unsigned shared_bytes;
    void **params;
    char error[256];
};

template <class... A, size_t... I>
inline void call(void (*k)(A...), void **p, std::index_sequence<I...>) {
    k(*static_cast<std::remove_cv_t<std::remove_reference_t<A>> *>(p[I])...);
}

// A kernel's illegal access (SIGSEGV or SIGBUS while a kernel runs) ends the launch with an
// error instead of the process, as a GPU reports an illegal address.
inline sigjmp_buf fault_env;
inline volatile sig_atomic_t in_kernel = 0;
inline void *fault_addr = nullptr;
inline void on_fault(int sig, siginfo_t *si, void *) {
    if (!in_kernel) { // not a kernel's: let the default action happen
        signal(sig, SIG_DFL);
        raise(sig);
        return;
    }
    in_kernel = 0;
    fault_addr = si->si_addr;
    siglongjmp(fault_env, 1);
}

// The byte size of each of a kernel's parameters (a graph capture copies them) into out[..cap),
// count returned; -1 where the kernel has more than `cap` parameters (nothing written).
template <class... A> inline int param_sizes(void (*)(A...), size_t *out, size_t cap) {
    if (sizeof...(A) > cap) return -1;
    size_t s[] = {0, sizeof(std::remove_cv_t<std::remove_reference_t<A>>)...};
    for (size_t i = 0; i < sizeof...(A); i++) out[i] = s[i + 1];
    return (int)sizeof...(A);
}

template <class... A> inline int launch(void (*k)(A...), Launch *l) {
    unsigned n = l->block[0] * l->block[1] * l->block[2];
    if (n == 0 || n > MAX_THREADS) {
        snprintf(l->error, sizeof l->error, "block of %u threads (1..%u)", n, MAX_THREADS);
        return 1;
    }
    ensure_stacks();
    struct Ctx { void (*k)(A...); void **p; } ctx{k, l->params};
    st.arg = &ctx;
    st.body = [](void *c) {
        auto *x = (Ctx *)c;
        call(x->k, x->p, std::index_sequence_for<A...>{});
    };
    st.bdim = dim3{l->block[0], l->block[1], l->block[2]};
    st.gdim = dim3{l->grid[0], l->grid[1], l->grid[2]};
    st.nthreads = n;
    st.failed = false;
    // The handler runs on a stack of its own: a fault may be a fiber's stack overflow.
    static char alt[64 * 1024];
    stack_t ss{}, old_ss{};
    ss.ss_sp = alt;
    ss.ss_size = sizeof alt;
    sigaltstack(&ss, &old_ss);
    struct sigaction sa{}, old_segv{}, old_bus{};
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &old_segv);
    sigaction(SIGBUS, &sa, &old_bus);
    int rc = 0;
    if (sigsetjmp(fault_env, 1)) {
        unsigned t = st.fibers.empty() ? 0 : st.fibers[st.cur].tid;
        snprintf(l->error, sizeof l->error, "illegal address %p (block (%u,%u,%u), thread %u)", fault_addr,
                 st.block.x, st.block.y, st.block.z, t);
        rc = 2;
    } else {
        in_kernel = 1;
            // LOCKSTEP_CUDA_EMU_REVERSE runs blocks and threads last to first: code that leans on
        // an order CUDA does not promise (a missing barrier) then tends to fail.
        static const bool reverse = getenv("LOCKSTEP_CUDA_EMU_REVERSE") != nullptr;
        uint64_t gx = l->grid[0], gy = l->grid[1], nb = gx * gy * l->grid[2];
        for (uint64_t b = 0; b < nb && !rc; b++) {
            uint64_t i = reverse ? nb - 1 - b : b;
            st.block = uint3{(unsigned)(i % gx), (unsigned)(i / gx % gy), (unsigned)(i / (gx * gy))};
            if (!run_block()) {
                snprintf(l->error, sizeof l->error, "%s", st.why);
                rc = 1;
            }
        }
        in_kernel = 0;
    }
    sigaction(SIGSEGV, &old_segv, nullptr);
    sigaction(SIGBUS, &old_bus, nullptr);
    sigaltstack(&old_ss, nullptr);
    return rc;
}
} // namespace emu
