"""Generation backends: the embedded torch sampler, vLLM, and the synthetic load-testing engine.

``BACKENDS`` maps each ``generation.backend`` name to its class; ``scd.config.GENERATION_BACKENDS``
maps the same names to their config sub-tables.  A backend's module imports nothing heavy until
it opens (vLLM itself loads only when the vLLM backend does).
"""

from __future__ import annotations

from scd.config import Config
from scd.generation.base import BackendClass, GenerationBackend
from scd.generation.synthetic_backend import SyntheticBackend
from scd.generation.torch_backend import TorchBackend
from scd.generation.vllm_backend import VLLMBackend
from scd.model.policy import Policy

BACKENDS: dict[str, BackendClass] = {"torch": TorchBackend, "vllm": VLLMBackend, "synthetic": SyntheticBackend}


async def open_backend(config: Config, policy: Policy) -> GenerationBackend:
    """The configured backend serving ``policy``; heavy start-up runs off the event loop."""
    return await BACKENDS[config.generation.backend].open(config, policy)
