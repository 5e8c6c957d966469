//! Statistics over per-seed values, in memory: no files, no plots. The unit of replication is the
//! seed (one run), never the step: steps within a run are autocorrelated, so every interval here is
//! computed from one number (or one curve) per seed.
//!
//! Intervals are two-sided at level `1 - 2·alpha` (90 % for alpha = 0.05), the interval whose
//! inclusion in `(-margin, margin)` is exactly the two one-sided tests (TOST) at level alpha.

use super::result::Interval;
use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use statrs::distribution::{ContinuousCDF, StudentsT};

/// Arithmetic mean (NaN for an empty slice).
pub fn mean(x: &[f64]) -> f64 {
    if x.is_empty() {
        return f64::NAN;
    }
    x.iter().sum::<f64>() / x.len() as f64
}

/// Sample variance with n - 1 (NaN below two values).
pub fn variance(x: &[f64]) -> f64 {
    if x.len() < 2 {
        return f64::NAN;
    }
    let m = mean(x);
    x.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / (x.len() - 1) as f64
}

/// Median (NaN for an empty slice).
pub fn median(x: &[f64]) -> f64 {
    quantile(x, 0.5)
}

/// Linear-interpolation quantile (type 7, numpy's default) of unsorted values.
pub fn quantile(x: &[f64], q: f64) -> f64 {
    if x.is_empty() {
        return f64::NAN;
    }
    let mut s = x.to_vec();
    s.sort_by(f64::total_cmp);
    quantile_sorted(&s, q)
}

/// Type-7 quantile of sorted values.
pub fn quantile_sorted(s: &[f64], q: f64) -> f64 {
    if s.is_empty() {
        return f64::NAN;
    }
    let h = (s.len() - 1) as f64 * q.clamp(0.0, 1.0);
    let (lo, hi) = (h.floor() as usize, h.ceil() as usize);
    s[lo] + (h - lo as f64) * (s[hi] - s[lo])
}

/// Interquartile mean: the mean of the middle half, dropping `floor(n/4)` values at each end (as
/// rliable does through scipy's `trim_mean(x, 0.25)`); robust to one bad seed, and with fewer
/// than four values it is the plain mean.
pub fn iqm(x: &[f64]) -> f64 {
    if x.is_empty() {
        return f64::NAN;
    }
    let mut s = x.to_vec();
    s.sort_by(f64::total_cmp);
    let cut = s.len() / 4;
    mean(&s[cut..s.len() - cut])
}

/// Probability that a random run of `x` beats a random run of `y` (ties count half): the
/// Mann-Whitney U statistic divided by `n_x · n_y`, rliable's "probability of improvement".
/// `higher_is_better = false` flips what "beats" means.
pub fn prob_improvement(x: &[f64], y: &[f64], higher_is_better: bool) -> f64 {
    if x.is_empty() || y.is_empty() {
        return f64::NAN;
    }
    let mut u = 0.0;
    for &a in x {
        for &b in y {
            let (a, b) = if higher_is_better { (a, b) } else { (b, a) };
            u += if a > b {
                1.0
            } else if a == b {
                0.5
            } else {
                0.0
            };
        }
    }
    u / (x.len() * y.len()) as f64
}

/// Student's t quantile; `df` may be fractional (Welch). Above 10^5 degrees of freedom (or with
/// none finite) it is the normal quantile: statrs' t inverse does not converge quickly there.
pub fn t_quantile(p: f64, df: f64) -> f64 {
    use statrs::distribution::Normal;
    if !(df.is_finite() && df > 0.0) || df > 1e5 {
        return Normal::new(0.0, 1.0)
            .map(|n| n.inverse_cdf(p))
            .unwrap_or(f64::NAN);
    }
    StudentsT::new(0.0, 1.0, df)
        .map(|t| t.inverse_cdf(p))
        .unwrap_or(f64::NAN)
}

/// Welch's two-sample comparison of means: `(mean(x) - mean(y), standard error, degrees of freedom)`.
/// Returns a NaN standard error when either arm has fewer than two values.
pub fn welch(x: &[f64], y: &[f64]) -> (f64, f64, f64) {
    let d = mean(x) - mean(y);
    let (vx, vy) = (variance(x) / x.len() as f64, variance(y) / y.len() as f64);
    let se2 = vx + vy;
    if !se2.is_finite() {
        return (d, f64::NAN, f64::NAN);
    }
    if se2 == 0.0 {
        return (d, 0.0, (x.len() + y.len() - 2) as f64);
    }
    let df = se2 * se2
        / (vx * vx / (x.len() as f64 - 1.0) + vy * vy / (y.len() as f64 - 1.0))
            .max(f64::MIN_POSITIVE);
    (d, se2.sqrt(), df)
}

/// Welch's t interval for `mean(x) - mean(y)` at two-sided level `1 - 2·alpha`.
pub fn welch_interval(x: &[f64], y: &[f64], alpha: f64) -> Interval {
    let (d, se, df) = welch(x, y);
    let h = t_quantile(1.0 - alpha, df) * se;
    Interval {
        estimate: d,
        lo: d - h,
        hi: d + h,
    }
}

/// Pearson correlation of paired values (NaN below two pairs or with a constant arm).
pub fn correlation(x: &[f64], y: &[f64]) -> f64 {
    let n = x.len().min(y.len());
    if n < 2 {
        return f64::NAN;
    }
    let (mx, my) = (mean(&x[..n]), mean(&y[..n]));
    let (mut sxy, mut sxx, mut syy) = (0.0, 0.0, 0.0);
    for i in 0..n {
        let (a, b) = (x[i] - mx, y[i] - my);
        sxy += a * b;
        sxx += a * a;
        syy += b * b;
    }
    if sxx == 0.0 || syy == 0.0 {
        return f64::NAN;
    }
    sxy / (sxx * syy).sqrt()
}

/// Paired comparison of means: `x[i]` and `y[i]` come from the same seed. Returns
/// `(mean(x - y), standard error, degrees of freedom n - 1)`; the standard error is NaN below two
/// pairs. When the seed moves both arms the same way (common random numbers) the differences
/// vary less than either arm, and the paired standard error is the smaller one.
pub fn paired(x: &[f64], y: &[f64]) -> (f64, f64, f64) {
    let d: Vec<f64> = x.iter().zip(y).map(|(a, b)| a - b).collect();
    let n = d.len() as f64;
    (mean(&d), (variance(&d) / n).sqrt(), n - 1.0)
}

/// The paired t interval for `mean(x - y)` at two-sided level `1 - 2·alpha` (its inclusion in
/// `(-margin, margin)` is the paired TOST at level alpha).
pub fn paired_interval(x: &[f64], y: &[f64], alpha: f64) -> Interval {
    let (d, se, df) = paired(x, y);
    t_interval(d, se, df, alpha)
}

/// An interval on the log scale turned into a fold change: `exp` of each end.
pub fn exp_interval(i: Interval) -> Interval {
    Interval {
        estimate: i.estimate.exp(),
        lo: i.lo.exp(),
        hi: i.hi.exp(),
    }
}

/// One-sided p-value of a t statistic: `P(T >= t)` for Student's t with `df` degrees of freedom
/// (normal above 10^5 or without finite `df`, as [`t_quantile`]). Paired with [`t_quantile`], an
/// interval at `1 - 2·alpha` lies above `b` exactly when `t_upper_p((d - b) / se, df) < alpha`.
pub fn t_upper_p(t: f64, df: f64) -> f64 {
    use statrs::distribution::Normal;
    if t.is_nan() {
        return f64::NAN;
    }
    let cdf = if !(df.is_finite() && df > 0.0) || df > 1e5 {
        Normal::new(0.0, 1.0).map(|n| n.cdf(t)).ok()
    } else {
        StudentsT::new(0.0, 1.0, df).map(|d| d.cdf(t)).ok()
    };
    cdf.map_or(f64::NAN, |c| 1.0 - c)
}

/// One-sided p-value that a mean difference `d` with standard error `se` exceeds `bound`:
/// `P(T >= (d - bound) / se)`. A zero standard error (identical arms seed by seed) gives 0 when
/// `d > bound` and 1 otherwise.
pub fn above_p(d: f64, se: f64, df: f64, bound: f64) -> f64 {
    if se == 0.0 {
        return if d > bound { 0.0 } else { 1.0 };
    }
    t_upper_p((d - bound) / se, df)
}

/// A linear contrast `sum_i c_i · mean(groups[i])` with its standard error and degrees of freedom:
/// Welch-Satterthwaite over independent groups, the generalisation of [`welch`] (two groups with
/// weights `1, -1` give exactly Welch's difference); with `paired`, every group holds the same
/// seeds in the same order and the contrast is taken seed by seed, then a t over seeds, the
/// generalisation of [`paired`]. NaN standard error when a group has fewer than two values.
pub fn contrast(groups: &[Vec<f64>], weights: &[f64], paired: bool) -> (f64, f64, f64) {
    if paired {
        let n = groups.iter().map(Vec::len).min().unwrap_or(0);
        let per_seed: Vec<f64> = (0..n)
            .map(|j| groups.iter().zip(weights).map(|(g, c)| c * g[j]).sum())
            .collect();
        return (
            mean(&per_seed),
            (variance(&per_seed) / n as f64).sqrt(),
            n as f64 - 1.0,
        );
    }
    let est: f64 = groups.iter().zip(weights).map(|(g, c)| c * mean(g)).sum();
    let parts: Vec<(f64, f64)> = groups
        .iter()
        .zip(weights)
        .map(|(g, c)| (c * c * variance(g) / g.len() as f64, g.len() as f64 - 1.0))
        .collect();
    let var: f64 = parts.iter().map(|p| p.0).sum();
    if !var.is_finite() {
        return (est, f64::NAN, f64::NAN);
    }
    if var == 0.0 {
        return (est, 0.0, parts.iter().map(|p| p.1).sum());
    }
    let denom: f64 = parts
        .iter()
        .filter(|p| p.0 > 0.0)
        .map(|p| p.0 * p.0 / p.1)
        .sum();
    (est, var.sqrt(), var * var / denom.max(f64::MIN_POSITIVE))
}

/// The interval `d ± t(1 - alpha, df)·se`, two-sided at `1 - 2·alpha`.
pub fn t_interval(d: f64, se: f64, df: f64, alpha: f64) -> Interval {
    let h = if se == 0.0 {
        0.0
    } else {
        t_quantile(1.0 - alpha, df) * se
    };
    Interval {
        estimate: d,
        lo: d - h,
        hi: d + h,
    }
}

/// Exact one-sided p-values of the conditional binomial test of a Poisson rate ratio of 1, for
/// `a` events over exposure `ea` against `b` over `eb`: `(P(X >= a), P(X <= a))` with
/// `X ~ Binomial(a + b, ea / (ea + eb))`. They are the tests [`rate_ratio_interval`] inverts, so
/// its lower end is above 1 exactly when the first is below alpha.
pub fn rate_ratio_p(a: u64, ea: f64, b: u64, eb: f64) -> (f64, f64) {
    use statrs::distribution::{Binomial, DiscreteCDF};
    let n = a + b;
    if n == 0 {
        return (1.0, 1.0);
    }
    let Ok(d) = Binomial::new(ea / (ea + eb), n) else {
        return (f64::NAN, f64::NAN);
    };
    let upper = if a == 0 { 1.0 } else { d.sf(a - 1) };
    (upper, d.cdf(a))
}

/// Holm's step-down adjustment: adjusted p-values (each `min(1, max over earlier steps of
/// (m - rank)·p)`), so rejecting every adjusted p below alpha keeps the chance of any false
/// rejection among the `m` hypotheses at most alpha. NaN p-values are never rejected.
pub fn holm(p: &[f64]) -> Vec<f64> {
    let m = p.len();
    let mut order: Vec<usize> = (0..m).collect();
    order.sort_by(|&i, &j| {
        let key = |x: f64| if x.is_nan() { f64::INFINITY } else { x };
        key(p[i]).total_cmp(&key(p[j]))
    });
    let mut out = vec![1.0; m];
    let mut running: f64 = 0.0;
    for (rank, &i) in order.iter().enumerate() {
        let adj = if p[i].is_nan() {
            1.0
        } else {
            ((m - rank) as f64 * p[i]).min(1.0)
        };
        running = running.max(adj);
        out[i] = running;
    }
    out
}

/// Exact (Clopper-Pearson) interval of a Poisson rate ratio `(a / ea) / (b / eb)` at two-sided
/// level `1 - 2·alpha`, for `a` events over exposure `ea` against `b` over `eb`. Given the total
/// `a + b`, `a` is binomial with `p = ea·RR / (ea·RR + eb)`, so the Clopper-Pearson interval of
/// `p` maps to one of the ratio; it stays defined with zero events on either side (lower end 0
/// or upper end infinite). The estimate is NaN when both counts are zero.
pub fn rate_ratio_interval(a: u64, ea: f64, b: u64, eb: f64, alpha: f64) -> Interval {
    use statrs::distribution::Beta;
    let n = a + b;
    let (af, bf) = (a as f64, b as f64);
    let estimate = if n == 0 {
        f64::NAN
    } else {
        (af / ea) / (bf / eb)
    };
    let q = |p: f64, s: f64, f: f64| {
        Beta::new(s, f)
            .map(|d| d.inverse_cdf(p))
            .unwrap_or(f64::NAN)
    };
    let p_lo = if a == 0 { 0.0 } else { q(alpha, af, bf + 1.0) };
    let p_hi = if b == 0 {
        1.0
    } else {
        q(1.0 - alpha, af + 1.0, bf)
    };
    let to_rr = |p: f64| {
        if p >= 1.0 {
            f64::INFINITY
        } else {
            p / (1.0 - p) * eb / ea
        }
    };
    Interval {
        estimate,
        lo: if n == 0 { 0.0 } else { to_rr(p_lo) },
        hi: if n == 0 { f64::INFINITY } else { to_rr(p_hi) },
    }
}

/// A seeded resampler: every bootstrap in a comparison draws from one ChaCha stream, so the same
/// inputs and seed give the same intervals on every machine.
pub struct Resampler {
    rng: ChaCha8Rng,
}

impl Resampler {
    pub fn new(seed: u64) -> Resampler {
        Resampler {
            rng: ChaCha8Rng::seed_from_u64(seed),
        }
    }

    /// A uniform index below `n` (Lemire's multiply-shift; the bias, at most n / 2^64, is far
    /// below anything a bootstrap of seeds could show).
    #[inline]
    fn index(&mut self, n: usize) -> usize {
        ((self.rng.next_u64() as u128 * n as u128) >> 64) as usize
    }

    /// Fill `out` with draws from `x`, two 32-bit multiply-shift indices per 64-bit random word
    /// (seeds per arm are far below 2^32, so the bias stays below n / 2^32).
    fn fill(&mut self, x: &[f64], out: &mut [f64]) {
        let n = x.len() as u64;
        let mut chunks = out.chunks_exact_mut(2);
        for pair in &mut chunks {
            let r = self.rng.next_u64();
            pair[0] = x[(((r & 0xffff_ffff) * n) >> 32) as usize];
            pair[1] = x[(((r >> 32) * n) >> 32) as usize];
        }
        for v in chunks.into_remainder() {
            *v = x[self.index(x.len())];
        }
    }

    /// Resample counts: `counts[i]` is how often value `i` of `n` was drawn (sum `n`).
    pub fn counts(&mut self, n: usize, out: &mut [f64]) {
        out.iter_mut().for_each(|c| *c = 0.0);
        for _ in 0..n {
            out[self.index(n)] += 1.0;
        }
    }

    /// Stratified percentile bootstrap of `stat(x) - stat(y)`: each arm is resampled on its own
    /// (rliable's stratified bootstrap), `reps` times; the interval is two-sided `1 - 2·alpha`.
    pub fn diff_interval(
        &mut self,
        x: &[f64],
        y: &[f64],
        reps: usize,
        alpha: f64,
        stat: fn(&[f64]) -> f64,
    ) -> Interval {
        let estimate = stat(x) - stat(y);
        if x.is_empty() || y.is_empty() || reps == 0 {
            return Interval {
                estimate,
                lo: f64::NAN,
                hi: f64::NAN,
            };
        }
        let (mut bx, mut by) = (vec![0.0; x.len()], vec![0.0; y.len()]);
        let mut d = Vec::with_capacity(reps);
        for _ in 0..reps {
            self.fill(x, &mut bx);
            self.fill(y, &mut by);
            d.push(stat(&bx) - stat(&by));
        }
        let (lo, hi) = percentile_pair(&mut d, alpha);
        Interval { estimate, lo, hi }
    }

    /// Paired percentile bootstrap of `stat(x - y)`: the seeds are resampled with their pair,
    /// so the interval keeps the correlation the seed induces between the arms.
    pub fn paired_interval(
        &mut self,
        x: &[f64],
        y: &[f64],
        reps: usize,
        alpha: f64,
        stat: fn(&[f64]) -> f64,
    ) -> Interval {
        let d: Vec<f64> = x.iter().zip(y).map(|(a, b)| a - b).collect();
        let estimate = stat(&d);
        if d.is_empty() || reps == 0 {
            return Interval {
                estimate,
                lo: f64::NAN,
                hi: f64::NAN,
            };
        }
        let mut bd = vec![0.0; d.len()];
        let mut out = Vec::with_capacity(reps);
        for _ in 0..reps {
            self.fill(&d, &mut bd);
            out.push(stat(&bd));
        }
        let (lo, hi) = percentile_pair(&mut out, alpha);
        Interval { estimate, lo, hi }
    }

    /// Percentile bootstrap band of the mean curve over seeds. `curves` is `n` seeds x `t` steps,
    /// row-major. All steps share each resample (a resample is a set of seeds), and the resampled
    /// means are one matrix product `(t x n)·(n x reps)` done by `matrixmultiply`, so a band over
    /// 1,000 steps costs about as much as 1,000 scalar bootstraps.
    pub fn band(
        &mut self,
        curves: &[f64],
        n: usize,
        t: usize,
        reps: usize,
        alpha: f64,
    ) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let mean_curve: Vec<f64> = (0..t)
            .map(|j| (0..n).map(|i| curves[i * t + j]).sum::<f64>() / n as f64)
            .collect();
        if n < 2 || reps == 0 || t == 0 {
            return (mean_curve.clone(), mean_curve.clone(), mean_curve);
        }
        // counts: reps x n, each row scaled by 1/n so the product gives means.
        let mut counts = vec![0.0; reps * n];
        for r in 0..reps {
            self.counts(n, &mut counts[r * n..(r + 1) * n]);
        }
        counts.iter_mut().for_each(|c| *c /= n as f64);
        let mut means = vec![0.0; t * reps]; // t x reps, row-major
        assert!(
            curves.len() >= n * t,
            "band: {n} seeds x {t} steps need {} values",
            n * t
        );
        // SAFETY: dgemm reads A = curvesᵀ (t x n, element (j, i) at i·t + j < n·t <= curves.len()),
        // B = countsᵀ (n x reps, element (i, r) at r·n + i < reps·n) and writes C (t x reps,
        // element (j, r) at j·reps + r < t·reps = means.len()); the three buffers do not overlap.
        unsafe {
            matrixmultiply::dgemm(
                t,
                n,
                reps,
                1.0,
                curves.as_ptr(),
                1,
                t as isize,
                counts.as_ptr(),
                1,
                n as isize,
                0.0,
                means.as_mut_ptr(),
                reps as isize,
                1,
            );
        }
        let mut lo = Vec::with_capacity(t);
        let mut hi = Vec::with_capacity(t);
        for row in means.chunks_mut(reps) {
            let (l, h) = percentile_pair(row, alpha);
            lo.push(l);
            hi.push(h);
        }
        (mean_curve, lo, hi)
    }
}

/// The `alpha` and `1 - alpha` type-7 quantiles of `v` (reordered in place), by selection
/// instead of a full sort: two partial partitions cost about 1.5 passes over the values.
fn percentile_pair(v: &mut [f64], alpha: f64) -> (f64, f64) {
    if v.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    let last = (v.len() - 1) as f64;
    let q = |v: &mut [f64], p: f64| {
        let h = last * p;
        let (i, frac) = (h.floor() as usize, h - h.floor());
        let a = *v.select_nth_unstable_by(i, f64::total_cmp).1;
        if frac == 0.0 || i + 1 >= v.len() {
            return a;
        }
        // The next order statistic is the minimum of the part above i.
        let b = v[i + 1..].iter().copied().fold(f64::INFINITY, f64::min);
        a + frac * (b - a)
    };
    let lo = q(v, alpha);
    let hi = q(v, 1.0 - alpha);
    (lo, hi)
}

/// Least-squares slope of `y` over `x` (NaN below two distinct x).
pub fn ols_slope(x: &[f64], y: &[f64]) -> f64 {
    let (mx, my) = (mean(x), mean(y));
    let sxx: f64 = x.iter().map(|a| (a - mx) * (a - mx)).sum();
    if x.len() < 2 || sxx == 0.0 {
        return f64::NAN;
    }
    x.iter()
        .zip(y)
        .map(|(a, b)| (a - mx) * (b - my))
        .sum::<f64>()
        / sxx
}

/// Mean of per-seed values with a t interval over seeds at `1 - 2·alpha` (the drift of KL metrics:
/// one slope per seed, then across seeds, because residuals within a run are autocorrelated and a
/// pooled regression would claim far too much precision).
pub fn mean_interval(x: &[f64], alpha: f64) -> Interval {
    let m = mean(x);
    if x.len() < 2 {
        return Interval {
            estimate: m,
            lo: f64::NAN,
            hi: f64::NAN,
        };
    }
    let h = t_quantile(1.0 - alpha, x.len() as f64 - 1.0) * (variance(x) / x.len() as f64).sqrt();
    Interval {
        estimate: m,
        lo: m - h,
        hi: m + h,
    }
}

/// Seeds per arm needed so a true difference of `margin` is detected (one-sided level alpha) with
/// probability `power`, for per-seed standard deviation `sd`: the smallest `n` with
/// `margin / (sd·sqrt(2/n)) >= t(1-alpha, n-1) + t(power, n-1)` (equal arms, the usual
/// two-sample power formula with t quantiles). The degrees of freedom are Welch's worst case
/// (n - 1) rather than the pooled 2n - 2: with 2n - 2 the simulated power of the Welch procedure
/// came out at 0.78 for a stated 0.8, so the conservative count keeps the stated power a floor.
/// `None` when `sd` is not finite.
pub fn seeds_needed(sd: f64, margin: f64, alpha: f64, power: f64) -> Option<usize> {
    seeds_needed_diff(sd * std::f64::consts::SQRT_2, margin, alpha, power)
}

/// Seeds needed when one seed gives one difference of standard deviation `sd_diff` (a paired
/// design, where `sd_diff = sd·sqrt(2(1 - rho))`; two independent arms are `sd·sqrt(2)`): the
/// smallest `n` with `margin / (sd_diff / sqrt(n)) >= t(1-alpha, n-1) + t(power, n-1)`.
pub fn seeds_needed_diff(sd_diff: f64, margin: f64, alpha: f64, power: f64) -> Option<usize> {
    if !sd_diff.is_finite() || margin.is_nan() || margin <= 0.0 {
        return None;
    }
    if sd_diff == 0.0 {
        return Some(2);
    }
    // The normal-quantile answer is a lower bound (t quantiles are larger): start the search there.
    let z = t_quantile(1.0 - alpha, f64::INFINITY) + t_quantile(power, f64::INFINITY);
    let n0 = ((z * sd_diff / margin).powi(2)).floor().clamp(2.0, 1e9) as usize;
    (n0..n0 + 10_000).find(|&n| {
        let df = (n - 1) as f64;
        margin / (sd_diff / (n as f64).sqrt())
            >= t_quantile(1.0 - alpha, df) + t_quantile(power, df)
    })
}

/// An upper `1 - alpha` confidence bound on a standard deviation from a pooled sample variance
/// with `df` degrees of freedom (chi-squared). Used to decide whether the seeds can resolve the
/// margin, so a lucky small sample variance cannot make three seeds look like enough.
pub fn sd_upper(var: f64, df: f64, alpha: f64) -> f64 {
    use statrs::distribution::ChiSquared;
    if df.is_nan() || df <= 0.0 || !var.is_finite() {
        return f64::NAN;
    }
    match ChiSquared::new(df) {
        Ok(c) => (var * df / c.inverse_cdf(alpha)).sqrt(),
        Err(_) => f64::NAN,
    }
}

/// Pooled variance of two samples (NaN when neither has two values).
pub fn pooled_variance(x: &[f64], y: &[f64]) -> (f64, f64) {
    let df = (x.len().saturating_sub(1) + y.len().saturating_sub(1)) as f64;
    if df == 0.0 {
        return (f64::NAN, 0.0);
    }
    let ss = |v: &[f64]| {
        if v.len() < 2 {
            0.0
        } else {
            variance(v) * (v.len() - 1) as f64
        }
    };
    ((ss(x) + ss(y)) / df, df)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iqm_drops_a_quarter_at_each_end() {
        // 8 values: drop 2 at each end, mean of 3,4,5,6.
        assert_eq!(iqm(&[100.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, -50.0]), 3.5);
        assert_eq!(iqm(&[1.0, 2.0, 3.0]), 2.0, "fewer than four: plain mean");
    }

    #[test]
    fn probability_of_improvement_is_u_over_nm() {
        assert_eq!(prob_improvement(&[3.0, 4.0], &[1.0, 2.0], true), 1.0);
        assert_eq!(prob_improvement(&[3.0, 4.0], &[1.0, 2.0], false), 0.0);
        assert_eq!(prob_improvement(&[1.0, 3.0], &[1.0, 2.0], true), 0.625);
    }

    #[test]
    fn t_quantiles_match_tables() {
        assert!((t_quantile(0.95, 4.0) - 2.131_847).abs() < 1e-5);
        assert!((t_quantile(0.975, 10.0) - 2.228_139).abs() < 1e-5);
        assert!((t_quantile(0.95, f64::INFINITY) - 1.644_854).abs() < 1e-4);
    }

    #[test]
    fn welch_matches_a_hand_computation() {
        let (d, se, df) = welch(&[1.0, 2.0, 3.0], &[2.0, 4.0, 6.0, 8.0]);
        assert!((d - (2.0 - 5.0)).abs() < 1e-12);
        let (vx, vy): (f64, f64) = (1.0 / 3.0, (20.0 / 3.0) / 4.0);
        assert!((se - (vx + vy).sqrt()).abs() < 1e-12);
        let want = (vx + vy).powi(2) / (vx * vx / 2.0 + vy * vy / 3.0);
        assert!((df - want).abs() < 1e-9);
    }

    #[test]
    fn bootstrap_is_seeded_and_brackets_the_estimate() {
        let x = [1.0, 2.0, 3.0, 4.0, 5.0];
        let y = [0.0, 1.0, 2.0, 3.0, 4.0];
        let a = Resampler::new(7).diff_interval(&x, &y, 2000, 0.05, mean);
        let b = Resampler::new(7).diff_interval(&x, &y, 2000, 0.05, mean);
        assert_eq!(a, b);
        assert_eq!(a.estimate, 1.0);
        assert!(
            a.lo < 1.0 && a.hi > 1.0 && a.lo > -2.0 && a.hi < 4.0,
            "{a:?}"
        );
    }

    #[test]
    fn band_matches_a_direct_resampling_and_brackets_the_mean() {
        // 4 seeds x 3 steps; step 1 is constant across seeds, so its band has zero width.
        let curves = [
            1.0, 5.0, 0.0, //
            2.0, 5.0, 1.0, //
            3.0, 5.0, 5.0, //
            4.0, 5.0, 9.0,
        ];
        let (m, lo, hi) = Resampler::new(1).band(&curves, 4, 3, 4000, 0.05);
        assert_eq!(m, vec![2.5, 5.0, 3.75]);
        assert_eq!((lo[1], hi[1]), (5.0, 5.0));
        for j in 0..3 {
            assert!(lo[j] <= m[j] && m[j] <= hi[j]);
        }
        // The bootstrap mean of 4 values from {1,2,3,4}: 5 % / 95 % points are near 1.75 / 3.25.
        assert!(
            (lo[0] - 1.75).abs() <= 0.25 && (hi[0] - 3.25).abs() <= 0.25,
            "{lo:?} {hi:?}"
        );
    }

    #[test]
    fn percentiles_by_selection_match_sorting() {
        let mut v: Vec<f64> = (0..1001)
            .map(|i| ((i * 7919) % 1001) as f64 * 0.5)
            .collect();
        let sorted = {
            let mut s = v.clone();
            s.sort_by(f64::total_cmp);
            s
        };
        let (lo, hi) = percentile_pair(&mut v, 0.05);
        assert_eq!(
            (lo, hi),
            (
                quantile_sorted(&sorted, 0.05),
                quantile_sorted(&sorted, 0.95)
            )
        );
        let mut w = vec![1.0, 4.0, 2.0, 3.0];
        let want = (quantile(&w, 0.1), quantile(&w, 0.9));
        assert_eq!(percentile_pair(&mut w, 0.1), want);
        assert!((want.0 - 1.3).abs() < 1e-12 && (want.1 - 3.7).abs() < 1e-12);
    }

    #[test]
    fn paired_intervals_use_the_differences() {
        // Arms that move together: the differences are 1, 1.1, 0.9, 1.0.
        let x = [2.0, 5.1, 3.9, 8.0];
        let y = [1.0, 4.0, 3.0, 7.0];
        let (d, se, df) = paired(&x, &y);
        assert!((d - 1.0).abs() < 1e-12 && df == 3.0);
        let sd = (0.02f64 / 3.0).sqrt();
        assert!((se - sd / 2.0).abs() < 1e-12, "{se}");
        let (_, welch_se, _) = welch(&x, &y);
        assert!(
            welch_se > 10.0 * se,
            "the pairing removes the seed-to-seed spread"
        );
        assert!(correlation(&x, &y) > 0.99);
        let i = paired_interval(&x, &y, 0.05);
        assert!((i.hi - 1.0 - t_quantile(0.95, 3.0) * se).abs() < 1e-12);
        let b = Resampler::new(3).paired_interval(&x, &y, 4000, 0.05, mean);
        assert!(
            b.lo >= 0.9 && b.hi <= 1.1 && b.lo < 1.0 && b.hi > 1.0,
            "{b:?}"
        );
        // Two paired seeds at rho: a seed count that follows sd·sqrt(2(1 - rho)).
        let indep = seeds_needed(1.0, 1.0, 0.05, 0.8).unwrap();
        let rho = seeds_needed_diff((2.0f64 * 0.5).sqrt(), 1.0, 0.05, 0.8).unwrap();
        assert!(rho < indep && rho >= indep / 2 - 1, "{rho} vs {indep}");
    }

    #[test]
    fn rate_ratio_interval_is_exact_and_handles_zeros() {
        // 10 events in 100 steps against 10 in 100: ratio 1, interval brackets it.
        let i = rate_ratio_interval(10, 100.0, 10, 100.0, 0.05);
        assert_eq!(i.estimate, 1.0);
        assert!(
            i.lo < 1.0 && i.hi > 1.0 && i.lo > 0.3 && i.hi < 3.0,
            "{i:?}"
        );
        // Exposure scales the ratio: the same counts over half the steps is twice the rate.
        let j = rate_ratio_interval(10, 50.0, 10, 100.0, 0.05);
        assert!((j.estimate - 2.0).abs() < 1e-12 && (j.lo - 2.0 * i.lo).abs() < 1e-9);
        // No baseline events: the ratio has no upper end.
        let k = rate_ratio_interval(5, 100.0, 0, 100.0, 0.05);
        assert!(k.hi.is_infinite() && k.lo > 1.0, "{k:?}");
        // Clopper-Pearson for 0 of 5 (upper 1 - 0.05^(1/5)) maps to the ratio's upper end.
        let z = rate_ratio_interval(0, 100.0, 5, 100.0, 0.05);
        let p = 1.0 - 0.05f64.powf(0.2);
        assert_eq!(z.lo, 0.0);
        assert!((z.hi - p / (1.0 - p)).abs() < 1e-9, "{z:?}");
    }

    #[test]
    fn a_two_group_contrast_is_welch_or_paired() {
        let x = [2.0, 5.1, 3.9, 8.0];
        let y = [1.0, 4.0, 3.0, 7.5, 2.0];
        let (d, se, df) = contrast(&[x.to_vec(), y.to_vec()], &[1.0, -1.0], false);
        let w = welch(&x, &y);
        assert!((d - w.0).abs() < 1e-12 && (se - w.1).abs() < 1e-12 && (df - w.2).abs() < 1e-9);
        let i = t_interval(d, se, df, 0.05);
        assert!((i.lo - welch_interval(&x, &y, 0.05).lo).abs() < 1e-12);
        let y4 = &y[..4];
        let (d, se, df) = contrast(&[x.to_vec(), y4.to_vec()], &[1.0, -1.0], true);
        assert_eq!((d, se, df), paired(&x, y4));
    }

    #[test]
    fn p_values_agree_with_the_intervals_they_invert() {
        // d = 1, se = 0.4, df = 5: the 90 % interval's lower end is 1 - 2.015·0.4 = 0.194 > 0.
        let i = t_interval(1.0, 0.4, 5.0, 0.05);
        assert!(i.lo > 0.0);
        assert!(above_p(1.0, 0.4, 5.0, 0.0) < 0.05);
        assert!(above_p(1.0, 0.4, 5.0, i.lo + 1e-9) > 0.05 - 1e-6);
        assert!((t_upper_p(t_quantile(0.95, 5.0), 5.0) - 0.05).abs() < 1e-9);
        // Binomial: 12 events against 2 at equal exposure; P(X >= 12 | n = 14, p = 1/2).
        let (up, down) = rate_ratio_p(12, 100.0, 2, 100.0);
        let want = (1.0 + 14.0 + 91.0) / 16384.0;
        assert!((up - want).abs() < 1e-12, "{up}");
        assert!(down > 0.99);
        assert!(rate_ratio_interval(12, 100.0, 2, 100.0, 0.05).lo > 1.0);
        let (up, _) = rate_ratio_p(6, 100.0, 4, 100.0);
        assert!(up > 0.05 && rate_ratio_interval(6, 100.0, 4, 100.0, 0.05).lo < 1.0);
    }

    #[test]
    fn holm_steps_down() {
        // Sorted 0.01, 0.02, 0.04 over m = 3: 0.03, 0.04, 0.04 (monotone).
        let a = holm(&[0.04, 0.01, 0.02]);
        let want = [0.04, 0.03, 0.04];
        for (x, w) in a.iter().zip(want) {
            assert!((x - w).abs() < 1e-12, "{a:?}");
        }
        assert_eq!(holm(&[f64::NAN, 0.5]), vec![1.0, 1.0]);
        assert_eq!(holm(&[0.2]), vec![0.2]);
    }

    #[test]
    fn slope_and_seed_counts() {
        assert!((ols_slope(&[0.0, 1.0, 2.0], &[1.0, 3.0, 5.0]) - 2.0).abs() < 1e-12);
        let n = seeds_needed(1.0, 1.0, 0.05, 0.8).unwrap();
        // Normal approximation 2·(1.645+0.842)² ≈ 12.4; t quantiles add a seed.
        assert!((13..=15).contains(&n), "{n}");
        assert!(seeds_needed(1.0, 0.1, 0.05, 0.8).unwrap() > 1000);
        assert!(
            sd_upper(1.0, 4.0, 0.05) > 2.0,
            "4 df: the upper bound is ~2.4x"
        );
    }
}
