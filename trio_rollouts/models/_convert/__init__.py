"""Conversion between the models and JSON-ready data, through one configured cattrs Converter.

Everything that turns a model into plain ``dict``/``list``/``str``/number data and back goes
through one converter, built once from hooks registered by type. Structuring is strict
(JSON's ``1`` is accepted for a float field and becomes ``1.0``; nothing else is coerced:
``"1.0"`` is not a float, ``True`` is not an int) and reports *every* problem at once as a
:class:`ValidationError` whose lines read ``message @ $.path``. Unknown keys of a record go
to its ``extra`` dict and come back at top level on unstructure, so
``unstructure(structure(d, cls)) == d`` for a complete ``d``. ``Rollout | TokenRollout`` is
decided by the data's shape; ``EvaluationResponse`` is decided by the registered class its
``type_name`` names. The large homogeneous lists of a :class:`TokenRollout` (token ids,
masks, log-probabilities) are type-checked in one C-speed pass rather than element by
element, because a rollout holds thousands of them, and are taken over rather than copied.
:func:`dump_jsonl` and :func:`load_jsonl` stream records as JSON lines.

The package, one concern a module: ``_converter`` builds the converter and holds
:func:`structure` and :func:`unstructure`; ``_hooks`` structures primitives, lists, tuples
and unions, ``_records`` attrs classes and evaluation responses (both ways); ``_fast`` has
the fast paths; ``_errors`` the error paths (:class:`ValidationError` and its messages);
``_jsonl`` the JSON-lines files; ``_types`` the type predicates they share.
"""

from trio_rollouts.models._convert._converter import structure as structure
from trio_rollouts.models._convert._converter import unstructure as unstructure
from trio_rollouts.models._convert._errors import ValidationError as ValidationError
from trio_rollouts.models._convert._jsonl import dump_jsonl as dump_jsonl
from trio_rollouts.models._convert._jsonl import load_jsonl as load_jsonl

__all__ = ["ValidationError", "dump_jsonl", "load_jsonl", "structure", "unstructure"]
