"""A bundle's policy as a Hugging Face model directory: ``scd export BUNDLE OUT_DIR``, and ``run.export_dir``.

The directory is what ``transformers`` and vLLM load: ``config.json``, ``model.safetensors``, the tokenizer's
files, ``generation_config.json``, and ``scd_export.json`` naming the bundle and its step.  The weights are
the bundle's fp32 masters cast to the run's ``model.dtype``, as every weight sync casts them, in the
architecture and with the tokenizer of the model directory the run trained (``model.name``, recorded in the
bundle), carrying the chat template the run rendered its prompts with (a ``task.chat_template`` file, checked
against the digest the bundle recorded).  Every file gets a new file's usual mode (0644 under a 022 umask).
Written beside ``OUT_DIR`` and renamed into place, so a directory named ``OUT_DIR`` is always a whole export;
a bundle that does not verify writes nothing.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import orjson
import torch

from scd.checkpoint import layout
from scd.checkpoint.verify import verify_bundle
from scd.config import CHAT_TEMPLATE_WORDS
from scd.errors import EXIT_CONFIG, ScdError
from scd.model.policy import TINY

log = logging.getLogger(__name__)


class ExportRefused(ScdError):
    """``scd export`` asked for what it cannot do without losing something: exit 2, nothing written."""

    exit_code = EXIT_CONFIG


def export_bundle(bundle: Path, out_dir: Path, *, replace: bool = False) -> Path:
    """Write ``bundle``'s policy to ``out_dir`` as a Hugging Face directory; blocking.  ``replace``: an
    existing ``out_dir`` is replaced (only once the new export is whole), else refused unless empty."""
    info = verify_bundle(bundle).info
    model = info.config_fingerprint_fields["model"]
    name, dtype = model["name"], getattr(torch, model["dtype"])
    if name == TINY:
        raise ExportRefused(f"cannot export {bundle}: it trained scd's embedded tiny transformer (model.name = "
                            "'tiny'), which is no Hugging Face architecture; train a Hugging Face model directory "
                            "to export one (`scd model init-tiny DIR` makes a small Llama)")
    model_dir = Path(name)
    if not (model_dir / "config.json").is_file():
        raise ExportRefused(f"cannot export {bundle}: the model directory it trained ({model_dir}) has no "
                            "config.json any more; the export takes its architecture and tokenizer from there")
    if out_dir.exists() and not replace and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ExportRefused(f"{out_dir} exists and is not empty: pass --force to replace it")
    template = _chat_template_file(bundle, info.config_fingerprint_fields)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    partial = out_dir.parent / f".{out_dir.name}.partial-{uuid.uuid4().hex[:8]}"
    try:
        policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
        weights = torch.load(bundle / layout.MODEL_FILE, weights_only=True, mmap=True)
        policy.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in weights.items()})
        policy.save_pretrained(partial, safe_serialization=True)
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        if template is not None:
            tokenizer.chat_template = template
        tokenizer.save_pretrained(partial)
        (partial / "scd_export.json").write_bytes(orjson.dumps(
            {"bundle": str(bundle.resolve()), "step": info.step, "weight_version": info.weight_version,
             "dtype": model["dtype"]}, option=orjson.OPT_INDENT_2 | orjson.OPT_APPEND_NEWLINE))
        _give_new_file_modes(partial, like=partial / "scd_export.json")
        layout.fsync_tree(partial)
        _move_into_place(partial, out_dir)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    log.info("exported %s (step %d) to %s as %s", bundle, info.step, out_dir, model["dtype"])
    return out_dir


def _chat_template_file(bundle: Path, fields: dict[str, Any]) -> str | None:
    """The text of the ``task.chat_template`` file the bundle's run rendered prompts with; None when the run
    used the tokenizer's own template (saved with the tokenizer) or none.  A file gone or edited since is
    refused: the export would carry a template the policy never trained under."""
    path = fields["task"].get("chat_template", "auto")
    if path in CHAT_TEMPLATE_WORDS:
        return None
    recorded = fields["task.chat_template_sha256"]
    try:
        text = Path(path).read_bytes()
    except OSError as exc:
        raise ExportRefused(f"cannot export {bundle}: its run's chat template (task.chat_template = {path}) "
                            f"cannot be read ({exc.strerror}); the export carries the template the run used") from None
    if hashlib.sha256(text).hexdigest() != recorded:
        raise ExportRefused(f"cannot export {bundle}: its run's chat template (task.chat_template = {path}) was "
                            "edited since (its SHA-256 differs from the bundle's); restore the file the run used")
    return text.decode()


def _give_new_file_modes(root: Path, *, like: Path) -> None:
    """Every file under ``root`` gets the mode of ``like``, a file this process just created (0666 less the
    umask): transformers writes ``model.safetensors`` through a temporary file, whose mode is 0600."""
    mode = like.stat().st_mode & 0o777
    for path in root.rglob("*"):
        if path.is_file():
            path.chmod(mode)


def _move_into_place(partial: Path, out_dir: Path) -> None:
    """``partial`` becomes ``out_dir``; a replaced one is moved aside first and deleted only after."""
    aside = None
    if out_dir.exists():
        aside = out_dir.parent / f".{out_dir.name}.replaced-{uuid.uuid4().hex[:8]}"
        os.rename(out_dir, aside)
    os.rename(partial, out_dir)
    layout.fsync_path(out_dir.parent)
    if aside is not None and aside.is_dir():
        shutil.rmtree(aside)
    elif aside is not None:
        aside.unlink()
