"""Reading one family's config.json keys: aliases resolved, transformers' defaults filled, every value checked.

Shared by hfconfig.py (the older families) and hfconfig_families.py (Gemma 2/3, Phi-3, Qwen3-MoE, OLMo 2,
DeepSeek-V3). Each failure is an InputError naming ``model.<key>`` as the config spelled it. Pure.
"""

from __future__ import annotations

from typing import Any

from .errors import InputError

#: largest size accepted for any dimension (a guard against hostile input, far above any real model)
MAX_DIM = 2**32


def show(value: Any) -> str:
    """A config value for an error message (memplan.errors.shorten: cut, its length said, controls escaped)."""
    from .errors import shorten

    return shorten(value)


class Keys:
    """One family's config keys: ``defaults`` (the config class's dataclass defaults) under the given values,
    keys renamed by ``aliases`` (the class's ``attribute_map``: key as written → field read)."""

    def __init__(self, cfg: dict, family: str, defaults: dict[str, Any], aliases: dict[str, str],
                 prefix: str = "model."):
        self.family = family
        self.prefix = prefix  # "model.text_config." for a gemma3 config's text model
        self.values = dict(defaults)
        given: dict[str, tuple[str, Any]] = {}
        for key, value in cfg.items():
            field = aliases.get(key, key)
            if field in given and given[field][1] != value:
                other, before = given[field]
                raise InputError(f"{prefix}{key}", f"conflicts with {other} ({show(before)} vs {show(value)})")
            given[field] = (key, value)
        self.source_key = {field: key for field, (key, _) in given.items()}
        self.values.update({field: value for field, (_, value) in given.items()})

    def error(self, field: str, message: str) -> InputError:
        """An InputError naming the key as the config spelled it (e.g. n_embd, or hidden_size for GPT-2)."""
        return InputError(f"{self.prefix}{self.source_key.get(field, field)}", message)

    def int(self, field: str) -> int:
        value = self.values.get(field)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_DIM:
            raise self.error(field, f"must be a positive integer up to {MAX_DIM} (got {show(value)})")
        return value

    def opt_int(self, field: str) -> int | None:
        return None if self.values.get(field) is None else self.int(field)

    def count(self, field: str) -> int:
        """A non-negative integer (a number of layers or experts that may be 0)."""
        value = self.values.get(field)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_DIM:
            raise self.error(field, f"must be an integer from 0 to {MAX_DIM} (got {show(value)})")
        return value

    def bool(self, field: str, default: bool = False) -> bool:
        value = self.values.get(field, default)
        if not isinstance(value, bool):
            raise self.error(field, f"must be true or false (got {show(value)})")
        return value

    def str(self, field: str) -> str:
        value = self.values.get(field)
        if not isinstance(value, str) or not value:
            raise self.error(field, f"must be a non-empty string (got {show(value)})")
        return value

    def prob(self, field: str) -> float:
        """A dropout probability in [0, 1)."""
        value = self.values.get(field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
            raise self.error(field, f"must be a probability in [0, 1) (got {show(value)})")
        return float(value)

    def fraction(self, field: str) -> float:
        value = self.values.get(field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise self.error(field, f"must be a number in (0, 1] (got {show(value)})")
        return float(value)

    def opt_positive(self, field: str) -> float | None:
        """None, or a positive number (soft-capping values, scalars)."""
        value = self.values.get(field)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 2**32:
            raise self.error(field, f"must be a positive number or null (got {show(value)})")
        return float(value)

    def nonneg(self, field: str) -> float:
        """A number >= 0 (a loss coefficient)."""
        value = self.values.get(field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 2**32:
            raise self.error(field, f"must be a number >= 0 (got {show(value)})")
        return float(value)

    def layer_list(self, field: str, num_layers: int) -> tuple[int, ...]:
        """A list of layer indices (null: empty); indices past the last layer are kept (transformers ignores them)."""
        value = self.values.get(field)
        if value is None:
            return ()
        if not isinstance(value, list) or len(value) > 2**16 or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= MAX_DIM for i in value):
            raise self.error(field, f"must be a list of layer indices 0..{num_layers - 1} (got {show(value)})")
        return tuple(value)

    def padding_idx(self, vocab: int) -> int | None:
        """pad_token_id as nn.Embedding(vocab, hidden, padding_idx) takes it: None, or an index in
        [-vocab, vocab) (torch asserts "Padding_idx must be within num_embeddings"), returned as 0..vocab-1."""
        value = self.values.get("pad_token_id")
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not -vocab <= value < vocab:
            raise self.error("pad_token_id", f"must be null or a token id below vocab_size ({vocab}) (got {show(value)})")
        return value % vocab
