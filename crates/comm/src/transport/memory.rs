//! This process's memory use, for per-process reports (one rank per process under MPI).

/// Peak resident set size of this process in bytes (`VmHWM` of `/proc/self/status`), or `None`
/// where the platform does not report it.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    parse_vm_hwm(&status)
}

/// Starts the peak over again from the current resident size (Linux: `5` into
/// `/proc/self/clear_refs`), so that a later [`peak_rss_bytes`] covers only what came after,
/// such as training without the model's construction. Returns whether the platform did it.
pub fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// Page faults this process has taken without I/O so far (fresh pages zeroed and mapped,
/// mostly): `minflt` of `/proc/self/stat`, or `None` where the platform does not report it.
pub fn minor_page_faults() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    parse_minflt(&stat)
}

/// `minflt`, the 10th field; the 2nd (the command name, in parentheses) may hold spaces.
fn parse_minflt(stat: &str) -> Option<u64> {
    let after_name = &stat[stat.rfind(')')? + 1..];
    after_name.split_whitespace().nth(7)?.parse().ok()
}

fn parse_vm_hwm(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let mut parts = line["VmHWM:".len()..].split_whitespace();
    let value: u64 = parts.next()?.parse().ok()?;
    match parts.next() {
        Some("kB") | None => Some(value * 1024),
        Some(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_high_water_mark_in_bytes() {
        let status = "Name:\tx\nVmPeak:\t  9000 kB\nVmHWM:\t    1234 kB\nVmRSS:\t 1000 kB\n";
        assert_eq!(parse_vm_hwm(status), Some(1234 * 1024));
        assert_eq!(parse_vm_hwm("Name:\tx\n"), None);
        if cfg!(target_os = "linux") {
            assert!(peak_rss_bytes().is_some_and(|b| b > 0));
        }
    }

    #[test]
    fn reads_the_minor_faults_past_a_name_with_spaces() {
        let stat = "4242 (rank 0) worker) S 1 2 3 4 5 6 777 8 9 10 11 12";
        assert_eq!(parse_minflt(stat), Some(777));
        assert_eq!(parse_minflt("4242 (x) S 1"), None);
        if cfg!(target_os = "linux") {
            let before = minor_page_faults().unwrap();
            // 16 MiB written page by page: fresh pages, each a fault.
            let mut pages = vec![0u8; 16 << 20];
            pages.chunks_mut(4096).for_each(|p| p[0] = 1);
            std::hint::black_box(&pages);
            assert!(minor_page_faults().unwrap() >= before + 1000);
        }
    }
}
