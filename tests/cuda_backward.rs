//! The backward ops of the op set on a GPU (`GpuOps`) against the CPU's (`CpuOps`), each through
//! `engine::device::Ops` with one test body per op generic over the device, at the engine's
//! shapes (D 128, F 256, 2272 rows, 8 experts, top-2); the ops that accumulate do so into a
//! gradient that already holds values, as the trainer's do.
//!
//! Bit-identical to the CPU: RMSNorm (dx and dg), the router, the embedding and attention (their
//! sums run in one thread in the CPU's order; attention reads the forward's softmax weights, so no
//! `expf`). Within a tolerance: SwiGLU (the GPU's `expf`).
//!
//! Each test prints why and returns when no GPU is usable. On a GPU machine:
//! `cargo test --release --test cuda_backward -- --nocapture`.

mod common;

use common::{Device, assert_rel, max_abs, ragged, same_bits, uniform};
use lockstep::engine::device::cpu::CpuOps;
use lockstep::engine::device::{OpError, OpResult, Ops};
use lockstep::engine::layout::Layout;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const D: usize = 128;
const F: usize = 256;
const H: usize = 4;
const E: usize = 8;
const K: usize = 2;
/// The benchmark batch's trainer rows.
const N: usize = 2272;

/// (dx, dg) accumulated into `dx0`, `dg0`, with the forward's rstd; rows of `d` values.
fn rmsnorm_backward<'a, O: Device<'a>>(
    o: &O,
    (x, d): (&[f32], usize),
    gain: &'a [f32],
    dout: &[f32],
    (dx0, dg0): (&[f32], &[f32]),
) -> [Vec<f32>; 2] {
    let n = x.len() / d;
    let (x, gain) = (o.upload(x).unwrap(), o.param(gain));
    let (_, rstd) = o.rmsnorm(&x, &gain, n, d).unwrap();
    let (mut dx, mut dg) = (o.upload(dx0).unwrap(), o.upload(dg0).unwrap());
    let dout = o.upload(dout).unwrap();
    o.rmsnorm_backward(&mut dx, &mut dg, &dout, &x, &gain, &rstd, n, d)
        .unwrap();
    [o.to_host(&dx, n * d).unwrap(), o.to_host(&dg, d).unwrap()]
}

#[test]
fn rmsnorm_backward_matches_cpu_bit_for_bit() {
    let Some(g) = common::gpu_ops("rmsnorm_backward_matches_cpu_bit_for_bit") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    // Row counts below, at and past the kernel's tiles of rows; a width that leaves a partial
    // group of 32 columns.
    for (n, d) in [(1, D), (37, D), (N, D), (300, 48)] {
        let x = uniform(&mut rng, n * d, 3.0);
        let gain = uniform(&mut rng, d, 1.5);
        let dout = uniform(&mut rng, n * d, 1.0);
        // Gradients that already hold values: the kernels must add, not overwrite.
        let (dx, dg) = (uniform(&mut rng, n * d, 0.5), uniform(&mut rng, d, 0.5));
        let x = (&x[..], d);
        let [cdx, cdg] = rmsnorm_backward(&CpuOps::new(), x, &gain, &dout, (&dx, &dg));
        let [gdx, gdg] = rmsnorm_backward(g, x, &gain, &dout, (&dx, &dg));
        same_bits(&format!("{n}x{d}: dx"), &gdx, &cdx).unwrap();
        same_bits(&format!("{n}x{d}: dg"), &gdg, &cdg).unwrap();
    }
}

fn swiglu_backward<O: Ops>(o: &O, dout: &[f32], inp: &[f32], n: usize) -> Vec<f32> {
    let (dout, inp) = (o.upload(dout).unwrap(), o.upload(inp).unwrap());
    let dinp = o.swiglu_backward(&dout, &inp, n, F).unwrap();
    o.to_host(&dinp, n * 2 * F).unwrap()
}

#[test]
fn swiglu_backward_within_1e_5_of_cpu() {
    let Some(g) = common::gpu_ops("swiglu_backward_within_1e_5_of_cpu") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let n = N;
    let inp = uniform(&mut rng, n * 2 * F, 6.0);
    let dout = uniform(&mut rng, n * F, 1.0);
    let cpu = swiglu_backward(&CpuOps::new(), &dout, &inp, n);
    // Relative to the largest value: an `expf` ulp moves a term by an ulp of the term, and the
    // value it lands in can be much smaller than the term (cancellation).
    let got = swiglu_backward(g, &dout, &inp, n);
    assert_rel("swiglu dinp", &got, &cpu, max_abs(&cpu), 1e-5);
}

fn route_backward<O: Ops>(o: &O, dw: &[f32], ids: &[u32], w: &[f32], n: usize) -> Vec<f32> {
    let (dw, w) = (o.upload(dw).unwrap(), o.upload(w).unwrap());
    let dl = o.route_backward(&dw, &o.ids(ids).unwrap(), &w, n, E, K);
    o.to_host(&dl.unwrap(), n * E).unwrap()
}

#[test]
fn router_backward_matches_cpu_bit_for_bit() {
    let Some(g) = common::gpu_ops("router_backward_matches_cpu_bit_for_bit") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let n = N;
    let cpu = CpuOps::new();
    let logits = uniform(&mut rng, n * E, 4.0);
    let (ids, w) = cpu.route(&logits, n, E, K, None).unwrap();
    let dw = uniform(&mut rng, n * K, 1.0);
    let want = route_backward(&cpu, &dw, &ids, &w, n);
    same_bits(
        "router dlogits",
        &route_backward(g, &dw, &ids, &w, n),
        &want,
    )
    .unwrap();
    // An expert id out of range poisons its row instead of writing outside it.
    let mut bad = ids.clone();
    bad[5 * K] = E as u32;
    let v = route_backward(g, &dw, &bad, &w, n);
    assert!(v[5 * E..6 * E].iter().all(|x| x.is_nan()), "row 5 not NaN");
    assert!(v[..5 * E].iter().all(|x| !x.is_nan()), "rows 0-4 touched");
}

/// (dwte, dwpe) accumulated into `tables` from `dout` at `layout`'s positions.
fn embedding_backward<O: Ops>(
    o: &O,
    tables: (&[f32], &[f32]),
    dout: &[f32],
    tokens: &[u32],
    layout: &Layout,
) -> [Vec<f32>; 2] {
    let (mut dwte, mut dwpe) = (o.upload(tables.0).unwrap(), o.upload(tables.1).unwrap());
    let (dout, tok) = (o.upload(dout).unwrap(), o.ids(tokens).unwrap());
    let rows = o.rows(layout).unwrap();
    o.embedding_backward(&mut dwte, &mut dwpe, &dout, &tok, &rows, layout.rows(), D)
        .unwrap();
    [
        o.to_host(&dwte, tables.0.len()).unwrap(),
        o.to_host(&dwpe, tables.1.len()).unwrap(),
    ]
}

#[test]
fn embedding_backward_matches_cpu_bit_for_bit() {
    let Some(g) = common::gpu_ops("embedding_backward_matches_cpu_bit_for_bit") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let (vocab, npos) = (16, 16);
    // Few distinct tokens and positions, so each table row sums many rows: the order matters.
    let layout = Layout::plain(N / 16, 15);
    let n = layout.rows();
    let tokens: Vec<u32> = (0..n).map(|_| rng.random_range(0..vocab as u32)).collect();
    let dout = uniform(&mut rng, n * D, 1.0);
    let dwte = uniform(&mut rng, vocab * D, 0.5);
    let dwpe = uniform(&mut rng, npos * D, 0.5);
    let tables = (&dwte[..], &dwpe[..]);
    let [cte, cpe] = embedding_backward(&CpuOps::new(), tables, &dout, &tokens, &layout);
    let [gte, gpe] = embedding_backward(g, tables, &dout, &tokens, &layout);
    same_bits("dwte", &gte, &cte).unwrap();
    same_bits("dwpe", &gpe, &cpe).unwrap();
}

#[test]
fn backward_shape_errors_name_the_buffer() {
    let Some(g) = common::gpu_ops("backward_shape_errors_name_the_buffer") else {
        return;
    };
    fn shape<T>(r: OpResult<T>, what: &str) {
        match r {
            Err(OpError::Shape(m)) => assert!(m.contains(what), "{m:?} should name {what}"),
            Err(e) => panic!("expected a Shape error naming {what}, got {e:?}"),
            Ok(_) => panic!("expected a Shape error naming {what}, got Ok"),
        }
    }
    let n = 4;
    let z = |len: usize| Ops::zeros(g, len).unwrap();
    let (x, gain, rstd) = (z(n * D), z(D), z(n));
    let (mut dx, mut short) = (z(n * D), z(D - 1));
    shape(
        g.rmsnorm_backward(&mut dx, &mut short, &x, &x, &gain, &rstd, n, D),
        "dg",
    );
    shape(g.swiglu_backward(&z(n * F), &z(n * 2 * F - 1), n, F), "inp");
    shape(
        g.swiglu_backward(&z(n * F - 1), &z(n * 2 * F), n, F),
        "dout",
    );
    let ids = |len: usize| g.ids(&vec![0; len]).unwrap();
    shape(
        g.route_backward(&z(n * K), &ids(n * K - 1), &z(n * K), n, E, K),
        "ids",
    );
    shape(
        g.route_backward(&z(n * K), &ids(n * K), &z(n * K), n, E, E + 1),
        "top-k",
    );
}

/// dqkv of attention's backward, the forward's softmax weights `probs` given.
fn attention_backward<O: Ops>(
    o: &O,
    layout: &Layout,
    qkv: &[f32],
    probs: &[f32],
    dout: &[f32],
) -> Vec<f32> {
    let rows = o.rows(layout).unwrap();
    let (qkv, probs, dout) = (
        o.upload(qkv).unwrap(),
        o.upload(probs).unwrap(),
        o.upload(dout).unwrap(),
    );
    let dqkv = o
        .attention_backward(&dout, &qkv, &probs, &rows, H, D)
        .unwrap();
    o.to_host(&dqkv, layout.rows() * 3 * D).unwrap()
}

/// Attention's backward on a plain and two ragged shared-prefix layouts (a key row of a shared
/// prompt gathers gradients from every sample of its group), the forward's softmax weights from
/// the CPU.
#[test]
fn attention_backward_matches_cpu_bit_for_bit() {
    let Some(g) = common::gpu_ops("attention_backward_matches_cpu_bit_for_bit") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let cpu = CpuOps::new();
    let layouts = [
        ("plain", Layout::plain(16, 15)),
        ("ragged 256x16", ragged(&mut rng, 256, 16, 8, 8)),
        ("ragged 64x32", ragged(&mut rng, 64, 32, 8, 12)),
    ];
    for (what, layout) in layouts {
        let (n, s) = (layout.rows(), layout.max_context());
        let qkv = uniform(&mut rng, n * 3 * D, 1.0);
        let (_, probs) = cpu
            .attention(&qkv, &cpu.rows(&layout).unwrap(), H, D)
            .unwrap();
        assert_eq!(probs.len(), n * H * s);
        let dout = uniform(&mut rng, n * D, 1.0);
        let want = attention_backward(&cpu, &layout, &qkv, &probs, &dout);
        let got = attention_backward(g, &layout, &qkv, &probs, &dout);
        same_bits(&format!("{what}: dqkv"), &got, &want).unwrap();
    }
}
