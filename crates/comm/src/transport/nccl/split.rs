//! Which `ncclCommSplit` call makes a rank's communicator for one group.
//!
//! `ncclCommSplit` is collective over the parent communicator: every rank of the parent calls
//! it, and ranks passing the same `color` end up in one new communicator, ordered by `key`.
//! A mesh axis partitions the world into disjoint groups (the `tp` groups, the `dp` groups, ...),
//! and every rank asks for its own group along that axis at the same point of mesh
//! construction, so one split per axis builds all of that axis's communicators at once.
//!
//! The color of a group is its smallest global rank (unique among disjoint groups, the same on
//! every member, never negative) and the key is the rank's position in the group, so the new
//! communicator's rank order is the group order.

#[cfg(test)]
use crate::transport::error::MeshError;
#[cfg(test)]
use crate::transport::mesh::MeshShape;

/// The arguments of one rank's `ncclCommSplit` call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SplitKey {
    /// Ranks passing the same color join one communicator: the group's smallest global rank.
    pub color: i32,
    /// The rank's order in the new communicator: its position in the group.
    pub key: i32,
}

/// Why a group cannot be made by a split.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SplitError {
    /// The rank asking is not in the group.
    #[error("rank {rank} is not a member of group {ranks:?}")]
    NotAMember {
        /// The rank asking.
        rank: usize,
        /// The group's global ranks.
        ranks: Vec<usize>,
    },
    /// A rank or position in the group does not fit NCCL's `i32` ranks.
    #[error("group {ranks:?} does not fit NCCL's 32-bit ranks")]
    TooLarge {
        /// The group's global ranks.
        ranks: Vec<usize>,
    },
}

/// The split arguments with which `rank` joins the group of global `ranks` (in group order).
pub fn split_key(rank: usize, ranks: &[usize]) -> Result<SplitKey, SplitError> {
    let position = ranks
        .iter()
        .position(|r| *r == rank)
        .ok_or_else(|| SplitError::NotAMember {
            rank,
            ranks: ranks.to_vec(),
        })?;
    let smallest = *ranks.iter().min().expect("a member was found");
    let too_large = || SplitError::TooLarge {
        ranks: ranks.to_vec(),
    };
    Ok(SplitKey {
        color: i32::try_from(smallest).map_err(|_| too_large())?,
        key: i32::try_from(position).map_err(|_| too_large())?,
    })
}

/// The split arguments with which `rank` joins its group along the mesh dimensions `dims` (one
/// axis, or several flattened together), in the mesh's group order: how the tests check that
/// splits reproduce a mesh's groups.
#[cfg(test)]
fn mesh_split_key(shape: &MeshShape, rank: usize, dims: &[&str]) -> Result<SplitKey, MeshError> {
    let ranks = shape.group_ranks(rank, dims)?;
    split_key(rank, &ranks).map_err(|e| MeshError::BadFlatten {
        names: dims.iter().map(|d| d.to_string()).collect(),
        name: "nccl split".into(),
        reason: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    /// What NCCL does with the split arguments of every rank: groups by color, orders by key
    /// (then by parent rank).
    fn simulate(keys: &[SplitKey]) -> BTreeMap<i32, Vec<usize>> {
        let mut groups: BTreeMap<i32, Vec<(i32, usize)>> = BTreeMap::new();
        for (rank, k) in keys.iter().enumerate() {
            groups.entry(k.color).or_default().push((k.key, rank));
        }
        groups
            .into_iter()
            .map(|(c, mut members)| {
                members.sort();
                (c, members.into_iter().map(|(_, r)| r).collect())
            })
            .collect()
    }

    #[test]
    fn every_axis_split_reproduces_the_mesh_groups() {
        let shapes = [
            vec![("dp", 2), ("tp", 4)],
            vec![("dp_replicate", 2), ("dp_shard", 3), ("tp", 2)],
            vec![("pp", 1), ("dp", 5)],
            vec![("a", 3), ("b", 1), ("c", 2), ("d", 2)],
        ];
        for dims in shapes {
            let shape = MeshShape::new(&dims).unwrap();
            let names: Vec<&str> = shape.names().collect();
            // Single axes and every pair flattened together.
            let mut selections: Vec<Vec<&str>> = names.iter().map(|n| vec![*n]).collect();
            for i in 0..names.len() {
                for j in i + 1..names.len() {
                    selections.push(vec![names[i], names[j]]);
                }
            }
            for sel in selections {
                let keys: Vec<SplitKey> = (0..shape.size())
                    .map(|r| mesh_split_key(&shape, r, &sel).unwrap())
                    .collect();
                let groups = simulate(&keys);
                for rank in 0..shape.size() {
                    let expected = shape.group_ranks(rank, &sel).unwrap();
                    let got = &groups[&keys[rank].color];
                    assert_eq!(got, &expected, "{shape} along {sel:?}, rank {rank}");
                    assert_eq!(expected[keys[rank].key as usize], rank);
                }
                let group_count: usize = shape.size()
                    / sel
                        .iter()
                        .map(|n| shape.dim_size(n).unwrap())
                        .product::<usize>();
                assert_eq!(groups.len(), group_count, "{shape} along {sel:?}");
            }
        }
    }

    #[test]
    fn group_order_is_kept_even_when_not_sorted() {
        let ranks = [5, 1, 3];
        let keys: Vec<SplitKey> = ranks
            .iter()
            .map(|r| split_key(*r, &ranks).unwrap())
            .collect();
        assert!(keys.iter().all(|k| k.color == 1));
        assert_eq!(
            keys.iter().map(|k| k.key).collect::<Vec<_>>(),
            vec![0, 1, 2]
        );
    }

    #[test]
    fn non_members_and_huge_ranks_are_errors() {
        assert_eq!(
            split_key(2, &[0, 1]),
            Err(SplitError::NotAMember {
                rank: 2,
                ranks: vec![0, 1]
            })
        );
        let big = i32::MAX as usize + 1;
        assert!(matches!(
            split_key(big, &[big]),
            Err(SplitError::TooLarge { .. })
        ));
        let shape = MeshShape::new(&[("dp", 2)]).unwrap();
        assert!(mesh_split_key(&shape, 0, &["tp"]).is_err());
    }
}
