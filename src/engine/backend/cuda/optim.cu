// The optimizer's arithmetic on the device (`engine::optim`), for training state kept on the GPU:
// the AdamW update, its sums, and the gradients' squared norms, over a tensor that holds every
// run's copy back to back (`len` values a run). Same rules as backward.cu: each of the CPU's sums
// runs in one thread in the CPU's order, and NVRTC gets --fmad=false, so the results are the
// CPU's bits. A launch covers every tensor of a model (a table of their device addresses).

// needs: prelude.cuh (u32/u64, the grid-stride index helpers)

// Fields of one run's constants for one tensor (`engine::optim::AdamStep`, then whether the run
// takes the step: a run with K_ACTIVE 0 keeps its p, m and v and sums zeros), 9 floats.
#define K_LR 0
#define K_BETA1 1
#define K_BETA2 2
#define K_EPS 3
#define K_BC1 4
#define K_BC2 5
#define K_SCALE 6
#define K_DECAY 7
#define K_ACTIVE 8
#define K_FIELDS 9

// The CPU's sums run in element order, one add after another, and the bits depend on that order:
// each sum is one dependent chain. A block streams a segment's values through shared memory in
// tiles: while one thread per sum adds up tile k in order, the whole block loads (and squares)
// tile k + 1, so the chain never waits on a load from global memory.
#define SUM_THREADS 256
#define SUM_TILE 1024
#define SUM_PER_THREAD (SUM_TILE / SUM_THREADS)

// Adds tile values `t[0..n)` to `acc` in order (`t` 16-byte aligned). The chain of adds is the
// kernel's critical path, so the next eight values are loaded while the current eight are added:
// the chain waits on the previous add only, never on shared memory.
__device__ __forceinline__ double add_in_order(double acc, const double *t, u32 n) {
    const double2 *t2 = (const double2 *)t;
    u32 e = 0;
    if (n >= 8) {
        double2 cur[4];
#pragma unroll
        for (u32 j = 0; j < 4; j++) cur[j] = t2[j];
        for (e = 8; e + 8 <= n; e += 8) {
            double2 nxt[4];
#pragma unroll
            for (u32 j = 0; j < 4; j++) nxt[j] = t2[e / 2 + j];
#pragma unroll
            for (u32 j = 0; j < 4; j++) {
                acc = acc + cur[j].x;
                acc = acc + cur[j].y;
                cur[j] = nxt[j];
            }
        }
#pragma unroll
        for (u32 j = 0; j < 4; j++) {
            acc = acc + cur[j].x;
            acc = acc + cur[j].y;
        }
    }
    for (; e < n; e++) acc = acc + t[e];
    return acc;
}

// Up to two in-order sums over `n` values a block produces tile by tile: `produce(i, &a, &b)`
// gives value i's two terms (called once per i, by one thread, before any term of a later tile
// is added). Thread 0 sums the a terms from `a0`, thread 32 the b terms from `b0` (`two`: else b
// is not summed); the sums are returned in those threads. Every thread of the block calls it.
template <typename Produce>
__device__ void tile_sums(u64 n, bool two, double a0, double b0, Produce produce, double *out_a,
                          double *out_b) {
    __shared__ __align__(16) double ta[2][SUM_TILE];
    __shared__ __align__(16) double tb[2][SUM_TILE];
    u32 tid = threadIdx.x;
    u64 tiles = (n + SUM_TILE - 1) / SUM_TILE;
    // Tile 0 first; then each round makes tile k + 1 while tile k is summed.
    for (u32 j = 0; j < SUM_PER_THREAD; j++) {
        u64 i = (u64)j * SUM_THREADS + tid;
        if (i < n) produce(i, &ta[0][i], &tb[0][i]);
    }
    __syncthreads();
    double a = a0, b = b0;
    for (u64 k = 0; k < tiles; k++) {
        u32 cur = (u32)(k & 1), nxt = cur ^ 1u;
        u64 base = (k + 1) * SUM_TILE;
        if (k + 1 < tiles) {
            for (u32 j = 0; j < SUM_PER_THREAD; j++) {
                u64 i = base + (u64)j * SUM_THREADS + tid;
                u32 o = j * SUM_THREADS + tid;
                if (i < n) produce(i, &ta[nxt][o], &tb[nxt][o]);
            }
        }
        u64 left = n - k * SUM_TILE;
        u32 m = left < SUM_TILE ? (u32)left : SUM_TILE;
        if (tid == 0) a = add_in_order(a, ta[cur], m);
        if (two && tid == 32) b = add_in_order(b, tb[cur], m);
        __syncthreads();
    }
    if (tid == 0) *out_a = a;
    if (two && tid == 32) *out_b = b;
}

// AdamW (`optim::update_tensor`) on every tensor of a model, every run, in one launch: a block per
// (tensor t, run r, chunk c of CHUNK values), in that order (tensors' chunk counts from lens[t]).
// Tensor t's p, m, v, g start at ptrs[t], ptrs[T + t], ptrs[2T + t], ptrs[3T + t] and hold each
// run's lens[t] values in turn; run r's constants for t are ks + (t * runs + r) * K_FIELDS. Each
// element is updated in place; the block then sums its chunk's Σ step² and Σ p² (after the update)
// in f64 in element order from +0.0 into out[2i], out[2i + 1] for the block's index i. A run with
// K_ACTIVE 0 keeps p, m and v and sums zero steps.
extern "C" __global__ void adamw_model(double *__restrict__ out, const u64 *__restrict__ ptrs,
                                       const u64 *__restrict__ lens, const float *__restrict__ ks,
                                       u32 tensors, u32 runs, u32 chunk, u64 segments) {
    for (u64 seg = blockIdx.x; seg < segments; seg += gridDim.x) {
        // Which (tensor, run, chunk): the tensors' segment counts in turn.
        u64 rest = seg;
        u32 t = 0;
        u64 chunks = 0;
        for (; t < tensors; t++) {
            chunks = (lens[t] + chunk - 1) / chunk;
            if (rest < chunks * runs) break;
            rest -= chunks * runs;
        }
        u64 r = rest / chunks, c = rest % chunks, len = lens[t];
        u64 begin = r * len + c * chunk;
        u64 n = (c + 1) * chunk < len ? chunk : len - c * chunk;
        float *p = (float *)ptrs[t] + begin;
        float *m = (float *)ptrs[tensors + t] + begin;
        float *v = (float *)ptrs[2 * tensors + t] + begin;
        const float *g = (const float *)ptrs[3 * tensors + t] + begin;
        const float *k = ks + ((u64)t * runs + r) * K_FIELDS;
        bool active = k[K_ACTIVE] != 0.0f;
        auto produce = [&](u64 i, double *step_sq, double *w_sq) {
            float pi = p[i];
            float s = 0.0f;
            if (active) {
                float b1 = k[K_BETA1], b2 = k[K_BETA2];
                float gi = g[i] * k[K_SCALE];
                float mi = b1 * m[i] + (1.0f - b1) * gi;
                float vi = b2 * v[i] + (1.0f - b2) * gi * gi;
                s = k[K_LR] * ((mi / k[K_BC1]) / (sqrtf(vi / k[K_BC2]) + k[K_EPS]) + k[K_DECAY] * pi);
                m[i] = mi;
                v[i] = vi;
                pi = pi - s;
                p[i] = pi;
            }
            *step_sq = (double)s * (double)s;
            *w_sq = (double)pi * (double)pi;
        };
        tile_sums(n, true, 0.0, 0.0, produce, &out[2 * seg], &out[2 * seg + 1]);
    }
}

// `optim::sum_squares` of every run's block of several tensors at once, a block per (tensor, run):
// tensor t starts at device address ptrs[t] and holds `runs` blocks of lens[t] values;
// out[t * runs + r] is run r's Σ x² in f64 in element order from -0.0 (the start of Rust's float
// `Sum`).
extern "C" __global__ void sum_squares_many(double *__restrict__ out, const u64 *__restrict__ ptrs,
                                            const u64 *__restrict__ lens, u32 tensors,
                                            u32 runs) {
    for (u64 i = blockIdx.x; i < (u64)tensors * runs; i += gridDim.x) {
        u64 t = i / runs, r = i % runs;
        const float *x = (const float *)ptrs[t] + r * lens[t];
        auto produce = [&](u64 e, double *sq, double *) {
            double w = (double)x[e];
            *sq = w * w;
        };
        tile_sums(lens[t], false, -0.0, 0.0, produce, &out[i], (double *)0);
    }
}
