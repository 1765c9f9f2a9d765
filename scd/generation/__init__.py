"""Generation backends: the embedded torch sampler and vLLM (imported only when configured)."""

from __future__ import annotations

from scd.config import Config
from scd.generation.base import GenerationBackend
from scd.training.policy import Policy


async def open_backend(config: Config, policy: Policy) -> GenerationBackend:
    """The configured backend serving ``policy``; heavy start-up runs off the event loop."""
    if config.generation.backend == "vllm":
        from scd.generation.vllm_backend import VLLMBackend

        return await VLLMBackend.open(config, policy)
    import anyio

    from scd.generation.torch_backend import TorchBackend

    return await anyio.to_thread.run_sync(TorchBackend, config, policy)
