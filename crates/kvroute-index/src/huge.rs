//! Tables of several MiB in 2 MiB pages, where the kernel gives them: the
//! predicted layer's generations ([`crate::predicted`]) here, and the
//! tokenizer's vocabulary, merge pairs and piece caches (kvroute-tokenize).
//!
//! Those tables are read or written at random places across megabytes. In 4
//! KiB pages nearly every access also misses the TLB, and under the bench
//! machine's hypervisor a miss is a nested page walk whose reads compete for
//! the cache with everything else: a record's prefetches waited on those
//! walks, and the tokenizer's throughput swung by up to 40 % between runs of
//! one binary. In 2 MiB pages a table spans a handful.
//!
//! Linux backs memory with transparent huge pages when it is configured to
//! for all memory or, as commonly (and on the bench machine), only for memory
//! that asks with `madvise(MADV_HUGEPAGE)`. A table here is therefore its own
//! mapping, aligned to 2 MiB, that asks before it is first written. (Not the
//! allocator's: an aligned allocation from it may come from pages already
//! touched, after a large free raised malloc's mmap threshold, and its last
//! partial 2 MiB cannot be advised; with it the tokenizer's tables had half
//! as much in huge pages, 24–31 MiB against 61, and lost 5–15 % of its
//! throughput.) Where the kernel has no huge page to give, or elsewhere than
//! Linux, its pages stay small: only speed depends on it.

use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

/// A huge page's size on x86_64 and aarch64 Linux (with 4 KiB base pages).
pub const HUGE_PAGE: usize = 2 << 20;

/// A fixed-length slice of `T` in its own memory mapping (see the module).
pub struct HugeSlice<T: Copy> {
    /// The first element, 2 MiB aligned when the slice spans a huge page.
    ptr: NonNull<T>,
    len: usize,
    /// The mapping: where it starts and how long it is (0: none, `len` is 0).
    map: *mut libc::c_void,
    map_len: usize,
}

// SAFETY: a `HugeSlice` owns its elements as a `Box<[T]>` does.
unsafe impl<T: Copy + Send> Send for HugeSlice<T> {}
// SAFETY: shared access only reads, as through a `&[T]`.
unsafe impl<T: Copy + Sync> Sync for HugeSlice<T> {}

impl<T: Copy> HugeSlice<T> {
    /// `len` copies of `value`. Aborts as a failed allocation does when the
    /// memory cannot be mapped.
    pub fn filled(value: T, len: usize) -> Self {
        let bytes = len
            .checked_mul(size_of::<T>())
            .expect("a table's size fits in memory");
        if bytes == 0 {
            return HugeSlice {
                ptr: NonNull::dangling(),
                len,
                map: std::ptr::null_mut(),
                map_len: 0,
            };
        }
        // Room to start at a 2 MiB boundary; the slack is never touched, so
        // it costs address space, not memory.
        let huge = bytes >= HUGE_PAGE;
        let map_len = if huge { bytes + HUGE_PAGE } else { bytes };
        // SAFETY: a fresh private anonymous mapping; no existing memory is
        // named.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if map == libc::MAP_FAILED {
            let layout = std::alloc::Layout::from_size_align(bytes, align_of::<T>())
                .expect("a table's layout is valid");
            std::alloc::handle_alloc_error(layout);
        }
        let start = if huge {
            (map as usize).next_multiple_of(HUGE_PAGE)
        } else {
            map as usize
        };
        #[cfg(target_os = "linux")]
        if huge {
            // SAFETY: the range lies within the mapping made above. A refusal
            // (no transparent huge pages in this kernel) leaves small pages.
            unsafe {
                libc::madvise(
                    start as *mut libc::c_void,
                    bytes.next_multiple_of(HUGE_PAGE),
                    libc::MADV_HUGEPAGE,
                )
            };
        }
        let ptr = start as *mut T;
        for i in 0..len {
            // SAFETY: `start` is page aligned (so aligned for `T`) and the
            // mapping holds `len` elements from it.
            unsafe { ptr.add(i).write(value) };
        }
        HugeSlice {
            // SAFETY: mmap never returns null on success.
            ptr: unsafe { NonNull::new_unchecked(ptr) },
            len,
            map,
            map_len,
        }
    }
}

impl<T: Copy> Deref for HugeSlice<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        // SAFETY: `len` initialized elements from `ptr`, owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Copy> DerefMut for HugeSlice<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`, and `&mut self` is the only access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Copy> Drop for HugeSlice<T> {
    fn drop(&mut self) {
        if self.map_len > 0 {
            // SAFETY: the mapping made in `filled`, unmapped once; `T: Copy`
            // needs no drop.
            unsafe { libc::munmap(self.map, self.map_len) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_what_was_written_at_every_size() {
        for len in [0, 1, 1000, HUGE_PAGE / 8 - 1, HUGE_PAGE / 8 * 3 + 5] {
            let mut slice = HugeSlice::filled(7u64, len);
            assert_eq!(slice.len(), len);
            assert!(slice.iter().all(|&v| v == 7));
            for (i, v) in slice.iter_mut().enumerate() {
                *v = i as u64;
            }
            assert!(slice.iter().enumerate().all(|(i, &v)| v == i as u64));
            if len * 8 >= HUGE_PAGE {
                assert_eq!(slice.as_ptr() as usize % HUGE_PAGE, 0);
            }
        }
    }
}
