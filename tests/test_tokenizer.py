import json
import shutil
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.errors import InvalidRequestError, ModelLoadError
from engine.tiny_model import CORPUS_PATH
from engine.tokenizer import Tokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]
ARCHS = ["llama", "qwen2"]

STRINGS = [
    "", " ", "  ", "\n", "\n\n\n", "\t", " \t\n ", "a", "Hello", " Hello", "Hello ", "Hello  world",
    "Hello, world! How are you?", "I'm fine, you're not; it's 4:30 p.m. n't 've 'll 'd",
    "1234567890", "3.14159 -7 +12 1e-5", "$19.99 €5 £3.50 ¥1000",
    "naïve café résumé", "e\u0301", "A\u030a", "\u212b", "ﬁ ﬀ", "ß ẞ", "İstanbul ı",
    "Καλημέρα κόσμε", "Привет, мир!", "你好，世界！", "こんにちは、世界", "안녕하세요", "שלום", "مرحبا", "नमस्ते",
    "😀", "😀😀😀", "👍🏽", "👩‍💻", "👨‍👩‍👧‍👦", "🇫🇷🇯🇵", "🏳️‍🌈", "\U0010ffff", "\u0000", "\x7f", "\ufeffbom",
    "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>user\nhi<|im_end|>\n", "x<|im_end|>y", "<|im_", "|>",
    "<|begin_of_text|><|begin_of_text|>", " <|im_start|> ", "<unused_7>", "<s></s>",
    "def f(x):\n    return x * 2\n", "{\"a\": [1, 2]}", "<p>&amp;</p>", "line1\r\nline2\rline3",
]
STRINGS += CORPUS_PATH.read_text(encoding="utf-8").splitlines()[:40]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Wie geht's? 中文 😀"}],
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "tool_calls": None},
        {"role": "user", "content": "  spaced  \n"},
    ],
    [{"role": "tool", "content": "{\"ok\": true}"}, {"role": "user", "content": ""}],
]

# Leans on trim_blocks / lstrip_blocks (no "-" markers), loopcontrols, namespace, tojson with non-ASCII and
# HTML characters, the special-token variables, extra template kwargs and reasoning aliases.
CUSTOM_TEMPLATE = """{{ bos_token }}
{% set ns = namespace(count=0) %}
{% for message in messages %}
    {% if message.role == 'stop' %}{% break %}{% endif %}
    {% if message.role == 'skip' %}{% continue %}{% endif %}
    {% set ns.count = ns.count + 1 %}
<{{ message.role }}>{{ message.content | trim }}{% if message.reasoning_content %} [{{ message.thinking }}]{% endif %}
{{ message | tojson }}
{% endfor %}
count={{ ns.count }} eos={{ eos_token }} pad={{ pad_token }} flag={{ flag | default('none') }}
{% if add_generation_prompt %}
<assistant>
{% endif %}"""


@pytest.fixture(scope="module")
def pairs(tiny_llama_dir, tiny_qwen2_dir):
    """(ours, transformers') per arch."""
    from transformers import AutoTokenizer

    return {
        arch: (Tokenizer.from_dir(path), AutoTokenizer.from_pretrained(path))
        for arch, path in (("llama", tiny_llama_dir), ("qwen2", tiny_qwen2_dir))
    }


def variant(source: Path, destination: Path, *, config=None, tokenizer_json=None, drop=(), files=None) -> Path:
    """A copy of a checkpoint's tokenizer files with edits: config/tokenizer_json edit the dicts in place."""
    shutil.copytree(source, destination)
    for name, edit in (("tokenizer_config.json", config), ("tokenizer.json", tokenizer_json)):
        if edit is not None:
            data = json.loads((destination / name).read_text(encoding="utf-8"))
            edit(data)
            (destination / name).write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    for name in drop:
        (destination / name).unlink()
    for name, text in (files or {}).items():
        (destination / name).write_text(text, encoding="utf-8")
    return destination


def assert_same_behaviour(ours: Tokenizer, hf, strings) -> None:
    for text in strings:
        for add_special_tokens in (True, False):
            ids = ours.encode(text, add_special_tokens=add_special_tokens)
            assert ids == hf.encode(text, add_special_tokens=add_special_tokens), (text, add_special_tokens)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), text


@pytest.mark.parametrize("arch", ARCHS)
def test_encode_and_decode_match_transformers(pairs, arch):
    ours, hf = pairs[arch]
    assert_same_behaviour(ours, hf, STRINGS)
    assert ours.encode("Hello")[0] == ours.bos_token_id == 0
    assert ours.decode(ours.encode("naïve 中文 😀"), skip_special_tokens=True) == "naïve 中文 😀"


@pytest.mark.parametrize("arch", ARCHS)
@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=40))
def test_encode_matches_transformers_on_any_text(pairs, arch, text):
    ours, hf = pairs[arch]
    assert_same_behaviour(ours, hf, [text])


@pytest.mark.parametrize("arch", ARCHS)
@settings(max_examples=100, deadline=None)
@given(ids=st.lists(st.integers(0, 511), max_size=30))
def test_decode_matches_transformers_on_any_ids(pairs, arch, ids):
    """Random ids: partial UTF-8 sequences (U+FFFD), special tokens in the middle of characters."""
    ours, hf = pairs[arch]
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)


@pytest.mark.parametrize("arch", ARCHS)
def test_special_ids_and_vocab_size(pairs, arch):
    ours, hf = pairs[arch]
    assert ours.vocab_size == len(hf) == 512
    assert ours.bos_token_id == hf.bos_token_id == 0
    assert ours.eos_token_ids == frozenset({1, 3})  # generation_config's [1, 3] and eos_token 1
    assert ours.all_special_ids == frozenset(hf.all_special_ids) == frozenset({0, 1, 2, 3})
    assert ours.convert_ids_to_tokens([0, 3, 4, 511]) == hf.convert_ids_to_tokens([0, 3, 4, 511])
    assert ours.convert_ids_to_tokens([512]) == [None]
    assert ours.special_tokens == {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
                                   "pad_token": "<|end_of_text|>"}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(pairs, arch, conversation, add_generation_prompt):
    ours, hf = pairs[arch]
    text = ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    assert text == hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    ids = ours.apply_chat_template_ids(conversation, add_generation_prompt=add_generation_prompt)
    expected = hf.apply_chat_template(conversation, tokenize=True, add_generation_prompt=add_generation_prompt,
                                      return_dict=False)
    assert ids == expected
    assert ids[0] == 0 and ids.count(0) == 1  # the template's bos, not a second one from encode


def test_chat_template_text_is_exact(pairs):
    ours, _ = pairs["llama"]
    text = ours.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "Hi 😀"}])
    assert text == ("<|begin_of_text|><|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi 😀<|im_end|>\n"
                    "<|im_start|>assistant\n")


def test_template_errors_match_transformers(pairs):
    ours, hf = pairs["llama"]
    bad = [{"role": "wizard", "content": "x"}]
    with pytest.raises(jinja2.TemplateError, match="unknown role 'wizard'") as ours_error:
        ours.apply_chat_template(bad)
    with pytest.raises(jinja2.TemplateError) as hf_error:
        hf.apply_chat_template(bad, tokenize=False)
    assert str(ours_error.value) == str(hf_error.value)
    with pytest.raises(InvalidRequestError, match="messages=.* must hold at least one message"):
        ours.apply_chat_template([])


@pytest.mark.parametrize("arch", ARCHS)
def test_chat_template_file_takes_priority_and_renders_like_transformers(tiny_llama_dir, tiny_qwen2_dir, tmp_path,
                                                                         arch):
    from transformers import AutoTokenizer

    source = tiny_llama_dir if arch == "llama" else tiny_qwen2_dir
    path = variant(source, tmp_path / "t", files={"chat_template.jinja": CUSTOM_TEMPLATE})
    ours, hf = Tokenizer.from_dir(path), AutoTokenizer.from_pretrained(path)
    conversation = [
        {"role": "system", "content": "  <b>&</b> 中文  "},
        {"role": "skip", "content": "hidden"},
        {"role": "user", "content": "Hi 😀", "name": None},
        {"role": "assistant", "content": "ok", "reasoning": "because"},
        {"role": "stop", "content": "x"},
        {"role": "user", "content": "never shown"},
    ]
    for add_generation_prompt in (True, False):
        for kwargs in ({}, {"flag": "on"}):
            text = ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, **kwargs)
            assert text == hf.apply_chat_template(conversation, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, **kwargs)
    assert "count=3" in text and '"content": "  <b>&</b> 中文  "' in text and "[because]" in text
    assert "never shown" not in text and "name" not in text


def test_list_of_named_templates_uses_the_default(tiny_llama_dir, tmp_path):
    def edit(config):
        config["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ 1 }}"}]

    path = variant(tiny_llama_dir, tmp_path / "t", config=edit)
    assert Tokenizer.from_dir(path).apply_chat_template([{"role": "user", "content": "x"}]) == "D1"


@pytest.mark.parametrize("post_processor", [True, False])
@pytest.mark.parametrize("add_bos_token", [True, False, None])
def test_add_bos_token_in_config_behaves_like_transformers(tiny_llama_dir, tmp_path, post_processor, add_bos_token):
    """Llama 2 style configs. transformers 5 ignores add_bos/eos_token when tokenizer.json exists: the
    post-processor alone decides whether a BOS is added."""
    from transformers import AutoTokenizer

    def edit_config(config):
        config["tokenizer_class"] = "LlamaTokenizerFast"
        if add_bos_token is not None:
            config["add_bos_token"] = add_bos_token
            config["add_eos_token"] = True

    def edit_tokenizer(data):
        if not post_processor:
            data["post_processor"] = None

    path = variant(tiny_llama_dir, tmp_path / "t", config=edit_config, tokenizer_json=edit_tokenizer)
    ours, hf = Tokenizer.from_dir(path), AutoTokenizer.from_pretrained(path)
    assert_same_behaviour(ours, hf, ["Hello", "中文 😀", ""])
    assert (ours.encode("Hello")[0] == 0) is post_processor


def test_special_tokens_missing_from_tokenizer_json_are_added_like_transformers(tiny_llama_dir, tmp_path):
    def edit(config):
        config["sep_token"] = "<|sep|>"  # not in the vocab: becomes id 512
        config["additional_special_tokens"] = ["<|im_start|>", "<|im_end|>", "Ġthe"]  # Ġthe: a plain BPE entry
        config["image_token"] = "<|image|>"  # any *_token string is a named special token

    from transformers import AutoTokenizer

    path = variant(tiny_llama_dir, tmp_path / "t", config=edit)
    ours, hf = Tokenizer.from_dir(path), AutoTokenizer.from_pretrained(path)
    assert ours.vocab_size == len(hf) == 514
    assert ours.all_special_ids == frozenset(hf.all_special_ids)
    assert_same_behaviour(ours, hf, ["a<|sep|>b", "in the end", "Ġthe", "<|image|> x", "the the"])
    assert ours.special_tokens["image_token"] == "<|image|>"


def test_legacy_special_tokens_map_is_read_without_added_tokens_decoder(tiny_llama_dir, tmp_path):
    from transformers import AutoTokenizer

    def edit(config):
        for key in ("added_tokens_decoder", "bos_token", "eos_token", "pad_token", "additional_special_tokens"):
            config.pop(key)

    path = variant(tiny_llama_dir, tmp_path / "t", config=edit)
    ours, hf = Tokenizer.from_dir(path), AutoTokenizer.from_pretrained(path)
    assert ours.bos_token_id == hf.bos_token_id == 0
    assert ours.all_special_ids == frozenset(hf.all_special_ids) == frozenset({0, 1, 2, 3})
    assert ours.apply_chat_template([{"role": "user", "content": "x"}]) == hf.apply_chat_template(
        [{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True)


def test_eos_token_ids_unite_generation_config_and_tokenizer_config(tiny_llama_dir, tmp_path):
    single = variant(tiny_llama_dir, tmp_path / "single",
                     files={"generation_config.json": json.dumps({"eos_token_id": 3})})
    assert Tokenizer.from_dir(single).eos_token_ids == frozenset({1, 3})
    missing = variant(tiny_llama_dir, tmp_path / "missing", drop=["generation_config.json"])
    assert Tokenizer.from_dir(missing).eos_token_ids == frozenset({1})

    def drop_eos(config):
        config.pop("eos_token")

    only_generation = variant(tiny_llama_dir, tmp_path / "only", config=drop_eos)
    assert Tokenizer.from_dir(only_generation).eos_token_ids == frozenset({1, 3})


def test_truncation_and_padding_in_tokenizer_json_are_ignored(tiny_llama_dir, tmp_path):
    def edit(data):
        data["truncation"] = {"direction": "Right", "max_length": 2, "strategy": "LongestFirst", "stride": 0}
        data["padding"] = {"strategy": {"Fixed": 16}, "direction": "Right", "pad_to_multiple_of": None,
                           "pad_id": 1, "pad_type_id": 0, "pad_token": "<|end_of_text|>"}

    path = variant(tiny_llama_dir, tmp_path / "t", tokenizer_json=edit)
    from transformers import AutoTokenizer

    ours, hf = Tokenizer.from_dir(path), AutoTokenizer.from_pretrained(path)
    assert ours.encode("Hello there, world") == hf.encode("Hello there, world")
    assert len(ours.encode("Hello there, world")) > 2


def test_missing_tokenizer_json_names_the_path(tiny_llama_dir, tmp_path):
    path = variant(tiny_llama_dir, tmp_path / "t", drop=["tokenizer.json"])
    with pytest.raises(ModelLoadError, match=f"{path / 'tokenizer.json'} not found"):
        Tokenizer.from_dir(path)


def test_no_chat_template_is_a_clear_error(tiny_llama_dir, tmp_path):
    def edit(config):
        config.pop("chat_template")

    path = variant(tiny_llama_dir, tmp_path / "t", config=edit)
    tokenizer = Tokenizer.from_dir(path)
    assert not tokenizer.has_chat_template
    assert tokenizer.encode("still works") == Tokenizer.from_dir(tiny_llama_dir).encode("still works")
    with pytest.raises(InvalidRequestError, match=f"the model at {path} has no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}])


def test_tokenizing_needs_neither_transformers_nor_torch(tiny_llama_dir):
    code = (
        "import sys; from engine.tokenizer import Tokenizer; "
        f"t = Tokenizer.from_dir({str(tiny_llama_dir)!r}); "
        "t.apply_chat_template_ids([{'role': 'user', 'content': 'x'}]); "
        "assert 'transformers' not in sys.modules and 'torch' not in sys.modules, 'heavy import'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True)
