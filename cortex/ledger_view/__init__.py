"""The shared ledger view (layout.py: the file and its table; writer.py: ingest's side; reader.py:
extproc's): one writer (`ingest`) publishes which worker holds which block key, many readers
(`extproc`, on the request hot path) read it with no lock and no RPC.

Layout. Everything lives in one file (normally under /dev/shm) that every process maps with `mmap`.
`multiprocessing.shared_memory` is deliberately not used: in 3.11 its resource tracker unlinks a segment when
any attaching process exits, so a restarting reader would delete the writer's view. The file is

    header   16 native uint64 words (magic, layout version, epoch, seqlock counter, heartbeat,
             capacity, max_workers, words per bitset, keys held, meta version, meta length,
             meta capacity, retired flag, reserved)
    meta     `meta capacity` bytes holding an orjson document (routing metadata: worker addresses, ...)
    keys     uint64[capacity]           0 marks an empty slot, so keys are nonzero
    bits     uint64[capacity, words]    bit w set <=> worker w holds the key; words = ceil(max_workers / 64)

The table is open addressing with linear probing from slot `key & (capacity - 1)`: block keys are already
xxh3 outputs, so their low bits are as good as any hash. Deletion is by backward shift, so there are no
tombstones and a probe for an absent key always ends at the first empty slot. At a load of at most 0.5 that
costs 8 + 8 * words bytes per slot, i.e. 32 bytes per key for up to 64 workers when the table is fullest and
64 right after it doubles.

Consistency: a seqlock. The writer makes the counter odd before it mutates and even after; a reader reads
the counter (retrying while it is odd), computes its answer from the mapping (the compiled match, `_native.pyx`,
reads the rows in place; the numpy paths copy them), re-reads the counter and retries if it moved, up to
`ViewReader.RETRIES` times before raising `ViewBusy`. Readers never write to the mapping, so any number of them
cost the writer nothing. Torn reads are harmless until the counter check throws them away: every slot index is
masked, and probes are bounded.

A seqlock favours the writer: a reader only succeeds if no section opens during its ~20-60 us read. So the
writer keeps sections short: each op does its probing, insert placement and backward-shift deletion
(simulated on an overlay) first, and the section holds only the resulting vectorised stores. A reader that
meets an odd counter polls it briefly before sleeping, which rides out such sections. `batch()` is the
exception by design -- the whole batch is one section -- so a writer that is inside batches nearly all the
time starves readers (they get `ViewBusy` and should route without the view); keep bookkeeping that does
not touch the view outside the batch.

Memory ordering: the counter protocol needs "writer stores become visible in program order" and "reader
loads are performed in program order". x86-64 (TSO) gives both in hardware, so no fences are issued. What
this assumes: (1) the C compiler does not move a load or store across the boundaries between the separate
CPython/numpy calls that make up a section -- each access sits behind calls through function pointers, which
act as compiler barriers in practice though nothing formally promises it; (2) aligned 8-byte header words are
read and written whole (they are, on x86-64); (3) writer and readers share one host and one kernel. On weakly
ordered CPUs (aarch64) a reader's data loads may be satisfied after its second counter load, so a torn read
could go unnoticed; running there needs explicit barriers, which this module does not provide.

Growth and replacement: the writer never resizes a mapping. When the keys held would exceed `max_load` of the
capacity it builds a file of double capacity next to the path under a temporary name, copies the entries,
`os.rename`s it over the path and then sets the retired flag in the old file. A restarted writer does the
same with a fresh random epoch, so readers can tell an incarnation change (their cached view of the ledger
is gone) from a mere growth. A reader detects replacement with `refresh()` (the path's inode differs from
its mapping's); `match`, `meta` and `heartbeat_age` also refresh on their own when they see the retired flag,
which costs one word read per call. The old mapping stays valid, and stale but consistent, until the reader
drops it, so a reader is never left holding unmapped memory. If replacement happens inside a `batch()`, the
new file starts with an odd counter and the old one is left odd, so no reader ever sees half a batch.

Liveness: the writer stores `time.monotonic_ns()` as a heartbeat (on `heartbeat()` and at the end of every
write section). CLOCK_MONOTONIC is system-wide on Linux (one clock per boot, shared by all processes unless
they sit in different time namespaces), so a reader can compute the writer's silence directly. A writer that
dies inside a write section leaves the counter odd: readers then get `ViewBusy` (immediately once the
heartbeat is stale) until a new writer replaces the file.

Byte order is native; the magic word rejects a file from a host of the other endianness. The writer is not
thread-safe (it is meant to be driven by one ingest loop); a reader may be shared by threads, as `refresh`
swaps in a whole new mapping object rather than mutating the one a concurrent `match` is using.
"""


from cortex.ledger_view.layout import ViewBusy, default_path
from cortex.ledger_view.reader import ViewReader
from cortex.ledger_view.writer import ViewWriter

__all__ = ["ViewBusy", "ViewReader", "ViewWriter", "default_path"]
