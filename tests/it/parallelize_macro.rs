//! What `#[parallelize]` generates: the `ModelDescription` (units, tp styles, named plans, head
//! counts), the order and paths `map_units` and `apply_tp` visit, and the local
//! head counts, on annotated models covering both attribute orders, a generic struct, nested
//! structs, `Vec` and `Option` fields, a named plan and a custom sidecar.

use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::{Embedding, Linear};
use burn::tensor::{Device, Tensor};
use burn_parallel::comm::launch;
use burn_parallel::models::LLAMA_PLAN;
use burn_parallel::parallelize;
use burn_parallel::parallelizer::{
    DefaultParallelizer, HeadCount, ModelDescription, ModelParallelizer, ParallelError,
    Parallelize, UnitMap, Unsupported,
};
use burn_parallel::tp::{ParallelStyle, Tp, TpApplier, TpError, TpModule, TpPlan, TpReport};

use crate::common::ndarray;
use crate::tp_common::{embedding_on, linear_on};

const MODEL: usize = 4;

#[parallelize]
#[derive(Module, Debug)]
pub struct Attn {
    #[tp(colwise)]
    q: Tp<Linear>,
    #[tp(rowwise)]
    o: Tp<Linear>,
    #[module(skip)]
    #[tp(heads)]
    heads: usize,
    #[tp(kv_heads)]
    #[module(skip)]
    kv_heads: usize,
}

/// Derive first, then the attribute; sequence-parallel styles with and without a dim.
#[derive(Module, Debug)]
#[parallelize]
pub struct Mlp {
    #[tp(colwise_sp)]
    up: Tp<Linear>,
    #[tp(rowwise_sp(2))]
    down: Tp<Linear>,
    /// A `Tp` field without a style: a plan may still style it.
    gate: Tp<Linear>,
}

#[parallelize]
#[derive(Module, Debug)]
pub struct Block {
    norm: Linear,
    #[nested]
    attn: Attn,
    #[nested]
    #[fsdp(unit)]
    mlp: Mlp,
}

/// A generic stack: each element is a unit, and recursed into.
#[parallelize]
#[derive(Module, Debug)]
pub struct Stack<B: Module> {
    #[nested]
    #[fsdp(unit)]
    blocks: Vec<B>,
    #[tp(colwise)]
    heads_out: Vec<Tp<Linear>>,
}

#[derive(Default)]
pub struct TinySidecar;

impl ModelParallelizer for TinySidecar {}

#[parallelize(plan = LLAMA_PLAN, sidecar = TinySidecar)]
#[derive(Module, Debug)]
pub struct Model {
    #[tp(vocab_parallel)]
    embed: Tp<Embedding>,
    #[nested]
    stack: Stack<Block>,
    #[fsdp(unit)]
    extra: Option<Linear>,
    #[nested]
    #[fsdp(unit)]
    maybe_block: Option<Block>,
    #[tp(colwise_gathered)]
    head: Option<Tp<Linear>>,
}

fn lin(d: &Device, seed: u64) -> Linear {
    linear_on(d, seed, MODEL, MODEL)
}

fn block(d: &Device, seed: u64) -> Block {
    Block {
        norm: lin(d, seed),
        attn: Attn {
            q: Tp::new(lin(d, seed + 1)),
            o: Tp::new(lin(d, seed + 2)),
            heads: 4,
            kv_heads: 2,
        },
        mlp: Mlp {
            up: Tp::new(lin(d, seed + 3)),
            down: Tp::new(lin(d, seed + 4)),
            gate: Tp::new(lin(d, seed + 5)),
        },
    }
}

fn model(d: &Device, with_options: bool) -> Model {
    Model {
        embed: Tp::new(embedding_on(d, 1, MODEL, MODEL)),
        stack: Stack {
            blocks: vec![block(d, 10), block(d, 20)],
            heads_out: vec![Tp::new(lin(d, 30)), Tp::new(lin(d, 31))],
        },
        extra: with_options.then(|| lin(d, 40)),
        maybe_block: with_options.then(|| block(d, 50)),
        head: with_options.then(|| Tp::new(lin(d, 60))),
    }
}

fn describe<M: Parallelize>(m: &M, path: &str) -> ModelDescription {
    let mut out = ModelDescription::default();
    m.describe(path, &mut out);
    out
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

fn tp(path: &str, style: ParallelStyle) -> (String, ParallelStyle) {
    (path.to_string(), style)
}

fn heads(path: &str) -> HeadCount {
    HeadCount {
        path: path.to_string(),
        heads: Some(4),
        kv_heads: Some(2),
    }
}

/// The tp entries of one `Block` at `p`.
fn block_tp(p: &str) -> Vec<(String, ParallelStyle)> {
    vec![
        tp(&format!("{p}.attn.q"), ParallelStyle::colwise()),
        tp(&format!("{p}.attn.o"), ParallelStyle::rowwise()),
        tp(&format!("{p}.mlp.up"), ParallelStyle::colwise_sp(1)),
        tp(&format!("{p}.mlp.down"), ParallelStyle::rowwise_sp(2)),
    ]
}

#[test]
fn describe_lists_units_styles_plans_and_heads() {
    let d = ndarray();
    let got = describe(&model(&d, true), "");
    let mut tp_entries = vec![tp("embed", ParallelStyle::vocab_parallel())];
    tp_entries.extend(block_tp("stack.blocks.0"));
    tp_entries.extend(block_tp("stack.blocks.1"));
    tp_entries.push(tp("stack.heads_out.*", ParallelStyle::colwise()));
    tp_entries.extend(block_tp("maybe_block"));
    tp_entries.push(tp("head", ParallelStyle::colwise_gathered()));
    let want = ModelDescription {
        units: strings(&[
            "stack.blocks.0",
            "stack.blocks.0.mlp",
            "stack.blocks.1",
            "stack.blocks.1.mlp",
            "extra",
            "maybe_block",
            "maybe_block.mlp",
        ]),
        tp_entries,
        named_plans: vec![(String::new(), LLAMA_PLAN)],
        heads: vec![
            heads("stack.blocks.0.attn"),
            heads("stack.blocks.1.attn"),
            heads("maybe_block.attn"),
        ],
        absent: Vec::new(),
        experts: Vec::new(),
        parts: Vec::new(),
    };
    assert_eq!(got, want);
}

#[test]
fn describe_skips_absent_options_and_prefixes_the_root_path() {
    let d = ndarray();
    let got = describe(&model(&d, false), "net");
    assert_eq!(
        got.units,
        strings(&[
            "net.stack.blocks.0",
            "net.stack.blocks.0.mlp",
            "net.stack.blocks.1",
            "net.stack.blocks.1.mlp"
        ])
    );
    assert_eq!(got.named_plans, vec![("net".to_string(), LLAMA_PLAN)]);
    assert!(
        got.tp_entries
            .iter()
            .all(|(p, _)| !p.contains("head") || p.contains("heads_out"))
    );
    assert_eq!(got.heads.len(), 2);
    // The absent optional Tp head drops out of the named plan (it has an `lm_head` entry).
    assert_eq!(got.absent, strings(&["net.head"]), "{got:?}");
    let with_lm_head = ModelDescription {
        named_plans: vec![(String::new(), LLAMA_PLAN)],
        ..ModelDescription::default()
    };
    let mut without = with_lm_head.clone();
    without.absent = strings(&["lm_head"]);
    let has_lm_head = |d: &ModelDescription| {
        d.tp_plan(false)
            .entries()
            .iter()
            .any(|(p, _)| p == "lm_head")
    };
    assert!(has_lm_head(&with_lm_head));
    assert!(!has_lm_head(&without));
}

#[test]
fn sidecar_is_the_named_type_or_the_default() {
    let name = |n: &str| n.to_string();
    assert_eq!(
        name(std::any::type_name::<<Model as Parallelize>::Sidecar>()),
        name(std::any::type_name::<TinySidecar>())
    );
    assert_eq!(
        name(std::any::type_name::<<Block as Parallelize>::Sidecar>()),
        name(std::any::type_name::<DefaultParallelizer>())
    );
}

/// Records each unit path, and counts the parameters of what it was given.
struct Recorder(Vec<(String, usize)>);

struct Count(usize);

impl ModuleVisitor for Count {
    fn visit_float<const D: usize>(&mut self, _param: &Param<Tensor<D>>) {
        self.0 += 1;
    }
}

fn count<M: Module>(m: &M) -> usize {
    let mut c = Count(0);
    m.visit(&mut c);
    c.0
}

impl UnitMap for Recorder {
    type Error = ParallelError;

    fn unit<M: Module>(&mut self, path: &str, module: M) -> Result<M, ParallelError> {
        self.0.push((path.to_string(), count(&module)));
        Ok(module)
    }
}

#[test]
fn map_units_visits_inner_units_before_outer_in_declaration_order() {
    let d = ndarray();
    let m = model(&d, true);
    let params = count(&m);
    let mut rec = Recorder(Vec::new());
    let m = m.map_units("", &mut rec).unwrap();
    assert_eq!(count(&m), params);
    // Block: norm (2) + attn (4) + mlp (6) params; Mlp: 6; Linear: 2.
    let want = [
        ("stack.blocks.0.mlp", 6),
        ("stack.blocks.0", 12),
        ("stack.blocks.1.mlp", 6),
        ("stack.blocks.1", 12),
        ("extra", 2),
        ("maybe_block.mlp", 6),
        ("maybe_block", 12),
    ];
    let want: Vec<_> = want.iter().map(|(p, n)| (p.to_string(), *n)).collect();
    assert_eq!(rec.0, want);
}

/// A unit map that fails at one path: the error comes back out of `map_units`.
struct FailAt(&'static str);

impl UnitMap for FailAt {
    type Error = ParallelError;

    fn unit<M: Module>(&mut self, path: &str, module: M) -> Result<M, ParallelError> {
        if path == self.0 {
            Err(ParallelError::NotSupported(Unsupported::Other(format!(
                "unit {path}"
            ))))
        } else {
            Ok(module)
        }
    }
}

#[test]
fn map_units_returns_the_unit_maps_error() {
    let err = model(&ndarray(), true)
        .map_units("", &mut FailAt("stack.blocks.1.mlp"))
        .unwrap_err();
    assert!(err.to_string().contains("stack.blocks.1.mlp"), "{err}");
}

/// Applies the plan on a 2-rank group and returns what one rank saw.
fn apply_on_two<T: Send>(plan: TpPlan, f: impl Fn(Model, TpReport) -> T + Send + Sync) -> T {
    launch(2, |ctx| {
        let group = ctx.world()?;
        let mut cx = TpApplier::new(&plan, &group);
        let m = model(&ndarray(), true).apply_tp("", &mut cx)?;
        Ok::<_, TpError>(f(m, cx.finish()))
    })
    .unwrap()
    .remove(0)
}

/// The parameters `visit_tp_sharded` reports.
fn sharded(m: &Model) -> usize {
    let mut c = Count(0);
    m.visit_tp_sharded(&mut c);
    c.0
}

/// A plan with just the model's field styles (the named llama plan's paths are not in it).
fn field_plan(d: &Device) -> TpPlan {
    describe(&model(d, true), "")
        .tp_entries
        .into_iter()
        .fold(TpPlan::new(), |p, (path, style)| p.with(path, style))
}

#[test]
fn apply_tp_reaches_every_tp_field_through_nested_vec_and_option_fields() {
    let (report, sharded_params) = apply_on_two(field_plan(&ndarray()), |m, r| (r, sharded(&m)));
    let mut covered: Vec<_> = report.applied.iter().map(|(p, _)| p.clone()).collect();
    covered.extend(report.uncovered_modules.iter().cloned());
    covered.sort();
    let mut want = strings(&["embed", "head", "stack.heads_out.0", "stack.heads_out.1"]);
    for b in ["stack.blocks.0", "stack.blocks.1", "maybe_block"] {
        for f in ["attn.q", "attn.o", "mlp.up", "mlp.down", "mlp.gate"] {
            want.push(format!("{b}.{f}"));
        }
    }
    want.sort();
    assert_eq!(covered, want);
    let mut uncovered = report.uncovered_modules.clone();
    uncovered.sort();
    assert_eq!(
        uncovered,
        strings(&[
            "maybe_block.mlp.gate",
            "stack.blocks.0.mlp.gate",
            "stack.blocks.1.mlp.gate"
        ])
    );
    assert!(report.unmatched_entries.is_empty(), "{report:?}");
    // Split weights and biases: colwise-like styles split both, rowwise ones the weight only.
    // Per block: q 2 + o 1 + up 2 + down 1; embed 1, heads_out 2 x 2, head 2.
    assert_eq!(sharded_params, 3 * 6 + 1 + 4 + 2);
}

fn attn_heads(m: &Model) -> [(usize, usize); 3] {
    let heads = |a: &Attn| (a.heads, a.kv_heads);
    [
        heads(&m.stack.blocks[0].attn),
        heads(&m.stack.blocks[1].attn),
        heads(&m.maybe_block.as_ref().unwrap().attn),
    ]
}

#[test]
fn head_counts_turn_local_only_where_a_tp_field_was_styled() {
    // Every attention styled: 4 heads, 2 kv heads over tp 2.
    let all = apply_on_two(field_plan(&ndarray()), |m, _| attn_heads(&m));
    assert_eq!(all, [(2, 1); 3]);
    // Only block 1's attention styled (its o_proj): the others keep their counts.
    let plan = TpPlan::new().with("stack.blocks.1.attn.o", ParallelStyle::rowwise());
    let one = apply_on_two(plan, |m, _| attn_heads(&m));
    assert_eq!(one, [(4, 2), (2, 1), (4, 2)]);
    // Nothing styled: no head count changes, and no sharded parameters.
    let none = apply_on_two(TpPlan::new(), |m, _| (attn_heads(&m), sharded(&m)));
    assert_eq!(none, ([(4, 2); 3], 0));
}

#[test]
fn head_counts_that_do_not_divide_are_an_error_only_when_styled() {
    let odd = |plan: TpPlan| {
        launch(2, move |ctx| {
            let group = ctx.world()?;
            let mut cx = TpApplier::new(&plan, &group);
            let mut a = block(&ndarray(), 1).attn;
            a.heads = 3;
            a.kv_heads = 3;
            a.apply_tp("attn", &mut cx).map(|a| a.heads)
        })
    };
    assert_eq!(odd(TpPlan::new()).unwrap(), vec![3, 3]);
    let err = odd(TpPlan::new().with("attn.q", ParallelStyle::colwise())).unwrap_err();
    assert!(err.to_string().contains("num_heads"), "{err}");
}
