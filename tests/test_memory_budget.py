"""The KV cache sized from a fraction of the device's memory (--kv-cache-memory-fraction, vLLM's
gpu_memory_utilization): the budget arithmetic exactly, the weights counted as the model holds them, and a real
runtime whose block count follows the fraction."""

import argparse

import pytest
import torch

from duet.cli_common import add_engine_args, engine_config
from engine.config import ModelConfig
from engine.default_model import default_model_path
from engine.engine_config import EngineConfig
from engine.errors import ModelLoadError
from engine.kernels import native_library
from engine.kv_cache_manager import cdiv
from engine.linear_fast import FastLinear
from engine.memory_budget import DeviceMemory, device_memory, kv_cache_budget_bytes
from engine.quantization import weight_bytes_by_kind
from engine.runtime import build_runtime
from engine.weights import build_model, planned_weight_bytes

GIB = 1024**3


def test_budget_is_the_fraction_less_what_is_in_use_and_the_weights():
    assert kv_cache_budget_bytes(0.5, DeviceMemory(8 * GIB, 1 * GIB), 1 * GIB) == 2 * GIB
    assert kv_cache_budget_bytes(0.9, DeviceMemory(80 * GIB, 0), 16 * GIB) == int(0.9 * 80 * GIB) - 16 * GIB
    assert kv_cache_budget_bytes(1, DeviceMemory(100, 10), 89) == 1


def test_a_fraction_that_leaves_nothing_says_where_the_memory_went():
    with pytest.raises(ValueError, match=r"kv_cache_memory_fraction=0.25 leaves no room for the KV cache: 0.25 x "
                                         r"8.00 GiB = 2.00 GiB, of which 1.00 GiB is in use and the weights take "
                                         r"1.00 GiB"):
        kv_cache_budget_bytes(0.25, DeviceMemory(8 * GIB, 1 * GIB), 1 * GIB)


def parse(argv):
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return engine_config(p.parse_args(argv))


def test_the_flag_sets_the_fraction_and_refuses_bad_values():
    assert parse(["--kv-cache-memory-fraction", "0.85"]) == EngineConfig(kv_cache_memory_fraction=0.85)
    for bad in ("0", "1.5", "-0.1"):
        with pytest.raises(ValueError, match=rf"kv_cache_memory_fraction={float(bad)!r} is invalid: must be in "
                                             r"\(0, 1\]"):
            parse(["--kv-cache-memory-fraction", bad])
    with pytest.raises(ValueError, match="num_kv_blocks=8 and kv_cache_memory_fraction=0.5 both size the KV cache"):
        parse(["--kv-cache-memory-fraction", "0.5", "--num-kv-blocks", "8"])


def test_weights_are_counted_as_the_model_holds_them(tiny_llama_dir):
    rt = build_runtime(tiny_llama_dir, EngineConfig(num_kv_blocks=4, dtype="float32", quantization="none"))
    held = sum(p.numel() * p.element_size() for p in rt.model.parameters())
    config = ModelConfig.from_path(tiny_llama_dir)
    assert planned_weight_bytes(config, tiny_llama_dir, torch.float32) == held
    assert planned_weight_bytes(config, tiny_llama_dir, torch.bfloat16) == held // 2
    assert held // 2 < planned_weight_bytes(config, tiny_llama_dir, torch.float32, tp_size=2) < held  # rank 0's
    # int8 (this model's MLP width, 176, is no multiple of int4's groups): the linears as their packed tensors
    model = build_model(config, tiny_llama_dir, torch.float32, 64, quantization="int8")
    planned = planned_weight_bytes(config, tiny_llama_dir, torch.float32, quantization="int8")
    assert planned == sum(weight_bytes_by_kind(model).values()) < held


@pytest.mark.slow
def test_the_default_gguf_kept_quantized_is_counted_packed():
    path = default_model_path()
    config = ModelConfig.from_path(path)
    model = build_model(config, path, torch.float32, 64, quantization="auto")
    planned = planned_weight_bytes(config, path, torch.float32, quantization="auto")
    assert planned == sum(weight_bytes_by_kind(model).values())
    # the embedding stays dense (113 MB in fp32) next to the packed tied lm_head (Q8_0)
    assert planned < planned_weight_bytes(config, path, torch.float32, quantization="none") / 2


def test_cpu_memory_is_the_container_limit_or_ram():
    memory = device_memory(torch.device("cpu"))
    assert 0 < memory.used_bytes < memory.total_bytes  # this process's resident memory, inside the total


def test_runtime_sizes_the_cache_from_the_fraction(tiny_llama_dir):
    model_config = ModelConfig.from_path(tiny_llama_dir)
    weights = planned_weight_bytes(model_config, tiny_llama_dir, torch.float32)
    block_size = 256
    block_bytes = 2 * model_config.num_layers * block_size * model_config.num_kv_heads * model_config.head_dim * 4
    target_blocks = 3000  # 384 MiB, far below the cap (max_num_seqs x blocks per sequence): the fraction decides
    memory = device_memory(torch.device("cpu"))
    fraction = (memory.used_bytes + weights + target_blocks * block_bytes) / memory.total_bytes
    config = EngineConfig(dtype="float32", block_size=block_size, kv_cache_memory_fraction=fraction,
                          max_num_seqs=4096)
    assert config.max_num_seqs * cdiv(model_config.max_position_embeddings, block_size) > 2 * target_blocks
    rt = build_runtime(tiny_llama_dir, config)
    # resident memory moves a little between the measurement above and the one inside build_runtime
    slack_blocks = 32 * 1024**2 // block_bytes  # 256 blocks
    assert abs(rt.num_kv_blocks - target_blocks) <= slack_blocks, (rt.num_kv_blocks, target_blocks, slack_blocks)
    assert rt.block_pool.num_free_blocks == rt.num_kv_blocks
    with pytest.raises(ModelLoadError, match=r"kv_cache_memory_fraction=1e-06 leaves no room for the KV cache"):
        build_runtime(tiny_llama_dir, EngineConfig(dtype="float32", kv_cache_memory_fraction=1e-6))


@pytest.mark.skipif(native_library() is None, reason="the C kernels could not be built here")
def test_a_fast_linears_views_of_one_weight_count_once():
    weight = torch.randn(512, 512)  # 1 MiB: not packed, the one-row GEMV reads it in place
    fast = FastLinear(weight, None, pack=False, gemv=True)
    assert fast.gemv.weight.data_ptr() == fast.rows.weight.data_ptr() == weight.data_ptr()
    assert weight_bytes_by_kind(torch.nn.Sequential(fast)) == {"float32": 512 * 512 * 4}
