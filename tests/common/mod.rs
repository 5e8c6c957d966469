//! Helpers shared by the test files (each test crate that says `mod common;` compiles its own
//! copy, and uses a subset of it): GPU fixtures and comparisons, and whether a process is gone.
#![allow(dead_code)]

use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use lockstep::engine::backend::cuda::device_ops::GpuOps;
use lockstep::engine::backend::cuda::{self, CudaError};
use lockstep::engine::device::Ops;
use lockstep::engine::device::cpu::CpuOps;
use lockstep::engine::layout::Layout;
use lockstep::engine::model::Routing;
use lockstep::formats::{Fp8BlockVariant, Fp8Elem, Fp8Tile, MxScaleRule, QuantFormat, SecondScale};
use lockstep::recipe::{ModelPlan, SitePlan};
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use std::sync::{Arc, OnceLock};

/// A test file's GPU fixture, built once on first use: `None` where there is no GPU (the test
/// prints `skipping <test>: <why>` and passes); a GPU that is present but fails to set up fails
/// the test instead of skipping it.
pub fn gpu_fixture<T>(
    cell: &'static OnceLock<Result<T, String>>,
    test: &str,
    build: impl FnOnce() -> Result<T, CudaError>,
) -> Option<&'static T> {
    let r = cell.get_or_init(|| match cuda::skip_reason() {
        Some(why) => Err(why),
        None => build().map_err(|e| format!("GPU present but unusable: {e}")),
    });
    match r {
        Ok(v) => Some(v),
        Err(why) if why.starts_with("GPU present") => panic!("{test}: {why}"),
        Err(why) => {
            eprintln!("skipping {test}: {why}");
            None
        }
    }
}

/// The test file's op set on cuda:0 ([`gpu_fixture`]): `None` where there is no GPU.
pub fn gpu_ops(test: &str) -> Option<&'static GpuOps> {
    static G: OnceLock<Result<GpuOps, String>> = OnceLock::new();
    gpu_fixture(&G, test, || GpuOps::new(&cuda::CudaDevice::open(0)?))
}

/// Every format variant the quantizers implement.
pub fn all_formats() -> Vec<QuantFormat> {
    let mut v = vec![QuantFormat::Bf16];
    for elem in [Fp8Elem::E4M3, Fp8Elem::E5M2] {
        for rule in [MxScaleRule::TeCeil, MxScaleRule::OcpFloor] {
            v.push(QuantFormat::Mxfp8 { elem, rule });
        }
    }
    for second in [SecondScale::PerTensor, SecondScale::PerToken] {
        for shards in [1, 2, 4] {
            v.push(QuantFormat::Nvfp4 { second, shards });
        }
    }
    for tile in [Fp8Tile::Act1x128, Fp8Tile::Weight128x128] {
        for variant in [
            Fp8BlockVariant::Te,
            Fp8BlockVariant::DeepseekV3,
            Fp8BlockVariant::DeepseekV3Ue8m0,
            Fp8BlockVariant::Deepgemm,
            Fp8BlockVariant::DeepgemmUe8m0,
        ] {
            v.push(QuantFormat::Fp8Block { tile, variant });
        }
    }
    v
}

/// A uniform FP32 plan, a shipped preset, or "nvfp4-dq-per-tensor": nvfp4-dq with per-tensor
/// second-level activation scales on the experts (the one activation format that is not
/// row-local, so each expert's rows are quantized apart, as on the CPU).
pub fn plan(name: &str, layers: usize) -> ModelPlan {
    match name {
        "fp32" => ModelPlan::uniform(layers, SitePlan::FP32),
        "nvfp4-dq-per-tensor" => {
            let mut p = plan("nvfp4-dq", layers);
            for l in &mut p.layers {
                l.experts_fc1.act_scale = SecondScale::PerTensor;
                l.experts_fc2.act_scale = SecondScale::PerTensor;
            }
            p
        }
        _ => lockstep::recipe::presets::preset(name)
            .unwrap()
            .resolve(layers)
            .unwrap(),
    }
}

/// The fraction of expert choices two routing records share, position by position.
pub fn agreement(a: &Routing, b: &Routing) -> f64 {
    let (mut same, mut all) = (0usize, 0usize);
    for (la, lb) in a.layers.iter().zip(&b.layers) {
        same += la.iter().zip(lb).filter(|(x, y)| x == y).count();
        all += la.len();
    }
    same as f64 / all.max(1) as f64
}

/// Bit patterns, to compare floats exactly (NaN included).
pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Uniform values in [-scale, scale).
pub fn uniform(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| (rng.random::<f32>() * 2.0 - 1.0) * scale)
        .collect()
}

/// `Err` naming the first element whose bits differ.
pub fn same_bits(what: &str, gpu: &[f32], cpu: &[f32]) -> Result<(), String> {
    if gpu.len() != cpu.len() {
        return Err(format!("{what}: {} values vs {}", gpu.len(), cpu.len()));
    }
    match gpu
        .iter()
        .zip(cpu)
        .position(|(a, b)| a.to_bits() != b.to_bits())
    {
        None => Ok(()),
        Some(i) => Err(format!(
            "{what}: element {i} differs: gpu {:e} ({:#010x}) cpu {:e} ({:#010x})",
            gpu[i],
            gpu[i].to_bits(),
            cpu[i],
            cpu[i].to_bits()
        )),
    }
}

/// max over elements of |gpu − cpu| / max(|cpu|, floor) (NaN against anything but NaN counts as
/// infinite), and where it is largest.
pub fn max_rel(gpu: &[f32], cpu: &[f32], floor: f32) -> (f32, usize) {
    assert_eq!(gpu.len(), cpu.len());
    let mut worst = (0.0f32, 0);
    for (i, (&g, &c)) in gpu.iter().zip(cpu).enumerate() {
        let r = match (g.is_nan(), c.is_nan()) {
            (true, true) => 0.0,
            (false, false) => (g - c).abs() / c.abs().max(floor),
            _ => f32::INFINITY,
        };
        if r > worst.0 {
            worst = (r, i);
        }
    }
    worst
}

pub fn assert_rel(what: &str, gpu: &[f32], cpu: &[f32], floor: f32, bound: f32) {
    let (r, i) = max_rel(gpu, cpu, floor);
    assert!(
        r < bound,
        "{what}: relative error {r:e} >= {bound:e} at element {i} (gpu {:e}, cpu {:e})",
        gpu[i],
        cpu[i]
    );
}

pub fn max_abs(v: &[f32]) -> f32 {
    v.iter().fold(0.0f32, |m, x| m.max(x.abs()))
}

/// A ragged shared-prefix layout at the benchmark's shape: `b` sequences of `t` positions in
/// groups of `n` sharing a `prefix`-token prompt, sequence s keeping `used[s]` positions (some end
/// inside the prompt, some run to the end).
pub fn ragged(rng: &mut ChaCha8Rng, b: usize, t: usize, n: usize, prefix: usize) -> Layout {
    let mut tokens = vec![0u32; b * t];
    for s in 0..b {
        for p in 0..t {
            tokens[s * t + p] = if p < prefix {
                (s / n * 7 + p) as u32
            } else {
                rng.random_range(0..32)
            };
        }
    }
    let used: Vec<usize> = (0..b)
        .map(|s| match s % 5 {
            0 => t,
            1 => prefix - 1,
            _ => rng.random_range(prefix..=t),
        })
        .collect();
    let l = Layout::shared_prefix(&tokens, b, t, n, prefix, Some(&used));
    assert_ne!(
        l,
        Layout::plain(b, t),
        "the test layout must share prefixes"
    );
    l
}

/// What a test body generic over the op set needs beyond [`Ops`]: a parameter (norm gain,
/// embedding table) from host values, which the CPU borrows and a GPU uploads.
pub trait Device<'a>: Ops {
    fn param(&self, x: &'a [f32]) -> Self::Param;
}

impl<'a> Device<'a> for CpuOps<'a> {
    fn param(&self, x: &'a [f32]) -> &'a [f32] {
        x
    }
}

impl<'a> Device<'a> for GpuOps {
    fn param(&self, x: &'a [f32]) -> CudaSlice<f32> {
        self.upload(x).unwrap()
    }
}

impl StreamIo for GpuOps {
    fn stream(&self) -> &Arc<CudaStream> {
        GpuOps::stream(self)
    }
}

/// Copies between the host and a test fixture's stream (a fixture implements `stream`).
pub trait StreamIo {
    fn stream(&self) -> &Arc<CudaStream>;

    fn up<T: DeviceRepr>(&self, v: &[T]) -> CudaSlice<T> {
        self.stream().clone_htod(v).unwrap()
    }

    fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> CudaSlice<T> {
        self.stream().alloc_zeros(n).unwrap()
    }

    /// Waits for the stream, so every queued kernel has finished.
    fn down<T: DeviceRepr + Default + Clone>(&self, d: &CudaSlice<T>) -> Vec<T> {
        let v = self.stream().clone_dtoh(d).unwrap();
        self.stream().synchronize().unwrap();
        v
    }
}

/// An out-of-bounds store on `ordinal`'s primary context (the one the engine's backend uses),
/// then a wait that returns the fault: from here every call on that context fails, as after a
/// hardware fault.
pub fn fault(ordinal: usize) {
    use cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
    let ctx = CudaContext::new(ordinal).unwrap();
    let src =
        r#"extern "C" __global__ void oob(float* p) { p[(1ull << 40) + threadIdx.x] = 1.0f; }"#;
    let ptx = cudarc::nvrtc::compile_ptx(src).unwrap();
    let f = ctx.load_module(ptx).unwrap().load_function("oob").unwrap();
    let stream = ctx.new_stream().unwrap();
    let buf = stream.alloc_zeros::<f32>(32).unwrap();
    let mut launch = stream.launch_builder(&f);
    launch.arg(&buf);
    // SAFETY: deliberately unsafe: the kernel writes far outside `buf` to fault the context.
    let _ = unsafe { launch.launch(LaunchConfig::for_num_elems(32)) };
    assert!(
        stream.synchronize().is_err(),
        "the planted fault did not fault"
    );
}

/// True once process `pid` is gone or a zombie (killed, waiting for its parent or init to reap
/// it), polling until `limit`.
pub fn gone_within(pid: &str, limit: std::time::Duration) -> bool {
    let t0 = std::time::Instant::now();
    loop {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let state = stat
            .rsplit(')')
            .next()
            .and_then(|r| r.split_whitespace().next());
        if matches!(state, None | Some("Z") | Some("X")) {
            return true;
        }
        if t0.elapsed() > limit {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// Largest |a - b| over the largest |b| (b the reference).
pub fn rel(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-30);
    a.iter()
        .zip(b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
        / scale
}

/// Two recipes (BF16, and NVFP4 with dequantized backward operands) × 3 seeds on the tiny
/// model, 4 steps: the suite of the GPU sweep tests, named `name` (its store folder).
pub fn tiny_two_recipe_suite(
    name: &str,
) -> (
    lockstep::suite::spec::SuiteSpec,
    Vec<lockstep::suite::plan::RunSpec>,
) {
    let text = format!(
        r#"
name = "{name}"
seeds = [0, 1, 2]
[workload]
model = "tiny"
steps = 4
prompts_per_step = 4
samples_per_prompt = 4
[workload.warm_start]
max_steps = 4
eval_prompts = 8
[[configs]]
name = "bf16"
recipe = "bf16"
[[configs]]
name = "nvfp4-dq"
recipe = "nvfp4-dq"
"#
    );
    let s =
        lockstep::suite::spec::parse(&text, std::path::Path::new(&format!("{name}.toml"))).unwrap();
    let runs = lockstep::suite::plan::expand(&s).unwrap();
    (s, runs)
}

/// Every deterministic scalar (as bits) of every step a run recorded.
pub fn step_bits(rd: &lockstep::store::RunDir) -> Vec<std::collections::BTreeMap<String, u64>> {
    rd.read_scalars()
        .unwrap()
        .iter()
        .map(|s| s.deterministic_scalars())
        .collect()
}

/// Activation counts of one pass against a reference pass of the same model whose GEMMs sum in
/// another order (the CPU, or the same run outside a batch): the first site's input (embedding +
/// RMSNorm, no GEMM) must count the same; later sites see GEMM outputs, where a value at a
/// format's edge can fall either side, so their totals may move by a few. None when they agree.
pub fn counts_disagree(
    got: &[(String, lockstep::formats::QuantStats)],
    reference: &[(String, lockstep::formats::QuantStats)],
) -> Option<String> {
    let names = |s: &[(String, lockstep::formats::QuantStats)]| -> Vec<String> {
        s.iter().map(|(n, _)| n.clone()).collect()
    };
    if names(got) != names(reference) {
        return Some("count sites differ".into());
    }
    let pair = |q: &lockstep::formats::QuantStats| (q.saturated, q.underflowed);
    if let (Some((n, g)), Some((_, r))) = (got.first(), reference.first())
        && pair(g) != pair(r)
    {
        return Some(format!("{n} counts {:?} vs {:?}", pair(g), pair(r)));
    }
    let total = |s: &[(String, lockstep::formats::QuantStats)]| {
        s.iter().fold((0u64, 0u64), |(a, b), (_, q)| {
            (a + q.saturated, b + q.underflowed)
        })
    };
    let (gt, rt) = (total(got), total(reference));
    eprintln!("  counts (saturated, underflowed): {gt:?} against {rt:?}");
    let close = |g: u64, r: u64| g.abs_diff(r) as f64 <= 8.0 + 0.02 * r as f64;
    (!close(gt.0, rt.0) || !close(gt.1, rt.1)).then(|| format!("counts {gt:?} vs {rt:?}"))
}
