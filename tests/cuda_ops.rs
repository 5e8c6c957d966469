//! Issue 7 (device-resident engine): the forward-op kernels (`engine::backend::cuda::ops`) against
//! the CPU ops (`engine::ops`) on random inputs at the engine's shapes (D 128, F 256, up to 4096
//! rows, 8 experts, top-2, 4 heads, contexts up to 32, plain and ragged shared-prefix layouts).
//!
//! Bit-identical to the CPU: RMSNorm (out and rstd), the embedding, `add_into`, `gather_rows`
//! and the MoE combine. Within a tolerance (the GPU's `expf` is not glibc's): SwiGLU, attention and
//! the router, each with its bound stated where it is checked; the router's expert ids are equal
//! exactly (ties included). Attention and the router repeat bit for bit run to run.
//!
//! Each test prints why and returns when no GPU is usable. On a GPU machine:
//! `cargo test --release --test cuda_ops -- --nocapture`.

mod common;

use common::{StreamIo, assert_rel, max_abs, ragged, same_bits, uniform};
use cudarc::driver::CudaStream;
use lockstep::engine::backend::cuda::ops::{CudaOps, DeviceLayout};
use lockstep::engine::backend::cuda::{CudaDevice, CudaError};
use lockstep::engine::layout::Layout;
use lockstep::engine::ops;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::{Arc, OnceLock};

/// The engine's shapes (the `small` model and the benchmark batch).
const D: usize = 128;
const F: usize = 256;
const H: usize = 4;
const E: usize = 8;
const K: usize = 2;

struct Gpu {
    ops: CudaOps,
    stream: Arc<CudaStream>,
}

/// The shared kernels and a stream, or `None` (with the reason printed) where there is no GPU.
fn gpu(test: &str) -> Option<&'static Gpu> {
    static G: OnceLock<Result<Gpu, String>> = OnceLock::new();
    common::gpu_fixture(&G, test, || {
        let d = CudaDevice::open(0)?;
        Ok(Gpu {
            ops: CudaOps::new(&d)?,
            stream: d.context().new_stream()?,
        })
    })
}

impl StreamIo for Gpu {
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

#[test]
fn rmsnorm_matches_cpu_bit_for_bit() {
    let Some(g) = gpu("rmsnorm_matches_cpu_bit_for_bit") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    // The model's width, a width with an 8-lane remainder, and one row.
    for (n, d, scale) in [(4096, D, 1.0f32), (1001, 100, 30.0), (1, D, 1e-3)] {
        let x = uniform(&mut rng, n * d, scale);
        let gain = uniform(&mut rng, d, 2.0);
        let (mut out, mut rstd) = (vec![0.0; n * d], vec![0.0; n]);
        ops::rmsnorm_forward(&mut out, &mut rstd, &x, &gain, n, d);
        // Buffers one row longer than needed: the op fills the leading n rows only.
        let (mut dout, mut drstd) = (g.zeros::<f32>((n + 1) * d), g.zeros::<f32>(n + 1));
        g.ops
            .rmsnorm_forward(
                &g.stream,
                &mut dout,
                &mut drstd,
                &g.up(&x),
                &g.up(&gain),
                n,
                d,
            )
            .unwrap();
        let (go, gr) = (g.down(&dout), g.down(&drstd));
        same_bits(&format!("rmsnorm out {n}x{d}"), &go[..n * d], &out).unwrap();
        same_bits(&format!("rmsnorm rstd {n}x{d}"), &gr[..n], &rstd).unwrap();
        assert!(go[n * d..].iter().all(|&v| v == 0.0) && gr[n] == 0.0);
    }
}

#[test]
fn embedding_matches_cpu_bit_for_bit_with_layout_positions() {
    let Some(g) = gpu("embedding_matches_cpu_bit_for_bit_with_layout_positions") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let (v, s) = (64, 32);
    let layout = ragged(&mut rng, 256, 16, 8, 8);
    let n = layout.rows();
    let tokens: Vec<u32> = (0..n).map(|_| rng.random_range(0..v as u32)).collect();
    let (wte, wpe) = (uniform(&mut rng, v * D, 1.0), uniform(&mut rng, s * D, 1.0));
    let mut out = vec![0.0; n * D];
    ops::embedding_forward(&mut out, &tokens, &wte, &wpe, |i| layout.position(i), D);
    let dl = DeviceLayout::upload(&g.stream, &layout).unwrap();
    let (dwte, dwpe) = (g.up(&wte), g.up(&wpe));
    let mut dout = g.zeros::<f32>(n * D);
    g.ops
        .embedding_forward(
            &g.stream,
            &mut dout,
            &g.up(&tokens),
            &dl.positions,
            &dwte,
            &dwpe,
            n,
            D,
        )
        .unwrap();
    same_bits("embedding", &g.down(&dout), &out).unwrap();

    // A token past the vocabulary is a NaN row, not a read outside wte; the other rows are kept.
    let mut bad = tokens.clone();
    bad[3] = v as u32;
    g.ops
        .embedding_forward(
            &g.stream,
            &mut dout,
            &g.up(&bad),
            &dl.positions,
            &dwte,
            &dwpe,
            n,
            D,
        )
        .unwrap();
    let got = g.down(&dout);
    assert!(got[3 * D..4 * D].iter().all(|x| x.is_nan()));
    same_bits("embedding rows 0..3", &got[..3 * D], &out[..3 * D]).unwrap();
}

#[test]
fn swiglu_within_1e_5_of_cpu() {
    let Some(g) = gpu("swiglu_within_1e_5_of_cpu") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let n = 4096;
    let inp = uniform(&mut rng, n * 2 * F, 6.0);
    let mut out = vec![0.0; n * F];
    ops::swiglu_forward(&mut out, &inp, n, F);
    let mut dout = g.zeros::<f32>(n * F);
    g.ops
        .swiglu_forward(&g.stream, &mut dout, &g.up(&inp), n, F)
        .unwrap();
    // Elementwise, no cancellation: per-element relative error (an `expf` ulp or two, ~3e-7).
    assert_rel("swiglu", &g.down(&dout), &out, 1e-30, 1e-5);
}

#[test]
fn attention_matches_cpu_on_plain_and_ragged_layouts_and_repeats() {
    let Some(g) = gpu("attention_matches_cpu_on_plain_and_ragged_layouts_and_repeats") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let layouts = [
        Layout::plain(64, 32),
        ragged(&mut rng, 256, 16, 8, 8),
        ragged(&mut rng, 64, 32, 8, 12),
    ];
    for (li, layout) in layouts.iter().enumerate() {
        let (n, s) = (layout.rows(), layout.max_context());
        // Scale 3 makes some softmax rows peaked, scale 1 keeps them flat.
        for scale in [1.0f32, 3.0] {
            let what = format!("layout {li} ({n} rows, context {s}), qkv scale {scale}");
            let qkv = uniform(&mut rng, n * 3 * D, scale);
            let (mut out, mut probs) = (vec![0.0; n * D], vec![0.0; n * H * s]);
            ops::attention_forward(&mut out, &mut probs, &qkv, layout, H, D);
            let dl = DeviceLayout::upload(&g.stream, layout).unwrap();
            let dqkv = g.up(&qkv);
            let run = || {
                // Filled with a non-zero value so the zeros past each context are the kernel's.
                let mut dout = g.up(&vec![7.0f32; n * D]);
                let mut dprobs = g.up(&vec![7.0f32; n * H * s]);
                g.ops
                    .attention_forward(&g.stream, &mut dout, &mut dprobs, &dqkv, &dl, H, D)
                    .unwrap();
                (g.down(&dout), g.down(&dprobs))
            };
            let (go, gp) = run();
            // Probabilities are positive, no cancellation: per element, < 1e-5.
            assert_rel(&format!("{what}: probs"), &gp, &probs, 1e-30, 1e-5);
            for (i, (a, b)) in gp.iter().zip(&probs).enumerate() {
                assert!(
                    (*a == 0.0) == (*b == 0.0),
                    "{what}: probs {i}: gpu {a}, cpu {b} (zero past the context on one side only)"
                );
            }
            // Outputs are sums of ± terms that can cancel: error relative to the largest output.
            assert_rel(&format!("{what}: out"), &go, &out, max_abs(&out), 1e-5);
            let (go2, gp2) = run();
            same_bits(&format!("{what}: out run to run"), &go2, &go).unwrap();
            same_bits(&format!("{what}: probs run to run"), &gp2, &gp).unwrap();
        }
    }
}

/// The CPU router and the GPU router on the same logits; returns (gpu ids, gpu probs, gpu
/// weights) after checking ids and probs/weights to 1e-5 per element. With `exact_ids` every id
/// must match; without, a token may differ only where the CPU's probabilities of the two experts
/// are within 1e-6 of each other (a near tie an `expf` ulp can flip; few in continuous logits),
/// and its weights are then not compared.
fn check_router(
    g: &Gpu,
    what: &str,
    logits: &[f32],
    n: usize,
    replay: Option<&[u32]>,
    exact_ids: bool,
) -> (Vec<u32>, Vec<f32>, Vec<f32>) {
    let (mut p, mut ids, mut w) = (vec![0.0; n * E], vec![0u32; n * K], vec![0.0; n * K]);
    ops::router_forward(&mut p, &mut ids, &mut w, logits, n, E, K, replay);
    let (mut dp, mut dids, mut dw) = (
        g.zeros::<f32>(n * E),
        g.zeros::<u32>(n * K),
        g.zeros::<f32>(n * K),
    );
    let drep = replay.map(|r| g.up(r));
    g.ops
        .router_forward(
            &g.stream,
            &mut dp,
            &mut dids,
            &mut dw,
            &g.up(logits),
            n,
            E,
            K,
            drep.as_ref(),
        )
        .unwrap();
    let (gp, gids, gw) = (g.down(&dp), g.down(&dids), g.down(&dw));
    let mut near_ties = Vec::new();
    for t in 0..n {
        let (gi, ci, pt) = (&gids[t * K..][..K], &ids[t * K..][..K], &p[t * E..][..E]);
        if gi == ci {
            continue;
        }
        let near = gi.iter().zip(ci).all(|(&a, &b)| {
            let (pa, pb) = (pt[a as usize], pt[b as usize]);
            (pa - pb).abs() <= 1e-6 * pb
        });
        assert!(
            !exact_ids && near,
            "{what}: token {t} ids gpu {gi:?} cpu {ci:?}, cpu probs {pt:?}"
        );
        near_ties.push(t);
    }
    assert!(
        near_ties.len() <= 8,
        "{what}: {} near ties",
        near_ties.len()
    );
    // Probabilities and renormalized weights are positive ratios: per element, < 1e-5.
    assert_rel(&format!("{what}: probs"), &gp, &p, 1e-30, 1e-5);
    let keep = |v: &[f32]| -> Vec<f32> {
        (0..n)
            .filter(|t| !near_ties.contains(t))
            .flat_map(|t| v[t * K..][..K].to_vec())
            .collect()
    };
    assert_rel(
        &format!("{what}: weights"),
        &keep(&gw),
        &keep(&w),
        1e-30,
        1e-5,
    );
    (gids, gp, gw)
}

#[test]
fn router_matches_cpu_with_ties_and_replay_and_repeats() {
    let Some(g) = gpu("router_matches_cpu_with_ties_and_replay_and_repeats") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let n = 4096;
    // Logits on a grid of 1/4 in [-2, 2]: many exact ties (equal logits give equal probabilities
    // on both devices), and distinct ones at least 1/4 apart, far beyond an ulp of `expf`.
    let mut tied: Vec<f32> = (0..n * E)
        .map(|_| rng.random_range(-8i32..=8) as f32 / 4.0)
        .collect();
    tied[..E].fill(0.5); // all equal: experts 0 and 1
    tied[E..2 * E].copy_from_slice(&[0.0, 1.0, 0.0, 1.0, 1.0, -1.0, 0.0, 1.0]); // 1 and 3
    let (ids, ..) = check_router(g, "tied logits", &tied, n, None, true);
    assert_eq!(&ids[..2 * K], &[0, 1, 1, 3]);
    let tie_rows = (0..n)
        .filter(|t| {
            let row = &tied[t * E..][..E];
            let top = row[ids[t * K] as usize];
            row.iter().filter(|&&v| v == top).count() > 1
        })
        .count();
    assert!(tie_rows > n / 10, "only {tie_rows} rows tie at the top");

    // Continuous logits (router-like magnitudes), with a run-to-run repeat.
    let logits = uniform(&mut rng, n * E, 3.0);
    let first = check_router(g, "random logits", &logits, n, None, false);
    let second = check_router(g, "random logits, again", &logits, n, None, false);
    assert_eq!(first.0, second.0, "router ids run to run");
    same_bits("router probs run to run", &second.1, &first.1).unwrap();
    same_bits("router weights run to run", &second.2, &first.2).unwrap();

    // Replay: the ids are forced (including a repeated expert and a reversed pair), the
    // probabilities and weights still come from these logits.
    let replay: Vec<u32> = (0..n)
        .flat_map(|t| match t % 3 {
            0 => [7, 0],
            1 => [3, 3],
            _ => {
                let a = rng.random_range(0..E as u32);
                [a, (a + 1 + rng.random_range(0..E as u32 - 1)) % E as u32]
            }
        })
        .collect();
    let (ids, ..) = check_router(g, "replay", &logits, n, Some(&replay), true);
    assert_eq!(ids, replay);
}

#[test]
fn add_into_and_gather_rows_match_cpu_bit_for_bit() {
    let Some(g) = gpu("add_into_and_gather_rows_match_cpu_bit_for_bit") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(6);
    let n = 4096;
    let (a, b) = (
        uniform(&mut rng, n * D, 5.0),
        uniform(&mut rng, n * D, 1e-3),
    );
    let mut da = g.up(&a);
    g.ops
        .add_into(&g.stream, &mut da, &g.up(&b), n * D)
        .unwrap();
    let cpu: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
    same_bits("add_into", &g.down(&da), &cpu).unwrap();

    // An expert's tokens: rows chosen with repeats, out of order.
    let m = 1500;
    let rows: Vec<u32> = (0..m).map(|_| rng.random_range(0..n as u32)).collect();
    let mut dst = g.zeros::<f32>(m * D);
    let dsrc = g.up(&a);
    g.ops
        .gather_rows(&g.stream, &mut dst, &dsrc, &g.up(&rows), m, D)
        .unwrap();
    let cpu: Vec<f32> = rows
        .iter()
        .flat_map(|&r| a[r as usize * D..][..D].to_vec())
        .collect();
    same_bits("gather_rows", &g.down(&dst), &cpu).unwrap();

    // A row index past the source is a NaN row.
    let mut bad = rows.clone();
    bad[1] = n as u32;
    g.ops
        .gather_rows(&g.stream, &mut dst, &dsrc, &g.up(&bad), m, D)
        .unwrap();
    let got = g.down(&dst);
    assert!(got[D..2 * D].iter().all(|x| x.is_nan()));
    same_bits("gather_rows row 0", &got[..D], &cpu[..D]).unwrap();
}

/// `model.rs`'s `moe_forward` tail on the host, as written there: out = shared; for each expert in
/// id order, for each of its slots in slot order, out[s / k] += weights[s] · y(s); then out += x.
#[allow(clippy::too_many_arguments)]
fn moe_combine_cpu(
    shared: &[f32],
    y_all: &[f32],
    slot_row: &[u32],
    ids: &[u32],
    weights: &[f32],
    x: &[f32],
    k: usize,
    d: usize,
) -> Vec<f32> {
    let mut out = shared.to_vec();
    let e = ids.iter().map(|&i| i as usize + 1).max().unwrap_or(0);
    let mut slots = vec![Vec::new(); e];
    for (s, &id) in ids.iter().enumerate() {
        slots[id as usize].push(s);
    }
    for expert in &slots {
        for &s in expert {
            let gate = weights[s];
            let y = &y_all[slot_row[s] as usize * d..][..d];
            out[(s / k) * d..][..d]
                .iter_mut()
                .zip(y)
                .for_each(|(o, &v)| *o += gate * v);
        }
    }
    out.iter_mut().zip(x).for_each(|(a, &b)| *a += b);
    out
}

#[test]
fn moe_combine_matches_model_order_bit_for_bit() {
    let Some(g) = gpu("moe_combine_matches_model_order_bit_for_bit") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let n = 4096;
    let logits = uniform(&mut rng, n * E, 3.0);
    let (mut p, mut ids, mut w) = (vec![0.0; n * E], vec![0u32; n * K], vec![0.0; n * K]);
    ops::router_forward(&mut p, &mut ids, &mut w, &logits, n, E, K, None);
    // Some tokens with a repeated expert (possible under replay): slot order breaks the tie.
    for t in (0..n).step_by(17) {
        ids[t * K + 1] = ids[t * K];
    }
    assert!(
        (0..n).any(|t| ids[t * K] > ids[t * K + 1]),
        "no token lists its experts out of id order; the test would not check the order"
    );
    // y_all rows grouped by expert, slots in order within each (as the resident forward packs
    // them); slot_row is the inverse permutation.
    let mut order = Vec::new();
    for ei in 0..E as u32 {
        order.extend((0..n * K).filter(|&s| ids[s] == ei));
    }
    let mut slot_row = vec![0u32; n * K];
    for (r, &s) in order.iter().enumerate() {
        slot_row[s] = r as u32;
    }
    let y_all = uniform(&mut rng, n * K * D, 2.0);
    let (shared, x) = (uniform(&mut rng, n * D, 1.0), uniform(&mut rng, n * D, 4.0));
    let cpu = moe_combine_cpu(&shared, &y_all, &slot_row, &ids, &w, &x, K, D);
    let mut dout = g.zeros::<f32>(n * D);
    g.ops
        .moe_combine(
            &g.stream,
            &mut dout,
            &g.up(&shared),
            &g.up(&y_all),
            &g.up(&slot_row),
            &g.up(&ids),
            &g.up(&w),
            &g.up(&x),
            n,
            K,
            D,
        )
        .unwrap();
    let got = g.down(&dout);
    same_bits("moe_combine", &got, &cpu).unwrap();
    // The order is observable: summing the slots in j order instead gives other bits somewhere,
    // so the equality above checks the order, not just the terms.
    let mut j_order = shared.clone();
    for (s, (&row, &gate)) in slot_row.iter().zip(&w).enumerate() {
        let y = &y_all[row as usize * D..][..D];
        j_order[(s / K) * D..][..D]
            .iter_mut()
            .zip(y)
            .for_each(|(o, &v)| *o += gate * v);
    }
    j_order.iter_mut().zip(&x).for_each(|(a, &b)| *a += b);
    assert!(
        same_bits("j order", &j_order, &cpu).is_err(),
        "slot order and id order agree on every element; the order is untested"
    );
}

#[test]
fn short_buffers_and_bad_shapes_are_shape_errors() {
    let Some(g) = gpu("short_buffers_and_bad_shapes_are_shape_errors") else {
        return;
    };
    let s = &g.stream;
    let shape = |r: Result<(), CudaError>, what: &str| match r {
        Err(CudaError::Shape(m)) => assert!(m.contains(what), "{m:?} should name {what}"),
        other => panic!("expected a Shape error naming {what}, got {other:?}"),
    };
    let (n, d) = (16, D);
    let x = g.zeros::<f32>(n * d);
    let (mut out, mut short) = (g.zeros::<f32>(n * d), g.zeros::<f32>(n * d - 1));
    let mut rstd = g.zeros::<f32>(n);
    let gain = g.zeros::<f32>(d);
    shape(
        g.ops
            .rmsnorm_forward(s, &mut short, &mut rstd, &x, &gain, n, d),
        "out",
    );
    shape(g.ops.add_into(s, &mut out, &short, n * d), "src");
    shape(g.ops.swiglu_forward(s, &mut out, &x, n, d), "inp");
    let layout = DeviceLayout::upload(s, &Layout::plain(2, 8)).unwrap();
    let mut probs = g.zeros::<f32>(16 * H * 8);
    shape(
        g.ops
            .attention_forward(s, &mut out, &mut probs, &x, &layout, H, D),
        "qkv",
    );
    shape(
        g.ops
            .attention_forward(s, &mut out, &mut probs, &x, &layout, 3, D),
        "multiple",
    );
    let (mut p, mut ids, mut w) = (g.zeros::<f32>(n * E), g.zeros(n * K), g.zeros(n * K));
    let logits = g.zeros::<f32>(n * E);
    shape(
        g.ops
            .router_forward(s, &mut p, &mut ids, &mut w, &logits, n, E, E + 1, None),
        "top-k",
    );
    let rep = g.zeros::<u32>(n * K - 1);
    shape(
        g.ops
            .router_forward(s, &mut p, &mut ids, &mut w, &logits, n, E, K, Some(&rep)),
        "replay",
    );
    // Nothing was queued by the refused calls, and the right shapes still work.
    g.ops
        .rmsnorm_forward(s, &mut out, &mut rstd, &x, &gain, n, d)
        .unwrap();
    s.synchronize().unwrap();
}
