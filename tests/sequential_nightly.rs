//! Issue 20, item 2 end to end: `lockstep nightly` on a suite with `[checks.sequential]` (or with
//! `--seeds auto`) runs seeds in batches and stops each configuration once the group-sequential
//! procedure decides it. On the tiny model, a copy of
//! BF16 under another name (A/A) is decided `equivalent` at the first look and runs no more seeds;
//! a recipe broken on purpose (per-tensor NVFP4 scales in the rollout) keeps going and is
//! `regressed` by the last look; the night regresses.

use std::path::Path;
use std::process::Command;

const SUITE: &str = r#"
name = "sequential"
engine = "builtin"
seeds = [0, 1, 2, 3, 4, 5, 6, 7]

[workload]
model = "tiny"
task = "add:2"
prompts_per_step = 8
samples_per_prompt = 8
max_response_tokens = 5
steps = 30
eval_every = 0

[[configs]]
name = "bf16"
recipe = "bf16"

[[configs]]
name = "bf16-again"
recipe = "bf16"

[[configs]]
name = "broken"
recipe = "nvfp4-dq"
contract_break = "per-tensor-nvfp4"

[checks]
margin = { of_level = 0.05 }
final_window = 10
bootstrap_reps = 500
band_reps = 100

[checks.sequential]
min_seeds = 3
max_seeds = 8
batch = 2
"#;

fn runs_of(store: &Path, config: &str) -> usize {
    std::fs::read_dir(store)
        .unwrap()
        .filter(|e| {
            let p = e.as_ref().unwrap().path();
            std::fs::read_to_string(p.join("manifest.json"))
                .is_ok_and(|m| m.contains(&format!("\"config_name\": \"{config}\"")))
        })
        .count()
}

#[test]
fn seeds_auto_stops_decided_configurations_and_keeps_running_undecided_ones() {
    let tmp = tempfile::tempdir().unwrap();
    let suite = tmp.path().join("sequential.toml");
    std::fs::write(&suite, SUITE).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(["nightly", suite.to_str().unwrap(), "--store", "runs"])
        // The suite's [checks.sequential] makes the night sequential; the flag overrides its
        // first look (3 seeds in the suite).
        .args(["--min-seeds", "4"])
        .current_dir(tmp.path())
        .env("LOCKSTEP_CACHE", tmp.path().join("cache"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(1),
        "the broken recipe regresses\n{stdout}\n{stderr}"
    );
    assert!(
        stdout.contains("sequential: bf16-again at 4 seeds: Equivalent"),
        "{stdout}"
    );
    assert!(
        stdout.contains("sequential: broken at 8 seeds: Regressed"),
        "{stdout}"
    );
    let store = tmp.path().join("runs/sequential");
    assert_eq!(
        runs_of(&store, "bf16-again"),
        4,
        "decided at the first look: no more seeds"
    );
    assert_eq!(runs_of(&store, "broken"), 8);
    assert_eq!(
        runs_of(&store, "bf16"),
        8,
        "the baseline runs what any configuration needs"
    );
    let cmp: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(store.join("compare.json")).unwrap())
            .unwrap();
    let reward = |config: &str| {
        cmp["configs"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["config"] == config)
            .unwrap()["metrics"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["metric"] == "rollout/raw_reward")
            .unwrap()
            .clone()
    };
    assert_eq!(reward("bf16-again")["verdict"], "equivalent");
    assert_eq!(reward("broken")["verdict"], "regressed");
    assert!(
        reward("broken")["reason"]
            .as_str()
            .unwrap()
            .starts_with("sequential seeds: regressed at 8 seeds"),
        "{}",
        reward("broken")["reason"]
    );
    assert_eq!(
        cmp["problems"].as_array().map(Vec::len),
        Some(0),
        "{}",
        cmp["problems"]
    );
}

#[test]
fn sequential_flags_without_sequential_seeds_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let suite = tmp.path().join("sequential.toml");
    std::fs::write(&suite, SUITE).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(["nightly", suite.to_str().unwrap(), "--store", "runs"])
        .args(["--seeds", "fixed", "--batch", "2"])
        .current_dir(tmp.path())
        .env("LOCKSTEP_CACHE", tmp.path().join("cache"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--seeds auto"), "{stderr}");
    assert!(
        !tmp.path().join("runs").exists(),
        "refused before running anything"
    );
    let bad = SUITE.replace("max_seeds = 8", "max_seeds = 2");
    std::fs::write(&suite, bad).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(["suite", "check", suite.to_str().unwrap()])
        .current_dir(tmp.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("sequential.toml:") && stderr.contains("max_seeds (2)"),
        "{stderr}"
    );
}
