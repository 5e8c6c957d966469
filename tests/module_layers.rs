//! The top-level modules of `src/` form layers, and a module may only use modules below its own.
//! An upward use is reported with its file and line; an import circle (which an upward use is
//! needed for) is reported separately. Layers, bottom to top, are in [`LAYERS`].
//!
//! A use is any path that reaches another top-level module: `crate::x`, each item of a grouped
//! `use crate::{x, y::z}`, `pub use` re-exports, `super::` chains that climb to the crate root,
//! and, in the binary's files (`src/main.rs` and the modules it declares), `lockstep::x`. Comments
//! and string literals are skipped. Test code is checked like the rest: nothing needs exempting.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Bottom to top. `io` sits above `formats` (reading a Fortran-order `.npy` transposes with the
/// quantizer's own transpose); `tools` (the quantize command and benchmarks) above `engine`, whose
/// step it times; `cli` is the binary (`src/main.rs` and `src/cli/`).
const LAYERS: &[&str] = &[
    "formats", "io", "recipe", "engine", "tools", "store", "suite", "compare", "report", "cli",
];

/// The library's name in the binary's paths (`lockstep::suite::...`).
const LIB: &str = "lockstep";

#[derive(Debug, Clone, PartialEq)]
enum Token {
    Ident(String),
    /// `::`
    PathSep,
    Punct(char),
}

/// The tokens of Rust source that matter for paths, each with its 1-based line. Comments, string,
/// byte-string, raw-string and char literals are dropped, so a path quoted in a doc comment or an
/// error message is not taken for a use.
fn tokens(src: &str) -> Vec<(usize, Token)> {
    let c: Vec<char> = src.chars().collect();
    let (mut i, mut line, mut out) = (0, 1, Vec::new());
    let newlines = |from: usize, to: usize| c[from..to].iter().filter(|&&x| x == '\n').count();
    while i < c.len() {
        let start = i;
        match c[i] {
            '\n' => i += 1,
            '/' if c.get(i + 1) == Some(&'/') => {
                while i < c.len() && c[i] != '\n' {
                    i += 1;
                }
            }
            '/' if c.get(i + 1) == Some(&'*') => i = block_comment_end(&c, i),
            '"' => i = string_end(&c, i + 1),
            '\'' => i = char_or_lifetime_end(&c, i),
            ':' if c.get(i + 1) == Some(&':') => {
                out.push((line, Token::PathSep));
                i += 2;
            }
            x if x.is_alphabetic() || x == '_' => {
                while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                    i += 1;
                }
                let word: String = c[start..i].iter().collect();
                match raw_or_byte_string_end(&c, &word, i) {
                    Some(end) => i = end,
                    None => out.push((line, Token::Ident(word))),
                }
            }
            x if x.is_whitespace() => i += 1,
            x => {
                out.push((line, Token::Punct(x)));
                i += 1;
            }
        }
        line += newlines(start, i);
    }
    out
}

/// Index just past the `*/` closing the (possibly nested) block comment opening at `i`.
fn block_comment_end(c: &[char], mut i: usize) -> usize {
    let mut depth = 0;
    while i < c.len() {
        if c[i] == '/' && c.get(i + 1) == Some(&'*') {
            depth += 1;
            i += 2;
        } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
            depth -= 1;
            i += 2;
            if depth == 0 {
                return i;
            }
        } else {
            i += 1;
        }
    }
    i
}

/// Index just past the `"` closing a string whose body starts at `i` (escapes honoured).
fn string_end(c: &[char], mut i: usize) -> usize {
    while i < c.len() && c[i] != '"' {
        i += if c[i] == '\\' { 2 } else { 1 };
    }
    i + 1
}

/// `'x'`, `'\n'` and `'\u{..}'` are char literals; `'a` in `&'a str` or `'outer:` is a lifetime
/// or label, of which only the quote is skipped.
fn char_or_lifetime_end(c: &[char], i: usize) -> usize {
    if c.get(i + 1) == Some(&'\\') {
        let mut j = i + 2;
        while j < c.len() && c[j] != '\'' {
            j += 1;
        }
        j + 1
    } else if c.get(i + 2) == Some(&'\'') {
        i + 3
    } else {
        i + 1
    }
}

/// When `word` (just read, ending at `i`) prefixes a literal (`b"..."`, `r#"..."#`, `br"..."`,
/// `c"..."`), the index just past that literal.
fn raw_or_byte_string_end(c: &[char], word: &str, i: usize) -> Option<usize> {
    match (word, c.get(i)) {
        ("b" | "c", Some('"')) => Some(string_end(c, i + 1)),
        ("r" | "br" | "cr", Some('"' | '#')) => {
            let hashes = c[i..].iter().take_while(|&&x| x == '#').count();
            if c.get(i + hashes) != Some(&'"') {
                return None;
            }
            let close: Vec<char> = std::iter::once('"')
                .chain(std::iter::repeat_n('#', hashes))
                .collect();
            let body = i + hashes + 1;
            let end = (body..c.len())
                .find(|&j| c[j..].starts_with(&close))
                .unwrap_or(c.len());
            Some(end + close.len())
        }
        _ => None,
    }
}

/// A source file: its path, the top-level module it belongs to and its module path.
struct SourceFile {
    rel: String,
    /// `cli` for the binary's files.
    top: String,
    /// Its module path inside its crate: `suite/plan.rs` is `["suite", "plan"]`.
    module: Vec<String>,
    /// Whether it is one of the binary's files, whose `crate::` is the binary's own root.
    in_bin: bool,
}

/// `rel` is the path under `src/`; `bin_modules` the modules `src/main.rs` declares.
fn source_file(rel: &str, bin_modules: &[String]) -> Option<SourceFile> {
    let stem = rel.strip_suffix(".rs")?;
    let mut module: Vec<String> = stem.split('/').map(String::from).collect();
    if module.last().is_some_and(|m| m == "mod") || module == ["lib"] || module == ["main"] {
        module.pop();
    }
    let in_bin = rel == "main.rs" || module.first().is_some_and(|m| bin_modules.contains(m));
    let top = match (in_bin, module.first()) {
        (true, _) => bin_modules.first()?.clone(),
        (false, Some(m)) => m.clone(),
        (false, None) => return None, // lib.rs declares the modules and uses none
    };
    Some(SourceFile {
        rel: format!("src/{rel}"),
        top,
        module,
        in_bin,
    })
}

/// The modules `src/main.rs` declares (`mod cli;`): the binary's own top-level modules.
fn bin_modules(main_rs: &str) -> Vec<String> {
    let t = tokens(main_rs);
    t.windows(3)
        .filter_map(|w| match w {
            [
                (_, Token::Ident(m)),
                (_, Token::Ident(name)),
                (_, Token::Punct(';')),
            ] if m == "mod" => Some(name.clone()),
            _ => None,
        })
        .collect()
}

/// Every top-level module of the library that `file`'s code names, with the line naming it.
fn references(file: &SourceFile, src: &str) -> Vec<(usize, String)> {
    let t = tokens(src);
    let mut out = Vec::new();
    // Inline `mod name { ... }` blocks open so far, with the brace depth inside each.
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0;
    for i in 0..t.len() {
        match &t[i].1 {
            Token::Punct('{') => {
                depth += 1;
                if let [.., (_, Token::Ident(kw)), (_, Token::Ident(name))] = &t[..i]
                    && kw == "mod"
                {
                    inline.push((name.clone(), depth));
                }
            }
            Token::Punct('}') => {
                if inline.last().is_some_and(|&(_, d)| d == depth) {
                    inline.pop();
                }
                depth = depth.saturating_sub(1);
            }
            Token::Ident(w) if t.get(i + 1).map(|x| &x.1) == Some(&Token::PathSep) => {
                let after_sep = i > 0 && t[i - 1].1 == Token::PathSep;
                if after_sep {
                    continue; // the middle of a path, not its start
                }
                let mut here = file.module.clone();
                here.extend(inline.iter().map(|(n, _)| n.clone()));
                out.extend(path_targets(file, &here, &t, i, w));
            }
            _ => {}
        }
    }
    out
}

/// The library's top-level modules a path starting with `first` at token `i` reaches from
/// module `here`. A path into the binary's own modules reaches none of the library's.
fn path_targets(
    file: &SourceFile,
    here: &[String],
    t: &[(usize, Token)],
    i: usize,
    first: &str,
) -> Vec<(usize, String)> {
    let into_lib = |j: usize| {
        if file.in_bin {
            Vec::new()
        } else {
            names_after_root(t, j)
        }
    };
    match first {
        "crate" => into_lib(i + 2),
        LIB if file.in_bin => names_after_root(t, i + 2),
        "super" => {
            let mut climbs = 0;
            let mut j = i;
            while matches!(&t.get(j).map(|x| &x.1), Some(Token::Ident(s)) if s == "super")
                && t.get(j + 1).map(|x| &x.1) == Some(&Token::PathSep)
            {
                climbs += 1;
                j += 2;
            }
            // Fewer climbs stay inside the file's own top-level module.
            if climbs == here.len() {
                into_lib(j)
            } else {
                Vec::new()
            }
        }
        _ => Vec::new(),
    }
}

/// The top-level names a path names just after its crate root (token `j`): `x` in `crate::x::y`,
/// or each item's first name in a group `crate::{x, y::z, w::{..}}`.
fn names_after_root(t: &[(usize, Token)], j: usize) -> Vec<(usize, String)> {
    match t.get(j) {
        Some((line, Token::Ident(name))) => vec![(*line, name.clone())],
        Some((_, Token::Punct('{'))) => {
            let mut out = Vec::new();
            let mut depth = 0;
            let mut item_start = true;
            for (line, tok) in &t[j..] {
                match tok {
                    Token::Punct('{') => depth += 1,
                    Token::Punct('}') => {
                        depth -= 1;
                        if depth == 0 {
                            break;
                        }
                    }
                    Token::Punct(',') if depth == 1 => item_start = true,
                    Token::Ident(name) if depth == 1 && item_start => {
                        if name != "self" {
                            out.push((*line, name.clone()));
                        }
                        item_start = false;
                    }
                    _ => {}
                }
            }
            out
        }
        _ => Vec::new(),
    }
}

/// What the check found: uses of a higher layer (one line each) and import circles.
#[derive(Debug, Default)]
struct Findings {
    upward: Vec<String>,
    circles: Vec<Vec<String>>,
    /// Top-level modules missing from [`LAYERS`].
    unplaced: BTreeSet<String>,
}

/// Check `files` (paths under `src/` with their text) against [`LAYERS`].
fn check(files: &[(String, String)]) -> Findings {
    let rank = |m: &str| LAYERS.iter().position(|l| *l == m);
    let bins = files
        .iter()
        .find(|(rel, _)| rel == "main.rs")
        .map(|(_, text)| bin_modules(text))
        .unwrap_or_default();
    let mut found = Findings::default();
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (rel, text) in files {
        let Some(file) = source_file(rel, &bins) else {
            continue;
        };
        let Some(from) = rank(&file.top) else {
            found.unplaced.insert(file.top.clone());
            continue;
        };
        for (line, to) in references(&file, text) {
            if to == file.top || to == "self" {
                continue;
            }
            match rank(&to) {
                None => {
                    found.unplaced.insert(to.clone());
                }
                Some(r) if r > from => found.upward.push(format!(
                    "{}:{line}: `{}` uses `{to}`, a layer above it",
                    file.rel, file.top
                )),
                Some(_) => {}
            }
            edges.entry(file.top.clone()).or_default().insert(to);
        }
    }
    found.circles = circles(&edges);
    found
}

/// Groups of modules that reach each other through `edges` (each an import circle), sorted.
fn circles(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    let reach = |from: &str| {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.to_string()];
        while let Some(m) = todo.pop() {
            for n in edges.get(&m).into_iter().flatten() {
                if seen.insert(n.clone()) {
                    todo.push(n.clone());
                }
            }
        }
        seen
    };
    let reaches: BTreeMap<&String, BTreeSet<String>> =
        edges.keys().map(|m| (m, reach(m))).collect();
    let mut out: BTreeSet<Vec<String>> = BTreeSet::new();
    for (m, r) in &reaches {
        if r.contains(*m) {
            let group = r
                .iter()
                .filter(|n| reaches.get(n).is_some_and(|back| back.contains(*m)))
                .cloned()
                .collect();
            out.insert(group);
        }
    }
    out.into_iter().collect()
}

/// Every `.rs` file under `dir`, as (path relative to `src/`, text).
fn read_sources(src: &Path, dir: &Path, out: &mut Vec<(String, String)>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            read_sources(src, &path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let rel = path.strip_prefix(src).unwrap().to_string_lossy();
            let text = std::fs::read_to_string(&path).unwrap();
            out.push((rel.replace('\\', "/"), text));
        }
    }
}

#[test]
fn no_module_uses_a_layer_above_its_own_and_none_are_in_a_circle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    read_sources(&src, &src, &mut files);
    files.sort();
    let found = check(&files);
    assert!(
        found.unplaced.is_empty(),
        "top-level modules not in LAYERS (tests/module_layers.rs): {:?}; place each in the order",
        found.unplaced
    );
    let mut tops: BTreeSet<&str> = files
        .iter()
        .filter_map(|(rel, _)| rel.split('/').next())
        .map(|m| m.trim_end_matches(".rs"))
        .collect();
    tops.remove("lib");
    tops.remove("main");
    let stale: Vec<&&str> = LAYERS.iter().filter(|l| !tops.contains(**l)).collect();
    assert!(stale.is_empty(), "LAYERS names missing modules: {stale:?}");
    assert!(
        found.upward.is_empty(),
        "uses of a higher layer (layers bottom to top: {}):\n{}",
        LAYERS.join(" < "),
        found.upward.join("\n")
    );
    assert!(
        found.circles.is_empty(),
        "import circles: {:?}",
        found.circles
    );
}

// The checker on small inputs.

fn files(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter()
        .map(|(p, t)| (p.to_string(), t.to_string()))
        .collect()
}

fn names(rel: &str, src: &str) -> Vec<String> {
    let file = source_file(rel, &["cli".to_string()]).unwrap();
    references(&file, src).into_iter().map(|(_, n)| n).collect()
}

#[test]
fn a_planted_upward_use_is_caught_with_file_and_line() {
    let found = check(&files(&[
        ("formats/mod.rs", "//! codecs\n\npub mod tensor;\n"),
        (
            "formats/tensor.rs",
            "fn f() {\n    let x = crate::engine::model::X;\n}\n",
        ),
        ("engine/mod.rs", "use crate::formats::Tensor;\n"),
    ]));
    assert_eq!(
        found.upward,
        ["src/formats/tensor.rs:2: `formats` uses `engine`, a layer above it"]
    );
    // engine uses formats, so the planted use also closes a circle.
    assert_eq!(found.circles, [["engine", "formats"]]);
}

#[test]
fn grouped_uses_and_re_exports_are_parsed() {
    assert_eq!(
        names(
            "store/run.rs",
            "pub use crate::{engine::{a, b}, self as me, formats,\n io::npy::Matrix};"
        ),
        ["engine", "formats", "io"]
    );
    let found = check(&files(&[(
        "engine/mod.rs",
        "pub use crate::{formats::Tensor,\n    suite::RunSpec};\n",
    )]));
    assert_eq!(
        found.upward,
        ["src/engine/mod.rs:2: `engine` uses `suite`, a layer above it"]
    );
}

#[test]
fn super_chains_count_only_when_they_reach_the_crate_root() {
    assert_eq!(
        names("suite/plan.rs", "use super::super::store::RunDir;"),
        ["store"]
    );
    assert_eq!(names("suite/mod.rs", "use super::compare::X;"), ["compare"]);
    assert!(names("suite/plan.rs", "use super::spec::SuiteSpec;").is_empty());
    // Inside an inline module one more `super` is needed to leave the file's module.
    let inline = "mod tests {\n    use super::compare::X;\n    use super::super::store::Y;\n}\nuse super::report::Z;";
    assert_eq!(names("suite/mod.rs", inline), ["store", "report"]);
    // The binary's `super::` stays in the binary.
    assert!(names("cli/bench.rs", "let m = super::engine::model_preset(x);").is_empty());
}

#[test]
fn comments_and_literals_are_not_uses() {
    let src = "/// see [`crate::report`]\n// crate::cli\n/* crate::suite /* nested */ */\nconst A: &str = \"crate::compare\";\nconst B: &str = r#\"crate::store \"quoted\"\"#;\nconst C: char = '\"';\nfn f<'a>(x: &'a str) { crate::io::x() }\n";
    assert_eq!(names("formats/mod.rs", src), ["io"]);
}

#[test]
fn the_binary_reaches_the_library_through_its_name() {
    let found = check(&files(&[
        (
            "main.rs",
            "mod cli;\nfn main() { lockstep::io::one_line(\"\"); }\n",
        ),
        (
            "cli/mod.rs",
            "use crate::cli::suite;\nuse lockstep::report::x;\n",
        ),
        ("io/mod.rs", ""),
    ]));
    assert!(found.upward.is_empty(), "{:?}", found.upward);
    assert!(found.unplaced.is_empty(), "{:?}", found.unplaced);
}

#[test]
fn a_circle_is_reported() {
    let found = check(&files(&[
        ("store/mod.rs", "use crate::suite::x;\n"),
        ("suite/mod.rs", "use crate::store::y;\n"),
        ("engine/mod.rs", "use crate::recipe::z;\n"),
    ]));
    assert_eq!(found.circles, [["store", "suite"]]);
    assert_eq!(found.upward.len(), 1, "{:?}", found.upward);
}
