//! How a batch splits over the data-parallel ranks, and how their outputs join again for the
//! metrics: the two things about a user's types the strategy has to be told.

use std::ops::Range;

use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use burn_parallel_comm::{ProcessGroup, ReduceOp};
use burn_train::{ClassificationOutput, MultiLabelClassificationOutput, RegressionOutput};

use crate::error::LearnerError;

/// A batch (a `TrainStep` or `InferenceStep` input) whose rows the data-parallel ranks share:
/// data-parallel rank `d` of `dp` trains on rows `d * B / dp .. (d + 1) * B / dp` of each
/// `B`-row batch, and the tensor-parallel ranks of one data-parallel group on the same rows.
///
/// ```ignore
/// impl SplitBatch for MyBatch {
///     fn batch_size(&self) -> usize { self.targets.dims()[0] }
///     fn rows(&self, rows: Range<usize>, device: &Device) -> Self {
///         Self { inputs: slice_rows(&self.inputs, rows.clone(), device),
///                targets: slice_rows_int(&self.targets, rows, device) }
///     }
/// }
/// ```
pub trait SplitBatch: Send + 'static {
    /// The number of rows (items) in the batch.
    fn batch_size(&self) -> usize;
    /// The batch of the rows `rows`, on `device` (the rank's device).
    fn rows(&self, rows: Range<usize>, device: &Device) -> Self;
}

/// A step output (`TrainStep::Output`, `InferenceStep::Output`) that the data-parallel ranks'
/// outputs join into the output of the whole batch, in data-parallel rank order, so that the
/// metrics computed from it equal a one-device run's. Collective over the group.
///
/// Implemented for burn-train's [`ClassificationOutput`], [`MultiLabelClassificationOutput`]
/// and [`RegressionOutput`]; for an output of your own, join every per-row tensor with
/// [`gather_rows`] / [`gather_rows_int`] and the mean loss with [`gather_mean`].
pub trait GatherOutput: Sized + Send {
    /// The output of the whole batch from every rank's output of its `rows` (the number of
    /// rows this rank computed), on every rank of `group`.
    fn gather(self, rows: usize, group: &ProcessGroup) -> Result<Self, LearnerError>;
}

/// The rows `rows` of `tensor` (along dim 0), on `device`.
pub fn slice_rows<const D: usize>(
    tensor: &Tensor<D>,
    rows: Range<usize>,
    device: &Device,
) -> Tensor<D> {
    tensor
        .clone()
        .narrow(0, rows.start, rows.len())
        .to_device(device)
}

/// [`slice_rows`] for an integer tensor.
pub fn slice_rows_int<const D: usize>(
    tensor: &Tensor<D, Int>,
    rows: Range<usize>,
    device: &Device,
) -> Tensor<D, Int> {
    tensor
        .clone()
        .narrow(0, rows.start, rows.len())
        .to_device(device)
}

/// Every rank's `tensor` concatenated along dim 0, in rank order of `group`. Collective.
pub fn gather_rows<const D: usize>(
    tensor: Tensor<D>,
    group: &ProcessGroup,
) -> Result<Tensor<D>, LearnerError> {
    if group.size() == 1 {
        return Ok(tensor);
    }
    let device = tensor.device();
    let data = group.all_gather(tensor.detach().into_data(), 0)?;
    Ok(Tensor::from_data(data, &device))
}

/// [`gather_rows`] for an integer tensor.
pub fn gather_rows_int<const D: usize>(
    tensor: Tensor<D, Int>,
    group: &ProcessGroup,
) -> Result<Tensor<D, Int>, LearnerError> {
    if group.size() == 1 {
        return Ok(tensor);
    }
    let device = tensor.device();
    let data = group.all_gather(tensor.into_data(), 0)?;
    Ok(Tensor::from_data(data, &device))
}

/// The mean over the whole batch of a per-rank mean `loss` (shape `[1]`) over `rows` rows:
/// the sum over ranks of `loss * rows`, divided by the total rows. Collective.
pub fn gather_mean(
    loss: Tensor<1>,
    rows: usize,
    group: &ProcessGroup,
) -> Result<Tensor<1>, LearnerError> {
    if group.size() == 1 {
        return Ok(loss);
    }
    let device = loss.device();
    let dtype = loss.dtype();
    let local = loss.detach().into_data().convert_dtype(DType::F64);
    let local = local
        .try_into_vec::<f64>()
        .map_err(|e| LearnerError::Unsupported(format!("a loss of {e:?}")))?;
    if local.len() != 1 {
        return Err(LearnerError::Unsupported(format!(
            "the step's loss has {} elements: GatherOutput expects the mean loss, one element",
            local.len()
        )));
    }
    let summed = group.all_reduce(
        TensorData::new(vec![local[0] * rows as f64, rows as f64], [2]),
        ReduceOp::Sum,
    )?;
    let summed = summed.try_into_vec::<f64>().expect("f64 sums");
    let mean = TensorData::new(vec![summed[0] / summed[1]], [1]).convert_dtype(dtype);
    Ok(Tensor::from_data(mean, &device))
}

impl GatherOutput for ClassificationOutput {
    fn gather(self, rows: usize, group: &ProcessGroup) -> Result<Self, LearnerError> {
        Ok(ClassificationOutput {
            loss: gather_mean(self.loss, rows, group)?,
            output: gather_rows(self.output, group)?,
            targets: gather_rows_int(self.targets, group)?,
        })
    }
}

impl GatherOutput for MultiLabelClassificationOutput {
    fn gather(self, rows: usize, group: &ProcessGroup) -> Result<Self, LearnerError> {
        Ok(MultiLabelClassificationOutput {
            loss: gather_mean(self.loss, rows, group)?,
            output: gather_rows(self.output, group)?,
            targets: gather_rows_int(self.targets, group)?,
        })
    }
}

impl GatherOutput for RegressionOutput {
    fn gather(self, rows: usize, group: &ProcessGroup) -> Result<Self, LearnerError> {
        Ok(RegressionOutput {
            loss: gather_mean(self.loss, rows, group)?,
            output: gather_rows(self.output, group)?,
            targets: gather_rows(self.targets, group)?,
        })
    }
}
