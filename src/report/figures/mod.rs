//! Every figure of the report, one file per chart, drawn with plotters into PNGs in the report
//! folder. This module holds what the charts share: the drawing context (comparison, runs, palette),
//! the curve primitives (band, raw per-seed lines, mean), downsampling that keeps extremes, and the
//! colour legend strip.
//!
//! Conventions: 1200 px wide, readable at 100 % zoom (tick labels 15 px, axis titles 16 px, titles
//! 20 px); raw per-seed lines are always drawn under the mean and its band; a curve longer than
//! [`MAX_POINTS`] is thinned by keeping each bucket's min and max, so a one-step spike survives.

pub mod heatmap;
pub mod kl_ref;
pub mod mismatch;
pub mod reward;
pub mod sweep;
pub mod timings;

use super::palette::Palette;
use super::{ReportError, ReportInput};
use crate::compare::{Band, MetricComparison, SuiteComparison};
use plotters::coord::Shift;
use plotters::coord::ranged1d::{KeyPointHint, NoDefaultFormatting, Ranged, ValueFormatter};
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;
use rayon::prelude::*;
use std::path::Path;

/// Figure width in pixels.
pub const WIDTH: u32 = 1200;
/// Curves longer than this are thinned to min/max pairs per bucket.
pub const MAX_POINTS: usize = 2000;
/// Mean curves with at most this many points get a dot per point.
pub const SPARSE_POINTS: usize = 12;

pub const TITLE_PX: u32 = 20;
pub const LABEL_PX: u32 = 15;
pub const AXIS_PX: u32 = 16;

/// Error type inside a chart function (plotters' errors are generic over the backend).
pub type DrawResult<T = ()> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// Where a figure goes in the page.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Section {
    Reward,
    Mismatch,
    KlReference,
    Gradients,
    Timings,
    Sweeps,
}

/// A drawn figure: its PNG beside `index.html` and the words around it.
#[derive(Debug, Clone)]
pub struct Figure {
    /// File name in the report folder (ASCII, built by the report, never from user strings alone).
    pub file: String,
    pub section: Section,
    pub title: String,
    pub caption: String,
    pub width: u32,
    pub height: u32,
}

/// What every chart reads.
pub struct Ctx<'a> {
    pub input: &'a ReportInput<'a>,
    pub palette: Palette,
    /// Configurations in display order, baseline first.
    pub order: Vec<String>,
}

impl<'a> Ctx<'a> {
    pub fn new(input: &'a ReportInput<'a>) -> Ctx<'a> {
        let cmp = input.comparison;
        let mut order = vec![cmp.baseline_config.clone()];
        for c in &cmp.configs {
            if !order.contains(&c.config) {
                order.push(c.config.clone());
            }
        }
        let family = |name: &str| {
            input
                .runs
                .iter()
                .find(|r| r.config == name)
                .map(|r| r.base.clone())
                .unwrap_or_else(|| name.to_string())
        };
        let pairs: Vec<(String, String)> = order.iter().map(|c| (c.clone(), family(c))).collect();
        Ctx {
            palette: Palette::new(&pairs, &cmp.baseline_config),
            order,
            input,
        }
    }

    pub fn cmp(&self) -> &SuiteComparison {
        self.input.comparison
    }

    pub fn baseline(&self) -> &str {
        &self.input.comparison.baseline_config
    }

    /// One configuration's comparison on `metric`.
    pub fn metric(&self, config: &str, metric: &str) -> Option<&MetricComparison> {
        self.cmp()
            .configs
            .iter()
            .find(|c| c.config == config)
            .and_then(|c| c.metrics.iter().find(|m| m.metric == metric))
    }

    /// The curve of `config` on `metric`: its own band, or for the baseline the `baseline` band any
    /// comparison carries.
    pub fn band(&self, config: &str, metric: &str) -> Option<&Band> {
        if let Some(m) = self.metric(config, metric)
            && config != self.baseline()
        {
            return Some(&m.curve);
        }
        if config == self.baseline() {
            return self
                .cmp()
                .configs
                .iter()
                .flat_map(|c| &c.metrics)
                .find(|m| m.metric == metric)
                .map(|m| &m.baseline);
        }
        None
    }

    /// Whether any configuration has `metric`.
    pub fn has_metric(&self, metric: &str) -> bool {
        self.cmp()
            .configs
            .iter()
            .flat_map(|c| &c.metrics)
            .any(|m| m.metric == metric)
    }

    /// Configurations (display order) that have a curve for `metric`.
    pub fn with_band(&self, metric: &str) -> Vec<&str> {
        self.order
            .iter()
            .filter(|c| self.band(c, metric).is_some())
            .map(|c| c.as_str())
            .collect()
    }

    /// Whether the built-in engine's emulated timings are among the runs.
    pub fn emulated(&self) -> bool {
        self.input.runs.iter().any(|r| r.manifest.emulated)
    }
}

type Job<'a> = Box<dyn FnOnce() -> Result<Vec<Figure>, ReportError> + Send + 'a>;

/// Draw every figure into `dir` (in parallel) and return them in page order.
pub fn draw_all(input: &ReportInput<'_>, dir: &Path) -> Result<Vec<Figure>, ReportError> {
    super::font::ensure_registered().map_err(|msg| ReportError::Figure {
        file: "(font)".into(),
        msg,
    })?;
    let ctx = Ctx::new(input);
    let ctx = &ctx;
    let mut jobs: Vec<Job<'_>> = vec![
        Box::new(move || reward::draw(ctx, dir)),
        Box::new(move || mismatch::draw(ctx, dir)),
        Box::new(move || kl_ref::draw(ctx, dir)),
        Box::new(move || timings::draw(ctx, dir)),
        Box::new(move || sweep::draw(ctx, dir)),
    ];
    for (i, config) in ctx.order.iter().enumerate() {
        jobs.push(Box::new(move || heatmap::draw(ctx, dir, i, config)));
    }
    let drawn: Vec<Vec<Figure>> = jobs
        .into_par_iter()
        .map(|job| job())
        .collect::<Result<_, _>>()?;
    let mut figs: Vec<Figure> = drawn.into_iter().flatten().collect();
    figs.sort_by_key(|f| f.section);
    Ok(figs)
}

/// Draw a `w x h` figure with `draw` into an RGB buffer and write it as `dir/file` (PNG).
/// Encoding goes through the `png` crate's fast (fdeflate) mode rather than plotters' image
/// encoder: several times faster for these flat-colour charts, so the nightly report stays well
/// under its 10 s budget.
pub fn render(
    dir: &Path,
    file: &str,
    (w, h): (u32, u32),
    draw: impl FnOnce(&DrawingArea<BitMapBackend<'_>, Shift>) -> DrawResult,
) -> Result<(), ReportError> {
    let mut buf = vec![255u8; w as usize * h as usize * 3];
    (|| -> DrawResult {
        let root = BitMapBackend::with_buffer(&mut buf, (w, h)).into_drawing_area();
        draw(&root)?;
        root.present()?;
        Ok(())
    })()
    .map_err(fail(file))?;
    let png = encode_png(&buf, w, h).map_err(|e| ReportError::Figure {
        file: file.to_string(),
        msg: format!("PNG encoding: {e}"),
    })?;
    crate::io::atomic::write_file(&dir.join(file), &png)?;
    Ok(())
}

/// RGB8 pixels → PNG bytes.
pub fn encode_png(rgb: &[u8], w: u32, h: u32) -> Result<Vec<u8>, png::EncodingError> {
    let mut out = Vec::new();
    let mut enc = png::Encoder::new(&mut out, w, h);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    enc.set_compression(png::Compression::Fast);
    let mut writer = enc.write_header()?;
    writer.write_image_data(rgb)?;
    writer.finish()?;
    Ok(out)
}

/// Turn a chart's error into the report's, naming the file.
pub fn fail(file: &str) -> impl Fn(Box<dyn std::error::Error + Send + Sync>) -> ReportError + '_ {
    move |e| ReportError::Figure {
        file: file.to_string(),
        msg: e.to_string(),
    }
}

/// A file-name-safe slug of a config name (letters, digits and `-` only), prefixed by its index so
/// two names that slug alike still get different files.
pub fn slug(i: usize, name: &str) -> String {
    let s: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    let s = s
        .split('-')
        .filter(|p| !p.is_empty())
        .collect::<Vec<_>>()
        .join("-");
    let s: String = s.chars().take(60).collect();
    format!("{i:02}-{s}")
}

/// Thin `(x, y)` to at most `max` points by keeping each bucket's minimum and maximum in step
/// order: the shape, every spike and every dip survive. Non-finite values are dropped (they are
/// events in the run store, not points).
pub fn downsample(points: &[(f64, f64)], max: usize) -> Vec<(f64, f64)> {
    let finite: Vec<(f64, f64)> = points
        .iter()
        .copied()
        .filter(|(x, y)| x.is_finite() && y.is_finite())
        .collect();
    if finite.len() <= max || max < 4 {
        return finite;
    }
    let buckets = max / 2;
    let per = finite.len().div_ceil(buckets);
    let mut out = Vec::with_capacity(buckets * 2);
    for chunk in finite.chunks(per) {
        let (mut lo, mut hi) = (0, 0);
        for (i, p) in chunk.iter().enumerate() {
            if p.1 < chunk[lo].1 {
                lo = i;
            }
            if p.1 > chunk[hi].1 {
                hi = i;
            }
        }
        let (a, b) = if lo <= hi { (lo, hi) } else { (hi, lo) };
        out.push(chunk[a]);
        if b != a {
            out.push(chunk[b]);
        }
    }
    out
}

/// Steps and values zipped, downsampled, with values clamped up to `floor` (log axes).
pub fn series(steps: &[usize], values: &[f64], floor: Option<f64>) -> Vec<(f64, f64)> {
    let pts: Vec<(f64, f64)> = steps
        .iter()
        .zip(values)
        .map(|(s, v)| (*s as f64, floor.map_or(*v, |f| v.max(f))))
        .collect();
    downsample(&pts, MAX_POINTS)
}

/// Smallest and largest finite value over several slices (None when there is none).
pub fn value_range<'v>(vals: impl IntoIterator<Item = &'v [f64]>) -> Option<(f64, f64)> {
    let mut r: Option<(f64, f64)> = None;
    for v in vals
        .into_iter()
        .flatten()
        .copied()
        .filter(|v| v.is_finite())
    {
        r = Some(r.map_or((v, v), |(a, b)| (a.min(v), b.max(v))));
    }
    r
}

/// Smallest positive finite value (for log axes).
pub fn min_positive<'v>(vals: impl IntoIterator<Item = &'v [f64]>) -> Option<f64> {
    vals.into_iter()
        .flatten()
        .copied()
        .filter(|v| v.is_finite() && *v > 0.0)
        .reduce(f64::min)
}

/// A linear range with a little headroom (and a non-empty span).
pub fn padded(lo: f64, hi: f64) -> std::ops::Range<f64> {
    let span = (hi - lo).abs();
    let pad = if span > 0.0 {
        span * 0.06
    } else {
        lo.abs().max(1.0) * 0.1
    };
    (lo - pad)..(hi + pad)
}

/// All values of a band (mean, CI and every seed) for axis ranges.
pub fn band_values(b: &Band) -> Vec<&[f64]> {
    let mut v: Vec<&[f64]> = vec![&b.mean, &b.lo, &b.hi];
    v.extend(b.per_seed.iter().map(|(_, s)| s.as_slice()));
    v
}

/// The step range of several bands.
pub fn step_range<'b>(bands: impl IntoIterator<Item = &'b Band>) -> std::ops::Range<f64> {
    let mut hi = 1usize;
    let mut lo = usize::MAX;
    for b in bands {
        if let (Some(f), Some(l)) = (b.steps.first(), b.steps.last()) {
            lo = lo.min(*f);
            hi = hi.max(*l);
        }
    }
    if lo == usize::MAX {
        lo = 0;
    }
    lo as f64..(hi.max(lo + 1)) as f64
}

/// A linear f64 axis whose ticks sit exactly at given values (layer-group centres, sweep values);
/// plotters' own `with_key_points` has no value formatter for f64, so the mesh cannot label it.
#[derive(Clone)]
pub struct KeyAxis {
    inner: RangedCoordf64,
    keys: Vec<f64>,
}

impl KeyAxis {
    pub fn new(range: std::ops::Range<f64>, keys: Vec<f64>) -> KeyAxis {
        KeyAxis {
            inner: range.into(),
            keys,
        }
    }
}

impl Ranged for KeyAxis {
    type FormatOption = NoDefaultFormatting;
    type ValueType = f64;
    fn map(&self, v: &f64, limit: (i32, i32)) -> i32 {
        self.inner.map(v, limit)
    }
    fn key_points<H: KeyPointHint>(&self, hint: H) -> Vec<f64> {
        let max = hint.max_num_points().max(1);
        let every = self.keys.len().div_ceil(max).max(1);
        self.keys.iter().step_by(every).copied().collect()
    }
    fn range(&self) -> std::ops::Range<f64> {
        self.inner.range()
    }
}

impl ValueFormatter<f64> for KeyAxis {
    fn format(v: &f64) -> String {
        format!("{v}")
    }
}

/// Which layers of a curve to draw.
#[derive(Debug, Clone, Copy)]
pub struct CurveStyle {
    pub band: bool,
    pub seeds: bool,
    pub mean: bool,
}

impl CurveStyle {
    pub const ALL: CurveStyle = CurveStyle {
        band: true,
        seeds: true,
        mean: true,
    };
}

/// Draw one configuration's curve: CI band (filled, faint), each seed's raw line (thin), the mean
/// (thick). `floor` clamps values for log axes.
pub fn draw_band<Y: Ranged<ValueType = f64>>(
    chart: &mut ChartContext<'_, BitMapBackend<'_>, Cartesian2d<RangedCoordf64, Y>>,
    b: &Band,
    color: RGBColor,
    floor: Option<f64>,
    what: CurveStyle,
) -> DrawResult {
    if what.band
        && b.lo.len() == b.steps.len()
        && b.hi.len() == b.steps.len()
        && !b.steps.is_empty()
    {
        let mut poly = series(&b.steps, &b.hi, floor);
        let mut lower = series(&b.steps, &b.lo, floor);
        lower.reverse();
        poly.extend(lower);
        chart.draw_series(std::iter::once(Polygon::new(
            poly,
            color.mix(0.16).filled(),
        )))?;
    }
    if what.seeds {
        for (_, vals) in &b.per_seed {
            let n = vals.len().min(b.steps.len());
            chart.draw_series(LineSeries::new(
                series(&b.steps[..n], &vals[..n], floor),
                color.mix(0.45).stroke_width(1),
            ))?;
        }
    }
    if what.mean {
        let pts = series(&b.steps, &b.mean, floor);
        // Sparse curves (evaluation every N steps) get a dot per measured step, so a reader sees
        // where the data is and where the line only interpolates.
        if pts.len() <= SPARSE_POINTS {
            chart.draw_series(pts.iter().map(|p| Circle::new(*p, 4, color.filled())))?;
        }
        chart.draw_series(LineSeries::new(pts, color.stroke_width(3)))?;
    }
    Ok(())
}

/// Style a chart's mesh with the report's fonts; `x`/`y` are the axis titles (with units).
pub fn mesh<Y: Ranged<ValueType = f64> + ValueFormatter<f64>>(
    chart: &mut ChartContext<'_, BitMapBackend<'_>, Cartesian2d<RangedCoordf64, Y>>,
    x: &str,
    y: &str,
    y_fmt: &dyn Fn(&f64) -> String,
) -> DrawResult {
    chart
        .configure_mesh()
        .x_desc(x)
        .y_desc(y)
        .label_style((super::font::FAMILY, LABEL_PX))
        .axis_desc_style((super::font::FAMILY, AXIS_PX))
        .max_light_lines(1)
        .light_line_style(RGBColor(243, 243, 243))
        .bold_line_style(RGBColor(215, 215, 215))
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(y_fmt)
        .draw()?;
    Ok(())
}

/// Tick labels for a linear axis over `range`: as many decimals as the tick spacing needs (so
/// neighbouring ticks never print alike), scientific for tiny or huge magnitudes, and an exact
/// `0` instead of rounding noise like `7e-18`.
pub fn axis_fmt(range: &std::ops::Range<f64>) -> impl Fn(&f64) -> String + use<> {
    let span = (range.end - range.start).abs().max(f64::MIN_POSITIVE);
    let step = span / 10.0;
    let big = range.start.abs().max(range.end.abs());
    let sci = !(1e-3..1e5).contains(&big);
    let sig = ((big / step).log10().ceil().max(0.0) as usize).min(4);
    let dec = ((-step.log10()).ceil().max(0.0) as usize).min(8);
    move |v: &f64| {
        if v.abs() < step * 1e-6 {
            "0".into()
        } else if sci {
            format!("{v:.sig$e}")
        } else {
            format!("{v:.dec$}")
        }
    }
}

/// A row of colour swatches with configuration names across the top of a figure; wraps to more
/// rows when needed. Returns the height used.
pub fn legend_strip(
    area: &DrawingArea<BitMapBackend<'_>, Shift>,
    entries: &[(String, RGBColor)],
) -> DrawResult<u32> {
    let font: TextStyle<'_> = (super::font::FAMILY, LABEL_PX).into_font().into();
    let (w, _) = area.dim_in_pixel();
    let (mut x, mut y) = (12i32, 8i32);
    for (name, color) in entries {
        let (tw, _) = area.estimate_text_size(name, &font)?;
        let item = 34 + tw as i32 + 22;
        if x + item > w as i32 - 8 && x > 12 {
            x = 12;
            y += 24;
        }
        area.draw(&Rectangle::new(
            [(x, y + 6), (x + 26, y + 12)],
            color.filled(),
        ))?;
        area.draw(&Text::new(name.clone(), (x + 34, y), font.clone()))?;
        x += item;
    }
    Ok((y + 26) as u32)
}

/// Height a legend strip of these names needs at [`WIDTH`].
pub fn legend_height(names: &[&str]) -> u32 {
    // Estimate: ~8.5 px per character at 15 px DejaVu Sans, plus the swatch.
    let mut rows = 1;
    let mut x = 12;
    for n in names {
        let item = 34 + (n.chars().count() as u32 * 9) + 22;
        if x + item > WIDTH - 8 && x > 12 {
            rows += 1;
            x = 12;
        }
        x += item;
    }
    10 + rows * 24
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn downsampling_keeps_a_one_step_spike_and_the_endpoints_order() {
        let mut pts: Vec<(f64, f64)> = (0..100_000)
            .map(|i| (i as f64, 1.0 + (i % 7) as f64 * 0.01))
            .collect();
        pts[53_217].1 = 500.0;
        pts[80_001].1 = -3.0;
        let d = downsample(&pts, 1000);
        assert!(d.len() <= 1000, "{}", d.len());
        assert!(d.contains(&(53_217.0, 500.0)), "spike lost");
        assert!(d.contains(&(80_001.0, -3.0)), "dip lost");
        assert!(d.windows(2).all(|w| w[0].0 < w[1].0), "not in step order");
        // Short series are left alone; non-finite points dropped.
        let short = vec![(0.0, 1.0), (1.0, f64::NAN), (2.0, 3.0)];
        assert_eq!(downsample(&short, 1000), vec![(0.0, 1.0), (2.0, 3.0)]);
    }

    #[test]
    fn tick_labels_never_repeat_and_zero_prints_as_zero() {
        for (lo, hi) in [
            (0.0, 0.0055),
            (0.1, 0.8),
            (-0.05, 0.05),
            (1e-7, 5e-6),
            (0.0, 400.0),
        ] {
            let f = axis_fmt(&(lo..hi));
            let ticks: Vec<String> = (0..=10)
                .map(|i| f(&(lo + (hi - lo) * i as f64 / 10.0)))
                .collect();
            let uniq: std::collections::BTreeSet<&String> = ticks.iter().collect();
            assert_eq!(uniq.len(), ticks.len(), "{ticks:?}");
        }
        assert_eq!(axis_fmt(&(-0.05..0.05))(&7e-18), "0");
    }

    #[test]
    fn slugs_are_file_safe_and_distinct_by_index() {
        let s = slug(3, "<script>alert(1)</script> \"&'/../x");
        assert!(
            s.chars().all(|c| c.is_ascii_alphanumeric() || c == '-'),
            "{s}"
        );
        assert!(s.starts_with("03-"));
        assert_ne!(slug(1, "a b"), slug(2, "a/b"));
    }
}
