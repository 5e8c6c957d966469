// lockstep's quantizers as CUDA kernels, compiled at run time by NVRTC.
//
// Every function here ports `src/formats/` (the one quantizer), line for line where the CPU's
// instruction sequence is also good on the GPU and otherwise by an exact equivalent (the E2M1
// rounding, `rcp.rn` for 1/y), and the tests in `tests/cuda_quantizer.rs` check the bytes against
// it. The arithmetic must stay IEEE FP32:
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

// bf16::bf16_from_f32.
__device__ __forceinline__ u16 bf16_rne(float x) {
    u32 u = fbits(x);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (u16)((u >> 16) | 0x0040u);
    u32 lsb = (u >> 16) & 1u;
    return (u16)((u + 0x7FFFu + lsb) >> 16);
}

// bf16::round_bf16: a quantizer that reads its input's BF16 rounding (`round_in`) forms it as it
// loads, the same bits as quantizing a rounded copy.
__device__ __forceinline__ float bf16_val(float x) { return bitsf((u32)bf16_rne(x) << 16); }
__device__ __forceinline__ float4 bf16_val4(float4 v) {
    return make_float4(bf16_val(v.x), bf16_val(v.y), bf16_val(v.z), bf16_val(v.w));
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

// Ordering key of |x|: the magnitude bits. As integers every NaN orders above Inf, so a max over
// keys propagates NaN; `key_f` turns the result back into the amax, with the CPU's NaN (f32::NAN,
// 0x7FC00000) for any NaN: `amax_nan_propagating` bit for bit.
__device__ __forceinline__ u32 amax_key(float x) { return fbits(x) & 0x7FFFFFFFu; }
__device__ __forceinline__ u32 canon_key(u32 k) { return k > 0x7F800000u ? F32_NAN_BITS : k; }
__device__ __forceinline__ float key_f(u32 k) { return bitsf(canon_key(k)); }

// ---- hardware FP8 conversion (sm_89+): cvt.rn.satfinite, two elements an instruction ----------------
// Same rounding (RNE) and saturation as the CPU codecs; only NaN differs (the hardware keeps the
// sign, and its E5M2 NaN pattern is its own), so NaN bytes are rewritten to the CPU's code:
// E4M3 0x7F, E5M2 0x7E. Bytes whose magnitude is NaN: E4M3 0x7F, E5M2 above 0x7C (satfinite never
// makes Inf).

__device__ __forceinline__ u32 fix_nan_bytes(u32 p, u32 add, u32 nan_code) {
    u32 nanmask = ((p & 0x7F7F7F7Fu) + add) & 0x80808080u;
    u32 bytes = (nanmask >> 7) * 0xFFu;
    return (p & ~bytes) | (nan_code & bytes);
}

__device__ __forceinline__ u32 e4m3x4(float a, float b, float c, float d) {
#if __CUDA_ARCH__ >= 890
    unsigned short lo, hi;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(b), "f"(a));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(d), "f"(c));
    return fix_nan_bytes((u32)lo | ((u32)hi << 16), 0x01010101u, 0x7F7F7F7Fu);
#else
    return (u32)e4m3_sat(a) | ((u32)e4m3_sat(b) << 8) | ((u32)e4m3_sat(c) << 16) | ((u32)e4m3_sat(d) << 24);
#endif
}

__device__ __forceinline__ u32 e5m2x4(float a, float b, float c, float d) {
#if __CUDA_ARCH__ >= 890
    unsigned short lo, hi;
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(b), "f"(a));
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(d), "f"(c));
    return fix_nan_bytes((u32)lo | ((u32)hi << 16), 0x03030303u, 0x7E7E7E7Eu);
#else
    return (u32)e5m2_sat(a) | ((u32)e5m2_sat(b) << 8) | ((u32)e5m2_sat(c) << 16) | ((u32)e5m2_sat(d) << 24);
#endif
}

// Number of bytes of `p` whose FP8 magnitude is zero.
__device__ __forceinline__ u32 zero_bytes(u32 p) {
    u32 z = p & 0x7F7F7F7Fu;
    return 4u - __popc((z + 0x7F7F7F7Fu) & 0x80808080u);
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

// Grid-stride kernels keep the stats in registers and flush them once per thread block; each
// thread keeps U independent 16-byte loads in flight (memory-level parallelism for HBM latency).
#define U 4

// ---- BF16 -----------------------------------------------------------------------------------------

__device__ __forceinline__ u16 bf16_one(float v, u32 *sat, u32 *under) {
    u16 c = bf16_rne(v);
    *sat += (is_finite(v) && (c & 0x7FFFu) == 0x7F80u) ? 1u : 0u;
    *under += (v != 0.0f && (c & 0x7FFFu) == 0u) ? 1u : 0u;
    return c;
}

extern "C" __global__ void bf16_quantize(const float *__restrict__ x, u16 *__restrict__ codes,
                                         u64 n, u64 *stats) {
    u32 el = 0, sat = 0, under = 0;
    u64 n4 = n / 4;
    const float4 *x4 = (const float4 *)x;
    uint2 *c4 = (uint2 *)codes;
    u64 step = (u64)gridDim.x * blockDim.x * U;
    for (u64 b = (u64)blockIdx.x * blockDim.x * U + threadIdx.x; b < n4; b += step) {
        float4 v[U];
#pragma unroll
        for (int k = 0; k < U; k++) {
            u64 i = b + (u64)k * blockDim.x;
            v[k] = i < n4 ? x4[i] : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int k = 0; k < U; k++) {
            u64 i = b + (u64)k * blockDim.x;
            if (i < n4) {
                u32 c0 = bf16_one(v[k].x, &sat, &under), c1 = bf16_one(v[k].y, &sat, &under);
                u32 c2 = bf16_one(v[k].z, &sat, &under), c3 = bf16_one(v[k].w, &sat, &under);
                c4[i] = make_uint2(c0 | (c1 << 16), c2 | (c3 << 16));
                el += 4;
            }
        }
    }
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = n4 * 4 + (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        codes[i] = bf16_one(x[i], &sat, &under);
        el += 1;
    }
    flush_stats(stats, el, sat, under);
}

// ---- MXFP8 ----------------------------------------------------------------------------------------
// Templated on the element (0 = E4M3, 1 = E5M2) and the scale rule (0 = TE ceil, 1 = OCP floor).
// Both rules see the same block amax (max |x| over the non-NaN elements); OCP also needs to know
// whether a NaN was there.

__device__ __forceinline__ int floor_log2(float a) {
    u32 u = fbits(a);
    int e = (int)((u >> 23) & 0xFFu);
    if (e != 0) return e - 127;
    return (31 - __clz((int)(u & 0x7FFFFFu))) - 149;
}

// The E8M0 byte of a block (mxfp8::quantize_block) from its amax `m`; 0xFF with `nanblock` when
// the OCP rule makes the whole block NaN. Both rules then multiply by 2^(127-b) (exact, so the
// CPU's f64 product for OCP rounds to the same FP32).
template <int RULE>
__device__ __forceinline__ u32 mx_scale(float m, bool nan, float rcp_max, int emax, bool *nanblock) {
    *nanblock = false;
    if (RULE == 0) return e8m0_ceil(m * rcp_max);
    int e = m == 0.0f ? -126 : floor_log2(m);
    int shared = e - emax;
    if (nan || !is_finite(m) || shared > 127) {
        *nanblock = true;
        return 0xFF;
    }
    return (u32)(max(shared, -127) + 127);
}

template <int ELEM>
__device__ __forceinline__ u32 fp8x4(float a, float b, float c, float d) {
    return ELEM == 0 ? e4m3x4(a, b, c, d) : e5m2x4(a, b, c, d);
}

// Four elements of a (non-NaN) block under the multiplier `inv`; `m` is the block amax. The
// saturation count only needs a per-element look when the block's largest value clips (or holds
// an Inf); underflow is zero-magnitude codes from non-zero inputs.
template <int ELEM>
__device__ __forceinline__ u32 mx_encode4(float v0, float v1, float v2, float v3, float m, float inv,
                                          float max_elem, u32 *sat, u32 *under) {
    float s0 = v0 * inv, s1 = v1 * inv, s2 = v2 * inv, s3 = v3 * inv;
    u32 p = fp8x4<ELEM>(s0, s1, s2, s3);
    if (m * inv > max_elem) {
        *sat += (fabsf(s0) > max_elem && is_finite(v0)) + (fabsf(s1) > max_elem && is_finite(v1)) +
                (fabsf(s2) > max_elem && is_finite(v2)) + (fabsf(s3) > max_elem && is_finite(v3));
    }
    if (zero_bytes(p)) {
        *under += ((p & 0x7Fu) == 0 && v0 != 0.0f) + (((p >> 8) & 0x7Fu) == 0 && v1 != 0.0f) +
                  (((p >> 16) & 0x7Fu) == 0 && v2 != 0.0f) + (((p >> 24) & 0x7Fu) == 0 && v3 != 0.0f);
    }
    return p;
}

// Row axis: eight lanes per 32-element block, one float4 each; `n4` (float4 count) is a multiple
// of 8. Warps stride over chunks of 32·U float4s so shuffles always see whole blocks.
template <int ELEM, int RULE>
__device__ __forceinline__ void mxfp8_row(const float4 *__restrict__ x, u32 *__restrict__ codes,
                                          u8 *__restrict__ scales, u64 n4, float max_elem,
                                          float rcp_max, int emax, u64 *stats, int round_in) {
    // Count slots: gridDim.y tensors of n4 float4s back to back, the y-th counted in stats[3y..].
    x += (u64)blockIdx.y * n4;
    codes += (u64)blockIdx.y * n4;
    scales += (u64)blockIdx.y * n4 / 8;
    stats += 3 * (u64)blockIdx.y;
    u32 lane = threadIdx.x & 31;
    u64 warp = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    u64 nwarps = ((u64)gridDim.x * blockDim.x) >> 5;
    u32 el = 0, sat = 0, under = 0;
    for (u64 base = warp * 32 * U; base < n4; base += nwarps * 32 * U) {
        float4 v[U];
#pragma unroll
        for (int k = 0; k < U; k++) {
            u64 i = base + k * 32 + lane;
            v[k] = i < n4 ? x[i] : make_float4(0.f, 0.f, 0.f, 0.f);
            if (round_in) v[k] = bf16_val4(v[k]);
        }
#pragma unroll
        for (int k = 0; k < U; k++) {
            u64 i = base + k * 32 + lane;
            float m = fmaxf(fmaxf(fabsf(v[k].x), fabsf(v[k].y)), fmaxf(fabsf(v[k].z), fabsf(v[k].w)));
            u32 nan = 0;
            if (RULE == 1)
                nan = (is_nan(v[k].x) | is_nan(v[k].y) | is_nan(v[k].z) | is_nan(v[k].w)) ? 1u : 0u;
            for (int o = 4; o > 0; o >>= 1) {
                m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
                if (RULE == 1) nan |= __shfl_xor_sync(0xFFFFFFFFu, nan, o);
            }
            // fmaxf(NaN, NaN) is NaN: an all-NaN block has amax 0 (amax_ignoring_nan starts at 0;
            // the TE rule's scale byte is then 0x00, not 0xFF).
            m = fmaxf(m, 0.0f);
            bool nanblock;
            u32 b = mx_scale<RULE>(m, nan != 0, rcp_max, emax, &nanblock);
            u32 packed = 0x7F7F7F7Fu, s_ = 0, u_ = 0;
            if (!nanblock)
                packed = mx_encode4<ELEM>(v[k].x, v[k].y, v[k].z, v[k].w, m, e8m0_rcp(b), max_elem, &s_, &u_);
            if (i < n4) {
                codes[i] = packed;
                if ((i & 7) == 0) scales[i >> 3] = (u8)b;
                if (!nanblock) { el += 4; sat += s_; under += u_; }
            }
        }
    }
    flush_stats(stats, el, sat, under);
}

// Column axis through a shared-memory tile: a 256-thread block takes TR = 128 rows x TC = 64
// columns (32 KiB of FP32) at a time, loads it with coalesced float4 loads (scalar loads when cols
// is not a multiple of 4), then thread (column c, row block rb) reads its 32 elements down the
// tile (consecutive lanes, consecutive columns: no bank conflicts) and encodes them. The codes go
// through a second shared tile [TC][TR + 16] bytes (the 16-byte pad keeps the 16-byte stores
// conflict-free) so that each warp stores whole 128-byte runs of the column-major output
// (codes[c*rows + r], the transposed blocked view). `rows` is a multiple of 32. Measured on the
// H200 (16384², e4m3 te): 0.387 ms against 0.788 for a thread per (column, row block) writing
// its 32 bytes at a stride of `rows`; without the code staging 0.60; 32x256 tiles 0.62; 64x128
// tiles 0.40; 3 blocks an SM (72 registers) 0.488 against 4 (64 registers, __launch_bounds__);
// 5 (48 registers, 12 bytes of spills) 0.437.
template <int ELEM, int RULE, int TR, int TC>
__device__ __forceinline__ void mxfp8_col_tile(const float *__restrict__ x, u8 *__restrict__ codes,
                                               u8 *__restrict__ scales, u64 rows, u64 cols,
                                               float max_elem, float rcp_max, int emax, u64 *stats) {
    __shared__ __align__(16) float s[TR * TC];
    __shared__ __align__(16) u8 cs[TC * (TR + 16)];
    const u32 tid = threadIdx.x;
    const u64 rbs = rows / 32;
    const u64 ntc = (cols + TC - 1) / TC;
    const u64 ntiles = ntc * ((rows + TR - 1) / TR);
    const bool vec = (cols & 3) == 0;
    u32 el = 0, sat = 0, under = 0;
    for (u64 tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
        const u64 r0 = (tile / ntc) * TR, c0 = (tile % ntc) * TC;
        if (vec) {
            constexpr int K = TR * TC / 4 / 256;
            float4 v[K];
#pragma unroll
            for (int k = 0; k < K; k++) {
                u32 idx = k * 256 + tid;
                u64 r = r0 + idx / (TC / 4), c = c0 + (idx % (TC / 4)) * 4;
                v[k] = (r < rows && c < cols) ? *(const float4 *)&x[r * cols + c]
                                              : make_float4(0.f, 0.f, 0.f, 0.f);
            }
            __syncthreads();
#pragma unroll
            for (int k = 0; k < K; k++) ((float4 *)s)[k * 256 + tid] = v[k];
        } else {
            constexpr int K = TR * TC / 256;
            float v[K];
#pragma unroll
            for (int k = 0; k < K; k++) {
                u32 idx = k * 256 + tid;
                u64 r = r0 + idx / TC, c = c0 + idx % TC;
                v[k] = (r < rows && c < cols) ? x[r * cols + c] : 0.0f;
            }
            __syncthreads();
#pragma unroll
            for (int k = 0; k < K; k++) s[k * 256 + tid] = v[k];
        }
        __syncthreads();
        const u32 c = tid % TC, rb = tid / TC;
        const u64 gc = c0 + c, gr = r0 + rb * 32;
        const bool live = gc < cols && gr < rows;
        if (live) {
            u32 w[8];
            float v[32];
            float m = 0.0f;
            bool nan = false;
#pragma unroll
            for (int i = 0; i < 32; i++) v[i] = s[(rb * 32 + i) * TC + c];
#pragma unroll
            for (int i = 0; i < 32; i++) {
                if (RULE == 1) nan |= is_nan(v[i]);
                m = fmaxf(m, fabsf(v[i]));
            }
            bool nanblock;
            u32 b = mx_scale<RULE>(m, nan, rcp_max, emax, &nanblock);
            float inv = e8m0_rcp(b);
#pragma unroll
            for (int q = 0; q < 8; q++)
                w[q] = nanblock ? 0x7F7F7F7Fu
                                : mx_encode4<ELEM>(v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3], m,
                                                   inv, max_elem, &sat, &under);
            if (!nanblock) el += 32;
            scales[gc * rbs + gr / 32] = (u8)b;
            uint4 *o = (uint4 *)&cs[c * (TR + 16) + rb * 32];
            o[0] = make_uint4(w[0], w[1], w[2], w[3]);
            o[1] = make_uint4(w[4], w[5], w[6], w[7]);
        }
        __syncthreads();
        constexpr int P = TR / 16; // uint4 pieces per column run
#pragma unroll
        for (int k = 0; k < TC * P / 256; k++) {
            u32 idx = k * 256 + tid;
            u32 cc = idx / P, part = idx % P;
            u64 g = c0 + cc, r = r0 + part * 16;
            if (g < cols && r < rows)
                *(uint4 *)&codes[g * rows + r] = *(const uint4 *)&cs[cc * (TR + 16) + part * 16];
        }
    }
    flush_stats(stats, el, sat, under);
}

#define MX_TR 128 // tile of the column kernels (quant.rs sizes the grid by it)
#define MX_TC 64
#define MX_KERNELS(SUFFIX, E, R)                                                                       \
    extern "C" __global__ void mxfp8_row_##SUFFIX(const float4 *__restrict__ x, u32 *__restrict__ codes, \
                                                  u8 *__restrict__ scales, u64 n4, float max_elem,     \
                                                  float rcp_max, int emax, u64 *stats,                  \
                                                  int round_in) {                                       \
        mxfp8_row<E, R>(x, codes, scales, n4, max_elem, rcp_max, emax, stats, round_in);               \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(256, 4) mxfp8_col_##SUFFIX(                          \
        const float *__restrict__ x, u8 *__restrict__ codes, u8 *__restrict__ scales, u64 rows,         \
        u64 cols, float max_elem, float rcp_max, int emax, u64 *stats) {                               \
        mxfp8_col_tile<E, R, MX_TR, MX_TC>(x, codes, scales, rows, cols, max_elem, rcp_max, emax, stats); \
    }
MX_KERNELS(e4m3_te, 0, 0)
MX_KERNELS(e4m3_ocp, 0, 1)
MX_KERNELS(e5m2_te, 1, 0)
MX_KERNELS(e5m2_ocp, 1, 1)

// ---- NVFP4 ----------------------------------------------------------------------------------------

// nvfp4::GlobalScale::from_amax: S_enc = min(2688 / amax, FLT_MAX), 1 when that is 0.
__device__ __forceinline__ float nv_s_enc(float amax) {
    float s = 2688.0f / amax;
    if (!is_nan(s)) s = fminf(s, FLT_MAX_F);
    if (s == 0.0f) s = 1.0f;
    return s;
}

// Block-wide max of a key (every thread gets it). Uses `s_k` (32 entries) and two barriers.
__device__ __forceinline__ u32 block_max(u32 k, u32 *s_k) {
    for (int o = 16; o > 0; o >>= 1) k = max(k, __shfl_xor_sync(0xFFFFFFFFu, k, o));
    if ((threadIdx.x & 31) == 0) s_k[threadIdx.x >> 5] = k;
    __syncthreads();
    u32 r = 0;
    for (u32 w = 0; w < (blockDim.x + 31) / 32; w++) r = max(r, s_k[w]);
    __syncthreads();
    return r;
}

// Per (row, shard) amax keys: one thread block per segment, each folded into a per-shard tensor
// amax (zero-initialised keys): the per-tensor second-level scale with more than one shard.
extern "C" __global__ void nvfp4_amax(const float4 *__restrict__ x, u32 *__restrict__ row_keys,
                                      u32 *tensor_keys, u64 rows, u64 cols, u32 shards) {
    __shared__ u32 s_k[32];
    u64 w4 = cols / shards / 4;
    for (u64 seg = blockIdx.x; seg < rows * shards; seg += gridDim.x) {
        u64 off = (seg / shards) * (cols / 4) + (seg % shards) * w4;
        u32 k = 0;
#pragma unroll 4
        for (u64 j = threadIdx.x; j < w4; j += blockDim.x) {
            float4 v = x[off + j];
            k = max(k, max(max(amax_key(v.x), amax_key(v.y)), max(amax_key(v.z), amax_key(v.w))));
        }
        k = block_max(k, s_k);
        if (threadIdx.x == 0) {
            row_keys[seg] = canon_key(k);
            if (tensor_keys) atomicMax(&tensor_keys[seg % shards], k);
        }
    }
}

// ---- NVFP4, a thread per 16-element block ------------------------------------------------------------
// Each thread owns whole blocks: four 16-byte loads of one block's 64 contiguous bytes (the warp's
// four loads cover the same 2 KiB, so L1 merges them), the block amax without shuffles, one scale
// computation per block instead of one per lane, and one 8-byte code store per block (a warp's
// stores are contiguous).

// max(|a|, |b|) propagating NaN (max.NaN): the block amax of `amax_nan_propagating` for non-NaN
// blocks, and a NaN for any block with one.
__device__ __forceinline__ float absmax_nan(float a, float b) {
    float r;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(fabsf(a)), "f"(fabsf(b)));
    return r;
}
__device__ __forceinline__ float maxnan(float a, float b) {
    float r;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float amax16(const float4 *v) {
    float m0 = maxnan(absmax_nan(v[0].x, v[0].y), absmax_nan(v[0].z, v[0].w));
    float m1 = maxnan(absmax_nan(v[1].x, v[1].y), absmax_nan(v[1].z, v[1].w));
    float m2 = maxnan(absmax_nan(v[2].x, v[2].y), absmax_nan(v[2].z, v[2].w));
    float m3 = maxnan(absmax_nan(v[3].x, v[3].y), absmax_nan(v[3].z, v[3].w));
    return maxnan(maxnan(m0, m1), maxnan(m2, m3));
}
// The amax key (|x| bits, NaN above Inf) of a block amax from `amax16` (non-negative or NaN).
__device__ __forceinline__ u32 amax16_key(float m) { return fbits(m) & 0x7FFFFFFFu; }

// Number of non-zero 3-bit magnitudes among the eight 4-bit codes of `p`.
__device__ __forceinline__ u32 nz_nibbles(u32 p) { return __popc(((p & 0x77777777u) + 0x77777777u) & 0x88888888u); }

// e2m1_te for a non-NaN x, by the magic-number rounding of FP32 addition (about 10 instructions
// against the CPU's ~17-instruction bit trick; equal on all 2^32 inputs, and the element sweep
// test checks it on the GPU). With a = min(|x|, 6), adding M = 2^22, 2^23 or 2^24 (for a below 2,
// in [2, 4), in [4, 6]) rounds a to a multiple of ulp(M) = 0.5, 1 or 2, the E2M1 spacing there,
// ties to even, in one IEEE addition (a < M/2 keeps a + M in M's binade). k = bits(a + M) -
// bits(M) is a / spacing rounded (even k on a tie), and the magnitude code is k, k + 2 or k + 4:
//   a in      spacing  M      k      code
//   [0, 2)    0.5      2^22   0..4   k      (0.25 -> 0, 0.75 -> 2, 1.75 -> 4: ties to even)
//   [2, 4)    1        2^23   2..4   k + 2  (2.5 -> 4, 3.5 -> 6)
//   [4, 6]    2        2^24   2..3   k + 4  (5 -> 6, above 5 -> 7)
// The offset 2·(log2 M - 22) is (bits(M) >> 22) - 298. Sign: 8 for x < 0 (so -0.0 -> 0 and a
// negative value that rounds to 0 -> 8, as on the CPU).
__device__ __forceinline__ u32 e2m1_magic(float x) {
    float a = fminf(fabsf(x), 6.0f);
    int mb = max((int)(fbits(a) & 0x7F800000u) + (22 << 23), 0x4A800000);
    u32 k = fbits(a + bitsf((u32)mb)) - (u32)mb;
    u32 mag = k + (((u32)mb >> 22) - 298u);
    return mag | (x < 0.0f ? 8u : 0u);
}

// e2m1::e2m1_from_f32 with the TE reference convention (-0.0 and NaN -> code 0); the element
// sweep test checks it (and so `e2m1_magic`) against the CPU.
__device__ __forceinline__ u32 e2m1_te(float x) { return is_nan(x) ? 0u : e2m1_magic(x); }

// E4M3 code of a non-NaN x in [0, 448] (fp8::e4m3_from_f32_sat), and the value of a non-NaN
// code (exact: every E4M3 value is an FP16 value).
__device__ __forceinline__ u32 e4m3_pos(float x) {
#if __CUDA_ARCH__ >= 890
    unsigned short p;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %1;" : "=h"(p) : "f"(x));
    return p & 0xFFu;
#else
    return e4m3_sat(x);
#endif
}
__device__ __forceinline__ float e4m3_value(u32 c) {
#if __CUDA_ARCH__ >= 890
    float f;
    asm("{\n\t.reg .b32 h2;\n\t.reg .b16 lo, hi;\n\tcvt.rn.f16x2.e4m3x2 h2, %1;\n\t"
        "mov.b32 {lo, hi}, h2;\n\tcvt.f32.f16 %0, lo;\n\t}"
        : "=f"(f) : "h"((unsigned short)c));
    return f;
#else
    return e4m3_decode(c);
#endif
}

// One block (`v`, amax `vec_max`) under a second-level scale (`mult` = S_enc·fp32(1/6), `s_dec`
// = 1/S_enc): nvfp4::block_scale and nvfp4::encode. Returns the 16 codes, element j in bits
// 4j..4j+3, and sets the scale byte.
__device__ __forceinline__ uint2 nv_block16(const float4 *v, float vec_max, float mult, float s_dec,
                                            u32 *scale, u32 *sat, u32 *under) {
    const float *e = (const float *)v;
    float ds = vec_max * mult;
    if (is_nan(ds)) {
        // A NaN in the block or the row (per-token) or tensor amax: scale NaN (0x7F), every code
        // 0 (NaN·x encodes as 0), and every finite non-zero element counts as underflowed.
        *scale = 0x7Fu;
#pragma unroll
        for (int j = 0; j < 16; j++) *under += (e[j] != 0.0f && is_finite(e[j])) ? 1u : 0u;
        return make_uint2(0u, 0u);
    }
    // ds >= 0 here: min(ds, FLT_MAX).clamp(-448, 448) is min(ds, 448).
    u32 sc = e4m3_pos(fminf(ds, 448.0f));
    *scale = sc;
    // rcp.rn is the correctly rounded 1/y, the same value as the IEEE division the CPU does.
    float enc = fminf(__frcp_rn(e4m3_value(sc) * s_dec), FLT_MAX_F);
    float s[16];
#pragma unroll
    for (int j = 0; j < 16; j++) s[j] = e[j] * enc;
    u32 lo = 0, hi = 0, nonzero = 0;
#pragma unroll
    for (int j = 0; j < 16; j++) {
        u32 c = e2m1_magic(s[j]);
        if (j < 8) lo |= c << (4 * j);
        else hi |= c << (4 * (j - 8));
        nonzero += (e[j] != 0.0f) ? 1u : 0u;
    }
    // Underflow: a non-zero input whose code magnitude is 0. No code here comes from a NaN, so
    // it is (non-zero inputs) - (non-zero magnitudes); an Inf input encodes as 6 and is in both.
    *under += nonzero - nz_nibbles(lo) - nz_nibbles(hi);
    // Saturation needs a per-element look only when the block's largest scaled value clips.
    if (vec_max * enc > 6.0f) {
#pragma unroll
        for (int j = 0; j < 16; j++) *sat += (fabsf(s[j]) > 6.0f && fabsf(e[j]) < __int_as_float(0x7F800000)) ? 1u : 0u;
    }
    return make_uint2(lo, hi);
}

// Block b's 16 values, BF16-rounded as they load when `round_in`.
__device__ __forceinline__ void nv_load16(const float4 *__restrict__ x, u64 b, float4 *v, int round_in) {
#pragma unroll
    for (int k = 0; k < 4; k++) v[k] = round_in ? bf16_val4(x[4 * b + k]) : x[4 * b + k];
}

// Count slots of the per-token kernels: gridDim.y tensors of nsegs segments back to back (the
// runs of a batch); a thread block of slot y moves its pointers to the y-th, counted in
// stats[3y..3y+3].
__device__ __forceinline__ void nv_token_slot(const float4 *__restrict__ &x, uint2 *__restrict__ &codes,
                                              u8 *__restrict__ &scales, u32 *__restrict__ &row_keys,
                                              u64 nsegs, u32 L, u64 *&stats) {
    u64 blocks = (u64)blockIdx.y * nsegs * L;
    x += 4 * blocks;
    codes += blocks;
    scales += blocks;
    row_keys += (u64)blockIdx.y * nsegs;
    stats += 3 * (u64)blockIdx.y;
}

#define NV_T 256
#define NV_B 4 // blocks per thread
#define NV_CHUNK (NV_T * NV_B)

// Per-token scales, fused, with one barrier per chunk. `L` = 16-element blocks per (row, shard)
// segment; segment s is blocks [s·L, (s+1)·L) of the flattened tensor. A thread block takes a
// chunk of whole segments (up to NV_CHUNK blocks, NV_B per thread, held in registers): block
// amaxes, segment amaxes (a warp max, then a shared-memory atomic max), one barrier, then every
// thread derives its segments' scales itself and encodes its blocks: one pass over memory. The
// segment keys rotate through three shared buffers: buffer (i+1)%3 is cleared during chunk i,
// before its barrier, when its last readers (chunk i-2, before the barrier of chunk i-1) are done
// and before its next writers (chunk i+1, after the barrier of chunk i) start. Segments longer
// than a chunk are read twice (amax, then encode).
extern "C" __global__ void __launch_bounds__(NV_T) nvfp4_token16(
    const float4 *__restrict__ x, uint2 *__restrict__ codes, u8 *__restrict__ scales,
    u32 *__restrict__ row_keys, u64 nsegs, u32 L, float rcp6, u64 *stats, int round_in) {
    __shared__ u32 s_key[3][NV_CHUNK];
    nv_token_slot(x, codes, scales, row_keys, nsegs, L, stats);
    u32 t = threadIdx.x;
    u32 el = 0, sat = 0, under = 0;
    if (L <= NV_CHUNK) {
        u32 spc = NV_CHUNK / L;
        u64 nchunks = (nsegs + spc - 1) / spc;
        for (u32 i = t; i < spc; i += NV_T) s_key[0][i] = 0;
        u32 p = 0;
        for (u64 c = blockIdx.x; c < nchunks; c += gridDim.x, p = p == 2 ? 0 : p + 1) {
            u64 seg0 = c * spc;
            u32 nseg = (u32)min((u64)spc, nsegs - seg0);
            u32 nb = nseg * L;
            u64 b0 = seg0 * L;
            float4 v[NV_B][4];
            float bm[NV_B];
            u32 sgs[NV_B];
#pragma unroll
            for (int q = 0; q < NV_B; q++) {
                u32 b = t + q * NV_T;
                if (b < nb) nv_load16(x, b0 + b, v[q], round_in);
            }
            u32 pn = p == 2 ? 0 : p + 1;
            for (u32 i = t; i < spc; i += NV_T) s_key[pn][i] = 0;
            if (c == blockIdx.x) __syncthreads(); // the first chunk's buffer was cleared above
#pragma unroll
            for (int q = 0; q < NV_B; q++) {
                u32 b = t + q * NV_T;
                bool ok = b < nb;
                bm[q] = ok ? amax16(v[q]) : 0.0f;
                u32 k = amax16_key(bm[q]);
                u32 sg = ok ? b / L : 0xFFFFFFFFu;
                sgs[q] = sg;
                // A warp's 32 consecutive blocks usually share a segment (L a multiple of 32).
                if (__all_sync(0xFFFFFFFFu, sg == __shfl_sync(0xFFFFFFFFu, sg, 0) && ok)) {
                    k = __reduce_max_sync(0xFFFFFFFFu, k);
                    if ((t & 31) == 0) atomicMax(&s_key[p][sg], k);
                } else if (ok) {
                    atomicMax(&s_key[p][sg], k);
                }
            }
            __syncthreads();
            u32 last = 0xFFFFFFFFu;
            float mult = 0.0f, s_dec = 0.0f;
#pragma unroll
            for (int q = 0; q < NV_B; q++) {
                u32 b = t + q * NV_T;
                if (b < nb) {
                    u32 sg = sgs[q], sc;
                    if (sg != last) {
                        u32 k = s_key[p][sg];
                        float s_enc = nv_s_enc(key_f(k));
                        mult = s_enc * rcp6;
                        s_dec = __frcp_rn(s_enc);
                        last = sg;
                        if (b == sg * L) row_keys[seg0 + sg] = canon_key(k);
                    }
                    codes[b0 + b] = nv_block16(v[q], bm[q], mult, s_dec, &sc, &sat, &under);
                    scales[b0 + b] = (u8)sc;
                    el += 16;
                }
            }
        }
    } else {
        for (u64 sgi = blockIdx.x; sgi < nsegs; sgi += gridDim.x) {
            u64 b0 = sgi * L;
            u32 k = 0;
            for (u32 b = t; b < L; b += NV_T) {
                float4 v[4];
                nv_load16(x, b0 + b, v, round_in);
                k = max(k, amax16_key(amax16(v)));
            }
            k = block_max(k, s_key[0]);
            if (t == 0) row_keys[sgi] = canon_key(k);
            float s_enc = nv_s_enc(key_f(k));
            float mult = s_enc * rcp6, s_dec = __frcp_rn(s_enc);
            for (u32 b = t; b < L; b += NV_T) {
                float4 v[4];
                nv_load16(x, b0 + b, v, round_in);
                u32 sc;
                codes[b0 + b] = nv_block16(v, amax16(v), mult, s_dec, &sc, &sat, &under);
                scales[b0 + b] = (u8)sc;
                el += 16;
            }
        }
    }
    flush_stats(stats, el, sat, under);
}

// ---- NVFP4 per-token, rows staged in shared memory (sm_90) ----------------------------------------
// `nvfp4_token16` above must hold a chunk's loads in registers until its segment amaxes are known,
// so a thread block has no loads in flight while it encodes. Here a persistent thread block (one
// per SM, 1024 threads, a 16-element block each) has the Hopper copy engine (TMA,
// `cp.async.bulk`) bring chunks of whole segments (up to 1024 blocks, 64 KiB, contiguous) into a
// ring of three shared-memory stages, two chunks ahead of the one it encodes, so the next chunks'
// bytes are in flight while it computes. Per chunk: wait on the stage's mbarrier, block amaxes from
// shared memory and segment amaxes (as above), barrier, encode and store. The host uses it on
// compute capability 9.0+ with 204 KiB of shared memory a block, for segments of at most 1024
// blocks, and the register kernel otherwise.
//
// A thread reads its block's four float4 starting at float4 `rot = (b >> 1) & 3` and wrapping
// (a quarter-warp's eight 16-byte reads then fall in eight different bank groups); codes of
// float4 k land in bits 16k.. of the block's 64-bit code word, so the word is rotated back by
// 16·rot bits.
#define SG_T 1024
#define SG_CHUNK 1024
#define SG_STAGES 3

__device__ __forceinline__ u32 smem_addr(const void *p) { return (u32)__cvta_generic_to_shared(p); }

extern "C" __global__ void __launch_bounds__(SG_T, 1) nvfp4_token_staged(
    const float4 *__restrict__ x, uint2 *__restrict__ codes, u8 *__restrict__ scales,
    u32 *__restrict__ row_keys, u64 nsegs, u32 L, float rcp6, u64 *stats, int round_in) {
#if __CUDA_ARCH__ >= 900
    extern __shared__ float4 stage[]; // [SG_STAGES][SG_CHUNK * 4]
    __shared__ u32 s_key[SG_STAGES][SG_CHUNK];
    __shared__ __align__(8) unsigned long long s_bar[SG_STAGES];
    nv_token_slot(x, codes, scales, row_keys, nsegs, L, stats);
    u32 t = threadIdx.x;
    u32 el = 0, sat = 0, under = 0;
    u32 spc = SG_CHUNK / L;
    u64 nchunks = (nsegs + spc - 1) / spc;
    if (t == 0) {
        for (int i = 0; i < SG_STAGES; i++)
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&s_bar[i])));
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    for (u32 i = t; i < spc; i += SG_T) s_key[0][i] = 0;
    __syncthreads();
    // Thread 0 starts the copy of chunk c (if any) into stage st; its mbarrier completes when the
    // bytes have landed.
    auto fetch = [&](u64 c, u32 st) {
        if (t == 0 && c < nchunks) {
            u64 seg0 = c * spc;
            u32 bytes = (u32)min((u64)spc, nsegs - seg0) * L * 64;
            u32 bar = smem_addr(&s_bar[st]);
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
            asm volatile(
                "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                ::"r"(smem_addr(stage + (u64)st * SG_CHUNK * 4)), "l"(x + seg0 * L * 4), "r"(bytes), "r"(bar)
                : "memory");
        }
    };
    fetch(blockIdx.x, 0);
    fetch((u64)blockIdx.x + gridDim.x, 1);
    u32 p = 0, phase = 0; // phase: parity of this round through the ring
    for (u64 c = blockIdx.x; c < nchunks; c += gridDim.x) {
        // Stage (p + 2) % 3 was last read before the second barrier of the previous chunk.
        fetch(c + 2 * (u64)gridDim.x, p == 0 ? 2 : p - 1);
        u32 pn = p == 2 ? 0 : p + 1;
        for (u32 i = t; i < spc; i += SG_T) s_key[pn][i] = 0;
        asm volatile(
            "{\n\t.reg .pred done;\n\tWAIT_%=:\n\t"
            "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n\t"
            "@!done bra WAIT_%=;\n\t}" ::"r"(smem_addr(&s_bar[p])), "r"(phase) : "memory");
        u64 seg0 = c * spc;
        u32 nb = (u32)min((u64)spc, nsegs - seg0) * L;
        u64 b0 = seg0 * L;
        const float4 *sv = stage + (u64)p * SG_CHUNK * 4;
        u32 b = t;
        bool ok = b < nb;
        u32 rot = (b >> 1) & 3;
        float4 v[4];
        if (ok) {
#pragma unroll
            for (int k = 0; k < 4; k++) {
                v[k] = sv[4 * b + ((k + rot) & 3)];
                if (round_in) v[k] = bf16_val4(v[k]);
            }
        }
        float bm = ok ? amax16(v) : 0.0f;
        u32 key = amax16_key(bm);
        u32 sg = ok ? b / L : 0xFFFFFFFFu;
        if (__all_sync(0xFFFFFFFFu, sg == __shfl_sync(0xFFFFFFFFu, sg, 0) && ok)) {
            key = __reduce_max_sync(0xFFFFFFFFu, key);
            if ((t & 31) == 0) atomicMax(&s_key[p][sg], key);
        } else if (ok) {
            atomicMax(&s_key[p][sg], key);
        }
        __syncthreads();
        if (ok) {
            u32 k = s_key[p][sg], sc;
            float s_enc = nv_s_enc(key_f(k));
            if (b == sg * L) row_keys[seg0 + sg] = canon_key(k);
            uint2 w = nv_block16(v, bm, s_enc * rcp6, __frcp_rn(s_enc), &sc, &sat, &under);
            u64 word = ((u64)w.y << 32) | w.x;
            u32 sh = 16 * rot;
            word = sh == 0 ? word : (word << sh) | (word >> (64 - sh));
            codes[b0 + b] = make_uint2((u32)word, (u32)(word >> 32));
            scales[b0 + b] = (u8)sc;
            el += 16;
        }
        if (p == 2) phase ^= 1;
        p = pn;
    }
    flush_stats(stats, el, sat, under);
#endif
}

// The tensor amax key of a one-shard per-tensor scale: a flat grid-stride max over `n4` float4s
// (8 coalesced loads in flight per thread), one atomic per warp into the zero-initialised key.
extern "C" __global__ void __launch_bounds__(NV_T) nvfp4_amax16(const float4 *__restrict__ x,
                                                                u32 *tensor_key, u64 n4) {
    float m = 0.0f;
    for (u64 i = (u64)blockIdx.x * NV_T * 8 + threadIdx.x; i < n4; i += (u64)gridDim.x * NV_T * 8) {
        float4 v[8];
#pragma unroll
        for (int q = 0; q < 8; q++) {
            u64 j = i + q * NV_T;
            v[q] = j < n4 ? x[j] : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int q = 0; q < 8; q++)
            m = maxnan(m, maxnan(absmax_nan(v[q].x, v[q].y), absmax_nan(v[q].z, v[q].w)));
    }
    u32 k = __reduce_max_sync(0xFFFFFFFFu, amax16_key(m));
    if ((threadIdx.x & 31) == 0) atomicMax(tensor_key, k);
}

// Per-tensor scales: every block under the precomputed `[shards]` amax keys (block b is in shard
// (b / L) % shards); NV_B blocks per thread in flight, grid-stride.
extern "C" __global__ void __launch_bounds__(NV_T) nvfp4_tensor16(
    const float4 *__restrict__ x, uint2 *__restrict__ codes, u8 *__restrict__ scales,
    const u32 *__restrict__ amax_keys, u64 nblocks, u32 L, u32 shards, float rcp6, u64 *stats) {
    u32 el = 0, sat = 0, under = 0;
    float s_enc1 = nv_s_enc(key_f(amax_keys[0])); // the only scale when shards == 1
    float mult1 = s_enc1 * rcp6, s_dec1 = __frcp_rn(s_enc1);
    for (u64 g = (u64)blockIdx.x * NV_CHUNK + threadIdx.x; g < nblocks; g += (u64)gridDim.x * NV_CHUNK) {
        float4 v[NV_B][4];
#pragma unroll
        for (int q = 0; q < NV_B; q++) {
            u64 b = g + q * NV_T;
            if (b < nblocks) nv_load16(x, b, v[q], 0);
        }
#pragma unroll
        for (int q = 0; q < NV_B; q++) {
            u64 b = g + q * NV_T;
            if (b < nblocks) {
                float mult = mult1, s_dec = s_dec1;
                if (shards > 1) {
                    float s_enc = nv_s_enc(key_f(amax_keys[(b / L) % shards]));
                    mult = s_enc * rcp6;
                    s_dec = __frcp_rn(s_enc);
                }
                u32 sc;
                codes[b] = nv_block16(v[q], amax16(v[q]), mult, s_dec, &sc, &sat, &under);
                scales[b] = (u8)sc;
                el += 16;
            }
        }
    }
    flush_stats(stats, el, sat, under);
}

// ---- FP8 block scaling ------------------------------------------------------------------------------
// variant: 0 te, 1 deepseek-v3, 2 deepseek-v3-ue8m0, 3 deepgemm, 4 deepgemm-ue8m0.
// tile_rows: 1 (1x128) or 128 (128x128). Tiles along cols may be partial (last tile).

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

// fp8_block::tile_scale: the stored decode multiplier and the encode operand (a multiplier for
// te/deepgemm, a divisor for deepseek-v3). NaN results are stored as the CPU's NaN (0x7FC00000):
// NVIDIA arithmetic returns 0x7FFFFFFF where x86 propagates the operand's bits.
__device__ __forceinline__ void tile_scale(float amax, int variant, float *scale_inv, float *apply) {
    if (variant == 0) {
        float scale = amax == 0.0f ? __int_as_float(0x7F800000) : 448.0f / amax;
        if ((fbits(scale) & 0x7FFFFFFFu) == 0x7F800000u) scale = FLT_MAX_F;
        if (amax == 0.0f) scale = 1.0f;
        float inv = 1.0f / scale;
        *scale_inv = is_nan(inv) ? bitsf(F32_NAN_BITS) : inv;
        *apply = scale;
    } else {
        float s = fmaxf(amax, 1e-4f) / 448.0f;
        if (is_nan(amax)) s = bitsf(F32_NAN_BITS);
        if (variant == 4) s = ceil_ue8m0(s);
        if (variant == 2) s = pow2_ceil(s);
        *scale_inv = s;
        *apply = (variant == 3 || variant == 4) ? 1.0f / s : s;
    }
}

__device__ __forceinline__ u32 fp8_encode1(float v, float a, bool divide, u32 *sat, u32 *under) {
    float s = divide ? v / a : v * a;
    u32 code = e4m3_sat(s);
    *sat += (fabsf(s) > 448.0f && is_finite(v)) ? 1u : 0u;
    *under += ((code & 0x7Fu) == 0 && v != 0.0f && is_finite(v)) ? 1u : 0u;
    return code;
}

__device__ __forceinline__ u32 fp8_encode4(float4 v, float a, bool divide, u32 *sat, u32 *under) {
    float s0 = divide ? v.x / a : v.x * a, s1 = divide ? v.y / a : v.y * a;
    float s2 = divide ? v.z / a : v.z * a, s3 = divide ? v.w / a : v.w * a;
    u32 p = e4m3x4(s0, s1, s2, s3);
    float m = fmaxf(fmaxf(fabsf(s0), fabsf(s1)), fmaxf(fabsf(s2), fabsf(s3)));
    if (m > 448.0f) {
        *sat += (fabsf(s0) > 448.0f && is_finite(v.x)) + (fabsf(s1) > 448.0f && is_finite(v.y)) +
                (fabsf(s2) > 448.0f && is_finite(v.z)) + (fabsf(s3) > 448.0f && is_finite(v.w));
    }
    if (zero_bytes(p)) {
        float vs[4] = {v.x, v.y, v.z, v.w};
        for (int j = 0; j < 4; j++)
            *under += (((p >> (8 * j)) & 0x7Fu) == 0 && vs[j] != 0.0f && is_finite(vs[j])) ? 1u : 0u;
    }
    return p;
}

__device__ __forceinline__ u32 key4(float4 v) {
    return max(max(amax_key(v.x), amax_key(v.y)), max(amax_key(v.z), amax_key(v.w)));
}

// 1x128 tiles, fused, for `cols` a multiple of 4: a warp per row at a time, a tile per 32 lanes
// (one float4 each), U tiles in flight. The last tile of a row may be partial.
extern "C" __global__ void fp8_block_1x128(const float *__restrict__ x, u32 *__restrict__ codes,
                                           float *__restrict__ scale_inv, u64 rows, u64 cols,
                                           int variant, u64 *stats) {
    u32 lane = threadIdx.x & 31;
    u64 warp = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    u64 nwarps = ((u64)gridDim.x * blockDim.x) >> 5;
    u32 tc = (u32)((cols + 127) / 128), c4 = (u32)(cols / 4);
    bool divide = variant == 1 || variant == 2;
    u32 el = 0, sat = 0, under = 0;
    for (u64 r = warp; r < rows; r += nwarps) {
        const float4 *xr = (const float4 *)(x + r * cols);
        u32 *cr = codes + r * c4;
        for (u32 t0 = 0; t0 < tc; t0 += U) {
            float4 v[U];
#pragma unroll
            for (int k = 0; k < U; k++) {
                u32 j = (t0 + k) * 32 + lane;
                v[k] = j < c4 ? xr[j] : make_float4(0.f, 0.f, 0.f, 0.f);
            }
#pragma unroll
            for (int k = 0; k < U; k++) {
                u32 j = (t0 + k) * 32 + lane;
                u32 key = key4(v[k]);
                for (int o = 16; o > 0; o >>= 1) key = max(key, __shfl_xor_sync(0xFFFFFFFFu, key, o));
                float sinv, a;
                tile_scale(key_f(key), variant, &sinv, &a);
                if (j < c4) {
                    cr[j] = fp8_encode4(v[k], a, divide, &sat, &under);
                    el += 4;
                }
                if (lane == 0 && t0 + k < tc) scale_inv[r * tc + t0 + k] = sinv;
            }
        }
    }
    flush_stats(stats, el, sat, under);
}

// 128x128 tiles, fused, for `cols` a multiple of 4: a 256-thread block per tile holds the tile in
// registers (16 float4 a thread), reduces its amax, then encodes: one pass over memory.
extern "C" __global__ void fp8_block_128x128(const float *__restrict__ x, u32 *__restrict__ codes,
                                             float *__restrict__ scale_inv, u64 rows, u64 cols,
                                             int variant, u64 *stats) {
    __shared__ u32 s_k[32];
    u64 tr = (rows + 127) / 128, tc = (cols + 127) / 128;
    u32 cl = threadIdx.x & 31, rl = threadIdx.x >> 5;
    bool divide = variant == 1 || variant == 2;
    u32 el = 0, sat = 0, under = 0;
    for (u64 t = blockIdx.x; t < tr * tc; t += gridDim.x) {
        u64 r0 = (t / tc) * 128, c = (t % tc) * 128 + 4 * cl;
        float4 v[16];
        u32 key = 0;
#pragma unroll
        for (int j = 0; j < 16; j++) {
            u64 r = r0 + rl + 8 * j;
            bool ok = r < rows && c < cols;
            v[j] = ok ? *(const float4 *)(x + r * cols + c) : make_float4(0.f, 0.f, 0.f, 0.f);
            key = max(key, key4(v[j]));
        }
        key = block_max(key, s_k);
        float sinv, a;
        tile_scale(key_f(key), variant, &sinv, &a);
        if (threadIdx.x == 0) scale_inv[t] = sinv;
#pragma unroll
        for (int j = 0; j < 16; j++) {
            u64 r = r0 + rl + 8 * j;
            if (r < rows && c < cols) {
                codes[(r * cols + c) / 4] = fp8_encode4(v[j], a, divide, &sat, &under);
                el += 4;
            }
        }
    }
    flush_stats(stats, el, sat, under);
}

// Any shape (cols not a multiple of 4): tile amax keys, one warp per (row, 128-column tile),
// folded into the tile grid with atomicMax (zero-initialised keys) ...
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

// ... then the tile scales ...
extern "C" __global__ void fp8_block_scales(const u32 *__restrict__ tile_keys, float *scale_inv,
                                            float *apply, u64 tiles, int variant) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= tiles) return;
    tile_scale(key_f(tile_keys[i]), variant, &scale_inv[i], &apply[i]);
}

// ... then every element.
extern "C" __global__ void fp8_block_encode(const float *__restrict__ x, u8 *__restrict__ codes,
                                            const float *__restrict__ apply, u64 rows, u64 cols,
                                            u32 tile_rows, int divide, u64 *stats) {
    u64 tc = (cols + 127) / 128;
    u64 n = rows * cols;
    u32 el = 0, sat = 0, under = 0;
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        u64 r = i / cols, c = i % cols;
        codes[i] = (u8)fp8_encode1(x[i], apply[(r / tile_rows) * tc + c / 128], divide != 0, &sat, &under);
        el += 1;
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
    // Through the same 4-wide encoders the quantizers use (the hardware cvt on sm_89+).
    out[5 * i + 0] = (u8)(e4m3x4(x, x, x, x) & 0xFFu);
    out[5 * i + 1] = (u8)(e5m2x4(x, x, x, x) >> 24);
    out[5 * i + 2] = (u8)e2m1_te(x);
    out[5 * i + 3] = (u8)(b & 0xFF);
    out[5 * i + 4] = (u8)(b >> 8);
    e8m0[i] = (u8)e8m0_ceil(x);
}
