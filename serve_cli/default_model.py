"""The built-in tiny random model (``--model builtin:tiny-random``): the whole serving path in a
few megabytes, for fast tests and for trying the stack with nothing installed beyond xhal[serve].

It is a tiny Llama-architecture model with SEEDED RANDOM weights: its output is noise. It exists to
exercise the whole serving path (tokenizer, chat template, scheduler, executor, sampler). Its
tokenizer is a byte-level BPE trained here, on the short English text below, wrapped as a
transformers ``PreTrainedTokenizerFast`` with BOS/EOS/PAD tokens and a chat template. It is
generated once into the cache directory (``XHAL_CACHE_DIR``, default ``~/.cache/xhal``) and reused.
The default of ``xhal-serve`` is the real SmolLM2 model (``serve_cli.builtin_models``).
"""

from __future__ import annotations

import os
from pathlib import Path

VERSION = 1  # bump when the generated files change, so stale caches are not reused
SEED = 0
NAME = f"default-model-v{VERSION}"

ARCH = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,  # the smallest head size every built-in attention backend declares
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)
WEIGHT_STD = 0.08

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
ROLES = ("<|system|>", "<|user|>", "<|assistant|>")
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

TEXT = """\
The morning was cool and bright, and the river ran quietly past the old mill.
A small boat drifted near the bank while two children counted the ducks on the water.
Their grandmother sat on a wooden bench and told them stories about the town.
She said that long ago the mill ground wheat for every family in the valley.
Farmers came with heavy carts, and the miller weighed each sack before he opened it.
Today the mill is a museum, and visitors walk through its rooms to see the great stones.
In the afternoon the wind turned, clouds gathered over the hills, and rain began to fall.
The children ran home along the path, laughing, with their shoes full of mud.
Computers follow instructions one step at a time, but they take many steps every second.
A program reads numbers, adds them, compares them, and writes the results to memory.
When a model writes text, it predicts the next word from the words that came before.
It repeats this again and again until it reaches the end of an answer or a limit.
Good tools are simple to use, easy to understand, and honest about what they can do.
Please write clear questions, and the answers will often be clearer too.
What time is it? It is half past three, and the tea is ready in the kitchen.
How many apples are in the basket? There are seven red apples and five green ones.
Where did you put the keys? They are on the table by the window, under the newspaper.
Why is the sky blue? Sunlight scatters in the air, and blue light scatters the most.
One, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve.
Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday make a week.
January, February, March, April, May, June, July, August, September, October, November, December.
Hello! Thank you very much. You are welcome. Good night, and see you tomorrow.
"""
TOKENIZER_VOCAB_SIZE = 1024  # a ceiling: the small text yields fewer merges


def ensure_default_model(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The directory of the tiny random model under ``cache_dir`` (default
    ``xhal.env.cache_dir()``), generated on first use, atomically
    (``model_cache.ensure_cached``)."""
    from serve_cli.model_cache import ensure_cached

    return ensure_cached(NAME, write_default_model, cache_dir)


def write_default_model(path: Path) -> None:
    """Write the tokenizer files and the checkpoint (config.json, model.safetensors) to ``path``."""
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(str(path))
    _build_model(len(tokenizer), tokenizer).save_pretrained(str(path), safe_serialization=True)


def build_tokenizer():
    """A byte-level BPE trained on ``TEXT`` (deterministic), as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=[PAD, BOS, EOS, *ROLES],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXT.splitlines(keepends=True), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=list(ROLES),
        model_max_length=ARCH["max_position_embeddings"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _build_model(vocab_size: int, tokenizer):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **ARCH,
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(WEIGHT_STD * torch.randn(param.shape, generator=generator))
    return model
