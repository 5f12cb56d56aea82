//! SFT examples and rows, TRL's convention: an example is `bos + ids(prompt) +
//! ids(completion) + eos`, each part tokenized on its own without specials; its row's inputs
//! are `ids[:-1]` and targets `ids[1:]`, and a target that is a prompt token (or bos) does not
//! count, so the completion's first token is the first target that does.

use crate::data::Example;

/// The example of one prompt/completion pair, from their ids.
pub fn sft_example(bos: u32, prompt: &[u32], completion: &[u32], eos: u32) -> Example {
    let mut ids = Vec::with_capacity(prompt.len() + completion.len() + 2);
    ids.push(bos);
    ids.extend_from_slice(prompt);
    ids.extend_from_slice(completion);
    ids.push(eos);
    let prompt_len = 1 + prompt.len();
    let counts = (0..ids.len()).map(|i| i >= prompt_len).collect();
    Example { ids, counts }
}

/// One row before padding: inputs, targets, whether each target counts, and each position's
/// rotary position and segment (the example it belongs to, for packed rows).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Row {
    /// Input ids.
    pub inputs: Vec<u32>,
    /// Target ids (each input's next token).
    pub targets: Vec<u32>,
    /// Whether each target counts in the loss.
    pub counts: Vec<bool>,
    /// Each input's position (restarting at 0 per example).
    pub positions: Vec<u32>,
    /// Each input's example within the row (0 for unpacked rows).
    pub segments: Vec<u32>,
}

impl Row {
    /// Appends `example` (at most `max_len + 1` of its ids, so at most `max_len` positions) as
    /// segment `segment`; returns whether it was truncated.
    pub fn push(&mut self, example: &Example, max_len: usize, segment: u32) -> bool {
        let n = example.ids.len().min(max_len + 1);
        let ids = &example.ids[..n];
        if n < 2 {
            return example.ids.len() > n;
        }
        self.inputs.extend_from_slice(&ids[..n - 1]);
        self.targets.extend_from_slice(&ids[1..]);
        self.counts.extend_from_slice(&example.counts[1..n]);
        self.positions.extend(0..(n - 1) as u32);
        self.segments.extend(std::iter::repeat_n(segment, n - 1));
        example.ids.len() > n
    }

    /// Positions in the row.
    pub fn len(&self) -> usize {
        self.inputs.len()
    }

    /// Whether the row has no positions.
    pub fn is_empty(&self) -> bool {
        self.inputs.is_empty()
    }
}

/// One row per example, each cut to `max_len` positions; also how many were truncated.
pub fn rows_of(examples: &[Example], max_len: usize) -> (Vec<Row>, usize) {
    let mut truncated = 0;
    let rows = examples
        .iter()
        .map(|e| {
            let mut row = Row::default();
            truncated += row.push(e, max_len, 0) as usize;
            row
        })
        .collect();
    (rows, truncated)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_targets_and_bos_do_not_count() {
        let e = sft_example(1, &[10, 11], &[20, 21, 22], 2);
        assert_eq!(e.ids, [1, 10, 11, 20, 21, 22, 2]);
        let (rows, truncated) = rows_of(std::slice::from_ref(&e), 64);
        assert_eq!(truncated, 0);
        let r = &rows[0];
        assert_eq!(r.inputs, [1, 10, 11, 20, 21, 22]);
        assert_eq!(r.targets, [10, 11, 20, 21, 22, 2]);
        // The completion's first token (20) is the first target that counts; eos counts.
        assert_eq!(r.counts, [false, false, true, true, true, true]);
        assert_eq!(r.positions, [0, 1, 2, 3, 4, 5]);
        // Cut to 4 positions: ids[..5].
        let (rows, truncated) = rows_of(&[e], 4);
        assert_eq!(truncated, 1);
        assert_eq!(rows[0].inputs, [1, 10, 11, 20]);
        assert_eq!(rows[0].targets, [10, 11, 20, 21]);
        assert_eq!(rows[0].counts, [false, false, true, true]);
    }
}
