// The resident trainer's MoE backward pieces (`model::moe_backward` around the experts' FFN), over
// the capacity-padded expert batch of moe.cu: expert e owns rows [e*cap, (e+1)*cap), slot s =
// t*k + j (token t, choice j) sits at row slot_row[s]. Same rules as backward.cu: each of the
// CPU's sums runs in one thread in the CPU's order, so the results are the CPU's bits; no float
// atomics; a slot row outside the batch gives NaN instead of an access outside a buffer.

// needs: prelude.cuh (u32/u64, NAN_F, the grid-stride and warp index helpers, the slot order)

// `model::expert_backward`'s first loop, for every slot at once. A warp per slot s: lane 0 sums
// dgate[s] = sum_c dh[t, c] * y_all[row, c] (from -0.0, in column order, as Rust's `Sum`), and
// the lanes write dy_all[row, c] = weights[s] * dh[t, c]. Rows no slot owns are not touched
// (the caller zeroes dy_all: padding rows stay zero, so they add nothing to the GEMMs).
extern "C" __global__ void expert_dy(float *__restrict__ dy_all, float *__restrict__ dgate,
                                     const float *__restrict__ dh, const float *__restrict__ y_all,
                                     const u32 *__restrict__ slot_row,
                                     const float *__restrict__ weights, u32 nk, u32 k, u32 d,
                                     u32 rows) {
    for (u64 s = gwarp(); s < nk; s += nwarps()) {
        u64 t = s / k;
        u32 row = slot_row[s];
        const float *src = dh + t * d;
        if (row >= rows) {
            if (lane() == 0) dgate[s] = NAN_F;
            continue;
        }
        if (lane() == 0) {
            float acc = -0.0f;
            for (u32 c = 0; c < d; c++) acc = acc + src[c] * y_all[(u64)row * d + c];
            dgate[s] = acc;
        }
        float w = weights[s];
        for (u32 c = lane(); c < d; c += 32) dy_all[(u64)row * d + c] = w * src[c];
    }
}

// `model::moe_backward`'s scatter: dxn[t, c] += dxe_all[slot_row[s], c] for t's k slots in
// increasing (expert id, j), the CPU's loop over experts and their token-ordered slot lists (the
// order of ops.cu's moe_combine). A thread per (token, column).
extern "C" __global__ void expert_dx_scatter(float *__restrict__ dxn,
                                             const float *__restrict__ dxe_all,
                                             const u32 *__restrict__ slot_row,
                                             const u32 *__restrict__ ids, u32 n, u32 k, u32 d,
                                             u32 rows) {
    u64 total = (u64)n * d;
    for (u64 idx = gtid(); idx < total; idx += gstride()) {
        u64 t = idx / d, c = idx % d;
        const u32 *id = ids + t * k;
        float o = dxn[idx];
        u64 last = 0;
        for (u32 step = 0; step < k; step++) {
            u32 row = slot_row[t * k + next_slot_in_expert_order(id, k, step, &last)];
            o = o + (row < rows ? dxe_all[(u64)row * d + c] : NAN_F);
        }
        dxn[idx] = o;
    }
}
