// Shared by the engine-op kernel files (ops.cu, backward.cu): `CudaDevice::compile_with_prelude`
// puts this text in front of each (NVRTC gets no include path at run time), and
// scripts/kernel-check.py does the same for files that say `// needs: prelude.cuh`.

typedef unsigned int u32;
typedef unsigned long long u64;

#define NAN_F __int_as_float(0x7FC00000)  // the CPU's f32::NAN
#define NEG_INF __int_as_float(0xFF800000)
// A token id marking a padding row (a run's rows padded up to the batch's): it embeds to zeros.
#define PAD_ROW 0xFFFFFFFFu

__device__ __forceinline__ u64 gtid() { return (u64)blockIdx.x * blockDim.x + threadIdx.x; }
__device__ __forceinline__ u64 gstride() { return (u64)gridDim.x * blockDim.x; }
__device__ __forceinline__ u32 lane() { return threadIdx.x & 31u; }
__device__ __forceinline__ u64 gwarp() { return gtid() >> 5; }
__device__ __forceinline__ u64 nwarps() { return gstride() >> 5; }

// `ops::dot`: 8 partial sums over chunks of 8, combined pairwise in a fixed order, then the
// remainder added one by one.
__device__ float dot8(const float *a, const float *b, u32 len) {
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    u32 chunks = len / 8;
    for (u32 c = 0; c < chunks; c++) {
#pragma unroll
        for (int l = 0; l < 8; l++) acc[l] = acc[l] + a[c * 8 + l] * b[c * 8 + l];
    }
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (u32 i = chunks * 8; i < len; i++) s = s + a[i] * b[i];
    return s;
}

// The j of token t's next slot in increasing (expert id, j) order, after the one `*last` holds
// (step 0: the first): the order of the CPU's loops over experts and their token-ordered slot
// lists (`moe_forward`'s combine, `moe_backward`'s scatter). `id` is the token's k expert ids.
__device__ __forceinline__ u32 next_slot_in_expert_order(const u32 *id, u32 k, u32 step, u64 *last) {
    u64 best = ~0ull;
    for (u32 j = 0; j < k; j++) {
        u64 key = ((u64)id[j] << 32) | j;
        if ((step == 0 || key > *last) && key < best) best = key;
    }
    *last = best;
    return (u32)(best & 0xFFFFFFFFull);
}
