//! Run ids survive upgrades: a field added at its old-behaviour value leaves every id as it was,
//! any other value changes it, and the id of one shipped run is pinned.

use lockstep::suite::identity::{
    IDENTITY_DEFAULTS, canonical, format_run_id, identity_defaults, identity_text, to_json,
};
use lockstep::suite::runner::unplanned_runs;
use lockstep::suite::{RunSpec, SuiteSpec, expand, load};
use serde::Serialize;
use serde_json::{Value, json};
use std::path::Path;

fn smoke() -> (SuiteSpec, Vec<RunSpec>) {
    let s = load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("suites/smoke.toml")).unwrap();
    let runs = expand(&s).unwrap();
    (s, runs)
}

fn text_of(s: &SuiteSpec, r: &RunSpec) -> String {
    identity_text(s, &r.config, &r.run, &r.env, &r.vars)
}

/// The shipped smoke suite's `bf16` seed 0. A deliberate change of run identity renames every run
/// in every store (a rerun redoes them all): update this id, and say so in README's "Upgrading".
const SMOKE_BF16_S0: &str = "bf16-s0-849ca151b056";

#[test]
fn the_id_of_a_shipped_run_is_pinned() {
    let (s, runs) = smoke();
    let r = runs
        .iter()
        .find(|r| r.config == "bf16" && r.seed == 0)
        .unwrap();
    assert_eq!(r.run_id, SMOKE_BF16_S0, "identity: {}", text_of(&s, r));
}

#[test]
fn fields_at_their_defaults_are_left_out_and_keys_are_sorted() {
    let (s, runs) = smoke();
    let text = text_of(&s, &runs[0]);
    // smoke.toml sets max_response_tokens = 5 (default 8) and prompts_per_step = 8 (the default).
    assert!(text.contains(r#""max_response_tokens":5"#), "{text}");
    for default in [
        "prompts_per_step",
        "beta1",
        "warm_start",
        "contract_break",
        "env",
        "argv",
    ] {
        assert!(
            !text.contains(&format!("\"{default}\"")),
            "{default}: {text}"
        );
    }
    let v: Value = serde_json::from_str(&text).unwrap();
    let keys: Vec<&String> = v.as_object().unwrap().keys().collect();
    assert_eq!(keys, ["config", "engine", "run"]);
    assert_eq!(format_run_id(&runs[0].config, 0, &text), runs[0].run_id);
}

#[test]
fn every_entry_of_the_defaults_table_names_a_field_runs_have() {
    // A misspelt entry would leave its field hashed; compare the table's shape with a real run's.
    fn missing(table: &Value, real: &Value, at: &str, out: &mut Vec<String>) {
        if let Value::Object(t) = table {
            for (k, v) in t {
                match real.get(k) {
                    Some(r) => missing(v, r, &format!("{at}.{k}"), out),
                    None => out.push(format!("{at}.{k}")),
                }
            }
        }
    }
    let (s, runs) = smoke();
    let r = &runs[0];
    let raw = json!({
        "engine": s.engine, "config": r.config, "run": to_json(&r.run),
        "env": r.env, "vars": r.vars, "argv": Value::Null,
    });
    let mut out = Vec::new();
    missing(&identity_defaults(), &raw, "", &mut out);
    assert!(
        out.is_empty(),
        "not fields of a run: {out:?}\n{IDENTITY_DEFAULTS}"
    );
}

// An upgrade adds `extra` to a settings struct; old stores hold runs made by the old shape.

#[derive(Serialize)]
struct OldShape {
    lr: f32,
    steps: usize,
}

#[derive(Serialize)]
struct NewShape {
    lr: f32,
    steps: usize,
    /// The old behaviour is `extra = 0`.
    #[serde(default)]
    extra: usize,
}

fn id_of<T: Serialize>(x: &T) -> (String, String) {
    // The upgrade adds `"extra": 0` to the defaults table along with the field.
    let mut defaults = identity_defaults();
    defaults["run"]["extra"] = json!(0);
    let text = canonical(
        &json!({ "engine": "builtin", "run": to_json(x) }),
        &defaults,
    )
    .to_string();
    (format_run_id("c", 0, &text), text)
}

#[test]
fn a_field_added_at_its_default_keeps_the_id_and_any_other_value_changes_it() {
    let old = id_of(&OldShape {
        lr: 1e-3,
        steps: 20,
    });
    let new = id_of(&NewShape {
        lr: 1e-3,
        steps: 20,
        extra: 0,
    });
    assert_eq!(new, old);
    assert_eq!(
        old.1,
        r#"{"engine":"builtin","run":{"lr":0.001,"steps":20}}"#
    );
    let set = id_of(&NewShape {
        lr: 1e-3,
        steps: 20,
        extra: 3,
    });
    assert_ne!(set.0, old.0);
    assert!(set.1.contains(r#""extra":3"#), "{}", set.1);
}

#[test]
fn a_setting_at_a_value_other_than_its_default_changes_the_id() {
    let (s, runs) = smoke();
    let base = &runs[0];
    let mut other = base.clone();
    other.run.grpo.beta1 = 0.8;
    let text = text_of(&s, &other);
    assert!(text.contains(r#""beta1":0.8"#), "{text}");
    assert_ne!(format_run_id(&other.config, 0, &text), base.run_id);
}

#[test]
fn one_element_arrays_in_the_table_apply_to_every_element() {
    let defaults = json!({ "rules": [{ "backward": null }] });
    let v = json!({ "rules": [
        { "pattern": "*", "backward": null },
        { "pattern": "a.*", "backward": "quantized" },
    ]});
    assert_eq!(
        canonical(&v, &defaults).to_string(),
        r#"{"rules":[{"pattern":"*"},{"backward":"quantized","pattern":"a.*"}]}"#
    );
}

#[test]
fn folders_of_other_run_ids_are_found() {
    let (_, runs) = smoke();
    let d = tempfile::tempdir().unwrap();
    for name in [
        runs[0].run_id.as_str(),
        "bf16-s0-000000000000",
        "half-written",
    ] {
        std::fs::create_dir(d.path().join(name)).unwrap();
    }
    for name in [runs[0].run_id.as_str(), "bf16-s0-000000000000"] {
        std::fs::write(d.path().join(name).join("manifest.json"), "{}").unwrap();
    }
    assert_eq!(unplanned_runs(d.path(), &runs), ["bf16-s0-000000000000"]);
    assert!(unplanned_runs(&d.path().join("absent"), &runs).is_empty());
}

#[test]
fn lockstep_run_says_when_the_store_holds_runs_of_other_ids() {
    let d = tempfile::tempdir().unwrap();
    let suite = d.path().join("s.toml");
    let text = "name = \"s\"\nengine = \"command\"\nseeds = [0]\n[workload]\nsteps = 1\n[command]\nargv = [\"true\"]\ntimeout_s = 10\n[command.metrics]\nfiles = [\"m.jsonl\"]\nstep = \"step\"\n[[configs]]\nname = \"bf16\"\nrecipe = \"bf16\"\n";
    std::fs::write(&suite, text).unwrap();
    let old = d.path().join("store/s/bf16-s0-000000000000");
    std::fs::create_dir_all(&old).unwrap();
    std::fs::write(old.join("manifest.json"), "{}").unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(["run", suite.to_str().unwrap(), "--store"])
        .arg(d.path().join("store"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("note: 1 run folder(s)") && err.contains("bf16-s0-000000000000"),
        "{err}"
    );
}
