// Expert routing on the device for the resident forward: slots (token t, choice j) -> rows of a
// capacity-padded expert batch, without a host round trip.
//
// Expert e owns rows [e*cap, (e+1)*cap) of the batch, its slots in token order (as
// `model::expert_slots` lists them), then zero rows up to `cap`. Zero rows change no amax, so
// no code of any row-local quantization, and add nothing to a GEMM's other rows; the combine
// reads only the slots' rows.

typedef unsigned int u32;

// A block per run ranks its slots chunk by chunk (ROUTE_THREADS slots, a thread each, in slot
// order): within a warp a slot's rank among its expert's slots is a ballot's count of the lanes
// before it; across the chunk's warps and the earlier chunks, an exclusive prefix of the warps'
// counts kept per expert in shared memory. So ranks follow slot order (stable, deterministic),
// as one walk over the slots would give them. Runs stepped together own consecutive slot ranges
// (nk / runs each) and experts (e each): expert ex of run q is batch expert q*e + ex.
// slot_row[s] = (q*e + ex)*cap + rank; src_row[(q*e + ex)*cap + r] = token of the r-th slot, or
// 0xFFFFFFFF past the expert's count (a zero row). Slots whose expert id is out of range get
// slot_row 0xFFFFFFFF. At most ROUTE_MAX_EXPERTS experts a run (the shared counters' room).
#define ROUTE_THREADS 1024
#define ROUTE_WARPS (ROUTE_THREADS / 32)
#define ROUTE_MAX_EXPERTS 256
extern "C" __global__ void route_slots(const u32 *__restrict__ ids, u32 *__restrict__ slot_row,
                                       u32 *__restrict__ src_row, u32 nk, u32 k, u32 e, u32 cap,
                                       u32 runs) {
    __shared__ u32 before[ROUTE_WARPS * ROUTE_MAX_EXPERTS]; // [warp][e]: its count, then its offset
    __shared__ u32 total[ROUTE_MAX_EXPERTS];                // [e]: slots ranked so far
    u32 q = blockIdx.x, tid = threadIdx.x, lane = tid & 31u, warp = tid >> 5;
    u32 run_slots = nk / runs, first = q * run_slots;
    for (u32 i = tid; i < e; i += ROUTE_THREADS) total[i] = 0;
    for (u32 c = 0; c < run_slots; c += ROUTE_THREADS) {
        for (u32 i = tid; i < ROUTE_WARPS * e; i += ROUTE_THREADS) before[i] = 0;
        __syncthreads();
        bool live = c + tid < run_slots;
        u32 s = first + c + tid;
        u32 id = live ? ids[s] : 0xFFFFFFFFu;
        u32 rank = 0; // this warp's lanes before this one with the same expert
        for (u32 ex = 0; ex < e; ex++) {
            unsigned m = __ballot_sync(0xFFFFFFFFu, id == ex);
            if (id == ex) rank = (u32)__popc(m & ((1u << lane) - 1u));
            if (lane == 0) before[warp * e + ex] = (u32)__popc(m);
        }
        __syncthreads();
        for (u32 ex = tid; ex < e; ex += ROUTE_THREADS) {
            u32 run = total[ex];
            for (u32 w = 0; w < ROUTE_WARPS; w++) {
                u32 n = before[w * e + ex];
                before[w * e + ex] = run;
                run += n;
            }
            total[ex] = run;
        }
        __syncthreads();
        if (live) {
            u32 r = id < e ? before[warp * e + id] + rank : 0xFFFFFFFFu;
            if (r < cap) {
                u32 qx = q * e + id;
                slot_row[s] = qx * cap + r;
                src_row[qx * cap + r] = s / k;
            } else {
                slot_row[s] = 0xFFFFFFFFu; // an id out of range (cap >= every expert's count)
            }
        }
        __syncthreads(); // `before` is cleared for the next chunk
    }
    for (u32 ex = 0; ex < e; ex++) {
        u32 qx = q * e + ex;
        for (u32 r = min(total[ex], cap) + tid; r < cap; r += ROUTE_THREADS) src_row[qx * cap + r] = 0xFFFFFFFFu;
    }
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
