// lockstep's quantizers as CUDA kernels, compiled at run time by NVRTC.
//
// Every function here is a line-for-line port of `src/formats/` (the one quantizer), and the test
// `cuda_quantizer_matches_cpu` checks the bytes against it. The arithmetic must stay IEEE FP32:
// the module is compiled with --fmad=false --ftz=false --prec-div=true --prec-sqrt=true (no
// fast-math, no approximate reciprocals), and every constant that Rust computes in FP32 (1/448,
// 1/6, ...) is passed in from the host rather than folded here.
//
// Layout conventions (see `formats::tensor`): the input is the blocked view, row-major, `rows x
// cols`; blocks run along rows. Codes are one byte per element (FP4: two per byte, element 2i in
// the low nibble; BF16: two bytes little-endian). Stats are three u64 counters: elements,
// saturated, underflowed, with the CPU's exact definitions.

typedef unsigned int u32;
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned long long u64;

#define F32_NAN_BITS 0x7FC00000u
#define FLT_MAX_F 3.40282346638528859812e+38f

__device__ __forceinline__ u32 fbits(float x) { return __float_as_uint(x); }
__device__ __forceinline__ float bitsf(u32 u) { return __uint_as_float(u); }
__device__ __forceinline__ bool is_nan(float x) { return (fbits(x) & 0x7FFFFFFFu) > 0x7F800000u; }
__device__ __forceinline__ bool is_finite(float x) { return (fbits(x) & 0x7FFFFFFFu) < 0x7F800000u; }

// ---- element codecs (formats::{bf16, fp8, e2m1, e8m0, minifloat}) -------------------------------

// minifloat::round_magnitude: RNE of a finite FP32 magnitude to a small float's magnitude code.
__device__ u32 round_magnitude(u32 abs_bits, u32 mbits, int bias) {
    int exp_field = (int)(abs_bits >> 23);
    if (exp_field == 0) return 0;
    u32 sig = (1u << 23) | (abs_bits & 0x7FFFFFu);
    int e = exp_field - 127;
    int min_normal_exp = 1 - bias;
    u32 base, shift, kept;
    if (e >= min_normal_exp) {
        base = ((u32)(e + bias)) << mbits;
        shift = 23 - mbits;
        kept = (sig & 0x7FFFFFu) >> shift;
    } else {
        int s = 23 - (int)mbits + (min_normal_exp - e);
        if (s > 24) return 0;
        base = 0;
        shift = (u32)s;
        kept = sig >> shift;
    }
    u32 rem = sig & ((1u << shift) - 1u);
    u32 half = 1u << (shift - 1);
    u32 code = base + kept;
    return (rem > half || (rem == half && (code & 1u))) ? code + 1u : code;
}

// fp8::e4m3_from_f32_sat (branch-free fast path).
__device__ __forceinline__ u8 e4m3_sat(float x) {
    u32 u = fbits(x);
    float a = fminf(bitsf(u & 0x7FFFFFFFu), 448.0f);
    u32 ab = fbits(a);
    u32 normal = (ab - (120u << 23) + (0x7FFFFu + ((ab >> 20) & 1u))) >> 20;
    u32 sub = fbits(a * 512.0f + 8388608.0f) - 0x4B000000u;
    u32 mag = ab < (121u << 23) ? sub : normal;
    u8 code = (u8)(((u >> 24) & 0x80u) | (mag & 0xFFu));
    return is_nan(x) ? (u8)0x7F : code;
}

// fp8::e5m2_from_f32_sat.
__device__ __forceinline__ u8 e5m2_sat(float x) {
    if (is_nan(x)) return 0x7E;
    u32 u = fbits(x);
    u32 abs_bits = u & 0x7FFFFFFFu;
    u32 mag = abs_bits >= 0x7F800000u ? 0x7Bu : min(round_magnitude(abs_bits, 2, 15), 0x7Bu);
    return (u8)(((u >> 24) & 0x80u) | mag);
}

// fp8::e4m3_to_f32 (exact).
__device__ __forceinline__ float e4m3_decode(u32 c) {
    u32 e = (c >> 3) & 0xFu, m = c & 7u;
    float mag;
    if (e == 15u && m == 7u) return bitsf(F32_NAN_BITS);
    if (e == 0u) mag = (float)m * (1.0f / 512.0f);
    else mag = bitsf(((e + 120u) << 23) | (m << 20));
    return (c & 0x80u) ? -mag : mag;
}

// e2m1::e2m1_from_f32 with the TE reference convention (-0.0 and NaN -> code 0).
__device__ __forceinline__ u32 e2m1_te(float x) {
    u32 u = fbits(x);
    float a = fminf(bitsf(u & 0x7FFFFFFFu), 6.0f);
    u32 ab = fbits(a);
    u32 normal = (ab - (126u << 23) + (0x1FFFFFu + ((ab >> 22) & 1u))) >> 22;
    u32 sub = fbits(a * 2.0f + 8388608.0f) - 0x4B000000u;
    u32 mag = ab < (127u << 23) ? sub : normal;
    u32 code = ((u >> 28) & 8u) | (mag & 0xFFu);
    if (is_nan(x) || u == 0x80000000u) return 0;
    return code;
}

// bf16::bf16_from_f32.
__device__ __forceinline__ u16 bf16_rne(float x) {
    u32 u = fbits(x);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (u16)((u >> 16) | 0x0040u);
    u32 lsb = (u >> 16) & 1u;
    return (u16)((u + 0x7FFFu + lsb) >> 16);
}

// e8m0::e8m0_ceil_from_f32 (TE float_to_e8m0).
__device__ __forceinline__ u32 e8m0_ceil(float v) {
    if (is_nan(v)) return 0xFF;
    u32 u = fbits(v);
    if ((u & 0x7FFFFFFFu) == 0x7F800000u) return 0xFE;
    if ((u & 0x7FFFFFFFu) == 0) return 0;
    u32 e = (u >> 23) & 0xFFu, m = u & 0x7FFFFFu;
    bool bump = m > 0 && e != 0xFEu && !(e == 0 && m <= 0x400000u);
    return (e + (bump ? 1u : 0u)) & 0xFFu;
}

// e8m0::e8m0_reciprocal: 2^(127-b).
__device__ __forceinline__ float e8m0_rcp(u32 b) {
    if (b == 0xFFu) return bitsf(F32_NAN_BITS);
    if (b == 254u) return bitsf(0x00400000u);
    return bitsf((254u - b) << 23);
}

// Ordering key of |x| with NaN propagating: max over keys is `amax_nan_propagating`
// (canonical NaN 0x7FC00000 wins over every number, as f32::NAN does on the CPU).
__device__ __forceinline__ u32 amax_key(float x) {
    return is_nan(x) ? F32_NAN_BITS : (fbits(x) & 0x7FFFFFFFu);
}

// ---- stats ----------------------------------------------------------------------------------------

// Block-wide sum of three counters, one atomic per counter per thread block.
__device__ void flush_stats(u64 *stats, u32 el, u32 sat, u32 under) {
    __shared__ u32 s_el, s_sat, s_under;
    if (threadIdx.x == 0) { s_el = 0; s_sat = 0; s_under = 0; }
    __syncthreads();
    for (int o = 16; o > 0; o >>= 1) {
        el += __shfl_xor_sync(0xFFFFFFFFu, el, o);
        sat += __shfl_xor_sync(0xFFFFFFFFu, sat, o);
        under += __shfl_xor_sync(0xFFFFFFFFu, under, o);
    }
    if ((threadIdx.x & 31) == 0) {
        if (el) atomicAdd(&s_el, el);
        if (sat) atomicAdd(&s_sat, sat);
        if (under) atomicAdd(&s_under, under);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        if (s_el) atomicAdd(&stats[0], (u64)s_el);
        if (s_sat) atomicAdd(&stats[1], (u64)s_sat);
        if (s_under) atomicAdd(&stats[2], (u64)s_under);
    }
}

// ---- BF16 -----------------------------------------------------------------------------------------

extern "C" __global__ void bf16_quantize(const float *__restrict__ x, u16 *__restrict__ codes,
                                         u64 n, u64 *stats) {
    u32 el = 0, sat = 0, under = 0;
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (; i < n; i += stride) {
        float v = x[i];
        u16 c = bf16_rne(v);
        codes[i] = c;
        el += 1;
        sat += (is_finite(v) && (c & 0x7FFFu) == 0x7F80u) ? 1u : 0u;
        under += (v != 0.0f && (c & 0x7FFFu) == 0u) ? 1u : 0u;
    }
    flush_stats(stats, el, sat, under);
}

// ---- MXFP8 ----------------------------------------------------------------------------------------
// Eight threads per 32-element block, four elements (one float4) each; `n` is a multiple of 32.
// elem: 0 = E4M3, 1 = E5M2. rule: 0 = TE ceil, 1 = OCP floor.

__device__ __forceinline__ u8 fp8_encode(float s, int elem) { return elem == 0 ? e4m3_sat(s) : e5m2_sat(s); }

__device__ __forceinline__ int floor_log2(float a) {
    u32 u = fbits(a);
    int e = (int)((u >> 23) & 0xFFu);
    if (e != 0) return e - 127;
    return (31 - __clz((int)(u & 0x7FFFFFu))) - 149;
}

extern "C" __global__ void mxfp8_quantize(const float4 *__restrict__ x, u32 *__restrict__ codes,
                                          u8 *__restrict__ scales, u64 n4, int elem, int rule,
                                          float max_elem, float rcp_max, int emax, u64 *stats) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    bool valid = i < n4;
    float4 v = valid ? x[i] : make_float4(0.f, 0.f, 0.f, 0.f);
    float vs[4] = {v.x, v.y, v.z, v.w};
    u32 el = 0, sat = 0, under = 0;
    u32 packed = 0;
    u32 scale;
    if (rule == 0) {
        // amax_ignoring_nan: NaN compares false and is skipped.
        float m = 0.0f;
        for (int k = 0; k < 4; k++) { float a = fabsf(vs[k]); m = a > m ? a : m; }
        for (int o = 4; o > 0; o >>= 1) { float p = __shfl_xor_sync(0xFFFFFFFFu, m, o); m = p > m ? p : m; }
        scale = e8m0_ceil(m * rcp_max);
        float inv = e8m0_rcp(scale);
        for (int k = 0; k < 4; k++) {
            float s = vs[k] * inv;
            u32 c = fp8_encode(s, elem);
            sat += (fabsf(s) > max_elem && is_finite(vs[k])) ? 1u : 0u;
            under += ((c & 0x7Fu) == 0 && vs[k] != 0.0f) ? 1u : 0u;
            packed |= c << (8 * k);
        }
        el = 4;
    } else {
        float m = 0.0f;
        u32 nan = 0;
        for (int k = 0; k < 4; k++) { nan |= is_nan(vs[k]) ? 1u : 0u; m = fmaxf(m, fabsf(vs[k])); }
        for (int o = 4; o > 0; o >>= 1) {
            m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
            nan |= __shfl_xor_sync(0xFFFFFFFFu, nan, o);
        }
        int e = m == 0.0f ? -126 : floor_log2(m);
        int shared = e - emax;
        if (nan || !is_finite(m) || shared > 127) {
            // The whole block is NaN: scale 0xFF, codes 0x7F, no element counted (as on the CPU).
            scale = 0xFF;
            packed = 0x7F7F7F7Fu;
        } else {
            scale = (u32)(max(shared, -127) + 127);
            int sh = max(shared, -127);
            double mul = ldexp(1.0, -sh);
            for (int k = 0; k < 4; k++) {
                float s = (float)((double)vs[k] * mul);
                u32 c = fp8_encode(s, elem);
                sat += (fabsf(s) > max_elem && is_finite(vs[k])) ? 1u : 0u;
                under += ((c & 0x7Fu) == 0 && vs[k] != 0.0f && is_finite(vs[k])) ? 1u : 0u;
                packed |= c << (8 * k);
            }
            el = 4;
        }
    }
    if (valid) {
        codes[i] = packed;
        if ((i & 7) == 0) scales[i >> 3] = (u8)scale;
    } else {
        el = sat = under = 0;
    }
    flush_stats(stats, el, sat, under);
}

// ---- NVFP4 ----------------------------------------------------------------------------------------

// Per (row, shard) amax keys of a `rows x cols` tensor cut into `shards` equal slices along cols:
// one thread block per (row, shard). With `tensor_keys` set, also folds each into a per-shard
// tensor amax (zero-initialised keys), which is what the per-tensor second-level scale needs.
extern "C" __global__ void nvfp4_amax(const float *__restrict__ x, u32 *__restrict__ row_keys,
                                      u32 *tensor_keys, u64 cols, u32 shards) {
    u64 seg = blockIdx.x;
    u64 row = seg / shards, sh = seg % shards;
    u64 w = cols / shards;
    const float4 *p = (const float4 *)(x + row * cols + sh * w);
    u32 k = 0;
    for (u64 j = threadIdx.x; j < w / 4; j += blockDim.x) {
        float4 v = p[j];
        k = max(k, max(max(amax_key(v.x), amax_key(v.y)), max(amax_key(v.z), amax_key(v.w))));
    }
    for (int o = 16; o > 0; o >>= 1) k = max(k, __shfl_xor_sync(0xFFFFFFFFu, k, o));
    __shared__ u32 s_k;
    if (threadIdx.x == 0) s_k = 0;
    __syncthreads();
    if ((threadIdx.x & 31) == 0) atomicMax(&s_k, k);
    __syncthreads();
    if (threadIdx.x == 0) {
        row_keys[seg] = s_k;
        if (tensor_keys) atomicMax(&tensor_keys[sh], s_k);
    }
}

// nvfp4::GlobalScale::from_amax: S_enc = min(2688 / amax, FLT_MAX), 1 when that is 0.
__device__ __forceinline__ float nv_s_enc(float amax) {
    float s = 2688.0f / amax;
    if (!is_nan(s)) s = fminf(s, FLT_MAX_F);
    if (s == 0.0f) s = 1.0f;
    return s;
}

// Four threads per 16-element block, four elements each. `amax_keys` holds the global amax as keys:
// `[shards]` (per tensor, per_token = 0) or `[rows, shards]` (per token).
extern "C" __global__ void nvfp4_quantize(const float4 *__restrict__ x, u16 *__restrict__ codes,
                                          u8 *__restrict__ scales, const u32 *__restrict__ amax_keys,
                                          u64 n4, u64 cols, u32 shards, int per_token, float rcp6,
                                          u64 *stats) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    bool valid = i < n4;
    float4 v = valid ? x[i] : make_float4(0.f, 0.f, 0.f, 0.f);
    float vs[4] = {v.x, v.y, v.z, v.w};
    u64 e0 = i * 4;
    u64 row = e0 / cols, col = e0 % cols;
    u64 sh = col / (cols / shards);
    u32 key = valid ? amax_keys[per_token ? row * shards + sh : sh] : 0u;
    float amax = bitsf(key);
    float s_enc = nv_s_enc(amax);
    float s_dec = 1.0f / s_enc;
    // Block amax, NaN propagating.
    u32 k = 0;
    for (int j = 0; j < 4; j++) k = max(k, amax_key(vs[j]));
    for (int o = 2; o > 0; o >>= 1) k = max(k, __shfl_xor_sync(0xFFFFFFFFu, k, o));
    float vec_max = bitsf(k);
    float mult = s_enc * rcp6;
    float ds = vec_max * mult;
    if (!is_nan(ds)) ds = fminf(fmaxf(fminf(ds, FLT_MAX_F), -448.0f), 448.0f);
    u32 scale = e4m3_sat(ds);
    float enc = 1.0f / (e4m3_decode(scale) * s_dec);
    if (!is_nan(enc)) enc = fminf(enc, FLT_MAX_F);
    u32 packed = 0, sat = 0, under = 0;
    for (int j = 0; j < 4; j++) {
        float s = vs[j] * enc;
        u32 c = e2m1_te(s);
        bool fin = fabsf(vs[j]) < __int_as_float(0x7F800000);
        sat += (fabsf(s) > 6.0f && fin) ? 1u : 0u;
        under += ((c & 7u) == 0 && vs[j] != 0.0f && fin) ? 1u : 0u;
        packed |= c << (4 * j);
    }
    u32 el = 4;
    if (valid) {
        codes[i] = (u16)packed;
        if ((i & 3) == 0) scales[i >> 2] = (u8)scale;
    } else {
        el = sat = under = 0;
    }
    flush_stats(stats, el, sat, under);
}

// ---- FP8 block scaling ------------------------------------------------------------------------------
// variant: 0 te, 1 deepseek-v3, 2 deepseek-v3-ue8m0, 3 deepgemm, 4 deepgemm-ue8m0.
// tile_rows: 1 (1x128) or 128 (128x128). Tiles along cols may be partial (last tile).

// Tile amax keys: one warp per (row, 128-column tile), folded into the tile grid with atomicMax
// (zero-initialised keys).
extern "C" __global__ void fp8_block_amax(const float *__restrict__ x, u32 *tile_keys, u64 rows,
                                          u64 cols, u32 tile_rows) {
    u64 warp = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    u32 lane = threadIdx.x & 31;
    u64 tc = (cols + 127) / 128;
    if (warp >= rows * tc) return; // whole warps exit together (blockDim is a multiple of 32)
    u64 r = warp / tc, t = warp % tc;
    u64 c0 = t * 128, c1 = min(c0 + 128, cols);
    u32 k = 0;
    for (u64 c = c0 + lane; c < c1; c += 32) k = max(k, amax_key(x[r * cols + c]));
    for (int o = 16; o > 0; o >>= 1) k = max(k, __shfl_xor_sync(0xFFFFFFFFu, k, o));
    if (lane == 0) atomicMax(&tile_keys[(r / tile_rows) * tc + t], k);
}

// 2^ceil(log2 s) for a positive normal s (fp8_block::pow2_ceil).
__device__ __forceinline__ float pow2_ceil(float s) {
    if (!is_finite(s) || s <= 0.0f) return s;
    u32 b = fbits(s);
    u32 e = ((b >> 23) & 0xFFu) + ((b & 0x7FFFFFu) != 0 ? 1u : 0u);
    return bitsf(min(e, 254u) << 23);
}

// fp8_block::ceil_ue8m0_deepgemm.
__device__ __forceinline__ float ceil_ue8m0(float s) {
    if (is_nan(s)) return s;
    u32 b = fbits(fabsf(s));
    u32 e = ((b >> 23) & 0xFFu) + ((b & 0x7FFFFFu) != 0 ? 1u : 0u);
    return bitsf(min(max(e, 1u), 254u) << 23);
}

// fp8_block::tile_scale: writes the stored decode multiplier and the encode operand (a multiplier
// for te/deepgemm, a divisor for deepseek-v3).
extern "C" __global__ void fp8_block_scales(const u32 *__restrict__ tile_keys, float *scale_inv,
                                            float *apply, u64 tiles, int variant) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= tiles) return;
    float amax = bitsf(tile_keys[i]);
    if (variant == 0) {
        float scale = amax == 0.0f ? __int_as_float(0x7F800000) : 448.0f / amax;
        if ((fbits(scale) & 0x7FFFFFFFu) == 0x7F800000u) scale = FLT_MAX_F;
        if (amax == 0.0f) scale = 1.0f;
        scale_inv[i] = 1.0f / scale;
        apply[i] = scale;
    } else {
        float s = fmaxf(amax, 1e-4f) / 448.0f;
        if (is_nan(amax)) s = bitsf(F32_NAN_BITS);
        if (variant == 4) s = ceil_ue8m0(s);
        if (variant == 2) s = pow2_ceil(s);
        scale_inv[i] = s;
        apply[i] = (variant == 3 || variant == 4) ? 1.0f / s : s;
    }
}

extern "C" __global__ void fp8_block_encode(const float *__restrict__ x, u8 *__restrict__ codes,
                                            const float *__restrict__ apply, u64 rows, u64 cols,
                                            u32 tile_rows, int divide, u64 *stats) {
    u64 tc = (cols + 127) / 128;
    u64 n = rows * cols;
    u32 el = 0, sat = 0, under = 0;
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        u64 r = i / cols, c = i % cols;
        float a = apply[(r / tile_rows) * tc + c / 128];
        float v = x[i];
        float s = divide ? v / a : v * a;
        u8 code = e4m3_sat(s);
        codes[i] = code;
        el += 1;
        sat += (fabsf(s) > 448.0f && is_finite(v)) ? 1u : 0u;
        under += ((code & 0x7Fu) == 0 && v != 0.0f && is_finite(v)) ? 1u : 0u;
    }
    flush_stats(stats, el, sat, under);
}

// ---- layout and element tests ---------------------------------------------------------------------

// out[c, r] = x[r, c] through 32x32 shared-memory tiles (column quantization = row quantization of
// the transpose). Block (32, 8).
extern "C" __global__ void transpose_f32(const float *__restrict__ x, float *__restrict__ out,
                                         u64 rows, u64 cols) {
    __shared__ float tile[32][33];
    u64 c = (u64)blockIdx.x * 32 + threadIdx.x;
    u64 r0 = (u64)blockIdx.y * 32;
    for (u32 j = threadIdx.y; j < 32; j += 8) {
        u64 r = r0 + j;
        if (r < rows && c < cols) tile[j][threadIdx.x] = x[r * cols + c];
    }
    __syncthreads();
    u64 oc = r0 + threadIdx.x;          // column of out = row of x
    u64 orow0 = (u64)blockIdx.x * 32;   // row of out = column of x
    for (u32 j = threadIdx.y; j < 32; j += 8) {
        u64 orow = orow0 + j;
        if (orow < cols && oc < rows) out[orow * rows + oc] = tile[threadIdx.x][j];
    }
}

// Every element codec on every input, for the exhaustive GPU-vs-CPU element test:
// out[5 * i + {0..4}] = e4m3_sat, e5m2_sat, e2m1_te, bf16 low byte, bf16 high byte;
// e8m0[i] = e8m0_ceil(x).
extern "C" __global__ void encode_elements(const u32 *__restrict__ bits, u8 *__restrict__ out,
                                           u8 *__restrict__ e8m0, u64 n) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float x = bitsf(bits[i]);
    u16 b = bf16_rne(x);
    out[5 * i + 0] = e4m3_sat(x);
    out[5 * i + 1] = e5m2_sat(x);
    out[5 * i + 2] = (u8)e2m1_te(x);
    out[5 * i + 3] = (u8)(b & 0xFF);
    out[5 * i + 4] = (u8)(b >> 8);
    e8m0[i] = (u8)e8m0_ceil(x);
}
