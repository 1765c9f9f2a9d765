"""The vLLM backend: imported lazily, and exercised only where CUDA exists."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO


def test_scd_does_not_import_vllm_for_the_torch_backend() -> None:
    code = ("import sys, scd.cli, scd.daemon, scd.generation; "
            "from scd.generation import build_backend; assert 'vllm' not in sys.modules; print('lazy')")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "lazy", out.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (vLLM runs only on GPUs)")
async def test_vllm_generates_a_tagged_group(tmp_path) -> None:
    from scd.config import parse_config
    from scd.generation import build_backend
    from scd.generation.base import GroupRequest
    from scd.tasks import Prompt

    config = parse_config({"generation": {"backend": "vllm", "max_new_tokens": 8},
                           "model": {"name": "facebook/opt-125m"}}, tmp_path)
    backend = build_backend(config)
    try:
        [result] = await backend.generate([GroupRequest("e0-p0", 0, Prompt(0, "1234", "4321"), 4, None, 0.0)])
        assert len(result.rollouts) == 4
        assert all(r.weight_version == 0 for r in result.rollouts)
        assert backend.generated_tokens() > 0
    finally:
        await backend.aclose()
