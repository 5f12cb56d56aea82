//! The trainer's command line: each config of examples/configs given as
//! `--distributed-config FILE` is the same run as its flags (the same `DistributedConfig`, the
//! same losses bit for bit); a flag overrides the file, and keys the file leaves out keep the
//! trainer's defaults; an unknown name in a file or a flag is an error listing the valid names.

use std::path::{Path, PathBuf};

use burn_parallel::train::{
    Backend, BuiltinModel, Dtype, Malloc, OptimizerKind, Strategy, TpPlanName, TrainArgs,
    TrainConfig, ZeroDpStrategy, train,
};
use clap::Parser;

use crate::parallelize_config::temp_path;

/// Each file of examples/configs and the flags that say the same.
const AS_FLAGS: [(&str, &[&str]); 9] = [
    ("ddp", &["--strategy", "ddp", "--world-size", "2"]),
    ("fsdp2", &["--strategy", "fsdp2", "--world-size", "2"]),
    ("fsdp2_3", &["--strategy", "fsdp2", "--world-size", "3"]),
    (
        "fsdp2_tp",
        &["--strategy", "fsdp2_tp", "--world-size", "4", "--tp", "2"],
    ),
    (
        "hsdp",
        &[
            "--strategy",
            "hsdp",
            "--world-size",
            "4",
            "--dp-replicate",
            "2",
        ],
    ),
    (
        "megatron_fsdp",
        &[
            "--strategy",
            "megatron_fsdp",
            "--world-size",
            "3",
            "--zero-dp-strategy",
            "optim_grads_params",
            "--bucket-size",
            "1000000",
        ],
    ),
    (
        "megatron_fsdp_zero1_hsdp",
        &[
            "--strategy",
            "megatron_fsdp",
            "--world-size",
            "4",
            "--dp-replicate",
            "2",
            "--zero-dp-strategy",
            "1",
        ],
    ),
    ("single", &["--strategy", "single", "--world-size", "1"]),
    ("tp", &["--strategy", "tp", "--world-size", "2"]),
];

/// What every run here shares: the tiny Llama, 2 short steps on ndarray rank threads.
const TINY: [&str; 10] = [
    "--steps",
    "2",
    "--global-batch",
    "4",
    "--seq-len",
    "8",
    "--backend",
    "ndarray",
    "--engine",
    "threads",
];

fn configs_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/configs")
}

/// The trainer's command line, the program name first.
fn parse(args: &[&str]) -> Result<TrainArgs, clap::Error> {
    TrainArgs::try_parse_from(["train_llama"].iter().chain(TINY.iter()).chain(args))
}

/// The run `args` describe, or the error (of the parser or of the config) as text.
fn config_of(args: &[&str]) -> Result<TrainConfig, String> {
    let args = parse(args).map_err(|e| e.to_string())?;
    args.config().map_err(|e| e.to_string())
}

fn with_file(file: &Path, more: &[&str]) -> Result<TrainConfig, String> {
    let file = file.to_str().unwrap();
    let args: Vec<&str> = ["--distributed-config", file]
        .into_iter()
        .chain(more.iter().copied())
        .collect();
    config_of(&args)
}

fn loss_bits(cfg: &TrainConfig) -> Vec<u32> {
    let summary = train(cfg, &|_| {}).unwrap_or_else(|e| panic!("{cfg:?}: {e}"));
    summary.losses().iter().map(|l| l.to_bits()).collect()
}

/// An empty command line is `TrainConfig::default()`: the flags that are config fields declare
/// their defaults once, on the field, and the flags that describe other fields (the distributed
/// flags, --seq-len, --grad-clip, the data and LoRA flags) resolve to the same defaults.
#[test]
fn an_empty_command_line_is_the_default_config() {
    let parsed = TrainArgs::try_parse_from(["train_llama", "--engine", "threads"])
        .unwrap()
        .config()
        .unwrap();
    let default = TrainConfig::default();
    assert_eq!(parsed, default);
    // The figures the docs and the README quote.
    assert_eq!(
        (default.steps, default.global_batch, default.seq_len),
        (40, 8, 64)
    );
    assert_eq!((default.lr, default.grad_clip), (3e-3, Some(1.0)));
    assert_eq!(
        (default.beta1, default.beta2, default.eps),
        (0.9, 0.999, 1e-8)
    );
    // 0 turns clipping off.
    let off = TrainArgs::try_parse_from(["train_llama", "--engine", "threads", "--grad-clip", "0"])
        .unwrap()
        .config()
        .unwrap();
    assert_eq!(off.grad_clip, None);
}

#[test]
fn every_example_config_file_is_the_same_run_as_its_flags() {
    let mut files: Vec<String> = std::fs::read_dir(configs_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
        .collect();
    files.sort();
    let listed: Vec<&str> = AS_FLAGS.iter().map(|(name, _)| *name).collect();
    assert_eq!(
        files, listed,
        "one row of AS_FLAGS per file of examples/configs"
    );
    for (name, flags) in AS_FLAGS {
        let file = configs_dir().join(format!("{name}.toml"));
        let from_file = with_file(&file, &[]).unwrap_or_else(|e| panic!("{name}: {e}"));
        let from_flags = config_of(flags).unwrap_or_else(|e| panic!("{name} as flags: {e}"));
        assert_eq!(from_file.distributed, from_flags.distributed, "{name}");
        let (a, b) = (loss_bits(&from_file), loss_bits(&from_flags));
        assert_eq!(a.len(), 2, "{name}");
        assert_eq!(a, b, "{name}: the file's losses and the flags' differ");
    }
}

#[test]
fn flags_override_the_file_and_absent_keys_keep_the_trainers_defaults() {
    let dir = configs_dir();
    // The file's world size, replaced by the flag; its strategy kept.
    let cfg = with_file(&dir.join("fsdp2.toml"), &["--world-size", "3"]).unwrap();
    assert_eq!(
        cfg,
        config_of(&["--strategy", "fsdp2", "--world-size", "3"]).unwrap()
    );
    assert_eq!(train(&cfg, &|_| {}).unwrap().mesh.world(), 3);
    // A flag beats a table's key, and the other keys of the table stay the file's.
    let cfg = with_file(
        &dir.join("megatron_fsdp.toml"),
        &["--zero-dp-strategy", "optim_grads"],
    )
    .unwrap()
    .distributed;
    assert_eq!(
        cfg.megatron_fsdp.zero_dp_strategy,
        ZeroDpStrategy::OptimGrads
    );
    assert_eq!(cfg.megatron_fsdp.bucket_size, Some(1_000_000));
    // ZeRO-2 keeps gathered weights: the trainer's resharding default then stays unset.
    assert_eq!(cfg.reshard_after_forward, None);
    // A file without tp_size under fsdp2_tp gets the trainer's tp 2; a flag replaces it.
    let file = temp_path("trainer-fsdp2_tp.toml");
    std::fs::write(&file, "strategy = \"fsdp2_tp\"\nworld_size = 4\n").unwrap();
    assert_eq!(with_file(&file, &[]).unwrap().distributed.tp_size, 2);
    let wide = with_file(&file, &["--tp", "4"]).unwrap().distributed;
    assert_eq!((wide.tp_size, wide.world_size), (4, Some(4)));
    // The same layout in JSON and YAML is the same config.
    let toml = with_file(&dir.join("fsdp2_tp.toml"), &[]).unwrap();
    for (ext, text) in [
        (
            "json",
            r#"{"strategy": "fsdp2_tp", "world_size": 4, "tp_size": 2}"#,
        ),
        ("yaml", "strategy: fsdp2_tp\nworld_size: 4\ntp_size: 2\n"),
    ] {
        let file = temp_path(&format!("trainer-fsdp2_tp.{ext}"));
        std::fs::write(&file, text).unwrap();
        assert_eq!(with_file(&file, &[]).unwrap(), toml, "{ext}");
    }
    // `--param-dtype f32` is no cast, as the file's absent key.
    let f32_flag = config_of(&["--param-dtype", "f32"]).unwrap();
    assert_eq!(f32_flag.distributed.mp_policy.param_dtype, None);
    assert_eq!(f32_flag, config_of(&[]).unwrap());
    let bf16 = config_of(&["--param-dtype", "bfloat16"]).unwrap();
    assert_eq!(bf16.distributed.mp_policy.param_dtype, Some(Dtype::Bf16));
}

/// The error names the word and lists every name of its enum's table.
#[track_caller]
fn assert_lists(err: &str, word: &str, names: &[&str]) {
    assert!(err.contains(&format!("`{word}`")), "{word}: {err}");
    for name in names {
        assert!(err.contains(name), "{word}: {name} missing from {err}");
    }
}

#[test]
fn unknown_names_in_a_file_or_a_flag_are_errors_listing_the_valid_names() {
    for (file, text, word, names) in [
        (
            "strategy.toml",
            "strategy = \"fsdp3\"\n",
            "fsdp3",
            Strategy::NAMES,
        ),
        (
            "dtype.toml",
            "[mp_policy]\nparam_dtype = \"f8\"\n",
            "f8",
            Dtype::NAMES,
        ),
        (
            "zero.yaml",
            "strategy: megatron_fsdp\nmegatron_fsdp:\n  zero_dp_strategy: 4\n",
            "4",
            ZeroDpStrategy::NAMES,
        ),
    ] {
        let path = temp_path(&format!("trainer-unknown-{file}"));
        std::fs::write(&path, text).unwrap();
        let err = with_file(&path, &[]).expect_err(file);
        assert!(err.contains(path.to_str().unwrap()), "{err}");
        assert_lists(&err, word, names);
    }
    for (flag, word, names) in [
        ("--strategy", "fsdp3", Strategy::NAMES),
        ("--zero-dp-strategy", "4", ZeroDpStrategy::NAMES),
        ("--param-dtype", "f8", Dtype::NAMES),
        ("--reduce-dtype", "f8", Dtype::NAMES),
        ("--tp-plan", "gpt", TpPlanName::NAMES),
        ("--optimizer", "adam", OptimizerKind::NAMES),
        ("--backend", "gpu", Backend::NAMES),
        ("--model", "huge", BuiltinModel::NAMES),
        ("--malloc", "never", Malloc::NAMES),
    ] {
        // Alone: TINY gives some of these flags already.
        let err = TrainArgs::try_parse_from(["train_llama", flag, word])
            .expect_err(flag)
            .to_string();
        assert!(err.contains(flag), "{err}");
        assert_lists(&err, word, names);
    }
}

/// `--threads-per-rank` sets each rank's compute pool; the run is the same computation, and a
/// zero is refused at launch with a message naming it.
#[test]
fn threads_per_rank_sets_the_compute_pool_and_zero_is_an_error() {
    let two = config_of(&[
        "--strategy",
        "ddp",
        "--world-size",
        "2",
        "--threads-per-rank",
        "2",
    ])
    .unwrap();
    assert_eq!(two.threads_per_rank, Some(2));
    let one = TrainConfig {
        threads_per_rank: Some(1),
        ..two.clone()
    };
    // Matmul blocking does not depend on the thread count: the same bits.
    assert_eq!(loss_bits(&one), loss_bits(&two));
    let zero = TrainConfig {
        threads_per_rank: Some(0),
        ..two
    };
    let err = train(&zero, &|_| {}).unwrap_err().to_string();
    assert!(err.contains("threads per rank must be at least 1"), "{err}");
}
