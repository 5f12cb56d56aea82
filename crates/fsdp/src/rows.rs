//! Sharded loading: what a load asks for ([`RowRequest`]) and where an FSDP config finds it
//! ([`RowSource`]).

use std::ops::Range;
use std::sync::{Arc, Mutex};

use burn::module::ParamId;
use burn::tensor::TensorData;

/// What a sharded load asks its source for: rows `rows` (along dim 0) of the full parameter at
/// `path` (Burn's module path, e.g. `layers.0.weight`), whose full shape is `shape`. `rows` is
/// empty on a rank that holds no rows of a small parameter: return a `[0, ...]` tensor of the
/// parameter's dtype.
#[derive(Debug, Clone)]
pub struct RowRequest<'a> {
    /// Burn's module path of the parameter.
    pub path: &'a str,
    /// The parameter's id.
    pub id: ParamId,
    /// The full (unsharded) shape.
    pub shape: &'a [usize],
    /// The rows (along dim 0) this rank stores; under the flat layout, the rows that cover its
    /// piece (the rest of their elements is dropped after the read).
    pub rows: Range<usize>,
}

/// The reader behind a [`RowSource`].
type ReadRows = dyn FnMut(&RowRequest) -> Result<TensorData, String> + Send;

/// Where [`fully_shard`](crate::fully_shard) reads each lazy parameter's rows when an
/// [`FsdpConfig`](crate::FsdpConfig) carries one ([`FsdpConfig::rows_from`](crate::FsdpConfig::rows_from)),
/// so that no rank materializes the full model. Carried by the config rather than passed
/// beside it, so that every hook that shards with the config (a sidecar's own
/// `fully_shard_module` included) loads the same way. Clones share the reader.
#[derive(Clone)]
pub struct RowSource(Arc<Mutex<Box<ReadRows>>>);

impl RowSource {
    /// A source answering each request with `read` (its error is reported with the
    /// parameter's path).
    pub fn new<E: std::fmt::Display>(
        mut read: impl FnMut(&RowRequest) -> Result<TensorData, E> + Send + 'static,
    ) -> Self {
        Self(Arc::new(Mutex::new(Box::new(move |r: &RowRequest| {
            read(r).map_err(|e| e.to_string())
        }))))
    }

    /// The rows `request` asks for.
    pub(crate) fn read(&self, request: &RowRequest) -> Result<TensorData, String> {
        let mut read = self.0.lock().unwrap_or_else(|e| e.into_inner());
        read(request)
    }
}

impl std::fmt::Debug for RowSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RowSource")
    }
}
