"""The two gateways Cortex answers, and every place they differ: one value per process, chosen when it starts.

- `EnvoyMode` (`cortex run`): Cortex's own Envoy, configured by Cortex (cortex/envoy_config.py). The pick is the
  x-cortex endpoint list, every candidate in order (Envoy retries down it); a request Cortex could not decide is
  left to Envoy's own balancing; no header a client sends can choose an upstream there, since Envoy's route only
  reads what extproc set.
- `PickerMode` (`cortex epp`): the endpoint picker of a Gateway API Inference Extension gateway Cortex did not
  configure (extproc/epp.py, docs/gie.md): the pick also travels as `envoy.lb` dynamic metadata, with as many
  fallbacks as the gateway can use; a client's own copies of the reserved headers are removed; the gateway's
  subset hint narrows the candidates; an undecided request follows the InferencePool's failure mode; an answer
  whose serving endpoint the gateway does not report claims no hit; the conformance suite's test headers are
  honoured in its test mode.

The stream's framing (buffered or full duplex) is not a mode's: it comes in each stream's first message and the
machine handles both (extproc/stream.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Protocol

from envoy.config.core.v3.base_pb2 import HeaderValueOption
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from cortex.config import CortexConfig
from extproc import epp
from extproc.answers import header

Undecided = Literal["gateway", "refuse", "least_loaded"]
"""What becomes of a request routing failed for: left to the gateway's balancing, refused (503), or sent to the
least loaded worker of the fleet."""


class GatewayMode(Protocol):
    answers_undecided: bool
    """Whether a request with no decision still gets a routing answer (else the gateway's balancing takes it)."""

    def subset(self, req: Any) -> tuple[str, ...] | None:
        """The endpoints the gateway allows for this request (from the stream's first message); None: any."""

    def test_selection(self, cfg: CortexConfig) -> bool:
        """Whether the conformance suite's `test-epp-endpoint-selection` header is followed."""

    def destination(self, addresses: Sequence[str], cfg: CortexConfig) -> str:
        """The endpoint list's value for candidates `addresses`, in order."""

    def removals(self, headers: Sequence[HeaderValueOption]) -> list[str]:
        """Request headers to strip beside those the routing answer sets."""

    def dress(self, response: pb.ProcessingResponse, endpoints: str) -> None:
        """Whatever else the gateway reads the pick from."""

    def undecided(self, cfg: CortexConfig) -> Undecided:
        """What becomes of a request routing failed for."""

    def unconfirmed(self, served: str) -> bool:
        """An answer of several named endpoints whose serving one the gateway did not report: no hit is claimed."""

    def stamp(self, response: pb.ProcessingResponse, served: str, cfg: CortexConfig) -> None:
        """Anything the gateway wants on the answer's headers beside Cortex's claim headers."""


LISTED = 8
"""Endpoints Cortex's own Envoy is given per request. Its override_host policy takes the next listed endpoint at each
attempt (the first, then one retry: cortex/envoy_config.py), skips those no longer in the pool, and falls back to
least_request once the list is spent, so eight leave room for six workers removed since the decision. The whole
pool was listed before: 8 KB of addresses on every request at 512 workers, over the simulated engine's 8,190-byte
header limit (its requests were refused with 400), and without bound as fleets grow (uvicorn's limit is 16 KB,
Envoy's own 60 KB)."""


class EnvoyMode:
    """Cortex's own Envoy (`cortex run`)."""

    answers_undecided = False

    def subset(self, req: Any) -> tuple[str, ...] | None:
        return None

    def test_selection(self, cfg: CortexConfig) -> bool:
        return False

    def destination(self, addresses: Sequence[str], cfg: CortexConfig) -> str:
        return epp.destination(addresses, LISTED - 1)

    def removals(self, headers: Sequence[HeaderValueOption]) -> list[str]:
        return []  # Envoy's route reads only what extproc set

    def dress(self, response: pb.ProcessingResponse, endpoints: str) -> None:
        return None

    def undecided(self, cfg: CortexConfig) -> Undecided:
        return "gateway"

    def unconfirmed(self, served: str) -> bool:
        return False  # its Envoy always reports the endpoint that served (Cortex wrote that config)

    def stamp(self, response: pb.ProcessingResponse, served: str, cfg: CortexConfig) -> None:
        return None


class PickerMode:
    """The endpoint picker of a gateway Cortex did not configure (`cortex epp`)."""

    answers_undecided = True

    def subset(self, req: Any) -> tuple[str, ...] | None:
        return epp.subset_of(req.metadata_context)

    def test_selection(self, cfg: CortexConfig) -> bool:
        return cfg.epp.conformance_test

    def destination(self, addresses: Sequence[str], cfg: CortexConfig) -> str:
        return epp.destination(addresses, cfg.epp.fallback_endpoints)

    def removals(self, headers: Sequence[HeaderValueOption]) -> list[str]:
        # A gateway Cortex did not configure forwards a client's own copies of these.
        return epp.reserved_removals(headers)

    def dress(self, response: pb.ProcessingResponse, endpoints: str) -> None:
        if endpoints:
            response.dynamic_metadata.update({epp.LB_NAMESPACE: {epp.DESTINATION: endpoints}})

    def undecided(self, cfg: CortexConfig) -> Undecided:
        # The InferencePool's failure mode: FailOpen sends it to the least loaded endpoint, FailClose refuses it.
        return "refuse" if cfg.epp.failure_mode == "FailClose" else "least_loaded"

    def unconfirmed(self, served: str) -> bool:
        return not served  # a retry may have gone to a fallback

    def stamp(self, response: pb.ProcessingResponse, served: str, cfg: CortexConfig) -> None:
        if cfg.epp.conformance_test:
            # The conformance suite checks where its request went (its verifier plugin's header).
            response.response_headers.response.header_mutation.set_headers.append(
                header(epp.TEST_SERVED, served or "fail: missing envoy lb metadata"))


def of(picker: bool) -> GatewayMode:
    return PickerMode() if picker else EnvoyMode()
