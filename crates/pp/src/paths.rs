//! How a stage's parameters are named in the whole model: what a sharded checkpoint keys them
//! by, so that a checkpoint saved under one pipeline split loads under another (or without
//! pipeline parallelism).

/// A pipeline stage whose module paths differ from the whole model's (a stage's layers are
/// usually renumbered from 0). Sharded checkpoints of stages
/// (`burn_parallel_checkpoint::save_stages`, `Checkpoint::load_stages`) store and look up
/// every parameter, and its optimizer state, by [`global_path`](Self::global_path).
///
/// A whole model needs no implementation: the plain `save` and `Checkpoint::load` keep its
/// paths as they are.
pub trait StageParamPaths {
    /// This stage's index in the whole pipeline (stage `c * p + r` for chunk `c` of pipeline
    /// rank `r` under the interleaved schedule): a checkpoint lists the stages' parameters in
    /// this order.
    fn stage_index(&self) -> usize;

    /// The whole model's path of this stage's parameter `local` (a Burn module path such as
    /// `layers.0.mlp.up_proj.weight`; on a stage whose first layer is the model's layer 2,
    /// `layers.2.mlp.up_proj.weight`).
    fn global_path(&self, local: &str) -> String;
}

/// `local` with the number after a leading `prefix` (`layers.`) shifted by `offset`: the
/// mapping of a stage that holds a slice of a numbered list of layers. Paths outside the list
/// are returned unchanged.
///
/// `renumber("layers.", 2, "layers.0.mlp.up_proj.weight") == "layers.2.mlp.up_proj.weight"`.
pub fn renumber(prefix: &str, offset: usize, local: &str) -> String {
    let Some(rest) = local.strip_prefix(prefix) else {
        return local.to_string();
    };
    let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
    let (number, tail) = rest.split_at(digits);
    match number.parse::<usize>() {
        Ok(n) if tail.is_empty() || tail.starts_with('.') => {
            format!("{prefix}{}{tail}", n + offset)
        }
        _ => local.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::renumber;

    #[test]
    fn renumbers_only_the_layer_index() {
        assert_eq!(
            renumber("layers.", 2, "layers.0.mlp.up_proj.weight"),
            "layers.2.mlp.up_proj.weight"
        );
        assert_eq!(renumber("layers.", 3, "layers.11"), "layers.14");
        assert_eq!(
            renumber("layers.", 2, "embed_tokens.weight"),
            "embed_tokens.weight"
        );
        assert_eq!(renumber("layers.", 2, "layers.x.weight"), "layers.x.weight");
        assert_eq!(
            renumber("layers.", 2, "layers.1x.weight"),
            "layers.1x.weight"
        );
        assert_eq!(renumber("layers.", 0, "layers.5.w"), "layers.5.w");
    }
}
