//! QLoRA's base: every `Lora<Linear>` of a model stored in bitsandbytes' NF4 (what
//! `BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")` quantizes: the decoder
//! layers' linears; the embedding, the norms and the LM head, which are not `Lora` fields, stay
//! as they are). The packed blocks are the base's `weight` parameter, an f32 tensor of
//! `[blocks, 12]` ([`Nf4::to_blocks`]): FSDP shards and gathers them like any parameter (by
//! blocks), and each forward decodes them on the device in f32 (`bnb_4bit_compute_dtype =
//! float32`). Backward decodes them again rather than keeping the decoded weight.

use burn::module::{Param, ParamId};
use burn::nn::Linear;
use burn::tensor::{FloatDType, Tensor, TensorData};
use burn_parallel_comm::collectives::CodedWeight;

use crate::apply::LoraModule;
use crate::error::LoraError;
use crate::lora::Lora;
use crate::nf4::{NF4_BLOCK, NF4_CODE, quantize_nf4};

/// How an NF4 weight of `d_in -> d_out` features decodes.
pub fn nf4_weight(d_in: usize, d_out: usize) -> CodedWeight {
    CodedWeight {
        code: NF4_CODE,
        block: NF4_BLOCK,
        d_in,
        d_out,
    }
}

/// A base [`quantize_bases`] left lazy (its weight not read yet): `packed` is the id of the
/// packed parameter, `source` that of the full-precision weight it is quantized from. A sharded
/// load reads only this rank's blocks of `source` and quantizes them ([`quantize_blocks`]), so
/// no rank reads a whole weight.
#[derive(Debug, Clone)]
pub struct LazyQuantized {
    /// The packed parameter's id (what a row source is asked for).
    pub packed: ParamId,
    /// The full-precision weight's id (what the checkpoint knows).
    pub source: ParamId,
    /// How the packed weight decodes.
    pub coded: CodedWeight,
}

/// The packed blocks ([`Nf4::to_blocks`](crate::Nf4::to_blocks)) of `values`, a run of the
/// weight as PyTorch lays it out (row-major `[out, in]`) that starts on a block boundary.
pub fn quantize_blocks(values: &[f32]) -> Vec<f32> {
    quantize_nf4(values).to_blocks()
}

/// The blocks of `weight` (Burn's `[d_in, d_out]`), quantized in PyTorch's order.
fn blocks_of(weight: Tensor<2>, coded: &CodedWeight) -> Result<Tensor<2>, String> {
    let device = weight.device();
    let torch_order = weight
        .detach()
        .cast(FloatDType::F32)
        .transpose()
        .into_data()
        .convert::<f32>();
    let values = torch_order
        .as_slice::<f32>()
        .map_err(|e| format!("reading the weight to quantize: {e:?}"))?;
    let blocks = TensorData::new(quantize_blocks(values), coded.packed_shape());
    Ok(Tensor::<2>::from_data(blocks, &device))
}

impl Lora<Linear> {
    /// This layer with its base weight stored in NF4 (frozen, as every QLoRA base), quantized
    /// from the weight as PyTorch lays it out (`[out, in]`, row-major) so that the blocks are
    /// bitsandbytes'. A lazy weight stays unread: the packed parameter is lazy too, and
    /// quantizes the weight when first used whole. An adapter, if any, is kept.
    pub fn quantize_nf4(self, path: &str) -> Result<Self, LoraError> {
        Ok(self.quantize_base(path)?.0)
    }

    /// [`quantize_nf4`](Self::quantize_nf4), and the lazy parameter it made, if any.
    fn quantize_base(self, path: &str) -> Result<(Self, Option<LazyQuantized>), LoraError> {
        if self.quantized.is_some() {
            return Err(LoraError::InvalidConfig(format!(
                "`{path}` is already quantized to 4 bits"
            )));
        }
        let [d_in, d_out] = self.features();
        let coded = nf4_weight(d_in, d_out);
        let mut base = self.base;
        let source = base.weight;
        let (weight, lazy) = match source.is_initialized() {
            true => {
                let blocks = blocks_of(source.val(), &coded)
                    .map_err(|e| LoraError::InvalidConfig(format!("`{path}`: {e}")))?;
                (Param::from_tensor(blocks), None)
            }
            false => {
                let lazy = LazyQuantized {
                    packed: ParamId::new(),
                    source: source.id,
                    coded: coded.clone(),
                };
                let (device, layout, path) =
                    (source.lazy_device(), coded.clone(), path.to_string());
                let init = move |device: &burn::tensor::Device, _: bool| {
                    let blocks = blocks_of(source.val(), &layout)
                        .unwrap_or_else(|e| panic!("quantizing `{path}`: {e}"));
                    blocks.to_device(device)
                };
                let shape = coded.packed_shape();
                let param = Param::uninitialized(lazy.packed, init, device, false, shape.into());
                (param, Some(lazy))
            }
        };
        base.weight = weight.set_require_grad(false);
        let layer = Self {
            base,
            adapter: self.adapter,
            quantized: Some(coded),
        };
        Ok((layer, lazy))
    }
}

/// `model` with every `Lora` layer's base stored in NF4 ([`Lora::quantize_nf4`]): QLoRA's
/// base, before [`apply_lora`](crate::apply_lora) attaches the adapters (to any of them) and
/// before `parallelize_model` shards it. Also returns the bases left lazy, which a sharded
/// load of a lazily read checkpoint needs to read only this rank's blocks.
pub fn quantize_bases<M: LoraModule>(model: M) -> Result<(M, Vec<LazyQuantized>), LoraError> {
    let mut lazy = Vec::new();
    let model = model.map_lora("", &mut |path, layer| {
        let (layer, left) = layer.quantize_base(path)?;
        lazy.extend(left);
        Ok(layer)
    })?;
    Ok((model, lazy))
}
