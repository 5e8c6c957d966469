//! Recipes from TOML or YAML files, or by preset name. Parse errors carry the file, line and column
//! (both parsers report them) and unknown keys are rejected (`deny_unknown_fields`), with the
//! nearest known key suggested.

use super::presets::{preset, suggest};
use super::{Recipe, RecipeError};
use std::path::Path;

/// Why a recipe could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{path}: {err}")]
    Io { path: String, err: std::io::Error },
    #[error("{path}: {msg}")]
    Parse { path: String, msg: String },
    #[error(transparent)]
    Recipe(#[from] RecipeError),
}

/// Keys a recipe file may use (for typo suggestions).
const KEYS: [&str; 9] = [
    "name",
    "rules",
    "backward",
    "bf16_first",
    "bf16_last",
    "nvfp4_activation_scale",
    "nvfp4_shards",
    "weight_decay",
    "weight_decay_low_precision",
];

/// A preset name, or a path to a `.toml` / `.yaml` / `.yml` recipe file.
pub fn load(spec: &str) -> Result<Recipe, LoadError> {
    let p = Path::new(spec);
    let is_file = matches!(
        p.extension().and_then(|e| e.to_str()),
        Some("toml" | "yaml" | "yml")
    );
    if !is_file {
        return Ok(preset(spec)?);
    }
    let meta = std::fs::metadata(p).map_err(|err| LoadError::Io {
        path: spec.into(),
        err,
    })?;
    if !meta.is_file() || meta.len() > MAX_RECIPE_BYTES as u64 {
        return Err(LoadError::Parse {
            path: spec.into(),
            msg: format!(
                "must be a regular file of at most {MAX_RECIPE_BYTES} bytes ({} bytes)",
                meta.len()
            ),
        });
    }
    let text = std::fs::read_to_string(p).map_err(|err| LoadError::Io {
        path: spec.into(),
        err,
    })?;
    parse(&text, p)
}

/// Largest recipe file read (real recipes are well under 10 KiB).
pub const MAX_RECIPE_BYTES: usize = 1 << 20;
/// Deepest `[`/`{` nesting a recipe may use (real recipes use 2). The YAML parser takes time
/// quadratic in the nesting (60 KB of `[` took 19.5 s), so it is bounded before parsing.
pub const MAX_NESTING: usize = 32;

/// Reject text too large or nested too deep before a parser sees it: `(line, column, what)`.
fn check_shape(text: &str) -> Result<(), (usize, usize, String)> {
    if text.len() > MAX_RECIPE_BYTES {
        return Err((
            1,
            1,
            format!(
                "{} bytes, at most {MAX_RECIPE_BYTES} are allowed",
                text.len()
            ),
        ));
    }
    let (mut depth, mut quote) = (0usize, None::<char>);
    for (n, line) in text.lines().enumerate() {
        for (col, c) in line.chars().enumerate() {
            match (quote, c) {
                (Some(q), c) if c == q => quote = None,
                (Some(_), _) => {}
                (None, '\'' | '"') => quote = Some(c),
                (None, '#') => break,
                (None, '[' | '{') => {
                    depth += 1;
                    if depth > MAX_NESTING {
                        return Err((
                            n + 1,
                            col + 1,
                            format!("nested more than {MAX_NESTING} levels of [ or {{; flatten it"),
                        ));
                    }
                }
                (None, ']' | '}') => depth = depth.saturating_sub(1),
                _ => {}
            }
        }
        if quote == Some('\'') || quote == Some('"') {
            // TOML and YAML flow strings end on their line (multi-line strings only lose the count).
            quote = None;
        }
    }
    Ok(())
}

/// Parse recipe text; the format follows the extension of `path` (which also names errors).
pub fn parse(text: &str, path: &Path) -> Result<Recipe, LoadError> {
    if let Err((line, col, what)) = check_shape(text) {
        return Err(LoadError::Parse {
            path: format!("{}:{line}:{col}", path.display()),
            msg: what,
        });
    }
    let yaml = matches!(
        path.extension().and_then(|e| e.to_str()),
        Some("yaml" | "yml")
    );
    let res: Result<Recipe, (String, String)> = if yaml {
        serde_norway::from_str(text).map_err(|e| {
            let at = match e.location() {
                Some(l) => format!("{}:{}:{}", path.display(), l.line(), l.column()),
                None => path.display().to_string(),
            };
            (at, crate::io::one_line(&e.to_string()))
        })
    } else {
        toml::from_str(text).map_err(|e| crate::io::toml_error(path, text, &e))
    };
    let mut r = res.map_err(|(at, msg)| LoadError::Parse {
        path: at,
        msg: with_suggestion(msg),
    })?;
    if r.name.is_empty() {
        r.name = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
    }
    Ok(r)
}

/// Append "did you mean" to an unknown-field message.
fn with_suggestion(msg: String) -> String {
    let Some(start) = msg.find("unknown field `") else {
        return msg.trim_end().to_string();
    };
    let rest = &msg[start + "unknown field `".len()..];
    let field = rest.split('`').next().unwrap_or("");
    match suggest(field, &KEYS) {
        Some(s) => format!("{} (did you mean `{s}`?)", msg.trim_end()),
        None => msg.trim_end().to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::recipe::{BackwardMode, LayerCount, Precision};

    const TOML: &str = r#"
name = "experts-nvfp4"
backward = "dequantized"
bf16_last = 0.15
bf16_first = 1

[[rules]]
pattern = "*.mlp.experts.linear_fc*"
format = "nvfp4"

[[rules]]
pattern = "*"
format = "bf16"
"#;

    #[test]
    fn toml_and_yaml_read_the_same_recipe() {
        let t = parse(TOML, Path::new("r.toml")).unwrap();
        assert_eq!(t.rules.len(), 2);
        assert_eq!(t.rules[0].format, Precision::Nvfp4);
        assert_eq!(t.backward, BackwardMode::Dequantized);
        assert_eq!(t.bf16_last, Some(LayerCount::Fraction(0.15)));
        assert_eq!(t.bf16_first, Some(LayerCount::Layers(1)));
        let yaml = "name: experts-nvfp4\nbackward: dequantized\nbf16_last: 0.15\nbf16_first: 1\nrules:\n  - pattern: '*.mlp.experts.linear_fc*'\n    format: nvfp4\n  - pattern: '*'\n    format: bf16\n";
        let y = parse(yaml, Path::new("r.yaml")).unwrap();
        assert_eq!(t, y);
        assert_eq!(t.resolve(6).unwrap(), y.resolve(6).unwrap());
    }

    #[test]
    fn errors_name_line_and_suggest_keys() {
        let bad = TOML.replace("bf16_first = 1", "bf16_frist = 1");
        let e = parse(&bad, Path::new("r.toml")).unwrap_err().to_string();
        assert!(e.starts_with("r.toml:5:1: "), "{e}");
        assert!(e.contains("did you mean `bf16_first`"), "{e}");
        let bad = TOML.replace("format = \"nvfp4\"", "format = \"nvfp5\"");
        let e = parse(&bad, Path::new("r.toml")).unwrap_err().to_string();
        assert!(
            e.contains("nvfp5") && e.starts_with("r.toml:9:10: ") && e.lines().count() == 1,
            "{e}"
        );
        let e = load("mxfp9").unwrap_err().to_string();
        assert!(e.contains("did you mean `mxfp8`"), "{e}");
    }

    #[test]
    fn name_defaults_to_file_stem() {
        let r = parse(
            &TOML.replace("name = \"experts-nvfp4\"\n", ""),
            Path::new("dir/my-recipe.toml"),
        )
        .unwrap();
        assert_eq!(r.name, "my-recipe");
    }

    #[test]
    fn deep_nesting_is_refused_before_the_parser_sees_it() {
        for p in ["r.yaml", "r.toml"] {
            let e = parse(&"[".repeat(60_000), Path::new(p))
                .unwrap_err()
                .to_string();
            assert!(
                e.starts_with(&format!("{p}:1:33: ")) && e.contains("nested"),
                "{e}"
            );
        }
        let ok = "rules: [{pattern: '[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[*', format: bf16}]\n";
        assert!(
            check_shape(ok).is_ok(),
            "brackets inside quotes do not count"
        );
    }
}
