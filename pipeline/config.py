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
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, InitSettingsSource, SettingsConfigDict

from pipeline.errors import PipelineError

ROOT = Path(__file__).resolve().parent


class ConfigError(PipelineError, ValueError):
    """A configuration file, variable or flag could not be read or validated."""


class Section(BaseModel):
    """Base of every config section: unknown keys are an error (catches typos), values are
    validated, and a loaded section is frozen (derive a changed copy with :meth:`Config.replace`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def _d(default: Any, description: str, **kw: Any) -> Any:
    """A field with its default, its ``--explain`` text and its range (pydantic ``Field``)."""
    if callable(default):  # a class or function: a factory of the default (mutable defaults)
        return Field(default_factory=default, description=description, **kw)
    return Field(default, description=description, **kw)


class KafkaConfig(Section):
    """Kafka client settings shared by every stage (passed to kafka-python)."""

    bootstrap_servers: str = _d("127.0.0.1:9092", "comma-separated host:port list of Kafka brokers")
    client_id: str = _d("pipeline", "client id prefix the broker sees (logs, quotas)")
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = _d(
        "PLAINTEXT", "transport security to the brokers")
    sasl_mechanism: str | None = _d(None, "SASL mechanism: PLAIN, SCRAM-SHA-256, SCRAM-SHA-512 or OAUTHBEARER")
    sasl_plain_username: str | None = _d(None, "SASL user name")
    sasl_plain_password: SecretStr | None = _d(None, "SASL password (secret: environment only)")
    ssl_cafile: str | None = _d(None, "CA bundle (PEM) that signs the brokers' certificates")
    ssl_certfile: str | None = _d(None, "client certificate (PEM) for mutual TLS")
    ssl_keyfile: str | None = _d(None, "private key (PEM) of ssl_certfile")
    ssl_check_hostname: bool = _d(True, "check that a broker's certificate names its host")
    # The defaults suit the embedded Tansu broker, whose group joins stall with long timeouts
    # (docs/environment.md §6); Apache Kafka refuses session timeouts below 6000 ms by default.
    session_timeout_ms: int = _d(2000, "consumer-group session timeout (ms): a member silent this long is "
                                 "removed and its partitions reassigned; Apache Kafka needs >= 6000",
                                 ge=100, le=3_600_000)
    heartbeat_interval_ms: int = _d(300, "consumer-group heartbeat period (ms); below session_timeout_ms",
                                    ge=10, le=3_600_000)
    max_poll_records: int = _d(500, "records returned by one consumer poll at most", ge=1)
    max_poll_interval_ms: int = _d(300_000, "longest gap (ms) between two polls before a consumer leaves its "
                                   "group", ge=1000)
    compression_type: Literal["none", "gzip", "lz4", "zstd", "snappy"] = _d(
        "lz4", "compression of produced record batches")
    linger_ms: int = _d(2, "how long (ms) a producer gathers records into one batch", ge=0, le=60_000)
    max_block_ms: int = _d(2000, "how long (ms) a send may block waiting for metadata or buffer space",
                           ge=0)
    request_timeout_ms: int = _d(30_000, "time-out (ms) of one request to a broker (kafka-python's and Kafka's "
                                 "default); past it the connection is reopened and the request sent again; "
                                 "kafka-python needs it below 540000", ge=1000, lt=540_000)
    max_request_size: int = _d(64 * 1024 * 1024, "largest produce request and fetch (bytes): bounds the size of "
                               "one record", ge=1024)

    @model_validator(mode="after")
    def _check(self) -> "KafkaConfig":
        if self.heartbeat_interval_ms >= self.session_timeout_ms:
            raise ValueError(f"heartbeat_interval_ms ({self.heartbeat_interval_ms}) must be below "
                             f"session_timeout_ms ({self.session_timeout_ms}): a member would be dropped "
                             "from its group between two heartbeats")
        if self.security_protocol.startswith("SASL") and not self.sasl_mechanism:
            raise ValueError(f"security_protocol {self.security_protocol} needs sasl_mechanism")
        return self

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

    file: str = _d(str(ROOT / "topics.yaml"), "YAML file declaring every topic (partitions, retention, schema)")
    prefix: str = _d("", "prepended to every topic name (namespacing, tests)")
    dlq_suffix: str = _d(".dlq", "appended to a topic's name to form its dead-letter topic", min_length=1)
    create_missing: bool = _d(True, "a stage creates the topics it uses that are missing, as topics.yaml declares "
                              "them; false: it refuses to start and names the `pipeline topics apply` command")

    def name(self, logical: str) -> str:
        """Physical topic name of a logical topic (``turns`` -> ``<prefix>turns``)."""
        return f"{self.prefix}{logical}"

    def dlq(self, logical: str) -> str:
        """Dead-letter topic of a logical topic (``turns`` -> ``<prefix>turns.dlq``)."""
        return f"{self.prefix}{logical}{self.dlq_suffix}"


#: the Hugging Face projections a LoRA adapter can target (Llama-family names, as PEFT spells them)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class EngineConfig(Section):
    """The policy inference engine (our CPU server, or SGLang) and how clients reach it."""

    url: str = _d("http://127.0.0.1:30000", "base URL of the policy engine (SGLang or `pipeline engine`)")
    kind: Literal["native", "sglang", "vllm"] = _d(
        "native", "server family of the policy engine: native (`pipeline engine`), sglang or vllm "
        "(docs/vllm.md); `pipeline engine` with vllm starts vLLM's own server")
    teacher_kind: Literal["native", "sglang", "vllm"] | None = _d(None, "server family of the OPD teacher "
                                                                    "(None: engine.kind)")
    host: str = _d("127.0.0.1", "`pipeline engine`: listen address")
    port: int = _d(30000, "`pipeline engine`: listen port (0: any free port)", ge=0, le=65535)
    model: str = _d("smollm2-135m", "`pipeline engine`: smollm2-135m, tiny-random or a HF folder")
    served_model_name: str | None = _d(None, "model name reported by /v1/models (None: the model's)")
    cache_dir: str = _d("~/.cache/openclaw-pipeline", "where converted model folders and the CPU "
                                 "judge's fine-tuned weights (judge/) are kept")
    context_length: int | None = _d(None, "longest prompt plus reply (tokens); None: the model's own maximum "
                                    "(max_position_embeddings of its config, 8192 for SmolLM2-135M)", ge=16)
    max_batch_size: int = _d(16, "requests decoded together at most", ge=1)
    prefix_cache_bytes: int = _d(1 << 30, "`pipeline engine`: bytes of prompt KV kept for reuse by later prompts "
                                 "with the same prefix (0: no prefix cache)", ge=0)
    prefix_cache_entries: int = _d(64, "`pipeline engine`: prompts kept in the prefix cache at most (LRU)", ge=0)
    prefix_cache_min_tokens: int = _d(16, "`pipeline engine`: shortest prompt stored / prefix reused", ge=1)
    threads: int | None = _d(None, "torch threads of the CPU engine (None: torch's default)", ge=1)
    enable_lora: bool = _d(False, "`pipeline engine`: serve LoRA adapters (SGLang's --enable-lora; docs/tenants.md)")
    max_lora_rank: int = _d(64, "`pipeline engine`: largest LoRA rank an adapter may have", ge=1)
    lora_target_modules: list[Literal[LORA_TARGETS]] = _d(  # type: ignore[valid-type]
        lambda: list(LORA_TARGETS), "`pipeline engine`: projections LoRA adapters may target")
    max_loras_per_batch: int = _d(8, "`pipeline engine`: distinct adapters decoded together, the base model "
                                  "counting as one", ge=1)
    lora_paths: dict[str, str] = _d(dict, "`pipeline engine`: adapters loaded at start, name -> folder "
                                    "(turns LoRA on)")
    seed: int = _d(0, "sampling seed of requests that give none")
    request_timeout_s: float = _d(300.0, "time-out (s) of one engine call made by our clients", gt=0)
    teacher_url: str | None = _d(None, "OPD teacher engine, a frozen model (None: refused unless "
                                 "judge.live_policy_teacher)")
    weight_version: str = _d("0", "policy version the engine reports before its first weight update")
    api_key: SecretStr | None = _d(None, "if set, the engine requires `Authorization: Bearer <key>` "
                                   "(secret: environment only)")


class ProxyConfig(Section):
    """The OpenAI-compatible front door."""

    host: str = _d("127.0.0.1", "listen address")
    port: int = _d(8000, "listen port (0: any free port)", ge=0, le=65535)
    api_keys: list[SecretStr] = _d(list, "accepted bearer keys; empty: no authentication (secret: environment only)")
    max_body_bytes: int = _d(4 * 1024 * 1024, "largest request body (bytes); larger ones get 413", ge=1024)
    default_turn_type: Literal["main", "side"] = _d("main", "turn type of a request without X-Turn-Type")
    sync_hold_timeout_s: float = _d(30.0, "during a weight sync new requests wait at most this long (s)", ge=0)
    buffer_dir: str | None = _d("proxy-buffer", "durable event buffer: every answered turn is on disk here "
                                "before its response completes (one folder per proxy, locked); None: "
                                "memory only (tests)")
    buffer_max_bytes: int = _d(1 << 30, "size bound of the disk buffer (bytes)", ge=1 << 20)
    buffer_fsync: bool = _d(False, "fsync each group commit (survives power loss; default: survives a crash)")
    buffer_max_events: int = _d(10_000, "events kept in memory while the disk buffer refuses them (full, "
                                "I/O error)", ge=1)
    engine_timeout_s: float = _d(300.0, "time-out (s) of one forwarded engine call", gt=0)
    anonymous: Literal["record", "skip", "reject"] = _d(
        "record", "requests no header, body field, agent marker or user field names a session of: record (session by "
        "continuation, docs/sessions.md), skip (serve only) or reject (400)")
    sync_strict: bool = _d(False, "answer 503 instead of serving when a weight-sync hold times out")
    sync_max_pause_s: float = _d(600.0, "a pause older than this (s) is ignored (the trainer died mid-sync)",
                                 gt=0)
    follow_control: bool = _d(True, "read `control` to hold requests during weight syncs")
    publish_delivery_timeout_ms: int = _d(30_000, "time-out (ms) of one event's delivery to Kafka", ge=1000)
    shutdown_flush_s: float = _d(10.0, "at shutdown, wait this long (s) for events to reach Kafka", ge=0)
    max_sessions: int = _d(100_000, "sessions whose state is kept (least recently used dropped first)", ge=1)
    session_idle_s: float = _d(14_400.0, "a session idle this long (s) is forgotten by the proxy; keep it at or "
                               "above judge.idle_timeout_s", gt=0)
    max_connections: int = _d(512, "keep-alive connection pool to the engine", ge=1)
    canary_engine_url: str | None = _d(None, "where a full-weight candidate's canary sessions go (the engines of "
                                       "rollout.canary_engines, or a router over them); engine.url: the others "
                                       "(docs/rollout.md, 'Full-weight canaries over several engines')")
    session_prefixes: int = _d(200_000, "completed turns remembered for conversation continuation (one digest "
                               "each, least recently used dropped first; docs/sessions.md)", ge=1)
    kafka_client: Literal["auto", "librdkafka", "kafka-python"] = _d(
        "auto", "Kafka client of the event publisher (auto: librdkafka when installed)")
    publish_linger_ms: int = _d(10, "events are gathered this long (ms) into one produce window", ge=0)
    default_temperature: float | None = _d(
        None, "sent (and recorded) when a request gives no temperature: set it when the served model's "
        "generation_config has a default other than 1.0 (the log-probs depend on it)", ge=0)
    tokenizer: str | None = _d(None, "the served model's tokenizer and generation_config (name or HF folder; "
                               "None: engine.model), read only in front of an SGLang engine")
    model_aliases: dict[str, str] = _d(dict, "other model names clients may send, each mapped to a served model "
                                       "id (e.g. {gpt-4o-mini: smollm2-135m}); turns record the served id")
    unknown_model: Literal["reject", "serve"] = _d(
        "serve", "a model name that is neither served nor an alias: serve it with the served model (answered "
        "and recorded as the served id, never the name sent) or reject it (404 model_not_found)")
    responses_store_bytes: int = _d(64 << 20, "/v1/responses: memory (bytes) of the conversations kept for "
                                    "previous_response_id (least recently used dropped first; 0: none kept)", ge=0)
    feedback_index_max: int = _d(200_000, "POST /v1/feedback: recorded main turns this proxy can resolve by "
                                 "response id or session + turn index (least recent dropped first; kept in "
                                 "buffer_dir/turn-index.jsonl across restarts)", ge=1)
    tenants: dict[str, str] = _d(dict, "API key -> tenant: {sha256 hex of the key: tenant id} (keys are never "
                                 "stored in clear); set: every request needs a mapped key (or one of api_keys: "
                                 "no tenant) and an X-Tenant-Id that disagrees is refused (403); empty: the "
                                 "X-Tenant-Id header names the tenant (docs/tenants.md)")

    @field_validator("tenants")
    @classmethod
    def _tenant_map(cls, v: dict[str, str]) -> dict[str, str]:
        from pipeline.events import tenant_error  # the one statement of the tenant domain

        for digest, tenant in v.items():
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise ValueError(f"proxy.tenants keys are the sha256 of an API key (64 lower-case hex digits), got "
                                 f"{digest[:12]!r}... (run: python -c \"import hashlib,sys;print(hashlib.sha256("
                                 f"sys.argv[1].encode()).hexdigest())\" KEY)")
            why = tenant_error(tenant)
            if why is not None:
                raise ValueError(f"proxy.tenants: tenant {tenant[:40]!r} {why}")
        return v


class JudgeConfig(Section):
    """The judge stage: join, scoring backend, votes, hints."""

    group_id: str = _d("judge", "consumer group of the judges (replicas share it)")
    mode: Literal["rl", "opd", "combine"] = _d("rl", "training signal: rl (votes -> reward), opd (hint -> "
                                               "teacher log-probs) or combine (both)")
    backend: str = _d("embedding", "llm, choice, embedding, constant, or your class as module:Class")
    url: str | None = _d(None, "judge endpoint of the llm/choice backends (None: engine.url)")
    model: str = _d("default", "model name sent to the judge endpoint (default: the first model its "
                    "/v1/models lists)")
    votes: int = _d(3, "PRM votes per turn (majority decides)", ge=1, le=64)
    temperature: float = _d(0.6, "sampling temperature of the votes", ge=0, le=10)
    max_tokens: int = _d(512, "longest vote or hint reply (tokens)", ge=1)
    vote_timeout_s: float = _d(60.0, "time-out (s) of one vote call", gt=0)
    retries: int = _d(2, "retries of a vote call that failed transiently (connection, time-out, 429/5xx)", ge=0)
    idle_timeout_s: float = _d(14_400.0, "the idle horizon: a session whose latest record is this far (event "
                               "time, s) behind its partition's newest record gets a session_end (idle_timeout); "
                               "hours, as people reply late (0: never)", ge=0)
    reorder_lateness_s: float = _d(60.0, "several proxies: a record that overtook an earlier one of its session "
                                   "waits this long (event time, s)", gt=0)
    max_in_flight: int = _d(256, "turns being judged at once", ge=1)
    teacher_top_k: int = _d(0, "OPD: also record the teacher's top-k log-probs per token (0: off)", ge=0, le=1024)
    api_key: SecretStr | None = _d(None, "bearer key of the judge endpoint (secret: environment only)")
    retry_backoff_s: float = _d(0.5, "first back-off (s) of a failed vote; doubles per retry, plus jitter", ge=0)
    hint_min_chars: int = _d(10, "an OPD hint counts when it is longer than this (characters)", ge=0)
    tokenizer: str | None = _d(None, "judge model tokenizer (choice backend; None: engine.model)")
    embedding_threads: int | None = _d(1, "torch threads of the embedding backend (None: torch's default)", ge=1)
    embedding_finetune_epochs: float = _d(2.0, "embedding backend: epochs of fine-tuning MiniLM on the labelled "
                                          "replies at first start (cached; 0: frozen MiniLM)", ge=0, le=20)
    teacher_timeout_s: float = _d(300.0, "time-out (s) of one teacher scoring call", gt=0)
    teacher_self_check: bool = _d(True, "OPD: at start, refuse a teacher whose log-probs do not follow the "
                                  "requested temperature (SGLang needs SGLANG_TEMP_SCALED_LOGPROBS=1)")
    live_policy_teacher: bool = _d(False, "OPD without engine.teacher_url: score with the live policy "
                                   "(engine.url), each turn only by the version that generated it (else no "
                                   "OPD term); off: engine.teacher_url is required")
    max_uncommitted_records: int = _d(200_000, "the consumer pauses its partitions above this many records "
                                      "read but not committed", ge=1)
    drain_timeout_s: float = _d(30.0, "at shutdown, wait this long (s) for judge jobs in flight", ge=0)
    reward_rule: Literal["precedence", "weighted"] = _d(
        "precedence", "how a turn's reward sources (judge votes, explicit feedback, session outcome) combine: "
        "precedence (the first present in reward_order) or weighted (weighted mean of the present ones; "
        "docs/feedback.md)")
    reward_order: list[Literal["judge", "feedback", "outcome"]] = _d(
        lambda: ["feedback", "outcome", "judge"], "precedence rule: the sources in order (the first present decides)")
    reward_weights: dict[Literal["judge", "feedback", "outcome"], float] = _d(
        dict, "weighted rule: weight of each source (default 1; 0: never counts)")
    feedback_grace_s: float = _d(0.0, "a judged turn is decided only once its partition's event time is this far "
                                 "(s) past its next state, so feedback sent meanwhile is used (0: decided at the "
                                 "next state; later feedback is counted as late)", ge=0)
    outcome_hold: bool = _d(False, "every turn of a session waits for its end, so the session outcome is credited "
                            "to all of them (off: to the turns still undecided at the end)")
    outcome_discount: float = _d(1.0, "the outcome's credit to the turn k turns before the last is "
                                 "outcome * outcome_discount**k", ge=0, le=1)
    # Tansu answers a fetch that reads its durable storage only within this wait: at 10 ms a judge
    # after a broker restart read about one record per second (docs/environment.md §6).
    fetch_max_wait_ms: int = _d(100, "how long (ms) the broker may hold an empty fetch; below "
                                "kafka.request_timeout_ms", ge=1)


class LoraConfig(Section):
    """``trainer.lora``: one LoRA adapter per tenant over a frozen, shared base (absent: full
    fine-tuning). Defaults are those of OpenClaw-RL's LoRA scripts (rank 16, alpha 32, every
    attention and MLP projection); the update of a target is ``(alpha / rank) * B @ A``."""

    rank: int = _d(16, "LoRA rank r of every adapter", ge=1, le=4096)
    alpha: int = _d(32, "LoRA alpha: the adapter's update is scaled by alpha / rank", ge=1)
    targets: list[Literal[LORA_TARGETS]] = _d(lambda: list(LORA_TARGETS),  # type: ignore[valid-type]
                                              "projections that get an adapter (PEFT target_modules)")

    @field_validator("targets")
    @classmethod
    def _targets(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("trainer.lora.targets is empty: an adapter needs at least one projection")
        if len(set(v)) != len(v):
            raise ValueError(f"trainer.lora.targets names a projection twice: {v}")
        return v


class TrainerConfig(Section):
    """The trainer stage: batches, loss, model, checkpoints, weight sync."""

    group_id: str = _d("trainer", "consumer group of the trainer")
    model: str = _d("smollm2-135m", "policy to train: smollm2-135m, tiny-random or a HF folder")
    rollout_batch_size: int = _d(16, "samples per trainer batch (one policy version)", ge=1)
    micro_batch_size: int = _d(4, "samples per forward/backward pass (memory bound)", ge=1)
    steps_per_batch: int = _d(1, "optimizer steps over each batch", ge=1)
    lr: float = _d(1e-6, "learning rate", gt=0, le=1)
    weight_decay: float = _d(0.0, "AdamW weight decay (never on norms and biases)", ge=0)
    clip_grad: float = _d(1.0, "global gradient-norm clip (0: off)", ge=0)
    w_rl: float = _d(1.0, "weight of the RL (GRPO) advantage in the combined advantage", ge=0)
    w_opd: float = _d(1.0, "weight of the OPD advantage (teacher - rollout log-prob)", ge=0)
    normalize_advantages: bool = _d(False, "subtract the batch mean reward (over samples with a reward)")
    eps_clip: float = _d(0.2, "PPO clip range below 1", gt=0, lt=1)
    eps_clip_high: float = _d(0.28, "PPO clip range above 1 (asymmetric clip)", gt=0)
    eps_clip_c: float | None = _d(None, "dual-clip constant c > 1 for negative advantages (None: off)", gt=1)
    kl_coef: float = _d(0.0, "weight of the KL penalty to the reference policy", ge=0)
    kl_type: Literal["k1", "k2", "k3", "low_var_kl"] = _d("low_var_kl", "KL estimator")
    entropy_coef: float = _d(0.0, "weight of the entropy bonus", ge=0)
    loss_agg: Literal["sum_of_sample_mean", "token_mean"] = _d(
        "sum_of_sample_mean", "loss aggregation: mean per sample then sum, or mean over all tokens")
    tis_cap: float | None = _d(None, "truncated importance sampling: cap of the per-token weight exp(trainer's "
                               "recomputed - engine's rollout log-prob) on the policy loss; needs old_log_probs=recompute "
                               "(None: off)", gt=0)
    max_staleness: int | None = _d(4, "samples older than this many policy versions are stale (None: never)",
                                   ge=0)
    stale_policy: Literal["drop", "downweight"] = _d("drop", "what happens to a stale sample")
    tp: int = _d(1, "tensor-parallel size (torchrun ranks per model replica)", ge=1)
    checkpoint_dir: str = _d("runs/trainer", "checkpoints (weights, optimizer, consumed offsets)")
    checkpoint_every: int = _d(1, "checkpoint every this many batches", ge=1)
    export_dir: str = _d("runs/weights", "exported HF weight folders the engines load")
    engines: list[str] = _d(lambda: ["engine-0"], "engine ids whose `applied` a weight sync waits for "
                            "(empty: publish without waiting)")
    sync_timeout_s: float = _d(300.0, "a weight sync waits this long (s) for the engines, then resumes", gt=0)
    metrics_file: str | None = _d(None, "JSONL file of per-step metrics (None: none)")
    run_id: str = _d("default", "run name: syncers apply weights of their run only")
    dtype: Literal["auto", "float32", "bfloat16"] = _d("auto", "training dtype (auto: fp32 on CPU, bf16 on CUDA)")
    export_dtype: Literal["auto", "float32", "bfloat16"] = _d("auto", "dtype of exported weights (auto: the "
                                                              "training dtype)")
    micro_batch_tokens: int = _d(0, "also cap padded tokens per micro-batch (0: no cap)", ge=0)
    recompute_attention: bool = _d(False, "recompute each layer's attention scores in the backward pass instead "
                                   "of keeping them (Megatron's selective recompute of core attention): the "
                                   "same gradients, far less memory for long prompts (a 3,000-token SmolLM2 "
                                   "sample on the CPU: ~10 GiB peak instead of over 15), a little more compute")
    count_masked_samples: bool = _d(False, "loss_mask=0 samples count toward rollout_batch_size and the "
                                    "loss denominator (slime: divided by the global batch size)")
    old_log_probs: Literal["rollout", "recompute"] = _d(
        "rollout", "behaviour log-probs of the PPO ratio: the engine's, or recomputed by the trainer")
    tis_floor: float = _d(0.0, "lower clamp of the truncated IS weight (below tis_cap)", ge=0)
    stale_decay: float = _d(0.5, "downweight: weight = stale_decay ** (staleness - max_staleness)", gt=0, le=1)
    adam_beta1: float = _d(0.9, "Adam beta1", ge=0, lt=1)
    adam_beta2: float = _d(0.98, "Adam beta2", ge=0, lt=1)
    adam_eps: float = _d(1e-8, "Adam epsilon", gt=0)
    threads: int | None = _d(None, "torch threads (None: torch's default)", ge=1)
    seed: int = _d(1234, "seed of initialisation and dropout")
    keep_checkpoints: int = _d(2, "checkpoints kept (older ones deleted)", ge=1)
    keep_exports: int = _d(3, "exported weight folders kept (older ones deleted after a sync; with lora: per "
                           "tenant, never the one its last resume names)", ge=1)
    max_steps: int | None = _d(None, "stop after this many batches (0: set up, publish, stop; None: run forever)",
                               ge=0)
    dedup_window: int = _d(100_000, "sample_ids remembered for de-duplication (kept in checkpoints)", ge=1)
    per_tenant: bool = _d(False, "one batch buffer per tenant: a batch never mixes tenants; it trains the one "
                          "shared policy, or with trainer.lora the tenant's adapter (off: one shared batch; "
                          "docs/tenants.md)")
    tenant_max_wait_records: int = _d(1000, "per_tenant: a tenant's partial batch is released once its oldest "
                                      "sample has waited this many records read from `samples` (never "
                                      "wall-clock)", ge=1)
    poll_timeout_s: float = _d(1.0, "one poll of `samples` waits at most this long (s)", gt=0)
    log_sample_ids: bool = _d(True, "write each step's sample_ids to the metrics log")
    progress: bool = _d(True, "progress bar on the console")
    lora: LoraConfig | None = _d(None, "LoRA adapters per tenant over the frozen base (rank, alpha, targets), each "
                                 "update synced as the tenant's adapter; needs per_tenant (the stage refuses "
                                 "without it); None: full fine-tuning")
    poison_steps: list[int] = _d(list, "test device (pipeline demo --rollout): the updates with these numbers (with "
                                 "lora: the tenant's update count n it publishes; else the policy version it "
                                 "produces) are trained with every sample's reward negated, logged as a WARNING "
                                 "and marked poisoned in the step record; empty: none (never set it in production)")
    missing_checkpoint: Literal["refuse", "fresh", "newest_export"] = _d(
        "refuse", "no checkpoint although exports show this run trained before: refuse, start fresh (base "
        "model, as a new higher version) or start from the newest export")

    @model_validator(mode="after")
    def _check(self) -> "TrainerConfig":
        if self.w_rl == 0 and self.w_opd == 0:
            raise ValueError("w_rl and w_opd are both 0: every advantage would be 0 and nothing would be learned")
        if self.tis_cap is not None and self.old_log_probs != "recompute":
            # with the engine's log-probs as the PPO behaviour policy the ratio is already trainer vs
            # engine; a TIS weight exp(recomputed - rollout) on top would correct the mismatch twice
            raise ValueError("tis_cap needs old_log_probs=recompute (decoupled PPO: ratio against the trainer's "
                             "recomputed log-probs, TIS weight exp(recomputed - rollout)); with old_log_probs="
                             "rollout the PPO ratio already corrects for the engine mismatch")
        if self.tis_cap is not None and self.tis_floor >= self.tis_cap:
            raise ValueError(f"tis_floor ({self.tis_floor}) must be below tis_cap ({self.tis_cap})")
        if self.stale_policy == "downweight" and self.max_staleness is None:
            raise ValueError("stale_policy=downweight needs max_staleness (with None no sample is ever stale)")
        return self


class SyncerConfig(Section):
    """One syncer per engine replica."""

    group_id: str | None = _d(None, "consumer group (None: syncer-<engine_id>)")
    engine_id: str = _d("engine-0", "this replica's id in applied/failed reports (one of trainer.engines)")
    engine_url: str | None = _d(None, "the engine it updates (None: engine.url)")
    retries: int = _d(3, "retries of an apply that failed transiently (connection, time-out, 5xx)", ge=0)
    retry_backoff_s: float = _d(2.0, "first back-off (s) between tries; doubles per retry, plus jitter", ge=0)
    run_id: str | None = _d(None, "apply weights of this run only (None: trainer.run_id)")
    apply_timeout_s: float = _d(300.0, "time-out (s) of one /update_weights_from_disk call (it waits for "
                                "requests in flight)", gt=0)
    check_interval_s: float = _d(5.0, "how often (s) the engine's served version is compared with the "
                                 "published one", gt=0)
    ready_port: int | None = _d(None, "serve GET /readyz here: 200 once the engine serves the published "
                                "version (None: off)", ge=0, le=65535)


class RolloutSection(Section):
    """Canary rollout of new versions, promotion and rollback decided from the records
    (docs/rollout.md). Off by default: every new version serves everyone, as before. With full
    weights (no ``trainer.lora``) and no ``canary_engines`` the eval set alone gates each version
    on the one engine, so :class:`Config` refuses ``enabled`` without ``eval_set`` (the evaluator
    refuses guards the eval set can never decide: :func:`pipeline.rollout.evalset.check_guards`)."""

    enabled: bool = _d(False, "serve a new version first to a canary share of sessions; the evaluator stage "
                       "promotes or rolls it back from the records (docs/rollout.md)")
    share: float = _d(0.1, "the canary's share of new sessions (sticky per session)", gt=0, lt=1)
    min_n: int = _d(400, "judged turns in each arm before a promotion", ge=1)
    rollback_min_n: int = _d(50, "judged turns in each arm before a rollback on live reward", ge=1)
    max_n: int = _d(2000, "judged turns in each arm after which an undecided canary is rolled back", ge=1)
    margin: float = _d(0.05, "non-inferiority margin of the live judged reward rate", ge=0, lt=1)
    guard_margin: float = _d(0.10, "non-inferiority margin of each guard metric", ge=0, lt=1)
    guard_min_n: int = _d(100, "eval-set items per arm before a guard counts", ge=1)
    z: float = _d(1.645, "z of the one-sided bounds (1.645: 95%)", gt=0)
    rollback_z: float = _d(2.326, "z of the live-reward rollback bound (2.326: 99%)", gt=0)
    guards: list[str] = _d(list, "eval-set metrics that must not fall (empty: the eval set's own guards; full "
                           "weights gated by the eval set: at least one, each checked by guard_min_n items, "
                           "refused by the evaluator otherwise)")
    eval_set: str | None = _d(None, "the eval set (JSONL, docs/rollout.md) the evaluator runs on every new "
                              "version (None: live reward only; full weights, no trainer.lora and no "
                              "canary_engines: required)")
    eval_max_tokens: int = _d(128, "max_tokens of each eval-set reply", ge=1)
    eval_seed: int = _d(1234, "sampling seed of the eval-set replies (the same for every version)", ge=0)
    canary_engines: list[str] = _d(list, "engine ids (a strict subset of trainer.engines) that take a full-weight "
                                   "candidate first, served to the canary share at proxy.canary_engine_url "
                                   "(empty: one full-weight engine, gated by the eval set alone)")

    @model_validator(mode="after")
    def _order(self) -> "RolloutSection":
        if not self.rollback_min_n <= self.min_n <= self.max_n:
            raise ValueError("rollout needs rollback_min_n <= min_n <= max_n")
        return self

    @property
    def full_weights_gate(self) -> str:
        """How the full weights' canary is decided (:data:`pipeline.rollout.fold.FULL_WEIGHTS_GATES`):
        ``"live"`` (live arms, then eval guards) with :attr:`canary_engines`, else ``"evalset"``."""
        return "live" if self.canary_engines else "evalset"

    def rule(self, guards: tuple = ()):
        """The :class:`pipeline.rollout.rule.RolloutConfig` of these values; ``guards``: the eval
        set's declared guards, used when ``guards`` is empty here."""
        from pipeline.rollout.rule import RolloutConfig

        return RolloutConfig(enabled=self.enabled, share=self.share, min_n=self.min_n,
                             rollback_min_n=self.rollback_min_n, max_n=self.max_n, margin=self.margin,
                             guard_margin=self.guard_margin, guard_min_n=self.guard_min_n, z=self.z,
                             rollback_z=self.rollback_z, guards=tuple(self.guards) or tuple(guards))


class DashboardConfig(Section):
    """``pipeline dashboard``: the web view of the topics and the stages' metrics."""

    host: str = _d("127.0.0.1", "listen address")
    port: int = _d(8080, "listen port (0: any free port)", ge=0, le=65535)
    show_text: bool = _d(False, "serve conversation text (requests, replies, next states, hints)")
    start: Literal["beginning", "now"] = _d("beginning", "where its topic reader starts")
    metrics_urls: dict[str, str] = _d(dict, "stage name -> Prometheus /metrics URL to scrape")
    scrape_interval_s: float = _d(2.0, "scrape period (s) of the stages' metrics", gt=0)
    push_interval_s: float = _d(1.0, "live-update period (s) of the browser stream", gt=0)
    max_sessions: int = _d(10_000, "sessions kept for the browser (oldest dropped)", ge=1)
    max_errors: int = _d(50, "latest dead letters kept per DLQ topic", ge=1)
    review: bool = _d(False, "let a reviewer thumb a turn up or down (with a correction) on the session page: "
                      "posted to the proxy's POST /v1/feedback with the reviewer's key (off: read-only)")
    proxy_url: str | None = _d(None, "the proxy reviews are posted to (None: http://<proxy.host>:<proxy.port>)")


def _check_canary_engines(c: "Config") -> None:
    """Refuse an inconsistent full-weight canary over several engines (``rollout.canary_engines``,
    ``proxy.canary_engine_url``; docs/rollout.md). Raises ValueError naming the setting."""
    canary, engines, url = list(c.rollout.canary_engines), list(c.trainer.engines), c.proxy.canary_engine_url
    if (canary or url is not None) and not c.rollout.enabled:
        raise ValueError(f"rollout.canary_engines ({canary}) / proxy.canary_engine_url ({url!r}) do nothing with "
                         "rollout.enabled false: set rollout.enabled=true, or unset them")
    if not canary:
        if url is not None:
            raise ValueError(f"proxy.canary_engine_url ({url!r}) is set but rollout.canary_engines is empty: name the "
                             "engines (of trainer.engines) behind it, or unset the URL")
        return
    if c.trainer.lora is not None:
        raise ValueError("rollout.canary_engines canaries the full weights over several engines; with trainer.lora "
                         "the tenants' adapters are canaried on every engine: leave rollout.canary_engines empty")
    if c.engine.kind == "vllm":
        raise ValueError("rollout.canary_engines with engine.kind vllm is not built: the proxy reads vLLM's weight "
                         "version from engine.url only")
    if len(set(canary)) != len(canary):
        raise ValueError(f"rollout.canary_engines lists an engine twice: {canary}")
    unknown = [e for e in canary if e not in engines]
    if unknown:
        raise ValueError(f"rollout.canary_engines {unknown} are not in trainer.engines {engines}")
    if len(canary) >= len(set(engines)):
        raise ValueError(f"rollout.canary_engines {canary} names every engine of trainer.engines {engines}: at "
                         "least one engine must keep serving the incumbent")
    if not url:
        raise ValueError(f"rollout.canary_engines {canary} needs proxy.canary_engine_url: where the proxy sends "
                         "the candidate's sessions (engine.url keeps the incumbent's)")
    if url.rstrip("/") == c.engine.url.rstrip("/"):
        raise ValueError(f"proxy.canary_engine_url is engine.url ({url!r}): the candidate's engines need their own "
                         "URL")


class Config(BaseSettings):
    """The effective configuration of one process (see the module docstring for precedence).

    Frozen once loaded: a stage that needs other values (a flag, a port chosen at start) derives
    a validated copy with :meth:`replace`.
    """

    model_config = SettingsConfigDict(env_prefix="PIPELINE_", env_nested_delimiter="__", extra="forbid",
                                      frozen=True)

    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = _d(
        "INFO", "log level of every stage (DEBUG also shows library chatter)")
    metrics_port: int | None = _d(None, "consumer stages: serve Prometheus /metrics on this port (None: off)",
                                  ge=0, le=65535)
    kafka: KafkaConfig = _d(KafkaConfig, "Kafka client settings")
    topics: TopicsConfig = _d(TopicsConfig, "topic definitions and naming")
    engine: EngineConfig = _d(EngineConfig, "the policy inference engine")
    proxy: ProxyConfig = _d(ProxyConfig, "the OpenAI-compatible proxy")
    judge: JudgeConfig = _d(JudgeConfig, "the judge stage")
    trainer: TrainerConfig = _d(TrainerConfig, "the trainer stage")
    syncer: SyncerConfig = _d(SyncerConfig, "the weight syncer of one engine replica")
    dashboard: DashboardConfig = _d(DashboardConfig, "the web dashboard")
    rollout: RolloutSection = _d(RolloutSection, "canary rollout, promotion and rollback (off by default)")

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, v: Any) -> Any:
        return v.upper() if isinstance(v, str) else v

    @model_validator(mode="after")
    def _check(self) -> "Config":
        if self.judge.idle_timeout_s > self.proxy.session_idle_s:
            raise ValueError(f"judge.idle_timeout_s ({self.judge.idle_timeout_s:g}) is above proxy.session_idle_s "
                             f"({self.proxy.session_idle_s:g}): the proxy would forget a session the judge still "
                             "holds open, and a late reply would lose its turn")
        if self.judge.fetch_max_wait_ms >= self.kafka.request_timeout_ms:
            raise ValueError(f"judge.fetch_max_wait_ms ({self.judge.fetch_max_wait_ms}) must be below "
                             f"kafka.request_timeout_ms ({self.kafka.request_timeout_ms}): every empty fetch "
                             "would time out")
        _check_canary_engines(self)
        if self.rollout.enabled and self.trainer.lora is None and not self.rollout.canary_engines \
                and not self.rollout.eval_set:
            # one full-weight engine serves the live candidate to everyone: no live arms to compare
            raise ValueError("rollout.enabled with full weights (no trainer.lora) and no rollout.canary_engines is "
                             "gated by the eval set alone (docs/rollout.md, 'The rule'): set rollout.eval_set (its "
                             "guards, or rollout.guards, must not fall); got eval_set=None. Or set "
                             "rollout.canary_engines (several full-weight engines), or canary tenants' LoRA adapters "
                             "(trainer.lora)")
        return self

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):  # noqa: D102
        return (init_settings, env_settings,
                InitSettingsSource(settings_cls, init_kwargs=_YAML_DATA.get()))

    def replace(self, **sections: Any) -> "Config":
        """A validated copy with some values changed: ``config.replace(trainer={"lr": 1e-5},
        log_level="DEBUG")``. Nested dicts are merged into the sections (other values are kept).

        Raises:
            ConfigError: a changed value is invalid, or the result breaks a cross-field rule.
        """
        data = _deep_merge(self.model_dump(), sections)
        try:
            return type(self).model_validate(data)
        except ValidationError as e:
            raise ConfigError(_messages(e)) from None


def _messages(e: ValidationError) -> str:
    out = []
    for err in e.errors():
        where = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        out.append(f"{where}: {msg}" if where else msg)
    return "; ".join(out)


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
        raise ConfigError(_messages(e)) from None
    finally:
        _YAML_DATA.reset(token)


def _range(field) -> str:
    """``>= 1``, ``0 < x <= 1``, ``one of a|b`` ... from a field's bounds or choices ('' when free)."""
    if get_origin(field.annotation) is Literal:
        return "one of " + "|".join(map(str, get_args(field.annotation)))
    lo = hi = ""
    for m in field.metadata:
        for attr, sym, side in (("ge", ">=", "lo"), ("gt", ">", "lo"), ("le", "<=", "hi"), ("lt", "<", "hi")):
            v = getattr(m, attr, None)
            if v is not None:
                if side == "lo":
                    lo = f"{sym} {v:g}" if isinstance(v, float) else f"{sym} {v}"
                else:
                    hi = f"{sym} {v:g}" if isinstance(v, float) else f"{sym} {v}"
    if lo and hi:
        return f"{lo.replace('>=', '').replace('>', '').strip()} {'<=' if lo.startswith('>=') else '<'} x {hi}"
    return lo or hi


def explain(config: Config) -> list[tuple[str, Any, str, str]]:
    """Every setting as ``(dotted key, effective value, description, allowed range)``, in
    declaration order; secrets masked. This is what ``pipeline config show --explain`` prints."""
    data = redacted(config)
    rows = []
    for name, field in type(config).model_fields.items():
        sub = getattr(field.annotation, "model_fields", None)
        if sub is None:
            rows.append((name, data[name], field.description or "", _range(field)))
            continue
        for key, f in sub.items():
            rows.append((f"{name}.{key}", data[name][key], f.description or "", _range(f)))
    return rows


def redacted(config: Config) -> dict:
    """The config as plain data with every secret replaced by ``'***'``."""
    return config.model_dump(mode="json")  # SecretStr dumps as '**********'
