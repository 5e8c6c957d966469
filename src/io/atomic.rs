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

/// Write several folders under `root` all or nothing: each is filled in a staging folder inside
/// `root` (`fill(i, folder)`), and only when every one is complete are they moved into place,
/// replacing folders of the same name. Any error leaves `root` as it was (a failed move is rolled
/// back), so a bad entry or a full disk never leaves half an import visible.
pub fn write_dirs<E: From<IoError>>(
    root: &Path,
    names: &[String],
    mut fill: impl FnMut(usize, &Path) -> Result<(), E>,
) -> Result<(), E> {
    std::fs::create_dir_all(root).map_err(|e| IoError::io(root, e))?;
    let staging = temp_sibling(&root.join("staging"));
    std::fs::create_dir(&staging).map_err(|e| IoError::io(&staging, e))?;
    let res = (|| -> Result<(), E> {
        for (i, name) in names.iter().enumerate() {
            let dir = staging.join(name);
            std::fs::create_dir(&dir).map_err(|e| IoError::io(&dir, e))?;
            fill(i, &dir)?;
        }
        publish(root, &staging, names).map_err(E::from)
    })();
    let _ = std::fs::remove_dir_all(&staging);
    res
}

/// Move each staged folder into `root`, keeping replaced folders in `staging` until all moved.
fn publish(root: &Path, staging: &Path, names: &[String]) -> Result<(), IoError> {
    let old = |n: &str| staging.join(format!(".old-{n}"));
    let mut done: Vec<(&String, bool)> = Vec::new();
    let step = |name: &String| -> std::io::Result<bool> {
        let target = root.join(name);
        let replaced = target.exists();
        if replaced {
            std::fs::rename(&target, old(name))?;
        }
        if let Err(e) = std::fs::rename(staging.join(name), &target) {
            if replaced {
                let _ = std::fs::rename(old(name), &target);
            }
            return Err(e);
        }
        Ok(replaced)
    };
    for name in names {
        match step(name) {
            Ok(replaced) => done.push((name, replaced)),
            Err(e) => {
                for (n, replaced) in done.into_iter().rev() {
                    let target = root.join(n);
                    let _ = std::fs::rename(&target, staging.join(n));
                    if replaced {
                        let _ = std::fs::rename(old(n), &target);
                    }
                }
                return Err(IoError::io(&root.join(name), e));
            }
        }
    }
    Ok(())
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
    fn several_folders_land_all_or_nothing() {
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir(root.path().join("b")).unwrap();
        std::fs::write(root.path().join("b/old.txt"), b"old").unwrap();
        let names: Vec<String> = ["a", "b", "c"].map(String::from).to_vec();
        // The third fails: nothing new appears and `b` keeps its old content.
        let r: Result<(), IoError> = write_dirs(root.path(), &names, |i, d| {
            write_file(&d.join("x.txt"), b"new")?;
            if i == 2 {
                Err(IoError::invalid(d, "boom"))
            } else {
                Ok(())
            }
        });
        assert!(r.is_err());
        let mut left: Vec<String> = std::fs::read_dir(root.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, ["b"], "no staging folder or partial import left");
        assert!(root.path().join("b/old.txt").exists());
        // All succeed: every folder is there, `b` replaced.
        write_dirs::<IoError>(root.path(), &names, |_, d| {
            write_file(&d.join("x.txt"), b"new")
        })
        .unwrap();
        for n in &names {
            assert_eq!(
                std::fs::read(root.path().join(n).join("x.txt")).unwrap(),
                b"new"
            );
        }
        assert!(!root.path().join("b/old.txt").exists());
        assert_eq!(std::fs::read_dir(root.path()).unwrap().count(), 3);
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
