//! CPU clocks of the benches: the calling thread's, exact to the nanosecond,
//! and a whole process's from the scheduler's per-thread statistics.

use anyhow::Context;

/// CPU time of the calling thread so far, exact to the nanosecond
/// (`CLOCK_THREAD_CPUTIME_ID`; the thread's schedstat moves in whole scheduler
/// ticks on some kernels, ~4 ms here).
pub(super) fn thread_cpu_time() -> std::io::Result<std::time::Duration> {
    let mut clock = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `clock` is a valid, writable timespec for the call.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut clock) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(std::time::Duration::new(
        clock.tv_sec as u64,
        clock.tv_nsec as u32,
    ))
}

/// The first field of a schedstat file: nanoseconds on the CPU.
fn schedstat_ns(path: &std::path::Path) -> anyhow::Result<u64> {
    let stat =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    stat.split_whitespace()
        .next()
        .and_then(|ns| ns.parse().ok())
        .with_context(|| format!("unexpected format of {}", path.display()))
}

/// CPU time used so far by all threads of process `pid`, from the scheduler's
/// per-thread statistics (nanoseconds, unlike the tick-counted /proc/PID/stat).
pub(super) fn process_cpu_ns(pid: u32) -> anyhow::Result<u64> {
    let mut total = 0;
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        total += schedstat_ns(&task?.path().join("schedstat"))?;
    }
    Ok(total)
}
