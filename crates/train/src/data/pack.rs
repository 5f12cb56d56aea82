//! `--pack`: several examples in one row, as transformers' `DataCollatorWithFlattening`
//! flattens them. Examples are taken in file order and placed greedily: the next example
//! joins the current row if its positions fit in `seq_len`, else it starts a new row (an
//! example longer than `seq_len` is truncated to it and fills a row of its own). Positions
//! restart at 0 per example and each example is its own segment: attention does not cross
//! segments (a block-diagonal causal mask), so a packed row computes exactly what its examples
//! compute unpacked.

use crate::data::Example;
use crate::data::sft::Row;

/// The packed rows of `examples` in rows of at most `seq_len` positions, and how many examples
/// were truncated.
pub fn pack(examples: &[Example], seq_len: usize) -> (Vec<Row>, usize) {
    let mut rows = Vec::new();
    let mut row = Row::default();
    let mut segment = 0u32;
    let mut truncated = 0;
    for e in examples {
        let positions = e.ids.len().saturating_sub(1).min(seq_len);
        if !row.is_empty() && row.len() + positions > seq_len {
            rows.push(std::mem::take(&mut row));
            segment = 0;
        }
        truncated += row.push(e, seq_len, segment) as usize;
        segment += 1;
    }
    if !row.is_empty() {
        rows.push(row);
    }
    (rows, truncated)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn example(n: u32) -> Example {
        Example {
            ids: (0..n).collect(),
            counts: vec![true; n as usize],
        }
    }

    #[test]
    fn examples_fill_rows_in_order_with_positions_restarting() {
        // 3, 2, 4 and 6 positions (ids 4, 3, 5, 7) in rows of 6: [3 + 2], [4], [6].
        let (rows, truncated) = pack(&[example(4), example(3), example(5), example(7)], 6);
        assert_eq!(truncated, 0);
        assert_eq!(rows.len(), 3);
        assert_eq!(rows[0].positions, [0, 1, 2, 0, 1]);
        assert_eq!(rows[0].segments, [0, 0, 0, 1, 1]);
        assert_eq!(rows[0].inputs, [0, 1, 2, 0, 1]);
        assert_eq!(rows[0].targets, [1, 2, 3, 1, 2]);
        assert_eq!(rows[1].positions, [0, 1, 2, 3]);
        assert_eq!(rows[2].len(), 6);
        // Too long: truncated to a row of its own.
        let (rows, truncated) = pack(&[example(2), example(9)], 6);
        assert_eq!(truncated, 1);
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[1].positions, [0, 1, 2, 3, 4, 5]);
    }
}
