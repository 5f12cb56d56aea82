//! FSDP backward prefetch: when a unit's backward starts, the re-gathers of that unit and of
//! the `backward_prefetch_depth` units before it are issued at once, so that they overlap the
//! backward above them. The values are the same bits at every depth; what changes is when the
//! gathers are issued, seen here in the gathered-bytes high-water mark of backward (each
//! unit in flight holds its gathered weights) and in the count of gathers, which must not grow.

use burn_parallel::comm::{OpKind, launch};
use burn_parallel::fsdp::{FsdpConfig, MemoryKind, forward_units, fully_shard};

use crate::common::{flex_ad, tensor, vec_of};
use crate::frozen_reshard::{adapter_grads, lora_stack};

type Failure = Box<dyn std::error::Error + Send + Sync>;

const WIDTH: usize = 12;
const LAYERS: usize = 5;
const ROWS: usize = 3;

/// What one rank saw in one forward and backward.
#[derive(Debug, PartialEq)]
struct Seen {
    loss: Vec<f32>,
    grads: Vec<Vec<f32>>,
    input_grad: Vec<f32>,
    backward_gathers: u64,
    /// The peak of gathered bytes during backward alone.
    backward_gathered_peak: usize,
}

/// The stack sharded per layer over 3 ranks (uneven rows: 12 rows of the base, 2 of `lora_a`),
/// on a gradient-checkpointing device, with backward prefetch `depth`.
fn run(depth: usize) -> Vec<Seen> {
    launch(3, move |ctx| {
        let device = flex_ad().gradient_checkpointing();
        let group = ctx.world()?;
        let config = FsdpConfig::new(group.clone())
            .forward_prefetch_depth(0)
            .backward_prefetch_depth(depth);
        // Each unit's gather trains (the adapter), and its frozen base is rebuilt in backward on
        // its own.
        let layers = lora_stack(&device, LAYERS, WIDTH)
            .layers
            .into_iter()
            .map(|layer| fully_shard(layer, &config))
            .collect::<Result<Vec<_>, _>>()?;
        let x = tensor(9 + group.index() as u64, [ROWS, WIDTH], &device).require_grad();
        let out = forward_units(&layers, x.clone(), |layer, x| layer.forward(x).tanh());
        let loss = out.powi_scalar(2).sum();
        let forward_gathers = group.stats().calls(OpKind::AllGather);
        config.memory().reset_peak();
        let grads = loss.backward();
        let backward_gathered_peak = config.memory().report().peak.get(MemoryKind::Gathered);
        let backward_gathers = group.stats().calls(OpKind::AllGather) - forward_gathers;
        let input_grad = vec_of(&x.grad(&grads).expect("the input is tracked"));
        let grads = adapter_grads(&layers, &grads);
        Ok::<_, Failure>(Seen {
            loss: vec_of(&loss),
            grads,
            input_grad,
            backward_gathers,
            backward_gathered_peak,
        })
    })
    .unwrap()
}

/// Depths 0, 1, 2 and one past the units compute the same bits and gather as often; each
/// extra unit of depth holds more gathered bytes at backward's peak, until every unit before
/// the last is issued at once.
#[test]
fn backward_prefetch_changes_when_units_are_gathered_not_what_is_computed() {
    let runs: Vec<Vec<Seen>> = [0, 1, 2, LAYERS + 1].into_iter().map(run).collect();
    let without = &runs[0];
    for (rank, seen) in without.iter().enumerate() {
        // Each unit's gather (for the adapter) and its base's rebuild (for the input gradient).
        assert_eq!(seen.backward_gathers, 2 * LAYERS as u64, "rank {rank}");
    }
    for (depth, with) in [1, 2, LAYERS + 1].iter().zip(&runs[1..]) {
        for (rank, (w, o)) in with.iter().zip(without).enumerate() {
            assert_eq!(w.loss, o.loss, "depth {depth}, rank {rank}");
            assert_eq!(w.grads, o.grads, "depth {depth}, rank {rank}");
            assert_eq!(w.input_grad, o.input_grad, "depth {depth}, rank {rank}");
            assert_eq!(w.backward_gathers, o.backward_gathers, "depth {depth}");
        }
    }
    let peaks: Vec<usize> = runs.iter().map(|r| r[0].backward_gathered_peak).collect();
    eprintln!(
        "backward gathered peaks by depth 0, 1, 2, {}: {peaks:?}",
        LAYERS + 1
    );
    assert!(
        peaks[0] < peaks[1] && peaks[1] < peaks[2] && peaks[2] < peaks[3],
        "the high-water mark grows with the depth: {peaks:?}"
    );
}
