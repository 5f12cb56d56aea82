//! The recompute all-gather: under gradient checkpointing the gathered weight is dropped after
//! forward and gathered again in backward (FSDP's reshard-after-forward); without it, one
//! gather. Gradients are identical either way.

use burn::tensor::Device;
use burn_parallel::comm::chunk::chunk_range;
use burn_parallel::comm::collectives as coll;
use burn_parallel::comm::{CollectiveError, OpKind, launch};

use crate::common::{ndarray_ad, tensor, vec_of};

/// Per rank: (all_gather calls, reduce_scatter calls, shard gradient).
fn train_step(device: Device, recompute: bool) -> Vec<(u64, u64, Vec<f32>)> {
    launch(3, |ctx| {
        let group = ctx.world()?;
        let me = group.index();
        let rows = chunk_range(5, 3, me);
        let shard = tensor(1, [5, 4], &device)
            .narrow(0, rows.start, rows.len())
            .require_grad();
        let x = tensor(10 + me as u64, [2, 5], &device);
        let gathered = if recompute {
            coll::all_gather_recompute(shard.clone(), &group, 0)?
        } else {
            coll::all_gather(shard.clone(), &group, 0)?
        };
        // The matmul's backward needs the gathered weight (for the input gradient path).
        let y = x.require_grad().matmul(gathered).tanh();
        let grads = y.sum().backward();
        let stats = group.stats();
        Ok::<_, CollectiveError>((
            stats.calls(OpKind::AllGather),
            stats.calls(OpKind::ReduceScatter),
            vec_of(&shard.grad(&grads).unwrap()),
        ))
    })
    .unwrap()
}

#[test]
fn recompute_gather_runs_twice_under_checkpointing_and_once_without() {
    let plain = train_step(ndarray_ad(), false);
    let kept = train_step(ndarray_ad(), true);
    let checkpointed = train_step(ndarray_ad().gradient_checkpointing(), true);
    for rank in 0..3 {
        assert_eq!((plain[rank].0, plain[rank].1), (1, 1));
        assert_eq!(
            (kept[rank].0, kept[rank].1),
            (1, 1),
            "no checkpointing: kept"
        );
        assert_eq!(
            (checkpointed[rank].0, checkpointed[rank].1),
            (2, 1),
            "checkpointing: gathered again in backward"
        );
        assert_eq!(kept[rank].2, plain[rank].2);
        assert_eq!(checkpointed[rank].2, plain[rank].2);
    }
}
