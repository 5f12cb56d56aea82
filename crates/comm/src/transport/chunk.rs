//! How a dimension of `n` elements is split over `parts` ranks: FSDP2's pad-to-ceil rule
//! (PyTorch's `torch.chunk`): every chunk holds `ceil(n / parts)` elements except the tail,
//! which holds what is left, possibly nothing. Concatenating the chunks gives back `n`.

/// The size of each rank's chunk, in rank order.
pub fn chunk_sizes(n: usize, parts: usize) -> Vec<usize> {
    assert!(parts > 0, "cannot split into 0 parts");
    let chunk = n.div_ceil(parts);
    (0..parts)
        .map(|i| n.saturating_sub(i * chunk).min(chunk))
        .collect()
}

/// The half-open range of elements that `rank` holds.
pub fn chunk_range(n: usize, parts: usize, rank: usize) -> std::ops::Range<usize> {
    assert!(rank < parts, "rank {rank} outside {parts} parts");
    let chunk = n.div_ceil(parts);
    let start = (rank * chunk).min(n);
    let end = ((rank + 1) * chunk).min(n);
    start..end
}

/// The padded chunk size: what each rank allocates so that all shards have one shape.
pub fn padded_chunk(n: usize, parts: usize) -> usize {
    n.div_ceil(parts)
}

/// Offsets of consecutive chunks of the given sizes.
pub fn offsets(sizes: &[usize]) -> Vec<usize> {
    let mut acc = 0;
    sizes
        .iter()
        .map(|s| {
            let start = acc;
            acc += s;
            start
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_follow_torch_chunk() {
        assert_eq!(chunk_sizes(10, 4), vec![3, 3, 3, 1]);
        assert_eq!(chunk_sizes(5, 4), vec![2, 2, 1, 0]);
        assert_eq!(chunk_sizes(2, 4), vec![1, 1, 0, 0]);
        assert_eq!(chunk_sizes(0, 3), vec![0, 0, 0]);
        assert_eq!(chunk_sizes(8, 4), vec![2, 2, 2, 2]);
    }

    #[test]
    fn ranges_tile_the_dimension() {
        for n in 0..20 {
            for parts in 1..7 {
                let sizes = chunk_sizes(n, parts);
                assert_eq!(sizes.iter().sum::<usize>(), n);
                let mut next = 0;
                for (rank, size) in sizes.iter().enumerate() {
                    let r = chunk_range(n, parts, rank);
                    assert_eq!(r.start, next);
                    assert_eq!(r.len(), *size);
                    assert!(r.len() <= padded_chunk(n, parts));
                    next = r.end;
                }
            }
        }
    }
}
