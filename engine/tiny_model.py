"""Tiny random Llama / Qwen2 checkpoints, made locally in Hugging Face format.

Nothing is fetched from a model hub: the weights are random (seeded) and the tokenizer is a byte-level BPE
trained in milliseconds on `engine/data/tiny_corpus.txt`. The result loads with
`transformers.AutoModelForCausalLM` / `AutoTokenizer`, so tests can use transformers as the oracle.

Token id layout of every tiny tokenizer (special tokens lowest, so they never move with `vocab`):

    0 <|begin_of_text|>   bos; prepended by the tokenizer.json post-processor
    1 <|end_of_text|>     eos (config.json); generation also stops on <|im_end|>
    2 <|im_start|>        ChatML turn markers used by the chat template
    3 <|im_end|>
    4 ..                  the 256 byte-level symbols, then the learned merges
    ..  vocab-1           <unused_N> padding, plain vocab entries (not added tokens), so the tokenizer's
                          vocab size equals the model's even when the corpus cannot fill it

Same arguments, same files: BPE training is deterministic as it is (checked in tests across processes and
thread counts; no single-threading needed) and the weights come from `torch.manual_seed(seed)`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from engine.cache_dir import duet_cache_dir

ARCHS = ("llama", "qwen2")
DTYPES = ("float32", "bfloat16", "float16")
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN)  # ids 0..3, in this order
MIN_VOCAB = len(SPECIAL_TOKENS) + 256  # every byte must have a token: byte-level BPE has no <unk>
CORPUS_PATH = Path(__file__).parent / "data" / "tiny_corpus.txt"

DEFAULT_MODEL_NAME = "tiny-llama-v1"  # bump the suffix whenever DEFAULT_MODEL_ARGS or the output changes
DEFAULT_MODEL_ARGS = dict(arch="llama", layers=2, hidden=128, heads=4, kv_heads=2, vocab=1024, seed=0)

# The pre-tokenizer split patterns of the real tokenizers, so the tiny ones tokenize text the same way
# (Llama 3 groups digits in threes, Qwen2 splits every digit).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML, with Hermes-style tools (as Qwen2.5's template has them): with `tools`, a system turn lists them in
# <tools></tools> and asks for calls as <tool_call>{"name": ..., "arguments": ...}</tool_call>, and an assistant
# turn's earlier calls are rendered the same way; without tools, the rendering is plain ChatML.
CHAT_TEMPLATE = r"""{{- bos_token }}
{%- if tools %}
    {{- '<|im_start|>system\nYou may call one or more functions. Function signatures are within '
        + '<tools></tools>:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\n</tools>\nFor each call return <tool_call>{"name": <function-name>, "arguments": '
        + '<args-json-object>}</tool_call><|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message['role'] not in ('system', 'user', 'assistant', 'tool') %}
        {{- raise_exception("unknown role '" + message['role'] + "': expected system, user, assistant or tool") }}
    {%- endif %}
    {%- if message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] %}
        {{- '<|im_start|>assistant\n' + (message['content'] or '') }}
        {%- for call in message['tool_calls'] %}
            {{- '<tool_call>' + ({'name': call['function']['name'], 'arguments': call['function']['arguments']}
                | tojson) + '</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""


def make_tiny_model(
    out_dir: str | os.PathLike,
    *,
    arch: str = "llama",
    layers: int = 2,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 1024,
    intermediate: int | None = None,
    seed: int = 0,
    max_position_embeddings: int = 4096,
    tie_word_embeddings: bool | None = None,
    dtype: str = "float32",
    initializer_range: float = 0.1,
) -> Path:
    """Write a complete random checkpoint into `out_dir` (created if missing) and return its path.

    Files: config.json, model.safetensors, generation_config.json, tokenizer.json, tokenizer_config.json (with a
    ChatML `chat_template`), special_tokens_map.json. "llama" has untied embeddings and no biases; "qwen2" ties
    the embeddings and has q/k/v biases. `tie_word_embeddings=None` takes the architecture's default and
    `intermediate=None` a multiple of 16 near 8/3 * hidden. Biases and norm weights are randomized too (not
    left at 0 and 1), so a loader that forgets them produces different logits.
    """
    _validate(arch, layers, hidden, heads, kv_heads, vocab, intermediate, seed, max_position_embeddings, dtype,
              initializer_range)
    if intermediate is None:
        intermediate = max(16, 16 * round(8 * hidden / 3 / 16))
    if tie_word_embeddings is None:
        tie_word_embeddings = arch == "qwen2"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer(arch, vocab)
    tokenizer.save(str(out / "tokenizer.json"))
    eos_ids = [tokenizer.token_to_id(EOS_TOKEN), tokenizer.token_to_id(IM_END_TOKEN)]
    _write_json(out / "tokenizer_config.json", _tokenizer_config(arch, tokenizer, max_position_embeddings))
    _write_json(out / "special_tokens_map.json", {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN],
    })

    config_fields = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5 if arch == "llama" else 1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=initializer_range,
        bos_token_id=tokenizer.token_to_id(BOS_TOKEN),
        eos_token_id=eos_ids[0],
        dtype=dtype,
    )
    model = _random_model(arch, config_fields, seed, generation_eos_ids=eos_ids)
    model.save_pretrained(out, safe_serialization=True)
    # transformers 5 writes rope_theta only inside `rope_parameters`; checkpoints made with transformers 4 (and
    # most on the Hub) carry it at the top level. Write both so a loader written for either reads this one.
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    config.setdefault("rope_theta", 10000.0)
    _write_json(out / "config.json", config)
    return out


def default_model_dir() -> Path:
    """A cached tiny random Llama (2 layers, hidden 128), made on first use: fast to load where any checkpoint
    will do. (The embedded default of `duet` commands is SmolLM2: engine/default_model.py.)

    Lives at `$DUET_CACHE_DIR/models/tiny-llama-v1` (default cache dir `~/.cache/duet`). It is built in a
    temporary directory next to it and renamed into place, so a reader never sees a half-written checkpoint;
    if another process wins the race, its copy is used.
    """
    target = duet_cache_dir() / "models" / DEFAULT_MODEL_NAME
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.tmp-", dir=target.parent))
    try:
        make_tiny_model(tmp, **DEFAULT_MODEL_ARGS)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def build_tokenizer(arch: str, vocab: int) -> Tokenizer:
    """Train the tiny byte-level BPE for `arch` and pad it to exactly `vocab` ids."""
    _check_tokenizer_args(arch, vocab)
    tokenizer = Tokenizer(models.BPE())
    split = LLAMA3_SPLIT if arch == "llama" else QWEN2_SPLIT
    if arch == "qwen2":
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, seen in the corpus or not
        show_progress=False,
    )
    corpus = CORPUS_PATH.read_text(encoding="utf-8")
    tokenizer.train_from_iterator(corpus.splitlines(keepends=True), trainer=trainer)
    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single=f"{BOS_TOKEN} $A",
            pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1",
            special_tokens=[(BOS_TOKEN, tokenizer.token_to_id(BOS_TOKEN))],
        ),
    ])
    return _pad_vocab(tokenizer, vocab)


def _pad_vocab(tokenizer: Tokenizer, vocab: int) -> Tokenizer:
    # Plain vocab entries, not added tokens: 150k added tokens would make every encode scan them.
    spec = json.loads(tokenizer.to_str())
    table = spec["model"]["vocab"]
    for token_id in range(len(table), vocab):
        name = f"<unused_{token_id}>"
        assert name not in table, f"padding token {name} collides with a learned token"
        table[name] = token_id
    padded = Tokenizer.from_str(json.dumps(spec, ensure_ascii=False))
    assert padded.get_vocab_size(with_added_tokens=True) == vocab
    return padded


def _tokenizer_config(arch: str, tokenizer: Tokenizer, model_max_length: int) -> dict:
    added = {
        str(tokenizer.token_to_id(token)): {
            "content": token, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": True,
        }
        for token in SPECIAL_TOKENS
    }
    return {
        # transformers 5 rebuilds a qwen2 tokenizer with Qwen2Tokenizer whatever this says; a llama one stays the
        # generic class, which uses tokenizer.json as it is (like Llama 3's checkpoints).
        "tokenizer_class": "Qwen2Tokenizer" if arch == "qwen2" else "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,  # Qwen2Tokenizer would otherwise add a new "<|endoftext|>" token
        "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN],
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }


def _random_model(arch: str, config_fields: dict, seed: int, generation_eos_ids: list[int]):
    import torch  # deferred: tokenizer-only callers should not pay for torch + transformers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
    config_class, model_class = classes[arch]
    config = config_class(**config_fields)
    std = config.initializer_range
    with torch.random.fork_rng(devices=[]):  # seed locally; the caller's RNG state is left as it was
        torch.manual_seed(seed)
        model = model_class(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(".bias"):
                    param.normal_(0.0, std)
                elif "norm" in name:
                    param.normal_(1.0, std)
    model = model.to(getattr(torch, config_fields["dtype"]))
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=generation_eos_ids)
    return model


def _validate(arch, layers, hidden, heads, kv_heads, vocab, intermediate, seed, max_position_embeddings, dtype,
              initializer_range) -> None:
    _check_tokenizer_args(arch, vocab)
    _check("dtype", dtype, dtype in DTYPES, f"must be one of {', '.join(DTYPES)}")
    for name, value in (("layers", layers), ("hidden", hidden), ("heads", heads), ("kv_heads", kv_heads),
                        ("max_position_embeddings", max_position_embeddings)):
        _check(name, value, _is_int(value) and value >= 1, "must be an integer >= 1")
    _check("intermediate", intermediate, intermediate is None or (_is_int(intermediate) and intermediate >= 1),
           "must be None (8/3 * hidden) or an integer >= 1")
    _check("seed", seed, _is_int(seed) and 0 <= seed < 2**63, "must be an integer in [0, 2**63)")
    _check("initializer_range", initializer_range,
           isinstance(initializer_range, (int, float)) and 0 < initializer_range <= 1, "must be in (0, 1]")
    _check("heads", heads, heads % kv_heads == 0, f"must be a multiple of kv_heads={kv_heads}")
    _check("hidden", hidden, hidden % heads == 0, f"must be a multiple of heads={heads}")
    _check("hidden", hidden, (hidden // heads) % 2 == 0,
           f"must give an even head dim (hidden / heads = {hidden / heads:g}); rotary embeddings rotate pairs")


def _check_tokenizer_args(arch: str, vocab: int) -> None:
    _check("arch", arch, arch in ARCHS, f"must be one of {', '.join(ARCHS)}")
    _check("vocab", vocab, _is_int(vocab) and vocab >= MIN_VOCAB,
           f"must be an integer >= {MIN_VOCAB} (4 special tokens + 256 byte tokens)")


def _check(name: str, value: object, ok: bool, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid: {allowed}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
