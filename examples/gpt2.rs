//! A GPT-2-style decoder, written with the public API only, trained under every strategy of
//! `examples/configs/*.toml` and compared with the single-device run of `single.toml`: the
//! losses of every step and the whole trained model (every shard gathered back) must agree to
//! float round-off, or the program fails. Then every config saves a sharded checkpoint
//! halfway (model and SGD momentum) and the next config in the list resumes it in its own
//! layout: the resumed runs must match one device too.
//!
//! The model is plain Burn (learned positions, LayerNorm with bias, q/k/v/o with biases, GELU
//! MLP, untied head) plus its parallelism: `#[parallelize]` on each struct, `#[tp(..)]` styles on
//! the `Tp` layers, `#[nested]` and `#[fsdp(unit)]` on the layer stack, and two calls in forward
//! (`forward_shared` for q/k/v, `forward_units` for the blocks).
//!
//! ```text
//! cargo run --release --example gpt2 -- --steps 6 --vocab 509
//! ```

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::nn::{Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::optim::SgdConfig;
use burn::optim::momentum::MomentumConfig;
use burn::tensor::activation::{gelu, softmax};
use burn::tensor::{Bool, Device, Int, Tensor, TensorData};
use burn_parallel::checkpoint::{self, BurnOptimizer, Checkpoint, TrainingProgress};
use burn_parallel::prelude::*;
use clap::Parser;

#[parallelize]
#[derive(Module, Debug)]
struct Attention {
    #[tp(colwise)]
    q: Tp<Linear>,
    #[tp(colwise)]
    k: Tp<Linear>,
    #[tp(colwise)]
    v: Tp<Linear>,
    #[tp(rowwise)]
    o: Tp<Linear>,
    #[module(skip)]
    #[tp(heads)]
    heads: usize,
}

#[parallelize]
#[derive(Module, Debug)]
struct Mlp {
    #[tp(colwise)]
    fc: Tp<Linear>,
    #[tp(rowwise)]
    proj: Tp<Linear>,
}

#[parallelize]
#[derive(Module, Debug)]
struct Block {
    ln_1: LayerNorm,
    #[nested]
    attn: Attention,
    ln_2: LayerNorm,
    #[nested]
    mlp: Mlp,
}

#[parallelize]
#[derive(Module, Debug)]
struct Gpt2 {
    #[tp(vocab_parallel)]
    wte: Tp<Embedding>,
    wpe: Embedding,
    #[nested]
    #[fsdp(unit)]
    h: Vec<Block>,
    ln_f: LayerNorm,
    #[tp(colwise)]
    lm_head: Tp<Linear>,
}

/// The model's sizes.
#[derive(Debug, Clone, Copy)]
struct Gpt2Config {
    vocab: usize,
    positions: usize,
    d_model: usize,
    heads: usize,
    layers: usize,
}

impl Gpt2 {
    fn new(c: &Gpt2Config, device: &Device) -> Self {
        let linear = |i, o| Tp::new(LinearConfig::new(i, o).init(device));
        let norm = || LayerNormConfig::new(c.d_model).init(device);
        let block = |_| Block {
            ln_1: norm(),
            attn: Attention {
                q: linear(c.d_model, c.d_model),
                k: linear(c.d_model, c.d_model),
                v: linear(c.d_model, c.d_model),
                o: linear(c.d_model, c.d_model),
                heads: c.heads,
            },
            ln_2: norm(),
            mlp: Mlp {
                fc: linear(c.d_model, 4 * c.d_model),
                proj: linear(4 * c.d_model, c.d_model),
            },
        };
        Self {
            wte: Tp::new(EmbeddingConfig::new(c.vocab, c.d_model).init(device)),
            wpe: EmbeddingConfig::new(c.positions, c.d_model).init(device),
            h: (0..c.layers).map(block).collect(),
            ln_f: norm(),
            lm_head: linear(c.d_model, c.vocab),
        }
    }

    /// Logits `[batch, seq, vocab]` (this rank's vocab chunk under tensor parallelism).
    fn forward(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        // Under FSDP, the parameters outside the blocks (embeddings, final norm, head) are
        // gathered once, together, for the whole forward.
        let body = || {
            let [_, seq] = ids.dims();
            let positions = Tensor::<1, Int>::arange(0..seq as i64, &ids.device()).unsqueeze();
            let x = self.wte.forward(ids.clone()) + self.wpe.forward(positions);
            let x = forward_units(&self.h, x, |block, x| block.forward(x));
            self.lm_head.forward(self.ln_f.forward(x))
        };
        with_module_unit(self, body)
    }
}

impl Block {
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let x = x.clone() + self.attn.forward(self.ln_1.forward(x));
        x.clone() + self.mlp.forward(self.ln_2.forward(x))
    }
}

impl Mlp {
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        self.proj.forward(gelu(self.fc.forward(x)))
    }
}

impl Attention {
    /// Causal self-attention over this rank's heads (all of them without tensor parallelism).
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let [q, k, v] = forward_shared(x, [&self.q, &self.k, &self.v]);
        let [b, t, d] = q.dims();
        let hd = d / self.heads;
        let split = |x: Tensor<3>| x.reshape([b, t, self.heads, hd]).swap_dims(1, 2);
        let (q, k, v) = (split(q), split(k), split(v));
        let scores = q.matmul(k.swap_dims(2, 3)) / (hd as f64).sqrt();
        let later = Tensor::<2, Bool>::tril_mask([t, t], 0, &scores.device());
        let scores = scores.mask_fill(later.unsqueeze::<4>(), f32::NEG_INFINITY);
        let y = softmax(scores, 3)
            .matmul(v)
            .swap_dims(1, 2)
            .reshape([b, t, d]);
        self.o.forward(y)
    }
}

#[derive(Parser, Debug)]
#[command(about = "Train a GPT-2-style model under every config and compare with one device")]
struct Args {
    /// Training steps per config.
    #[arg(long, default_value_t = 4)]
    steps: usize,
    /// Vocabulary size (509 divides by no world size).
    #[arg(long, default_value_t = 509)]
    vocab: usize,
    /// Folder of DistributedConfig files; `single.toml` there is the reference.
    #[arg(long, default_value = "examples/configs")]
    configs: PathBuf,
    /// Where the halfway checkpoints go (removed at the end); default: the system's temp dir.
    #[arg(long)]
    save_dir: Option<PathBuf>,
}

const BATCH: usize = 6;
const SEQ: usize = 12;
const LR: f64 = 0.1;

/// Rows `rows` of step `step`'s token batch: ids `[rows, SEQ]` and next-token targets.
fn batch(
    step: usize,
    rows: std::ops::Range<usize>,
    vocab: usize,
    device: &Device,
) -> (Tensor<2, Int>, Tensor<1, Int>) {
    let token = |row: usize, pos: usize| ((step * 7919 + row * 104_729 + pos * 31) % vocab) as i64;
    let n = rows.len();
    let ids: Vec<i64> = rows
        .clone()
        .flat_map(|r| (0..SEQ).map(move |p| token(r, p)))
        .collect();
    let targets: Vec<i64> = rows
        .flat_map(|r| (1..=SEQ).map(move |p| token(r, p)))
        .collect();
    (
        Tensor::from_data(TensorData::new(ids, [n, SEQ]), device),
        Tensor::from_data(TensorData::new(targets, [n * SEQ]), device),
    )
}

/// One config's run: the loss of every step and the whole trained model by path.
type Run = (Vec<f32>, BTreeMap<String, TensorData>);

/// What one run trains: its steps, the checkpoint it resumes from and the one it saves at its
/// end.
struct Leg<'a> {
    steps: Range<usize>,
    resume: Option<&'a Path>,
    save: Option<&'a Path>,
}

/// Trains `leg` under `config` (every rank starts from `init`, one record built once, or from
/// the checkpoint it resumes) and returns rank 0's losses and the whole trained model.
fn train(
    config: &DistributedConfig,
    model: &Gpt2Config,
    init: &burn::store::ModuleRecord,
    leg: &Leg,
) -> Result<Run, Box<dyn std::error::Error>> {
    let world = config.world_size.unwrap_or(1);
    let runs = run_ranks(world, |rank| {
        let device = Device::flex().autodiff();
        let ctx = MeshContext::new(&rank, config.clone(), device.clone())?;
        let gpt2 = Gpt2::new(model, &device).load_record(init.clone());
        let mut gpt2 = parallelize_model(gpt2, &ctx)?;
        let mut optim = SgdConfig::new()
            .with_momentum(Some(MomentumConfig::new()))
            .init();
        if let Some(dir) = leg.resume {
            // Any layout loads any other's checkpoint: each rank reads only its regions.
            let mut state = BurnOptimizer::new(&mut optim, &gpt2)?;
            gpt2 = Checkpoint::open(dir)?
                .load(gpt2, Some(&mut state), &ctx, &Default::default())?
                .0;
        }
        let rows = ctx.local_rows(BATCH);
        let mut losses = Vec::new();
        for step in leg.steps.clone() {
            let (ids, targets) = batch(step, rows.rows.clone(), model.vocab, &device);
            let logits = gpt2.forward(ids);
            let [b, t, v] = logits.dims();
            let loss = loss_parallel(
                logits.reshape([b * t, v]),
                targets,
                ctx.tp_group(),
                model.vocab,
            )?;
            let (next, report) = Step::new(&ctx, &rows).clip(1.0).run(
                gpt2,
                loss,
                OptimizerStep::new(&mut optim, LR),
            )?;
            gpt2 = next;
            losses.push(report.loss);
        }
        if let Some(dir) = leg.save {
            let state = BurnOptimizer::new(&mut optim, &gpt2)?;
            let end = leg.steps.end;
            let progress = TrainingProgress {
                step: end as u64,
                data_position: (end * BATCH) as u64,
                ..Default::default()
            };
            checkpoint::save(
                dir,
                &gpt2,
                Some(&state),
                &progress,
                &ctx,
                &Default::default(),
            )?;
        }
        let state = full_state_dict(gpt2)?;
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>((losses, state))
    })
    .map_err(|e| e.to_string())?;
    Ok(runs.into_iter().next().expect("rank 0 ran").1)
}

/// The largest relative difference between two lists of values.
fn max_rel(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / y.abs().max(1e-3))
        .fold(0.0, f32::max)
}

/// How far `run` is from the reference run: losses and weights, each the largest relative
/// difference.
fn differences(run: &Run, reference: &Run) -> Result<(f32, f32), String> {
    let (losses, state) = run;
    let (want_losses, want_state) = reference;
    let weights = state
        .iter()
        .map(|(path, data)| {
            let want = want_state
                .get(path)
                .ok_or(format!("no {path} in the single-device model"))?;
            let [got, want] = [data, want].map(|d| d.try_to_vec::<f32>().unwrap_or_default());
            Ok(max_rel(&got, &want))
        })
        .collect::<Result<Vec<f32>, String>>()?;
    Ok((
        max_rel(losses, want_losses),
        weights.into_iter().fold(0.0, f32::max),
    ))
}

fn configs(dir: &Path) -> Result<Vec<(String, DistributedConfig)>, Box<dyn std::error::Error>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()?;
    files.retain(|p| p.extension().is_some_and(|e| e == "toml"));
    files.sort();
    files
        .into_iter()
        .map(|p| {
            let name = p
                .file_stem()
                .unwrap_or_default()
                .to_string_lossy()
                .to_string();
            Ok((name, DistributedConfig::from_file(&p)?))
        })
        .collect()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let model = Gpt2Config {
        vocab: args.vocab,
        positions: SEQ,
        d_model: 16,
        heads: 4,
        layers: 2,
    };
    // One initial model for every rank of every run: Burn's random init seeded once, here.
    let host = Device::flex();
    host.seed(2);
    let init = Gpt2::new(&model, &host).into_record();
    let configs = configs(&args.configs)?;
    let (_, single) = configs
        .iter()
        .find(|(name, _)| name == "single")
        .ok_or("the configs folder has no single.toml (the reference)")?;
    let whole = Leg {
        steps: 0..args.steps,
        resume: None,
        save: None,
    };
    let reference = train(single, &model, &init, &whole)?;
    let width = configs
        .iter()
        .map(|(n, _)| n.len())
        .max()
        .unwrap_or(0)
        .max(6);
    println!(
        "{:<width$} {:>5} {:>10} {:>14} {:>14}",
        "config", "ranks", "last loss", "loss vs single", "weights vs single"
    );
    let mut worst = 0.0f32;
    for (name, config) in &configs {
        let run = train(config, &model, &init, &whole)?;
        let (loss_diff, weight_diff) =
            differences(&run, &reference).map_err(|e| format!("{name}: {e}"))?;
        worst = worst.max(loss_diff).max(weight_diff);
        println!(
            "{name:<width$} {:>5} {:>10.5} {loss_diff:>14.2e} {weight_diff:>14.2e}",
            config.world_size.unwrap_or(1),
            run.0.last().copied().unwrap_or(f32::NAN),
        );
    }

    // Halfway checkpoints: saved under one config, resumed under the next one's layout.
    let save_dir = args.save_dir.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!("gpt2-checkpoints-{}", std::process::id()))
    });
    let half = args.steps / 2;
    let pair_width = 2 * width + 4;
    println!(
        "\n{:<pair_width$} {:>14} {:>14}",
        "saved -> resumed", "loss vs single", "weights vs single"
    );
    for (i, (saved_name, saved_config)) in configs.iter().enumerate() {
        let (resumed_name, resumed_config) = &configs[(i + 1) % configs.len()];
        let dir = checkpoint::step_dir(&save_dir.join(saved_name), half as u64);
        let first = Leg {
            steps: 0..half,
            resume: None,
            save: Some(&dir),
        };
        let rest = Leg {
            steps: half..args.steps,
            resume: Some(&dir),
            save: None,
        };
        let (mut losses, _) = train(saved_config, &model, &init, &first)?;
        let (rest_losses, state) = train(resumed_config, &model, &init, &rest)?;
        losses.extend(rest_losses);
        let pair = format!("{saved_name} -> {resumed_name}");
        let (loss_diff, weight_diff) =
            differences(&(losses, state), &reference).map_err(|e| format!("{pair}: {e}"))?;
        worst = worst.max(loss_diff).max(weight_diff);
        println!("{pair:<pair_width$} {loss_diff:>14.2e} {weight_diff:>14.2e}");
    }
    std::fs::remove_dir_all(&save_dir).map_err(|e| format!("{}: {e}", save_dir.display()))?;
    if worst > 1e-5 {
        return Err(format!("a run differs from one device by {worst:.2e} (> 1e-5)").into());
    }
    println!(
        "every strategy, and every resume in another layout, matches one device to {worst:.1e} \
         (vocab {})",
        model.vocab
    );
    Ok(())
}
