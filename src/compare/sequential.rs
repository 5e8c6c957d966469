//! Sequential seeds: decide after each batch of seeds whether a configuration is `equivalent` to
//! the baseline, `regressed`, or needs more seeds, while the stated error rates hold over the whole
//! procedure and not per look. Pure statistics over per-seed values; running the seeds is the
//! caller's (a runner calls [`SequentialPlan::decide`] after each batch of both arms).
//!
//! The design is a group-sequential test with error spending (Lan and DeMets 1983): the looks are
//! fixed in advance at `min_seeds, min_seeds + batch, ..., max_seeds` seeds per arm, and the
//! one-sided error `alpha` is spent over the looks by the O'Brien-Fleming-type function
//! `alpha(t) = 2 - 2·Phi(z(1 - alpha/2) / sqrt(t))`, where `t = n / max_seeds` is the information
//! fraction. The boundary `c_k` of look `k` solves "the chance of crossing first at look `k`
//! when nothing changed is `alpha(t_k) - alpha(t_{k-1})`" for the correlated statistics
//! `Z_k = B(t_k) / sqrt(t_k)` of a Brownian motion (the numerical recursion of Armitage,
//! McPherson and Rowe on a grid), so early looks need overwhelming evidence (about 4 sigma at a
//! third of the seeds) and the last look runs at nearly the fixed-design level. Each boundary is
//! turned into a nominal one-sided level `p_k = 1 - Phi(c_k)` and applied to the t interval of the
//! look (paired when the seeds couple the arms, Welch otherwise), the usual nominal-p conversion
//! for an estimated variance.
//!
//! At each look, with the difference oriented so positive is better and `[lo, hi]` its interval at
//! two-sided level `1 - 2·p_k`:
//! - `equivalent` when `-margin < lo` and `hi < margin` (both one-sided tests of TOST at the
//!   look's level) and the seeds reach what the margin needs at a fixed design (the same count as
//!   `compare`'s, from a 99 % upper bound on the noise), so a quiet first batch cannot stop early;
//! - `regressed` when `hi < 0` (worse at the look's level; spending keeps the chance of ever
//!   saying so for identical arms at most `alpha`);
//! - otherwise `continue` with the next look's seed count, and at the last look `inconclusive`
//!   with the seeds a fixed design would need.

use super::result::Interval;
use super::stats;
use serde::{Deserialize, Serialize};
use statrs::distribution::{ContinuousCDF, Normal};

/// What the procedure says after a look.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SequentialVerdict {
    Equivalent,
    Regressed,
    /// Run more seeds: up to `next_seeds` per arm.
    Continue,
    /// The last look was reached undecided.
    Inconclusive,
}

/// One look's decision and what it rests on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SequentialDecision {
    pub verdict: SequentialVerdict,
    /// Seeds per arm the look used.
    pub seeds: usize,
    /// With `continue`: the seeds per arm of the next look.
    pub next_seeds: Option<usize>,
    /// Difference (configuration - baseline, metric units) with its interval at `1 - 2·nominal`.
    pub interval: Interval,
    /// One-sided level of this look's tests (from the boundary).
    pub nominal_alpha: f64,
    /// The error spent up to and including this look, `alpha(t_k)`.
    pub spent_alpha: f64,
    /// Seeds per arm a fixed design needs for the margin at the stated power (99 % noise bound).
    pub seeds_needed: Option<usize>,
    pub reason: String,
}

/// The planned looks and their boundaries.
#[derive(Debug, Clone, PartialEq)]
pub struct SequentialPlan {
    /// One-sided error of each test over the whole procedure.
    pub alpha: f64,
    /// Power at which the margin's seed count is computed.
    pub power: f64,
    /// Equivalence margin, absolute, in the metric's units.
    pub margin: f64,
    pub higher_is_better: bool,
    /// Seeds per arm at each look, ascending; the last is `max_seeds`.
    pub looks: Vec<usize>,
    /// `alpha(t_k)` at each look.
    pub spent: Vec<f64>,
    /// Boundary `c_k` (standard normal units) at each look.
    pub bounds: Vec<f64>,
}

/// Why a plan cannot be made.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanError {
    #[error(
        "sequential seeds: min_seeds {min} must be at least 2 and at most max_seeds {max}; set --min-seeds/--max-seeds so that 2 <= min <= max"
    )]
    Seeds { min: usize, max: usize },
    #[error("sequential seeds: batch must be at least 1 (got 0); use --batch 1 or more")]
    Batch,
    #[error("sequential seeds: alpha {0} must be in (0, 0.5), power in (0.5, 1), margin > 0")]
    Levels(f64),
}

/// The O'Brien-Fleming-type spending function of Lan and DeMets at information fraction `t`:
/// `2 - 2·Phi(z(1 - alpha/2) / sqrt(t))`; it is 0 at `t = 0` and `alpha` at `t = 1`.
pub fn obrien_fleming_spent(alpha: f64, t: f64) -> f64 {
    if t <= 0.0 {
        return 0.0;
    }
    let z = std_normal().inverse_cdf(1.0 - alpha / 2.0);
    2.0 - 2.0 * std_normal().cdf(z / t.min(1.0).sqrt())
}

fn std_normal() -> Normal {
    Normal::new(0.0, 1.0).expect("the standard normal has valid parameters")
}

impl SequentialPlan {
    /// Looks at `min_seeds`, then every `batch` seeds, up to `max_seeds` (always a look).
    pub fn new(
        alpha: f64,
        power: f64,
        margin: f64,
        higher_is_better: bool,
        min_seeds: usize,
        max_seeds: usize,
        batch: usize,
    ) -> Result<SequentialPlan, PlanError> {
        if !(alpha > 0.0 && alpha < 0.5 && power > 0.5 && power < 1.0 && margin > 0.0) {
            return Err(PlanError::Levels(alpha));
        }
        if min_seeds < 2 || min_seeds > max_seeds {
            return Err(PlanError::Seeds {
                min: min_seeds,
                max: max_seeds,
            });
        }
        if batch == 0 {
            return Err(PlanError::Batch);
        }
        let mut looks: Vec<usize> = (min_seeds..max_seeds).step_by(batch).collect();
        looks.push(max_seeds);
        let t: Vec<f64> = looks.iter().map(|&n| n as f64 / max_seeds as f64).collect();
        let spent: Vec<f64> = t.iter().map(|&t| obrien_fleming_spent(alpha, t)).collect();
        let bounds = boundaries(&t, &spent);
        Ok(SequentialPlan {
            alpha,
            power,
            margin,
            higher_is_better,
            looks,
            spent,
            bounds,
        })
    }

    /// The nominal one-sided level of look `k`.
    pub fn nominal(&self, k: usize) -> f64 {
        1.0 - std_normal().cdf(self.bounds[k])
    }

    /// Decide from the per-seed values so far: `x` the configuration's, `y` the baseline's; with
    /// `paired`, `x[i]` and `y[i]` are the same seed (the same length is then required, else the
    /// shorter length counts). The look used is the last planned one at or below the seeds in
    /// hand; the error rates hold when the caller looks only at the planned counts.
    pub fn decide(&self, x: &[f64], y: &[f64], paired: bool) -> SequentialDecision {
        let n = x.len().min(y.len());
        let (x, y) = if paired { (&x[..n], &y[..n]) } else { (x, y) };
        let Some(k) = self.looks.iter().rposition(|&l| l <= n) else {
            return SequentialDecision {
                verdict: SequentialVerdict::Continue,
                seeds: n,
                next_seeds: Some(self.looks[0]),
                interval: Interval {
                    estimate: stats::mean(x) - stats::mean(y),
                    lo: f64::NAN,
                    hi: f64::NAN,
                },
                nominal_alpha: 0.0,
                spent_alpha: 0.0,
                seeds_needed: None,
                reason: format!(
                    "{n} seed(s) per arm; the first look is at {}",
                    self.looks[0]
                ),
            };
        };
        let p = self.nominal(k);
        let (raw, sd_diff_up) = if paired {
            let d: Vec<f64> = x.iter().zip(y).map(|(a, b)| a - b).collect();
            let up = stats::sd_upper(stats::variance(&d), n as f64 - 1.0, 0.01);
            (stats::paired_interval(x, y, p), up)
        } else {
            let (var, df) = stats::pooled_variance(x, y);
            let up = stats::sd_upper(var, df, 0.01) * std::f64::consts::SQRT_2;
            (stats::welch_interval(x, y, p), up)
        };
        let needed = stats::seeds_needed_diff(sd_diff_up, self.margin, self.alpha, self.power);
        let (lo, hi) = if self.higher_is_better {
            (raw.lo, raw.hi)
        } else {
            (-raw.hi, -raw.lo)
        };
        let m = self.margin;
        let last = k + 1 == self.looks.len();
        let f = super::expr::fmt_num;
        let ci = format!("{} [{}, {}]", f(raw.estimate), f(raw.lo), f(raw.hi));
        let level = format!(
            "look {} of {} at {n} seeds, nominal one-sided level {:.2e}",
            k + 1,
            self.looks.len(),
            p
        );
        let (verdict, reason) = if !(lo.is_finite() && hi.is_finite()) {
            (
                if last {
                    SequentialVerdict::Inconclusive
                } else {
                    SequentialVerdict::Continue
                },
                format!("{level}: no interval could be computed ({ci})"),
            )
        } else if lo > -m && hi < m && needed.is_some_and(|k| n >= k) {
            (
                SequentialVerdict::Equivalent,
                format!("{level}: difference {ci} inside ±{}", f(m)),
            )
        } else if hi < 0.0 {
            (
                SequentialVerdict::Regressed,
                format!("{level}: difference {ci} wholly on the worse side of 0"),
            )
        } else if last {
            (
                SequentialVerdict::Inconclusive,
                format!(
                    "{level}: difference {ci} undecided at the last look; a fixed design would need about {} seeds",
                    needed.map_or("more".into(), |k| k.to_string())
                ),
            )
        } else {
            (
                SequentialVerdict::Continue,
                format!("{level}: difference {ci} undecided"),
            )
        };
        SequentialDecision {
            verdict,
            seeds: n,
            next_seeds: (verdict == SequentialVerdict::Continue).then(|| self.looks[k + 1]),
            interval: raw,
            nominal_alpha: p,
            spent_alpha: self.spent[k],
            seeds_needed: needed,
            reason,
        }
    }

    /// Whether the last look resolves the margin at the stated power for a per-seed difference of
    /// standard deviation `sd_diff` (paired: `sd·sqrt(2(1 - rho))`; independent arms:
    /// `sd·sqrt(2)`): a fixed design of `max_seeds` at the last look's nominal level reaches the
    /// power. When it does not, `max_seeds` is too small for this noise and the procedure will
    /// often end `inconclusive`; a runner can say so before spending the seeds.
    pub fn resolves(&self, sd_diff: f64) -> bool {
        let k = self.looks.len() - 1;
        stats::seeds_needed_diff(sd_diff, self.margin, self.nominal(k), self.power)
            .is_some_and(|n| n <= self.looks[k])
    }

    /// One line for a report's method section.
    pub fn describe(&self) -> String {
        let b: Vec<String> = self
            .looks
            .iter()
            .zip(&self.bounds)
            .map(|(n, c)| format!("{n} seeds: z {c:.2}"))
            .collect();
        format!(
            "Sequential seeds: group-sequential tests with Lan-DeMets O'Brien-Fleming-type error spending (one-sided alpha {} per test over the whole procedure), looks and boundaries {}; each boundary is applied to the look's t interval as a nominal level.",
            self.alpha,
            b.join(", ")
        )
    }
}

/// Boundaries `c_k` for looks at information fractions `t` (ascending, last 1) with cumulative
/// spending `spent`: the first-crossing probability of `B(t_k) / sqrt(t_k) >= c_k` under no
/// change equals `spent[k] - spent[k-1]`. The density of the paths still running is carried on a
/// grid of `B` (spacing a fortieth of the smallest look-to-look standard deviation, from -10 to
/// the boundary, trapezoid weights) and convolved with the Gaussian increment between looks.
fn boundaries(t: &[f64], spent: &[f64]) -> Vec<f64> {
    let nd = std_normal();
    let min_step = t
        .iter()
        .scan(0.0, |prev, &x| {
            let d = x - *prev;
            *prev = x;
            Some(d)
        })
        .fold(f64::INFINITY, f64::min);
    let h = min_step.max(1e-6).sqrt() / 40.0;
    let phi = |x: f64| (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
    // Density of B(t_k) at grid points, with trapezoid weights, for the paths not yet crossed.
    let lo = -10.0;
    let mut grid: Vec<f64> = Vec::new();
    let mut wdens: Vec<f64> = Vec::new(); // density times quadrature weight
    let mut out = Vec::with_capacity(t.len());
    let mut prev_t = 0.0;
    for (k, &tk) in t.iter().enumerate() {
        let target = spent[k] - if k == 0 { 0.0 } else { spent[k - 1] };
        let sd = (tk - prev_t).sqrt();
        // Crossing probability for a boundary c: P(B(t_k) >= c·sqrt(t_k), not crossed before).
        let cross = |c: f64| -> f64 {
            let b = c * tk.sqrt();
            if k == 0 {
                1.0 - nd.cdf(b / sd)
            } else {
                grid.iter()
                    .zip(&wdens)
                    .map(|(u, w)| w * (1.0 - nd.cdf((b - u) / sd)))
                    .sum::<f64>()
            }
        };
        let c = if target <= 0.0 {
            f64::INFINITY
        } else {
            // Bisection on c in [0, 12]: crossing falls as c rises.
            let (mut a, mut z) = (0.0, 12.0);
            for _ in 0..60 {
                let mid = 0.5 * (a + z);
                if cross(mid) > target {
                    a = mid;
                } else {
                    z = mid;
                }
            }
            0.5 * (a + z)
        };
        out.push(c);
        if k + 1 == t.len() {
            break;
        }
        // The continuing paths at t_k: grid from `lo` up to the boundary, which is the last point.
        let top = if c.is_finite() { c * tk.sqrt() } else { 12.0 };
        let mut new_grid: Vec<f64> = (0..)
            .map(|i| lo + i as f64 * h)
            .take_while(|&s| s < top)
            .collect();
        new_grid.push(top);
        let dens: Vec<f64> = new_grid
            .iter()
            .map(|&s| {
                if k == 0 {
                    phi(s / sd) / sd
                } else {
                    grid.iter()
                        .zip(&wdens)
                        .map(|(u, w)| w * phi((s - u) / sd) / sd)
                        .sum::<f64>()
                }
            })
            .collect();
        let m = new_grid.len();
        wdens = (0..m)
            .map(|i| {
                let left = if i > 0 {
                    new_grid[i] - new_grid[i - 1]
                } else {
                    0.0
                };
                let right = if i + 1 < m {
                    new_grid[i + 1] - new_grid[i]
                } else {
                    0.0
                };
                dens[i] * 0.5 * (left + right)
            })
            .collect();
        grid = new_grid;
        prev_t = tk;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spending_reaches_alpha_at_the_end_and_little_early() {
        assert!((obrien_fleming_spent(0.05, 1.0) - 0.05).abs() < 1e-9);
        assert_eq!(obrien_fleming_spent(0.05, 0.0), 0.0);
        assert!(obrien_fleming_spent(0.05, 0.25) < 1e-4);
        assert!(obrien_fleming_spent(0.05, 0.5) < 0.006);
    }

    #[test]
    fn one_look_is_the_fixed_design_and_two_looks_match_published_bounds() {
        let p = SequentialPlan::new(0.05, 0.8, 0.05, true, 10, 10, 5).unwrap();
        assert_eq!(p.looks, vec![10]);
        assert!((p.bounds[0] - 1.644_854).abs() < 1e-4, "{:?}", p.bounds);
        // Two equally spaced looks, Lan-DeMets O'Brien-Fleming-type spending at one-sided 0.025
        // (R gsDesign, `sfLDOF`, k = 2): 2.963 and 1.969. The first is closed form,
        // `z(1 - alpha(0.5))`; the second needs the recursion. (The classical, unspent
        // O'Brien-Fleming bounds are 2.797 and 1.977.)
        let p = SequentialPlan::new(0.025, 0.8, 0.05, true, 5, 10, 5).unwrap();
        assert_eq!(p.looks, vec![5, 10]);
        assert!((p.bounds[0] - 2.963).abs() < 0.002, "{:?}", p.bounds);
        assert!((p.bounds[1] - 1.969).abs() < 0.002, "{:?}", p.bounds);
    }

    #[test]
    fn boundaries_spend_alpha_over_the_looks_of_a_brownian_motion() {
        use rand::{Rng, SeedableRng};
        let p = SequentialPlan::new(0.05, 0.8, 0.05, true, 3, 15, 3).unwrap();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        let paths = 200_000;
        let mut first = vec![0usize; p.looks.len()];
        for _ in 0..paths {
            let (mut sum, mut n) = (0.0, 0usize);
            for (k, &look) in p.looks.iter().enumerate() {
                while n < look {
                    // Standard normal by Box-Muller.
                    let u1: f64 = rng.random_range(f64::EPSILON..1.0);
                    let u2: f64 = rng.random_range(0.0..1.0);
                    sum += (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
                    n += 1;
                }
                if sum / (n as f64).sqrt() >= p.bounds[k] {
                    first[k] += 1;
                    break;
                }
            }
        }
        let mut prev = 0.0;
        for (k, c) in first.iter().enumerate() {
            let want = p.spent[k] - prev;
            prev = p.spent[k];
            let got = *c as f64 / paths as f64;
            let se = (want * (1.0 - want) / paths as f64).sqrt();
            println!("look {k}: first crossings {got:.5}, spent {want:.5}");
            assert!(
                (got - want).abs() <= 3.0 * se + 1e-4,
                "look {k}: {got} vs {want}"
            );
        }
    }

    #[test]
    fn looks_follow_the_batches_and_bad_plans_say_why() {
        let p = SequentialPlan::new(0.05, 0.8, 0.05, true, 3, 12, 4).unwrap();
        assert_eq!(p.looks, vec![3, 7, 11, 12]);
        assert!(p.bounds.windows(2).all(|w| w[0] > w[1]), "{:?}", p.bounds);
        let e = SequentialPlan::new(0.05, 0.8, 0.05, true, 1, 12, 4).unwrap_err();
        assert!(e.to_string().contains("--min-seeds"), "{e}");
        assert_eq!(
            SequentialPlan::new(0.05, 0.8, 0.05, true, 3, 12, 0),
            Err(PlanError::Batch)
        );
    }

    #[test]
    fn before_the_first_look_it_asks_for_seeds() {
        let p = SequentialPlan::new(0.05, 0.8, 0.05, true, 3, 12, 3).unwrap();
        let d = p.decide(&[0.5, 0.5], &[0.5, 0.5], true);
        assert_eq!(
            (d.verdict, d.next_seeds),
            (SequentialVerdict::Continue, Some(3))
        );
        // A large drop with tiny noise is regressed at the first look.
        let x = [0.30, 0.31, 0.29, 0.30];
        let y = [0.50, 0.51, 0.49, 0.50];
        let d = p.decide(&x[..3], &y[..3], true);
        assert_eq!(d.verdict, SequentialVerdict::Regressed, "{}", d.reason);
    }
}
