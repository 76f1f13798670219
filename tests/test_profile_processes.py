"""perf/profile_processes.py: the pure parts that turn raw samples into the tables (vectors from real samples)."""

from __future__ import annotations

from perf.profile_processes import EXTPROC, INGEST, Stacks, is_wait, parse_frame, perf_profile, rust_names, self_label

LIBC = "/usr/lib/x86_64-linux-gnu/libc.so.6"
PY = "/root/.pyenv/versions/3.11.7/lib/python3.11"
TREE = "/work/wt/profile"


def frames(*specs: str) -> tuple:
    return tuple(parse_frame(s) for s in specs)


def test_raw_lines_parse_into_threads_and_frames() -> None:
    raw = (f"thread (18053): MainThread;Runner.run ({PY}/asyncio/runners.py);epoll_wait ({LIBC}) 7\n"
           f"thread (18175): cortex-tail_0;_worker ({PY}/concurrent/futures/thread.py);"
           f"pthread_cond_timedwait ({LIBC});0x7f3bd9ca3f16 ({LIBC}) 3\n")
    s = Stacks.parse(raw)
    assert sum(s.samples.values()) == 10
    (tid, name, fs), n = next(iter(s.samples.items()))
    assert (tid, name, n) == ("18053", "MainThread", 7)
    assert fs[-1].func == "epoll_wait" and fs[-1].file == LIBC


def test_waits_are_dropped_and_work_is_kept() -> None:
    # A wait whose innermost frames libc leaves unnamed.
    assert is_wait(frames(f"_worker ({PY}/concurrent/futures/thread.py)", f"pthread_cond_timedwait ({LIBC})",
                          f"0x7f3bd9ca3f16 ({LIBC})"))
    # A lock wait in CPython whose semaphore call libc leaves unnamed.
    assert is_wait(frames(f"_worker ({PY}/concurrent/futures/thread.py)", "_queue_SimpleQueue_get_impl (x.c)",
                          "PyThread_acquire_lock_timed (thread_pthread.h)", f"0x7f094b2aed90 ({LIBC})"))
    # The selector's wait when py-spy could not unwind the native frames under it.
    assert is_wait(frames(f"BaseEventLoop._run_once ({PY}/asyncio/base_events.py)",
                          f"EpollSelector.select ({PY}/selectors.py)"))
    # libc's bare syscall under a queue get is a futex wait; under anything else it is not judged a wait.
    assert is_wait(frames(f"SimpleQueue.get ({PY}/queue.py)", f"syscall ({LIBC})"))
    assert not is_wait(frames(f"parse_body ({TREE}/extproc/request.py)", f"syscall ({LIBC})"))
    # A zero-timeout poll inside pyzmq (a ZMQ_EVENTS check) is work.
    assert not is_wait(frames(f"_readable ({TREE}/ingest/source.py)",
                              "Socket.get (/x/site-packages/zmq/sugar/socket.py)", f"poll ({LIBC})"))
    assert is_wait(frames("uv__io_poll (/project/src/unix/linux.c)", f"poll ({LIBC})"))
    assert not is_wait(frames(f"Predictions.expire ({TREE}/extproc/predictions.py)"))


def test_extproc_parts_outer_context_wins_over_what_it_calls() -> None:
    # The deferred tail hashing its keys is the tail's cost, not the request path's hashing.
    tail = frames(f"DeferredTail._drain ({TREE}/extproc/prompt_walk.py)", f"Tail.keys ({TREE}/extproc/prompt_walk.py)",
                  f"chain_keys ({TREE}/cortex/blockkeys.py)")
    assert EXTPROC.part(tail).startswith("deferred tail")
    upkeep = frames(f"serve.<locals>.upkeep ({TREE}/extproc/serve.py)", f"Router.upkeep ({TREE}/extproc/router.py)",
                    f"Predictions.expire ({TREE}/extproc/predictions.py)")
    assert EXTPROC.part(upkeep).startswith("upkeep")
    # Otherwise the innermost named part: tokenizing inside the walk inside prepare.
    tok = frames(f"ExtProc.process ({TREE}/extproc/server.py)", f"prepare ({TREE}/extproc/prepare.py)",
                 f"walk ({TREE}/extproc/prompt_walk.py)", f"TokenCursor.next ({TREE}/cortex/piecewise/token_cursor.py)",
                 "native (/x/site-packages/tokenizers/tokenizers.abi3.so)")
    assert EXTPROC.part(tok).startswith("tokenize")
    grpc = frames(f"Runner.run ({PY}/asyncio/runners.py)", "0x1 (/x/site-packages/grpc/_cython/cygrpc.so)")
    assert EXTPROC.part(grpc).startswith("gRPC")
    assert EXTPROC.part(frames(f"Runner.run ({PY}/asyncio/runners.py)")) == EXTPROC.rest


def test_ingest_parts() -> None:
    writes = frames(f"EventSource.run ({TREE}/ingest/source.py)", f"Ledger.deferred ({TREE}/ingest/ledger.py)",
                    f"ViewWriter.add ({TREE}/cortex/ledger_view/writer.py)")
    assert INGEST.part(writes).startswith("events: view writes")
    meta = frames(f"Ingest._heartbeat_loop ({TREE}/ingest/service.py)",
                  f"ViewWriter.set_meta ({TREE}/cortex/ledger_view/writer.py)")
    assert INGEST.part(meta).startswith("heartbeat")
    parse = frames(f"ProbeLoops._poll_load ({TREE}/ingest/probe_loops.py)", f"read_load ({TREE}/ingest/probes.py)",
                   f"parse_metrics ({TREE}/cortex/engines/vllm.py)")
    assert INGEST.part(parse) == "load: parse (parse_metrics)"


def test_self_frames_name_native_code_by_library_and_python_caller() -> None:
    fs = frames(f"SegmentEncoder._safe_prefix ({TREE}/cortex/piecewise_tokenize.py)",
                "_RINvXs0_NtNtNtCsevLNFiNqfJP_4core4iter8adapters3map10tokenizers6models3bpe4word14get_chars_iter"
                "3BPE14word_to_tokens (/x/site-packages/tokenizers/tokenizers.abi3.so)",
                f"_PyObject_Malloc ({PY}/../libpython3.11.so.1.0)")
    assert self_label(fs) == "get_chars_iter, word_to_tokens (tokenizers.abi3.so) <- SegmentEncoder._safe_prefix"
    assert rust_names("_RNvXs_3foo7do_this7do_that") == ["do_this", "do_that"]


PERF = """\
wrk:worker_1 18164
\tffffffff8201cf99 tcp_ack ([kernel.kallsyms])
\tffffffff82034822 tcp_v4_rcv ([kernel.kallsyms])
\tffffffff81e6743b net_rx_action ([kernel.kallsyms])
\tffffffff820113ae tcp_recvmsg ([kernel.kallsyms])
\tffffffff821ed511 do_syscall_64 ([kernel.kallsyms])
\tffffffff81000130 entry_SYSCALL_64_after_hwframe ([kernel.kallsyms])
\t           fddfd __GI___readv (/usr/lib/x86_64-linux-gnu/libc.so.6)
\t         5abaaec [unknown] (/venv/envoy/_bin/envoy)

wrk:worker_0 18163
\t         5abaaec [unknown] (/venv/envoy/_bin/envoy)
\t           891f5 start_thread (/usr/lib/x86_64-linux-gnu/libc.so.6)

envoy 18160
\tffffffff81dacc75 finish_task_switch.isra.0 ([kernel.kallsyms])
\tffffffff81dacc00 asm_sysvec_reschedule_ipi ([kernel.kallsyms])
\t         5abaaec [unknown] (/venv/envoy/_bin/envoy)
"""


def test_perf_script_shares() -> None:
    p = perf_profile(PERF)
    assert p["samples"] == 3
    shares = {x["name"]: x["samples"] for x in p["ring"]}
    assert shares == {"kernel": 2, "user": 1}
    assert {x["name"]: x["samples"] for x in p["threads"]} == {"wrk:worker_N": 2, "envoy": 1}
    calls = {x["name"]: x["samples"] for x in p["syscalls"]}
    assert calls == {"readv": 1, "(no syscall: asm_sysvec_reschedule_ipi)": 1}
    assert p["kernel_paths"][0]["name"].startswith("loopback receive")
