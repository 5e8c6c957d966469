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

/// Read a 2-D float32 `.npy` (C or Fortran order; Fortran is transposed into row-major).
pub fn read_matrix_f32(path: &Path) -> Result<Matrix, IoError> {
    let bytes = std::fs::read(path).map_err(|e| IoError::io(path, e))?;
    let npy = npyz::NpyFile::new(&bytes[..]).map_err(|e| {
        IoError::invalid(
            path,
            format!("not a .npy file ({e}); write it with numpy.save"),
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
    let (rows, cols) = (shape[0] as usize, shape[1] as usize);
    if rows == 0 || cols == 0 {
        return Err(IoError::invalid(
            path,
            format!("array is empty ({rows}x{cols})"),
        ));
    }
    let fortran = npy.order() == npyz::Order::Fortran;
    let data: Vec<f32> = npy.into_vec().map_err(|e| {
        IoError::invalid(
            path,
            format!("truncated or unreadable data: header says {rows}x{cols} float32 ({e})"),
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
}
