"""Samplers: which ready groups a train step may take, and when prompts may be dispatched.

Every sampler keeps the staleness window: a group whose start weight version
is more than ``max_staleness_versions`` behind the trainer is never selected;
the train pump evicts it instead.  The gated samplers also throttle dispatch
on the trainer's progress; that dispatch state (quota, target steps, refills)
is in ``state()``, which every cut captures, so they restore from a replay
checkpoint exactly where they stopped.  A sampler that declares
``supports_replay_checkpoint = False`` restores in shadow mode.

Admission is paced (``Rollouts.has_capacity``): groups in flight plus ready
stay within ``groups_per_step x (max_staleness_versions + 1)``, what the window
lets the trainer take.  The ungated sampler is held to it there; the gated
samplers' quotas keep the same bound by themselves and stay the rule for them
(only a configured ``buffer_capacity_groups`` caps them besides), so a state
re-derived at a restore is never blocked by the cap.

At restore, each sampler checks the document it is handed against what the
restored ledger holds (``check_state``, ``restore_dispatch``): a document that
could not make progress from there is refused naming its field, never trusted
into a run that stalls.  A gated sampler counts in steps of ``groups_per_step``
and records it in its document; restored under another value (an allowed config
change: it is part of the config fingerprint), it re-derives its state from the
ledger's dispatched groups instead.
"""

from __future__ import annotations

import importlib
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, cast

import orjson

from scd.config import Config
from scd.errors import ConfigError, InvariantViolation
from scd.ledger import PromptLedger, PromptState
from scd.replay import GroupMeta


class SamplerStateError(InvariantViolation):
    """A restored sampler document the sampler cannot resume from; ``field`` names the culprit."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"sampler state field {field!r}: {reason}")
        self.field = field


@dataclass(frozen=True, slots=True)
class DispatchedGroup:
    """A prompt dispatched and neither trained nor dropped: in flight, or ready in the replay index."""

    group_id: str
    target_step: int | None


@dataclass(frozen=True, slots=True)
class DispatchView:
    """What a restored cut's ledger says about dispatch; the sampler state restored with it must agree."""

    trainer_step: int
    live: tuple[DispatchedGroup, ...]  # in admission order

    @classmethod
    def of(cls, ledger: PromptLedger, trainer_step: int) -> DispatchView:
        live = tuple(DispatchedGroup(group_id, entry.target_step) for group_id, entry in ledger.entries().items()
                     if entry.state in (PromptState.IN_FLIGHT, PromptState.READY))
        return cls(trainer_step, live)


def _require_fields(state: Mapping[str, object], required: Collection[str], optional: Collection[str] = ()) -> None:
    unknown = sorted(set(state) - set(required) - set(optional))
    if unknown:
        raise SamplerStateError(unknown[0], f"is not part of this sampler's state (its fields: "
                                            f"{sorted({*required, *optional})})")
    missing = sorted(set(required) - set(state))
    if missing:
        raise SamplerStateError(missing[0], "is missing")


def _count(state: Mapping[str, object], field: str) -> int:
    value = state[field]
    # JSON true is a Python int too: a count must be a real integer.
    if type(value) is not int or value < 0:
        raise SamplerStateError(field, f"must be a count (an integer >= 0), got {value!r:.80}")
    return value


def _steps(state: Mapping[str, object], field: str) -> list[int]:
    value = state[field]
    if not isinstance(value, list) or any(type(v) is not int or v < 0 for v in value):
        raise SamplerStateError(field, f"must be a list of step numbers, got {value!r:.80}")
    return value


def _counted_in(state: Mapping[str, object], groups_per_step: int) -> bool:
    """Whether a gated sampler's document counts in steps of ``groups_per_step``.

    A document that does not say is from before documents recorded it: its bundle's config
    fingerprint differs too, so it is restored only with --allow-config-change, and re-derived.
    """
    if "groups_per_step" not in state:
        return False
    recorded = state["groups_per_step"]
    if type(recorded) is not int or recorded < 1:
        raise SamplerStateError("groups_per_step", f"must be an integer >= 1, got {recorded!r:.80}")
    return recorded == groups_per_step


class Sampler:
    name: ClassVar[str]
    supports_replay_checkpoint: ClassVar[bool]

    def __init__(self, max_staleness_versions: int, groups_per_step: int) -> None:
        self.max_staleness_versions = max_staleness_versions
        self.groups_per_step = groups_per_step
        self.dispatched = 0

    def is_stale(self, group: GroupMeta, trainer_version: int) -> bool:
        return group.start_weight_version < trainer_version - self.max_staleness_versions

    def may_dispatch(self, trainer_step: int) -> bool:
        return True

    def on_dispatch(self) -> int | None:
        """Count a dispatch; returns the group's target step, if the sampler assigns one."""
        self.dispatched += 1
        return None

    def on_evicted(self, group: GroupMeta) -> None:
        """A dispatched group was dropped (stale, or filtered for zero reward variance); a gated sampler must not
        count it as delivered."""

    def select(self, ready: Sequence[GroupMeta], trainer_version: int, trainer_step: int) -> list[GroupMeta]:
        """The groups for the next train step, or [] if they are not ready yet. Never a stale one."""
        raise NotImplementedError

    def state(self) -> dict[str, object]:
        return {"dispatched": self.dispatched}

    def load_state(self, state: dict[str, object]) -> None:
        self.dispatched = int(state["dispatched"])  # type: ignore[call-overload]

    def check_state(self, state: Mapping[str, object], view: DispatchView) -> None:
        """Refuse (``SamplerStateError``, naming the field) a restored document this sampler cannot resume
        from, given the dispatched groups of the restored ledger.

        The base sampler's count gates nothing: its document must have exactly the fields of
        ``state()``, the count a count.  A sampler whose state gates dispatch checks it against ``view``.
        """
        fields = self.state().keys()
        _require_fields(state, fields)
        if "dispatched" in fields:
            _count(state, "dispatched")

    def restore_dispatch(self, state: Mapping[str, object], view: DispatchView) -> dict[str, int | None]:
        """Resume from a restored document: checked against ``view``, then loaded.

        Returns the target steps it moves, by group id, for the restore to apply to the ledger and
        the replay index (a gated sampler that re-derives its state); none here.
        """
        self.check_state(state, view)
        self.load_state(dict(state))
        return {}


class WindowedSampler(Sampler):
    """Ungated: oldest in-window groups first."""

    name = "windowed"
    supports_replay_checkpoint = True

    def select(self, ready: Sequence[GroupMeta], trainer_version: int, trainer_step: int) -> list[GroupMeta]:
        fresh = [g for g in ready if not self.is_stale(g, trainer_version)]
        return fresh[: self.groups_per_step] if len(fresh) >= self.groups_per_step else []


class WeightFifoSampler(Sampler):
    """Dispatch gated on the trainer version: at most ``max_staleness + 1`` steps of prompts ahead.

    Selection takes the groups made by the oldest weights first.
    """

    name = "weight_fifo"
    supports_replay_checkpoint = True

    def may_dispatch(self, trainer_step: int) -> bool:
        return self.dispatched < self.groups_per_step * (trainer_step + 1 + self.max_staleness_versions)

    def on_evicted(self, group: GroupMeta) -> None:
        # The quota counts groups that can still be trained: an evicted one frees its slot, or the
        # step it was meant for could never fill.
        self.dispatched -= 1

    def state(self) -> dict[str, object]:
        return {"dispatched": self.dispatched, "groups_per_step": self.groups_per_step}

    def _dispatched_by(self, view: DispatchView) -> int:
        """The quota used at ``view``: ``groups_per_step`` for each step trained, one per group still to train."""
        return view.trainer_step * self.groups_per_step + len(view.live)

    def check_state(self, state: Mapping[str, object], view: DispatchView) -> None:
        """The quota used must be exactly what the ledger accounts for: a higher one never dispatches
        enough to fill a step (the run stalls), a lower one dispatches past the staleness window.
        Counted in another groups_per_step, the document is checked for form only (it is re-derived)."""
        _require_fields(state, ("dispatched",), ("groups_per_step",))
        dispatched = _count(state, "dispatched")
        if not _counted_in(state, self.groups_per_step):
            return
        expected = self._dispatched_by(view)
        if dispatched != expected:
            raise SamplerStateError("dispatched", f"is {dispatched}, but {view.trainer_step} steps of "
                                                  f"{self.groups_per_step} groups were trained and the ledger holds "
                                                  f"{len(view.live)} dispatched groups not trained yet: it must be "
                                                  f"{expected}")

    def restore_dispatch(self, state: Mapping[str, object], view: DispatchView) -> dict[str, int | None]:
        """Counted in another groups_per_step, the quota used is re-derived from the ledger (no target
        steps to move): the groups in flight and ready are trained in the new steps, then dispatch goes on."""
        if _counted_in(state, self.groups_per_step):
            return super().restore_dispatch(state, view)
        self.check_state(state, view)
        self.dispatched = self._dispatched_by(view)
        return {}

    def select(self, ready: Sequence[GroupMeta], trainer_version: int, trainer_step: int) -> list[GroupMeta]:
        fresh = sorted((g for g in ready if not self.is_stale(g, trainer_version)),
                       key=lambda g: g.end_weight_version)
        return fresh[: self.groups_per_step] if len(fresh) >= self.groups_per_step else []


class InOrderSampler(Sampler):
    """Each dispatched group gets a target step; step s trains exactly its own groups.

    A group evicted as stale leaves its step one short; its target goes to the
    next dispatch, ahead of the quota, so step s always fills and the run never stalls.
    """

    name = "in_order"
    supports_replay_checkpoint = True

    def __init__(self, max_staleness_versions: int, groups_per_step: int) -> None:
        super().__init__(max_staleness_versions, groups_per_step)
        self.refill: list[int] = []

    def may_dispatch(self, trainer_step: int) -> bool:
        ahead = self.dispatched // self.groups_per_step - trainer_step
        return bool(self.refill) or ahead <= self.max_staleness_versions

    def on_dispatch(self) -> int | None:
        if self.refill:
            return self.refill.pop(0)
        target = self.dispatched // self.groups_per_step
        self.dispatched += 1
        return target

    def on_evicted(self, group: GroupMeta) -> None:
        if group.target_step is not None:
            self.refill.append(group.target_step)
            self.refill.sort()

    def state(self) -> dict[str, object]:
        return {"dispatched": self.dispatched, "refill": list(self.refill), "groups_per_step": self.groups_per_step}

    def load_state(self, state: dict[str, object]) -> None:
        super().load_state(state)
        self.refill = list(state.get("refill", []))  # type: ignore[call-overload]

    def check_state(self, state: Mapping[str, object], view: DispatchView) -> None:
        """Every dispatched group and every refill names a step not trained yet, and each such step gets
        exactly its groups from the two: ``groups_per_step`` for a step dispatched whole, the remainder
        for the step being dispatched, none beyond.  Any other count leaves a step that can never fill
        (``select`` takes exactly ``groups_per_step``): the run would stall.  Counted in another
        groups_per_step, the document is checked for form only (it is re-derived)."""
        _require_fields(state, ("dispatched", "refill"), ("groups_per_step",))
        dispatched, refill = _count(state, "dispatched"), _steps(state, "refill")
        step = view.trainer_step
        for group in view.live:
            if group.target_step is None or group.target_step < step:
                raise SamplerStateError("target_step", f"the ledger's dispatched group {group.group_id} has target "
                                                       f"step {group.target_step}, and the next step to train is "
                                                       f"{step}: it would never be trained")
        if refill != sorted(refill) or (refill and refill[0] < step):
            raise SamplerStateError("refill", f"{refill[:10]} must list steps in order, none before the next step "
                                              f"to train ({step})")
        if not _counted_in(state, self.groups_per_step):
            return
        per_step = self.groups_per_step
        if dispatched < step * per_step:
            raise SamplerStateError("dispatched", f"is {dispatched}, but {step} steps of {per_step} groups were "
                                                  "trained")
        next_step, partial = divmod(dispatched, per_step)
        if next_step - step > len(view.live) + len(refill):
            raise SamplerStateError("dispatched", f"is {dispatched}: steps {step} to {next_step - 1} would each "
                                                  f"need {per_step} groups, and the ledger holds {len(view.live)} "
                                                  f"with {len(refill)} to refill")
        live = Counter(group.target_step for group in view.live)
        refills = Counter(refill)
        for target in sorted({*range(step, next_step + 1), *live, *refills}):
            needed = per_step if target < next_step else partial if target == next_step else 0
            have = live[target] + refills[target]
            if have != needed:
                # Too many refills for a step the ledger alone does not overfill: the refill is at fault.
                field = "refill" if live[target] <= needed < have else "dispatched"
                raise SamplerStateError(field, f"step {target} would get {live[target]} groups from the ledger and "
                                               f"{refills[target]} refills; with dispatched = {dispatched} and "
                                               f"groups_per_step = {per_step} it takes exactly {needed}: it "
                                               "could never be trained")

    def restore_dispatch(self, state: Mapping[str, object], view: DispatchView) -> dict[str, int | None]:
        """Counted in another groups_per_step, the state is re-derived: the ledger's dispatched groups,
        in the order of their old target steps, fill the steps from the next one to train on,
        ``groups_per_step`` each (the last one partly); nothing is left to refill, and dispatch goes on
        after them.  Returns the groups whose target step moved."""
        if _counted_in(state, self.groups_per_step):
            return super().restore_dispatch(state, view)
        self.check_state(state, view)
        # check_state proved every target an int; sorted() is stable: admission order within a step.
        in_order = sorted(view.live, key=lambda group: cast(int, group.target_step))
        self.dispatched = view.trainer_step * self.groups_per_step + len(in_order)
        self.refill = []
        retargets: dict[str, int | None] = {}
        for position, group in enumerate(in_order):
            target = view.trainer_step + position // self.groups_per_step
            if target != group.target_step:
                retargets[group.group_id] = target
        return retargets

    def select(self, ready: Sequence[GroupMeta], trainer_version: int, trainer_step: int) -> list[GroupMeta]:
        mine = [g for g in ready if g.target_step == trainer_step and not self.is_stale(g, trainer_version)]
        return mine if len(mine) == self.groups_per_step else []


BUILTIN_SAMPLERS: dict[str, type[Sampler]] = {
    cls.name: cls for cls in (WindowedSampler, WeightFifoSampler, InOrderSampler)
}


# The methods through which a sampler keeps dispatch state of its own (quotas, targets).
_DISPATCH_METHODS = ("may_dispatch", "on_dispatch", "on_evicted")


def gates_dispatch(cls: type[Sampler]) -> bool:
    """Whether ``cls`` keeps dispatch state, judged by what it overrides, not by what it declares."""
    return any(getattr(cls, m) is not getattr(Sampler, m) for m in _DISPATCH_METHODS)


def dispatch_state_round_trips(cls: type[Sampler], window: int, per_step: int) -> bool:
    """Whether a copy restored from ``state()`` dispatches exactly like the original.

    Exercised, not trusted: dispatch, an eviction and a few steps, then the two must agree on
    every gate and every target from there on.
    """
    original = cls(window, per_step)
    evicted = False
    for step in range(3):
        for _ in range(2 * per_step):
            if not original.may_dispatch(step):
                break
            target = original.on_dispatch()
            if not evicted:
                original.on_evicted(_probe_group(target))
                evicted = True
    copy = cls(window, per_step)
    copy.load_state(orjson.loads(orjson.dumps(original.state())))
    for step in range(3, 6):
        for _ in range(per_step + 1):
            gates = (original.may_dispatch(step), copy.may_dispatch(step))
            if gates[0] != gates[1]:
                return False
            if gates[0] and original.on_dispatch() != copy.on_dispatch():
                return False
    return True


def _probe_group(target: int | None) -> GroupMeta:
    return GroupMeta(group_id="e0-p0", epoch=0, prompt_id=0, sample_ids=("e0-p0/0",), start_weight_version=0,
                     end_weight_version=0, prompt_len=1, seq_lens=(2,), rewards=(0.0,), weight_versions=(0,),
                     target_step=target)


def build_sampler(config: Config) -> Sampler:
    """The configured sampler, its declared capability checked against its behaviour.

    Called before Ray starts, so a bad custom sampler exits 2 naming the key, not a traceback.
    A sampler that gates dispatch may claim replay recovery only if its dispatch state really
    survives ``state()`` / ``load_state()``.
    """
    spec = config.async_rl.sampler.name
    key = "async_rl.sampler.name"
    if ":" in spec:
        module_name, _, class_name = spec.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except Exception as exc:  # importing runs the module: a SyntaxError, or whatever it raises
            raise ConfigError(key, f"cannot load custom sampler {spec}: {type(exc).__name__}: {exc}") from None
    else:
        cls = BUILTIN_SAMPLERS[spec]
    if not (isinstance(cls, type) and issubclass(cls, Sampler)):
        raise ConfigError(key, f"{spec} is not a subclass of scd.samplers.Sampler")
    if not isinstance(getattr(cls, "supports_replay_checkpoint", None), bool):
        raise ConfigError(key, f"{spec} must declare supports_replay_checkpoint as a bool")
    if not isinstance(getattr(cls, "name", None), str):
        raise ConfigError(key, f"{spec} must declare its name as a str")
    if cls.select is Sampler.select:
        raise ConfigError(key, f"{spec} does not implement select()")
    window, per_step = config.async_rl.sampler.max_staleness_versions, config.trainer.groups_per_step
    try:
        sampler = cls(window, per_step)
        recoverable = not gates_dispatch(cls) or dispatch_state_round_trips(cls, window, per_step)
    except Exception as exc:
        raise ConfigError(key, f"{spec} could not be exercised: {exc!r}") from None
    if cls.supports_replay_checkpoint and not recoverable:
        raise ConfigError(key, f"{spec} declares supports_replay_checkpoint but gates dispatch (it overrides "
                               f"{[m for m in _DISPATCH_METHODS if getattr(cls, m) is not getattr(Sampler, m)]}) "
                               "with state that state()/load_state() do not carry: it would not survive a restore")
    return sampler
