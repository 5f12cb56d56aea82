//! Projections a Hugging Face model holds as one module while the model here holds them as
//! parts (Phi-3's `qkv_proj` as `q_proj`, `k_proj`, `v_proj`, split so that tensor
//! parallelism splits each by its own heads). peft adapts such a module as one: one `lora_A`
//! that every part reads, and one `lora_B` whose rows are the parts' outputs one after
//! another. Here the first part holds `a`, every part its columns of `b`.

use std::collections::HashMap;

use crate::error::LoraError;

/// A module peft adapts as one that the model holds as `parts` (module paths, in the order of
/// the fused output's rows). A [`LoraModule`](crate::LoraModule) reports them from
/// [`fused_modules`](crate::LoraModule::fused_modules).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FusedModule {
    /// The Hugging Face module's path (`model.layers.0.self_attn.qkv_proj`).
    pub path: String,
    /// The parts' paths (`...q_proj`, `...k_proj`, `...v_proj`).
    pub parts: Vec<String>,
}

/// Where a `Lora` layer sits in peft's view of the model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PeftModule<'a> {
    /// The module's path as peft names it (the fused module's for a part).
    pub path: &'a str,
    /// For a part: its index, the parts' count, and the first output row of the fused `b`
    /// that it holds.
    pub part: Option<Part>,
}

/// A part of a fused module.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Part {
    pub index: usize,
    pub count: usize,
    /// Its first row of the fused module's outputs, and the fused module's output count.
    pub offset: usize,
    pub fused_out: usize,
}

impl Part {
    /// The part that holds the shared `a`.
    pub fn is_first(&self) -> bool {
        self.index == 0
    }
}

/// The model's fused modules, indexed by part path, with each part's output width.
#[derive(Debug, Default)]
pub(crate) struct FusedIndex {
    parts: HashMap<String, (String, Part)>,
}

impl FusedIndex {
    /// The index of `modules`, whose parts' output widths are `widths` (by `Lora` path).
    pub fn new(
        modules: Vec<FusedModule>,
        widths: &HashMap<String, usize>,
    ) -> Result<Self, LoraError> {
        let mut parts = HashMap::new();
        for module in modules {
            let outs = module
                .parts
                .iter()
                .map(|p| {
                    widths.get(p).copied().ok_or_else(|| {
                        LoraError::InvalidConfig(format!(
                            "the fused module `{}` names the part `{p}`, which is not a Lora \
                             layer of the model",
                            module.path
                        ))
                    })
                })
                .collect::<Result<Vec<_>, _>>()?;
            let fused_out = outs.iter().sum();
            let mut offset = 0;
            for (index, (p, out)) in module.parts.iter().zip(&outs).enumerate() {
                let part = Part {
                    index,
                    count: outs.len(),
                    offset,
                    fused_out,
                };
                parts.insert(p.clone(), (module.path.clone(), part));
                offset += out;
            }
        }
        Ok(Self { parts })
    }

    /// Where the `Lora` layer at `path` sits in peft's view.
    pub fn locate<'a>(&'a self, path: &'a str) -> PeftModule<'a> {
        match self.parts.get(path) {
            Some((fused, part)) => PeftModule {
                path: fused,
                part: Some(*part),
            },
            None => PeftModule { path, part: None },
        }
    }
}
