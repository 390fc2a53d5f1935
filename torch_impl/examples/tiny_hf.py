"""A tiny Hugging Face Qwen3-MoE folder and a chat JSONL, made offline and seeded: the
README's fine-tune starts from ``moezero example tiny-hf DIR`` (or ``python -m
moezero.examples.tiny_hf DIR``), and the ``finetune`` benchmark series builds its inputs here.

- ``save_tokenizer``: a byte-level BPE trained with ``tokenizers`` on generated sentences, with
  a ChatML chat template (``TEMPLATE``) as transformers 5 saves one;
- ``save_model``: a random ``Qwen3MoeForCausalLM`` (transformers' own init) beside it;
- ``conversations``: synthetic user/assistant chats, written by ``write_jsonl``.

Everything is seeded, so every run sees the same tokens. The benchmark keeps conversations
under its sequence length, so neither system it compares truncates one (TRL's BFD packing
truncates what overflows a bin) and both train the same tokens. Needs the ``hf`` extra.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
WORDS = ("the a cat dog fox bird owl sat ran saw ate slept on under over near beside big "
         "small red blue green quick lazy happy old mat tree house river stone hill road "
         "and then so because what where when why how is are was yes no").split()
TEMPLATE = """\
{%- if messages[0]['role'] != 'system' %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- generation %}{{- message.content + '<|im_end|>' }}{%- endgeneration %}
        {{- '\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
"""ChatML (Qwen's layout) with ``{% generation %}`` markers around each assistant reply and
its end-of-turn token: the span moezero's ``prepare-data`` and transformers'
``return_assistant_tokens_mask`` (TRL's ``assistant_only_loss``) both train."""


def _sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


def conversations(count: int, seed: int, max_words: int) -> list[dict]:
    """``count`` chats of 1-3 user/assistant turns (a system message in a third of them), each
    at most ``max_words`` words of content (plus the system message's 6); lengths vary from a
    few words to the cap, replies longer than questions."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        budget = rng.randint(max_words // 8, max_words)
        turns = rng.randint(1, 3)
        messages = ([{"role": "system", "content": _sentence(rng, 6)}]
                    if rng.random() < 1 / 3 else [])
        for _ in range(turns):
            share = max(4, budget // turns)  # words of one turn: a question, a longer reply
            messages.append({"role": "user",
                             "content": _sentence(rng, rng.randint(2, share // 2))})
            messages.append({"role": "assistant",
                             "content": _sentence(rng, rng.randint(share // 2, share))})
        out.append({"messages": messages})
    return out


def write_jsonl(chats: list[dict], path: Path) -> Path:
    path.write_text("".join(json.dumps(c) + "\n" for c in chats))
    return path


def train_bpe(texts: list[str], vocab_size: int, specials: tuple[str, ...]):
    """A byte-level BPE (GPT-2 style pre-tokenizer and decoder) trained on ``texts`` with the
    ``tokenizers`` library, ``specials`` first (ids 0, 1, ...)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok


def save_tokenizer(folder: Path, vocab_size: int) -> int:
    """A byte-level BPE trained on the series' words, ``SPECIALS`` first, saved with
    ``TEMPLATE`` as ``chat_template.jinja`` (transformers 5's place); returns its size."""
    rng = random.Random(1)
    texts = [_sentence(rng, 12) for _ in range(2000)] + ["system user assistant You are a "
                                                         "helpful assistant.\n"]
    tok = train_bpe(texts, vocab_size, SPECIALS)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "model_max_length": 4096}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    return tok.get_vocab_size()


def save_model(folder: Path, model: dict, vocab_size: int, seed: int) -> int:
    """A random ``Qwen3MoeForCausalLM`` of the series' shape (fp32, safetensors) in ``folder``
    beside the tokenizer; returns its parameter count."""
    import torch
    import transformers

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=model["dim"], intermediate_size=model["ffn_dim"],
        moe_intermediate_size=model["ffn_dim"], num_hidden_layers=model["n_layers"],
        num_attention_heads=model["n_heads"], num_key_value_heads=model["n_kv_heads"],
        head_dim=model["dim"] // model["n_heads"], num_experts=model["num_experts"],
        num_experts_per_tok=model["top_k"], norm_topk_prob=True, tie_word_embeddings=False,
        max_position_embeddings=4096, output_router_logits=True,
        router_aux_loss_coef=model["aux_loss_coef"], eos_token_id=2, pad_token_id=0,
        bos_token_id=None)
    torch.manual_seed(seed)
    hf = transformers.Qwen3MoeForCausalLM(cfg)
    hf.save_pretrained(folder)
    return sum(p.numel() for p in hf.parameters())


TINY_MODEL = {"dim": 32, "ffn_dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
              "num_experts": 4, "top_k": 2, "aux_loss_coef": 0.001}
"""The example's shape: trains in seconds on a CPU."""


def make(out: Path, *, chats: int = 200, vocab_size: int = 320, seed: int = 0) -> str:
    """``out/tiny-qwen3/`` (weights, tokenizer, chat template) and ``out/chats.jsonl``;
    returns what it wrote, in one line. Refuses (ValueError) to write over either."""
    model_dir, data = out / "tiny-qwen3", out / "chats.jsonl"
    for path in (model_dir, data):
        if path.exists():
            raise ValueError(f"{path}: exists (the example writes a new one)")
    import transformers

    transformers.utils.logging.disable_progress_bar()  # one line of output, not a bar
    vocab = save_tokenizer(model_dir, vocab_size)
    params = save_model(model_dir, TINY_MODEL, vocab, seed)
    write_jsonl(conversations(chats, seed, 24), data)
    return (f"wrote {model_dir} (a random Qwen3-MoE: {TINY_MODEL['n_layers']} layers, "
            f"{TINY_MODEL['num_experts']} experts, {params:,} parameters; a {vocab}-token BPE "
            f"tokenizer with a ChatML template) and {data} ({chats} conversations)")


def main(argv: list[str] | None = None) -> int:
    """``python -m moezero.examples.tiny_hf DIR``."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m moezero.examples.tiny_hf DIR", file=sys.stderr)
        return 2
    try:
        print(make(Path(args[0])))
    except (ValueError, ImportError) as exc:
        print(f"moezero: error: example tiny-hf: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
