//! SIGINT and SIGTERM while a suite runs. The handler only records the signal; the runner stops
//! taking runs, the command engine stops each launcher's process group (TERM, then KILL after the
//! grace period) and the built-in engine stops between steps, so every run in flight is written
//! as `interrupted` and nothing lockstep started is left running. The process then exits with
//! 128 + the signal (130 for Ctrl-C, 143 for SIGTERM), as a shell would report it.

use std::sync::atomic::{AtomicI32, Ordering};

static SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn record(sig: libc::c_int) {
    // Only an atomic store: async-signal-safe.
    SIGNAL.store(sig, Ordering::SeqCst);
}

/// Route SIGINT and SIGTERM to [`requested`] instead of ending the process at once.
pub fn install() {
    let handler = record as extern "C" fn(libc::c_int) as libc::sighandler_t;
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, handler);
        libc::signal(libc::SIGTERM, handler);
    }
}

/// The signal received since [`install`], if any.
pub fn requested() -> Option<i32> {
    match SIGNAL.load(Ordering::SeqCst) {
        0 => None,
        s => Some(s),
    }
}

/// The exit code a process stopped by `sig` reports (128 + the signal number).
pub fn exit_code(sig: i32) -> u8 {
    u8::try_from(128 + sig).unwrap_or(255)
}
