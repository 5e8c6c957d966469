//! Several runs stepped at once on one GPU (`CudaBackend`'s `*_batch` calls, `cuda::batch`)
//! against each run alone on the same GPU.
//!
//! Without a GPU each test prints why it skips and passes. On a GPU: runs of different weights,
//! row counts and plans in one batch give each run its numbers alone to GEMM summation order
//! (the routing replayed so both run the same experts), the same activation counts, and repeat
//! bit for bit; a run whose weights are NaN leaves its neighbours' numbers bit for bit as they
//! were; a suite stepped in batches finishes every run as it does alone and repeats bit for bit.
//! `cargo test --release --test cuda_batch -- --nocapture` prints the measured differences.

mod common;

use common::{bits, plan, rel};
use lockstep::engine::backend::cuda::CudaBackend;
use lockstep::engine::backend::{Backend, Counts, ForwardItem};
use lockstep::engine::layout::Layout;
use lockstep::engine::model::{ModelConfig, Params, PreparedModel, Routing, forward_rows};
use lockstep::store::{RunDir, RunStatus};
use lockstep::suite::runner::{RunnerOptions, run_suite};
use lockstep::tools::bench::trainer_batch;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::collections::BTreeMap;
use std::sync::OnceLock;

fn gpu(test: &str) -> Option<&'static CudaBackend> {
    static B: OnceLock<Result<CudaBackend, String>> = OnceLock::new();
    common::gpu_fixture(&B, test, || CudaBackend::new(0))
}

/// One run of a batch: its model, rows and the routing its CPU forward chose (replayed by the
/// GPU passes, alone and batched, so that both run the same experts).
struct Run {
    prep: PreparedModel,
    tokens: Vec<u32>,
    layout: Layout,
    routing: Routing,
}

fn run(cfg: &ModelConfig, plan_name: &str, seed: u64, shape: (usize, usize, usize, usize)) -> Run {
    let params = Params::init(cfg, seed).unwrap();
    let prep = PreparedModel::new(&params, &plan(plan_name, cfg.n_layers)).unwrap();
    let (tokens, layout) = trainer_batch(cfg.vocab, shape, seed, true);
    let (_, _, routing) = forward_rows(&prep, &tokens, &layout, None);
    Run {
        prep,
        tokens,
        layout,
        routing,
    }
}

fn items(runs: &[Run]) -> Vec<ForwardItem<'_>> {
    runs.iter()
        .map(|r| ForwardItem {
            prep: &r.prep,
            tokens: &r.tokens,
            layout: &r.layout,
            replay: Some(&r.routing),
        })
        .collect()
}

/// dL/dlogits of a run's rows, from its own seed.
fn dlogits(r: &Run, seed: u64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    common::uniform(&mut rng, r.layout.rows() * r.prep.config.vocab, 1e-2)
}

#[test]
fn batched_training_pass_gives_each_run_its_numbers_alone() {
    let Some(be) = gpu("batched_training_pass_gives_each_run_its_numbers_alone") else {
        return;
    };
    let cfg = ModelConfig::small();
    // (plans of the three runs, tolerance on logits, on each gradient tensor): GPU-vs-GPU, so
    // only the GEMMs' order differs (a strided batch of a padded shape against one GEMM).
    let cases: [([&str; 3], f32, f32); 3] = [
        (["fp32", "fp32", "fp32"], 2e-6, 5e-6),
        (["nvfp4-dq", "nvfp4-dq", "nvfp4-dq"], 4e-2, 0.15),
        (["bf16", "mxfp8", "bf16"], 1e-2, 0.15),
    ];
    let shapes = [(8, 8, 7, 15), (6, 8, 7, 15), (8, 4, 7, 12)];
    let mut failures = Vec::new();
    for (plans, tol_logits, tol_grad) in cases {
        let runs: Vec<Run> = (0..3)
            .map(|i| run(&cfg, plans[i], 21 + i as u64, shapes[i]))
            .collect();
        let batch = be.train_forward_batch(&items(&runs), Counts::Keep).unwrap();
        // Repeated without the per-run counts: the same bits all the same.
        let again = be.train_forward_batch(&items(&runs), Counts::Skip).unwrap();
        let dls: Vec<Vec<f32>> = runs
            .iter()
            .enumerate()
            .map(|(i, r)| dlogits(r, 5 + i as u64))
            .collect();
        let d: Vec<Option<&[f32]>> = dls.iter().map(|v| Some(&v[..])).collect();
        let grads = batch.backward(&d);
        let grads_again = again.backward(&d);
        for (i, r) in runs.iter().enumerate() {
            let alone = be
                .train_forward(&r.prep, &r.tokens, &r.layout, Some(&r.routing))
                .unwrap();
            let g_alone = alone.backward(&dls[i]);
            let g = grads[i].as_ref().expect("every run given dlogits");
            let l_diff = rel(batch.logits(i), alone.logits());
            let mut worst = (0.0f32, String::new());
            for ((name, a), (_, b)) in g.named_tensors().iter().zip(g_alone.named_tensors()) {
                let d = rel(a, b);
                if d > worst.0 {
                    worst = (d, name.clone());
                }
            }
            eprintln!(
                "{plans:?} run {i} ({} rows): logits {l_diff:.2e}, worst gradient {:.2e} ({})",
                r.layout.rows(),
                worst.0,
                worst.1
            );
            if l_diff > tol_logits || worst.0 > tol_grad {
                failures.push(format!(
                    "{plans:?} run {i}: logits {l_diff:.2e}, {} {:.2e}",
                    worst.1, worst.0
                ));
            }
            // Counts move by a few where the GEMMs sum in another order (a padded batch).
            if let Some(why) = common::counts_disagree(&batch.quant_stats(i), &alone.quant_stats())
            {
                failures.push(format!("{plans:?} run {i}: {why} (batch vs alone)"));
            }
            if bits(batch.logits(i)) != bits(again.logits(i)) {
                failures.push(format!("{plans:?} run {i}: logits do not repeat"));
            }
            let g2 = grads_again[i].as_ref().unwrap();
            for ((name, a), (_, b)) in g.named_tensors().iter().zip(g2.named_tensors()) {
                if bits(a) != bits(b) {
                    failures.push(format!("{plans:?} run {i}: {name} does not repeat"));
                }
            }
        }
        // A run given no dlogits is skipped; the others' gradients are the same bits.
        let partial = batch.backward(&[d[0], None, d[2]]);
        assert!(partial[1].is_none());
        for i in [0, 2] {
            let (a, b) = (partial[i].as_ref().unwrap(), grads[i].as_ref().unwrap());
            for ((name, x), (_, y)) in a.named_tensors().iter().zip(b.named_tensors()) {
                if bits(x) != bits(y) {
                    failures.push(format!(
                        "{plans:?} run {i}: {name} depends on run 1's dlogits"
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn a_non_finite_run_leaves_its_neighbours_bit_for_bit() {
    let Some(be) = gpu("a_non_finite_run_leaves_its_neighbours_bit_for_bit") else {
        return;
    };
    let cfg = ModelConfig::small();
    let shapes = [(8, 8, 7, 15), (6, 8, 7, 15), (8, 4, 7, 12)];
    let runs: Vec<Run> = (0..3)
        .map(|i| run(&cfg, "nvfp4-dq", 31 + i as u64, shapes[i]))
        .collect();
    // Run 1 again with a NaN planted in its token embedding and one layer's qkv weights.
    let mut bad_params = Params::init(&cfg, 32).unwrap();
    bad_params.wte[5] = f32::NAN;
    bad_params.layers[0].linear_qkv[17] = f32::NAN;
    let bad = Run {
        prep: PreparedModel::new(&bad_params, &plan("nvfp4-dq", cfg.n_layers)).unwrap(),
        tokens: runs[1].tokens.clone(),
        layout: runs[1].layout.clone(),
        routing: runs[1].routing.clone(),
    };
    let healthy = be.train_forward_batch(&items(&runs), Counts::Keep).unwrap();
    let mut mixed_items = items(&runs);
    mixed_items[1].prep = &bad.prep;
    let mixed = be.train_forward_batch(&mixed_items, Counts::Keep).unwrap();
    assert!(
        mixed.logits(1).iter().any(|x| x.is_nan()),
        "the planted NaN reaches run 1's logits"
    );
    let dls: Vec<Vec<f32>> = runs
        .iter()
        .enumerate()
        .map(|(i, r)| dlogits(r, 9 + i as u64))
        .collect();
    let d: Vec<Option<&[f32]>> = dls.iter().map(|v| Some(&v[..])).collect();
    let (gh, gm) = (healthy.backward(&d), mixed.backward(&d));
    for i in [0, 2] {
        assert_eq!(
            bits(healthy.logits(i)),
            bits(mixed.logits(i)),
            "run {i}'s logits"
        );
        let (a, b) = (gh[i].as_ref().unwrap(), gm[i].as_ref().unwrap());
        for ((name, x), (_, y)) in a.named_tensors().iter().zip(b.named_tensors()) {
            assert_eq!(bits(x), bits(y), "run {i}'s {name}");
        }
    }
    let bad_g = gm[1].as_ref().unwrap();
    assert!(
        bad_g
            .named_tensors()
            .iter()
            .any(|(_, t)| t.iter().any(|x| !x.is_finite()))
    );
}

#[test]
fn batched_reference_forward_gives_each_run_its_logits_alone() {
    let Some(be) = gpu("batched_reference_forward_gives_each_run_its_logits_alone") else {
        return;
    };
    let cfg = ModelConfig::small();
    let shapes = [(8, 8, 7, 15), (6, 8, 7, 15), (8, 4, 7, 12), (8, 8, 7, 15)];
    let runs: Vec<Run> = (0..4)
        .map(|i| {
            run(
                &cfg,
                if i == 3 { "mxfp8" } else { "nvfp4-dq" },
                41 + i as u64,
                shapes[i],
            )
        })
        .collect();
    let batch = be.forward_logits_batch(&items(&runs)).unwrap();
    let again = be.forward_logits_batch(&items(&runs)).unwrap();
    for (i, r) in runs.iter().enumerate() {
        let alone = be
            .forward_logits(&r.prep, &r.tokens, &r.layout, Some(&r.routing))
            .unwrap();
        let d = rel(&batch[i], &alone);
        eprintln!("reference forward, run {i}: logits {d:.2e}");
        assert!(d < 4e-2, "run {i}: logits differ by {d:.2e}");
        assert_eq!(bits(&batch[i]), bits(&again[i]), "run {i} repeats");
    }
    // The stacked models stay on the device for the next step's reference forward (the
    // trainer's reference does not change), as one run's does: a fresh backend (its counters
    // this test's alone) uploads the four once, and the held copy gives the same bits.
    let fresh = CudaBackend::new(0).unwrap();
    let first = fresh.forward_logits_batch(&items(&runs)).unwrap();
    assert_eq!(fresh.take_counters().model_uploads, 4);
    let held = fresh.forward_logits_batch(&items(&runs)).unwrap();
    assert_eq!(fresh.take_counters().model_uploads, 0, "uploaded again");
    for i in 0..runs.len() {
        assert_eq!(
            bits(&first[i]),
            bits(&held[i]),
            "run {i} from the held copy"
        );
        assert_eq!(
            bits(&first[i]),
            bits(&batch[i]),
            "run {i} on another backend"
        );
    }
}

#[test]
fn batched_decoder_gives_each_run_its_decode_alone() {
    let Some(be) = gpu("batched_decoder_gives_each_run_its_decode_alone") else {
        return;
    };
    let cfg = ModelConfig::small();
    let preps: Vec<PreparedModel> = (0..3)
        .map(|i| {
            let p = Params::init(&cfg, 51 + i as u64).unwrap();
            let name = if i == 1 { "bf16" } else { "nvfp4-dq" };
            PreparedModel::new(&p, &plan(name, cfg.n_layers)).unwrap()
        })
        .collect();
    let refs: Vec<&PreparedModel> = preps.iter().collect();
    let (seqs, samples, prompt, steps) = (4usize, 2usize, 5usize, 6usize);
    let positions = prompt + steps;
    let tok = |m: usize, s: usize, p: usize| ((7 * m + 3 * s + p) % 12) as u32;
    let mut batch = be.decoder_batch(&refs, seqs, positions).unwrap();
    let mut alone: Vec<_> = refs
        .iter()
        .map(|p| be.decoder(p, seqs, positions).unwrap())
        .collect();
    // The prompts in one pass, then each copied to its samples, then one position at a time.
    let fed: Vec<Vec<u32>> = (0..3)
        .map(|m| {
            (0..seqs)
                .flat_map(|s| (0..prompt).map(move |p| tok(m, s, p)))
                .collect()
        })
        .collect();
    let routed = batch.feed(&fed, prompt);
    for (m, d) in alone.iter_mut().enumerate() {
        let r = d.feed(&fed[m], prompt);
        let agree = r
            .iter()
            .zip(&routed[m])
            .map(|(a, b)| common::agreement(a, b))
            .fold(1.0f64, f64::min);
        assert!(agree > 0.99, "run {m}: prompt routing agrees on {agree}");
    }
    batch.repeat_each(samples);
    alone.iter_mut().for_each(|d| d.repeat_each(samples));
    for step in 0..steps {
        let input: Vec<Vec<u32>> = (0..3)
            .map(|m| {
                (0..seqs * samples)
                    .map(|s| tok(m, s, prompt + step))
                    .collect()
            })
            .collect();
        let out = batch.step(&input);
        for (m, d) in alone.iter_mut().enumerate() {
            let (l, r) = d.step(&input[m]);
            let diff = rel(&out[m].0, &l);
            assert!(
                diff < 4e-2,
                "run {m} step {step}: logits differ by {diff:.2e}"
            );
            assert!(
                common::agreement(&out[m].1, &r) > 0.99,
                "run {m} step {step}: routing"
            );
        }
    }
}

/// Per run: status, steps recorded and every deterministic scalar (as bits) of every step.
type Outcomes = BTreeMap<String, (RunStatus, Vec<BTreeMap<String, u64>>)>;

/// The suite run on `be` into a fresh store, `batch` runs stepped together.
fn suite_outcomes(be: &CudaBackend, batch: usize) -> Outcomes {
    // With batches of 4, one batch holds both plans.
    let (s, runs) = common::tiny_two_recipe_suite("batched");
    let d = tempfile::tempdir().unwrap();
    let opts = RunnerOptions {
        store: d.path().join("runs"),
        jobs: 1,
        force: false,
        cache: d.path().join("cache"),
        threads_per_worker: None,
        batch_runs: Some(batch),
    };
    let backends: [&dyn Backend; 1] = [be];
    run_suite(&backends, &s, &runs, &opts, &|_| {}).unwrap();
    runs.iter()
        .map(|r| {
            let rd = RunDir::open(&opts.store.join("batched").join(&r.run_id));
            let status = rd.read_manifest().unwrap().status;
            (r.run_id.clone(), (status, common::step_bits(&rd)))
        })
        .collect()
}

#[test]
fn suite_runs_batched_repeat_bit_for_bit_and_finish_as_alone() {
    let Some(be) = gpu("suite_runs_batched_repeat_bit_for_bit_and_finish_as_alone") else {
        return;
    };
    // Batches of 4: bf16's three seeds with nvfp4-dq's first, then nvfp4-dq's other two.
    let batched = suite_outcomes(be, 4);
    let again = suite_outcomes(be, 4);
    let alone = suite_outcomes(be, 1);
    assert_eq!(batched.len(), 6);
    for (id, (status, steps)) in &batched {
        assert_eq!(*status, RunStatus::Ok, "{id}");
        assert_eq!(steps.len(), 4, "{id}: steps recorded");
        assert_eq!(alone[id].0, RunStatus::Ok, "{id} alone: {:?}", alone[id].0);
        assert_eq!(alone[id].1.len(), steps.len(), "{id} alone: steps recorded");
        // Same batch composition: the same bits, every metric of every step.
        assert_eq!(&again[id].1, steps, "{id}: a second batched sweep differs");
    }
}

/// `bench step --batch-runs`' training-pass comparison: both ways run (with each run's model
/// uploaded and its gradients downloaded, and with both left on the GPU), for runs of one plan
/// and of two (one pass either way); a dL/dlogits of another length than the batch's rows is an
/// error.
#[test]
fn training_pass_is_timed_with_and_without_transfers() {
    let Some(be) = gpu("training_pass_is_timed_with_and_without_transfers") else {
        return;
    };
    let cfg = ModelConfig::tiny();
    let runs: Vec<Run> = (0..2)
        .map(|i| run(&cfg, "bf16", 60 + i, (2, 2, 3, 6 + i as usize)))
        .collect();
    let its = items(&runs);
    let n = CudaBackend::train_pass_rows(&its);
    // Each run padded to the longer one's rows.
    let longest = runs.iter().map(|r| r.layout.rows()).max().unwrap();
    assert_eq!(n, 2 * longest);
    let dl = vec![1e-3f32; n * cfg.vocab];
    let t = be.train_pass_times(&its, &dl, 1).unwrap();
    for s in [t.with_transfers, t.on_device, t.prepared_on_device] {
        assert!(s.is_finite() && s > 0.0, "{t:?}");
    }
    assert!(be.train_pass_times(&its, &dl[1..], 1).is_err());
    let mixed = [
        run(&cfg, "bf16", 70, (2, 2, 3, 6)),
        run(&cfg, "mxfp8", 71, (2, 2, 3, 6)),
    ];
    let mixed_dl = vec![1e-3f32; CudaBackend::train_pass_rows(&items(&mixed)) * cfg.vocab];
    let t = be.train_pass_times(&items(&mixed), &mixed_dl, 1).unwrap();
    assert!(
        t.prepared_on_device.is_finite() && t.prepared_on_device > 0.0,
        "{t:?}"
    );
}

/// Weights prepared on the GPU from master weights kept there (`GpuOps::prepare_models`, what
/// training state kept on the device runs each minibatch on) give the batched training pass's
/// logits and gradients bit for bit, against the same runs' models prepared on the host and
/// uploaded, for every weight format and backward mode (the tiny model's sites take both ways of
/// `CudaLinear::prepare_stacked`: stacked where blocks allow it, weight by weight where not).
#[test]
fn weights_prepared_on_the_gpu_train_as_uploaded_ones() {
    let Some(be) = gpu("weights_prepared_on_the_gpu_train_as_uploaded_ones") else {
        return;
    };
    let cfg = ModelConfig::tiny();
    for name in [
        "fp32",
        "bf16",
        "mxfp8",
        "mxfp8-hp",
        "mxfp8-dq",
        "nvfp4-hp",
        "nvfp4-dq",
        "fp8-block",
    ] {
        let params: Vec<Params> = (0..3)
            .map(|i| Params::init(&cfg, 80 + i).unwrap())
            .collect();
        let runs: Vec<Run> = params
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let prep = PreparedModel::new(p, &plan(name, cfg.n_layers)).unwrap();
                let (tokens, layout) = trainer_batch(cfg.vocab, (2, 2, 3, 6), 90 + i as u64, true);
                let (_, _, routing) = forward_rows(&prep, &tokens, &layout, None);
                Run {
                    prep,
                    tokens,
                    layout,
                    routing,
                }
            })
            .collect();
        let its = items(&runs);
        let dls: Vec<Vec<f32>> = runs.iter().map(|r| dlogits(r, 7)).collect();
        let uploaded = be.train_forward_batch(&its, Counts::Skip).unwrap();
        let inputs: Vec<Option<&[f32]>> = dls.iter().map(|d| Some(&d[..])).collect();
        let grads = uploaded.backward(&inputs);
        // The same dL/dlogits laid out as the joint pass lays out rows: each run's block of
        // `cap` rows.
        let n = CudaBackend::train_pass_rows(&its);
        let cap = n / runs.len();
        let mut joint = vec![0.0f32; n * cfg.vocab];
        for (m, d) in dls.iter().enumerate() {
            joint[m * cap * cfg.vocab..][..d.len()].copy_from_slice(d);
        }
        let masters: Vec<&Params> = params.iter().collect();
        let (logits, dev_grads) = be.train_pass_from_masters(&its, &masters, &joint).unwrap();
        for m in 0..runs.len() {
            let same = |what: &str, got: &[f32], want: &[f32]| {
                common::same_bits(&format!("{name}: run {m}'s {what}"), got, want)
                    .unwrap_or_else(|e| panic!("{e}"))
            };
            same("logits", &logits[m], uploaded.logits(m));
            let want = grads[m].as_ref().unwrap().named_tensors();
            for ((t, got), (_, w)) in dev_grads[m].named_tensors().into_iter().zip(want) {
                same(&format!("gradient of {t}"), got, w);
            }
        }
    }
    // The masters must be one per run.
    let runs = [
        run(&cfg, "bf16", 1, (2, 2, 3, 6)),
        run(&cfg, "bf16", 2, (2, 2, 3, 6)),
    ];
    let p = Params::init(&cfg, 1).unwrap();
    let dl = vec![0.0f32; CudaBackend::train_pass_rows(&items(&runs)) * cfg.vocab];
    assert!(
        be.train_pass_from_masters(&items(&runs), &[&p], &dl)
            .is_err()
    );
}

/// Training state held on the GPU (`Backend::holds_training`: master weights, moments and
/// gradients stay there; weights prepared, norms summed and AdamW run on the device) trains as
/// the host-state path does, bit for bit: every record and the final weights, for five runs of
/// three recipes stepped together (passes of two, two and one run; two minibatches a step, so the
/// later forwards run on the held weights too; one run leaving after two steps) and for one run
/// alone. A released run's state is gone.
#[test]
fn training_state_held_on_the_gpu_trains_as_host_state() {
    use lockstep::engine::task::Task;
    use lockstep::engine::trainer::{ContractBreak, GrpoConfig, Trainer};
    use lockstep::recipe::presets::preset;
    if gpu("training_state_held_on_the_gpu_trains_as_host_state").is_none() {
        return;
    }
    // A backend of its own: the switch below is the backend's, and other tests step on the
    // shared one at the same time.
    let own = CudaBackend::new(0).unwrap();
    let be = &own;
    let task = Task::Add(2);
    // Evaluated every step (greedy decodes of the step's export); the five runs sample the export
    // a step old, so the run that leaves is still in the stack its neighbours sample from.
    let grpo = |lag: usize| GrpoConfig {
        prompts_per_step: 4,
        samples_per_prompt: 4,
        max_response_tokens: task.answer_len() + 1,
        minibatches: 2,
        kl_coef: 0.1,
        eval_every: 1,
        eval_prompts: 4,
        policy_lag: lag,
        ..Default::default()
    };
    let cfg = ModelConfig::tiny();
    let trainers = |recipes: &[&str]| -> Vec<Trainer> {
        let lag = usize::from(recipes.len() > 1);
        recipes
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let init = Params::init(&cfg, 40 + i as u64).unwrap();
                Trainer::new(
                    init,
                    task,
                    preset(r).unwrap(),
                    grpo(lag),
                    9,
                    ContractBreak::None,
                )
                .unwrap()
            })
            .collect()
    };
    type Trained = (
        Vec<Vec<lockstep::engine::metrics::StepRecord>>,
        Vec<Vec<u32>>,
    );
    let train = |held: bool, recipes: &[&str]| -> Trained {
        be.set_holds_training(held);
        let mut ts = trainers(recipes);
        let mut recs = vec![Vec::new(); ts.len()];
        for step in 0..3 {
            // Run 1 leaves after two steps, as a finished or diverged run leaves its batch: the
            // others' state is gathered into a batch without it.
            let mut refs: Vec<(usize, &mut Trainer)> = ts
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| step < 2 || *i != 1 || recipes.len() == 1)
                .collect();
            let index: Vec<usize> = refs.iter().map(|(i, _)| *i).collect();
            let mut members: Vec<&mut Trainer> = refs.iter_mut().map(|(_, t)| &mut **t).collect();
            for (i, rec) in index.into_iter().zip(Trainer::step_batch(&mut members, be)) {
                recs[i].push(rec);
            }
        }
        // Every run's weights read back in one copy (runs of two groups, and one alone).
        Trainer::sync_params_batch(&mut ts.iter_mut().collect::<Vec<_>>(), be);
        let weights = ts
            .iter_mut()
            .map(|t| {
                let w = t
                    .params
                    .named_tensors()
                    .iter()
                    .flat_map(|(_, v)| bits(v))
                    .collect();
                be.release_held(t.run_key());
                w
            })
            .collect();
        // Held runs export on the device: one export a run-step, no model uploaded for them.
        let steps: usize = recs.iter().map(Vec::len).sum();
        let exports = be.take_counters().held_exports;
        assert_eq!(
            exports,
            if held { steps as u64 } else { 0 },
            "device exports"
        );
        (recs, weights)
    };
    for recipes in [
        &["bf16", "nvfp4-dq", "bf16", "nvfp4-dq", "mxfp8"][..],
        &["mxfp8-dq"][..],
    ] {
        let (held, held_w) = train(true, recipes);
        let (host, host_w) = train(false, recipes);
        for (m, (a, b)) in held.iter().zip(&host).enumerate() {
            for (step, (ra, rb)) in a.iter().zip(b).enumerate() {
                let what = format!("{recipes:?} run {m} step {step}");
                assert_eq!(
                    ra.deterministic_scalars(),
                    rb.deterministic_scalars(),
                    "{what}"
                );
                assert_eq!(ra.layers, rb.layers, "{what}: per-layer rows");
                assert_eq!(ra.events, rb.events, "{what}: events");
                assert!(
                    ra.scalars["train/update_weight_ratio"] > 0.0,
                    "{what}: no update"
                );
                assert!(ra.scalars.contains_key("eval/accuracy"), "{what}: eval");
            }
        }
        assert!(held_w == host_w, "{recipes:?}: final weights differ");
    }
    be.set_holds_training(true);
    let mut t = trainers(&["bf16"]).remove(0);
    t.step(be);
    assert!(be.held_params(&[t.run_key()]).is_ok());
    be.release_held(t.run_key());
    assert!(be.held_params(&[t.run_key()]).is_err());
    // From three runs stepped together: a pair keeps its state on the host, a trio on the GPU,
    // and the trio's runs stay held when one of them leaves.
    be.set_held_from(3);
    for (n, held) in [(2, false), (3, true)] {
        let mut ts = trainers(&vec!["bf16"; n]);
        for left in [n, n - 1] {
            let mut members: Vec<&mut Trainer> = ts.iter_mut().take(left).collect();
            Trainer::step_batch(&mut members, be);
        }
        for t in &ts {
            assert_eq!(be.held_params(&[t.run_key()]).is_ok(), held, "{n} runs");
            be.release_held(t.run_key());
        }
    }
}

/// The warm start on a GPU that holds training state (prepared, stepped and updated there, read
/// back once at the end) ends where the host-state warm start ends, bit for bit.
#[test]
fn warm_start_on_held_state_trains_as_host_state() {
    use lockstep::engine::task::Task;
    use lockstep::engine::warmstart::{WarmStartConfig, warm_start};
    if gpu("warm_start_on_held_state_trains_as_host_state").is_none() {
        return;
    }
    let own = CudaBackend::new(0).unwrap();
    let cfg = ModelConfig::tiny();
    // Every step clipped or not as it falls, evaluated twice on the way, never stopping early.
    let ws = WarmStartConfig {
        max_steps: 6,
        batch: 8,
        lr: 3e-2,
        target_accuracy: 1.1,
        eval_every: 3,
        eval_prompts: 8,
        seed: 3,
    };
    let train = |held: bool| {
        own.set_holds_training(held);
        let mut lines = Vec::new();
        own.take_counters();
        let (params, info) = warm_start(&own, &cfg, Task::Add(2), &ws, None, |l| {
            lines.push(l.to_string())
        })
        .unwrap();
        (params, info.accuracy, lines, own.take_counters())
    };
    let (host, host_acc, host_log, host_counts) = train(false);
    let (held, held_acc, held_log, held_counts) = train(true);
    assert_eq!(
        host_counts.held_exports, 0,
        "host state exports on the host"
    );
    assert_eq!(
        held_counts.held_exports, 3,
        "one device export per evaluation"
    );
    assert_eq!(held_counts.model_uploads, 0, "held state uploads no model");
    assert_eq!(held_log, host_log, "evaluations along the way");
    assert_eq!(held_acc.to_bits(), host_acc.to_bits());
    let init = Params::init(&cfg, ws.seed).unwrap();
    assert!(held != init, "the warm start did not train");
    for ((name, a), (_, b)) in held.named_tensors().iter().zip(host.named_tensors()) {
        assert_eq!(bits(a), bits(b), "{name}");
    }
}
