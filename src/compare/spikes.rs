//! Gradient spikes in one site's grad-norm series. Two rules, either one flags a step:
//! - robust z: `(ln g_t - median(ln g)) / (1.4826 · MAD(ln g))` over the preceding `window` steps
//!   (llm.c and OLMo 2 use a rolling z-score; median/MAD keeps an earlier spike from masking the
//!   next one, and the log makes the rule scale-free);
//! - ratio to the rolling max: `g_t / max(g over the window)` (Megatron's "10x the recent max").
//!
//! The window holds only earlier steps, so a spike never judges itself, and a step needs
//! `min_history` finite earlier values before it can be judged. Non-finite norms are not spikes
//! here: the trainer records them as `non_finite` events.

use super::settings::SpikeRule;
use super::stats::median;

/// A flagged step: index into the series, ratio to the rolling max, robust z.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Flag {
    pub index: usize,
    pub ratio: f64,
    pub z: f64,
}

/// Flag spikes in one grad-norm series (values in step order).
pub fn find(g: &[f64], rule: &SpikeRule) -> Vec<Flag> {
    let mut out = Vec::new();
    let logs: Vec<f64> = g
        .iter()
        .map(|v| if v.is_finite() && *v > 0.0 { v.ln() } else { f64::NAN })
        .collect();
    let mut win: Vec<f64> = Vec::with_capacity(rule.window);
    let mut dev: Vec<f64> = Vec::with_capacity(rule.window);
    for i in 0..g.len() {
        if !logs[i].is_finite() {
            continue;
        }
        let from = i.saturating_sub(rule.window);
        win.clear();
        win.extend(logs[from..i].iter().copied().filter(|v| v.is_finite()));
        if win.len() < rule.min_history {
            continue;
        }
        let max_log = win.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let ratio = (logs[i] - max_log).exp();
        let med = median(&win);
        // Cheap exit: at or below the median a step can be neither kind of spike.
        if logs[i] <= med && ratio < rule.ratio {
            continue;
        }
        dev.clear();
        dev.extend(win.iter().map(|v| (v - med).abs()));
        let mad = median(&dev).max(rule.mad_floor);
        let z = (logs[i] - med) / (1.4826 * mad);
        if z >= rule.z || ratio >= rule.ratio {
            out.push(Flag { index: i, ratio, z });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn noisy(n: usize) -> Vec<f64> {
        // deterministic ±10 % wiggle around 1.0
        (0..n).map(|i| 1.0 + 0.1 * ((i * 7919 % 13) as f64 / 6.0 - 1.0)).collect()
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
    fn early_steps_and_non_finite_values_are_not_judged() {
        let rule = SpikeRule::default();
        let g = vec![1.0, 50.0, f64::NAN, 1.0, 1.0, 1.0, 1.0, 1.0, f64::INFINITY, 1.0];
        assert!(find(&g, &rule).is_empty());
    }
}
