//! Scalars from TensorBoard event files (`*.tfevents.*`), as Megatron, Miles, NeMo-RL, verl and
//! TRL (`report_to="tensorboard"`) write them.
//!
//! An event file is a sequence of TFRecords: an 8-byte little-endian length, the masked CRC-32C of
//! those 8 bytes, the record, and the masked CRC-32C of the record. Each record is an `Event`
//! protobuf; its `summary` holds `Value`s with a tag and either the old `simple_value` (TensorFlow
//! 1, tensorboardX) or a scalar `tensor` (TensorBoard 2, PyTorch's SummaryWriter with
//! `new_style=True`). Histograms, images, text and graph events carry no scalar and are passed
//! over. The message types below declare only the fields lockstep reads, with TensorFlow's field
//! numbers (`tensorflow/core/util/event.proto`, `tensorflow/core/framework/summary.proto`,
//! `tensor.proto`); prost skips the rest. The framing is a few lines over the `crc32c` crate.

use prost::Message;

#[derive(Clone, PartialEq, Message)]
struct Event {
    #[prost(double, tag = "1")]
    wall_time: f64,
    #[prost(int64, tag = "2")]
    step: i64,
    #[prost(message, optional, tag = "5")]
    summary: Option<Summary>,
}

#[derive(Clone, PartialEq, Message)]
struct Summary {
    #[prost(message, repeated, tag = "1")]
    value: Vec<SummaryValue>,
}

#[derive(Clone, PartialEq, Message)]
struct SummaryValue {
    #[prost(string, tag = "1")]
    tag: String,
    #[prost(float, optional, tag = "2")]
    simple_value: Option<f32>,
    #[prost(message, optional, tag = "8")]
    tensor: Option<TensorProto>,
}

#[derive(Clone, PartialEq, Message)]
struct TensorProto {
    #[prost(int32, tag = "1")]
    dtype: i32,
    #[prost(bytes = "vec", tag = "4")]
    tensor_content: Vec<u8>,
    #[prost(float, repeated, tag = "5")]
    float_val: Vec<f32>,
    #[prost(double, repeated, tag = "6")]
    double_val: Vec<f64>,
    #[prost(int32, repeated, tag = "7")]
    int_val: Vec<i32>,
    #[prost(int64, repeated, tag = "10")]
    int64_val: Vec<i64>,
}

// TensorFlow's `DataType` numbers for the scalar types a summary may hold.
const DT_FLOAT: i32 = 1;
const DT_DOUBLE: i32 = 2;
const DT_INT32: i32 = 3;
const DT_INT64: i32 = 9;

impl TensorProto {
    /// The value of a one-element numeric tensor.
    fn scalar(&self) -> Option<f64> {
        let content = &self.tensor_content;
        match self.dtype {
            DT_FLOAT => self.float_val.first().map(|v| f64::from(*v)).or_else(|| {
                Some(f64::from(f32::from_le_bytes(
                    content.get(..4)?.try_into().ok()?,
                )))
            }),
            DT_DOUBLE => self
                .double_val
                .first()
                .copied()
                .or_else(|| Some(f64::from_le_bytes(content.get(..8)?.try_into().ok()?))),
            DT_INT32 => self.int_val.first().map(|v| f64::from(*v)),
            DT_INT64 => self.int64_val.first().map(|v| *v as f64),
            _ => None,
        }
    }
}

/// A scalar read from an event file.
#[derive(Debug, Clone, PartialEq)]
pub struct Scalar {
    pub step: u64,
    pub tag: String,
    pub value: f64,
}

/// What one event file held.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EventFile {
    pub scalars: Vec<Scalar>,
    /// Events at a negative step, skipped.
    pub skipped: usize,
    /// Where reading stopped early, when `keep_partial` allowed it: the byte offset and why.
    pub stopped: Option<(usize, String)>,
}

/// TFRecord's CRC mask (keeps a CRC of data that itself holds CRCs from being trivially zero).
fn masked_crc(bytes: &[u8]) -> u32 {
    let c = crc32c::crc32c(bytes);
    c.rotate_right(15).wrapping_add(0xa282_ead8)
}

fn le_u32(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// Read every scalar of an event file's bytes. A truncated or corrupt record is an error naming
/// its byte offset, unless `keep_partial`, where the records before it are kept and the offset
/// and reason are returned in [`EventFile::stopped`] (a job killed mid-write leaves a cut-off last
/// record).
pub fn read(bytes: &[u8], keep_partial: bool) -> Result<EventFile, String> {
    let mut out = EventFile::default();
    let mut at = 0usize;
    while at < bytes.len() {
        let problem = match next_record(bytes, at) {
            Ok((record, next)) => match Event::decode(record) {
                Ok(ev) => {
                    take_scalars(&ev, &mut out);
                    at = next;
                    continue;
                }
                Err(e) => format!("record is not an Event protobuf ({e})"),
            },
            Err(why) => why,
        };
        if keep_partial {
            out.stopped = Some((at, problem));
            break;
        }
        return Err(format!(
            "byte {at}: {problem}; set `keep_partial_events = true` in the metrics mapping to keep the records before it"
        ));
    }
    Ok(out)
}

/// The record starting at `at` and where the next one starts.
fn next_record(bytes: &[u8], at: usize) -> Result<(&[u8], usize), String> {
    let header = bytes
        .get(at..at + 12)
        .ok_or("truncated record header (the file ends mid-record)")?;
    if masked_crc(&header[..8]) != le_u32(&header[8..12]) {
        return Err("length checksum mismatch (not a TFRecord, or corrupt)".into());
    }
    let len = u64::from_le_bytes(header[..8].try_into().map_err(|_| "bad header")?);
    let len = usize::try_from(len).map_err(|_| "record length too large")?;
    let start = at + 12;
    let end = start
        .checked_add(len)
        .filter(|e| e.checked_add(4).is_some_and(|e| e <= bytes.len()))
        .ok_or("truncated record (the file ends mid-record)")?;
    let data = &bytes[start..end];
    if masked_crc(data) != le_u32(&bytes[end..end + 4]) {
        return Err("record checksum mismatch (corrupt)".into());
    }
    Ok((data, end + 4))
}

fn take_scalars(ev: &Event, out: &mut EventFile) {
    let Some(summary) = &ev.summary else {
        return;
    };
    for v in &summary.value {
        let value = v
            .simple_value
            .map(f64::from)
            .or_else(|| v.tensor.as_ref().and_then(TensorProto::scalar));
        let Some(value) = value else {
            continue; // a histogram, image or text: not a scalar metric
        };
        match u64::try_from(ev.step) {
            Ok(step) => out.scalars.push(Scalar {
                step,
                tag: v.tag.clone(),
                value,
            }),
            Err(_) => out.skipped += 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One TFRecord around `data`.
    fn record(data: &[u8]) -> Vec<u8> {
        let len = (data.len() as u64).to_le_bytes();
        let mut r = len.to_vec();
        r.extend_from_slice(&masked_crc(&len).to_le_bytes());
        r.extend_from_slice(data);
        r.extend_from_slice(&masked_crc(data).to_le_bytes());
        r
    }

    fn scalar_event(
        step: i64,
        tag: &str,
        simple: Option<f32>,
        tensor: Option<TensorProto>,
    ) -> Vec<u8> {
        Event {
            wall_time: 1.0,
            step,
            summary: Some(Summary {
                value: vec![SummaryValue {
                    tag: tag.into(),
                    simple_value: simple,
                    tensor,
                }],
            }),
        }
        .encode_to_vec()
    }

    #[test]
    fn masked_crc_matches_tensorflow() {
        // TensorFlow's crc32c_test: Mask(Value("foo")) and the masked value of an empty string.
        assert_eq!(crc32c::crc32c(b""), 0);
        assert_eq!(masked_crc(b""), 0xa282_ead8);
        assert_eq!(
            crc32c::crc32c(b"123456789"),
            0xe306_9283,
            "CRC-32C check value"
        );
    }

    #[test]
    fn both_scalar_forms_are_read_and_corruption_is_located() {
        let mut bytes = record(
            &Event {
                wall_time: 0.0,
                step: 0,
                summary: None,
            }
            .encode_to_vec(),
        );
        bytes.extend(record(&scalar_event(3, "train/reward", Some(0.25), None)));
        let t = TensorProto {
            dtype: DT_FLOAT,
            tensor_content: 0.5f32.to_le_bytes().to_vec(),
            ..Default::default()
        };
        bytes.extend(record(&scalar_event(4, "train/reward", None, Some(t))));
        let t = TensorProto {
            dtype: DT_DOUBLE,
            double_val: vec![f64::NAN],
            ..Default::default()
        };
        bytes.extend(record(&scalar_event(5, "train/loss", None, Some(t))));
        bytes.extend(record(&scalar_event(-1, "x", Some(1.0), None)));
        let f = read(&bytes, false).unwrap();
        assert_eq!(f.scalars.len(), 3);
        assert_eq!(
            f.scalars[0],
            Scalar {
                step: 3,
                tag: "train/reward".into(),
                value: 0.25
            }
        );
        assert_eq!(f.scalars[1].value, 0.5);
        assert!(f.scalars[2].value.is_nan());
        assert_eq!(f.skipped, 1, "the negative step");
        // Cut the last record short: an error with its offset, or the records before it.
        let good = bytes.len();
        bytes.extend(record(&scalar_event(6, "train/reward", Some(1.0), None)));
        let cut = &bytes[..bytes.len() - 3];
        let e = read(cut, false).unwrap_err();
        assert!(
            e.starts_with(&format!("byte {good}: truncated record")),
            "{e}"
        );
        let f = read(cut, true).unwrap();
        assert_eq!(f.scalars.len(), 3);
        assert_eq!(f.stopped.as_ref().map(|s| s.0), Some(good));
        // Flip a byte inside a record: the checksum catches it.
        let mut bad = bytes.clone();
        bad[good + 14] ^= 0x40;
        assert!(read(&bad, false).unwrap_err().contains("checksum mismatch"));
        assert!(read(b"not an event file at all", false).is_err());
    }
}
