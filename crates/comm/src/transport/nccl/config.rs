//! The configuration of the engine's communicators: non-blocking (`blocking = 0`), so that no
//! NCCL call ever blocks the rank's thread and a call that cannot finish can be aborted by its
//! owner between two polls (see [`super::watchdog`]).
//!
//! cudarc's `ncclConfig_t` changes with the NCCL version its bindings target, so the engine
//! passes its own copy of the fields NCCL 2.17 defined, filled as `NCCL_CONFIG_INITIALIZER`
//! fills them. NCCL reads `size` bytes of a config whose `version` is 2.14 or newer and keeps
//! its defaults for the fields it did not get, so this prefix is right for every NCCL the engine
//! accepts (2.18 and newer, see [`super::library::check_nccl_version`]).

use std::ffi::{c_char, c_int, c_uint};

/// `NCCL_CONFIG_UNDEF_INT`: NCCL picks its default.
pub const UNDEF_INT: c_int = c_int::MIN;
/// The magic number `NCCL_CONFIG_INITIALIZER` sets.
pub const MAGIC: c_uint = 0xcafe_beef;
/// The NCCL version whose fields [`NcclConfig`] holds (2.17.1, `NCCL_VERSION(2, 17, 1)`).
pub const VERSION: c_uint = 21701;

/// `ncclConfig_t` as NCCL 2.17 defines it.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct NcclConfig {
    /// `sizeof` this struct: how many bytes NCCL reads.
    pub size: usize,
    /// [`MAGIC`].
    pub magic: c_uint,
    /// [`VERSION`].
    pub version: c_uint,
    /// 0: calls return `ncclInProgress` instead of blocking.
    pub blocking: c_int,
    /// Left to NCCL ([`UNDEF_INT`]).
    pub cga_cluster_size: c_int,
    /// Left to NCCL.
    pub min_ctas: c_int,
    /// Left to NCCL.
    pub max_ctas: c_int,
    /// Left to NCCL (null).
    pub net_name: *const c_char,
    /// Left to NCCL.
    pub split_share: c_int,
}

impl NcclConfig {
    /// NCCL's defaults with `blocking = 0`.
    pub fn non_blocking() -> Self {
        Self {
            size: std::mem::size_of::<Self>(),
            magic: MAGIC,
            version: VERSION,
            blocking: 0,
            cga_cluster_size: UNDEF_INT,
            min_ctas: UNDEF_INT,
            max_ctas: UNDEF_INT,
            net_name: std::ptr::null(),
            split_share: UNDEF_INT,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_is_nccls_2_17_layout_with_blocking_off() {
        let c = NcclConfig::non_blocking();
        // size_t, 2 x unsigned, 4 x int, a pointer, an int: 48 bytes on 64-bit targets.
        assert_eq!(c.size, 48);
        assert_eq!(std::mem::offset_of!(NcclConfig, blocking), 16);
        assert_eq!(std::mem::offset_of!(NcclConfig, net_name), 32);
        assert_eq!(std::mem::offset_of!(NcclConfig, split_share), 40);
        assert_eq!((c.magic, c.blocking), (0xcafebeef, 0));
        // 2.14+: NCCL copies `size` bytes rather than reading `blocking` alone.
        assert!(c.version >= 21400);
        assert_eq!(c.split_share, i32::MIN);
    }
}
