//! Every TOML example in `docs/command-engine.md` stays valid: whole suites parse and expand (what
//! `lockstep suite check` does), and `[command.metrics]` fragments are valid metrics mappings.

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
