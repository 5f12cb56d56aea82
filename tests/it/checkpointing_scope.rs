//! `activation_checkpointing_scope` on a two-part model (a "vision" and a "language" layer
//! stack, declared with `#[parallelize(part = ..)]`): each scope sets the policy of exactly the
//! stacks it names, trains as without checkpointing on one device and under FSDP2 x2 (5 rows
//! over 2 ranks), and a scope naming an undeclared part, a part without a `#[checkpoint]`
//! field, or a part with checkpointing by op is a named error.

use burn::module::Module;
use burn::nn::Linear;
use burn::optim::SgdConfig;
use burn::tensor::{Device, Tensor};
use burn_parallel::comm::checkpoint::LayerCheckpointing;
use burn_parallel::comm::launch;
use burn_parallel::fsdp::{forward_units_checkpointed, with_module_unit};
use burn_parallel::parallelize;
use burn_parallel::parallelizer::{
    DistributedConfig, MeshContext, MixedPrecisionConfig, OptimizerStep, ParallelizableModel, Step,
    Strategy, full_model, parallelize_model,
};

use crate::common::{assert_close, ndarray_ad, tensor};
use crate::parallelize_train::values_of;
use crate::tp_common::linear_on;

const WIDTH: usize = 6;
const ROWS: usize = 5;
const STEPS: usize = 2;
const LR: f64 = 0.1;

#[derive(Module, Debug)]
pub struct Layer {
    fc: Linear,
}

impl Layer {
    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        x.clone() + self.fc.forward(x).tanh()
    }
}

/// A stack of layers that checkpoints them as its `#[checkpoint]` field says.
#[parallelize]
#[derive(Module, Debug)]
pub struct Stack {
    #[fsdp(unit)]
    layers: Vec<Layer>,
    #[module(skip)]
    #[checkpoint]
    checkpointing: LayerCheckpointing,
}

impl Stack {
    fn new(d: &Device, seed: u64, layers: u64) -> Self {
        let layer = |i: u64| Layer {
            fc: linear_on(d, seed + 10 * i, WIDTH, WIDTH),
        };
        Self {
            layers: (0..layers).map(layer).collect(),
            checkpointing: LayerCheckpointing::Off,
        }
    }

    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        forward_units_checkpointed(&self.layers, x, self.checkpointing, |l: &Layer, x| {
            l.forward(x)
        })
    }
}

/// A stack without a `#[checkpoint]` field.
#[parallelize]
#[derive(Module, Debug)]
pub struct PlainStack {
    #[fsdp(unit)]
    layers: Vec<Layer>,
}

#[parallelize]
#[derive(Module, Debug)]
pub struct TwoPart {
    #[nested]
    #[parallelize(part = "vision")]
    vision: Stack,
    #[nested]
    #[parallelize(part = "language")]
    language: Stack,
    head: Linear,
}

impl TwoPart {
    fn new(d: &Device) -> Self {
        Self {
            vision: Stack::new(d, 100, 2),
            language: Stack::new(d, 200, 3),
            head: linear_on(d, 300, WIDTH, 1),
        }
    }

    fn forward(&self, image: Tensor<2>, text: Tensor<2>) -> Tensor<2> {
        with_module_unit(self, || {
            let seen = self.vision.forward(image);
            self.head.forward(self.language.forward(text + seen))
        })
    }

    fn policies(&self) -> [LayerCheckpointing; 2] {
        [self.vision.checkpointing, self.language.checkpointing]
    }
}

/// A model whose vision part has no `#[checkpoint]` field.
#[parallelize]
#[derive(Module, Debug)]
pub struct UncheckpointedPart {
    #[nested]
    #[parallelize(part = "vision")]
    vision: PlainStack,
    #[nested]
    language: Stack,
}

fn config(strategy: Strategy, scope: &str, option: &str) -> DistributedConfig {
    DistributedConfig {
        strategy,
        activation_checkpointing: true,
        activation_checkpointing_mode: "selective".into(),
        selective_ac_option: option.into(),
        activation_checkpointing_scope: scope.into(),
        mp_policy: MixedPrecisionConfig::full_precision(),
        ..DistributedConfig::default()
    }
}

struct Run {
    policies: [LayerCheckpointing; 2],
    losses: Vec<f32>,
    weights: Vec<Vec<f32>>,
}

/// `STEPS` SGD steps of a squared error on `ROWS` rows, each rank on its own.
fn train(world: usize, cfg: DistributedConfig) -> Vec<Run> {
    launch(world, |rank| {
        let ctx = MeshContext::new(&rank, cfg.clone(), ndarray_ad())?;
        let d = ctx.device().clone();
        let mut model = parallelize_model(TwoPart::new(&d), &ctx)?;
        let policies = model.policies();
        let rows = ctx.local_rows(ROWS);
        let mut optim = SgdConfig::new().init();
        let mut losses = Vec::new();
        for step in 0..STEPS as u64 {
            let all = |seed: u64| tensor(seed + step, [ROWS, WIDTH], &d);
            let mine = |t: Tensor<2>| t.slice([rows.rows.clone(), 0..WIDTH]);
            let (image, text) = (mine(all(1)), mine(all(2)));
            let target = mine(tensor(3 + step, [ROWS, 1], &d));
            let loss = (model.forward(image, text) - target).powi_scalar(2).mean();
            let (next, report) =
                Step::new(&ctx, &rows).run(model, loss, OptimizerStep::new(&mut optim, LR))?;
            model = next;
            losses.push(report.loss);
        }
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(Run {
            policies,
            losses,
            weights: values_of(&full_model(model)?),
        })
    })
    .unwrap()
}

#[test]
fn a_scope_checkpoints_its_parts_layers_and_trains_as_without() {
    use LayerCheckpointing::{Every, Off};
    let cases = [
        ("all", [Every(2), Every(2)]),
        ("vision", [Every(2), Off]),
        ("language", [Off, Every(2)]),
        ("none", [Off, Off]),
    ];
    for (strategy, world) in [(Strategy::Single, 1), (Strategy::Fsdp2, 2)] {
        let mut plain = config(strategy, "all", "2");
        plain.activation_checkpointing = false;
        let want = train(world, plain);
        assert_eq!(want[0].policies, [Off, Off]);
        for (scope, policies) in cases {
            let got = train(world, config(strategy, scope, "2"));
            for (rank, (g, w)) in got.iter().zip(&want).enumerate() {
                let what = format!("{strategy} x{world}, scope {scope}, rank {rank}");
                assert_eq!(g.policies, policies, "{what}: policies");
                assert_close(&g.losses, &w.losses, 1e-6, &format!("{what}: losses"));
                for (i, (gw, ww)) in g.weights.iter().zip(&w.weights).enumerate() {
                    assert_close(gw, ww, 1e-6, &format!("{what}: parameter {i}"));
                }
            }
        }
    }
}

fn parallelize_error<M: ParallelizableModel>(
    cfg: DistributedConfig,
    model: impl Fn(&Device) -> M + Sync,
) -> String {
    let errors = launch(1, |rank| {
        let error = MeshContext::new(&rank, cfg.clone(), ndarray_ad())
            .and_then(|ctx| parallelize_model(model(ctx.device()), &ctx))
            .err()
            .map(|e| e.to_string());
        Ok::<_, String>(error)
    })
    .unwrap();
    errors[0].clone().expect("the scope was refused")
}

#[test]
fn a_scope_naming_no_checkpointable_part_is_a_named_error() {
    let single = |scope: &str, option: &str| config(Strategy::Single, scope, option);
    let undeclared = parallelize_error(single("audio", "2"), TwoPart::new);
    assert!(
        undeclared.contains("\"audio\"") && undeclared.contains("language, vision"),
        "{undeclared}"
    );
    let no_parts = parallelize_error(single("language", "1"), |d| Stack::new(d, 1, 2));
    assert!(no_parts.contains("no parts"), "{no_parts}");
    let no_field = parallelize_error(single("vision", "1"), |d| UncheckpointedPart {
        vision: PlainStack {
            layers: Stack::new(d, 1, 2).layers,
        },
        language: Stack::new(d, 2, 2),
    });
    assert!(
        no_field.contains("\"vision\"") && no_field.contains("#[checkpoint]"),
        "{no_field}"
    );
    let by_op = parallelize_error(single("vision", "op"), TwoPart::new);
    assert!(
        by_op.contains("\"vision\"") && by_op.contains("whole model"),
        "{by_op}"
    );
}
