//! Issue 6: the report opens in a real browser. Renders `index.html` in headless Chromium (Debian's
//! `chromium`, installed by `.ci/run`), checks that every figure decoded (naturalWidth > 0, read
//! back through `--dump-dom`) and that a screenshot of the page is not blank. Skipped, with a
//! message, where no Chromium is installed.

use lockstep::report::fixture::{self, Shape};
use lockstep::report::{ReportInput, write_report};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The first Chromium on PATH.
fn chromium() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    for dir in std::env::split_paths(&path) {
        for name in [
            "chromium",
            "chromium-browser",
            "google-chrome",
            "google-chrome-stable",
        ] {
            let p = dir.join(name);
            if p.is_file() {
                return Some(p);
            }
        }
    }
    None
}

/// Run headless Chromium on `url` with `extra` flags; its stdout (through a file: a dumped DOM
/// with inline figures is megabytes, far more than a pipe holds while we wait), or a panic after
/// 90 s.
fn headless(browser: &Path, profile: &Path, extra: &[&str], url: &str) -> String {
    std::fs::create_dir_all(profile).unwrap();
    let out_path = profile.join("stdout.txt");
    let stdout = std::fs::File::create(&out_path).unwrap();
    let mut cmd = Command::new(browser);
    cmd.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--hide-scrollbars",
    ])
    .arg(format!("--user-data-dir={}", profile.display()))
    .args(extra)
    .arg(url)
    .stdin(Stdio::null())
    .stdout(stdout)
    .stderr(Stdio::null());
    let mut child = cmd.spawn().expect("start chromium");
    let start = Instant::now();
    loop {
        if child.try_wait().expect("wait").is_some() {
            break;
        }
        if start.elapsed() > Duration::from_secs(90) {
            let _ = child.kill();
            panic!("chromium did not finish in 90 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    String::from_utf8_lossy(&std::fs::read(&out_path).unwrap()).into_owned()
}

/// Decode an RGB(A) PNG into (width, height, rgb pixels).
fn decode(png_bytes: &[u8]) -> (u32, u32, Vec<[u8; 3]>) {
    let dec = png::Decoder::new(std::io::Cursor::new(png_bytes));
    let mut reader = dec.read_info().expect("png header");
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).expect("png frame");
    let ch = match info.color_type {
        png::ColorType::Rgb => 3,
        png::ColorType::Rgba => 4,
        other => panic!("unexpected colour type {other:?}"),
    };
    let px = buf[..info.buffer_size()]
        .chunks(ch)
        .map(|c| [c[0], c[1], c[2]])
        .collect();
    (info.width, info.height, px)
}

#[test]
fn report_renders_in_headless_chromium_with_every_figure_loaded() {
    let Some(browser) = chromium() else {
        eprintln!(
            "SKIPPED: no chromium on PATH (CI installs Debian's `chromium`; `apt-get install -y chromium`)"
        );
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let f = fixture::synthetic(&Shape::small());
    let input = ReportInput {
        spec: &f.spec,
        suite_dir: Path::new("runs/synthetic"),
        comparison: &f.comparison,
        runs: &f.runs,
    };
    let index = write_report(&input, &tmp.path().join("reports")).unwrap();
    let html = std::fs::read_to_string(&index).unwrap();
    let figures = html.matches("<img ").count();
    assert!(figures >= 8, "{figures}");

    // 1. Every image decoded. A probe script goes in a copy of the page *before* the page's CSP
    // meta tag (which forbids scripts from that point on), so the page itself is tested as shipped,
    // CSP included: a CSP that blocked data: images would show here as naturalWidth 0.
    let probe = "<script>addEventListener('load',function(){document.documentElement.setAttribute('data-probe',Array.prototype.map.call(document.images,function(i){return i.complete&&i.naturalWidth>0?i.naturalWidth:0}).join(','))})</script>";
    let head = "<head><meta charset=\"utf-8\">";
    assert!(html.contains(head));
    let probed = html.replacen(head, &format!("{head}{probe}"), 1);
    let probe_page = index.with_file_name("probe.html");
    std::fs::write(&probe_page, probed).unwrap();
    let dom = headless(
        &browser,
        &tmp.path().join("profile-dom"),
        &["--dump-dom"],
        &format!("file://{}", probe_page.display()),
    );
    let widths: Vec<u32> = dom
        .split("data-probe=\"")
        .nth(1)
        .unwrap_or_else(|| {
            panic!(
                "probe did not run; DOM starts: {}",
                &dom[..dom.len().min(300)]
            )
        })
        .split('"')
        .next()
        .unwrap()
        .split(',')
        .map(|w| w.parse().unwrap())
        .collect();
    assert_eq!(widths.len(), figures, "images in the DOM");
    assert!(
        widths.iter().all(|w| *w == 1200),
        "some figure did not load: {widths:?}"
    );

    // 2. A screenshot of the shipped page is not blank: plenty of non-white pixels and colours.
    let shot = tmp.path().join("shot.png");
    headless(
        &browser,
        &tmp.path().join("profile-shot"),
        &[
            "--window-size=1280,2200",
            &format!("--screenshot={}", shot.display()),
        ],
        &format!("file://{}", index.display()),
    );
    let bytes = std::fs::read(&shot).expect("chromium wrote no screenshot");
    let (w, h, px) = decode(&bytes);
    assert!(w >= 1000 && h >= 1000, "{w}x{h}");
    let non_white = px.iter().filter(|p| p.iter().any(|c| *c < 235)).count();
    let colours: std::collections::BTreeSet<[u8; 3]> = px.iter().copied().collect();
    assert!(
        non_white as f64 / px.len() as f64 > 0.05,
        "screenshot nearly blank: {non_white} of {} pixels drawn",
        px.len()
    );
    assert!(
        colours.len() > 200,
        "screenshot has only {} colours",
        colours.len()
    );
}
