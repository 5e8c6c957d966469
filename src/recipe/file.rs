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
    let text = std::fs::read_to_string(p).map_err(|err| LoadError::Io {
        path: spec.into(),
        err,
    })?;
    parse(&text, p)
}

/// Parse recipe text; the format follows the extension of `path` (which also names errors).
pub fn parse(text: &str, path: &Path) -> Result<Recipe, LoadError> {
    let yaml = matches!(
        path.extension().and_then(|e| e.to_str()),
        Some("yaml" | "yml")
    );
    let res: Result<Recipe, String> = if yaml {
        serde_norway::from_str(text).map_err(|e| e.to_string())
    } else {
        toml::from_str(text).map_err(|e| e.to_string())
    };
    let mut r = res.map_err(|msg| LoadError::Parse {
        path: path.display().to_string(),
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
        assert!(e.starts_with("r.toml:"), "{e}");
        assert!(e.contains("line 5"), "{e}");
        assert!(e.contains("did you mean `bf16_first`"), "{e}");
        let bad = TOML.replace("format = \"nvfp4\"", "format = \"nvfp5\"");
        let e = parse(&bad, Path::new("r.toml")).unwrap_err().to_string();
        assert!(
            e.contains("nvfp5") && e.contains("line 9, column 10"),
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
}
