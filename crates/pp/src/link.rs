//! Point-to-point between neighbouring stages over the pipeline groups: the shape handshake and
//! the activations and gradients. Only detached data crosses ranks (a tracked tensor handed to
//! another rank would merge two autodiff graphs).
//!
//! Activations go to the next rank and gradients to the previous one, round the ring of
//! pipeline ranks (the interleaved schedule sends the last rank's activations on to rank 0).
//! They travel on two groups over the same ranks: every engine delivers one group's messages
//! between two ranks in order, and with two ranks an activation and a gradient may be in
//! flight between the same pair at once, each direction of the schedule in its own order.

use burn::tensor::TensorData;
use burn_parallel_comm::{Collective, CollectiveHandle, ProcessGroup};

use crate::error::PipelineError;

/// One rank's ends of the links to its neighbouring ranks: its place is its index in the
/// pipeline groups. Sends are started without waiting (receives block);
/// [`StageLink::finish`] waits for every send so that a failed one is reported.
pub struct StageLink {
    forward: ProcessGroup,
    backward: ProcessGroup,
    pending: Vec<CollectiveHandle>,
}

impl StageLink {
    /// The links over `forward` (activations) and `backward` (gradients): two groups of the
    /// same ranks, in pipeline order.
    pub fn new(forward: ProcessGroup, backward: ProcessGroup) -> Result<Self, PipelineError> {
        if forward.ranks() != backward.ranks() || forward.label() == backward.label() {
            return Err(PipelineError::Schedule(format!(
                "the activation and gradient groups must be two groups of the same ranks, not \
                 {} and {}",
                forward.label(),
                backward.label()
            )));
        }
        Ok(Self {
            forward,
            backward,
            pending: Vec::new(),
        })
    }

    /// This rank's place in the pipeline.
    pub fn rank(&self) -> usize {
        self.forward.index()
    }

    /// The number of pipeline ranks.
    pub fn ranks(&self) -> usize {
        self.forward.size()
    }

    fn next(&self) -> usize {
        (self.rank() + 1) % self.ranks()
    }

    fn prev(&self) -> usize {
        (self.rank() + self.ranks() - 1) % self.ranks()
    }

    /// Starts sending an activation to the next rank.
    pub fn send_activation(&mut self, data: TensorData) {
        let dst = self.next();
        let handle = self.forward.start(Collective::Send { data, dst });
        self.pending.push(handle);
    }

    /// Starts sending a gradient to the previous rank.
    pub fn send_gradient(&mut self, data: TensorData) {
        let dst = self.prev();
        let handle = self.backward.start(Collective::Send { data, dst });
        self.pending.push(handle);
    }

    /// The next activation from the previous rank.
    pub fn recv_activation(&self) -> Result<TensorData, PipelineError> {
        Ok(self.forward.recv(self.prev())?)
    }

    /// The next gradient from the next rank.
    pub fn recv_gradient(&self) -> Result<TensorData, PipelineError> {
        Ok(self.backward.recv(self.next())?)
    }

    /// Waits for every send started so far.
    pub fn finish(&mut self) -> Result<(), PipelineError> {
        for handle in self.pending.drain(..) {
            handle.wait()?;
        }
        Ok(())
    }

    /// The handshake before a step: this rank sends the shapes it will send (`outputs`, one
    /// per message, in order; `None` when it sends no activation) to the next rank and the
    /// shapes it expects (`inputs`; `None` when it receives none) to the previous one; both
    /// ends of a link compare them, and a disagreement is the same
    /// [`PipelineError::ShapeMismatch`] on both, before any activation moves.
    pub fn agree_shapes(
        &mut self,
        inputs: Option<&[Vec<usize>]>,
        outputs: Option<&[Vec<usize>]>,
    ) -> Result<(), PipelineError> {
        if let Some(outputs) = outputs {
            self.send_activation(encode(outputs));
        }
        if let Some(inputs) = inputs {
            self.send_gradient(encode(inputs));
        }
        let mut result = Ok(());
        if let Some(inputs) = inputs {
            let sent = decode(self.recv_activation()?)?;
            if sent != inputs {
                result = Err(PipelineError::ShapeMismatch {
                    sender: self.prev(),
                    receiver: self.rank(),
                    sent,
                    expected: inputs.to_vec(),
                });
            }
        }
        if let Some(outputs) = outputs {
            let expected = decode(self.recv_gradient()?)?;
            if expected != outputs && result.is_ok() {
                result = Err(PipelineError::ShapeMismatch {
                    sender: self.rank(),
                    receiver: self.next(),
                    sent: outputs.to_vec(),
                    expected,
                });
            }
        }
        self.finish()?;
        result
    }
}

/// Shapes as one i64 message: the count, then each shape's rank and dims.
fn encode(shapes: &[Vec<usize>]) -> TensorData {
    let mut words = vec![shapes.len() as i64];
    for shape in shapes {
        words.push(shape.len() as i64);
        words.extend(shape.iter().map(|&d| d as i64));
    }
    let n = words.len();
    TensorData::new(words, [n])
}

fn decode(data: TensorData) -> Result<Vec<Vec<usize>>, PipelineError> {
    let bad = || PipelineError::Schedule("a malformed shape handshake message".into());
    let words = data
        .convert::<i64>()
        .try_into_vec::<i64>()
        .map_err(|_| bad())?;
    let mut it = words.into_iter().map(|w| w as usize);
    let count = it.next().ok_or_else(bad)?;
    (0..count)
        .map(|_| {
            let rank = it.next().ok_or_else(bad)?;
            (0..rank).map(|_| it.next().ok_or_else(bad)).collect()
        })
        .collect()
}
