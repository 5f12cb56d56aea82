//! Optimizers on this rank's stored parameters (the shards under FSDP): elementwise, so the
//! update of a shard is exactly the slice of the full update.
//!
//! Burn's own `AdamW` computes PyTorch's formula (decoupled decay, bias correction, eps added
//! to sqrt(v_hat)); it is not used here because its state lives in a `GradientsParams` keyed
//! by the whole module, while these keep per-parameter state next to the shards and follow
//! PyTorch's operation order exactly.

use std::collections::HashMap;

mod flex;
#[cfg(test)]
mod tests;
mod update;

use burn::backend::Dispatch;
use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::tensor::{GradientCheckpointingStrategy, Gradients, Tensor};
use burn_parallel_checkpoint::OptimizerState;
use serde_json::json;

use update::{AdamWBackend, AdamWScalars};

/// An optimizer step on every parameter of a module.
pub trait Optimizer {
    /// `model` with each parameter that has a gradient in `grads` updated.
    fn step<M: Module>(&mut self, model: M, grads: &Gradients) -> M;
    /// f32 tensors of optimizer state per parameter tensor.
    fn states_per_param(&self) -> usize;
}

/// `p -= lr * g`.
#[derive(Debug, Clone)]
pub struct Sgd {
    /// Learning rate.
    pub lr: f32,
}

impl Optimizer for Sgd {
    fn step<M: Module>(&mut self, model: M, grads: &Gradients) -> M {
        struct Step<'a> {
            grads: &'a Gradients,
            lr: f32,
        }
        impl ModuleMapper for Step<'_> {
            fn map_float<const D: usize>(&mut self, p: Param<Tensor<D>>) -> Param<Tensor<D>> {
                let grad = p.base().grad(self.grads);
                let lr = self.lr;
                p.map(|t| match grad {
                    Some(g) if g.dims().iter().product::<usize>() > 0 => {
                        let strategy = t.gradient_checkpointing_strategy();
                        new_leaf(t.inner() - g * lr, strategy)
                    }
                    _ => t,
                })
            }
        }
        model.map(&mut Step { grads, lr: self.lr })
    }

    fn states_per_param(&self) -> usize {
        0
    }
}

/// PyTorch's `torch.optim.AdamW`:
/// `p *= 1 - lr*wd; m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g^2;
///  p -= (lr / (1-b1^t)) * m / (sqrt(v) / sqrt(1-b2^t) + eps)`.
#[derive(Debug, Clone)]
pub struct AdamW {
    /// Learning rate.
    pub lr: f32,
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Added to the bias-corrected sqrt(v) for stability.
    pub eps: f32,
    /// Decoupled weight decay.
    pub weight_decay: f32,
    step: i32,
    /// (m, v) of each parameter, flattened, on the inner (non-autodiff) backend.
    moments: HashMap<ParamId, (Tensor<1>, Tensor<1>)>,
}

impl AdamW {
    /// AdamW with these hyperparameters and no state yet (step 0).
    pub fn new(lr: f32, beta1: f32, beta2: f32, eps: f32, weight_decay: f32) -> Self {
        Self {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            step: 0,
            moments: HashMap::new(),
        }
    }

    /// This step's scalars, computed in f32 as PyTorch's for-loop AdamW computes them.
    fn scalars(&self) -> AdamWScalars {
        let bias1 = 1.0 - self.beta1.powi(self.step);
        let bias2 = 1.0 - self.beta2.powi(self.step);
        AdamWScalars {
            beta1: self.beta1,
            one_minus_beta1: 1.0 - self.beta1,
            beta2: self.beta2,
            one_minus_beta2: 1.0 - self.beta2,
            bias2_sqrt: bias2.sqrt(),
            eps: self.eps,
            step_size: self.lr / bias1,
            decay: (self.weight_decay != 0.0).then_some(1.0 - self.lr * self.weight_decay),
        }
    }
}

impl Optimizer for AdamW {
    fn step<M: Module>(&mut self, model: M, grads: &Gradients) -> M {
        self.step += 1;
        let mut mapper = AdamWStep { opt: self, grads };
        model.map(&mut mapper)
    }

    fn states_per_param(&self) -> usize {
        2
    }
}

struct AdamWStep<'a> {
    opt: &'a mut AdamW,
    grads: &'a Gradients,
}

impl ModuleMapper for AdamWStep<'_> {
    fn map_float<const D: usize>(&mut self, p: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let Some(g) = p.base().grad(self.grads) else {
            return p;
        };
        let shape = g.dims();
        let n: usize = shape.iter().product();
        if n == 0 {
            return p;
        }
        let o = &mut *self.opt;
        let s = o.scalars();
        let moments = o.moments.remove(&p.id);
        let mut updated_moments = None;
        let p = p.map(|t| {
            let strategy = t.gradient_checkpointing_strategy();
            let x = t.inner().reshape([n]).into_dispatch();
            let g = g.reshape([n]).into_dispatch();
            let (x, m, v) = match moments {
                Some((m, v)) => {
                    let (m, v) = (m.into_dispatch(), v.into_dispatch());
                    <Dispatch as AdamWBackend>::adamw_step(x, g, m, v, s)
                }
                None => <Dispatch as AdamWBackend>::adamw_first_step(x, g, s),
            };
            updated_moments = Some((Tensor::from_dispatch(m), Tensor::from_dispatch(v)));
            new_leaf(Tensor::<1>::from_dispatch(x).reshape(shape), strategy)
        });
        if let Some(moments) = updated_moments {
            o.moments.insert(p.id, moments);
        }
        p
    }
}

/// An updated parameter as a new autodiff leaf that keeps the old one's gradient
/// checkpointing strategy (the strategy its device gave it).
fn new_leaf<const D: usize>(
    updated: Tensor<D>,
    strategy: Option<GradientCheckpointingStrategy>,
) -> Tensor<D> {
    let leaf = updated.autodiff();
    match strategy {
        Some(strategy) => leaf.with_gradient_checkpointing_strategy(strategy),
        None => leaf,
    }
    .require_grad()
}

/// An f32 setting as the f64 of its shortest decimal (0.9, not 0.8999999761581421), for JSON.
pub(crate) fn decimal(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(x as f64)
}

/// SGD keeps no state: a checkpoint records its kind and learning rate only.
impl OptimizerState for Sgd {
    fn kind(&self) -> &str {
        "sgd"
    }

    fn state_names(&self) -> Vec<String> {
        Vec::new()
    }

    fn scalars(&self) -> serde_json::Value {
        json!({ "lr": decimal(self.lr) })
    }

    fn load_scalars(&mut self, _scalars: &serde_json::Value) -> Result<(), String> {
        // The learning rate is the resumed run's own setting.
        Ok(())
    }

    fn param_state(&self, _id: ParamId) -> Option<Vec<Tensor<1>>> {
        None
    }

    fn load_param_state(&mut self, _id: ParamId, _state: Vec<Tensor<1>>) {}
}

/// AdamW's state: the step count (bias correction) and both moments of every parameter shard,
/// under PyTorch's names. Hyperparameters are saved for the record; a resumed run uses its own.
impl OptimizerState for AdamW {
    fn kind(&self) -> &str {
        "adamw"
    }

    fn state_names(&self) -> Vec<String> {
        vec!["exp_avg".into(), "exp_avg_sq".into()]
    }

    fn scalars(&self) -> serde_json::Value {
        json!({
            "step": self.step,
            "lr": decimal(self.lr),
            "beta1": decimal(self.beta1),
            "beta2": decimal(self.beta2),
            "eps": decimal(self.eps),
            "weight_decay": decimal(self.weight_decay),
        })
    }

    fn load_scalars(&mut self, scalars: &serde_json::Value) -> Result<(), String> {
        let step = scalars
            .get("step")
            .and_then(|s| s.as_i64())
            .ok_or_else(|| format!("adamw scalars without an integer `step`: {scalars}"))?;
        self.step = i32::try_from(step).map_err(|_| format!("adamw step {step} out of range"))?;
        Ok(())
    }

    fn param_state(&self, id: ParamId) -> Option<Vec<Tensor<1>>> {
        let (m, v) = self.moments.get(&id)?;
        Some(vec![m.clone(), v.clone()])
    }

    fn load_param_state(&mut self, id: ParamId, state: Vec<Tensor<1>>) {
        let mut state = state.into_iter();
        if let (Some(m), Some(v)) = (state.next(), state.next()) {
            self.moments.insert(id, (m, v));
        }
    }
}
