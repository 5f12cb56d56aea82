//! The trainer's data (`--data`, `--tokenizer`, `--pack`, `--shuffle-seed`, `--eval-data`):
//! u16 `.bin` ids, or text and JSONL tokenized with a Hugging Face tokenizer, as rows of
//! inputs, targets and a mask of the targets that count. docs/data.md describes the formats.
//!
//! Order: the samples of step `s` are the global indices `s*B + j` for `j` in `0..B` (`B` the
//! step's whole batch, `--global-batch` times `--grad-accum`); index `g` is item `g % n` of
//! the file (`n` items: stream samples or examples), or with `--shuffle-seed S` item
//! `perm_e[g % n]` of epoch `e = g / n` ([`permutation`]). Data-parallel rank `d` of `dp` takes
//! rows `d*B'/dp .. (d+1)*B'/dp` of each micro-batch of `B' = --global-batch` rows.

pub mod cache;
pub mod chat;
pub mod formats;
pub mod pack;
pub mod sft;
pub mod tokenizer;

use std::ops::Range;
use std::path::{Path, PathBuf};

use burn_parallel_models::data::TokenData;

use crate::error::{TrainError, flag_error};
use formats::Format;
use sft::Row;
use tokenizer::TextTokenizer;

/// Tokenized ids of one record (or of a whole text), and whether each id counts as a target
/// (the id at position `i` is the target of position `i - 1`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Example {
    /// Token ids.
    pub ids: Vec<u32>,
    /// Whether each id counts when it is a target.
    pub counts: Vec<bool>,
}

/// How much of the eval data an evaluation reads (`--eval-batches K|all`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EvalBatches {
    /// The whole eval file once (the default, `all`): its last batch of `--global-batch` rows
    /// may be partial, and the rows past the file's end count nothing.
    #[default]
    All,
    /// The first `K` batches of `--global-batch` rows (`K` >= 1, within the file).
    First(usize),
}

impl EvalBatches {
    /// The global batches of `rows` rows an evaluation of `items` items reads.
    pub fn batches(self, items: usize, rows: usize) -> usize {
        match self {
            EvalBatches::All => items.div_ceil(rows.max(1)),
            EvalBatches::First(k) => k,
        }
    }

    /// The items an evaluation may count: all of them, or the first `K` batches'.
    pub fn items(self, items: usize, rows: usize) -> usize {
        match self {
            EvalBatches::All => items,
            EvalBatches::First(k) => (k * rows).min(items),
        }
    }
}

impl std::str::FromStr for EvalBatches {
    type Err = String;

    fn from_str(word: &str) -> Result<Self, String> {
        match word {
            "all" => Ok(EvalBatches::All),
            _ => match word.parse::<usize>() {
                Ok(k) if k >= 1 => Ok(EvalBatches::First(k)),
                _ => Err(format!(
                    "`{word}`: give `all` (the whole eval file, the default) or a count of \
                     batches, at least 1"
                )),
            },
        }
    }
}

impl std::fmt::Display for EvalBatches {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EvalBatches::All => f.write_str("all"),
            EvalBatches::First(k) => write!(f, "{k}"),
        }
    }
}

/// How the trainer reads its data, beyond the file (`TrainConfig::data`).
#[derive(Debug, Clone, PartialEq)]
pub struct DataOptions {
    /// A Hugging Face tokenizer.json for `.txt` and `.jsonl` data (`--tokenizer`).
    pub tokenizer: Option<PathBuf>,
    /// Several SFT or chat examples per row (`--pack`).
    pub pack: bool,
    /// Shuffle the items per epoch with this seed (`--shuffle-seed`; None: file order).
    pub shuffle_seed: Option<u64>,
    /// Pad SFT and chat rows to `--seq-len` rather than to the step's longest row (the
    /// command line sets it when `--seq-len` is given).
    pub pad_to_seq_len: bool,
    /// Evaluation data, in any of `--data`'s formats (`--eval-data`).
    pub eval_data: Option<PathBuf>,
    /// Evaluate every this many steps, and after the last (`--eval-every`; 0: never).
    pub eval_every: usize,
    /// How much of the eval data each evaluation reads (`--eval-batches`; default all of it).
    pub eval_batches: EvalBatches,
    /// Refuse SFT and chat data holding an example with no trained token (`--strict-data`;
    /// default false: such examples are counted in a warning).
    pub strict_data: bool,
}

impl Default for DataOptions {
    fn default() -> Self {
        Self {
            tokenizer: None,
            pack: false,
            shuffle_seed: None,
            pad_to_seq_len: false,
            eval_data: None,
            eval_every: 0,
            eval_batches: EvalBatches::All,
            strict_data: false,
        }
    }
}

/// One data-parallel rank's rows: ids, targets and a weight mask (1: the target counts),
/// row-major `[rows, seq_len]`; for packed rows also each position's rotary position and
/// segment (the example it belongs to).
#[derive(Debug, Clone, PartialEq)]
pub struct LossBatch {
    /// Rows.
    pub rows: usize,
    /// Positions per row.
    pub seq_len: usize,
    /// Input ids.
    pub inputs: Vec<i64>,
    /// Target ids (pad for padding).
    pub targets: Vec<i64>,
    /// 1.0 where the target counts, else 0.0.
    pub mask: Vec<f32>,
    /// Packed rows' positions (restarting per example) and segments; None when unpacked.
    pub packed: Option<(Vec<i64>, Vec<i64>)>,
}

impl LossBatch {
    /// Counts nothing in the rows from `row` on (an evaluation's rows past the file's end).
    pub fn count_rows_before(&mut self, row: usize) {
        let from = row.saturating_mul(self.seq_len).min(self.mask.len());
        self.mask[from..].iter_mut().for_each(|m| *m = 0.0);
    }

    /// Unpacked rows of a token stream, where every target counts.
    fn every_target(rows: usize, seq_len: usize, inputs: Vec<i64>, targets: Vec<i64>) -> Self {
        Self {
            rows,
            seq_len,
            inputs,
            targets,
            mask: vec![1.0; rows * seq_len],
            packed: None,
        }
    }

    /// The targets that count.
    pub fn count(&self) -> usize {
        self.mask.iter().filter(|m| **m > 0.0).count()
    }
}

/// A loaded data set.
#[derive(Debug)]
pub enum Dataset {
    /// u16 ids (a `.bin` file or the synthetic corpus): every target counts.
    Tokens(TokenData),
    /// Tokenized text cut into samples of `seq_len + 1` ids: every target counts.
    Stream {
        /// The ids.
        ids: Vec<u32>,
        /// Positions per sample.
        seq_len: usize,
    },
    /// SFT or chat rows (one example each, or packed), padded per batch.
    Rows {
        /// The rows, unpadded.
        rows: Vec<Row>,
        /// The pad id.
        pad: u32,
        /// Whether rows are packed.
        packed: bool,
    },
}

impl Dataset {
    /// Items (samples or rows) per epoch.
    pub fn len(&self) -> usize {
        match self {
            Dataset::Tokens(d) => d.num_samples(),
            Dataset::Stream { ids, seq_len } => (ids.len() - 1) / seq_len,
            Dataset::Rows { rows, .. } => rows.len(),
        }
    }

    /// Whether the data set has no items.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether some targets do not count (SFT and chat): the loss is then the masked mean.
    pub fn masked(&self) -> bool {
        matches!(self, Dataset::Rows { .. })
    }

    /// Whether rows are packed (the model needs positions and segments).
    pub fn packed(&self) -> bool {
        matches!(self, Dataset::Rows { packed: true, .. })
    }

    /// The item of global sample index `g` (file order, or epoch-shuffled with `seed`).
    fn item(&self, g: usize, seed: Option<u64>, perms: &mut Vec<(usize, Vec<usize>)>) -> usize {
        let n = self.len();
        let Some(seed) = seed else {
            return g % n;
        };
        let epoch = g / n;
        if let Some((_, p)) = perms.iter().find(|(e, _)| *e == epoch) {
            return p[g % n];
        }
        let p = permutation(n, seed, epoch as u64);
        let item = p[g % n];
        perms.push((epoch, p));
        item
    }

    /// The longest row (in positions) among global samples `samples`.
    pub fn longest(&self, samples: Range<usize>, seed: Option<u64>) -> usize {
        let mut perms = Vec::new();
        match self {
            Dataset::Tokens(d) => d.seq_len(),
            Dataset::Stream { seq_len, .. } => *seq_len,
            Dataset::Rows { rows, .. } => samples
                .map(|g| rows[self.item(g, seed, &mut perms)].len())
                .max()
                .unwrap_or(1)
                .max(1),
        }
    }

    /// The rows of global samples `samples`, rows padded (SFT, chat) to `pad_len` positions.
    pub fn batch(&self, samples: Range<usize>, seed: Option<u64>, pad_len: usize) -> LossBatch {
        let mut perms = Vec::new();
        let items: Vec<usize> = samples.map(|g| self.item(g, seed, &mut perms)).collect();
        let rows = items.len();
        match self {
            Dataset::Tokens(d) => {
                let t = d.seq_len();
                let (mut inputs, mut targets) = (Vec::new(), Vec::new());
                for k in items {
                    let b = d.batch(0, 0, k..k + 1);
                    inputs.extend(b.inputs);
                    targets.extend(b.targets);
                }
                LossBatch::every_target(rows, t, inputs, targets)
            }
            Dataset::Stream { ids, seq_len } => {
                let t = *seq_len;
                let (mut inputs, mut targets) = (Vec::new(), Vec::new());
                for k in items {
                    let sample = &ids[k * t..k * t + t + 1];
                    inputs.extend(sample[..t].iter().map(|x| *x as i64));
                    targets.extend(sample[1..].iter().map(|x| *x as i64));
                }
                LossBatch::every_target(rows, t, inputs, targets)
            }
            Dataset::Rows {
                rows: all,
                pad,
                packed,
            } => {
                let t = pad_len;
                let pad = *pad as i64;
                let cap = rows * t;
                let (mut inputs, mut targets, mut mask) = (
                    Vec::with_capacity(cap),
                    Vec::with_capacity(cap),
                    Vec::with_capacity(cap),
                );
                let (mut positions, mut segments) = (Vec::new(), Vec::new());
                for k in items {
                    let r = &all[k];
                    let n = r.len().min(t);
                    let fill = t - n;
                    inputs.extend(r.inputs[..n].iter().map(|x| *x as i64));
                    inputs.extend(std::iter::repeat_n(pad, fill));
                    targets.extend(r.targets[..n].iter().map(|x| *x as i64));
                    targets.extend(std::iter::repeat_n(pad, fill));
                    mask.extend(r.counts[..n].iter().map(|c| *c as u8 as f32));
                    mask.extend(std::iter::repeat_n(0.0, fill));
                    if *packed {
                        positions.extend(r.positions[..n].iter().map(|x| *x as i64));
                        positions.extend(0..fill as i64);
                        // Padding is a segment of its own after the row's examples.
                        let last = r.segments[..n].last().map_or(0, |s| *s as i64 + 1);
                        segments.extend(r.segments[..n].iter().map(|x| *x as i64));
                        segments.extend(std::iter::repeat_n(last, fill));
                    }
                }
                LossBatch {
                    rows,
                    seq_len: t,
                    inputs,
                    targets,
                    mask,
                    packed: packed.then_some((positions, segments)),
                }
            }
        }
    }
}

/// The permutation of epoch `epoch` under `--shuffle-seed seed`: Fisher–Yates over `0..n`,
/// `i` from `n - 1` down to 1 swapping `p[i]` with `p[j]`, `j = next() % (i + 1)`, where
/// `next` is SplitMix64 started at `seed ^ (epoch * 0x9E3779B97F4A7C15)`.
pub fn permutation(n: usize, seed: u64, epoch: u64) -> Vec<usize> {
    let mut state = seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let mut next = || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let mut p: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = (next() % (i as u64 + 1)) as usize;
        p.swap(i, j);
    }
    p
}

/// Loads `path` for rows of `seq_len` positions and a model of `vocab` ids; `what` names the
/// flag (`--data`, `--eval-data`) in messages.
pub fn load(
    path: &Path,
    opts: &DataOptions,
    seq_len: usize,
    vocab: usize,
    what: &'static str,
) -> Result<Dataset, TrainError> {
    let bytes = std::fs::read(path)
        .map_err(|e| TrainError::Data(format!("{what} {}: cannot read it: {e}", path.display())))?;
    let format = formats::detect(path, &bytes)?;
    if format == Format::Bin {
        if opts.pack {
            return Err(flag_error(
                "--pack",
                format!(
                    "needs SFT or chat records, but {what} {} is u16 ids",
                    path.display()
                ),
            ));
        }
        return Ok(Dataset::Tokens(TokenData::load(path, vocab, seq_len)?));
    }
    let tok = text_tokenizer(path, format, opts, what)?;
    let examples = tokenized(path, &bytes, format, &tok, cache::CACHE_MIN_BYTES)?;
    check_vocab(&examples, vocab, &tok, path, what)?;
    if format.has_examples() {
        check_trained_tokens(&examples, opts.strict_data, path, what)?;
        let pad = tok.need("pad", format.name())?;
        let rows = example_rows(&examples, opts.pack, seq_len, path, what);
        return Ok(Dataset::Rows {
            rows,
            pad,
            packed: opts.pack,
        });
    }
    token_stream(examples, seq_len, path, what)
}

/// The `--tokenizer` that text data `path` (of `format`) needs. `--pack` is refused here too,
/// before the tokenizer is read, when the format has no examples to pack.
fn text_tokenizer(
    path: &Path,
    format: Format,
    opts: &DataOptions,
    what: &'static str,
) -> Result<TextTokenizer, TrainError> {
    let tok_path = opts.tokenizer.as_deref().ok_or_else(|| {
        flag_error(
            what,
            format!(
                "{} is text ({}): give --tokenizer tokenizer.json",
                path.display(),
                format.name()
            ),
        )
    })?;
    if opts.pack && !format.has_examples() {
        return Err(flag_error(
            "--pack",
            format!(
                "needs SFT or chat records, but {what} {} is {} (a token stream, already cut \
                 into full rows)",
                path.display(),
                format.name()
            ),
        ));
    }
    TextTokenizer::load(tok_path)
}

/// Refuses data holding an id past the model's vocabulary, naming the first: the tokenizer is
/// not the model's, which is better said before training than found mid-run.
fn check_vocab(
    examples: &[Example],
    vocab: usize,
    tok: &TextTokenizer,
    path: &Path,
    what: &str,
) -> Result<(), TrainError> {
    let outside = examples
        .iter()
        .flat_map(|e| e.ids.iter())
        .enumerate()
        .find(|(_, id)| **id as usize >= vocab);
    match outside {
        Some((i, id)) => Err(TrainError::Data(format!(
            "{what} {}: token id {id} (token {i} of the data) is outside the model's vocab_size \
             {vocab}: {} has {} ids; use the model's own tokenizer",
            path.display(),
            tok.path().display(),
            tok.vocab_size()
        ))),
        None => Ok(()),
    }
}

/// Examples that train nothing (a conversation without an assistant turn, an empty
/// completion): counted in a warning on stderr, or refused under `--strict-data`. A step
/// made only of such rows is skipped (`"skipped": "no trained tokens"`).
fn check_trained_tokens(
    examples: &[Example],
    strict: bool,
    path: &Path,
    what: &'static str,
) -> Result<(), TrainError> {
    // The id at position i is the target of position i - 1: the first never is one.
    let untrained = examples
        .iter()
        .filter(|e| !e.counts.iter().skip(1).any(|&c| c))
        .count();
    if untrained == 0 {
        return Ok(());
    }
    let message = format!(
        "{} of {} examples of {} have no trained token (no assistant turn, or an empty \
         completion): they add nothing to the loss",
        untrained,
        examples.len(),
        path.display()
    );
    match strict {
        true => Err(flag_error(
            what,
            format!("{message}; drop them, or leave out --strict-data"),
        )),
        false => {
            eprintln!("{what}: {message} (--strict-data refuses such data)");
            Ok(())
        }
    }
}

/// SFT or chat examples as rows of at most `seq_len` positions (several per row when
/// `packed`); the examples cut to fit are counted on stderr, since they train on less than
/// their text.
fn example_rows(
    examples: &[Example],
    packed: bool,
    seq_len: usize,
    path: &Path,
    what: &str,
) -> Vec<Row> {
    let (rows, truncated) = match packed {
        true => pack::pack(examples, seq_len),
        false => sft::rows_of(examples, seq_len),
    };
    if truncated > 0 {
        eprintln!(
            "{what} {}: {truncated} of {} examples are longer than --seq-len {seq_len} \
             positions and were truncated",
            path.display(),
            examples.len()
        );
    }
    rows
}

/// A token stream of the examples' ids, which must hold at least one sample of `seq_len + 1`.
fn token_stream(
    examples: Vec<Example>,
    seq_len: usize,
    path: &Path,
    what: &str,
) -> Result<Dataset, TrainError> {
    let ids: Vec<u32> = examples.into_iter().flat_map(|e| e.ids).collect();
    if ids.len() < seq_len + 1 {
        return Err(TrainError::Data(format!(
            "{what} {}: {} tokens are too few for one sample of --seq-len {seq_len} (needs {})",
            path.display(),
            ids.len(),
            seq_len + 1
        )));
    }
    Ok(Dataset::Stream { ids, seq_len })
}

/// The examples of a text or JSONL file, from its cache when the file has at least
/// `cache_from` bytes and the cache is current, else tokenized (and then cached when large).
fn tokenized(
    path: &Path,
    bytes: &[u8],
    format: Format,
    tok: &TextTokenizer,
    cache_from: u64,
) -> Result<Vec<Example>, TrainError> {
    let large = bytes.len() as u64 >= cache_from;
    let (cache_file, key) = (
        cache::cache_path(path),
        cache::key(tok.hash, bytes, format.name()),
    );
    if large && let Some(examples) = cache::read(&cache_file, key) {
        return Ok(examples);
    }
    let examples = tokenize(path, bytes, format, tok)?;
    if large {
        cache::write(&cache_file, key, &examples);
    }
    Ok(examples)
}

/// Tokenizes a text or JSONL file of `format`.
pub fn tokenize(
    path: &Path,
    bytes: &[u8],
    format: Format,
    tok: &TextTokenizer,
) -> Result<Vec<Example>, TrainError> {
    let text = formats::utf8(path, bytes)?;
    let whole = || format!("--data {}", path.display());
    if format == Format::Text {
        let ids = tok.encode(text, &whole)?;
        let counts = vec![true; ids.len()];
        return Ok(vec![Example { ids, counts }]);
    }
    let template = match format {
        Format::Chat => Some(chat::ChatTemplate::of(tok)?),
        _ => None,
    };
    let (bos, eos) = match format {
        Format::Sft => (tok.need("bos", "SFT")?, tok.need("eos", "SFT")?),
        Format::JsonlText => (0, tok.need("eos", "{\"text\"} pretraining")?),
        _ => (0, 0),
    };
    let mut examples = Vec::new();
    for record in formats::records(path, text) {
        let (line, record) = record?;
        let at = |field: &str| format!("--data {} line {line} \"{field}\"", path.display());
        let field = |key: &str| formats::string_field(path, line, &record, key);
        let example = match format {
            Format::JsonlText => {
                let mut ids = tok.encode(field("text")?, &|| at("text"))?;
                ids.push(eos);
                let counts = vec![true; ids.len()];
                Example { ids, counts }
            }
            Format::Sft => {
                let prompt = tok.encode(field("prompt")?, &|| at("prompt"))?;
                let completion = tok.encode(field("completion")?, &|| at("completion"))?;
                sft::sft_example(bos, &prompt, &completion, eos)
            }
            _ => {
                let what = || format!("--data {} line {line}", path.display());
                let messages = record.get("messages").ok_or_else(|| {
                    TrainError::Data(format!("{}: no \"messages\" field", what()))
                })?;
                let messages = chat::messages_of(messages, &what)?;
                let template = template.as_ref().expect("chat has a template");
                let e = chat::chat_example(tok, template, &messages, &what)?;
                if e.ids.len() < 2 {
                    return Err(TrainError::Data(format!(
                        "{}: renders to {} token(s); a chat example needs at least 2",
                        what(),
                        e.ids.len()
                    )));
                }
                e
            }
        };
        examples.push(example);
    }
    Ok(examples)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permutations_are_permutations_that_change_per_epoch_and_seed() {
        let p = permutation(10, 3, 0);
        let mut sorted = p.clone();
        sorted.sort();
        assert_eq!(sorted, (0..10).collect::<Vec<_>>());
        assert_eq!(p, permutation(10, 3, 0));
        assert_ne!(p, permutation(10, 3, 1));
        assert_ne!(p, permutation(10, 4, 0));
        assert_eq!(permutation(1, 3, 0), vec![0]);
    }

    #[test]
    fn large_files_are_tokenized_once_and_a_stale_cache_is_rebuilt() {
        let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data");
        let tok = TextTokenizer::load(&fixtures.join("tokenizer.json")).unwrap();
        let dir = std::env::temp_dir().join(format!("bp-tokcache-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("d.jsonl");
        let first = b"{\"prompt\": \"the model\", \"completion\": \" reads\"}\n";
        let fresh = tokenize(&path, first, Format::Sft, &tok).unwrap();
        // Cached on the first read (every file counts as large here).
        let got = tokenized(&path, first, Format::Sft, &tok, 0).unwrap();
        assert_eq!(got, fresh);
        let cache_file = cache::cache_path(&path);
        let key = cache::key(tok.hash, first, "sft");
        assert_eq!(cache::read(&cache_file, key), Some(fresh.clone()));
        // The second read is the cache's: a cache that says otherwise is believed.
        let planted = vec![Example {
            ids: vec![7, 8],
            counts: vec![false, true],
        }];
        cache::write(&cache_file, key, &planted);
        assert_eq!(
            tokenized(&path, first, Format::Sft, &tok, 0).unwrap(),
            planted
        );
        // Changed data (or format): the key differs, the cache is rebuilt and overwritten.
        let second = b"{\"prompt\": \"the model\", \"completion\": \" moves\"}\n";
        let rebuilt = tokenized(&path, second, Format::Sft, &tok, 0).unwrap();
        assert_eq!(rebuilt, tokenize(&path, second, Format::Sft, &tok).unwrap());
        assert_ne!(rebuilt, fresh);
        assert_eq!(
            cache::read(&cache_file, cache::key(tok.hash, second, "sft")),
            Some(rebuilt)
        );
        assert_eq!(cache::read(&cache_file, key), None);
        // Below the size threshold nothing is cached.
        std::fs::remove_file(&cache_file).unwrap();
        tokenized(&path, first, Format::Sft, &tok, u64::MAX).unwrap();
        assert!(!cache_file.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn rows_pad_with_pad_and_mask_it() {
        let rows = sft::rows_of(
            &[
                sft::sft_example(1, &[5], &[6, 7], 2),
                sft::sft_example(1, &[5, 5], &[8], 2),
            ],
            16,
        )
        .0;
        let data = Dataset::Rows {
            rows,
            pad: 3,
            packed: false,
        };
        assert_eq!(data.longest(0..2, None), 4);
        // Global samples 1, 2 (= item 1, item 0) padded to 5.
        let b = data.batch(1..3, None, 5);
        assert_eq!(b.inputs, [1, 5, 5, 8, 3, 1, 5, 6, 7, 3]);
        assert_eq!(b.targets, [5, 5, 8, 2, 3, 5, 6, 7, 2, 3]);
        assert_eq!(b.mask, [0., 0., 1., 1., 0., 0., 1., 1., 1., 0.]);
        assert_eq!(b.count(), 5);
        // Shuffled: the epoch's permutation picks the items.
        let p = permutation(2, 9, 1);
        let b = data.batch(2..3, Some(9), 5);
        assert_eq!(b.inputs[..2], [1, 5]);
        assert_eq!(b.inputs[2], if p[0] == 0 { 6 } else { 5 });
    }
}
