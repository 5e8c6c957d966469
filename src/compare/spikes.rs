//! Gradient spikes in one site's grad-norm series. Two rules, either one flags a step:
//! - robust z: `(ln g_t - median(ln g)) / (1.4826 · MAD(ln g))` over the preceding `window` steps
//!   (llm.c and OLMo 2 use a rolling z-score; median/MAD keeps an earlier spike from masking the
//!   next one, and the log makes the rule scale-free), for a step that is also a new high of the
//!   window (early in a run the MAD is small and a step below the recent max is no spike);
//! - ratio to the rolling max: `g_t / max(g over the window)` (Megatron's "10x the recent max").
//!
//! The window holds only earlier steps, so a spike never judges itself, and a step needs
//! `min_history` finite earlier values before it can be judged. Non-finite norms are not spikes
//! here: the trainer records them as `non_finite` events.

use super::settings::SpikeRule;

/// A flagged step: index into the series, ratio to the rolling max, robust z.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Flag {
    pub index: usize,
    pub ratio: f64,
    pub z: f64,
}

/// Flag spikes in one grad-norm series (values in step order).
///
/// The window is kept sorted as it slides (insert and remove by binary search), so the median is
/// a lookup and the MAD a merge of the two halves' distances to it; a step that cannot reach the
/// z threshold even with the MAD at its floor skips the MAD entirely.
pub fn find(g: &[f64], rule: &SpikeRule) -> Vec<Flag> {
    let mut out = Vec::new();
    let logs: Vec<f64> = g
        .iter()
        .map(|v| {
            if v.is_finite() && *v > 0.0 {
                v.ln()
            } else {
                f64::NAN
            }
        })
        .collect();
    let mut win: Vec<f64> = Vec::with_capacity(rule.window + 1);
    let z_reach = rule.z * 1.4826 * rule.mad_floor;
    for i in 0..g.len() {
        if i > rule.window {
            let old = logs[i - rule.window - 1];
            if old.is_finite()
                && let Ok(k) = win.binary_search_by(|p| p.total_cmp(&old))
            {
                win.remove(k);
            }
        }
        if i > 0 {
            let new = logs[i - 1];
            if new.is_finite() {
                let k = win.partition_point(|p| p.total_cmp(&new).is_lt());
                win.insert(k, new);
            }
        }
        let x = logs[i];
        if !x.is_finite() || win.len() < rule.min_history {
            continue;
        }
        let ratio = (x - win[win.len() - 1]).exp();
        let med = sorted_median(&win);
        if x - med < z_reach && ratio < rule.ratio {
            continue; // z < rule.z whatever the MAD, and under the ratio rule
        }
        let mad = sorted_mad(&win, med).max(rule.mad_floor);
        let z = (x - med) / (1.4826 * mad);
        if (z >= rule.z && ratio > 1.0) || ratio >= rule.ratio {
            out.push(Flag { index: i, ratio, z });
        }
    }
    out
}

fn sorted_median(s: &[f64]) -> f64 {
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        0.5 * (s[n / 2 - 1] + s[n / 2])
    }
}

/// Median absolute deviation of sorted values from their median `med`: the distances below the
/// median grow leftwards and those above grow rightwards, so merging the two runs gives the
/// distances in order without sorting.
fn sorted_mad(s: &[f64], med: f64) -> f64 {
    let n = s.len();
    let split = s.partition_point(|v| *v < med);
    let (mut l, mut r) = (split as isize - 1, split);
    let mut d = Vec::with_capacity(n);
    while d.len() < n {
        let dl = if l >= 0 {
            med - s[l as usize]
        } else {
            f64::INFINITY
        };
        let dr = if r < n { s[r] - med } else { f64::INFINITY };
        if dl <= dr {
            d.push(dl);
            l -= 1;
        } else {
            d.push(dr);
            r += 1;
        }
    }
    sorted_median(&d)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn noisy(n: usize) -> Vec<f64> {
        // deterministic ±10 % wiggle around 1.0
        (0..n)
            .map(|i| 1.0 + 0.1 * ((i * 7919 % 13) as f64 / 6.0 - 1.0))
            .collect()
    }

    #[test]
    fn a_single_jump_is_found_once_and_noise_is_not() {
        let rule = SpikeRule::default();
        let mut g = noisy(60);
        assert!(find(&g, &rule).is_empty(), "±10 % noise is not a spike");
        g[40] = 30.0;
        let f = find(&g, &rule);
        assert_eq!(f.len(), 1, "{f:?}");
        assert_eq!(f[0].index, 40);
        assert!(f[0].ratio > 20.0 && f[0].z > rule.z);
    }

    #[test]
    fn the_z_rule_fires_below_the_ratio_threshold() {
        let rule = SpikeRule::default();
        let mut g = noisy(60);
        g[30] = 4.0; // 4x: under the 10x ratio rule, far above 6 robust sigmas of ±10 % noise
        let f = find(&g, &rule);
        assert_eq!(f.iter().map(|f| f.index).collect::<Vec<_>>(), vec![30]);
        assert!(f[0].ratio < rule.ratio);
    }

    #[test]
    fn sorted_median_and_mad_match_the_definitions() {
        use crate::compare::stats::median;
        for n in 1..12 {
            let mut v: Vec<f64> = (0..n).map(|i| ((i * 37 % 11) as f64).powf(1.3)).collect();
            v.sort_by(f64::total_cmp);
            let m = median(&v);
            assert_eq!(sorted_median(&v), m);
            let dev: Vec<f64> = v.iter().map(|x| (x - m).abs()).collect();
            assert_eq!(sorted_mad(&v, m), median(&dev), "n = {n}");
        }
    }

    #[test]
    fn a_step_below_the_recent_max_is_not_a_z_spike() {
        let rule = SpikeRule::default();
        // Quiet series with one earlier high; a later step at 2x the median but below that high.
        let mut g = vec![1.0; 40];
        g[20] = 3.0;
        g[30] = 2.5;
        let f = find(&g, &rule);
        assert_eq!(
            f.iter().map(|f| f.index).collect::<Vec<_>>(),
            vec![20],
            "{f:?}"
        );
    }

    #[test]
    fn early_steps_and_non_finite_values_are_not_judged() {
        let rule = SpikeRule::default();
        let g = vec![
            1.0,
            50.0,
            f64::NAN,
            1.0,
            1.0,
            1.0,
            1.0,
            1.0,
            f64::INFINITY,
            1.0,
        ];
        assert!(find(&g, &rule).is_empty());
    }
}
