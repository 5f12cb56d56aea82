//! `--pack`: a packed row (examples back to back, positions restarting, attention blocked
//! between examples) gives each example's logits as it has them alone, and a packed run trains
//! on the same loss and gradient as the unpacked run over the same examples.

use burn::tensor::{Int, Tensor, TensorData};
use burn_parallel::models::Llama;
use burn_parallel::train::data::pack::pack;
use burn_parallel::train::data::{self, DataOptions, Dataset};
use burn_parallel::train::{Strategy, TrainConfig};

use crate::common::{ndarray, to_vec};
use crate::data_sft::{fixture, text_model, text_run};
use crate::llama_train::{assert_curves, run};

fn logits(model: &Llama, ids: &[i64], packed: Option<(&[i64], &[i64])>) -> Vec<f32> {
    let n = ids.len();
    let ids = Tensor::<2, Int>::from_data(TensorData::new(ids.to_vec(), [1, n]), &ndarray());
    let out = match packed {
        None => model.forward(ids),
        Some((positions, segments)) => {
            model
                .try_forward_packed(ids, positions, segments)
                .unwrap()
                .0
        }
    };
    to_vec(&out.into_data())
}

#[test]
fn a_packed_row_gives_each_examples_own_logits() {
    let opts = DataOptions {
        tokenizer: Some(fixture("tokenizer.json")),
        ..DataOptions::default()
    };
    let Dataset::Rows { rows, .. } =
        data::load(&fixture("sft.jsonl"), &opts, 64, 320, "--data").unwrap()
    else {
        panic!("sft rows");
    };
    let model = Llama::seeded(&text_model(), 3, &ndarray());
    let vocab = 320;
    // Three examples in one row of 64 positions.
    let examples: Vec<_> = rows[..3]
        .iter()
        .map(|r| data::Example {
            ids: r
                .inputs
                .iter()
                .copied()
                .chain(r.targets.last().copied())
                .collect(),
            counts: std::iter::once(false)
                .chain(r.counts.iter().copied())
                .collect(),
        })
        .collect();
    let (packed, truncated) = pack(&examples, 64);
    assert_eq!((packed.len(), truncated), (1, 0));
    let row = &packed[0];
    let wide = |v: &[u32]| v.iter().map(|x| *x as i64).collect::<Vec<_>>();
    let got = logits(
        &model,
        &wide(&row.inputs),
        Some((&wide(&row.positions), &wide(&row.segments))),
    );
    let mut at = 0;
    for r in &rows[..3] {
        let alone = logits(&model, &wide(&r.inputs), None);
        let part = &got[at * vocab..(at + r.len()) * vocab];
        for (i, (g, w)) in part.iter().zip(&alone).enumerate() {
            assert!(
                (g - w).abs() <= 1e-5 * w.abs().max(1.0),
                "position {i}: {g} vs {w}"
            );
        }
        at += r.len();
    }
    assert_eq!(at, row.len());
}

/// All 12 SFT examples per step, unpacked (12 rows) and packed (fewer rows of 64): the same
/// loss and gradient norm at every step, on one device and under fsdp2 x2 and tp 2.
#[test]
fn a_packed_run_trains_like_the_unpacked_one() {
    let opts = DataOptions {
        tokenizer: Some(fixture("tokenizer.json")),
        pack: true,
        ..DataOptions::default()
    };
    let packed_rows = data::load(&fixture("sft.jsonl"), &opts, 64, 320, "--data")
        .unwrap()
        .len();
    assert!(packed_rows < 12, "{packed_rows}");
    let cfg = |strategy, world, pack: bool| TrainConfig {
        seq_len: 64,
        global_batch: if pack { packed_rows } else { 12 },
        data_options: DataOptions {
            pack,
            ..opts.clone()
        },
        ..text_run(strategy, world, "sft.jsonl")
    };
    let unpacked = run(&cfg(Strategy::Single, 1, false));
    for (strategy, world) in [
        (Strategy::Single, 1),
        (Strategy::Fsdp2, 2),
        (Strategy::Tp, 2),
    ] {
        let packed = run(&cfg(strategy, world, true));
        assert_curves(
            &packed,
            &unpacked,
            1e-5,
            &format!("packed {strategy} x{world}"),
        );
    }
}
