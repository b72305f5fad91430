"""Build a tiny, randomly initialised Llama with a byte-level tokenizer, offline.

The model is noise (its weights are random) but it is a real ``transformers`` model:
``transformers serve`` loads it, applies its chat template, generates with it and
answers over the OpenAI-compatible API exactly as it would for a trained one. That is
all the real-server check needs, and it costs a few MB and no download.

    python tools/real_server/build_tiny_llama.py OUT_DIR
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
#: ChatML's turn markers, so that a ChatML template (Qwen's, ``nox -s vllm``'s
#: episodes-qwen2.5 check) renders in this vocabulary: two more special tokens, after the
#: three above (whose ids, 256 to 258, do not move).
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
#: Every STOP_EVERY-th byte token ends a generation, as EOS does (see build()).
STOP_EVERY = 8

#: The same plain rendering as ``trio_rollouts.inference.render_plain_chat``: one
#: ``<|role|>`` line per message, then ``<|assistant|>`` opening the reply; an earlier
#: assistant message ends with ``<|eos|>``, the token that ends a generated turn, as chat
#: templates close a turn with the engine's stop token (ChatML's ``<|im_end|>\n``), so
#: ``HFRenderer`` finds its end-of-turn ids. A prompt without assistant messages renders
#: exactly as ``render_plain_chat``.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}<|eos|>{% endif %}"
    # An expression: Hugging Face renders with trim_blocks, which would eat a newline
    # written right after the endif.
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """One token per byte (256) plus five special tokens (``<|bos|>``, ``<|eos|>``,
    ``<|pad|>``, ``<|im_start|>``, ``<|im_end|>``): every text round-trips."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: index for index, symbol in enumerate(sorted(alphabet))}
    for special in (BOS, EOS, PAD, IM_START, IM_END):
        vocab[special] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
    )


def build(out_dir: Path, *, seed: int = 0, heads: int = 4) -> Path:
    """Save the tokenizer and a random Llama (hidden 64, 2 layers, ``heads`` heads) in
    ``out_dir``. vLLM's CPU attention needs a head size of 32 or more: ``heads=2``."""
    tokenizer = byte_level_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.do_sample = True
    # A request without max_tokens (the CLI's default) may generate 1024 tokens on
    # `transformers serve`, and a random model samples EOS once in ~260 tokens. Every 8th
    # byte also ends a generation, so completions stay ~8 tokens long: a few seconds per
    # command on a CPU instead of minutes. <|im_end|> ends one too, as it does a ChatML
    # model's turn (the plain template's turns still end with <|eos|>).
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    stops = [tokenizer.eos_token_id, im_end, *range(0, STOP_EVERY * 32, STOP_EVERY)]
    model.generation_config.eos_token_id = stops
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path, help="where to save the model (created)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (vLLM: 2)")
    options = parser.parse_args()
    print(build(options.directory, heads=options.heads))
