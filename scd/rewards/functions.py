"""The reward functions themselves, as the scorer and its worker processes both load them.

A function is a built-in (``match``, ``exact``, ``math``, ``regex``) or a Python ``module:function``;
``load_function`` resolves one from its ``[[task.rewards]]`` table, or raises ``ConfigError`` naming
the key.  ``checked`` turns what a function returned into a reward, or the reason it is none.  Nothing
here imports the event loop's libraries: a worker process loads this and the user's code only.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import math
import numbers
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any, Literal, TypeVar

import msgspec

from scd.config import RewardConfig
from scd.errors import ConfigError
from scd.tasks import PromptField

# A number, or a dict whose "score" is the reward and whose other keys are parts reported beside it.
RewardValue = float | dict[str, float]
RewardFunction = Callable[[PromptField, str, Any, dict[str, Any]], object]
# "unavailable": an HTTP reward's service did not answer (after its retries): not the completion's fault.
Cause = Literal["exception", "not_finite", "not_a_number", "timeout", "crashed", "http", "malformed", "unavailable"]
HTTP_REWARD = "http"
SCORE = "score"


@dataclass(frozen=True, slots=True)
class Failure:
    """Why a call gave no value: ``cause`` is the metric's label, ``detail`` what the error says."""

    cause: Cause
    detail: str


Outcome = RewardValue | Failure


def _number(value: object) -> float | Failure:
    # bool is an int to Python, but a reward function returning True is a predicate by mistake.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return Failure("not_a_number", f"returned {value!r} ({type(value).__name__}), not a number")
    number = float(value)
    if not math.isfinite(number):
        return Failure("not_finite", f"returned {number}")
    return number


def checked(value: object) -> Outcome:
    """A function's return value as a reward, or why it is none.

    A dict follows verl's and TRL's users: its ``"score"`` is the reward, every other key a number
    reported beside it; a dict without ``"score"`` is malformed.
    """
    if not isinstance(value, dict):
        return _number(value)
    if SCORE not in value:
        return Failure("malformed", f"returned a dict without a {SCORE!r} key (keys {sorted(map(str, value))[:10]}): "
                                    f"a dict's {SCORE!r} is the reward, its other keys are reported beside it")
    parts: dict[str, float] = {}
    for part, part_value in value.items():
        number = _number(part_value)
        if isinstance(number, Failure):
            return Failure(number.cause, f"part {part!r} {number.detail}")
        parts[str(part)] = number
    return parts


# ---- the built-ins -----------------------------------------------------------------------------


def match_score(completion: str, answer: str) -> float:
    """Fraction of answer characters the completion text matches, position by position; an empty
    answer is matched by an empty completion only."""
    if not answer:
        return float(not completion)
    hits = sum(1 for got, want in zip(completion, answer, strict=False) if got == want)
    return hits / len(answer)


def _match(prompt: PromptField, completion: str, answer: Any, row: dict[str, Any]) -> float:
    return match_score(completion, str(answer))


def _normalized(text: str) -> str:
    return " ".join(text.split()).casefold()


def _exact(prompt: PromptField, completion: str, answer: Any, row: dict[str, Any]) -> float:
    return float(_normalized(completion) == _normalized(str(answer)))


class _RegexArgs(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pattern: str
    flags: str = ""  # letters of Python's inline flags: "i" ignore case, "m" multiline, "s" dot-all, ...


_REGEX_FLAGS = {"a": re.ASCII, "i": re.IGNORECASE, "m": re.MULTILINE, "s": re.DOTALL, "x": re.VERBOSE}


def _regex_reward(args: dict[str, object], key: str) -> RewardFunction:
    regex_args = args_as(_RegexArgs, args, key)
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
    # scorer's deadline bounds the call (by killing the worker process).  Its warning that nothing else does
    # would mislead.
    for logger in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(logger).addFilter(_DEADLINE_IS_THE_SCORERS)
    # As open-r1's and TRL's accuracy rewards: a completion's answer is a \boxed{} one or one after an anchor
    # ("the final answer is", "Answer:"), never the last number it happens to mention.
    anchored = [math_verify.LatexExtractionConfig(try_extract_without_anchor=False, boxed_match_priority=0),
                math_verify.ExprExtractionConfig(try_extract_without_anchor=False)]

    def math_verified(prompt: PromptField, completion: str, answer: Any, row: dict[str, Any]) -> float:
        # The answer is read as LaTeX first: read plain, "3\sqrt{2}" is its leading 3.  Plain is for what is
        # no LaTeX at all.
        gold = (math_verify.parse(f"${answer}$", parsing_timeout=None)
                or math_verify.parse(str(answer), parsing_timeout=None))
        if not gold:
            raise ValueError(f"math-verify finds no expression in the answer {answer!r}")
        given = math_verify.parse(completion, extraction_config=anchored, parsing_timeout=None)
        return float(math_verify.verify(gold, given, timeout_seconds=None))

    return _WarmedUp(math_verified, partial(math_verified, "", r"so $\boxed{\frac{1}{2}}$", r"\frac{1}{2}", {}))


@dataclass(frozen=True, slots=True)
class _WarmedUp:
    """A built-in whose first call is slow (imports, compiled grammars): a worker process makes that call
    while it starts, so that no scored call pays for it against its deadline."""

    call: RewardFunction
    warm_up: Callable[[], object]


def _no_args(args: dict[str, object], key: str) -> None:
    if args:
        raise ConfigError(f"{key}.args", f"this reward takes no args, got {sorted(args)}")


def _plain(function: RewardFunction) -> Callable[[dict[str, object], str], RewardFunction]:
    def load(args: dict[str, object], key: str) -> RewardFunction:
        _no_args(args, key)
        return function

    return load


# Each built-in's loader: its args checked and bound, or a ConfigError naming the key.
BUILTINS: dict[str, Callable[[dict[str, object], str], RewardFunction | _WarmedUp]] = {
    "match": _plain(_match), "exact": _plain(_exact), "math": _math_reward, "regex": _regex_reward,
}


# ---- loading -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LoadedFunction:
    name: str  # its default label: the built-in's name, or the Python function's
    call: RewardFunction  # its args bound
    is_async: bool
    warm_up: Callable[[], object] | None = None  # what a worker process calls once before it takes calls


def load_function(reward: RewardConfig, key: str, base_dir: Path) -> LoadedFunction:
    """A built-in or ``module:function``, its args checked; ``module`` is imported from ``base_dir``
    first, then ``sys.path``.  Raises ``ConfigError`` naming the key of what cannot be resolved."""
    function = reward.function
    if function in BUILTINS:
        builtin = BUILTINS[function](reward.args, key)
        if isinstance(builtin, _WarmedUp):
            return LoadedFunction(function, builtin.call, is_async=False, warm_up=builtin.warm_up)
        return LoadedFunction(function, builtin, is_async=False)
    module_name, _, attribute = function.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"{key}.function", f"must be one of {', '.join(BUILTINS)}, {HTTP_REWARD}, "
                                             f"module:function or path/to/file.py:function, got {function!r}")
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
    # An object whose __call__ is ``async def`` is as async as a function that is.
    is_async = inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(type(target).__call__)
    return LoadedFunction(attribute, call, is_async)


def _imported(module_name: str, base_dir: Path, key: str) -> ModuleType:
    """``module_name`` imported from ``base_dir`` first, then ``sys.path``; a name ending in ``.py`` is the
    module's file, relative to ``base_dir`` (as verl's ``custom_reward_function.path``)."""
    if module_name.endswith(".py"):
        return _loaded_file(base_dir / module_name, key)
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


def _loaded_file(path: Path, key: str) -> ModuleType:
    """The module in the file at ``path``, once per process; its own directory is searched first for what it
    imports, while it loads."""
    path = path.resolve()
    # Named by its path, so that two files of one name are two modules.
    name = "scd_reward_file_" + re.sub(r"\W", "_", str(path))
    if name in sys.modules:
        return sys.modules[name]
    if not path.is_file():
        raise ConfigError(key, f"no reward module file {path}")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None  # a path ending in .py always has a source loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise ConfigError(key, f"cannot load {path}: {type(exc).__name__}: {exc}") from None
    finally:
        sys.path.remove(str(path.parent))
    return module


_S = TypeVar("_S", bound=msgspec.Struct)
# msgspec names the field as "`$.url`" for a bad value and "field `url`" for a missing or unknown one.
_FIELD_IN_ERROR = re.compile(r"`\$\.(\w+)`|field `(\w+)`")


def args_as(struct: type[_S], args: dict[str, object], key: str) -> _S:
    """``args`` as ``struct``, or a ``ConfigError`` naming the field of ``key.args`` that is wrong."""
    try:
        return msgspec.convert(args, struct, strict=True)
    except msgspec.ValidationError as exc:
        found = _FIELD_IN_ERROR.search(str(exc))
        field = (found.group(1) or found.group(2)) if found else ""
        raise ConfigError(f"{key}.args.{field}" if field else f"{key}.args", str(exc)) from None
