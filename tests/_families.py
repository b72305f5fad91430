"""The real chat templates of ``tests/data/chat_templates``, each with an offline tokenizer.

``MANIFEST.json`` says per family which tokens are special, which are plain added tokens,
the BOS and EOS, and the stop tokens; :func:`tokenizer` trains a tiny byte-level BPE,
adds those tokens and sets the real template as its ``chat_template`` (once per family).

The pre-tokenizer isolates every whitespace character before the byte-level split, so a
text is cut into the same tokens whatever comes before or after it at whitespace and at
special tokens: ``encode(a) + encode(b) == encode(a + b)`` at every seam an episode
makes (the generation prompt's end, a stop token). A real BPE that merges runs of
whitespace (``"\\n\\n"``) does not promise that; what the model samples there is the
engine's business, not the renderer's, so the tests need a tokenizer that keeps the
question of the renderer's ids apart from it.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"


@functools.cache
def manifest() -> dict[str, dict[str, Any]]:
    """The manifest's entries by family (empty when it is not there)."""
    path = TEMPLATES / "MANIFEST.json"
    if not path.exists():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return {entry["family"]: entry for entry in data["templates"]}


def template_text(family: str) -> str:
    # newline="" keeps a file's CRLF line endings as written (Kimi-K2's).
    with (TEMPLATES / manifest()[family]["file"]).open(encoding="utf-8", newline="") as file:
        return file.read()


CORPUS = [
    "system user assistant tool You are a helpful assistant. Today Date: Cutting Knowledge",
    "Hello. Hi. What is 2 + 2? It is 4. The weather in Paris is sunny. Let me think.",
    '{"name": "calculator", "arguments": {"expression": "2+2"}, "parameters": "id"}',
    "<tool_response> </tool_response> # Tools <tools> </tools> function call json result",
    "calculator expression Evaluate an arithmetic expression. object string type properties",
    "0123456789 + - * / ( ) abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ",
] * 20


def _train(specials: list[str], added: list[str]) -> Any:
    import tokenizers

    model = tokenizers.Tokenizer(tokenizers.models.BPE())
    model.pre_tokenizer = tokenizers.pre_tokenizers.Sequence(
        [
            tokenizers.pre_tokenizers.Split(tokenizers.Regex(r"\s"), behavior="isolated"),
            tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    model.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=600,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    model.train_from_iterator(CORPUS, trainer)
    model.add_special_tokens(specials)
    if added:
        model.add_tokens(added)
    return model


@functools.cache
def tokenizer(family: str) -> Any:
    """The family's offline tokenizer with its real chat template."""
    import transformers

    entry = manifest()[family]
    added = list(entry["non_special_added"])
    specials = [token for token in entry["special_tokens"] if token not in added]
    for token in (entry["bos_token"], entry["eos_token"], *entry["stop_tokens"]):
        if token and token not in specials and token not in added:
            specials.append(token)
    kwargs: dict[str, Any] = {"eos_token": entry["eos_token"]}
    if entry["bos_token"]:
        kwargs["bos_token"] = entry["bos_token"]
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=_train(specials, added),
        chat_template=template_text(family),
        **kwargs,
    )
