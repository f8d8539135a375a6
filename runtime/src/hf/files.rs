//! The `model.safetensors` of a model directory: read a tensor at a time into f32, and written
//! a tensor at a time from the parameters' own memory.

use std::path::Path;

use cellgraph_compiler::HostTensor;

use super::io;
use crate::error::{Result, RuntimeError};

/// `v` (`[rows, cols]` row-major) transposed: `[cols, rows]`.
pub(super) fn transposed(v: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; v.len()];
    crate::host::layout::permute(v, &[rows, cols], &[1, 0], &mut out);
    out
}

/// A tensor's values as f32: its own memory when it holds f32.
pub(super) fn values(t: &HostTensor) -> std::borrow::Cow<'_, [f32]> {
    match &t.data {
        cellgraph_compiler::HostData::F32(v) => std::borrow::Cow::Borrowed(v),
        _ => std::borrow::Cow::Owned(t.to_f32()),
    }
}

/// The tensors of the safetensors file at `path` that `keep` keeps (`Some(transpose)`), in
/// the file's order, each read from the file straight into its own f32 buffer (f16 and bf16
/// widened through a small buffer), with no copy of the file in memory; a rank-2 tensor kept
/// with `transpose` (a `Conv1D` weight) is read into one reused buffer, then transposed into
/// its own. The file is checked as `SafeTensors::deserialize` checks it, before any tensor is
/// read: a header that parses, offsets that tile the data exactly, the file's length.
pub(super) fn read_safetensors(path: &Path, keep: impl Fn(&str) -> Option<bool>) -> Result<Vec<(String, HostTensor)>> {
    use safetensors::Dtype;
    use std::io::{Read, Seek, SeekFrom};
    let bad = |detail: String| RuntimeError::Data { path: path.display().to_string(), offset: 0, detail };
    let truncated = |why: String| bad(format!("not a safetensors file or truncated ({why})"));
    let mut f = std::fs::File::open(path).map_err(|e| io(path, e))?;
    let len = f.metadata().map_err(|e| io(path, e))?.len();
    let mut n = [0u8; 8];
    f.read_exact(&mut n).map_err(|_| truncated(format!("{len} bytes: no header")))?;
    let n = u64::from_le_bytes(n);
    if n > 100_000_000 || n > len - 8 {
        return Err(truncated(format!("a header of {n} bytes in a file of {len}")));
    }
    let mut header = vec![0u8; n as usize];
    f.read_exact(&mut header).map_err(|e| io(path, e))?;
    let meta: safetensors::tensor::Metadata = serde_json::from_slice(&header).map_err(|e| truncated(format!("its header: {e}")))?;
    let mut tensors = Vec::new();
    let mut end = 0;
    for name in meta.offset_keys() {
        let info = meta.info(&name).expect("a name of the header");
        let numel = info.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        let bytes = match info.dtype {
            Dtype::F32 => numel.and_then(|n| n.checked_mul(4)),
            Dtype::F16 | Dtype::BF16 => numel.and_then(|n| n.checked_mul(2)),
            other => return Err(bad(format!("tensor `{name}` has dtype {other:?}; a model's weights are F32, F16 or BF16 here"))),
        };
        let (start, stop) = info.data_offsets;
        if start != end || Some(stop.wrapping_sub(start)) != bytes || stop < start {
            return Err(truncated(format!(
                "tensor `{name}`'s offsets {start}..{stop} do not follow {end} or fit its {:?} {:?}",
                info.dtype, info.shape
            )));
        }
        end = stop;
        tensors.push((name.clone(), info.dtype, info.shape.clone(), numel.unwrap_or(0), stop - start));
    }
    if 8 + n + end as u64 != len {
        return Err(truncated(format!("its header describes {end} bytes of data, the file holds {}", len - 8 - n)));
    }
    // Reads `out.len()` values of `dtype` from the file into `out`.
    let mut chunk = Vec::new();
    let mut read = |f: &mut std::fs::File, dtype: Dtype, out: &mut [f32]| -> std::io::Result<()> {
        if dtype == Dtype::F32 {
            // SAFETY: `out`'s memory as bytes, which any bit pattern of an f32 is.
            f.read_exact(unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(out)) })?;
            if cfg!(target_endian = "big") {
                out.iter_mut().for_each(|x| *x = f32::from_bits(u32::from_le(x.to_bits())));
            }
            return Ok(());
        }
        for part in out.chunks_mut(1 << 16) {
            chunk.resize(2 * part.len(), 0u8);
            f.read_exact(&mut chunk)?;
            let halves = chunk.chunks_exact(2).map(|b| [b[0], b[1]]);
            match dtype {
                Dtype::F16 => part.iter_mut().zip(halves).for_each(|(x, b)| *x = half::f16::from_le_bytes(b).to_f32()),
                _ => part.iter_mut().zip(halves).for_each(|(x, b)| *x = half::bf16::from_le_bytes(b).to_f32()),
            }
        }
        Ok(())
    };
    let mut scratch = Vec::new();
    let mut out = Vec::new();
    for (name, dtype, shape, numel, bytes) in tensors {
        let Some(transpose) = keep(&name) else {
            f.seek(SeekFrom::Current(bytes as i64)).map_err(|e| io(path, e))?;
            continue;
        };
        let (shape, v) = match (transpose, shape.as_slice()) {
            (true, &[rows, cols]) => {
                scratch.resize(numel.max(scratch.len()), 0.0);
                read(&mut f, dtype, &mut scratch[..numel]).map_err(|e| io(path, e))?;
                (vec![cols, rows], transposed(&scratch[..numel], rows, cols))
            }
            _ => {
                let mut v = vec![0.0f32; numel];
                read(&mut f, dtype, &mut v).map_err(|e| io(path, e))?;
                (shape, v)
            }
        };
        out.push((name, HostTensor::f32(shape, v).expect("the header's shape, checked")));
    }
    Ok(out)
}

/// One tensor of a saved model, as safetensors writes it (f32, little-endian): `values`, or
/// their transpose (`transpose: [rows, cols]` of `values`; a `Conv1D` weight), made only when
/// the file is written, one tensor at a time.
pub(super) struct Saved<'a> {
    pub values: std::borrow::Cow<'a, [f32]>,
    pub shape: Vec<usize>,
    pub transpose: Option<[usize; 2]>,
}

impl safetensors::View for &Saved<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        safetensors::Dtype::F32
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        let values = match self.transpose {
            Some([rows, cols]) => std::borrow::Cow::Owned(transposed(&self.values, rows, cols)),
            None => std::borrow::Cow::Borrowed(&*self.values),
        };
        #[cfg(target_endian = "little")]
        if let std::borrow::Cow::Borrowed(v) = values {
            // SAFETY: f32 has no padding and every bit pattern is a byte sequence; on a
            // little-endian target its memory is its little-endian bytes.
            return std::borrow::Cow::Borrowed(unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), 4 * v.len()) });
        }
        let mut bytes = Vec::with_capacity(4 * values.len());
        values.iter().for_each(|x| bytes.extend_from_slice(&x.to_le_bytes()));
        std::borrow::Cow::Owned(bytes)
    }
    fn data_len(&self) -> usize {
        4 * self.values.len()
    }
}
