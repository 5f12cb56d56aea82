//! Step time of the parallel strategies against one device, in the same run, on ndarray:
//! - TP: forward+backward of an MLP block (colwise then rowwise) at tp 2 vs the same block
//!   on one rank.
//! - FSDP: a training step (forward, backward, AdamW) of a 4-layer MLP on 1, 2 and 4 ranks vs
//!   single-device training on the same global batch, with each rank's peak model-state bytes
//!   (parameters + gathered weights + gradients + AdamW state, from `fsdp::memory`) against
//!   the single-device peak.
//!
//! Run: cargo bench --bench strategies
//!
//! Ranks are threads sharing this machine's cores (ndarray computes each rank on one thread),
//! so a ratio below 1 is the work spread over cores; above 1 is the strategy's overhead.
//! Model-state bytes follow `fsdp::memory`'s accounting (what FSDP gathers and reduces, and the
//! parameters and optimizer state the loop reports), not the allocator; activations are not
//! counted. Without gradient checkpointing Burn keeps every gathered unit until backward;
//! reshard-after-forward (on a checkpointing device) frees each after its forward.

use std::time::{Duration, Instant};

use burn::module::{Module, Param};
use burn::nn::Linear;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Tensor, TensorData};
use burn_parallel::comm::launch;
use burn_parallel::fsdp::memory::{
    ADAMW_MOMENTS, MemoryTracker, grad_bytes, optimizer_state_bytes, param_bytes,
};
use burn_parallel::fsdp::{FsdpConfig, forward_units, fully_shard};
use burn_parallel::tp::{ParallelStyle, Tp};

const TOKENS: usize = 512;
const MODEL: usize = 256;
const HIDDEN: usize = 1024;
const REPEATS: usize = 5;

#[allow(deprecated)]
fn device() -> Device {
    Device::ndarray().autodiff()
}

fn data(seed: u64, shape: [usize; 2], device: &Device) -> Tensor<2> {
    let n = shape[0] * shape[1];
    let values: Vec<f32> = (0..n)
        .map(|i| ((i as u64 * 2_654_435_761 + seed * 97) % 2001) as f32 / 1000.0 - 1.0)
        .map(|v| v * 0.05)
        .collect();
    Tensor::from_data(TensorData::new(values, shape), device)
}

fn linear(seed: u64, d_in: usize, d_out: usize, device: &Device) -> Linear {
    Linear {
        weight: Param::from_tensor(data(seed, [d_in, d_out], device)),
        bias: Some(Param::from_tensor(
            data(seed + 1, [1, d_out], device).reshape([d_out]),
        )),
    }
}

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Forward+backward of the block; `up`/`down` may be tensor-parallel.
fn block_step(up: &Tp<Linear>, down: &Tp<Linear>, device: &Device) -> Duration {
    let x = data(7, [TOKENS, MODEL], device).require_grad();
    let started = Instant::now();
    let y = down.forward(up.forward(x).tanh());
    let grads = y.sum().backward();
    std::hint::black_box(grads);
    started.elapsed()
}

fn tp_block(tp: usize) -> Duration {
    let times = launch(tp, |ctx| {
        let group = ctx.world()?;
        let device = device();
        let (mut up, mut down) = (
            Tp::new(linear(1, MODEL, HIDDEN, &device)),
            Tp::new(linear(3, HIDDEN, MODEL, &device)),
        );
        if tp > 1 {
            up = up.parallelize(ParallelStyle::colwise(), &group, "up")?;
            down = down.parallelize(ParallelStyle::rowwise(), &group, "down")?;
        }
        let mut times = Vec::new();
        for _ in 0..REPEATS {
            group.barrier()?;
            times.push(block_step(&up, &down, &device));
        }
        Ok::<_, Box<dyn std::error::Error>>(times)
    })
    .expect("tp launch");
    median(times[0].clone())
}

#[derive(Module, Debug)]
struct Mlp {
    layers: Vec<Linear>,
}

impl Mlp {
    fn new(device: &Device) -> Self {
        let dims = [MODEL, HIDDEN, HIDDEN, HIDDEN, MODEL];
        let layers = dims
            .windows(2)
            .enumerate()
            .map(|(i, w)| linear(10 + 2 * i as u64, w[0], w[1], device))
            .collect();
        Self { layers }
    }

    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.layers.iter().fold(x, |x, l| layer_forward(l, x))
    }
}

fn layer_forward(layer: &Linear, x: Tensor<2>) -> Tensor<2> {
    layer.forward(x).tanh()
}

/// How FSDP runs the layers.
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    /// Every parameter gathered by itself.
    PerParam,
    /// Each layer one unit (one gather), with forward prefetch.
    Units,
    /// Units with prefetch, resharded after forward (on a gradient-checkpointing device).
    UnitsReshard,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::PerParam => "per-parameter gathers",
            Mode::Units => "layer units + prefetch",
            Mode::UnitsReshard => "units + prefetch + reshard",
        }
    }
}

/// (median step time, peak model-state bytes of rank 0) of a training step (forward,
/// backward, AdamW) on `world` ranks, each with `TOKENS / world` rows; `world == 0` is single
/// device.
fn fsdp_step(world: usize, mode: Mode) -> (Duration, usize) {
    let ranks = world.max(1);
    let out = launch(ranks, |ctx| {
        let group = ctx.world()?;
        let device = if mode == Mode::UnitsReshard {
            device().gradient_checkpointing()
        } else {
            device()
        };
        let config = FsdpConfig::new(group.clone());
        let memory: MemoryTracker = config.memory().clone();
        let model = Mlp::new(&device);
        let mut model = if world == 0 {
            model
        } else {
            fully_shard(model, &config)?
        };
        memory.set_params(param_bytes(&model));
        let mut optim = AdamWConfig::new().init();
        let rows = TOKENS / ranks;
        let mut times = Vec::new();
        for _ in 0..REPEATS {
            group.barrier()?;
            let x = data(5 + ctx.rank() as u64, [rows, MODEL], &device);
            let started = Instant::now();
            let out = if world > 0 && mode != Mode::PerParam {
                forward_units(&model.layers, x, layer_forward)
            } else {
                model.forward(x)
            };
            let loss = out.powi_scalar(2).mean();
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            if world == 0 {
                // FSDP counts the gradients its reduce-scatters hand out; one device reports them.
                memory.set_grads(grad_bytes(&model, &grads));
            }
            model = optim.step(1e-3, model, grads);
            memory.set_optimizer(optimizer_state_bytes(&model, ADAMW_MOMENTS));
            memory.release_grads();
            times.push(started.elapsed());
        }
        Ok::<_, Box<dyn std::error::Error>>((median(times), memory.peak_model_state_bytes()))
    })
    .expect("fsdp launch");
    out[0]
}

fn main() {
    println!(
        "TP MLP block [{TOKENS} x {MODEL}] -> {HIDDEN} -> {MODEL}, forward+backward, median of {REPEATS}"
    );
    let one = tp_block(1);
    let two = tp_block(2);
    println!("  one rank: {:>8.1} ms", ms(one));
    println!(
        "  tp = 2:   {:>8.1} ms   ratio {:.2}",
        ms(two),
        ms(two) / ms(one)
    );

    println!(
        "FSDP 4-layer MLP ({MODEL}-{HIDDEN}-{HIDDEN}-{HIDDEN}-{MODEL}), training step (AdamW) on a {TOKENS}-row global batch"
    );
    let (single, single_bytes) = fsdp_step(0, Mode::PerParam);
    println!(
        "  single device: {:>8.1} ms   {:>10} peak model-state bytes",
        ms(single),
        single_bytes
    );
    for mode in [Mode::PerParam, Mode::Units, Mode::UnitsReshard] {
        for world in [1, 2, 4] {
            let (t, bytes) = fsdp_step(world, mode);
            println!(
                "  fsdp {world} rank(s), {:<27} {:>6.1} ms (ratio {:.2})   {:>10} peak bytes per rank (ratio {:.3})",
                format!("{}:", mode.name()),
                ms(t),
                ms(t) / ms(single),
                bytes,
                bytes as f64 / single_bytes as f64
            );
        }
    }
}
