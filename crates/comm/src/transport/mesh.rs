//! The device mesh: ranks arranged on named dimensions (`dp_replicate`, `dp_shard`, `cp`, `tp`,
//! `ep`, or any name), row-major with the last dimension fastest (PyTorch's
//! `init_device_mesh`), one process group per dimension and per flattened set of dimensions.

use std::collections::BTreeMap;
use std::fmt;

use crate::transport::engine::RankContext;
use crate::transport::error::MeshError;
use crate::transport::group::ProcessGroup;

/// The pure shape of a mesh: names and sizes, and the rank <-> coordinate mapping.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MeshShape {
    dims: Vec<(String, usize)>,
}

impl fmt::Display for MeshShape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self.dims.iter().map(|(n, s)| format!("{n}={s}")).collect();
        write!(f, "[{}]", parts.join(" x "))
    }
}

impl MeshShape {
    /// A mesh from `(name, size)` pairs, outermost first.
    pub fn new<S: AsRef<str>>(dims: &[(S, usize)]) -> Result<Self, MeshError> {
        let dims: Vec<(String, usize)> = dims
            .iter()
            .map(|(n, s)| (n.as_ref().to_string(), *s))
            .collect();
        let shape = Self { dims };
        if shape.dims.is_empty() {
            return Err(MeshError::Empty);
        }
        for (i, (name, size)) in shape.dims.iter().enumerate() {
            let valid =
                !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            if !valid {
                return Err(MeshError::BadName { name: name.clone() });
            }
            if *size == 0 {
                return Err(MeshError::ZeroSize { name: name.clone() });
            }
            if shape.dims[..i].iter().any(|(n, _)| n == name) {
                return Err(MeshError::DuplicateName {
                    name: name.clone(),
                    dims: shape.to_string(),
                });
            }
        }
        Ok(shape)
    }

    /// Number of ranks in the mesh.
    pub fn size(&self) -> usize {
        self.dims.iter().map(|(_, s)| s).product()
    }

    /// Number of dimensions.
    pub fn ndim(&self) -> usize {
        self.dims.len()
    }

    /// The dimension names, outermost first.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.dims.iter().map(|(n, _)| n.as_str())
    }

    /// The `(name, size)` pairs, outermost first.
    pub fn dims(&self) -> &[(String, usize)] {
        &self.dims
    }

    /// Position of dimension `name`.
    pub fn axis(&self, name: &str) -> Result<usize, MeshError> {
        self.dims
            .iter()
            .position(|(n, _)| n == name)
            .ok_or_else(|| MeshError::UnknownDim {
                name: name.into(),
                dims: self.to_string(),
            })
    }

    /// Size of dimension `name`.
    pub fn dim_size(&self, name: &str) -> Result<usize, MeshError> {
        Ok(self.dims[self.axis(name)?].1)
    }

    /// Coordinates of `rank`, one per dimension.
    pub fn coords(&self, rank: usize) -> Result<Vec<usize>, MeshError> {
        if rank >= self.size() {
            return Err(MeshError::RankOutOfRange {
                rank,
                dims: self.to_string(),
                size: self.size(),
            });
        }
        let mut rest = rank;
        let mut coords = vec![0; self.dims.len()];
        for (i, (_, size)) in self.dims.iter().enumerate().rev() {
            coords[i] = rest % size;
            rest /= size;
        }
        Ok(coords)
    }

    /// The rank at `coords`.
    pub fn rank_of(&self, coords: &[usize]) -> usize {
        coords
            .iter()
            .zip(&self.dims)
            .fold(0, |acc, (c, (_, size))| acc * size + c)
    }

    /// The ranks that share every coordinate of `rank` except those of `names`, ordered
    /// row-major over `names` in mesh order: the group of `rank` along those dimensions.
    pub fn group_ranks(&self, rank: usize, names: &[&str]) -> Result<Vec<usize>, MeshError> {
        let mut axes = names
            .iter()
            .map(|n| self.axis(n))
            .collect::<Result<Vec<_>, _>>()?;
        axes.sort_unstable();
        let base = self.coords(rank)?;
        let count: usize = axes.iter().map(|a| self.dims[*a].1).product();
        Ok((0..count)
            .map(|mut k| {
                let mut coords = base.clone();
                for a in axes.iter().rev() {
                    coords[*a] = k % self.dims[*a].1;
                    k /= self.dims[*a].1;
                }
                self.rank_of(&coords)
            })
            .collect())
    }
}

/// A rank's view of a mesh: the shape, its coordinates, and a process group per dimension and
/// per flattened dimension.
#[derive(Debug, Clone)]
pub struct DeviceMesh {
    shape: MeshShape,
    ctx: RankContext,
    /// Global rank of each mesh position (row-major).
    ranks: Vec<usize>,
    /// This rank's position in the mesh.
    position: usize,
    groups: BTreeMap<String, ProcessGroup>,
    flattened: BTreeMap<String, Vec<String>>,
}

impl DeviceMesh {
    /// The mesh over the whole world. Its size must equal the world size. Every rank builds it.
    pub fn new(ctx: &RankContext, shape: MeshShape) -> Result<Self, MeshError> {
        if shape.size() != ctx.world_size() {
            return Err(MeshError::WorldSizeMismatch {
                dims: shape.to_string(),
                mesh_size: shape.size(),
                world_size: ctx.world_size(),
            });
        }
        let ranks: Vec<usize> = (0..shape.size()).collect();
        Self::over(ctx, shape, ranks, ctx.rank())
    }

    /// A mesh of `shape` laid over the global `ranks` (mesh position -> global rank).
    fn over(
        ctx: &RankContext,
        shape: MeshShape,
        ranks: Vec<usize>,
        rank: usize,
    ) -> Result<Self, MeshError> {
        let position = ranks
            .iter()
            .position(|r| *r == rank)
            .expect("a mesh is only built by its members");
        let mut mesh = Self {
            shape,
            ctx: ctx.clone(),
            ranks,
            position,
            groups: BTreeMap::new(),
            flattened: BTreeMap::new(),
        };
        let names: Vec<String> = mesh.shape.names().map(String::from).collect();
        for name in names {
            let group = mesh.make_group(&[name.as_str()], &name)?;
            mesh.groups.insert(name, group);
        }
        Ok(mesh)
    }

    fn make_group(&self, dims: &[&str], label: &str) -> Result<ProcessGroup, MeshError> {
        let ranks: Vec<usize> = self
            .shape
            .group_ranks(self.position, dims)?
            .into_iter()
            .map(|p| self.ranks[p])
            .collect();
        Ok(self.ctx.group(label, &ranks)?)
    }

    /// The shape (the mesh dimensions; flattened ones are not in it).
    pub fn shape(&self) -> &MeshShape {
        &self.shape
    }

    /// The rank context the mesh's groups were made from.
    pub fn context(&self) -> &RankContext {
        &self.ctx
    }

    /// This rank's global rank.
    pub fn rank(&self) -> usize {
        self.ranks[self.position]
    }

    /// This rank's coordinate along `name` (a mesh or flattened dimension).
    pub fn coord(&self, name: &str) -> Result<usize, MeshError> {
        Ok(self.group(name)?.index())
    }

    /// Size of `name` (a mesh or flattened dimension).
    pub fn size(&self, name: &str) -> Result<usize, MeshError> {
        Ok(self.group(name)?.size())
    }

    /// The process group along `name` (a mesh or flattened dimension).
    pub fn group(&self, name: &str) -> Result<&ProcessGroup, MeshError> {
        self.groups.get(name).ok_or_else(|| MeshError::UnknownDim {
            name: name.into(),
            dims: self.describe(),
        })
    }

    /// Whether `name` is a mesh or flattened dimension.
    pub fn has(&self, name: &str) -> bool {
        self.groups.contains_key(name)
    }

    /// Adds the dimension `name` that spans `dims` together (e.g. `dp_shard_cp` over
    /// `dp_shard` and `cp`), with its own group. Every rank calls it. Flattening a single
    /// dimension aliases it under a new name with its own group.
    pub fn flatten(&mut self, dims: &[&str], name: &str) -> Result<&ProcessGroup, MeshError> {
        let bad = |reason: String| MeshError::BadFlatten {
            names: dims.iter().map(|d| d.to_string()).collect(),
            name: name.into(),
            reason,
        };
        if dims.is_empty() {
            return Err(bad("nothing to flatten".into()));
        }
        if self.groups.contains_key(name) {
            return Err(bad(format!(
                "{name:?} already names a dimension of {}",
                self.describe()
            )));
        }
        for (i, d) in dims.iter().enumerate() {
            self.shape.axis(d)?;
            if dims[..i].contains(d) {
                return Err(bad(format!("{d:?} is listed twice")));
            }
        }
        let group = self.make_group(dims, name)?;
        self.flattened
            .insert(name.into(), dims.iter().map(|d| d.to_string()).collect());
        Ok(self.groups.entry(name.into()).or_insert(group))
    }

    /// The mesh of the dimensions `names` that contains this rank, in mesh order, with the
    /// same groups as this mesh for those dimensions.
    pub fn submesh(&self, names: &[&str]) -> Result<DeviceMesh, MeshError> {
        let mut axes = names
            .iter()
            .map(|n| self.shape.axis(n))
            .collect::<Result<Vec<_>, _>>()?;
        axes.sort_unstable();
        axes.dedup();
        let dims: Vec<(String, usize)> = axes.iter().map(|a| self.shape.dims[*a].clone()).collect();
        let shape = MeshShape::new(&dims)?;
        let ranks: Vec<usize> = self
            .shape
            .group_ranks(self.position, names)?
            .into_iter()
            .map(|p| self.ranks[p])
            .collect();
        let position = ranks
            .iter()
            .position(|r| *r == self.rank())
            .expect("a rank is in its own group");
        let groups = shape
            .names()
            .map(|n| (n.to_string(), self.groups[n].clone()))
            .collect();
        Ok(DeviceMesh {
            shape,
            ctx: self.ctx.clone(),
            ranks,
            position,
            groups,
            flattened: BTreeMap::new(),
        })
    }

    fn describe(&self) -> String {
        let mut s = self.shape.to_string();
        for (name, dims) in &self.flattened {
            s.push_str(&format!(" + {name}=({})", dims.join(" x ")));
        }
        s
    }
}
