//! Where a model's parameter values come from: a seeded initialisation that every rank
//! computes identically (Burn's RNG is process-wide, so rank threads cannot share it), or a
//! checkpoint.

use burn::module::ParamId;
use burn::tensor::TensorData;

use crate::config::LlamaConfig;
use crate::error::ModelError;

/// What a parameter is; decides its initialisation and its checkpoint layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParamKind {
    /// A Linear weight: Burn `[in, out]`, Hugging Face `[out, in]`.
    LinearWeight,
    /// A bias (zero-initialized).
    Bias,
    /// An embedding table, `[vocab, hidden]` in both layouts.
    Embedding,
    /// A norm's scale (initialized to one).
    Norm,
}

/// A parameter's value in Burn's layout, or why it could not be had.
pub type ParamValue = Result<TensorData, ModelError>;

/// Reads a parameter's full value later, when (if ever) the lazy parameter is materialized.
pub type DeferredRead = Box<dyn FnOnce() -> ParamValue + Send + Sync>;

/// Gives each parameter its value, by Hugging Face name, in Burn's layout (`shape`).
pub trait TensorSource {
    /// The value of parameter `name`, now.
    fn tensor(&mut self, name: &str, shape: &[usize], kind: ParamKind) -> ParamValue;

    /// A source that defers returns how to read the parameter later (the model then holds a
    /// lazy parameter with id `id`, so that a sharded load can ask for its rows only); the
    /// default reads now, through [`tensor`](Self::tensor).
    fn deferred(
        &mut self,
        _id: ParamId,
        _name: &str,
        _shape: &[usize],
        _kind: ParamKind,
    ) -> Result<Option<DeferredRead>, ModelError> {
        Ok(None)
    }
}

/// Hugging Face's initialisation (normal(0, initializer_range) weights, zero biases, unit
/// norms), each parameter drawn from its own seed (the base seed and its name).
#[derive(Debug, Clone)]
pub struct SeededInit {
    /// The base seed, mixed with each parameter's name.
    pub seed: u64,
    /// Standard deviation of the normal weights.
    pub std: f64,
}

impl SeededInit {
    /// `config`'s initialisation (its `initializer_range`) from `seed`.
    pub fn new(config: &LlamaConfig, seed: u64) -> Self {
        Self {
            seed,
            std: config.initializer_range,
        }
    }
}

impl TensorSource for SeededInit {
    fn tensor(&mut self, name: &str, shape: &[usize], kind: ParamKind) -> ParamValue {
        let n = shape.iter().product();
        let values = match kind {
            ParamKind::Norm => vec![1.0; n],
            ParamKind::Bias => vec![0.0; n],
            ParamKind::LinearWeight | ParamKind::Embedding => {
                seeded_normal(self.seed ^ fnv1a(name), n, self.std)
            }
        };
        Ok(TensorData::new(values, shape.to_vec()))
    }
}

fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

/// `n` draws of normal(0, std) from `seed` (splitmix64 and Box-Muller): the same values on
/// every thread and process.
pub fn seeded_normal(seed: u64, n: usize, std: f64) -> Vec<f32> {
    let mut state = seed;
    let mut uniform = move || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        // In (0, 1]: never 0, so the logarithm is finite.
        ((z >> 11) as f64 + 1.0) / (1u64 << 53) as f64
    };
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let (u1, u2) = (uniform(), uniform());
        let r = (-2.0 * u1.ln()).sqrt() * std;
        let t = std::f64::consts::TAU * u2;
        out.push((r * t.cos()) as f32);
        if out.len() < n {
            out.push((r * t.sin()) as f32);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeded_normal_is_reproducible_and_scaled() {
        let a = seeded_normal(7, 20_001, 0.02);
        assert_eq!(a, seeded_normal(7, 20_001, 0.02));
        assert_ne!(a, seeded_normal(8, 20_001, 0.02));
        let mean = a.iter().map(|x| *x as f64).sum::<f64>() / a.len() as f64;
        let var = a.iter().map(|x| (*x as f64 - mean).powi(2)).sum::<f64>() / a.len() as f64;
        assert!(
            mean.abs() < 1e-3 && (var.sqrt() - 0.02).abs() < 1e-3,
            "{mean} {var}"
        );
    }
}
