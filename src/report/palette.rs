//! One colour per configuration, the same in every figure and in the HTML tables' swatches, so a
//! reader learns it once. The baseline (BF16) is near-black; every other configuration family (base
//! configuration without sweep values) gets its own hue from a colour-blind-aware set, and the
//! members of a swept family get lighter or darker shades of that hue, in sweep order, so a sweep
//! reads as one family.

use plotters::style::RGBColor;
use std::collections::BTreeMap;

/// The baseline's colour.
pub const BASELINE: (u8, u8, u8) = (0x22, 0x22, 0x22);

/// Family hues (Tableau 10 without its grey, which is too close to the baseline).
const HUES: [(u8, u8, u8); 9] = [
    (0x1f, 0x77, 0xb4),
    (0xff, 0x7f, 0x0e),
    (0x2c, 0xa0, 0x2c),
    (0xd6, 0x27, 0x28),
    (0x94, 0x67, 0xbd),
    (0x8c, 0x56, 0x4b),
    (0xe3, 0x77, 0xc2),
    (0xbc, 0xbd, 0x22),
    (0x17, 0xbe, 0xcf),
];

/// Config name → colour, and family name → hue.
#[derive(Debug, Clone, Default)]
pub struct Palette {
    configs: BTreeMap<String, (u8, u8, u8)>,
    families: BTreeMap<String, (u8, u8, u8)>,
}

impl Palette {
    /// `configs` in display order (baseline included), each with its family name.
    pub fn new(configs: &[(String, String)], baseline: &str) -> Palette {
        let mut order: Vec<&str> = Vec::new();
        let mut members: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for (name, family) in configs {
            if name == baseline {
                continue;
            }
            if !members.contains_key(family.as_str()) {
                order.push(family);
            }
            members.entry(family).or_default().push(name);
        }
        let mut p = Palette::default();
        p.configs.insert(baseline.to_string(), BASELINE);
        let mut next_hue = 0;
        for fam in &order {
            // Swept variants of the baseline (e.g. `bf16 [bf16_last=4]`) stay black-grey.
            let hue = if *fam == baseline {
                BASELINE
            } else {
                next_hue += 1;
                HUES[(next_hue - 1) % HUES.len()]
            };
            p.families.insert(fam.to_string(), hue);
            let m = &members[fam];
            for (j, name) in m.iter().enumerate() {
                // Shades from darker (-0.4) to lighter (+0.4) across the family.
                let t = if m.len() == 1 {
                    0.0
                } else if hue == BASELINE {
                    0.2 + 0.4 * j as f64 / (m.len() - 1) as f64
                } else {
                    -0.4 + 0.8 * j as f64 / (m.len() - 1) as f64
                };
                p.configs.insert(name.to_string(), shade(hue, t));
            }
        }
        p
    }

    /// The configuration's colour (mid grey for a name the palette was not built with).
    pub fn rgb(&self, config: &str) -> (u8, u8, u8) {
        self.configs
            .get(config)
            .copied()
            .unwrap_or((0x99, 0x99, 0x99))
    }

    pub fn color(&self, config: &str) -> RGBColor {
        let (r, g, b) = self.rgb(config);
        RGBColor(r, g, b)
    }

    /// A family's hue (for sweep plots, where one line is one family).
    pub fn family_color(&self, family: &str) -> RGBColor {
        let (r, g, b) = self
            .families
            .get(family)
            .or(self.configs.get(family))
            .copied()
            .unwrap_or((0x99, 0x99, 0x99));
        RGBColor(r, g, b)
    }

    /// `#rrggbb` for HTML.
    pub fn hex(&self, config: &str) -> String {
        let (r, g, b) = self.rgb(config);
        format!("#{r:02x}{g:02x}{b:02x}")
    }
}

/// Mix towards black (t < 0) or white (t > 0).
fn shade((r, g, b): (u8, u8, u8), t: f64) -> (u8, u8, u8) {
    let f = |c: u8| {
        let c = c as f64;
        let v = if t < 0.0 {
            c * (1.0 + t)
        } else {
            c + (255.0 - c) * t
        };
        v.round().clamp(0.0, 255.0) as u8
    };
    (f(r), f(g), f(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfgs(v: &[(&str, &str)]) -> Vec<(String, String)> {
        v.iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect()
    }

    #[test]
    fn every_config_gets_a_distinct_stable_colour() {
        let c = cfgs(&[
            ("bf16", "bf16"),
            ("mxfp8", "mxfp8"),
            ("nvfp4-hp", "nvfp4-hp"),
            ("nvfp4-dq [bf16_last=2]", "nvfp4-dq"),
            ("nvfp4-dq [bf16_last=4]", "nvfp4-dq"),
        ]);
        let p = Palette::new(&c, "bf16");
        let q = Palette::new(&c, "bf16");
        let colours: Vec<_> = c.iter().map(|(n, _)| p.rgb(n)).collect();
        for (i, a) in colours.iter().enumerate() {
            for b in &colours[i + 1..] {
                assert_ne!(a, b, "two configs share a colour");
            }
        }
        for (n, _) in &c {
            assert_eq!(p.rgb(n), q.rgb(n), "colour of {n} not stable");
        }
        assert_eq!(p.rgb("bf16"), BASELINE);
        assert_eq!(p.hex("bf16"), "#222222");
        // Members of one sweep family are shades of the family's hue: same dominant channel.
        let (a, b) = (
            p.rgb("nvfp4-dq [bf16_last=2]"),
            p.rgb("nvfp4-dq [bf16_last=4]"),
        );
        let dom = |(r, g, b): (u8, u8, u8)| {
            [r, g, b]
                .iter()
                .enumerate()
                .max_by_key(|x| x.1)
                .map(|x| x.0)
        };
        assert_eq!(dom(a), dom(b));
    }

    #[test]
    fn swept_baseline_variants_stay_grey_and_do_not_take_a_hue() {
        let c = cfgs(&[
            ("bf16", "bf16"),
            ("bf16 [bf16_last=2]", "bf16"),
            ("bf16 [bf16_last=4]", "bf16"),
            ("nvfp4-dq [bf16_last=2]", "nvfp4-dq"),
        ]);
        let p = Palette::new(&c, "bf16");
        for n in ["bf16 [bf16_last=2]", "bf16 [bf16_last=4]"] {
            let (r, g, b) = p.rgb(n);
            assert!(r == g && g == b, "{n} is not grey: {:?}", (r, g, b));
            assert_ne!(p.rgb(n), BASELINE);
        }
        assert_ne!(p.rgb("bf16 [bf16_last=2]"), p.rgb("bf16 [bf16_last=4]"));
        // The first real family still gets the first hue.
        assert_eq!(p.rgb("nvfp4-dq [bf16_last=2]"), HUES[0]);
    }
}
