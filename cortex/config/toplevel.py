"""cortex.yaml as a whole: `CortexConfig` with the checks that span its sections, and reading, checking and writing
the file."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import Field, ValidationError, model_validator

from cortex import engines
from cortex.config.base import ConfigError, Strict
from cortex.config.fleet import AliasConfig, DiscoveryConfig, ModelConfig, PdConfig, WorkerConfig
from cortex.config.network import AdminListen, Listen, TimeoutsConfig, UpstreamTlsConfig
from cortex.config.processes import (
    BreakerConfig,
    EppConfig,
    ExtprocConfig,
    IngestConfig,
    LogConfig,
    ObserveConfig,
    PeersConfig,
    StructuredOutputConfig,
)
from cortex.config.scheduler import SchedulerConfig, SessionConfig
from cortex.config.tenancy import AdmissionConfig, AuthConfig, TenantConfig

if TYPE_CHECKING:  # loaded when first used: reading a config does not need jinja2 or tokenizers
    from cortex.model_bundle import BundleCache, ModelBundle


class CortexConfig(Strict):
    """The whole file. Unknown keys are errors, so a typo never silently falls back to a default."""

    listen: Listen = Listen()
    admin: AdminListen = AdminListen()
    ingest: IngestConfig = IngestConfig()
    extproc: ExtprocConfig = ExtprocConfig()
    observe: ObserveConfig = ObserveConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    timeouts: TimeoutsConfig = TimeoutsConfig()
    log: LogConfig = LogConfig()
    auth: AuthConfig = AuthConfig()
    tenants: list[TenantConfig] = Field(default_factory=list)
    """Who may call and how much (docs/tenancy.md). Empty: one unlimited default tenant, no keys."""
    admission: AdmissionConfig = AdmissionConfig()
    session: SessionConfig = SessionConfig()
    structured_output: StructuredOutputConfig = StructuredOutputConfig()
    breaker: BreakerConfig = BreakerConfig()
    """Per-worker circuit breakers on the answers workers give (docs/reliability.md)."""
    peers: PeersConfig = PeersConfig()
    """The other gateway replicas this one shares its work with (docs/replicas.md)."""
    runtime_dir: str | None = None
    """Where generated Envoy files, the shared ledger view, logs and workers.json live (default
    /tmp/cortex-<listen port>). workers.json keeps fleet changes made through the admin API across restarts;
    `cortex run --reset-workers` forgets them."""
    block_size: int = Field(16, ge=1, le=4096)
    """Cortex's own key block size in tokens; engine blocks are mapped onto it."""
    models: list[ModelConfig] = Field(min_length=1)
    """Served models (at least one)."""
    aliases: list[AliasConfig] = Field(default_factory=list)
    """Public names mapped to weighted models; listed by /v1/models beside the models."""
    workers: list[WorkerConfig] = Field(default_factory=list)
    """Workers known at start."""
    discovery: DiscoveryConfig = DiscoveryConfig()
    epp: EppConfig = EppConfig()
    upstream_tls: UpstreamTlsConfig = UpstreamTlsConfig()

    @model_validator(mode="after")
    def _cross_checks(self) -> CortexConfig:
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"models: duplicate model name in {names}")
        alias_names = [a.name for a in self.aliases]
        clash = sorted(set(alias_names) & set(names) | {a for a in alias_names if alias_names.count(a) > 1})
        if clash:
            raise ValueError(f"aliases: {clash} duplicate an alias or a model name")
        for a in self.aliases:
            for ref in [t.model for t in a.targets] + ([a.fallback] if a.fallback else []):
                if ref not in names:
                    raise ValueError(f"aliases[{a.name}]: {ref!r} is not one of the models {names}")
        # A vLLM adapter is named by `model` itself: each name must lead to one model (SGLang's are qualified).
        adapters = [a for m in self.models if engines.adapter(m.engine).lora_as_model for a in m.loras]
        taken = set(names) | set(alias_names)
        clash = sorted({a for a in adapters if adapters.count(a) > 1 or a in taken})
        if clash:
            raise ValueError(f"models[].loras: vLLM adapter(s) {clash} also name another model, adapter or alias")
        ids = [w.id for w in self.workers]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise ValueError(f"workers: duplicate worker id {dup}")
        by_name = {m.name: m for m in self.models}
        for w in self.workers:
            if w.model not in by_name:
                raise ValueError(f"workers[{w.id}].model: {w.model!r} is not one of the models {names}")
            if by_name[w.model].engine != w.engine:
                raise ValueError(f"workers[{w.id}].engine: {w.engine!r} but model {w.model!r} is served by "
                                 f"{by_name[w.model].engine!r}")
            if w.bootstrap_port is not None and (
                    w.role != "prefill" or not engines.adapter(w.engine).pd_prefill_needs_bootstrap_port):
                raise ValueError(f"workers[{w.id}].bootstrap_port: only an SGLang prefill worker has one")
            if w.dp_size > 1 and w.kv_events is not None and not w.kv_events.startswith("tcp://"):
                raise ValueError(f"workers[{w.id}].kv_events: data-parallel ranks need a tcp:// endpoint "
                                 "(rank r publishes on port + r)")
        for m in self.models:
            if self.block_size % m.engine_page_size():
                raise ValueError(f"models[{m.name}].page_size: {m.engine_page_size()} does not divide block_size "
                                 f"{self.block_size}; Cortex blocks must be whole engine pages (a Cortex hit must "
                                 "never claim part of a page the engine cannot reuse)")
        hold = self.longest_extproc_hold_s()
        if 0 < self.timeouts.request_receive_s <= hold:
            raise ValueError(f"timeouts.request_receive_s: {self.timeouts.request_receive_s} s would cut requests "
                             f"while extproc may still hold them (up to {hold} s: extproc.message_timeout_ms and "
                             "the PD start budgets); raise it or set 0")
        tenant_ids = [t.id for t in self.tenants]
        dup = sorted({i for i in tenant_ids if tenant_ids.count(i) > 1})
        if dup:
            raise ValueError(f"tenants: duplicate tenant id {dup}")
        keys = [k for t in self.tenants for k in t.api_keys]
        if len(set(keys)) != len(keys):
            raise ValueError("tenants: the same API key digest is listed for two tenants (or twice)")
        if self.auth.required and not keys and self.auth.tenant_header is None:
            raise ValueError("auth.required: no tenant has an API key and no auth.tenant_header is set, so every "
                             "request would be refused")
        for i, pool in enumerate(self.discovery.kubernetes):
            if pool.model not in by_name:
                raise ValueError(f"discovery.kubernetes[{i}].model: {pool.model!r} is not one of the models {names}")
            if by_name[pool.model].engine != pool.engine:
                raise ValueError(f"discovery.kubernetes[{i}].engine: {pool.engine!r} but model {pool.model!r} is "
                                 f"served by {by_name[pool.model].engine!r}")
        if self.extproc.transport == "http":
            pd = sorted({w.id for w in self.workers if w.role != "both"})
            if pd or self.structured_output.validate_responses:
                raise ValueError("extproc.transport: http cannot serve " + (
                    f"PD workers ({', '.join(pd)})" if pd else "structured_output.validate_responses") +
                    ": both need the response phase only ext_proc's gRPC stream gives; use transport: grpc")
        targets = sum(w.dp_size for w in self.workers)
        if targets > self.ingest.max_workers:
            raise ValueError(f"workers: {targets} routing targets (workers x dp ranks) but ingest.max_workers is "
                             f"{self.ingest.max_workers}")
        return self

    def longest_extproc_hold_s(self, waiting_room: bool = True) -> int:
        """How long extproc may hold one request message, plus slack (Envoy's max_message_timeout): a PD pair's
        start budget, an SGLang decode's headers waiting for its prefill (the watchdog), or a single-worker
        fallback answering; after the waiting room's time-to-live when it is on (a released request may then
        start a pair, and Envoy takes one deadline extension per message)."""
        longest = max((max(m.pd.start_budget_s(e), m.pd.bootstrap_timeout_s + 5, m.pd.fallback_timeout_s)
                       for m in self.models for e in engines.ENGINE_NAMES), default=0.0)
        room = self.admission.waiting_room
        wait = room.ttl_s if waiting_room and room.enabled else 0.0
        return int(max(longest + 10, self.extproc.message_timeout_ms / 1000 + 1) + wait)

    def bundle_sources(self) -> list[tuple[str, Path, str | None]]:
        """(name, tokenizer path, chat template path) per model: what BundleCache.load_all loads. Raises
        BundleError naming the model whose tokenizer cannot be found."""
        from cortex.model_bundle import BundleError

        sources = []
        for m in self.models:
            try:
                sources.append((m.name, m.tokenizer_dir(), m.chat_template))
            except BundleError as exc:
                raise BundleError(f"model {m.name!r}: tokenizer {m.tokenizer}: {exc}") from None
        return sources

    def fails_closed(self) -> bool:
        """Whether Envoy refuses a request no extproc process answers (extproc.failure_mode; `auto`: when an API
        key or a tenant's limit would otherwise be skipped)."""
        mode = self.extproc.failure_mode
        return mode == "closed" or (mode == "auto" and (self.auth.required or bool(self.tenants)))

    def runtime_path(self) -> Path:
        return Path(self.runtime_dir or f"/tmp/cortex-{self.listen.port}")

    def view_path(self) -> Path:
        """The shared ledger view ingest writes and extproc reads."""
        return self.runtime_path() / "ledger.view"

    def model(self, name: str) -> ModelConfig | None:
        return next((m for m in self.models if m.name == name), None)

    def pd(self, model: str) -> PdConfig:
        """A model's PD settings (the defaults for a name that is not configured)."""
        m = self.model(model)
        return m.pd if m is not None else PdConfig()


def parse_config(data: Any, source: str = "<config>") -> CortexConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping, got {type(data).__name__}")
    try:
        return CortexConfig.model_validate(data)
    except ValidationError as exc:
        lines = [f"{source}: {exc.error_count()} problem(s):"]
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or "(top level)"
            value = err.get("input")
            shown = repr(value) if not isinstance(value, dict | list) else type(value).__name__
            lines.append(f"  - {where}: {err['msg']} (got {shown[:80]})")
        raise ConfigError("\n".join(lines)) from None


def load_config(path: str | os.PathLike[str]) -> CortexConfig:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config {p}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from None
    return parse_config(data, str(p))


def check_models(cfg: CortexConfig, bundles: BundleCache | None = None) -> dict[str, ModelBundle]:
    """Load and exercise every model's bundle (tokenizer files, chat template, page size); raises BundleError
    with one line naming the model and the path. `cortex check` and `cortex run` call it before anything starts,
    the config watcher on each edit, with the process's `bundles` so that only changed files load again."""
    from cortex.model_bundle import BundleCache, verify_bundle

    loaded = (bundles or BundleCache()).load_all(cfg.bundle_sources())
    for m in cfg.models:
        verify_bundle(loaded[m.name], m.engine_page_size(), m.chat_template)
    return loaded


def dump_config(cfg: CortexConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json", exclude_none=True), sort_keys=False)
