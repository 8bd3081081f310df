"""The serving engine: requests, sampling, the token-budget scheduler over the hybrid cache, the runner and the offline LLM API."""

from openk3.serve.engine import EngineConfig, LLMEngine
from openk3.serve.llm import LLM
from openk3.serve.request import CompletionOutput, RequestOutput
from openk3.serve.sampling import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]
