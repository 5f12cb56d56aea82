//! `adapter_model.safetensors`: each adapted module's `lora_A.weight [r, in]` and
//! `lora_B.weight [out, r]` under peft's key names, f32, f16 or bf16.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

use crate::error::LoraError;

/// The tensor file's name in an adapter directory.
pub const WEIGHTS_FILE: &str = "adapter_model.safetensors";

/// What peft puts before a module's path (`PeftModel.base_model` is the `LoraModel`, its
/// `model` the wrapped transformers model).
const PREFIX: &str = "base_model.model.";
const A_KEY: &str = ".lora_A.weight";
const B_KEY: &str = ".lora_B.weight";

/// A row-major f32 matrix.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Matrix {
    pub shape: [usize; 2],
    pub values: Vec<f32>,
}

impl Matrix {
    /// The transpose (`[r, c]` -> `[c, r]`): peft's `[out, in]`-style factors are Burn's
    /// `[in, out]` transposed.
    pub fn transpose(&self) -> Self {
        let [r, c] = self.shape;
        let values = (0..c)
            .flat_map(|j| (0..r).map(move |i| self.values[i * c + j]))
            .collect();
        Self {
            shape: [c, r],
            values,
        }
    }

    /// Rows `range` (peft's `lora_B` of one part of a fused module).
    pub fn rows(&self, range: std::ops::Range<usize>) -> Self {
        let c = self.shape[1];
        Self {
            shape: [range.len(), c],
            values: self.values[range.start * c..range.end * c].to_vec(),
        }
    }

    /// The matrices side by side (`[r, c_i]` -> `[r, sum c_i]`): the parts' `b`s as the fused
    /// module's. Every part has the same rows.
    pub fn columns(parts: &[Matrix]) -> Self {
        let r = parts.first().map_or(0, |m| m.shape[0]);
        let c = parts.iter().map(|m| m.shape[1]).sum();
        let values = (0..r)
            .flat_map(|i| {
                parts
                    .iter()
                    .flat_map(move |m| m.values[i * m.shape[1]..(i + 1) * m.shape[1]].iter())
            })
            .copied()
            .collect();
        Self {
            shape: [r, c],
            values,
        }
    }
}

/// One module's factors as peft stores them: `a` is `lora_A.weight [r, in]`, `b` is
/// `lora_B.weight [out, r]`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PeftFactors {
    pub a: Matrix,
    pub b: Matrix,
}

/// The key of `module`'s factor (`lora_A` when `a`).
pub(crate) fn key(module: &str, a: bool) -> String {
    format!("{PREFIX}{module}{}", if a { A_KEY } else { B_KEY })
}

/// Reads `path` into module path -> factors. Every key must be a LoRA factor of peft's
/// naming, every module must have both, and each tensor must be 2-d f32, f16 or bf16.
pub(crate) fn read(path: &Path) -> Result<BTreeMap<String, PeftFactors>, LoraError> {
    let bad = |reason: String| LoraError::file(path, reason);
    let bytes = std::fs::read(path).map_err(|e| {
        bad(format!(
            "cannot read it ({e}); an adapter directory holds {WEIGHTS_FILE} next to \
             adapter_config.json"
        ))
    })?;
    let file = SafeTensors::deserialize(&bytes)
        .map_err(|e| bad(format!("not a safetensors file: {e}")))?;
    let mut halves: BTreeMap<String, (Option<Matrix>, Option<Matrix>)> = BTreeMap::new();
    for (name, view) in file.iter() {
        let module_and_factor = name.strip_prefix(PREFIX).and_then(|rest| {
            rest.strip_suffix(A_KEY)
                .map(|m| (m, true))
                .or_else(|| rest.strip_suffix(B_KEY).map(|m| (m, false)))
        });
        let Some((module, is_a)) = module_and_factor.filter(|(m, _)| !m.is_empty()) else {
            return Err(bad(format!(
                "`{name}` is not a LoRA factor; keys are `{PREFIX}<module path>{A_KEY}` and \
                 `..{B_KEY}` (trained biases or fully saved modules are not supported)"
            )));
        };
        let matrix = decode(name, &view).map_err(bad)?;
        let slot = halves.entry(module.to_string()).or_default();
        match is_a {
            true => slot.0 = Some(matrix),
            false => slot.1 = Some(matrix),
        }
    }
    halves
        .into_iter()
        .map(|(module, pair)| match pair {
            (Some(a), Some(b)) => Ok((module, PeftFactors { a, b })),
            (a, _) => {
                let missing = key(&module, a.is_none());
                Err(bad(format!(
                    "`{missing}` is missing; a module needs both factors"
                )))
            }
        })
        .collect()
}

fn decode(name: &str, view: &TensorView<'_>) -> Result<Matrix, String> {
    let shape: [usize; 2] = view.shape().try_into().map_err(|_| {
        format!(
            "`{name}` has shape {:?}; a LoRA factor is a matrix",
            view.shape()
        )
    })?;
    let bytes = view.data();
    let values = match view.dtype() {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        other => {
            return Err(format!(
                "`{name}` has dtype {other:?}; save the adapter in float32, float16 or bfloat16"
            ));
        }
    };
    Ok(Matrix { shape, values })
}

/// Writes module path -> factors (peft's layout) to `path` in f32, with PyTorch's format
/// marker as peft writes it.
pub(crate) fn write(path: &Path, modules: &[(String, PeftFactors)]) -> Result<(), LoraError> {
    let encoded: Vec<(String, [usize; 2], Vec<u8>)> = modules
        .iter()
        .flat_map(|(module, f)| [(key(module, true), &f.a), (key(module, false), &f.b)])
        .map(|(k, m)| {
            let bytes = m.values.iter().flat_map(|v| v.to_le_bytes()).collect();
            (k, m.shape, bytes)
        })
        .collect();
    let bad = |reason: String| LoraError::file(path, reason);
    let views = encoded
        .iter()
        .map(|(k, shape, bytes)| {
            TensorView::new(Dtype::F32, shape.to_vec(), bytes)
                .map(|v| (k.as_str(), v))
                .map_err(|e| bad(e.to_string()))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(metadata), path)
        .map_err(|e| bad(format!("cannot write it: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transpose_swaps_rows_and_columns() {
        let m = Matrix {
            shape: [2, 3],
            values: vec![1., 2., 3., 4., 5., 6.],
        };
        let t = m.transpose();
        assert_eq!(t.shape, [3, 2]);
        assert_eq!(t.values, [1., 4., 2., 5., 3., 6.]);
        assert_eq!(t.transpose(), m);
    }

    #[test]
    fn factors_round_trip_and_half_precision_reads() {
        let dir = std::env::temp_dir().join(format!("peft-tensors-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(WEIGHTS_FILE);
        let f = PeftFactors {
            a: Matrix {
                shape: [1, 2],
                values: vec![0.5, -1.0],
            },
            b: Matrix {
                shape: [3, 1],
                values: vec![1.0, 2.0, -0.25],
            },
        };
        write(
            &path,
            &[("model.layers.0.self_attn.q_proj".into(), f.clone())],
        )
        .unwrap();
        let back = read(&path).unwrap();
        assert_eq!(back["model.layers.0.self_attn.q_proj"], f);
        // bf16 (exact for these values), and a lone factor refused.
        let bytes: Vec<u8> = [0.5f32, -1.0]
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect();
        let a = TensorView::new(Dtype::BF16, vec![1, 2], &bytes).unwrap();
        safetensors::serialize_to_file([(key("m", true), a)], None, &path).unwrap();
        let err = read(&path).unwrap_err().to_string();
        assert!(
            err.contains("`base_model.model.m.lora_B.weight` is missing"),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
