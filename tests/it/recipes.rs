//! `--recipe`: NeMo AutoModel's recipe sections read into the trainer's flags. The recipes in
//! examples/recipes/ resolve to the runs their keys say (CI also runs each for 2 steps);
//! flags override a recipe; unknown sections, keys and `_target_`s are named errors listing
//! the valid ones; `dp_size: none` is the rest of the world and a given dp_size counts the
//! replicas too; `--print-recipe`'s output reads back to itself.

use std::path::{Path, PathBuf};

use burn_parallel::train::{OptimizerKind, Strategy, TrainArgs, TrainConfig};

use crate::llama_hf::temp_dir;

fn args(list: &[&str]) -> Result<TrainArgs, String> {
    let argv = std::iter::once("train_llama").chain(list.iter().copied());
    TrainArgs::parse_with_recipe(argv).map_err(|e| e.to_string())
}

fn config(list: &[&str]) -> TrainConfig {
    let parsed = args(list).unwrap_or_else(|e| panic!("{list:?}: {e}"));
    parsed.config().unwrap_or_else(|e| panic!("{list:?}: {e}"))
}

fn example(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("examples/recipes")
        .join(name)
        .display()
        .to_string()
}

/// `text` written to `dir/name`.
fn recipe_file(dir: &Path, name: &str, text: &str) -> String {
    let path: PathBuf = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

#[test]
fn the_example_recipes_resolve_to_the_runs_they_describe() {
    let lora = config(&["--recipe", &example("lora_chat_sft.yaml")]);
    assert_eq!(lora.lora.rank, Some(8));
    assert_eq!(lora.lora.alpha, Some(16.0));
    assert_eq!(lora.distributed.strategy, Strategy::Fsdp2);
    assert_eq!(lora.world_size().unwrap(), 2);
    assert_eq!((lora.optimizer, lora.lr), (OptimizerKind::AdamW, 1e-3));
    // global 8 rows a step, 2 per rank per micro-step on 2 ranks: 2 micro-steps of 4.
    assert_eq!((lora.global_batch, lora.grad_accum), (4, 2));
    assert_eq!((lora.steps, lora.seq_len, lora.seed), (20, 128, 1234));
    assert_eq!(lora.save_every, Some(10));
    assert_eq!(lora.data_options.eval_every, 10);

    let pretrain = config(&["--recipe", &example("pretrain.yaml")]);
    assert!(!pretrain.lora.enabled());
    // dp_size 4 fixes the world at 4.
    assert_eq!(pretrain.world_size().unwrap(), 4);
    assert_eq!((pretrain.global_batch, pretrain.grad_accum), (16, 2));
    assert_eq!(
        (pretrain.beta1, pretrain.beta2, pretrain.weight_decay),
        (0.9, 0.95, 0.1)
    );
    assert!(pretrain.save.as_ref().unwrap().ends_with("consolidated"));
    assert_eq!(
        pretrain.model.hidden_size, 1024,
        "examples/models/llama_95m.json"
    );
}

#[test]
fn flags_override_the_recipe() {
    let cfg = config(&[
        "--recipe",
        &example("lora_chat_sft.yaml"),
        "--steps",
        "3",
        "--lr",
        "0.5",
        "--world-size",
        "4",
        "--lora-rank",
        "2",
    ]);
    assert_eq!((cfg.steps, cfg.lr, cfg.lora.rank), (3, 0.5, Some(2)));
    assert_eq!(cfg.world_size().unwrap(), 4);
    // 8 rows a step at 2 per rank on 4 ranks: one micro-step.
    assert_eq!((cfg.global_batch, cfg.grad_accum), (8, 1));
    // A flag given before --recipe overrides it too.
    let cfg = config(&["--steps", "5", "--recipe", &example("pretrain.yaml")]);
    assert_eq!(cfg.steps, 5);
}

#[test]
fn unknown_sections_keys_and_targets_are_named_with_the_valid_ones() {
    let dir = temp_dir("recipes-bad");
    let cases = [
        (
            "section.yaml",
            "trainerr:\n  steps: 2\n",
            &["unknown section `trainerr`", "step_scheduler"][..],
        ),
        (
            "key.yaml",
            "peft:\n  rank: 8\n",
            &["unknown key `peft.rank`", "dim, alpha"][..],
        ),
        (
            "target.yaml",
            "dataset:\n  _target_: nemo_automodel.components.datasets.llm.squad.make_squad_dataset\n",
            &["make_squad_dataset", "ChatDataset"][..],
        ),
        (
            "distributed.yaml",
            "distributed:\n  _target_: foo.ZeroManager\n",
            &["foo.ZeroManager", "FSDP2Manager"][..],
        ),
        (
            "dropout.yaml",
            "peft:\n  dim: 4\n  dropout: 0.1\n",
            &["dropout", "not implemented"][..],
        ),
        (
            "adam.yaml",
            "optimizer:\n  _target_: torch.optim.Adam\n  weight_decay: 0.1\n",
            &["Adam", "AdamW"][..],
        ),
        ("config-key.yaml", "distributed:\n  tp: 2\n", &["tp"][..]),
        (
            "dp.yaml",
            "distributed:\n  dp_size: 3\n  dp_replicate_size: 2\n",
            &["dp_size: 3"][..],
        ),
        ("ext.txt", "rng:\n  seed: 1\n", &["unknown extension"][..]),
    ];
    for (name, text, needles) in cases {
        let path = recipe_file(&dir, name, text);
        let msg = match args(&["--recipe", &path]) {
            Err(e) => e,
            Ok(a) => a.config().map(|_| ()).unwrap_err().to_string(),
        };
        for needle in needles {
            assert!(msg.contains(needle), "{name}: `{needle}` not in: {msg}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn dp_size_none_is_the_rest_of_the_world_and_a_given_one_counts_replicas() {
    let dir = temp_dir("recipes-dp");
    let none = recipe_file(
        &dir,
        "none.yaml",
        "distributed:\n  _target_: nemo_automodel.components.distributed.fsdp2.FSDP2Manager\n  \
         dp_size: none\n  tp_size: 2\n  sequence_parallel: true\n",
    );
    let cfg = config(&["--recipe", &none, "--world-size", "6"]);
    let plan = cfg.distributed.plan(6).unwrap();
    assert_eq!((plan.sizes().dp(), plan.sizes().tp), (3, 2));
    assert!(cfg.distributed.sequence_parallel);
    let hsdp = recipe_file(
        &dir,
        "hsdp.yaml",
        "distributed:\n  _target_: nemo_automodel.components.distributed.fsdp2.FSDP2Manager\n  \
         dp_size: 4\n  dp_replicate_size: 2\n",
    );
    let cfg = config(&["--recipe", &hsdp]);
    assert_eq!(cfg.world_size().unwrap(), 4);
    let sizes = cfg.distributed.plan(4).unwrap().sizes();
    assert_eq!((sizes.dp(), sizes.dp_replicate), (4, 2));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_printed_recipe_reads_back_to_itself() {
    let dir = temp_dir("recipes-print");
    for (recipe, extra) in [
        ("lora_chat_sft.yaml", &[][..]),
        (
            "pretrain.yaml",
            &["--grad-clip", "0", "--lr-schedule", "linear"][..],
        ),
    ] {
        let mut list = vec!["--recipe".to_string(), example(recipe)];
        list.extend(extra.iter().map(|s| s.to_string()));
        let list: Vec<&str> = list.iter().map(String::as_str).collect();
        let first = args(&list).unwrap();
        let printed = first.recipe_yaml(&first.config().unwrap());
        let path = recipe_file(&dir, recipe, &printed);
        let again = args(&["--recipe", &path]).unwrap();
        assert_eq!(
            again.recipe_yaml(&again.config().unwrap()),
            printed,
            "{recipe}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
