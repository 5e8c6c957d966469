// Backward counterparts of ops.cu, for the resident trainer: the same rules (each sum the CPU
// runs in one row or one column runs in one thread in the CPU's order, so those results are the
// CPU's bits; ops that call expf are held to a tolerance; no float atomics anywhere). Every
// kernel accumulates (+=) into its gradient buffers, as `engine::ops`'s backward functions do.
// An out-of-range index turns its output into NaN instead of reading or writing outside a buffer.

// needs: prelude.cuh (u32/u64, NAN_F, the grid-stride and warp index helpers, dot8)

// ops::rmsnorm_backward, dx part. A warp per row: lane 0 sums dout*g*x in column order (from
// -0.0, as Rust's `Sum`), then dx[c] += s*dout[c]*g[c] - c3*x[c] with c3 = s*s*s*dot/d.
extern "C" __global__ void rmsnorm_backward_dx(float *__restrict__ dx, const float *__restrict__ dout,
                                               const float *__restrict__ x,
                                               const float *__restrict__ gain,
                                               const float *__restrict__ rstd, u32 n, u32 d,
                                               float d_f, u32 run_rows) {
    for (u64 r = gwarp(); r < n; r += nwarps()) {
        const float *dor = dout + r * d, *xr = x + r * d, *g = gain + (r / run_rows) * d;
        float s = rstd[r];
        float c3 = 0.0f;
        if (lane() == 0) {
            float dot = -0.0f;
            for (u32 c = 0; c < d; c++) dot = dot + dor[c] * g[c] * xr[c];
            c3 = s * s * s * dot / d_f;
        }
        c3 = __shfl_sync(0xFFFFFFFFu, c3, 0);
        for (u32 c = lane(); c < d; c += 32) dx[r * d + c] = dx[r * d + c] + (s * dor[c] * g[c] - c3 * xr[c]);
    }
}

// ops::rmsnorm_backward, gain part: dg[c] += dout[r, c]*x[r, c]*rstd[r] over rows in order. A
// block per (run, 32 columns): run q's rows are q*run_rows.., its gains dg[q*d..]. Each column's
// sum is one chain of adds in row order, in lane c of warp 0. While that warp adds up one tile of
// DG_TILE rows, the whole block forms the next tile's terms into shared memory (coalesced loads,
// many in flight), so the chain never waits on global memory.
#define DG_TILE 128
#define DG_WARPS 8

// Adds column terms t[0], t[32], ... (n of them) to `acc` in order, loading eight ahead.
__device__ __forceinline__ float add_column_in_order(float acc, const float *t, u32 n) {
    u32 j = 0;
    if (n >= 8) {
        float cur[8];
#pragma unroll
        for (u32 i = 0; i < 8; i++) cur[i] = t[i * 32];
        for (j = 8; j + 8 <= n; j += 8) {
            float nxt[8];
#pragma unroll
            for (u32 i = 0; i < 8; i++) nxt[i] = t[(j + i) * 32];
#pragma unroll
            for (u32 i = 0; i < 8; i++) {
                acc = acc + cur[i];
                cur[i] = nxt[i];
            }
        }
#pragma unroll
        for (u32 i = 0; i < 8; i++) acc = acc + cur[i];
    }
    for (; j < n; j++) acc = acc + t[j * 32];
    return acc;
}

extern "C" __global__ void rmsnorm_backward_dg(float *__restrict__ dg, const float *__restrict__ dout,
                                               const float *__restrict__ x,
                                               const float *__restrict__ rstd, u32 n, u32 d,
                                               u32 run_rows) {
    __shared__ float tile[2][DG_TILE * 32];
    u64 runs = n / run_rows, chunks = (d + 31) / 32;
    u32 ln = threadIdx.x % 32, warp = threadIdx.x / 32;
    u32 tiles = (run_rows + DG_TILE - 1) / DG_TILE;
    for (u64 blk = blockIdx.x; blk < runs * chunks; blk += gridDim.x) {
        u64 q = blk / chunks, c = (blk % chunks) * 32 + ln;
        bool col = c < d;
        const u64 first = q * run_rows;
        // Tile k's terms: rows k*DG_TILE.. of the run, warp w forming rows w, w + DG_WARPS, ...
        auto form = [&](u32 k, float *t) {
            for (u32 j = warp; j < DG_TILE; j += DG_WARPS) {
                u64 r = (u64)k * DG_TILE + j;
                if (col && r < run_rows) {
                    u64 g = first + r;
                    t[j * 32 + ln] = dout[g * d + c] * x[g * d + c] * rstd[g];
                }
            }
        };
        float acc = 0.0f;
        if (warp == 0 && col) acc = dg[q * d + c];
        form(0, tile[0]);
        __syncthreads();
        for (u32 k = 0; k < tiles; k++) {
            u32 cur = k & 1u;
            if (k + 1 < tiles) form(k + 1, tile[cur ^ 1u]);
            if (warp == 0 && col) {
                u32 left = run_rows - k * DG_TILE;
                acc = add_column_in_order(acc, &tile[cur][ln], left < DG_TILE ? left : DG_TILE);
            }
            __syncthreads();
        }
        if (warp == 0 && col) dg[q * d + c] = acc;
    }
}

// ops::swiglu_backward: dinp [n, 2f] += from dout [n, f]; silu'(g) = sg*(1 + g*(1 - sg)). A thread
// per (row, column).
extern "C" __global__ void swiglu_backward(float *__restrict__ dinp, const float *__restrict__ dout,
                                           const float *__restrict__ inp, u32 n, u32 f) {
    u64 total = (u64)n * f;
    for (u64 idx = gtid(); idx < total; idx += gstride()) {
        u64 i = idx / f, c = idx % f;
        float gv = inp[i * 2 * f + c], uv = inp[i * 2 * f + f + c], dy = dout[idx];
        float sg = 1.0f / (1.0f + expf(-gv));
        dinp[i * 2 * f + c] = dinp[i * 2 * f + c] + dy * uv * sg * (1.0f + gv * (1.0f - sg));
        dinp[i * 2 * f + f + c] = dinp[i * 2 * f + f + c] + dy * gv * sg;
    }
}

// ops::router_backward: for row r, s = sum_j dw[j]*w[j] (from -0.0, in j order), then
// dlogits[r, id_j] += w_j*(dw_j - s) in j order. A thread per row; a row with an id >= e becomes NaN.
extern "C" __global__ void router_backward(float *__restrict__ dlogits, const float *__restrict__ dw,
                                           const u32 *__restrict__ ids, const float *__restrict__ w,
                                           u32 n, u32 e, u32 k) {
    for (u64 r = gtid(); r < n; r += gstride()) {
        const float *dwr = dw + r * k, *wr = w + r * k;
        const u32 *idr = ids + r * k;
        float *dl = dlogits + r * e;
        bool bad = false;
        for (u32 j = 0; j < k; j++) bad = bad || idr[j] >= e;
        if (bad) {
            for (u32 c = 0; c < e; c++) dl[c] = NAN_F;
            continue;
        }
        float s = -0.0f;
        for (u32 j = 0; j < k; j++) s = s + dwr[j] * wr[j];
        for (u32 j = 0; j < k; j++) dl[idr[j]] = dl[idr[j]] + wr[j] * (dwr[j] - s);
    }
}

// ops::embedding_backward: dwte[tokens[i]] += dout[i], dwpe[positions[i]] += dout[i], rows in
// order (the CPU's sequential scatter-add). A thread per (run, column), so every element's sum
// runs in row order; run q's rows are q*run_rows.. and its tables follow run q-1's. Padding rows
// (PAD_ROW) add nothing; a token or position out of range skips its add and poisons the column
// with NaN.
extern "C" __global__ void embedding_backward(float *__restrict__ dwte, float *__restrict__ dwpe,
                                              const float *__restrict__ dout,
                                              const u32 *__restrict__ tokens,
                                              const u32 *__restrict__ positions, u32 n, u32 d,
                                              u32 vocab, u32 npos, u32 run_rows) {
    u64 runs = n / run_rows;
    for (u64 qc = gtid(); qc < runs * d; qc += gstride()) {
        u64 q = qc / d, c = qc % d;
        float *te = dwte + q * vocab * d, *pe = dwpe + q * npos * d;
        bool bad = false;
        for (u64 i = q * run_rows; i < (q + 1) * run_rows; i++) {
            u32 t = tokens[i], p = positions[i];
            if (t == PAD_ROW) continue;
            float v = dout[i * d + c];
            if (t < vocab) te[(u64)t * d + c] = te[(u64)t * d + c] + v; else bad = true;
            if (p < npos) pe[(u64)p * d + c] = pe[(u64)p * d + c] + v; else bad = true;
        }
        if (bad) {
            if (vocab > 0) te[c] = NAN_F;
            if (npos > 0) pe[c] = NAN_F;
        }
    }
}

// ops::attention_backward, part 1: a warp per (query row i, head). dP_j = dO_i . V_key(j);
// sum = P . dP (the CPU's `dot`); dS_j = P_j (dP_j - sum) scale, kept in ds [n, h, S] for part 2;
// then dQ_i += sum_j dS_j K_key(j) in j order (a lane per column). Keys >= n poison the row.
extern "C" __global__ void attention_backward_dq(float *__restrict__ dqkv, float *__restrict__ ds,
                                                 const float *__restrict__ dout,
                                                 const float *__restrict__ qkv,
                                                 const float *__restrict__ probs,
                                                 const u32 *__restrict__ ctx_len,
                                                 const u32 *__restrict__ ctx_keys, u32 n, u32 h,
                                                 u32 d, u32 s, float scale) {
    const u32 dh = d / h;
    const u64 w3 = 3ull * d;
    for (u64 item = gwarp(); item < (u64)n * h; item += nwarps()) {
        u64 i = item / h;
        u32 hi = (u32)(item % h);
        u32 len = min(ctx_len[i], s);
        const u32 *keys = ctx_keys + i * s;
        const float *p = probs + item * s;
        float *dsr = ds + item * s;
        const float *d_o = dout + i * d + hi * dh;
        for (u32 j = lane(); j < len; j += 32) {
            u32 key = keys[j];
            dsr[j] = key < n ? dot8(d_o, qkv + key * w3 + 2 * d + hi * dh, dh) : NAN_F;
        }
        __syncwarp();
        float sum = 0.0f;
        if (lane() == 0) sum = dot8(p, dsr, len);
        sum = __shfl_sync(0xFFFFFFFFu, sum, 0);
        for (u32 j = lane(); j < len; j += 32) dsr[j] = p[j] * (dsr[j] - sum) * scale;
        __syncwarp();
        for (u32 c = lane(); c < dh; c += 32) {
            float *dq = dqkv + i * w3 + hi * dh + c;
            float acc = *dq;
            for (u32 j = 0; j < len; j++) {
                u32 key = keys[j];
                acc = acc + dsr[j] * (key < n ? qkv[key * w3 + d + hi * dh + c] : NAN_F);
            }
            *dq = acc;
        }
        __syncwarp();
    }
}

// ops::attention_backward, part 2: a warp per (key row k, head). The query rows of k's layout
// group (group_first[k] .. group_end[k]) that attend to k add, in row order, dS_ij Q_i to dK_k
// and P_ij dO_i to dV_k (a lane per column): the CPU's order, since it walks a group's query rows
// in order and each attends to a key once.
extern "C" __global__ void attention_backward_dkv(float *__restrict__ dqkv,
                                                  const float *__restrict__ ds,
                                                  const float *__restrict__ dout,
                                                  const float *__restrict__ qkv,
                                                  const float *__restrict__ probs,
                                                  const u32 *__restrict__ ctx_len,
                                                  const u32 *__restrict__ ctx_keys,
                                                  const u32 *__restrict__ group_first,
                                                  const u32 *__restrict__ group_end, u32 n, u32 h,
                                                  u32 d, u32 s) {
    const u32 dh = d / h;
    const u64 w3 = 3ull * d;
    for (u64 item = gwarp(); item < (u64)n * h; item += nwarps()) {
        u32 k = (u32)(item / h), hi = (u32)(item % h);
        u32 first = group_first[k], end = min(group_end[k], n);
        for (u32 c0 = 0; c0 < dh; c0 += 32) {
            u32 c = c0 + lane();
            float dk = 0.0f, dv = 0.0f;
            if (c < dh) {
                dk = dqkv[(u64)k * w3 + d + hi * dh + c];
                dv = dqkv[(u64)k * w3 + 2 * d + hi * dh + c];
            }
            for (u32 i = first; i < end; i++) {
                u32 len = min(ctx_len[i], s);
                // The lane that holds k in row i's context (at most one: keys are distinct).
                u32 hit = 0;
                for (u32 j0 = 0; j0 < len; j0 += 32) {
                    u32 j = j0 + lane();
                    hit |= __ballot_sync(0xFFFFFFFFu, j < len && ctx_keys[(u64)i * s + j] == k);
                    if (hit) {
                        u32 jj = j0 + (__ffs(hit) - 1);
                        u64 pr = ((u64)i * h + hi) * s + jj;
                        if (c < dh) {
                            dk = dk + ds[pr] * qkv[(u64)i * w3 + hi * dh + c];
                            dv = dv + probs[pr] * dout[(u64)i * d + hi * dh + c];
                        }
                        break;
                    }
                }
            }
            if (c < dh) {
                dqkv[(u64)k * w3 + d + hi * dh + c] = dk;
                dqkv[(u64)k * w3 + 2 * d + hi * dh + c] = dv;
            }
        }
    }
}
