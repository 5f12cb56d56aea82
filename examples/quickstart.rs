//! The shortest complete program: a model, a config, a launch, training, a saved model.
//!
//! ```text
//! cargo run --release --example quickstart -- examples/configs/fsdp2_tp.toml
//! ```

use burn::module::Module;
use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
use burn::optim::AdamWConfig;
use burn::tensor::activation::relu;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_parallel::prelude::*;

const VOCAB: usize = 64;
const WIDTH: usize = 32;

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
    blocks: Vec<Block>,
    #[tp(colwise)]
    head: Tp<Linear>,
}

impl Model {
    fn new(device: &Device) -> Self {
        let linear = |i, o| Tp::new(LinearConfig::new(i, o).init(device));
        Self {
            embed: Tp::new(EmbeddingConfig::new(VOCAB, WIDTH).init(device)),
            blocks: (0..2)
                .map(|_| Block {
                    up: linear(WIDTH, 4 * WIDTH),
                    down: linear(4 * WIDTH, WIDTH),
                })
                .collect(),
            head: linear(WIDTH, VOCAB),
        }
    }

    /// Logits `[tokens, VOCAB]` (this rank's vocab chunk under tensor parallelism).
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

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args()
        .nth(1)
        .unwrap_or("examples/configs/fsdp2.toml".into());
    let config = DistributedConfig::from_file(&path)?;
    let world = config.world_size.unwrap_or(1);
    // One initial model for every rank: built once, loaded by each.
    let init = Model::new(&Device::flex()).into_record();
    run_ranks(world, |rank| {
        let device = Device::flex().autodiff();
        let ctx = MeshContext::new(&rank, config.clone(), device.clone())?;
        let mut model = parallelize_model(Model::new(&device).load_record(init.clone()), &ctx)?;
        let mut optimizer = AdamWConfig::new().init();
        let rows = ctx.local_rows(8);
        for step in 0..20 {
            // Each row is the sequence 0, 1, 2, ... shifted by its index: predict the next id.
            let ids: Vec<i64> = rows
                .rows
                .clone()
                .flat_map(|r| (0..17).map(move |p| ((r + p + step) % VOCAB) as i64))
                .collect();
            let ids = Tensor::<2, Int>::from_data(TensorData::new(ids, [rows.len(), 17]), &device);
            let (inputs, targets) = (
                ids.clone().narrow(1, 0, 16),
                ids.narrow(1, 1, 16).flatten(0, 1),
            );
            let loss = loss_parallel(model.forward(inputs), targets, ctx.tp_group(), VOCAB)?;
            let (next, report) =
                train_step(model, loss, &rows, &mut optimizer, 1e-2, Some(1.0), &ctx)?;
            model = next;
            if rank.rank() == 0 {
                println!(
                    "step {step:2}: loss {:.4}, grad norm {:.3}",
                    report.loss, report.grad_norm
                );
            }
        }
        // The whole model, every shard gathered back, saved with Burn's own record format.
        let whole = full_model(model)?;
        if rank.rank() == 0 {
            let file = std::env::temp_dir().join("quickstart-model.bpk");
            whole.save_file(&file)?;
            println!("saved to {}", file.display());
        }
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    })?;
    Ok(())
}
