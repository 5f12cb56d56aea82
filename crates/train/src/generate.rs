//! Looking at what a model says: greedy or sampled decoding on one device from a Hugging Face
//! model directory (what `--save` writes, or any Llama checkpoint), with its tokenizer and chat
//! template. The trainer's `--generate PROMPT` runs it; no parallelism, no KV cache (each new
//! token runs the whole sequence again), which is plenty for a look at a fine-tuned model.

use std::path::{Path, PathBuf};

use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_parallel_models::checkpoint::load_llama;

use crate::data::chat::{ChatTemplate, Message};
use crate::data::tokenizer::TextTokenizer;
use crate::error::{TrainError, flag_error};

/// How to decode.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateOptions {
    /// New tokens at most (default 64); decoding stops earlier at an end-of-sequence id.
    pub max_new_tokens: usize,
    /// `None` (the default): greedy, the most likely token each time. `Some(t)`: sample from
    /// the softmax of the logits divided by `t`, with `seed`.
    pub temperature: Option<f32>,
    /// The sampling seed (default 0).
    pub seed: u64,
    /// Render the prompt as one user message through the tokenizer's chat template, the
    /// assistant header opened (default true; the prompt as plain text without a template).
    pub chat: bool,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        Self {
            max_new_tokens: 64,
            temperature: None,
            seed: 0,
            chat: true,
        }
    }
}

/// What decoding produced.
#[derive(Debug, Clone, PartialEq)]
pub struct Generated {
    /// The prompt's ids, as the model read them (rendered through the chat template).
    pub prompt_ids: Vec<u32>,
    /// The new ids, the end-of-sequence id included when decoding stopped at one.
    pub ids: Vec<u32>,
    /// The new ids as text, special tokens left out.
    pub text: String,
}

/// Decodes from the model in `model_dir` on `device` after `prompt`, with `tokenizer` (default:
/// the tokenizer.json in `model_dir`, as `--save` writes it). Stops at `max_new_tokens` or at an
/// end-of-sequence id: generation_config.json's `eos_token_id` (one id or a list, as `--save`
/// writes it with the template's end-of-turn token), else the tokenizer's eos.
pub fn generate(
    model_dir: &Path,
    tokenizer: Option<&Path>,
    prompt: &str,
    options: &GenerateOptions,
    device: &Device,
) -> Result<Generated, TrainError> {
    if let Some(t) = options.temperature
        && !(t.is_finite() && t > 0.0)
    {
        return Err(flag_error(
            "--temperature",
            format!("{t} must be a positive number (leave it out for greedy decoding)"),
        ));
    }
    let tokenizer_path = tokenizer
        .map(Path::to_path_buf)
        .unwrap_or_else(|| model_dir.join("tokenizer.json"));
    let tok = TextTokenizer::load(&tokenizer_path)?;
    let text = match (options.chat, &tok.chat_template) {
        (true, Some(_)) => ChatTemplate::of(&tok)?.render(
            &[Message {
                role: "user".into(),
                content: prompt.into(),
            }],
            true,
        )?,
        _ => prompt.to_string(),
    };
    let prompt_ids = tok.encode(&text, &|| "--generate's prompt".into())?;
    if prompt_ids.is_empty() {
        return Err(flag_error("--generate", "the prompt has no tokens"));
    }
    let stop = stop_ids(model_dir, &tok)?;
    let model = load_llama(model_dir, device)?;
    let mut sampler = options.temperature.map(|t| Sampler::new(t, options.seed));
    let mut ids = prompt_ids.clone();
    let mut new = Vec::new();
    for _ in 0..options.max_new_tokens {
        let n = ids.len();
        let input = ids.iter().map(|&i| i as i64).collect::<Vec<_>>();
        let input = Tensor::<2, Int>::from_data(TensorData::new(input, [1, n]), device);
        let logits = model.try_forward(input)?;
        let vocab = logits.dims()[2];
        let last = logits.slice([0..1, n - 1..n, 0..vocab]).reshape([vocab]);
        let last: Vec<f32> = last
            .into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .expect("f32 logits");
        let next = match sampler.as_mut() {
            Some(sampler) => sampler.sample(&last),
            None => argmax(&last),
        };
        ids.push(next);
        new.push(next);
        if stop.contains(&next) {
            break;
        }
    }
    let text = tok.decode(&new)?;
    Ok(Generated {
        prompt_ids,
        ids: new,
        text,
    })
}

/// The id of the largest logit (the first of equal ones).
fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// The ids that end decoding: generation_config.json's `eos_token_id` (an id or a list), else
/// the tokenizer's eos.
fn stop_ids(model_dir: &Path, tok: &TextTokenizer) -> Result<Vec<u32>, TrainError> {
    let path: PathBuf = model_dir.join("generation_config.json");
    let from_file = match std::fs::read_to_string(&path) {
        Ok(text) => {
            let value: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| TrainError::Data(format!("{}: not JSON: {e}", path.display())))?;
            match &value["eos_token_id"] {
                serde_json::Value::Number(n) => n.as_u64().map(|n| vec![n as u32]),
                serde_json::Value::Array(list) => Some(
                    list.iter()
                        .filter_map(|v| v.as_u64())
                        .map(|n| n as u32)
                        .collect(),
                ),
                _ => None,
            }
        }
        Err(_) => None,
    };
    Ok(from_file.unwrap_or_else(|| tok.eos.iter().map(|s| s.id).collect()))
}

/// Sampling from `softmax(logits / temperature)` with a seeded generator (splitmix64), so a
/// seed gives the same text on every machine.
struct Sampler {
    temperature: f32,
    state: u64,
}

impl Sampler {
    fn new(temperature: f32, seed: u64) -> Self {
        Self {
            temperature,
            state: seed,
        }
    }

    /// A uniform number in [0, 1).
    fn uniform(&mut self) -> f64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }

    fn sample(&mut self, logits: &[f32]) -> u32 {
        let t = f64::from(self.temperature);
        let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
        let weights: Vec<f64> = logits
            .iter()
            .map(|&v| ((v as f64 - max) / t).exp())
            .collect();
        let total: f64 = weights.iter().sum();
        let mut target = self.uniform() * total;
        for (i, w) in weights.iter().enumerate() {
            if target < *w {
                return i as u32;
            }
            target -= w;
        }
        (weights.len() - 1) as u32
    }
}
