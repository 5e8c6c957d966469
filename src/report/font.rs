//! The one font every figure uses: DejaVu Sans (Bitstream Vera license, `assets/fonts/`), compiled
//! into the binary and registered with plotters once. Without it plotters' `ab_glyph` backend draws
//! no text at all, and with system fonts the same report would render differently per machine.

use std::sync::OnceLock;

/// DejaVu Sans 2.37, copied from Debian's `fonts-dejavu-core` (license in `assets/fonts/`).
pub static DEJAVU_SANS: &[u8] = include_bytes!("../../assets/fonts/DejaVuSans.ttf");

/// The family name figures ask for (plotters' `FontFamily::SansSerif`).
pub const FAMILY: &str = "sans-serif";

/// Register the shipped font for the normal style (idempotent, thread-safe). Bold and italic are
/// never requested by the figures, so only one face ships.
pub fn ensure_registered() -> Result<(), String> {
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        plotters::style::register_font(FAMILY, plotters::style::FontStyle::Normal, DEJAVU_SANS)
            .map_err(|_| "the shipped DejaVu Sans font could not be parsed".to_string())
    })
    .clone()
}

#[cfg(test)]
mod tests {
    use super::*;
    use plotters::prelude::*;

    /// Dark pixels after drawing `text` on white (0 when no font could draw it).
    fn ink(text: &str) -> usize {
        let (w, h) = (200u32, 40u32);
        let mut buf = vec![255u8; (w * h * 3) as usize];
        {
            let root = BitMapBackend::with_buffer(&mut buf, (w, h)).into_drawing_area();
            let style: TextStyle<'_> = (FAMILY, 20).into_font().into();
            // An unregistered family is an error or no ink; either way nothing is drawn.
            let _ = root.draw(&Text::new(text.to_string(), (5, 5), style));
            let _ = root.present();
        }
        buf.chunks(3).filter(|p| p.iter().all(|c| *c < 128)).count()
    }

    #[test]
    fn the_shipped_font_registers_and_draws_text() {
        ensure_registered().expect("DejaVu Sans parses");
        ensure_registered().expect("registering twice is fine");
        assert!(ink("step 10, reward") > 50, "no text drawn");
        assert_eq!(ink(""), 0);
    }
}
