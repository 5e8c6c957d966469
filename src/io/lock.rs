//! Locks between processes: a file holding its owner's pid, taken over when that process is gone.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// An exclusive lock between processes (a run, a warm start being trained); released on drop.
/// The lock file holds its owner as `PID START`,
/// START being the process start time (field 22 of `/proc/PID/stat`, clock ticks since boot), so
/// a lock left by a killed process is taken over even when its pid now belongs to another live
/// process. A lock holding only a pid (or on a system without `/proc`) is trusted while that pid
/// exists.
pub struct PidLock(PathBuf);

impl PidLock {
    /// The lock at `path`, or `None` while a live process holds it.
    pub fn acquire(path: &Path) -> Option<PidLock> {
        // The lock appears with its owner already in it: the owner is written to a private file
        // that is then hard-linked into place (atomic, fails if the lock exists). Creating the lock
        // and then writing the pid let another process read an empty lock in between, take it for
        // stale, delete it and run the same run a second time.
        let me = std::process::id();
        let mine = path.with_extension(format!("lock.{me}"));
        let owner = match process_start(me) {
            Some(start) => format!("{me} {start}"),
            None => me.to_string(),
        };
        if std::fs::write(&mine, owner).is_err() {
            return None;
        }
        let mut taken = None;
        for _ in 0..2 {
            if std::fs::hard_link(&mine, path).is_ok() {
                taken = Some(PidLock(path.to_path_buf()));
                break;
            }
            let held = std::fs::read_to_string(path)
                .ok()
                .is_some_and(|s| owner_alive(&s));
            if held {
                break;
            }
            let _ = std::fs::remove_file(path); // stale: its owner is gone
        }
        let _ = std::fs::remove_file(&mine);
        taken
    }

    /// The lock at `path`, waiting (polling every `poll`) while a live process holds it; an
    /// error where the lock cannot be written at all (a read-only folder).
    pub fn wait(path: &Path, poll: Duration) -> std::io::Result<PidLock> {
        loop {
            if let Some(l) = PidLock::acquire(path) {
                return Ok(l);
            }
            if !path.exists() {
                // Not held, yet not taken: the folder refuses the lock file.
                std::fs::write(path.with_extension("lock-probe"), b"")?;
                let _ = std::fs::remove_file(path.with_extension("lock-probe"));
            }
            std::thread::sleep(poll);
        }
    }
}

/// Whether the process a lock names (`PID` or `PID START`) is still the one that wrote it.
fn owner_alive(lock: &str) -> bool {
    let mut it = lock.split_whitespace();
    let Some(pid) = it.next().and_then(|p| p.parse::<u32>().ok()) else {
        return false;
    };
    if !Path::new(&format!("/proc/{pid}")).exists() {
        return false;
    }
    match (
        it.next().and_then(|s| s.parse::<u64>().ok()),
        process_start(pid),
    ) {
        (Some(recorded), Some(now)) => recorded == now,
        _ => true,
    }
}

/// Start time of process `pid` in clock ticks since boot: field 22 of `/proc/PID/stat`, counted
/// after the `)` that closes the command name (which may itself hold spaces and parentheses).
fn process_start(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = &stat[stat.rfind(')')? + 1..];
    after.split_whitespace().nth(19)?.parse().ok()
}

impl Drop for PidLock {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_locks_are_taken_over_and_live_ones_respected() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("r.lock");
        std::fs::write(&p, "999999999").unwrap(); // no such process
        let l = PidLock::acquire(&p).expect("stale lock taken over");
        assert!(
            PidLock::acquire(&p).is_none(),
            "our own live lock must block a second taker"
        );
        drop(l);
        assert!(!p.exists());
    }

    #[test]
    fn a_lock_whose_pid_was_reused_by_another_process_is_taken_over() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("r.lock");
        let me = std::process::id();
        let start = process_start(me).expect("/proc is mounted on Linux");
        // Our pid is alive, but the lock's writer started at another time: a reused pid.
        std::fs::write(&p, format!("{me} {}", start + 1)).unwrap();
        assert!(!owner_alive(&std::fs::read_to_string(&p).unwrap()));
        let l = PidLock::acquire(&p).expect("lock of a dead owner taken over");
        let held = std::fs::read_to_string(&p).unwrap();
        assert_eq!(held, format!("{me} {start}"));
        assert!(owner_alive(&held));
        drop(l);
        assert!(owner_alive(&me.to_string()), "a pid-only lock is trusted");
        assert!(!owner_alive("garbage"));
    }

    #[test]
    fn a_waiter_gets_the_lock_once_its_holder_lets_go() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("w.lock");
        let held = PidLock::acquire(&p).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let waiter = {
            let p = p.clone();
            std::thread::spawn(move || {
                let l = PidLock::wait(&p, Duration::from_millis(5)).unwrap();
                tx.send(()).unwrap();
                drop(l);
            })
        };
        assert!(
            rx.recv_timeout(Duration::from_millis(100)).is_err(),
            "the waiter must not get a held lock"
        );
        drop(held);
        rx.recv_timeout(Duration::from_secs(5))
            .expect("the waiter gets the released lock");
        waiter.join().unwrap();
    }
}
