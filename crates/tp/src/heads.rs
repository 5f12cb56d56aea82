//! Attention heads under tensor parallelism: each rank runs heads / tp query heads and
//! kv_heads / tp key/value heads, so both must divide the tp size.

use crate::error::TpError;

/// The head counts one rank runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalHeads {
    /// Query heads: `num_heads / tp`.
    pub heads: usize,
    /// Key/value heads: `num_kv_heads / tp`.
    pub kv_heads: usize,
}

/// The per-rank head counts, or an error naming the counts that do not divide `tp`.
pub fn local_heads(heads: usize, kv_heads: usize, tp: usize) -> Result<LocalHeads, TpError> {
    let bad_q = tp == 0 || !heads.is_multiple_of(tp);
    let bad_kv = tp == 0 || !kv_heads.is_multiple_of(tp);
    let which = match (bad_q, bad_kv) {
        (true, true) => "num_heads and num_kv_heads",
        (true, false) => "num_heads",
        (false, true) => "num_kv_heads",
        (false, false) => {
            return Ok(LocalHeads {
                heads: heads / tp,
                kv_heads: kv_heads / tp,
            });
        }
    };
    Err(TpError::HeadsNotDivisible {
        heads,
        kv_heads,
        tp,
        which,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn divisible_heads_split_evenly() {
        assert_eq!(
            local_heads(8, 4, 4).unwrap(),
            LocalHeads {
                heads: 2,
                kv_heads: 1
            }
        );
    }

    #[test]
    fn indivisible_heads_name_the_counts() {
        let msg = local_heads(6, 2, 4).unwrap_err().to_string();
        assert!(msg.contains("num_heads = 6"), "{msg}");
        assert!(msg.contains("num_kv_heads = 2"), "{msg}");
        assert!(msg.contains("tp = 4"), "{msg}");
        assert!(
            msg.contains("num_heads and num_kv_heads not divisible"),
            "{msg}"
        );
        let msg = local_heads(8, 2, 4).unwrap_err().to_string();
        assert!(msg.contains("(num_kv_heads not divisible)"), "{msg}");
    }
}
