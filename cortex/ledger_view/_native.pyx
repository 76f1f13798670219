# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True
"""The view's two hot loops compiled: probing the open-addressing table for a chain of keys, and counting how many
leading rows of a chain each worker appears in. Same results as layout.py's numpy staging (tests/test_view.py
checks both against the definition); built when a C compiler is there, and layout.py falls back to numpy when it
is not.

Why compiled: numpy costs about a microsecond a call whatever its size, so the staged probe of a 512-key chain
spends ~40 us in call overhead and its p99 over 100 us on a shared machine, where a plain loop probes the same
chain in a few microseconds (issue 28's lookup goal: p99 <= 50 us at 256 workers; docs/performance.md, "Fleet
scale").

Both functions read a table another process may be writing (the seqlock in the package docstring): every index is
masked into the table, a probe longer than the table reports a torn read, and the caller checks the sequence
counter before it believes any result."""

from libc.stdint cimport int32_t, int64_t, uint64_t


cdef extern from *:
    int __builtin_ctzll(unsigned long long) nogil


def leading_slots(const uint64_t[::1] table, const uint64_t[::1] q, int64_t[::1] out):
    """Slots of the leading run of `q`'s keys present in `table` (nonzero keys, linear probing from key & mask) into
    `out[:run]`; returns the run's length, or -1 when a probe ran past the table's size (a torn read)."""
    _fits(table, q, out)
    return _probe_all(table, q, out, True)


def slots_of(const uint64_t[::1] table, const uint64_t[::1] q, int64_t[::1] out):
    """Each key's slot into `out`, -1 where absent; returns the number of keys, or -1 on a torn read."""
    _fits(table, q, out)
    return _probe_all(table, q, out, False)


cdef Py_ssize_t _probe_all(const uint64_t[::1] table, const uint64_t[::1] q, int64_t[::1] out,
                           bint leading) noexcept nogil:
    cdef Py_ssize_t n = q.shape[0], i
    cdef uint64_t mask = <uint64_t>table.shape[0] - 1
    cdef uint64_t k, x, p, steps
    for i in range(n):
        k = q[i]
        p = k & mask
        steps = 0
        while True:
            x = table[p]
            if x == k:
                out[i] = <int64_t>p
                break
            if x == 0:
                if leading:
                    return i
                out[i] = -1
                break
            p = (p + 1) & mask
            steps += 1
            if steps > mask:
                return -1
    return n


def prefix_counts(const uint64_t[:, ::1] bits, const int64_t[::1] rows, uint64_t[::1] cum, int32_t[::1] out):
    """For the chain whose key i has its holders (bitsets of `cum.shape[0]` words) in bits[rows[i]]: how many leading
    keys each worker holds, into `out` (one entry per worker; bits past it are ignored). `cum` is scratch, one word
    per bitset word. Reading the rows in place spares the copy numpy's gather makes (16 KB for 512 keys at 256
    workers)."""
    if cum.shape[0] < bits.shape[1]:
        raise ValueError("cum needs one word per bitset word")
    _prefix_counts(bits, rows, cum, out)


def _fits(const uint64_t[::1] table, const uint64_t[::1] q, int64_t[::1] out):
    # Bounds are not checked inside the loops: these are what they rely on.
    n = table.shape[0]
    if n == 0 or n & (n - 1):
        raise ValueError("the table's size must be a power of two")
    if out.shape[0] < q.shape[0]:
        raise ValueError("out needs one entry per key")


cdef void _prefix_counts(const uint64_t[:, ::1] bits, const int64_t[::1] rows, uint64_t[::1] cum,
                         int32_t[::1] out) noexcept nogil:
    cdef Py_ssize_t n = rows.shape[0], words = bits.shape[1], workers = out.shape[0], i, w, idx
    cdef uint64_t size = <uint64_t>bits.shape[0]
    cdef uint64_t c, kept, gone, alive, row
    for w in range(workers):
        out[w] = 0
    for w in range(words):
        cum[w] = ~(<uint64_t>0)
    for i in range(n):
        # A worker's bit leaves the running AND at the first key it does not hold: its count is that key's index.
        row = <uint64_t>rows[i]
        if row >= size:  # never from leading_slots (its slots are masked into the table); no read outside it
            n = i
            break
        alive = 0
        for w in range(words):
            c = cum[w]
            if c == 0:
                continue
            kept = c & bits[row, w]
            gone = c ^ kept
            while gone:
                idx = w * 64 + __builtin_ctzll(gone)
                if idx < workers:
                    out[idx] = <int32_t>i
                gone &= gone - 1
            cum[w] = kept
            alive |= kept
        if alive == 0:
            return
    for w in range(words):
        gone = cum[w]
        while gone:
            idx = w * 64 + __builtin_ctzll(gone)
            if idx < workers:
                out[idx] = <int32_t>n
            gone &= gone - 1
