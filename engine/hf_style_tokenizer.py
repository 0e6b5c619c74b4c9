"""`LLM.get_tokenizer()`: the engine's own tokenizer behind the signatures and defaults of a Hugging Face
tokenizer (what vLLM's `get_tokenizer()` returns), so code written against vLLM gets the same results.

It delegates to `engine.tokenizer.Tokenizer` (the ids it gives are the ids the engine runs); only the
defaults differ from duet's: `decode` keeps special tokens, and `apply_chat_template` tokenizes and adds no
generation prompt unless asked, as transformers does.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.tokenizer import Tokenizer


class HFStyleTokenizer:
    def __init__(self, tokenizer: Tokenizer):
        self.duet = tokenizer  # duet's own API (apply_chat_template_ids, max_text_bytes, ...)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.duet.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else token_ids
        return self.duet.decode(ids, skip_special_tokens=skip_special_tokens)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = self.encode(text, add_special_tokens)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}

    def apply_chat_template(self, conversation: list[dict], tokenize: bool = True, add_generation_prompt: bool = False,
                            **template_kwargs) -> str | list[int]:
        if tokenize:
            return self.duet.apply_chat_template_ids(conversation, add_generation_prompt, **template_kwargs)
        return self.duet.apply_chat_template(conversation, add_generation_prompt, **template_kwargs)

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self.duet.convert_ids_to_tokens([ids])[0]
        return self.duet.convert_ids_to_tokens(ids)

    @property
    def vocab_size(self) -> int:
        return self.duet.vocab_size

    def __len__(self) -> int:
        return self.duet.vocab_size

    @property
    def bos_token_id(self) -> int | None:
        return self.duet.bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        """The `eos_token`'s id, else the smallest id that ends generation (duet keeps them as a set)."""
        eos = self.duet.special_tokens.get("eos_token")
        if eos is not None:
            return self.duet.token_to_id(eos)
        return min(self.duet.eos_token_ids, default=None)

    @property
    def all_special_ids(self) -> list[int]:
        return sorted(self.duet.all_special_ids)
