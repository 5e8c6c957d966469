// The engine's forward ops (`crate::engine::ops`) on device buffers, for the resident forward.
//
// Compiled by NVRTC with --fmad=false --ftz=false --prec-div=true --prec-sqrt=true, so every
// +, *, / and sqrtf is one correctly rounded IEEE FP32 operation, as on the CPU. Each reduction the
// CPU does in one row (rmsnorm's sum of squares, attention's `dot`, softmax sums, the router's
// weight sum) runs in one thread in the CPU's order, so those results are the CPU's bits. Only
// expf differs (CUDA's is within 2 ulp, glibc's within 1), which is why attention, SwiGLU and the
// router are held to a tolerance. No float atomics anywhere: same inputs, same bits.
//
// Indices the host cannot check without a copy (tokens, positions, gathered rows, replayed expert
// ids, attention keys) are checked here: an out-of-range index turns its output into NaN (the
// CPU would panic) instead of reading outside a buffer.

// needs: prelude.cuh (u32/u64, NAN_F, NEG_INF, the grid-stride and warp index helpers, dot8)

// out[i] = wte[tokens[i]] + wpe[positions[i]]; a thread per element.
extern "C" __global__ void embedding_forward(float *__restrict__ out, const u32 *__restrict__ tokens,
                                             const u32 *__restrict__ positions,
                                             const float *__restrict__ wte,
                                             const float *__restrict__ wpe, u32 n, u32 d, u32 vocab,
                                             u32 npos, u32 run_rows) {
    // Runs stepped together: row i belongs to run i / run_rows, whose tables follow the previous
    // run's; a PAD_ROW token (a run's padding up to the batch's rows) embeds to zeros.
    u64 total = (u64)n * d;
    for (u64 idx = gtid(); idx < total; idx += gstride()) {
        u64 i = idx / d, c = idx % d, r = i / run_rows;
        u32 t = tokens[i], p = positions[i];
        if (t == PAD_ROW) {
            out[idx] = 0.0f;
            continue;
        }
        out[idx] = (t < vocab && p < npos)
                       ? wte[(r * vocab + t) * d + c] + wpe[(r * npos + p) * d + c]
                       : NAN_F;
    }
}

// A warp per row: lane 0 sums the squares in column order (from -0.0, as Rust's `Sum` does), the
// warp writes the row.
extern "C" __global__ void rmsnorm_forward(float *__restrict__ out, float *__restrict__ rstd,
                                           const float *__restrict__ x, const float *__restrict__ g,
                                           u32 n, u32 d, float d_f, float eps, u32 run_rows) {
    for (u64 r = gwarp(); r < n; r += nwarps()) {
        const float *xr = x + r * d;
        const float *gr = g + (r / run_rows) * d;
        float s = 0.0f;
        if (lane() == 0) {
            float sum = -0.0f;
            for (u32 c = 0; c < d; c++) sum = sum + xr[c] * xr[c];
            float ms = sum / d_f;
            s = 1.0f / sqrtf(ms + eps);
            rstd[r] = s;
        }
        s = __shfl_sync(0xFFFFFFFFu, s, 0);
        for (u32 c = lane(); c < d; c += 32) out[r * d + c] = xr[c] * s * gr[c];
    }
}

// out [n, f] = silu(gate) * up on inp [n, 2f] (gate = columns 0..f); a thread per element.
extern "C" __global__ void swiglu_forward(float *__restrict__ out, const float *__restrict__ inp,
                                          u32 n, u32 f) {
    u64 total = (u64)n * f;
    for (u64 idx = gtid(); idx < total; idx += gstride()) {
        u64 i = idx / f, c = idx % f;
        float gv = inp[i * 2 * f + c], uv = inp[i * 2 * f + f + c];
        float sg = 1.0f / (1.0f + expf(-gv));
        out[idx] = gv * sg * uv;
    }
}

// A warp per (row, head). The row's probs [s] double as the score buffer: lanes compute the scores
// of keys lane, lane+32, ...; lane 0 takes the max and the sum in key order (the CPU's
// `softmax_in_place`); lanes then write P·V one output column each, summing over keys in order.
// Queries are the Q columns of q [n, 3d]; keys and values the K and V columns of kv [nk, 3d]: the
// same rows in a forward, a decoder's KV cache in a decode step.
// ctx_len [n], ctx_keys [n, s]: the row's key count and the kv row of its j-th key.
extern "C" __global__ void attention_forward(float *__restrict__ out, float *__restrict__ probs,
                                             const float *__restrict__ q,
                                             const float *__restrict__ kv,
                                             const u32 *__restrict__ ctx_len,
                                             const u32 *__restrict__ ctx_keys, u32 n, u32 nk, u32 h,
                                             u32 d, u32 s, float scale) {
    const u32 dh = d / h;
    const u64 w3 = 3ull * d;
    for (u64 item = gwarp(); item < (u64)n * h; item += nwarps()) {
        u64 i = item / h;
        u32 hi = (u32)(item % h);
        u32 len = min(ctx_len[i], s);
        const u32 *keys = ctx_keys + i * s;
        float *p = probs + item * s;
        const float *qi = q + i * w3 + hi * dh;
        for (u32 j = lane(); j < len; j += 32) {
            u32 key = keys[j];
            p[j] = key < nk ? dot8(qi, kv + key * w3 + d + hi * dh, dh) * scale : NAN_F;
        }
        __syncwarp();
        float mx = NEG_INF;
        if (lane() == 0)
            for (u32 j = 0; j < len; j++) mx = fmaxf(mx, p[j]);
        mx = __shfl_sync(0xFFFFFFFFu, mx, 0);
        for (u32 j = lane(); j < len; j += 32) p[j] = expf(p[j] - mx);
        __syncwarp();
        float inv = 0.0f;
        if (lane() == 0) {
            float sum = 0.0f;
            for (u32 j = 0; j < len; j++) sum = sum + p[j];
            inv = 1.0f / sum;
        }
        inv = __shfl_sync(0xFFFFFFFFu, inv, 0);
        for (u32 j = lane(); j < s; j += 32) p[j] = j < len ? p[j] * inv : 0.0f;
        __syncwarp();
        for (u32 c = lane(); c < dh; c += 32) {
            float o = 0.0f;
            for (u32 j = 0; j < len; j++) {
                u32 key = keys[j];
                float v = key < nk ? kv[key * w3 + 2 * d + hi * dh + c] : NAN_F;
                o = o + p[j] * v;
            }
            out[i * d + hi * dh + c] = o;
        }
        __syncwarp();
    }
}

// One row of the router: softmax of the logits into p (in place, the CPU's order), the ids either
// chosen by `select_top_k` (strict > scan, so among equal values the lower index wins) or
// replayed, then weights = p[id] / sum over the ids (sum from -0.0, in id order).
__device__ void router_row(float *p, u32 *ids, float *w, const float *l, const u32 *replay, u32 e,
                           u32 k) {
    float mx = NEG_INF;
    for (u32 i = 0; i < e; i++) {
        p[i] = l[i];
        mx = fmaxf(mx, l[i]);
    }
    float sum = 0.0f;
    for (u32 i = 0; i < e; i++) {
        float v = expf(p[i] - mx);
        p[i] = v;
        sum = sum + v;
    }
    float inv = 1.0f / sum;
    for (u32 i = 0; i < e; i++) p[i] = p[i] * inv;
    for (u32 j = 0; j < k; j++) {
        if (replay) {
            ids[j] = replay[j];
            continue;
        }
        int best = -1;
        float bv = 0.0f;
        for (u32 i = 0; i < e; i++) {
            bool taken = false;
            for (u32 m = 0; m < j; m++) taken |= ids[m] == i;
            if (taken) continue;
            float v = p[i];
            if (best < 0 || v > bv) {
                best = (int)i;
                bv = v;
            }
        }
        ids[j] = best < 0 ? 0u : (u32)best;
    }
    float ws = -0.0f;
    for (u32 j = 0; j < k; j++) ws = ws + (ids[j] < e ? p[ids[j]] : NAN_F);
    for (u32 j = 0; j < k; j++) w[j] = (ids[j] < e ? p[ids[j]] : NAN_F) / ws;
}

// A thread per row (E is 8 at the shipped sizes).
extern "C" __global__ void router_topk(float *__restrict__ probs, u32 *__restrict__ ids,
                                       float *__restrict__ weights,
                                       const float *__restrict__ logits, u32 n, u32 e, u32 k) {
    for (u64 r = gtid(); r < n; r += gstride())
        router_row(probs + r * e, ids + r * k, weights + r * k, logits + r * e, nullptr, e, k);
}

extern "C" __global__ void router_replay(float *__restrict__ probs, u32 *__restrict__ ids,
                                         float *__restrict__ weights,
                                         const float *__restrict__ logits,
                                         const u32 *__restrict__ replay, u32 n, u32 e, u32 k) {
    for (u64 r = gtid(); r < n; r += gstride())
        router_row(probs + r * e, ids + r * k, weights + r * k, logits + r * e, replay + r * k, e,
                   k);
}

// dst[i] += src[i].
extern "C" __global__ void add_into(float *__restrict__ dst, const float *__restrict__ src,
                                    u64 len) {
    for (u64 i = gtid(); i < len; i += gstride()) dst[i] = dst[i] + src[i];
}

// The end of `moe_forward` for token t: o = shared_y[t]; then its k choices in (expert id, slot)
// order, the order the CPU's loop over experts and their slot lists visits them,
// o += weights[s] * y_all[slot_row[s]]; then o += x[t]. A thread per element.
extern "C" __global__ void moe_combine(float *__restrict__ out, const float *__restrict__ shared_y,
                                       const float *__restrict__ y_all,
                                       const u32 *__restrict__ slot_row,
                                       const u32 *__restrict__ ids,
                                       const float *__restrict__ weights,
                                       const float *__restrict__ x, u32 n, u32 k, u32 d,
                                       u32 y_rows) {
    u64 total = (u64)n * d;
    for (u64 idx = gtid(); idx < total; idx += gstride()) {
        u64 t = idx / d, c = idx % d;
        const u32 *id = ids + t * k;
        float o = shared_y[idx];
        u64 last = 0;
        for (u32 step = 0; step < k; step++) {
            u64 s = t * k + next_slot_in_expert_order(id, k, step, &last);
            u32 row = slot_row[s];
            float v = row < y_rows ? y_all[(u64)row * d + c] : NAN_F;
            o = o + weights[s] * v;
        }
        out[idx] = o + x[idx];
    }
}
