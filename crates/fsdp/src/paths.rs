//! Module paths of parameters (`layers.0.mlp.up_proj.weight`), the names every by-path view of a
//! model uses: full state dicts, checkpoints, replica checks.

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::Tensor;

/// Visits float parameters knowing each one's dotted module path.
pub trait PathVisitor {
    /// Called once per float parameter, in module order.
    fn visit_float<const D: usize>(&mut self, path: &str, param: &Param<Tensor<D>>);
}

/// Visits every float parameter of `module` with its dotted module path, in module order.
pub fn visit_with_paths<M: Module, V: PathVisitor>(module: &M, visitor: &mut V) {
    struct Tracking<'a, V> {
        stack: Vec<String>,
        inner: &'a mut V,
    }
    impl<V: PathVisitor> ModuleVisitor for Tracking<'_, V> {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.stack.push(name.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.stack.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.inner.visit_float(&self.stack.join("."), param);
        }
    }
    module.visit(&mut Tracking {
        stack: Vec::new(),
        inner: visitor,
    });
}
