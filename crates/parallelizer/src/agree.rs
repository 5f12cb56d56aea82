//! Every rank must start from the same weights: FSDP and TP slice a replicated model, so a
//! rank built from another seed would train a different model silently. One all-gather of a
//! fingerprint per parameter finds the first parameter that differs, before any sharding.
//!
//! The fingerprint hashes the parameter's bytes on the host. A float reduction computed on the
//! device would not do: GPU (and CubeCL) reductions are not bit-reproducible from one call to
//! the next, so identical weights could compare unequal.

use burn::module::{Module, Param};
use burn::tensor::{DType, Tensor, TensorData};
use burn_parallel_fsdp::{PathVisitor, visit_with_paths};
use xxhash_rust::xxh3::Xxh3;

use burn_parallel_describe::{ModelDescription, Parallelize};

use crate::context::MeshContext;
use crate::error::ParallelError;

/// A 64-bit hash of a tensor's dtype, shape and bytes as stored (no conversion, so two
/// tensors hash alike exactly when they are the same bytes of the same layout).
pub(crate) fn fingerprint(data: &TensorData) -> u64 {
    let mut hasher = Xxh3::new();
    hasher.update(format!("{:?} {:?}", data.dtype(), data.shape()).as_bytes());
    hasher.update(data.as_bytes());
    hasher.digest()
}

/// Module paths and fingerprints of the initialized float parameters, in module order. Lazy
/// parameters (read from one checkpoint on every rank) are left out.
fn fingerprints<M: Module>(model: &M, skip: &dyn Fn(&str) -> bool) -> (Vec<String>, Vec<u64>) {
    struct Hashes<'a> {
        skip: &'a dyn Fn(&str) -> bool,
        paths: Vec<String>,
        hashes: Vec<u64>,
    }
    impl PathVisitor for Hashes<'_> {
        fn visit_float<const D: usize>(&mut self, path: &str, param: &Param<Tensor<D>>) {
            if !param.is_initialized() || (self.skip)(path) {
                return;
            }
            // One parameter on the host at a time.
            let data = param.val().detach().into_data();
            self.paths.push(path.to_string());
            self.hashes.push(fingerprint(&data));
        }
    }
    let mut hashes = Hashes {
        skip,
        paths: Vec::new(),
        hashes: Vec::new(),
    };
    visit_with_paths(model, &mut hashes);
    (hashes.paths, hashes.hashes)
}

/// The index of the first fingerprint where `theirs` differs from `first`, or where the lists
/// differ in length (a rank holding other parameters).
fn first_difference(first: &[u64], theirs: &[u64]) -> Option<usize> {
    (0..first.len().max(theirs.len())).find(|&i| first.get(i) != theirs.get(i))
}

/// Checks that every rank of the mesh holds the same parameters as rank 0, naming the first
/// parameter and rank that differ. Under expert parallelism the experts are left out: a model
/// loaded for it already holds each rank's own. Collective over the whole mesh.
pub(crate) fn check_replicas_agree<M: Parallelize>(
    model: &M,
    ctx: &MeshContext,
) -> Result<(), ParallelError> {
    let world = ctx.world_group();
    if world.size() == 1 {
        return Ok(());
    }
    let mut description = ModelDescription::default();
    if ctx.expert_groups().is_some() {
        model.describe("", &mut description);
    }
    let (paths, local) = fingerprints(model, &|path| description.is_expert_param(path));
    let bytes: Vec<u8> = local.iter().flat_map(|h| h.to_le_bytes()).collect();
    let len = bytes.len();
    let (all, sizes) =
        world.all_gather_sized(TensorData::from_bytes_vec(bytes, [len], DType::U8), 0)?;
    let mut per_rank = Vec::with_capacity(sizes.len());
    let mut at = 0;
    for size in sizes {
        let words = all.as_bytes()[at..at + size]
            .chunks_exact(8)
            .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")))
            .collect::<Vec<_>>();
        per_rank.push(words);
        at += size;
    }
    let first = &per_rank[0];
    for (rank, theirs) in per_rank.iter().enumerate().skip(1) {
        if let Some(i) = first_difference(first, theirs) {
            let param = paths.get(i).cloned().unwrap_or_else(|| {
                format!("(parameter #{i}: rank {} holds more)", world.ranks()[rank])
            });
            return Err(ParallelError::ReplicasDiffer {
                rank: world.ranks()[rank],
                param,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprints_see_one_bit_dtype_and_shape() {
        let values = vec![1.0f32, -2.5, 3.25, 0.0];
        let base = fingerprint(&TensorData::new(values.clone(), [2, 2]));
        let mut flipped = values.clone();
        flipped[3] = -0.0; // equal as floats, other bytes
        assert_ne!(base, fingerprint(&TensorData::new(flipped, [2, 2])));
        assert_ne!(base, fingerprint(&TensorData::new(values.clone(), [4])));
        let as_f64: Vec<f64> = values.iter().map(|&v| v as f64).collect();
        assert_ne!(base, fingerprint(&TensorData::new(as_f64, [2, 2])));
        assert_eq!(base, fingerprint(&TensorData::new(values, [2, 2])));
    }

    #[test]
    fn a_shorter_list_differs_where_it_ends() {
        assert_eq!(first_difference(&[1, 2, 3], &[1, 2, 3]), None);
        assert_eq!(first_difference(&[1, 2, 3], &[1, 9, 3]), Some(1));
        assert_eq!(first_difference(&[1, 2, 3], &[1, 2]), Some(2));
        assert_eq!(first_difference(&[1, 2], &[1, 2, 5]), Some(2));
    }
}
