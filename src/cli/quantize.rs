//! `lockstep quantize`: flags → a validated [`QuantFormat`], then `tools::quantize`.

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use lockstep::formats::{
    Axis, Fp8BlockVariant, Fp8Elem, Fp8Tile, MxScaleRule, QuantFormat, SecondScale,
};
use std::path::PathBuf;

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum FormatArg {
    Bf16,
    Mxfp8,
    Nvfp4,
    #[value(name = "fp8-block")]
    Fp8Block,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum AxisArg {
    Row,
    Col,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum SecondScaleArg {
    Tensor,
    Token,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum RuleArg {
    /// TransformerEngine: scale rounded up, nothing clips (default).
    Te,
    /// OCP MX v1.0: floor(log2 amax) - emax, the block max may clip.
    Ocp,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum ElemArg {
    E4m3,
    E5m2,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum TileArg {
    #[value(name = "1x128")]
    Act,
    #[value(name = "128x128")]
    Weight,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum Fp8VariantArg {
    Te,
    DeepseekV3,
    DeepseekV3Ue8m0,
    Deepgemm,
    DeepgemmUe8m0,
}

#[derive(Debug, Args)]
pub struct QuantizeArgs {
    /// Format: bf16, mxfp8 (E4M3, 32-blocks, E8M0 scale), nvfp4 (E2M1, 16-blocks, E4M3 scale +
    /// FP32 second-level scale), fp8-block (DeepSeek-V3 style FP32-scaled tiles).
    #[arg(long, required_unless_present = "check")]
    pub format: Option<FormatArg>,
    /// Blocks along rows (forward GEMM operand) or columns (the backward's transposed use).
    #[arg(long, value_enum, default_value_t = AxisArg::Row)]
    pub axis: AxisArg,
    /// NVFP4 only: second-level scale per tensor or per token (row). Default: token.
    #[arg(long)]
    pub second_scale: Option<SecondScaleArg>,
    /// NVFP4 only: compute the second-level scale over K split into S equal shards. Default 1.
    #[arg(long)]
    pub shards: Option<usize>,
    /// MXFP8 only: E8M0 scale rule. Default: te.
    #[arg(long)]
    pub scale_rule: Option<RuleArg>,
    /// MXFP8 only: element format. Default: e4m3.
    #[arg(long)]
    pub element: Option<ElemArg>,
    /// fp8-block only: tile shape. Default: 1x128.
    #[arg(long)]
    pub tile: Option<TileArg>,
    /// fp8-block only: scale variant (spec §5). Default: te.
    #[arg(long)]
    pub fp8_variant: Option<Fp8VariantArg>,
    /// Input: a 2-D float32 .npy.
    #[arg(long = "in", value_name = "X.npy", required_unless_present = "check")]
    pub input: Option<PathBuf>,
    /// Output folder: new, empty, or a previous quantize output (replaced as a whole). Never `.`,
    /// `..`, a folder holding the input, or a folder with other files; nothing is written on error.
    #[arg(long, value_name = "DIR", required_unless_present = "check")]
    pub out: Option<PathBuf>,
    /// Run every golden vector file in DIR (laid out like tests/golden/) and print pass/fail per case.
    #[arg(long, value_name = "DIR", conflicts_with_all = ["format", "input", "out"])]
    pub check: Option<PathBuf>,
}

impl QuantizeArgs {
    /// Validate the flag combination into a format.
    pub fn format(&self) -> Result<QuantFormat> {
        let Some(f) = self.format else {
            bail!("--format is required")
        };
        let misuse = |flag: &str, applies: &str| -> Result<QuantFormat> {
            bail!("{flag} only applies to --format {applies}; remove it or change the format")
        };
        if !matches!(f, FormatArg::Nvfp4) {
            if self.second_scale.is_some() {
                return misuse("--second-scale", "nvfp4");
            }
            if self.shards.is_some() {
                return misuse("--shards", "nvfp4");
            }
        }
        if !matches!(f, FormatArg::Mxfp8) {
            if self.scale_rule.is_some() {
                return misuse("--scale-rule", "mxfp8");
            }
            if self.element.is_some() {
                return misuse("--element", "mxfp8");
            }
        }
        if !matches!(f, FormatArg::Fp8Block) {
            if self.tile.is_some() {
                return misuse("--tile", "fp8-block");
            }
            if self.fp8_variant.is_some() {
                return misuse("--fp8-variant", "fp8-block");
            }
        }
        Ok(match f {
            FormatArg::Bf16 => QuantFormat::Bf16,
            FormatArg::Mxfp8 => QuantFormat::Mxfp8 {
                elem: match self.element.unwrap_or(ElemArg::E4m3) {
                    ElemArg::E4m3 => Fp8Elem::E4M3,
                    ElemArg::E5m2 => Fp8Elem::E5M2,
                },
                rule: match self.scale_rule.unwrap_or(RuleArg::Te) {
                    RuleArg::Te => MxScaleRule::TeCeil,
                    RuleArg::Ocp => MxScaleRule::OcpFloor,
                },
            },
            FormatArg::Nvfp4 => {
                let shards = self.shards.unwrap_or(1);
                if shards == 0 {
                    bail!("--shards must be at least 1");
                }
                let second = match self.second_scale.unwrap_or(SecondScaleArg::Token) {
                    SecondScaleArg::Tensor => SecondScale::PerTensor,
                    SecondScaleArg::Token => SecondScale::PerToken,
                };
                QuantFormat::Nvfp4 { second, shards }
            }
            FormatArg::Fp8Block => QuantFormat::Fp8Block {
                tile: match self.tile.unwrap_or(TileArg::Act) {
                    TileArg::Act => Fp8Tile::Act1x128,
                    TileArg::Weight => Fp8Tile::Weight128x128,
                },
                variant: match self.fp8_variant.unwrap_or(Fp8VariantArg::Te) {
                    Fp8VariantArg::Te => Fp8BlockVariant::Te,
                    Fp8VariantArg::DeepseekV3 => Fp8BlockVariant::DeepseekV3,
                    Fp8VariantArg::DeepseekV3Ue8m0 => Fp8BlockVariant::DeepseekV3Ue8m0,
                    Fp8VariantArg::Deepgemm => Fp8BlockVariant::Deepgemm,
                    Fp8VariantArg::DeepgemmUe8m0 => Fp8BlockVariant::DeepgemmUe8m0,
                },
            },
        })
    }
}

/// Run the command; returns whether everything passed (for `--check`).
pub fn run(args: &QuantizeArgs) -> Result<bool> {
    if let Some(dir) = &args.check {
        let results = lockstep::formats::golden::check_dir(dir)?;
        let failed = results.iter().filter(|r| !r.passed).count();
        for r in &results {
            println!(
                "{} {} / {}: {}",
                if r.passed { "PASS" } else { "FAIL" },
                r.file,
                r.case,
                r.detail
            );
        }
        println!(
            "golden: {} passed, {} failed",
            results.len() - failed,
            failed
        );
        return Ok(failed == 0);
    }
    let fmt = args.format()?;
    let axis = match args.axis {
        AxisArg::Row => Axis::Row,
        AxisArg::Col => Axis::Col,
    };
    let (input, out) = (
        args.input.as_ref().context("--in is required")?,
        args.out.as_ref().context("--out is required")?,
    );
    let m = lockstep::tools::quantize::quantize_file(input, out, &fmt, axis)?;
    println!("format         {}", fmt.name());
    println!("max abs error  {:.6e}", m.max_abs_error);
    println!("relative RMSE  {:.6e}", m.relative_rmse);
    println!("SQNR           {:.2} dB", m.sqnr_db);
    println!(
        "finite         {} (the statistics above cover these)",
        m.finite
    );
    println!(
        "non-finite     {} NaN, {} inf in the input; {} finite input(s) dequantized to inf or NaN",
        m.nan, m.inf, m.overflow
    );
    if m.overflow > 0 {
        // The statistics above leave these out, so an all-overflowed block cannot read as exact.
        println!(
            "warning        {} finite input(s) overflowed: their dequantized value (the spec's formula in f32) is inf or NaN; the statistics above leave them out (quantized.json stats.overflow)",
            m.overflow
        );
    }
    println!("wrote          {}", out.display());
    Ok(true)
}
