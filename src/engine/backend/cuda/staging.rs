//! Whole-model copies between host and device through one page-locked buffer each way.
//!
//! A copy from pageable host memory waits for the stream's earlier work and then goes through
//! the driver's own bounce buffer, one tensor at a time: a model's ~60 tensors cost ~20 ms that
//! way at the benchmark shape. [`Staging::upload`] packs all of them (in parallel) into one
//! page-locked buffer, moves that in one DMA copy, and splits it on the device with
//! device-to-device copies. Nothing on the host waits for the copy; the buffer is reused by the
//! next upload only once this one's copy has finished (an event). [`Staging::download`] is the
//! way back (a backward's gradients): gathered on the device, one copy, unpacked in parallel.

use super::CudaError;
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, CudaView, PinnedHostSlice};
use rayon::prelude::*;
use std::sync::{Arc, Mutex};

/// The page-locked buffer and the event recorded after the last copy out of it.
struct Pinned {
    host: PinnedHostSlice<f32>,
    copied: Option<CudaEvent>,
}

impl Pinned {
    /// Wait until the last copy out of the buffer is done.
    fn wait(&self) -> Result<(), CudaError> {
        if let Some(e) = &self.copied {
            e.synchronize()?;
        }
        Ok(())
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // The buffer must outlive the DMA reading it; errors cannot be returned from drop.
        let _ = self.wait();
    }
}

/// Uploads and downloads on one stream, each through a page-locked buffer of the copy's exact
/// size. A step uploads models of two sizes (the rollout's exported model and the trainer's
/// prepared one) through one stream, so a few sizes are kept: page-locking memory and freeing
/// it are slow driver calls (the free waits for the whole device), far dearer than the copy.
pub struct Staging {
    stream: Arc<CudaStream>,
    pinned: Mutex<Vec<Pinned>>,
    down: Mutex<Vec<Pinned>>,
}

/// Page-locked buffers kept per direction (the most recently used ones).
const KEPT_BUFFERS: usize = 4;

impl Staging {
    pub fn new(stream: &Arc<CudaStream>) -> Self {
        Staging {
            stream: stream.clone(),
            pinned: Mutex::new(Vec::new()),
            down: Mutex::new(Vec::new()),
        }
    }

    /// One new device buffer per group, holding the group's parts back to back (a site's routed
    /// experts are one group of E parts). Queued on the stream: usable by later work on it.
    pub fn upload(&self, groups: &[Vec<&[f32]>]) -> Result<Vec<CudaSlice<f32>>, CudaError> {
        let lens: Vec<usize> = groups
            .iter()
            .map(|g| g.iter().map(|p| p.len()).sum())
            .collect();
        let total: usize = lens.iter().sum();
        let s = &self.stream;
        if total == 0 {
            return groups.iter().map(|_| Ok(s.null()?)).collect();
        }
        let mut guard = sized(&self.pinned, s, total)?;
        let pinned = guard.last_mut().expect("sized");
        pinned.wait()?;
        pack(pinned.host.as_mut_slice()?, groups);
        // SAFETY: every element is written by the copy below before any read.
        let mut all = unsafe { s.alloc::<f32>(total)? };
        s.memcpy_htod(&pinned.host, &mut all)?;
        pinned.copied = Some(s.record_event(None)?);
        let mut out = Vec::with_capacity(groups.len());
        let mut off = 0;
        for &len in &lens {
            if len == 0 {
                out.push(s.null()?);
                continue;
            }
            // SAFETY: written in full by the copy that follows.
            let mut d = unsafe { s.alloc::<f32>(len)? };
            s.memcpy_dtod(&all.slice(off..off + len), &mut d)?;
            out.push(d);
            off += len;
        }
        Ok(out)
    }

    /// Each `(src, dst)`: the first `dst.len()` values of `src` into `dst`, after the stream's
    /// earlier work (this waits for it).
    pub fn download(&self, parts: &mut [(CudaView<'_, f32>, &mut [f32])]) -> Result<(), CudaError> {
        let total: usize = parts.iter().map(|(_, d)| d.len()).sum();
        if total == 0 {
            return Ok(());
        }
        let s = &self.stream;
        // SAFETY: every element is written by the gathering copies below before the read.
        let mut all = unsafe { s.alloc::<f32>(total)? };
        let mut off = 0;
        for (src, dst) in parts.iter() {
            let len = dst.len();
            if len > 0 {
                if src.len() < len {
                    return Err(CudaError::Shape(format!(
                        "download: {len} values asked of a buffer of {}",
                        src.len()
                    )));
                }
                s.memcpy_dtod(&src.slice(..len), &mut all.slice_mut(off..off + len))?;
            }
            off += len;
        }
        let mut guard = sized(&self.down, s, total)?;
        let pinned = guard.last_mut().expect("sized");
        s.memcpy_dtoh(&all, &mut pinned.host)?;
        s.synchronize()?;
        let host = pinned.host.as_slice()?;
        let mut pieces = Vec::with_capacity(parts.len());
        let mut rest = host;
        for (_, dst) in parts.iter_mut() {
            let (piece, tail) = rest.split_at(dst.len());
            pieces.push((&mut **dst, piece));
            rest = tail;
        }
        pieces
            .into_par_iter()
            .for_each(|(dst, piece)| dst.copy_from_slice(piece));
        Ok(())
    }
}

/// The buffers in `slot`, the last one holding exactly `total` values: a kept one of that size,
/// or a new one (the least recently used dropped beyond [`KEPT_BUFFERS`]).
fn sized<'a>(
    slot: &'a Mutex<Vec<Pinned>>,
    s: &Arc<CudaStream>,
    total: usize,
) -> Result<std::sync::MutexGuard<'a, Vec<Pinned>>, CudaError> {
    let mut guard = slot
        .lock()
        .map_err(|_| CudaError::Shape("staging buffer: a previous copy panicked".into()))?;
    match guard.iter().position(|p| p.host.len() == total) {
        Some(i) => {
            let p = guard.remove(i);
            guard.push(p);
        }
        None => {
            if guard.len() >= KEPT_BUFFERS {
                guard.remove(0); // waits for its copy as it drops
            }
            // SAFETY: every use writes the buffer in full before reading it.
            let host = unsafe { s.context().alloc_pinned_with_flags::<f32>(total, 0)? };
            guard.push(Pinned { host, copied: None });
        }
    }
    Ok(guard)
}

/// Every group's parts back to back into `dst` (exactly their total length), in parallel.
fn pack(dst: &mut [f32], groups: &[Vec<&[f32]>]) {
    let mut pieces = Vec::new();
    let mut rest = dst;
    for part in groups.iter().flatten() {
        let (piece, tail) = rest.split_at_mut(part.len());
        pieces.push((piece, *part));
        rest = tail;
    }
    debug_assert!(rest.is_empty());
    pieces
        .into_par_iter()
        .for_each(|(piece, part)| piece.copy_from_slice(part));
}

#[cfg(test)]
mod tests {
    use super::pack;

    #[test]
    fn pack_puts_groups_back_to_back_in_order() {
        let (a, b, c) = (vec![1.0f32, 2.0], vec![3.0f32], vec![4.0f32, 5.0, 6.0]);
        let groups: Vec<Vec<&[f32]>> = vec![vec![&a, &b], vec![], vec![&c]];
        let mut dst = vec![0.0f32; 6];
        pack(&mut dst, &groups);
        assert_eq!(dst, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    }
}
