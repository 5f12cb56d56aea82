//! One pass over the data loaders per process, shared by the process's rank threads.
//!
//! burn-train's loaders shuffle with an RNG that every `iter()`, `to_device()` and `slice()`
//! advances, so ranks iterating their own copies would each see another order. One feeder
//! thread per process iterates the loaders exactly as the single-device strategy does (one
//! `to_device` each, one `iter()` per epoch and split) and hands every local rank each whole
//! batch; a rank takes its rows of it ([`SplitBatch::rows`](crate::SplitBatch::rows)). Under
//! MPI each process runs its own feeder over its own copy of the loaders, which the same seed
//! makes identical.

use std::sync::mpsc::{Receiver, SyncSender};
use std::sync::{Arc, Mutex};

use burn::data::dataloader::{DataLoader, Progress};
use burn_train::Interrupter;

/// What the feeder hands each rank, in order: per epoch the training batches then `End`, the
/// validation batches then `End`.
pub(crate) enum Fed<T, V> {
    /// A training batch (shared by the local ranks) and the loader's progress after it.
    Train(Arc<Mutex<T>>, Progress),
    /// A validation batch and the loader's progress after it.
    Valid(Arc<Mutex<V>>, Progress),
    /// The end of the split.
    End,
    /// The loader failed; the error is on the interrupter.
    Failed,
}

impl<T, V> Clone for Fed<T, V> {
    fn clone(&self) -> Self {
        match self {
            Fed::Train(b, p) => Fed::Train(b.clone(), p.clone()),
            Fed::Valid(b, p) => Fed::Valid(b.clone(), p.clone()),
            Fed::End => Fed::End,
            Fed::Failed => Fed::Failed,
        }
    }
}

/// The feeder thread's body: waits for the local ranks' channels, then runs the epochs
/// `first..=last`. It ends when every pass is sent, when a rank hangs up (training stopped),
/// or when a loader fails (after recording the error on `interrupter`). Creating an iterator
/// is what draws a shuffled order, so the skipped epochs of a resumed run cost no data reads.
pub(crate) fn feed<T, V>(
    ranks: Receiver<Vec<SyncSender<Fed<T, V>>>>,
    train: Arc<dyn DataLoader<T>>,
    valid: Arc<dyn DataLoader<V>>,
    (first, last): (usize, usize),
    interrupter: Interrupter,
) {
    let Ok(ranks) = ranks.recv() else {
        return; // no rank got far enough to train
    };
    // A resumed run (first > 1) shuffles its epochs as the uninterrupted run did: each earlier
    // epoch's `iter()` advances the loaders' RNG as it would have.
    for _ in 1..first {
        drop(train.iter());
        drop(valid.iter());
    }
    for _ in first..=last {
        if !pass(&ranks, &*train, Fed::Train, &interrupter)
            || !pass(&ranks, &*valid, Fed::Valid, &interrupter)
        {
            return;
        }
    }
}

/// One split: every item to every rank, then `End`. False when the feeder must stop.
fn pass<O, T, V>(
    ranks: &[SyncSender<Fed<T, V>>],
    loader: &dyn DataLoader<O>,
    wrap: fn(Arc<Mutex<O>>, Progress) -> Fed<T, V>,
    interrupter: &Interrupter,
) -> bool {
    let send = |message: Fed<T, V>| ranks.iter().all(|r| r.send(message.clone()).is_ok());
    let mut items = loader.iter();
    while let Some(item) = items.next() {
        let progress = items.progress();
        match item {
            Ok(batch) => {
                if !send(wrap(Arc::new(Mutex::new(batch)), progress)) {
                    return false;
                }
            }
            Err(error) => {
                interrupter.fail(error);
                send(Fed::Failed);
                return false;
            }
        }
    }
    send(Fed::End)
}
