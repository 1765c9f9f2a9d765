"""Generation backends: the embedded torch sampler, vLLM, and the synthetic load-testing engine."""

from __future__ import annotations

from scd.config import Config
from scd.generation.base import GenerationBackend
from scd.training.policy import Policy


async def open_backend(config: Config, policy: Policy) -> GenerationBackend:
    """The configured backend serving ``policy``; heavy start-up runs off the event loop."""
    if config.generation.backend == "vllm":
        from scd.generation.vllm_backend import VLLMBackend

        return await VLLMBackend.open(config, policy)
    if config.generation.backend == "synthetic":
        from scd.generation.synthetic_backend import SyntheticBackend

        return SyntheticBackend(config)
    import anyio

    from scd.generation.torch_backend import TorchBackend

    return await anyio.to_thread.run_sync(TorchBackend, config, policy)
