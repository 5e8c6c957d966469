//! Issue 19: `lockstep ... | head` panicked with "failed printing to stdout: Broken pipe" (exit
//! 101). A reader that stops reading is not an error: the command ends with exit 0 and says nothing.

use std::process::{Command, Stdio};

#[test]
fn a_closed_stdout_ends_the_command_quietly() {
    let dir = tempfile::tempdir().unwrap();
    let suite = dir.path().join("s.toml");
    // 4,000 runs print ~300 KB, far more than a pipe buffers, so the write after the reader has
    // gone is certain to fail.
    let seeds: Vec<String> = (0..2000).map(|s| s.to_string()).collect();
    std::fs::write(
        &suite,
        format!(
            "name = \"p\"\nseeds = [{}]\n[workload]\nsteps = 3\n[[configs]]\nname = \"bf16\"\nrecipe = \"bf16\"\n[[configs]]\nname = \"nv\"\nrecipe = \"nvfp4-dq\"\n",
            seeds.join(", ")
        ),
    )
    .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(["suite", "show"])
        .arg(&suite)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take()); // the reader goes away, like `head` after its lines
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(err.is_empty(), "nothing on stderr: {err}");
}
