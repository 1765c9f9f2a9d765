"""Reward functions: what a completion scores, from the config's ``[[task.rewards]]``.

A completion's reward is the weighted sum of its reward functions' values.  A function is a built-in
(``match``, ``exact``, ``math``, ``regex``), a Python function named ``module:function``, or ``http``: a
remote scorer that takes completions in batches.  ``load_rewards`` resolves every one of them when the
config is loaded, so a typo fails before Ray starts and names its key; ``Scorer.score`` then judges
completions.

A Python reward is ``reward(prompt, completion, answer, row, **args) -> float | dict[str, float]``, plain
or ``async def``: ``prompt`` is the dataset's prompt field as given (text, or chat messages), ``answer``
any JSON value, ``row`` the row's other columns.  A dict is a reward in parts: each part is reported,
and their sum is the function's value.

User code never runs on the event loop: a sync function runs on a worker thread (a capacity limiter
bounds them), an async function and the HTTP scorer on the loop's own I/O, and every call has a
deadline.  A call that raises, misses its deadline, or returns anything but a finite number (or a dict
of them) fails: the run stops with a ``RewardError`` (``task.reward_errors = "stop"``), or the function
scores 0 on that completion and the failure is counted (``"zero"``).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import math
import numbers
import re
import sys
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any, Literal, Protocol, TypeVar

import aiohttp
import anyio
import msgspec
import orjson

from scd.config import RewardConfig, TaskConfig
from scd.errors import ConfigError, RewardError
from scd.telemetry import metrics

log = logging.getLogger(__name__)

PromptField = str | list[dict[str, Any]]
RewardValue = float | dict[str, float]
RewardFunction = Callable[[PromptField, str, Any, dict[str, Any]], object]
Cause = Literal["exception", "not_finite", "not_a_number", "timeout", "stuck", "http", "malformed"]
_T = TypeVar("_T")

# Worker threads sync rewards share.  A CPU-bound Python reward holds the GIL, so more threads do not
# score faster, and each one more that computes starves the event loop longer: on a 2-core box the loop
# waited up to ~40 ms beside 2 computing threads, ~100 ms beside 4, a whole 0.3 s call beside 8.  A reward
# that waits on I/O is better written ``async def`` than given more threads.
SYNC_REWARD_THREADS = 4
HTTP_REWARD = "http"


@dataclass(frozen=True, slots=True)
class RewardInput:
    """One completion to judge, with its prompt's fields as the dataset has them."""

    prompt_id: int
    prompt: PromptField
    completion: str
    answer: Any
    row: dict[str, Any]  # the row's columns other than prompt and answer


@dataclass(frozen=True, slots=True)
class Scored:
    """A completion's reward and what it is made of."""

    total: float  # the sum of each function's value times its weight
    # Each function's unweighted value by reward name; a dict-returning function's parts as "name/part".
    # A function that failed under reward_errors = "zero" reads 0 under its name.
    components: dict[str, float]


@dataclass(frozen=True, slots=True)
class ScorerStatistics:
    calls: int  # function calls (one per completion) and HTTP requests (one per batch, each retry again)
    errors: int  # completions a function failed on, whatever reward_errors says
    errors_zeroed: int  # of those, scored 0 under reward_errors = "zero"
    timeouts: int  # calls past their deadline (an HTTP request: per attempt)
    http_retries: int  # HTTP requests sent again after a connection error, a 5xx or a timeout
    threads_abandoned: int  # worker threads still running a sync call that timed out


@dataclass(slots=True)
class _Counts:
    calls: int = 0
    errors: int = 0
    errors_zeroed: int = 0
    timeouts: int = 0
    http_retries: int = 0


@dataclass(frozen=True, slots=True)
class _Failure:
    """Why a call gave no value: ``cause`` is the metric's label, ``detail`` what the error says."""

    cause: Cause
    detail: str


Outcome = RewardValue | _Failure


def _number(value: object) -> float | _Failure:
    # bool is an int to Python, but a reward function returning True is a predicate by mistake.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return _Failure("not_a_number", f"returned {value!r} ({type(value).__name__}), not a number")
    number = float(value)
    if not math.isfinite(number):
        return _Failure("not_finite", f"returned {number}")
    return number


def _checked(value: object) -> Outcome:
    """A function's return value as a reward, or why it is none."""
    if not isinstance(value, dict):
        return _number(value)
    parts: dict[str, float] = {}
    for part, part_value in value.items():
        number = _number(part_value)
        if isinstance(number, _Failure):
            return _Failure(number.cause, f"part {part!r} {number.detail}")
        parts[str(part)] = number
    return parts


async def _gather(calls: Sequence[Callable[[], Awaitable[_T]]]) -> list[_T]:
    """Run the calls concurrently; their results in the calls' order."""
    results: dict[int, _T] = {}

    async def run(index: int, call: Callable[[], Awaitable[_T]]) -> None:
        results[index] = await call()

    async with anyio.create_task_group() as tg:
        for index, call in enumerate(calls):
            tg.start_soon(run, index, call)
    return [results[index] for index in range(len(calls))]


# ---- the built-ins -----------------------------------------------------------------------------


def match_score(completion: str, answer: str) -> float:
    """Fraction of answer characters the completion text matches, position by position."""
    hits = sum(1 for got, want in zip(completion, answer, strict=False) if got == want)
    return hits / len(answer)


def _match(prompt: PromptField, completion: str, answer: Any, row: dict[str, Any]) -> float:
    return match_score(completion, answer)


def _normalized(text: str) -> str:
    return " ".join(text.split()).casefold()


def _exact(prompt: PromptField, completion: str, answer: Any, row: dict[str, Any]) -> float:
    return float(_normalized(completion) == _normalized(str(answer)))


class _RegexArgs(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pattern: str
    flags: str = ""  # letters of Python's inline flags: "i" ignore case, "m" multiline, "s" dot-all, ...


_REGEX_FLAGS = {"a": re.ASCII, "i": re.IGNORECASE, "m": re.MULTILINE, "s": re.DOTALL, "x": re.VERBOSE}


def _regex_reward(args: dict[str, object], key: str) -> RewardFunction:
    regex_args = _args_as(_RegexArgs, args, key)
    unknown = sorted(set(regex_args.flags) - set(_REGEX_FLAGS))
    if unknown:
        raise ConfigError(f"{key}.args.flags", f"unknown flags {unknown}: use letters of {''.join(_REGEX_FLAGS)}")
    flags = re.NOFLAG
    for letter in regex_args.flags:
        flags |= _REGEX_FLAGS[letter]
    try:
        pattern = re.compile(regex_args.pattern, flags)
    except re.error as exc:
        raise ConfigError(f"{key}.args.pattern", f"{regex_args.pattern!r} is not a regular expression: {exc}") from None

    def regex(prompt: PromptField, completion: str, answer: Any, row: dict[str, Any]) -> float:
        return float(pattern.search(completion) is not None)

    return regex


class _DeadlineIsTheScorers(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


_DEADLINE_IS_THE_SCORERS = _DeadlineIsTheScorers()


def _math_reward(args: dict[str, object], key: str) -> RewardFunction:
    _no_args(args, key)
    # Imported here: it brings sympy, half a second of start-up every run without a math reward would pay.
    try:
        import math_verify
    except ImportError as exc:
        raise ConfigError(f"{key}.function", f"the math reward needs the math-verify package: {exc}") from None

    # math-verify's own timeouts use SIGALRM, which works on the main thread only: they are off, and the
    # scorer's deadline bounds the call.  Its warning that nothing else does would mislead.
    for logger in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(logger).addFilter(_DEADLINE_IS_THE_SCORERS)

    def parse(text: str) -> list[Any]:
        return math_verify.parse(text, parsing_timeout=None)

    def math_verified(prompt: PromptField, completion: str, answer: Any, row: dict[str, Any]) -> float:
        # A bare answer such as "x^2+1" is read as the LaTeX it is once it sits between dollars.
        gold = parse(str(answer)) or parse(f"${answer}$")
        if not gold:
            raise ValueError(f"math-verify finds no expression in the answer {answer!r}")
        return float(math_verify.verify(gold, parse(completion), timeout_seconds=None))

    return math_verified


def _no_args(args: dict[str, object], key: str) -> None:
    if args:
        raise ConfigError(f"{key}.args", f"this reward takes no args, got {sorted(args)}")


def _plain(function: RewardFunction) -> Callable[[dict[str, object], str], RewardFunction]:
    def load(args: dict[str, object], key: str) -> RewardFunction:
        _no_args(args, key)
        return function

    return load


# Each built-in's loader: its args checked and bound, or a ConfigError naming the key.
_BUILTINS: dict[str, Callable[[dict[str, object], str], RewardFunction]] = {
    "match": _plain(_match), "exact": _plain(_exact), "math": _math_reward, "regex": _regex_reward,
}


# ---- worker threads ----------------------------------------------------------------------------


@dataclass(slots=True)
class _ThreadCall:
    running: bool = False
    cancelled: bool = False  # before it started: the thread skips it
    abandoned: bool = False  # while it ran: its thread runs on, counted


class _Threads:
    """The worker threads sync rewards run on, behind one capacity limiter.

    A thread cannot be stopped: a call past its deadline is abandoned and its thread runs on until the
    function returns.  Those threads are counted, and once there are as many as the limiter's tokens,
    calls fail at once instead of starting ever more threads beside them.
    """

    def __init__(self, count: int) -> None:
        self._limiter = anyio.CapacityLimiter(count)
        self._lock = threading.Lock()  # the call states are shared with the threads
        self.abandoned = 0

    def exhausted(self) -> bool:
        return self.abandoned >= self._limiter.total_tokens

    async def run(self, call: Callable[[], object]) -> object:
        state = _ThreadCall()

        def in_thread() -> object:
            with self._lock:
                if state.cancelled:
                    return None
                state.running = True
            try:
                return call()
            finally:
                with self._lock:
                    state.running = False
                    if state.abandoned:
                        self.abandoned -= 1

        try:
            return await anyio.to_thread.run_sync(in_thread, limiter=self._limiter, abandon_on_cancel=True)
        except anyio.get_cancelled_exc_class():
            with self._lock:
                if state.running:
                    state.abandoned = True
                    self.abandoned += 1
                else:
                    state.cancelled = True
            raise


# ---- the reward kinds --------------------------------------------------------------------------


@dataclass(slots=True)
class _Context:
    """What every reward of one scorer shares."""

    timeout_s: float
    counts: _Counts
    threads: _Threads
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
class _FunctionReward:
    """A built-in or a Python function, called once per completion."""

    name: str
    function: str
    weight: float
    call: RewardFunction  # its args bound
    is_async: bool

    async def evaluate(self, items: Sequence[RewardInput], context: _Context) -> list[Outcome]:
        return await _gather([partial(self._one, item, context) for item in items])

    async def _one(self, item: RewardInput, context: _Context) -> Outcome:
        if not self.is_async and context.threads.exhausted():
            return _Failure("stuck", f"every one of the {SYNC_REWARD_THREADS} reward threads still runs a call "
                                     "that timed out")
        call = partial(self.call, item.prompt, item.completion, item.answer, item.row)
        context.counts.calls += 1
        try:
            with anyio.fail_after(context.timeout_s):
                try:
                    value = await call() if self.is_async else await context.threads.run(call)
                except Exception as exc:
                    return _Failure("exception", f"raised {type(exc).__name__}: {exc}")
        except TimeoutError:
            context.counts.timeouts += 1
            return _Failure("timeout", f"took longer than task.reward_timeout_s = {context.timeout_s} s")
        return _checked(value)


class _HttpArgs(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    url: str
    timeout_s: float = 0.0  # one request's deadline; 0 = task.reward_timeout_s
    max_concurrency: int = 16  # requests in flight to this url, across all groups being scored
    retries: int = 3  # after a connection error, a 5xx or a timeout
    batch_size: int = 32  # completions per request
    backoff_s: float = 0.5  # before the first retry; doubled before each next one


_HTTP_JSON = {"Content-Type": "application/json"}


class _HttpReward:
    """A remote scorer: POST ``{"items": [...]}``, answered ``{"rewards": [...]}``, one entry per item."""

    def __init__(self, name: str, weight: float, args: _HttpArgs, timeout_s: float) -> None:
        self.name = name
        self.function = HTTP_REWARD
        self.weight = weight
        self._args = args
        self._timeout_s = args.timeout_s or timeout_s
        self._limiter = anyio.CapacityLimiter(args.max_concurrency)

    async def evaluate(self, items: Sequence[RewardInput], context: _Context) -> list[Outcome]:
        size = self._args.batch_size
        batches = [items[start:start + size] for start in range(0, len(items), size)]
        scored = await _gather([partial(self._batch, batch, context) for batch in batches])
        return [outcome for batch in scored for outcome in batch]

    async def _batch(self, items: Sequence[RewardInput], context: _Context) -> list[Outcome]:
        answered = await self._post(items, context)
        if isinstance(answered, _Failure):
            return [answered] * len(items)
        return [_checked(value) for value in answered]

    async def _post(self, items: Sequence[RewardInput], context: _Context) -> list[object] | _Failure:
        url, retries = self._args.url, self._args.retries
        body = orjson.dumps({"items": [{"prompt": i.prompt, "completion": i.completion, "answer": i.answer,
                                        "row": i.row} for i in items]})
        failure: _Failure  # the last attempt's: every path through the loop that does not return sets it
        for attempt in range(retries + 1):
            if attempt:
                context.counts.http_retries += 1
                await anyio.sleep(self._args.backoff_s * 2 ** (attempt - 1))
            context.counts.calls += 1
            try:
                async with self._limiter:
                    with anyio.fail_after(self._timeout_s):
                        async with context.http_session().post(url, data=body, headers=_HTTP_JSON) as response:
                            status, content = response.status, await response.read()
            except TimeoutError:
                context.counts.timeouts += 1
                failure = _Failure("timeout", f"{url} did not answer within {self._timeout_s} s")
                continue
            except aiohttp.ClientError as exc:  # refused, reset, or the server went away mid-answer
                failure = _Failure("http", f"{url}: {type(exc).__name__}: {exc}")
                continue
            if status >= 500:
                failure = _Failure("http", f"{url} answered HTTP {status}")
                continue
            if not 200 <= status < 300:  # the server refuses this request: it would refuse it again
                return _Failure("http", f"{url} answered HTTP {status}: {content[:200]!r}")
            return _rewards_of(content, len(items), url)
        return _Failure(failure.cause, f"{failure.detail} ({retries} retries spent)")


def _rewards_of(content: bytes, count: int, url: str) -> list[object] | _Failure:
    try:
        payload = orjson.loads(content)
    except orjson.JSONDecodeError:
        return _Failure("malformed", f"{url} answered no JSON: {content[:200]!r}")
    rewards = payload.get("rewards") if isinstance(payload, dict) else None
    if not isinstance(rewards, list) or len(rewards) != count:
        return _Failure("malformed", f'{url} answered {content[:200]!r}: need {{"rewards": [...]}} with one entry '
                                     f"for each of the {count} items")
    return rewards


# ---- the scorer --------------------------------------------------------------------------------


class Scorer:
    """Judges completions with the configured rewards; ``aclose`` when done (it may hold HTTP connections)."""

    def __init__(self, rewards: Sequence[_Reward], *, timeout_s: float, zero_errors: bool) -> None:
        self._rewards = list(rewards)
        self._zero_errors = zero_errors
        self._counts = _Counts()
        self._context = _Context(timeout_s=timeout_s, counts=self._counts, threads=_Threads(SYNC_REWARD_THREADS))
        self._logged_causes: set[tuple[str, str]] = set()

    async def score(self, inputs: Sequence[RewardInput]) -> list[Scored]:
        """Every completion's reward, in the order given.  Raises ``RewardError`` for a failed call unless
        ``task.reward_errors = "zero"``."""
        items = list(inputs)
        outcomes = await _gather([partial(reward.evaluate, items, self._context) for reward in self._rewards])
        failures = [(reward, item, outcome) for reward, by_item in zip(self._rewards, outcomes, strict=True)
                    for item, outcome in zip(items, by_item, strict=True) if isinstance(outcome, _Failure)]
        self._counts.errors += len(failures)
        for reward, item, failure in failures:
            metrics.reward_errors.labels(name=reward.name, cause=failure.cause).inc()
            if self._zero_errors and (reward.name, failure.cause) not in self._logged_causes:
                # Once per reward and cause: the counter says how often, the log what it looks like.
                self._logged_causes.add((reward.name, failure.cause))
                log.warning("reward %r scores 0 on prompt %d (task.reward_errors = \"zero\"): %s; further %s "
                            "failures are only counted", reward.name, item.prompt_id, failure.detail, failure.cause)
        if failures and not self._zero_errors:
            reward, item, failure = failures[0]
            raise RewardError(reward.name, reward.function, item.prompt_id, failure.cause, failure.detail)
        self._counts.errors_zeroed += len(failures)
        return [self._combined([by_item[index] for by_item in outcomes]) for index in range(len(items))]

    def _combined(self, outcomes: Sequence[Outcome]) -> Scored:
        total = 0.0
        components: dict[str, float] = {}
        for reward, outcome in zip(self._rewards, outcomes, strict=True):
            if isinstance(outcome, _Failure):
                components[reward.name] = 0.0  # counted as an error, not observed as a value
                continue
            if isinstance(outcome, dict):
                parts = {f"{reward.name}/{part}": value for part, value in outcome.items()}
                total += reward.weight * sum(outcome.values())
            else:
                parts = {reward.name: outcome}
                total += reward.weight * outcome
            for name, value in parts.items():
                metrics.reward.labels(name=name).observe(value)
            components.update(parts)
        return Scored(total=total, components=components)

    def statistics(self) -> ScorerStatistics:
        return ScorerStatistics(**dataclasses.asdict(self._counts),
                                threads_abandoned=self._context.threads.abandoned)

    async def aclose(self) -> None:
        if self._context.http is not None:
            await self._context.http.close()
            self._context.http = None


# ---- loading -----------------------------------------------------------------------------------


def load_rewards(config: TaskConfig, base_dir: Path) -> Scorer:
    """The scorer for ``config.rewards`` (none: the character match), every function resolved now.

    A ``module:function`` is imported from ``base_dir`` (the config file's directory) first, then
    ``sys.path``.  Raises ``ConfigError`` naming the key of a reward that cannot be resolved.
    """
    configured = config.rewards or [RewardConfig(function="match")]
    rewards = [_loaded(reward, f"task.rewards[{index}]", base_dir, config.reward_timeout_s)
               for index, reward in enumerate(configured)]
    seen: set[str] = set()
    for index, reward in enumerate(rewards):
        key = f"task.rewards[{index}].name"
        if "/" in reward.name:
            raise ConfigError(key, f"{reward.name!r}: a name may not hold '/', which joins a reward to its parts")
        if reward.name in seen:
            raise ConfigError(key, f"two rewards are named {reward.name!r}: give each a name of its own")
        seen.add(reward.name)
    return Scorer(rewards, timeout_s=config.reward_timeout_s, zero_errors=config.reward_errors == "zero")


def _loaded(reward: RewardConfig, key: str, base_dir: Path, timeout_s: float) -> _Reward:
    function = reward.function
    if function in _BUILTINS:
        call = _BUILTINS[function](reward.args, key)
        return _FunctionReward(reward.name or function, function, reward.weight, call, is_async=False)
    if function == HTTP_REWARD:
        return _HttpReward(reward.name or HTTP_REWARD, reward.weight, _http_args(reward.args, key), timeout_s)
    module_name, _, attribute = function.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"{key}.function", f"must be one of {', '.join(_BUILTINS)}, {HTTP_REWARD}, or "
                                             f"module:function, got {function!r}")
    module = _imported(module_name, base_dir, f"{key}.function")
    target = getattr(module, attribute, None)
    if not callable(target):
        raise ConfigError(f"{key}.function", f"module {module_name!r} ({module.__file__}) has no function "
                                             f"{attribute!r}")
    try:
        inspect.signature(target).bind("", "", None, {}, **reward.args)
    except TypeError as exc:
        raise ConfigError(f"{key}.args", f"{function} cannot be called as "
                                         f"{attribute}(prompt, completion, answer, row, **args): {exc}") from None
    except ValueError:
        pass  # no signature to check (a function implemented in C): its first call will tell
    call = partial(target, **reward.args) if reward.args else target
    return _FunctionReward(reward.name or attribute, function, reward.weight, call,
                           is_async=inspect.iscoroutinefunction(target))


def _imported(module_name: str, base_dir: Path, key: str) -> ModuleType:
    # The config's directory comes first, as a script's own does for `python script.py`; only for this
    # import, so the process keeps its own search path.
    sys.path.insert(0, str(base_dir))
    try:
        return importlib.import_module(module_name)
    except Exception as exc:  # the module's own code runs here: any error it raises is the config's
        raise ConfigError(key, f"cannot import {module_name!r} from {base_dir} or sys.path: "
                               f"{type(exc).__name__}: {exc}") from None
    finally:
        sys.path.remove(str(base_dir))


def _http_args(args: dict[str, object], key: str) -> _HttpArgs:
    http = _args_as(_HttpArgs, args, key)
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


_S = TypeVar("_S", bound=msgspec.Struct)
# msgspec names the field as "`$.url`" for a bad value and "field `url`" for a missing or unknown one.
_FIELD_IN_ERROR = re.compile(r"`\$\.(\w+)`|field `(\w+)`")


def _args_as(struct: type[_S], args: dict[str, object], key: str) -> _S:
    try:
        return msgspec.convert(args, struct, strict=True)
    except msgspec.ValidationError as exc:
        found = _FIELD_IN_ERROR.search(str(exc))
        field = (found.group(1) or found.group(2)) if found else ""
        raise ConfigError(f"{key}.args.{field}" if field else f"{key}.args", str(exc)) from None
