//! Whole-model host-to-device copies through one page-locked buffer.
//!
//! A copy from pageable host memory waits for the stream's earlier work and then goes through
//! the driver's own bounce buffer, one tensor at a time: a model's ~60 tensors cost ~20 ms that
//! way at the benchmark shape. [`Staging::upload`] packs all of them (in parallel) into one
//! page-locked buffer, moves that in one DMA copy, and splits it on the device with
//! device-to-device copies. Nothing on the host waits for the copy; the buffer is reused by the
//! next upload only once this one's copy has finished (an event).

use super::CudaError;
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, PinnedHostSlice};
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

/// Uploads on one stream through a page-locked buffer sized to the last upload (a run's models
/// keep their size, so it is allocated once per stream).
pub struct Staging {
    stream: Arc<CudaStream>,
    pinned: Mutex<Option<Pinned>>,
}

impl Staging {
    pub fn new(stream: &Arc<CudaStream>) -> Self {
        Staging {
            stream: stream.clone(),
            pinned: Mutex::new(None),
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
        let mut guard = self
            .pinned
            .lock()
            .map_err(|_| CudaError::Shape("staging buffer: a previous upload panicked".into()))?;
        if guard.as_ref().is_none_or(|p| p.host.len() != total) {
            *guard = None; // the old buffer waits for its copy as it drops
            // SAFETY: the buffer is written in full below before anything reads it.
            let host = unsafe { s.context().alloc_pinned_with_flags::<f32>(total, 0)? };
            *guard = Some(Pinned { host, copied: None });
        }
        let pinned = guard.as_mut().expect("allocated above");
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
