//! The CUDA emulator's own semantics (`scripts/cuda-emu`), checked where it stands in for a GPU.
//!
//! It skips everywhere else (on a real GPU, and without one): it is about the emulator, and its
//! last kernel deadlocks on purpose, which a GPU would hang on. Under the emulator: a shared
//! memory tree reduction across `__syncthreads`, shuffles, votes and warp reductions give exactly
//! what CUDA defines; a graph capture refuses a kernel of more parameters than it copies; and a
//! block whose threads wait at barriers the others never reach fails its launch (and, as CUDA's
//! sticky errors, every later call on the device) instead of hanging.

use std::sync::Arc;

use cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
use lockstep::engine::backend::cuda;

const KERNELS: &str = r#"
extern "C" __global__ void block_sum(const unsigned *x, unsigned *out) {
    __shared__ unsigned s[256];
    unsigned t = threadIdx.x;
    s[t] = x[blockIdx.x * blockDim.x + t];
    __syncthreads();
    for (unsigned o = blockDim.x / 2; o > 0; o >>= 1) {
        if (t < o) s[t] += s[t + o];
        __syncthreads();
    }
    if (t == 0) out[blockIdx.x] = s[0];
}

// Per thread: [butterfly sum over the warp, ballot of odd lanes, lane 3's value, warp max].
extern "C" __global__ void warp_ops(const unsigned *x, unsigned *out) {
    unsigned t = blockIdx.x * blockDim.x + threadIdx.x, v = x[t], s = v;
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xFFFFFFFFu, s, o);
    out[4 * t] = s;
    out[4 * t + 1] = __ballot_sync(0xFFFFFFFFu, threadIdx.x & 1);
    out[4 * t + 2] = __shfl_sync(0xFFFFFFFFu, v, 3);
    out[4 * t + 3] = __reduce_max_sync(0xFFFFFFFFu, v);
}

// Lane 0 waits for lane 1 at a warp barrier while lane 1 waits for lane 0 at the block's.
extern "C" __global__ void deadlock(unsigned *out) {
    if (threadIdx.x == 0) __syncwarp(3u);
    else __syncthreads();
    out[threadIdx.x] = 1;
}
"#;

#[test]
fn emulated_barriers_warps_captures_and_deadlocks_behave_as_cuda_defines() {
    if cuda::skip_reason().is_some() {
        eprintln!("skipping: no CUDA device (real or emulated)");
        return;
    }
    let ctx = CudaContext::new(0).unwrap();
    if !ctx.name().unwrap().starts_with("lockstep CUDA emulator") {
        eprintln!("skipping: a real GPU (this test is about the emulator)");
        return;
    }
    let module = ctx
        .load_module(cudarc::nvrtc::compile_ptx(KERNELS).unwrap())
        .unwrap();
    // Before the deadlock below, whose error is sticky.
    capture_refuses_a_kernel_of_more_parameters_than_it_copies(&ctx);
    let stream = ctx.default_stream();
    let launch = |blocks: u32, threads: u32| LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    };
    let x: Vec<u32> = (0..1024u32)
        .map(|i| i.wrapping_mul(2654435761) >> 20)
        .collect();
    let dx = stream.clone_htod(&x).unwrap();

    let mut sums = stream.alloc_zeros::<u32>(4).unwrap();
    let f = module.load_function("block_sum").unwrap();
    let mut b = stream.launch_builder(&f);
    b.arg(&dx).arg(&mut sums);
    // SAFETY: 4 blocks of 256 threads read x[0..1024] and write sums[0..4], all allocated.
    unsafe { b.launch(launch(4, 256)) }.unwrap();
    let want: Vec<u32> = x.chunks(256).map(|c| c.iter().sum()).collect();
    assert_eq!(stream.clone_dtoh(&sums).unwrap(), want, "block sums");

    let mut out = stream.alloc_zeros::<u32>(4 * 1024).unwrap();
    let f = module.load_function("warp_ops").unwrap();
    let mut b = stream.launch_builder(&f);
    b.arg(&dx).arg(&mut out);
    // SAFETY: 8 blocks of 128 threads read x[0..1024] and write out[0..4096].
    unsafe { b.launch(launch(8, 128)) }.unwrap();
    let out = stream.clone_dtoh(&out).unwrap();
    for (w, lanes) in x.chunks(32).enumerate() {
        for l in 0..32 {
            let got = &out[4 * (32 * w + l)..4 * (32 * w + l) + 4];
            let want = [
                lanes.iter().sum::<u32>(),
                0xAAAA_AAAA,
                lanes[3],
                *lanes.iter().max().unwrap(),
            ];
            assert_eq!(got, want, "warp {w} lane {l}");
        }
    }

    let mut flags = stream.alloc_zeros::<u32>(32).unwrap();
    let f = module.load_function("deadlock").unwrap();
    let mut b = stream.launch_builder(&f);
    b.arg(&mut flags);
    // SAFETY: one block of 32 threads writes flags[0..32]; it deadlocks before that by design.
    let r = unsafe { b.launch(launch(1, 32)) };
    let e = format!(
        "{:?}",
        r.expect_err("a deadlocked block must fail its launch")
    );
    assert!(e.contains("LAUNCH_FAILED"), "{e}");
    let later = format!(
        "{:?}",
        stream.synchronize().expect_err("the error is sticky")
    );
    assert!(later.contains("LAUNCH_FAILED"), "{later}");
}

/// A graph capture copies each kernel argument's bytes, by the kernel's parameter sizes, into a
/// buffer of 64: a kernel of more parameters is refused while capturing (the capture is then
/// invalid) rather than written past that buffer, and launches as usual outside a capture.
fn capture_refuses_a_kernel_of_more_parameters_than_it_copies(ctx: &Arc<CudaContext>) {
    use cudarc::driver::sys;
    // out[0] = a0 + ... + a(n-1), for kernels of n + 1 parameters.
    let kernel = |name: &str, n: usize| {
        let params: Vec<String> = (0..n).map(|i| format!("unsigned a{i}")).collect();
        let sum: Vec<String> = (0..n).map(|i| format!("a{i}")).collect();
        format!(
            "extern \"C\" __global__ void {name}(unsigned *out, {}) {{ out[0] = {}; }}\n",
            params.join(", "),
            sum.join(" + ")
        )
    };
    let src = kernel("args64", 63) + &kernel("args65", 64);
    let module = ctx
        .load_module(cudarc::nvrtc::compile_ptx(src).unwrap())
        .unwrap();
    let stream = ctx.new_stream().unwrap();
    let one = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (1, 1, 1),
        shared_mem_bytes: 0,
    };
    let args: Vec<u32> = (1..=64).collect();
    let mut out = stream.alloc_zeros::<u32>(1).unwrap();
    let launch = |name: &str, n: usize, out: &mut cudarc::driver::CudaSlice<u32>| {
        let f = module.load_function(name).unwrap();
        let mut b = stream.launch_builder(&f);
        b.arg(out);
        for a in &args[..n] {
            b.arg(a);
        }
        // SAFETY: one thread writes out[0], allocated; the arguments match the parameters.
        unsafe { b.launch(one) }.map(|_| ())
    };
    // Outside a capture both run.
    launch("args65", 64, &mut out).unwrap();
    assert_eq!(stream.clone_dtoh(&out).unwrap(), vec![64 * 65 / 2]);
    // Captured: 64 parameters are recorded and replayed; 65 are refused.
    let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
    let flags = sys::CUgraphInstantiate_flags(0);
    stream.begin_capture(mode).unwrap();
    launch("args64", 63, &mut out).unwrap();
    let graph = stream.end_capture(flags).unwrap().expect("a graph");
    graph.launch().unwrap();
    assert_eq!(stream.clone_dtoh(&out).unwrap(), vec![63 * 64 / 2]);
    stream.begin_capture(mode).unwrap();
    let refused = launch("args65", 64, &mut out);
    let ended = stream.end_capture(flags);
    let e = format!("{:?}", refused.expect_err("65 parameters captured"));
    assert!(e.contains("CAPTURE_UNSUPPORTED"), "{e}");
    assert!(
        ended.is_err(),
        "a capture that refused a launch ends invalid"
    );
}
