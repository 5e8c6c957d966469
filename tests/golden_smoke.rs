//! The smoke suite's checked-in golden baseline (`baselines/smoke/`), matched exactly: any change
//! to what the CPU engine computes (model, quantizer, optimizer, rollout, task) shows here as a
//! diff, so a refactor that claims to change nothing is held to it. A deliberate change of the
//! numbers re-saves the baseline in the same commit:
//! `lockstep run suites/smoke.toml --store S && lockstep baseline save --suite suites/smoke.toml --store S`.

use std::process::Command;

/// The baseline was saved on an x86-64 machine whose GEMM (`matrixmultiply`) picked its AVX2+FMA
/// kernel at run time; another kernel rounds differently, so elsewhere the comparison says nothing.
fn same_gemm_kernel_as_the_baseline() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[test]
fn the_smoke_suite_reproduces_its_golden_baseline_bit_for_bit() {
    if !same_gemm_kernel_as_the_baseline() {
        eprintln!("skipping: the golden baseline is for x86-64 with AVX2 and FMA");
        return;
    }
    let root = env!("CARGO_MANIFEST_DIR");
    let store = tempfile::tempdir().unwrap();
    let suite = format!("{root}/suites/smoke.toml");
    let run = Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(["run", &suite, "--jobs", "2", "--store"])
        .arg(store.path())
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "smoke run failed: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    let diff = Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(["baseline", "diff", "--suite", &suite, "--baselines"])
        .arg(format!("{root}/baselines"))
        .arg("--store")
        .arg(store.path())
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&diff.stdout);
    assert!(diff.status.success(), "golden baseline differs:\n{out}");
    // Exact, not within a tolerance: every row of the table says so.
    let rows: Vec<&str> = out
        .lines()
        .skip(1)
        .filter(|l| !l.starts_with("golden"))
        .collect();
    assert_eq!(rows.len(), 30, "6 configurations x 5 metrics:\n{out}");
    assert!(
        rows.iter().all(|l| l.trim_end().ends_with("exact")),
        "{out}"
    );
}
