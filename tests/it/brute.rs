//! Brute-force references: every collective computed element by element from all ranks'
//! inputs with plain index arithmetic, independent of the engine's byte-level code.

#![allow(dead_code)]

/// A dense f32 tensor: values in row-major order with a shape.
#[derive(Debug, Clone, PartialEq)]
pub struct Dense {
    pub shape: Vec<usize>,
    pub values: Vec<f32>,
}

impl Dense {
    pub fn new(shape: Vec<usize>, values: Vec<f32>) -> Self {
        assert_eq!(shape.iter().product::<usize>(), values.len());
        Self { shape, values }
    }

    fn strides(&self) -> Vec<usize> {
        let mut strides = vec![1; self.shape.len()];
        for i in (0..self.shape.len().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * self.shape[i + 1];
        }
        strides
    }

    pub fn get(&self, index: &[usize]) -> f32 {
        let offset: usize = index.iter().zip(self.strides()).map(|(i, s)| i * s).sum();
        self.values[offset]
    }

    /// Every multi-index of `shape`, row-major.
    pub fn indices(shape: &[usize]) -> Vec<Vec<usize>> {
        let total: usize = shape.iter().product();
        (0..total)
            .map(|mut k| {
                let mut idx = vec![0; shape.len()];
                for d in (0..shape.len()).rev() {
                    idx[d] = k % shape[d];
                    k /= shape[d];
                }
                idx
            })
            .collect()
    }

    pub fn build(shape: Vec<usize>, f: impl Fn(&[usize]) -> f32) -> Self {
        let values = Self::indices(&shape).iter().map(|i| f(i)).collect();
        Self::new(shape, values)
    }
}

fn starts(sizes: &[usize]) -> Vec<usize> {
    let mut acc = 0;
    sizes
        .iter()
        .map(|s| {
            let v = acc;
            acc += s;
            v
        })
        .collect()
}

/// Which piece an index along a concatenated dimension falls in, and where inside it.
fn locate(sizes: &[usize], i: usize) -> (usize, usize) {
    let mut start = 0;
    for (piece, size) in sizes.iter().enumerate() {
        if i < start + size {
            return (piece, i - start);
        }
        start += size;
    }
    panic!("index {i} beyond pieces {sizes:?}")
}

pub fn concat(parts: &[Dense], dim: usize) -> Dense {
    let sizes: Vec<usize> = parts.iter().map(|p| p.shape[dim]).collect();
    let mut shape = parts[0].shape.clone();
    shape[dim] = sizes.iter().sum();
    Dense::build(shape, |idx| {
        let (piece, at) = locate(&sizes, idx[dim]);
        let mut local = idx.to_vec();
        local[dim] = at;
        parts[piece].get(&local)
    })
}

pub fn slice(t: &Dense, dim: usize, start: usize, len: usize) -> Dense {
    let mut shape = t.shape.clone();
    shape[dim] = len;
    Dense::build(shape, |idx| {
        let mut src = idx.to_vec();
        src[dim] += start;
        t.get(&src)
    })
}

/// Elementwise reduction in rank order; `round` is applied to the final value (identity for
/// f32, a bf16 round trip for bf16).
pub fn reduce(inputs: &[Dense], op: &str, round: impl Fn(f32) -> f32) -> Dense {
    let shape = inputs[0].shape.clone();
    let n = inputs.len() as f32;
    Dense::build(shape, |idx| {
        let vals = inputs.iter().map(|t| t.get(idx));
        let v = match op {
            "sum" => vals.fold(None, |acc: Option<f32>, v| Some(acc.map_or(v, |a| a + v))),
            "avg" => vals
                .fold(None, |acc: Option<f32>, v| Some(acc.map_or(v, |a| a + v)))
                .map(|s| s / n),
            "max" => vals.fold(None, |acc: Option<f32>, v| {
                Some(acc.map_or(v, |a| a.max(v)))
            }),
            "min" => vals.fold(None, |acc: Option<f32>, v| {
                Some(acc.map_or(v, |a| a.min(v)))
            }),
            other => panic!("unknown op {other}"),
        };
        round(v.unwrap())
    })
}

/// Rank `me`'s output of reduce_scatter with chunk `sizes` along `dim`.
pub fn reduce_scatter(
    inputs: &[Dense],
    dim: usize,
    sizes: &[usize],
    me: usize,
    round: impl Fn(f32) -> f32,
) -> Dense {
    let start = starts(sizes)[me];
    let pieces: Vec<Dense> = inputs
        .iter()
        .map(|t| slice(t, dim, start, sizes[me]))
        .collect();
    reduce(&pieces, "sum", round)
}

/// Rank `me`'s output of all_to_all: from each source, its slice `me` along `split_dim`,
/// concatenated along `concat_dim`.
pub fn all_to_all(
    inputs: &[Dense],
    send_sizes: &[Vec<usize>],
    split_dim: usize,
    concat_dim: usize,
    me: usize,
) -> Dense {
    let pieces: Vec<Dense> = inputs
        .iter()
        .zip(send_sizes)
        .map(|(t, sizes)| slice(t, split_dim, starts(sizes)[me], sizes[me]))
        .collect();
    concat(&pieces, concat_dim)
}
