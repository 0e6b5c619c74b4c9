"""duet's model runtime, shared by prefill and decode workers.

    from engine import LLM, SamplingParams
    outputs = LLM(model_dir).generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
    print(outputs[0].outputs[0].text)

Names load lazily so that light users (the router hashes and tokenizes) do not import torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "engine.llm",
    "LLMEngine": "engine.llm_engine",
    "EngineConfig": "engine.config",
    "ModelConfig": "engine.config",
    "SamplingParams": "engine.sampling_params",
    "StructuredOutput": "engine.structured_output",
    "RequestOutput": "engine.outputs",
    "CompletionOutput": "engine.outputs",
    "Logprob": "engine.logprob",
    "TextPrompt": "engine.prompt",
    "TokensPrompt": "engine.prompt",
    "InvalidRequestError": "engine.errors",
    "ModelLoadError": "engine.errors",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
