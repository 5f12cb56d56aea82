//! What every rank states before an NCCL call, and the verdict they all reach on it.
//!
//! NCCL trusts its callers: ranks that enter a collective with different sizes hang or exchange
//! garbage. So before the call each rank states it as a fixed number of words ([`CallSpec`]:
//! op, dtype, shape, dims, split sizes, and any problem it found locally), the words go round
//! in one small all-gather, and [`decide`] turns every rank's words into one verdict. The
//! verdict depends only on the words all ranks hold, so it is the same everywhere: a mismatch,
//! or bad sizes on one rank, is the same error on every rank and none of them enters NCCL.
//!
//! [`Agreement`] adds the cache: a call whose every-rank description each rank can work out on
//! its own (an all-reduce, a reduce-scatter, a gather of known sizes, as FSDP's are) is agreed
//! once and then runs without the exchange while it repeats. A program whose ranks diverge
//! after that is caught by the engine's watchdog instead (see [`super::watchdog`]);
//! [`AgreementMode::EveryCall`] checks every call, for debugging such a program.
//!
//! Pure and compiled without the `nccl` feature: the tests run the protocol over threads.

use std::collections::HashMap;

use burn::tensor::DType;

use super::types::{dtype_code, dtype_from_code};
use crate::transport::collective::{GroupInfo, OpKind};
use crate::transport::data::reducible;
use crate::transport::error::CollectiveError;

/// Dimensions a tensor may have on the NCCL engine (the statement has a fixed size).
pub const MAX_DIMS: usize = 8;
/// Words before the per-rank list: op, dtype, ndim, problem, dims, two parameters.
const FIXED_WORDS: usize = 4 + MAX_DIMS + 2;
/// Distinct calls the cache keeps; a model has far fewer parameter shapes than this.
const CACHE_CAPACITY: usize = 4096;

/// How a call's tensors relate across ranks: what [`decide`] checks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallKind {
    /// Equal shapes on every rank (all-reduce).
    Same,
    /// Equal shapes except along `dim`; `sizes`: every rank's length there, when known.
    Gather {
        /// The dimension pieces are concatenated along.
        dim: usize,
        /// Every rank's length along `dim`, when the caller knows them.
        sizes: Option<Vec<usize>>,
    },
    /// Equal shapes, cut along `dim` into `sizes` (the same on every rank).
    Scatter {
        /// The dimension the pieces are cut along.
        dim: usize,
        /// Each rank's piece length.
        sizes: Vec<usize>,
    },
    /// Slice `j` along `split` (`send[j]` long) goes to rank `j`; received slices are
    /// concatenated along `concat`.
    AllToAll {
        /// The dimension slices are cut along.
        split: usize,
        /// The dimension received slices are concatenated along.
        concat: usize,
        /// This rank's slice length for each rank.
        send: Vec<usize>,
    },
    /// The root's tensor to every rank; the others state no tensor.
    Broadcast {
        /// The group position of the root.
        root: usize,
    },
    /// No tensor.
    Barrier,
}

/// One rank's statement of the call it is about to make.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallSpec {
    /// The collective.
    pub op: OpKind,
    /// The tensor's element type and shape (`None`: no tensor, as a broadcast's non-roots).
    pub tensor: Option<(DType, Vec<usize>)>,
    /// How the ranks' tensors relate.
    pub kind: CallKind,
}

/// What a rank found wrong with its own call, stated so every rank can report it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Problem {
    TooManyDims = 1,
    UnsupportedDtype,
    NotReducible,
    NoSuchDim,
    BadSizes,
    NoRootTensor,
    NoSuchRoot,
}

impl Problem {
    const ALL: [Problem; 7] = [
        Problem::TooManyDims,
        Problem::UnsupportedDtype,
        Problem::NotReducible,
        Problem::NoSuchDim,
        Problem::BadSizes,
        Problem::NoRootTensor,
        Problem::NoSuchRoot,
    ];

    fn describe(self) -> &'static str {
        match self {
            Problem::TooManyDims => "passed a tensor of more than 8 dimensions (NCCL engine limit)",
            Problem::UnsupportedDtype => "passed a dtype NCCL has no type for",
            Problem::NotReducible => "asked for a reduction of a dtype that cannot be reduced",
            Problem::NoSuchDim => "named a dimension the tensor does not have",
            Problem::BadSizes => {
                "gave piece sizes that are not one per rank summing to the tensor's length \
                 along the dimension"
            }
            Problem::NoRootTensor => "is the root but gave no tensor",
            Problem::NoSuchRoot => "named a root outside the group",
        }
    }
}

/// One rank's words, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Stated {
    op: Option<OpKind>,
    dtype: Option<DType>,
    shape: Vec<usize>,
    problem: Option<Problem>,
    params: [usize; 2],
    list: Vec<usize>,
}

/// What the other ranks' calls look like, once every rank agreed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Agreed {
    /// Each rank's tensor shape, in group order (empty for a rank without a tensor).
    pub shapes: Vec<Vec<usize>>,
    /// Each rank's per-rank list (all-to-all send sizes), in group order.
    pub lists: Vec<Vec<usize>>,
    /// The dtype of the call's tensors (the root's, for a broadcast).
    pub dtype: Option<DType>,
}

impl CallSpec {
    /// The problem this rank can see on its own, if any.
    fn problem(&self, group: &GroupInfo) -> Option<Problem> {
        let (group_size, me) = (group.size(), group.index);
        let pieces_ok = |sizes: &[usize], len: usize| {
            sizes.len() == group_size && sizes.iter().sum::<usize>() == len
        };
        if let CallKind::Broadcast { root } = self.kind
            && root >= group_size
        {
            return Some(Problem::NoSuchRoot);
        }
        let Some((dtype, shape)) = &self.tensor else {
            return match self.kind {
                CallKind::Broadcast { root } if root != me => None,
                CallKind::Barrier => None,
                _ => Some(Problem::NoRootTensor),
            };
        };
        if shape.len() > MAX_DIMS {
            return Some(Problem::TooManyDims);
        }
        if dtype_code(*dtype).is_none() {
            return Some(Problem::UnsupportedDtype);
        }
        if matches!(self.op, OpKind::AllReduce | OpKind::ReduceScatter) && !reducible(*dtype) {
            return Some(Problem::NotReducible);
        }
        let dims: Vec<usize> = match &self.kind {
            CallKind::Gather { dim, .. } | CallKind::Scatter { dim, .. } => vec![*dim],
            CallKind::AllToAll { split, concat, .. } => vec![*split, *concat],
            _ => Vec::new(),
        };
        if dims.iter().any(|d| *d >= shape.len()) {
            return Some(Problem::NoSuchDim);
        }
        let sizes_ok = match &self.kind {
            CallKind::Gather {
                dim,
                sizes: Some(sizes),
            } => sizes.len() == group_size && sizes[me] == shape[*dim],
            CallKind::Scatter { dim, sizes } => pieces_ok(sizes, shape[*dim]),
            CallKind::AllToAll { split, send, .. } => pieces_ok(send, shape[*split]),
            _ => true,
        };
        (!sizes_ok).then_some(Problem::BadSizes)
    }

    /// The words this rank states: `FIXED_WORDS + group_size`, the same count on every rank.
    pub fn words(&self, group: &GroupInfo) -> Vec<u64> {
        let n = group.size();
        let mut w = vec![0u64; FIXED_WORDS + n];
        w[0] = self.op as u64 + 1;
        let problem = self.problem(group);
        w[3] = problem.map_or(0, |p| p as u64);
        if let Some((dtype, shape)) = &self.tensor {
            w[1] = dtype_code(*dtype).map_or(0, |c| c + 1);
            w[2] = shape.len().min(MAX_DIMS) as u64;
            for (slot, s) in w[4..4 + MAX_DIMS].iter_mut().zip(shape) {
                *slot = *s as u64;
            }
        }
        let (params, list): ([usize; 2], &[usize]) = match &self.kind {
            CallKind::Same | CallKind::Barrier => ([0, 0], &[]),
            CallKind::Gather { dim, sizes } => (
                [*dim, usize::from(sizes.is_some())],
                sizes.as_deref().unwrap_or(&[]),
            ),
            CallKind::Scatter { dim, sizes } => ([*dim, 0], sizes),
            CallKind::AllToAll {
                split,
                concat,
                send,
            } => ([*split, *concat], send),
            CallKind::Broadcast { root } => ([*root, 0], &[]),
        };
        w[4 + MAX_DIMS] = params[0] as u64;
        w[5 + MAX_DIMS] = params[1] as u64;
        for (slot, s) in w[FIXED_WORDS..].iter_mut().zip(list) {
            *slot = *s as u64;
        }
        w
    }

    /// The words every correct rank states the same way, when this rank can work them out
    /// alone: the call is then cacheable. `None` for calls whose agreement carries information
    /// (a gather of unknown sizes, an all-to-all, a broadcast) or that have a problem.
    pub fn cache_key(&self, group: &GroupInfo) -> Option<Vec<u64>> {
        let mut words = self.words(group);
        if words[3] != 0 {
            return None;
        }
        match &self.kind {
            CallKind::Same | CallKind::Scatter { .. } => Some(words),
            CallKind::Gather {
                dim,
                sizes: Some(_),
            } => {
                words[4 + dim] = 0;
                Some(words)
            }
            _ => None,
        }
    }
}

fn decode(words: &[u64]) -> Stated {
    let ndim = (words[2] as usize).min(MAX_DIMS);
    Stated {
        op: (words[0] as usize)
            .checked_sub(1)
            .and_then(|i| OpKind::ALL.get(i).copied()),
        dtype: words[1].checked_sub(1).and_then(dtype_from_code),
        shape: words[4..4 + ndim].iter().map(|x| *x as usize).collect(),
        problem: Problem::ALL.iter().copied().find(|p| *p as u64 == words[3]),
        params: [words[4 + MAX_DIMS] as usize, words[5 + MAX_DIMS] as usize],
        list: words[FIXED_WORDS..].iter().map(|x| *x as usize).collect(),
    }
}

fn describe(s: &Stated) -> String {
    let name = s.op.map_or("an unknown op", |o| o.name());
    match s.dtype {
        Some(d) => format!("{name}({d:?} {:?})", s.shape),
        None => format!("{name}()"),
    }
}

/// The verdict on every rank's words (`all[j]`: group member `j`'s), the same on every rank:
/// the agreed call, or the first problem or mismatch, naming the rank. `spec` is this rank's.
pub fn decide(
    spec: &CallSpec,
    all: &[Vec<u64>],
    group: &GroupInfo,
) -> Result<Agreed, CollectiveError> {
    let stated: Vec<Stated> = all.iter().map(|w| decode(w)).collect();
    check_problems(spec, &stated, group)?;
    // The reference every rank is compared with: the root for a broadcast, else the first.
    let reference = match spec.kind {
        CallKind::Broadcast { root } => root,
        _ => 0,
    };
    check_same_call(spec, &stated, reference, group)?;
    if let CallKind::AllToAll { split, concat, .. } = spec.kind {
        check_all_to_all_slices(&stated, split, concat, group)?;
    }
    Ok(Agreed {
        shapes: stated.iter().map(|s| s.shape.clone()).collect(),
        lists: stated.iter().map(|s| s.list.clone()).collect(),
        dtype: stated[reference].dtype,
    })
}

/// The first problem a rank found with its own call, as every rank's error: checked before any
/// comparison, so a rank with bad sizes is named for them rather than as a mismatch.
fn check_problems(
    spec: &CallSpec,
    stated: &[Stated],
    group: &GroupInfo,
) -> Result<(), CollectiveError> {
    let op = spec.op.name();
    for (j, s) in stated.iter().enumerate() {
        if let Some(p) = s.problem {
            return Err(CollectiveError::InvalidArgument {
                op: op.into(),
                group: group.label.clone(),
                message: format!(
                    "rank {} {} in {}; no rank entered NCCL",
                    group.ranks[j],
                    p.describe(),
                    describe(s)
                ),
            });
        }
    }
    Ok(())
}

/// Checks that every rank states the call of rank `reference`: the same op and parameters,
/// dtype and shape (except along the dims the call lets differ) and, for a gather or scatter,
/// the same sizes.
fn check_same_call(
    spec: &CallSpec,
    stated: &[Stated],
    reference: usize,
    group: &GroupInfo,
) -> Result<(), CollectiveError> {
    let free: Vec<usize> = match &spec.kind {
        CallKind::Gather { dim, .. } => vec![*dim],
        CallKind::AllToAll { split, concat, .. } => vec![*split, *concat],
        _ => Vec::new(),
    };
    let r = &stated[reference];
    for (j, s) in stated.iter().enumerate() {
        let with_tensor = s.dtype.is_some() && r.dtype.is_some();
        let agrees = s.op == r.op
            && s.params == r.params
            && (!with_tensor
                || (s.dtype == r.dtype
                    && s.shape.len() == r.shape.len()
                    && s.shape
                        .iter()
                        .zip(&r.shape)
                        .enumerate()
                        .all(|(d, (a, b))| free.contains(&d) || a == b)))
            && match spec.kind {
                CallKind::Scatter { .. } | CallKind::Gather { .. } => s.list == r.list,
                _ => true,
            };
        if !agrees {
            return Err(mismatch(group, reference, r, j, s, ""));
        }
    }
    Ok(())
}

/// Checks that the all-to-all slices reaching each rank can be concatenated: every rank
/// agreeing with the reference is not enough, since each rank cuts its own sizes.
fn check_all_to_all_slices(
    stated: &[Stated],
    split: usize,
    concat: usize,
    group: &GroupInfo,
) -> Result<(), CollectiveError> {
    // Rank j's slice for rank i: j's shape with `send[i]` rows along `split`; the slices
    // that reach one rank must agree except along `concat`.
    let slice = |j: usize, i: usize| {
        let mut shape = stated[j].shape.clone();
        shape[split] = stated[j].list[i];
        shape
    };
    for i in 0..stated.len() {
        let first = slice(0, i);
        for j in 1..stated.len() {
            let other = slice(j, i);
            let fits = other
                .iter()
                .zip(&first)
                .enumerate()
                .all(|(d, (a, b))| d == concat || a == b);
            if !fits {
                let why = format!(
                    ", whose slices for rank {} ({first:?} and {other:?}) cannot be \
                     concatenated along dim {concat}",
                    group.ranks[i]
                );
                return Err(mismatch(group, 0, &stated[0], j, &stated[j], &why));
            }
        }
    }
    Ok(())
}

fn mismatch(
    group: &GroupInfo,
    a: usize,
    sa: &Stated,
    b: usize,
    sb: &Stated,
    why: &str,
) -> CollectiveError {
    let with_list = |s: &Stated| {
        if s.list.iter().any(|x| *x != 0) {
            format!("{} with sizes {:?}", describe(s), s.list)
        } else {
            describe(s)
        }
    };
    CollectiveError::Mismatch {
        group: group.label.clone(),
        seq: 0,
        rank_a: group.ranks[a],
        call_a: with_list(sa),
        rank_b: group.ranks[b],
        call_b: format!("{}{why}", with_list(sb)),
    }
}

/// Whether the ranks agree on every call, or once per repeating call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AgreementMode {
    /// Agree once per distinct cacheable call (see the module docs); the default.
    #[default]
    Cached,
    /// One small all-gather before every call: a divergent program is an error naming both
    /// calls at once, instead of a watchdog timeout.
    EveryCall,
}

/// Environment variable that turns on [`AgreementMode::EveryCall`] (`every-call`).
pub const CHECK_ENV: &str = "BURN_PARALLEL_NCCL_CHECK";

impl AgreementMode {
    /// The mode [`CHECK_ENV`] asks for; the default when unset.
    pub fn from_env() -> Self {
        match std::env::var(CHECK_ENV).as_deref() {
            Ok("every-call") => AgreementMode::EveryCall,
            _ => AgreementMode::Cached,
        }
    }
}

/// One group's agreements: the mode and the calls already agreed.
#[derive(Debug, Default)]
pub struct Agreement {
    mode: AgreementMode,
    agreed: HashMap<Vec<u64>, Agreed>,
}

impl Agreement {
    /// An agreement keeper in `mode`.
    pub fn new(mode: AgreementMode) -> Self {
        Self {
            mode,
            ..Self::default()
        }
    }

    /// Agrees on `spec` with the group: from the cache when the call was agreed before, else
    /// through `exchange`, which must all-gather the words (the same count from every rank)
    /// and return them in group order.
    pub fn agree(
        &mut self,
        spec: &CallSpec,
        group: &GroupInfo,
        exchange: impl FnOnce(&[u64]) -> Result<Vec<Vec<u64>>, CollectiveError>,
    ) -> Result<Agreed, CollectiveError> {
        let key = match self.mode {
            AgreementMode::Cached => spec.cache_key(group),
            AgreementMode::EveryCall => None,
        };
        if let Some(agreed) = key.as_ref().and_then(|k| self.agreed.get(k)) {
            return Ok(agreed.clone());
        }
        let all = exchange(&spec.words(group))?;
        let agreed = decide(spec, &all, group)?;
        if let Some(key) = key {
            // Every correct rank inserts the same keys in the same order, so clearing when
            // full keeps the ranks' caches equal.
            if self.agreed.len() >= CACHE_CAPACITY {
                self.agreed.clear();
            }
            self.agreed.insert(key, agreed.clone());
        }
        Ok(agreed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Barrier, Mutex};

    /// An all-gather of words between threads, standing in for NCCL's.
    #[derive(Clone)]
    struct FakeWorld {
        slots: Arc<Mutex<Vec<Vec<u64>>>>,
        barrier: Arc<Barrier>,
        rounds: Arc<Mutex<usize>>,
    }

    impl FakeWorld {
        fn new(n: usize) -> Self {
            Self {
                slots: Arc::new(Mutex::new(vec![Vec::new(); n])),
                barrier: Arc::new(Barrier::new(n)),
                rounds: Arc::default(),
            }
        }

        fn all_gather(&self, me: usize, words: &[u64]) -> Vec<Vec<u64>> {
            self.slots.lock().unwrap()[me] = words.to_vec();
            if self.barrier.wait().is_leader() {
                *self.rounds.lock().unwrap() += 1;
            }
            let all = self.slots.lock().unwrap().clone();
            self.barrier.wait();
            all
        }
    }

    fn group(n: usize, me: usize) -> GroupInfo {
        GroupInfo {
            label: "dp".into(),
            ranks: (0..n).collect(),
            index: me,
        }
    }

    /// Runs `calls(rank)` on `n` threads, each call agreed through the fake world; returns
    /// every rank's verdicts.
    fn run(
        n: usize,
        mode: AgreementMode,
        calls: impl Fn(usize) -> Vec<CallSpec> + Sync,
    ) -> (Vec<Vec<Result<Agreed, CollectiveError>>>, usize) {
        let world = FakeWorld::new(n);
        let out = std::thread::scope(|s| {
            let handles: Vec<_> = (0..n)
                .map(|me| {
                    let (world, calls) = (world.clone(), &calls);
                    s.spawn(move || {
                        let mut agreement = Agreement::new(mode);
                        let g = group(n, me);
                        calls(me)
                            .iter()
                            .map(|c| agreement.agree(c, &g, |w| Ok(world.all_gather(me, w))))
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let rounds = *world.rounds.lock().unwrap();
        (out, rounds)
    }

    fn scatter(shape: Vec<usize>, sizes: Vec<usize>) -> CallSpec {
        CallSpec {
            op: OpKind::ReduceScatter,
            tensor: Some((DType::F32, shape)),
            kind: CallKind::Scatter { dim: 0, sizes },
        }
    }

    #[test]
    fn bad_sizes_on_one_rank_are_every_ranks_error() {
        // Rank 2 cuts 7 rows as [3, 3, 2] (sums to 8): every rank gets the same error.
        let (out, _) = run(3, AgreementMode::EveryCall, |me| {
            let sizes = if me == 2 {
                vec![3, 3, 2]
            } else {
                vec![3, 2, 2]
            };
            vec![scatter(vec![7, 4], sizes)]
        });
        let errors: Vec<String> = out
            .iter()
            .map(|r| r[0].clone().unwrap_err().to_string())
            .collect();
        assert!(errors.iter().all(|e| e == &errors[0]), "{errors:?}");
        assert!(
            errors[0].contains("rank 2") && errors[0].contains("sizes"),
            "{}",
            errors[0]
        );
    }

    #[test]
    fn different_sizes_on_one_rank_are_every_ranks_error() {
        // Valid on each rank alone, but rank 1 cuts differently: a mismatch naming both.
        let (out, _) = run(2, AgreementMode::EveryCall, |me| {
            let sizes = if me == 1 { vec![4, 3] } else { vec![3, 4] };
            vec![scatter(vec![7, 4], sizes)]
        });
        for r in &out {
            let e = r[0].clone().unwrap_err();
            assert!(matches!(e, CollectiveError::Mismatch { .. }), "{e}");
            assert!(e.to_string().contains("[4, 3]"), "{e}");
        }
        assert_eq!(out[0][0], out[1][0]);
    }

    #[test]
    fn gathers_learn_every_ranks_length_and_check_the_rest() {
        let (out, _) = run(3, AgreementMode::Cached, |me| {
            let rows = [3, 2, 0][me];
            vec![
                CallSpec {
                    op: OpKind::AllGather,
                    tensor: Some((DType::F32, vec![rows, 5])),
                    kind: CallKind::Gather {
                        dim: 0,
                        sizes: None,
                    },
                },
                // Rank 1 gathers a tensor of another width: everyone's error.
                CallSpec {
                    op: OpKind::AllGather,
                    tensor: Some((DType::F32, vec![rows, if me == 1 { 6 } else { 5 }])),
                    kind: CallKind::Gather {
                        dim: 0,
                        sizes: None,
                    },
                },
            ]
        });
        for r in &out {
            assert_eq!(
                r[0].as_ref().unwrap().shapes,
                vec![vec![3, 5], vec![2, 5], vec![0, 5]]
            );
            let e = r[1].clone().unwrap_err().to_string();
            assert!(e.contains("rank 1") && e.contains("[2, 6]"), "{e}");
        }
    }

    #[test]
    fn all_to_all_slices_that_cannot_be_concatenated_are_everyones_error() {
        // Split along dim 0, concatenated along dim 1: the slices one rank receives must have
        // the same rows, but rank 0 sends rank 0 one row and rank 1 sends it two.
        let (out, _) = run(2, AgreementMode::EveryCall, |me| {
            vec![CallSpec {
                op: OpKind::AllToAll,
                tensor: Some((DType::F32, vec![4, 2 + me])),
                kind: CallKind::AllToAll {
                    split: 0,
                    concat: 1,
                    send: if me == 0 { vec![1, 3] } else { vec![2, 2] },
                },
            }]
        });
        for r in &out {
            let e = r[0].clone().unwrap_err().to_string();
            assert!(e.contains("cannot be concatenated"), "{e}");
        }
        // A rank whose send sizes do not sum to its rows: everyone's error, naming it.
        let (out, _) = run(2, AgreementMode::EveryCall, |me| {
            vec![CallSpec {
                op: OpKind::AllToAll,
                tensor: Some((DType::F32, vec![4, 2])),
                kind: CallKind::AllToAll {
                    split: 0,
                    concat: 0,
                    send: if me == 0 { vec![1, 3] } else { vec![1, 1] },
                },
            }]
        });
        for r in &out {
            let e = r[0].clone().unwrap_err().to_string();
            assert!(e.contains("rank 1") && e.contains("piece sizes"), "{e}");
        }
    }

    #[test]
    fn repeated_static_calls_are_agreed_once() {
        // Five steps of FSDP-like traffic: a gather of known uneven sizes, its reduce-scatter
        // and an all-reduce. Each distinct call goes round once; gathers of unknown sizes and
        // all-to-alls go round every time.
        let (out, rounds) = run(3, AgreementMode::Cached, |me| {
            let sizes = vec![3, 2, 2];
            let step = [
                CallSpec {
                    op: OpKind::AllGather,
                    tensor: Some((DType::F32, vec![sizes[me], 4])),
                    kind: CallKind::Gather {
                        dim: 0,
                        sizes: Some(sizes.clone()),
                    },
                },
                scatter(vec![7, 4], sizes.clone()),
                CallSpec {
                    op: OpKind::AllReduce,
                    tensor: Some((DType::F32, vec![1])),
                    kind: CallKind::Same,
                },
                CallSpec {
                    op: OpKind::AllToAll,
                    tensor: Some((DType::F32, vec![3, 1])),
                    kind: CallKind::AllToAll {
                        split: 0,
                        concat: 0,
                        send: vec![1, 1, 1],
                    },
                },
            ];
            step.iter().cycle().take(4 * 5).cloned().collect()
        });
        assert!(out.iter().flatten().all(Result::is_ok));
        assert_eq!(
            rounds,
            3 + 5,
            "3 static calls once, the all-to-all every step"
        );
        let (_, every) = run(3, AgreementMode::EveryCall, |_| {
            vec![scatter(vec![6], vec![2, 2, 2]); 4]
        });
        assert_eq!(every, 4);
    }

    #[test]
    fn a_broadcast_takes_the_roots_tensor() {
        let (out, _) = run(2, AgreementMode::Cached, |me| {
            vec![CallSpec {
                op: OpKind::Broadcast,
                tensor: (me == 1).then(|| (DType::I64, vec![2, 3])),
                kind: CallKind::Broadcast { root: 1 },
            }]
        });
        for r in &out {
            let a = r[0].as_ref().unwrap();
            assert_eq!((a.dtype, &a.shapes[1]), (Some(DType::I64), &vec![2, 3]));
        }
        // A root without a tensor is everyone's error.
        let (out, _) = run(2, AgreementMode::Cached, |_| {
            vec![CallSpec {
                op: OpKind::Broadcast,
                tensor: None,
                kind: CallKind::Broadcast { root: 0 },
            }]
        });
        assert!(out.iter().all(|r| r[0].is_err()));
    }

    #[test]
    fn a_gather_of_known_sizes_checks_this_ranks_length() {
        let spec = CallSpec {
            op: OpKind::AllGather,
            tensor: Some((DType::F32, vec![2, 4])),
            kind: CallKind::Gather {
                dim: 0,
                sizes: Some(vec![3, 2]),
            },
        };
        // Rank 0 holds 2 rows where the sizes say 3: a problem, not cacheable.
        assert!(spec.cache_key(&group(2, 0)).is_none());
        assert!(spec.cache_key(&group(2, 1)).is_some());
        assert_eq!(
            spec.cache_key(&group(2, 1)),
            CallSpec {
                tensor: Some((DType::F32, vec![3, 4])),
                ..spec.clone()
            }
            .cache_key(&group(2, 0)),
            "every rank's key is the same"
        );
    }
}
