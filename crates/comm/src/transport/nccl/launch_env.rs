//! A process's place in a launch, as the launcher's environment describes it: the rank and
//! world size (`RANK`, `WORLD_SIZE`, as `torchrun` names them, and `LOCAL_RANK` for the GPU),
//! and where the NCCL unique id comes from ([`super::rendezvous`]).

use super::rendezvous::{IdSource, id_source};
use super::unique_id::IdError;

/// One process's place in a launch, as the launcher's environment describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    /// Where the unique id comes from.
    pub source: IdSource,
    /// This process's global rank (`RANK`).
    pub rank: usize,
    /// Number of ranks (`WORLD_SIZE`).
    pub world_size: usize,
    /// The GPU of this process on its node (`LOCAL_RANK`, else `rank`).
    pub local_rank: usize,
}

/// Reads [`LaunchEnv`] through `get` (the process environment in [`LaunchEnv::from_env`]); such
/// a launcher passes the id ([`ID_ENV`](super::unique_id::ID_ENV)) or rank 0's address
/// (`NCCL_COMM_ID`).
pub fn launch_env(get: impl Fn(&str) -> Option<String>) -> Result<LaunchEnv, IdError> {
    let number = |var: &str| -> Result<Option<usize>, IdError> {
        get(var)
            .map(|v| {
                v.trim().parse::<usize>().map_err(|_| IdError::BadNumber {
                    var: var.into(),
                    value: v.clone(),
                })
            })
            .transpose()
    };
    let required = |var: &str| number(var)?.ok_or(IdError::Missing { var: var.into() });
    let rank = required("RANK")?;
    let world_size = required("WORLD_SIZE")?;
    if rank >= world_size {
        return Err(IdError::RankOutOfRange { rank, world_size });
    }
    let local_rank = number("LOCAL_RANK")?.unwrap_or(rank);
    let source = id_source(&get, false)?;
    Ok(LaunchEnv {
        source,
        rank,
        world_size,
        local_rank,
    })
}

impl LaunchEnv {
    /// Reads the launch from this process's environment.
    pub fn from_env() -> Result<Self, IdError> {
        launch_env(|var| std::env::var(var).ok())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::super::unique_id::{ID_ENV, UniqueIdBytes, encode, sample_id};
    use super::*;

    fn sample() -> UniqueIdBytes {
        sample_id()
    }

    #[test]
    fn launch_environment_is_read_and_checked() {
        let hex = encode(&sample());
        let env = |pairs: &[(&str, &str)]| {
            let map: HashMap<String, String> = pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            launch_env(move |k| map.get(k).cloned())
        };
        let ok = env(&[("RANK", "3"), ("WORLD_SIZE", "8"), (ID_ENV, &hex)]).unwrap();
        assert_eq!((ok.rank, ok.world_size, ok.local_rank), (3, 8, 3));
        assert_eq!(ok.source, IdSource::Given(sample()));
        let local = env(&[
            ("RANK", "9"),
            ("WORLD_SIZE", "16"),
            ("LOCAL_RANK", "1"),
            (ID_ENV, &hex),
        ])
        .unwrap();
        assert_eq!(local.local_rank, 1);
        let missing = env(&[("RANK", "0"), ("WORLD_SIZE", "2")]).unwrap_err();
        assert!(
            missing
                .to_string()
                .starts_with("NCCL_COMM_ID (or BURN_PARALLEL_NCCL_ID) is not set")
        );
        assert_eq!(
            env(&[("RANK", "2"), ("WORLD_SIZE", "2"), (ID_ENV, &hex)]).unwrap_err(),
            IdError::RankOutOfRange {
                rank: 2,
                world_size: 2
            }
        );
        assert_eq!(
            env(&[("RANK", "x"), ("WORLD_SIZE", "2")]).unwrap_err(),
            IdError::BadNumber {
                var: "RANK".into(),
                value: "x".into()
            }
        );
    }
}
