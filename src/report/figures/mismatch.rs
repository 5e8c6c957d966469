//! Train-rollout mismatch: mean |logp_train - logp_rollout| and the k3 KL between the trainer's and
//! the rollout's policy, every configuration on one log-scale axis per metric (a format's mismatch
//! differs from BF16's by orders of magnitude, which a linear axis would flatten to zero).

use super::*;

/// Panels of several configurations on log axes, one panel per metric; used for mismatch and for
/// the raw KL to the reference.
pub struct LogPanel<'m> {
    pub metric: &'m str,
    pub title: &'m str,
    pub y_desc: &'m str,
}

/// Train-rollout mismatch figure.
pub fn draw(ctx: &Ctx<'_>, dir: &Path) -> Result<Vec<Figure>, ReportError> {
    let panels: Vec<LogPanel<'_>> = [
        LogPanel {
            metric: "train/train_rollout_logprob_abs_diff",
            title: "logprob |train - rollout|",
            y_desc: "mean |Δ logprob| (nats, log scale)",
        },
        LogPanel {
            metric: "train/train_rollout_kl",
            title: "train-rollout KL (k3)",
            y_desc: "KL (nats, log scale)",
        },
    ]
    .into_iter()
    .filter(|p| ctx.has_metric(p.metric))
    .collect();
    if panels.is_empty() {
        return Ok(vec![]);
    }
    let file = "mismatch.png";
    let (w, h, floor) = log_panels(ctx, dir, file, &panels)?;
    Ok(vec![Figure {
        file: file.into(),
        section: Section::Mismatch,
        title: "Train-rollout mismatch".into(),
        caption: format!(
            "How far the trainer's log-probabilities are from the rollout's on the same samples \
             (`{}`), per step, all configurations on a log scale. Thick: mean over seeds; shaded: \
             bootstrap band; thin: each seed's raw curve.{}",
            panels
                .iter()
                .map(|p| p.metric)
                .collect::<Vec<_>>()
                .join("`, `"),
            floor_note(floor)
        ),
        width: w,
        height: h,
    }])
}

/// Words for values drawn at the log axis floor.
pub fn floor_note(floor: Option<f64>) -> String {
    match floor {
        Some(f) => {
            format!(" Values at or below {f:.1e} (zero included) are drawn at the axis floor.")
        }
        None => String::new(),
    }
}

/// Draw `panels` side by side on log y axes; returns the size and the floor used.
pub fn log_panels(
    ctx: &Ctx<'_>,
    dir: &Path,
    file: &str,
    panels: &[LogPanel<'_>],
) -> Result<(u32, u32, Option<f64>), ReportError> {
    let names: Vec<&str> = ctx
        .order
        .iter()
        .map(|c| c.as_str())
        .filter(|c| panels.iter().any(|p| ctx.band(c, p.metric).is_some()))
        .collect();
    let legend_h = legend_height(&names);
    let (w, h) = (WIDTH, legend_h + 460);
    let mut floor_used = None;
    render(dir, file, (w, h), |root| {
        root.fill(&WHITE)?;
        let (top, body) = root.split_vertically(legend_h);
        let entries: Vec<(String, RGBColor)> = names
            .iter()
            .map(|n| (n.to_string(), ctx.palette.color(n)))
            .collect();
        legend_strip(&top, &entries)?;
        let cells = body.split_evenly((1, panels.len()));
        for (cell, p) in cells.iter().zip(panels) {
            let bands: Vec<(&str, &Band)> = names
                .iter()
                .filter_map(|c| ctx.band(c, p.metric).map(|b| (*c, b)))
                .collect();
            if let Some(f) = log_panel(cell, ctx, &bands, p.title, p.y_desc)? {
                floor_used = Some(f);
            }
        }
        Ok(())
    })?;
    Ok((w, h, floor_used))
}

/// One log-y panel of several configurations' curves. Returns the floor when some value was at or
/// below zero and had to be drawn there.
pub fn log_panel(
    cell: &DrawingArea<BitMapBackend<'_>, Shift>,
    ctx: &Ctx<'_>,
    bands: &[(&str, &Band)],
    title: &str,
    y_desc: &str,
) -> DrawResult<Option<f64>> {
    let xr = step_range(bands.iter().map(|(_, b)| *b));
    let vals: Vec<&[f64]> = bands.iter().flat_map(|(_, b)| band_values(b)).collect();
    let minp = min_positive(vals.iter().copied()).unwrap_or(1e-8);
    let (_, maxv) = value_range(vals.iter().copied()).unwrap_or((minp, minp * 10.0));
    let any_nonpos = vals
        .iter()
        .flat_map(|v| v.iter())
        .any(|v| v.is_finite() && *v <= 0.0);
    let floor = minp / 2.0;
    let top_v = maxv.max(floor * 10.0) * 2.0;
    let mut chart = ChartBuilder::on(cell)
        .caption(title, (super::super::font::FAMILY, TITLE_PX))
        .margin(10)
        .x_label_area_size(44)
        .y_label_area_size(78)
        .build_cartesian_2d(xr, (floor..top_v).log_scale())?;
    mesh(&mut chart, "step", y_desc, &log_tick)?;
    draw_layers(&mut chart, ctx, bands, Some(floor))?;
    Ok(any_nonpos.then_some(floor))
}

/// Log-axis tick labels: only mantissas 1, 2 and 5 are labelled, so the minor ticks plotters puts
/// just below each power of ten do not print on top of each other.
pub fn log_tick(v: &f64) -> String {
    if *v <= 0.0 || !v.is_finite() {
        return String::new();
    }
    let e = v.log10().floor();
    let m = v / 10f64.powf(e);
    let m = if m > 9.5 { 1.0 } else { m };
    if [1.0, 2.0, 5.0].iter().any(|x| (m - x).abs() < 0.05) {
        format!("{v:.0e}")
    } else {
        String::new()
    }
}

/// One linear-y panel of several configurations' curves.
pub fn linear_panel(
    cell: &DrawingArea<BitMapBackend<'_>, Shift>,
    ctx: &Ctx<'_>,
    bands: &[(&str, &Band)],
    title: &str,
    y_desc: &str,
) -> DrawResult {
    let xr = step_range(bands.iter().map(|(_, b)| *b));
    let vals: Vec<&[f64]> = bands.iter().flat_map(|(_, b)| band_values(b)).collect();
    let (lo, hi) = value_range(vals.iter().copied()).unwrap_or((0.0, 1.0));
    let yr = padded(lo, hi);
    let fmt = axis_fmt(&yr);
    let mut chart = ChartBuilder::on(cell)
        .caption(title, (super::super::font::FAMILY, TITLE_PX))
        .margin(10)
        .x_label_area_size(44)
        .y_label_area_size(78)
        .build_cartesian_2d(xr, yr)?;
    mesh(&mut chart, "step", y_desc, &fmt)?;
    draw_layers(&mut chart, ctx, bands, None)
}

/// Bands of every configuration first, then raw seeds, then means, so no mean hides under a band.
fn draw_layers<Y: Ranged<ValueType = f64>>(
    chart: &mut ChartContext<'_, BitMapBackend<'_>, Cartesian2d<RangedCoordf64, Y>>,
    ctx: &Ctx<'_>,
    bands: &[(&str, &Band)],
    floor: Option<f64>,
) -> DrawResult {
    for what in [
        CurveStyle {
            band: true,
            seeds: false,
            mean: false,
        },
        CurveStyle {
            band: false,
            seeds: true,
            mean: false,
        },
        CurveStyle {
            band: false,
            seeds: false,
            mean: true,
        },
    ] {
        for (c, b) in bands {
            draw_band(chart, b, ctx.palette.color(c), floor, what)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::log_tick;

    #[test]
    fn log_ticks_label_one_two_five_only() {
        assert_eq!(log_tick(&1e-3), "1e-3");
        assert_eq!(log_tick(&2e-3), "2e-3");
        assert_eq!(log_tick(&0.005), "5e-3");
        assert_eq!(log_tick(&9e-3), "");
        assert_eq!(log_tick(&7e-3), "");
        assert_eq!(log_tick(&0.0), "");
    }
}
