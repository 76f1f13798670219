"""The one YAML file that configures Cortex, validated at the edge with errors that name field, value and reason.

Import every name from here (`from cortex.config import CortexConfig`); the modules hold one part each:
`base` (the strict base model, `Port`, `ConfigError`), `network` (listeners, timeouts, TLS to workers), `processes`
(ingest, extproc, observe, logs, `cortex epp`), `scheduler` (worker choice, session affinity), `tenancy` (tenants,
auth, admission), `fleet` (models, aliases, workers, Kubernetes discovery), `toplevel` (`CortexConfig`, its
cross-section checks, loading) and `reference` (docs/configuration.md, generated).
"""

from __future__ import annotations

from cortex.config.base import ConfigError, Port
from cortex.config.fleet import (
    UNRESOLVED,
    AliasConfig,
    AliasTarget,
    DiscoveryConfig,
    Engine,
    KubernetesPool,
    MediaConfig,
    ModelConfig,
    PdConfig,
    Role,
    WorkerConfig,
)
from cortex.config.network import AdminListen, Listen, TimeoutsConfig, UpstreamTlsConfig, reachable_host
from cortex.config.processes import (
    BreakerConfig,
    EppConfig,
    ExtprocConfig,
    ExtprocTls,
    IngestConfig,
    LogConfig,
    ObserveConfig,
    PeersConfig,
    StructuredOutputConfig,
)
from cortex.config.reference import reference_markdown
from cortex.config.scheduler import SchedulerConfig, SessionConfig
from cortex.config.tenancy import (
    AdmissionConfig,
    AuthConfig,
    ChargeWeights,
    TenantConfig,
    TenantLimits,
    WaitingRoomConfig,
)
from cortex.config.toplevel import CortexConfig, check_models, dump_config, load_config, parse_config

__all__ = ["UNRESOLVED", "AdminListen", "AdmissionConfig", "AliasConfig", "AliasTarget", "AuthConfig", "BreakerConfig",
           "ChargeWeights", "ConfigError", "CortexConfig", "DiscoveryConfig", "Engine", "EppConfig", "ExtprocConfig",
           "ExtprocTls", "IngestConfig", "KubernetesPool", "Listen", "LogConfig", "MediaConfig", "ModelConfig",
           "ObserveConfig", "PdConfig", "PeersConfig", "Port", "Role", "SchedulerConfig", "SessionConfig",
           "StructuredOutputConfig", "TenantConfig", "TenantLimits", "TimeoutsConfig", "UpstreamTlsConfig",
           "WaitingRoomConfig", "WorkerConfig", "check_models", "dump_config", "load_config", "parse_config",
           "reachable_host", "reference_markdown"]
