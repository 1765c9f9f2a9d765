"""The bundle format and the checkpoint vocabulary, defined once.

Every JSON file scd writes into a bundle is one of the msgspec structs below;
decoding validates types and refuses unknown fields, so a save, verify,
restore, ``scd checkpoint inspect`` and ``scd report`` can only read what was
written.  The enums name the phases, triggers, outcomes and reasons that the
checkpointer records, the metrics label and the report plots.
"""

from __future__ import annotations

import enum
import time
import uuid
from pathlib import Path
from typing import Any, TypeVar, cast

import msgspec

from scd.replay import GroupMeta

SCHEMA_VERSION = 6
# Schema 3: a TQ key per group (a value of bytes), BLAKE3 file digests, ``Sidecar.uncut_keys``.
# Schema 4: ledger entries list their staged siblings (TQ's staging partition); a schema 3 bundle
# reads as one with none staged.
# Schema 5: the finished siblings a cut did not stage are ``Sidecar.finished_siblings``, no longer
# prefixes with a finish reason; an older sidecar's are split out as it is read.
# Schema 6: the scores of in-flight groups' finished siblings (``Sidecar.sibling_scores``) and each ready
# group's reward components (``GroupMeta.reward_components``); a schema 5 bundle reads as one with none.
READABLE_SCHEMAS = frozenset({3, 4, 5, SCHEMA_VERSION})


class CheckpointPhase(enum.StrEnum):
    TOTAL = "total"
    BARRIER_WAIT = "barrier_wait"
    EXCLUSIVE_HOLD = "exclusive_hold"  # the whole hold: nothing subtracted
    MUTATIONS_BLOCKED = "mutations_blocked"  # how long the first mutation this checkpoint blocked waited
    PREFIX_CAPTURE = "prefix_capture"  # the siblings of in-flight groups the cut does not stage, copied
    STATE_COPY = "state_copy"  # the trainer's weights and optimizer state copied to host memory
    TRAIN_PUMP_BLOCKED = "train_pump_blocked"  # the train pump's wait for the cut, the copy excluded
    TQ_SAVE = "tq_save"  # TQ's native snapshot, outside the hold, while mutations go on
    TQ_LIST = "tq_list"
    POLICY_WRITE = "policy_write"  # weights and optimizer state to files
    SIDECAR_WRITE = "sidecar_write"  # dataloader file and replay metadata sidecar
    HASH = "hash"  # the BLAKE3 digest of every bundle file, TQ's snapshot included
    FSYNC = "fsync"  # training_info written, the whole tree fsynced
    COMMIT = "commit"  # marker, rename, latest, retention


class RestorePhase(enum.StrEnum):
    """Each names the one thing it times, in the order restore runs them."""

    RESOLVE = "resolve"  # find the bundle, check the commit marker and every file's digest
    REPLAY_METADATA = "replay_metadata"  # decode the sidecar, ledger and dataloader; check them and the config
    POLICY_LOAD = "policy_load"  # weights and optimizer state into the trainer
    DATALOADER = "dataloader"  # the prompt order's state, checked against the ledger
    TQ = "tq"  # TQ's native snapshot loaded
    TQ_INVENTORY = "tq_inventory"  # TQ listed against the cut: uncut keys cleared, the rest exact
    LEDGER = "ledger"  # the cut installed (ledger, index, sampler state, counters)
    SIBLINGS = "siblings"  # in-window staged siblings read back, older ones unstaged
    EVICT = "evict"  # restored groups already stale evicted
    RESCORE = "rescore"  # the ready groups scored again under a changed reward set (0 when it is the same)
    FIRST_WEIGHT_SYNC = "first_weight_sync"  # the restored weights to generation
    REDISPATCH = "redispatch"  # in-flight prompts requeued for their missing siblings
    TOTAL = "total"  # from the start of restore to the moment the first admission may run


class Trigger(enum.StrEnum):
    """Why a checkpoint was attempted."""

    INTERVAL = "interval"
    SIGNAL = "signal"
    SHUTDOWN = "shutdown"
    FINAL = "final"
    EVAL = "eval"  # after a held-out evaluation: the bundle records that its step was evaluated


class Outcome(enum.StrEnum):
    SCHEDULED = "scheduled"  # cut taken, the writer has it; completed or failed is recorded later
    COMPLETED = "completed"
    SKIPPED = "skipped"
    FAILED = "failed"


class SkipReason(enum.StrEnum):
    NO_PROGRESS = "no_progress"
    ALREADY_RUNNING = "already_running"
    BUNDLE_EXISTS = "bundle_exists"


class FailReason(enum.StrEnum):
    IO_ERROR = "io_error"
    DISK_FULL = "disk_full"
    TIMEOUT = "timeout"
    SHORT_READ = "short_read"
    INVARIANT_VIOLATION = "invariant_violation"


# Every (outcome, reason) label pair the attempts counter can carry: a completed attempt is labelled
# with its trigger, a skipped or failed one with why.
OUTCOME_REASONS: tuple[tuple[Outcome, str], ...] = (
    *((Outcome.COMPLETED, t.value) for t in Trigger),
    *((Outcome.SKIPPED, r.value) for r in SkipReason),
    *((Outcome.FAILED, r.value) for r in FailReason),
)


class _Document(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    schema_version: int = SCHEMA_VERSION


class RunIdentity(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The logical run experiment trackers show as one, across restarts."""

    run_id: str  # the W&B run id; the MLflow run is tagged with it; the TensorBoard run directory's name
    started_at: float  # wall-clock time of the run's first start: the trackers' time axis counts from it
    # Restarts that restored a bundle other than a clean exit's (a crash came before): the MTBF estimate.
    crash_restores: int = 0
    # Seconds the run had run at the cut, each process's share by its own monotonic clock (a duration never
    # comes from wall clocks of two processes); 0 in bundles before it was recorded, whose runs count from
    # their next restore.
    run_s: float = 0.0


def new_run_identity() -> RunIdentity:
    return RunIdentity(run_id=uuid.uuid4().hex[:16], started_at=time.time())


class TrainingInfo(_Document):
    step: int
    weight_version: int
    epoch: int
    group_size: int
    sampler: str
    supports_replay_checkpoint: bool
    partition: str
    replay_digest: str
    groups: int
    samples: int
    capacity: int
    time: float
    config_fingerprint: str
    config_fingerprint_fields: dict[str, Any]
    files: dict[str, str]  # relative path -> BLAKE3 digest, every file but this one and the marker
    sidecar_bytes: int
    data_plane_bytes: int
    # TQ's storage units when saved: TQ loads a snapshot only into as many.  None in bundles written
    # before it was recorded (``verify.storage_units_of`` counts their snapshot's unit files).
    storage_units: int | None = None
    # None in bundles written before it was recorded: a restore from one starts a new tracker run.
    run: RunIdentity | None = None
    # What took the bundle ("" before it was recorded): a restore from any but a clean exit's
    # ("final", "shutdown") follows a crash.
    trigger: str = ""
    # The steps a held-out evaluation finished at (scd.evaluation): each is evaluated once across restores.
    evaluated_steps: list[int] = msgspec.field(default_factory=list)
    # The evaluations finished before the cut and not reported then, each its ``eval`` event's fields: reported
    # once the bundle is committed, or at a restore from it if the event log lacks them.
    held_evals: list[dict[str, Any]] = msgspec.field(default_factory=list)
    # ``Config.training_settings`` when saved (the loss, the lr schedule, dynamic sampling), by dotted key; a key
    # a bundle lacks, written before the setting existed, trained with its default.
    training_settings: dict[str, Any] = msgspec.field(default_factory=dict)


class LedgerEntryRecord(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    group_id: str
    epoch: int
    prompt_id: int
    state: str
    reason: str
    target_step: int | None
    staged: list[tuple[int, int]] = []  # (sibling index, weight version) of an in-flight group's staged siblings


class LedgerDocument(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    entries: list[LedgerEntryRecord]
    pruned: dict[str, int]


class SamplerDocument(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str
    state: dict[str, Any]
    supports_replay_checkpoint: bool


class PrefixRecord(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """A part-way sibling of an in-flight group at the cut.  ``version_runs``: (first token index,
    weight version) per run, ascending."""

    group_id: str
    index: int
    token_ids: list[int]
    logprobs: list[float]
    version_runs: list[tuple[int, int]]


class FinishedSiblingRecord(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """A finished sibling of an in-flight group the cut did not stage (still queued for staging)."""

    group_id: str
    index: int
    token_ids: list[int]
    logprobs: list[float]
    weight_version: int  # its oldest token's
    finish_reason: str


class SiblingScoreRecord(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """The score of a finished sibling of an in-flight group at the cut (staged, or one of
    ``Sidecar.finished_siblings``): a restore never scores it again."""

    group_id: str
    index: int
    weight_version: int  # the sibling's: which completion of that index was scored
    total: float
    components: dict[str, float]


class Sidecar(_Document):
    """``replay_buffer_metadata.json``: the replay index and the ledger, no tensors."""

    partition: str
    replay_digest: str
    groups: list[GroupMeta]
    ledger: LedgerDocument
    sampler: SamplerDocument
    # TQ keys (group ids) the snapshot may hold beyond the cut (put while the save ran); restore
    # clears them.  Schema 2 bundles (a key per row, saved inside the hold) have none.
    uncut_keys: list[str] = []
    # Prompts per bucket and fate (``scd.skew``), continued by a restore.  Bundles written before
    # they were counted have none: the counts start at zero.
    prompt_fates: dict[str, dict[str, int]] = {}
    # Part-way siblings of in-flight groups: resumed from their prefix by a restore.  Bundles written
    # before prefixes were captured have none.
    prefixes: list[PrefixRecord] = []
    # Finished siblings of in-flight groups the cut did not stage: a restore keeps them as finished.
    finished_siblings: list[FinishedSiblingRecord] = []
    # Scores of the cut's finished siblings of in-flight groups; one that has none is scored by the restore.
    sibling_scores: list[SiblingScoreRecord] = []


class _Schema4PrefixRecord(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """A schema 4 prefix: part-way (``finish_reason`` "") or a finished sibling the cut did not stage."""

    group_id: str
    index: int
    token_ids: list[int]
    logprobs: list[float]
    version_runs: list[tuple[int, int]]
    finish_reason: str = ""


class _Schema4Sidecar(Sidecar, kw_only=True):
    prefixes: list[_Schema4PrefixRecord] = []  # type: ignore[assignment]


def _sidecar_from_schema_4(old: _Schema4Sidecar, name: str) -> Sidecar:
    """A schema 3 or 4 sidecar as schema 5: its finished prefixes become finished siblings, each as old
    as its one version run (the only way a schema 4 cut wrote a finished sibling)."""
    prefixes, finished = [], []
    for p in old.prefixes:
        if not p.finish_reason:
            prefixes.append(PrefixRecord(p.group_id, p.index, p.token_ids, p.logprobs, p.version_runs))
        elif len(p.version_runs) == 1 and p.version_runs[0][0] == 0:
            finished.append(FinishedSiblingRecord(p.group_id, p.index, p.token_ids, p.logprobs,
                                                  p.version_runs[0][1], p.finish_reason))
        else:
            raise SchemaError(f"{name} is malformed: the finished prefix of sibling {p.index} of group "
                              f"{p.group_id} has version runs {p.version_runs}, not one from its first token")
    fields = {f: getattr(old, f) for f in Sidecar.__struct_fields__
              if f not in ("prefixes", "finished_siblings", "sibling_scores")}
    return Sidecar(**fields, prefixes=prefixes, finished_siblings=finished)


class DataloaderDocument(_Document):
    seed: int
    epoch: int
    cursor: int


D = TypeVar("D", bound=_Document)


class SchemaError(ValueError):
    """A bundle file that does not decode as its struct; the message names the file and the field."""


def encode(document: msgspec.Struct, *, indent: bool = False) -> bytes:
    data = msgspec.json.encode(document, order="sorted")
    return msgspec.json.format(data, indent=2) if indent else data


def decode(path: Path, kind: type[D]) -> D:
    """Read ``path`` as ``kind``; a missing, corrupt, mistyped or other-version file raises ``SchemaError``."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise SchemaError(f"{path.name} is missing") from None
    try:
        version = msgspec.json.decode(raw, type=_Version).schema_version
    except msgspec.DecodeError as exc:
        raise SchemaError(f"{path.name} is not valid JSON (truncated or corrupt): {exc}") from None
    if version == 2:
        raise SchemaError(f"{path.name} has schema_version 2: its TQ snapshot stores a row per sample as "
                          f"tensors, and this scd stores a group per key (schema {SCHEMA_VERSION}). Finish or "
                          "restore that run with the scd that wrote it, or move its bundles out of "
                          "checkpointing.dir to start empty")
    if version not in READABLE_SCHEMAS:
        raise SchemaError(f"{path.name} has schema_version {version!r}; this scd reads "
                          f"{sorted(READABLE_SCHEMAS)}")
    try:
        if kind is Sidecar and version in (3, 4):
            return cast(D, _sidecar_from_schema_4(msgspec.json.decode(raw, type=_Schema4Sidecar), path.name))
        return msgspec.json.decode(raw, type=kind)
    except msgspec.DecodeError as exc:
        raise SchemaError(f"{path.name} is malformed: {exc}") from None


class _Version(msgspec.Struct):
    schema_version: int | None = None
