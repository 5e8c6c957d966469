//! History rows from a W&B run's transaction log (`run-<id>.wandb`), the only place an offline run
//! (`WANDB_MODE=offline`) or a current SDK keeps its history on disk: `files/` holds no
//! `wandb-history.jsonl` since the SDK moved to its Go core, and `wandb-summary.json` only the last
//! value of each key.
//!
//! The file is a LevelDB log (`google/leveldb` `doc/log_format.md`) behind a 7-byte W&B header:
//! `":W&B"`, the magic 0xBEE1 (little-endian) and version 0. It is cut into 32 KiB blocks; each
//! chunk is a 7-byte header (CRC-32 of the type byte and the data, length, type FULL/FIRST/MIDDLE/
//! LAST) and its data, a block tail shorter than a header is zero padding, and a record split over
//! blocks is rejoined from its FIRST, MIDDLE and LAST chunks. W&B checks the chunks with the plain
//! IEEE CRC-32 (`CRCAlgoIEEE`), not LevelDB's masked CRC-32C. Sources: wandb/wandb
//! `core/pkg/leveldb/record.go` and `crc.go`, `core/internal/transactionlog/{reader,writer}.go`,
//! the older `wandb/sdk/internal/datastore.py`.
//!
//! Each record is a `Record` protobuf (`wandb/proto/wandb_internal.proto`); lockstep declares only
//! its `history` field (2), a `HistoryRecord` of `HistoryItem`s (`key` or `nested_key`, the value
//! as `value_json`, `NaN` and `Infinity` spelt as Python's `json` does) and its `HistoryStep`. The
//! other records (run, config, summary, console output, system stats) are passed over. A nested
//! key is joined with `.`, as W&B's app and API show it (`{"perf": {"step_time": 2}}` is
//! `perf.step_time`).

use prost::Message;

#[derive(Clone, PartialEq, Message)]
struct Record {
    #[prost(message, optional, tag = "2")]
    history: Option<HistoryRecord>,
}

#[derive(Clone, PartialEq, Message)]
struct HistoryRecord {
    #[prost(message, repeated, tag = "1")]
    item: Vec<HistoryItem>,
    #[prost(message, optional, tag = "2")]
    step: Option<HistoryStep>,
}

#[derive(Clone, PartialEq, Message)]
struct HistoryItem {
    #[prost(string, tag = "1")]
    key: String,
    #[prost(string, repeated, tag = "2")]
    nested_key: Vec<String>,
    #[prost(string, tag = "16")]
    value_json: String,
}

#[derive(Clone, PartialEq, Message)]
struct HistoryStep {
    #[prost(int64, tag = "1")]
    num: i64,
}

/// One `run.log` row: the flattened key and the value's JSON text, in the order logged.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HistoryRow {
    pub items: Vec<(String, String)>,
    /// W&B's step (`_step`), from the record's `HistoryStep`.
    pub step: i64,
}

/// What one transaction log held.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TransactionLog {
    pub rows: Vec<HistoryRow>,
    /// Where reading stopped early, when `keep_partial` allowed it: the byte offset and why.
    pub stopped: Option<(usize, String)>,
}

const HEADER: [u8; 7] = [b':', b'W', b'&', b'B', 0xE1, 0xBE, 0];
const BLOCK: usize = 32 * 1024;
const CHUNK_HEADER: usize = 7;
const FULL: u8 = 1;
const FIRST: u8 = 2;
const MIDDLE: u8 = 3;
const LAST: u8 = 4;

/// Read every history row of a transaction log's bytes. A truncated or corrupt chunk is an error
/// naming its byte offset, unless `keep_partial` (a run killed mid-write, or one still running),
/// where the rows before it are kept and the offset and reason returned in
/// [`TransactionLog::stopped`].
pub fn read(bytes: &[u8], keep_partial: bool) -> Result<TransactionLog, String> {
    if bytes.get(..4) != Some(&HEADER[..4]) {
        return Err("not a W&B transaction log (no `:W&B` header)".into());
    }
    if bytes.get(..7) != Some(&HEADER[..]) {
        return Err(format!(
            "W&B transaction log header {:02x?}: lockstep reads version 0 (magic e1 be 00); sync it with `wandb sync` and export the history instead",
            &bytes[..bytes.len().min(7)]
        ));
    }
    let mut out = TransactionLog::default();
    let mut at = HEADER.len();
    let mut pending: Option<(usize, Vec<u8>)> = None; // a FIRST chunk's offset and data so far
    while at < bytes.len() {
        let problem = match next_chunk(bytes, at) {
            Ok(Chunk::Padding(next)) => {
                at = next;
                continue;
            }
            Ok(Chunk::Data(kind, data, next)) => match (kind, pending.take()) {
                (FULL, None) => match take_record(data, &mut out) {
                    Ok(()) => {
                        at = next;
                        continue;
                    }
                    Err(e) => e,
                },
                (FIRST, None) => {
                    pending = Some((at, data.to_vec()));
                    at = next;
                    continue;
                }
                (MIDDLE, Some((start, mut buf))) => {
                    buf.extend_from_slice(data);
                    pending = Some((start, buf));
                    at = next;
                    continue;
                }
                (LAST, Some((start, mut buf))) => {
                    buf.extend_from_slice(data);
                    match take_record(&buf, &mut out) {
                        Ok(()) => {
                            at = next;
                            continue;
                        }
                        Err(e) => {
                            at = start;
                            e
                        }
                    }
                }
                (k, Some((start, _))) => {
                    at = start;
                    format!("record split over blocks is broken by a chunk of type {k}")
                }
                (k, None) => format!("chunk of type {k} where a record should start (corrupt)"),
            },
            Err(why) => {
                // Inside a split record the record's own start is where reading stopped.
                if let Some((start, _)) = pending {
                    at = start;
                }
                why
            }
        };
        if keep_partial {
            out.stopped = Some((at, problem));
            return Ok(out);
        }
        return Err(format!(
            "byte {at}: {problem}; set `keep_partial_events = true` in the metrics mapping to keep the rows before it"
        ));
    }
    if let Some((start, _)) = pending {
        let problem = "truncated record (the file ends mid-record)".to_string();
        if keep_partial {
            out.stopped = Some((start, problem));
        } else {
            return Err(format!(
                "byte {start}: {problem}; set `keep_partial_events = true` in the metrics mapping to keep the rows before it"
            ));
        }
    }
    Ok(out)
}

enum Chunk<'a> {
    /// Zero bytes up to the next block (a block tail, or the writer's zero fill).
    Padding(usize),
    /// A chunk's type, its data, and where the next one starts.
    Data(u8, &'a [u8], usize),
}

fn next_chunk(bytes: &[u8], at: usize) -> Result<Chunk<'_>, String> {
    let block_end = (at / BLOCK + 1) * BLOCK;
    if block_end - at < CHUNK_HEADER {
        return Ok(Chunk::Padding(block_end));
    }
    let h = bytes
        .get(at..at + CHUNK_HEADER)
        .ok_or("truncated chunk header (the file ends mid-record)")?;
    let checksum = u32::from_le_bytes([h[0], h[1], h[2], h[3]]);
    let len = usize::from(u16::from_le_bytes([h[4], h[5]]));
    let kind = h[6];
    if checksum == 0 && len == 0 && kind == 0 {
        return Ok(Chunk::Padding(block_end));
    }
    let start = at + CHUNK_HEADER;
    let end = start + len;
    if end > block_end {
        return Err(format!(
            "chunk of {len} bytes runs past its block (corrupt)"
        ));
    }
    let data = bytes
        .get(start..end)
        .ok_or("truncated chunk (the file ends mid-record)")?;
    let mut crc = crc32fast::Hasher::new();
    crc.update(&[kind]);
    crc.update(data);
    if crc.finalize() != checksum {
        return Err("chunk checksum mismatch (corrupt)".into());
    }
    if !(FULL..=LAST).contains(&kind) {
        return Err(format!("unknown chunk type {kind} (corrupt)"));
    }
    Ok(Chunk::Data(kind, data, end))
}

fn take_record(data: &[u8], out: &mut TransactionLog) -> Result<(), String> {
    let rec = Record::decode(data).map_err(|e| format!("record is not a W&B Record ({e})"))?;
    let Some(h) = rec.history else {
        return Ok(()); // run, config, summary, output, stats: no history
    };
    let items = h
        .item
        .into_iter()
        .map(|i| {
            let key = if i.nested_key.is_empty() {
                i.key
            } else {
                i.nested_key.join(".")
            };
            (key, i.value_json)
        })
        .collect();
    out.rows.push(HistoryRow {
        items,
        step: h.step.map_or(0, |s| s.num),
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn history(step: i64, items: &[(&[&str], &str)]) -> Vec<u8> {
        let item = items
            .iter()
            .map(|(k, v)| HistoryItem {
                key: if k.len() == 1 {
                    k[0].into()
                } else {
                    String::new()
                },
                nested_key: if k.len() == 1 {
                    vec![]
                } else {
                    k.iter().map(|s| s.to_string()).collect()
                },
                value_json: v.to_string(),
            })
            .collect();
        Record {
            history: Some(HistoryRecord {
                item,
                step: Some(HistoryStep { num: step }),
            }),
        }
        .encode_to_vec()
    }

    /// Lay records out as W&B's writer does: chunks in 32 KiB blocks, split where a block ends.
    fn log(records: &[Vec<u8>]) -> Vec<u8> {
        let mut out = HEADER.to_vec();
        for r in records {
            let mut rest = &r[..];
            let mut first = true;
            loop {
                let left = BLOCK - out.len() % BLOCK;
                if left < CHUNK_HEADER {
                    out.resize(out.len() + left, 0);
                    continue;
                }
                let n = rest.len().min(left - CHUNK_HEADER);
                let last = n == rest.len();
                let kind = match (first, last) {
                    (true, true) => FULL,
                    (true, false) => FIRST,
                    (false, false) => MIDDLE,
                    (false, true) => LAST,
                };
                let mut crc = crc32fast::Hasher::new();
                crc.update(&[kind]);
                crc.update(&rest[..n]);
                out.extend_from_slice(&crc.finalize().to_le_bytes());
                out.extend_from_slice(&(n as u16).to_le_bytes());
                out.push(kind);
                out.extend_from_slice(&rest[..n]);
                rest = &rest[n..];
                first = false;
                if last {
                    break;
                }
            }
        }
        out
    }

    #[test]
    fn rows_nested_keys_and_records_split_over_blocks_are_read() {
        let big = "x".repeat(2 * BLOCK + 100); // FIRST, MIDDLE and LAST chunks
        let bytes = log(&[
            Record { history: None }.encode_to_vec(),
            history(0, &[(&["train/loss"], "1.5"), (&["perf", "t"], "2")]),
            history(1, &[(&["note"], &format!("\"{big}\"")), (&["x"], "NaN")]),
            history(2, &[(&["train/loss"], "0.5")]),
        ]);
        assert!(bytes.len() > 2 * BLOCK);
        let t = read(&bytes, false).unwrap();
        assert_eq!(t.rows.len(), 3);
        assert_eq!(
            t.rows[0].items,
            [
                ("train/loss".to_string(), "1.5".to_string()),
                ("perf.t".to_string(), "2".to_string())
            ]
        );
        assert_eq!(t.rows[1].items[1], ("x".to_string(), "NaN".to_string()));
        assert_eq!((t.rows[2].step, t.rows[2].items.len()), (2, 1));
        assert_eq!(t.stopped, None);
    }

    #[test]
    fn corruption_and_truncation_are_located() {
        let one = history(0, &[(&["a"], "1")]);
        let bytes = log(&[one.clone(), one.clone()]);
        let second = 7 + CHUNK_HEADER + one.len();
        let cut = &bytes[..bytes.len() - 2];
        let e = read(cut, false).unwrap_err();
        assert!(
            e.starts_with(&format!("byte {second}: truncated chunk")),
            "{e}"
        );
        let t = read(cut, true).unwrap();
        assert_eq!(t.rows.len(), 1);
        assert_eq!(t.stopped.as_ref().map(|s| s.0), Some(second));
        let mut bad = bytes.clone();
        bad[second + CHUNK_HEADER + 1] ^= 0x10;
        assert!(read(&bad, false).unwrap_err().contains("checksum mismatch"));
        // A record cut inside its FIRST/MIDDLE chunks is located at its start.
        let big = history(0, &[(&["n"], &format!("\"{}\"", "y".repeat(BLOCK)))]);
        let bytes = log(&[one.clone(), big]);
        let e = read(&bytes[..BLOCK + 10], false).unwrap_err();
        assert!(e.starts_with(&format!("byte {second}:")), "{e}");
        assert!(read(b"not a log", false).unwrap_err().contains("not a W&B"));
        let e = read(b":W&B\xe1\xbe\x01", false).unwrap_err();
        assert!(e.contains("version 0"), "{e}");
    }
}
