"""Where each gateway process's CPU goes under the `unique` workload: Envoy, extproc and ingest (issue 14).

Runs `cortex bench --workload unique --contestant cortex` as a subprocess (its simulated workers, its `cortex run`),
finds the gateway's processes by their command lines under the bench's work directory, waits until traffic flows,
then measures two back-to-back windows while the bench keeps sending:

1. an unprofiled window (`--cpu-window` s): CPU per process and per thread from /proc, divided by the requests
   Envoy completed in it (admin `/stats`, `http.cortex.downstream_rq_completed`): CPU ms per request;
2. a profiled window (`--duration` s): extproc and ingest with `py-spy record --native -f raw -r 1000`, Envoy
   with `perf record -F 999 -g`, all at once; CPU per request is measured again (a sampler under ptrace
   inflates its target's CPU, so this window is for shares, the first for CPU).

py-spy's idle detection misses threads parked in a native wait here, so samples whose innermost named frame is
a wait (epoll/poll/select, futex, condition variables, semaphores, CPython's lock and GIL waits, libc `syscall`
under a queue get) are dropped and counted; pyzmq's zero-timeout polls are work. The rest is reported, for each
main thread, by part: the first frame, from the innermost outwards, that a part names (an enclosing context such
as the deferred tail or the upkeep wins over what it calls), and by self frame. Envoy's binary is stripped, so it
is reported by thread, by DSO, kernel against user, by syscall, by kernel path and by kernel symbol. Threads' CPU
comes from /proc (gRPC's and ZMQ's C threads are invisible to py-spy).

    python perf/profile_processes.py --json after.json --label after
    PYTHONPATH=/work/wt/before python perf/profile_processes.py --tree /work/wt/before --json before.json \\
        --label before
    python perf/profile_processes.py --from-json before.json --from-json after.json   # side by side

With several runs per label the tables show each run (CPU) or the shares pooled over the runs with their range
(profiles). `--work-dir DIR` keeps the raw samples; `--from-json X --reanalyze` recomputes a run's profiles from
them after a change of the grouping rules. docs/performance.md, "Where each process's CPU goes under `unique`",
has a run and how to read it.

Numbers only, nothing asserted. Bounded: the bench sends a fixed number of requests; every wait has a deadline;
every child (the bench and what it started, py-spy, perf) is stopped on exit or Ctrl-C. Loopback only (the
bench's processes bind 127.0.0.1). Needs root (or ptrace and perf_event permissions) for py-spy and perf.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent.parent
PY_SPY = Path(sys.executable).parent / "py-spy"
TICK = os.sysconf("SC_CLK_TCK")
TOP = 15

# -- processes ------------------------------------------------------------------------------------------------


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def _pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def _ppid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def descendants(root: int) -> list[int]:
    """Every live process under `root` (the bench starts its children in sessions of their own, so a process
    group would not reach them; parentage does)."""
    children: dict[int, list[int]] = defaultdict(list)
    for pid in _pids():
        ppid = _ppid(pid)
        if ppid is not None:
            children[ppid].append(pid)
    out: list[int] = []
    todo = [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def find_gateway(work_dir: Path, root: int) -> dict[str, int] | None:
    """Envoy, extproc (each index) and ingest started by the bench under `work_dir`, by their command lines."""
    found: dict[str, int] = {}
    prefix = str(work_dir)
    for pid in descendants(root):
        argv = _cmdline(pid)
        if "-c" not in argv:
            continue
        conf = argv[argv.index("-c") + 1] if argv.index("-c") + 1 < len(argv) else ""
        if not conf.startswith(prefix):
            continue
        if "cortexctl.cli" in argv and "extproc" in argv:
            idx = argv[argv.index("--index") + 1] if "--index" in argv else "0"
            found[f"extproc-{idx}"] = pid
        elif "cortexctl.cli" in argv and "ingest" in argv:
            found["ingest"] = pid
        elif Path(argv[0]).name == "envoy":
            found["envoy"] = pid
    return found if {"envoy", "ingest"} <= found.keys() and any(k.startswith("extproc") for k in found) else None


@dataclass
class CpuSnap:
    at: float
    process: float
    threads: dict[int, tuple[str, float]]


def cpu_snap(pid: int) -> CpuSnap:
    """User + system seconds of the process and of each of its threads (with the thread's name)."""
    def stat(path: Path) -> float:
        fields = path.read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICK

    at = time.monotonic()
    total = stat(Path(f"/proc/{pid}/stat"))
    threads: dict[int, tuple[str, float]] = {}
    for t in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            threads[int(t.name)] = ((t / "comm").read_text().strip(), stat(t / "stat"))
    return CpuSnap(at, total, threads)


def cpu_delta(a: CpuSnap, b: CpuSnap) -> tuple[float, dict[int, tuple[str, float]]]:
    """Process CPU seconds between two snapshots, and per thread (threads that ended meanwhile as tid 0)."""
    per: dict[int, tuple[str, float]] = {}
    for tid, (name, cpu) in b.threads.items():
        per[tid] = (name, cpu - a.threads.get(tid, (name, 0.0))[1])
    rest = (b.process - a.process) - sum(v for _, v in per.values())
    if rest > 0.005:
        per[0] = ("(rest: threads that ended, tick rounding)", rest)
    return b.process - a.process, per


def completed(admin: str) -> int:
    with urllib.request.urlopen(f"{admin}/stats?filter=^http\\.cortex\\.downstream_rq_completed$", timeout=5) as r:
        text = r.read().decode()
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "http.cortex.downstream_rq_completed":
            return int(value)
    raise RuntimeError(f"no downstream_rq_completed in Envoy's stats: {text[:200]!r}")


# -- py-spy samples -------------------------------------------------------------------------------------------

# Innermost frames that mean "waiting", whatever py-spy's idle flag said.
WAIT_LEAVES = re.compile(r"^(epoll_wait|epoll_pwait2?|(__)?poll|ppoll|__GI___poll|select|__select|pselect6?|"
                         r"(__)?futex\w*|do_futex_wait\w*|__lll_lock_wait\w*|pthread_cond_(timed)?wait\w*|"
                         r"__pthread_cond_(timed)?wait\w*|___pthread_cond_(timed)?wait\w*|sem_(timed|clock)?wait\w*|"
                         r"__new_sem_wait\w*|nanosleep|clock_nanosleep\w*|__GI___clock_nanosleep|"
                         r"__GI___nanosleep|zmq_poll|accept4?|__libc_accept|"
                         # CPython's lock and GIL waits (the semaphore or condition under them is often unnamed)
                         r"PyThread_acquire_lock(_timed)?|acquire_timed|lock_PyThread_acquire_lock|rlock_acquire|"
                         r"take_gil|PyCOND_(TIMED)?WAIT|_queue_SimpleQueue_get_impl)$")
# libc's bare `syscall` is a futex wait when it is reached from one of these Python frames.
WAIT_CALLERS = re.compile(r"^(get|wait|acquire|_wait_for_tstate_lock|_worker|join|result|sleep|select|poll)$")
FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")
# Python frames that wait, when py-spy could not unwind the native frames under them: (file, function).
PY_WAITS = {("selectors.py", "select"), ("threading.py", "wait"), ("threading.py", "_wait_for_tstate_lock"),
            ("threading.py", "join"), ("queue.py", "get"), ("thread.py", "_worker")}
THREAD = re.compile(r"^thread \((?P<id>0x[0-9A-Fa-f]+|\d+)\)(?::?\s*(?P<name>.*))?$")


@dataclass(frozen=True, slots=True)
class Frame:
    func: str
    file: str

    @property
    def short(self) -> str:
        return f"{self.func} ({short_path(self.file)})"


def short_path(file: str) -> str:
    for marker in ("/site-packages/", "/lib/python3.11/", "/lib/python3.12/"):
        if marker in file:
            return file.split(marker, 1)[1]
    for top in ("/extproc/", "/ingest/", "/cortex/"):
        if top in file:
            return top[1:] + file.rsplit(top, 1)[1]
    return Path(file).name if "/" in file else file


def parse_frame(text: str) -> Frame:
    m = FRAME.match(text)
    if m is None:
        return Frame(text, "")
    return Frame(m["func"], m["file"])


@dataclass
class Stacks:
    """py-spy's raw samples: (thread id, thread name, frames root -> leaf) -> count."""
    samples: Counter[tuple[str, str, tuple[Frame, ...]]] = field(default_factory=Counter)

    @classmethod
    def parse(cls, text: str) -> Stacks:
        out = cls()
        for line in text.splitlines():
            stack, _, n = line.rpartition(" ")
            if not stack or not n.isdigit():
                continue
            parts = stack.split(";")
            tid, tname = "?", ""
            frames = []
            for p in parts:
                m = THREAD.match(p)
                if m is not None:
                    tid, tname = m["id"], (m["name"] or "").strip()
                elif p.startswith("process "):
                    continue
                else:
                    frames.append(parse_frame(p))
            out.samples[(tid, tname, tuple(frames))] += int(n)
        return out


def unnamed(f: Frame) -> bool:
    """A native frame py-spy could not name (an address in libc's stripped internals, the vDSO, ...)."""
    return f.func.startswith("0x")


def is_wait(frames: Sequence[Frame]) -> bool:
    """True when the innermost named frame is a wait (libc's unnamed internals under it are part of the wait)."""
    leaf = next((f for f in reversed(frames) if not unnamed(f)), None)
    if leaf is None:
        return not frames
    if leaf.file.endswith(".py"):
        return (Path(leaf.file).name, leaf.func.rsplit(".", 1)[-1]) in PY_WAITS
    if WAIT_LEAVES.match(leaf.func):
        # libzmq's poll with a zero timeout (a ZMQ_EVENTS check, a non-blocking receive) is work, not a wait:
        # nothing on these event loops blocks inside pyzmq.
        return not (leaf.func in ("poll", "__poll", "zmq_poll") and any("/zmq/" in f.file for f in frames))
    if leaf.func in ("syscall", "__syscall_cancel_arch", "__internal_syscall_cancel"):
        return any(WAIT_CALLERS.match(f.func.rsplit(".", 1)[-1]) and f.file.endswith(".py") for f in frames)
    return False


def interpreter(f: Frame) -> bool:
    """CPython's own C frames (libpython / the python binary): not what a self-time list should name."""
    name = Path(f.file).name
    return name.startswith(("libpython", "python3", "python")) and not name.endswith(".py")


def self_frame(frames: Sequence[Frame]) -> Frame:
    for f in reversed(frames):
        if not interpreter(f):
            return f
    return frames[-1]


RUST_IDENT = re.compile(r"(?<![0-9])([1-9][0-9]*)_?(?=([a-z][a-z0-9_]*))")


RUST_STD = {"for_each", "extend_trusted", "into_iter", "from_iter", "call_once", "call_mut", "drop_in_place",
            "drop_glue", "spec_extend", "extend_desugared", "try_fold", "unwrap_failed", "into_pyobject"}


def rust_names(symbol: str) -> list[str]:
    """The function-like identifiers (snake_case) of a Rust v0 mangled symbol, in order, without repeats."""
    out: list[str] = []
    for m in RUST_IDENT.finditer(symbol):
        ident = m[2][: int(m[1])]
        if len(ident) == int(m[1]) and "_" in ident.strip("_") and ident not in out and ident not in RUST_STD:
            out.append(ident)
    return out


def self_label(frames: Sequence[Frame]) -> str:
    """The self frame, named for a reader: a Python function with its file; a native one with its library and
    the innermost Python frame that called it (an unnamed address as `native`)."""
    f = self_frame(frames)
    if f.file.endswith(".py") or not f.file:
        return f.short
    name = f.func
    if unnamed(f):
        name = "native"
    elif name.startswith("_R") and len(name) > 40:
        name = ", ".join(rust_names(name)[-2:]) or "native"
    elif len(name) > 60:
        name = name[:57] + "..."
    caller = next((g for g in reversed(frames) if g.file.endswith(".py")), None)
    lib = Path(f.file).name if "/" in f.file else f.file
    return f"{name} ({lib})" + (f" <- {caller.func}" if caller is not None else "")


@dataclass(frozen=True, slots=True)
class Rule:
    part: str
    match: Callable[[Frame], bool]


def in_file(*suffixes: str, funcs: Iterable[str] | None = None) -> Callable[[Frame], bool]:
    names = None if funcs is None else set(funcs)

    def match(f: Frame) -> bool:
        if not f.file.endswith(suffixes):
            return False
        return names is None or f.func.rsplit(".", 1)[-1] in names or f.func in names
    return match


def path_has(*needles: str) -> Callable[[Frame], bool]:
    return lambda f: any(n in f.file for n in needles)


@dataclass(frozen=True, slots=True)
class Grouping:
    """Parts of a main thread: `outer` rules win when any frame of the stack matches (an enclosing context);
    otherwise the innermost frame that an `inner` rule matches names the part; else `rest`."""
    outer: tuple[Rule, ...]
    inner: tuple[Rule, ...]
    rest: str

    def part(self, frames: Sequence[Frame]) -> str:
        for rule in self.outer:
            if any(rule.match(f) for f in frames):
                return rule.part
        for f in reversed(frames):
            for rule in self.inner:
                if rule.match(f):
                    return rule.part
        return self.rest


EXTPROC = Grouping(
    outer=(
        Rule("deferred tail (DeferredTail: tail tokenize, keys, predictions)",
             in_file("extproc/prompt_walk.py", funcs=("_drain", "_finish", "run_pending", "_kick", "catch_up"))),
        Rule("upkeep (ClusterView.refresh, Router.upkeep, config poll)",
             lambda f: in_file("extproc/cluster_view.py", funcs=("refresh",))(f)
             or in_file("extproc/router.py", funcs=("upkeep",))(f)
             or in_file("extproc/serve.py", funcs=("upkeep",))(f) or in_file("cortex/config_watch.py")(f)),
        Rule("health (gRPC health checks)", in_file("cortex/grpc_health.py")),
    ),
    inner=(
        Rule("template render (chat template, jinja2)",
             lambda f: in_file("extproc/prepare.py", funcs=("prompt_text",))(f)
             or in_file("cortex/model_bundle.py", funcs=("render_chat", "_tojson"))(f) or "jinja2" in f.file),
        Rule("tokenize (piecewise, BPE, tokenizers)",
             lambda f: in_file("cortex/fast_bpe.py")(f) or path_has("cortex/piecewise/")(f)
             or in_file("cortex/model_bundle.py", funcs=("encode",))(f) or path_has("tokenizers", "tiktoken",
                                                                                   "fastokens", "rs_bpe")(f)),
        Rule("hash (block keys)", lambda f: in_file("cortex/blockkeys.py")(f) or path_has("xxhash")(f)),
        Rule("lookup (ledger view)",
             lambda f: in_file("cortex/ledger_view/reader.py", "cortex/ledger_view/layout.py")(f)
             or in_file("extproc/cluster_view.py", "extproc/snapshot.py", funcs=("match",))(f)),
        Rule("prompt walk bookkeeping (prompt_walk.walk: ids, counts, predictions)",
             in_file("extproc/prompt_walk.py", "extproc/predictions.py")),
        Rule("body parse (parse_body, orjson, pydantic)", lambda f: in_file("extproc/request.py")(f)
             or path_has("pydantic")(f)),
        Rule("plan/score (snapshot, resolve, candidates, policy)",
             lambda f: in_file("extproc/plan.py", "extproc/candidates.py", "extproc/pd.py", "extproc/snapshot.py",
                               "extproc/registry.py", "extproc/prepare.py", "extproc/router.py",
                               "cortex/inflight.py", "extproc/cluster_view.py")(f) or "extproc/policies/" in f.file),
        Rule("response building (headers, body answer, metrics)",
             lambda f: (in_file("extproc/server.py")(f) and f.func.rsplit(".", 1)[-1] != "process")
             or in_file("extproc/answers.py", "extproc/acting.py", "extproc/responses.py", "extproc/pd_act.py",
                        "extproc/room_glue.py", "extproc/route_explain.py", "extproc/metrics.py",
                        "cortex/headers.py")(f)
             or path_has("prometheus_client")(f)),
        Rule("gRPC/asyncio stream machinery (grpc.aio, protobuf, ExtProc.process)",
             lambda f: path_has("grpc", "protobuf", "upb")(f) or in_file("extproc/server.py", funcs=("process",))(f)),
    ),
    rest="event loop and other (uvloop/asyncio, interpreter)",
)

INGEST = Grouping(
    outer=(
        Rule("heartbeat and publication (meta document), health probes",
             lambda f: in_file("ingest/service.py", funcs=("_heartbeat_loop", "publish_meta"))(f)
             or in_file("ingest/probe_loops.py", funcs=("_watch_health", "_check_routed"))(f)
             or in_file("ingest/probes.py", funcs=("probe_health",))(f)),
        Rule("parity checks, config watch, admin API",
             lambda f: in_file("ingest/service.py", funcs=("_config_loop", "_apply_config"))(f)
             or in_file("ingest/probe_loops.py", funcs=("_token_parity_loop", "_check_tokens"))(f)
             or in_file("ingest/admin.py", "ingest/readiness.py", "ingest/tokenizer_parity.py",
                        "cortex/config_watch.py")(f)),
    ),
    inner=(
        Rule("load: parse (parse_metrics)", lambda f: "cortex/engines/" in f.file and "parse" in f.func),
        Rule("load: HTTP client (aiohttp)", lambda f: path_has("aiohttp", "multidict", "yarl")(f)
             or in_file("ingest/probes.py", funcs=("read_load",))(f)),
        Rule("load: apply, cadence, silence/tail checks",
             lambda f: in_file("ingest/probe_loops.py", funcs=("_poll_load", "_check_worker", "_check_silence",
                                                              "_check_publishers", "_check_tails", "_wake"))(f)
             or in_file("ingest/workers.py", "ingest/silence.py")(f) or "cortex/engines/" in f.file),
        Rule("events: view writes (ViewWriter, layout)",
             in_file("cortex/ledger_view/writer.py", "cortex/ledger_view/layout.py")),
        Rule("events: decode (decode_batch, msgspec)", lambda f: in_file("ingest/events.py")(f)
             or path_has("msgspec")(f)),
        Rule("events: sync state machine", in_file("ingest/sync.py")),
        Rule("events: ledger apply (Ledger, chain_keys)",
             lambda f: in_file("ingest/ledger.py", "ingest/ledger_lanes.py", "ingest/ledger_publish.py",
                               "cortex/blockkeys.py", "ingest/hash_parity.py",
                               "cortex/engine_hashes.py")(f) or path_has("xxhash")(f)),
        Rule("events: ZMQ receive and poll (pyzmq, EventSource)",
             lambda f: path_has("/zmq/", "pyzmq", "libzmq")(f) or in_file("ingest/source.py")(f)),
    ),
    rest="the event loop itself and other (asyncio, _Timed, interpreter)",
)


def python_profile(text: str, pid: int, grouping: Grouping, tree: Path) -> dict[str, Any]:
    """Shares by thread and, for the main thread, by part; top self frames; which tree the code came from."""
    stacks = Stacks.parse(text)
    total = sum(stacks.samples.values())
    dropped = 0
    threads: Counter[str] = Counter()
    thread_names: dict[str, str] = {}
    parts: Counter[str] = Counter()
    selfs: Counter[str] = Counter()
    main_total = 0
    files: Counter[str] = Counter()
    main_ids = {str(pid), hex(pid).upper().replace("X", "x")}
    ids = {tid for tid, _, _ in stacks.samples}
    # The main thread: its OS id is the pid; py-spy names it MainThread when it can.
    main = next((t for t, n, _ in stacks.samples if n == "MainThread"), None) or next(
        (t for t in ids if t in main_ids), None)
    for (tid, tname, frames), n in stacks.samples.items():
        if is_wait(frames):
            dropped += n
            continue
        threads[tid] += n
        if tname:
            thread_names[tid] = tname
        for f in frames:
            if f.file.endswith(".py") and ("/extproc/" in f.file or "/ingest/" in f.file or "/cortex/" in f.file):
                for top in ("/extproc/", "/ingest/", "/cortex/"):
                    if top in f.file:
                        files[f.file.rsplit(top, 1)[0]] += n
                        break
        if tid == main:
            main_total += n
            parts[grouping.part(frames)] += n
            selfs[self_label(frames)] += n
    kept = total - dropped
    roots = dict(files.most_common())
    return {
        "samples": total, "dropped_waits": dropped, "kept": kept, "main_thread": main,
        "threads": [{"id": t, "name": thread_names.get(t, ""), "samples": n,
                     "share": round(n / kept, 4) if kept else 0.0} for t, n in threads.most_common()],
        "main_samples": main_total,
        "parts": [{"part": p, "samples": n, "share": round(n / main_total, 4) if main_total else 0.0}
                  for p, n in parts.most_common()],
        "top_self": [{"frame": s, "samples": n, "share": round(n / main_total, 4) if main_total else 0.0}
                     for s, n in selfs.most_common(TOP)],
        "code_roots": roots,
        "tree_ok": bool(roots) and all(Path(r).resolve() == tree.resolve() for r in roots),
    }


# -- perf (Envoy) ---------------------------------------------------------------------------------------------

PERF_LINE = re.compile(r"^\s*([0-9a-f]+)\s+(.*?)\s+\((.*)\)\s*$")
SYSCALL = re.compile(r"^(?:__x64_sys_|__ia32_sys_|__se_sys_|__do_sys_|ksys_|__sys_)(\w+)$")


def kernel(dso: str) -> bool:
    return dso.startswith("[kernel") or dso.endswith(".ko")


def perf_profile(script: str) -> dict[str, Any]:
    """`perf script` output (comm, tid, callchains) -> shares by thread, DSO, kernel/user, syscall, symbol."""
    total = 0
    by_thread: Counter[str] = Counter()
    by_dso: Counter[str] = Counter()
    ring: Counter[str] = Counter()
    syscalls: Counter[str] = Counter()
    ksyms: Counter[str] = Counter()
    usyms: Counter[str] = Counter()
    paths: Counter[str] = Counter()

    def flush(comm: str, chain: list[tuple[str, str]]) -> None:
        nonlocal total
        if not chain:
            return
        total += 1
        by_thread[comm] += 1
        sym, dso = chain[0]
        by_dso[Path(dso).name if dso.startswith("/") else dso] += 1
        if kernel(dso):
            ring["kernel"] += 1
            ksyms[sym] += 1
            syscalls[syscall_of(chain)] += 1
            paths[net_path(chain)] += 1
        else:
            ring["user"] += 1
            usyms[f"{sym} ({Path(dso).name})"] += 1

    comm = ""
    chain: list[tuple[str, str]] = []
    for line in script.splitlines():
        if not line.strip():
            flush(comm, chain)
            chain = []
            continue
        if not line[0].isspace():
            flush(comm, chain)
            chain = []
            comm = line.split()[0] if line.split() else "?"
            comm = re.sub(r"\d+$", "N", comm)
            continue
        m = PERF_LINE.match(line)
        if m is not None:
            chain.append((m[2].split("+0x", 1)[0], m[3]))
    flush(comm, chain)

    def share(c: Counter[str], n: int | None = None) -> list[dict[str, Any]]:
        return [{"name": k, "samples": v, "share": round(v / total, 4) if total else 0.0}
                for k, v in c.most_common(n)]

    return {"samples": total, "threads": share(by_thread), "dsos": share(by_dso, TOP),
            "ring": share(ring), "syscalls": share(syscalls, TOP), "kernel_symbols": share(ksyms, TOP),
            "user_symbols": share(usyms, 5), "kernel_paths": share(paths)}


def syscall_of(chain: list[tuple[str, str]]) -> str:
    """The system call a kernel stack (innermost first) is in: named by the libc wrapper that entered it (the
    kernel's own syscall functions are inlined on this kernel), else by the frame under `do_syscall_64`; a stack
    with no syscall entry is an interrupt, a softirq or a fault, named by its outermost kernel frame."""
    names = [s for s, _ in chain]
    if "do_syscall_64" not in names:
        entry = next((s for s, d in reversed(chain) if kernel(d)), names[0])
        return f"(no syscall: {entry})"
    i = names.index("do_syscall_64")
    user = next((s for s, d in chain[i:] if not kernel(d)), None)
    if user is not None and user != "[unknown]":
        return re.sub(r"^(__GI___|__libc_|__GI_|__)", "", user).removesuffix("64")
    below = names[i - 1] if i > 0 else names[0]
    m = SYSCALL.match(below)
    return m[1] if m else below


# Kernel call paths, most specific first: the first one found anywhere in a kernel stack names its path.
NET_PATHS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("loopback receive (softirq: net_rx_action, ip_rcv, tcp_v4_rcv)",
     ("net_rx_action", "__netif_receive_skb", "ip_rcv", "tcp_v4_rcv", "process_backlog")),
    ("TCP send (tcp_sendmsg)", ("tcp_sendmsg", "tcp_sendmsg_locked", "tcp_write_xmit")),
    ("TCP receive (tcp_recvmsg)", ("tcp_recvmsg", "tcp_recvmsg_locked")),
    ("epoll (ep_poll, ep_send_events)", ("ep_poll", "do_epoll_wait", "ep_send_events", "do_epoll_ctl")),
    ("futex", ("do_futex", "futex_wait", "futex_wake")),
    ("scheduler (schedule, context switch)", ("__schedule", "schedule", "finish_task_switch")),
    ("timers and interrupts", ("hrtimer_interrupt", "asm_sysvec_apic_timer_interrupt", "irq_exit_rcu")),
    ("syscall entry/exit", ("entry_SYSCALL_64", "syscall_exit_to_user_mode", "do_syscall_64")),
)


def net_path(chain: list[tuple[str, str]]) -> str:
    syms = {s for s, d in chain if kernel(d)}
    for name, marks in NET_PATHS:
        if syms & set(marks):
            return name
    return "other kernel"


# -- one run --------------------------------------------------------------------------------------------------


class Children:
    """Every process this script starts, stopped by pid on exit: the bench (SIGINT first, so it stops its own
    children), whatever it left, py-spy and perf."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.bench: subprocess.Popen[bytes] | None = None

    def start(self, argv: list[str], **kw: Any) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(argv, **kw)
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        under = descendants(self.bench.pid) if self.bench is not None and self.bench.poll() is None else []
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGINT)
        for proc in self.procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait(5)
        # What the bench started and did not stop (it was killed): by pid, TERM then KILL.
        for sig in (signal.SIGTERM, signal.SIGKILL):
            alive = [p for p in under if _ppid(p) is not None]
            for p in alive:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, sig)
            deadline = time.monotonic() + 5
            while alive and time.monotonic() < deadline:
                alive = [p for p in alive if _ppid(p) is not None]
                time.sleep(0.1)


def _wait(what: str, check: Callable[[], Any], timeout: float, bench: subprocess.Popen[bytes], log: Path) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if bench.poll() is not None:
            raise RuntimeError(f"the bench exited ({bench.returncode}) before {what}: "
                               f"{log.read_text(errors='replace')[-1500:]}")
        with contextlib.suppress(OSError, ValueError, RuntimeError):
            got = check()
            if got:
                return got
        time.sleep(0.2)
    raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")


def _window(pids: dict[str, int], admin: str) -> tuple[dict[str, CpuSnap], int]:
    try:
        return {k: cpu_snap(p) for k, p in pids.items()}, completed(admin)
    except OSError as exc:
        raise RuntimeError(f"a gateway process is gone (the bench ended early, or it crashed): {exc}") from exc


def _cpu_figures(pids: dict[str, int], a: tuple[dict[str, CpuSnap], int], b: tuple[dict[str, CpuSnap], int],
                 pyspy_names: dict[str, dict[str, str]] | None = None) -> dict[str, Any]:
    reqs = b[1] - a[1]
    out: dict[str, Any] = {"requests": reqs, "seconds": round(next(iter(b[0].values())).at
                                                              - next(iter(a[0].values())).at, 2), "processes": {}}
    for k, pid in pids.items():
        total, per = cpu_delta(a[0][k], b[0][k])
        names = (pyspy_names or {}).get(k, {})
        threads = []
        for tid, (comm, cpu) in sorted(per.items(), key=lambda kv: -kv[1][1]):
            if cpu <= 0:
                continue
            label = "main" if tid == pid else names.get(str(tid)) or comm
            threads.append({"tid": tid, "name": label, "comm": comm, "cpu_s": round(cpu, 3)})
        out["processes"][k] = {"pid": pid, "cpu_s": round(total, 3),
                               "cpu_ms_per_request": round(1000 * total / reqs, 3) if reqs else None,
                               "threads": threads}
    out["gateway_cpu_ms_per_request"] = (round(sum(p["cpu_s"] for p in out["processes"].values()) * 1000 / reqs, 3)
                                         if reqs else None)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    tree = Path(args.tree).resolve()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="cortex-profile-")).resolve()
    if work.exists() and any(work.iterdir()):
        raise SystemExit(f"--work-dir {work} is not empty")
    work.mkdir(parents=True, exist_ok=True)
    # Arrivals must outlast both windows: attaching and detaching the samplers adds 5-15 s to the second one
    # (more on a busy machine).
    requests = args.requests or math.ceil(args.rate * (args.warmup + args.cpu_window + args.duration + 30))
    bench_json = work / "bench.json"
    argv = [sys.executable, "-m", "cortexctl.cli", "bench", "--workload", "unique", "--contestant", "cortex",
            "--overhead-probes", "0", "--sweep-rates", "off", "--rate", str(args.rate), "--requests", str(requests),
            "--work-dir", str(work / "bench"), "--json", str(bench_json)]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out: dict[str, Any] = {
        "label": args.label or tree.name, "tree": str(tree),
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "bench_command": "cortex " + " ".join(argv[3:]), "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "rate": args.rate, "requests_sent": requests, "window_s": {"cpu": args.cpu_window, "profile": args.duration},
    }
    children = Children()
    log = work / "bench.log"
    try:
        with open(log, "wb") as fh:
            bench = children.bench = children.start(argv, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=str(tree))
        pids: dict[str, int] = _wait("the gateway's processes", lambda: find_gateway(work / "bench", bench.pid),
                                     180, bench, log)
        out["pythonpath"] = {k: _environ(p).get("PYTHONPATH") for k, p in pids.items() if k != "envoy"}
        conf = yaml.safe_load((work / "bench" / "cortex.yaml").read_text())
        admin = f"http://{conf['admin']['host']}:{conf['admin']['port']}"
        # Traffic flows: the bench's warm-up chat is one request, its run the rest.
        _wait("traffic", lambda: completed(admin) >= 1 + max(3, int(args.rate)), 180, bench, log)
        time.sleep(args.warmup)
        a = _window(pids, admin)
        time.sleep(args.cpu_window)
        b = _window(pids, admin)
        out["loadavg_profile"] = [round(x, 2) for x in os.getloadavg()]
        # The profiled window: all samplers at once, over the same seconds.
        samplers: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
        for k, pid in pids.items():
            if k == "envoy":
                data = work / "envoy.perf.data"
                samplers[k] = (children.start(["perf", "record", "-F", "999", "-g", "-p", str(pid), "-o", str(data),
                                               "--", "sleep", str(args.duration)],
                                              stdout=subprocess.DEVNULL, stderr=open(work / "perf.log", "wb")),  # noqa: SIM115
                               data)
            else:
                raw = work / f"{k}.pyspy.txt"
                samplers[k] = (children.start([str(PY_SPY), "record", "--native", "--threads", "--nolineno",
                                               "--full-filenames", "-f", "raw", "-r", str(args.sample_rate),
                                               "--duration", str(args.duration), "--pid", str(pid), "-o", str(raw)],
                                              stdout=subprocess.DEVNULL,
                                              stderr=open(work / f"{k}.pyspy.log", "wb")),  # noqa: SIM115
                               raw)
        c = _window(pids, admin)
        for k, (proc, _) in samplers.items():
            try:
                proc.wait(args.duration + 60)
            except subprocess.TimeoutExpired as exc:
                raise RuntimeError(f"the {k} sampler did not finish") from exc
        d = _window(pids, admin)
        out["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        profiles: dict[str, Any] = {}
        for k, (proc, path) in samplers.items():
            if proc.returncode != 0 or not path.exists():
                profiles[k] = {"error": f"sampler exited {proc.returncode}"}
                continue
            profiles[k] = analyze(k, path, pids[k], tree)
        names = {k: {str(t["id"]): t["name"] for t in p.get("threads", []) if t.get("name")}
                 for k, p in profiles.items() if k != "envoy"}
        out["cpu"] = _cpu_figures(pids, a, b, names)
        out["cpu_profiled"] = _cpu_figures(pids, c, d, names)
        out["profiles"] = profiles
        with contextlib.suppress(subprocess.TimeoutExpired):
            bench.wait(args.bench_timeout)
        if bench.returncode == 0 and bench_json.exists():
            res = json.loads(bench_json.read_text())
            r = res["workloads"]["unique"]["results"]["cortex"]
            out["bench"] = {k: r.get(k) for k in ("completed", "requests", "hit_ratio", "ttft_ms",
                                                 "gateway_cpu_ms_per_request", "gateway_cpu_ms_per_request_by_part")}
        else:
            out["bench"] = {"error": f"bench exited {bench.returncode}: {log.read_text(errors='replace')[-500:]}"}
    finally:
        children.stop()
        if not args.keep:
            shutil.rmtree(work / "bench", ignore_errors=True)
    out["work_dir"] = str(work)
    return out


def analyze(k: str, path: Path, pid: int, tree: Path) -> dict[str, Any]:
    """One process's profile from its sampler's raw file (perf.data for Envoy, py-spy's raw text otherwise)."""
    if k == "envoy":
        script = subprocess.run(["perf", "script", "-i", str(path), "-F", "comm,tid,ip,sym,dso"],
                                capture_output=True, text=True, timeout=300, check=False).stdout
        return perf_profile(script)
    return python_profile(path.read_text(), pid, INGEST if k == "ingest" else EXTPROC, tree)


def reanalyze(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved run's profiles computed again from the raw files kept in its work directory (after a change of
    the grouping rules: the samples stay the same)."""
    work = Path(saved["work_dir"])
    for k, fig in saved["cpu"]["processes"].items():
        path = work / ("envoy.perf.data" if k == "envoy" else f"{k}.pyspy.txt")
        if path.exists():
            saved["profiles"][k] = analyze(k, path, fig["pid"], Path(saved["tree"]))
    return saved


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return {}
    return dict(x.decode(errors="replace").split("=", 1) for x in raw if b"=" in x)


# -- Markdown -------------------------------------------------------------------------------------------------


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f} %"


def _ms(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def _table(head: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _cells(runs: Sequence[dict[str, Any]], get: Callable[[dict[str, Any]], str]) -> str:
    """The runs' values as `a / b / c`, with their mean when there are several."""
    vals = [get(r) for r in runs]
    nums = [float(v) for v in vals if v != "–"]
    return " / ".join(vals) + (f" (mean {sum(nums) / len(nums):.2f})" if len(nums) > 1 else "")


def _pooled_rows(profs: dict[str, list[dict[str, Any]]], cols: Sequence[str], key: str, name_key: str,
                 total_key: str, show: Callable[[str], str], limit: int | None = None) -> list[list[str]]:
    """One row per name: per label, its share pooled over that label's runs (their samples summed), then the
    runs' range when there are several. A name missing from a run's list counts 0 there (a top list is cut)."""
    def pooled(c: str, name: str) -> tuple[float, list[float]]:
        per = []
        hits = total = 0
        for p in profs[c]:
            n = next((x["samples"] for x in p[key] if x[name_key] == name), 0)
            hits += n
            total += p[total_key]
            per.append(n / p[total_key] if p[total_key] else 0.0)
        return (hits / total if total else 0.0), per

    names: list[str] = []
    for c in cols:
        for p in profs[c]:
            names += [x[name_key] for x in p[key] if x[name_key] not in names]
    names.sort(key=lambda n: -pooled(cols[0], n)[0] - sum(pooled(c, n)[0] for c in cols[1:]) / 1000)
    rows = []
    for n in names[:limit]:
        cells = []
        for c in cols:
            share, per = pooled(c, n)
            cell = _pct(share)
            if len(per) > 1:
                cell += f" ({100 * min(per):.0f}–{100 * max(per):.0f})"
            cells.append(cell)
        rows.append([show(n), *cells])
    return rows


def render(runs: Sequence[dict[str, Any]]) -> str:
    """Tables with one column per label (before, after, ...); a label's runs are shown as `a / b`."""
    labels: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        labels.setdefault(r["label"], []).append(r)
    cols = list(labels)
    out: list[str] = []
    out.append("Runs: " + "; ".join(
        f"{r['label']}: {r['started']}, tree {r['tree']}, load average {r['loadavg_start'][0]} at start, "
        f"{r.get('loadavg_profile', ['?'])[0]} when profiling, {r['cpu']['requests']} requests in the "
        f"{r['cpu']['seconds']} s CPU window, {r['cpu_profiled']['requests']} in the "
        f"{r['cpu_profiled']['seconds']} s profiled one" for r in runs) + ".")
    out.append("")
    procs = sorted({k for r in runs for k in r["cpu"]["processes"]}, key=lambda k: ("envoy", "extproc", "ingest")
                   .index(k.split("-")[0]) if k.split("-")[0] in ("envoy", "extproc", "ingest") else 9)
    def per_request(window: str, k: str | None) -> Callable[[dict[str, Any]], str]:
        def get(r: dict[str, Any]) -> str:
            w = r[window]
            return _ms(w["gateway_cpu_ms_per_request"] if k is None
                       else w["processes"].get(k, {}).get("cpu_ms_per_request"))
        return get

    rows = [[k, *(_cells(labels[c], per_request("cpu", k)) for c in cols)] for k in procs]
    rows.append(["gateway", *(_cells(labels[c], per_request("cpu", None)) for c in cols)])
    rows.append(["gateway, while profiled", *(_cells(labels[c], per_request("cpu_profiled", None)) for c in cols)])
    out += ["**CPU per request (ms, unprofiled window, /proc)**", "", _table(["process", *cols], rows), ""]

    # Threads: CPU ms per request by thread name, per process.
    for k in procs:
        names: list[str] = []
        for r in runs:
            for t in r["cpu"]["processes"].get(k, {}).get("threads", []):
                if t["name"] not in names:
                    names.append(t["name"])

        def thread_ms(name: str, k: str = k) -> Callable[[dict[str, Any]], str]:
            def get(run: dict[str, Any]) -> str:
                p = run["cpu"]["processes"].get(k, {})
                cpu = sum(t["cpu_s"] for t in p.get("threads", []) if t["name"] == name)
                return _ms(1000 * cpu / run["cpu"]["requests"]) if run["cpu"]["requests"] else "–"
            return get
        trows = [[n, *(_cells(labels[c], thread_ms(n)) for c in cols)] for n in names]
        out += [f"**{k}: CPU per request by thread (ms)**", "", _table(["thread", *cols], trows), ""]

    for k in procs:
        if k == "envoy":
            continue
        profs = {c: [r["profiles"].get(k, {}) for r in labels[c]] for c in cols}
        if not all("parts" in p for ps in profs.values() for p in ps):
            continue
        prows = _pooled_rows(profs, cols, "parts", "part", "main_samples", lambda n: n)
        out += [f"**{k}: main thread by part (py-spy; share of its non-wait samples, pooled over the runs, "
                "and the runs' range)**", "", _table(["part", *cols], prows), ""]
        out.append("Samples (kept of all, waits dropped; main thread): " + "; ".join(
            f"{c}: " + " / ".join(f"{p['kept']} of {p['samples']} ({p['dropped_waits']} waits dropped), "
                                  f"main thread {p['main_samples']}" for p in profs[c]) for c in cols) + ".")
        out.append("")
        srows = _pooled_rows(profs, cols, "top_self", "frame", "main_samples", lambda n: f"`{n}`", TOP)
        out += [f"**{k}: top self frames of the main thread (innermost non-interpreter frame; pooled, range)**", "",
                _table(["frame", *cols], srows), ""]
    envs = {c: [r["profiles"].get("envoy", {}) for r in labels[c]] for c in cols}
    if all("samples" in p for ps in envs.values() for p in ps):
        out.append("Envoy samples: " + "; ".join(f"{c}: " + " / ".join(str(p["samples"]) for p in envs[c])
                                                 for c in cols) + ".")
        out.append("")
        for title, key in (("kernel vs user", "ring"), ("by thread", "threads"), ("by DSO (innermost frame)", "dsos"),
                           ("kernel samples by syscall", "syscalls"), ("kernel samples by path", "kernel_paths"),
                           ("top kernel symbols (innermost)", "kernel_symbols")):
            erows = _pooled_rows(envs, cols, key, "name", "samples",
                                 (lambda n: f"`{n}`") if key in ("kernel_symbols", "dsos") else (lambda n: n), TOP)
            out += [f"**Envoy (perf; share of all its samples, pooled, range): {title}**", "",
                    _table([key, *cols], erows), ""]
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--tree", default=str(HERE), help="the Cortex tree to run (its path goes first on PYTHONPATH)")
    p.add_argument("--label", help="name of this run in tables (default: the tree's directory name)")
    p.add_argument("--rate", type=float, default=20.0, help="requests per second the bench sends (default 20)")
    p.add_argument("--requests", type=int, help="requests the bench sends (default: enough for every window)")
    p.add_argument("--duration", type=int, default=12, help="seconds of profiling (default 12)")
    p.add_argument("--cpu-window", type=int, default=12, help="seconds of the unprofiled CPU window (default 12)")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds of traffic before the first window")
    p.add_argument("--sample-rate", type=int, default=1000, help="py-spy samples per second (default 1000)")
    p.add_argument("--bench-timeout", type=float, default=180.0, help="seconds to wait for the bench to end")
    p.add_argument("--work-dir", help="keep the raw profiles here (default: a new temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep the bench's logs and configs too")
    p.add_argument("--json", metavar="PATH", help="write the raw figures here")
    p.add_argument("--from-json", metavar="PATH", action="append", default=[],
                   help="render saved runs side by side instead of running (repeatable)")
    p.add_argument("--reanalyze", action="store_true",
                   help="with --from-json: recompute the profiles from the raw files kept in each run's work "
                        "directory, and save them back into its JSON")
    args = p.parse_args()
    if args.from_json:
        runs = []
        for x in args.from_json:
            saved = json.loads(Path(x).read_text())
            if args.reanalyze:
                saved = reanalyze(saved)
                Path(x).write_text(json.dumps(saved, indent=1))
            runs.append(saved)
        print(render(runs))
        return 0
    if shutil.which("perf") is None or not PY_SPY.exists():
        raise SystemExit("needs perf on PATH and py-spy next to this Python")
    # A shell starts a background job with SIGINT ignored, and children inherit an ignored signal: handle it here,
    # so Ctrl-C (or kill -INT) still stops this script, and the bench it starts gets SIGINT's default back.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: sys.exit(130))  # runs the cleanup in run()'s finally
    result = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(render([result]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
