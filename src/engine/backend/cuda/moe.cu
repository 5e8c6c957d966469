// Expert routing on the device for the resident forward: slots (token t, choice j) -> rows of a
// capacity-padded expert batch, without a host round trip.
//
// Expert e owns rows [e*cap, (e+1)*cap) of the batch, its slots in token order (as
// `model::expert_slots` lists them), then zero rows up to `cap`. Zero rows change no amax, so
// no code of any row-local quantization, and add nothing to a GEMM's other rows; the combine
// reads only the slots' rows.

typedef unsigned int u32;

// One thread per expert walks its run's slots in order: stable (token order) and deterministic.
// Runs stepped together own consecutive slot ranges (nk / runs each) and experts (e each):
// expert ex of run q is batch expert q*e + ex. At the shipped sizes (n*k ~ 4.5k slots a run,
// 8 experts) one pass is ~25 us; a block-wide scan would replace it for larger batches.
// slot_row[s] = (q*e + ex)*cap + rank; src_row[(q*e + ex)*cap + r] = token of the r-th slot, or
// 0xFFFFFFFF past the expert's count (a zero row). Slots whose expert id is out of range get
// slot_row 0xFFFFFFFF.
extern "C" __global__ void route_slots(const u32 *__restrict__ ids, u32 *__restrict__ slot_row,
                                       u32 *__restrict__ src_row, u32 nk, u32 k, u32 e, u32 cap,
                                       u32 runs) {
    u32 qx = blockIdx.x * blockDim.x + threadIdx.x;
    if (qx >= e * runs) return;
    u32 q = qx / e, ex = qx % e, run_slots = nk / runs;
    u32 r = 0;
    for (u32 s = q * run_slots; s < (q + 1) * run_slots; s++) {
        u32 id = ids[s];
        if (ex == 0 && id >= e) slot_row[s] = 0xFFFFFFFFu;
        if (id != ex) continue;
        if (r < cap) {
            slot_row[s] = qx * cap + r;
            src_row[qx * cap + r] = s / k;
        } else {
            slot_row[s] = 0xFFFFFFFFu; // cannot happen with cap >= every expert's count
        }
        r++;
    }
    for (; r < cap; r++) src_row[qx * cap + r] = 0xFFFFFFFFu;
}

// counts[q*e + id] = how many of run q's slots chose expert id (ids >= e are not counted), over
// zeroed counts: the largest sets the batch's capacity (integer sums, so any order gives the same).
extern "C" __global__ void expert_counts(const u32 *__restrict__ ids, u32 *__restrict__ counts,
                                         u32 nk, u32 e, u32 runs) {
    u32 run_slots = nk / runs;
    for (u32 s = blockIdx.x * blockDim.x + threadIdx.x; s < nk; s += gridDim.x * blockDim.x) {
        u32 id = ids[s];
        if (id < e) atomicAdd(&counts[(s / run_slots) * e + id], 1u);
    }
}

// dst[row] = x[src_row[row]] (d values), or zeros where src_row is 0xFFFFFFFF (or out of range).
extern "C" __global__ void gather_padded(float *__restrict__ dst, const float *__restrict__ x,
                                         const u32 *__restrict__ src_row, u32 rows, u32 d, u32 n) {
    unsigned long long total = (unsigned long long)rows * d;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        u32 row = (u32)(i / d), c = (u32)(i % d);
        u32 src = src_row[row];
        dst[i] = src < n ? x[(unsigned long long)src * d + c] : 0.0f;
    }
}
