//! Sweeps on GPUs through the suite runner, and what a lost card does to them.
//!
//! - Two cards (skipped with fewer): the runs spread over both, each manifest names its card
//!   (ordinal, model, UUID), and every metric equals the same run's on one card alone, bit for
//!   bit: the engine repeats across cards of one model, not only on one card. Then a real kernel
//!   fault on cuda:1 mid-sweep (an out-of-bounds store launched into that card's primary
//!   context, which the engine shares, as after a hardware fault). CUDA's sticky errors are per
//!   process: on two H200s the fault also failed the run in flight on cuda:0, which is why a
//!   sweep runs each card in worker processes of its own by default (`scripts/multi-gpu-check.sh`
//!   faults one card under them). What must hold in one process: the faulted card is reported
//!   lost, every failed run names its own card, and no run reported `ok` holds other metrics
//!   than on one card alone.
//! - One card (any GPU machine): the same fault on cuda:0 during the second of four runs. The
//!   first run stays `ok`, the second fails naming the card, the card is reported lost, the two
//!   runs nobody could take count as `not run`, and the lost card's backend drops without a
//!   panic.
//!
//! One test: a fault ends CUDA for the rest of the process, so with two cards the one-card part
//! is left to one-GPU machines.

mod common;

use common::fault;
use lockstep::engine::backend::Backend;
use lockstep::engine::backend::cuda::{self, CudaBackend};
use lockstep::store::{RunDir, RunStatus};
use lockstep::suite::plan::RunSpec;
use lockstep::suite::runner::{Progress, RunnerOptions, Summary, run_suite};
use lockstep::suite::spec::SuiteSpec;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Mutex;

fn suite() -> (SuiteSpec, Vec<RunSpec>) {
    common::tiny_two_recipe_suite("two-gpus")
}

/// Run the suite into `dir/runs` on `backends` with `jobs` workers; `on_progress` sees every event.
fn sweep(
    dir: &Path,
    backends: &[&dyn Backend],
    jobs: usize,
    on_progress: &(dyn Fn(&Progress<'_>) + Sync),
) -> Summary {
    let (s, runs) = suite();
    let opts = RunnerOptions {
        store: dir.join("runs"),
        jobs,
        force: false,
        cache: dir.join("cache"),
        threads_per_worker: None,
        // One run a worker: the cards' runs are compared with one card's bit for bit, and a
        // batch's composition would differ between the two.
        batch_runs: Some(1),
    };
    run_suite(backends, &s, &runs, &opts, &|p| on_progress(&p)).unwrap()
}

/// Per run id: status, device, the manifest's extras and every deterministic scalar of every step.
type Outcomes = BTreeMap<
    String,
    (
        RunStatus,
        String,
        Option<String>,
        Vec<BTreeMap<String, u64>>,
    ),
>;

fn outcomes(dir: &Path) -> Outcomes {
    let (_, runs) = suite();
    runs.iter()
        .map(|r| {
            let rd = RunDir::open(&dir.join("runs").join("two-gpus").join(&r.run_id));
            let m = rd.read_manifest().unwrap();
            let steps = match m.status {
                RunStatus::Ok => common::step_bits(&rd),
                _ => Vec::new(),
            };
            let gpu = m
                .extra
                .get("gpu")
                .and_then(|g| g.as_str())
                .map(String::from);
            let detail = m.error.or(gpu);
            (r.run_id.clone(), (m.status, m.device, detail, steps))
        })
        .collect()
}

#[test]
fn sweeps_spread_over_cards_repeat_across_them_and_survive_losing_one() {
    if let Some(why) = cuda::skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let g0 = CudaBackend::new(0).unwrap();
    match cuda::device_count() {
        Ok(n) if n >= 2 => {
            two_cards(&g0, CudaBackend::new(1).unwrap());
            eprintln!("the one-card part skips: the two-card fault ended CUDA in this process");
        }
        other => {
            eprintln!("the two-card part skips: {other:?} GPU(s) visible");
            a_card_that_faults_fails_its_run_and_no_later_run_goes_to_it(g0);
        }
    }
}

/// The two-card case of the module doc: `g0` stays healthy, `g1` is lost.
fn two_cards(g0: &CudaBackend, g1: CudaBackend) {
    let quiet = |_: &Progress<'_>| {};

    // One card alone: the reference.
    let one = tempfile::tempdir().unwrap();
    let sum = sweep(one.path(), &[g0], 1, &quiet);
    assert_eq!((sum.ok, sum.failed), (6, 0), "{sum:?}");
    let reference = outcomes(one.path());

    // Both cards: spread evenly, each manifest names its card, every metric as on one card.
    let two = tempfile::tempdir().unwrap();
    let sum = sweep(two.path(), &[g0, &g1], 2, &quiet);
    assert_eq!((sum.ok, sum.failed), (6, 0), "{sum:?}");
    assert!(
        sum.per_device.values().all(|&n| n >= 2),
        "runs not spread: {:?}",
        sum.per_device
    );
    let spread = outcomes(two.path());
    // Read before the fault below: a faulted context answers no more driver calls, its UUID
    // query included (cudarc reports an error a failed free recorded on it).
    let uuids = [g0.device().uuid().unwrap(), g1.device().uuid().unwrap()];
    let uuid = |b: &CudaBackend| uuids[usize::from(!std::ptr::eq(b, g0))].clone();
    for (id, (status, device, gpu, steps)) in &spread {
        assert_eq!(*status, RunStatus::Ok, "{id}");
        let card = if device == "cuda:0" { g0 } else { &g1 };
        let gpu = gpu.as_deref().unwrap_or_default();
        assert!(gpu.contains(&uuid(card)), "{id}: manifest gpu `{gpu}`");
        assert_eq!(
            *steps, reference[id].3,
            "{id} on {device} differs from cuda:0 alone"
        );
    }
    assert_ne!(uuid(g0), uuid(&g1));

    // Both cards, cuda:1 faults during its first run's first step.
    let lost = tempfile::tempdir().unwrap();
    let on_card: Mutex<BTreeMap<String, String>> = Mutex::default();
    let planted = Mutex::new(false);
    let plant = |p: &Progress<'_>| match p {
        Progress::Started { run, device } => {
            on_card
                .lock()
                .unwrap()
                .insert(run.run_id.clone(), device.to_string());
        }
        Progress::Step { run, .. } => {
            let here = on_card.lock().unwrap().get(&run.run_id).cloned();
            let mut done = planted.lock().unwrap();
            if here.as_deref() == Some("cuda:1") && !*done {
                *done = true;
                fault(1);
            }
        }
        _ => {}
    };
    let sum = sweep(lost.path(), &[g0, &g1], 2, &plant);
    assert!(*planted.lock().unwrap(), "no run started on cuda:1");
    assert!(sum.failed >= 1, "{sum:?}");
    assert_eq!(sum.ok + sum.failed + sum.not_run, 6, "{sum:?}");
    assert!(
        sum.lost_devices.iter().any(|(d, _)| d == "cuda:1"),
        "{sum:?}"
    );
    let started = on_card.lock().unwrap().clone();
    for (id, device) in started {
        let rd = RunDir::open(&lost.path().join("runs").join("two-gpus").join(&id));
        let m = rd.read_manifest().unwrap();
        assert_eq!(m.device, device, "{id}");
        match m.status {
            RunStatus::Failed => {
                let error = m.error.unwrap_or_default();
                let card = if device == "cuda:0" { g0 } else { &g1 };
                assert!(
                    error.contains(&device) && error.contains(&uuid(card)),
                    "{id}: error does not name its card: {error}"
                );
            }
            status => {
                assert_eq!(status, RunStatus::Ok, "{id}");
                assert_eq!(
                    common::step_bits(&rd),
                    reference[&id].3,
                    "{id} on {device} changed"
                );
            }
        }
    }
    // The faulted card stays lost.
    assert!(g1.health().is_err());
}

/// Four runs of one recipe on the tiny model, for the one-card case.
const ONE_CARD: &str = r#"
name = "fault"
seeds = [0, 1, 2, 3]
[workload]
model = "tiny"
steps = 3
prompts_per_step = 4
samples_per_prompt = 4
[workload.warm_start]
max_steps = 4
eval_prompts = 8
[[configs]]
name = "nvfp4-dq"
recipe = "nvfp4-dq"
"#;

/// The one-card case of the module doc, on `g0`.
fn a_card_that_faults_fails_its_run_and_no_later_run_goes_to_it(g0: CudaBackend) {
    let uuid = g0.device().uuid().unwrap();
    let s = lockstep::suite::spec::parse(ONE_CARD, Path::new("fault.toml")).unwrap();
    let runs = lockstep::suite::plan::expand(&s).unwrap();
    let d = tempfile::tempdir().unwrap();
    let opts = RunnerOptions {
        store: d.path().join("runs"),
        jobs: 1,
        force: false,
        cache: d.path().join("cache"),
        threads_per_worker: None,
        // One run at a time (a GPU batches by default): the fault lands during the second.
        batch_runs: Some(1),
    };
    let started = Mutex::new(0usize);
    let planted = Mutex::new(false);
    let plant = |p: Progress<'_>| match p {
        Progress::Started { .. } => *started.lock().unwrap() += 1,
        Progress::Step { .. } => {
            let mut done = planted.lock().unwrap();
            if *started.lock().unwrap() == 2 && !*done {
                *done = true;
                fault(0);
            }
        }
        _ => {}
    };
    let sum = run_suite(&[&g0], &s, &runs, &opts, &plant).unwrap();
    assert_eq!((sum.ok, sum.failed, sum.not_run), (1, 1, 2), "{sum:?}");
    assert_eq!(sum.lost_devices.len(), 1, "{sum:?}");
    assert_eq!(sum.lost_devices[0].0, "cuda:0");
    let manifest = |i: usize| {
        RunDir::open(&opts.store.join("fault").join(&runs[i].run_id))
            .read_manifest()
            .unwrap()
    };
    assert_eq!(manifest(0).status, RunStatus::Ok);
    let failed = manifest(1);
    assert_eq!(failed.status, RunStatus::Failed);
    let error = failed.error.unwrap_or_default();
    assert!(
        error.contains("cuda:0") && error.contains(&uuid) && error.contains("stopped computing"),
        "the error does not name the card: {error}"
    );
    eprintln!("failed run's error: {error}");
    assert!(g0.health().is_err());
    drop(g0); // a lost card's backend drops without panicking
}
