//! File plumbing shared by the commands: `.npy` arrays and atomic writes. Every error names the file.

pub mod atomic;
pub mod npy;

/// An I/O failure with the path it happened on.
#[derive(Debug, thiserror::Error)]
pub enum IoError {
    #[error("{path}: {err}")]
    Io { path: String, err: std::io::Error },
    #[error("{path}: {what}")]
    Invalid { path: String, what: String },
}

impl IoError {
    pub fn io(path: &std::path::Path, source: std::io::Error) -> Self {
        IoError::Io {
            path: path.display().to_string(),
            err: source,
        }
    }
    pub fn invalid(path: &std::path::Path, what: impl Into<String>) -> Self {
        IoError::Invalid {
            path: path.display().to_string(),
            what: what.into(),
        }
    }
}
