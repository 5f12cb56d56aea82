//! NCCL's 128-byte unique id as bytes and hex, and why an id or the launcher's environment
//! could not be read.
//!
//! Rank 0 creates the id (`ncclGetUniqueId`, whose bootstrap root listens in rank 0's process)
//! and every rank needs the same bytes before it can join the communicator; how they travel
//! without losing the root is [`super::rendezvous`], and a process's place in the launch is
//! [`super::launch_env`].

use std::fmt::Write;

/// Bytes in an NCCL unique id (`NCCL_UNIQUE_ID_BYTES`).
pub const ID_BYTES: usize = 128;

/// The environment variable that carries the hex-encoded id.
pub const ID_ENV: &str = "BURN_PARALLEL_NCCL_ID";

/// A unique id as plain bytes (NCCL declares it as `char[128]`).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct UniqueIdBytes(pub [u8; ID_BYTES]);

impl std::fmt::Debug for UniqueIdBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "UniqueIdBytes({}...)", &encode(self)[..16])
    }
}

/// Why an id or the launcher's environment could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    /// A required variable is not set.
    #[error(
        "{var} is not set: rank 0's process must create the NCCL unique id and stay alive while \
         the ranks join (its bootstrap root listens there). Give every process \
         NCCL_COMM_ID=<rank 0's host>:<free port>, or launch with mpirun and the `mpi` feature \
         (rank 0 broadcasts the id); an id printed by a process that has exited does not work"
    )]
    Missing {
        /// The variable.
        var: String,
    },
    /// Rank 0's id did not reach this rank.
    #[error("NCCL rendezvous: {reason}")]
    Rendezvous {
        /// What went wrong, on rank 0 or in the broadcast.
        reason: String,
    },
    /// The id has the wrong number of hex digits.
    #[error("{var} must hold {expected} hex digits (a {ID_BYTES}-byte NCCL unique id), got {got}")]
    BadLength {
        /// Where the id came from.
        var: String,
        /// Digits an id has.
        expected: usize,
        /// Digits found.
        got: usize,
    },
    /// The id holds a character that is not a hex digit.
    #[error("{var} holds {found:?} at position {position}, which is not a hex digit")]
    BadDigit {
        /// Where the id came from.
        var: String,
        /// The character's index.
        position: usize,
        /// The character.
        found: char,
    },
    /// `RANK`, `WORLD_SIZE` or `LOCAL_RANK` is not a non-negative integer.
    #[error("{var}={value:?} is not a non-negative integer")]
    BadNumber {
        /// The variable.
        var: String,
        /// What it holds.
        value: String,
    },
    /// `RANK` is not below `WORLD_SIZE`.
    #[error("RANK={rank} is outside WORLD_SIZE={world_size}")]
    RankOutOfRange {
        /// `RANK`.
        rank: usize,
        /// `WORLD_SIZE`.
        world_size: usize,
    },
}

/// The id as 256 lowercase hex digits.
pub fn encode(id: &UniqueIdBytes) -> String {
    let mut s = String::with_capacity(2 * ID_BYTES);
    for b in id.0 {
        write!(s, "{b:02x}").expect("writing to a String");
    }
    s
}

/// The id from [`encode`]'s hex digits (either case); `var` names the source in errors.
pub fn decode(hex: &str, var: &str) -> Result<UniqueIdBytes, IdError> {
    let hex = hex.trim();
    if hex.len() != 2 * ID_BYTES {
        return Err(IdError::BadLength {
            var: var.into(),
            expected: 2 * ID_BYTES,
            got: hex.len(),
        });
    }
    let mut out = [0u8; ID_BYTES];
    let digits: Vec<char> = hex.chars().collect();
    for (i, pair) in digits.chunks(2).enumerate() {
        let mut byte = 0u8;
        for (j, c) in pair.iter().enumerate() {
            let v = c.to_digit(16).ok_or_else(|| IdError::BadDigit {
                var: var.into(),
                position: 2 * i + j,
                found: *c,
            })?;
            byte = byte * 16 + v as u8;
        }
        out[i] = byte;
    }
    Ok(UniqueIdBytes(out))
}

/// A fixed id with every byte different, for tests.
#[cfg(test)]
pub(crate) fn sample_id() -> UniqueIdBytes {
    let mut b = [0u8; ID_BYTES];
    for (i, x) in b.iter_mut().enumerate() {
        *x = (i * 37 + 11) as u8;
    }
    UniqueIdBytes(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> UniqueIdBytes {
        sample_id()
    }

    #[test]
    fn ids_round_trip_through_hex() {
        let id = sample();
        let hex = encode(&id);
        assert_eq!(hex.len(), 256);
        assert!(hex.starts_with("0b30"));
        assert_eq!(decode(&hex, "X").unwrap(), id);
        assert_eq!(decode(&hex.to_uppercase(), "X").unwrap(), id);
        assert_eq!(decode(&format!(" {hex}\n"), "X").unwrap(), id);
    }

    #[test]
    fn bad_ids_name_the_problem() {
        let e = decode("abc", ID_ENV).unwrap_err();
        assert_eq!(
            e.to_string(),
            "BURN_PARALLEL_NCCL_ID must hold 256 hex digits (a 128-byte NCCL unique id), got 3"
        );
        let mut hex = encode(&sample());
        hex.replace_range(10..11, "z");
        let e = decode(&hex, ID_ENV).unwrap_err();
        assert_eq!(
            e,
            IdError::BadDigit {
                var: ID_ENV.into(),
                position: 10,
                found: 'z'
            }
        );
    }
}
