// The resident decoder's KV cache (`resident::DeviceKvCache`): one buffer per layer of
// `seqs x capacity` rows of 3d floats, sequence i's position p at row i * capacity + p. The K and
// V columns hold BF16-rounded values (as `model::KvCache` stores them); the Q columns are never
// read from the cache.

typedef unsigned int u32;
typedef unsigned long long u64;

// cache[(i * capacity + pos) * w + c] = x[i * w + c] for i < n, c < w: one decode step's rows into
// the cache. A thread per element.
extern "C" __global__ void kv_store(float *__restrict__ cache, const float *__restrict__ x, u32 n,
                                    u32 capacity, u32 pos, u32 w) {
    u64 total = (u64)n * w;
    for (u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (u64)gridDim.x * blockDim.x) {
        u64 i = idx / w, c = idx % w;
        cache[((u64)i * capacity + pos) * w + c] = x[idx];
    }
}
