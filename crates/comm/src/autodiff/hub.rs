//! The hub that collects the gradients of [`split_segments`](super::split_segments)'s views,
//! shared by the hub node and its views (the backend extension's nodes carry it).

use std::any::Any;
use std::ops::Range;
use std::sync::{Arc, Mutex};

/// The gradients the views of one split left for their hub, with the ranges each view was
/// made of. Shared by the hub and its views (type-erased: the backend's tensor type is only
/// known inside its ops).
#[derive(Clone, Default)]
pub struct SplitHub(Arc<Mutex<Vec<Deposit>>>);

/// A view's gradient (the backend's tensor, type-erased) and the ranges the view was made of.
type Deposit = (Vec<Range<usize>>, Box<dyn Any + Send>);

impl std::fmt::Debug for SplitHub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.0.lock().map_or(0, |d| d.len());
        write!(f, "SplitHub({n} gradients)")
    }
}

impl SplitHub {
    /// Leaves the gradient of the view made of `segments`.
    pub(crate) fn deposit<T: Any + Send>(&self, segments: Vec<Range<usize>>, grad: T) {
        self.lock().push((segments, Box::new(grad)));
    }

    /// Takes every gradient left, with its view's ranges.
    pub(crate) fn take<T: Any>(&self) -> Vec<(Vec<Range<usize>>, T)> {
        std::mem::take(&mut *self.lock())
            .into_iter()
            .map(|(segments, g)| {
                let g = g.downcast::<T>().expect("one backend per split");
                (segments, *g)
            })
            .collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Deposit>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}
