//! What a forward hands each decoder layer besides its input: the rotary `cos`/`sin` tables and
//! the token layout (packed rows, context parallelism), built once per forward. Gemma 3's
//! sliding-window layers rotate with their own base, so they get tables of their own.

use burn::tensor::{DType, Device, Tensor};
use burn_parallel_comm::ProcessGroup;

use super::DecoderLayer;
use crate::context_parallel::TokenLayout;
use crate::error::ModelError;
use crate::rope::Rope;

/// One rope's tables, and the layout built with them (when the rows are packed or split).
pub(crate) struct Tables {
    cos: Tensor<4>,
    sin: Tensor<4>,
    layout: Option<TokenLayout>,
}

impl Tables {
    fn new(
        rope: &Rope,
        [batch, seq]: [usize; 2],
        packed: Option<(&[i64], &[i64])>,
        cp: Option<&ProcessGroup>,
        device: &Device,
        dtype: DType,
    ) -> Result<Self, ModelError> {
        // Positions span the whole sequence: under sequence parallelism attention gathers it.
        let layout = match (packed, cp) {
            (None, None) => None,
            _ => Some(TokenLayout::new(
                rope, batch, seq, packed, cp, device, dtype,
            )?),
        };
        let (cos, sin) = match &layout {
            None => rope.cos_sin(seq, device, dtype),
            Some(layout) => (layout.cos.clone(), layout.sin.clone()),
        };
        Ok(Self { cos, sin, layout })
    }
}

/// The tables of a forward: the model's rope, and the sliding layers' own when it has one.
pub(crate) struct Rotary {
    global: Tables,
    local: Option<Tables>,
}

impl Rotary {
    /// The tables of `[batch, seq]` tokens (this rank's `seq` under context parallelism over
    /// `cp`), packed as `packed` says, in `dtype`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        rope: &Rope,
        rope_local: Option<&Rope>,
        shape: [usize; 2],
        packed: Option<(&[i64], &[i64])>,
        cp: Option<&ProcessGroup>,
        device: &Device,
        dtype: DType,
    ) -> Result<Self, ModelError> {
        let tables = |r: &Rope| Tables::new(r, shape, packed, cp, device, dtype);
        Ok(Self {
            global: tables(rope)?,
            local: rope_local.map(tables).transpose()?,
        })
    }

    /// Layer `l`'s `cos`, `sin` and layout: the sliding-window layers' own rope when there is
    /// one.
    pub(crate) fn for_layer(
        &self,
        l: &DecoderLayer,
    ) -> (&Tensor<4>, &Tensor<4>, Option<&TokenLayout>) {
        let t = match (&self.local, l.self_attn.sliding_window) {
            (Some(local), Some(_)) => local,
            _ => &self.global,
        };
        (&t.cos, &t.sin, t.layout.as_ref())
    }
}
