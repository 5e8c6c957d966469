// The optimizer's arithmetic on the device (`engine::optim`), for training state kept on the GPU:
// the AdamW update, its sums, and the gradients' squared norms, over a tensor that holds every
// run's copy back to back (`len` values a run). Same rules as backward.cu: each of the CPU's sums
// runs in one thread in the CPU's order, and NVRTC gets --fmad=false, so the results are the
// CPU's bits.

// needs: prelude.cuh (u32/u64, the grid-stride index helpers)

// Fields of one run's constants (`engine::optim::AdamStep`, then whether the run takes the step:
// a run with K_ACTIVE 0 keeps its p, m and v and sums zeros), 9 floats a run.
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

// `optim::update_tensor`'s element update, run r's block with run r's constants `ks + 8r`; `step`
// keeps each element's update for the sums below.
extern "C" __global__ void adamw_update(float *__restrict__ p, float *__restrict__ m,
                                        float *__restrict__ v, float *__restrict__ step,
                                        const float *__restrict__ g, const float *__restrict__ ks,
                                        u64 len, u32 runs) {
    u64 total = len * runs;
    for (u64 idx = gtid(); idx < total; idx += gstride()) {
        const float *k = ks + (idx / len) * K_FIELDS;
        if (k[K_ACTIVE] == 0.0f) {
            step[idx] = 0.0f;
            continue;
        }
        float b1 = k[K_BETA1], b2 = k[K_BETA2];
        float gi = g[idx] * k[K_SCALE];
        float mi = b1 * m[idx] + (1.0f - b1) * gi;
        float vi = b2 * v[idx] + (1.0f - b2) * gi * gi;
        float pi = p[idx];
        float s = k[K_LR] * ((mi / k[K_BC1]) / (sqrtf(vi / k[K_BC2]) + k[K_EPS]) + k[K_DECAY] * pi);
        m[idx] = mi;
        v[idx] = vi;
        p[idx] = pi - s;
        step[idx] = s;
    }
}

// The update's sums, a thread per (run, chunk of `chunk` values of the run's block): Σ step² and
// Σ p² (after the update) in f64, in element order from +0.0, as `optim::update_tensor` sums a
// chunk. out[2i], out[2i + 1] for i = r * chunks + c.
extern "C" __global__ void adamw_chunk_sums(double *__restrict__ out,
                                            const float *__restrict__ step,
                                            const float *__restrict__ p, u64 len, u32 runs,
                                            u32 chunk) {
    u64 chunks = (len + chunk - 1) / chunk;
    for (u64 i = gtid(); i < chunks * runs; i += gstride()) {
        u64 r = i / chunks, c = i % chunks;
        u64 begin = r * len + c * chunk;
        u64 end = r * len + ((c + 1) * chunk < len ? (c + 1) * chunk : len);
        double upd = 0.0, wsq = 0.0;
        for (u64 e = begin; e < end; e++) {
            double s = (double)step[e], w = (double)p[e];
            upd = upd + s * s;
            wsq = wsq + w * w;
        }
        out[2 * i] = upd;
        out[2 * i + 1] = wsq;
    }
}

// `optim::sum_squares` of each run's block, a thread per run: Σ x² in f64 in element order from
// -0.0 (the start of Rust's float `Sum`).
extern "C" __global__ void sum_squares(double *__restrict__ out, const float *__restrict__ x,
                                       u64 len, u32 runs) {
    for (u64 r = gtid(); r < runs; r += gstride()) {
        double acc = -0.0;
        for (u64 e = r * len; e < (r + 1) * len; e++) {
            double w = (double)x[e];
            acc = acc + w * w;
        }
        out[r] = acc;
    }
}

// `sum_squares` of every run's block of several tensors at once, a thread per (tensor, run):
// tensor t starts at device address ptrs[t] and holds `runs` blocks of lens[t] values;
// out[t * runs + r] is run r's sum, in element order from -0.0 as above.
extern "C" __global__ void sum_squares_many(double *__restrict__ out, const u64 *__restrict__ ptrs,
                                            const u64 *__restrict__ lens, u32 tensors,
                                            u32 runs) {
    for (u64 i = gtid(); i < (u64)tensors * runs; i += gstride()) {
        u64 t = i / runs, r = i % runs;
        const float *x = (const float *)ptrs[t] + r * lens[t];
        double acc = -0.0;
        for (u64 e = 0; e < lens[t]; e++) {
            double w = (double)x[e];
            acc = acc + w * w;
        }
        out[i] = acc;
    }
}
