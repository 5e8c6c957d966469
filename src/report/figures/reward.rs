//! Reward per configuration against BF16: one panel per low-precision configuration, each with the
//! baseline's band and its own (mean, bootstrap band over seeds, every seed's raw curve), on one
//! shared y axis so panels compare at a glance. Held-out accuracy gets the same figure when logged.

use super::*;

const PANEL_H: u32 = 330;

/// Reward (and eval accuracy) figures.
pub fn draw(ctx: &Ctx<'_>, dir: &Path) -> Result<Vec<Figure>, ReportError> {
    let mut out = Vec::new();
    for (metric, file, title, y) in [
        (
            "rollout/raw_reward",
            "reward.png",
            "Reward per configuration against the baseline",
            "mean reward per sample",
        ),
        (
            "eval/accuracy",
            "eval-accuracy.png",
            "Held-out accuracy per configuration against the baseline",
            "accuracy (fraction correct)",
        ),
    ] {
        if ctx.has_metric(metric) {
            out.push(vs_baseline(ctx, dir, metric, file, title, y)?);
        }
    }
    Ok(out)
}

/// Small multiples of `metric`: each configuration against the baseline.
pub fn vs_baseline(
    ctx: &Ctx<'_>,
    dir: &Path,
    metric: &str,
    file: &str,
    title: &str,
    y_desc: &str,
) -> Result<Figure, ReportError> {
    let base = ctx.baseline();
    let mut panels: Vec<&str> = ctx
        .with_band(metric)
        .into_iter()
        .filter(|c| *c != base)
        .collect();
    if panels.is_empty() {
        panels.push(base);
    }
    let cols = panels.len().min(3);
    let rows = panels.len().div_ceil(3);
    let names: Vec<&str> = std::iter::once(base)
        .chain(panels.iter().copied())
        .collect();
    let legend_h = legend_height(&names);
    let (w, h) = (WIDTH, legend_h + rows as u32 * PANEL_H);
    render(dir, file, (w, h), |root| {
        root.fill(&WHITE)?;
        let (top, grid) = root.split_vertically(legend_h);
        let entries: Vec<(String, RGBColor)> = names
            .iter()
            .map(|n| (n.to_string(), ctx.palette.color(n)))
            .collect();
        legend_strip(&top, &entries)?;
        let grid = grid.margin(0, 0, 0, 0);
        let cells = grid.split_evenly((rows, 3));
        let bands: Vec<&Band> = names.iter().filter_map(|c| ctx.band(c, metric)).collect();
        let xr = step_range(bands.iter().copied());
        let (lo, hi) = value_range(bands.iter().flat_map(|b| band_values(b))).unwrap_or((0.0, 1.0));
        for (cell, cfg) in cells.iter().zip(&panels) {
            let yr = padded(lo, hi);
            let fmt = axis_fmt(&yr);
            let mut chart = ChartBuilder::on(cell)
                .caption(*cfg, (super::super::font::FAMILY, 17))
                .margin(8)
                .x_label_area_size(44)
                .y_label_area_size(if cols == 1 { 70 } else { 64 })
                .build_cartesian_2d(xr.clone(), yr)?;
            mesh(&mut chart, "step", y_desc, &fmt)?;
            let order: &[&str] = if *cfg == base { &[base] } else { &[base, cfg] };
            for c in order {
                if let Some(b) = ctx.band(c, metric) {
                    draw_band(&mut chart, b, ctx.palette.color(c), None, CurveStyle::ALL)?;
                }
            }
        }
        Ok(())
    })?;
    Ok(Figure {
        file: file.to_string(),
        section: Section::Reward,
        title: title.to_string(),
        caption: format!(
            "`{metric}` per step. Each panel: one configuration (colour) against {base} (black). \
             Thick line: mean over seeds; shaded: bootstrap confidence band over seeds; thin lines: \
             each seed's raw curve (nothing is smoothed). All panels share the y axis."
        ),
        width: w,
        height: h,
    })
}
