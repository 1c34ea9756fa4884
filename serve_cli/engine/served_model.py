"""Model discovery: which checkpoint the engine serves and what its files say, read once.

``config.json`` is read here and nowhere else on the served path: the model runner, the loader
and the tensor-parallel workers all get this ``ServedModel`` (plain data, so it pickles to the
workers) and build from its ``hf_config``. The context limit lives in it too, so nothing passes
``max_model_len`` around beside the config.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from serve_cli.engine.config import EngineConfig

DEFAULT_MAX_MODEL_LEN = 2048  # for a config.json without max_position_embeddings


@dataclass(frozen=True)
class ServedModel:
    """The checkpoint ``directory``, its ``config.json`` as read (``hf_config``), the context
    limit the engine serves (``max_model_len``) and the vocabulary size."""

    directory: Path
    hf_config: dict[str, Any]
    max_model_len: int
    vocab_size: int

    @classmethod
    def discover(cls, config: EngineConfig) -> ServedModel:
        """The model ``config`` names (the built-in tiny model when it names none). Raises
        ``ValueError`` when ``config.max_model_len`` exceeds what the model supports."""
        from models.loader import read_config
        from serve_cli.default_model import ensure_default_model

        directory = Path(config.model_dir) if config.model_dir else ensure_default_model()
        hf_config = read_config(directory)
        return cls(
            directory,
            hf_config,
            _max_model_len(hf_config, config.max_model_len),
            int(hf_config["vocab_size"]),
        )

    def eos_token_ids(self, tokenizer: Any) -> frozenset[int]:
        """EOS ids from config.json, generation_config.json and the tokenizer, all together."""
        sources = [self.hf_config.get("eos_token_id"), tokenizer.eos_token_id]
        generation = self.directory / "generation_config.json"
        if generation.is_file():
            sources.append(json.loads(generation.read_text()).get("eos_token_id"))
        ids: set[int] = set()
        for value in sources:
            values = value if isinstance(value, list) else [value]
            ids.update(v for v in values if isinstance(v, int))
        return frozenset(ids)


def _max_model_len(hf_config: dict[str, Any], wanted: int | None) -> int:
    limit = hf_config.get("max_position_embeddings")
    chosen = wanted or limit or DEFAULT_MAX_MODEL_LEN
    if limit is not None and chosen > limit:
        raise ValueError(
            f"max_model_len ({chosen}) exceeds the model's max_position_embeddings ({limit}); "
            "lower max_model_len"
        )
    return int(chosen)
