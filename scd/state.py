"""Controller state: what a checkpoint cut captures, and the only code that changes it.

The state is the prompt ledger, the replay index, the prompt order (the
dataloader cursor), the sampler's dispatch state, the trainer counters, the
prompts' fates per bucket (``scd.skew``) and the run's identity for experiment
trackers.

The rule, said once: **every change to this state happens inside a mutation
holding the checkpoint barrier's shared side** (``barrier.mutation``, tagged
with a ``MutationKind``), counters and ledger prunes included.  A cut is taken under
the exclusive side, so it sees every change whole or not at all.  There is no
other way in or out for checkpoints: ``snapshot()`` reads a cut, ``install()``
puts a restored one back before any mutation has run.

TQ rows are written here too, inside the same mutations (commit puts, consume
and evict clear), through the ``RowStore`` the daemon hands in: the rows and
the index that names them change together.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
import msgspec

from scd.barrier import CheckpointBarrier, MutationKind
from scd.dataloader import DataloaderState, PromptOrder
from scd.errors import InvariantViolation
from scd.ledger import DropReason, PromptLedger, PromptState, StagedSiblings, staged_key
from scd.records import Completion, Rollout
from scd.replay import GroupMeta, ReplayIndex
from scd.samplers import DispatchView, Sampler
from scd.schema import RunIdentity, new_run_identity
from scd.skew import Fate, FateCounts, PromptBuckets, PromptFates


class RowStore(Protocol):
    """The data plane's writing side, as the state's mutations use it: one key per group, its id."""

    async def put_group(self, key: str, rows: Sequence[Rollout]) -> None: ...

    async def put_siblings(self, keys: Sequence[str], completions: Sequence[Completion]) -> None: ...

    async def clear(self, keys: Sequence[str]) -> None: ...

    def clear_later(self, keys: Sequence[str]) -> None: ...

    async def discard_failed_put(self, keys: Sequence[str]) -> None: ...


@dataclass(slots=True)
class Cut:
    """The state at one instant, read under the exclusive barrier; later mutations never reach it."""

    step: int
    weight_version: int
    dataloader: DataloaderState
    groups: list[GroupMeta]
    ledger: PromptLedger  # a copy (immutable entries): turned into its document off the hold
    sampler_name: str
    sampler_state: dict[str, Any]
    supports_replay_checkpoint: bool
    replay_digest: str
    captured_at: float
    fates: FateCounts
    run: RunIdentity
    evaluated_steps: list[int]
    held_evals: list[dict[str, Any]]  # ControllerState.held_evals: reported once this cut's bundle is committed

    def keys(self) -> set[str]:
        """Every TQ key the cut names: its ready groups and its in-flight groups' staged siblings."""
        return {g.group_id for g in self.groups} | self.ledger.staged_keys()


@dataclass(slots=True)
class Restored:
    """What a verified bundle puts back; ``index`` is empty when the sampler restores in shadow mode."""

    step: int
    weight_version: int
    dataloader: DataloaderState
    index: ReplayIndex
    ledger: PromptLedger
    sampler_state: dict[str, Any]
    shadow: bool
    fates: FateCounts
    run: RunIdentity | None  # None from a bundle that predates it: the run keeps a new identity
    # The bundle is not a clean exit's (its trigger not final or shutdown): a crash came before this restore.
    after_crash: bool = True
    evaluated_steps: list[int] = field(default_factory=list)
    held_evals: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class StateStatistics:
    trainer_step: int
    weight_version: int
    epoch: int
    replay_groups: int
    replay_rows: int
    in_flight: int
    committed_groups: int
    evicted_stale: int
    filtered_groups: int  # complete groups with no reward variance, never committed (this process)
    ledger: dict[str, int]
    staged_siblings: int  # finished siblings of in-flight groups staged in TQ now (scd_staged_siblings)


class ControllerState:
    def __init__(self, num_prompts: int, seed: int, sampler: Sampler, rows: RowStore,
                 barrier: CheckpointBarrier) -> None:
        self.ledger = PromptLedger()
        self.replay = ReplayIndex()
        self.order = PromptOrder(num_prompts, DataloaderState(seed=seed))
        self.sampler = sampler
        self.barrier = barrier
        self.trainer_step = 0
        self.weight_version = 0
        self.in_flight = 0
        self.committed_groups = 0
        self.evicted_stale = 0
        self.filtered_groups = 0
        self.fates = PromptFates(PromptBuckets.single(num_prompts))
        self.run = new_run_identity()
        self.evaluated_steps: list[int] = []  # held-out evals finished (scd.evaluation.EvalSchedule)
        # What a prompt left in flight counts when generated again: no restore, or a clean exit's bundle, drained
        # it (redispatched); a crash's bundle lost what was generated for it since (``install``).
        self._restored_fate = Fate.REDISPATCHED
        # Finished evals not reported yet, each its ``eval`` event's fields: the next cut holds them, and they
        # are reported once its bundle is committed (``scd.telemetry.eval_reports``), so a crash never
        # reports one twice nor loses one.
        self.held_evals: list[dict[str, Any]] = []
        self._run_clock = time.monotonic()  # when this process's share of the run's seconds began
        self._rows = rows

    def statistics(self) -> StateStatistics:
        return StateStatistics(
            trainer_step=self.trainer_step, weight_version=self.weight_version, epoch=self.order.state.epoch,
            replay_groups=len(self.replay), replay_rows=self.replay.rows, in_flight=self.in_flight,
            committed_groups=self.committed_groups, evicted_stale=self.evicted_stale,
            filtered_groups=self.filtered_groups, ledger=self.ledger.counts(),
            staged_siblings=self.ledger.staged_count(),
        )

    def use_buckets(self, buckets: PromptBuckets) -> None:
        """Count fates in ``buckets`` (the prompts' token lengths are known once the policy encoded them)."""
        if self.barrier.statistics().mutations:
            raise InvariantViolation("prompt buckets changed after the controller state was mutated")
        self.fates = PromptFates(buckets)

    def window_start(self) -> int:
        """The oldest weight version whose rollouts a train step may still take."""
        return self.weight_version - self.sampler.max_staleness_versions

    # ---- mutations -------------------------------------------------------------------------------

    async def admit(self) -> str:
        """Advance the cursor and record the prompt in flight, as one mutation (atomic admission)."""
        async with self.barrier.mutation(MutationKind.ADMIT):
            epoch, prompt_id = self.order.take()
            group_id = self.ledger.admit(epoch, prompt_id, self.sampler.on_dispatch())
            self.fates.count(prompt_id, Fate.ADMITTED)
            self.in_flight += 1
        return group_id

    async def redispatch_in_flight(self) -> list[str]:
        """Every prompt the ledger holds in flight: a run that stopped mid-generation left them there."""
        async with self.barrier.mutation(MutationKind.REDISPATCH):
            pending = self.ledger.in_state(PromptState.IN_FLIGHT)
            self.in_flight = len(pending)
        return pending

    async def count_generated_again(self, group_ids: Sequence[str]) -> None:
        """The in-flight prompts of a restored cut (or of a drained run, run again) that generation runs for
        again, each counted lost to the crash before the restore (or redispatched after a clean exit).  One
        whose every sibling the cut kept is not: nothing of it was lost, it only awaits its commit."""
        async with self.barrier.mutation(MutationKind.REDISPATCH):
            for group_id in group_ids:
                self.fates.count(self.ledger.entry(group_id).prompt_id, self._restored_fate)

    async def note_redispatch(self, group_id: str, reason: str) -> None:
        async with self.barrier.mutation(MutationKind.REDISPATCH):
            self.ledger.note_redispatch(group_id, reason)
            self.fates.count(self.ledger.entry(group_id).prompt_id, Fate.REDISPATCHED)

    async def _put_or_discard(self, keys: list[str], put: Awaitable[None]) -> None:
        """Run ``put``; if it fails, the data it may have written under ``keys`` is cleared.

        The original error propagates; a failing clear is attached to it as context.
        """
        try:
            await put
        except BaseException as put_error:
            with anyio.CancelScope(shield=True):
                try:
                    await self._rows.discard_failed_put(keys)
                except Exception as clear_error:
                    put_error.add_note(f"clearing the rows it may have written failed too: {clear_error!r}")
                    raise put_error from clear_error
            raise

    async def stage_siblings(self, finished: Sequence[tuple[str, int, Completion]]) -> None:
        """Finished siblings (group id, index, completion) of in-flight groups: staged in TQ in one
        put and recorded in the ledger, together."""
        async with self.barrier.mutation(MutationKind.STAGE):
            for group_id, index, _ in finished:
                state = self.ledger.state_of(group_id)
                if state is not PromptState.IN_FLIGHT:
                    raise InvariantViolation(f"sibling {index} staged for group {group_id} whose ledger state "
                                             f"is {state}")
            keys = [staged_key(group_id, index, c.weight_version) for group_id, index, c in finished]
            await self._put_or_discard(keys, self._rows.put_siblings(keys, [c for _, _, c in finished]))
            for group_id, index, completion in finished:
                self.ledger.stage(group_id, index, completion.weight_version)

    async def unstage_siblings(self, group_id: str, siblings: StagedSiblings) -> None:
        """Staged siblings that will be generated again (out of the staleness window): cleared and forgotten."""
        async with self.barrier.mutation(MutationKind.STAGE):
            await self._rows.clear([staged_key(group_id, index, version) for index, version in siblings])
            self.ledger.unstage(group_id, siblings)

    async def commit(self, group: GroupMeta, rows: Sequence[Rollout]) -> None:
        """Put a group's rows and index it; its staged siblings' keys are cleared (the group holds them now).

        If the put fails, the rows it may have written are cleared and the group stays in flight.
        """
        async with self.barrier.mutation(MutationKind.COMMIT):
            state = self.ledger.state_of(group.group_id)
            if state is not PromptState.IN_FLIGHT:
                raise InvariantViolation(f"commit of group {group.group_id} whose ledger state is {state}")
            await self._put_or_discard([group.group_id], self._rows.put_group(group.group_id, rows))
            self._rows.clear_later(self.ledger.entry(group.group_id).staged_keys())
            self.replay.add(group)
            self.ledger.advance(group.group_id, PromptState.READY)
            self.in_flight -= 1
            self.committed_groups += 1

    async def filter(self, group: GroupMeta) -> None:
        """A complete group whose rewards are all equal (no GRPO signal) leaves flight without a commit: its
        prompt is done for the epoch (ledger and fate: filtered), its staged siblings' keys are cleared, and a
        gated sampler's quota frees its slot (as for a group dropped stale), so admission refills in its place."""
        async with self.barrier.mutation(MutationKind.COMMIT):
            state = self.ledger.state_of(group.group_id)
            if state is not PromptState.IN_FLIGHT:
                raise InvariantViolation(f"filter of group {group.group_id} whose ledger state is {state}")
            self._rows.clear_later(self.ledger.entry(group.group_id).staged_keys())
            self.ledger.advance(group.group_id, PromptState.FILTERED)
            self.sampler.on_evicted(group)
            self.fates.count(group.prompt_id, Fate.FILTERED)
            self.in_flight -= 1
            self.filtered_groups += 1

    async def replace_ready_groups(self, groups: Sequence[GroupMeta]) -> None:
        """Ready groups scored again (a restore under a changed reward set), each put in place of the group of
        its id in the replay index; their rows in TQ are the same."""
        async with self.barrier.mutation(MutationKind.RESCORE):
            for group in groups:
                if group.group_id not in self.replay:
                    raise InvariantViolation(f"rescore of group {group.group_id} that is not in the replay index")
            for group in groups:
                self.replay.replace(group)

    async def _remove(self, kind: MutationKind, groups: Sequence[GroupMeta], state: PromptState,
                      reason: str = "") -> None:
        for group in groups:
            if group.group_id not in self.replay:
                raise InvariantViolation(f"{kind} of group {group.group_id} that is not in the replay index")
        await self._rows.clear([g.group_id for g in groups])
        for group in groups:
            self.replay.remove(group.group_id)
            self.ledger.advance(group.group_id, state, reason)

    async def finish_step(self, batch: Sequence[GroupMeta]) -> None:
        """A train step's groups are consumed and the counters advance, together."""
        async with self.barrier.mutation(MutationKind.CONSUME):
            await self._remove(MutationKind.CONSUME, batch, PromptState.CONSUMED)
            for group in batch:
                self.fates.count(group.prompt_id, Fate.TRAINED)
            self.trainer_step += 1
            self.weight_version += 1
            self.ledger.prune_finished_epochs(self.order.state.epoch)

    async def evict_stale(self, *, at_restore: bool = False) -> list[GroupMeta]:
        """Drop every group the sampler calls stale at the current version; returns them.

        ``at_restore``: the restore evicts restored groups that went stale while the run was down.
        """
        stale = [g for g in self.replay.groups() if self.sampler.is_stale(g, self.weight_version)]
        if stale:
            async with self.barrier.mutation(MutationKind.EVICT):
                await self._remove(MutationKind.EVICT, stale, PromptState.DROPPED, DropReason.STALE)
                for group in stale:
                    self.sampler.on_evicted(group)
                    self.fates.count(group.prompt_id, Fate.EVICTED if at_restore else Fate.DROPPED_STALE)
                self.evicted_stale += len(stale)
        return stale

    # ---- checkpoints -----------------------------------------------------------------------------

    def snapshot(self) -> Cut:
        """The cut; only under the barrier's exclusive side, where no mutation can interleave.

        Cheap by construction (milliseconds at 10k groups): lists and maps are copied by
        reference to immutable records; documents are built by the writer.
        """
        if not self.barrier.statistics().exclusive_active:
            raise InvariantViolation("a cut was read without holding the checkpoint barrier exclusively")
        dl = self.order.state
        return Cut(
            step=self.trainer_step, weight_version=self.weight_version,
            dataloader=DataloaderState(seed=dl.seed, epoch=dl.epoch, cursor=dl.cursor),
            groups=self.replay.groups(), ledger=self.ledger.copy(), sampler_name=self.sampler.name,
            sampler_state=self.sampler.state(), supports_replay_checkpoint=self.sampler.supports_replay_checkpoint,
            replay_digest=self.replay.digest(), captured_at=time.time(), fates=self.fates.counts(),
            run=msgspec.structs.replace(self.run, run_s=self.run_seconds()),
            evaluated_steps=list(self.evaluated_steps), held_evals=list(self.held_evals),
        )

    # The eval records change outside the barrier: only the train pump evaluates and takes cuts, and the
    # writer's ``evals_reported`` runs while it writes, when the train pump takes no cut.

    def note_evaluated(self, step: int) -> None:
        """A held-out evaluation of ``step`` finished: every later cut records it (``EvalSchedule``)."""
        self.evaluated_steps.append(step)

    def hold_eval(self, record: dict[str, Any]) -> None:
        """An evaluation finished, not reported yet: the next cut holds it (``record``: its event's fields)."""
        self.note_evaluated(record["step"])
        self.held_evals.append(record)

    def evals_reported(self, steps: Sequence[int]) -> None:
        """The evaluations of ``steps`` are reported: later cuts hold them no more."""
        self.held_evals = [record for record in self.held_evals if record["step"] not in steps]

    def run_seconds(self) -> float:
        """How long the logical run has run, across its processes: the restored cut's seconds, then this
        process's monotonic clock since."""
        return self.run.run_s + time.monotonic() - self._run_clock

    def install(self, restored: Restored) -> None:
        """Put a verified cut back; only before any mutation has run.

        In shadow mode (a sampler that does not restore its dispatch state) the ready
        groups and staged siblings were not loaded: their prompts go back in flight with
        fresh target steps, to be generated whole.
        """
        if self.barrier.statistics().mutations:
            raise InvariantViolation("restore after the controller state was already mutated")
        self.trainer_step = restored.step
        self.weight_version = restored.weight_version
        self.order.restore(restored.dataloader.seed, restored.dataloader.epoch, restored.dataloader.cursor)
        self.ledger = restored.ledger
        self.replay = restored.index
        self.fates.load(restored.fates)
        self.run = restored.run or self.run
        self.evaluated_steps = list(restored.evaluated_steps)
        self.held_evals = list(restored.held_evals)
        self._run_clock = time.monotonic()
        if restored.shadow:
            self.sampler.load_state({"dispatched": self.trainer_step * self.sampler.groups_per_step})
            for group_id in self.ledger.in_state(PromptState.READY):
                self.ledger.requeue_after_shadow_restore(group_id)
            for group_id in self.ledger.in_state(PromptState.IN_FLIGHT):
                self.ledger.retarget(group_id, self.sampler.on_dispatch())
                # TQ's snapshot was not loaded: staged siblings are generated again.
                self.ledger.unstage(group_id, self.ledger.entry(group_id).staged)
        else:
            # The sampler checks its document against the ledger (re-deriving it if it counts in another
            # groups_per_step); the target steps it moves, it moves in the ledger and the index here.
            view = DispatchView.of(self.ledger, self.trainer_step)
            for group_id, target_step in self.sampler.restore_dispatch(restored.sampler_state, view).items():
                self.ledger.retarget(group_id, target_step)
                if group_id in self.replay:
                    self.replay.retarget(group_id, target_step)
        # A clean exit's in-flight prompts were drained, not lost: they are dispatched again.  Counted once the
        # restore knows which ones generation must run for again (``count_generated_again``).
        self._restored_fate = Fate.LOST_TO_CRASH if restored.after_crash else Fate.REDISPATCHED

