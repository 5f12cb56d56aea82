//! Parallel styles (DTensor's ColwiseParallel / RowwiseParallel / SequenceParallel) and the
//! activation layouts they expect and produce.

use std::fmt;

/// Layout of an activation over the tp group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// Every rank holds the whole tensor.
    Replicated,
    /// Split on the last (feature) dim: the output of a colwise layer.
    Sharded,
    /// Split on a sequence dim (pad-to-ceil chunks): the sequence-parallel region.
    SequenceSharded {
        /// The sequence dim.
        dim: usize,
    },
}

/// How a module takes part in tensor parallelism.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParallelStyle {
    /// Weight split on the output features. Input: `Replicated` (backward all-reduces its
    /// gradient) or `SequenceSharded` (all-gathered first). Output: `Sharded` or
    /// `Replicated` (gathered).
    Colwise {
        /// Layout of the input.
        input: Layout,
        /// Layout of the output.
        output: Layout,
    },
    /// Weight split on the input features (an Embedding: on the vocab, masked lookup).
    /// Input: `Sharded` or `Replicated` (split here). Output: `Replicated` (all-reduce) or
    /// `SequenceSharded` (reduce-scatter). A bias is added once, after the reduction.
    Rowwise {
        /// Layout of the input.
        input: Layout,
        /// Layout of the output.
        output: Layout,
    },
    /// Colwise on a fused projection (one `qkv` Linear, or `gate_up`): the output features are
    /// `parts` equal parts (q, k, v) and each part is split over the group on its own, so rank
    /// `r` holds its chunk of every part, part by part, and splits its local output into
    /// `parts` equal local parts exactly as the model splits the full one. Input: as
    /// `Colwise`. Output: `Sharded` only (a gathered output would interleave the ranks' chunks).
    ColwiseFused {
        /// How many equal parts the output features are (3 for q/k/v, 2 for gate/up).
        parts: usize,
        /// Layout of the input.
        input: Layout,
        /// Layout of the output: `Sharded`.
        output: Layout,
    },
    /// Norm-like module run on a sequence-sharded activation; its replicated parameters
    /// get partial gradients, summed over the group by `sync_tp_grads`.
    Sequence {
        /// The sequence dim the activation is split on.
        dim: usize,
    },
}

impl ParallelStyle {
    /// Colwise on a replicated input, with a feature-sharded output (for a rowwise layer next).
    pub fn colwise() -> Self {
        Self::Colwise {
            input: Layout::Replicated,
            output: Layout::Sharded,
        }
    }

    /// Colwise with the output gathered back to a replicated tensor.
    pub fn colwise_gathered() -> Self {
        Self::Colwise {
            input: Layout::Replicated,
            output: Layout::Replicated,
        }
    }

    /// Colwise whose input is sequence-sharded on `dim` (sequence parallelism).
    pub fn colwise_sp(dim: usize) -> Self {
        Self::Colwise {
            input: Layout::SequenceSharded { dim },
            output: Layout::Sharded,
        }
    }

    /// Colwise on a fused projection of `parts` equal parts (`colwise_fused(3)` for a `qkv`
    /// Linear, `colwise_fused(2)` for `gate_up`): each part is split over the group on its own,
    /// so the local output splits into `parts` local parts as the full one does. Replicated
    /// input, feature-sharded output (for a rowwise layer next).
    pub fn colwise_fused(parts: usize) -> Self {
        Self::ColwiseFused {
            parts,
            input: Layout::Replicated,
            output: Layout::Sharded,
        }
    }

    /// How many equal parts of the split dim are split over the group separately: `parts` of
    /// a fused colwise style, 1 for every other style (one contiguous chunk).
    pub fn parts(&self) -> usize {
        match *self {
            Self::ColwiseFused { parts, .. } => parts,
            _ => 1,
        }
    }

    /// Rowwise on a feature-sharded input (a colwise output), all-reduced to a replicated output.
    pub fn rowwise() -> Self {
        Self::Rowwise {
            input: Layout::Sharded,
            output: Layout::Replicated,
        }
    }

    /// Rowwise on a replicated input: each rank takes its slice of the features.
    pub fn rowwise_from_replicated() -> Self {
        Self::Rowwise {
            input: Layout::Replicated,
            output: Layout::Replicated,
        }
    }

    /// Rowwise whose output is reduce-scattered on the sequence `dim`.
    pub fn rowwise_sp(dim: usize) -> Self {
        Self::Rowwise {
            input: Layout::Sharded,
            output: Layout::SequenceSharded { dim },
        }
    }

    /// Vocab-parallel embedding: replicated ids, vocab-sharded table, all-reduced output.
    pub fn vocab_parallel() -> Self {
        Self::Rowwise {
            input: Layout::Replicated,
            output: Layout::Replicated,
        }
    }

    /// Vocab-parallel embedding whose output is reduce-scattered on the sequence `dim`.
    pub fn vocab_parallel_sp(dim: usize) -> Self {
        Self::Rowwise {
            input: Layout::Replicated,
            output: Layout::SequenceSharded { dim },
        }
    }

    /// A norm-like module run on an activation sequence-sharded on `dim`.
    pub fn sequence_parallel(dim: usize) -> Self {
        Self::Sequence { dim }
    }

    /// A style by the name `#[tp(..)]` and config files write, `name` or `name(N)`, through
    /// the one table of burn-parallel-styles (sequence dims default to 1 of
    /// `[batch, seq, hidden]`). The error lists the accepted names.
    pub fn by_name(text: &str) -> Result<Self, String> {
        let resolved = burn_parallel_styles::parse(text)?;
        Self::from_resolved(resolved)
    }

    /// The constructor a table entry names, with its argument.
    fn from_resolved(resolved: burn_parallel_styles::ResolvedStyle) -> Result<Self, String> {
        let arg = resolved.arg.unwrap_or(0);
        Ok(match resolved.style.name {
            "colwise" => Self::colwise(),
            "colwise_gathered" => Self::colwise_gathered(),
            "rowwise" => Self::rowwise(),
            "rowwise_from_replicated" => Self::rowwise_from_replicated(),
            "vocab_parallel" => Self::vocab_parallel(),
            "colwise_sp" => Self::colwise_sp(arg),
            "rowwise_sp" => Self::rowwise_sp(arg),
            "vocab_parallel_sp" => Self::vocab_parallel_sp(arg),
            "sequence_parallel" => Self::sequence_parallel(arg),
            "colwise_fused" => Self::colwise_fused(arg),
            other => {
                return Err(format!(
                    "tp style `{other}` has no ParallelStyle constructor"
                ));
            }
        })
    }

    /// Checks the layouts make sense for the style; returns why not.
    pub(crate) fn check_layouts(&self) -> Result<(), String> {
        match *self {
            Self::Colwise { input, output } => {
                if input == Layout::Sharded {
                    return Err(
                        "a colwise layer needs a replicated or sequence-sharded input".into(),
                    );
                }
                if matches!(output, Layout::SequenceSharded { .. }) {
                    return Err("a colwise layer's output is feature-sharded or replicated".into());
                }
            }
            Self::ColwiseFused {
                parts,
                input,
                output,
            } => {
                if parts == 0 {
                    return Err("a fused colwise layer needs at least one part".into());
                }
                if input == Layout::Sharded {
                    return Err(
                        "a fused colwise layer needs a replicated or sequence-sharded input".into(),
                    );
                }
                if output != Layout::Sharded {
                    // Each rank holds its chunk of every part: gathering the output would
                    // interleave the ranks' chunks instead of rebuilding the parts.
                    return Err(format!(
                        "a fused colwise layer's output must stay feature-sharded (each rank \
                         holds its chunk of each of the {parts} parts; a gathered or \
                         sequence-sharded output would interleave the ranks' chunks): use \
                         colwise_fused({parts}) with a rowwise layer after the split, or split \
                         the fused layer into separate layers with colwise_gathered"
                    ));
                }
            }
            Self::Rowwise { input, output } => {
                if matches!(input, Layout::SequenceSharded { .. }) {
                    return Err(
                        "a rowwise layer needs a feature-sharded or replicated input".into(),
                    );
                }
                if output == Layout::Sharded {
                    return Err("a rowwise layer's output is replicated or sequence-sharded".into());
                }
            }
            Self::Sequence { .. } => {}
        }
        Ok(())
    }

    /// Whether this style leaves replicated parameters with partial gradients (their
    /// forward sees only this rank's tokens).
    pub(crate) fn sequence_sharded_output(&self) -> bool {
        matches!(
            self,
            Self::Rowwise {
                output: Layout::SequenceSharded { .. },
                ..
            } | Self::Sequence { .. }
        )
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Layout::Replicated => write!(f, "Replicated"),
            Layout::Sharded => write!(f, "Sharded(-1)"),
            Layout::SequenceSharded { dim } => write!(f, "Sharded({dim})"),
        }
    }
}

impl fmt::Display for ParallelStyle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Colwise { input, output } => write!(f, "Colwise({input} -> {output})"),
            Self::ColwiseFused {
                parts,
                input,
                output,
            } => write!(f, "ColwiseFused({parts} parts, {input} -> {output})"),
            Self::Rowwise { input, output } => write!(f, "Rowwise({input} -> {output})"),
            Self::Sequence { dim } => write!(f, "SequenceParallel(dim {dim})"),
        }
    }
}

#[cfg(test)]
mod by_name_tests {
    use super::ParallelStyle;

    #[test]
    fn every_name_of_the_table_has_a_constructor() {
        for style in burn_parallel_styles::STYLES {
            let text = match style.arg {
                burn_parallel_styles::StyleArg::Parts => format!("{}(2)", style.name),
                _ => style.name.to_string(),
            };
            assert!(ParallelStyle::by_name(&text).is_ok(), "{text}");
        }
        assert_eq!(
            ParallelStyle::by_name("colwise_sp").unwrap(),
            ParallelStyle::colwise_sp(1)
        );
        assert_eq!(
            ParallelStyle::by_name("colwise_fused(3)").unwrap(),
            ParallelStyle::colwise_fused(3)
        );
    }
}
