//! Which parameters of a module train: read from each parameter's `require_grad` without
//! initializing lazy ones, so that the parallelizer can tell frozen modules (whose units reduce
//! nothing, or that stay whole on every rank) and a model with nothing to train apart.

use std::collections::HashSet;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::tensor::{Tensor, TensorData};

/// How many float parameters of a module take a gradient and how many do not. Parameters on a
/// device without autodiff are in neither count: nothing trains there (inference), so they say
/// nothing about what the user froze.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Trainability {
    /// Parameters with `require_grad` on an autodiff device.
    pub trainable: usize,
    /// Parameters without `require_grad` on an autodiff device.
    pub frozen: usize,
}

impl Trainability {
    /// Every parameter counted is frozen, and there is at least one: a wholly frozen module.
    pub fn wholly_frozen(&self) -> bool {
        self.frozen > 0 && self.trainable == 0
    }
}

/// Counts `module`'s trainable and frozen parameters (see [`Trainability`]). Under FSDP the
/// shards are counted (they keep their parameter's setting). No communication; lazy parameters
/// stay lazy.
pub fn trainability<M: Module>(module: &M) -> Trainability {
    struct Count(Trainability);
    impl ModuleVisitor for Count {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            match is_trainable(param) {
                Some(true) => self.0.trainable += 1,
                Some(false) => self.0.frozen += 1,
                None => {}
            }
        }
    }
    let mut count = Count(Trainability::default());
    module.visit(&mut count);
    count.0
}

/// The ids of `module`'s float parameters, in no particular order.
pub fn param_ids<M: Module>(module: &M) -> HashSet<ParamId> {
    struct Ids(HashSet<ParamId>);
    impl ModuleVisitor for Ids {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.insert(param.id);
        }
    }
    let mut ids = Ids(HashSet::new());
    module.visit(&mut ids);
    ids.0
}

/// The ids of `module`'s frozen parameters: without `require_grad` on an autodiff device (see
/// [`Trainability`]). No communication; lazy parameters stay lazy.
pub fn frozen_param_ids<M: Module>(module: &M) -> HashSet<ParamId> {
    struct Frozen(HashSet<ParamId>);
    impl ModuleVisitor for Frozen {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if is_trainable(param) == Some(false) {
                self.0.insert(param.id);
            }
        }
    }
    let mut frozen = Frozen(HashSet::new());
    module.visit(&mut frozen);
    frozen.0
}

/// Whether `param` takes a gradient; `None` on a device without autodiff.
fn is_trainable<const D: usize>(param: &Param<Tensor<D>>) -> Option<bool> {
    let device = param.lazy_device();
    if !device.is_autodiff() {
        return None;
    }
    if param.is_initialized() {
        return Some(param.base().is_require_grad());
    }
    // Burn reads a lazy parameter's setting only when loading into it: load an empty tensor
    // into a clone (the clone's own state; the initializer does not run).
    let empty = Tensor::<D>::from_data(TensorData::new(Vec::<f32>::new(), [0; D]), &device);
    let loaded = param.clone().transform_for_load(empty, param.id);
    Some(loaded.base().is_require_grad())
}

#[cfg(test)]
mod tests {
    use burn::module::{Module, ModuleVisitor, Param};
    use burn::nn::LinearConfig;
    use burn::tensor::{Device, Tensor};

    use super::{Trainability, trainability};

    #[allow(deprecated)]
    fn plain() -> Device {
        Device::ndarray()
    }

    /// Whether any float parameter of `module` is initialized.
    fn any_initialized<M: Module>(module: &M) -> bool {
        struct Any(bool);
        impl ModuleVisitor for Any {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                self.0 |= param.is_initialized();
            }
        }
        let mut any = Any(false);
        module.visit(&mut any);
        any.0
    }

    /// Lazy parameters are read without being initialized; a plain device counts nothing.
    #[test]
    fn counts_lazy_and_initialized_parameters_on_autodiff_devices_only() {
        let device = plain().autodiff();
        let lazy = LinearConfig::new(3, 2).init(&device);
        assert!(!any_initialized(&lazy));
        let both = Trainability {
            trainable: 2,
            frozen: 0,
        };
        assert_eq!(trainability(&lazy), both);
        let frozen = lazy.no_grad();
        assert_eq!(trainability(&frozen).frozen, 2);
        assert!(trainability(&frozen).wholly_frozen());
        assert!(
            !any_initialized(&frozen),
            "counting initialized a parameter"
        );
        let initialized = LinearConfig::new(3, 2).init(&device);
        let _ = initialized.weight.val();
        assert_eq!(trainability(&initialized).trainable, 2);
        let inference = LinearConfig::new(3, 2).init(&plain()).no_grad();
        assert_eq!(trainability(&inference), Trainability::default());
        assert!(!trainability(&inference).wholly_frozen());
    }
}
