//! Atomic writes: a reader never sees a half-written file or folder. Files are written to a temp
//! name in the same directory and renamed; folders are filled under a temp name and renamed as a
//! whole, so a failure leaves nothing behind. A folder is only replaced when the caller says what
//! it may replace ([`Replace`]): `.`, `..`, `/`, a folder holding a protected path and a non-empty
//! folder that is not a previous output are refused before anything is written.

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
/// If `fill` fails, the temp folder is removed and `dir` is untouched. `dir` must end in a plain
/// name (not `.`, `..` or `/`); an existing `dir` is replaced whatever it holds, so callers whose
/// `dir` comes from the user go through [`write_dir_checked`].
pub fn write_dir<E: From<IoError>>(
    dir: &Path,
    fill: impl FnOnce(&Path) -> Result<(), E>,
) -> Result<(), E> {
    if !has_plain_name(dir) {
        return Err(IoError::invalid(
            dir,
            "is not a folder name that can be replaced (., .., /); name a new folder",
        )
        .into());
    }
    let tmp = temp_sibling(dir);
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|e| IoError::io(parent, e))?;
    }
    std::fs::create_dir(&tmp).map_err(|e| IoError::io(&tmp, e))?;
    let res = fill(&tmp).and_then(|()| publish(&tmp, dir).map_err(E::from));
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
        publish_all(root, &staging, names).map_err(E::from)
    })();
    let _ = std::fs::remove_dir_all(&staging);
    res
}

/// Move each staged folder into `root`, keeping replaced folders in `staging` until all moved.
fn publish_all(root: &Path, staging: &Path, names: &[String]) -> Result<(), IoError> {
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

/// Move the filled `tmp` to `dir`: an existing `dir` is first renamed aside (so a failed rename
/// leaves it in place), then removed once the new folder is visible.
fn publish(tmp: &Path, dir: &Path) -> Result<(), IoError> {
    let meta = std::fs::symlink_metadata(dir);
    if meta.is_err() {
        return std::fs::rename(tmp, dir).map_err(|e| IoError::io(dir, e));
    }
    let old = temp_sibling(dir);
    std::fs::rename(dir, &old).map_err(|e| IoError::io(dir, e))?;
    if let Err(e) = std::fs::rename(tmp, dir) {
        let _ = std::fs::rename(&old, dir);
        return Err(IoError::io(dir, e));
    }
    std::fs::remove_dir_all(&old).map_err(|e| IoError::io(&old, e))
}

/// Whether the last component of `p` is a plain name: `.`, `..`, `/` and `x/..` are not.
fn has_plain_name(p: &Path) -> bool {
    matches!(
        p.components().next_back(),
        Some(std::path::Component::Normal(_))
    )
}

/// What an output folder given by the user may replace.
pub struct Replace<'a> {
    /// Paths (inputs) that must survive: a folder holding one of them is refused.
    pub protect: &'a [&'a Path],
    /// Whether an existing non-empty folder holds exactly a previous output of the same command
    /// (`Err` says what is foreign in it).
    pub previous_output: &'a dyn Fn(&Path) -> Result<(), String>,
}

/// Check that `dir` may be (re)created under `rule`: it is new, empty, or a previous output, is a
/// real folder (not a symlink or a file), and holds none of the protected paths.
pub fn check_replaceable(dir: &Path, rule: &Replace<'_>) -> Result<(), IoError> {
    if !has_plain_name(dir) {
        return Err(IoError::invalid(
            dir,
            "cannot be an output folder (., .., /); name a new folder, e.g. --out quantized",
        ));
    }
    let meta = match std::fs::symlink_metadata(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(IoError::io(dir, e)),
        Ok(m) => m,
    };
    if meta.file_type().is_symlink() {
        return Err(IoError::invalid(
            dir,
            "is a symbolic link; name a new folder (the link and its target are left alone)",
        ));
    }
    if !meta.is_dir() {
        return Err(IoError::invalid(
            dir,
            "exists and is not a folder; name a new folder",
        ));
    }
    let canon = dir.canonicalize().map_err(|e| IoError::io(dir, e))?;
    for p in rule.protect {
        if let Ok(pc) = p.canonicalize()
            && pc.starts_with(&canon)
        {
            return Err(IoError::invalid(
                dir,
                format!(
                    "holds the input {}; name a new folder for the output",
                    p.display()
                ),
            ));
        }
    }
    let mut entries = std::fs::read_dir(dir).map_err(|e| IoError::io(dir, e))?;
    if entries.next().is_none() {
        return Ok(());
    }
    (rule.previous_output)(dir).map_err(|why| {
        IoError::invalid(
            dir,
            format!("is not empty and not a previous output ({why}); name a new folder or remove it yourself"),
        )
    })
}

/// [`write_dir`] for a folder the user named: refused (nothing touched) unless
/// [`check_replaceable`] allows it.
pub fn write_dir_checked<E: From<IoError>>(
    dir: &Path,
    rule: &Replace<'_>,
    fill: impl FnOnce(&Path) -> Result<(), E>,
) -> Result<(), E> {
    check_replaceable(dir, rule)?;
    write_dir(dir, fill)
}

/// A [`Replace::previous_output`] check: `dir` holds only regular files named in `allowed`,
/// including `marker`.
pub fn only_files(dir: &Path, allowed: &[&str], marker: &str) -> Result<(), String> {
    let mut has_marker = false;
    for e in std::fs::read_dir(dir).map_err(|e| e.to_string())? {
        let e = e.map_err(|e| e.to_string())?;
        let name = e.file_name().to_string_lossy().into_owned();
        let ft = e.file_type().map_err(|e| e.to_string())?;
        if !ft.is_file() || !allowed.contains(&name.as_str()) {
            return Err(format!("`{name}` was not written by this command"));
        }
        has_marker |= name == marker;
    }
    if has_marker {
        Ok(())
    } else {
        Err(format!("no {marker}"))
    }
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

    fn quantize_like(dir: &Path) -> Result<(), String> {
        only_files(dir, &["a.npy", "meta.json"], "meta.json")
    }

    fn rule<'a>(protect: &'a [&'a Path]) -> Replace<'a> {
        Replace {
            protect,
            previous_output: &quantize_like,
        }
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn dot_dotdot_and_root_are_refused_before_anything_is_touched() {
        let root = tempfile::tempdir().unwrap();
        std::fs::write(root.path().join("keep.txt"), b"x").unwrap();
        for d in [
            root.path().join("."),
            root.path().join(".."),
            root.path().join("sub/.."),
            PathBuf::from("/"),
            PathBuf::from("."),
        ] {
            let e = check_replaceable(&d, &rule(&[])).unwrap_err().to_string();
            assert!(e.contains("name a new folder"), "{e}");
            assert!(write_dir::<IoError>(&d, |_| Ok(())).is_err());
        }
        assert_eq!(names(root.path()), ["keep.txt"]);
    }

    #[test]
    fn a_folder_holding_the_input_or_foreign_files_is_refused() {
        let root = tempfile::tempdir().unwrap();
        let data = root.path().join("data");
        std::fs::create_dir_all(data.join("deep")).unwrap();
        let input = data.join("deep/x.npy");
        std::fs::write(&input, b"input").unwrap();
        for d in [data.clone(), data.join("deep"), root.path().to_path_buf()] {
            let e = check_replaceable(&d, &rule(&[&input]))
                .unwrap_err()
                .to_string();
            assert!(e.contains("holds the input"), "{e}");
        }
        let foreign = root.path().join("foreign");
        std::fs::create_dir(&foreign).unwrap();
        std::fs::write(foreign.join("a.npy"), b"mine").unwrap();
        std::fs::write(foreign.join("notes.txt"), b"mine").unwrap();
        let e = write_dir_checked::<IoError>(&foreign, &rule(&[&input]), |_| Ok(()))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("notes.txt") && e.contains("not a previous output"),
            "{e}"
        );
        assert_eq!(names(&foreign), ["a.npy", "notes.txt"]);
        let e = check_replaceable(&input, &rule(&[]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a folder"), "{e}");
        assert_eq!(std::fs::read(&input).unwrap(), b"input");
    }

    #[test]
    fn empty_folders_and_previous_outputs_are_replaced() {
        let root = tempfile::tempdir().unwrap();
        let out = root.path().join("out");
        std::fs::create_dir(&out).unwrap();
        write_dir_checked::<IoError>(&out, &rule(&[]), |t| {
            write_file(&t.join("a.npy"), b"1")?;
            write_file(&t.join("meta.json"), b"{}")
        })
        .unwrap();
        write_dir_checked::<IoError>(&out, &rule(&[]), |t| write_file(&t.join("meta.json"), b"2"))
            .unwrap();
        assert_eq!(names(&out), ["meta.json"]);
        assert_eq!(names(root.path()), ["out"], "nothing left aside");
    }

    #[cfg(unix)]
    #[test]
    fn a_symlinked_output_is_refused() {
        let root = tempfile::tempdir().unwrap();
        let target = root.path().join("target");
        std::fs::create_dir(&target).unwrap();
        let link = root.path().join("link");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let e = check_replaceable(&link, &rule(&[]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("symbolic link"), "{e}");
    }
}
