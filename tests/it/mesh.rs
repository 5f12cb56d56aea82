//! The device mesh: shapes, coordinates, groups per dimension, flattened dimensions,
//! sub-meshes, and groups of different dimensions working at the same time.

use burn::tensor::TensorData;
use burn_parallel::comm::{DeviceMesh, MeshError, MeshShape, ReduceOp, launch};

use crate::common::to_vec;

#[test]
fn coordinates_are_row_major_with_the_last_dim_fastest() {
    let shape = MeshShape::new(&[("dp", 2), ("tp", 3)]).unwrap();
    assert_eq!(shape.size(), 6);
    assert_eq!(shape.coords(4).unwrap(), vec![1, 1]);
    assert_eq!(shape.rank_of(&[1, 2]), 5);
    for r in 0..6 {
        assert_eq!(shape.rank_of(&shape.coords(r).unwrap()), r);
    }
    assert_eq!(shape.group_ranks(4, &["tp"]).unwrap(), vec![3, 4, 5]);
    assert_eq!(shape.group_ranks(4, &["dp"]).unwrap(), vec![1, 4]);
    assert_eq!(
        shape.group_ranks(4, &["tp", "dp"]).unwrap(),
        vec![0, 1, 2, 3, 4, 5]
    );
}

#[test]
fn invalid_meshes_name_the_problem() {
    let err = |dims: &[(&str, usize)]| MeshShape::new(dims).unwrap_err().to_string();
    assert_eq!(err(&[]), "a device mesh needs at least one dimension");
    assert!(err(&[("dp", 2), ("tp", 0)]).contains("\"tp\" has size 0"));
    assert!(err(&[("tp", 2), ("tp", 2)]).contains("\"tp\" is used twice"));
    assert!(err(&[("t p", 2)]).contains("non-empty identifiers"));
    let shape = MeshShape::new(&[("dp", 2), ("tp", 2)]).unwrap();
    assert!(matches!(
        shape.axis("ep"),
        Err(MeshError::UnknownDim { .. })
    ));
    assert!(
        shape
            .coords(4)
            .unwrap_err()
            .to_string()
            .contains("rank 4 is outside")
    );

    let msgs = launch(3, |ctx| {
        let shape = MeshShape::new(&[("dp_shard", 2), ("tp", 2)]).unwrap();
        Ok::<_, MeshError>(DeviceMesh::new(&ctx, shape).unwrap_err().to_string())
    })
    .unwrap();
    assert_eq!(
        msgs[0],
        "mesh [dp_shard=2 x tp=2] has 4 ranks but the world has 3"
    );
}

#[test]
fn groups_flattened_dims_and_submeshes() {
    let out = launch(8, |ctx| {
        let shape = MeshShape::new(&[("dp_replicate", 2), ("dp_shard", 2), ("tp", 2)])?;
        let mut mesh = DeviceMesh::new(&ctx, shape)?;
        let tp = mesh.group("tp")?.ranks().to_vec();
        let dp_shard = mesh.group("dp_shard")?.ranks().to_vec();
        let dp = mesh
            .flatten(&["dp_replicate", "dp_shard"], "dp")?
            .ranks()
            .to_vec();
        let dup = mesh.flatten(&["tp"], "dp").unwrap_err().to_string();
        let sub = mesh.submesh(&["dp_shard", "tp"])?;
        let sub_ranks = sub.shape().to_string();
        let coords = (
            mesh.coord("dp_replicate")?,
            mesh.coord("dp_shard")?,
            mesh.coord("tp")?,
        );
        let missing = mesh.group("ep").unwrap_err().to_string();
        Ok::<_, MeshError>((
            tp,
            dp_shard,
            dp,
            dup,
            sub_ranks,
            sub.group("tp")?.ranks().to_vec(),
            coords,
            missing,
        ))
    })
    .unwrap();
    let (tp, dp_shard, dp, dup, sub, sub_tp, coords, missing) = &out[5];
    assert_eq!(tp, &vec![4, 5]);
    assert_eq!(dp_shard, &vec![5, 7]);
    assert_eq!(dp, &vec![1, 3, 5, 7]);
    assert!(dup.contains("already names a dimension"), "{dup}");
    assert_eq!(sub, "[dp_shard=2 x tp=2]");
    assert_eq!(sub_tp, &vec![4, 5]);
    assert_eq!(*coords, (1, 0, 1));
    assert!(missing.contains("has no dimension \"ep\""), "{missing}");
}

/// TP and DP groups exchange at the same time, blocking and async, without interfering.
#[test]
fn concurrent_groups_do_not_interfere() {
    let out = launch(6, |ctx| {
        let mesh = DeviceMesh::new(&ctx, MeshShape::new(&[("dp", 2), ("tp", 3)])?)?;
        let (dp, tp) = (mesh.group("dp")?, mesh.group("tp")?);
        let me = ctx.rank() as f32;
        let mut results = Vec::new();
        for step in 0..20 {
            let pending =
                dp.all_reduce_async(TensorData::new(vec![me + step as f32], [1]), ReduceOp::Sum);
            let t = tp.all_gather(TensorData::new(vec![me], [1]), 0)?;
            let d = pending.wait_data()?;
            results.push((to_vec(&d)[0], to_vec(&t)));
        }
        Ok::<_, MeshError>(results)
    })
    .unwrap();
    for (rank, results) in out.iter().enumerate() {
        let (dp_row, tp_row) = (rank / 3, rank % 3);
        let _ = dp_row;
        for (step, (d, t)) in results.iter().enumerate() {
            let peer = if rank < 3 { rank + 3 } else { rank - 3 };
            assert_eq!(*d, (rank + peer) as f32 + 2.0 * step as f32);
            let base = rank - tp_row;
            assert_eq!(t, &vec![base as f32, base as f32 + 1.0, base as f32 + 2.0]);
        }
    }
}

/// Launches in parallel threads of one process share nothing.
#[test]
fn parallel_launches_are_independent() {
    let handles: Vec<_> = (0..4)
        .map(|k| {
            std::thread::spawn(move || {
                launch(3, |ctx| {
                    let world = ctx.world()?;
                    let v =
                        world.all_reduce(TensorData::new(vec![k as f32], [1]), ReduceOp::Sum)?;
                    Ok::<_, burn_parallel::comm::CollectiveError>(to_vec(&v)[0])
                })
                .unwrap()
            })
        })
        .collect();
    for (k, h) in handles.into_iter().enumerate() {
        assert_eq!(h.join().unwrap(), vec![3.0 * k as f32; 3]);
    }
}
