//! Run identity: a run's id hashes a canonical JSON form of what the run computes, so a rerun of a
//! suite finds its finished runs, and an upgrade that adds a setting does not rename them.
//!
//! The canonical form leaves out every field at its value in [`IDENTITY_DEFAULTS`], the value that
//! reproduces what runs did before the field existed, and writes object keys sorted. Adding a
//! field therefore keeps every id as long as its old-behaviour value is added to that table; a
//! run that sets the field to anything else gets a new id.

use super::builtin::RunConfig;
use super::spec::SuiteSpec;
use serde::Serialize;
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;

/// For each identity field, the value that means "as before this field existed". Frozen: when a
/// type's `Default` changes later, runs at the new default compute something new and must get a
/// new id, so the entries here stay as they are. A new field's entry is added with it (else every
/// id changes and the pinned id in `tests/run_identity.rs` fails). A one-element array applies its
/// element to every element of the array it stands for (`"rules": [{...}]`).
pub const IDENTITY_DEFAULTS: &str = r#"{
  "env": {},
  "vars": {},
  "argv": null,
  "run": {
    "contract_break": "none",
    "grpo": {
      "prompts_per_step": 8, "samples_per_prompt": 8, "max_response_tokens": 8,
      "temperature": 1.0, "minibatches": 1, "lr": 0.001, "beta1": 0.9, "beta2": 0.999,
      "adam_eps": 1e-8, "grad_clip": 1.0, "clip_low": 0.2, "clip_high": 0.28, "tis_cap": 2.0,
      "kl_coef": 0.0, "routing_replay": true, "eval_every": 10, "eval_prompts": 64,
      "spike_ratio": 10.0, "spike_window": 10
    },
    "warm_start": {
      "max_steps": 4000, "batch": 64, "lr": 0.003, "target_accuracy": 0.3, "eval_every": 25,
      "eval_prompts": 128, "seed": 0
    },
    "recipe": {
      "backward": "high-precision", "nvfp4_activation_scale": "per-token", "nvfp4_shards": 1,
      "weight_decay": 0.01, "weight_decay_low_precision": 0.0
    }
  }
}"#;

/// The id of one planned run, `<config>-s<seed>-<hash>` ([`format_run_id`]). The rule: the hash
/// is over [`identity_text`], what the run computes as JSON with object keys sorted and every
/// field at its [`IDENTITY_DEFAULTS`] value left out, so a version that adds a setting at its
/// old-behaviour value keeps every id, and any other value gives a new one.
pub fn run_id(
    s: &SuiteSpec,
    config: &str,
    run: &RunConfig,
    env: &BTreeMap<String, String>,
    vars: &BTreeMap<String, String>,
) -> String {
    format_run_id(config, run.seed, &identity_text(s, config, run, env, vars))
}

/// What a run id hashes: everything that determines what the run computes, in the canonical
/// form of [`canonical`] over [`IDENTITY_DEFAULTS`]. That is the engine, the configuration's name,
/// the resolved run (model, task, recipe, GRPO and warm-start settings, contract break, seed,
/// steps), the environment and placeholder values, and for the command engine the launcher's argv
/// template. Not hashed: the device and the number of workers or threads (chosen per `lockstep
/// run`; results do not depend on the thread count, and a run finished on one device is not
/// redone on another), the command engine's timeout and kill grace (how long to wait) and its
/// metrics mapping (how to read the output: `lockstep run --reingest` re-reads finished runs).
pub fn identity_text(
    s: &SuiteSpec,
    config: &str,
    run: &RunConfig,
    env: &BTreeMap<String, String>,
    vars: &BTreeMap<String, String>,
) -> String {
    let identity = serde_json::json!({
        "engine": s.engine,
        "config": config,
        "run": to_json(run),
        "env": env,
        "vars": vars,
        "argv": s.command.as_ref().map(|c| &c.argv),
    });
    canonical(&identity, &identity_defaults()).to_string()
}

/// [`IDENTITY_DEFAULTS`] parsed.
pub fn identity_defaults() -> Value {
    serde_json::from_str(IDENTITY_DEFAULTS).expect("IDENTITY_DEFAULTS is valid JSON")
}

/// `x` as JSON, through its text form, so an `f32` such as `1e-3` reads as `0.001` (its shortest
/// decimal, as [`IDENTITY_DEFAULTS`] writes it) rather than as the `f64` nearest the `f32`.
pub fn to_json<T: Serialize>(x: &T) -> Value {
    serde_json::to_string(x)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or(Value::Null)
}

/// `value` with every object field equal to its entry in `defaults` left out (recursively, and
/// through one-element arrays in `defaults`: see [`IDENTITY_DEFAULTS`]), object keys sorted.
pub fn canonical(value: &Value, defaults: &Value) -> Value {
    match (value, defaults) {
        (Value::Object(v), _) => {
            let mut keys: Vec<&String> = v.keys().collect();
            keys.sort();
            let mut out = Map::new();
            for k in keys {
                let d = defaults.get(k);
                if d == Some(&v[k]) {
                    continue;
                }
                out.insert(k.clone(), canonical(&v[k], d.unwrap_or(&Value::Null)));
            }
            Value::Object(out)
        }
        (Value::Array(v), Value::Array(d)) if d.len() == 1 => {
            Value::Array(v.iter().map(|x| canonical(x, &d[0])).collect())
        }
        (Value::Array(v), _) => {
            Value::Array(v.iter().map(|x| canonical(x, &Value::Null)).collect())
        }
        _ => value.clone(),
    }
}

/// Longest configuration slug kept in a run id, so the id (slug, seed, hash) stays a valid file
/// name however long the configuration's name is; the hash keeps truncated ids distinct.
const MAX_SLUG: usize = 96;

/// `<config slug>-s<seed>-<12 hex of sha256(identity)>`: readable, and safe as a path component
/// whatever the configuration is called (anything but ASCII letters, digits and `-` becomes `_`).
pub fn format_run_id(config: &str, seed: u64, identity: &str) -> String {
    let h: [u8; 32] = Sha256::digest(identity.as_bytes()).into();
    let hex: String = h[..6].iter().map(|b| format!("{b:02x}")).collect();
    let slug: String = config
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    let slug = slug.trim_matches('_');
    let slug = &slug[..slug.len().min(MAX_SLUG)];
    format!("{slug}-s{seed}-{hex}")
}
