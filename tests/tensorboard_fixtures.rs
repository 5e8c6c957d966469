//! Issue 25: TensorBoard event files written by real writers (tensorboardX's SummaryWriter and
//! PyTorch's torch.utils.tensorboard.SummaryWriter: the `simple_value` form; TensorBoard's own
//! `scalar_pb`: the tensor form) are read back to the exact
//! values through the metrics mapping, with TRL's preset (1-based steps, `train/` prefix). The
//! fixtures and the script that wrote them are in `tests/fixtures/tensorboard/`.

use lockstep::suite::metrics::{MetricsMapping, read_metrics};
use std::path::Path;

fn mapping() -> MetricsMapping {
    toml::from_str("files = [\"events.out.tfevents.*\"]\npreset = \"trl\"\n").unwrap()
}

#[test]
fn event_files_from_every_writer_read_back_exactly() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tensorboard");
    let expected: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(root.join("expected.json")).unwrap())
            .unwrap();
    for writer in ["tensorboardx", "torch", "tensorboard-v2"] {
        let read = read_metrics(&root.join(writer), &mapping()).unwrap();
        assert!(read.missing.is_empty(), "{writer}");
        assert_eq!(read.records.len(), expected.len(), "{writer}");
        for (rec, want) in read.records.iter().zip(&expected) {
            assert_eq!(
                rec.step as u64 + 1,
                want["step"].as_u64().unwrap(),
                "{writer}: 1-based"
            );
            // Every writer stores 32-bit floats: the value read is the f32 nearest the logged one.
            let f32_of = |v: f64| f64::from(v as f32);
            let reward = want["train/reward"].as_f64().unwrap();
            assert_eq!(
                rec.get("rollout/raw_reward"),
                Some(f32_of(reward)),
                "{writer}: mapped by the preset"
            );
            match want["train/grad_norm"].as_f64() {
                Some(g) => assert_eq!(rec.get("train/grad_norm"), Some(f32_of(g)), "{writer}"),
                None => {
                    let g = rec.get("train/grad_norm");
                    assert!(g.is_some_and(f64::is_nan), "{writer}: NaN kept, got {g:?}");
                }
            }
        }
        assert_eq!(
            read.divergence(),
            Some((3, "train/grad_norm".to_string())),
            "{writer}"
        );
    }
}

#[test]
fn a_cut_off_event_file_fails_with_its_offset_unless_partial_records_are_kept() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tensorboard/tensorboardx");
    let bytes = std::fs::read(src.join("events.out.tfevents.fixture")).unwrap();
    let d = tempfile::tempdir().unwrap();
    std::fs::write(
        d.path().join("events.out.tfevents.cut"),
        &bytes[..bytes.len() - 5],
    )
    .unwrap();
    let e = read_metrics(d.path(), &mapping()).unwrap_err();
    assert!(
        e.contains("events.out.tfevents.cut: byte ") && e.contains("truncated"),
        "{e}"
    );
    let mut keep = mapping();
    keep.keep_partial_events = true;
    let r = read_metrics(d.path(), &keep).unwrap();
    assert_eq!(r.records.len(), 4, "every step before the cut");
    assert_eq!(r.skipped, 1, "the cut record");
}
