//! Device-resident row-wise fake quantization (`CudaFakeQuantizer`) gives, bit for bit, the FP32
//! values of the CPU's `lockstep::formats::fake_quantize(.., Axis::Row, ..)` for every format, on
//! activation-like tensors with outliers, zeros, subnormals, NaN and Inf and on whole blocks of
//! special values; `round_bf16` matches the CPU on a sweep of FP32 bit patterns; bad shapes are
//! errors and zero rows are a no-op. Column fake quantization (`fake_quantize_cols`, and with the
//! rows zero-padded to the block multiple) gives `fake_quantize(.., Axis::Col, ..)`'s values.
//! Counted in slots (the runs of a batch), each slot's counts are its own rows' alone.
//!
//! Each test prints why and returns when no GPU is usable (CPU-only CI). On a GPU machine:
//! `cargo test --release --test cuda_fake_quant -- --nocapture`.

mod common;

use lockstep::engine::backend::cuda::fake_quant::CudaFakeQuantizer;
use lockstep::engine::backend::cuda::{CudaDevice, CudaError, CudaQuantizer};
use lockstep::formats::bf16::round_bf16;
use lockstep::formats::{Axis, QuantFormat, SecondScale, fake_quantize};
use lockstep::tools::bench_gpu::bench_input;
use std::sync::{Arc, OnceLock};

/// The shared fake quantizer, or `None` (with the reason printed) where there is no GPU.
fn gpu(test: &str) -> Option<&'static CudaFakeQuantizer> {
    static Q: OnceLock<Result<CudaFakeQuantizer, String>> = OnceLock::new();
    common::gpu_fixture(&Q, test, || {
        let q = CudaQuantizer::new(&CudaDevice::open(0)?)?;
        CudaFakeQuantizer::new(Arc::new(q))
    })
}

/// Test inputs of `rows x cols`, by kind:
/// 0. `bench_input`: activation-like, 1e4-scale outliers, zeros, FP32 subnormals;
/// 1. the same with specials sprinkled densely (NaN, ±Inf, -0, the E4M3 tie 464, the E2M1 tie 5,
///    f32::MAX, the smallest negative subnormal), so many blocks hold one;
/// 2. whole rows of one hard case each: zeros of both signs, subnormals only, a NaN block, an Inf,
///    values near FLT_MAX, values near 1e-30, all NaN, ties, -Inf among zeros;
/// 3. no NaN, one Inf (the tensor amax), every third row zero (NVFP4 blocks of zeros under an
///    Inf second-level amax: 0 x Inf in the dequantization);
/// 4. all zeros (amax 0 everywhere).
fn input(kind: usize, rows: usize, cols: usize, seed: u64) -> Vec<f32> {
    let n = rows * cols;
    let mut x = bench_input(n, seed);
    match kind {
        0 => {}
        1 => {
            for (i, v) in x.iter_mut().enumerate() {
                let h = (i as u64 ^ seed).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 58;
                *v = match h {
                    0 => f32::NAN,
                    1 => f32::INFINITY,
                    2 => f32::NEG_INFINITY,
                    3 => -0.0,
                    4 => 464.0,
                    5 => 5.0,
                    6 => f32::MAX,
                    7 => -f32::from_bits(1),
                    _ => *v,
                };
            }
        }
        2 => {
            for (r, row) in x.chunks_mut(cols.max(1)).enumerate() {
                let c = row.len();
                match r % 10 {
                    0 => row
                        .iter_mut()
                        .enumerate()
                        .for_each(|(j, v)| *v = if j % 2 == 0 { 0.0 } else { -0.0 }),
                    1 => row.iter_mut().enumerate().for_each(|(j, v)| {
                        *v = f32::from_bits(1 + (j as u32 * 7919) % 0x007F_FFFF)
                    }),
                    2 => row[..c.min(32)].fill(f32::NAN),
                    3 => row[5 % c] = f32::INFINITY,
                    4 => {
                        row.iter_mut().for_each(|v| *v *= 1e34);
                        row[c / 2] = -f32::MAX;
                    }
                    5 => row.iter_mut().for_each(|v| *v *= 1e-30),
                    6 => row.fill(f32::NAN),
                    7 => row
                        .iter_mut()
                        .enumerate()
                        .for_each(|(j, v)| *v = [5.0, -464.0, 0.25, 3.5, -0.75, 1.75, 2.5][j % 7]),
                    8 => {
                        row.fill(0.0);
                        row[c - 1] = f32::NEG_INFINITY;
                    }
                    _ => {}
                }
            }
        }
        3 => {
            for (r, row) in x.chunks_mut(cols.max(1)).enumerate() {
                if r % 3 == 0 {
                    row.fill(0.0);
                }
            }
            if n > 0 {
                x[n / 2] = f32::INFINITY;
            }
        }
        _ => x.fill(0.0),
    }
    x
}

/// Which fake quantization a comparison runs.
#[derive(Clone, Copy, Debug)]
enum Mode {
    /// Blocks along rows (`fake_quantize_rows`).
    Rows,
    /// Blocks along columns (`fake_quantize_cols`).
    Cols,
    /// Blocks along columns, rows zero-padded to the block multiple (`fake_quantize_cols_padded`,
    /// the CPU reference built here as `linear.rs` builds it).
    ColsPadded,
    /// Blocks along rows, columns zero-padded to the block multiple (`fake_quantize_rows_padded`,
    /// likewise).
    RowsPadded,
    /// Blocks along rows of the input's BF16 rounding (`fake_quantize_rows_of_rounding`, which
    /// rounds as the quantizer loads for MXFP8 and per-token NVFP4).
    RowsOfRounding,
}

/// The CPU's values for `mode`.
fn cpu_reference(
    x: &[f32],
    rows: usize,
    cols: usize,
    fmt: &QuantFormat,
    mode: Mode,
) -> Result<Vec<f32>, lockstep::formats::FormatError> {
    let n = rows * cols;
    let mut want = vec![0.0f32; n];
    match mode {
        Mode::Rows => fake_quantize(x, rows, cols, fmt, Axis::Row, &mut want).map(|_| want),
        Mode::RowsOfRounding => {
            let rounded: Vec<f32> = x.iter().map(|v| round_bf16(*v)).collect();
            fake_quantize(&rounded, rows, cols, fmt, Axis::Row, &mut want).map(|_| want)
        }
        Mode::Cols => fake_quantize(x, rows, cols, fmt, Axis::Col, &mut want).map(|_| want),
        Mode::ColsPadded => {
            let m = fmt.required_multiple();
            let rp = rows.div_ceil(m) * m;
            let mut padded = vec![0.0f32; rp * cols];
            padded[..n].copy_from_slice(x);
            let mut out = vec![0.0f32; rp * cols];
            fake_quantize(&padded, rp, cols, fmt, Axis::Col, &mut out)?;
            out.truncate(n);
            Ok(out)
        }
        Mode::RowsPadded => {
            let m = fmt.required_multiple();
            let cp = cols.div_ceil(m) * m;
            let mut padded = vec![0.0f32; rows * cp];
            for r in 0..rows {
                padded[r * cp..r * cp + cols].copy_from_slice(&x[r * cols..(r + 1) * cols]);
            }
            let mut out = vec![0.0f32; rows * cp];
            fake_quantize(&padded, rows, cp, fmt, Axis::Row, &mut out)?;
            Ok((0..rows)
                .flat_map(|r| out[r * cp..r * cp + cols].to_vec())
                .collect())
        }
    }
}

/// Upload, fake-quantize on the GPU, download; `Err` with the first difference from the CPU.
fn compare(
    fq: &CudaFakeQuantizer,
    x: &[f32],
    rows: usize,
    cols: usize,
    fmt: &QuantFormat,
) -> Result<(), String> {
    compare_mode(fq, x, rows, cols, fmt, Mode::Rows)
}

fn compare_mode(
    fq: &CudaFakeQuantizer,
    x: &[f32],
    rows: usize,
    cols: usize,
    fmt: &QuantFormat,
    mode: Mode,
) -> Result<(), String> {
    let n = rows * cols;
    let want = cpu_reference(x, rows, cols, fmt, mode).map_err(|e| format!("cpu: {e}"))?;
    let s = fq.quantizer().stream();
    let dx = s.clone_htod(x).map_err(|e| format!("upload: {e}"))?;
    let mut dout = s.alloc_zeros::<f32>(n).map_err(|e| format!("alloc: {e}"))?;
    match mode {
        Mode::Rows => fq.fake_quantize_rows(&dx, rows, cols, fmt, &mut dout),
        Mode::Cols => fq.fake_quantize_cols(&dx, rows, cols, fmt, &mut dout),
        Mode::ColsPadded => fq.fake_quantize_cols_padded(&dx, rows, cols, fmt, &mut dout),
        Mode::RowsPadded => fq.fake_quantize_rows_padded(&dx, rows, cols, fmt, &mut dout),
        Mode::RowsOfRounding => {
            fq.fake_quantize_rows_of_rounding(&dx, (rows, cols), fmt, &mut dout, None)
        }
    }
    .map_err(|e| format!("gpu: {e}"))?;
    let got = s.clone_dtoh(&dout).map_err(|e| format!("download: {e}"))?;
    s.synchronize().map_err(|e| format!("sync: {e}"))?;
    match want
        .iter()
        .zip(&got)
        .position(|(w, g)| w.to_bits() != g.to_bits())
    {
        None => Ok(()),
        Some(i) => Err(format!(
            "{} {mode:?} {rows}x{cols}: first difference at {i} (row {}, col {}): x {:#010x}, \
             cpu {:#010x}, gpu {:#010x}",
            fmt.name(),
            i / cols,
            i % cols,
            x[i].to_bits(),
            want[i].to_bits(),
            got[i].to_bits()
        )),
    }
}

#[test]
fn gpu_fake_quantize_matches_cpu_for_every_format() {
    let Some(fq) = gpu("gpu_fake_quantize_matches_cpu_for_every_format") else {
        return;
    };
    // 7x96: three MX blocks, 2-shard NVFP4 segments of three blocks; 130x200: partial FP8 tiles
    // both ways (shapes the other formats reject are skipped, as the CPU rejects them).
    let shapes = [
        (2048, 128),
        (2048, 256),
        (37, 256),
        (1, 128),
        (7, 96),
        (130, 200),
    ];
    let mut checked = 0;
    let mut failures = Vec::new();
    for (si, &(rows, cols)) in shapes.iter().enumerate() {
        for kind in 0..5 {
            let x = input(kind, rows, cols, (si * 5 + kind) as u64 + 11);
            for fmt in common::all_formats() {
                let mut probe = vec![0.0f32; rows * cols];
                if fake_quantize(&x, rows, cols, &fmt, Axis::Row, &mut probe).is_err() {
                    continue;
                }
                checked += 1;
                if let Err(e) = compare(fq, &x, rows, cols, &fmt) {
                    failures.push(format!("input kind {kind}: {e}"));
                }
            }
        }
    }
    for f in failures.iter().take(20) {
        eprintln!("FAIL {f}");
    }
    assert!(
        failures.is_empty(),
        "{} of {checked} fake quantizations differ",
        failures.len()
    );
    // 23 formats on the four block-friendly shapes, plus the odd ones.
    assert!(
        checked >= 5 * 4 * 23,
        "only {checked} fake quantizations ran"
    );
}

/// The fake quantizer of `gpu` with per-token NVFP4 on the register kernel (`nvfp4_token16`),
/// which a GPU with TMA uses only where the staged kernel cannot take a shape.
fn gpu_register(test: &str) -> Option<&'static CudaFakeQuantizer> {
    static Q: OnceLock<Result<CudaFakeQuantizer, String>> = OnceLock::new();
    common::gpu_fixture(&Q, test, || {
        let q = CudaQuantizer::new(&CudaDevice::open(0)?)?.with_staged_nvfp4(false);
        CudaFakeQuantizer::new(Arc::new(q))
    })
}

/// Quantizing the BF16 rounding of the input (what a site quantizes) as the quantizer loads it
/// gives, bit for bit, the CPU's fake quantization of `round_bf16(x)` for every format, through
/// both per-token NVFP4 kernels; inputs include values at and beside BF16 ties, some rounding up
/// to a larger block amax, so a quantizer that read the input unrounded would differ.
#[test]
fn gpu_fake_quantize_of_rounding_matches_cpu_for_every_format() {
    let name = "gpu_fake_quantize_of_rounding_matches_cpu_for_every_format";
    let (Some(staged), Some(register)) = (gpu(name), gpu_register(name)) else {
        return;
    };
    let shapes = [(2048, 256), (37, 256), (7, 96), (130, 200)];
    let mut checked = 0;
    let mut failures = Vec::new();
    for (si, &(rows, cols)) in shapes.iter().enumerate() {
        for kind in 0..6 {
            let seed = (si * 6 + kind) as u64 + 51;
            let x = match kind {
                // Low halves at, just below and just above a BF16 tie.
                5 => input(0, rows, cols, seed)
                    .iter()
                    .enumerate()
                    .map(|(i, v)| {
                        let low = [0x8000, 0x7FFF, 0x8001, 0xFFFF][i % 4];
                        f32::from_bits((v.to_bits() & 0xFFFF_0000) | low)
                    })
                    .collect(),
                _ => input(kind, rows, cols, seed),
            };
            for fmt in common::all_formats() {
                let mut probe = vec![0.0f32; rows * cols];
                if fake_quantize(&x, rows, cols, &fmt, Axis::Row, &mut probe).is_err() {
                    continue;
                }
                for (which, fq) in [("staged", staged), ("register", register)] {
                    checked += 1;
                    if let Err(e) = compare_mode(fq, &x, rows, cols, &fmt, Mode::RowsOfRounding) {
                        failures.push(format!("{which}, input kind {kind}: {e}"));
                    }
                }
            }
        }
    }
    for f in failures.iter().take(20) {
        eprintln!("FAIL {f}");
    }
    assert!(
        failures.is_empty(),
        "{} of {checked} fake quantizations differ",
        failures.len()
    );
    assert!(
        checked >= 2 * 6 * 3 * 20,
        "only {checked} fake quantizations ran"
    );
}

/// Counts in slots (the runs of a batch, one quantization for all): each slot gets what the CPU
/// counts for its part of the rows alone, added to what the slot held, the slots beside them are
/// untouched, and the values are the whole tensor's, for every format (per-token NVFP4 and MXFP8
/// in one launch, the others part by part). The parts differ in kind (specials, zeros), so a count
/// in the wrong slot, or one slot's parts counted twice, fails it. The same holds quantizing
/// the input's BF16 rounding (`fake_quantize_rows_of_rounding`), counted as the CPU counts the
/// rounded parts.
#[test]
fn gpu_counts_in_slots_are_each_parts_own() {
    let Some(fq) = gpu("gpu_counts_in_slots_are_each_parts_own") else {
        return;
    };
    let s = fq.quantizer().stream();
    let mut checked = 0;
    let cases = [(37, 256, 3), (2, 96, 4), (128, 128, 2)];
    for (&(per, cols, slots), rounding) in cases.iter().flat_map(|c| [(c, false), (c, true)]) {
        let rows = per * slots;
        let input_x: Vec<f32> = (0..slots)
            .flat_map(|i| input([1, 0, 3, 4][i % 4], per, cols, 90 + i as u64))
            .collect();
        // What the CPU quantizes.
        let x: Vec<f32> = match rounding {
            true => input_x.iter().map(|v| round_bf16(*v)).collect(),
            false => input_x.clone(),
        };
        for fmt in common::all_formats() {
            let mut want = vec![0.0f32; rows * cols];
            if fake_quantize(&x, rows, cols, &fmt, Axis::Row, &mut want).is_err() {
                continue;
            }
            let prior: Vec<u64> = (0..3 * (slots + 2) as u64).map(|v| 1000 + v).collect();
            let mut expect = prior.clone();
            for i in 0..slots {
                let part = &x[i * per * cols..(i + 1) * per * cols];
                let mut out = vec![0.0f32; per * cols];
                let st = fake_quantize(part, per, cols, &fmt, Axis::Row, &mut out).unwrap();
                let at = 3 * (1 + i);
                expect[at] += st.elements;
                expect[at + 1] += st.saturated;
                expect[at + 2] += st.underflowed;
            }
            let dx = s.clone_htod(&input_x).unwrap();
            let mut dout = s.alloc_zeros::<f32>(rows * cols).unwrap();
            let mut counts = s.clone_htod(&prior).unwrap();
            let acc = lockstep::engine::linear::CountSlots {
                counts: &mut counts,
                first: 1,
                slots,
            };
            match rounding {
                true => {
                    fq.fake_quantize_rows_of_rounding(&dx, (rows, cols), &fmt, &mut dout, Some(acc))
                }
                false => fq.fake_quantize_rows_counted(&dx, rows, cols, &fmt, &mut dout, Some(acc)),
            }
            .unwrap();
            let got = s.clone_dtoh(&counts).unwrap();
            let values = s.clone_dtoh(&dout).unwrap();
            let name = format!(
                "{}{}",
                fmt.name(),
                if rounding { " of rounding" } else { "" }
            );
            assert_eq!(got, expect, "{name} {slots} slots of {per}x{cols}: counts");
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert!(
                bits(&values) == bits(&want),
                "{name} {slots} slots of {per}x{cols}: values"
            );
            checked += 1;
        }
    }
    assert!(checked >= 2 * 3 * 20, "only {checked} slot countings ran");
}

/// Column fake quantization (the `Quantized` backward mode's dgrad/wgrad operands), plain and
/// with the token dimension zero-padded to the block multiple, and row fake quantization with
/// the columns zero-padded (dy of the 8-wide router), for every format.
#[test]
fn gpu_fake_quantize_cols_matches_cpu_for_every_format() {
    let Some(fq) = gpu("gpu_fake_quantize_cols_matches_cpu_for_every_format") else {
        return;
    };
    let cases = [
        (Mode::Cols, 256, 96),
        (Mode::Cols, 128, 40),
        (Mode::Cols, 2048, 8),
        (Mode::ColsPadded, 37, 128),
        (Mode::ColsPadded, 300, 24),
        (Mode::ColsPadded, 1, 256),
        (Mode::RowsPadded, 300, 8),
        (Mode::RowsPadded, 37, 40),
    ];
    let (mut checked, mut failures) = (0, Vec::new());
    for (ci, &(mode, rows, cols)) in cases.iter().enumerate() {
        for kind in 0..5 {
            let x = input(kind, rows, cols, (ci * 5 + kind) as u64 + 101);
            for fmt in common::all_formats() {
                if cpu_reference(&x, rows, cols, &fmt, mode).is_err() {
                    continue;
                }
                checked += 1;
                if let Err(e) = compare_mode(fq, &x, rows, cols, &fmt, mode) {
                    failures.push(format!("input kind {kind}: {e}"));
                }
            }
        }
    }
    for f in failures.iter().take(20) {
        eprintln!("FAIL {f}");
    }
    assert!(
        failures.is_empty(),
        "{} of {checked} column fake quantizations differ",
        failures.len()
    );
    assert!(checked >= 8 * 5 * 20, "only {checked} ran");
}

#[test]
fn gpu_fake_quantize_shapes_zero_rows_and_longer_buffers() {
    let Some(fq) = gpu("gpu_fake_quantize_shapes_zero_rows_and_longer_buffers") else {
        return;
    };
    let s = fq.quantizer().stream();
    let sentinel = f32::from_bits(0x7F80_1234);
    let x = input(1, 3, 128, 5);
    let dx = s.clone_htod(&x).unwrap();
    let mx = QuantFormat::MXFP8;

    // Zero rows: no launch, nothing written (the CPU calls this shape empty).
    let mut dout = s.clone_htod(&vec![sentinel; 3 * 128]).unwrap();
    for fmt in common::all_formats() {
        fq.fake_quantize_rows(&dx, 0, 128, &fmt, &mut dout)
            .unwrap_or_else(|e| panic!("{} with 0 rows: {e}", fmt.name()));
    }
    // Buffers longer than rows*cols: the first rows*cols values, the rest untouched.
    for fmt in common::all_formats() {
        fq.fake_quantize_rows(&dx, 2, 128, &fmt, &mut dout).unwrap();
        let got = s.clone_dtoh(&dout).unwrap();
        s.synchronize().unwrap();
        let mut want = vec![0.0f32; 2 * 128];
        fake_quantize(&x[..256], 2, 128, &fmt, Axis::Row, &mut want).unwrap();
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got[..256]), bits(&want), "{}", fmt.name());
        assert!(
            got[256..].iter().all(|v| v.to_bits() == sentinel.to_bits()),
            "{} wrote past rows*cols",
            fmt.name()
        );
    }

    // Bad input is an error, as on the CPU.
    let mut out = s.alloc_zeros::<f32>(3 * 128).unwrap();
    let err = fq.fake_quantize_rows(&dx, 8, 48, &mx, &mut out);
    assert!(matches!(err, Err(CudaError::Format(_))), "{err:?}");
    let nv0 = QuantFormat::Nvfp4 {
        second: SecondScale::PerToken,
        shards: 0,
    };
    let err = fq.fake_quantize_rows(&dx, 1, 128, &nv0, &mut out);
    assert!(matches!(err, Err(CudaError::Format(_))), "{err:?}");
    let nv4 = QuantFormat::Nvfp4 {
        second: SecondScale::PerTensor,
        shards: 4,
    };
    let err = fq.fake_quantize_rows(&dx, 3, 96, &nv4, &mut out);
    assert!(matches!(err, Err(CudaError::Format(_))), "{err:?}");
    let err = fq.fake_quantize_rows(&dx, 4, 128, &mx, &mut out);
    assert!(matches!(err, Err(CudaError::Shape(_))), "{err:?}");
    let mut short = s.alloc_zeros::<f32>(128).unwrap();
    let err = fq.fake_quantize_rows(&dx, 2, 128, &mx, &mut short);
    assert!(matches!(err, Err(CudaError::Shape(_))), "{err:?}");
    let err = fq.round_bf16(&dx, &mut short, 129);
    assert!(matches!(err, Err(CudaError::Shape(_))), "{err:?}");
}

#[test]
fn gpu_round_bf16_matches_cpu_on_a_sweep_of_fp32_bit_patterns() {
    let Some(fq) = gpu("gpu_round_bf16_matches_cpu_on_a_sweep_of_fp32_bit_patterns") else {
        return;
    };
    // Every 1021st bit pattern (both signs, every exponent, NaN payloads, signalling NaN), every
    // pattern of a 2^20 range near 1 (all rounding cases of the low 16 bits), the ties and
    // overflow points, and one value past the end that must stay untouched.
    let mut bits: Vec<u32> = (0..=u32::MAX / 1021).map(|i| i * 1021).collect();
    bits.extend(0x3F80_0000u32..0x3F80_0000 + (1 << 20));
    bits.extend([
        0x7F7F_8000,
        0x7F7F_7FFF,
        0xFF7F_8000,
        0x7F80_0000,
        0xFF80_0000,
        0x7F80_0001,
        0xFF80_0001,
        0x7FC0_0000,
        0xFFFF_FFFF,
        0x8000_0000,
        0x0000_8000,
        0x0001_8000,
    ]);
    let x: Vec<f32> = bits.iter().map(|b| f32::from_bits(*b)).collect();
    let n = x.len() - 1;
    let s = fq.quantizer().stream();
    let dx = s.clone_htod(&x).unwrap();
    let mut dout = s.clone_htod(&x).unwrap();
    fq.round_bf16(&dx, &mut dout, n).unwrap();
    let got = s.clone_dtoh(&dout).unwrap();
    s.synchronize().unwrap();
    let mut bad = 0;
    for (i, (v, g)) in x[..n].iter().zip(&got).enumerate() {
        let want = round_bf16(*v);
        if want.to_bits() != g.to_bits() {
            if bad < 5 {
                eprintln!(
                    "at {i}: x = {:#010x}: cpu {:#010x} gpu {:#010x}",
                    v.to_bits(),
                    want.to_bits(),
                    g.to_bits()
                );
            }
            bad += 1;
        }
    }
    assert_eq!(bad, 0, "{bad} of {n} inputs differ");
    assert_eq!(got[n].to_bits(), x[n].to_bits(), "wrote past n");
    fq.round_bf16(&dx, &mut dout, 0).unwrap();
}
