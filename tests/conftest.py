"""The test tiers (docs/testing.md).

`pytest -q` runs everything (the README's and CI's command). `pytest -m "not e2e"` is the unit tier: no test in it
starts a process. `e2e` marks every test that starts one (Envoy, the gateway, simulators, vLLM, Prometheus, a
browser, a command-line tool): every test in a file named `*_e2e.py` or under tests/real_engine/, and the files and
tests listed in `E2E` below, which keeps the classification in one place instead of in ninety files.

The list cannot go stale quietly: while a test that is not marked `e2e` runs (its fixtures' set-up and tear-down
included), starting a process fails it with a message naming this file.

Under pytest-xdist (`-n 3`, the README's command) each file is one unit of work, so a module's gateway starts
once, and the real-engine tier is one unit on one worker: its engines never start beside another worker's
(xdist hands out the units with the most tests first, so it starts at once and does not end the run). Each
worker picks ports from its own blocks below the ephemeral range (cortexbench/launch.py: share_ports, free_run).
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

from cortexbench.launch import share_ports

HERE = Path(__file__).resolve().parent
REAL_ENGINE_GROUP = "real_engine"
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", "gw1", ... under pytest-xdist
if _WORKER is not None:
    share_ports(int(_WORKER.removeprefix("gw")), int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))

E2E: tuple[str, ...] = (
    "sim/test_real_engine_decode.py",
    "sim/test_server.py::test_cli_ready_line_serves_and_stops_gracefully",
    "sim/test_sglang_router.py",
    "test_admin_auth.py::test_engine_admin_paths_are_not_forwarded",
    "test_admin_auth.py::test_every_admin_route_answers_401_without_the_token",
    "test_admin_auth.py::test_health_and_metrics_stay_open",
    "test_admin_auth.py::test_route_explain_is_on_the_admin_port_behind_the_token",
    "test_admin_auth.py::test_routing_headers_can_be_turned_off_for_everyone",
    "test_admin_auth.py::test_the_public_listener_never_serves_admin_routes",
    "test_admin_auth.py::test_the_token_opens_them_and_a_browser_can_use_basic_auth",
    "test_alert_rules.py::test_promtool_check_rules",
    "test_alert_rules.py::test_promtool_test_rules",
    "test_bench_goodput.py::test_goodput_end_to_end",
    "test_bench_goodput.py::test_goodput_takes_one_ttft_slo_form",
    "test_bench_noisy.py::test_noisy_neighbor_tiny_run_refuses_the_flood_under_the_limit",
    "test_bench_noisy.py::test_noisy_only_contestants_are_refused_elsewhere",
    "test_bench_saturation.py::test_a_bad_ladder_is_refused",
    "test_bench_saturation.py::test_saturation_quick_runs_cortex_and_envoy_alone",
    "test_bench_smg.py::test_mesh_replica_routes_to_where_another_replica_sent_a_prefix",
    "test_bench_smg.py::test_smg_listens_on_loopback_counts_as_router_and_stops_with_its_group",
    "test_bench_smoke.py::test_bench_runs_and_every_contestant_reports",
    "test_bench_smoke.py::test_closed_loop_runs_every_session",
    "test_bench_smoke.py::test_oracle_sends_a_repeated_prompt_where_it_is_cached",
    "test_bench_smoke.py::test_replicas_with_a_restart_and_bypass_traffic",
    "test_cli.py::test_check_loads_every_model_bundle",
    "test_cli.py::test_check_names_field_value_and_reason",
    "test_cli.py::test_check_prints_defaults",
    "test_cli.py::test_demo_runs_routes_and_stops_cleanly",
    "test_cli.py::test_run_refuses_a_broken_bundle_before_starting_anything",
    "test_cli.py::test_supervisor_gives_up_on_a_crash_loop",
    "test_cli.py::test_supervisor_gives_up_when_a_gate_fails",
    "test_cli.py::test_supervisor_restarts_then_stops_everything_on_sigterm",
    "test_cli.py::test_supervisor_starts_in_stages_behind_gates_and_stops_in_reverse",
    "test_dashboard.py::test_a_restart_shows_as_a_new_start_time",
    "test_dashboard.py::test_alert_test_series_are_real",
    "test_dashboard.py::test_every_dashboard_query_parses",
    "test_dashboard.py::test_existing_metrics_exist",
    "test_dashboard.py::test_observer_metrics_exist",
    "test_dashboard.py::test_queried_labels_are_exposed",
    "test_dashboard.py::test_suffixes_match_the_exposed_types",
    "test_event_fields.py::test_the_vectors_are_what_vllm_encodes",
    "test_fallback_chain.py",
    "test_fuzz_gateway.py",
    "test_gateway.py",
    "test_grpc_runtime.py::test_every_cortex_command_sets_it_before_grpc_is_imported",
    "test_grpc_runtime.py::test_the_installed_grpcio_knows_every_experiment_named",
    "test_hit_rule.py::test_the_vectors_are_what_vllm_produces",
    "test_hot_prefix.py",
    "test_hot_reload.py",
    "test_http_transport.py::test_envoy_loads_the_http_transport_and_calls_each_process_and_hears_its_ends",
    "test_inflight.py::test_restart_of_a_real_peer_process",
    "test_k8s_manifests.py",
    "test_logs.py::test_a_real_gateway_writes_only_json_lines_from_every_process",
    "test_logs.py::test_bad_log_values_are_clear_config_errors",
    "test_logs.py::test_configure_in_a_process_json_everywhere_including_warnings_and_crashes",
    "test_logs.py::test_envoy_writes_the_same_json_shape",
    "test_logs.py::test_supervisor_events_go_to_the_cortex_logger",
    "test_logs.py::test_the_simulator_ready_line_in_json_keeps_its_fields",
    "test_media.py::test_the_vectors_are_what_vllm_produces",
    "test_multi_extproc.py",
    "test_observe_lua.py",
    "test_packaging.py::test_envoy_accepts_generated_config",
    "test_publisher_connects_out.py::test_an_engine_that_binds_needs_no_diagnosis",
    "test_publisher_connects_out.py::test_an_engine_that_connects_out_is_diagnosed",
    "test_readiness.py::test_ready_only_once_every_extproc_serves_and_envoy_routes",
    "test_status_page.py::test_page_shows_the_fleet_and_the_decisions",
    "test_status_page.py::test_page_without_the_observer_still_shows_the_fleet",
    "test_timeouts.py::test_envoy_loads_the_worker_clusters",
    "test_upstream_tls.py::test_bad_files_stop_the_process_at_start_with_the_field",
    "test_upstream_tls.py::test_envoy_accepts_the_tls_clusters",
    "test_upstream_tls.py::test_request_arguments",
    "test_upstream_tls.py::test_run_refuses_an_unreadable_certificate_before_starting_anything",
    "test_upstream_tls.py::test_ssl_context_presents_the_client_certificate_and_trusts_the_ca",
    "test_view.py::test_two_processes_never_see_a_partial_batch",
    "test_vllm_hashing_real.py",
)
"""Paths relative to tests/: a whole file (`test_x.py`) or one test and its parametrisations (`test_x.py::test_y`)."""


def _is_e2e(item: pytest.Item) -> bool:
    rel = Path(item.path).resolve().relative_to(HERE).as_posix()
    if rel.endswith("_e2e.py") or rel.startswith("real_engine/") or rel in E2E:
        return True
    name = item.name.split("[", 1)[0]
    return f"{rel}::{name}" in E2E


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _is_e2e(item):
            item.add_marker(pytest.mark.e2e)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under pytest-xdist: a file's tests go to one worker, and so do all the real-engine tier's. (xdist's own
    `--dist loadgroup` cannot be used: with pytest 9 its group suffix no longer reaches the node id.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return REAL_ENGINE_GROUP if path.startswith("tests/real_engine/") else path

    return ByFile(config, log)


_running: list[str] = []  # the unit-tier test now running, for the refusal's message


class _Refused(subprocess.Popen):
    """`subprocess.Popen` while a unit-tier test runs (asyncio's subprocesses and `subprocess.run` go through it):
    still the class for `isinstance` and annotations, but it starts nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._child_created = False  # what Popen.__del__ reads
        raise AssertionError(f"{_running[-1]} starts a process: mark it e2e (tests/conftest.py, E2E)")


def _refused_start(self: multiprocessing.process.BaseProcess) -> None:
    raise AssertionError(f"{_running[-1]} starts a process: mark it e2e (tests/conftest.py, E2E)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    if item.get_closest_marker("e2e") is not None:
        yield
        return
    _running.append(item.nodeid)
    popen, start = subprocess.Popen, multiprocessing.process.BaseProcess.start
    subprocess.Popen = _Refused  # type: ignore[misc]
    multiprocessing.process.BaseProcess.start = _refused_start  # type: ignore[method-assign]
    try:
        yield
    finally:
        subprocess.Popen = popen  # type: ignore[misc]
        multiprocessing.process.BaseProcess.start = start  # type: ignore[method-assign]
        _running.pop()


@pytest.fixture(scope="module", params=["grpc", "http"])
def transport(request: pytest.FixtureRequest) -> Generator[str, None, None]:
    """Both decision transports (extproc.transport) for the suites whose gateway fixture asks for this: the gateway
    is built once per transport and every test of the suite runs on each (tests/harness.py reads the variable)."""
    before = os.environ.get("CORTEX_TEST_TRANSPORT")
    os.environ["CORTEX_TEST_TRANSPORT"] = request.param
    try:
        yield request.param
    finally:
        if before is None:
            os.environ.pop("CORTEX_TEST_TRANSPORT", None)
        else:
            os.environ["CORTEX_TEST_TRANSPORT"] = before
