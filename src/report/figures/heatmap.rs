//! Gradient norm heatmap per configuration: one strip per site, grouped by layer (layer x step),
//! colour = log10 of the gradient norm, with the comparison's spike events circled. One shared
//! colour scale across configurations, so the heatmaps compare. A cell shows the largest value over
//! the configuration's seeds (and over the steps it covers when a long run has more steps than
//! columns), so binning never hides a spike; non-finite norms are red.

use super::*;
use crate::report::runs::RunData;
use std::collections::{BTreeMap, BTreeSet};

/// At most this many step columns; longer runs are binned (max per bin).
pub const MAX_COLS: usize = 400;
/// More site rows than this and sites are combined per layer (root of the sum of squares).
pub const MAX_SITE_ROWS: usize = 300;

/// The gradient norms of one configuration laid out for drawing.
#[derive(Debug, Clone, PartialEq)]
pub struct Grid {
    /// (layer, site) per row, bottom to top; site is empty when sites were combined per layer.
    pub rows: Vec<(i64, String)>,
    pub first_step: usize,
    /// Steps per column.
    pub bin: usize,
    pub cols: usize,
    /// Row-major `rows x cols`: the largest finite norm in the cell, if any.
    pub cells: Vec<Option<f64>>,
    /// Cells where some norm was NaN or infinite.
    pub non_finite: Vec<bool>,
}

impl Grid {
    /// Lay out the per-layer records of `runs` (one configuration, any number of seeds).
    pub fn build(runs: &[&RunData], max_cols: usize, max_site_rows: usize) -> Grid {
        let sites: BTreeSet<(i64, &str)> = runs
            .iter()
            .flat_map(|r| &r.layers)
            .map(|l| (l.layer, l.site.as_str()))
            .collect();
        let per_layer = sites.len() > max_site_rows;
        let key = |layer: i64, site: &str| -> (i64, String) {
            if per_layer {
                (layer, String::new())
            } else {
                (layer, site.to_string())
            }
        };
        let rows: Vec<(i64, String)> = sites
            .iter()
            .map(|(l, s)| key(*l, s))
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        let steps = runs.iter().flat_map(|r| &r.layers).map(|l| l.step);
        let (lo, hi) = steps.fold((usize::MAX, 0), |(a, b), s| (a.min(s), b.max(s)));
        let (first_step, n) = if lo == usize::MAX {
            (0, 1)
        } else {
            (lo, hi - lo + 1)
        };
        let bin = n.div_ceil(max_cols.max(1));
        let cols = n.div_ceil(bin);
        let index: BTreeMap<&(i64, String), usize> =
            rows.iter().enumerate().map(|(i, r)| (r, i)).collect();
        let mut cells = vec![None; rows.len() * cols];
        let mut non_finite = vec![false; rows.len() * cols];
        for run in runs {
            // Per run: combine sites into the row value (root of sum of squares when per layer).
            let mut sq: BTreeMap<(usize, usize), f64> = BTreeMap::new();
            for l in &run.layers {
                let row = index[&key(l.layer, &l.site)];
                let col = (l.step - first_step) / bin;
                if !l.grad_norm.is_finite() {
                    non_finite[row * cols + col] = true;
                    continue;
                }
                let e = sq.entry((row, l.step)).or_insert(0.0);
                *e += l.grad_norm * l.grad_norm;
            }
            for ((row, step), s) in sq {
                let v = s.sqrt();
                let c = &mut cells[row * cols + (step - first_step) / bin];
                *c = Some(c.map_or(v, |x: f64| x.max(v)));
            }
        }
        Grid {
            rows,
            first_step,
            bin,
            cols,
            cells,
            non_finite,
        }
    }

    /// The row of a spike's site and layer (its layer's middle row when sites were combined).
    pub fn row_of(&self, layer: i64, site: &str) -> Option<usize> {
        self.rows
            .iter()
            .position(|(l, s)| *l == layer && (s == site || s.is_empty()))
    }

    /// Each layer's rows as (layer, first row, row count), bottom to top.
    pub fn layer_groups(&self) -> Vec<(i64, usize, usize)> {
        let mut out: Vec<(i64, usize, usize)> = Vec::new();
        for (i, (l, _)) in self.rows.iter().enumerate() {
            match out.last_mut() {
                Some(g) if g.0 == *l => g.2 += 1,
                _ => out.push((*l, i, 1)),
            }
        }
        out
    }
}

/// Viridis, sampled at five points and interpolated linearly: perceptually ordered, colour-blind
/// safe, and free of red (kept for non-finite cells) and magenta (spike rings).
pub fn viridis(t: f64) -> RGBColor {
    const P: [(f64, f64, f64); 5] = [
        (68.0, 1.0, 84.0),
        (59.0, 82.0, 139.0),
        (33.0, 145.0, 140.0),
        (94.0, 201.0, 98.0),
        (253.0, 231.0, 37.0),
    ];
    let t = if t.is_finite() {
        t.clamp(0.0, 1.0)
    } else {
        0.0
    } * 4.0;
    let i = (t.floor() as usize).min(3);
    let f = t - i as f64;
    let mix = |a: f64, b: f64| (a + (b - a) * f).round() as u8;
    let (a, b) = (P[i], P[i + 1]);
    RGBColor(mix(a.0, b.0), mix(a.1, b.1), mix(a.2, b.2))
}

/// log10 range of every finite positive norm of every configuration (one scale for all heatmaps).
fn shared_log_range(runs: &[RunData]) -> (f64, f64) {
    let mut r: Option<(f64, f64)> = None;
    for l in runs.iter().flat_map(|r| &r.layers) {
        if l.grad_norm.is_finite() && l.grad_norm > 0.0 {
            let v = l.grad_norm.log10();
            r = Some(r.map_or((v, v), |(a, b)| (a.min(v), b.max(v))));
        }
    }
    match r {
        Some((a, b)) if b > a => (a, b),
        Some((a, _)) => (a - 0.5, a + 0.5),
        None => (-1.0, 1.0),
    }
}

fn layer_label(l: i64) -> String {
    if l < 0 {
        "embed/out".into()
    } else {
        format!("layer {l}")
    }
}

/// The heatmap of configuration `config` (display index `i`); nothing when it has no layer rows.
pub fn draw(ctx: &Ctx<'_>, dir: &Path, i: usize, config: &str) -> Result<Vec<Figure>, ReportError> {
    let runs: Vec<&RunData> = ctx
        .input
        .runs
        .iter()
        .filter(|r| r.config == config && r.finished() && !r.layers.is_empty())
        .collect();
    if runs.is_empty() {
        return Ok(vec![]);
    }
    let grid = Grid::build(&runs, MAX_COLS, MAX_SITE_ROWS);
    let (lmin, lmax) = shared_log_range(ctx.input.runs);
    let nrows = grid.rows.len();
    let row_px = (600 / nrows.max(1)).clamp(3, 14) as u32;
    let (w, h) = (WIDTH, 120 + row_px * nrows as u32 + 60);
    let file = format!("grad-heatmap-{}.png", slug(i, config));
    let spikes: Vec<&crate::compare::Spike> = ctx
        .cmp()
        .spikes
        .iter()
        .filter(|s| s.config == config)
        .collect();
    let groups = grid.layer_groups();
    let centers: Vec<f64> = groups
        .iter()
        .map(|(_, start, n)| *start as f64 + *n as f64 / 2.0)
        .collect();
    let label_at = |y: &f64| {
        groups
            .iter()
            .zip(&centers)
            .find(|(_, c)| (**c - y).abs() < 1e-6)
            .map(|((l, _, _), _)| layer_label(*l))
            .unwrap_or_default()
    };
    render(dir, &file, (w, h), |root| {
        root.fill(&WHITE)?;
        let (main, bar) = root.split_horizontally(w - 130);
        let x0 = grid.first_step as f64;
        let x1 = x0 + (grid.cols * grid.bin) as f64;
        let yr = KeyAxis::new(0f64..nrows as f64, centers.clone());
        let mut chart = ChartBuilder::on(&main)
            .caption(
                format!("Gradient norm per site and layer: {config}"),
                (crate::report::font::FAMILY, TITLE_PX),
            )
            .margin(12)
            .x_label_area_size(44)
            .y_label_area_size(90)
            .build_cartesian_2d(x0..x1, yr)?;
        chart
            .configure_mesh()
            .disable_mesh()
            .x_desc("step")
            .y_desc("layer (one strip per site)")
            .label_style((crate::report::font::FAMILY, LABEL_PX))
            .axis_desc_style((crate::report::font::FAMILY, AXIS_PX))
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_label_formatter(&label_at)
            .draw()?;
        chart.draw_series(std::iter::once(Rectangle::new(
            [(x0, 0.0), (x1, nrows as f64)],
            RGBColor(238, 238, 238).filled(),
        )))?;
        let span = lmax - lmin;
        chart.draw_series((0..nrows).flat_map(|r| {
            let grid = &grid;
            (0..grid.cols).filter_map(move |c| {
                let k = r * grid.cols + c;
                let color = if grid.non_finite[k] {
                    RGBColor(230, 0, 0)
                } else {
                    let v = grid.cells[k]?;
                    if v <= 0.0 {
                        return None;
                    }
                    viridis((v.log10() - lmin) / span)
                };
                let xa = x0 + (c * grid.bin) as f64;
                Some(Rectangle::new(
                    [(xa, r as f64), (xa + grid.bin as f64, r as f64 + 1.0)],
                    color.filled(),
                ))
            })
        }))?;
        // Thin white lines between layers.
        for (_, start, _) in groups.iter().skip(1) {
            chart.draw_series(std::iter::once(PathElement::new(
                vec![(x0, *start as f64), (x1, *start as f64)],
                WHITE.stroke_width(2),
            )))?;
        }
        for s in &spikes {
            let Some(row) = grid.row_of(s.layer, &s.site) else {
                continue;
            };
            let x = x0
                + ((s.step - grid.first_step.min(s.step)) / grid.bin * grid.bin) as f64
                + grid.bin as f64 / 2.0;
            let y = row as f64 + 0.5;
            chart.draw_series(std::iter::once(Circle::new(
                (x, y),
                8,
                WHITE.stroke_width(4),
            )))?;
            chart.draw_series(std::iter::once(Circle::new(
                (x, y),
                8,
                RGBColor(255, 0, 255).stroke_width(2),
            )))?;
        }
        colour_bar(&bar, lmin, lmax)?;
        Ok(())
    })?;
    let site_order: Vec<&str> = grid
        .rows
        .iter()
        .filter(|(l, _)| Some(*l) == groups.iter().map(|g| g.0).find(|l| *l >= 0))
        .map(|(_, s)| s.as_str())
        .collect();
    let strips = if grid.rows.iter().all(|(_, s)| s.is_empty()) {
        "one strip per layer (sites combined: root of the sum of squares)".to_string()
    } else {
        format!(
            "within each layer one strip per site, bottom to top: {}",
            site_order.join(", ")
        )
    };
    let binning = if grid.bin > 1 {
        format!(
            " Each column covers {} steps and shows their largest value.",
            grid.bin
        )
    } else {
        String::new()
    };
    Ok(vec![Figure {
        file,
        section: Section::Gradients,
        title: format!("Gradient norms: {config}"),
        caption: format!(
            "Gradient norm (L2, before clipping) per step, {strips}; colour is log10 of the norm on \
             a scale shared by all configurations (bar on the right); each cell is the largest \
             value over the {} seed(s).{binning} Magenta rings: gradient spikes found by the \
             comparison ({} here; see the spike table). Red: non-finite norms; grey: no data.",
            runs.len(),
            spikes.len()
        ),
        width: w,
        height: h,
    }])
}

/// Vertical colour bar for log10 norms.
fn colour_bar(area: &DrawingArea<BitMapBackend<'_>, Shift>, lmin: f64, lmax: f64) -> DrawResult {
    let mut chart = ChartBuilder::on(area)
        .caption("log10 norm", (crate::report::font::FAMILY, LABEL_PX))
        .margin_top(14)
        .margin_bottom(56)
        .margin_left(6)
        .margin_right(10)
        .right_y_label_area_size(56)
        .build_cartesian_2d(0f64..1f64, lmin..lmax)?;
    chart
        .configure_mesh()
        .disable_mesh()
        .disable_x_axis()
        .label_style((crate::report::font::FAMILY, LABEL_PX))
        .axis_desc_style((crate::report::font::FAMILY, AXIS_PX))
        .y_label_formatter(&|v| format!("{v:.1}"))
        .draw()?;
    let n = 100;
    chart.draw_series((0..n).map(|k| {
        let a = lmin + (lmax - lmin) * k as f64 / n as f64;
        let b = lmin + (lmax - lmin) * (k + 1) as f64 / n as f64;
        Rectangle::new(
            [(0.0, a), (1.0, b)],
            viridis(k as f64 / (n - 1) as f64).filled(),
        )
    }))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::metrics::LayerRecord;
    use crate::store::Manifest;

    fn run(seed: u64, rows: &[(usize, &str, i64, f64)]) -> RunData {
        RunData {
            dir: "x".into(),
            manifest: Manifest::start("r", "builtin", serde_json::json!({}), seed, 1, "cpu"),
            config: "c".into(),
            base: "c".into(),
            axes: Default::default(),
            layers: rows
                .iter()
                .map(|(step, site, layer, g)| LayerRecord {
                    step: *step,
                    site: site.to_string(),
                    layer: *layer,
                    precision: "nvfp4".into(),
                    grad_norm: *g,
                    saturated: 0,
                    underflowed: 0,
                })
                .collect(),
            perf: Default::default(),
        }
    }

    #[test]
    fn binning_keeps_the_spike_of_any_seed_and_flags_non_finite() {
        let mut a = Vec::new();
        for s in 0..1000 {
            a.push((s, "mlp.experts.linear_fc2", 5, 1.0));
            a.push((s, "mlp.router", 5, 0.5));
        }
        let mut b = a.clone();
        b[2 * 537].3 = 80.0; // seed b, step 537, fc2: a spike
        b[2 * 900 + 1].3 = f64::NAN;
        let (ra, rb) = (run(0, &a), run(1, &b));
        let g = Grid::build(&[&ra, &rb], 400, 300);
        assert_eq!(g.bin, 3);
        assert_eq!(g.cols, 334);
        let row = g.row_of(5, "mlp.experts.linear_fc2").unwrap();
        assert_eq!(
            g.cells[row * g.cols + 537 / 3],
            Some(80.0),
            "spike lost to binning"
        );
        let router = g.row_of(5, "mlp.router").unwrap();
        assert!(g.non_finite[router * g.cols + 300]);
        assert_eq!(g.cells[row * g.cols], Some(1.0));
    }

    #[test]
    fn too_many_sites_combine_per_layer_by_root_sum_of_squares() {
        let r = run(0, &[(0, "a", 0, 3.0), (0, "b", 0, 4.0), (0, "a", 1, 1.0)]);
        let g = Grid::build(&[&r], 400, 2);
        assert_eq!(g.rows, vec![(0, String::new()), (1, String::new())]);
        assert_eq!(g.cells[0], Some(5.0));
        assert_eq!(g.row_of(0, "b"), Some(0));
        assert_eq!(g.layer_groups(), vec![(0, 0, 1), (1, 1, 1)]);
    }

    #[test]
    fn viridis_runs_dark_to_light() {
        let lum = |c: RGBColor| 0.3 * c.0 as f64 + 0.59 * c.1 as f64 + 0.11 * c.2 as f64;
        let v: Vec<f64> = (0..=10).map(|k| lum(viridis(k as f64 / 10.0))).collect();
        assert!(v.windows(2).all(|w| w[1] > w[0]), "{v:?}");
    }
}
