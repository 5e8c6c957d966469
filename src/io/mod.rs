//! File plumbing shared by the commands: `.npy` arrays, atomic writes and locks between processes. Every error names the file.

pub mod atomic;
pub mod lock;
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

/// 1-based `(line, column)` of byte offset `pos` in `text` (column in characters).
pub fn line_col(text: &str, pos: usize) -> (usize, usize) {
    let mut pos = pos.min(text.len());
    while !text.is_char_boundary(pos) {
        pos -= 1;
    }
    let before = &text[..pos];
    let line = before.matches('\n').count() + 1;
    let col = before.rsplit('\n').next().unwrap_or("").chars().count() + 1;
    (line, col)
}

/// A message on one line: its non-empty lines, trimmed, joined with `; ` (parsers such as `toml`
/// add multi-line snippets that break one-error-per-line logs and grep).
pub fn one_line(msg: &str) -> String {
    msg.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("; ")
}

/// A TOML parse error as `(PATH:LINE:COL, what)`, without the snippet `toml` prints.
pub fn toml_error(path: &std::path::Path, text: &str, e: &toml::de::Error) -> (String, String) {
    let at = match e.span() {
        Some(span) => {
            let (l, c) = line_col(text, span.start);
            format!("{}:{l}:{c}", path.display())
        }
        None => path.display().to_string(),
    };
    (at, one_line(e.message()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn toml_errors_become_one_line_with_file_line_and_column() {
        let text = "a = 1\nb = \"x\"\nc = [1,\n";
        let e = toml::from_str::<toml::Table>(text).unwrap_err();
        assert!(
            e.to_string().lines().count() > 1,
            "toml's own message is multi-line"
        );
        let (at, what) = toml_error(std::path::Path::new("s.toml"), text, &e);
        assert!(at.starts_with("s.toml:"), "{at}");
        assert!(!what.contains('\n'));
        assert_eq!(line_col("ab\ncd", 4), (2, 2));
        assert_eq!(line_col("é", 1), (1, 1));
        assert_eq!(one_line("x\n  |\n y \n"), "x; |; y");
    }
}
