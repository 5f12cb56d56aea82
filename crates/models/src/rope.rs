//! The rotary position embedding of Hugging Face transformers (rotate-half convention): its
//! frequencies from the config, the `cos`/`sin` tables of positions, and their application to
//! queries and keys.

use burn::tensor::{DType, Device, Tensor, TensorData};

use crate::config::{LlamaConfig, RopeScaling};
use crate::fused;

/// Rotary position embedding frequencies (Hugging Face's rotate-half convention).
#[derive(Debug, Clone)]
pub struct Rope {
    /// One frequency per pair of dims, `head_dim / 2` of them, f32 as transformers keeps them.
    pub inv_freq: Vec<f32>,
}

impl Rope {
    /// The frequencies of `config`'s rotating dims (`head_dim`, or its
    /// `partial_rotary_factor` share), `rope_theta` and `rope_scaling`.
    pub fn new(config: &LlamaConfig) -> Self {
        let dim = config.rotary_dim();
        let mut inv_freq: Vec<f64> = (0..dim / 2)
            .map(|i| {
                let exponent = (2 * i) as f32 / dim as f32;
                1.0 / (config.rope_theta as f32).powf(exponent) as f64
            })
            .collect();
        match config.rope_scaling {
            None => {}
            Some(RopeScaling::Linear { factor }) => inv_freq.iter_mut().for_each(|f| *f /= factor),
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old,
            }) => {
                let (low_wavelen, high_wavelen) = (old / low_freq_factor, old / high_freq_factor);
                for f in &mut inv_freq {
                    let wavelen = std::f64::consts::TAU / *f;
                    if wavelen > low_wavelen {
                        *f /= factor;
                    } else if wavelen >= high_wavelen {
                        let smooth = (old / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        *f = (1.0 - smooth) * *f / factor + smooth * *f;
                    }
                }
            }
        }
        Self {
            inv_freq: inv_freq.into_iter().map(|f| f as f32).collect(),
        }
    }

    /// Gemma 3's sliding-window layers' frequencies: `rope_local_theta`, no scaling (`None`
    /// when the config has no local base).
    pub fn local(config: &LlamaConfig) -> Option<Self> {
        let theta = config.rope_local_theta?;
        Some(Self::new(&LlamaConfig {
            rope_theta: theta,
            rope_scaling: None,
            ..config.clone()
        }))
    }

    /// `(cos, sin)` of positions `0..seq`, `[1, 1, seq, head_dim]`, in `dtype`.
    pub fn cos_sin(&self, seq: usize, device: &Device, dtype: DType) -> (Tensor<4>, Tensor<4>) {
        let half = self.inv_freq.len();
        let dim = 2 * half;
        let (mut cos, mut sin) = (Vec::with_capacity(seq * dim), Vec::with_capacity(seq * dim));
        for pos in 0..seq {
            // The angle in f32 as transformers computes it; cos/sin of that f32 angle.
            let angles: Vec<f32> = self.inv_freq.iter().map(|f| f * pos as f32).collect();
            for _ in 0..2 {
                cos.extend(angles.iter().map(|a| (*a as f64).cos() as f32));
                sin.extend(angles.iter().map(|a| (*a as f64).sin() as f32));
            }
        }
        let make = |v: Vec<f32>| {
            Tensor::<4>::from_data(TensorData::new(v, [1, 1, seq, dim]), device).cast(dtype)
        };
        (make(cos), make(sin))
    }

    /// `(cos, sin)` of each row's own `positions` (`[batch, seq]`), `[batch, 1, seq,
    /// head_dim]`, in `dtype`: packed rows, whose positions restart per example.
    pub fn cos_sin_at(
        &self,
        positions: &[i64],
        batch: usize,
        device: &Device,
        dtype: DType,
    ) -> (Tensor<4>, Tensor<4>) {
        let seq = positions.len() / batch.max(1);
        let dim = 2 * self.inv_freq.len();
        let (cos, sin) = (Vec::with_capacity(positions.len() * dim), Vec::new());
        let (mut cos, mut sin) = (cos, sin);
        for &pos in positions {
            let angles: Vec<f32> = self.inv_freq.iter().map(|f| f * pos as f32).collect();
            for _ in 0..2 {
                cos.extend(angles.iter().map(|a| (*a as f64).cos() as f32));
                sin.extend(angles.iter().map(|a| (*a as f64).sin() as f32));
            }
        }
        let make = |v: Vec<f32>| {
            Tensor::<4>::from_data(TensorData::new(v, [batch, 1, seq, dim]), device).cast(dtype)
        };
        (make(cos), make(sin))
    }

    /// [`apply`](Self::apply) with plain tensor ops, for `cos`/`sin` of any leading shape
    /// that broadcasts (per-row positions).
    pub fn apply_plain(x: Tensor<4>, cos: &Tensor<4>, sin: &Tensor<4>) -> Tensor<4> {
        partially(x, cos, |x| Self::rotate_plain(x, cos, sin))
    }

    fn rotate_plain(x: Tensor<4>, cos: &Tensor<4>, sin: &Tensor<4>) -> Tensor<4> {
        let half = x.dims()[3] / 2;
        let x1 = x.clone().narrow(3, 0, half);
        let x2 = x.clone().narrow(3, half, half);
        let rotated = Tensor::cat(vec![x2.neg(), x1], 3);
        x * cos.clone() + rotated * sin.clone()
    }

    /// `x * cos + rotate_half(x) * sin` on `[batch, heads, seq, head_dim]`; with partial
    /// rotary (`cos` narrower than the head), on the head's first dims only.
    pub fn apply(x: Tensor<4>, cos: &Tensor<4>, sin: &Tensor<4>) -> Tensor<4> {
        partially(x, cos, |x| fused::rotary(x, cos, sin))
    }
}

/// `rotate` on the first `cos.dims()[3]` dims of each head of `x`, the rest passed through
/// (transformers' `q_rot, q_pass` split); all of `x` when they are as wide.
fn partially(
    x: Tensor<4>,
    cos: &Tensor<4>,
    rotate: impl FnOnce(Tensor<4>) -> Tensor<4>,
) -> Tensor<4> {
    let (dim, turning) = (x.dims()[3], cos.dims()[3]);
    if turning >= dim {
        return rotate(x);
    }
    let pass = x.clone().narrow(3, turning, dim - turning);
    Tensor::cat(vec![rotate(x.narrow(3, 0, turning)), pass], 3)
}
