// Decoding of the GPU quantizer's output (and BF16 rounding) on the device, compiled at run time
// by NVRTC with the exact-arithmetic options of `CudaDevice::compile`.
//
// Row-wise fake quantization is `CudaQuantizer::quantize_into` (quant.cu, the one quantizer on the
// GPU, tested byte for byte against the CPU) followed by one kernel here that only DECODES its
// buffers (codes, scales, second-level amax) to FP32 with the CPU's dequantize arithmetic and
// multiplication order (`QuantizedTensor::dequantize_blocked`, `mxfp8::dequantize_block`,
// `nvfp4::dequantize_block`, `fp8_block::decode`). Nothing here derives a code or a scale.
// Layouts (see `formats::tensor` and quant.rs): codes of the row-major blocked view, one byte an
// element (FP4: two a byte, element 2i in the low nibble); scale bytes one per block, row-major;
// FP8 block scales one FP32 `scale_inv` per tile; NVFP4 global amax as keys (FP32 bits, any key
// above 0x7F800000 is the CPU's NaN).
//
// NaN bits: NVIDIA arithmetic returns 0x7FFFFFFF for any NaN result; the host propagates the NaN
// operand (quieted) and returns its own "default NaN" for an invalid operation (0 x Inf: x86
// 0xFFC00000). Every decode product goes through `hmul`, which does what the host does; the
// host's default NaN is measured in Rust and passed in (`dnan`), as is fp32(1/2688).
//
// The one exception to "decode only" is `bf16_round`: BF16 fake quantization in one pass, the
// GPU's counterpart of the CPU's own one-pass special case `tensor::fake_quantize_bf16` (round to
// BF16 and back; no scales), also used to round operands to BF16.

typedef unsigned int u32;
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned long long u64;

#define F32_NAN_BITS 0x7FC00000u

__device__ __forceinline__ u32 fbits(float x) { return __float_as_uint(x); }
__device__ __forceinline__ float bitsf(u32 u) { return __uint_as_float(u); }
__device__ __forceinline__ bool is_nan(float x) { return (fbits(x) & 0x7FFFFFFFu) > 0x7F800000u; }

// a * b with the host's NaN rules: a NaN operand propagates quieted (the first one if both are
// NaN; every NaN pair here has equal bits), an invalid product gives the host's default NaN.
__device__ __forceinline__ float hmul(float a, float b, u32 dnan) {
    if (is_nan(a)) return bitsf(fbits(a) | 0x00400000u);
    if (is_nan(b)) return bitsf(fbits(b) | 0x00400000u);
    float r = a * b;
    return is_nan(r) ? bitsf(dnan) : r;
}

// The sign bit of a code applied by bit operation (also to NaN, exactly as Rust's negation).
__device__ __forceinline__ float with_sign(float mag, bool neg) {
    return bitsf(fbits(mag) | (neg ? 0x80000000u : 0u));
}

// ---- element and scale decoders (formats::{fp8, e2m1, e8m0}) -------------------------------------

// fp8::e4m3_to_f32 (exact; 0x7F and 0xFF are f32::NAN, unsigned).
__device__ __forceinline__ float e4m3_decode(u32 c) {
    u32 e = (c >> 3) & 0xFu, m = c & 7u;
    if (e == 15u && m == 7u) return bitsf(F32_NAN_BITS);
    float mag = e == 0u ? (float)m * (1.0f / 512.0f) : bitsf(((e + 120u) << 23) | (m << 20));
    return with_sign(mag, (c & 0x80u) != 0);
}

// fp8::e5m2_to_f32 (exact; exponent field 31 is Inf or NaN, with the code's sign).
__device__ __forceinline__ float e5m2_decode(u32 c) {
    u32 e = (c >> 2) & 0x1Fu, m = c & 3u;
    float mag;
    if (e == 31u) mag = bitsf(m == 0u ? 0x7F800000u : F32_NAN_BITS);
    else if (e == 0u) mag = (float)m * (1.0f / 65536.0f);
    else mag = bitsf(((e + 112u) << 23) | (m << 21));
    return with_sign(mag, (c & 0x80u) != 0);
}

// e2m1::E2M1_VALUES[c & 15] (code 8 is -0.0).
__device__ __forceinline__ float e2m1_value(u32 c) {
    u32 m = c & 7u;
    float mag = m < 4u ? (float)m * 0.5f : (m == 7u ? 6.0f : (float)(m - 2u));
    return with_sign(mag, (c & 8u) != 0);
}

// e8m0::e8m0_to_f32: 2^(b-127); 0x00 is the subnormal 2^-127, 0xFF is NaN.
__device__ __forceinline__ float e8m0_value(u32 b) {
    if (b == 0xFFu) return bitsf(F32_NAN_BITS);
    if (b == 0u) return bitsf(0x00400000u);
    return bitsf(b << 23);
}

// An amax key as the FP32 amax the CPU holds (any NaN as f32::NAN).
__device__ __forceinline__ float key_f(u32 k) { return bitsf(k > 0x7F800000u ? F32_NAN_BITS : k); }

// ---- BF16 -----------------------------------------------------------------------------------------

// bf16::bf16_from_f32 (as quant.cu's `bf16_rne`; the sweep test holds both to the CPU).
__device__ __forceinline__ u16 bf16_rne(float x) {
    u32 u = fbits(x);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (u16)((u >> 16) | 0x0040u);
    u32 lsb = (u >> 16) & 1u;
    return (u16)((u + 0x7FFFu + lsb) >> 16);
}

// bf16::round_bf16 (and the BF16 row fake quantization): out[i] = bf16_to_f32(bf16_from_f32(x[i])).
extern "C" __global__ void bf16_round(const float *__restrict__ x, float *__restrict__ out, u64 n) {
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        out[i] = bitsf((u32)bf16_rne(x[i]) << 16);
}

// The BF16 bits of two tensors' values (bf16_rne) in one launch: a BF16 tensor-core GEMM's
// operands, from FP32 tensors that hold BF16 values (then exactly their bits).
extern "C" __global__ void bf16_pack2(const float *__restrict__ a, u16 *__restrict__ pa, u64 na,
                                      const float *__restrict__ b, u16 *__restrict__ pb, u64 nb) {
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < na + nb; i += stride) {
        if (i < na)
            pa[i] = bf16_rne(a[i]);
        else
            pb[i - na] = bf16_rne(b[i - na]);
    }
}

// bf16_round that also counts as `tensor::fake_quantize_bf16` does (`Bf16Counts::add`): acc[1] +=
// finite inputs that round to infinity, acc[2] += nonzero inputs that round to zero, acc[0] += n.
// Integer atomics: the totals do not depend on the order.
// Count slots: the grid's y index takes the y-th of gridDim.y tensors of n values stored back to
// back (a run each), counted into acc[3y..3y+3].
extern "C" __global__ void bf16_round_count(const float *__restrict__ x, float *__restrict__ out,
                                            u64 n, u64 *__restrict__ acc) {
    x += (u64)blockIdx.y * n;
    out += (u64)blockIdx.y * n;
    acc += 3 * (u64)blockIdx.y;
    u64 stride = (u64)gridDim.x * blockDim.x;
    u64 sat = 0, under = 0;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float v = x[i];
        float r = bitsf((u32)bf16_rne(v) << 16);
        out[i] = r;
        bool finite = (fbits(v) & 0x7F800000u) != 0x7F800000u;
        bool inf = (fbits(r) & 0x7FFFFFFFu) == 0x7F800000u;
        sat += (u64)(finite && inf);
        under += (u64)(v != 0.0f && r == 0.0f);
    }
    if (sat) atomicAdd(acc + 1, sat);
    if (under) atomicAdd(acc + 2, under);
    if (blockIdx.x == 0 && threadIdx.x == 0) atomicAdd(acc, n);
}

// ---- MXFP8: mxfp8::dequantize_block, x' = decode(code) · 2^(b-127) --------------------------------
// A thread per four elements (one u32 of codes, one float4 out); `n4` = n/4, n a multiple of 32,
// so scale byte i/8 belongs to all four. ELEM: 0 E4M3, 1 E5M2.

template <int ELEM>
__device__ __forceinline__ float mx_decode(u32 c) {
    return ELEM == 0 ? e4m3_decode(c) : e5m2_decode(c);
}

template <int ELEM>
__device__ __forceinline__ void mxfp8_dq(const u32 *__restrict__ codes, const u8 *__restrict__ scales,
                                         float4 *__restrict__ out, u64 n4, u32 dnan) {
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += stride) {
        u32 p = codes[i];
        float s = e8m0_value(scales[i >> 3]);
        out[i] = make_float4(hmul(mx_decode<ELEM>(p & 0xFFu), s, dnan),
                             hmul(mx_decode<ELEM>((p >> 8) & 0xFFu), s, dnan),
                             hmul(mx_decode<ELEM>((p >> 16) & 0xFFu), s, dnan),
                             hmul(mx_decode<ELEM>(p >> 24), s, dnan));
    }
}

extern "C" __global__ void mxfp8_dq_e4m3(const u32 *__restrict__ codes, const u8 *__restrict__ scales,
                                         float4 *__restrict__ out, u64 n4, u32 dnan) {
    mxfp8_dq<0>(codes, scales, out, n4, dnan);
}
extern "C" __global__ void mxfp8_dq_e5m2(const u32 *__restrict__ codes, const u8 *__restrict__ scales,
                                         float4 *__restrict__ out, u64 n4, u32 dnan) {
    mxfp8_dq<1>(codes, scales, out, n4, dnan);
}

// ---- NVFP4: nvfp4::dequantize_block ---------------------------------------------------------------
// fin = fp32(fp32(e4m3(scale) · amax) · fp32(1/2688)), x' = e2m1(code) · fin. A thread per
// 16-element block b (of `nblocks`): its eight code bytes (one uint2), its scale byte, and the
// global amax of its (row, shard) segment b / L: keys[b / L] per token, keys[(b / L) % shards]
// per tensor.
extern "C" __global__ void nvfp4_dq(const uint2 *__restrict__ codes, const u8 *__restrict__ scales,
                                    const u32 *__restrict__ keys, float4 *__restrict__ out,
                                    u64 nblocks, u64 L, u64 shards, int per_token, float rcp2688,
                                    u32 dnan) {
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 b = (u64)blockIdx.x * blockDim.x + threadIdx.x; b < nblocks; b += stride) {
        uint2 w = codes[b];
        u64 seg = b / L;
        float amax = key_f(keys[per_token ? seg : seg % shards]);
        float fin = hmul(hmul(e4m3_decode(scales[b]), amax, dnan), rcp2688, dnan);
        float o[16];
#pragma unroll
        for (int j = 0; j < 8; j++) {
            o[j] = hmul(e2m1_value(w.x >> (4 * j)), fin, dnan);
            o[8 + j] = hmul(e2m1_value(w.y >> (4 * j)), fin, dnan);
        }
#pragma unroll
        for (int k = 0; k < 4; k++)
            out[4 * b + k] = make_float4(o[4 * k], o[4 * k + 1], o[4 * k + 2], o[4 * k + 3]);
    }
}

// ---- FP8 block scaling: fp8_block::decode, x' = e4m3(code) · scale_inv ------------------------------
// A warp per (row, 128-column tile) (the last tile of a row may be partial); the tile's
// `scale_inv` is scales[(r / tile_rows) · tc + t] (tile_rows 1 for 1x128, 128 for 128x128).
extern "C" __global__ void fp8_block_dq(const u8 *__restrict__ codes, const float *__restrict__ scales,
                                        float *__restrict__ out, u64 rows, u64 cols, u64 tile_rows,
                                        u32 dnan) {
    u32 lane = threadIdx.x & 31;
    u64 tc = (cols + 127) / 128;
    u64 warp = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    u64 nwarps = ((u64)gridDim.x * blockDim.x) >> 5;
    for (u64 w = warp; w < rows * tc; w += nwarps) {
        u64 r = w / tc, t = w % tc;
        float sinv = scales[(r / tile_rows) * tc + t];
        u64 c1 = min(t * 128 + 128, cols);
        for (u64 c = t * 128 + lane; c < c1; c += 32) {
            u64 i = r * cols + c;
            out[i] = hmul(e4m3_decode(codes[i]), sinv, dnan);
        }
    }
}
