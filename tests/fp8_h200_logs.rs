//! A real low-precision run of a PyTorch GRPO loop, decided again in CI: the H200 night of
//! `examples/fp8-grpo` (docs/fp8-grpo-h200-2026-12-04/, 9 seeds each of bf16 and real FP8 via
//! torch._scaled_mm, logged by torch.utils.tensorboard under TRL's names) is re-read from its
//! committed event files through the ingest suite `examples/fp8-grpo/h200-logs.toml`, and the
//! verdicts the GPU night printed come out again. (The reward interval is narrower here than
//! that night's: the night ran seeds sequentially, whose looks spend error at stricter levels.)

use std::path::Path;
use std::process::Command;

fn lockstep(args: &[&str], store: &Path) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(args)
        .args(["--store", store.to_str().unwrap()])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

#[test]
fn the_h200_fp8_night_is_decided_again_from_its_tensorboard_files() {
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("runs");
    let suite = "examples/fp8-grpo/h200-logs.toml";
    let (code, out) = lockstep(&["run", suite], &store);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("18 imported (0 not finished), 0 planned run(s) missing"),
        "{out}"
    );
    let reports = tmp.path().join("reports");
    let (code, out) = lockstep(
        &[
            "nightly",
            suite,
            "--no-run",
            "--reports",
            reports.to_str().unwrap(),
        ],
        &store,
    );
    assert_eq!(code, 0, "the night passes\n{out}");
    assert!(out.contains("overall: PASS"), "{out}");

    let dir = store.join("fp8-grpo-h200-logs");
    let cmp: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("compare.json")).unwrap()).unwrap();
    let fp8 = cmp["configs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["config"] == "fp8")
        .unwrap();
    let metric = |name: &str| {
        fp8["metrics"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["metric"] == name)
            .unwrap_or_else(|| panic!("{name} read from the event files"))
            .clone()
    };
    let reward = metric("rollout/raw_reward");
    assert_eq!(reward["verdict"], "equivalent", "{reward}");
    assert_eq!(fp8["seeds"].as_array().map(Vec::len), Some(9));
    // The published FP8 finding: train-rollout mismatch well above BF16's.
    let kl = metric("train/train_rollout_kl");
    assert_eq!(kl["verdict"], "higher", "{kl}");
    assert!(
        kl["reason"]
            .as_str()
            .unwrap()
            .contains(" 23x bf16 [21x, 26x]"),
        "{kl}"
    );
    // Per-layer gradient norms came through the layers pattern: spikes are found per site.
    let spikes = cmp["spikes"].as_array().unwrap();
    let count = |c: &str| spikes.iter().filter(|s| s["config"] == c).count();
    assert_eq!(
        (count("bf16"), count("fp8")),
        (3, 27),
        "spikes per configuration"
    );
    assert!(
        spikes.iter().all(|s| s["layer"].is_u64()),
        "per-layer spikes"
    );
}
