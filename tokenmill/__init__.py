"""tokenmill: a high-throughput LLM inference engine you can read in an afternoon."""

from tokenmill.engine.llm import LLM
from tokenmill.outputs import CompletionOutput, Logprob, RequestOutput
from tokenmill.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
