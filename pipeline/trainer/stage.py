"""The trainer stage: consume ``samples`` in fixed-size batches, update the policy, sync weights.

One step (rank 0 talks to Kafka; every TP/DP rank trains on the broadcast batch)::

    batch   = source.next_batch(policy_version)       # rollout_batch_size samples, exact offsets
    metrics = policy.train_batch(batch)               # steps_per_batch optimizer steps
    policy_version += 1                               # unless the batch had nothing to train
    checkpoint(model, optimizer, step, policy_version, offsets, dedup window)  # every N steps
    commit offsets to the consumer group              # lag visibility only
    export -> <export_dir>/v<version>/ (atomic, sha256)
    control: pause -> weights -> (applied from every engine | timeout -> failed) -> resume
    metrics log line + progress bar

With ``trainer.lora`` (and ``trainer.per_tenant``, required) each step trains the batch's
tenant's adapter over the frozen base instead, and syncs that adapter alone
(:mod:`pipeline.trainer.adapters`)::

    batch    = source.next_batch(...)                  # one tenant's samples
    commands = control from commands_offset            # freeze / unfreeze / reset / delete, applied
    metrics  = policy.train_batch(batch, adapter=T)    # none when T is frozen or the batch has no tenant
    n_T += 1; export T's adapter -> <export_dir>/adapters/<slug>/<version[:16]>/
    checkpoint(adapters + optimizer states, tenants' table, commands_offset, offsets)
    control: pause(T, A) -> weights(T, A) -> applied/failed -> resume(T, A or the previous one)

Policy version = number of weight syncs; 0 is the initial checkpoint the engines start with.
On restart the trainer restores the newest checkpoint and seeks every partition to its
offsets, so no sample is trained twice or skipped (with ``checkpoint_every: 1``; with a larger
interval the steps after the last checkpoint are redone from the same offsets and weights). If
the engines were told about a version the checkpoint does not have (they served weights from
steps that were rolled back), the restored weights are exported and synced as a new, higher
version, so versions never go backwards. A version whose sync did not finish is synced again.
The configured optimizer hyper-parameters replace the checkpoint's (the change is logged).

Never a silent roll-back: with no complete checkpoint but traces of earlier training (exports,
``synced.json``, a ``latest`` pointer to a missing folder) the trainer refuses to start
(:class:`CheckpointMissing`, naming both directories) unless ``trainer.missing_checkpoint`` is
``newest_export`` (continue from the newest export's weights; fresh optimizer moments) or
``fresh`` (the base model, published as a new, higher version).

Never NaN weights (:mod:`pipeline.trainer.guards`): samples with non-finite values go to
``samples.dlq``; an optimizer step with a non-finite loss or gradient is skipped and counted;
weights are checked after each step and after a restore, and non-finite ones raise
:class:`guards.NonFiniteWeights` before anything is checkpointed, exported or synced.
"""

from __future__ import annotations

import logging
import shutil
import signal
import threading
import time
from pathlib import Path

import torch

from pipeline import events, weightsync
from pipeline.config import Config, ConfigError
from pipeline.errors import PipelineError
from pipeline.models import resolve_model
from pipeline.trainer import checkpoint as C
from pipeline.trainer import dist
from pipeline.trainer import guards
from pipeline.trainer import prom
from pipeline.trainer.metrics import MetricsLog, Progress, step_line

log = logging.getLogger(__name__)


def export_versions(export_dir: str | Path) -> list[int]:
    """Versions with a complete export folder (``v<N>`` holding its checksum file), ascending."""
    out = []
    root = Path(export_dir)
    if root.is_dir():
        for p in root.glob("v*"):
            if p.is_dir() and p.name[1:].isdigit() and (p / weightsync.CHECKSUM_FILE).exists():
                out.append(int(p.name[1:]))
    return sorted(out)


class CheckpointMissing(PipelineError, RuntimeError):
    """The checkpoint directory has no usable checkpoint although this run has trained before."""


class TrainerStage:
    """The ``python -m pipeline trainer`` process (see the module docstring).

    Args:
        config: the process config.
        stop: set it (or send SIGTERM/SIGINT when :meth:`run` installs handlers) to finish the
            current step and exit.
    """

    def __init__(self, config: Config, stop: threading.Event | None = None) -> None:
        if config.trainer.lora is not None and not config.trainer.per_tenant:
            raise ConfigError("trainer.lora trains one adapter per tenant, so it needs per-tenant batches: set "
                              "trainer.per_tenant=true as well (or leave trainer.lora unset for full fine-tuning)")
        self.config, self.cfg = config, config.trainer
        self.stop = stop or threading.Event()
        self.step = 0
        self.version = 0
        self.source = self.publisher = self.steps_out = None
        self.adapters = self.commands = None  # trainer.lora: pipeline.trainer.adapters
        self._commands: list[tuple[str, str]] = []  # read while idle, not applied yet
        self._untrained_logged: set[str] = set()
        self.log = MetricsLog(None)

    # ------------------------------------------------------------ setup

    def _setup(self) -> None:
        from pipeline.trainer.policy import PolicyTrainer

        cfg = self.cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.ckpt_dir = Path(cfg.checkpoint_dir)
        self.export_dir = Path(cfg.export_dir)
        found, from_export = self._plan_restore()  # refuses before the model is built
        self.par = dist.init(cfg.tp, cfg.seed)
        self.hf_dir = resolve_model(cfg.model, self.config.engine.cache_dir)
        self.policy = PolicyTrainer(cfg, self.hf_dir, self.par)
        offsets: dict[int, int] = {}
        seen: list[str] = []
        resume = None
        last_record = None
        tenants_meta, commands_offset = None, 0
        if found is not None:
            meta, state = C.load(found, self.par)
            self.policy.load_state_dict(state)
            self._check_weights(f"checkpoint {found}")
            self.step, self.version = int(meta["step"]), int(meta["policy_version"])
            topic_offsets = meta.get("offsets", {}).get(self.config.topics.name("samples"), {})
            offsets = {int(p): int(o) for p, o in topic_offsets.items()}
            seen = list(meta.get("seen", []))
            resume = meta.get("resume")  # per-tenant buffers: what was consumed above the offsets
            last_record = meta.get("record")
            tenants_meta, commands_offset = meta.get("tenants"), int(meta.get("commands_offset", 0))
            log.info("restored %s: step %d, policy version %d, offsets %s", found, self.step, self.version, offsets)
        elif from_export is not None:
            self.policy.load_weights(self.export_dir / f"v{from_export:06d}")
            self._check_weights(f"export v{from_export:06d}")
            self.version = from_export
            log.warning("no checkpoint in %s: continuing from the weights of export v%06d (optimizer moments "
                        "start fresh; samples are read from the consumer group's committed offsets)",
                        self.ckpt_dir, from_export)
        need_sync = False
        if self.par.is_main:
            self.log = MetricsLog(cfg.metrics_file or self.ckpt_dir / "metrics.jsonl")
            self.log.reconcile(self.step, last_record)
            for tmp in self.export_dir.glob(".v*.tmp-*") if self.export_dir.is_dir() else []:
                shutil.rmtree(tmp, ignore_errors=True)
            published = max(export_versions(self.export_dir) + [C.read_synced(self.ckpt_dir)])
            if cfg.lora is not None:
                pass  # the base is frozen and never published: adapters are synced per tenant below
            elif published > self.version:
                log.warning("engines may serve v%d, newer than the checkpoint's v%d: re-publishing the "
                            "restored weights as v%d", published, self.version, published + 1)
                self.version, need_sync = published + 1, True
            elif C.read_synced(self.ckpt_dir) < self.version:
                need_sync = True
            from pipeline.trainer.source import SampleSource
            from pipeline.trainer.sync import WeightPublisher

            last = weightsync.read_published(self.export_dir)
            if last is not None and last.run_id == cfg.run_id:  # the gauge survives a restart
                prom.PUBLISHED_VERSION.set(last.policy_version)

            self.source = SampleSource(self.config, offsets, seen, validate=self._validate, resume=resume)
            self.publisher = WeightPublisher(self.config)
            from pipeline.trainer.publish import StepPublisher

            self.steps_out = StepPublisher(self.config, self.publisher.producer)
        self.version, need_sync = dist.broadcast_object((self.version, need_sync))
        prom.POLICY_VERSION.set(self.version)
        if cfg.lora is not None:
            self._setup_adapters(tenants_meta, commands_offset)
        elif need_sync:
            self._export_and_sync({})

    def _setup_adapters(self, meta: dict | None, commands_offset: int) -> None:
        """``trainer.lora``: the tenants' state from the checkpoint; rank 0 reads commands from
        ``commands_offset`` and every rank applies those already there; then tenants whose last
        update was not synced (and still have an adapter) are exported and synced."""
        from pipeline.trainer.adapters import CommandReader, TenantAdapters

        self.adapters = TenantAdapters(self.config, self.policy, self.par.is_main, meta)
        if self.par.is_main:
            self.adapters.publisher = self.publisher
            self.source.adapters = self.adapters.table
            self.commands = CommandReader(self.config, commands_offset)
        # commands read after the checkpoint first: a reset or delete that followed it must not be
        # undone by re-syncing the adapter it dropped
        pending = dist.broadcast_object([(c.action, c.tenant) for c in self.commands.poll()] if self.par.is_main
                                        else None)
        if pending:
            self.adapters.apply(pending)
        for tenant in dist.broadcast_object(self.adapters.need_sync() if self.par.is_main else None):
            log.info("tenant %s: its last adapter update was not synced: syncing it again", tenant)
            self._adapter_update(tenant, {})

    def _plan_restore(self) -> tuple[Path | None, int | None]:
        """``(checkpoint to restore, export version to load)``; at most one is set.

        Without a complete checkpoint but with traces of training (an export folder, a synced
        version, a ``latest`` pointer), starting from the base model would silently roll the
        policy back: refused unless ``trainer.missing_checkpoint`` says ``fresh`` or
        ``newest_export``.

        Raises:
            CheckpointMissing: the refusal, naming both directories and the two ways forward.
        """
        found = C.latest(self.ckpt_dir)
        if found is not None:
            return found, None
        exports = export_versions(self.export_dir)
        synced = C.read_synced(self.ckpt_dir)
        pointer = C.pointer(self.ckpt_dir)
        traces = []
        if exports:
            traces.append(f"export directory {self.export_dir} holds trained weights up to v{exports[-1]:06d}")
        if synced:
            traces.append(f"{self.ckpt_dir / C.SYNCED} says v{synced} was synced to the engines")
        if pointer is not None:
            traces.append(f"{self.ckpt_dir / C.LATEST} names {pointer}, which is missing or incomplete")
        from pipeline.trainer.adapters import SYNCED_FILE, read_synced

        if read_synced(self.ckpt_dir):
            traces.append(f"{self.ckpt_dir / SYNCED_FILE} says tenants' adapters were synced to the engines")
        if not traces:
            return None, None  # a new run
        mode = self.cfg.missing_checkpoint
        if mode == "newest_export" and exports:
            return None, exports[-1]
        if mode == "fresh":
            log.warning("no checkpoint in %s although %s: starting from the base model %s as told "
                        "(trainer.missing_checkpoint=fresh)", self.ckpt_dir, "; ".join(traces), self.cfg.model)
            return None, None
        newest = (f"--from-newest-export (trainer.missing_checkpoint=newest_export) continues from the "
                  f"weights of v{exports[-1]:06d}" if exports else
                  f"--from-newest-export cannot help: {self.export_dir} holds no complete export")
        raise CheckpointMissing(
            f"checkpoint directory {self.ckpt_dir} holds no complete checkpoint, but "
            f"{'; '.join(traces)}. Starting from the base model would silently roll training back. "
            f"Restore the checkpoint directory, or restart with {newest}, or with --start-fresh "
            f"(trainer.missing_checkpoint=fresh) to train from the base model {self.cfg.model} again.")

    def _check_weights(self, what: str) -> None:
        """Raise :class:`guards.NonFiniteWeights` (on every rank) if the weights hold NaN/inf."""
        bad = self.policy.nonfinite_weights()
        if bad:
            raise guards.NonFiniteWeights(
                f"{what}: non-finite values in {len(bad)} parameter(s) ({', '.join(bad[:5])}); "
                f"nothing is checkpointed, exported or synced")

    def _validate(self, s: events.Sample) -> str | None:
        """Why ``s`` cannot be trained by this model (goes to the DLQ), or None."""
        arch = self.policy.arch
        bad = guards.nonfinite_fields(s)
        if bad:
            return "non-finite values: " + ", ".join(bad)
        if s.tokens and (min(s.tokens) < 0 or max(s.tokens) >= arch.vocab_size):
            return f"token id out of range for vocabulary {arch.vocab_size}"
        if len(s.tokens) > arch.max_positions:
            return f"{len(s.tokens)} tokens exceed the model's {arch.max_positions} positions"
        return None

    # ------------------------------------------------------------ sync

    def _export_and_sync(self, record: dict) -> None:
        """Export the weights as ``v<version>`` (reusing a complete folder) and run the sync."""
        out = self.export_dir / f"v{self.version:06d}"
        t0 = time.perf_counter()
        reuse = False
        if self.par.is_main and out.exists():
            try:
                weightsync.verify_folder(out)
                reuse = True
            except (OSError, ValueError):
                shutil.rmtree(out, ignore_errors=True)
        reuse = dist.broadcast_object(reuse)
        exported = None if reuse else self.policy.export(out)
        record["export_s"] = time.perf_counter() - t0
        if not self.par.is_main:
            return
        sha = exported.sha256 if exported is not None else weightsync.verify_folder(out)
        location = str(out.resolve())
        report = self.publisher.sync(self.version, location, sha, stop=self.stop)
        record.update(sync_s=report.seconds, sync_applied=report.applied, sync_failed=report.failed)
        C.write_synced(self.ckpt_dir, self.version)
        self._prune_exports()

    def _prune_exports(self) -> None:
        versions = export_versions(self.export_dir)
        for v in versions[:max(0, len(versions) - self.cfg.keep_exports)]:
            shutil.rmtree(self.export_dir / f"v{v:06d}", ignore_errors=True)

    # ------------------------------------------------------------ adapters (trainer.lora)

    def _adapter_export(self, tenant: str, record: dict) -> tuple[dict, Path] | None:
        """``trainer.lora``: export ``tenant``'s adapter (collective); rank 0 gets ``(adapter,
        folder)`` and the step record its ``adapter``."""
        t0 = time.perf_counter()
        got = self.adapters.export(tenant)
        record["export_s"] = time.perf_counter() - t0
        if got is not None:
            record["adapter"] = got[0]
        return got

    def _adapter_sync(self, tenant: str, exported: tuple[dict, Path], record: dict) -> None:
        """Rank 0: the adapter sync of ``tenant``'s update (its figures into the step record)."""
        report = self.adapters.sync(tenant, exported[0], exported[1], self.stop)
        record.update(sync_s=report.seconds, sync_applied=report.applied, sync_failed=report.failed,
                      resumed=report.resumed)

    def _adapter_update(self, tenant: str, record: dict) -> None:
        """Export and sync ``tenant``'s adapter at once (a restart's unfinished sync)."""
        exported = self._adapter_export(tenant, record)
        if exported is not None:
            self._adapter_sync(tenant, exported, record)

    # ------------------------------------------------------------ loop

    def _commands_waiting(self) -> bool:
        """Rank 0, idle on ``samples``: read ``control``; True when commands arrived."""
        self._commands += [(c.action, c.tenant) for c in self.commands.poll()]
        return bool(self._commands)

    def _next_payload(self):
        """Rank 0 takes the next batch and, with ``trainer.lora``, applies the commands that arrived
        and decides whether the batch trains; everything is broadcast (only rank 0's stop flag
        counts). While no sample arrives, commands are applied as they come (a payload without
        samples). Returns ``(batch or None, (samples or None, weights, stopping, tenant,
        commands, why_not))``, or None when stopping."""
        batch, commands, why_not = None, [], None
        if self.par.is_main and not self.stop.is_set():
            lora = self.adapters is not None
            batch = self.source.next_batch(self.version, self.stop, idle=self._commands_waiting if lora else None)
            if lora and (batch is not None or self._commands):
                commands, self._commands = self._commands + [(c.action, c.tenant) for c in self.commands.poll()], []
                self.adapters.apply(commands)
                why_not = self.adapters.why_not_trained(batch.tenant) if batch is not None else None
        payload = dist.broadcast_object(None if batch is None and not commands else (
            None if batch is None else batch.samples, None if batch is None else batch.weights, self.stop.is_set(),
            None if batch is None else batch.tenant, commands, why_not))
        if payload is None:
            return None
        if not self.par.is_main and payload[4]:
            self.adapters.apply(payload[4])
        return batch, payload

    def _train(self, samples: list, weights: list, tenant: str | None, why_not: str | None):
        """Train the batch (or, with ``why_not``, count it untrained); returns ``(result, record)``."""
        from pipeline.trainer.policy import StepResult

        lora = self.adapters is not None
        if why_not is not None:
            result = StepResult({"train_samples": 0.0, "train_tokens": 0.0, f"{why_not}_samples": float(len(samples))},
                                skipped=True)
            if self.par.is_main and (tenant or "") not in self._untrained_logged:
                self._untrained_logged.add(tenant or "")
                log.warning("a batch of %s trains nothing (%s): its samples are consumed and counted as "
                            "%s_samples (logged once per tenant)", f"tenant {tenant}" if tenant else "samples without a "
                            "tenant (served by the frozen base)", why_not, why_not)
        else:
            result = self.policy.train_batch(samples, weights, policy_version=None if lora else self.version,
                                             adapter=tenant if lora else None)
        if not result.skipped:
            self._check_weights(f"step {self.step + 1}")
        self.step += 1
        if not result.skipped:
            if lora:
                self.adapters.table.bump(tenant)
            else:
                self.version += 1
        version = self.adapters.table.updates(tenant) if lora else self.version
        record: dict = {"step": self.step, "policy_version": version, "time_ms": events.now_ms(),
                        "optimizer_steps": self.policy.optimizer_steps, "skipped": result.skipped,
                        "batch_samples": len(samples), **result.metrics}
        return result, record

    def _checkpoint(self, batch, record: dict) -> None:
        """Save the checkpoint (collective) and commit the offsets to the group (rank 0)."""
        meta = {"policy_version": self.version, "record": record,
                "offsets": {self.config.topics.name("samples"): batch.offsets if batch else {}},
                "seen": self.source.dedup.to_list() if self.source else [],
                "resume": batch.resume if batch else None}
        if self.adapters is not None:
            meta["tenants"] = self.adapters.table.to_meta()
            meta["commands_offset"] = self.commands.position if self.commands is not None else 0
        C.save(self.ckpt_dir, self.step, self.par, self.policy.state_dict(), meta, self.cfg.keep_checkpoints)
        if self.par.is_main:
            self.source.commit(batch.offsets)

    def _one_step(self, progress: Progress) -> bool:
        """Train one batch; False when stopping (no batch)."""
        cfg = self.cfg
        got = self._next_payload()
        if got is None:
            return False
        batch, (samples, weights, stopping, tenant, _, why_not) = got
        if samples is None:  # commands applied while no sample arrived: no step
            return not stopping
        t_batch = time.perf_counter()  # the wait for a full batch (consume_s) is not part of step_s
        result, record = self._train(samples, weights, tenant, why_not)
        if batch is not None:
            record.update(batch.stats)
            if cfg.per_tenant:
                record["tenant"] = batch.tenant
            if cfg.log_sample_ids:
                record["sample_ids"] = [s.sample_id for s in samples]
                # where consumption ended: with the previous step's, which records this step consumed
                record["offsets"] = {str(p): o for p, o in batch.offsets.items()}
        exported = None
        if self.adapters is not None and not result.skipped:  # exported before the checkpoint: its
            exported = self._adapter_export(tenant, record)   # version is in the checkpoint's table
        t1 = time.perf_counter()
        last = cfg.max_steps is not None and self.step >= cfg.max_steps
        if self.step % cfg.checkpoint_every == 0 or last or stopping:
            self._checkpoint(batch, record)
        record["checkpoint_s"] = time.perf_counter() - t1
        if not result.skipped:
            if self.adapters is None:
                self._export_and_sync(record)
            elif exported is not None:
                self._adapter_sync(tenant, exported, record)
        self._report(record, result, samples, t_batch, progress)
        return not stopping

    def _report(self, record: dict, result, samples: list, t_batch: float, progress: Progress) -> None:
        """The step's timings; rank 0 logs it (JSONL, ``metrics`` topic, Prometheus, progress)."""
        step_s = time.perf_counter() - t_batch
        record.update(step_s=step_s, samples_per_s=record["train_samples"] / step_s,
                      tokens_per_s=record["train_tokens"] / step_s,
                      train_tokens_per_s=record["train_tokens"] / max(
                          record.get("forward_backward_s", 0.0) + record.get("optimizer_s", 0.0), 1e-9))
        if self.par.is_main:
            self.log.append(record)
            self.steps_out.publish(record, {samples[i].sample_id: a for i, a in result.sample_advantages.items()})
            prom.observe_step(record)
            progress.update(record)
            log.info("%s", step_line(record))

    def run(self, install_signals: bool = True) -> int:
        """Set up, then train until ``max_steps`` or a stop request. Returns an exit status."""
        if install_signals and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: self.stop.set())
        self._setup()
        if self.par.is_main:
            from pipeline.metrics import serve_metrics

            serve_metrics(self.config.metrics_port)
        progress = Progress(self.cfg.progress and self.par.is_main, self.cfg.max_steps, self.step)
        try:
            while self.cfg.max_steps is None or self.step < self.cfg.max_steps:
                if not self._one_step(progress):
                    break
        finally:
            progress.close()
            if self.source is not None:
                self.source.close()
            if self.publisher is not None:
                self.publisher.close()
            if self.commands is not None:
                self.commands.close()
        log.info("trainer stopped at step %d, policy version %d", self.step, self.version)
        return 0
