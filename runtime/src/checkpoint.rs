//! Checkpoints: named tensors, written atomically, in two formats.
//!
//! - Native: safetensors, with a CRC-32 of every tensor's bytes in the metadata
//!   (`cellgraph.crc32`), checked on load. A checkpoint whose bytes do not match is an error,
//!   never a partial load.
//! - MindSpore `.ckpt`: protobuf `Checkpoint { repeated Value { tag, TensorProto { dims,
//!   tensor_type, tensor_content } } }` (proto2, so `dims` is unpacked), one `Checkpoint`
//!   message per tensor, concatenated, scalars without dims, then MindSpore 2.x's CRC
//!   trailer, as `save_checkpoint(..., crc_check=True)` writes it: the 7 bytes `crc_num` and
//!   the CRC-32 (zlib's, `binascii.crc32`) of all the message bytes as a 10-byte big-endian
//!   integer. Loading verifies the trailer when present; an empty or unparsable file is an
//!   error.
//!
//! Both are written to a temporary file in the same directory, synced, then renamed over the
//! target, so a crash leaves either the old file or the new one. The format is chosen by the
//! extension: `.ckpt` is MindSpore's, anything else native.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use cellgraph_compiler::{HostData, HostTensor};
use prost::Message;

use crate::error::{Result, RuntimeError};

/// MindSpore's checkpoint messages.
pub mod proto {
    /// `TensorProto` of MindSpore's checkpoint.proto.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct TensorProto {
        #[prost(int64, repeated, packed = "false", tag = "1")]
        pub dims: Vec<i64>,
        #[prost(string, tag = "2")]
        pub tensor_type: String,
        #[prost(bytes = "vec", tag = "3")]
        pub tensor_content: Vec<u8>,
    }
    /// `Checkpoint.Value`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Value {
        #[prost(string, tag = "1")]
        pub tag: String,
        #[prost(message, optional, tag = "2")]
        pub tensor: Option<TensorProto>,
    }
    /// `Checkpoint`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Checkpoint {
        #[prost(message, repeated, tag = "1")]
        pub value: Vec<Value>,
    }
}

/// Named host tensors.
pub type Tensors = BTreeMap<String, HostTensor>;

fn err(path: &Path, offset: u64, detail: impl Into<String>) -> RuntimeError {
    RuntimeError::Data { path: path.display().to_string(), offset, detail: detail.into() }
}

fn io(path: &Path, source: std::io::Error) -> RuntimeError {
    RuntimeError::Io { path: path.display().to_string(), source }
}

/// Little-endian bytes of a tensor and MindSpore's type name.
fn encode(t: &HostTensor) -> (Vec<u8>, &'static str) {
    match &t.data {
        HostData::F32(v) => (v.iter().flat_map(|x| x.to_le_bytes()).collect(), "Float32"),
        HostData::F64(v) => (v.iter().flat_map(|x| (*x as f32).to_le_bytes()).collect(), "Float32"),
        HostData::I32(v) => (v.iter().flat_map(|x| x.to_le_bytes()).collect(), "Int32"),
        HostData::I64(v) => (v.iter().flat_map(|x| x.to_le_bytes()).collect(), "Int64"),
        HostData::Bool(v) => (v.iter().map(|&b| b as u8).collect(), "Bool"),
    }
}

fn decode(path: &Path, name: &str, shape: Vec<usize>, ty: &str, bytes: &[u8]) -> Result<HostTensor> {
    let n: usize = shape.iter().product();
    let width = match ty {
        "Float32" | "Int32" => 4,
        "Int64" => 8,
        "Bool" => 1,
        other => return Err(err(path, 0, format!("tensor `{name}` has type {other}, which cellgraph does not load (Float32, Int32, Int64, Bool)"))),
    };
    if bytes.len() != n * width {
        return Err(err(path, 0, format!("tensor `{name}`: shape {shape:?} of {ty} needs {} bytes, the file holds {}", n * width, bytes.len())));
    }
    let data = match ty {
        "Float32" => HostData::F32(bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()),
        "Int32" => HostData::I32(bytes.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap())).collect()),
        "Int64" => HostData::I64(bytes.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect()),
        _ => HostData::Bool(bytes.iter().map(|&b| b != 0).collect()),
    };
    Ok(HostTensor { shape, data })
}

/// The directory `path` is written in, and a temporary name beside it.
fn temp_beside(path: &Path) -> Result<(&Path, std::path::PathBuf)> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).ok_or_else(|| RuntimeError::Invalid {
        what: format!("checkpoint target {}", path.display()),
        detail: "names no file; give a file path such as model.ckpt".into(),
    })?;
    Ok((dir, dir.join(format!(".{name}.tmp-{}", std::process::id()))))
}

fn cannot_write(path: &Path, e: std::io::Error) -> RuntimeError {
    RuntimeError::Invalid { what: format!("cannot write checkpoint {}", path.display()), detail: format!("{e}; choose a writable file path") }
}

/// Checks, before any work, that a checkpoint can be written at `path`: not a directory, its
/// directory exists or can be made, and a file can be created there (a probe file, removed).
pub fn check_writable(path: &Path) -> Result<()> {
    if path.is_dir() {
        return Err(RuntimeError::Invalid {
            what: format!("checkpoint target {}", path.display()),
            detail: "is a directory; give a file path such as model.ckpt".into(),
        });
    }
    let (dir, tmp) = temp_beside(path)?;
    std::fs::create_dir_all(dir).map_err(|e| cannot_write(path, e))?;
    std::fs::File::create(&tmp).map_err(|e| cannot_write(path, e))?;
    let _ = std::fs::remove_file(&tmp);
    Ok(())
}

/// Writes `bytes` to `path` atomically: temp file in the same directory, fsync, rename. A
/// failure removes the temporary file (a full disk does not stay full) and names `path`.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_with(path, |tmp| std::fs::File::create(tmp)?.write_all(bytes))
}

/// [`write_atomic`] of what `write` writes to the temporary file it is given (a writer that
/// streams, so that the file's bytes need not all be in memory at once); then fsync and
/// rename, or on any failure the temporary file removed.
pub fn write_atomic_with(path: &Path, write: impl FnOnce(&Path) -> std::io::Result<()>) -> Result<()> {
    if path.is_dir() {
        return Err(RuntimeError::Invalid {
            what: format!("checkpoint target {}", path.display()),
            detail: "is a directory; give a file path such as model.ckpt".into(),
        });
    }
    let (dir, tmp) = temp_beside(path)?;
    std::fs::create_dir_all(dir).map_err(|e| cannot_write(path, e))?;
    let written = write(&tmp).and_then(|_| std::fs::File::open(&tmp)?.sync_all());
    let result = written.and_then(|_| std::fs::rename(&tmp, path));
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(cannot_write(path, e));
    }
    Ok(())
}

/// MindSpore's CRC trailer: `crc_num` then the CRC-32 as a 10-byte big-endian integer.
const CRC_TAG: &[u8] = b"crc_num";
const CRC_TRAILER: usize = CRC_TAG.len() + 10;

/// Encodes tensors as a MindSpore `.ckpt`: one `Checkpoint` message per tensor, then the CRC
/// trailer of `save_checkpoint(..., crc_check=True)`.
pub fn to_ckpt_bytes(tensors: &Tensors) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, t) in tensors {
        let (bytes, ty) = encode(t);
        let dims = t.shape.iter().map(|&d| d as i64).collect();
        let value = proto::Value { tag: name.clone(), tensor: Some(proto::TensorProto { dims, tensor_type: ty.into(), tensor_content: bytes }) };
        proto::Checkpoint { value: vec![value] }.encode(&mut out).expect("a Vec grows");
    }
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(CRC_TAG);
    out.extend_from_slice(&[0, 0, 0, 0, 0, 0]);
    out.extend_from_slice(&crc.to_be_bytes());
    out
}

/// Decodes a MindSpore `.ckpt`, verifying its CRC trailer when there is one; `path` names
/// the file in errors. Slices of one tensor (MindSpore splits tensors over 512 MiB into
/// consecutive values with the same tag) are joined.
pub fn from_ckpt_bytes(path: &Path, bytes: &[u8]) -> Result<Tensors> {
    if bytes.is_empty() {
        return Err(err(path, 0, "the file is empty: not a checkpoint (an interrupted save? MindSpore writes atomically only since 2.x)"));
    }
    let body = match bytes.len().checked_sub(CRC_TRAILER) {
        Some(at) if &bytes[at..at + CRC_TAG.len()] == CRC_TAG => {
            let stored = bytes[at + CRC_TAG.len()..].iter().fold(0u128, |acc, &b| acc << 8 | b as u128);
            let computed = crc32fast::hash(&bytes[..at]);
            if stored != computed as u128 {
                return Err(err(
                    path,
                    at as u64,
                    format!("CRC check failed (stored {stored:#010x}, computed {computed:#010x}): the checkpoint is damaged"),
                ));
            }
            &bytes[..at]
        }
        _ => bytes,
    };
    let ckpt = proto::Checkpoint::decode(body).map_err(|e| err(path, 0, format!("not a MindSpore checkpoint, or truncated ({e})")))?;
    if ckpt.value.is_empty() {
        return Err(err(path, 0, "holds no tensors: not a checkpoint"));
    }
    let mut parts: Vec<(String, proto::TensorProto)> = Vec::new();
    for v in ckpt.value {
        let t = v.tensor.ok_or_else(|| err(path, 0, format!("entry `{}` has no tensor", v.tag)))?;
        match parts.last_mut() {
            Some((tag, prev)) if *tag == v.tag && prev.dims == t.dims && prev.tensor_type == t.tensor_type => {
                prev.tensor_content.extend(t.tensor_content)
            }
            _ => parts.push((v.tag, t)),
        }
    }
    let mut out = Tensors::new();
    for (tag, t) in parts {
        // A scalar has no dims (MindSpore 1.x wrote `[0]`).
        let one = t.dims.is_empty() || (t.tensor_content.len() <= 8 && t.dims == [0]);
        let shape = if one { vec![] } else { t.dims.iter().map(|&d| d.max(0) as usize).collect() };
        let tensor = decode(path, &tag, shape, &t.tensor_type, &t.tensor_content)?;
        if out.insert(tag.clone(), tensor).is_some() {
            return Err(err(path, 0, format!("entry `{tag}` appears twice")));
        }
    }
    Ok(out)
}

fn crc_of(tensors: &Tensors) -> u32 {
    let mut h = crc32fast::Hasher::new();
    for (name, t) in tensors {
        h.update(name.as_bytes());
        h.update(&encode(t).0);
    }
    h.finalize()
}

/// Encodes tensors as safetensors with a checksum and the given extra metadata.
pub fn to_safetensors_bytes(tensors: &Tensors, meta: &BTreeMap<String, String>) -> Result<Vec<u8>> {
    let encoded: Vec<(String, Vec<u8>, safetensors::Dtype, Vec<usize>)> = tensors
        .iter()
        .map(|(n, t)| {
            let (bytes, ty) = encode(t);
            let dtype = match ty {
                "Float32" => safetensors::Dtype::F32,
                "Int32" => safetensors::Dtype::I32,
                "Int64" => safetensors::Dtype::I64,
                _ => safetensors::Dtype::BOOL,
            };
            (n.clone(), bytes, dtype, t.shape.clone())
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> = encoded
        .iter()
        .map(|(n, b, d, s)| Ok((n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).map_err(|e| err(Path::new(n), 0, e.to_string()))?)))
        .collect::<Result<_>>()?;
    let mut meta = meta.clone();
    meta.insert("cellgraph.crc32".into(), format!("{:08x}", crc_of(tensors)));
    meta.insert("format".into(), "cellgraph-1".into());
    let meta: std::collections::HashMap<String, String> = meta.into_iter().collect();
    let bytes = safetensors::tensor::serialize(views, Some(meta)).map_err(|e| err(Path::new("<memory>"), 0, e.to_string()))?;
    Ok(sorted_metadata(bytes))
}

/// The same safetensors bytes with the header's `__metadata__` in key order: safetensors
/// writes it from a `HashMap`, in an order that differs from one save to the next, and a
/// checkpoint of the same values should be the same bytes. The header keeps its padding to
/// 8 bytes with spaces, as safetensors pads it.
fn sorted_metadata(bytes: Vec<u8>) -> Vec<u8> {
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes of header length")) as usize;
    let mut header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).expect("safetensors writes a JSON object as its header");
    let Some(serde_json::Value::Object(meta)) = header.remove("__metadata__") else { return bytes };
    let meta: BTreeMap<String, serde_json::Value> = meta.into_iter().collect();
    let mut sorted = serde_json::Map::new();
    sorted.insert("__metadata__".into(), serde_json::Value::Object(meta.into_iter().collect()));
    sorted.extend(header);
    let mut text = serde_json::to_vec(&sorted).expect("a JSON object serializes");
    text.resize(text.len().div_ceil(8) * 8, b' ');
    let mut out = Vec::with_capacity(8 + text.len() + bytes.len() - 8 - n);
    out.extend_from_slice(&(text.len() as u64).to_le_bytes());
    out.extend_from_slice(&text);
    out.extend_from_slice(&bytes[8 + n..]);
    out
}

/// Decodes native safetensors and checks the checksum; returns tensors and metadata.
pub fn from_safetensors_bytes(path: &Path, bytes: &[u8]) -> Result<(Tensors, BTreeMap<String, String>)> {
    let st = safetensors::SafeTensors::deserialize(bytes).map_err(|e| err(path, 0, format!("not a safetensors file or truncated ({e})")))?;
    let (_, header) = safetensors::SafeTensors::read_metadata(bytes).map_err(|e| err(path, 0, e.to_string()))?;
    let meta: BTreeMap<String, String> = header.metadata().clone().unwrap_or_default().into_iter().collect();
    let mut tensors = Tensors::new();
    for (name, view) in st.tensors() {
        let ty = match view.dtype() {
            safetensors::Dtype::F32 => "Float32",
            safetensors::Dtype::I32 => "Int32",
            safetensors::Dtype::I64 => "Int64",
            safetensors::Dtype::BOOL => "Bool",
            other => return Err(err(path, 0, format!("tensor `{name}` has dtype {other:?}, which cellgraph does not load"))),
        };
        tensors.insert(name.clone(), decode(path, &name, view.shape().to_vec(), ty, view.data())?);
    }
    if let Some(want) = meta.get("cellgraph.crc32") {
        let got = format!("{:08x}", crc_of(&tensors));
        if &got != want {
            return Err(err(path, 0, format!("checksum mismatch (stored {want}, computed {got}): the checkpoint is corrupt")));
        }
    }
    Ok((tensors, meta))
}

/// Saves tensors (and, natively, metadata) to `path`; `.ckpt` selects MindSpore's format.
pub fn save(path: &Path, tensors: &Tensors, meta: &BTreeMap<String, String>) -> Result<()> {
    let bytes = if is_ckpt(path) { to_ckpt_bytes(tensors) } else { to_safetensors_bytes(tensors, meta)? };
    write_atomic(path, &bytes)
}

/// Loads tensors and metadata from `path`; `.ckpt` is read as MindSpore's format (no metadata).
pub fn load(path: &Path) -> Result<(Tensors, BTreeMap<String, String>)> {
    let bytes = std::fs::read(path).map_err(|e| io(path, e))?;
    if bytes.is_empty() {
        return Err(err(path, 0, "the file is empty: not a checkpoint"));
    }
    if is_ckpt(path) {
        Ok((from_ckpt_bytes(path, &bytes)?, BTreeMap::new()))
    } else {
        from_safetensors_bytes(path, &bytes)
    }
}

fn is_ckpt(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "ckpt")
}
