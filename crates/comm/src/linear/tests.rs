//! The bf16 kernel against f64 math on the same bf16 values, and [`linear`] on the autodiff
//! backend: bf16 values and gradients against f64 math and against Burn's own bf16 linear,
//! f32 bit for bit Burn's linear (the same gemm products, unbatched), with and without gradient
//! checkpointing, on uneven shapes and transposed weights.

use burn::tensor::{Device, FloatDType, Tensor, TensorData, bf16};

use super::bf16_gemm::{self, Kernel};
use super::linear;
use super::packing::Bf16Matrix;

/// Deterministic values in about [-2, 2).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(6364136223846793005) | 1;
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
        })
        .collect()
}

/// One bf16 unit in the last place at `x`'s magnitude (7 stored mantissa bits).
fn ulp(x: f64) -> f64 {
    if x == 0.0 {
        return f64::MIN_POSITIVE;
    }
    2f64.powi(x.abs().log2().floor() as i32 - 7)
}

/// `got` within one bf16 ulp of the exact `want`, plus the f32 sum's own rounding
/// (`abs_sum`: the sum of the terms' magnitudes).
fn assert_bf16_close(what: &str, got: f32, want: f64, abs_sum: f64) {
    let tol = ulp(want) + abs_sum * 2f64.powi(-20);
    assert!(
        (got as f64 - want).abs() <= tol,
        "{what}: got {got}, exact {want} (tolerance {tol})"
    );
}

/// `a @ b` in f64, and each element's sum of magnitudes.
fn product_f64(a: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> (Vec<f64>, Vec<f64>) {
    let mut out = vec![0.0; m * n];
    let mut abs = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            for p in 0..k {
                out[i * n + j] += a[i * k + p] * b[p * n + j];
                abs[i * n + j] += (a[i * k + p] * b[p * n + j]).abs();
            }
        }
    }
    (out, abs)
}

/// How a test stores a logical row-major matrix.
#[derive(Debug, Clone, Copy)]
enum Layout {
    Rows,
    Transposed,
    /// Row-major with a gap after every element: strides `2 * cols` and 2.
    Spaced,
}

impl Layout {
    fn store(self, x: &[bf16], rows: usize, cols: usize) -> Vec<bf16> {
        let mut s = vec![bf16::ZERO; x.len() * if let Self::Spaced = self { 2 } else { 1 }];
        for r in 0..rows {
            for c in 0..cols {
                let at = match self {
                    Self::Rows => r * cols + c,
                    Self::Transposed => c * rows + r,
                    Self::Spaced => 2 * (r * cols + c),
                };
                s[at] = x[r * cols + c];
            }
        }
        s
    }

    fn view(self, data: &[bf16], rows: usize, cols: usize) -> Bf16Matrix<'_> {
        let (row_stride, col_stride) = match self {
            Self::Rows => (cols, 1),
            Self::Transposed => (1, rows),
            Self::Spaced => (2 * cols, 2),
        };
        Bf16Matrix {
            data,
            rows,
            cols,
            row_stride,
            col_stride,
        }
    }
}

/// Both kernels (vectors, and AMX tiles where this CPU and Linux allow them) against f64 math.
#[test]
fn bf16_matmul_matches_f64_math_on_uneven_and_transposed_operands() {
    let kernels = [Kernel::Vectors, Kernel::Tiles];
    for kernel in kernels.into_iter().filter(|kernel| {
        let runs = kernel.runs_here();
        if !runs {
            eprintln!("this CPU or OS cannot run {kernel:?}: flex takes the next kernel down");
        }
        runs
    }) {
        matmul_matches_f64_math(kernel);
    }
}

fn matmul_matches_f64_math(kernel: Kernel) {
    // Uneven everywhere: odd k (a padded pair), m past a tile and a block, n past a panel;
    // whole tiles (32 rows, 64 k: two AMX chunks, 32 columns); two whole micro-kernels
    // against uneven panels; a whole block and a short one.
    for (m, k, n) in [
        (1, 1, 1),
        (13, 7, 33),
        (97, 258, 65),
        (200, 3, 40),
        (5, 0, 3),
        (32, 64, 32),
        (64, 96, 70),
        (100, 64, 33),
    ] {
        // Each operand row-major, transposed, or every other element of a wider row-major
        // buffer (neither stride 1: the packing's strided reads).
        for (a_layout, b_layout) in [
            (Layout::Rows, Layout::Rows),
            (Layout::Transposed, Layout::Rows),
            (Layout::Rows, Layout::Transposed),
            (Layout::Spaced, Layout::Spaced),
        ] {
            let a: Vec<bf16> = values(m * k, 1).into_iter().map(bf16::from_f32).collect();
            let b: Vec<bf16> = values(k * n, 2).into_iter().map(bf16::from_f32).collect();
            let (a_store, b_store) = (a_layout.store(&a, m, k), b_layout.store(&b, k, n));
            // NaN where the kernel writes nothing: every element must be written.
            let mut out = vec![std::mem::MaybeUninit::new(bf16::NAN); m * n];
            bf16_gemm::matmul_on(
                kernel,
                a_layout.view(&a_store, m, k),
                b_layout.view(&b_store, k, n),
                &mut out,
            );
            // SAFETY: initialised to NaN above, overwritten by the kernel.
            let out: Vec<bf16> = out.iter().map(|o| unsafe { o.assume_init() }).collect();
            let f64s = |x: &[bf16]| x.iter().map(|v| v.to_f64()).collect::<Vec<_>>();
            let (want, abs) = product_f64(&f64s(&a), &f64s(&b), m, k, n);
            for (i, got) in out.iter().enumerate() {
                let what = format!("{kernel:?} {m}x{k}x{n} ({a_layout:?}, {b_layout:?})[{i}]");
                assert_bf16_close(&what, got.to_f32(), want[i], abs[i]);
            }
        }
    }
}

/// The devices the layer runs on: flex with and without gradient checkpointing.
fn devices() -> Vec<Device> {
    let flex = Device::flex().autodiff();
    vec![flex.clone(), flex.gradient_checkpointing()]
}

fn read<const D: usize>(t: &Tensor<D>) -> Vec<f32> {
    t.to_data().convert::<f32>().to_vec::<f32>().unwrap()
}

/// `x`, `w` (stored `[d_out, d_in]` and transposed, as a tied head's), `b` and the output's
/// gradient `g`, in `dtype`, tracked; the loss `sum(linear(x, w, b) * g)`.
struct Case {
    x: Tensor<3>,
    w_stored: Tensor<2>,
    b: Tensor<1>,
    g: Tensor<3>,
}

impl Case {
    fn new(device: &Device, dtype: FloatDType, [batch, seq, d_in, d_out]: [usize; 4]) -> Self {
        let make = |shape: Vec<usize>, seed| {
            let n = shape.iter().product();
            Tensor::<1>::from_data(TensorData::new(values(n, seed), [n]), device).cast(dtype)
        };
        Self {
            x: make(vec![batch * seq * d_in], 3)
                .reshape([batch, seq, d_in])
                .require_grad(),
            w_stored: make(vec![d_out * d_in], 4)
                .reshape([d_out, d_in])
                .require_grad(),
            b: make(vec![d_out], 5).require_grad(),
            g: make(vec![batch * seq * d_out], 6).reshape([batch, seq, d_out]),
        }
    }

    /// The output and the gradients of `x`, the stored weight and the bias, through `layer`.
    fn run(&self, layer: impl Fn(Tensor<3>, Tensor<2>, Tensor<1>) -> Tensor<3>) -> [Vec<f32>; 4] {
        let y = layer(
            self.x.clone(),
            self.w_stored.clone().transpose(),
            self.b.clone(),
        );
        let grads = (y.clone() * self.g.clone()).sum().backward();
        let grad = |t: Option<Vec<f32>>| t.expect("a tracked input has a gradient");
        [
            read(&y),
            grad(self.x.grad(&grads).map(|t| read(&t))),
            grad(self.w_stored.grad(&grads).map(|t| read(&t))),
            grad(self.b.grad(&grads).map(|t| read(&t))),
        ]
    }
}

#[test]
fn f32_linear_is_burns_bit_for_bit() {
    for device in devices() {
        let case = Case::new(&device, FloatDType::F32, [2, 5, 33, 40]);
        let ours = case.run(|x, w, b| linear(x, w, Some(b)));
        let burns = case.run(|x, w, b| burn::tensor::module::linear(x, w, Some(b)));
        assert_eq!(ours, burns, "on {device:?}");
    }
}

#[test]
fn bf16_linear_matches_f64_math_and_burns_bf16_linear() {
    let (batch, seq, d_in, d_out) = (2, 7, 37, 45);
    for device in devices() {
        let case = Case::new(&device, FloatDType::BF16, [batch, seq, d_in, d_out]);
        let [y, dx, dw_stored, db] = case.run(|x, w, b| linear(x, w, Some(b)));
        let [by, bdx, bdw, bdb] = case.run(|x, w, b| burn::tensor::module::linear(x, w, Some(b)));
        let f64s = |t: &Tensor<3>| read(t).into_iter().map(f64::from).collect::<Vec<_>>();
        let rows = batch * seq;
        let x = f64s(&case.x);
        let g = f64s(&case.g);
        let w_stored: Vec<f64> = read(&case.w_stored).into_iter().map(f64::from).collect();
        let bias: Vec<f64> = read(&case.b).into_iter().map(f64::from).collect();
        // w = w_stored^T: [d_in, d_out].
        let mut w = vec![0.0; d_in * d_out];
        for o in 0..d_out {
            for i in 0..d_in {
                w[i * d_out + o] = w_stored[o * d_in + i];
            }
        }
        let transpose = |m: &[f64], r: usize, c: usize| {
            let mut t = vec![0.0; m.len()];
            for i in 0..r {
                for j in 0..c {
                    t[j * r + i] = m[i * c + j];
                }
            }
            t
        };
        // y = x w + b (the product rounded to bf16, then the bias added and rounded).
        let (xw, xw_abs) = product_f64(&x, &w, rows, d_in, d_out);
        for (i, got) in y.iter().enumerate() {
            let want = xw[i] + bias[i % d_out];
            let tol_abs = xw_abs[i] + bias[i % d_out].abs() + ulp(xw[i]) * 2f64.powi(20);
            assert_bf16_close(&format!("y[{i}] on {device:?}"), *got, want, tol_abs);
        }
        // dx = g w^T; dw = x^T g (compared as w_stored's gradient, its transpose); db = sum g.
        let (want_dx, dx_abs) = product_f64(&g, &transpose(&w, d_in, d_out), rows, d_out, d_in);
        for (i, got) in dx.iter().enumerate() {
            assert_bf16_close(
                &format!("dx[{i}] on {device:?}"),
                *got,
                want_dx[i],
                dx_abs[i],
            );
        }
        let (want_dw, dw_abs) = product_f64(&transpose(&x, rows, d_in), &g, d_in, rows, d_out);
        for o in 0..d_out {
            for i in 0..d_in {
                let (got, at) = (dw_stored[o * d_in + i], i * d_out + o);
                let what = format!("dw[{i}, {o}] on {device:?}");
                assert_bf16_close(&what, got, want_dw[at], dw_abs[at]);
            }
        }
        for (o, got) in db.iter().enumerate() {
            let col: Vec<f64> = (0..rows).map(|r| g[r * d_out + o]).collect();
            let want: f64 = col.iter().sum();
            let abs: f64 = col.iter().map(|v| v.abs()).sum();
            assert_bf16_close(&format!("db[{o}] on {device:?}"), *got, want, abs * 4.0);
        }
        // Burn's bf16 linear (operands in f32 through gemm) agrees to a bf16 ulp or two.
        for (what, ours, burns) in [("y", &y, &by), ("dx", &dx, &bdx), ("dw", &dw_stored, &bdw)] {
            for (i, (a, b)) in ours.iter().zip(burns.iter()).enumerate() {
                let tol = 2.0 * ulp(*b as f64) + 1e-3;
                assert!(
                    (*a as f64 - *b as f64).abs() <= tol,
                    "{what}[{i}] on {device:?}: ours {a}, Burn's {b}"
                );
            }
        }
        assert_eq!(db, bdb, "the bias gradient is Burn's kernel on {device:?}");
    }
}

/// Broadcast views (a zero stride), sizes of one and of zero give the values of Burn's bf16
/// linear.
#[test]
fn bf16_linear_on_broadcast_weights_and_single_rows_is_burns() {
    let device = Device::flex();
    let bf16 = |t: Tensor<2>| t.cast(FloatDType::BF16);
    let data = |n, seed| TensorData::new(values(n, seed), [n]);
    let x: Tensor<2> = bf16(Tensor::<1>::from_data(data(3 * 20, 7), &device).reshape([3, 20]));
    let row: Tensor<2> = bf16(Tensor::<1>::from_data(data(9, 8), &device).reshape([1, 9]));
    let broadcast = row.clone().expand([20, 9]);
    let column: Tensor<2> = bf16(Tensor::<1>::from_data(data(20, 10), &device).reshape([20, 1]));
    let broadcast_columns = column.expand([20, 9]);
    let single = x.clone().slice([0..1, 0..20]);
    let no_features = bf16(Tensor::<2>::zeros([3, 0], &device));
    let no_outputs = bf16(Tensor::<2>::zeros([20, 0], &device));
    for (what, x, w) in [
        (
            "no input features",
            no_features,
            bf16(Tensor::<2>::zeros([0, 9], &device)),
        ),
        ("no outputs", x.clone(), no_outputs),
        ("weight broadcast over rows", x.clone(), broadcast.clone()),
        (
            "weight broadcast over columns",
            x.clone(),
            broadcast_columns,
        ),
        ("one row", single, broadcast),
        (
            "one column",
            x,
            bf16(Tensor::<1>::from_data(data(20, 9), &device).reshape([20, 1])),
        ),
    ] {
        let (ours, burns) = (
            linear(x.clone(), w.clone(), None),
            burn::tensor::module::linear(x, w, None),
        );
        assert_eq!(ours.dims(), burns.dims(), "{what}");
        let (ours, burns) = (read(&ours), read(&burns));
        for (i, (a, b)) in ours.iter().zip(&burns).enumerate() {
            let tol = 2.0 * ulp(*b as f64) + 1e-3;
            assert!(
                (*a as f64 - *b as f64).abs() <= tol,
                "{what}[{i}]: ours {a}, Burn's {b}"
            );
        }
    }
}
