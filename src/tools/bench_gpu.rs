//! Device timings for `lockstep bench quantize --device cuda`: every quantizer kernel next to a
//! device-to-device copy of the same tensor, measured in the same run with CUDA events (median of
//! repetitions after warm-up), so the ratio reads the same on any card.
//!
//! Bandwidth counts the fewest bytes each operation must move (input read once, outputs written
//! once): `8n` for the copy, `4n` + codes + scales for a quantizer. `vs_copy` is the quantizer's
//! bandwidth over the copy's: 1.0 means it moves its bytes as fast as a copy does.

use crate::engine::backend::cuda::{CudaDevice, CudaError, CudaQuantizer};
use crate::formats::{
    Axis, Fp8BlockVariant, Fp8Elem, Fp8Tile, MxScaleRule, QuantFormat, SecondScale,
};
use cudarc::driver::CudaStream;
use cudarc::driver::sys::CUevent_flags;
use std::sync::Arc;

/// One measured line.
#[derive(Debug, Clone, serde::Serialize)]
pub struct GpuBenchRow {
    pub what: String,
    pub median_ms: f64,
    /// FP32 input bytes per second (GB/s).
    pub input_gb_s: f64,
    /// Fewest bytes moved per second (GB/s).
    pub moved_gb_s: f64,
    /// `moved_gb_s` over the copy's.
    pub vs_copy: f64,
}

/// What the bench ran on and what it measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct GpuBench {
    pub device: String,
    pub compute_capability: (i32, i32),
    pub rows: usize,
    pub cols: usize,
    pub reps: usize,
    pub lines: Vec<GpuBenchRow>,
}

/// The formats the bench times, with their display names.
pub fn bench_formats() -> Vec<(&'static str, QuantFormat, Axis)> {
    let nv = |second, shards| QuantFormat::Nvfp4 { second, shards };
    vec![
        ("bf16", QuantFormat::Bf16, Axis::Row),
        ("mxfp8 e4m3 te", QuantFormat::MXFP8, Axis::Row),
        (
            "mxfp8 e5m2 ocp",
            QuantFormat::Mxfp8 {
                elem: Fp8Elem::E5M2,
                rule: MxScaleRule::OcpFloor,
            },
            Axis::Row,
        ),
        ("mxfp8 e4m3 te (col)", QuantFormat::MXFP8, Axis::Col),
        ("nvfp4 per-tensor", nv(SecondScale::PerTensor, 1), Axis::Row),
        ("nvfp4 per-token", nv(SecondScale::PerToken, 1), Axis::Row),
        (
            "nvfp4 per-token 4 shards",
            nv(SecondScale::PerToken, 4),
            Axis::Row,
        ),
        (
            "fp8-block 1x128 te",
            QuantFormat::Fp8Block {
                tile: Fp8Tile::Act1x128,
                variant: Fp8BlockVariant::Te,
            },
            Axis::Row,
        ),
        (
            "fp8-block 128x128 deepgemm",
            QuantFormat::Fp8Block {
                tile: Fp8Tile::Weight128x128,
                variant: Fp8BlockVariant::Deepgemm,
            },
            Axis::Row,
        ),
    ]
}

/// Activation-like test data: a cheap deterministic hash, with 1 % outliers at 1e4 scale, zeros
/// and subnormals (so no path times only the easy case).
pub fn bench_input(n: usize, seed: u64) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let mut z = (i as u64).wrapping_add(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15));
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            let u = (z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
            match z & 0x3FF {
                0..=9 => u * 1e4,
                10 => 0.0,
                11 => f32::from_bits((z >> 8) as u32 & 0x007F_FFFF),
                _ => u,
            }
        })
        .collect()
}

/// Median milliseconds of `f` over `reps` event-timed runs after two warm-ups.
fn time_ms(
    stream: &Arc<CudaStream>,
    reps: usize,
    mut f: impl FnMut() -> Result<(), CudaError>,
) -> Result<f64, CudaError> {
    for _ in 0..2 {
        f()?;
    }
    stream.synchronize()?;
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps.max(1) {
        let start = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        f()?;
        let end = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        end.synchronize()?;
        times.push(start.elapsed_ms(&end)? as f64);
    }
    times.sort_by(|a, b| a.total_cmp(b));
    Ok(times[times.len() / 2])
}

/// Time every quantizer of [`bench_formats`] and a device-to-device copy on a `rows x cols` FP32
/// tensor on `cuda:ordinal`.
pub fn quantize_bandwidth(
    ordinal: usize,
    rows: usize,
    cols: usize,
    reps: usize,
) -> Result<GpuBench, CudaError> {
    let dev = CudaDevice::open(ordinal)?;
    let q = CudaQuantizer::new(&dev)?;
    let s = q.stream().clone();
    let n = rows * cols;
    let x = s.clone_htod(&bench_input(n, 1))?;
    let mut dst = s.alloc_zeros::<f32>(n)?;
    let copy_ms = time_ms(&s, reps, || Ok(s.memcpy_dtod(&x, &mut dst)?))?;
    drop(dst);
    let copy_bw = (8 * n) as f64 / (copy_ms * 1e-3) / 1e9;
    let mut lines = vec![GpuBenchRow {
        what: "copy (device to device)".into(),
        median_ms: copy_ms,
        input_gb_s: (4 * n) as f64 / (copy_ms * 1e-3) / 1e9,
        moved_gb_s: copy_bw,
        vs_copy: 1.0,
    }];
    // Per-token NVFP4 has two kernels (`CudaQuantizer::with_staged_nvfp4`): where the staged one
    // runs, the register kernel is timed next to it.
    let register = CudaQuantizer::new(&dev)?.with_staged_nvfp4(false);
    let mut runs: Vec<(String, &CudaQuantizer, QuantFormat, Axis)> = Vec::new();
    for (name, fmt, axis) in bench_formats() {
        runs.push((name.into(), &q, fmt, axis));
        if let QuantFormat::Nvfp4 {
            second: SecondScale::PerToken,
            shards,
        } = fmt
            && q.uses_staged_nvfp4(cols / shards / 16)
        {
            runs.push((format!("{name} (register kernel)"), &register, fmt, axis));
        }
    }
    for (name, qz, fmt, axis) in runs {
        let mut out = qz.alloc(rows, cols, &fmt, axis)?;
        let ms = time_ms(qz.stream(), reps, || qz.quantize_into(&x, &mut out))?;
        let bw = out.min_bytes() as f64 / (ms * 1e-3) / 1e9;
        lines.push(GpuBenchRow {
            what: name,
            median_ms: ms,
            input_gb_s: (4 * n) as f64 / (ms * 1e-3) / 1e9,
            moved_gb_s: bw,
            vs_copy: bw / copy_bw,
        });
    }
    Ok(GpuBench {
        device: format!("cuda:{ordinal} ({})", dev.name()),
        compute_capability: dev.compute_capability(),
        rows,
        cols,
        reps,
        lines,
    })
}
