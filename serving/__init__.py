"""Serving: the engine (`LLM`), its scheduler, caches, speculative decoding and the server.

vLLM's import habit works: `from serving import LLM, SamplingParams`.
"""

from serving.core.sampling import SamplingParams
from serving.engine import LLM, RequestOutput

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
