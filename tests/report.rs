//! Issue 6: the report folder (one self-contained page, a PNG per figure, written atomically), HTML
//! escaping of hostile names, sweep figures, and the `lockstep report` command.

use base64::Engine;
use lockstep::report::fixture::{self, Fixture, Shape};
use lockstep::report::{ReportInput, write_report};
use std::path::{Path, PathBuf};

fn report(f: &Fixture, out: &Path) -> PathBuf {
    let input = ReportInput {
        spec: &f.spec,
        suite_dir: Path::new("runs/synthetic"),
        comparison: &f.comparison,
        runs: &f.runs,
    };
    write_report(&input, out).expect("report written")
}

/// Width and height from a PNG's IHDR chunk.
fn png_size(bytes: &[u8]) -> (u32, u32) {
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "not a PNG");
    let be = |b: &[u8]| u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
    (be(&bytes[16..20]), be(&bytes[20..24]))
}

fn pngs(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "png"))
        .collect();
    v.sort();
    v
}

#[test]
fn every_figure_is_inline_and_beside_the_page_and_the_folder_is_complete() {
    let tmp = tempfile::tempdir().unwrap();
    let f = fixture::synthetic(&Shape::small());
    let index = report(&f, tmp.path());
    let dir = index.parent().unwrap();
    assert_eq!(dir.parent().unwrap(), tmp.path().join("synthetic"));
    let html = std::fs::read_to_string(&index).unwrap();
    let files = pngs(dir);
    let names: Vec<String> = files
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    for want in [
        "reward.png",
        "eval-accuracy.png",
        "mismatch.png",
        "kl-reference.png",
        "timings.png",
    ] {
        assert!(
            names.contains(&want.to_string()),
            "{want} missing: {names:?}"
        );
    }
    let heatmaps = names
        .iter()
        .filter(|n| n.starts_with("grad-heatmap-"))
        .count();
    assert_eq!(heatmaps, 4, "one heatmap per config: {names:?}");
    assert_eq!(
        html.matches("<img ").count(),
        files.len(),
        "one <img> per PNG"
    );
    for p in &files {
        let bytes = std::fs::read(p).unwrap();
        let (w, h) = png_size(&bytes);
        assert_eq!(w, 1200, "{}", p.display());
        assert!(h > 200, "{}", p.display());
        let b64 = base64::engine::general_purpose::STANDARD.encode(&bytes);
        let at = html
            .find(&b64)
            .unwrap_or_else(|| panic!("{} not inlined", p.display()));
        // The <img> carrying it states the PNG's real size.
        let tag_start = html[..at].rfind("<img ").unwrap();
        let tag = &html[tag_start..at];
        assert!(
            tag.contains(&format!("width=\"{w}\" height=\"{h}\"")),
            "{tag}"
        );
    }
    // Self-contained: no external resource, no script, a CSP that forbids both.
    assert!(!html.contains("http://") && !html.contains("https://"));
    assert!(!html.to_lowercase().contains("<script"));
    assert!(html.contains("default-src 'none'; img-src data:"));
    for section in [
        "id=\"summary\"",
        "id=\"verdicts\"",
        "id=\"checks\"",
        "id=\"spikes\"",
        "id=\"contract\"",
        "id=\"method\"",
        "id=\"metadata\"",
    ] {
        assert!(html.contains(section), "{section} missing");
    }
    assert!(html.contains("3/3 low-precision configs equivalent to bf16 reward within 0.05."));
    assert!(
        html.contains("(emulated)") || html.contains("emulated:"),
        "timings not labelled emulated"
    );
    // Every spike is a row of the spike table.
    assert_eq!(f.comparison.spikes.len(), 3);
    let spike_rows = html
        .split("id=\"spikes\"")
        .nth(1)
        .unwrap()
        .split("</table>")
        .next()
        .unwrap()
        .matches("<tr><td>")
        .count();
    assert_eq!(spike_rows, 3);
    // Atomic: nothing but the report folder is left in the suite's report root.
    let left: Vec<_> = std::fs::read_dir(tmp.path().join("synthetic"))
        .unwrap()
        .collect();
    assert_eq!(left.len(), 1, "temp folders left behind");
    // A second report in the same second does not replace the first.
    let again = report(&f, tmp.path());
    assert_ne!(again, index);
    assert!(index.is_file() && again.is_file());
}

#[test]
fn hostile_names_from_suites_configs_and_runs_are_escaped() {
    let tmp = tempfile::tempdir().unwrap();
    let evil = "<script>alert(1)</script>";
    let quotes = "q\"uo'te & amp";
    let mut shape = Shape::small();
    shape.configs = vec!["bf16".into(), evil.into(), quotes.into(), "nvfp4-hp".into()];
    let mut f = fixture::synthetic(&shape);
    f.spec.description = "<img src=x onerror=alert(2)>".into();
    for r in &mut f.runs {
        r.manifest.host = "<iframe src=\"https://evil.example\"></iframe>".into();
        r.manifest.error = Some("</td></tr></table><script>alert(3)</script>".into());
    }
    for s in &mut f.comparison.spikes {
        s.site = "mlp.<b>experts</b>".into();
    }
    for c in &mut f.comparison.checks {
        c.message = "'\"><script>alert(4)</script>".into();
    }
    let index = report(&f, tmp.path());
    let html = std::fs::read_to_string(&index).unwrap();
    let lower = html.to_lowercase();
    for bad in ["<script", "<iframe", "<img src=x", "<b>experts"] {
        assert!(!lower.contains(bad), "unescaped `{bad}` in the page");
    }
    assert!(html.contains("&lt;script&gt;alert(1)&lt;/script&gt;"));
    assert!(html.contains("q&quot;uo&#39;te &amp; amp"));
    assert!(html.contains("&lt;img src=x onerror=alert(2)&gt;"));
    assert!(html.contains("&lt;iframe src=&quot;https://evil.example&quot;&gt;"));
    // Only the report's own images, and their file names are plain ASCII.
    let files = pngs(index.parent().unwrap());
    assert_eq!(html.matches("<img ").count(), files.len());
    for p in &files {
        let n = p.file_name().unwrap().to_string_lossy().into_owned();
        assert!(
            n.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.'),
            "{n}"
        );
    }
}

#[test]
fn ablation_suites_get_a_sweep_figure_per_axis() {
    let tmp = tempfile::tempdir().unwrap();
    let f = fixture::synthetic(&Shape::ablation());
    let index = report(&f, tmp.path());
    let names: Vec<String> = pngs(index.parent().unwrap())
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert!(
        names.contains(&"sweep-00-bf16-last.png".to_string()),
        "{names:?}"
    );
    let html = std::fs::read_to_string(&index).unwrap();
    assert!(html.contains("Sweep over bf16_last"));
}

/// RGB pixels of a PNG.
fn pixels(path: &Path) -> Vec<[u8; 3]> {
    let dec = png::Decoder::new(std::io::Cursor::new(std::fs::read(path).unwrap()));
    let mut r = dec.read_info().unwrap();
    let mut buf = vec![0; r.output_buffer_size()];
    let info = r.next_frame(&mut buf).unwrap();
    assert_eq!(info.color_type, png::ColorType::Rgb);
    buf[..info.buffer_size()]
        .chunks(3)
        .map(|c| [c[0], c[1], c[2]])
        .collect()
}

#[test]
fn each_config_has_its_colour_in_every_figure_and_spikes_are_ringed() {
    let tmp = tempfile::tempdir().unwrap();
    let f = fixture::synthetic(&Shape::small());
    let index = report(&f, tmp.path());
    let dir = index.parent().unwrap();
    let input = ReportInput {
        spec: &f.spec,
        suite_dir: Path::new("runs/synthetic"),
        comparison: &f.comparison,
        runs: &f.runs,
    };
    let ctx = lockstep::report::figures::Ctx::new(&input);
    let html = std::fs::read_to_string(&index).unwrap();
    for file in [
        "reward.png",
        "mismatch.png",
        "kl-reference.png",
        "timings.png",
    ] {
        let px = pixels(&dir.join(file));
        for c in &ctx.order {
            let (r, g, b) = ctx.palette.rgb(c);
            let n = px.iter().filter(|p| **p == [r, g, b]).count();
            assert!(n > 100, "{c} drawn in {n} pixels of its colour in {file}");
        }
    }
    for c in &ctx.order {
        assert!(
            html.contains(&format!("background:{}", ctx.palette.hex(c))),
            "swatch of {c}"
        );
    }
    // Spike rings (magenta) only on the heatmap of the config with spikes.
    for (i, c) in ctx.order.iter().enumerate() {
        let file = format!("grad-heatmap-{}.png", lockstep::report::figures::slug(i, c));
        let rings = pixels(&dir.join(&file))
            .iter()
            .filter(|p| **p == [255, 0, 255])
            .count();
        let spikes = f
            .comparison
            .spikes
            .iter()
            .filter(|s| &s.config == c)
            .count();
        assert_eq!(
            rings > 0,
            spikes > 0,
            "{file}: {rings} ring pixels, {spikes} spikes"
        );
    }
}

fn write_suite(dir: &Path) -> PathBuf {
    let p = dir.join("synthetic.toml");
    std::fs::write(
        &p,
        "name = \"synthetic\"\nseeds = [0, 1, 2]\n[workload]\nmodel = \"small\"\nsteps = 30\n\
         [[configs]]\nname = \"bf16\"\nrecipe = \"bf16\"\n[[configs]]\nname = \"mxfp8\"\nrecipe = \"mxfp8\"\n",
    )
    .unwrap();
    p
}

#[test]
fn report_command_compares_the_store_and_explains_a_missing_one() {
    let tmp = tempfile::tempdir().unwrap();
    let suite = write_suite(tmp.path());
    let f = fixture::synthetic(&Shape::small());
    let store = tmp.path().join("store");
    let run = || {
        std::process::Command::new(env!("CARGO_BIN_EXE_lockstep"))
            .args(["report", "--suite"])
            .arg(&suite)
            .arg("--store")
            .arg(&store)
            .arg("--out")
            .arg(tmp.path().join("reports"))
            .output()
            .unwrap()
    };
    let out = run();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("lockstep run"), "{err}");
    f.write_store(&store.join("synthetic")).unwrap();
    // The fixture's runs are not this suite's planned runs, so draw its saved comparison.
    let saved = tmp.path().join("compare.json");
    std::fs::write(&saved, serde_json::to_string(&f.comparison).unwrap()).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(["report", "--suite"])
        .arg(&suite)
        .arg("--store")
        .arg(&store)
        .arg("--out")
        .arg(tmp.path().join("reports"))
        .arg("--comparison")
        .arg(&saved)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("index.html"), "{text}");
    let suite_reports = tmp.path().join("reports/synthetic");
    let dirs: Vec<_> = std::fs::read_dir(&suite_reports).unwrap().collect();
    assert_eq!(dirs.len(), 1);
    let dir = dirs[0].as_ref().unwrap().path();
    let html = std::fs::read_to_string(dir.join("index.html")).unwrap();
    // Heatmaps come from the layers read back from the store: one per config.
    assert_eq!(html.matches("<h3>Gradient norms: ").count(), 4);
    assert!(html.contains(&store.join("synthetic").display().to_string()));
}

/// A store holding, beside each current run, a copy under an old run id (as a store made before
/// the one-time id change keeps it): `report` draws and counts only the suite's current runs and
/// says in one line that it skipped the stale folder; `compare` uses only the current runs too.
#[test]
fn report_and_compare_skip_a_stale_folder_of_the_same_config_and_seed() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let suite = dir.join("stale.toml");
    std::fs::write(
        &suite,
        "name = \"stale\"\nseeds = [0]\n[workload]\nmodel = \"tiny\"\ntask = \"add:2\"\nsteps = 2\n\
         prompts_per_step = 2\nsamples_per_prompt = 2\nmax_response_tokens = 4\n\
         [workload.warm_start]\nmax_steps = 2\neval_prompts = 8\n\
         [[configs]]\nname = \"bf16\"\nrecipe = \"bf16\"\n[[configs]]\nname = \"mxfp8\"\nrecipe = \"mxfp8\"\n",
    )
    .unwrap();
    let store = dir.join("runs");
    let bin = env!("CARGO_BIN_EXE_lockstep");
    let lockstep = |args: &[&str]| {
        std::process::Command::new(bin)
            .current_dir(dir)
            .env("LOCKSTEP_CACHE", dir.join("cache"))
            .args(args)
            .output()
            .unwrap()
    };
    let (s, st) = (suite.to_str().unwrap(), store.to_str().unwrap());
    let o = lockstep(&["run", s, "--store", st, "--jobs", "1"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let root = store.join("stale");
    let current: Vec<String> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| root.join(n).join("manifest.json").is_file())
        .collect();
    assert_eq!(current.len(), 2, "{current:?}");
    let bf16 = current.iter().find(|n| n.starts_with("bf16-s0-")).unwrap();
    // The same configuration and seed under an id of an older lockstep.
    let old = "bf16-s0-0ldhash00000";
    std::fs::create_dir(root.join(old)).unwrap();
    for e in std::fs::read_dir(root.join(bf16)).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, root.join(old).join(p.file_name().unwrap())).unwrap();
    }
    let rd = lockstep::store::RunDir::open(&root.join(old));
    let mut m = rd.read_manifest().unwrap();
    m.run_id = old.into();
    rd.write_manifest(&m).unwrap();

    let out = dir.join("reports");
    let o = lockstep(&[
        "report",
        "--suite",
        s,
        "--store",
        st,
        "--out",
        out.to_str().unwrap(),
    ]);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert!(o.status.success(), "{stderr}");
    assert!(
        stdout.contains("(2 runs"),
        "counted the stale folder: {stdout}"
    );
    let note: Vec<&str> = stderr.lines().filter(|l| l.contains("stale")).collect();
    assert_eq!(note.len(), 1, "one line about the stale folder: {stderr}");
    assert!(
        note[0].contains("skipped 1 stale run folder") && note[0].contains(old),
        "{stderr}"
    );
    let index = std::fs::read_dir(out.join("stale"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path()
        .join("index.html");
    let html = std::fs::read_to_string(index).unwrap();
    assert!(html.contains(bf16.as_str()), "the current run is listed");
    assert!(!html.contains(old), "the stale run is drawn or listed");

    // compare: the stale copy is not a second bf16 seed.
    let _ = lockstep(&["compare", "--suite", s, "--store", st]);
    let cmp: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root.join("compare.json")).unwrap()).unwrap();
    let mx = cmp["configs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["config"] == "mxfp8")
        .unwrap();
    assert_eq!(mx["seeds"], serde_json::json!([0]));
    assert!(
        cmp["warnings"].as_array().unwrap().iter().any(|w| {
            let w = w.as_str().unwrap();
            w.contains("skipped 1 stale run folder(s)") && w.contains(old)
        }),
        "{}",
        cmp["warnings"]
    );
}
