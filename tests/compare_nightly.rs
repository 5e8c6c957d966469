//! Issue 5 end to end on a tiny real suite (built-in engine, about 10-20 s with the warm start):
//! `lockstep nightly` runs, compares and writes verdict.json, summary.md, junit.xml and
//! compare.json; a failing check alerts only on the second consecutive night; `baseline save`
//! then `baseline diff` match exactly, and a changed golden value is reported with its step;
//! `suite check` points at a bad check expression.

use lockstep::compare::SuiteComparison;
use std::path::Path;
use std::process::Command;

const SUITE: &str = r#"
name = "tiny-nightly"
engine = "builtin"
seeds = [0, 1, 2]

[workload]
model = "tiny"
task = "add:2"
prompts_per_step = 4
samples_per_prompt = 4
steps = 12
eval_every = 0

[[configs]]
name = "bf16"
recipe = "bf16"

[[configs]]
name = "nvfp4-dq"
recipe = "nvfp4-dq"

[[configs]]
name = "nvfp4-broken"
recipe = "nvfp4-dq"
contract_break = "per-tensor-nvfp4"

[checks]
margin = 0.2
final_window = 4
nights = 2
bootstrap_reps = 500
expr = ["contract_violations == 0", "max(train/train_rollout_kl) < 1"]
"#;

fn lockstep(dir: &Path, args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(args)
        .current_dir(dir)
        .env("LOCKSTEP_CACHE", dir.join("cache"))
        .output()
        .expect("the lockstep binary runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

#[test]
fn nightly_compare_and_golden_values_on_a_tiny_suite() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    std::fs::write(dir.join("suite.toml"), SUITE).unwrap();

    // Night 1: the broken contract fails a check, but one night is not enough to alert.
    let (code, out) = lockstep(
        dir,
        &[
            "nightly",
            "suite.toml",
            "--jobs",
            "2",
            "--date",
            "2026-12-01",
        ],
    );
    assert_eq!(code, 0, "{out}");
    let folder = dir.join("runs/tiny-nightly");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(folder.join("verdict.json")).unwrap())
            .unwrap();
    assert_eq!(v["verdict"], "pending", "{v}");
    // One vocabulary (issue 20): the report's banner does not say REGRESSION for a night that
    // nightly calls pending, and `compare` on that night says PENDING and exits 0 like nightly.
    let report = out
        .lines()
        .find_map(|l| l.strip_prefix("report: "))
        .expect("nightly names its report");
    let html = std::fs::read_to_string(dir.join(report)).unwrap();
    assert!(
        html.contains(">PENDING</span></h1>") && !html.contains(">REGRESSION</span>"),
        "the banner says nightly's word for the night"
    );
    let written: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(folder.join("compare.json")).unwrap())
            .unwrap();
    assert_eq!(written["night_state"], "pending", "compare.json agrees");
    let (code, cmp_out) = lockstep(
        dir,
        &["compare", "--suite", "suite.toml", "--date", "2026-12-01"],
    );
    assert_eq!(code, 0, "{cmp_out}");
    assert!(cmp_out.contains("overall: PENDING"), "{cmp_out}");
    let cmp: SuiteComparison =
        serde_json::from_str(&std::fs::read_to_string(folder.join("compare.json")).unwrap())
            .unwrap();
    let broken = cmp
        .contract
        .iter()
        .find(|r| r.config == "nvfp4-broken")
        .unwrap();
    assert!(
        broken.violations > 0 && broken.steps_checked > 0,
        "{broken:?}"
    );
    let intact = cmp
        .contract
        .iter()
        .find(|r| r.config == "nvfp4-dq")
        .unwrap();
    assert_eq!(intact.violations, 0);
    let failed: Vec<_> = cmp.checks.iter().filter(|c| !c.passed).collect();
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert_eq!(failed[0].config, "nvfp4-broken");
    let reward = &cmp.configs[0].metrics[0];
    assert_eq!(reward.metric, "rollout/raw_reward");
    assert_eq!(reward.curve.steps.len(), 12);
    assert_eq!(reward.curve.per_seed.len(), 3);
    assert!(!cmp.method.description.is_empty());

    // Night 2 (no new runs): the same failure again alerts, with since = night 1.
    let (code, out) = lockstep(
        dir,
        &["nightly", "suite.toml", "--no-run", "--date", "2026-12-02"],
    );
    assert_eq!(code, 1, "{out}");
    let md = std::fs::read_to_string(folder.join("summary.md")).unwrap();
    assert!(
        md.contains("REGRESSION") && md.contains("since 2026-12-01, 2 nights"),
        "{md}"
    );
    let junit = std::fs::read_to_string(folder.join("junit.xml")).unwrap();
    assert!(junit.contains("<testcase classname=\"tiny-nightly.nvfp4-broken\" name=\"contract_violations == 0\"><failure"), "{junit}");
    assert_eq!(
        junit.matches("<testcase").count(),
        2 * 2 + 2,
        "two checks on two configs, one margin metric each"
    );

    // Golden values: exact on the same platform, and a changed value is found with its step.
    let (code, out) = lockstep(dir, &["baseline", "save", "--suite", "suite.toml"]);
    assert_eq!(code, 0, "{out}");
    let (code, out) = lockstep(dir, &["baseline", "diff", "--suite", "suite.toml"]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("exact") && !out.contains("CHANGED"), "{out}");
    let csv = dir.join("baselines/tiny-nightly/bf16.csv");
    let text = std::fs::read_to_string(&csv).unwrap();
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    let head: Vec<&str> = lines[0].split(',').collect();
    let col = head
        .iter()
        .position(|h| *h == "rollout/raw_reward")
        .unwrap();
    let mut row: Vec<String> = lines[4].split(',').map(str::to_string).collect();
    row[col] = "0.987654321".into();
    lines[4] = row.join(",");
    std::fs::write(&csv, lines.join("\n") + "\n").unwrap();
    let (code, out) = lockstep(dir, &["baseline", "diff", "--suite", "suite.toml"]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("CHANGED (first: seed 0 step 3)"), "{out}");

    // A bad expression is an error at `suite check` time, with its position.
    let bad = SUITE.replace(
        "max(train/train_rollout_kl) < 1",
        "max(train/train_rollout_kl) <",
    );
    std::fs::write(dir.join("bad.toml"), bad).unwrap();
    let (code, out) = lockstep(dir, &["suite", "check", "bad.toml"]);
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains("bad.toml:32:67:") && out.contains("at byte 29"),
        "{out}"
    );
}
