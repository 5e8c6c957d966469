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
