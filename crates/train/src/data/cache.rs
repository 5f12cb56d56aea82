//! The tokenized-data cache: a large text or JSONL file is tokenized once into
//! `<data file>.tokcache` beside it, keyed by a hash (FNV-1a, 64 bits) of the tokenizer's
//! files, the data file's bytes, the format and the cache's version. A cache whose key differs
//! (a changed tokenizer, data file or format) is stale: it is rebuilt and overwritten.
//!
//! File layout, little-endian: `b"BPTOKC01"`, the key (u64), the example count (u64), then per
//! example its length (u32), its ids (u32 each) and one byte per id (1: its target counts).

use std::path::{Path, PathBuf};

use crate::data::Example;

/// FNV-1a's 64-bit offset basis (the hash of nothing).
pub const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// Data files at least this large are cached (smaller ones are tokenized on every run).
pub const CACHE_MIN_BYTES: u64 = 1 << 20;

const MAGIC: &[u8; 8] = b"BPTOKC01";

/// FNV-1a over `bytes`, continuing from `hash`.
pub fn fnv1a(mut hash: u64, bytes: &[u8]) -> u64 {
    for b in bytes {
        hash ^= *b as u64;
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

/// The cache file of `data`.
pub fn cache_path(data: &Path) -> PathBuf {
    let mut name = data.file_name().unwrap_or_default().to_os_string();
    name.push(".tokcache");
    data.with_file_name(name)
}

/// The key of `data`'s bytes tokenized by a tokenizer of hash `tokenizer` as `format`.
pub fn key(tokenizer: u64, data: &[u8], format: &str) -> u64 {
    let h = fnv1a(FNV_OFFSET, MAGIC);
    let h = fnv1a(h, &tokenizer.to_le_bytes());
    let h = fnv1a(h, format.as_bytes());
    fnv1a(h, data)
}

/// The examples cached at `path` under `key`, or None when there is no cache or it is stale
/// or unreadable.
pub fn read(path: &Path, key: u64) -> Option<Vec<Example>> {
    let bytes = std::fs::read(path).ok()?;
    let mut at = 0usize;
    let mut take = |n: usize| -> Option<&[u8]> {
        let s = bytes.get(at..at + n)?;
        at += n;
        Some(s)
    };
    if take(8)? != MAGIC {
        return None;
    }
    let u64_of = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes"));
    if u64_of(take(8)?) != key {
        return None;
    }
    let count = u64_of(take(8)?) as usize;
    let mut examples = Vec::with_capacity(count.min(1 << 24));
    for _ in 0..count {
        let len = u32::from_le_bytes(take(4)?.try_into().ok()?) as usize;
        let ids = take(4 * len)?
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect();
        let counts = take(len)?.iter().map(|b| *b == 1).collect();
        examples.push(Example { ids, counts });
    }
    Some(examples)
}

/// Writes `examples` to `path` under `key` (through a temporary file, renamed into place, so
/// that a reader never sees half a cache). A failure only costs the next run a re-tokenization:
/// it is reported on stderr, not an error.
pub fn write(path: &Path, key: u64, examples: &[Example]) {
    let mut out = Vec::new();
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&key.to_le_bytes());
    out.extend_from_slice(&(examples.len() as u64).to_le_bytes());
    for e in examples {
        out.extend_from_slice(&(e.ids.len() as u32).to_le_bytes());
        for id in &e.ids {
            out.extend_from_slice(&id.to_le_bytes());
        }
        out.extend(e.counts.iter().map(|c| *c as u8));
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let done = std::fs::write(&tmp, &out).and_then(|_| std::fs::rename(&tmp, path));
    if let Err(e) = done {
        let _ = std::fs::remove_file(&tmp);
        eprintln!("cannot write the token cache {}: {e}", path.display());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cache_reads_back_and_a_changed_key_is_stale() {
        let dir = std::env::temp_dir().join(format!("bp-cache-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = cache_path(&dir.join("d.jsonl"));
        assert!(path.ends_with("d.jsonl.tokcache"));
        let examples = vec![
            Example {
                ids: vec![1, 2, 70000],
                counts: vec![false, true, true],
            },
            Example {
                ids: vec![],
                counts: vec![],
            },
        ];
        let k = key(7, b"data", "sft");
        write(&path, k, &examples);
        assert_eq!(read(&path, k), Some(examples));
        assert_ne!(k, key(8, b"data", "sft"));
        assert_ne!(k, key(7, b"data!", "sft"));
        assert_ne!(k, key(7, b"data", "chat"));
        assert_eq!(read(&path, key(7, b"data!", "sft")), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn fnv1a_matches_its_reference_values() {
        // The published FNV-1a 64 test vectors.
        assert_eq!(fnv1a(FNV_OFFSET, b""), 0xcbf29ce484222325);
        assert_eq!(fnv1a(FNV_OFFSET, b"a"), 0xaf63dc4c8601ec8c);
        assert_eq!(fnv1a(FNV_OFFSET, b"foobar"), 0x85944171f73967e8);
    }
}
