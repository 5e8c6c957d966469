//! What a CUDA graph would save the rollout's decode: one decode position of a batch of runs
//! ([`pass::decode_on_device`], the work a rollout queues per generated token) timed as queued
//! op by op and as one captured graph replayed, outputs read back in both, with the replay's
//! outputs checked bit for bit against the queued ones. `lockstep bench decode` prints it.
//!
//! The engine's rollout does not use graphs: this measures whether it would pay.

use cudarc::driver::sys;

use super::CudaBackend;
use super::device_ops::GpuOps;
use crate::engine::device::{OpError, Ops};
use crate::engine::model::pass::{self, Weights};
use crate::engine::model::{PreparedModel, Routing};

/// One decode position's wall time, queued op by op and replayed as a graph.
#[derive(Debug, Clone)]
pub struct DecodeTimes {
    /// Median milliseconds of the position queued op by op, outputs read back.
    pub queued_ms: f64,
    /// The same as one graph replay; `None` where the stream could not capture it (the reason in
    /// `capture_error`).
    pub replay_ms: Option<f64>,
    /// Kernels, copies and allocations in the captured graph (its nodes).
    pub nodes: usize,
    /// The replay's logits and routing are bit for bit the queued position's.
    pub same: bool,
    pub capture_error: Option<String>,
}

/// How a caller times a position: `time(f)` calls `f` (one position, outputs read back) as often
/// as it likes and returns the milliseconds it reports (`lockstep bench`: a median).
pub type Timer<'t> =
    &'t mut dyn FnMut(&mut dyn FnMut() -> Result<(), OpError>) -> Result<f64, OpError>;

/// Time one decode position of `seqs` sequences of each of `preps`' runs (one stacked model, as
/// a batch decodes), after feeding each sequence `prompt`: `time` of the position queued op by
/// op against `time` of the position captured as a graph and replayed.
pub fn decode_times(
    backend: &CudaBackend,
    preps: &[&PreparedModel],
    seqs: usize,
    prompt: &[u32],
    time: Timer<'_>,
) -> Result<DecodeTimes, OpError> {
    let mut ops = backend.take_ops()?;
    ops.set_runs(preps.len());
    let out = measure(&ops, preps, seqs, prompt, time);
    match &out {
        // A failed capture can leave the stream unusable: that op set is dropped, not pooled.
        Ok(t) if t.capture_error.is_none() => backend.give_ops(ops),
        _ => drop(ops),
    }
    out
}

fn measure(
    ops: &GpuOps,
    preps: &[&PreparedModel],
    seqs: usize,
    prompt: &[u32],
    time: Timer<'_>,
) -> Result<DecodeTimes, OpError> {
    let model = ops.upload_models(preps, false)?;
    let cfg = model.config.clone();
    let n = seqs * preps.len();
    let mut kv = ops.kv_cache(cfg.n_layers, n, prompt.len() + 1, cfg.d_model, cfg.n_heads)?;
    let fed: Vec<u32> = (0..n).flat_map(|_| prompt.iter().copied()).collect();
    pass::decode(ops, &model, &mut kv, &fed, prompt.len(), None)?;
    let next: Vec<u32> = (0..n).map(|i| (i % cfg.vocab) as u32).collect();
    let rows = ops.decode_rows(&kv, 1)?;
    let toks = ops.ids(&next)?;
    let mut queued = || -> Result<(Vec<f32>, Routing), OpError> {
        let (logits, ids) = pass::decode_on_device(ops, &model, &mut kv, &toks, &rows, 1, None)?;
        pass::outputs_to_host(ops, &cfg, &logits, &ids, n)
    };
    // The warm-up also fills the op set's caches (quantizer scratch, packed weights), so the
    // capture allocates only the position's own buffers.
    let want = queued()?;
    let queued_ms = time(&mut || queued().map(|_| ()))?;
    let captured = capture(ops, &model, &mut kv, &toks, &rows);
    let (graph, logits, ids) = match captured {
        Ok(c) => c,
        Err(e) => {
            return Ok(DecodeTimes {
                queued_ms,
                replay_ms: None,
                nodes: 0,
                same: false,
                capture_error: Some(e.to_string()),
            });
        }
    };
    let nodes = graph_nodes(&graph)?;
    let replay = || -> Result<(Vec<f32>, Routing), OpError> {
        graph.launch()?;
        pass::outputs_to_host(ops, &cfg, &logits, &ids, n)
    };
    let got = replay()?;
    let same = bits(&got.0) == bits(&want.0) && got.1.layers == want.1.layers;
    let replay_ms = time(&mut || replay().map(|_| ()))?;
    // The outputs live in the graph's memory: freed (outside the graph) before it is destroyed.
    drop((logits, ids));
    drop(graph);
    Ok(DecodeTimes {
        queued_ms,
        replay_ms: Some(replay_ms),
        nodes,
        same,
        capture_error: None,
    })
}

type Captured = (
    cudarc::driver::CudaGraph,
    cudarc::driver::CudaSlice<f32>,
    Vec<cudarc::driver::CudaSlice<u32>>,
);

/// The decode position captured on the op set's stream; its outputs stay allocated in the
/// graph's memory, which each launch frees and makes again at the same addresses.
fn capture(
    ops: &GpuOps,
    model: &Weights<GpuOps>,
    kv: &mut <GpuOps as Ops>::Kv,
    toks: &<GpuOps as Ops>::Ids,
    rows: &<GpuOps as Ops>::Rows,
) -> Result<Captured, OpError> {
    let s = ops.stream();
    s.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
    let made = pass::decode_on_device(ops, model, kv, toks, rows, 1, None);
    // Capture ends whatever the pass did, so the stream leaves capture mode.
    let graph = s.end_capture(
        sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
    );
    let (logits, ids) = made?;
    let graph = graph?.ok_or_else(|| OpError::Shape("capture made no graph".into()))?;
    Ok((graph, logits, ids))
}

fn graph_nodes(g: &cudarc::driver::CudaGraph) -> Result<usize, OpError> {
    let mut count = 0usize;
    // SAFETY: a null node array asks only for the count; the graph lives across the call.
    unsafe { sys::cuGraphGetNodes(g.cu_graph(), std::ptr::null_mut(), &mut count) }.result()?;
    Ok(count)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}
