//! Issue 25: W&B history read back to the exact values logged, from every form W&B keeps it in:
//! an offline run's transaction log written by W&B's own SDK, `scan_history()` rows dumped as JSON
//! lines, an older client's `wandb-history.jsonl`, and the app's panel CSV export. W&B's
//! bookkeeping keys (`_runtime`, `_timestamp`, `_wandb.runtime`) and the logged histogram are
//! neither metrics nor junk; the NaN gradient norm is a stored value and a `non_finite` event.
//! The fixtures and the script that made them are in `tests/fixtures/wandb/`.

use lockstep::suite::metrics::{MetricsMapping, MetricsRead, read_metrics};
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/wandb")
}

fn read(toml_text: &str) -> MetricsRead {
    let m: MetricsMapping = toml::from_str(toml_text).unwrap();
    read_metrics(&root(), &m).unwrap_or_else(|e| panic!("{toml_text}: {e}"))
}

fn expected() -> Vec<serde_json::Value> {
    serde_json::from_str(&std::fs::read_to_string(root().join("expected.json")).unwrap()).unwrap()
}

/// Every logged key at its exact value, W&B's `_step` as the step, nothing skipped.
fn check(r: &MetricsRead, what: &str, keys: &[&str]) {
    let want = expected();
    assert!(r.missing.is_empty(), "{what}: {:?}", r.missing);
    assert_eq!(
        r.skipped, 0,
        "{what}: bookkeeping and histograms are not junk"
    );
    assert_eq!(r.duplicates, 0, "{what}");
    assert_eq!(r.records.len(), want.len(), "{what}");
    for (rec, w) in r.records.iter().zip(&want) {
        assert_eq!(rec.step as u64, w["_step"].as_u64().unwrap(), "{what}");
        let mut stored: Vec<&str> = rec.scalars.keys().map(String::as_str).collect();
        stored.sort_unstable();
        let mut listed = keys.to_vec();
        listed.sort_unstable();
        assert_eq!(stored, listed, "{what}: step {}", rec.step);
        for k in keys {
            match w[*k].as_f64() {
                Some(v) => assert_eq!(rec.get(k), Some(v), "{what}: {k} at {}", rec.step),
                None => assert!(rec.get(k).is_some_and(f64::is_nan), "{what}: {k} NaN kept"),
            }
        }
    }
    assert_eq!(
        r.divergence(),
        Some((2, "train/grad_norm".to_string())),
        "{what}: the NaN gradient norm"
    );
    let ev = &r.records[2].events;
    assert_eq!(ev.len(), 1, "{what}: {ev:?}");
    assert_eq!(
        (ev[0].kind.as_str(), ev[0].site.as_str()),
        ("non_finite", "train/grad_norm")
    );
}

const ALL: [&str; 5] = [
    "train/loss",
    "rollout/raw_reward",
    "perf.step_time",
    "train/grad_norm",
    "train/global_step",
];

#[test]
fn the_sdk_transaction_log_of_an_offline_run_reads_back_exactly() {
    let r = read("files = [\"offline-run/run-*.wandb\"]\n");
    check(&r, "run-lockstep0.wandb", &ALL);
}

#[test]
fn scan_history_rows_read_back_by_source_and_by_their_step_key() {
    check(
        &read("files = [\"scan-history.jsonl\"]\nsource = \"wandb\"\n"),
        "source = wandb",
        &ALL,
    );
    // With no `step` key and W&B's `_step` in every row, the rows are W&B's without being told.
    check(&read("files = [\"scan-history.jsonl\"]\n"), "auto", &ALL);
}

#[test]
fn an_older_clients_history_file_reads_back_by_its_name() {
    check(
        &read("files = [\"wandb-history.jsonl\"]\n"),
        "wandb-history.jsonl",
        &ALL,
    );
}

#[test]
fn the_apps_panel_export_drops_the_run_prefix_and_the_band_columns() {
    check(
        &read("files = [\"panel-export.csv\"]\n"),
        "panel-export.csv",
        &["train/loss", "train/grad_norm"],
    );
}

#[test]
fn the_trl_preset_steps_by_train_global_step() {
    // TRL (transformers' WandbCallback) charts against `train/global_step`, 1-based.
    for file in [
        "offline-run/run-*.wandb",
        "scan-history.jsonl",
        "wandb-history.jsonl",
    ] {
        let r = read(&format!(
            "files = [\"{file}\"]\nsource = \"wandb\"\npreset = \"trl\"\n"
        ));
        let steps: Vec<usize> = r.records.iter().map(|x| x.step).collect();
        assert_eq!(steps, [0, 1, 2], "{file}");
        assert_eq!(r.before_first, 0, "{file}");
        assert_eq!(r.records[1].get("train/loss"), Some(0.5), "{file}");
        assert!(
            !r.records[0].scalars.contains_key("train/global_step"),
            "{file}: the step key is not a metric"
        );
    }
}

#[test]
fn a_cut_off_transaction_log_fails_with_its_offset_unless_partial_rows_are_kept() {
    let bytes = std::fs::read(root().join("offline-run/run-lockstep0.wandb")).unwrap();
    let d = tempfile::tempdir().unwrap();
    let cut = bytes.len() - 3;
    std::fs::write(d.path().join("run-x.wandb"), &bytes[..cut]).unwrap();
    let m: MetricsMapping = toml::from_str("files = [\"run-x.wandb\"]\n").unwrap();
    let e = read_metrics(d.path(), &m).unwrap_err();
    assert!(e.contains("run-x.wandb: byte "), "{e}");
    assert!(e.contains("keep_partial_events = true"), "{e}");
    assert!(!e.contains('\n'), "one line: {e}");
    let m: MetricsMapping =
        toml::from_str("files = [\"run-x.wandb\"]\nkeep_partial_events = true\n").unwrap();
    let r = read_metrics(d.path(), &m).unwrap();
    assert_eq!(
        r.records.len(),
        3,
        "the history rows come before the exit records"
    );
    assert_eq!(r.skipped, 1, "the cut");
}

#[test]
fn a_summary_file_is_refused_with_where_the_history_is() {
    let d = tempfile::tempdir().unwrap();
    std::fs::create_dir(d.path().join("files")).unwrap();
    std::fs::write(
        d.path().join("files/wandb-summary.json"),
        "{\"_step\": 2, \"train/loss\": 0.375, \"_wandb\": {\"runtime\": 0}}",
    )
    .unwrap();
    let m: MetricsMapping = toml::from_str("files = [\"files/wandb-summary.json\"]\n").unwrap();
    let e = read_metrics(d.path(), &m).unwrap_err();
    assert!(e.contains("only each key's last value"), "{e}");
    assert!(e.contains("run-*.wandb"), "{e}");
}
