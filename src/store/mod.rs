//! The run store: the only module that writes or reads run files. A run folder holds
//! `manifest.json` (resolved config, seed, versions, host, status), `scalars.parquet` (one row per
//! step, one column per metric key), `layers.parquet` (per site and layer), `events.jsonl` and
//! `log.txt`. Every file is written atomically, so a reader never sees a half-written one.

pub mod baseline;
pub mod columns;
pub mod run;
pub mod table;

pub use run::{Manifest, RunDir, RunStatus};

/// A path component that cannot escape its parent.
pub fn safe_component(s: &str) -> Result<(), String> {
    if s.is_empty() || s.starts_with('.') || s.len() > 200 {
        return Err("must be 1-200 characters and not start with `.`".into());
    }
    if let Some(c) = s
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')))
    {
        return Err(format!(
            "character {c:?} is not allowed (letters, digits, -, _, .)"
        ));
    }
    Ok(())
}
