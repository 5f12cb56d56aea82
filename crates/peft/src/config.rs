//! Which modules get an adapter and how it is scaled: peft's `LoraConfig` (`r`, `lora_alpha`,
//! `target_modules`, `use_rslora`).

use crate::error::LoraError;

/// How to build LoRA adapters and where to put them.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    /// The adapter rank `r` (`a: [in, r]`, `b: [r, out]`).
    pub r: usize,
    /// peft's `lora_alpha`: the adapter output is scaled by `alpha / r` (`alpha / sqrt(r)`
    /// with [`rslora`](Self::rslora)).
    pub alpha: f64,
    /// Module names, as peft's `target_modules`: a `Lora` module whose path equals a target or
    /// ends with `.` + target gets an adapter (`q_proj` matches `layers.0.self_attn.q_proj`).
    pub targets: Vec<String>,
    /// Rank-stabilized LoRA: scale by `alpha / sqrt(r)`.
    pub rslora: bool,
    /// Seed of `a`'s initialization. Every rank derives the same `a` from it and the module
    /// path, so data- and tensor-parallel ranks start from identical adapters.
    pub seed: u64,
}

impl LoraConfig {
    /// Rank `r`, scale numerator `alpha`, adapters on the modules named `targets`; plain LoRA
    /// scaling and seed 0.
    pub fn new(r: usize, alpha: f64, targets: &[&str]) -> Self {
        Self {
            r,
            alpha,
            targets: targets.iter().map(|t| t.to_string()).collect(),
            rslora: false,
            seed: 0,
        }
    }

    /// With rank-stabilized scaling (`alpha / sqrt(r)`) on or off.
    pub fn with_rslora(mut self, rslora: bool) -> Self {
        self.rslora = rslora;
        self
    }

    /// With the seed of `a`'s initialization.
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// The factor the adapter's output is multiplied by.
    pub fn scale(&self) -> f64 {
        match self.rslora {
            true => self.alpha / (self.r as f64).sqrt(),
            false => self.alpha / self.r as f64,
        }
    }

    /// Whether the module at `path` is a target (peft's rule for a list of names: equal, or a
    /// suffix after a dot). Returns the index of the first matching target.
    pub fn target_of(&self, path: &str) -> Option<usize> {
        self.targets.iter().position(|t| {
            path == t
                || path
                    .strip_suffix(t.as_str())
                    .is_some_and(|head| head.ends_with('.'))
        })
    }

    /// Refuses a config that cannot build an adapter.
    pub fn validate(&self) -> Result<(), LoraError> {
        let bad = |what: String| Err(LoraError::InvalidConfig(what));
        if self.r == 0 {
            return bad("r is 0; give the adapter rank, e.g. 8".into());
        }
        if !self.alpha.is_finite() || self.alpha == 0.0 {
            return bad(format!(
                "alpha is {}; give a finite non-zero alpha (peft's lora_alpha, often 2 * r)",
                self.alpha
            ));
        }
        if self.targets.is_empty() || self.targets.iter().any(|t| t.is_empty()) {
            return bad(format!(
                "targets {:?} must be non-empty module names, e.g. [\"q_proj\", \"v_proj\"]",
                self.targets
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_match_whole_names_or_dotted_suffixes_as_peft_does() {
        let c = LoraConfig::new(4, 8.0, &["q_proj", "mlp.down_proj"]);
        assert_eq!(c.target_of("layers.0.self_attn.q_proj"), Some(0));
        assert_eq!(c.target_of("q_proj"), Some(0));
        assert_eq!(c.target_of("layers.0.self_attn.qq_proj"), None);
        assert_eq!(c.target_of("layers.1.mlp.down_proj"), Some(1));
        assert_eq!(c.target_of("layers.1.xmlp.down_proj"), None);
        assert_eq!(c.scale(), 2.0);
        assert_eq!(c.clone().with_rslora(true).scale(), 4.0);
    }

    #[test]
    fn a_config_without_rank_alpha_or_targets_is_refused_by_name() {
        let err = |c: LoraConfig| c.validate().unwrap_err().to_string();
        assert!(err(LoraConfig::new(0, 8.0, &["q_proj"])).contains("r is 0"));
        assert!(err(LoraConfig::new(4, 0.0, &["q_proj"])).contains("alpha is 0"));
        assert!(err(LoraConfig::new(4, 8.0, &[])).contains("targets"));
    }
}
