"""``scd export`` and ``run.export_dir``: a bundle's policy as a Hugging Face directory that transformers loads,
with the bundle's weights; bad input refused with nothing written."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import orjson
import torch

from scd.checkpoint import layout
from tests.conftest import REPO, SCD, ScdProcess, tree_digest, write_config

HF_FILES = {"config.json", "model.safetensors", "generation_config.json", "tokenizer_config.json", "scd_export.json"}
# Unlike the tiny Llama tokenizer's own: the prompt's text, then "=" where the answer starts.
PLAIN_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"


def export(bundle: Path, out_dir: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SCD, "export", str(bundle), str(out_dir), *flags], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


def load_holding_the_bundles_weights(exported: Path, bundle: Path) -> tuple[Any, dict[str, torch.Tensor]]:
    """The export as transformers loads it, checked to hold exactly ``bundle``'s weights (in its dtype), and
    those weights."""
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(exported, local_files_only=True)
    saved = torch.load(bundle / layout.MODEL_FILE, weights_only=True)
    for name, tensor in loaded.state_dict().items():
        torch.testing.assert_close(tensor, saved[name].to(tensor.dtype), rtol=0, atol=0, msg=name)
    return loaded, saved


def greedy(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    generated = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0)
    return generated[0, len(prompt):].tolist()


def new_file_mode(directory: Path) -> int:
    """The mode a file this process creates gets: 0666 less the umask."""
    probe = directory / "mode-probe"
    probe.touch()
    return probe.stat().st_mode & 0o777


def test_a_run_exports_its_final_bundle_that_transformers_loads_with_its_weights_and_scd_export_guards_its_input(
        tmp_path: Path, scd_processes: list[ScdProcess], session_ray: str, tiny_llama: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # A dataset task whose prompts go through a chat template given as a file.
    dataset = tmp_path / "train.jsonl"
    dataset.write_bytes(b"".join(orjson.dumps({"prompt": f"{k * 37 % 10_000:04d}",
                                               "answer": f"{k * 37 % 10_000:04d}"[::-1]}) + b"\n" for k in range(64)))
    (tmp_path / "plain.jinja").write_text(PLAIN_TEMPLATE)
    config = write_config(tmp_path, ray_address=session_ray)
    config.write_text(config.read_text().replace(
        'name = "reverse"\nsize = 64\n', f'name = "jsonl"\npath = "{dataset}"\nchat_template = "plain.jinja"\n'))
    scd = ScdProcess(config, "--max-steps", "2", "--set", f"model.name='{tiny_llama}'",
                     "--set", "checkpointing.enabled=true", "--set", "run.export_dir='export'")
    scd_processes.append(scd)
    assert scd.wait(timeout=300) == 0, scd.output()[-3000:]
    out = tmp_path / "out"
    bundle = layout.step_dir(out / "checkpoints", 2)
    exported = out / "export"
    assert HF_FILES <= {p.name for p in exported.iterdir()}
    assert orjson.loads((exported / "scd_export.json").read_bytes())["step"] == 2
    # Every file has a new file's mode (transformers writes the weights through a 0600 temporary file).
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in exported.iterdir()} == \
        {p.name: oct(new_file_mode(tmp_path)) for p in exported.iterdir()}
    # The tokenizer carries the template the run rendered its prompts with, not the model directory's.
    tokenizer = AutoTokenizer.from_pretrained(exported, local_files_only=True)
    assert tokenizer.chat_template == PLAIN_TEMPLATE
    assert tokenizer.apply_chat_template([{"role": "user", "content": "1234"}], add_generation_prompt=True,
                                         tokenize=False) == "1234="

    # The export's weights are the bundle's, in model.dtype; it generates as the trainer's weights do.
    loaded, saved = load_holding_the_bundles_weights(exported, bundle)
    base = AutoModelForCausalLM.from_pretrained(tiny_llama, local_files_only=True)
    assert any(not torch.equal(tensor, base.state_dict()[name]) for name, tensor in saved.items())
    trainer = AutoModelForCausalLM.from_pretrained(tiny_llama, local_files_only=True)
    trainer.load_state_dict(saved)
    prompt = AutoTokenizer.from_pretrained(exported, local_files_only=True)("12345")["input_ids"]
    assert greedy(loaded.eval(), prompt) == greedy(trainer.eval(), prompt)

    # `scd export` of the same bundle: a new directory, never over a non-empty one without --force.
    again = tmp_path / "again"
    done = export(bundle, again)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (again / "model.safetensors").read_bytes() == (exported / "model.safetensors").read_bytes()
    before = tree_digest(again)
    refused = export(bundle, again)
    assert refused.returncode == 2 and f"{again} exists and is not empty: pass --force" in refused.stderr
    assert tree_digest(again) == before
    forced = export(bundle, again, "--force")
    assert forced.returncode == 0, forced.stderr[-3000:]
    assert HF_FILES <= {p.name for p in again.iterdir()}
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".again")) == []

    # A template file edited since the run is refused: the export would carry one the policy never saw.
    (tmp_path / "plain.jinja").write_text(PLAIN_TEMPLATE + "\n")
    edited = export(bundle, tmp_path / "edited")
    assert edited.returncode == 2 and f"task.chat_template = {tmp_path / 'plain.jinja'}) was edited" in edited.stderr
    assert not (tmp_path / "edited").exists()

    # A bundle that fails verification writes nothing.
    data = bytearray((bundle / layout.MODEL_FILE).read_bytes())
    data[-1] ^= 0xFF
    (bundle / layout.MODEL_FILE).write_bytes(bytes(data))
    broken = export(bundle, tmp_path / "broken")
    assert broken.returncode == 3 and "does not match its BLAKE3 digest" in broken.stderr
    assert not (tmp_path / "broken").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".broken")]


def test_exporting_the_tiny_transformer_is_refused_naming_why(tmp_path: Path) -> None:
    """Before any run: the config refuses ``run.export_dir`` for the tiny model, exit 2."""
    config = write_config(tmp_path)
    refused = subprocess.run([*SCD, "run", str(config), "--set", "checkpointing.enabled=true",
                              "--set", "run.export_dir='export'"], cwd=REPO, capture_output=True, text=True,
                             timeout=120)
    assert refused.returncode == 2
    assert "run.export_dir" in refused.stderr and "tiny transformer" in refused.stderr


def test_run_export_dir_needs_checkpointing(tmp_path: Path, tiny_llama: Path) -> None:
    config = write_config(tmp_path)
    refused = subprocess.run([*SCD, "run", str(config), "--set", f"model.name='{tiny_llama}'",
                              "--set", "checkpointing.enabled=false", "--set", "run.export_dir='export'"],
                             cwd=REPO, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "checkpointing.enabled = true" in refused.stderr
