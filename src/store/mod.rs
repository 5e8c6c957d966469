//! The run store: the only module that writes or reads run files. A run folder holds
//! `manifest.json` (resolved config, seed, versions, host, status), `scalars.parquet` (one row per
//! step, one column per metric key), `layers.parquet` (per site and layer), `events.jsonl` and
//! `log.txt`. Every file is written atomically, so a reader never sees a half-written one.

pub mod baseline;
pub mod columns;
pub mod run;
pub mod table;

pub use run::{Manifest, RunDir, RunStatus};
