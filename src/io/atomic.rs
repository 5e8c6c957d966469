//! Atomic writes: a reader never sees a half-written file or folder. Files are written to a temp
//! name in the same directory and renamed; folders are filled under a temp name and renamed as a
//! whole, so a failure leaves nothing behind.

use super::IoError;
use std::io::Write;
use std::path::{Path, PathBuf};

/// A sibling temp path of `path` unique to this process and call.
fn temp_sibling(path: &Path) -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = format!(
        ".{name}.tmp-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    );
    path.with_file_name(tmp)
}

/// Write `bytes` to `path` atomically (temp file, fsync, rename).
pub fn write_file(path: &Path, bytes: &[u8]) -> Result<(), IoError> {
    let tmp = temp_sibling(path);
    let res = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    res.map_err(|e| IoError::io(path, e))
}

/// Build a folder atomically: `fill` writes into a fresh temp folder, which then replaces `dir`.
/// If `fill` fails, the temp folder is removed and `dir` is untouched.
pub fn write_dir<E: From<IoError>>(
    dir: &Path,
    fill: impl FnOnce(&Path) -> Result<(), E>,
) -> Result<(), E> {
    let tmp = temp_sibling(dir);
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|e| IoError::io(parent, e))?;
    }
    std::fs::create_dir(&tmp).map_err(|e| IoError::io(&tmp, e))?;
    let res = fill(&tmp).and_then(|()| {
        if dir.exists() {
            std::fs::remove_dir_all(dir).map_err(|e| IoError::io(dir, e))?;
        }
        std::fs::rename(&tmp, dir).map_err(|e| IoError::io(dir, e).into())
    });
    if res.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    res
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_fill_leaves_nothing_behind() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("out");
        let r: Result<(), IoError> = write_dir(&dir, |tmp| {
            write_file(&tmp.join("a.txt"), b"half")?;
            Err(IoError::invalid(tmp, "boom"))
        });
        assert!(r.is_err());
        assert_eq!(
            std::fs::read_dir(root.path()).unwrap().count(),
            0,
            "temp folder left behind"
        );
    }

    #[test]
    fn successful_fill_replaces_the_folder() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("out");
        std::fs::create_dir(&dir).unwrap();
        std::fs::write(dir.join("old.txt"), b"old").unwrap();
        write_dir::<IoError>(&dir, |tmp| write_file(&tmp.join("new.txt"), b"new")).unwrap();
        assert!(!dir.join("old.txt").exists());
        assert_eq!(std::fs::read(dir.join("new.txt")).unwrap(), b"new");
        assert_eq!(std::fs::read_dir(root.path()).unwrap().count(), 1);
    }
}
