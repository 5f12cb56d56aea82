//! Runs one step of a schedule on this rank's chunks (its stages): each microbatch's forward
//! and backward in the schedule's order, activations and gradients exchanged with the
//! neighbouring ranks, and the parameter gradients summed over the microbatches.

use std::time::{Duration, Instant};

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::{DType, Device, Gradients, Tensor, TensorData};

use crate::error::PipelineError;
use crate::link::StageLink;
use crate::schedule::{Action, ScheduleKind, actions};
use crate::stage::{PipelineStage, StageOutput};

/// What one step of the schedule leaves on this rank.
pub struct StageGrads {
    /// The parameter gradients of every chunk, summed over the microbatches (not yet
    /// averaged over data-parallel ranks).
    pub grads: Gradients,
    /// On the rank holding the last stage, the sum over microbatches of each one's weighted
    /// loss; 0 elsewhere.
    pub loss: f64,
    /// How the schedule went on this rank.
    pub stats: ScheduleStats,
}

/// What one rank measured of one step's schedule: the bubble and the activation memory.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScheduleStats {
    /// Wall time of the whole schedule on this rank (handshake included).
    pub total: Duration,
    /// Of it, the time spent waiting for a neighbour's activation or gradient: this rank's
    /// share of the bubble (compare with [`bubble_fraction`](crate::bubble_fraction)).
    pub waiting: Duration,
    /// The most microbatches whose activations this rank held at once (summed over its
    /// chunks): `m` under GPipe, at most `p - s` under 1F1B.
    pub peak_microbatches: usize,
}

impl ScheduleStats {
    /// The share of the schedule spent waiting.
    pub fn idle_fraction(&self) -> f64 {
        self.waiting.as_secs_f64() / self.total.as_secs_f64().max(f64::MIN_POSITIVE)
    }
}

/// What a forward left for its backward.
struct Saved<const D: usize> {
    /// The received input (a leaf; `None` on the first stage).
    input: Option<Tensor<D>>,
    /// The activation sent on, or the last stage's weighted loss.
    output: Output<D>,
}

enum Output<const D: usize> {
    Activation(Tensor<D>),
    Loss(Tensor<1>),
}

/// Runs `kind` over `microbatches` on this rank's `chunks` (one stage, or under the
/// interleaved schedule chunk `c` being stage `c * p + r` of rank `r` of `p`), whose
/// neighbours are reached through `link`. `weights[m]` scales microbatch `m`'s loss (its share
/// of what the step averages, so that the sum over microbatches and data-parallel ranks is the
/// global batch's mean loss). Received activations are built on `device`.
/// `gradient_sync(last)` is called before each backward, `last` being true for each chunk's
/// final one: FSDP defers its gradient reduction until then. Collective over the pipeline
/// groups; every rank of a stage's data-parallel groups runs the same microbatches in the same
/// order.
pub fn run_schedule<const D: usize, S: PipelineStage<D> + Module>(
    chunks: &[S],
    link: &mut StageLink,
    kind: ScheduleKind,
    microbatches: &[S::Microbatch],
    weights: &[f64],
    device: &Device,
    gradient_sync: &dyn Fn(bool),
) -> Result<StageGrads, PipelineError> {
    let started = Instant::now();
    let (mut runner, plan) = prepare(chunks, link, kind, microbatches, weights, device)?;
    let v = chunks.len();
    // Each chunk's last backward: FSDP reduces that chunk's deferred gradients there.
    let last_backward: Vec<usize> = (0..v)
        .map(|c| {
            plan.iter()
                .rposition(|a| matches!(a, Action::Backward { chunk, .. } if *chunk == c))
                .expect("every chunk runs a backward")
        })
        .collect();
    for (i, action) in plan.into_iter().enumerate() {
        match action {
            Action::Forward { chunk, microbatch } => runner.forward(
                chunk,
                microbatch,
                &microbatches[microbatch],
                weights[microbatch],
            )?,
            Action::Backward { chunk, microbatch } => {
                gradient_sync(last_backward[chunk] == i);
                runner.backward(chunk, microbatch)?;
            }
        }
    }
    runner.link.finish()?;
    // No parameter gradient at all: this rank's stages are wholly frozen. A throwaway leaf's
    // backward makes the empty set (Burn has no other public constructor).
    let grads = runner.grads.unwrap_or_else(|| {
        Tensor::<1>::zeros([1], device)
            .require_grad()
            .sum()
            .backward()
    });
    Ok(StageGrads {
        grads,
        loss: runner.loss,
        stats: ScheduleStats {
            total: started.elapsed(),
            waiting: runner.waiting,
            peak_microbatches: runner.peak,
        },
    })
}

/// This rank's actions under `kind` and a runner for them, once the chunks' positions and the
/// weights are checked and the shapes agreed with the neighbours.
fn prepare<'a, const D: usize, S: PipelineStage<D> + Module>(
    chunks: &'a [S],
    link: &'a mut StageLink,
    kind: ScheduleKind,
    microbatches: &[S::Microbatch],
    weights: &[f64],
    device: &'a Device,
) -> Result<(Runner<'a, D, S>, Vec<Action>), PipelineError> {
    let (r, p, v) = (link.rank(), link.ranks(), chunks.len());
    for (c, chunk) in chunks.iter().enumerate() {
        if chunk.position() != (c * p + r, p * v) {
            let (s, n) = chunk.position();
            return Err(PipelineError::Stage {
                stage: c * p + r,
                stages: p * v,
                message: format!(
                    "chunk {c} of pipeline rank {r} was built as stage {s} of {n}; with {p} \
                     ranks and {v} chunks each it must be stage {} of {}",
                    c * p + r,
                    p * v
                ),
            });
        }
    }
    if weights.len() != microbatches.len() {
        return Err(PipelineError::Schedule(format!(
            "{} loss weights for {} microbatches",
            weights.len(),
            microbatches.len()
        )));
    }
    let plan = actions(kind, r, p, v, microbatches.len())?;
    let mut runner = Runner {
        chunks,
        link,
        device,
        r,
        p,
        saved: (0..v)
            .map(|_| (0..microbatches.len()).map(|_| None).collect())
            .collect(),
        grads: None,
        loss: 0.0,
        waiting: Duration::ZERO,
        live: 0,
        peak: 0,
        inputs: Vec::new(),
        outputs: Vec::new(),
    };
    runner.agree_shapes(microbatches)?;
    Ok((runner, plan))
}

/// Runs only the forwards of `kind`'s schedule over `microbatches` (an evaluation): the same
/// handshake, sends and receives as [`run_schedule`] without any backward, each microbatch's
/// graph dropped once its activation is sent. Returns, on the rank holding the last stage, the
/// sum over microbatches of each one's loss times `weights[m]`; 0 elsewhere. Collective over
/// the pipeline groups.
pub fn run_forward<const D: usize, S: PipelineStage<D> + Module>(
    chunks: &[S],
    link: &mut StageLink,
    kind: ScheduleKind,
    microbatches: &[S::Microbatch],
    weights: &[f64],
    device: &Device,
) -> Result<f64, PipelineError> {
    let (mut runner, plan) = prepare(chunks, link, kind, microbatches, weights, device)?;
    // The forwards keep their order in the schedule: each rank's are a subsequence of a
    // deadlock-free schedule, and dropping the backwards only removes waits.
    for action in plan {
        if let Action::Forward { chunk, microbatch } = action {
            let mb = &microbatches[microbatch];
            runner.forward(chunk, microbatch, mb, weights[microbatch])?;
            runner.saved[chunk][microbatch] = None;
            runner.live -= 1;
        }
    }
    runner.link.finish()?;
    Ok(runner.loss)
}

struct Runner<'a, const D: usize, S> {
    chunks: &'a [S],
    link: &'a mut StageLink,
    device: &'a Device,
    r: usize,
    p: usize,
    /// `saved[chunk][microbatch]`.
    saved: Vec<Vec<Option<Saved<D>>>>,
    grads: Option<Gradients>,
    loss: f64,
    /// Time blocked in receives.
    waiting: Duration,
    /// Microbatches whose forward ran and backward has not, now and at most.
    live: usize,
    peak: usize,
    /// The declared shapes, `[chunk][microbatch]` (empty where a chunk receives or sends none).
    inputs: Vec<Vec<Vec<usize>>>,
    outputs: Vec<Vec<Vec<usize>>>,
}

impl<const D: usize, S: PipelineStage<D> + Module> Runner<'_, D, S> {
    fn stage(&self, chunk: usize) -> usize {
        chunk * self.p + self.r
    }

    fn stages(&self) -> usize {
        self.chunks.len() * self.p
    }

    /// Every chunk's declared shapes, then the handshake with the neighbours (the messages of
    /// every chunk in chunk order: the order the neighbour's chunks list them).
    fn agree_shapes(&mut self, microbatches: &[S::Microbatch]) -> Result<(), PipelineError> {
        let declared = |f: &dyn Fn(&S::Microbatch) -> Option<[usize; D]>| {
            microbatches
                .iter()
                .map(|mb| f(mb).map(|s| s.to_vec()).unwrap_or_default())
                .collect::<Vec<_>>()
        };
        for chunk in self.chunks {
            self.inputs.push(declared(&|mb| chunk.input_shape(mb)));
            self.outputs.push(declared(&|mb| chunk.output_shape(mb)));
        }
        let (mut inputs, mut outputs) = (Vec::new(), Vec::new());
        for c in 0..self.chunks.len() {
            if self.stage(c) > 0 {
                inputs.extend(self.inputs[c].iter().cloned());
            }
            if self.stage(c) + 1 < self.stages() {
                outputs.extend(self.outputs[c].iter().cloned());
            }
        }
        let receives = (0..self.chunks.len()).any(|c| self.stage(c) > 0);
        let sends = (0..self.chunks.len()).any(|c| self.stage(c) + 1 < self.stages());
        let started = Instant::now();
        let agreed = self.link.agree_shapes(
            receives.then_some(inputs.as_slice()),
            sends.then_some(outputs.as_slice()),
        );
        self.waiting += started.elapsed();
        agreed
    }

    /// A receive, its wait counted.
    fn receive(
        &mut self,
        recv: fn(&StageLink) -> Result<TensorData, PipelineError>,
    ) -> Result<TensorData, PipelineError> {
        let started = Instant::now();
        let data = recv(self.link);
        self.waiting += started.elapsed();
        data
    }

    fn forward(
        &mut self,
        c: usize,
        m: usize,
        mb: &S::Microbatch,
        weight: f64,
    ) -> Result<(), PipelineError> {
        let (stage, stages) = (self.stage(c), self.stages());
        let input = match stage {
            0 => None,
            _ => {
                let data = self.receive(StageLink::recv_activation)?;
                self.check(
                    c,
                    m,
                    "activation received",
                    data.shape(),
                    &self.inputs[c][m],
                )?;
                // A leaf of this stage's graph: its gradient is what goes back.
                Some(Tensor::<D>::from_data(data, self.device).require_grad())
            }
        };
        let output = match (
            self.chunks[c].forward(mb, input.clone())?,
            stage + 1 == stages,
        ) {
            (StageOutput::Activation(output), false) => {
                let data = output.clone().detach().into_data();
                self.check(c, m, "activation sent", data.shape(), &self.outputs[c][m])?;
                self.link.send_activation(data);
                Output::Activation(output)
            }
            (StageOutput::Loss(loss), true) => {
                let loss = loss.mul_scalar(weight);
                self.loss += scalar(loss.clone().detach().into_data());
                Output::Loss(loss)
            }
            (StageOutput::Loss(_), false) => {
                return Err(self.error(c, "returned a loss but is not the last stage"));
            }
            (StageOutput::Activation(_), true) => {
                return Err(self.error(c, "is the last stage but returned no loss"));
            }
        };
        self.saved[c][m] = Some(Saved { input, output });
        self.live += 1;
        self.peak = self.peak.max(self.live);
        Ok(())
    }

    fn backward(&mut self, c: usize, m: usize) -> Result<(), PipelineError> {
        let Saved { input, output } = self.saved[c][m]
            .take()
            .expect("a schedule runs forward first");
        self.live -= 1;
        let mut grads = match output {
            Output::Loss(loss) => loss.backward(),
            Output::Activation(output) => {
                let data = self.receive(StageLink::recv_gradient)?;
                self.check(c, m, "gradient received", data.shape(), &self.outputs[c][m])?;
                // A wholly frozen first stage: nothing in it trains and nothing precedes it.
                if !output.is_tracked() {
                    return Ok(());
                }
                let grad = Tensor::<D>::from_data(data, &output.device());
                // d(sum(out * g))/d(out) = g: backward seeded with the received gradient.
                (output * grad).sum().backward()
            }
        };
        if let Some(input) = input {
            let grad = input
                .grad_remove(&mut grads)
                .ok_or_else(|| self.error(c, "its input received no gradient"))?;
            let data = grad.into_data();
            self.check(c, m, "gradient sent", data.shape(), &self.inputs[c][m])?;
            self.link.send_gradient(data);
        }
        match self.grads.as_mut() {
            None => self.grads = Some(grads),
            Some(sum) => self.chunks[c].visit(&mut AddGrads {
                into: sum,
                from: grads,
            }),
        }
        Ok(())
    }

    fn check(
        &self,
        c: usize,
        m: usize,
        what: &'static str,
        found: &[usize],
        declared: &[usize],
    ) -> Result<(), PipelineError> {
        match found == declared {
            true => Ok(()),
            false => Err(PipelineError::UndeclaredShape {
                stage: self.stage(c),
                microbatch: m,
                what,
                found: found.to_vec(),
                declared: declared.to_vec(),
            }),
        }
    }

    fn error(&self, c: usize, message: &str) -> PipelineError {
        PipelineError::Stage {
            stage: self.stage(c),
            stages: self.stages(),
            message: message.into(),
        }
    }
}

/// Adds every parameter's gradient in `from` to its gradient in `into`.
struct AddGrads<'a> {
    into: &'a mut Gradients,
    from: Gradients,
}

impl ModuleVisitor for AddGrads<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let value = param.val();
        if let Some(g) = value.grad_remove(&mut self.from) {
            let sum = match value.grad_remove(self.into) {
                Some(acc) => acc + g,
                None => g,
            };
            value.grad_replace(self.into, sum);
        }
    }
}

fn scalar(data: TensorData) -> f64 {
    data.convert_dtype(DType::F64)
        .try_into_vec::<f64>()
        .expect("a scalar")[0]
}
