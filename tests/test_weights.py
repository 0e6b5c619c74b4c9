"""The one weight loader: tensor specs, the safetensors source, and a TP rank's shard as a slice of each spec."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import ModelLoadError
from engine.config import ModelConfig
from engine.model import LlamaForCausalLM
from engine.tensor_parallel import TPGroup, plan_shard
from engine.tensor_source import SafetensorsSource, TensorSlice, open_source
from engine.tensor_specs import Split, tensor_specs
from engine.weight_arena import ALIGN_BYTES, HUGE_PAGE_BYTES, WeightArena
from engine.weights import _INITIALIZERS, build_model, load_weights


def copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def expected_shard(full: dict[str, torch.Tensor], config: ModelConfig, rank: int, size: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s parameters written out by hand from the whole checkpoint (the module docstring of
    engine/tensor_parallel.py): what `build_model(..., tp=...)` must hold."""
    shard = plan_shard(config, rank, size)
    d = config.head_dim
    q0, q1 = (h * d for h in shard.q_heads)
    k0, k1 = (h * d for h in shard.kv_heads)
    i0, i1 = shard.intermediate
    v0, v1 = shard.vocab
    out = {"embed_tokens.weight": full["model.embed_tokens.weight"][v0:v1], "norm.weight": full["model.norm.weight"]}
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = full["lm_head.weight"][v0:v1]
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}", f"layers.{i}"
        kinds = ["weight"] + (["bias"] if config.qkv_bias else [])
        for kind in kinds:
            out[f"{ours}.self_attn.qkv_proj.{kind}"] = torch.cat([
                full[f"{hf}.self_attn.q_proj.{kind}"][q0:q1], full[f"{hf}.self_attn.k_proj.{kind}"][k0:k1],
                full[f"{hf}.self_attn.v_proj.{kind}"][k0:k1]])
        out[f"{ours}.self_attn.o_proj.weight"] = full[f"{hf}.self_attn.o_proj.weight"][:, q0:q1]
        out[f"{ours}.mlp.gate_up_proj.weight"] = torch.cat([full[f"{hf}.mlp.gate_proj.weight"][i0:i1],
                                                            full[f"{hf}.mlp.up_proj.weight"][i0:i1]])
        out[f"{ours}.mlp.down_proj.weight"] = full[f"{hf}.mlp.down_proj.weight"][:, i0:i1]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{ours}.{norm}.weight"] = full[f"{hf}.{norm}.weight"]
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("size", [2, 4])  # 4 > 2 kv heads: each kv head is replicated on two ranks
def test_tp_shard_loading_equals_slicing_the_full_tensors(arch, size, request):
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    config = ModelConfig.from_dir(model_dir)
    full = load_file(model_dir / "model.safetensors")
    for rank in range(size):
        model = build_model(config, model_dir, torch.float32, 64, tp=TPGroup(rank, size))  # no collective runs
        params = dict(model.named_parameters())
        expected = expected_shard(full, config, rank, size)
        assert sorted(params) == sorted(expected)
        for name, tensor in expected.items():
            assert torch.equal(params[name], tensor), (rank, name)


def test_plain_loading_equals_the_checkpoint(tiny_qwen2_dir):
    config = ModelConfig.from_dir(tiny_qwen2_dir)
    full = load_file(tiny_qwen2_dir / "model.safetensors")
    model = build_model(config, tiny_qwen2_dir, torch.float32, 64)
    assert dict(model.named_parameters()).keys() == expected_shard(full, config, 0, 1).keys()
    for name, tensor in expected_shard(full, config, 0, 1).items():
        assert torch.equal(dict(model.named_parameters())[name], tensor), name


def test_building_skips_random_init_and_puts_torch_init_back(tiny_qwen2_dir):
    """The model is built without running torch.nn.init's initializers (every weight is loaded), and they are
    torch's own again afterwards."""
    initializers = {name: getattr(torch.nn.init, name) for name in _INITIALIZERS}
    config = ModelConfig.from_dir(tiny_qwen2_dir)
    calls = []
    with pytest.MonkeyPatch.context() as m:
        m.setattr(torch.nn.init, "normal_", lambda tensor, *a, **k: calls.append(tensor.shape) or tensor)
        initializers["normal_"] = torch.nn.init.normal_
        build_model(config, tiny_qwen2_dir, torch.float32, 64)
        assert calls == []  # nn.Embedding's normal_ was not run
        assert {name: getattr(torch.nn.init, name) for name in _INITIALIZERS} == initializers
        torch.nn.Embedding(4, 2)  # the initializer in place again
        assert calls == [(4, 2)]


def test_specs_list_every_checkpoint_tensor_once(tiny_llama_dir, tiny_qwen2_dir):
    for model_dir in (tiny_llama_dir, tiny_qwen2_dir):
        config = ModelConfig.from_dir(model_dir)
        specs = tensor_specs(config)
        full = load_file(model_dir / "model.safetensors")
        assert {s.checkpoint_name: s.shape for s in specs.specs} == {n: tuple(t.shape) for n, t in full.items()}
    qwen2 = tensor_specs(ModelConfig.from_dir(tiny_qwen2_dir))
    by_name = {s.checkpoint_name: s for s in qwen2.specs}
    v_bias = by_name["model.layers.1.self_attn.v_proj.bias"]
    assert (v_bias.param_name, v_bias.row_offset, v_bias.split) == ("layers.1.self_attn.qkv_proj.bias", 64 + 32,
                                                                   Split.KV_HEAD_ROWS)
    assert by_name["model.layers.0.mlp.down_proj.weight"].split is Split.INTERMEDIATE_COLUMNS
    assert qwen2.is_skipped("lm_head.weight") and qwen2.is_skipped("model.layers.0.self_attn.rotary_emb.inv_freq")
    assert not tensor_specs(ModelConfig.from_dir(tiny_llama_dir)).is_skipped("lm_head.weight")


def test_source_reads_only_the_slice_asked_for(tiny_llama_dir):
    full = load_file(tiny_llama_dir / "model.safetensors")
    with open_source(tiny_llama_dir) as source:
        name = "model.layers.0.mlp.down_proj.weight"
        assert source.shape(name) == tuple(full[name].shape) and source.location(name) == "model.safetensors"
        assert torch.equal(source.read(name, TensorSlice(1, 8, 24)), full[name][:, 8:24])
        assert torch.equal(source.read(name, TensorSlice(0, 3, 5)), full[name][3:5])
        assert torch.equal(source.read(name), full[name])
        assert sorted(source.names()) == sorted(full) and len(source.names()) == len(full)


def test_unexpected_tensor_is_named(tiny_llama_dir, tmp_path):
    d = copy(tiny_llama_dir, tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(2, 2)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    config = ModelConfig.from_dir(d)
    with pytest.raises(ModelLoadError, match=r"unexpected tensor model\.layers\.0\.mlp\.extra_proj\.weight in "
                                             r"model\.safetensors: the config has no place for it"):
        build_model(config, d, torch.float32, 64)
    with pytest.raises(ModelLoadError, match=r"unexpected tensor model\.layers\.0\.mlp\.extra_proj\.weight"):
        build_model(config, d, torch.float32, 64, tp=TPGroup(1, 2))


def test_errors_under_tensor_parallelism_name_the_tensor(tiny_llama_dir, tmp_path):
    d = copy(tiny_llama_dir, tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.1.self_attn.o_proj.weight"] = torch.zeros(64, 48)
    del tensors["model.norm.weight"]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    config = ModelConfig.from_dir(d)
    with pytest.raises(ModelLoadError, match=r"o_proj\.weight in model\.safetensors has shape \(64, 48\), but "
                                             r"config\.json implies \(64, 64\)"):
        build_model(config, d, torch.float32, 64, tp=TPGroup(0, 2))
    tensors["model.layers.1.self_attn.o_proj.weight"] = torch.zeros(64, 64)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=rf"checkpoint {d} is missing tensors: model\.norm\.weight$"):
        build_model(config, d, torch.float32, 64, tp=TPGroup(1, 2))


def test_a_tied_checkpoint_may_keep_its_lm_head(tiny_qwen2_dir, tmp_path):
    d = copy(tiny_qwen2_dir, tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    tensors["lm_head.weight"] = torch.full_like(tensors["model.embed_tokens.weight"], 7.0)  # skipped: tied
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    model = build_model(ModelConfig.from_dir(d), d, torch.float32, 64)
    assert model.lm_head is None and torch.equal(model.embed_tokens.weight, tensors["model.embed_tokens.weight"])


def test_missing_and_duplicated_shards_are_named(tiny_llama_dir, tmp_path):
    d = copy(tiny_llama_dir, tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    save_file({n: tensors[n] for n in names[:half]}, d / "a.safetensors", metadata={"format": "pt"})
    save_file({n: tensors[n] for n in names[half - 1:]}, d / "b.safetensors", metadata={"format": "pt"})
    weight_map = {n: "a.safetensors" for n in names[:half]} | {n: "b.safetensors" for n in names[half:]}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ModelLoadError, match=rf"tensor {names[half - 1]} is in both a\.safetensors and b\.safetensors"):
        SafetensorsSource.from_dir(d)
    (d / "b.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"shards listed in .*index\.json are missing: .*b\.safetensors"):
        SafetensorsSource.from_dir(d)
    (d / "model.safetensors.index.json").unlink()
    with pytest.raises(ModelLoadError, match="no model.safetensors or model.safetensors.index.json in"):
        open_source(d)


def test_loading_after_a_module_swap_is_refused(tiny_llama_dir):
    """Quantization and fast paths swap modules after loading; a model swapped first is not loaded into."""
    config = ModelConfig.from_dir(tiny_llama_dir)
    model = LlamaForCausalLM(config, 64)
    model.layers[0].mlp.gate_up_proj = torch.nn.Identity()  # as a swap to a module without that weight would
    with open_source(tiny_llama_dir) as source, pytest.raises(ValueError, match=r"no parameter "
                                                                                r"layers\.0\.mlp\.gate_up_proj\.weight"):
        load_weights(model, tensor_specs(config), source)


def test_a_cpu_model_lies_in_one_weight_arena(tiny_qwen2_dir):
    """On CPU every parameter and buffer is a view of one arena (engine/weight_arena.py): disjoint, each at a
    64-byte boundary, the first at a 2 MiB one."""
    config = ModelConfig.from_dir(tiny_qwen2_dir)
    model = build_model(config, tiny_qwen2_dir, torch.float32, 64)
    tensors = [*model.parameters(), *model.buffers()]
    base = {t.untyped_storage().data_ptr() for t in tensors}
    assert len(base) == 1  # one storage: the arena's buffer
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in tensors)
    assert all(start % ALIGN_BYTES == 0 for start, _ in spans)
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:], strict=False))
    assert spans[0][0] % HUGE_PAGE_BYTES == 0


def test_weight_arena_hands_out_aligned_zeroed_tensors_up_to_its_capacity():
    arena = WeightArena(3 * 64 + 10)
    a = arena.take((3, 5), torch.float32)  # 60 bytes: the next tensor starts 64 further
    b = arena.take((7,), torch.int8)
    c = arena.take((2, 3), torch.bfloat16)
    assert b.data_ptr() - a.data_ptr() == 64 and c.data_ptr() - b.data_ptr() == 64
    assert a.data_ptr() % HUGE_PAGE_BYTES == 0  # the arena starts on a 2 MiB boundary
    assert all(bool((t == 0).all()) for t in (a, b, c)) and a.is_contiguous() and c.shape == (2, 3)
    assert arena.used_bytes == 3 * 64
    with pytest.raises(MemoryError, match="holds 202 bytes: 12 more do not fit after 192"):
        arena.take((3,), torch.float32)
    a.fill_(1.5)
    assert float(a.sum()) == 22.5 and bool((b == 0).all())


def test_weight_arena_reports_its_huge_pages():
    """The kernel backs the arena with 2 MiB pages where transparent huge pages are enabled (`always` or
    `madvise`); the report reads /proc/self/smaps."""
    arena = WeightArena(4 * HUGE_PAGE_BYTES)
    arena.take((4 * HUGE_PAGE_BYTES,), torch.uint8).fill_(1)  # first touch: the pages appear now
    huge = arena.huge_page_bytes()
    try:
        mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        mode = ""
    if "[never]" in mode or not mode or huge is None:
        pytest.skip(f"no transparent huge pages here (enabled: {mode.strip() or 'unknown'})")
    assert huge > 0 and huge % HUGE_PAGE_BYTES == 0
