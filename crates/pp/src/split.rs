//! Which consecutive layers each stage holds.

use std::ops::Range;

use crate::error::PipelineError;

/// The layers of each of `stages` consecutive stages: stage `s` holds layers `range(s)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageSplit {
    counts: Vec<usize>,
}

impl StageSplit {
    /// `layers` split as evenly as possible over `stages`, earlier stages taking one layer more
    /// when it does not divide (TorchTitan's and Megatron's default). Every stage needs a layer.
    pub fn even(layers: usize, stages: usize) -> Result<Self, PipelineError> {
        if stages == 0 || layers < stages {
            return Err(PipelineError::Split(format!(
                "{layers} layers cannot fill {stages} stages (each stage needs at least one \
                 layer)"
            )));
        }
        let counts = (0..stages)
            .map(|s| layers / stages + usize::from(s < layers % stages))
            .collect();
        Ok(Self { counts })
    }

    /// An explicit split: stage `s` holds `counts[s]` layers. They must sum to `layers`, and
    /// no stage may be empty.
    pub fn explicit(counts: Vec<usize>, layers: usize) -> Result<Self, PipelineError> {
        let total: usize = counts.iter().sum();
        if counts.is_empty() || total != layers || counts.contains(&0) {
            return Err(PipelineError::Split(format!(
                "layers per stage {counts:?} must be positive and sum to the model's {layers} \
                 layers"
            )));
        }
        Ok(Self { counts })
    }

    /// The number of stages.
    pub fn stages(&self) -> usize {
        self.counts.len()
    }

    /// The number of layers over all stages.
    pub fn layers(&self) -> usize {
        self.counts.iter().sum()
    }

    /// The layers of each stage.
    pub fn counts(&self) -> &[usize] {
        &self.counts
    }

    /// The global indices of the layers of `stage`.
    pub fn range(&self, stage: usize) -> Range<usize> {
        let start: usize = self.counts[..stage].iter().sum();
        start..start + self.counts[stage]
    }
}

/// `rows` rows split into `parts` consecutive ranges whose lengths differ by at most one
/// (earlier parts the longer): the microbatches of a local batch. Every part needs a row.
pub fn split_rows(rows: usize, parts: usize) -> Result<Vec<Range<usize>>, PipelineError> {
    if parts == 0 || rows < parts {
        return Err(PipelineError::Schedule(format!(
            "{rows} rows cannot make {parts} microbatches (each needs at least one row)"
        )));
    }
    let mut start = 0;
    Ok((0..parts)
        .map(|p| {
            let len = rows / parts + usize::from(p < rows % parts);
            start += len;
            start - len..start
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn even_splits_give_earlier_stages_the_extra_layer() {
        let split = StageSplit::even(7, 3).unwrap();
        assert_eq!(split.counts(), &[3, 2, 2]);
        assert_eq!(
            (0..3).map(|s| split.range(s)).collect::<Vec<_>>(),
            vec![0..3, 3..5, 5..7]
        );
        assert!(StageSplit::even(1, 2).is_err());
        assert!(StageSplit::explicit(vec![1, 3], 4).is_ok());
        assert!(StageSplit::explicit(vec![0, 4], 4).is_err());
        assert!(StageSplit::explicit(vec![1, 2], 4).is_err());
    }

    #[test]
    fn rows_split_into_microbatches() {
        assert_eq!(split_rows(5, 2).unwrap(), vec![0..3, 3..5]);
        assert_eq!(split_rows(4, 4).unwrap(), vec![0..1, 1..2, 2..3, 3..4]);
        assert!(split_rows(2, 3).is_err());
    }
}
