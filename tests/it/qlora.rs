//! QLoRA: NF4 packs, scales and dequantizes weights as bitsandbytes does (its own output, in
//! tests/fixtures/nf4), and a base stored in NF4 decodes on the device to what the code book says
//! (checked against a search over the code book written here, with an all-zero block, a block
//! holding one huge value and a length that is not a multiple of 64), and the trainer's
//! `--lora-quantize nf4` trains as LoRA on the dequantized base (dequantized here, on the host,
//! from the code book) under single, ddp, fsdp2 (uneven), hsdp, megatron_fsdp and pp: same losses,
//! adapters and merged model. It starts from a peft adapter too; contradicting flags and tensor
//! parallelism are refused by name.

use std::path::Path;

use burn::nn::LinearConfig;
use burn::tensor::{Tensor, TensorData};
use burn_parallel::models::Llama;
use burn_parallel::models::checkpoint::{SaveDtype, hf_tensors, save_llama};
use burn_parallel::parallelizer::Strategy;
use burn_parallel::peft::Lora;
use burn_parallel::train::{
    DEFAULT_TARGETS, DistributedFlags, LoraOptions, LoraQuantize, TrainArgs, TrainConfig,
    TrainSummary,
};
use clap::Parser;

use crate::common::{assert_close, ndarray, to_vec, vec_of};
use crate::llama_hf::temp_dir;
use crate::llama_train::{assert_curves, resolved, run, small_model};
use crate::lora_llama::{lora_run, read_safetensors, trainer_error};

/// bitsandbytes' NF4 code book, as the decimal literals of its `create_normal_map` output.
const CODE: [f64; 16] = [
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
];

/// NF4's round trip of `values` (row-major), by direct search: per block of 64, each element
/// becomes the code value nearest to `element / absmax`, times the absmax; a block of zeros
/// stays zero.
fn dequantized(values: &[f32]) -> Vec<f32> {
    let mut out = Vec::with_capacity(values.len());
    for block in values.chunks(64) {
        let max = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        for &v in block {
            if max == 0.0 {
                out.push(0.0);
                continue;
            }
            let x = (v * (1.0 / max)) as f64;
            let nearest = CODE
                .iter()
                .min_by(|a, b| (*a - x).abs().total_cmp(&(*b - x).abs()))
                .unwrap();
            out.push(*nearest as f32 * max);
        }
    }
    out
}

/// `[rows, cols]` row-major, transposed.
fn transpose(v: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    (0..cols)
        .flat_map(|c| (0..rows).map(move |r| v[r * cols + c]))
        .collect()
}

/// On ndarray the decoding is Burn's plain ops, on flex its one-pass loop.
#[test]
fn nf4_blocks_decode_on_the_device_as_the_code_book_says() {
    for device in [ndarray(), burn::tensor::Device::flex()] {
        decodes_as_the_code_book_says(&device);
    }
}

fn decodes_as_the_code_book_says(device: &burn::tensor::Device) {
    let device = device.clone();
    // PyTorch's [out, in] = [20, 10]: 200 elements, blocks of 64, 64, 64 and 8.
    let (d_out, d_in) = (20, 10);
    let mut torch: Vec<f32> = crate::common::values(3, d_out * d_in)
        .iter()
        .map(|v| v * 0.1)
        .collect();
    torch[64..128].iter_mut().for_each(|v| *v = 0.0);
    torch[130] = 1.0e6;
    let mut linear = LinearConfig::new(d_in, d_out)
        .with_bias(false)
        .init(&device);
    let burn_layout = TensorData::new(transpose(&torch, d_out, d_in), [d_in, d_out]);
    linear.weight = burn::module::Param::from_tensor(Tensor::from_data(burn_layout, &device));

    let layer = Lora::new(linear).quantize_nf4("w").unwrap();
    let coded = layer.quantized().expect("quantized").clone();
    assert_eq!(
        coded.packed_shape(),
        [4, 12],
        "4 blocks of 11 packed values (six indices each) and an absmax"
    );
    assert_eq!(layer.base.weight.val().dims(), [4, 12]);
    assert_eq!(layer.features(), [d_in, d_out]);

    let want = dequantized(&torch);
    assert!(want[64..128].iter().all(|v| *v == 0.0));
    assert_eq!(want[130], 1.0e6, "a block's largest value is exact");
    // merged() decodes the blocks on the device (the forward's decoding).
    let decoded = vec_of(&layer.merged().weight.val());
    assert_eq!(decoded, transpose(&want, d_out, d_in));

    // The forward uses the decoded weight: x @ W.
    let x = Tensor::<2>::from_data(
        TensorData::new(crate::common::values(9, 3 * d_in), [3, d_in]),
        &device,
    );
    let w = Tensor::<2>::from_data(
        TensorData::new(transpose(&want, d_out, d_in), [d_in, d_out]),
        &device,
    );
    let got = vec_of(&layer.forward(x.clone()));
    assert_close(&got, &vec_of(&x.matmul(w)), 1e-6, "forward of a 4-bit base");
}

#[test]
fn nf4_is_what_bitsandbytes_makes_of_the_same_weights() {
    // scripts/make_nf4_fixture.py: bitsandbytes' quantize_4bit / dequantize_4bit (nf4, blocks
    // of 64), including a zero block, a huge value, a short last block and exact midpoints.
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/nf4/bnb.json");
    let fixture: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let floats = |v: &serde_json::Value| -> Vec<f32> { serde_json::from_value(v.clone()).unwrap() };
    for case in fixture["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let values = floats(&case["values"]);
        let packed: Vec<u8> = serde_json::from_value(case["packed"].clone()).unwrap();
        let q = burn_parallel::peft::quantize_nf4(&values);
        assert_eq!(q.packed, packed, "{name}: packed indices");
        assert_eq!(q.absmax, floats(&case["absmax"]), "{name}: absmax");
        let want = floats(&case["dequantized"]);
        assert_eq!(q.dequantize(), want, "{name}: dequantized on the host");

        // Decoded on the device, from a layer holding the weight in Burn's layout.
        let [d_out, d_in]: [usize; 2] = serde_json::from_value(case["shape"].clone()).unwrap();
        let device = ndarray();
        let mut linear = LinearConfig::new(d_in, d_out)
            .with_bias(false)
            .init(&device);
        let burn_layout = TensorData::new(transpose(&values, d_out, d_in), [d_in, d_out]);
        linear.weight = burn::module::Param::from_tensor(Tensor::from_data(burn_layout, &device));
        let layer = Lora::new(linear).quantize_nf4(name).unwrap();
        let decoded = vec_of(&layer.merged().weight.val());
        assert_eq!(
            decoded,
            transpose(&want, d_out, d_in),
            "{name}: decoded on the device"
        );
    }
}

/// The small model's checkpoint (seed 0) under `dir`, its decoder projections replaced by
/// their NF4 round trip when `dequantize`.
fn write_checkpoint(dir: &Path, dequantize: bool) {
    let config = small_model();
    let model = Llama::seeded(&config, 0, &ndarray());
    // What bitsandbytes quantizes: every linear of the decoder layers.
    let projections = DEFAULT_TARGETS;
    let tensors: Vec<(String, TensorData)> = hf_tensors(&model)
        .unwrap()
        .into_iter()
        .map(|(name, data)| {
            let quantized = dequantize
                && name.starts_with("model.layers.")
                && projections
                    .iter()
                    .any(|p| name.ends_with(&format!("{p}.weight")));
            match quantized {
                true => {
                    let shape = data.shape().to_vec();
                    (name, TensorData::new(dequantized(&to_vec(&data)), shape))
                }
                false => (name, data),
            }
        })
        .collect();
    save_llama(&config, &tensors, dir, SaveDtype::F32).unwrap();
}

/// A LoRA run (rank 4, alpha 8, the seven projections) from the checkpoint `from`, QLoRA's
/// when `quantize`, writing its adapter and merged model under `out`.
fn run_from(
    from: &Path,
    quantize: bool,
    strategy: Strategy,
    world: usize,
    out: &Path,
) -> TrainSummary {
    let base = lora_run(strategy, world, None, out);
    run(&TrainConfig {
        checkpoint: Some(from.to_path_buf()),
        lora: LoraOptions {
            quantize: quantize.then_some(LoraQuantize::Nf4),
            ..base.lora.clone()
        },
        ..base
    })
}

/// Every tensor of two safetensors files agrees to 1e-5.
fn assert_same_files(got: &Path, want: &Path, what: &str) {
    let (got, want) = (read_safetensors(got), read_safetensors(want));
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>(),
        "{what}: tensor names"
    );
    for (name, (shape, v)) in &got {
        assert_eq!(shape, &want[name].0, "{what}: {name}");
        assert_close(v, &want[name].1, 1e-5, &format!("{what}: {name}"));
    }
}

#[test]
fn qlora_trains_as_lora_on_the_dequantized_base_under_every_strategy() {
    let root = temp_dir("qlora-trainer");
    let (base, dequantized) = (root.join("base"), root.join("dequantized"));
    write_checkpoint(&base, false);
    write_checkpoint(&dequantized, true);
    let reference_out = root.join("lora-on-dequantized");
    let reference = run_from(&dequantized, false, Strategy::Single, 1, &reference_out);
    let files = |out: &Path| {
        [
            out.join("adapter/adapter_model.safetensors"),
            out.join("merged/model.safetensors"),
        ]
    };
    for (name, strategy, world) in [
        ("single", Strategy::Single, 1),
        ("ddp", Strategy::Ddp, 2),
        ("fsdp2 x3 (uneven)", Strategy::Fsdp2, 3),
        ("hsdp 2x2", Strategy::Hsdp, 4),
        ("megatron_fsdp", Strategy::MegatronFsdp, 2),
    ] {
        let out = root.join(name.replace([' ', '(', ')'], "_"));
        let got = run_from(&base, true, strategy, world, &out);
        let what = format!("QLoRA {name}");
        assert_curves(&got, &reference, 1e-5, &what);
        assert_eq!(
            got.steps[0].trainable_params,
            reference.steps[0].trainable_params
        );
        for (mine, theirs) in files(&out).iter().zip(files(&reference_out)) {
            assert_same_files(mine, &theirs, &what);
        }
    }
    // Pipeline parallelism: each stage quantizes its own layers' bases.
    let pp_out = root.join("pp2");
    let flags = DistributedFlags {
        pp: Some(2),
        ..DistributedFlags::on(Strategy::Fsdp2, 2)
    };
    let base_run = lora_run(Strategy::Fsdp2, 2, None, &pp_out);
    let got = run(&TrainConfig {
        checkpoint: Some(base.clone()),
        distributed: resolved(flags.clone()),
        pipeline: flags.pipeline(),
        lora: LoraOptions {
            quantize: Some(LoraQuantize::Nf4),
            ..base_run.lora.clone()
        },
        ..base_run
    });
    assert_curves(&got, &reference, 1e-5, "QLoRA pp 2");
    // (Its merged model is written per stage; the adapter is one file.)
    let adapter = |out: &Path| out.join("adapter/adapter_model.safetensors");
    assert_same_files(&adapter(&pp_out), &adapter(&reference_out), "QLoRA pp 2");

    // The full-precision base trains differently: the quantization is in effect.
    let plain = run_from(&base, false, Strategy::Single, 1, &root.join("plain"));
    assert_ne!(plain.losses()[0], reference.losses()[0]);

    // From a peft adapter (the reference's), QLoRA and LoRA on the dequantized base agree.
    let from_adapter = |checkpoint: &Path, quantize: bool, out: &Path| {
        let base = lora_run(Strategy::Fsdp2, 2, None, out);
        run(&TrainConfig {
            checkpoint: Some(checkpoint.to_path_buf()),
            lora: LoraOptions {
                init: Some(reference_out.join("adapter")),
                save_adapter: Some(out.join("adapter")),
                quantize: quantize.then_some(LoraQuantize::Nf4),
                ..LoraOptions::default()
            },
            ..base
        })
    };
    let (q_out, l_out) = (root.join("init-qlora"), root.join("init-lora"));
    let qlora = from_adapter(&base, true, &q_out);
    let lora = from_adapter(&dequantized, false, &l_out);
    assert_curves(&qlora, &lora, 1e-5, "QLoRA from a peft adapter");
    for (mine, theirs) in files(&q_out).iter().zip(files(&l_out)) {
        assert_same_files(mine, &theirs, "QLoRA from a peft adapter");
    }
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn qlora_flags_that_cannot_work_are_refused_by_name() {
    let msg = trainer_error(&["--lora-quantize", "nf4"]);
    assert!(
        msg.contains("--lora-quantize") && msg.contains("--lora-rank"),
        "{msg}"
    );
    let msg = trainer_error(&[
        "--lora-rank",
        "2",
        "--lora-quantize",
        "nf4",
        "--backend",
        "flex",
        "--param-dtype",
        "bf16",
    ]);
    assert!(msg.contains("--param-dtype"), "{msg}");
    let parsed = TrainArgs::try_parse_from(["train_llama", "--lora-quantize", "nf8"]);
    let msg = parsed.unwrap_err().to_string();
    assert!(msg.contains("nf8") && msg.contains("nf4"), "{msg}");
    let msg = trainer_error(&[
        "--lora-rank",
        "2",
        "--lora-quantize",
        "nf4",
        "--strategy",
        "tp",
        "--world-size",
        "2",
        "--tp",
        "2",
    ]);
    assert!(
        msg.contains("QLoRA base is not split by tensor parallelism"),
        "{msg}"
    );
}
