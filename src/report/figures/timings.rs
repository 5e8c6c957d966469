//! Rollout, train and weight-export time per configuration, read from the runs' `perf/*` series.
//! The built-in engine emulates the low-precision formats on the CPU, so its timings say what the
//! emulation costs, not what Blackwell hardware would do; the figure says "emulated" in its title
//! whenever a run's manifest does.

use super::*;
use crate::report::runs::RunData;

const PHASES: [(&str, &str); 3] = [
    ("perf/rollout_time", "rollout"),
    ("perf/train_time", "train"),
    ("perf/export_time", "weight export"),
];

/// Per seed: the mean of a `perf/*` series over its steps.
fn per_seed_means(runs: &[&RunData], key: &str) -> Vec<f64> {
    runs.iter()
        .filter_map(|r| {
            let v: Vec<f64> = r
                .perf
                .get(key)?
                .iter()
                .map(|(_, x)| *x)
                .filter(|x| x.is_finite())
                .collect();
            (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
        })
        .collect()
}

/// The timing figure (absent when no run logged `perf/*` phases).
pub fn draw(ctx: &Ctx<'_>, dir: &Path) -> Result<Vec<Figure>, ReportError> {
    let by_config: Vec<(&str, Vec<Vec<f64>>)> = ctx
        .order
        .iter()
        .map(|c| {
            let runs: Vec<&RunData> = ctx
                .input
                .runs
                .iter()
                .filter(|r| r.config == *c && r.finished())
                .collect();
            let phases = PHASES
                .iter()
                .map(|(k, _)| per_seed_means(&runs, k))
                .collect();
            (c.as_str(), phases)
        })
        .filter(|(_, p): &(&str, Vec<Vec<f64>>)| p.iter().any(|v| !v.is_empty()))
        .collect();
    if by_config.is_empty() {
        return Ok(vec![]);
    }
    let emulated = ctx.emulated();
    let names: Vec<&str> = by_config.iter().map(|(c, _)| *c).collect();
    let legend_h = legend_height(&names);
    let (w, h) = (WIDTH, legend_h + 470);
    let file = "timings.png";
    let n = by_config.len();
    render(dir, file, (w, h), |root| {
        root.fill(&WHITE)?;
        let (top, body) = root.split_vertically(legend_h);
        let entries: Vec<(String, RGBColor)> = names
            .iter()
            .map(|c| (c.to_string(), ctx.palette.color(c)))
            .collect();
        legend_strip(&top, &entries)?;
        let cells = body.split_evenly((1, PHASES.len()));
        for (p, (cell, (_, phase))) in cells.iter().zip(PHASES.iter()).enumerate() {
            let max = by_config
                .iter()
                .flat_map(|(_, v)| v[p].iter().copied())
                .fold(0.0f64, f64::max);
            let title = if emulated {
                format!("{phase} (emulated)")
            } else {
                phase.to_string()
            };
            let yr = 0f64..(max * 1.12).max(1e-9);
            let fmt = axis_fmt(&yr);
            let mut chart = ChartBuilder::on(cell)
                .caption(title, (crate::report::font::FAMILY, TITLE_PX))
                .margin(10)
                .x_label_area_size(44)
                .y_label_area_size(78)
                .build_cartesian_2d(0f64..n as f64, yr)?;
            chart
                .configure_mesh()
                .disable_x_mesh()
                .x_labels(0)
                .x_desc("configuration (colours as in the legend)")
                .y_desc("seconds per step")
                .label_style((crate::report::font::FAMILY, LABEL_PX))
                .axis_desc_style((crate::report::font::FAMILY, AXIS_PX))
                .max_light_lines(1)
                .light_line_style(RGBColor(243, 243, 243))
                .y_label_formatter(&fmt)
                .draw()?;
            for (i, (c, v)) in by_config.iter().enumerate() {
                let seeds = &v[p];
                if seeds.is_empty() {
                    continue;
                }
                let mean = seeds.iter().sum::<f64>() / seeds.len() as f64;
                let color = ctx.palette.color(c);
                let x = i as f64;
                chart.draw_series(std::iter::once(Rectangle::new(
                    [(x + 0.15, 0.0), (x + 0.85, mean)],
                    color.mix(0.75).filled(),
                )))?;
                let k = seeds.len().max(1) as f64;
                chart.draw_series(seeds.iter().enumerate().map(|(j, s)| {
                    let dx = 0.3 + 0.4 * (j as f64 + 0.5) / k;
                    Circle::new((x + dx, *s), 4, BLACK.filled())
                }))?;
            }
        }
        Ok(())
    })?;
    let title = if emulated {
        "Time per step (emulated: CPU emulation of the formats, not hardware timings)"
    } else {
        "Time per step"
    };
    let note = if emulated {
        " These runs used the built-in engine, whose manifests say `emulated`: low-precision \
         formats are emulated on the CPU, so these times measure the emulation, not Blackwell \
         hardware."
    } else {
        ""
    };
    Ok(vec![Figure {
        file: file.into(),
        section: Section::Timings,
        title: title.into(),
        caption: format!(
            "Seconds per step spent in rollout (`perf/rollout_time`), training \
             (`perf/train_time`) and weight export (`perf/export_time`). Bar: mean over seeds of \
             each seed's mean over steps; dots: each seed.{note}"
        ),
        width: w,
        height: h,
    }])
}
