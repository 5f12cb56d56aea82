//! The shortest complete program: a model, a config, a launch, training, a saved model. The
//! README shows it (a test checks that every line there is here, in order).
//!
//! ```text
//! cargo run --release --example quickstart
//! ```

use burn::module::Module;
use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
use burn::optim::AdamWConfig;
use burn::tensor::activation::relu;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_parallel::prelude::*;

const VOCAB: usize = 64;
const WIDTH: usize = 32;
const SEQ: usize = 16;

#[parallelize]
#[derive(Module, Debug)]
struct Block {
    #[tp(colwise)]
    up: Tp<Linear>,
    #[tp(rowwise)]
    down: Tp<Linear>,
}

#[parallelize]
#[derive(Module, Debug)]
struct Model {
    #[tp(vocab_parallel)]
    embed: Tp<Embedding>,
    #[nested]
    #[fsdp(unit)]
    blocks: Vec<Block>, // each block one FSDP unit
    #[tp(colwise)]
    head: Tp<Linear>,
}

impl Model {
    fn new(device: &Device) -> Self {
        let linear = |i, o| Tp::new(LinearConfig::new(i, o).init(device));
        let block = |_| Block {
            up: linear(WIDTH, 4 * WIDTH),
            down: linear(4 * WIDTH, WIDTH),
        };
        Self {
            embed: Tp::new(EmbeddingConfig::new(VOCAB, WIDTH).init(device)),
            blocks: (0..2).map(block).collect(),
            head: linear(WIDTH, VOCAB),
        }
    }

    fn forward(&self, ids: Tensor<2, Int>) -> Tensor<2> {
        let x = self.embed.forward(ids);
        let x = forward_units(&self.blocks, x, |b, x| {
            x.clone() + b.down.forward(relu(b.up.forward(x)))
        });
        let logits = self.head.forward(x);
        let [b, t, v] = logits.dims();
        logits.reshape([b * t, v])
    }
}

/// This rank's rows of step `step`: row `r` is the ids `r + step, r + step + 1, ...`, and the
/// model learns to predict the next one.
fn batch(step: usize, rows: &LocalRows, device: &Device) -> (Tensor<2, Int>, Tensor<1, Int>) {
    let token = |r: usize, p: usize| ((r + p + step) % VOCAB) as i64;
    let ids = |offset| -> Vec<i64> {
        let rows = rows.rows.clone();
        rows.flat_map(|r| (0..SEQ).map(move |p| token(r, p + offset)))
            .collect()
    };
    let n = rows.len();
    (
        Tensor::from_data(TensorData::new(ids(0), [n, SEQ]), device),
        Tensor::from_data(TensorData::new(ids(1), [n * SEQ]), device),
    )
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let config = DistributedConfig::from_file("examples/configs/fsdp2_tp.toml")?;
    let init = Model::new(&Device::flex()).into_record(); // one initial model for every rank
    run_ranks(config.world_size.unwrap_or(1), |rank| {
        let device = Device::flex().autodiff();
        let ctx = MeshContext::new(&rank, config.clone(), device.clone())?;
        let mut model = parallelize_model(Model::new(&device).load_record(init.clone()), &ctx)?;
        let mut optimizer = AdamWConfig::new().init();
        let rows = ctx.local_rows(8); // this rank's rows of each 8-row batch
        for step in 0..20 {
            let (inputs, targets) = batch(step, &rows, &device);
            let loss = loss_parallel(model.forward(inputs), targets, ctx.tp_group(), VOCAB)?;
            let update = OptimizerStep::new(&mut optimizer, 1e-2);
            let (next, report) = Step::new(&ctx, &rows).clip(1.0).run(model, loss, update)?;
            model = next;
            if rank.rank() == 0 && step % 5 == 4 {
                println!("step {step:2}: loss {:.4}", report.loss);
            }
        }
        let whole = full_model(model)?; // every shard gathered back: a plain `Model`
        if rank.rank() == 0 {
            whole.save_file(std::env::temp_dir().join("model.bpk"))?;
        }
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    })?;
    Ok(())
}
