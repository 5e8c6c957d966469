//! The one quantizer. Every path — training forward and backward, rollout, weight export, checkpoint
//! conversion, CPU and GPU — calls this module, so a tensor quantizes to the same bytes everywhere.
//! The rules are `shared/formats-spec.md` (copied section numbers are cited at each rule); the
//! golden vectors in `tests/golden/` pin them byte for byte.
//!
//! Layers, from the bits up:
//! - element codecs: [`bf16`], [`fp8`] (E4M3, E5M2), [`e8m0`], [`e2m1`], sharing one
//!   round-to-nearest-even in [`minifloat`];
//! - block rules: [`mxfp8`], [`nvfp4`], [`fp8_block`];
//! - [`tensor`]: 2-D tensors quantized along rows or columns into a [`QuantizedTensor`];
//! - [`golden`]: the conformance runner behind `lockstep quantize --check` and the tests.

pub mod bf16;
pub mod e2m1;
pub mod e8m0;
pub mod fp8;
pub mod fp8_block;
pub mod golden;
pub mod isa;
pub mod minifloat;
pub mod mxfp8;
pub mod nvfp4;
mod output;
pub mod tensor;

pub use fp8_block::Fp8BlockVariant;
pub use mxfp8::{Fp8Elem, MxScaleRule};
pub use tensor::{
    Axis, Fp8Tile, QuantFormat, QuantizedTensor, Scales, SecondScale, fake_quantize, quantize,
    quantize_nvfp4_joint,
};

/// Errors a caller can fix: shapes that do not block, inconsistent options.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FormatError {
    #[error(
        "dimension {dim} ({name} = {size}) is not a multiple of the {format} block size {block}; \
         pad the tensor or quantize along the other axis"
    )]
    NotDivisible {
        dim: usize,
        name: &'static str,
        size: usize,
        format: String,
        block: usize,
    },
    #[error("tensor has {got} values but the shape {rows}x{cols} needs {want}")]
    ShapeMismatch {
        rows: usize,
        cols: usize,
        got: usize,
        want: usize,
    },
    #[error("empty tensor ({rows}x{cols}): nothing to quantize")]
    Empty { rows: usize, cols: usize },
    #[error("invalid option: {0}")]
    Option(String),
}

/// Counts a quantizer observed: elements clipped to the format's max, and non-zero finite elements
/// that became zero. Integer sums, so merging per-thread counts is deterministic.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct QuantStats {
    pub elements: u64,
    pub saturated: u64,
    pub underflowed: u64,
}

impl QuantStats {
    #[inline]
    pub(crate) fn note(&mut self, v: f32, clipped: bool) {
        self.elements += 1;
        self.saturated += u64::from(clipped && v.is_finite());
    }
    #[inline]
    pub(crate) fn note_underflow(&mut self, v: f32, code_is_zero: bool) {
        self.underflowed += u64::from(code_is_zero && v != 0.0 && v.is_finite());
    }
    /// Add a block's counts, kept by its encode loop in 32-bit lanes (one block is far below
    /// 2^32 values; 64-bit counters inside the loop halve its vector width).
    #[inline]
    pub(crate) fn add_block(&mut self, elements: usize, saturated: u32, underflowed: u32) {
        self.elements += elements as u64;
        self.saturated += u64::from(saturated);
        self.underflowed += u64::from(underflowed);
    }
    pub fn merge(self, o: QuantStats) -> QuantStats {
        QuantStats {
            elements: self.elements + o.elements,
            saturated: self.saturated + o.saturated,
            underflowed: self.underflowed + o.underflowed,
        }
    }
}
