//! Output buffers the quantizers fill without zeroing them first.
//!
//! Codes are most of what a quantization writes, and `vec![0; n]` writes every byte once
//! more before the kernels do: a tenth of an MXFP8 row quantization's time in `perf`. The row
//! kernels therefore take their outputs as `MaybeUninit` bytes, which they only ever write,
//! and [`written_by`] turns the buffer into a `Vec<u8>` once they have covered it.

use std::mem::MaybeUninit;

/// A buffer of `n` bytes that `fill` writes completely, as a `Vec<u8>`, with what `fill`
/// returned. Debug builds (the test profile) fill it with 0xA5 first, so a byte a kernel
/// missed shows in the tests as a wrong code rather than as uninitialised memory.
///
/// # Safety
/// `fill` must write every one of the `n` bytes it is given.
pub(crate) unsafe fn written_by<R>(
    n: usize,
    fill: impl FnOnce(&mut [MaybeUninit<u8>]) -> R,
) -> (Vec<u8>, R) {
    let mut v: Vec<u8> = Vec::with_capacity(n);
    let spare = &mut v.spare_capacity_mut()[..n];
    if cfg!(debug_assertions) {
        spare.fill(MaybeUninit::new(0xA5));
    }
    let r = fill(spare);
    // SAFETY: `fill` wrote all `n` bytes (the caller's contract), within the capacity.
    unsafe { v.set_len(n) };
    (v, r)
}

/// `b` zeroed, as initialised bytes: for the rarely used kernels that read or fill their
/// outputs as `u8` (MXFP8's OCP rule and E5M2 elements).
pub(crate) fn zeroed(b: &mut [MaybeUninit<u8>]) -> &mut [u8] {
    b.fill(MaybeUninit::new(0));
    // SAFETY: every byte was just written; `MaybeUninit<u8>` has `u8`'s layout.
    unsafe { &mut *(b as *mut [MaybeUninit<u8>] as *mut [u8]) }
}
