"""Samplers: which ready groups a train step may take, and when prompts may be dispatched.

Every sampler keeps the staleness window: a group whose start weight version
is more than ``max_staleness_versions`` behind the trainer is never selected;
the train pump evicts it instead.  The gated samplers also throttle dispatch
on the trainer's progress; that dispatch state (quota, target steps, refills)
is in ``state()``, which every cut captures, so they restore from a replay
checkpoint exactly where they stopped.  A sampler that declares
``supports_replay_checkpoint = False`` restores in shadow mode.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import ClassVar

import orjson

from scd.config import Config
from scd.errors import ConfigError
from scd.replay import GroupMeta


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
        """A dispatched group was dropped as stale; a gated sampler must not count it as delivered."""

    def select(self, ready: Sequence[GroupMeta], trainer_version: int, trainer_step: int) -> list[GroupMeta]:
        """The groups for the next train step, or [] if they are not ready yet. Never a stale one."""
        raise NotImplementedError

    def state(self) -> dict[str, object]:
        return {"dispatched": self.dispatched}

    def load_state(self, state: dict[str, object]) -> None:
        self.dispatched = int(state["dispatched"])  # type: ignore[call-overload]


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
        return {"dispatched": self.dispatched, "refill": list(self.refill)}

    def load_state(self, state: dict[str, object]) -> None:
        super().load_state(state)
        self.refill = list(state.get("refill", []))  # type: ignore[call-overload]

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
        except (ImportError, AttributeError) as exc:
            raise ConfigError(key, f"cannot load custom sampler {spec}: {exc}") from None
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
