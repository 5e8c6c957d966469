//! Issue 2 (formats): `lockstep quantize` as a user runs it — real binary, temp folders.

use std::path::Path;
use std::process::Command;

fn lockstep() -> Command {
    Command::new(env!("CARGO_BIN_EXE_lockstep"))
}

fn write_npy_f32(path: &Path, data: &[f32], shape: &[u64]) {
    let bytes = lockstep::io::npy::to_bytes(data, shape).unwrap();
    std::fs::write(path, bytes).unwrap();
}

fn read_npy<T: npyz::Deserialize>(path: &Path) -> (Vec<u64>, Vec<T>) {
    let bytes = std::fs::read(path).unwrap();
    let f = npyz::NpyFile::new(&bytes[..]).unwrap();
    (f.shape().to_vec(), f.into_vec().unwrap())
}

fn sample(n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i as f32) * 0.7).sin() * if i % 37 == 0 { 20.0 } else { 1.0 })
        .collect()
}

#[test]
fn nvfp4_per_token_writes_every_array_and_matches_the_library() {
    let dir = tempfile::tempdir().unwrap();
    let (r, c) = (8usize, 64usize);
    let x = sample(r * c);
    let input = dir.path().join("x.npy");
    write_npy_f32(&input, &x, &[r as u64, c as u64]);
    let out = dir.path().join("q");
    let o = lockstep()
        .args([
            "quantize",
            "--format",
            "nvfp4",
            "--second-scale",
            "token",
            "--in",
        ])
        .arg(&input)
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let stdout = String::from_utf8_lossy(&o.stdout);
    for key in ["max abs error", "relative RMSE", "SQNR"] {
        assert!(stdout.contains(key), "missing {key} in {stdout}");
    }
    let fmt = lockstep::formats::QuantFormat::Nvfp4 {
        second: lockstep::formats::SecondScale::PerToken,
        shards: 1,
    };
    let q = lockstep::formats::quantize(&x, r, c, &fmt, lockstep::formats::Axis::Row).unwrap();
    let (shape, codes): (_, Vec<u8>) = read_npy(&out.join("codes.npy"));
    assert_eq!(shape, vec![r as u64, c as u64 / 2]);
    assert_eq!(codes, q.codes);
    let (shape, scales): (_, Vec<u8>) = read_npy(&out.join("scales.npy"));
    assert_eq!(shape, vec![r as u64, c as u64 / 16]);
    assert_eq!(lockstep::formats::Scales::E4m3(scales), q.scales);
    let (shape, g): (_, Vec<f32>) = read_npy(&out.join("global_scale.npy"));
    assert_eq!(shape, vec![r as u64]);
    assert_eq!(g, q.global_amax);
    let (shape, d): (_, Vec<f32>) = read_npy(&out.join("dequant.npy"));
    assert_eq!(shape, vec![r as u64, c as u64]);
    assert_eq!(d, q.dequantize());
}

#[test]
fn column_axis_mxfp8_and_fp8_block_scales() {
    let dir = tempfile::tempdir().unwrap();
    let (r, c) = (64usize, 48usize);
    let input = dir.path().join("x.npy");
    write_npy_f32(&input, &sample(r * c), &[r as u64, c as u64]);
    let out = dir.path().join("q");
    let ok = lockstep()
        .args(["quantize", "--format", "mxfp8", "--axis", "col", "--in"])
        .arg(&input)
        .arg("--out")
        .arg(&out)
        .status()
        .unwrap();
    assert!(ok.success());
    let (shape, _): (_, Vec<u8>) = read_npy(&out.join("scales.npy"));
    assert_eq!(
        shape,
        vec![c as u64, r as u64 / 32],
        "column blocks: one scale per 32 rows of each column"
    );
    let ok = lockstep()
        .args([
            "quantize",
            "--format",
            "fp8-block",
            "--tile",
            "128x128",
            "--in",
        ])
        .arg(&input)
        .arg("--out")
        .arg(&out)
        .status()
        .unwrap();
    assert!(ok.success());
    let (shape, _): (_, Vec<f32>) = read_npy(&out.join("scales.npy"));
    assert_eq!(shape, vec![1, 1]);
}

/// Bad input: one line on stderr, exit code 2, no output folder.
#[test]
fn bad_input_is_one_line_exit_2_and_leaves_no_folder() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.npy");
    write_npy_f32(&good, &sample(4 * 64), &[4, 64]);
    let odd = dir.path().join("odd.npy");
    write_npy_f32(&odd, &sample(4 * 40), &[4, 40]);
    let f64p = dir.path().join("f64.npy");
    std::fs::write(
        &f64p,
        lockstep::io::npy::to_bytes(&[1.0f64; 64], &[2, 32]).unwrap(),
    )
    .unwrap();
    let one_d = dir.path().join("oned.npy");
    write_npy_f32(&one_d, &sample(64), &[64]);
    let empty = dir.path().join("empty.npy");
    write_npy_f32(&empty, &[], &[0, 32]);
    let trunc = dir.path().join("trunc.npy");
    let b = std::fs::read(&good).unwrap();
    std::fs::write(&trunc, &b[..b.len() - 100]).unwrap();
    let junk = dir.path().join("junk.npy");
    std::fs::write(&junk, b"not numpy at all").unwrap();

    let cases: Vec<(Vec<&str>, &Path, &str)> = vec![
        (
            vec!["--format", "mxfp8"],
            &odd,
            "dimension 1 (cols = 40) is not a multiple of the MXFP8 block size 32",
        ),
        (
            vec!["--format", "nvfp4", "--shards", "3"],
            &good,
            "block size 48",
        ),
        (vec!["--format", "nvfp4"], &f64p, "float32"),
        (vec!["--format", "nvfp4"], &one_d, "expected 2"),
        (vec!["--format", "nvfp4"], &empty, "empty"),
        (vec!["--format", "nvfp4"], &trunc, "truncated"),
        (vec!["--format", "nvfp4"], &junk, "not a .npy"),
        (
            vec!["--format", "mxfp8", "--shards", "2"],
            &good,
            "--shards only applies to --format nvfp4",
        ),
        (
            vec!["--format", "bf16", "--tile", "1x128"],
            &good,
            "--tile only applies",
        ),
    ];
    for (flags, input, want) in cases {
        let out = dir.path().join("out");
        let o = lockstep()
            .arg("quantize")
            .args(&flags)
            .arg("--in")
            .arg(input)
            .arg("--out")
            .arg(&out)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{flags:?}: {err}");
        assert!(err.contains(want), "{flags:?}: wanted `{want}` in `{err}`");
        assert_eq!(
            err.trim_end().lines().count(),
            1,
            "{flags:?}: not one line: {err}"
        );
        assert!(!out.exists(), "{flags:?}: output folder left behind");
        let leftovers: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().contains(".tmp-"))
            .collect();
        assert!(leftovers.is_empty(), "{flags:?}: temp folder left behind");
    }
    // An unknown format is rejected by the flag parser, also with exit code 2.
    let o = lockstep()
        .args(["quantize", "--format", "fp6", "--in"])
        .arg(&good)
        .arg("--out")
        .arg(dir.path().join("o"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn check_passes_on_the_shipped_golden_and_fails_on_a_corrupted_copy() {
    let golden = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden");
    let o = lockstep()
        .args(["quantize", "--check"])
        .arg(&golden)
        .output()
        .unwrap();
    let s = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{s}");
    assert_eq!(s.lines().filter(|l| l.starts_with("PASS ")).count(), 83);
    assert!(s.contains("83 passed, 0 failed"));

    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(golden.join("mxfp8.json")).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["cases"][0]["blocks"][0]["te"]["codes"][3] = serde_json::Value::from(0);
    std::fs::write(dir.path().join("mxfp8.json"), v.to_string()).unwrap();
    let o = lockstep()
        .args(["quantize", "--check"])
        .arg(dir.path())
        .output()
        .unwrap();
    let s = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(1), "{s}");
    assert!(s.contains("FAIL mxfp8.json / normal_seed0 [te]"), "{s}");
}

/// Finite inputs near FLT_MAX (spec §3.1, §4.1, §5): the codes and scales are the spec's (MXFP8 TE
/// scale byte 247 with FLT_MAX at code 0x78 = 256), and the spec's f32 dequantization overflows:
/// MXFP8 TE gives 256·2^120 = inf, NVFP4's `e4m3(448)·global_amax` overflows so the whole block
/// decodes to ±inf (zero codes to 0·inf = NaN, as TE's kernel does), UE8M0 FP8 block scales like
/// MXFP8. Those elements are counted in quantized.json's overflow, left out of the error
/// statistics (which stay finite) and named in a printed warning; formats that stay in range
/// (OCP floor saturates, TE FP8 block) count none.
#[test]
fn values_near_flt_max_keep_spec_bytes_and_their_overflow_is_counted_not_averaged() {
    let dir = tempfile::tempdir().unwrap();
    let mut x = vec![0.5f32; 128];
    x[0] = f32::MAX;
    x[1] = -f32::MAX;
    x[2] = 1.0;
    x[3] = f32::MAX / 2.0;
    let input = dir.path().join("x.npy");
    write_npy_f32(&input, &x, &[1, 128]);
    // (flags, overflowed elements)
    let cases: [(&[&str], u64); 5] = [
        (&["--format", "mxfp8"], 2),
        (&["--format", "mxfp8", "--scale-rule", "ocp"], 0),
        (&["--format", "nvfp4"], 16),
        (
            &["--format", "fp8-block", "--fp8-variant", "deepgemm-ue8m0"],
            2,
        ),
        (&["--format", "fp8-block"], 0),
    ];
    for (i, (flags, overflow)) in cases.iter().enumerate() {
        let out = dir.path().join(format!("q{i}"));
        let o = lockstep()
            .arg("quantize")
            .args(*flags)
            .arg("--in")
            .arg(&input)
            .arg("--out")
            .arg(&out)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&o.stdout);
        assert!(
            o.status.success(),
            "{flags:?}: {stdout}{}",
            String::from_utf8_lossy(&o.stderr)
        );
        let meta: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("quantized.json")).unwrap())
                .unwrap();
        assert_eq!(meta["stats"]["overflow"], *overflow, "{flags:?}: {meta}");
        assert_eq!(meta["error"]["finite"], 128 - overflow, "{flags:?}");
        let (_, deq): (_, Vec<f32>) = read_npy(&out.join("dequant.npy"));
        let non_finite = deq.iter().filter(|v| !v.is_finite()).count() as u64;
        assert_eq!(non_finite, *overflow, "{flags:?}: {:?}", &deq[..4]);
        // The printed statistics are finite numbers over the finite elements.
        let stat = |key: &str| -> f64 {
            let line = stdout.lines().find(|l| l.starts_with(key)).unwrap();
            line[key.len()..]
                .split_whitespace()
                .next()
                .unwrap()
                .parse()
                .unwrap()
        };
        assert!(stat("max abs error").is_finite(), "{stdout}");
        assert!(stat("relative RMSE").is_finite(), "{stdout}");
        let warned = stdout.lines().any(|l| {
            l.starts_with("warning")
                && l.contains(&format!("{overflow} finite input(s) overflowed"))
        });
        assert_eq!(warned, *overflow > 0, "{flags:?}: {stdout}");
    }
    // The bytes are the spec's: MXFP8 TE, FLT_MAX gives scale byte 247 (§3.1) and code 0x78 (256).
    let (_, scales): (_, Vec<u8>) = read_npy(&dir.path().join("q0/scales.npy"));
    let (_, codes): (_, Vec<u8>) = read_npy(&dir.path().join("q0/codes.npy"));
    assert_eq!(scales[0], 247);
    assert_eq!((codes[0], codes[1]), (0x78, 0xF8));
    let (_, deq): (_, Vec<f32>) = read_npy(&dir.path().join("q0/dequant.npy"));
    assert_eq!((deq[0], deq[1]), (f32::INFINITY, f32::NEG_INFINITY));
    assert_eq!(deq[3], 2f32.powi(127), "FLT_MAX/2 stays finite");
    // NVFP4: global amax FLT_MAX, block scale 448 (0x7E), codes 7 and 15; the block decodes to
    // ±inf and its zero codes to NaN (TE kernel formula, as in golden `inf_in_tensor_te_ref`).
    let (_, g): (_, Vec<f32>) = read_npy(&dir.path().join("q2/global_scale.npy"));
    assert_eq!(g, vec![f32::MAX]);
    let (_, scales): (_, Vec<u8>) = read_npy(&dir.path().join("q2/scales.npy"));
    assert_eq!(scales[0], 0x7E);
    let (_, packed): (_, Vec<u8>) = read_npy(&dir.path().join("q2/codes.npy"));
    assert_eq!(packed[0], 0x7 | (0xF << 4));
    let (_, deq): (_, Vec<f32>) = read_npy(&dir.path().join("q2/dequant.npy"));
    assert_eq!((deq[0], deq[1]), (f32::INFINITY, f32::NEG_INFINITY));
    assert!(deq[2].is_nan(), "1.0 has code 0 in that block: 0·inf");
    assert!(deq[16..].iter().all(|v| v.is_finite()));
    // The TE FP8 block scale keeps FLT_MAX itself finite.
    let (_, deq): (_, Vec<f32>) = read_npy(&dir.path().join("q4/dequant.npy"));
    assert_eq!(deq[0], f32::MAX);
}
