//! The offload policy: shards, their gradients and the optimizer step on a host device
//! (ndarray) while gathers and compute run on the compute device (flex); training matches the
//! same run without offload and single-device training.

use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::Device;
use burn_parallel::comm::chunk::chunk_range;
use burn_parallel::comm::{ReduceOp, launch};
use burn_parallel::fsdp::{FsdpConfig, OffloadPolicy, forward_units, fully_shard, gather_full};

use crate::common::{assert_close, flex_ad, ndarray_ad, vec_of};
use crate::fsdp_memory::{BATCH, Stack, input, layer, stack};

const STEPS: usize = 2;
const LR: f64 = 0.05;

fn single_device() -> (Vec<f32>, Vec<f32>) {
    let device = flex_ad();
    let mut model = stack(&device);
    let mut optim = AdamWConfig::new().init();
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let out = model
            .layers
            .iter()
            .fold(input(step, 0..BATCH, &device), |x, l| layer(l, x));
        let loss = out.powi_scalar(2).sum() / BATCH as f32;
        losses.push(vec_of(&loss)[0]);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(LR, model, grads);
    }
    (losses, model.flat())
}

/// One rank's losses, gathered final weights, and each placement check with its outcome.
type RankOutcome = (Vec<f32>, Vec<f32>, Vec<(String, bool)>);

/// Per rank: losses, gathered final weights, and whether every placement check held.
fn sharded(world: usize, offload: bool) -> Vec<RankOutcome> {
    launch(world, |ctx| {
        let (compute, host) = (flex_ad(), ndarray_ad());
        let group = ctx.world()?;
        let mut config = FsdpConfig::new(group.clone());
        if offload {
            config = config.offload(OffloadPolicy::new(host.clone()));
        }
        let stored_on: &Device = if offload { &host } else { &compute };
        let mut model = fully_shard(stack(&compute), &config)?;
        let mut checks = Vec::new();
        let on = |model: &Stack, device: &Device| {
            model.layers.iter().all(|l| {
                l.weight.base().device() == *device
                    && l.bias.as_ref().unwrap().base().device() == *device
            })
        };
        checks.push(("shards after sharding".to_string(), on(&model, stored_on)));
        let rows = chunk_range(BATCH, world, group.index());
        let mut optim = AdamWConfig::new().init();
        let mut losses = Vec::new();
        for step in 0..STEPS {
            let out = forward_units(&model.layers, input(step, rows.clone(), &compute), layer);
            checks.push((format!("step {step}: activations"), out.device() == compute));
            let loss = out.powi_scalar(2).sum() / BATCH as f32;
            let global = group.all_reduce(loss.to_data(), ReduceOp::Sum)?;
            losses.push(global.try_to_vec::<f32>()?[0]);
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            // Every non-empty shard's gradient lands where the shard is stored. (A rank whose
            // shard of a small parameter is empty, as rank 2 of 3 for the 4-row first weight,
            // has no gradient entry for it: nothing to update.)
            for (i, l) in model.layers.iter().enumerate() {
                if l.weight.base().dims()[0] == 0 {
                    continue;
                }
                let grad_device = grads.get::<2>(l.weight.id).map(|g| g.device());
                checks.push((
                    format!("step {step}: layer {i} gradient ({grad_device:?}, offload {offload})"),
                    grad_device.as_ref() == Some(stored_on),
                ));
            }
            model = optim.step(LR, model, grads);
            checks.push((
                format!("step {step}: updated shards"),
                on(&model, stored_on),
            ));
        }
        let full = gather_full(model)?;
        Ok::<_, Box<dyn std::error::Error>>((losses, full.flat(), checks))
    })
    .unwrap()
}

#[test]
fn offloaded_shards_gradients_and_optimizer_step_stay_on_the_host() {
    let (want_losses, want_weights) = single_device();
    for world in [2, 3] {
        let plain = sharded(world, false);
        let offloaded = sharded(world, true);
        for (rank, (run, off)) in plain.iter().zip(&offloaded).enumerate() {
            let ctx = format!("{world} ranks, rank {rank}");
            for (what, held) in run.2.iter().chain(&off.2) {
                assert!(held, "{ctx}: {what} on the expected device");
            }
            assert_close(&run.0, &want_losses, 1e-5, &format!("{ctx}: losses"));
            assert_close(&off.0, &run.0, 1e-5, &format!("{ctx}: offloaded losses"));
            assert_close(&run.1, &want_weights, 1e-5, &format!("{ctx}: weights"));
            assert_close(&off.1, &run.1, 1e-5, &format!("{ctx}: offloaded weights"));
        }
    }
}
