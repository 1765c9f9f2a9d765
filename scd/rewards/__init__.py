"""Reward functions: what a completion scores, from the config's ``[[task.rewards]]``.

A completion's reward is the weighted sum of its reward functions' values.  A function is a built-in
(``match``, ``exact``, ``math``, ``regex``), a Python function named ``module:function``, or ``http``: a
remote scorer that takes completions in batches.  ``resolve_rewards`` resolves every one of them, and
``scd run`` calls it right after loading the config, so a typo fails before Ray starts and names its key;
``load_rewards`` makes the ``Scorer`` whose ``score`` judges completions.

A Python reward is ``reward(prompt, completion, answer, row, **args) -> float | dict[str, float]``, plain
or ``async def``: ``prompt`` is the dataset's prompt field as given (text, or chat messages), ``answer``
any JSON value, ``row`` the row's other columns.  A dict's ``"score"`` is the reward; its other keys are
reported beside it as parts (as verl's and TRL's users expect), and a dict without ``"score"`` fails.

Sync user code never runs in scd's process: a sync function, the built-ins included, runs in one of
``task.reward_workers`` worker processes (``scd.rewards.pool``), killed at its call's deadline.  An
async function runs on the event loop, so it must only await (CPU work there stalls the loop: such a
reward is written sync); the HTTP scorer runs on the loop's own I/O.  Every call has a deadline, counted
from when the call starts, not while it waits its turn.  A call that raises, misses its deadline, or
returns anything but a finite number (or a dict of them with a ``"score"``) fails: the run stops with a
``RewardError`` (``task.reward_errors = "stop"``), or the function scores 0 on that completion and the
failure is counted (``"zero"``).

An HTTP reward whose service cannot be reached, answers 429 or 5xx, or does not answer in time, after its
retries, is no failure of the completion, and neither is a Python reward that raises ``RewardUnavailable``
("my service is down, ask again later"; async or sync alike, the exception crosses from a worker process
as its cause): ``score`` raises ``RewardUnavailable`` whatever ``task.reward_errors`` says, carrying every
answer the other rewards (and the HTTP sub-batches that were answered) gave, and the caller
(``scd.scoring.scores_when_available``) waits for the service and asks again, handing those answers back,
so only what did not answer is asked again: no reward is paid twice for a completion.  The HTTP rewards are
asked first and the others once they answered, so an HTTP outage pays nothing else meanwhile.  Scoring an outage
0 would train the policy on noise for as long as it lasts.  An HTTP reward whose service has never answered
since scd started is refused (``ConfigError``, exit 2, naming its URL) once ``task.reward_start_timeout_s``
has passed since its first request (``Scorer.answered_before``: not in a run resumed past step 0, whose
rewards answered in an earlier process, unless the restore changed the reward's URL): a wrong URL fails the run
instead of waiting for ever.
"""

from __future__ import annotations

import dataclasses
import email.utils
import logging
import random
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol, TypeVar

import aiohttp
import anyio
import msgspec
import orjson

from scd.config import RewardConfig, TaskConfig
from scd.errors import ConfigError, RewardError
from scd.rewards.functions import (
    HTTP_REWARD,
    SCORE,
    Failure,
    Outcome,
    PromptField,
    args_as,
    checked,
    load_function,
    match_score,
)
from scd.rewards.pool import PoolCall, PoolStatistics, WorkerPool
from scd.tasks import Prompt
from scd.telemetry import metrics

__all__ = ["Answers", "Outage", "RewardInput", "RewardUnavailable", "Scored", "Scorer", "ScorerStatistics",
           "load_rewards", "match_score", "resolve_rewards"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class RewardInput:
    """One completion to judge, with its prompt's fields as the dataset has them."""

    prompt_id: int
    prompt: PromptField
    completion: str
    answer: Any
    row: dict[str, Any]  # the row's columns other than prompt and answer
    where: str  # the prompt's file:line (Parquet: file:row N), or the built-in's name and index: what errors name

    @classmethod
    def of(cls, prompt: Prompt, completion: str) -> RewardInput:
        """``completion`` of ``prompt``, with the fields the dataset gave it."""
        return cls(prompt.prompt_id, prompt.prompt, completion, prompt.answer, prompt.row, prompt.where)


@dataclass(frozen=True, slots=True)
class Scored:
    """A completion's reward and what it is made of."""

    total: float  # the sum of each function's value times its weight
    # Each function's unweighted value by reward name; a dict-returning function's parts as "name/part".
    # A function that failed under reward_errors = "zero" reads 0 under its name.
    components: dict[str, float]


@dataclass(slots=True)
class Answers:
    """What each reward answered on each completion of one ``score`` call so far: ``outcomes[reward][item]``,
    None where it has not answered yet."""

    outcomes: list[list[Outcome | None]]

    def missing(self, reward: int) -> list[int]:
        """The completions ``reward`` has not answered on yet."""
        return [item for item, outcome in enumerate(self.outcomes[reward]) if outcome is None]


class RewardUnavailable(Exception):
    """A reward's service did not answer (an HTTP reward's retries spent, or a Python reward raised this):
    the completions are not scored, and none of them is at fault.

    A Python reward raises it as ``RewardUnavailable("the judge at ... does not answer")``: scd waits and
    asks again later.  ``score`` raises it naming the ``reward``, with the ``answers`` it got meanwhile,
    which the next ``score`` of the same completions is handed back."""

    def __init__(self, detail: str, *, reward: str = "", answers: Answers | None = None) -> None:
        super().__init__(f"reward {reward!r} is unavailable: {detail}" if reward else detail)
        self.reward = reward
        self.detail = detail
        self.answers = answers


@dataclass(frozen=True, slots=True)
class Outage:
    """Which rewards' services do not answer now, and since when."""

    why: str  # each unavailable reward and what its last call met; "" when every reward answers
    seconds: float  # how long the oldest of them has not answered (0 without one)


@dataclass(frozen=True, slots=True)
class ScorerStatistics:
    calls: int  # function calls (one per completion) and HTTP requests (one per batch, each retry again)
    errors: int  # completions a function failed on, whatever reward_errors says
    errors_zeroed: int  # of those, scored 0 under reward_errors = "zero"
    timeouts: int  # calls past their deadline (an HTTP request: per attempt)
    http_retries: int  # HTTP requests sent again after a connection error, a 429 or 5xx, or a timeout
    pool: PoolStatistics  # the worker processes of the sync rewards


@dataclass(slots=True)
class _Counts:
    calls: int = 0
    errors: int = 0
    errors_zeroed: int = 0
    timeouts: int = 0
    http_retries: int = 0


async def _gather(calls: Sequence[Callable[[], Awaitable[_T]]]) -> list[_T]:
    """Run the calls concurrently; their results in the calls' order."""
    results: dict[int, _T] = {}

    async def run(index: int, call: Callable[[], Awaitable[_T]]) -> None:
        results[index] = await call()

    async with anyio.create_task_group() as tg:
        for index, call in enumerate(calls):
            tg.start_soon(run, index, call)
    return [results[index] for index in range(len(calls))]


# ---- the reward kinds --------------------------------------------------------------------------


@dataclass(slots=True)
class _Context:
    """What every reward of one scorer shares."""

    timeout_s: float
    counts: _Counts
    pool: WorkerPool
    http: aiohttp.ClientSession | None = None

    def http_session(self) -> aiohttp.ClientSession:
        # Made on first use: a session belongs to the running loop, and the scorer is loaded before there is one.
        if self.http is None:
            # No connection limit or total timeout of aiohttp's own: each HTTP reward's limiter and deadline bound it.
            self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                              timeout=aiohttp.ClientTimeout(total=None))
        return self.http


class _Reward(Protocol):
    name: str
    function: str  # as configured: what an error names
    weight: float

    async def evaluate(self, items: Sequence[RewardInput], context: _Context) -> list[Outcome]: ...


@dataclass(frozen=True, slots=True)
class _SyncReward:
    """A built-in or a sync Python function, called once per completion in the scorer's worker processes."""

    name: str
    function: str
    weight: float
    index: int  # its place among the rewards every worker process loads

    async def evaluate(self, items: Sequence[RewardInput], context: _Context) -> list[Outcome]:
        return await _gather([partial(self._one, item, context) for item in items])

    async def _one(self, item: RewardInput, context: _Context) -> Outcome:
        context.counts.calls += 1
        outcome = await context.pool.call(PoolCall(self.index, item.prompt, item.completion, item.answer, item.row),
                                          context.timeout_s)
        if isinstance(outcome, Failure) and outcome.cause == "timeout":
            context.counts.timeouts += 1
        return outcome


@dataclass(frozen=True, slots=True)
class _AsyncReward:
    """An ``async def`` Python function, awaited on the event loop once per completion."""

    name: str
    function: str
    weight: float
    call: Callable[..., Awaitable[object]]  # its args bound

    async def evaluate(self, items: Sequence[RewardInput], context: _Context) -> list[Outcome]:
        return await _gather([partial(self._one, item, context) for item in items])

    async def _one(self, item: RewardInput, context: _Context) -> Outcome:
        context.counts.calls += 1
        try:
            with anyio.fail_after(context.timeout_s):
                try:
                    value = await self.call(item.prompt, item.completion, item.answer, item.row)
                except RewardUnavailable as exc:  # the reward's own service is down: ask again later
                    return Failure("unavailable", exc.detail)
                except Exception as exc:
                    return Failure("exception", f"raised {type(exc).__name__}: {exc}")
        except TimeoutError:
            context.counts.timeouts += 1
            return Failure("timeout", f"took longer than task.reward_timeout_s = {context.timeout_s} s")
        return checked(value)


class _HttpArgs(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    url: str
    timeout_s: float = 0.0  # one request's deadline; 0 = task.reward_timeout_s
    max_concurrency: int = 16  # requests in flight to this url, across all groups being scored
    retries: int = 3  # after a connection error, a 429 or 5xx, or a timeout
    batch_size: int = 32  # completions per request
    # Before the first retry; doubled before each next one, each wait times a random factor in [0.5, 1.5) so
    # that batches refused together do not come back together; at least what a Retry-After header asks.
    backoff_s: float = 0.5


_HTTP_JSON = {"Content-Type": "application/json"}


class _HttpReward:
    """A remote scorer: POST ``{"items": [...]}``, answered ``{"rewards": [...]}``, one entry per item."""

    def __init__(self, key: str, name: str, weight: float, args: _HttpArgs, timeout_s: float) -> None:
        self.key = key  # its table, task.rewards[i]: what a refusal names
        self.name = name
        self.function = HTTP_REWARD
        self.weight = weight
        self._args = args
        self._timeout_s = args.timeout_s or timeout_s
        self._limiter = anyio.CapacityLimiter(args.max_concurrency)
        self._first_request_at: float | None = None  # time.monotonic() of this process's first request
        self._answered = False  # whether the service ever answered this process (2xx)

    def answered_before(self) -> None:
        """The run's service answered in an earlier process: it is never refused for not answering now."""
        self._answered = True

    def never_answered_refusal(self, start_timeout_s: float, detail: str) -> ConfigError | None:
        """The refusal of a service that has not answered once in ``start_timeout_s`` since the first request
        (a wrong URL, or a service never started), or None while it may still come up or once it answered."""
        if self._answered or self._first_request_at is None or not start_timeout_s:
            return None
        waited_s = time.monotonic() - self._first_request_at
        if waited_s < start_timeout_s:
            return None
        return ConfigError(f"{self.key}.args.url", (
            f"reward {self.name!r}: {self._args.url} has not answered once in the {waited_s:.0f} s since scd first "
            f"asked it (task.reward_start_timeout_s = {start_timeout_s:g}); last: {detail}. Is the URL right and "
            "the service up? (A service that answered once is waited for as long as an outage lasts.)"))

    async def evaluate(self, items: Sequence[RewardInput], context: _Context) -> list[Outcome]:
        size = self._args.batch_size
        batches = [items[start:start + size] for start in range(0, len(items), size)]
        scored = await _gather([partial(self._batch, batch, context) for batch in batches])
        return [outcome for batch in scored for outcome in batch]

    async def _batch(self, items: Sequence[RewardInput], context: _Context) -> list[Outcome]:
        answered = await self._post(items, context)
        if isinstance(answered, Failure):
            return [answered] * len(items)
        return [checked(value) for value in answered]

    async def _post(self, items: Sequence[RewardInput], context: _Context) -> list[object] | Failure:
        url, retries = self._args.url, self._args.retries
        body = orjson.dumps({"items": [{"prompt": i.prompt, "completion": i.completion, "answer": i.answer,
                                        "row": i.row} for i in items]})
        failure: Failure  # the last attempt's: every path through the loop that does not return sets it
        retry_after_s = 0.0  # what the last attempt's answer asked for
        for attempt in range(retries + 1):
            if attempt:
                context.counts.http_retries += 1
                backoff_s = self._args.backoff_s * 2 ** (attempt - 1) * random.uniform(0.5, 1.5)
                await anyio.sleep(max(backoff_s, retry_after_s))
                retry_after_s = 0.0
            context.counts.calls += 1
            if self._first_request_at is None:
                self._first_request_at = time.monotonic()
            try:
                async with self._limiter:
                    with anyio.fail_after(self._timeout_s):
                        async with context.http_session().post(url, data=body, headers=_HTTP_JSON) as response:
                            status, content = response.status, await response.read()
                            retry_after_s = _retry_after_s(response.headers.get("Retry-After"))
            except TimeoutError:
                context.counts.timeouts += 1
                failure = Failure("unavailable", f"{url} did not answer within {self._timeout_s} s")
                continue
            except aiohttp.ClientError as exc:  # refused, reset, or the server went away mid-answer
                failure = Failure("unavailable", f"{url}: {type(exc).__name__}: {exc}")
                continue
            if status == _TOO_MANY_REQUESTS or status >= 500:  # busy or broken for now: it may answer later
                failure = Failure("unavailable", f"{url} answered HTTP {status}")
                continue
            if not 200 <= status < 300:  # the server refuses this request: it would refuse it again
                return Failure("http", f"{url} answered HTTP {status}: {content[:200]!r}")
            self._answered = True
            return _rewards_of(content, len(items), url)
        return Failure(failure.cause, f"{failure.detail} ({retries} retries spent)")


_TOO_MANY_REQUESTS = 429


def _retry_after_s(header: str | None) -> float:
    """The wait a Retry-After header asks for: seconds, or an HTTP date; 0 without one (or one unreadable)."""
    if header is None:
        return 0.0
    if header.strip().isdigit():
        return float(header)
    try:
        when = email.utils.parsedate_to_datetime(header)
    except (TypeError, ValueError):
        return 0.0
    return max(0.0, when.timestamp() - time.time())


def _rewards_of(content: bytes, count: int, url: str) -> list[object] | Failure:
    try:
        payload = orjson.loads(content)
    except orjson.JSONDecodeError:
        return Failure("malformed", f"{url} answered no JSON: {content[:200]!r}")
    rewards = payload.get("rewards") if isinstance(payload, dict) else None
    if not isinstance(rewards, list) or len(rewards) != count:
        return Failure("malformed", f'{url} answered {content[:200]!r}: need {{"rewards": [...]}} with one entry '
                                     f"for each of the {count} items")
    return rewards


# ---- the scorer --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ResolvedRewards:
    """Every configured reward resolved (``resolve_rewards``): what a ``Scorer`` is made of."""

    rewards: list[_Reward]
    pooled: list[tuple[str, RewardConfig]]  # the sync rewards' keys and tables, as each worker process loads them
    base_dir: Path  # the config file's directory, where a worker imports a reward's module from first


class Scorer:
    """Judges completions with the configured rewards; ``aclose`` when done (it may hold worker processes and
    HTTP connections)."""

    def __init__(self, resolved: ResolvedRewards, *, timeout_s: float, zero_errors: bool, workers: int,
                 start_timeout_s: float = 0.0) -> None:
        self._rewards = resolved.rewards
        self._zero_errors = zero_errors
        self._start_timeout_s = start_timeout_s  # 0: a service that never answered is waited for as long as any
        self._outages: dict[str, tuple[str, float]] = {}  # reward name -> (what its last call met, since when)
        # The HTTP rewards are asked first, the others once those answered: while a service is down nothing else
        # is paid for the completions that wait, so a crash during one HTTP service's outage loses no answer that
        # would be paid again after the restore (a bundle holds a completion's score once every reward answered;
        # answers kept in memory while a second HTTP service or a Python reward is down are paid again).  The
        # price: a Python reward's latency adds to the HTTP reward's instead of overlapping it.
        http = [index for index, reward in enumerate(self._rewards) if isinstance(reward, _HttpReward)]
        self._phases = [phase for phase in (http, [i for i in range(len(self._rewards)) if i not in http]) if phase]
        self._counts = _Counts()
        # The pool starts its workers on its first call: a scorer is made before there is an event loop.
        self._context = _Context(timeout_s=timeout_s, counts=self._counts,
                                 pool=WorkerPool(resolved.pooled, resolved.base_dir, workers))
        self._logged_causes: set[tuple[str, str]] = set()

    async def score(self, inputs: Sequence[RewardInput], *, observe: bool = True,
                    answers: Answers | None = None) -> list[Scored]:
        """Every completion's reward, in the order given; ``observe``: into the reward histogram (training's,
        not an eval's).  Raises ``RewardError`` for a failed call unless ``task.reward_errors = "zero"``, and
        ``RewardUnavailable`` when a reward's service did not answer, with the ``answers`` got so far: handed
        back (the same ``inputs``), only what did not answer is asked again.  Raises ``ConfigError`` for an HTTP
        reward whose service never answered within ``task.reward_start_timeout_s``."""
        items = list(inputs)
        if answers is None:
            answers = Answers([[None] * len(items) for _ in self._rewards])
        for phase in self._phases:
            unavailable = await self._ask(phase, items, answers)
            for reward, failure in unavailable:
                refusal = (reward.never_answered_refusal(self._start_timeout_s, failure.detail)
                           if isinstance(reward, _HttpReward) else None)
                if refusal is not None:
                    raise refusal
            if unavailable:
                reward, failure = unavailable[0]
                raise RewardUnavailable(failure.detail, reward=reward.name, answers=answers)
        # Every reward has answered on every input by now.
        outcomes = [[outcome for outcome in kept if outcome is not None] for kept in answers.outcomes]
        failures = [(reward, item, outcome) for reward, by_item in zip(self._rewards, outcomes, strict=True)
                    for item, outcome in zip(items, by_item, strict=True) if isinstance(outcome, Failure)]
        self._counts.errors += len(failures)
        for reward, item, failure in failures:
            metrics.reward_errors.labels(name=reward.name, cause=failure.cause).inc()
            if self._zero_errors and (reward.name, failure.cause) not in self._logged_causes:
                # Once per reward and cause: the counter says how often, the log what it looks like.
                self._logged_causes.add((reward.name, failure.cause))
                log.warning("reward %r scores 0 on %s (task.reward_errors = \"zero\"): %s; further %s "
                            "failures are only counted", reward.name, item.where, failure.detail, failure.cause)
        if failures and not self._zero_errors:
            reward, item, failure = failures[0]
            raise RewardError(reward.name, reward.function, item.prompt_id, item.where, failure.cause, failure.detail)
        self._counts.errors_zeroed += len(failures)
        return [self._combined([by_item[index] for by_item in outcomes], observe) for index in range(len(items))]

    async def _ask(self, phase: Sequence[int], items: Sequence[RewardInput],
                   answers: Answers) -> list[tuple[_Reward, Failure]]:
        """Ask the rewards of ``phase`` (indices) what they have not answered yet, keeping what they answer in
        ``answers``; each one that did not answer, with what it met."""
        asked = {index: answers.missing(index) for index in phase}
        replies = await _gather([partial(self._rewards[index].evaluate, [items[i] for i in missing], self._context)
                                 for index, missing in asked.items()])
        unavailable: list[tuple[_Reward, Failure]] = []
        for (index, missing), outcomes in zip(asked.items(), replies, strict=True):
            reward, kept = self._rewards[index], answers.outcomes[index]
            down = [outcome for outcome in outcomes if isinstance(outcome, Failure) and outcome.cause == "unavailable"]
            for item, outcome in zip(missing, outcomes, strict=True):
                if not (isinstance(outcome, Failure) and outcome.cause == "unavailable"):
                    kept[item] = outcome
            if down:
                unavailable.append((reward, down[0]))
                self._down(reward.name, down[0].detail)
            elif missing:
                self._up(reward.name)
        return unavailable

    def _combined(self, outcomes: Sequence[Outcome], observe: bool) -> Scored:
        total = 0.0
        components: dict[str, float] = {}
        for reward, outcome in zip(self._rewards, outcomes, strict=True):
            if isinstance(outcome, Failure):
                components[reward.name] = 0.0  # counted as an error, not observed as a value
                continue
            if isinstance(outcome, dict):
                score = outcome[SCORE]
                parts = {reward.name: score} | {f"{reward.name}/{part}": value for part, value in outcome.items()
                                                if part != SCORE}
            else:
                score = outcome
                parts = {reward.name: outcome}
            total += reward.weight * score
            if observe:
                for name, value in parts.items():
                    metrics.reward.labels(name=name).observe(value)
            components.update(parts)
        return Scored(total=total, components=components)

    def statistics(self) -> ScorerStatistics:
        return ScorerStatistics(**dataclasses.asdict(self._counts), pool=self._context.pool.statistics())

    def answered_before(self, changed: Collection[str]) -> list[str]:
        """The run resumed past its first step, so its HTTP rewards answered in an earlier process: an outage at
        this start is waited out, not refused by ``task.reward_start_timeout_s`` (a restart during an outage
        must not end a run that systemd then would not restart).  Not one whose service the restore changed
        (``changed``: the reward settings that differ from the bundle's, ``task.rewards[i].args.url`` and the
        like): a reward new at its index, or now at another URL, never answered, and a wrong URL of its is
        still refused.  Returns the names of the rewards marked."""
        marked = [reward for reward in self._rewards if isinstance(reward, _HttpReward)
                  and not any(f"{reward.key}.{setting}" in changed for setting in ("function", "args.url"))]
        for reward in marked:
            reward.answered_before()
        return [reward.name for reward in marked]

    def outage(self) -> Outage:
        """The rewards whose service did not answer their last call (the stage's and an eval's alike)."""
        if not self._outages:
            return Outage("", 0.0)
        why = "; ".join(f"reward {name!r}: {detail}" for name, (detail, _) in self._outages.items())
        return Outage(why, time.monotonic() - min(since for _, since in self._outages.values()))

    def _down(self, reward: str, detail: str) -> None:
        since = self._outages[reward][1] if reward in self._outages else time.monotonic()
        if reward not in self._outages:
            log.warning("reward %r is unavailable: %s; the completions it owes wait and are asked again", reward,
                        detail)
        self._outages[reward] = (detail, since)
        metrics.reward_unavailable.set(1)

    def _up(self, reward: str) -> None:
        if reward in self._outages:
            _, since = self._outages.pop(reward)
            log.warning("reward %r answers again after %.0f s", reward, time.monotonic() - since)
            metrics.reward_unavailable.set(1 if self._outages else 0)

    async def aclose(self) -> None:
        await self._context.pool.aclose()
        if self._context.http is not None:
            await self._context.http.close()
            self._context.http = None


# ---- loading -----------------------------------------------------------------------------------


def resolve_rewards(config: TaskConfig, base_dir: Path) -> ResolvedRewards:
    """``config.rewards`` (none: the character match), every function resolved now; ``scd run`` calls this
    when it loads the config, before Ray starts.

    A ``module:function`` is imported from ``base_dir`` (the config file's directory) first, then
    ``sys.path``.  Raises ``ConfigError`` naming the key of a reward that cannot be resolved.
    """
    configured = config.rewards or [RewardConfig(function="match")]
    rewards: list[_Reward] = []
    pooled: list[tuple[str, RewardConfig]] = []
    for index, reward in enumerate(configured):
        key = f"task.rewards[{index}]"
        if reward.function == HTTP_REWARD:
            rewards.append(_HttpReward(key, reward.name or HTTP_REWARD, reward.weight, _http_args(reward.args, key),
                                       config.reward_timeout_s))
            continue
        loaded = load_function(reward, key, base_dir)
        name = reward.name or loaded.name
        if loaded.is_async:
            rewards.append(_AsyncReward(name, reward.function, reward.weight, loaded.call))
        else:
            rewards.append(_SyncReward(name, reward.function, reward.weight, len(pooled)))
            pooled.append((key, reward))
    seen: set[str] = set()
    for index, resolved in enumerate(rewards):
        key = f"task.rewards[{index}].name"
        if "/" in resolved.name:
            raise ConfigError(key, f"{resolved.name!r}: a name may not hold '/', which joins a reward to its parts")
        if resolved.name in seen:
            raise ConfigError(key, f"two rewards are named {resolved.name!r}: give each a name of its own")
        seen.add(resolved.name)
    return ResolvedRewards(rewards, pooled, base_dir)


def load_rewards(config: TaskConfig, base_dir: Path) -> Scorer:
    """The scorer for ``config.rewards``, resolved as ``resolve_rewards`` does."""
    return Scorer(resolve_rewards(config, base_dir), timeout_s=config.reward_timeout_s,
                  zero_errors=config.reward_errors == "zero", workers=config.reward_worker_count(),
                  start_timeout_s=config.reward_start_timeout_s)


def _http_args(args: dict[str, object], key: str) -> _HttpArgs:
    http = args_as(_HttpArgs, args, key)
    checks = (
        (http.url.startswith(("http://", "https://")), "url", f"must be an http:// or https:// URL, got {http.url!r}"),
        (http.timeout_s >= 0, "timeout_s", "must be >= 0 (0 = task.reward_timeout_s)"),
        (http.max_concurrency >= 1, "max_concurrency", "must be >= 1"),
        (http.retries >= 0, "retries", "must be >= 0"),
        (http.batch_size >= 1, "batch_size", "must be >= 1"),
        (http.backoff_s >= 0, "backoff_s", "must be >= 0"),
    )
    for ok, field, message in checks:
        if not ok:
            raise ConfigError(f"{key}.args.{field}", message)
    return http
