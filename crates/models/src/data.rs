//! Token data in the nanoGPT `.bin` convention: a flat file of little-endian u16 token ids.
//! Sample `k` is `tokens[k*T .. k*T + T + 1]` (inputs the first T, targets the last T);
//! `n_samples = (len - 1) / T`; step `s` uses samples `(s*B + j) % n_samples` for `j` in
//! `0..B`; data-parallel rank `d` of `dp` takes rows `d*B/dp .. (d+1)*B/dp` (tp ranks of one
//! dp group take the same rows).

use std::ops::Range;
use std::path::{Path, PathBuf};

use crate::error::ModelError;

/// A token stream checked against a vocabulary and a sequence length.
#[derive(Debug, Clone)]
pub struct TokenData {
    tokens: Vec<u16>,
    seq_len: usize,
    source: PathBuf,
}

/// One data-parallel rank's rows of a step: ids and next-token targets, row-major
/// `[rows, seq_len]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// Rows (samples) in the batch.
    pub rows: usize,
    /// Tokens per row.
    pub seq_len: usize,
    /// Input ids, `rows * seq_len`.
    pub inputs: Vec<i64>,
    /// Target ids: each input's next token, `rows * seq_len`.
    pub targets: Vec<i64>,
}

impl TokenData {
    /// Reads a u16 token file.
    pub fn load(path: impl AsRef<Path>, vocab: usize, seq_len: usize) -> Result<Self, ModelError> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(ModelError::io(path))?;
        if bytes.len() % 2 != 0 {
            return Err(ModelError::Data {
                path: path.into(),
                reason: format!("{} bytes is not a whole number of u16 tokens", bytes.len()),
            });
        }
        let tokens = bytes
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect();
        Self::new(tokens, vocab, seq_len, path)
    }

    /// Checks `tokens` against `vocab` and `seq_len`; `source` names them in errors.
    pub fn new(
        tokens: Vec<u16>,
        vocab: usize,
        seq_len: usize,
        source: impl Into<PathBuf>,
    ) -> Result<Self, ModelError> {
        let source = source.into();
        let bad = |reason: String| ModelError::Data {
            path: source.clone(),
            reason,
        };
        if seq_len == 0 {
            return Err(bad("sequence length must be at least 1".into()));
        }
        if tokens.len() < seq_len + 1 {
            return Err(bad(format!(
                "{} tokens are too few for one sample of seq_len {seq_len} (needs {})",
                tokens.len(),
                seq_len + 1
            )));
        }
        if let Some((i, t)) = tokens
            .iter()
            .enumerate()
            .find(|(_, t)| **t as usize >= vocab)
        {
            return Err(bad(format!(
                "token {t} at position {i} is outside the vocabulary of {vocab}"
            )));
        }
        Ok(Self {
            tokens,
            seq_len,
            source,
        })
    }

    /// The built-in learnable corpus: `len` tokens of a noisy counting sequence. Each token is
    /// the previous plus a stride from a short repeating pattern, so the next token is
    /// predictable from the last few; the loss falls quickly from ln(vocab).
    pub fn synthetic(vocab: usize, seq_len: usize, len: usize) -> Result<Self, ModelError> {
        const STRIDES: [usize; 5] = [1, 3, 1, 2, 7];
        let mut t = 0usize;
        let tokens = (0..len)
            .map(|i| {
                t = (t + STRIDES[i % STRIDES.len()]) % vocab;
                t as u16
            })
            .collect();
        Self::new(tokens, vocab, seq_len, "<synthetic>")
    }

    /// Where the tokens came from (`<synthetic>` for the synthetic corpus).
    pub fn source(&self) -> &Path {
        &self.source
    }

    /// Tokens per sample.
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// Tokens in the stream.
    pub fn num_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// Whole samples in the stream: `(num_tokens - 1) / seq_len`.
    pub fn num_samples(&self) -> usize {
        (self.tokens.len() - 1) / self.seq_len
    }

    /// Rows `rows` of step `step`'s global batch of `global` samples.
    pub fn batch(&self, step: usize, global: usize, rows: Range<usize>) -> Batch {
        let t = self.seq_len;
        let n = self.num_samples();
        let mut inputs = Vec::with_capacity(rows.len() * t);
        let mut targets = Vec::with_capacity(rows.len() * t);
        for j in rows.clone() {
            let k = (step * global + j) % n;
            let sample = &self.tokens[k * t..k * t + t + 1];
            inputs.extend(sample[..t].iter().map(|x| *x as i64));
            targets.extend(sample[1..].iter().map(|x| *x as i64));
        }
        Batch {
            rows: rows.len(),
            seq_len: t,
            inputs,
            targets,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_follow_the_nanogpt_convention() {
        let data = TokenData::new((0..23).collect(), 100, 4, "t").unwrap();
        assert_eq!(data.num_samples(), 5);
        // Step 1 of a global batch of 3: samples 3, 4, 0.
        let b = data.batch(1, 3, 0..3);
        assert_eq!(&b.inputs[..4], &[12, 13, 14, 15]);
        assert_eq!(&b.targets[..4], &[13, 14, 15, 16]);
        assert_eq!(&b.inputs[8..], &[0, 1, 2, 3]);
        // A subset of rows is the matching rows of the global batch.
        let d1 = data.batch(1, 3, 1..3);
        assert_eq!(d1.inputs, b.inputs[4..]);
    }

    #[test]
    fn bad_data_is_named() {
        let msg = TokenData::new(vec![1, 2, 300], 256, 1, "f.bin")
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("token 300 at position 2") && msg.contains("f.bin"),
            "{msg}"
        );
        let msg = TokenData::new(vec![1, 2], 256, 4, "f.bin")
            .unwrap_err()
            .to_string();
        assert!(msg.contains("too few"), "{msg}");
        let msg = TokenData::load("/nonexistent/x.bin", 256, 4)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("/nonexistent/x.bin"), "{msg}");
    }
}
