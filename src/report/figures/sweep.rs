//! Sweep-axis plots for ablations, e.g. train-rollout mismatch against the number of BF16 tail
//! layers: one figure per swept axis, one panel per tracked metric, x = the axis' values, y = the
//! comparison's final-window difference to the baseline with its confidence interval, one line per
//! configuration family (base configuration plus any other axes' values).

use super::*;
use std::collections::{BTreeMap, BTreeSet};

/// Metrics drawn against a sweep axis, in order of preference.
const METRICS: [(&str, &str); 4] = [
    ("train/train_rollout_kl", "train-rollout KL"),
    (
        "train/train_rollout_logprob_abs_diff",
        "logprob |train - rollout|",
    ),
    ("rollout/raw_reward", "reward"),
    ("train/kl_loss", "KL to reference"),
];

/// A readable x-axis title for the axes the suite format knows.
fn axis_desc(axis: &str) -> String {
    match axis {
        "bf16_last" => "layers kept in BF16 at the end (bf16_last)".into(),
        "bf16_first" => "layers kept in BF16 at the start (bf16_first)".into(),
        "shared_experts_bf16" => "shared experts kept in BF16 (shared_experts_bf16)".into(),
        "backward" => "backward operands (backward)".into(),
        other => other.to_string(),
    }
}

/// Values of an axis in display order: numeric when every value is a number, else first seen.
pub fn axis_values(values: &[String]) -> Vec<String> {
    let mut uniq: Vec<String> = Vec::new();
    for v in values {
        if !uniq.contains(v) {
            uniq.push(v.clone());
        }
    }
    if uniq.iter().all(|v| v.parse::<f64>().is_ok()) {
        uniq.sort_by(|a, b| {
            let (x, y) = (
                a.parse::<f64>().unwrap_or(0.0),
                b.parse::<f64>().unwrap_or(0.0),
            );
            x.total_cmp(&y)
        });
    }
    uniq
}

/// One line of a sweep plot: a family and its (axis value, config) points.
#[derive(Debug, Clone, PartialEq)]
pub struct SweepLine {
    pub label: String,
    /// The base configuration (its family hue colours the line).
    pub base: String,
    /// A member config (its colour stands for the line).
    pub color_of: String,
    pub points: Vec<(String, String)>,
}

/// Axis name → lines, from the runs' sweep axes (configs other than the baseline).
pub fn sweep_lines(ctx: &Ctx<'_>) -> BTreeMap<String, Vec<SweepLine>> {
    let mut meta: BTreeMap<&str, (&str, &BTreeMap<String, String>)> = BTreeMap::new();
    for r in ctx.input.runs {
        if r.config != ctx.baseline() && ctx.order.contains(&r.config) {
            meta.entry(&r.config).or_insert((&r.base, &r.axes));
        }
    }
    let axes: BTreeSet<&String> = meta.values().flat_map(|(_, a)| a.keys()).collect();
    let mut out = BTreeMap::new();
    for axis in axes {
        let mut lines: BTreeMap<String, SweepLine> = BTreeMap::new();
        for (config, (base, a)) in &meta {
            let Some(v) = a.get(axis) else { continue };
            let others: Vec<String> = a
                .iter()
                .filter(|(k, _)| *k != axis)
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            let label = if others.is_empty() {
                base.to_string()
            } else {
                format!("{base} [{}]", others.join(", "))
            };
            lines
                .entry(label.clone())
                .or_insert_with(|| SweepLine {
                    label,
                    base: base.to_string(),
                    color_of: config.to_string(),
                    points: vec![],
                })
                .points
                .push((v.clone(), config.to_string()));
        }
        let lines: Vec<SweepLine> = lines.into_values().collect();
        let distinct: BTreeSet<&String> = lines
            .iter()
            .flat_map(|l| l.points.iter().map(|p| &p.0))
            .collect();
        if distinct.len() >= 2 {
            out.insert(axis.clone(), lines);
        }
    }
    out
}

/// A line's colour: its family's hue when the family has one line on this axis, else the colour of
/// a member configuration (several lines of one family then stay distinct).
fn line_color(ctx: &Ctx<'_>, l: &SweepLine) -> RGBColor {
    if l.label == l.base {
        ctx.palette.family_color(&l.base)
    } else {
        ctx.palette.color(&l.color_of)
    }
}

/// One figure per swept axis (none for suites without sweeps).
pub fn draw(ctx: &Ctx<'_>, dir: &Path) -> Result<Vec<Figure>, ReportError> {
    let mut figs = Vec::new();
    for (k, (axis, lines)) in sweep_lines(ctx).into_iter().enumerate() {
        let metrics: Vec<(&str, &str)> = METRICS
            .iter()
            .copied()
            .filter(|(m, _)| {
                lines
                    .iter()
                    .any(|l| l.points.iter().any(|(_, c)| ctx.metric(c, m).is_some()))
            })
            .take(3)
            .collect();
        if metrics.is_empty() {
            continue;
        }
        let all_vals: Vec<String> = lines
            .iter()
            .flat_map(|l| l.points.iter().map(|p| p.0.clone()))
            .collect();
        let xs = axis_values(&all_vals);
        let labels: Vec<&str> = lines.iter().map(|l| l.label.as_str()).collect();
        let legend_h = legend_height(&labels);
        let (w, h) = (WIDTH, legend_h + 460);
        let file = format!("sweep-{}.png", slug(k, &axis));
        render(dir, &file, (w, h), |root| {
            root.fill(&WHITE)?;
            let (top, body) = root.split_vertically(legend_h);
            let entries: Vec<(String, RGBColor)> = lines
                .iter()
                .map(|l| (l.label.clone(), line_color(ctx, l)))
                .collect();
            legend_strip(&top, &entries)?;
            let cells = body.split_evenly((1, metrics.len()));
            for (cell, (metric, name)) in cells.iter().zip(&metrics) {
                panel(ctx, cell, &axis, &xs, &lines, metric, name)?;
            }
            Ok(())
        })?;
        figs.push(Figure {
            file,
            section: Section::Sweeps,
            title: format!("Sweep over {axis}"),
            caption: format!(
                "Final-window mean difference to {} (configuration minus baseline) against \
                 `{axis}`, with its confidence interval from the comparison (whiskers), for {}. \
                 Dashed grey: the equivalence margin where the suite sets one; solid grey: no \
                 difference.",
                ctx.baseline(),
                metrics
                    .iter()
                    .map(|(m, _)| format!("`{m}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            width: w,
            height: h,
        });
    }
    Ok(figs)
}

/// One metric's panel of a sweep figure.
fn panel(
    ctx: &Ctx<'_>,
    cell: &DrawingArea<BitMapBackend<'_>, Shift>,
    axis: &str,
    xs: &[String],
    lines: &[SweepLine],
    metric: &str,
    name: &str,
) -> DrawResult {
    let pts = |l: &SweepLine| -> Vec<(f64, crate::compare::Interval)> {
        let mut v: Vec<(f64, crate::compare::Interval)> = l
            .points
            .iter()
            .filter_map(|(x, c)| {
                let i = xs.iter().position(|v| v == x)?;
                Some((i as f64, ctx.metric(c, metric)?.final_diff))
            })
            .collect();
        v.sort_by(|a, b| a.0.total_cmp(&b.0));
        v
    };
    let margin = lines
        .iter()
        .flat_map(|l| &l.points)
        .find_map(|(_, c)| ctx.metric(c, metric).and_then(|m| m.margin));
    let mut vals: Vec<f64> = vec![0.0];
    for l in lines {
        for (_, iv) in pts(l) {
            vals.extend([iv.lo, iv.hi, iv.estimate]);
        }
    }
    if let Some(m) = margin {
        vals.extend([m, -m]);
    }
    let (lo, hi) = value_range([vals.as_slice()]).unwrap_or((-1.0, 1.0));
    let yr = padded(lo, hi);
    let fmt = axis_fmt(&yr);
    let n = xs.len();
    let xr = KeyAxis::new(-0.5f64..n as f64 - 0.5, (0..n).map(|i| i as f64).collect());
    let mut chart = ChartBuilder::on(cell)
        .caption(
            format!("Δ {name} vs {}", ctx.baseline()),
            (crate::report::font::FAMILY, TITLE_PX),
        )
        .margin(10)
        .x_label_area_size(48)
        .y_label_area_size(78)
        .build_cartesian_2d(xr, yr)?;
    chart
        .configure_mesh()
        .x_desc(axis_desc(axis))
        .y_desc("Δ final-window mean (config - baseline)")
        .label_style((crate::report::font::FAMILY, LABEL_PX))
        .axis_desc_style((crate::report::font::FAMILY, AXIS_PX))
        .max_light_lines(1)
        .light_line_style(RGBColor(243, 243, 243))
        .x_label_formatter(&|x| {
            xs.get(x.round().max(0.0) as usize)
                .cloned()
                .unwrap_or_default()
        })
        .y_label_formatter(&fmt)
        .draw()?;
    let (x0, x1) = (-0.5, n as f64 - 0.5);
    chart.draw_series(LineSeries::new(
        [(x0, 0.0), (x1, 0.0)],
        RGBColor(150, 150, 150),
    ))?;
    if let Some(m) = margin {
        for y in [m, -m] {
            chart.draw_series(DashedLineSeries::new(
                [(x0, y), (x1, y)],
                8,
                6,
                RGBColor(150, 150, 150).stroke_width(1),
            ))?;
        }
    }
    for (j, l) in lines.iter().enumerate() {
        let color = line_color(ctx, l);
        // Lines of different families side by side around each x, so whiskers do not overlap.
        let dx = (j as f64 - (lines.len() as f64 - 1.0) / 2.0) * 0.06;
        let p = pts(l);
        chart.draw_series(LineSeries::new(
            p.iter().map(|(x, iv)| (x + dx, iv.estimate)),
            color.stroke_width(2),
        ))?;
        // Whiskers: the interval plus short caps (plotters' ErrorBar needs a feature we skip).
        for (x, iv) in &p {
            let x = x + dx;
            for seg in [
                vec![(x, iv.lo), (x, iv.hi)],
                vec![(x - 0.04, iv.lo), (x + 0.04, iv.lo)],
                vec![(x - 0.04, iv.hi), (x + 0.04, iv.hi)],
            ] {
                chart.draw_series(std::iter::once(PathElement::new(
                    seg,
                    color.stroke_width(2),
                )))?;
            }
        }
        chart.draw_series(
            p.iter()
                .map(|(x, iv)| Circle::new((x + dx, iv.estimate), 5, color.filled())),
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numeric_axis_values_sort_as_numbers() {
        let v: Vec<String> = ["8", "2", "4", "2"].iter().map(|s| s.to_string()).collect();
        assert_eq!(axis_values(&v), vec!["2", "4", "8"]);
        let v: Vec<String> = ["quantized", "dequantized", "high-precision"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(axis_values(&v), v, "categorical values keep their order");
    }
}
