//! Issue 19: `lockstep quantize --out` deleted `.`, `..` and the folder holding the input. Each case
//! runs the real binary inside a temp folder and checks that nothing there was touched.

use std::path::Path;
use std::process::{Command, Output};

fn write_input(path: &Path, data: &[f32], rows: u64, cols: u64) {
    let bytes = lockstep::io::npy::to_bytes(data, &[rows, cols]).unwrap();
    std::fs::write(path, bytes).unwrap();
}

fn quantize(cwd: &Path, input: &Path, out: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .current_dir(cwd)
        .args(["quantize", "--format", "mxfp8", "--in"])
        .arg(input)
        .arg("--out")
        .arg(out)
        .output()
        .unwrap()
}

/// Every file under `dir` with its contents, sorted.
fn snapshot(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push((p.display().to_string(), std::fs::read(&p).unwrap()));
            }
        }
    }
    out.sort();
    out
}

fn assert_refused(o: &Output, want: &str) {
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
    assert!(err.contains(want), "expected `{want}` in: {err}");
}

#[test]
fn out_dot_dotdot_the_input_folder_and_its_ancestors_are_refused_untouched() {
    let root = tempfile::tempdir().unwrap();
    let work = root.path().join("work");
    let data = work.join("data");
    std::fs::create_dir_all(&data).unwrap();
    std::fs::write(root.path().join("sibling.txt"), b"parent's").unwrap();
    std::fs::write(work.join("notes.txt"), b"mine").unwrap();
    let input = data.join("x.npy");
    write_input(&input, &vec![1.0; 64], 2, 32);
    let before = snapshot(root.path());
    for (out, want) in [
        (".", "cannot be an output folder"),
        ("..", "cannot be an output folder"),
        ("data/..", "cannot be an output folder"),
        ("data", "holds the input"),
        ("data/", "holds the input"),
        ("../work", "holds the input"),
        ("data/x.npy", "not a folder"),
    ] {
        let o = quantize(&work, Path::new("data/x.npy"), Path::new(out));
        assert_refused(&o, want);
        assert_eq!(snapshot(root.path()), before, "--out {out} touched files");
    }
    let o = quantize(&work, &input, root.path());
    assert_refused(&o, "holds the input");
    assert_eq!(snapshot(root.path()), before);
}

#[test]
fn a_foreign_folder_is_refused_and_a_previous_output_replaced() {
    let root = tempfile::tempdir().unwrap();
    let input = root.path().join("x.npy");
    write_input(&input, &vec![0.5; 64], 2, 32);
    let foreign = root.path().join("foreign");
    std::fs::create_dir(&foreign).unwrap();
    std::fs::write(foreign.join("thesis.tex"), b"years of work").unwrap();
    let before = snapshot(root.path());
    assert_refused(
        &quantize(root.path(), &input, &foreign),
        "not a previous output",
    );
    assert_eq!(snapshot(root.path()), before);

    let out = root.path().join("q");
    let o = quantize(root.path(), &input, &out);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = quantize(root.path(), &input, &out);
    assert!(o.status.success(), "rerun over a previous output: {o:?}");
    std::fs::write(out.join("extra.txt"), b"user's").unwrap();
    assert_refused(&quantize(root.path(), &input, &out), "extra.txt");
    assert_eq!(std::fs::read(out.join("extra.txt")).unwrap(), b"user's");
}

#[test]
fn nan_inf_and_overflow_are_counted_not_reported_as_zero_error() {
    let root = tempfile::tempdir().unwrap();
    let input = root.path().join("x.npy");
    let mut x = vec![0.25f32; 64];
    x[0] = f32::NAN;
    x[1] = f32::INFINITY;
    x[32] = f32::MAX;
    write_input(&input, &x, 2, 32);
    let out = root.path().join("q");
    let o = quantize(root.path(), &input, &out);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains("1 NaN, 1 inf in the input"), "{stdout}");
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("quantized.json")).unwrap())
            .unwrap();
    let deq: Vec<f32> = {
        let b = std::fs::read(out.join("dequant.npy")).unwrap();
        npyz::NpyFile::new(&b[..]).unwrap().into_vec().unwrap()
    };
    let overflowed = meta["stats"]["overflow"].as_u64().unwrap();
    assert_eq!(meta["stats"]["nan"], 1);
    assert_eq!(meta["stats"]["inf"], 1);
    // FLT_MAX either survives as a finite value or is counted as overflow, never silently inf.
    assert_eq!(overflowed, u64::from(!deq[32].is_finite()));
    assert!(
        meta["error"]["max_abs_error"].as_f64().unwrap().is_finite(),
        "{meta}"
    );
}
