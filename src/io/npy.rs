//! `.npy` arrays through the `npyz` crate, with the checks a command-line user needs: 2-D,
//! float32, not empty, not truncated — each failure a one-line message naming the file.

use super::{IoError, atomic};
use npyz::WriterBuilder;
use std::path::Path;

/// A 2-D float32 array read from a `.npy` file (row-major).
#[derive(Debug, Clone)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

/// Read a 2-D float32 `.npy` (C or Fortran order; Fortran is transposed into row-major). Only a
/// regular file is read (a FIFO would block forever), and the shape in the header must fit in the
/// file before anything is allocated for it (a header claiming 2^32 x 2^32 is an error, not an
/// allocation abort).
pub fn read_matrix_f32(path: &Path) -> Result<Matrix, IoError> {
    let meta = std::fs::metadata(path).map_err(|e| IoError::io(path, e))?;
    if !meta.is_file() {
        return Err(IoError::invalid(
            path,
            "is not a regular file; give a .npy file written with numpy.save",
        ));
    }
    let bytes = std::fs::read(path).map_err(|e| IoError::io(path, e))?;
    check_header_shape(&bytes).map_err(|what| IoError::invalid(path, what))?;
    let npy = npyz::NpyFile::new(&bytes[..]).map_err(|e| {
        IoError::invalid(
            path,
            format!(
                "not a .npy file ({}); write it with numpy.save",
                super::one_line(&e.to_string())
            ),
        )
    })?;
    let shape = npy.shape().to_vec();
    let dtype = npy.dtype().descr().replace('\'', "");
    if dtype != "<f4" {
        return Err(IoError::invalid(
            path,
            format!("dtype is {dtype}, expected float32 (<f4); convert with x.astype(np.float32)"),
        ));
    }
    if shape.len() != 2 {
        return Err(IoError::invalid(
            path,
            format!(
                "array has {} dimension(s) {shape:?}, expected 2 (rows, cols)",
                shape.len()
            ),
        ));
    }
    if shape[0] == 0 || shape[1] == 0 {
        return Err(IoError::invalid(
            path,
            format!("array is empty ({}x{})", shape[0], shape[1]),
        ));
    }
    let need = shape[0]
        .checked_mul(shape[1])
        .and_then(|n| n.checked_mul(4))
        .filter(|&n| n <= bytes.len() as u64);
    if need.is_none() {
        return Err(IoError::invalid(
            path,
            format!(
                "header says {}x{} float32 but the file has only {} bytes; the file is truncated or its header is wrong",
                shape[0],
                shape[1],
                bytes.len()
            ),
        ));
    }
    let fortran = npy.order() == npyz::Order::Fortran;
    let (rows, cols) = (shape[0] as usize, shape[1] as usize);
    let data: Vec<f32> = npy.into_vec().map_err(|e| {
        IoError::invalid(
            path,
            format!(
                "truncated or unreadable data: header says {rows}x{cols} float32 ({})",
                super::one_line(&e.to_string())
            ),
        )
    })?;
    if data.len() != rows * cols {
        return Err(IoError::invalid(
            path,
            format!(
                "truncated: header says {rows}x{cols} but {} values present",
                data.len()
            ),
        ));
    }
    let data = if fortran {
        crate::formats::tensor::transpose(&data, cols, rows)
    } else {
        data
    };
    Ok(Matrix { rows, cols, data })
}

/// Check the `shape` of a `.npy` header against the file's size before `npyz` sees it: `npyz`
/// multiplies the dimensions unchecked (an overflow panic, or a wrapped count in release builds)
/// and sizes its buffer by them. Headers this cannot read are left to `npyz`'s own errors.
fn check_header_shape(bytes: &[u8]) -> Result<(), String> {
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Ok(());
    }
    let (len, start): (usize, usize) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        _ if bytes.len() >= 12 => (
            u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
            12,
        ),
        _ => return Ok(()),
    };
    let Some(header) = bytes.get(start..start.saturating_add(len)) else {
        return Err(format!(
            "truncated: the header claims {len} bytes but the file has {}",
            bytes.len()
        ));
    };
    let header = String::from_utf8_lossy(header);
    let Some(at) = header.find("'shape'") else {
        return Ok(());
    };
    let rest = &header[at + 7..];
    let (Some(open), Some(close)) = (rest.find('('), rest.find(')')) else {
        return Ok(());
    };
    if close < open {
        return Ok(());
    }
    let mut total: u64 = 4;
    let mut dims = Vec::new();
    for dim in rest[open + 1..close]
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
    {
        let n: u64 = dim.trim_end_matches('L').parse().map_err(|_| {
            format!(
                "header shape has `{}`, not a size; write the file with numpy.save",
                super::one_line(dim)
            )
        })?;
        total = total.saturating_mul(n);
        dims.push(n);
    }
    let data = (bytes.len() - start).saturating_sub(len) as u64;
    if total > data {
        return Err(format!(
            "truncated or wrong header: shape {dims:?} needs {total} bytes of float32 data, the file has {data}"
        ));
    }
    Ok(())
}

/// Serialize an array of `shape` to `.npy` bytes.
pub fn to_bytes<T: npyz::AutoSerialize + Copy>(
    data: &[T],
    shape: &[u64],
) -> std::io::Result<Vec<u8>> {
    let mut buf = Vec::new();
    let mut w = npyz::WriteOptions::new()
        .default_dtype()
        .shape(shape)
        .writer(&mut buf)
        .begin_nd()?;
    w.extend(data.iter().copied())?;
    w.finish()?;
    Ok(buf)
}

/// Write an array of `shape` to `path` atomically.
pub fn write<T: npyz::AutoSerialize + Copy>(
    path: &Path,
    data: &[T],
    shape: &[u64],
) -> Result<(), IoError> {
    let bytes = to_bytes(data, shape).map_err(|e| IoError::io(path, e))?;
    atomic::write_file(path, &bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_rejections() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.npy");
        write(&p, &[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]).unwrap();
        let m = read_matrix_f32(&p).unwrap();
        assert_eq!((m.rows, m.cols), (2, 3));
        assert_eq!(m.data, vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);

        let bytes = std::fs::read(&p).unwrap();
        std::fs::write(&p, &bytes[..bytes.len() - 5]).unwrap();
        let e = read_matrix_f32(&p).unwrap_err().to_string();
        assert!(e.contains("truncated"), "{e}");

        write(&p, &[1.0f64, 2.0], &[1, 2]).unwrap();
        assert!(
            read_matrix_f32(&p)
                .unwrap_err()
                .to_string()
                .contains("float32")
        );
        write(&p, &[1.0f32, 2.0], &[2]).unwrap();
        assert!(
            read_matrix_f32(&p)
                .unwrap_err()
                .to_string()
                .contains("expected 2")
        );
        write::<f32>(&p, &[], &[0, 4]).unwrap();
        assert!(
            read_matrix_f32(&p)
                .unwrap_err()
                .to_string()
                .contains("empty")
        );
        std::fs::write(&p, b"hello").unwrap();
        assert!(
            read_matrix_f32(&p)
                .unwrap_err()
                .to_string()
                .contains("not a .npy")
        );
    }

    /// A valid header for `shape` followed by `data_bytes` bytes of data.
    fn header_claiming(shape: &str, data_bytes: usize) -> Vec<u8> {
        let dict = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape}, }}");
        let mut h = dict.into_bytes();
        while (10 + h.len() + 1) % 64 != 0 {
            h.push(b' ');
        }
        h.push(b'\n');
        let mut out = b"\x93NUMPY\x01\x00".to_vec();
        out.extend_from_slice(&(h.len() as u16).to_le_bytes());
        out.extend_from_slice(&h);
        out.extend(std::iter::repeat_n(0u8, data_bytes));
        out
    }

    #[test]
    fn a_shape_larger_than_the_file_is_an_error_before_any_allocation() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.npy");
        for shape in [
            "(4294967296, 4294967296)",
            "(18446744073709551615, 2)",
            "(1000000, 1000000)",
            "(3, 3)",
        ] {
            std::fs::write(&p, header_claiming(shape, 16)).unwrap();
            let e = read_matrix_f32(&p).unwrap_err().to_string();
            assert_eq!(e.lines().count(), 1, "{e}");
            assert!(
                e.contains("x.npy") && (e.contains("truncated") || e.contains("not a .npy")),
                "{shape}: {e}"
            );
        }
        std::fs::write(&p, header_claiming("(2, 2)", 16)).unwrap();
        assert_eq!(read_matrix_f32(&p).unwrap().data, vec![0.0; 4]);
    }

    #[test]
    fn only_regular_files_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let e = read_matrix_f32(dir.path()).unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
    }
}
