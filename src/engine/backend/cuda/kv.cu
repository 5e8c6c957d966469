// The resident decoder's KV cache (`resident::DeviceKvCache`): one buffer per layer of
// `seqs x capacity` rows of 3d floats, sequence i's position p at row i * capacity + p. The K and
// V columns hold BF16-rounded values (as `model::KvCache` stores them); the Q columns are never
// read from the cache.

typedef unsigned int u32;
typedef unsigned long long u64;

// cache[(i * capacity + pos + j) * w + c] = x[(i * per_seq + j) * w + c] for the n = seqs x per_seq
// rows of x (sequence-major: per_seq consecutive positions of each sequence, from pos), c < w: a
// decode step's rows (per_seq 1) or a prompt's (per_seq its length) into the cache. A thread per
// element.
extern "C" __global__ void kv_store(float *__restrict__ cache, const float *__restrict__ x, u32 n,
                                    u32 capacity, u32 pos, u32 w, u32 per_seq) {
    u64 total = (u64)n * w;
    for (u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (u64)gridDim.x * blockDim.x) {
        u64 r = idx / w, c = idx % w;
        u64 i = r / per_seq, j = r % per_seq;
        cache[((u64)i * capacity + pos + j) * w + c] = x[idx];
    }
}
