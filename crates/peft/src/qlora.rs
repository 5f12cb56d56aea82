//! QLoRA's base: every `Lora<Linear>` of a model stored in bitsandbytes' NF4 (what
//! `BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")` quantizes: the decoder
//! layers' linears; the embedding, the norms and the LM head, which are not `Lora` fields, stay
//! as they are). The packed blocks are the base's `weight` parameter, an f32 tensor of
//! `[blocks, 17]` ([`Nf4::to_blocks`]): FSDP shards and gathers them like any parameter (by
//! blocks), and each forward decodes them on the device in f32 (`bnb_4bit_compute_dtype =
//! float32`). Backward decodes them again rather than keeping the decoded weight.

use burn::module::Param;
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

impl Lora<Linear> {
    /// This layer with its base weight stored in NF4 (frozen, as every QLoRA base), quantized
    /// from the weight as PyTorch lays it out (`[out, in]`, row-major) so that the blocks are
    /// bitsandbytes'. Reads a lazy weight. An adapter, if any, is kept.
    pub fn quantize_nf4(self, path: &str) -> Result<Self, LoraError> {
        if self.quantized.is_some() {
            return Err(LoraError::InvalidConfig(format!(
                "`{path}` is already quantized to 4 bits"
            )));
        }
        let [d_in, d_out] = self.features();
        let weight = self.base.weight.val().detach();
        let device = weight.device();
        let torch_order = weight
            .cast(FloatDType::F32)
            .transpose()
            .into_data()
            .convert::<f32>();
        let values = torch_order.as_slice::<f32>().map_err(|e| {
            LoraError::InvalidConfig(format!("`{path}`: reading the weight to quantize: {e:?}"))
        })?;
        let coded = nf4_weight(d_in, d_out);
        let blocks = TensorData::new(quantize_nf4(values).to_blocks(), coded.packed_shape());
        let mut base = self.base;
        base.weight =
            Param::from_tensor(Tensor::<2>::from_data(blocks, &device)).set_require_grad(false);
        Ok(Self {
            base,
            adapter: self.adapter,
            quantized: Some(coded),
        })
    }
}

/// `model` with every `Lora` layer's base stored in NF4 ([`Lora::quantize_nf4`]): QLoRA's
/// base, before [`apply_lora`](crate::apply_lora) attaches the adapters (to any of them) and
/// before `parallelize_model` shards it. Quantizes one layer at a time, so a lazily loaded
/// model holds one full-precision weight at once.
pub fn quantize_bases<M: LoraModule>(model: M) -> Result<M, LoraError> {
    model.map_lora("", &mut |path, layer| layer.quantize_nf4(path))
}
