//! KL to the BF16 reference (`train/kl_loss`), raw on a log axis and offset-corrected on a linear
//! one. A low-precision policy starts away from the BF16 reference by a constant format offset; the
//! corrected panel subtracts each run's step-0 value so only growth (drift) remains, which is what
//! decides whether training diverges.

use super::mismatch::{LogPanel, floor_note, linear_panel, log_panel};
use super::*;

const RAW: &str = "train/kl_loss";
const CORRECTED: &str = "train/kl_loss_minus_step0";

/// The KL-to-reference figure (absent when neither metric was compared).
pub fn draw(ctx: &Ctx<'_>, dir: &Path) -> Result<Vec<Figure>, ReportError> {
    if !ctx.has_metric(RAW) && !ctx.has_metric(CORRECTED) {
        return Ok(vec![]);
    }
    let names: Vec<&str> = ctx
        .order
        .iter()
        .map(|c| c.as_str())
        .filter(|c| ctx.band(c, RAW).is_some() || ctx.band(c, CORRECTED).is_some())
        .collect();
    let raw: Vec<(&str, &Band)> = names
        .iter()
        .filter_map(|c| ctx.band(c, RAW).map(|b| (*c, b)))
        .collect();
    // Offset-corrected curves: the logged metric when compared, else each raw curve shifted by
    // its own step-0 value (the same definition the engine logs).
    let derived = !ctx.has_metric(CORRECTED);
    let corrected_owned: Vec<(&str, Band)> = if derived {
        raw.iter()
            .map(|(c, b)| (*c, shift_to_step0(b, ctx.metric(c, RAW).and_then(|m| m.kl))))
            .collect()
    } else {
        names
            .iter()
            .filter_map(|c| ctx.band(c, CORRECTED).map(|b| (*c, b.clone())))
            .collect()
    };
    let corrected: Vec<(&str, &Band)> = corrected_owned.iter().map(|(c, b)| (*c, b)).collect();
    let file = "kl-reference.png";
    let legend_h = legend_height(&names);
    let (w, h) = (WIDTH, legend_h + 460);
    let raw_panel = LogPanel {
        metric: RAW,
        title: "KL to BF16 reference, raw",
        y_desc: "KL (nats, log scale)",
    };
    let mut floor = None;
    render(dir, file, (w, h), |root| {
        root.fill(&WHITE)?;
        let (top, body) = root.split_vertically(legend_h);
        let entries: Vec<(String, RGBColor)> = names
            .iter()
            .map(|n| (n.to_string(), ctx.palette.color(n)))
            .collect();
        legend_strip(&top, &entries)?;
        let cells = body.split_evenly((1, 2));
        if !raw.is_empty() {
            floor = log_panel(&cells[0], ctx, &raw, raw_panel.title, raw_panel.y_desc)?;
        }
        if !corrected.is_empty() {
            linear_panel(
                &cells[1],
                ctx,
                &corrected,
                "KL to reference minus its step-0 value",
                "KL growth since step 0 (nats)",
            )?;
        }
        Ok(())
    })?;
    let how = if derived {
        "each seed's curve minus its own step-0 value (mean and band shifted by the comparison's \
         step-0 offset)"
    } else {
        "`train/kl_loss_minus_step0` as logged"
    };
    Ok(vec![Figure {
        file: file.into(),
        section: Section::KlReference,
        title: "KL to the BF16 reference: offset and drift".into(),
        caption: format!(
            "Left: `{RAW}` (k3 KL to the BF16 warm start) per step on a log scale; a low-precision \
             format starts above zero by a constant offset. Right: offset-corrected, {how}, so only \
             growth remains. Thick: mean over seeds; shaded: bootstrap band; thin: each seed.{}",
            floor_note(floor)
        ),
        width: w,
        height: h,
    }])
}

/// A band shifted down by its step-0 value: per-seed curves by their own first value, the mean and
/// band by the comparison's step-0 offset (or the mean's first value when it has none).
pub fn shift_to_step0(b: &Band, kl: Option<crate::compare::KlSummary>) -> Band {
    let off = kl
        .map(|k| k.step0_offset)
        .or_else(|| b.mean.first().copied())
        .unwrap_or(0.0);
    let sub = |v: &[f64], o: f64| v.iter().map(|x| x - o).collect::<Vec<f64>>();
    Band {
        steps: b.steps.clone(),
        mean: sub(&b.mean, off),
        lo: sub(&b.lo, off),
        hi: sub(&b.hi, off),
        per_seed: b
            .per_seed
            .iter()
            .map(|(s, v)| (*s, sub(v, v.first().copied().unwrap_or(0.0))))
            .collect(),
    }
}
