"""Generation backends: the embedded torch sampler and vLLM (optional, imported lazily)."""

from __future__ import annotations

from scd.config import Config
from scd.generation.base import GenerationBackend


def build_backend(config: Config) -> GenerationBackend:
    if config.generation.backend == "vllm":
        from scd.generation.vllm_backend import VLLMBackend

        return VLLMBackend(config)
    from scd.generation.torch_backend import TorchBackend

    return TorchBackend(config)
