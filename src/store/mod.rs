//! The run store: the only module that writes or reads run files. A run folder holds
//! `manifest.json` (resolved config, seed, versions, host, status), `scalars.parquet` (one row per
//! step, one column per metric key), `layers.parquet` (per site and layer), `events.jsonl` and
//! `log.txt`. Every file is written atomically, so a reader never sees a half-written one.

pub mod baseline;
pub mod columns;
pub mod run;
pub mod table;

pub use run::{Manifest, RunDir, RunStatus};

use crate::io::IoError;
use std::path::{Path, PathBuf};

/// The run folders directly under a suite folder (those holding a `manifest.json`), sorted.
pub fn run_dirs(suite_dir: &Path) -> Result<Vec<PathBuf>, IoError> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(suite_dir)
        .map_err(|e| IoError::io(suite_dir, e))?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.join("manifest.json").is_file())
        .collect();
    out.sort();
    Ok(out)
}

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
