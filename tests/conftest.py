import pytest

from engine.tiny_model import make_tiny_model


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama", layers=2, hidden=64, heads=4,
                           kv_heads=2, vocab=512, seed=0)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), arch="qwen2", layers=2, hidden=64, heads=4,
                           kv_heads=2, vocab=512, seed=1)
