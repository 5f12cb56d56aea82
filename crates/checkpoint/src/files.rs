//! The per-rank shard files: safetensors written as a stream (header first, then one tensor at
//! a time, checksummed on the way and flushed to disk), and read back memory-mapped so that a
//! reader copies only the bytes it asks for.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use burn::tensor::{DType, Tensor};
use memmap2::Mmap;
use safetensors::tensor::{Dtype, Metadata as StMetadata, SafeTensors, TensorInfo};

use crate::error::CheckpointError;
use crate::meta::dtype_name;
use crate::region::Region;

/// A tensor on its way into a shard file: its checkpoint name, its name in the file, the region
/// of the full tensor it holds, and its value (flattened; Burn tensors are immutable, so a
/// clone is a snapshot).
#[derive(Debug, Clone)]
pub struct ShardTensor {
    pub key: String,
    /// Its safetensors entry name, unique in the file (which may hold several boxes of one
    /// tensor): the key, or the key and the box's start.
    pub entry: String,
    pub region: Region,
    pub dtype: DType,
    pub value: Tensor<1>,
}

/// What writing a shard file produced: its size, checksum and each tensor's checksum.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct WrittenFile {
    pub name: String,
    pub bytes: u64,
    pub crc32: u32,
    pub tensors: Vec<WrittenTensor>,
}

/// One tensor of a written file.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct WrittenTensor {
    pub key: String,
    pub entry: String,
    pub region: Region,
    pub dtype: String,
    pub crc32: u32,
}

fn st_dtype(dtype: DType) -> Dtype {
    match dtype {
        DType::F64 => Dtype::F64,
        DType::F32 => Dtype::F32,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        other => unreachable!("only float tensors are checkpointed, not {other:?}"),
    }
}

/// A writer that checksums everything it writes.
struct Crc<W> {
    inner: W,
    hasher: crc32fast::Hasher,
    bytes: u64,
}

impl<W: Write> Crc<W> {
    fn put(&mut self, buf: &[u8]) -> std::io::Result<()> {
        self.hasher.update(buf);
        self.bytes += buf.len() as u64;
        self.inner.write_all(buf)
    }
}

/// Writes `tensors` to `dir/name` in the safetensors format, one tensor in host memory at a
/// time, and flushes the file to disk.
pub fn write_shard_file(
    dir: &Path,
    name: &str,
    mut tensors: Vec<ShardTensor>,
) -> Result<WrittenFile, CheckpointError> {
    let path = dir.join(name);
    // Safetensors' own order (widest dtype first, then name) keeps every tensor aligned.
    tensors.sort_by(|a, b| (b.dtype.size(), &a.entry).cmp(&(a.dtype.size(), &b.entry)));
    let mut infos = Vec::with_capacity(tensors.len());
    let mut offset = 0;
    for t in &tensors {
        let len = t.region.volume() * t.dtype.size();
        infos.push((
            t.entry.clone(),
            TensorInfo {
                dtype: st_dtype(t.dtype),
                shape: t.region.shape.clone(),
                data_offsets: (offset, offset + len),
            },
        ));
        offset += len;
    }
    let header = StMetadata::new(None, infos)
        .map_err(|e| CheckpointError::corrupted(&path, format!("cannot describe tensors: {e}")))?;
    let mut header = serde_json::to_vec(&header).expect("a safetensors header serializes");
    header.resize(header.len().next_multiple_of(8), b' ');

    let io = CheckpointError::io(&path);
    let file = File::create(&path).map_err(CheckpointError::io(&path))?;
    let mut out = Crc {
        inner: BufWriter::with_capacity(1 << 20, file),
        hasher: crc32fast::Hasher::new(),
        bytes: 0,
    };
    let mut written = Vec::with_capacity(tensors.len());
    let result = (|| {
        out.put(&(header.len() as u64).to_le_bytes())?;
        out.put(&header)?;
        for t in tensors {
            let data = t.value.into_data();
            let bytes = data.as_bytes();
            let expected = t.region.volume() * t.dtype.size();
            if bytes.len() != expected || data.dtype() != t.dtype {
                return Err(std::io::Error::other(format!(
                    "tensor `{}` holds {} bytes of {:?}, its region {} needs {expected} of {:?}",
                    t.key,
                    bytes.len(),
                    data.dtype(),
                    t.region.describe(),
                    t.dtype
                )));
            }
            out.put(bytes)?;
            written.push(WrittenTensor {
                key: t.key,
                entry: t.entry,
                region: t.region,
                dtype: dtype_name(t.dtype).expect("a float dtype").to_string(),
                crc32: crc32fast::hash(bytes),
            });
        }
        out.inner.flush()?;
        out.inner.get_ref().sync_all()
    })();
    result.map_err(io)?;
    Ok(WrittenFile {
        name: name.to_string(),
        bytes: out.bytes,
        crc32: out.hasher.finalize(),
        tensors: written,
    })
}

/// A shard file mapped into memory, its safetensors header parsed.
pub struct ShardFile {
    path: PathBuf,
    map: Mmap,
    data_start: usize,
    header: StMetadata,
}

impl ShardFile {
    /// Maps `path`, which the metadata says is `bytes` long, and parses its header.
    pub fn open(path: &Path, bytes: u64) -> Result<Self, CheckpointError> {
        let file = File::open(path).map_err(CheckpointError::io(path))?;
        let len = file.metadata().map_err(CheckpointError::io(path))?.len();
        if len != bytes {
            return Err(CheckpointError::corrupted(
                path,
                format!("it has {len} bytes, the metadata says {bytes}"),
            ));
        }
        // SAFETY: checkpoint files are written once and never modified in place; a file
        // truncated under us would fault, as with any memory-mapped reader (safetensors' own).
        let map = unsafe { Mmap::map(&file) }.map_err(CheckpointError::io(path))?;
        let (n, header) = SafeTensors::read_metadata(&map).map_err(|e| {
            CheckpointError::corrupted(path, format!("bad safetensors header: {e}"))
        })?;
        Ok(Self {
            path: path.to_path_buf(),
            map,
            data_start: 8 + n,
            header,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The stored bytes of the entry named `entry` (a tensor's key, or the name the metadata
    /// records for one of its regions), checked against the region and dtype the metadata
    /// gives it.
    pub fn tensor(
        &self,
        entry: &str,
        region: &Region,
        dtype: &str,
    ) -> Result<&[u8], CheckpointError> {
        let info = self.header.info(entry).ok_or_else(|| {
            CheckpointError::corrupted(&self.path, format!("it does not hold tensor `{entry}`"))
        })?;
        if info.shape != region.shape || format!("{:?}", info.dtype) != dtype {
            return Err(CheckpointError::corrupted(
                &self.path,
                format!(
                    "tensor `{entry}` is {:?} {:?} in the file, {dtype} {:?} in the metadata",
                    info.dtype, info.shape, region.shape
                ),
            ));
        }
        let (s, e) = info.data_offsets;
        Ok(&self.map[self.data_start + s..self.data_start + e])
    }

    /// CRC32 of the whole file.
    pub fn crc32(&self) -> u32 {
        crc32fast::hash(&self.map)
    }

    /// The file's size in bytes.
    pub fn byte_len(&self) -> usize {
        self.map.len()
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, TensorData};

    use super::*;

    #[allow(deprecated)]
    fn device() -> Device {
        Device::ndarray()
    }

    #[test]
    fn shard_files_are_safetensors_with_their_checksums() {
        let dir = std::env::temp_dir().join(format!("bp-ckpt-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let values: Vec<f32> = (0..6).map(|i| i as f32 * 0.5).collect();
        let t = ShardTensor {
            key: "model/a.weight".into(),
            entry: "model/a.weight".into(),
            region: Region {
                start: vec![2, 0],
                shape: vec![2, 3],
            },
            dtype: DType::F32,
            value: Tensor::from_data(TensorData::new(values.clone(), [6]), &device()),
        };
        let written = write_shard_file(&dir, "f.safetensors", vec![t.clone()]).unwrap();
        let bytes = std::fs::read(dir.join("f.safetensors")).unwrap();
        assert_eq!(written.bytes, bytes.len() as u64);
        assert_eq!(written.crc32, crc32fast::hash(&bytes));
        // Safetensors itself reads it: the local block with its own shape.
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let view = st.tensor("model/a.weight").unwrap();
        assert_eq!(view.shape(), &[2, 3]);
        let raw: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(view.data(), &raw[..]);
        assert_eq!(written.tensors[0].crc32, crc32fast::hash(&raw));
        let file = ShardFile::open(&dir.join("f.safetensors"), written.bytes).unwrap();
        assert_eq!(
            file.tensor("model/a.weight", &t.region, "F32").unwrap(),
            &raw[..]
        );
        assert_eq!(file.crc32(), written.crc32);
        let err = ShardFile::open(&dir.join("f.safetensors"), written.bytes + 1)
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("f.safetensors") && err.contains("bytes"),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
