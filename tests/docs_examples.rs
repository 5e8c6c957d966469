//! Every TOML example in `docs/command-engine.md` stays valid: whole suites parse and expand (what
//! `lockstep suite check` does), and `[command.metrics]` fragments are valid metrics mappings.
//! Every `docs/...` path and relative link a page cites exists, so pruning old logs cannot break a
//! citation, and `docs/README.md` lists every page.

use lockstep::suite::metrics::MetricsMapping;
use std::path::Path;

fn toml_blocks(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur: Option<String> = None;
    for line in text.lines() {
        match (&mut cur, line.trim_start()) {
            (None, "```toml") => cur = Some(String::new()),
            (Some(b), "```") => {
                out.push(std::mem::take(b));
                cur = None;
            }
            (Some(b), _) => {
                b.push_str(line);
                b.push('\n');
            }
            _ => {}
        }
    }
    out
}

#[test]
fn every_toml_example_in_the_command_engine_guide_is_valid() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/command-engine.md");
    let text = std::fs::read_to_string(&path).unwrap();
    let blocks = toml_blocks(&text);
    let (mut suites, mut fragments) = (0, 0);
    for b in &blocks {
        if b.starts_with("name =") {
            let s = lockstep::suite::parse(b, &path).unwrap_or_else(|e| panic!("{e}\n{b}"));
            let runs = lockstep::suite::expand(&s).unwrap_or_else(|e| panic!("{e}\n{b}"));
            assert!(!runs.is_empty());
            suites += 1;
        } else {
            let t: toml::Table = toml::from_str(b).unwrap_or_else(|e| panic!("{e}\n{b}"));
            let m: MetricsMapping = t["command"]["metrics"]
                .clone()
                .try_into()
                .unwrap_or_else(|e| panic!("{e}\n{b}"));
            m.validate().unwrap();
            assert_eq!(
                m.first_step(),
                1,
                "every framework but Miles logs from step 1"
            );
            fragments += 1;
        }
    }
    assert_eq!((suites, fragments), (2, 6), "examples found: {blocks:?}");
}

/// `README.md`, the pages of `docs/` and the READMEs of `examples/` and `bench/`.
fn pages(root: &Path) -> Vec<std::path::PathBuf> {
    let mut out = vec![root.join("README.md"), root.join("bench/README.md")];
    for dir in ["docs", "examples"] {
        for e in std::fs::read_dir(root.join(dir)).unwrap() {
            let p = e.unwrap().path();
            if p.extension().is_some_and(|x| x == "md") {
                out.push(p);
            } else if p.join("README.md").is_file() {
                out.push(p.join("README.md"));
            }
        }
    }
    out.sort();
    out
}

/// Every `docs/...` path in `text` (a path ends at the first character no file name here uses;
/// a trailing `.` is the sentence's), and every relative markdown link target.
fn cited_paths(text: &str) -> (Vec<String>, Vec<String>) {
    let in_path = |c: char| c.is_ascii_alphanumeric() || "_./-".contains(c);
    let mut docs = Vec::new();
    for (i, _) in text.match_indices("docs/") {
        if text[..i].chars().next_back().is_some_and(in_path) {
            continue; // part of a longer path, e.g. `target/docs/`
        }
        let end = text[i..]
            .find(|c: char| !in_path(c))
            .map_or(text.len(), |n| i + n);
        docs.push(text[i..end].trim_end_matches('.').to_string());
    }
    let links = text
        .split("](")
        .skip(1)
        .filter_map(|rest| rest.split(')').next())
        .filter(|t| !t.contains("://") && !t.starts_with('#') && !t.is_empty())
        .map(|t| t.split('#').next().unwrap_or(t).to_string())
        .collect();
    (docs, links)
}

#[test]
fn every_docs_path_a_page_cites_exists() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut missing = Vec::new();
    let mut cited = 0;
    for page in pages(root) {
        let text = std::fs::read_to_string(&page).unwrap();
        let (docs, links) = cited_paths(&text);
        cited += docs.len() + links.len();
        let here = page.parent().unwrap();
        let targets = docs
            .iter()
            .map(|d| root.join(d))
            .chain(links.iter().map(|l| here.join(l)));
        for (target, name) in targets.zip(docs.iter().chain(&links)) {
            if !target.exists() {
                missing.push(format!(
                    "{}: {name}",
                    page.strip_prefix(root).unwrap().display()
                ));
            }
        }
    }
    assert!(
        cited > 30,
        "only {cited} citations found: is the scan broken?"
    );
    assert!(
        missing.is_empty(),
        "cited but missing:\n{}",
        missing.join("\n")
    );
}

#[test]
fn citations_are_found_whole() {
    let (docs, links) = cited_paths(
        "logs in `docs/cuda-logs/a-2026/`. See docs/cuda.md. Not target/docs/x. [p](cuda.md#x) [w](https://e.org)",
    );
    assert_eq!(docs, ["docs/cuda-logs/a-2026/", "docs/cuda.md"]);
    assert_eq!(links, ["cuda.md"]);
}

#[test]
fn the_docs_index_lists_every_page() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let index = std::fs::read_to_string(root.join("docs/README.md")).unwrap();
    let unlisted: Vec<String> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".md") && n != "README.md")
        .filter(|n| !index.contains(&format!("]({n})")))
        .collect();
    assert!(
        unlisted.is_empty(),
        "pages missing from docs/README.md: {unlisted:?}"
    );
}
