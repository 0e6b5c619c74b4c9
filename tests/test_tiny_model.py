import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import engine.tiny_model as tiny_model
from engine.tiny_model import SPECIAL_TOKENS, build_tokenizer, default_model_dir, make_tiny_model

REPO_ROOT = Path(__file__).resolve().parents[1]
FILES = {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "special_tokens_map.json"}


def read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_writes_a_complete_checkpoint(arch, request):
    path = request.getfixturevalue(f"tiny_{arch}_dir")
    assert {p.name for p in path.iterdir()} == FILES
    config = read_json(path / "config.json")
    assert config["model_type"] == arch
    assert (config["vocab_size"], config["hidden_size"], config["num_hidden_layers"]) == (512, 64, 2)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert config["intermediate_size"] == 176  # 16 * round(8/3 * 64 / 16)
    assert config["rope_theta"] == 10000.0 and config["rope_parameters"]["rope_theta"] == 10000.0
    assert config["rms_norm_eps"] == (1e-5 if arch == "llama" else 1e-6)
    assert config["tie_word_embeddings"] is (arch == "qwen2")
    assert (config["bos_token_id"], config["eos_token_id"]) == (0, 1)
    generation = read_json(path / "generation_config.json")
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (0, [1, 3])
    tokenizer_config = read_json(path / "tokenizer_config.json")
    assert "<|im_start|>" in tokenizer_config["chat_template"]
    assert (tokenizer_config["bos_token"], tokenizer_config["eos_token"]) == ("<|begin_of_text|>", "<|end_of_text|>")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_loads_with_transformers(arch, request):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = request.getfixturevalue(f"tiny_{arch}_dir")
    model = AutoModelForCausalLM.from_pretrained(path)
    hf_tokenizer = AutoTokenizer.from_pretrained(path)
    assert len(hf_tokenizer) == model.config.vocab_size == 512
    assert hf_tokenizer.convert_ids_to_tokens([0, 1, 2, 3]) == list(SPECIAL_TOKENS)
    ids = hf_tokenizer("Hello wörld 中文 😀", return_tensors="pt").input_ids
    assert ids[0, 0].item() == 0  # bos prepended by the post-processor
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 512) and torch.isfinite(logits).all()

    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tied is (arch == "qwen2")
    attention = model.model.layers[0].self_attn
    if arch == "qwen2":
        assert all(getattr(attention, p).bias.abs().sum() > 0 for p in ("q_proj", "k_proj", "v_proj"))
        assert attention.o_proj.bias is None
    else:
        assert all(getattr(attention, p).bias is None for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
    norm = model.model.layers[0].input_layernorm.weight
    assert not torch.equal(norm, torch.ones_like(norm))  # randomized, so a loader that skips it is caught


def test_same_arguments_give_identical_files_and_other_seeds_do_not(tmp_path, tiny_qwen2_dir):
    again = make_tiny_model(tmp_path / "again", arch="qwen2", layers=2, hidden=64, heads=4, kv_heads=2, vocab=512,
                            seed=1)
    reseeded = make_tiny_model(tmp_path / "reseeded", arch="qwen2", layers=2, hidden=64, heads=4, kv_heads=2,
                               vocab=512, seed=2)
    first, second = load_file(tiny_qwen2_dir / "model.safetensors"), load_file(again / "model.safetensors")
    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json"):
        assert (tiny_qwen2_dir / name).read_bytes() == (again / name).read_bytes(), name
    other = load_file(reseeded / "model.safetensors")
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])
    assert (tiny_qwen2_dir / "tokenizer.json").read_bytes() == (reseeded / "tokenizer.json").read_bytes()


def test_caller_rng_state_is_left_alone(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    make_tiny_model(tmp_path, hidden=32, heads=2, kv_heads=1, vocab=300, layers=1)
    assert torch.equal(torch.rand(3), expected)


def test_dtype_and_overrides(tmp_path):
    path = make_tiny_model(tmp_path, arch="llama", layers=1, hidden=32, heads=2, kv_heads=1, vocab=300,
                           intermediate=48, tie_word_embeddings=True, dtype="bfloat16", max_position_embeddings=256)
    config = read_json(path / "config.json")
    assert (config["dtype"], config["intermediate_size"], config["tie_word_embeddings"]) == ("bfloat16", 48, True)
    assert config["max_position_embeddings"] == 256
    tensors = load_file(path / "model.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert "lm_head.weight" not in tensors
    assert read_json(path / "tokenizer_config.json")["model_max_length"] == 256


def test_bpe_training_is_deterministic_across_processes_and_thread_counts():
    code = "import sys, engine.tiny_model as t; sys.stdout.write(t.build_tokenizer('llama', 700).to_str())"
    outputs = set()
    for threads in ("1", "4"):
        env = {**os.environ, "RAYON_NUM_THREADS": threads, "PYTHONHASHSEED": threads}
        result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                                check=True)
        outputs.add(result.stdout)
    outputs.add(build_tokenizer("llama", 700).to_str())
    assert len(outputs) == 1


def test_vocab_is_padded_with_plain_entries_to_any_size_quickly():
    start = time.perf_counter()
    tokenizer = build_tokenizer("qwen2", 151936)
    assert time.perf_counter() - start < 10.0  # ~1 s unloaded; slack for busy CI
    assert tokenizer.get_vocab_size(with_added_tokens=True) == 151936
    assert tokenizer.id_to_token(151935) == "<unused_151935>"
    assert sorted(tokenizer.get_added_tokens_decoder()) == [0, 1, 2, 3]  # padding is not added tokens
    assert tokenizer.decode([151935], skip_special_tokens=True) == "<unused_151935>"


def test_vocab_holds_tokens_that_end_mid_character(tiny_llama_dir):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_llama_dir / "tokenizer.json"))
    ids = tokenizer.encode("中文 😀 Αθήνα", add_special_tokens=False).ids
    partial = [i for i in ids if tokenizer.decode([i]).endswith("\ufffd")]
    assert partial, "some tokens should be partial UTF-8 sequences"
    assert tokenizer.decode(ids) == "中文 😀 Αθήνα"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"arch": "gpt2"}, "arch='gpt2' is invalid: must be one of llama, qwen2"),
        ({"heads": 4, "kv_heads": 3}, "heads=4 is invalid: must be a multiple of kv_heads=3"),
        ({"hidden": 100, "heads": 8, "kv_heads": 2}, "hidden=100 is invalid: must be a multiple of heads=8"),
        ({"hidden": 36, "heads": 4, "kv_heads": 2}, "hidden=36 is invalid: must give an even head dim"),
        ({"vocab": 100}, "vocab=100 is invalid: must be an integer >= 260"),
        ({"layers": 0}, "layers=0 is invalid: must be an integer >= 1"),
        ({"kv_heads": 0}, "kv_heads=0 is invalid: must be an integer >= 1"),
        ({"intermediate": 0}, "intermediate=0 is invalid"),
        ({"dtype": "int8"}, "dtype='int8' is invalid: must be one of float32, bfloat16, float16"),
        ({"seed": -1}, r"seed=-1 is invalid: must be an integer in \[0, 2\*\*63\)"),
        ({"initializer_range": 0}, r"initializer_range=0 is invalid: must be in \(0, 1\]"),
        ({"max_position_embeddings": 0}, "max_position_embeddings=0 is invalid"),
    ],
)
def test_invalid_arguments_name_the_argument_value_and_allowed_range(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_tiny_model(tmp_path / "never", **kwargs)
    assert not (tmp_path / "never").exists()


def test_default_model_is_made_once_with_fixed_arguments(tmp_path, monkeypatch):
    monkeypatch.setenv("DUET_CACHE_DIR", str(tmp_path))
    path = default_model_dir()
    assert path == tmp_path / "models" / "tiny-llama-v1"
    config = read_json(path / "config.json")
    assert (config["model_type"], config["hidden_size"], config["num_hidden_layers"]) == ("llama", 128, 2)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]) == (4, 2, 1024)
    assert sorted(p.name for p in path.parent.iterdir()) == ["tiny-llama-v1"]  # no temp dir left behind

    def must_not_build(*args, **kwargs):
        raise AssertionError("the default model was built twice")

    monkeypatch.setattr(tiny_model, "make_tiny_model", must_not_build)
    assert default_model_dir() == path


def test_default_model_uses_the_copy_of_a_process_that_won_the_race(tmp_path, monkeypatch, tiny_llama_dir):
    monkeypatch.setenv("DUET_CACHE_DIR", str(tmp_path))
    target = tmp_path / "models" / "tiny-llama-v1"

    def build_while_another_process_finishes_first(out_dir, **kwargs):
        shutil.copytree(tiny_llama_dir, target)  # the other process renames its copy into place first
        (Path(out_dir) / "config.json").write_text("{}")

    monkeypatch.setattr(tiny_model, "make_tiny_model", build_while_another_process_finishes_first)
    assert default_model_dir() == target
    assert (target / "config.json").read_bytes() == (tiny_llama_dir / "config.json").read_bytes()
    assert sorted(p.name for p in target.parent.iterdir()) == ["tiny-llama-v1"]
