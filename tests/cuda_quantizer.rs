//! Issue 7 (CUDA backend): the GPU quantizer's bytes equal the CPU quantizer's (`lockstep::formats`,
//! itself pinned by the golden vectors) on every golden input and on large random tensors with
//! outliers, subnormals, zeros, Inf and NaN, for every format, axis and shard count; every element
//! codec agrees on a sweep of FP32 bit patterns; the same seed gives identical metrics run to run
//! on the GPU (cuBLAS GEMMs against the CPU's: `tests/cuda_linear.rs`).
//!
//! Each test prints why and returns when no GPU is usable (CPU-only CI); the last test checks that
//! `--device cuda` is then a one-line error. Run them on a GPU machine with
//! `cargo test --release --test cuda_quantizer -- --nocapture`.

mod common;

use lockstep::engine::backend::Backend;
use lockstep::engine::backend::cuda::{self, CudaBackend, CudaDevice, CudaQuantizer};
use lockstep::formats::bf16::bf16_from_f32;
use lockstep::formats::e2m1::{E2m1Convention, e2m1_from_f32};
use lockstep::formats::e8m0::e8m0_ceil_from_f32;
use lockstep::formats::fp8::{e4m3_from_f32_sat, e5m2_from_f32_sat};
use lockstep::formats::{Axis, QuantFormat, QuantizedTensor, Scales, SecondScale, quantize};
use serde_json::Value;
use std::path::Path;
use std::sync::{Arc, OnceLock};

/// The shared quantizer, or `None` (with the reason printed) where there is no GPU.
fn gpu(test: &str) -> Option<&'static CudaQuantizer> {
    static Q: OnceLock<Result<CudaQuantizer, String>> = OnceLock::new();
    common::gpu_fixture(&Q, test, || CudaQuantizer::new(&CudaDevice::open(0)?))
}

fn scale_bytes(q: &QuantizedTensor) -> Vec<u8> {
    match &q.scales {
        Scales::None => vec![],
        Scales::E8m0(s) | Scales::E4m3(s) => s.clone(),
        Scales::F32(s) => s.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect(),
    }
}

/// Byte equality of two quantized tensors, or the first difference.
fn diff(cpu: &QuantizedTensor, gpu: &QuantizedTensor) -> Option<String> {
    if cpu.codes != gpu.codes {
        let i = cpu.codes.iter().zip(&gpu.codes).position(|(a, b)| a != b);
        return Some(format!(
            "codes differ (len {} vs {}), first at byte {i:?}: cpu {:?} gpu {:?}",
            cpu.codes.len(),
            gpu.codes.len(),
            i.map(|i| cpu.codes[i]),
            i.map(|i| gpu.codes[i])
        ));
    }
    let (a, b) = (scale_bytes(cpu), scale_bytes(gpu));
    if a != b {
        let i = a.iter().zip(&b).position(|(x, y)| x != y);
        return Some(format!("scales differ, first at byte {i:?}"));
    }
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    if bits(&cpu.global_amax) != bits(&gpu.global_amax) {
        return Some(format!(
            "global amax differs: cpu {:?} gpu {:?}",
            &cpu.global_amax[..cpu.global_amax.len().min(4)],
            &gpu.global_amax[..gpu.global_amax.len().min(4)]
        ));
    }
    if cpu.stats != gpu.stats {
        return Some(format!(
            "stats differ: cpu {:?} gpu {:?}",
            cpu.stats, gpu.stats
        ));
    }
    None
}

/// Quantize on both devices; `Err` describes the first mismatch.
fn same_bytes(
    q: &CudaQuantizer,
    x: &[f32],
    rows: usize,
    cols: usize,
    fmt: &QuantFormat,
    axis: Axis,
) -> Result<(), String> {
    let c = quantize(x, rows, cols, fmt, axis).map_err(|e| format!("cpu: {e}"))?;
    let g = q
        .quantize(x, rows, cols, fmt, axis)
        .map_err(|e| format!("gpu: {e}"))?;
    match diff(&c, &g) {
        None => Ok(()),
        Some(d) => Err(format!("{} {axis:?} {rows}x{cols}: {d}", fmt.name())),
    }
}

fn golden(name: &str) -> Value {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name);
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

fn xs(v: &Value) -> Vec<f32> {
    v["x_bits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| {
            f32::from_bits(
                u32::from_str_radix(h.as_str().unwrap().trim_start_matches("0x"), 16).unwrap(),
            )
        })
        .collect()
}

/// Every golden input tensor as (name, values, rows, cols).
fn golden_tensors() -> Vec<(String, Vec<f32>, usize, usize)> {
    let mut out = Vec::new();
    for f in ["bf16.json", "e4m3.json", "e2m1.json"] {
        let x = xs(&golden(f));
        let n = x.len();
        out.push((f.to_string(), x, 1, n));
    }
    for c in golden("mxfp8.json")["cases"].as_array().unwrap() {
        for (i, b) in c["blocks"].as_array().unwrap().iter().enumerate() {
            let x = xs(b);
            let n = x.len();
            out.push((format!("mxfp8 {} block {i}", c["name"]), x, 1, n));
        }
    }
    for c in golden("nvfp4.json")["cases"].as_array().unwrap() {
        let s = c["shape"].as_array().unwrap();
        let (r, k) = (
            s[0].as_u64().unwrap() as usize,
            s[1].as_u64().unwrap() as usize,
        );
        out.push((format!("nvfp4 {}", c["name"]), xs(c), r, k));
    }
    for c in golden("fp8_block.json")["cases"].as_array().unwrap() {
        let x = xs(c);
        let n = x.len();
        out.push((format!("fp8_block {}", c["name"]), x, 1, n));
    }
    out
}

#[test]
fn gpu_quantizer_matches_cpu_on_every_golden_vector() {
    let Some(q) = gpu("gpu_quantizer_matches_cpu_on_every_golden_vector") else {
        return;
    };
    let mut checked = 0;
    let mut failures = Vec::new();
    for (name, x, rows, cols) in golden_tensors() {
        for fmt in common::all_formats() {
            for axis in [Axis::Row, Axis::Col] {
                // Only the shapes the CPU accepts (block multiples along the blocked dimension).
                if quantize(&x, rows, cols, &fmt, axis).is_err() {
                    continue;
                }
                checked += 1;
                if let Err(e) = same_bytes(q, &x, rows, cols, &fmt, axis) {
                    failures.push(format!("{name}: {e}"));
                }
            }
        }
    }
    for f in failures.iter().take(10) {
        eprintln!("FAIL {f}");
    }
    assert!(
        failures.is_empty(),
        "{} of {checked} golden quantizations differ",
        failures.len()
    );
    // Every golden case was run in at least its own format (83 cases; most run in several).
    assert!(checked > 300, "only {checked} quantizations checked");
}

/// Activation-like values with the hard cases mixed in: 1e4-scale outliers, FP32 subnormals,
/// zeros of both signs, values at E4M3/E2M1 ties, Inf and NaN (the spec defines both).
fn nasty(n: usize, seed: u64, specials: bool) -> Vec<f32> {
    let mut x = lockstep::tools::bench_gpu::bench_input(n, seed);
    if specials {
        for (i, v) in x.iter_mut().enumerate() {
            let h = (i as u64 ^ seed).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 50;
            *v = match h {
                0 => f32::NAN,
                1 => f32::INFINITY,
                2 => f32::NEG_INFINITY,
                3 => -0.0,
                4 => 464.0, // the E4M3 tie above 448
                5 => 5.0,   // an E2M1 tie
                6 => f32::MAX,
                7 => -f32::from_bits(1),
                _ => *v,
            };
        }
    }
    x
}

#[test]
fn gpu_quantizer_matches_cpu_on_large_random_tensors() {
    let Some(q) = gpu("gpu_quantizer_matches_cpu_on_large_random_tensors") else {
        return;
    };
    // Per-token NVFP4 has two kernels: the staged one (the default wherever it runs, checked
    // here so that this test covers it on such a GPU) and the register one, checked alongside.
    let dev = CudaDevice::open(0).expect("device 0 opened above");
    let register = CudaQuantizer::new(&dev)
        .expect("quantizer compiled above")
        .with_staged_nvfp4(false);
    if dev.compute_capability().0 >= 9 {
        assert!(
            q.uses_staged_nvfp4(1024),
            "the staged kernel should run here"
        );
    }
    let per_token = |f: &QuantFormat| {
        matches!(
            f,
            QuantFormat::Nvfp4 {
                second: SecondScale::PerToken,
                ..
            }
        )
    };
    let mut failures = Vec::new();
    // (rows, cols, specials): a large finite tensor, one with NaN/Inf sprinkled in (most blocks
    // then hold a special), an odd shape (partial FP8 tiles, BF16 with no vector width), and rows
    // of 16448 = 64·257 columns: longer than the 16384 elements an NVFP4 per-token thread block
    // holds (its two-pass path) and, with 4 shards, 257-block segments that straddle warps.
    let shapes = [
        (1024, 2048, false),
        (512, 768, true),
        (257, 384, false),
        (301, 777, true),
        (32, 16448, false),
        (16, 16448, true),
    ];
    for (i, &(r, c, specials)) in shapes.iter().enumerate() {
        let x = nasty(r * c, i as u64 + 7, specials);
        for fmt in common::all_formats() {
            for axis in [Axis::Row, Axis::Col] {
                if quantize(&x, r, c, &fmt, axis).is_err() {
                    continue;
                }
                if let Err(e) = same_bytes(q, &x, r, c, &fmt, axis) {
                    failures.push(e);
                }
                if per_token(&fmt)
                    && let Err(e) = same_bytes(&register, &x, r, c, &fmt, axis)
                {
                    failures.push(format!("register kernel: {e}"));
                }
            }
        }
    }
    // Per-token NVFP4 on shapes where the staged kernel's thread blocks (one an SM) take several
    // chunks each, so its ring of three shared-memory stages wraps: 16384 columns (one
    // 1024-block segment a chunk) and 2048 (eight segments a chunk, or 32 with 4 shards).
    for (i, &(r, c)) in [(600, 16384), (8192, 2048)].iter().enumerate() {
        let x = nasty(r * c, i as u64 + 31, i == 0);
        for fmt in common::all_formats().into_iter().filter(per_token) {
            for qz in [q, &register] {
                if let Err(e) = same_bytes(qz, &x, r, c, &fmt, Axis::Row) {
                    failures.push(e);
                }
            }
        }
    }
    for f in failures.iter().take(10) {
        eprintln!("FAIL {f}");
    }
    assert!(
        failures.is_empty(),
        "{} quantizations differ",
        failures.len()
    );
}

/// Blocks and tiles made entirely of NaN (quiet and signalling, both signs), which the sprinkled
/// specials above almost never produce: a whole 32-element MXFP8 block (under the TE rule its
/// amax skips NaN and is 0, so the scale byte is 0x00, not 0xFF), whole NVFP4 blocks, segments and
/// rows (NaN block scale and second-level amax), a whole 128x128 FP8 tile and whole 1x128 tiles;
/// plus all-NaN tensors (every per-tensor amax NaN). Every format, both axes.
#[test]
fn gpu_quantizer_matches_cpu_on_all_nan_blocks() {
    let Some(q) = gpu("gpu_quantizer_matches_cpu_on_all_nan_blocks") else {
        return;
    };
    let nans = [
        0x7FC0_0000u32,
        0xFFC0_0000,
        0x7F80_0001,
        0xFFFF_FFFF,
        0x7FFF_FFFF,
    ];
    let nan = |i: usize| f32::from_bits(nans[i % nans.len()]);
    let (r, c) = (256, 256);
    let mut x = nasty(r * c, 41, false);
    for i in 0..128 {
        // The top-left 128x128 tile (MX blocks down its columns too).
        for j in 0..128 {
            x[i * c + j] = nan(i + j);
        }
    }
    for j in 0..c {
        x[200 * c + j] = nan(j); // a whole row
    }
    for j in 128..160 {
        x[130 * c + j] = nan(j); // one MX block, two NVFP4 blocks, a quarter of a 1x128 tile
    }
    for j in 240..256 {
        x[131 * c + j] = -f32::NAN; // one NVFP4 block at the end of a row
    }
    for i in 160..192 {
        x[i * c + 7] = nan(i); // one MX block down column 7
    }
    // The CPU's rule that the GPU must follow: an all-NaN MXFP8 block has TE scale byte 0x00.
    let cpu = quantize(&x, r, c, &QuantFormat::MXFP8, Axis::Row).unwrap();
    let Scales::E8m0(s) = &cpu.scales else {
        unreachable!("MXFP8 has E8M0 scales")
    };
    assert_eq!(s[130 * (c / 32) + 4], 0x00, "all-NaN MXFP8 block, TE rule");
    let all_nan: Vec<f32> = (0..64 * 128).map(nan).collect();
    // 130 columns: the FP8 block kernels for rows that are not float4-aligned, a partial tile.
    let odd_nan: Vec<f32> = (0..32 * 130).map(nan).collect();
    let mut failures = Vec::new();
    for (x, r, c) in [(&x, r, c), (&all_nan, 64, 128), (&odd_nan, 32, 130)] {
        for fmt in common::all_formats() {
            for axis in [Axis::Row, Axis::Col] {
                if quantize(x, r, c, &fmt, axis).is_err() {
                    continue;
                }
                if let Err(e) = same_bytes(q, x, r, c, &fmt, axis) {
                    failures.push(e);
                }
            }
        }
    }
    for f in failures.iter().take(10) {
        eprintln!("FAIL {f}");
    }
    assert!(
        failures.is_empty(),
        "{} quantizations differ",
        failures.len()
    );
}

#[test]
fn gpu_element_codecs_match_cpu_on_a_sweep_of_fp32_bit_patterns() {
    let Some(q) = gpu("gpu_element_codecs_match_cpu_on_a_sweep_of_fp32_bit_patterns") else {
        return;
    };
    // Every 1021st bit pattern (both signs, every exponent, NaN payloads) plus the neighbours of
    // every E4M3, E5M2 and E2M1 midpoint region near 1.
    let mut bits: Vec<u32> = (0..=u32::MAX / 1021).map(|i| i * 1021).collect();
    bits.extend(0x3F00_0000u32..0x3F00_0000 + (1 << 20));
    let got = q.encode_elements(&bits).unwrap();
    let mut bad = 0;
    for (b, g) in bits.iter().zip(&got) {
        let x = f32::from_bits(*b);
        let want = (
            e4m3_from_f32_sat(x),
            e5m2_from_f32_sat(x),
            e2m1_from_f32(x, E2m1Convention::TeRef),
            bf16_from_f32(x),
            e8m0_ceil_from_f32(x),
        );
        let have = (g.e4m3_sat, g.e5m2_sat, g.e2m1_te, g.bf16, g.e8m0_ceil);
        if want != have {
            if bad < 5 {
                eprintln!("x = {b:#010x}: cpu {want:?} gpu {have:?}");
            }
            bad += 1;
        }
    }
    assert_eq!(bad, 0, "{bad} of {} inputs differ", bits.len());
}

fn backend(test: &str) -> Option<Arc<CudaBackend>> {
    gpu(test)?;
    Some(Arc::new(
        CudaBackend::new(0).expect("cuBLAS starts where the quantizer did"),
    ))
}

#[test]
fn same_seed_gives_identical_metrics_on_the_gpu() {
    use lockstep::engine::model::{ModelConfig, Params};
    use lockstep::engine::task::Task;
    use lockstep::engine::trainer::{ContractBreak, GrpoConfig, Trainer};
    use lockstep::recipe::presets::preset;
    let Some(be) = backend("same_seed_gives_identical_metrics_on_the_gpu") else {
        return;
    };
    let task = Task::Add(2);
    let grpo = GrpoConfig {
        prompts_per_step: 8,
        samples_per_prompt: 4,
        max_response_tokens: task.answer_len() + 1,
        eval_every: 0,
        ..Default::default()
    };
    let init = Params::init(&ModelConfig::tiny(), 3).unwrap();
    let run = |be: &dyn Backend| {
        let mut t = Trainer::new(
            init.clone(),
            task,
            preset("nvfp4-dq").unwrap(),
            grpo.clone(),
            5,
            ContractBreak::None,
        )
        .unwrap();
        (0..3)
            .map(|_| t.step(be).deterministic_scalars())
            .collect::<Vec<_>>()
    };
    let a = run(be.as_ref());
    let b = run(be.as_ref());
    assert!(!a[0].is_empty());
    assert_eq!(a, b, "two GPU runs with the same seed differ");
}

#[test]
fn device_cuda_without_a_gpu_is_a_one_line_error() {
    let Some(why) = cuda::skip_reason() else {
        eprintln!("GPU present: the no-GPU error path is not reachable here");
        return;
    };
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(["bench", "quantize", "--device", "cuda"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "exit code");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.trim_end().lines().count(), 1, "stderr: {err}");
    assert!(
        err.contains("--device cuda:0") && err.contains("--device cpu"),
        "{err} ({why})"
    );
    // And the library says so without panicking.
    assert!(lockstep::engine::backend::open("cuda:3".parse().unwrap()).is_err());
}
