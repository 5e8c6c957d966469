//! The report page: one HTML file with no external resources (figures inline as base64 PNG, CSS
//! inline), safe to open from anywhere. Strings from suites, configurations and runs reach the page
//! only through [`Html::text`], which escapes them; markup can only be added from `&'static str`
//! literals ([`Html::raw`]), so a run named `<script>` stays text by construction. The page also
//! carries a Content-Security-Policy that allows no script, no network and only `data:` images.

use super::figures::{Ctx, Figure, Section};
use super::{ReportError, ReportInput};
use crate::compare::{ClaimResult, ClaimVerdict, MetricComparison, Verdict};
use crate::io::IoError;
use base64::Engine;
use std::collections::BTreeSet;
use std::path::Path;

/// Escape text for HTML content and attribute values.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// A page under construction: literal markup or escaped text, nothing else.
#[derive(Default)]
pub struct Html(String);

impl Html {
    /// Markup written in this crate's source (a literal, never data).
    pub fn raw(&mut self, s: &'static str) -> &mut Self {
        self.0.push_str(s);
        self
    }

    /// Text from anywhere, escaped.
    pub fn text(&mut self, s: &str) -> &mut Self {
        self.0.push_str(&escape(s));
        self
    }

    /// Text where `backticked` parts become `<code>`.
    pub fn rich(&mut self, s: &str) -> &mut Self {
        for (i, part) in s.split('`').enumerate() {
            if i % 2 == 1 {
                self.raw("<code>").text(part).raw("</code>");
            } else {
                self.text(part);
            }
        }
        self
    }

    /// A table cell with text.
    pub fn td(&mut self, s: &str) -> &mut Self {
        self.raw("<td>").text(s).raw("</td>")
    }

    /// A numeric cell with an estimate over its interval (two short lines keep tables narrow).
    pub fn ci(&mut self, iv: &crate::compare::Interval) -> &mut Self {
        self.raw("<td class=\"n\">")
            .text(&fmt_g(iv.estimate))
            .raw("<br><span class=\"ci\">[")
            .text(&format!("{}, {}", fmt_g(iv.lo), fmt_g(iv.hi)))
            .raw("]</span></td>")
    }

    /// A right-aligned numeric cell.
    pub fn num(&mut self, s: &str) -> &mut Self {
        self.raw("<td class=\"n\">").text(s).raw("</td>")
    }

    pub fn into_string(self) -> String {
        self.0
    }
}

/// Numbers in tables: 4 significant digits, scientific when tiny or huge.
pub fn fmt_g(x: f64) -> String {
    let a = x.abs();
    if !x.is_finite() {
        format!("{x}")
    } else if x == 0.0 {
        "0".into()
    } else if !(1e-3..1e5).contains(&a) {
        format!("{x:.3e}")
    } else {
        let digits = (3 - a.log10().floor() as i32).max(0) as usize;
        format!("{x:.digits$}")
    }
}

const STYLE: &str = r#"<style>
body{font-family:"DejaVu Sans",Verdana,system-ui,sans-serif;margin:0 auto;max-width:1260px;padding:16px 20px 40px;color:#1a1a1a;line-height:1.45;font-size:16px}
h1{font-size:26px;margin:8px 0 4px}h2{font-size:21px;margin:34px 0 8px;border-bottom:1px solid #ddd;padding-bottom:4px}h3{font-size:18px;margin:22px 0 6px}
.badge{display:inline-block;padding:3px 12px;border-radius:4px;font-weight:bold;color:#fff}
.pass,.equivalent,.improved,.reproduced{background:#2a7d2e}.regression,.regressed,.contradicted{background:#c62828}.inconclusive,.pending{background:#8a6d00}.described{background:#4a5a6a}
td .badge{font-size:13px;padding:1px 8px}
.summary{font-size:17px;background:#f6f8fa;border:1px solid #e1e4e8;border-radius:6px;padding:10px 18px}
.summary li{margin:4px 0}
table{border-collapse:collapse;margin:8px 0;font-size:13px}.scroll{overflow-x:auto}th,td{border:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top}th{background:#f3f3f3}
td.n{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}.ci{color:#555;font-size:12px}td.why{min-width:200px}
.sw{display:inline-block;width:14px;height:14px;border-radius:3px;vertical-align:-2px;margin-right:6px;border:1px solid #0003}
.keys span{margin-right:18px;white-space:nowrap}
figure{margin:14px 0 26px}figure img{max-width:100%;height:auto;border:1px solid #eee}figcaption{font-size:14px;color:#333;max-width:1200px}
code{background:#f3f3f3;padding:0 3px;border-radius:3px;font-size:90%}
nav a{margin-right:14px}.muted{color:#666}dl{display:grid;grid-template-columns:max-content auto;gap:2px 16px}dt{font-weight:bold}dd{margin:0}
</style>"#;

/// A colour swatch and the config name.
fn swatch(h: &mut Html, ctx: &Ctx<'_>, config: &str) {
    h.raw("<span class=\"sw\" style=\"background:")
        .text(&ctx.palette.hex(config))
        .raw("\"></span>")
        .text(config);
}

fn verdict_badge(h: &mut Html, v: Verdict) {
    let (class, word): (&'static str, &str) = match v {
        Verdict::Equivalent => ("equivalent", "equivalent"),
        Verdict::Regressed => ("regressed", "regressed"),
        Verdict::Improved => ("improved", "improved"),
        Verdict::Inconclusive => ("inconclusive", "inconclusive"),
        Verdict::Higher | Verdict::Lower | Verdict::NoDifference => ("described", v.words()),
    };
    h.raw("<span class=\"badge ")
        .raw(class)
        .raw("\">")
        .text(word)
        .raw("</span>");
}

/// Build the page; figures are read back from `dir` and inlined.
pub fn page(input: &ReportInput<'_>, figs: &[Figure], dir: &Path) -> Result<String, ReportError> {
    let ctx = Ctx::new(input);
    let cmp = input.comparison;
    let mut h = Html::default();
    h.raw("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n")
        .raw("<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; img-src data:; style-src 'unsafe-inline'\">\n")
        .raw("<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n<title>lockstep report: ")
        .text(&cmp.suite)
        .raw("</title>\n")
        .raw(STYLE)
        .raw("</head><body>\n<h1>lockstep report: ")
        .text(&cmp.suite)
        .raw(" ");
    let state = cmp.headline_state();
    let class: &'static str = match state.as_str() {
        "pass" => "pass",
        "regression" | "error" => "regression",
        _ => "inconclusive",
    };
    h.raw("<span class=\"badge ")
        .raw(class)
        .raw("\">")
        .text(&state.to_uppercase())
        .raw("</span></h1>\n");
    if !input.spec.description.is_empty() {
        h.raw("<p class=\"muted\">")
            .text(&input.spec.description)
            .raw("</p>\n");
    }
    findings_section(&mut h, &ctx, figs);
    summary_section(&mut h, &ctx);
    h.raw("<nav><a href=\"#findings\">Findings</a><a href=\"#verdicts\">Verdicts</a><a href=\"#checks\">Checks</a><a href=\"#figures\">Figures</a><a href=\"#spikes\">Spikes</a><a href=\"#contract\">Contract</a><a href=\"#method\">Method</a><a href=\"#metadata\">Metadata</a></nav>\n");
    verdict_section(&mut h, &ctx);
    checks_section(&mut h, &ctx);
    figure_sections(&mut h, &ctx, figs, dir)?;
    contract_section(&mut h, &ctx);
    method_section(&mut h, &ctx);
    metadata_section(&mut h, &ctx);
    h.raw("</body></html>\n");
    Ok(h.into_string())
}

/// The suite's published findings first: one line per claim with its verdict, the evidence in
/// numbers and a link to the figure that shows it.
fn findings_section(h: &mut Html, ctx: &Ctx<'_>, figs: &[Figure]) {
    let claims = &ctx.cmp().claims;
    if claims.is_empty() {
        return;
    }
    h.raw("<section id=\"findings\"><h2>Findings</h2>\n<p>Published findings held against these runs \
           (see Method for the tests and how several configurations of one claim are combined).</p>\n<ul>\n");
    for c in claims {
        let class: &'static str = match c.verdict {
            ClaimVerdict::Reproduced => "reproduced",
            ClaimVerdict::Contradicted => "contradicted",
            ClaimVerdict::Inconclusive => "inconclusive",
        };
        h.raw("<li><span class=\"badge ")
            .raw(class)
            .raw("\">")
            .text(c.verdict.words())
            .raw("</span> <b>")
            .text(&c.name)
            .raw("</b>");
        if c.gate {
            h.raw(" <span class=\"muted\">(gate)</span>");
        }
        h.raw(": &ldquo;")
            .text(&c.statement)
            .raw("&rdquo; <span class=\"muted\">(")
            .text(&c.source)
            .raw(")</span><br><code>")
            .text(&c.predicate)
            .raw("</code>: ")
            .text(&c.evidence)
            .raw(" <a href=\"#")
            .raw(claim_anchor(c, figs))
            .raw("\">")
            .text(&claim_figure(c, figs))
            .raw("</a></li>\n");
    }
    h.raw("</ul></section>\n");
}

/// The page section that shows a claim's evidence.
fn claim_section(c: &ClaimResult, figs: &[Figure]) -> Option<Section> {
    let m = c.metric.to_ascii_lowercase();
    let has = |s: Section| figs.iter().any(|f| f.section == s);
    let trend = matches!(c.expect.as_str(), "decreasing" | "increasing");
    let s = if c.expect == "spike_rate_higher" {
        Section::Gradients
    } else if trend && has(Section::Sweeps) {
        Section::Sweeps
    } else if m.contains("reward") || m.contains("accuracy") {
        Section::Reward
    } else if m.contains("kl_loss") {
        Section::KlReference
    } else if m.contains("kl") || m.contains("diff") || m.contains("prob_error") {
        Section::Mismatch
    } else if m.contains("grad") {
        Section::Gradients
    } else if m.starts_with("perf/") {
        Section::Timings
    } else {
        return None;
    };
    Some(s)
}

/// The anchor a claim links to: its section when it has figures, else the spike or verdict table.
fn claim_anchor(c: &ClaimResult, figs: &[Figure]) -> &'static str {
    if c.expect == "spike_rate_higher" {
        return "spikes";
    }
    match claim_section(c, figs) {
        Some(s) if figs.iter().any(|f| f.section == s) => section_heading(s).0,
        _ => "verdicts",
    }
}

/// The words of a claim's link: the figure that shows its metric, else the table.
fn claim_figure(c: &ClaimResult, figs: &[Figure]) -> String {
    if c.expect == "spike_rate_higher" {
        return "figure: gradient spike table".into();
    }
    let Some(s) = claim_section(c, figs) else {
        return "table: verdicts".into();
    };
    let mut in_section = figs.iter().filter(|f| f.section == s);
    let named = figs.iter().filter(|f| f.section == s).find(|f| {
        !c.metric.is_empty() && (f.title.contains(&c.metric) || f.caption.contains(&c.metric))
    });
    match named.or_else(|| in_section.next()) {
        Some(f) => format!("figure: {}", f.title),
        None => "table: verdicts".into(),
    }
}

fn summary_section(h: &mut Html, ctx: &Ctx<'_>) {
    h.raw("<section id=\"summary\"><div class=\"summary\"><ul>\n");
    for s in super::summary::sentences(ctx.cmp(), ctx.emulated()) {
        h.raw("<li>").rich(&s).raw("</li>\n");
    }
    h.raw("</ul></div>\n<p class=\"keys\">Colours: ");
    for c in &ctx.order {
        h.raw("<span>");
        swatch(h, ctx, c);
        if c == ctx.baseline() {
            h.text(" (baseline)");
        }
        h.raw("</span>");
    }
    h.raw("</p></section>\n");
}

fn verdict_section(h: &mut Html, ctx: &Ctx<'_>) {
    let cmp = ctx.cmp();
    h.raw("<section id=\"verdicts\"><h2>Verdicts against ")
        .text(ctx.baseline())
        .raw("</h2>\n<p>Every configuration and tracked metric against the baseline over seeds. \
              Differences are configuration minus baseline; brackets are confidence intervals \
              from the comparison.</p>\n")
        .raw("<div class=\"scroll\"><table><tr><th>configuration</th><th>metric</th><th>verdict</th><th>Δ final-window mean</th><th>Δ area under curve, per step</th><th>IQM, final window</th><th>P(config beats baseline)</th><th>KL: step-0 offset, drift</th><th>why</th></tr>\n");
    for c in cmp.configs.iter().filter(|c| c.config != ctx.baseline()) {
        for m in &c.metrics {
            verdict_row(h, ctx, &c.config, m);
        }
    }
    h.raw("</table></div></section>\n");
}

fn verdict_row(h: &mut Html, ctx: &Ctx<'_>, config: &str, m: &MetricComparison) {
    h.raw("<tr><td>");
    swatch(h, ctx, config);
    h.raw("</td><td><code>")
        .text(&m.metric)
        .raw("</code><br><span class=\"ci\">");
    h.text(if m.higher_is_better {
        "higher is better"
    } else {
        "lower is better"
    });
    h.raw("</span></td><td>");
    verdict_badge(h, m.verdict);
    h.raw("<br><span class=\"ci\">margin ")
        .text(&m.margin.map_or("none".into(), |x| format!("±{x}")))
        .raw("</span></td>")
        .ci(&m.final_diff)
        .ci(&m.auc_diff)
        .num(&fmt_g(m.iqm))
        .num(&format!("{:.2}", m.prob_improvement));
    match &m.kl {
        Some(k) => h
            .raw("<td class=\"n\">offset ")
            .text(&fmt_g(k.step0_offset))
            .raw("<br><span class=\"ci\">drift ")
            .text(&fmt_g(k.drift.estimate))
            .raw("/step<br>[")
            .text(&format!("{}, {}", fmt_g(k.drift.lo), fmt_g(k.drift.hi)))
            .raw("]</span></td>"),
        None => h.td(""),
    };
    h.raw("<td class=\"why\">").text(&m.reason);
    if let Some(p) = &m.pairing {
        h.raw("<br><span class=\"ci\">").text(&if p.se_ratio.is_finite() {
            format!(
                "paired over {} seeds: correlation {:.2}, interval {:.2}x narrower than Welch's (worth {:.1} independent seeds per arm)",
                p.seeds, p.correlation, p.se_ratio, p.effective_seeds
            )
        } else {
            format!("paired over {} seeds: identical seed by seed", p.seeds)
        });
        h.raw("</span>");
    }
    if let Some(r) = &m.margin_rule {
        h.raw("<br><span class=\"ci\">margin: ")
            .text(r)
            .raw("</span>");
    }
    h.raw("</td></tr>\n");
}

fn checks_section(h: &mut Html, ctx: &Ctx<'_>) {
    let checks = &ctx.cmp().checks;
    h.raw("<section id=\"checks\"><h2>Checks</h2>\n");
    if checks.is_empty() {
        h.raw("<p>The suite declares no checks.</p></section>\n");
        return;
    }
    h.raw("<table><tr><th>check</th><th>configuration</th><th>result</th><th>value</th><th>threshold</th><th>message</th></tr>\n");
    for c in checks {
        h.raw("<tr><td><code>")
            .text(&c.expr)
            .raw("</code></td><td>");
        swatch(h, ctx, &c.config);
        h.raw("</td><td>");
        if c.passed {
            h.raw("<span class=\"badge pass\">pass</span>");
        } else {
            h.raw("<span class=\"badge regression\">FAIL</span>");
        }
        h.raw("</td>")
            .num(&fmt_g(c.value))
            .num(&fmt_g(c.threshold))
            .td(&c.message)
            .raw("</tr>\n");
    }
    h.raw("</table></section>\n");
}

fn section_heading(s: Section) -> (&'static str, &'static str) {
    match s {
        Section::Reward => ("reward", "Reward"),
        Section::Mismatch => ("mismatch", "Train-rollout mismatch"),
        Section::KlReference => ("kl-reference", "KL to the reference"),
        Section::Gradients => ("gradients", "Gradient norms and spikes"),
        Section::Timings => ("timings", "Time"),
        Section::Sweeps => ("sweeps", "Sweep axes"),
    }
}

fn figure_sections(
    h: &mut Html,
    ctx: &Ctx<'_>,
    figs: &[Figure],
    dir: &Path,
) -> Result<(), ReportError> {
    h.raw("<div id=\"figures\"></div>\n");
    let sections: BTreeSet<Section> = figs.iter().map(|f| f.section).collect();
    let mut all = sections.clone();
    all.insert(Section::Gradients); // the spike table is there even without heatmaps
    for s in all {
        let (id, title) = section_heading(s);
        h.raw("<section id=\"")
            .raw(id)
            .raw("\"><h2>")
            .raw(title)
            .raw("</h2>\n");
        for f in figs.iter().filter(|f| f.section == s) {
            figure(h, f, dir)?;
        }
        if s == Section::Gradients {
            spike_table(h, ctx);
        }
        h.raw("</section>\n");
    }
    Ok(())
}

/// One figure, inlined from the PNG beside the page.
fn figure(h: &mut Html, f: &Figure, dir: &Path) -> Result<(), ReportError> {
    let path = dir.join(&f.file);
    let bytes = std::fs::read(&path).map_err(|e| IoError::io(&path, e))?;
    let b64 = base64::engine::general_purpose::STANDARD.encode(bytes);
    h.raw("<figure><h3>")
        .text(&f.title)
        .raw("</h3><img alt=\"")
        .text(&f.title)
        .raw("\" width=\"")
        .text(&f.width.to_string())
        .raw("\" height=\"")
        .text(&f.height.to_string())
        .raw("\" src=\"data:image/png;base64,")
        .text(&b64)
        .raw("\"><figcaption>")
        .rich(&f.caption)
        .raw(" <span class=\"muted\">(PNG: <a href=\"")
        .text(&f.file)
        .raw("\">")
        .text(&f.file)
        .raw("</a>)</span></figcaption></figure>\n");
    Ok(())
}

fn spike_table(h: &mut Html, ctx: &Ctx<'_>) {
    let cmp = ctx.cmp();
    let m = &cmp.method;
    h.raw("<h3 id=\"spikes\">Gradient spikes</h3>\n<p>")
        .text(&format!(
            "A spike is a step where a site's gradient norm has a robust z-score above {} \
             (log norm against the rolling median/MAD of the previous {} steps) or exceeds {}x \
             the rolling maximum (compare's offline rule; the engine's online `grad_spike` \
             events are a second rule, counted as events). Ratio: value over the rolling maximum.",
            m.spike_z, m.spike_window, m.spike_ratio
        ))
        .raw("</p>\n");
    spike_rate_table(h, ctx);
    if cmp.spikes.is_empty() {
        h.raw("<p>No spikes in any configuration.</p>\n");
        return;
    }
    let mut spikes: Vec<&crate::compare::Spike> = cmp.spikes.iter().collect();
    let rank = |c: &str| ctx.order.iter().position(|o| o == c).unwrap_or(usize::MAX);
    spikes.sort_by(|a, b| {
        (rank(&a.config), a.step, a.seed, a.layer).cmp(&(rank(&b.config), b.step, b.seed, b.layer))
    });
    h.raw("<table><tr><th>configuration</th><th>seed</th><th>step</th><th>site</th><th>layer</th><th>grad norm</th><th>ratio to rolling max</th><th>robust z</th></tr>\n");
    for s in spikes {
        h.raw("<tr><td>");
        swatch(h, ctx, &s.config);
        h.raw("</td>")
            .num(&s.seed.to_string())
            .num(&s.step.to_string())
            .raw("<td><code>")
            .text(&s.site)
            .raw("</code></td>")
            .num(&s.layer.to_string())
            .num(&fmt_g(s.value))
            .num(&fmt_g(s.ratio))
            .num(&fmt_g(s.z))
            .raw("</tr>\n");
    }
    h.raw("</table>\n");
}

/// Spikes counted against the baseline: per configuration over all sites, then per site and
/// layer where either arm has one.
fn spike_rate_table(h: &mut Html, ctx: &Ctx<'_>) {
    let rates = &ctx.cmp().spike_rates;
    if rates.is_empty() {
        return;
    }
    h.raw("<p>Against the baseline: spikes per judged step, the excess per 1,000 steps, and the rate ratio with its exact interval (spikes treated as Poisson events).</p>\n");
    h.raw("<table><tr><th>configuration</th><th>site</th><th>layer</th><th>spikes / steps</th><th>baseline spikes / steps</th><th>excess per 1,000 steps</th><th>rate ratio</th></tr>\n");
    for r in rates {
        h.raw("<tr><td>");
        swatch(h, ctx, &r.config);
        h.raw("</td><td><code>")
            .text(&r.site)
            .raw("</code></td>")
            .num(&if r.layer < 0 {
                "all".to_string()
            } else {
                r.layer.to_string()
            })
            .num(&format!("{} / {}", r.spikes, r.steps))
            .num(&format!("{} / {}", r.baseline_spikes, r.baseline_steps))
            .num(&format!("{:+.1}", r.excess_per_1k))
            .ci(&r.rate_ratio)
            .raw("</tr>\n");
    }
    h.raw("</table>\n");
}

fn contract_section(h: &mut Html, ctx: &Ctx<'_>) {
    h.raw("<section id=\"contract\"><h2>Rollout/trainer quantization contract</h2>\n<p>Every step the trainer and the rollout fingerprint each site's quantized weights and activation quantizer; a mismatch is a violation (the rollout is not sampling from the policy being trained).</p>\n");
    let rows = &ctx.cmp().contract;
    if rows.is_empty() {
        h.raw("<p>No contract data.</p></section>\n");
        return;
    }
    h.raw("<table><tr><th>configuration</th><th>runs</th><th>steps checked</th><th>violations</th></tr>\n");
    for r in rows {
        h.raw("<tr><td>");
        swatch(h, ctx, &r.config);
        h.raw("</td>")
            .num(&r.runs.to_string())
            .num(&r.steps_checked.to_string());
        if r.violations > 0 {
            h.raw("<td class=\"n\"><span class=\"badge regression\">")
                .text(&r.violations.to_string())
                .raw("</span></td>");
        } else {
            h.num("0");
        }
        h.raw("</tr>\n");
    }
    h.raw("</table></section>\n");
}

fn method_section(h: &mut Html, ctx: &Ctx<'_>) {
    let cmp = ctx.cmp();
    let m = &cmp.method;
    let seeds: BTreeSet<u64> = cmp
        .configs
        .iter()
        .flat_map(|c| c.seeds.iter().copied())
        .collect();
    let margins: BTreeSet<String> = cmp
        .configs
        .iter()
        .flat_map(|c| &c.metrics)
        .filter_map(|x| x.margin.map(|g| format!("{} ±{g}", x.metric)))
        .collect();
    h.raw("<section id=\"method\"><h2>Method</h2>\n<ul>\n");
    for d in &m.description {
        h.raw("<li>").rich(d).raw("</li>\n");
    }
    h.raw("</ul>\n<dl>\n");
    let mut row = |k: &'static str, v: String| {
        h.raw("<dt>")
            .raw(k)
            .raw("</dt><dd>")
            .text(&v)
            .raw("</dd>\n");
    };
    row("baseline", cmp.baseline_config.clone());
    row(
        "seeds",
        format!(
            "{} ({})",
            seeds.len(),
            seeds
                .iter()
                .map(|s| s.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    );
    row(
        "bootstrap",
        format!(
            "{} resamples over seeds, seed {}",
            m.bootstrap_reps, m.bootstrap_seed
        ),
    );
    row(
        "equivalence test",
        format!(
            "two one-sided tests at alpha {} ({:.0} % interval against the margin)",
            m.alpha,
            100.0 * (1.0 - 2.0 * m.alpha)
        ),
    );
    row(
        "margins",
        if margins.is_empty() {
            "none set".into()
        } else {
            margins.into_iter().collect::<Vec<_>>().join("; ")
        },
    );
    row("final window", format!("last {} steps", m.final_window));
    row(
        "spike rule",
        format!(
            "robust z > {} over a {}-step window, or > {}x the rolling max",
            m.spike_z, m.spike_window, m.spike_ratio
        ),
    );
    h.raw("</dl></section>\n");
}

/// Distinct values of a manifest field, joined.
fn distinct<'a>(vals: impl Iterator<Item = &'a str>) -> String {
    let s: BTreeSet<&str> = vals.collect();
    if s.is_empty() {
        "unknown".into()
    } else {
        s.into_iter().collect::<Vec<_>>().join(", ")
    }
}

fn metadata_section(h: &mut Html, ctx: &Ctx<'_>) {
    let input = ctx.input;
    let spec = input.spec;
    let runs = input.runs;
    h.raw("<section id=\"metadata\"><h2>Run metadata</h2>\n<dl>\n");
    let row = |h: &mut Html, k: &'static str, v: String| {
        h.raw("<dt>")
            .raw(k)
            .raw("</dt><dd>")
            .text(&v)
            .raw("</dd>\n");
    };
    row(h, "suite", spec.name.clone());
    row(h, "suite file", spec.path.display().to_string());
    row(h, "run store", input.suite_dir.display().to_string());
    row(h, "engine", spec.engine.clone());
    let w = &spec.workload;
    row(
        h,
        "workload",
        format!(
            "model {}, task {}, {} steps{}{}",
            w.model,
            w.task,
            w.steps,
            w.prompts_per_step
                .map_or(String::new(), |p| format!(", {p} prompts per step")),
            w.samples_per_prompt
                .map_or(String::new(), |s| format!(", {s} samples per prompt"))
        ),
    );
    row(
        h,
        "lockstep version (runs)",
        distinct(runs.iter().map(|r| r.manifest.lockstep_version.as_str())),
    );
    row(
        h,
        "git revision (runs)",
        distinct(runs.iter().map(|r| r.manifest.git_revision.as_str())),
    );
    row(
        h,
        "host",
        distinct(runs.iter().map(|r| r.manifest.host.as_str())),
    );
    row(
        h,
        "device",
        distinct(runs.iter().map(|r| r.manifest.device.as_str())),
    );
    row(
        h,
        "emulated formats",
        if ctx.emulated() {
            "yes: built-in engine, CPU emulation (timings are not hardware timings)".into()
        } else {
            "no".into()
        },
    );
    let started = runs
        .iter()
        .map(|r| r.manifest.started.as_str())
        .min()
        .unwrap_or("");
    let finished = runs
        .iter()
        .filter_map(|r| r.manifest.finished.as_deref())
        .max()
        .unwrap_or("");
    row(
        h,
        "runs",
        format!(
            "{} (started {started}, last finished {finished})",
            runs.len()
        ),
    );
    row(
        h,
        "report",
        format!(
            "generated {} by lockstep {} (revision {})",
            crate::store::run::now_utc(),
            env!("CARGO_PKG_VERSION"),
            env!("LOCKSTEP_GIT_REV")
        ),
    );
    h.raw("</dl>\n<details><summary>All runs</summary><table><tr><th>run id</th><th>configuration</th><th>seed</th><th>status</th><th>steps</th><th>host</th><th>started</th><th>finished</th><th>error</th></tr>\n");
    for r in runs {
        let m = &r.manifest;
        h.raw("<tr>").td(&m.run_id).raw("<td>");
        swatch(h, ctx, &r.config);
        h.raw("</td>")
            .num(&m.seed.to_string())
            .td(&format!("{:?}", m.status).to_lowercase())
            .num(&format!("{}/{}", m.steps_done, m.steps_planned))
            .td(&m.host)
            .td(&m.started)
            .td(m.finished.as_deref().unwrap_or(""))
            .td(m.error.as_deref().unwrap_or(""))
            .raw("</tr>\n");
    }
    h.raw("</table></details></section>\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_every_html_special_character() {
        assert_eq!(
            escape("<script>alert(\"x\")</script> & 'y'"),
            "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; &amp; &#39;y&#39;"
        );
        let mut h = Html::default();
        h.rich("metric `<b>` & more");
        assert_eq!(h.into_string(), "metric <code>&lt;b&gt;</code> &amp; more");
    }

    #[test]
    fn numbers_keep_four_significant_digits() {
        assert_eq!(fmt_g(0.123456), "0.1235");
        assert_eq!(fmt_g(12.3456), "12.35");
        assert_eq!(fmt_g(2.5e-5), "2.500e-5");
        assert_eq!(fmt_g(0.0), "0");
    }
}
