"""Checkpoint loading: config forms, shards, dtypes, and named errors for broken checkpoints."""

import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from engine import LLM, ModelLoadError, SamplingParams
from engine.config import ModelConfig

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def edit_config(model_dir, **changes):
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def test_unknown_architecture_is_named(tiny_llama_dir, tmp_path):
    d = copy(tiny_llama_dir, tmp_path / "m")
    edit_config(d, architectures=["GPTNeoXForCausalLM"])
    with pytest.raises(ModelLoadError, match=r"GPTNeoXForCausalLM.*not supported: allowed are LlamaForCausalLM"):
        LLM(d)


def test_missing_tensor_is_named(tiny_llama_dir, tmp_path):
    d = copy(tiny_llama_dir, tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"missing tensors: model\.layers\.1\.mlp\.up_proj\.weight"):
        LLM(d)


def test_misshaped_tensor_is_named(tiny_llama_dir, tmp_path):
    d = copy(tiny_llama_dir, tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(7, 64)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"k_proj\.weight in model\.safetensors has shape \(7, 64\), but "
                                             r"config\.json implies \(32, 64\)"):
        LLM(d)


def test_sharded_checkpoint_loads_the_same(tiny_llama_dir, tmp_path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    d = copy(tiny_llama_dir, tmp_path / "sharded")
    (d / "model.safetensors").unlink()
    hf.save_pretrained(d, max_shard_size="100KB")
    assert (d / "model.safetensors.index.json").is_file() and len(list(d.glob("model-*.safetensors"))) > 2
    prompt = [5, 6, 7, 8, 9]
    [ours], [ref] = LLM(d).generate(prompt, GREEDY), LLM(tiny_llama_dir).generate(prompt, GREEDY)
    assert ours.outputs[0].token_ids == ref.outputs[0].token_ids


def test_rope_theta_and_rope_parameters_forms_agree(tiny_llama_dir):
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    new_form = {**config, "rope_parameters": {"rope_theta": 500000.0, **scaling}}
    new_form.pop("rope_theta", None)
    old_form = {**config, "rope_theta": 500000.0, "rope_scaling": {**scaling}}
    old_form.pop("rope_parameters", None)
    legacy_key = {**old_form, "rope_scaling": {**scaling, "type": scaling["rope_type"]}}
    del legacy_key["rope_scaling"]["rope_type"]
    parsed = [ModelConfig.from_dict(c) for c in (new_form, old_form, legacy_key)]
    assert parsed[0] == parsed[1] == parsed[2]
    assert parsed[0].rope_theta == 500000.0 and parsed[0].rope_scaling["rope_type"] == "llama3"
    with pytest.raises(ModelLoadError, match="rope_type='yarn' is not supported"):
        ModelConfig.from_dict({**config, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0, "factor": 2.0}})


@pytest.mark.parametrize("arch_name", ["MistralForCausalLM"])
def test_mistral_architecture_loads_as_llama(tiny_llama_dir, tmp_path, arch_name):
    d = copy(tiny_llama_dir, tmp_path / "mistral")
    edit_config(d, architectures=[arch_name], model_type="mistral", sliding_window=None)
    hf = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    assert type(hf).__name__ == arch_name
    out = LLM(d).generate([3, 4, 5, 6], GREEDY)[0].outputs[0]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([[3, 4, 5, 6]]), max_new_tokens=24, do_sample=False, min_new_tokens=24)
    assert out.token_ids == ref[0, 4:].tolist()


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2"])
def test_config_without_architectures_loads_by_model_type(tiny_llama_dir, tiny_qwen2_dir, tmp_path, model_type):
    """As transformers' AutoModelForCausalLM does: no `architectures`, the class comes from model_type."""
    d = copy(tiny_qwen2_dir if model_type == "qwen2" else tiny_llama_dir, tmp_path / model_type)
    edit_config(d, architectures=None, model_type=model_type, sliding_window=None)
    assert "architectures" not in json.loads((d / "config.json").read_text())
    hf = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    expected = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}[model_type]
    assert type(hf).__name__ == ModelConfig.from_dir(d).architecture == expected
    out = LLM(d).generate([3, 4, 5, 6], GREEDY)[0].outputs[0]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([[3, 4, 5, 6]]), max_new_tokens=24, do_sample=False, min_new_tokens=24)
    assert out.token_ids == ref[0, 4:].tolist()


def test_config_without_architectures_names_an_unknown_model_type(tiny_llama_dir, tmp_path):
    d = copy(tiny_llama_dir, tmp_path / "m")
    edit_config(d, architectures=None, model_type="gpt_neox")
    with pytest.raises(ModelLoadError, match=r"no architectures and model_type='gpt_neox' is not supported: "
                                             r"allowed are llama, mistral, qwen2"):
        LLM(d)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_requested_dtype(tiny_llama_dir, dtype):
    llm = LLM(tiny_llama_dir, dtype=dtype)
    assert llm.engine.model.embed_tokens.weight.dtype == getattr(torch, dtype)
    assert llm.engine.runner.kv_caches[0][0].dtype == getattr(torch, dtype)
    out = llm.generate([3, 4, 5], GREEDY)[0].outputs[0]
    assert len(out.token_ids) == 24


def test_checkpoint_dtype_is_the_default(tiny_llama_dir, tmp_path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16)
    d = copy(tiny_llama_dir, tmp_path / "bf16")
    (d / "model.safetensors").unlink()
    hf.save_pretrained(d)
    assert LLM(d).engine.model.norm.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype='fp8' is invalid"):
        LLM(d, dtype="fp8")
