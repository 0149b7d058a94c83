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

With ``rollout.enabled`` (docs/rollout.md) rank 0 also folds every ``control`` record of its run
into a :class:`pipeline.rollout.serving.ServingView` (the command reader reads ``control`` from
its beginning: the view needs the history; actions below ``commands_offset`` were applied
before the checkpoint) and reads up to the ``resume`` of each of its own syncs before it goes on,
so the view holds the canary that sync opened. A scope (a tenant's adapter with ``trainer.lora``,
else the full weights) whose canary is open (``canary_open``) is **held**: its batches are still
trained (``n_T`` / the policy version counts them, the checkpoint keeps the weights, the offsets
and ``synced < updates`` as for any unsynced update) but not exported or synced, and the step
record says ``held: true``. Once a ``promote`` or ``rollback`` is read (applied in log order with
the commands, while idle too with ``trainer.per_tenant``) every scope with an unsynced newest
state and no open canary is exported and synced, the newest state being the next candidate; a
restart does the same for what it restored, so no update is lost or synced twice. A canary
whose candidate is the trainer's own unsynced newest state and not live (killed between its
``weights`` and its ``resume``) holds nothing: the restart syncs it again, and its ``resume``
makes it live. Samples keep
counting their staleness against the trained updates: a long canary with a small
``max_staleness`` drops the scope's samples as stale (counted as ``stale_dropped``; use
``stale_policy: downweight`` or ``max_staleness: null`` with long canaries).

After a ``rollback`` of a tenant's candidate (the newest version the trainer exported for it)
the tenant continues from the incumbent: its adapter is loaded from the incumbent's export folder
(``<export_dir>/adapters/<slug>/<version[:16]>/``, never pruned while it is the incumbent; the
base model: a fresh adapter, as ``reset`` makes), its optimizer state is fresh, the updates held
since the candidate are dropped with their weights (their samples stay consumed: trained once,
then discarded) and ``n_T`` keeps counting, so the next update publishes a new, higher ``n``.
A sync's ``previous`` (what its ``resume`` names when an engine failed) is the incumbent.

A rollback of the **full weights'** candidate (the newest export) restores the incumbent the same
way: its export folder ``<export_dir>/v<incumbent>`` (never pruned while it is the incumbent; a new
run declares v0 on ``control`` first unless ``control`` holds its order, so the first incumbent has
one too) is loaded into the model
(verified by its sha256), the optimizer's moments start fresh, the held updates are dropped with
their weights, and the policy version keeps counting: the next update is a new, higher version,
never a reused number. The restored state counts as synced (the syncers re-apply the incumbent);
the next step checkpoints it (whatever ``checkpoint_every``) before it exports anything, and a
restart before that reads the ``rollback`` again (it is above the checkpoint's
``commands_offset``) and restores again (the rolled-back version is still the newest export). A
tenant's restore is checkpointed the same way.

``trainer.poison_steps`` (a test device for ``pipeline demo --rollout``): the updates of the
listed number are trained on copies of their samples with their training signal inverted
(:func:`poison`: every ``reward`` negated, so the Binary-RL advantages flip, and the OPD term,
teacher minus rollout log-prob, negated too), logged at WARNING, and each step record (and
``TrainStep.metrics``) says ``poisoned: true``. The number is the update's (with ``trainer.lora``
the tenant's ``n_T`` it makes, else the policy version it produces); with ``rollout.enabled`` it
is the **candidate** the update will be published in (the k-th canary of its scope, from the
serving view), so every update held for that candidate is poisoned and no honest one. Before the
first poisoned update of a number the trained unit's Adam moments are reset: with the momentum of
honest updates an inverted one changes little (measured: docs/rollout.md, "The trainer").

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

import dataclasses
import functools
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
from pipeline.rollout.serving import version_of
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


def poison(samples: list[events.Sample]) -> list[events.Sample]:
    """``trainer.poison_steps``, a test device: copies of ``samples`` with their training signal
    inverted. Every ``reward`` is negated (None stays None: the Binary-RL advantage flips sign),
    and where a sample has teacher and rollout log-probs the teacher's are mirrored about the
    rollout's (``2 * rollout - teacher``, per token, nats), so the OPD advantage ``teacher -
    rollout`` is negated too (a sample without rollout log-probs keeps its teacher)."""
    out = []
    for s in samples:
        teacher = s.teacher_log_probs
        if teacher is not None and s.rollout_log_probs is not None:
            teacher = [2.0 * r - t for r, t in zip(s.rollout_log_probs, teacher)]
        out.append(dataclasses.replace(s, reward=None if s.reward is None else -s.reward, teacher_log_probs=teacher))
    return out


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
        self.adapters = None  # trainer.lora: pipeline.trainer.adapters
        self.commands = None  # rank 0, trainer.lora or rollout.enabled: the control reader
        self.view = None  # rank 0, rollout.enabled: pipeline.rollout.serving.ServingView
        self._commands: list[tuple] = []  # actions read, not applied yet
        self._untrained_logged: set[str] = set()
        self._poison_began: set[tuple] = set()  # (scope, k) of trainer.poison_steps begun (rank 0)
        self._checkpoint_due = False  # a rollback restored an incumbent: the next step checkpoints
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
            self._load_export(from_export)
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
            self._setup_control(commands_offset)
        self.version, need_sync = dist.broadcast_object((self.version, need_sync))
        prom.POLICY_VERSION.set(self.version)
        if cfg.lora is not None:
            self._setup_adapters(tenants_meta)
        elif self.config.rollout.enabled:  # need_sync is read_synced < version: _release's test
            self._pending_actions()
            self._publish_incumbent()
            self._release("its last version was not synced: syncing it again")
        elif need_sync:
            self._export_and_sync({})

    def _load_export(self, version: int) -> None:
        """Load the exported HF folder ``<export_dir>/v<version>`` into the model (collective; its
        checksum verified, then the weights checked for NaN/inf): ``trainer.missing_checkpoint:
        newest_export`` and a full-weight rollback (:meth:`_rollback_full`). Raises ``ValueError``
        on a checksum mismatch, ``FileNotFoundError`` without the folder's weights and
        :class:`guards.NonFiniteWeights`."""
        self.policy.load_weights(self.export_dir / f"v{version:06d}")
        self._check_weights(f"export v{version:06d}")

    def _publish_incumbent(self) -> None:
        """Full weights with ``rollout.enabled`` (collective; rank 0 decides): a run at policy
        version 0 whose ``control`` holds no ``weights`` order of v0 (read to its end at setup)
        exports v0 (a complete folder is reused: a trainer killed between the export and the
        order) and declares it (:meth:`pipeline.trainer.sync.WeightPublisher.declare`: a lone
        ``weights`` order, no pause and no wait: the engines serve these weights already, and the
        syncers start after the trainer), so the first incumbent has its own order (folder and
        sha256): what the syncers re-apply and this trainer restores after a rollback of its
        successor."""
        todo = self.par.is_main and self.version == 0 and 0 not in self.commands.full_orders
        if dist.broadcast_object(todo if self.par.is_main else None):
            got = self._export({})
            if self.par.is_main:
                log.info("policy v0: publishing the first incumbent's weights (rollout: a rollback restores them)")
                self.publisher.declare(0, *got)

    def _rollback_full(self, version: int, incumbent: int, decided: bool | None = None) -> bool:
        """``rollout.enabled``, full weights: the canary of policy ``version`` was rolled back (every
        rank; ``decided``: rank 0's verdict, which the other ranks follow). When ``version`` is the
        newest export (the head of what this trainer trains) and the incumbent's export
        ``v<incumbent>`` verifies, the trainer continues from the incumbent: its weights are loaded
        (:meth:`_load_export`), the optimizer's moments start fresh, the updates held since
        ``version`` are dropped with their weights (their samples stay consumed), the policy
        version keeps counting (never reused: the next update is ``self.version + 1``) and the
        restored state counts as synced (the engines serve the incumbent again). The next step
        checkpoints it before its export; a restart before it reads the ``rollback`` again and
        restores again.
        Returns whether it restored; otherwise (an older version, a missing or bad incumbent
        folder: logged) the trainer goes on from its own state."""
        if decided is None:
            decided = self._may_restore(version, incumbent)
        if not decided:
            return False
        self._load_export(incumbent)
        self.policy.reset_optimizer(None)
        if self.par.is_main:
            C.write_synced(self.ckpt_dir, self.version)
            log.warning("rollback of policy v%d: continuing from the incumbent v%d's export (fresh optimizer "
                        "state; the policy version stays %d, the next update is v%d)", version, incumbent,
                        self.version, self.version + 1)
        return True

    def _may_restore(self, version: int, incumbent: int) -> bool:
        """Rank 0: whether a rollback of ``version`` restores ``incumbent`` (:meth:`_rollback_full`)."""
        newest = max(export_versions(self.export_dir), default=None)
        if version != newest:
            log.info("rollback of policy v%d: not the newest export (v%s): nothing to restore", version, newest)
            return False
        try:
            weightsync.verify_folder(self.export_dir / f"v{incumbent:06d}")
        except (OSError, ValueError) as e:
            log.error("rollback of policy v%d: the incumbent's export v%06d cannot be loaded (%s): the trainer goes "
                      "on from its own state", version, incumbent, e)
            return False
        return True

    def _setup_control(self, commands_offset: int) -> None:
        """Rank 0: the ``control`` reader (``trainer.lora``: commands; ``rollout.enabled``: the
        serving view folded from the beginning and the decisions), from ``commands_offset``."""
        from pipeline.trainer.adapters import CommandReader

        if self.config.rollout.enabled:
            from pipeline.rollout.serving import ServingView

            self.view = ServingView(self.cfg.run_id)
        if self.cfg.lora is not None or self.view is not None:
            self.commands = CommandReader(self.config, commands_offset, self.view)

    def _pending_actions(self) -> None:
        """Rank 0 reads ``control`` up to its end (commands and decisions after the checkpoint's
        position) and applies them; then every other rank applies rank 0's list (collective)."""
        actions = None
        if self.par.is_main:
            actions = self.commands.poll() if self.commands is not None else []
            self._apply_actions(actions)
        actions = dist.broadcast_object(actions)
        if not self.par.is_main:
            self._apply_actions(actions)

    def _setup_adapters(self, meta: dict | None) -> None:
        """``trainer.lora``: the tenants' state from the checkpoint; rank 0 reads commands (and
        with ``rollout.enabled`` decisions) from the checkpoint's ``commands_offset`` and every rank
        applies those already there; then tenants whose last update was not synced (and still
        have an adapter, and no open canary) are exported and synced."""
        from pipeline.trainer.adapters import TenantAdapters

        self.adapters = TenantAdapters(self.config, self.policy, self.par.is_main, meta)
        if self.par.is_main:
            self.adapters.publisher = self.publisher
            self.adapters.view = self.view
            self.source.adapters = self.adapters.table
        # commands read after the checkpoint first: a reset or delete that followed it must not be
        # undone by re-syncing the adapter it dropped
        self._pending_actions()
        self._release("its last adapter update was not synced: syncing it again")

    def _apply_actions(self, actions: list[tuple]) -> None:
        """Apply what ``control`` asked, in log order (rank 0 first, then the others with rank 0's
        list): adapter commands, and with ``rollout.enabled`` the decisions: a ``rollback`` of a
        tenant's candidate restores the incumbent adapter
        (:meth:`pipeline.trainer.adapters.TenantAdapters.rollback`), one of the full weights'
        candidate the incumbent's weights (:meth:`_rollback_full`); rank 0 decides whether and
        appends its verdict to the action in ``actions``, which the other ranks follow. A
        ``promote`` changes no weights (what was held is released by :meth:`_release`). A restore
        makes the next step checkpoint (:meth:`_one_step`, before it exports anything)."""
        for i, a in enumerate(actions):
            if len(a) == 2:
                if self.adapters is not None:  # full weights: adapter commands are not for it
                    self.adapters.apply([a])
            elif a[0] == "rollback" and (a[1] is None) == (self.adapters is None):
                restore = self._rollback_full if a[1] is None else functools.partial(self.adapters.rollback, a[1])
                if self.par.is_main:
                    actions[i] = (*a[:4], restore(a[2], a[3]))
                    self._checkpoint_due |= actions[i][4]
                else:
                    self._checkpoint_due |= restore(a[2], a[3], decided=a[4])
            elif self.par.is_main:
                log.info("%s of %s %s", a[0], "the full weights" if a[1] is None else f"{a[1]}'s adapter", a[2])

    def _held(self, scope: str | None) -> bool:
        """Rank 0, ``rollout.enabled``: ``scope`` (a tenant, None: the full weights) gets no new sync
        now: its canary is open, or a decision about it was read and is not applied yet. A canary
        whose candidate is this trainer's own unsynced newest state and is not live does not hold
        it (:meth:`_interrupted`)."""
        if self.view is None:
            return False
        if any(len(a) >= 4 and a[1] == scope for a in self._commands):
            return True
        return self.view.canary_open(scope) and not self._interrupted(scope)

    def _interrupted(self, scope: str | None) -> bool:
        """Rank 0: the scope's candidate is not live and is the state this trainer has not synced
        yet (the full weights: a version above ``synced.json`` and not above ``self.version``; a
        tenant: the adapter content exported at its unsynced update count ``n_T``): its sync was
        cut short (the trainer was killed between ``weights`` and ``resume``), so nothing else will
        ever send its ``resume``. Syncing it again resumes it: a second ``weights`` of the
        candidate is no new canary, in the serving view as in the decider's fold (an open
        candidate's own order), so only the ``resume`` counts. A restart from a checkpoint older
        than the candidate re-publishes its restored weights under a higher version instead, whose
        order supersedes the candidate (undecided) and opens the next canary."""
        s = self.view.scope(scope)
        if s.candidate is None or s.live:
            return False
        if scope is None:
            return C.read_synced(self.ckpt_dir) < s.candidate <= self.version
        t = self.adapters.table[scope]
        return t.synced < t.updates and t.versions.get(version_of(s.candidate)) == t.updates

    def _release(self, why: str = "its canary was decided: syncing its newest state") -> None:
        """Export and sync every scope whose newest trained state was not synced and that is not
        held (collective; rank 0 decides): tenants with an adapter (``trainer.lora``), else the
        full weights. At setup: the unfinished syncs of a restart; with ``rollout.enabled`` also
        after actions were applied (a decided canary releases what was trained meanwhile)."""
        if self.adapters is None:
            todo = self.par.is_main and C.read_synced(self.ckpt_dir) < self.version and not self._held(None)
            if dist.broadcast_object(todo if self.par.is_main else None):
                if self.par.is_main:
                    log.info("policy v%d: %s", self.version, why)
                self._export_and_sync({})
            return
        todo = [t for t in self.adapters.need_sync() if not self._held(t)] if self.par.is_main else None
        for tenant in dist.broadcast_object(todo):
            if self.par.is_main:
                log.info("tenant %s: %s", tenant, why)
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
        got = self._export(record)
        if got is None:
            return
        candidate = self.view is not None and self.version != self.view.scope(None).incumbent
        if candidate:
            self._await_incumbent()
        report = self.publisher.sync(self.version, *got, stop=self.stop, engines=self.publisher.engines_for(candidate))
        record.update(sync_s=report.seconds, sync_applied=report.applied, sync_failed=report.failed)
        C.write_synced(self.ckpt_dir, self.version)
        self._after_sync(report)
        self._prune_exports()

    def _await_incumbent(self) -> None:
        """Rank 0, before a full-weight candidate's sync with ``rollout.canary_engines``: wait until
        every engine outside the canary applied the promoted incumbent (its order is read from
        ``control``; v0, declared, is served from the start), or the wait times out (logged,
        :meth:`pipeline.trainer.sync.WeightPublisher.await_applied`)."""
        incumbent = self.view.scope(None).incumbent
        canary = self.publisher.engines_for(True)
        others = [e for e in self.cfg.engines if e not in canary]
        offset = self.commands.full_orders.get(incumbent)
        if others and incumbent != 0 and offset is not None:
            self.publisher.await_applied(incumbent, offset, others, self.stop)

    def _export(self, record: dict) -> tuple[str, str] | None:
        """Export the weights as ``v<version>`` (collective; a complete folder is reused, its
        checksum verified); rank 0 gets ``(location, sha256)``, the others None. ``record`` gets
        ``export_s``."""
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
            return None
        sha = exported.sha256 if exported is not None else weightsync.verify_folder(out)
        return str(out.resolve()), sha

    def _prune_exports(self) -> None:
        """Keep the newest ``keep_exports`` folders, and with ``rollout.enabled`` the incumbent's."""
        versions = export_versions(self.export_dir)
        incumbent = self.view.scope(None).incumbent if self.view is not None else None
        for v in versions[:max(0, len(versions) - self.cfg.keep_exports)]:
            if v != incumbent:
                shutil.rmtree(self.export_dir / f"v{v:06d}", ignore_errors=True)

    def _after_sync(self, report) -> None:
        """Rank 0, ``rollout.enabled``: read ``control`` up to the sync's own ``resume``, so the
        serving view holds the canary it opened; the actions read meanwhile wait for the next
        payload."""
        if self.view is not None and report.offset is not None:
            self._commands += self.commands.catch_up(report.offset, self.stop)

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
        self._after_sync(report)

    def _adapter_update(self, tenant: str, record: dict) -> None:
        """Export and sync ``tenant``'s adapter at once (a restart's unfinished sync)."""
        exported = self._adapter_export(tenant, record)
        if exported is not None:
            self._adapter_sync(tenant, exported, record)

    # ------------------------------------------------------------ loop

    def _commands_waiting(self) -> bool:
        """Rank 0, idle on ``samples``: read ``control``; True when actions arrived."""
        self._commands += self.commands.poll()
        return bool(self._commands)

    def _poisoned(self, tenant: str | None) -> int:
        """Rank 0: whether the update about to be trained is in ``trainer.poison_steps`` (with
        ``rollout.enabled``: the candidate it will be published in, the scope's canaries so far
        + 1; else with ``trainer.lora``: ``tenant``'s update count it makes; else the policy
        version): 0 no, 1 yes, 2 yes and the first of its number this process trains (its
        optimizer moments are reset first: :meth:`_train`)."""
        if not self.cfg.poison_steps:
            return 0
        if self.view is not None:
            k = self.view.scope(tenant if self.adapters is not None else None).opened + 1
        else:
            k = (self.adapters.table.updates(tenant) if self.adapters is not None else self.version) + 1
        if k not in self.cfg.poison_steps:
            return 0
        first = (tenant, k) not in self._poison_began
        self._poison_began.add((tenant, k))
        return 2 if first else 1

    def _next_payload(self):
        """Rank 0 takes the next batch and, with ``trainer.lora``, applies the commands that arrived
        and decides whether the batch trains; everything is broadcast (only rank 0's stop flag
        counts). While no sample arrives, commands are applied as they come (a payload without
        samples). Returns ``(batch or None, (samples or None, weights, stopping, tenant,
        commands, why_not, poisoned))``, or None when stopping. With ``rollout.enabled`` the
        commands include the decisions (:class:`pipeline.trainer.adapters.CommandReader`)."""
        batch, commands, why_not, poisoned = None, [], None, False
        if self.par.is_main and not self.stop.is_set():
            reader = self.commands is not None
            batch = self.source.next_batch(self.version, self.stop, idle=self._commands_waiting if reader else None)
            if reader and (batch is not None or self._commands):
                commands, self._commands = self._commands + self.commands.poll(), []
                self._apply_actions(commands)
            if self.adapters is not None and batch is not None:
                why_not = self.adapters.why_not_trained(batch.tenant)
            poisoned = batch is not None and why_not is None and self._poisoned(batch.tenant)
        payload = dist.broadcast_object(None if batch is None and not commands else (
            None if batch is None else batch.samples, None if batch is None else batch.weights, self.stop.is_set(),
            None if batch is None else batch.tenant, commands, why_not, poisoned))
        if payload is None:
            return None
        if not self.par.is_main and payload[4]:
            self._apply_actions(payload[4])
        return batch, payload

    def _train(self, samples: list, weights: list, tenant: str | None, why_not: str | None,
               poisoned: int = 0):
        """Train the batch (or, with ``why_not``, count it untrained); returns ``(result, record)``.
        ``poisoned`` (``trainer.poison_steps``, a test device; :meth:`_poisoned`): the signal of
        every sample is inverted first (:func:`poison`), at 2 after the trained unit's optimizer
        moments are reset (the momentum of earlier honest updates would hide one inverted
        update), and the record says ``poisoned: true``."""
        from pipeline.trainer.policy import StepResult

        lora = self.adapters is not None
        if poisoned:
            samples = poison(samples)
            unit = tenant if lora else None
            if poisoned == 2 and (unit is None or unit in self.policy.adapters()):
                self.policy.reset_optimizer(unit)
            if self.par.is_main:
                log.warning("trainer.poison_steps: update %d%s is trained with its signal inverted (a test "
                            "device, never for production)", (self.adapters.table.updates(tenant) if lora else
                                                               self.version) + 1, f" of {tenant}" if lora else "")
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
        if poisoned:
            record["poisoned"] = True
        return result, record

    def _checkpoint(self, batch, record: dict) -> None:
        """Save the checkpoint (collective) and commit the offsets to the group (rank 0)."""
        meta = {"policy_version": self.version, "record": record,
                "offsets": {self.config.topics.name("samples"): batch.offsets if batch else {}},
                "seen": self.source.dedup.to_list() if self.source else [],
                "resume": batch.resume if batch else None}
        if self.adapters is not None:
            meta["tenants"] = self.adapters.table.to_meta()
        if self.adapters is not None or self.config.rollout.enabled:
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
        batch, (samples, weights, stopping, tenant, actions, why_not, poisoned) = got
        if actions and self.config.rollout.enabled:
            self._release()  # a decided canary: what was trained meanwhile is the next candidate
        if samples is None:  # commands applied while no sample arrived: no step
            return not stopping
        t_batch = time.perf_counter()  # the wait for a full batch (consume_s) is not part of step_s
        result, record = self._train(samples, weights, tenant, why_not, poisoned)
        if batch is not None:
            record.update(batch.stats)
            if cfg.per_tenant:
                record["tenant"] = batch.tenant
            if cfg.log_sample_ids:
                record["sample_ids"] = [s.sample_id for s in samples]
                # where consumption ended: with the previous step's, which records this step consumed
                record["offsets"] = {str(p): o for p, o in batch.offsets.items()}
        exported, held = None, False
        if self.config.rollout.enabled and not result.skipped:  # its canary is open: trained, not synced
            held = dist.broadcast_object(self._held(tenant if self.adapters is not None else None)
                                         if self.par.is_main else None)
            if held:
                record["held"] = True
        if self.adapters is not None and not result.skipped and not held:  # exported before the checkpoint:
            exported = self._adapter_export(tenant, record)                # its version is in the checkpoint's table
        t1 = time.perf_counter()
        last = cfg.max_steps is not None and self.step >= cfg.max_steps
        if self.step % cfg.checkpoint_every == 0 or last or stopping or self._checkpoint_due:
            self._checkpoint(batch, record)
            self._checkpoint_due = False
        record["checkpoint_s"] = time.perf_counter() - t1
        if not result.skipped and not held:
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
