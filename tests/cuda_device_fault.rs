//! A sweep whose only GPU faults mid-run (skips without a GPU): a real out-of-bounds kernel
//! store planted into the card's primary context during the second run's first step. The first
//! run stays `ok`, the second fails with the card's ordinal and UUID in its error, the card is
//! reported lost, the two runs nobody could take count as `not run`, and dropping the lost
//! card's backend does not panic. Its own test binary: the fault ends the card for the process.

mod common;

use common::fault;
use lockstep::engine::backend::Backend;
use lockstep::engine::backend::cuda::{self, CudaBackend};
use lockstep::store::{RunDir, RunStatus};
use lockstep::suite::runner::{Progress, RunnerOptions, run_suite};
use std::path::Path;
use std::sync::Mutex;

const SUITE: &str = r#"
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

#[test]
fn a_gpu_that_faults_fails_its_run_and_no_later_run_goes_to_it() {
    if let Some(why) = cuda::skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let g0 = CudaBackend::new(0).unwrap();
    let uuid = g0.device().uuid().unwrap();
    let s = lockstep::suite::spec::parse(SUITE, Path::new("fault.toml")).unwrap();
    let runs = lockstep::suite::plan::expand(&s).unwrap();
    let d = tempfile::tempdir().unwrap();
    let opts = RunnerOptions {
        store: d.path().join("runs"),
        jobs: 1,
        force: false,
        cache: d.path().join("cache"),
        threads_per_worker: None,
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
