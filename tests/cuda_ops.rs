//! Issue 7 (device-resident engine): the forward ops of the op set on a GPU (`GpuOps`) against
//! the CPU's (`CpuOps`), each through `engine::device::Ops` with one test body per op generic
//! over the device, on random inputs at the engine's shapes (D 128, F 256, up to 4096 rows,
//! 8 experts, top-2, 4 heads, contexts up to 32, plain and ragged shared-prefix layouts).
//!
//! Bit-identical to the CPU: RMSNorm (out and rstd), the embedding, `add_into` and the MoE
//! combine. Within a tolerance (the GPU's `expf` is not glibc's): SwiGLU, attention and the
//! router, each with its bound stated where it is checked; the router's expert ids are equal
//! exactly (ties included). Attention and the router repeat bit for bit run to run.
//!
//! Each test prints why and returns when no GPU is usable. On a GPU machine:
//! `cargo test --release --test cuda_ops -- --nocapture`.

mod common;

use common::{Device, assert_rel, max_abs, ragged, same_bits, uniform};
use lockstep::engine::backend::cuda::device_ops::GpuOps;
use lockstep::engine::device::cpu::CpuOps;
use lockstep::engine::device::{OpError, OpResult, Ops};
use lockstep::engine::layout::Layout;
use lockstep::engine::ops;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The engine's shapes (the `small` model and the benchmark batch).
const D: usize = 128;
const F: usize = 256;
const H: usize = 4;
const E: usize = 8;
const K: usize = 2;

fn rmsnorm<'a, O: Device<'a>>(
    o: &O,
    x: &[f32],
    gain: &'a [f32],
    n: usize,
    d: usize,
) -> [Vec<f32>; 2] {
    let (out, rstd) = o
        .rmsnorm(&o.upload(x).unwrap(), &o.param(gain), n, d)
        .unwrap();
    [
        o.to_host(&out, n * d).unwrap(),
        o.to_host(&rstd, n).unwrap(),
    ]
}

#[test]
fn rmsnorm_matches_cpu_bit_for_bit() {
    let Some(g) = common::gpu_ops("rmsnorm_matches_cpu_bit_for_bit") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    // The model's width, a width with an 8-lane remainder, and one row.
    for (n, d, scale) in [(4096, D, 1.0f32), (1001, 100, 30.0), (1, D, 1e-3)] {
        let x = uniform(&mut rng, n * d, scale);
        let gain = uniform(&mut rng, d, 2.0);
        let [out, rstd] = rmsnorm(&CpuOps::new(), &x, &gain, n, d);
        let [go, gr] = rmsnorm(g, &x, &gain, n, d);
        same_bits(&format!("rmsnorm out {n}x{d}"), &go, &out).unwrap();
        same_bits(&format!("rmsnorm rstd {n}x{d}"), &gr, &rstd).unwrap();
    }
}

fn embedding<'a, O: Device<'a>>(
    o: &O,
    tokens: &[u32],
    layout: &Layout,
    (wte, wpe): (&'a [f32], &'a [f32]),
) -> Vec<f32> {
    let n = layout.rows();
    let rows = o.rows(layout).unwrap();
    let (wte, wpe) = (o.param(wte), o.param(wpe));
    let h = o.embedding(&o.ids(tokens).unwrap(), &rows, &wte, &wpe, n, D);
    o.to_host(&h.unwrap(), n * D).unwrap()
}

#[test]
fn embedding_matches_cpu_bit_for_bit_with_layout_positions() {
    let Some(g) = common::gpu_ops("embedding_matches_cpu_bit_for_bit_with_layout_positions") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let (v, s) = (64, 32);
    let layout = ragged(&mut rng, 256, 16, 8, 8);
    let n = layout.rows();
    let tokens: Vec<u32> = (0..n).map(|_| rng.random_range(0..v as u32)).collect();
    let (wte, wpe) = (uniform(&mut rng, v * D, 1.0), uniform(&mut rng, s * D, 1.0));
    let cpu = embedding(&CpuOps::new(), &tokens, &layout, (&wte, &wpe));
    same_bits(
        "embedding",
        &embedding(g, &tokens, &layout, (&wte, &wpe)),
        &cpu,
    )
    .unwrap();

    // A token past the vocabulary is a NaN row, not a read outside wte; the other rows are kept.
    let mut bad = tokens.clone();
    bad[3] = v as u32;
    let got = embedding(g, &bad, &layout, (&wte, &wpe));
    assert!(got[3 * D..4 * D].iter().all(|x| x.is_nan()));
    same_bits("embedding rows 0..3", &got[..3 * D], &cpu[..3 * D]).unwrap();
}

fn swiglu<O: Ops>(o: &O, x: &[f32], n: usize) -> Vec<f32> {
    let y = o.swiglu(&o.upload(x).unwrap(), n, F).unwrap();
    o.to_host(&y, n * F).unwrap()
}

#[test]
fn swiglu_within_1e_5_of_cpu() {
    let Some(g) = common::gpu_ops("swiglu_within_1e_5_of_cpu") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let n = 4096;
    let inp = uniform(&mut rng, n * 2 * F, 6.0);
    // Elementwise, no cancellation: per-element relative error (an `expf` ulp or two, ~3e-7).
    assert_rel(
        "swiglu",
        &swiglu(g, &inp, n),
        &swiglu(&CpuOps::new(), &inp, n),
        1e-30,
        1e-5,
    );
}

/// (out, probs) of attention over `layout`.
fn attention<O: Ops>(o: &O, qkv: &[f32], layout: &Layout) -> (Vec<f32>, Vec<f32>) {
    let (n, s) = (layout.rows(), layout.max_context());
    let rows = o.rows(layout).unwrap();
    let (out, probs) = o.attention(&o.upload(qkv).unwrap(), &rows, H, D).unwrap();
    (
        o.to_host(&out, n * D).unwrap(),
        o.to_host(&probs, n * H * s).unwrap(),
    )
}

#[test]
fn attention_matches_cpu_on_plain_and_ragged_layouts_and_repeats() {
    let Some(g) = common::gpu_ops("attention_matches_cpu_on_plain_and_ragged_layouts_and_repeats")
    else {
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
            let (out, probs) = attention(&CpuOps::new(), &qkv, layout);
            let (go, gp) = attention(g, &qkv, layout);
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
            let (go2, gp2) = attention(g, &qkv, layout);
            same_bits(&format!("{what}: out run to run"), &go2, &go).unwrap();
            same_bits(&format!("{what}: probs run to run"), &gp2, &gp).unwrap();
        }
    }
}

/// (ids, gate weights) of the router on `logits` `[n, E]`.
fn route<O: Ops>(o: &O, logits: &[f32], n: usize, replay: Option<&[u32]>) -> (Vec<u32>, Vec<f32>) {
    let (ids, w) = o
        .route(&o.upload(logits).unwrap(), n, E, K, replay)
        .unwrap();
    let ids = o.ids_to_host(&[&ids], n * K).unwrap().remove(0);
    (ids, o.to_host(&w, n * K).unwrap())
}

/// The CPU router and the GPU router on the same logits; returns (gpu ids, gpu weights) after
/// checking the ids, and the weights to 1e-5 per element. With `exact_ids` every id must match;
/// without, a token may differ only where the CPU's probabilities of the two experts are within
/// 1e-6 of each other (a near tie an `expf` ulp can flip; few in continuous logits), and its
/// weights are then not compared.
fn check_router(
    g: &GpuOps,
    what: &str,
    logits: &[f32],
    n: usize,
    replay: Option<&[u32]>,
    exact_ids: bool,
) -> (Vec<u32>, Vec<f32>) {
    let (ids, w) = route(&CpuOps::new(), logits, n, replay);
    // The CPU's softmax probabilities, to tell near ties (`Ops::route` does not return them).
    let (mut p, mut pids, mut pw) = (vec![0.0; n * E], vec![0u32; n * K], vec![0.0; n * K]);
    ops::router_forward(&mut p, &mut pids, &mut pw, logits, n, E, K, replay);
    let (gids, gw) = route(g, logits, n, replay);
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
    // Renormalized weights are positive ratios: per element, < 1e-5.
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
    (gids, gw)
}

#[test]
fn router_matches_cpu_with_ties_and_replay_and_repeats() {
    let Some(g) = common::gpu_ops("router_matches_cpu_with_ties_and_replay_and_repeats") else {
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
    let (ids, _) = check_router(g, "tied logits", &tied, n, None, true);
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
    same_bits("router weights run to run", &second.1, &first.1).unwrap();

    // Replay: the ids are forced (including a repeated expert and a reversed pair), the weights
    // still come from these logits.
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
    let (ids, _) = check_router(g, "replay", &logits, n, Some(&replay), true);
    assert_eq!(ids, replay);
}

fn add_into<O: Ops>(o: &O, a: &[f32], b: &[f32]) -> Vec<f32> {
    let mut da = o.upload(a).unwrap();
    o.add_into(&mut da, &o.upload(b).unwrap(), a.len()).unwrap();
    o.to_host(&da, a.len()).unwrap()
}

#[test]
fn add_into_matches_cpu_bit_for_bit() {
    let Some(g) = common::gpu_ops("add_into_matches_cpu_bit_for_bit") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(6);
    let n = 4096;
    let (a, b) = (
        uniform(&mut rng, n * D, 5.0),
        uniform(&mut rng, n * D, 1e-3),
    );
    let cpu = add_into(&CpuOps::new(), &a, &b);
    same_bits("add_into", &add_into(g, &a, &b), &cpu).unwrap();
}

/// `model.rs`'s `moe_forward` tail on the host, as written there, with every expert the identity
/// (slot s's expert output is its token's row of `xe`): out = shared; for each expert in id
/// order, for each of its slots in slot order, out[s / k] += weights[s] · xe[s / k]; then
/// out += x.
fn moe_combine_cpu(
    shared: &[f32],
    xe: &[f32],
    ids: &[u32],
    weights: &[f32],
    x: &[f32],
) -> Vec<f32> {
    let mut out = shared.to_vec();
    for expert in 0..E as u32 {
        for s in (0..ids.len()).filter(|&s| ids[s] == expert) {
            let y = &xe[(s / K) * D..][..D];
            out[(s / K) * D..][..D]
                .iter_mut()
                .zip(y)
                .for_each(|(o, &v)| *o += weights[s] * v);
        }
    }
    out.iter_mut().zip(x).for_each(|(a, &b)| *a += b);
    out
}

/// Dispatch, gather and combine: each expert's batch is its tokens' rows of `xe`, unchanged.
fn combine<O: Ops>(
    o: &O,
    ids: &[u32],
    w: &[f32],
    xe: &[f32],
    shared: &[f32],
    x: &[f32],
) -> Vec<f32> {
    let n = x.len() / D;
    let dids = o.ids(ids).unwrap();
    let disp = o.dispatch(&dids, n, K, E).unwrap();
    let experts = o.gather(&o.upload(xe).unwrap(), &disp, D).unwrap();
    let (x, shared, w) = (
        o.upload(x).unwrap(),
        o.upload(shared).unwrap(),
        o.upload(w).unwrap(),
    );
    let out = o
        .combine(&x, &shared, &experts, &dids, &disp, &w, (n, K, D))
        .unwrap();
    o.to_host(&out, n * D).unwrap()
}

#[test]
fn moe_combine_matches_model_order_bit_for_bit() {
    let Some(g) = common::gpu_ops("moe_combine_matches_model_order_bit_for_bit") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let n = 4096;
    let logits = uniform(&mut rng, n * E, 3.0);
    let (ids, w) = route(&CpuOps::new(), &logits, n, None);
    assert!(
        (0..n).any(|t| ids[t * K] > ids[t * K + 1]),
        "no token lists its experts out of id order; the test would not check the order"
    );
    let xe = uniform(&mut rng, n * D, 2.0);
    let (shared, x) = (uniform(&mut rng, n * D, 1.0), uniform(&mut rng, n * D, 4.0));
    let want = moe_combine_cpu(&shared, &xe, &ids, &w, &x);
    same_bits(
        "moe_combine cpu",
        &combine(&CpuOps::new(), &ids, &w, &xe, &shared, &x),
        &want,
    )
    .unwrap();
    same_bits(
        "moe_combine gpu",
        &combine(g, &ids, &w, &xe, &shared, &x),
        &want,
    )
    .unwrap();
    // The order is observable: summing the slots in j order instead gives other bits somewhere,
    // so the equality above checks the order, not just the terms.
    let mut j_order = shared.clone();
    for (s, &gate) in w.iter().enumerate() {
        let y = &xe[(s / K) * D..][..D];
        j_order[(s / K) * D..][..D]
            .iter_mut()
            .zip(y)
            .for_each(|(o, &v)| *o += gate * v);
    }
    j_order.iter_mut().zip(&x).for_each(|(a, &b)| *a += b);
    assert!(
        same_bits("j order", &j_order, &want).is_err(),
        "slot order and id order agree on every element; the order is untested"
    );
}

/// The busiest expert's slot count in `ids` (`runs` runs' tokens in turn, each run's experts its
/// own), rounded up to the device's 128-row multiple.
fn busiest_rounded(ids: &[u32], runs: usize) -> usize {
    let most = ids
        .chunks(ids.len() / runs)
        .flat_map(|run| (0..E as u32).map(|e| run.iter().filter(|&&i| i == e).count()))
        .max()
        .unwrap_or(0);
    most.div_ceil(128).max(1) * 128
}

/// Runs stepped together with 512 rows each or more (`device_ops::COUNT_FROM_RUN_ROWS`: training
/// passes) give every expert of the batch the busiest one's count of rows; a run alone and decode
/// steps every row of a run. Either way each slot reaches the combine.
#[test]
fn expert_batch_holds_the_busiest_expert_and_drops_no_slot() {
    let Some(alone) = common::gpu_ops("expert_batch_holds_the_busiest_expert_and_drops_no_slot")
    else {
        return;
    };
    let mut two =
        GpuOps::new(&lockstep::engine::backend::cuda::CudaDevice::open(0).unwrap()).unwrap();
    two.set_runs(2);
    let mut rng = ChaCha8Rng::seed_from_u64(8);
    let n = 4096;
    let logits = uniform(&mut rng, n * E, 3.0);
    let (routed, _) = route(&CpuOps::new(), &logits, n, None);
    let skewed: Vec<u32> = (0..n).flat_map(|_| [5, 3]).collect();
    let decode = routed[..2 * 2 * 256].to_vec();
    let cases = [
        (
            "two runs",
            &two,
            2,
            &routed,
            2 * E * busiest_rounded(&routed, 2),
        ),
        ("two runs, skewed", &two, 2, &skewed, 2 * E * n / 2),
        ("two runs' decode step", &two, 2, &decode, 2 * E * 256),
        ("a run alone", alone, 1, &routed, E * n),
    ];
    for (what, g, runs, ids, rows) in cases {
        let n = ids.len() / K;
        let disp = g.dispatch(&g.ids(ids).unwrap(), n, K, E).unwrap();
        assert_eq!(g.dispatch_rows(&disp), rows, "{what}: rows of the batch");
        let w = uniform(&mut rng, n * K, 1.0);
        let xe = uniform(&mut rng, n * D, 2.0);
        let (shared, x) = (uniform(&mut rng, n * D, 1.0), uniform(&mut rng, n * D, 4.0));
        same_bits(
            &format!("{what}: combine over the batch ({runs} runs)"),
            &combine(g, ids, &w, &xe, &shared, &x),
            &moe_combine_cpu(&shared, &xe, ids, &w, &x),
        )
        .unwrap();
    }
    // A router's busiest expert is far below a row per token (the padding the count saves).
    let counted = busiest_rounded(&routed, 2);
    assert!(counted < n / 4, "{counted}");
}

/// The expert batch's routing (`moe::ExpertBatch::route`) against one walk over each run's
/// slots in order: every slot's batch row and every batch row's token, bit for bit. So each
/// expert's rows hold its tokens in token order (what a column quantization along tokens reads,
/// as the CPU's `expert_slots` lists them), then padding; an id out of range gets no row. Runs
/// of 1 and 3, a run's slots over several of the kernel's 1,024-slot chunks, 8 and 40 experts.
#[test]
fn routing_keeps_each_experts_tokens_in_token_order() {
    use lockstep::engine::backend::cuda::moe::{ExpertBatch, NO_ROW};
    if common::gpu_ops("routing_keeps_each_experts_tokens_in_token_order").is_none() {
        return;
    }
    let dev = lockstep::engine::backend::cuda::CudaDevice::open(0).unwrap();
    let batch = ExpertBatch::new(&dev).unwrap();
    let stream = dev.context().default_stream();
    let mut rng = ChaCha8Rng::seed_from_u64(21);
    for (runs, tokens, e) in [(1, 1500, 8), (3, 700, 8), (3, 1100, 40)] {
        let n = runs * tokens;
        // Two choices a token (distinct), one in 97 out of range.
        let ids: Vec<u32> = (0..n)
            .flat_map(|_| {
                let a = rng.random_range(0..e as u32);
                let b = (a + rng.random_range(1..e as u32)) % e as u32;
                let b = if rng.random_range(0..97) == 0 {
                    e as u32 + 3
                } else {
                    b
                };
                [a, b]
            })
            .collect();
        // One walk over each run's slots: the reference.
        let per_run = tokens * K;
        let mut count = vec![0usize; runs * e];
        let mut want_slot = vec![NO_ROW; n * K];
        let mut placed = Vec::new();
        for (s, &id) in ids.iter().enumerate() {
            let q = s / per_run;
            if (id as usize) < e {
                let qx = q * e + id as usize;
                placed.push((qx, count[qx], (s / K) as u32, s));
                count[qx] += 1;
            }
        }
        let busiest = *count.iter().max().unwrap();
        for cap in [busiest, busiest + 5] {
            let mut want_src = vec![NO_ROW; runs * e * cap];
            for &(qx, r, token, s) in &placed {
                want_slot[s] = (qx * cap + r) as u32;
                want_src[qx * cap + r] = token;
            }
            let d_ids = stream.clone_htod(&ids).unwrap();
            let got = batch.route(&stream, &d_ids, (n, K, e), cap, runs).unwrap();
            let slot_row = stream.clone_dtoh(&got.slot_row).unwrap();
            let src_row = stream.clone_dtoh(&got.src_row).unwrap();
            let what = format!("{runs} runs of {tokens} tokens, {e} experts, capacity {cap}");
            assert_eq!(slot_row[..n * K], want_slot[..], "{what}: slot rows");
            assert_eq!(
                src_row[..runs * e * cap],
                want_src[..],
                "{what}: batch rows' tokens"
            );
        }
    }
}

#[test]
fn short_buffers_and_bad_shapes_are_shape_errors() {
    let Some(g) = common::gpu_ops("short_buffers_and_bad_shapes_are_shape_errors") else {
        return;
    };
    fn shape<T>(r: OpResult<T>, what: &str) {
        match r {
            Err(OpError::Shape(m)) => assert!(m.contains(what), "{m:?} should name {what}"),
            Err(e) => panic!("expected a Shape error naming {what}, got {e:?}"),
            Ok(_) => panic!("expected a Shape error naming {what}, got Ok"),
        }
    }
    let (n, d) = (16, D);
    let x = g.zeros(n * d).unwrap();
    let (mut out, short) = (g.zeros(n * d).unwrap(), g.zeros(n * d - 1).unwrap());
    let gain = g.zeros(d).unwrap();
    shape(g.rmsnorm(&short, &gain, n, d), "x");
    shape(g.rmsnorm(&x, &g.zeros(d - 1).unwrap(), n, d), "g");
    shape(g.add_into(&mut out, &short, n * d), "src");
    shape(g.swiglu(&x, n, d), "inp");
    let rows = g.rows(&Layout::plain(2, 8)).unwrap();
    shape(g.attention(&x, &rows, H, D), "qkv");
    shape(g.attention(&x, &rows, 3, D), "multiple");
    let logits = g.zeros(n * E).unwrap();
    shape(g.route(&logits, n, E, E + 1, None), "top-k");
    shape(
        g.route(&logits, n, E, K, Some(&vec![0; n * K - 1])),
        "replay",
    );
    shape(g.route(&short, n * d / E, E, K, None), "logits");
    // Nothing was queued by the refused calls, and the right shapes still work.
    g.rmsnorm(&x, &gain, n, d).unwrap();
    g.stream().synchronize().unwrap();
}
