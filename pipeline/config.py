"""The one typed configuration object of every stage.

Precedence, highest first: ``--set section.key=value`` / ``--bootstrap`` flags, environment
variables ``PIPELINE_<SECTION>__<KEY>`` (e.g. ``PIPELINE_KAFKA__BOOTSTRAP_SERVERS``), the YAML
file given by ``--config`` or ``$PIPELINE_CONFIG``, then the defaults below. Secrets (SASL
password, proxy API keys) should come from the environment only; ``config show`` masks them.

Loading uses pydantic-settings; a bad value raises :class:`ConfigError` with the offending key.
"""

from __future__ import annotations

import contextvars
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError
from pydantic_settings import BaseSettings, InitSettingsSource, SettingsConfigDict

from pipeline.errors import PipelineError

ROOT = Path(__file__).resolve().parent


class ConfigError(PipelineError, ValueError):
    """A configuration file, variable or flag could not be read or validated."""


class Section(BaseModel):
    """Base of every config section: unknown keys are an error (catches typos)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class KafkaConfig(Section):
    """Kafka client settings shared by every stage (passed to kafka-python)."""

    bootstrap_servers: str = "127.0.0.1:9092"
    client_id: str = "pipeline"
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: str | None = None  # PLAIN, SCRAM-SHA-256, SCRAM-SHA-512, OAUTHBEARER
    sasl_plain_username: str | None = None
    sasl_plain_password: SecretStr | None = None
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_check_hostname: bool = True
    # Tansu (the embedded broker) needs short group timeouts (ENVIRONMENT.md); Apache Kafka's
    # group.min.session.timeout.ms is 6000 by default, so production configs raise these.
    session_timeout_ms: int = Field(2000, gt=0)
    heartbeat_interval_ms: int = Field(300, gt=0)
    max_poll_records: int = Field(500, ge=1)
    max_poll_interval_ms: int = 300_000
    compression_type: Literal["none", "gzip", "lz4", "zstd", "snappy"] = "lz4"
    linger_ms: int = 2
    producer_buffer_bytes: int = 32 * 1024 * 1024
    max_block_ms: int = 2000
    request_timeout_ms: int = 15_000
    max_request_size: int = 64 * 1024 * 1024

    def client_kwargs(self) -> dict[str, Any]:
        """kafka-python keyword arguments common to producers, consumers and admin clients."""
        kw: dict[str, Any] = {
            "bootstrap_servers": self.bootstrap_servers.split(","),
            "client_id": self.client_id,
            "security_protocol": self.security_protocol,
        }
        if self.sasl_mechanism:
            kw["sasl_mechanism"] = self.sasl_mechanism
            kw["sasl_plain_username"] = self.sasl_plain_username
            if self.sasl_plain_password is not None:
                kw["sasl_plain_password"] = self.sasl_plain_password.get_secret_value()
        if self.security_protocol in ("SSL", "SASL_SSL"):
            kw.update(ssl_cafile=self.ssl_cafile, ssl_certfile=self.ssl_certfile,
                      ssl_keyfile=self.ssl_keyfile, ssl_check_hostname=self.ssl_check_hostname)
        return kw


class TopicsConfig(Section):
    """Where topic definitions come from and how logical names map to broker topic names."""

    file: str = str(ROOT / "topics.yaml")
    prefix: str = ""  # prepended to every topic name (namespacing, tests)
    dlq_suffix: str = ".dlq"

    def name(self, logical: str) -> str:
        """Physical topic name of a logical topic (``turns`` -> ``<prefix>turns``)."""
        return f"{self.prefix}{logical}"

    def dlq(self, logical: str) -> str:
        """Dead-letter topic of a logical topic (``turns`` -> ``<prefix>turns.dlq``)."""
        return f"{self.prefix}{logical}{self.dlq_suffix}"


class EngineConfig(Section):
    """The policy inference engine (our CPU server, or SGLang) and how clients reach it."""

    url: str = "http://127.0.0.1:30000"
    host: str = "127.0.0.1"
    port: int = Field(30000, ge=0, le=65535)
    model: str = "smollm2-135m"  # smollm2-135m | tiny-random | <HF folder>
    served_model_name: str | None = None
    cache_dir: str = "~/.cache/openclaw-pipeline"
    context_length: int = Field(2048, ge=16)
    max_batch_size: int = Field(16, ge=1)
    threads: int | None = None
    seed: int = 0
    request_timeout_s: float = 300.0
    teacher_url: str | None = None  # OPD teacher engine; None: same as url
    # added by the engine stage
    weight_version: str = "0"  # initial policy version reported by the engine
    api_key: SecretStr | None = None  # if set, the engine requires "Authorization: Bearer <key>"


class ProxyConfig(Section):
    """The OpenAI-compatible front door."""

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_keys: list[SecretStr] = Field(default_factory=list)
    max_body_bytes: int = 4 * 1024 * 1024
    default_turn_type: Literal["main", "side"] = "main"
    sync_hold_timeout_s: float = 30.0
    # durable event buffer (pipeline/proxy/buffer.py): every answered turn is on disk before its
    # response completes. One folder per proxy (locked); None keeps events in memory only (tests).
    buffer_dir: str | None = "proxy-buffer"
    buffer_max_bytes: int = Field(1 << 30, ge=1 << 20)
    buffer_fsync: bool = False  # fsync each group commit (power-loss safe); default: safe against a crash
    buffer_max_events: int = 10_000  # in memory when the disk buffer refuses events (full, I/O error)
    engine_timeout_s: float = 300.0
    # requests without X-Session-Id: record (one-turn session + session_end), skip (serve only), reject (400)
    anonymous: Literal["record", "skip", "reject"] = "record"
    sync_strict: bool = False  # 503 instead of serving when a weight-sync hold times out
    sync_max_pause_s: float = 600.0  # a pause older than this is ignored (trainer died mid-sync)
    follow_control: bool = True
    publish_delivery_timeout_ms: int = 30_000
    shutdown_flush_s: float = 10.0
    max_sessions: int = 100_000
    session_idle_s: float = 3600.0
    max_connections: int = 512  # keep-alive pool to the engine
    kafka_client: Literal["auto", "librdkafka", "kafka-python"] = "auto"  # auto: librdkafka when installed
    publish_linger_ms: int = 10  # events are gathered this long into one produce window
    # sent (and recorded) when a request has no temperature: set it when the served model's
    # generation_config has a default temperature other than 1.0 (the log-probs depend on it)
    default_temperature: float | None = None
    # the served model's tokenizer and generation_config (name or HF folder; None: engine.model),
    # read only in front of an SGLang engine: raw log-prob bytes, chat defaults on the streamed path
    tokenizer: str | None = None


class JudgeConfig(Section):
    """The judge stage: join, scoring backend, votes, hints."""

    group_id: str = "judge"
    mode: Literal["rl", "opd", "combine"] = "rl"
    backend: str = "embedding"  # llm | choice | embedding | <module:Class>
    url: str | None = None  # judge endpoint for llm/choice; None: engine.url
    model: str = "default"
    votes: int = Field(3, ge=1)
    temperature: float = 0.6
    max_tokens: int = 512
    vote_timeout_s: float = 60.0
    retries: int = 2
    idle_timeout_s: float = 300.0  # idle sessions get a session_end (idle_timeout) record; keep < proxy.session_idle_s
    # several proxies: a record that overtook an earlier one of its session waits this long in event time
    reorder_lateness_s: float = Field(60.0, gt=0)
    max_in_flight: int = Field(256, ge=1)
    teacher_top_k: int = 0
    # added by the judge stage
    api_key: SecretStr | None = None  # bearer token of the judge endpoint (env only)
    retry_backoff_s: float = 0.5  # first back-off of a failed vote; doubles per retry
    hint_min_chars: int = 10  # an OPD hint counts when it is longer than this
    tokenizer: str | None = None  # judge model tokenizer (choice backend); None: engine.model
    embedding_threads: int | None = 1  # torch threads of the embedding backend
    teacher_timeout_s: float = 300.0  # one teacher /generate scoring call
    max_uncommitted_records: int = 200_000  # consumer pauses its partitions above this
    drain_timeout_s: float = 30.0  # at shutdown, wait this long for judge jobs in flight
    # consumer fetch wait: Tansu holds an empty fetch this long (latency), and answers a fetch that
    # reads its durable (s3) storage only within it: at 10 ms a judge after a broker restart read
    # ~1 record/s (bench/chaos.py), at 100 ms all of them
    fetch_max_wait_ms: int = Field(100, ge=1)


class TrainerConfig(Section):
    """The trainer stage: batches, loss, model, checkpoints, weight sync."""

    group_id: str = "trainer"
    model: str = "smollm2-135m"
    rollout_batch_size: int = Field(16, ge=1)
    micro_batch_size: int = Field(4, ge=1)
    steps_per_batch: int = Field(1, ge=1)
    lr: float = Field(1e-6, gt=0)
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    w_rl: float = 1.0
    w_opd: float = 1.0
    normalize_advantages: bool = False
    eps_clip: float = 0.2
    eps_clip_high: float = 0.28
    eps_clip_c: float | None = None
    kl_coef: float = 0.0
    kl_type: Literal["k1", "k2", "k3", "low_var_kl"] = "low_var_kl"
    entropy_coef: float = 0.0
    loss_agg: Literal["sum_of_sample_mean", "token_mean"] = "sum_of_sample_mean"
    tis_cap: float | None = None
    max_staleness: int | None = 4
    stale_policy: Literal["drop", "downweight"] = "drop"
    tp: int = Field(1, ge=1)
    checkpoint_dir: str = "runs/trainer"
    checkpoint_every: int = Field(1, ge=1)
    export_dir: str = "runs/weights"
    engines: list[str] = Field(default_factory=lambda: ["engine-0"])
    sync_timeout_s: float = 300.0
    metrics_file: str | None = None
    run_id: str = "default"
    # added by the trainer stage
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: fp32 on CPU, bf16 on CUDA
    export_dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: the training dtype
    micro_batch_tokens: int = 0  # >0: also cap padded tokens per micro-batch (memory bound)
    count_masked_samples: bool = False  # loss_mask=0 samples count toward rollout_batch_size
    old_log_probs: Literal["rollout", "recompute"] = "rollout"  # behaviour log-probs of the PPO ratio
    tis_floor: float = 0.0  # lower clamp of the truncated IS weight (tis_cap: upper; None = off)
    stale_decay: float = 0.5  # downweight: weight = stale_decay ** (staleness - max_staleness)
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    adam_eps: float = 1e-8
    threads: int | None = None  # torch threads (None: torch default)
    seed: int = 1234
    keep_checkpoints: int = 2
    keep_exports: int = 3  # exported weight folders kept (older ones are deleted after a sync)
    max_steps: int | None = None  # stop after this many trainer steps (batches); None: run forever
    dedup_window: int = 100_000  # remembered sample_ids for de-duplication (kept in checkpoints)
    poll_timeout_s: float = 1.0
    log_sample_ids: bool = True  # write each step's sample_ids to the metrics log
    progress: bool = True  # tqdm progress bar on the console
    # no checkpoint although exports / synced.json / a `latest` pointer show this run trained before:
    # refuse (default), fresh (base model, as a new higher version), newest_export (its weights)
    missing_checkpoint: Literal["refuse", "fresh", "newest_export"] = "refuse"


class SyncerConfig(Section):
    """One syncer per engine replica."""

    group_id: str | None = None  # default: syncer-<engine_id>
    engine_id: str = "engine-0"
    engine_url: str | None = None  # None: engine.url
    retries: int = 3
    retry_backoff_s: float = 2.0
    # added by the syncer
    run_id: str | None = None  # apply weights of this run only; None: trainer.run_id
    apply_timeout_s: float = 300.0  # one /update_weights_from_disk call (waits for in-flight requests)
    check_interval_s: float = Field(5.0, gt=0)  # how often the engine's served version is compared to the published
    ready_port: int | None = Field(None, ge=0, le=65535)  # GET /readyz: 200 once the engine serves the published version


class DashboardConfig(Section):
    """``pipeline dashboard``: the web view of the topics and the stages' metrics."""

    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    show_text: bool = False  # serve conversation text (requests, replies, next states, hints)
    start: Literal["beginning", "now"] = "beginning"  # where its topic reader starts
    metrics_urls: dict[str, str] = Field(default_factory=dict)  # stage -> Prometheus /metrics URL
    scrape_interval_s: float = Field(2.0, gt=0)
    push_interval_s: float = Field(1.0, gt=0)  # live-update period of the browser stream
    max_sessions: int = Field(10_000, ge=1)  # sessions kept for the browser (oldest dropped)
    max_errors: int = Field(50, ge=1)  # latest dead letters kept per DLQ topic


class Config(BaseSettings):
    """The effective configuration of one process (see the module docstring for precedence)."""

    model_config = SettingsConfigDict(env_prefix="PIPELINE_", env_nested_delimiter="__", extra="forbid")

    log_level: str = "INFO"
    metrics_port: int | None = Field(None, ge=0, le=65535)
    kafka: KafkaConfig = Field(default_factory=KafkaConfig)
    topics: TopicsConfig = Field(default_factory=TopicsConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    proxy: ProxyConfig = Field(default_factory=ProxyConfig)
    judge: JudgeConfig = Field(default_factory=JudgeConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    syncer: SyncerConfig = Field(default_factory=SyncerConfig)
    dashboard: DashboardConfig = Field(default_factory=DashboardConfig)

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):  # noqa: D102
        return (init_settings, env_settings,
                InitSettingsSource(settings_cls, init_kwargs=_YAML_DATA.get()))


#: (section, key) pairs that may only come from the environment (or programmatic use)
SECRETS = (("kafka", "sasl_plain_password"), ("proxy", "api_keys"), ("judge", "api_key"), ("engine", "api_key"))

_YAML_DATA: contextvars.ContextVar[dict] = contextvars.ContextVar("_YAML_DATA", default={})


def _deep_merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def parse_overrides(overrides: list[str] | tuple[str, ...]) -> dict:
    """Turn ``["judge.votes=5", "kafka.bootstrap_servers=h:9092"]`` into a nested dict.

    Values are parsed as YAML scalars (``5`` -> int, ``true`` -> bool, ``[a, b]`` -> list).
    Raises :class:`ConfigError` on an item without ``=``.
    """
    data: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not KEY=VALUE (e.g. judge.votes=5)")
        key, raw = item.split("=", 1)
        value = yaml.safe_load(raw) if raw != "" else ""
        node = data
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return data


def load_config(path: str | os.PathLike | None = None, overrides=(), bootstrap: str | None = None,
                **sections: Any) -> Config:
    """Build the effective :class:`Config`.

    Args:
        path: YAML file; ``None`` reads ``$PIPELINE_CONFIG`` if set, else no file.
        overrides: ``section.key=value`` strings (highest precedence).
        bootstrap: shortcut for ``kafka.bootstrap_servers``.
        sections: nested dicts merged like overrides (for programmatic use, e.g. tests).
    Raises:
        ConfigError: unreadable YAML, unknown key, or a value of the wrong type.
    """
    path = path or os.environ.get("PIPELINE_CONFIG")
    yaml_data: dict = {}
    if path:
        try:
            yaml_data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"cannot read config file {path}: {e}") from e
        if not isinstance(yaml_data, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
    flag_data = parse_overrides(list(overrides))
    for source, data in (("the config file", yaml_data), ("a --set flag", flag_data)):
        for section, key in SECRETS:
            if isinstance(data.get(section), dict) and data[section].get(key) not in (None, [], ""):
                raise ConfigError(f"{section}.{key} is a secret: set it in the environment "
                                  f"(PIPELINE_{section.upper()}__{key.upper()}), not in {source}")
    flags = _deep_merge(sections, flag_data)
    if bootstrap:
        flags = _deep_merge(flags, {"kafka": {"bootstrap_servers": bootstrap}})
    token = _YAML_DATA.set(yaml_data)
    try:
        return Config(**flags)
    except ValidationError as e:
        msgs = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise ConfigError(msgs) from None
    finally:
        _YAML_DATA.reset(token)


def redacted(config: Config) -> dict:
    """The config as plain data with every secret replaced by ``'***'``."""
    return config.model_dump(mode="json")  # SecretStr dumps as '**********'
