//! The trainer on tokenized text and SFT records (tests/data/, made by
//! scripts/make_text_fixtures.py): the tokenizer gives Hugging Face's Python ids; SFT and text
//! pretraining train under ddp 2, fsdp2 x3, tp 2 and fsdp2_tp 2x2 as on one device, with rows
//! whose completion token counts differ between ranks; the SFT loss of a batch is the masked
//! mean computed here from the model's logits without the trainer; K=2 accumulation equals the
//! doubled batch; the eval loss equals a forward-only computation; bad data is named.

use std::path::{Path, PathBuf};

use burn::tensor::{Int, Tensor, TensorData};
use burn_parallel::models::{Llama, LlamaConfig};
use burn_parallel::train::data::tokenizer::TextTokenizer;
use burn_parallel::train::data::{self, DataOptions, EvalBatches};
use burn_parallel::train::{Strategy, TrainConfig, TrainSummary, train};

use crate::common::{ndarray, to_vec};
use crate::llama_train::{assert_curves, run};

pub(crate) fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

/// The small test Llama with the fixture tokenizer's 320 ids.
pub(crate) fn text_model() -> LlamaConfig {
    LlamaConfig {
        vocab_size: 320,
        ..crate::llama_train::small_model()
    }
}

/// The small Llama on `data` (a tests/data file) with the fixture tokenizer: 2 steps of 4 rows
/// of at most 32 positions, ndarray, AdamW, no clipping.
pub(crate) fn text_run(strategy: Strategy, world: usize, data: &str) -> TrainConfig {
    TrainConfig {
        steps: 2,
        seq_len: 32,
        model: text_model(),
        data: Some(fixture(data)),
        data_options: DataOptions {
            tokenizer: Some(fixture("tokenizer.json")),
            ..DataOptions::default()
        },
        ..crate::train_guards::tiny_run(strategy, world, &[])
    }
}

fn expected() -> serde_json::Value {
    let text = std::fs::read_to_string(fixture("expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn ids_of(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn tokenizer() -> TextTokenizer {
    TextTokenizer::load(&fixture("tokenizer.json")).unwrap()
}

/// The SFT records of tests/data/sft.jsonl as (prompt, completion).
fn sft_records() -> Vec<(String, String)> {
    std::fs::read_to_string(fixture("sft.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (
                v["prompt"].as_str().unwrap().to_string(),
                v["completion"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// Example `i` as this test builds it: bos + prompt + completion + eos, and the index of the
/// first id that counts as a target (the completion's first).
fn sft_ids(tok: &TextTokenizer, i: usize) -> (Vec<u32>, usize) {
    let (prompt, completion) = &sft_records()[i];
    let p = tok.encode(prompt, &|| "prompt".into()).unwrap();
    let c = tok.encode(completion, &|| "completion".into()).unwrap();
    let mut ids = vec![tok.bos.as_ref().unwrap().id];
    ids.extend(&p);
    ids.extend(&c);
    ids.push(tok.eos.as_ref().unwrap().id);
    (ids, 1 + p.len())
}

/// Sum and count of the cross-entropy of the targets `ids[first..]` given the model's logits
/// of `ids[..-1]` alone (one unpadded row), in f64.
pub(crate) fn example_ce(model: &Llama, ids: &[u32], first: usize) -> (f64, usize) {
    let n = ids.len() - 1;
    let input: Vec<i64> = ids[..n].iter().map(|x| *x as i64).collect();
    let logits = model.forward(Tensor::<2, Int>::from_data(
        TensorData::new(input, [1, n]),
        &ndarray(),
    ));
    let vocab = logits.dims()[2];
    let logits = to_vec(&logits.into_data());
    let (mut sum, mut count) = (0.0, 0);
    for p in first.max(1) - 1..n {
        let row = &logits[p * vocab..(p + 1) * vocab];
        let max = row.iter().fold(f32::MIN, |a, b| a.max(*b)) as f64;
        let lse = max
            + row
                .iter()
                .map(|x| (*x as f64 - max).exp())
                .sum::<f64>()
                .ln();
        sum += lse - row[ids[p + 1] as usize] as f64;
        count += 1;
    }
    (sum, count)
}

#[test]
fn the_tokenizer_gives_hugging_faces_ids_and_specials() {
    let tok = tokenizer();
    let want = expected();
    assert_eq!(tok.vocab_size(), 320);
    assert_eq!(tok.bos.as_ref().unwrap().text, "<s>");
    // eos is written as a {"content": ...} object in tokenizer_config.json.
    assert_eq!(tok.eos.as_ref().unwrap().text, "</s>");
    assert_eq!(tok.pad.as_ref().unwrap().text, "<pad>");
    let (ids, first) = sft_ids(&tok, 0);
    assert_eq!(ids, ids_of(&want["sft_first"]));
    assert_eq!(first as u64, want["sft_first_prompt_len"].as_u64().unwrap());
    let text = std::fs::read_to_string(fixture("text.txt")).unwrap();
    let ids = tok.encode(&text, &|| "text".into()).unwrap();
    assert_eq!(ids[..40], ids_of(&want["text_first_40"])[..]);
}

/// The rows each of `dp` ranks holds at step 0 count different numbers of targets.
fn counts_per_rank(cfg: &TrainConfig, dp: usize) -> Vec<usize> {
    let d = data::load(
        cfg.data.as_ref().unwrap(),
        &cfg.data_options,
        cfg.seq_len,
        320,
        "--data",
    )
    .unwrap();
    let b = cfg.global_batch;
    let pad = d.longest(0..b, None);
    (0..dp)
        .map(|r| d.batch(r * b / dp..(r + 1) * b / dp, None, pad).count())
        .collect()
}

#[test]
fn sft_and_text_train_under_every_strategy_as_on_one_device() {
    let layouts = [
        (Strategy::Ddp, 2),
        (Strategy::Fsdp2, 3),
        (Strategy::Tp, 2),
        (Strategy::Fsdp2Tp, 4),
    ];
    for file in ["sft.jsonl", "text.txt", "text.jsonl", "chat.jsonl"] {
        let single = run(&text_run(Strategy::Single, 1, file));
        assert!(single.losses().iter().all(|l| l.is_finite()), "{file}");
        if file == "sft.jsonl" {
            // Different numbers of counting targets on the two dp ranks.
            let counts = counts_per_rank(&text_run(Strategy::Ddp, 2, file), 2);
            assert_ne!(counts[0], counts[1], "{counts:?}");
        }
        for (strategy, world) in layouts {
            let got = run(&text_run(strategy, world, file));
            assert_curves(&got, &single, 1e-5, &format!("{file} {strategy} x{world}"));
        }
    }
}

/// Step 0's loss of 4 SFT rows (padded together, two of them truncated at 16 positions) is
/// the sum of the completion targets' cross-entropy over their count, computed here on each
/// example alone from the seeded model's logits.
#[test]
fn the_sft_loss_is_the_masked_mean_over_the_global_batch() {
    let seq = 16;
    let cfg = TrainConfig {
        seq_len: seq,
        steps: 1,
        ..text_run(Strategy::Single, 1, "sft.jsonl")
    };
    let got = run(&cfg).steps[0].report.loss as f64;
    let ddp = run(&TrainConfig {
        steps: 1,
        ..text_run(Strategy::Ddp, 2, "sft.jsonl")
    });
    let tok = tokenizer();
    let model = Llama::seeded(&text_model(), cfg.seed, &ndarray());
    let (mut sum, mut count) = (0.0, 0);
    let mut truncated = 0;
    for i in 0..cfg.global_batch {
        let (mut ids, first) = sft_ids(&tok, i);
        if ids.len() > seq + 1 {
            ids.truncate(seq + 1);
            truncated += 1;
        }
        let (s, c) = example_ce(&model, &ids, first);
        sum += s;
        count += c;
    }
    assert!(truncated > 0, "the batch exercises truncation");
    let want = sum / count as f64;
    assert!((got - want).abs() <= 1e-5 * want, "{got} vs {want}");
    // Without truncation (seq 32 fits every example) ddp 2 gives the untruncated mean.
    let (mut sum, mut count) = (0.0, 0);
    for i in 0..4 {
        let (ids, first) = sft_ids(&tok, i);
        assert!(ids.len() <= 33);
        let (s, c) = example_ce(&model, &ids, first);
        sum += s;
        count += c;
    }
    let want = sum / count as f64;
    let got = ddp.steps[0].report.loss as f64;
    assert!((got - want).abs() <= 1e-5 * want, "ddp: {got} vs {want}");
}

fn accumulated(cfg: TrainConfig) -> (TrainSummary, TrainSummary) {
    let doubled = run(&TrainConfig {
        global_batch: 4,
        grad_accum: 1,
        steps: 3,
        ..cfg.clone()
    });
    let accumulated = run(&TrainConfig {
        global_batch: 2,
        grad_accum: 2,
        steps: 3,
        ..cfg
    });
    (accumulated, doubled)
}

/// `--grad-accum 2` of 2 rows equals one step of 4 rows: the same data, loss, gradient norm and
/// updates (the losses of later steps), SFT (different counts per micro-batch) and text, on one
/// device, ddp 2, fsdp2 2 (deferred reduce-scatter) and tp 2.
#[test]
fn accumulating_two_micro_batches_equals_the_doubled_batch() {
    for (strategy, world) in [
        (Strategy::Single, 1),
        (Strategy::Ddp, 2),
        (Strategy::Fsdp2, 2),
        (Strategy::Tp, 2),
    ] {
        for file in ["sft.jsonl", "text.txt"] {
            let (acc, doubled) = accumulated(TrainConfig {
                grad_clip: Some(1.0),
                ..text_run(strategy, world, file)
            });
            assert_curves(&acc, &doubled, 1e-5, &format!("{file} {strategy} x{world}"));
        }
    }
}

/// `--eval-data` at lr 0: every eval loss is the seeded model's masked mean over the first
/// `--eval-batches` batches, computed here forward-only; fsdp2 x2 and tp 2 report the same.
#[test]
fn the_eval_loss_equals_a_forward_only_computation() {
    let eval = |strategy, world| TrainConfig {
        lr: 0.0,
        steps: 3,
        data_options: DataOptions {
            tokenizer: Some(fixture("tokenizer.json")),
            eval_data: Some(fixture("sft.jsonl")),
            eval_every: 2,
            eval_batches: EvalBatches::First(2),
            ..DataOptions::default()
        },
        ..text_run(strategy, world, "text.txt")
    };
    let single = run(&eval(Strategy::Single, 1));
    let evals: Vec<Option<f32>> = single.steps.iter().map(|s| s.eval_loss).collect();
    // After steps 2 and 3 (every 2, and the last).
    assert!(
        evals[0].is_none() && evals[1].is_some() && evals[2].is_some(),
        "{evals:?}"
    );
    let tok = tokenizer();
    let model = Llama::seeded(&text_model(), 0, &ndarray());
    let (mut sum, mut count) = (0.0, 0);
    for i in 0..8 {
        let (ids, first) = sft_ids(&tok, i);
        let (s, c) = example_ce(&model, &ids, first);
        sum += s;
        count += c;
    }
    let want = sum / count as f64;
    for got in evals.iter().flatten() {
        assert!((*got as f64 - want).abs() <= 1e-5 * want, "{got} vs {want}");
    }
    for (strategy, world) in [(Strategy::Fsdp2, 2), (Strategy::Tp, 2)] {
        let got = run(&eval(strategy, world));
        for (g, w) in got.steps.iter().zip(&single.steps) {
            let (g, w) = (g.eval_loss, w.eval_loss);
            assert_eq!(g.is_some(), w.is_some());
            if let (Some(g), Some(w)) = (g, w) {
                assert!((g - w).abs() <= 1e-5 * w, "{strategy}: {g} vs {w}");
            }
        }
        // The training loss is untouched by evaluation.
        assert_curves(&got, &single, 1e-5, &format!("{strategy} with eval"));
    }
}

fn error_of(cfg: &TrainConfig) -> String {
    match train(cfg, &|_| {}) {
        Ok(_) => panic!("{cfg:?} must fail"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_data_is_named_with_its_file_line_and_field() {
    let dir = crate::llama_hf::temp_dir("bad-data");
    let with = |name: &str, text: &str| {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        TrainConfig {
            data: Some(path),
            ..text_run(Strategy::Single, 1, "sft.jsonl")
        }
    };
    let e = error_of(&with(
        "a.jsonl",
        "{\"prompt\": \"a\", \"completion\": \"b\"}\n\n{\"prompt\": 1}\n",
    ));
    assert!(
        e.contains("a.jsonl line 3") && e.contains("\"prompt\""),
        "{e}"
    );
    let e = error_of(&with(
        "b.jsonl",
        "{\"prompt\": \"a\", \"completion\": \"b\"}\nnot json\n",
    ));
    assert!(
        e.contains("b.jsonl line 2") && e.contains("not JSON"),
        "{e}"
    );
    let e = error_of(&TrainConfig {
        data_options: DataOptions::default(),
        ..text_run(Strategy::Single, 1, "text.txt")
    });
    assert!(e.contains("--tokenizer"), "{e}");
    let e = error_of(&TrainConfig {
        model: LlamaConfig::tiny(),
        ..text_run(Strategy::Single, 1, "text.txt")
    });
    assert!(e.contains("vocab_size 256"), "{e}");
    // A batch whose logits cannot fit in memory is refused before anything is allocated.
    let e = error_of(&TrainConfig {
        global_batch: 1 << 22,
        seq_len: 2048,
        data_options: DataOptions {
            pad_to_seq_len: true,
            ..text_run(Strategy::Single, 1, "sft.jsonl").data_options
        },
        ..text_run(Strategy::Single, 1, "sft.jsonl")
    });
    assert!(
        e.contains("logits need") && e.contains("--global-batch"),
        "{e}"
    );
}

/// The data flags on the command line: each sets its `DataOptions` field; `--seq-len` given
/// pads SFT rows to it; `--eval-data` and `--eval-every` go together.
#[test]
fn the_data_flags_parse_into_the_run() {
    use burn_parallel::train::TrainArgs;
    use clap::Parser;
    let parse = |extra: &[&str]| {
        let args = ["train_llama", "--engine", "threads", "--data", "d.jsonl"];
        TrainArgs::try_parse_from(args.iter().chain(extra))
    };
    let cfg = parse(&[
        "--tokenizer",
        "t.json",
        "--pack",
        "--shuffle-seed",
        "7",
        "--eval-data",
        "e.jsonl",
        "--eval-every",
        "5",
        "--eval-batches",
        "3",
        "--grad-accum",
        "4",
    ])
    .unwrap()
    .config()
    .unwrap();
    assert_eq!(
        cfg.data_options,
        DataOptions {
            tokenizer: Some("t.json".into()),
            pack: true,
            shuffle_seed: Some(7),
            pad_to_seq_len: false,
            eval_data: Some("e.jsonl".into()),
            eval_every: 5,
            eval_batches: EvalBatches::First(3),
            strict_data: false,
        }
    );
    assert_eq!((cfg.grad_accum, cfg.seq_len), (4, 64));
    let cfg = parse(&["--seq-len", "32"]).unwrap().config().unwrap();
    assert!(cfg.data_options.pad_to_seq_len && cfg.seq_len == 32);
    assert_eq!(cfg.grad_accum, 1);
    assert!(parse(&["--eval-data", "e.jsonl"]).is_err());
    let e = error_of(&TrainConfig {
        grad_accum: 0,
        ..text_run(Strategy::Single, 1, "sft.jsonl")
    });
    assert!(e.contains("--grad-accum"), "{e}");
}

/// `--shuffle-seed`: each epoch's own permutation of the 12 SFT examples (3 steps of 4 = one
/// epoch, then the next epoch's order), the same under ddp 2 as on one device, and another
/// order than the file's.
#[test]
fn shuffled_sft_trains_alike_under_ddp_and_differs_from_file_order() {
    let shuffled = |strategy, world| {
        let mut cfg = text_run(strategy, world, "sft.jsonl");
        cfg.steps = 4;
        cfg.data_options.shuffle_seed = Some(5);
        cfg
    };
    let single = run(&shuffled(Strategy::Single, 1));
    assert_curves(
        &run(&shuffled(Strategy::Ddp, 2)),
        &single,
        1e-5,
        "shuffled ddp x2",
    );
    let ordered = run(&TrainConfig {
        steps: 4,
        ..text_run(Strategy::Single, 1, "sft.jsonl")
    });
    assert_ne!(single.steps[0].report.loss, ordered.steps[0].report.loss);
    // Step 0 takes permutation(12, 5, 0)[0..4]: its loss is those examples' masked mean.
    let opts = shuffled(Strategy::Single, 1).data_options;
    let d = data::load(&fixture("sft.jsonl"), &opts, 32, 320, "--data").unwrap();
    let p = data::permutation(12, 5, 0);
    let (by_seed, by_perm) = (d.batch(0..4, Some(5), 32), {
        let rows: Vec<_> = p[..4]
            .iter()
            .map(|k| d.batch(*k..*k + 1, None, 32))
            .collect();
        rows.iter()
            .flat_map(|b| b.inputs.clone())
            .collect::<Vec<_>>()
    });
    assert_eq!(by_seed.inputs, by_perm);
}

/// `--save` after a LoRA chat fine-tune writes a directory Hugging Face tools load whole: the
/// tokenizer files beside `--tokenizer`, the tokenizer's bos/eos/pad ids in config.json, and a
/// generation_config.json whose eos ids include ChatML's `<|im_end|>` (the template's end of
/// turn); every file parses, and the saved model trains again from it.
#[test]
fn a_saved_chat_fine_tune_is_a_complete_model_directory() {
    use burn_parallel::train::LoraOptions;

    let dir = crate::llama_hf::temp_dir("complete-model-dir");
    let saved = dir.join("model");
    crate::llama_train::run(&TrainConfig {
        save: Some(saved.clone()),
        lora: LoraOptions {
            rank: Some(2),
            alpha: Some(4.0),
            ..LoraOptions::default()
        },
        ..text_run(Strategy::Fsdp2, 2, "chat.jsonl")
    });
    let json = |name: &str| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(saved.join(name)).unwrap())
            .unwrap_or_else(|e| panic!("{name}: {e}"))
    };
    let tok = tokenizer();
    let config = json("config.json");
    assert_eq!(config["bos_token_id"], tok.bos.as_ref().unwrap().id);
    assert_eq!(config["eos_token_id"], tok.eos.as_ref().unwrap().id);
    assert_eq!(config["pad_token_id"], tok.pad.as_ref().unwrap().id);
    let generation = json("generation_config.json");
    let im_end = tok.token_id("<|im_end|>").expect("ChatML's end of turn");
    assert_eq!(
        generation["eos_token_id"],
        serde_json::json!([tok.eos.as_ref().unwrap().id, im_end])
    );
    json("tokenizer_config.json");
    let copied = TextTokenizer::load(&saved.join("tokenizer.json")).unwrap();
    assert_eq!(copied.chat_template, tok.chat_template);
    crate::llama_train::run(&TrainConfig {
        checkpoint: Some(saved.clone()),
        ..text_run(Strategy::Single, 1, "chat.jsonl")
    });
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A global batch whose conversations have no assistant turn trains nothing: its step is
/// reported `"skipped": "no trained tokens"` and updates nothing on any rank (AdamW would still
/// move the weights), so the weights and optimizer state after the run equal those of the
/// same run without that batch, bit for bit, on one device and on 2 fsdp2 ranks. Loading such
/// data counts the untrained conversations; `--strict-data` refuses it.
#[test]
fn a_batch_without_trained_tokens_skips_its_update_on_every_rank() {
    use burn_parallel::checkpoint::step_dir;
    use burn_parallel::train::Skipped;

    let chats: Vec<String> = std::fs::read_to_string(fixture("chat.jsonl"))
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect();
    let untrained = r#"{"messages": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Each are shards"}]}"#;
    let dir = crate::llama_hf::temp_dir("no-trained-tokens");
    let file = |name: &str, lines: Vec<&str>| {
        let path = dir.join(name);
        std::fs::write(&path, lines.join("\n") + "\n").unwrap();
        path
    };
    let c: Vec<&str> = chats.iter().map(String::as_str).collect();
    let with = file(
        "with.jsonl",
        vec![c[0], c[1], untrained, untrained, c[2], c[3]],
    );
    let without = file("without.jsonl", vec![c[0], c[1], c[2], c[3]]);
    for (strategy, world) in [(Strategy::Single, 1), (Strategy::Fsdp2, 2)] {
        let cfg = |data: &Path, steps: usize, saves: &str| TrainConfig {
            global_batch: 2,
            steps,
            data: Some(data.to_path_buf()),
            save_every: Some(1),
            save_dir: Some(dir.join(format!("{saves}-{strategy}"))),
            ..text_run(strategy, world, "chat.jsonl")
        };
        let skipping = run(&cfg(&with, 3, "with"));
        let reasons: Vec<Option<Skipped>> = skipping.steps.iter().map(|s| s.skipped).collect();
        assert_eq!(
            reasons,
            [None, Some(Skipped::NoTrainedTokens), None],
            "{strategy}"
        );
        let json = serde_json::to_value(&skipping.steps[1]).unwrap();
        assert_eq!(json["skipped"], "no trained tokens");
        assert_eq!(
            serde_json::to_value(&skipping.steps[0]).unwrap()["skipped"],
            false
        );
        let plain = run(&cfg(&without, 2, "without"));
        let bits = |run: &str, done: u64| {
            crate::train_schedules::state_bits(&step_dir(
                &dir.join(format!("{run}-{strategy}")),
                done,
            ))
            .0
        };
        assert!(
            bits("with", 3) == bits("without", 2),
            "{strategy}: the batch without trained tokens changed the state"
        );
        assert_eq!(
            skipping.steps[2].report.loss.to_bits(),
            plain.steps[1].report.loss.to_bits(),
            "{strategy}"
        );
    }
    // Counted at load, refused under --strict-data, naming the count.
    let opts = DataOptions {
        tokenizer: Some(fixture("tokenizer.json")),
        strict_data: true,
        ..DataOptions::default()
    };
    let e = data::load(&with, &opts, 32, 320, "--data")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("--data") && e.contains("2 of 6 examples") && e.contains("no trained token"),
        "{e}"
    );
}

/// `--eval-batches all` (the default) reads the whole eval file once: with 12 records in
/// global batches of 5 the last batch holds 2, and the eval loss is the masked mean over all
/// 12 records computed here forward-only, on one device and on 3 fsdp2 ranks (uneven rows). A
/// count of batches past the file's end is refused rather than wrapped around.
#[test]
fn the_eval_over_the_whole_file_counts_each_record_once() {
    let eval = |strategy, world, eval_batches| TrainConfig {
        lr: 0.0,
        steps: 1,
        global_batch: 5,
        data_options: DataOptions {
            tokenizer: Some(fixture("tokenizer.json")),
            eval_data: Some(fixture("sft.jsonl")),
            eval_every: 1,
            eval_batches,
            ..DataOptions::default()
        },
        ..text_run(strategy, world, "text.txt")
    };
    assert_eq!(DataOptions::default().eval_batches, EvalBatches::All);
    let tok = tokenizer();
    let model = Llama::seeded(&text_model(), 0, &ndarray());
    let records = sft_records().len();
    assert_eq!(records, 12);
    let (mut sum, mut count) = (0.0, 0);
    for i in 0..records {
        let (ids, first) = sft_ids(&tok, i);
        let (s, c) = example_ce(&model, &ids, first);
        sum += s;
        count += c;
    }
    let want = sum / count as f64;
    for (strategy, world) in [(Strategy::Single, 1), (Strategy::Fsdp2, 3)] {
        let got = run(&eval(strategy, world, EvalBatches::All)).steps[0]
            .eval_loss
            .expect("an eval after the last step") as f64;
        assert!(
            (got - want).abs() <= 1e-5 * want,
            "{strategy}: {got} vs {want}"
        );
    }
    let e = error_of(&eval(Strategy::Single, 1, EvalBatches::First(3)));
    assert!(
        e.contains("--eval-batches") && e.contains("15 items") && e.contains("has 12"),
        "{e}"
    );
    assert_eq!("all".parse::<EvalBatches>(), Ok(EvalBatches::All));
    assert_eq!("2".parse::<EvalBatches>(), Ok(EvalBatches::First(2)));
    assert!("0".parse::<EvalBatches>().is_err());
}

/// `generate` reads back what `--save` wrote (weights, tokenizer, chat template,
/// generation_config.json): greedy decoding after a chat prompt picks at each step the most
/// likely next token of the saved weights (recomputed here with a plain forward of the prompt
/// and the tokens so far), and stops at generation_config's end ids or at `max_new_tokens`; a
/// seeded sample repeats itself; a bad temperature is refused by name.
#[test]
fn generation_reads_the_saved_model_directory() {
    use burn_parallel::models::checkpoint::load_llama;
    use burn_parallel::train::{GenerateOptions, generate};

    let dir = crate::llama_hf::temp_dir("generate");
    let save = dir.join("model");
    run(&TrainConfig {
        save: Some(save.clone()),
        ..text_run(Strategy::Single, 1, "chat.jsonl")
    });
    let greedy = GenerateOptions {
        max_new_tokens: 6,
        ..GenerateOptions::default()
    };
    let device = ndarray();
    let out = generate(&save, None, "Each are shards", &greedy, &device).unwrap();
    assert!(!out.ids.is_empty() && out.ids.len() <= 6, "{out:?}");
    let tok = tokenizer();
    let prompt = tok.decode(&out.prompt_ids).unwrap();
    assert!(prompt.contains("Each are shards"), "{prompt}");
    let model = load_llama(&save, &device).unwrap();
    let mut ids = out.prompt_ids.clone();
    for &next in &out.ids {
        let n = ids.len();
        let input: Vec<i64> = ids.iter().map(|&i| i as i64).collect();
        let logits = model.forward(Tensor::<2, Int>::from_data(
            TensorData::new(input, [1, n]),
            &device,
        ));
        let last = to_vec(
            &logits
                .slice([0..1, n - 1..n, 0..320])
                .reshape([320])
                .into_data(),
        );
        let best = (0..320).fold(0, |b, i| if last[i] > last[b] { i } else { b });
        assert_eq!(next as usize, best, "greedy picks the most likely token");
        ids.push(next);
    }
    let config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(save.join("generation_config.json")).unwrap(),
    )
    .unwrap();
    let ends: Vec<u64> = match &config["eos_token_id"] {
        serde_json::Value::Array(list) => list.iter().filter_map(|v| v.as_u64()).collect(),
        v => v.as_u64().into_iter().collect(),
    };
    let last = *out.ids.last().unwrap() as u64;
    assert!(
        out.ids.len() == 6 || ends.contains(&last),
        "stopped early at {last}, not an end id {ends:?}"
    );
    let sampled = GenerateOptions {
        temperature: Some(1.0),
        seed: 3,
        ..greedy.clone()
    };
    let a = generate(&save, None, "Each are shards", &sampled, &device).unwrap();
    let b = generate(&save, None, "Each are shards", &sampled, &device).unwrap();
    assert_eq!(a, b);
    let cold = GenerateOptions {
        temperature: Some(0.0),
        ..greedy
    };
    let e = generate(&save, None, "x", &cold, &device)
        .unwrap_err()
        .to_string();
    assert!(e.contains("--temperature"), "{e}");
}

/// A template shipped as `chat_template.jinja` with `{% generation %}` marks trains exactly the
/// marked spans, as transformers' `return_assistant_tokens_mask` reads them. Here the marks
/// enclose the assistant content only, not its `<|im_end|>`, a choice only the marks can make.
/// The mask equals one this test computes from the conversation text it writes itself. The same
/// template without marks keeps today's rule: the content, `<|im_end|>` and its newline count.
#[test]
fn generation_marks_in_a_shipped_template_choose_the_trained_tokens() {
    use burn_parallel::train::data::formats::detect;

    let dir = crate::llama_hf::temp_dir("generation-marks");
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixture(file), dir.join(file)).unwrap();
    }
    let template = |marks: bool| {
        let (open, close) = match marks {
            true => ("{% generation %}", "{% endgeneration %}"),
            false => ("", ""),
        };
        format!(
            "{{{{ bos_token }}}}{{% for message in messages %}}{{{{ '<|im_start|>' + \
             message['role'] + '\\n' }}}}{{% if message['role'] == 'assistant' %}}{open}{{{{ \
             message['content'] }}}}{close}{{% else %}}{{{{ message['content'] }}}}{{% endif \
             %}}{{{{ '<|im_end|>\\n' }}}}{{% endfor %}}{{% if add_generation_prompt %}}{{{{ \
             '<|im_start|>assistant\\n' }}}}{{% endif %}}"
        )
    };
    let chats = std::fs::read_to_string(fixture("chat.jsonl")).unwrap();
    let data = dir.join("chat.jsonl");
    std::fs::write(&data, &chats).unwrap();
    let examples = |marks: bool| {
        std::fs::write(dir.join("chat_template.jinja"), template(marks)).unwrap();
        let tok = TextTokenizer::load(&dir.join("tokenizer.json")).unwrap();
        let bytes = std::fs::read(&data).unwrap();
        let format = detect(&data, &bytes).unwrap();
        (data::tokenize(&data, &bytes, format, &tok).unwrap(), tok)
    };
    // The text and the trained byte ranges, written here from the records.
    let expected = |line: &str, tok: &TextTokenizer, with_end: bool| {
        let record: serde_json::Value = serde_json::from_str(line).unwrap();
        let mut text = String::from("<s>");
        let mut spans = Vec::new();
        for m in record["messages"].as_array().unwrap() {
            let (role, content) = (m["role"].as_str().unwrap(), m["content"].as_str().unwrap());
            text.push_str(&format!("<|im_start|>{role}\n"));
            let start = text.len();
            text.push_str(content);
            let end = text.len();
            text.push_str("<|im_end|>\n");
            if role == "assistant" {
                spans.push(start..if with_end { text.len() } else { end });
            }
        }
        let (ids, offsets) = tok
            .encode_with_offsets(&text, &|| "the test".into())
            .unwrap();
        let counts: Vec<bool> = offsets
            .iter()
            .map(|(s, _)| spans.iter().any(|r| r.contains(s)))
            .collect();
        (ids, counts)
    };
    for marks in [true, false] {
        let (got, tok) = examples(marks);
        let lines: Vec<&str> = chats.lines().collect();
        assert_eq!(got.len(), lines.len());
        for (example, line) in got.iter().zip(lines) {
            let (ids, counts) = expected(line, &tok, !marks);
            assert_eq!(example.ids, ids, "marks {marks}");
            assert_eq!(example.counts, counts, "marks {marks}: {line}");
            assert!(counts.iter().any(|&c| c), "something trains");
        }
    }
}
