"""Arithmetic with a calculator tool: a multi-turn environment and a policy that learns
to use it.

:class:`CalculatorEnvironment` is an :class:`~trio_rollouts.Environment` for
:class:`~trio_rollouts.MultiTurnAgent`: the class itself is the factory
(``MultiTurnAgent(environment=CalculatorEnvironment, ...)``), one environment per episode
of a problem from :func:`~trio_rollouts.envs.make_problems`. It offers one tool,
``calculator``, which evaluates an arithmetic expression safely (:func:`calculate`: the
expression is parsed with :mod:`ast` and only numbers and arithmetic are evaluated, never
``eval``), answers every tool call with one ``"tool"`` message, and ends the episode at
the first turn without tool calls, with reward 1.0 when that turn's last number is the
answer.

:class:`ToolUsePolicy` is a learnable policy for
:class:`~trio_rollouts.inference.EmbeddedInference` (the model of ``trio-rollouts demo
--task tool``): two shared rows of logits, one over "call the calculator or answer a
wrong number" and one over "answer the tool's result or a wrong number", trained with
a clipped GRPO step from whole episodes.
"""

from __future__ import annotations

import ast
import json
import math
import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import trio

from trio_rollouts._checks import is_real
from trio_rollouts._messages import ChatMessage
from trio_rollouts.agents._environment import BaseEnvironment, EnvironmentStep
from trio_rollouts.agents._reward_only import last_number_reward
from trio_rollouts.models._problems import Problem
from trio_rollouts.models._rollouts import RolloutGroup, TokenRollout
from trio_rollouts.renderers import AssistantTurn, ToolCall

__all__ = [
    "CALCULATOR_TOOL",
    "MAX_EXPONENT",
    "MAX_EXPRESSION_LENGTH",
    "CalculatorEnvironment",
    "CalculatorError",
    "ToolUsePolicy",
    "calculate",
]

#: The longest expression :func:`calculate` reads, in characters.
MAX_EXPRESSION_LENGTH = 200
#: The largest exponent ``**`` accepts, in absolute value.
MAX_EXPONENT = 100
#: Results (and intermediate results) must stay below ``10 ** _MAX_DIGITS`` in absolute value.
_MAX_DIGITS = 100

#: The OpenAI function schema of the ``calculator`` tool.
CALCULATOR_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": (
            "Evaluate an arithmetic expression: numbers, + - * / // % ** (exponent at most "
            f"{MAX_EXPONENT}), unary minus and parentheses. Returns the result."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {
                    "type": "string",
                    "description": "The expression to evaluate, such as '17 * (3 + 4)'.",
                }
            },
            "required": ["expression"],
        },
    },
}


class CalculatorError(ValueError):
    """An expression :func:`calculate` will not evaluate; the message says why."""


_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_SYMBOL: dict[type[ast.AST], str] = {
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.Div: "/",
    ast.FloorDiv: "//",
    ast.Mod: "%",
    ast.Pow: "**",
}


def calculate(expression: str) -> int | float:
    """The value of an arithmetic ``expression``, evaluated without ``eval``.

    The expression is parsed with :func:`ast.parse` (mode ``"eval"``) and only these
    nodes are evaluated: int and float literals, ``+ - * / // % **``, unary ``-`` and
    ``+``, and parentheses. Anything else (names, calls, attributes, strings, booleans,
    comparisons, ...) is refused. ``**`` takes an exponent of at most
    :data:`MAX_EXPONENT` in absolute value, and every intermediate result must stay
    below ``10 ** 100`` in absolute value and be finite; an expression longer than
    :data:`MAX_EXPRESSION_LENGTH` characters is refused unread.

    Raises :class:`CalculatorError` (a ``ValueError``) saying why, for a syntax error,
    a refused construct, a division or modulo by zero, or a result out of bounds;
    ``TypeError`` when ``expression`` is not a ``str``.
    """
    if not isinstance(expression, str):
        msg = f"expression must be a str, got {type(expression).__name__}"
        raise TypeError(msg)
    if len(expression) > MAX_EXPRESSION_LENGTH:
        msg = (
            f"the expression is {len(expression)} characters long; at most "
            f"{MAX_EXPRESSION_LENGTH} are read"
        )
        raise CalculatorError(msg)
    if not expression.strip():
        msg = "the expression is empty"
        raise CalculatorError(msg)
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as error:
        msg = f"invalid syntax in {expression!r} ({error.msg})"
        raise CalculatorError(msg) from None
    except (ValueError, RecursionError, MemoryError):
        msg = f"cannot parse {expression!r}"
        raise CalculatorError(msg) from None
    return _evaluate(tree.body)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            msg = f"{value!r} is not a number (only numbers and arithmetic are allowed)"
            raise CalculatorError(msg)
        return _bounded(value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = _evaluate(node.operand)
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp) and type(node.op) in _SYMBOL:
        left = _evaluate(node.left)
        right = _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            return _power(left, right)
        symbol = _SYMBOL[type(node.op)]
        if symbol in ("/", "//", "%") and right == 0:
            what = "division" if symbol != "%" else "modulo"
            msg = f"{what} by zero ({_format(left)} {symbol} {_format(right)})"
            raise CalculatorError(msg)
        try:
            value = _BINARY[type(node.op)](left, right)
        except OverflowError:
            msg = f"{_format(left)} {symbol} {_format(right)} is too large"
            raise CalculatorError(msg) from None
        return _bounded(value)
    msg = (
        f"{type(node).__name__} is not allowed: only numbers, + - * / // % **, unary minus "
        "and parentheses"
    )
    raise CalculatorError(msg)


def _power(base: int | float, exponent: int | float) -> int | float:
    if abs(exponent) > MAX_EXPONENT:
        msg = f"the exponent {_format(exponent)} is larger than {MAX_EXPONENT}"
        raise CalculatorError(msg)
    if base == 0 and exponent < 0:
        msg = f"division by zero (0 ** {_format(exponent)})"
        raise CalculatorError(msg)
    if abs(base) > 1 and exponent > 0 and exponent * math.log10(abs(base)) >= _MAX_DIGITS:
        msg = f"{_format(base)} ** {_format(exponent)} is too large (at least 10 ** {_MAX_DIGITS})"
        raise CalculatorError(msg)
    if base < 0 and not float(exponent).is_integer():
        msg = f"{_format(base)} ** {_format(exponent)} is not a real number"
        raise CalculatorError(msg)
    try:
        value = base**exponent
    except OverflowError:
        msg = f"{_format(base)} ** {_format(exponent)} is too large"
        raise CalculatorError(msg) from None
    return _bounded(value)


def _bounded(value: int | float) -> int | float:
    if isinstance(value, float) and not math.isfinite(value):
        msg = "the result is not a finite number"
        raise CalculatorError(msg)
    if abs(value) >= 10**_MAX_DIGITS:
        msg = f"the result is too large (at least 10 ** {_MAX_DIGITS})"
        raise CalculatorError(msg)
    return value


def _format(value: int | float) -> str:
    """A number as the calculator writes it: ints whole, integral floats without
    ``.0``, other floats with up to 12 significant digits."""
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return format(value, ".12g")
    return str(value)


def _check_problem(problem: object) -> Problem:
    if not isinstance(problem, Problem):
        msg = f"CalculatorEnvironment needs a Problem, got {type(problem).__name__}"
        raise TypeError(msg)
    if isinstance(problem.answer, bool) or not is_real(problem.answer):
        msg = (
            f"CalculatorEnvironment needs a numeric answer, problem {problem.problem_id!r} "
            f"has {problem.answer!r:.80}"
        )
        raise TypeError(msg)
    if not isinstance(problem.prompt, str):
        msg = (
            f"CalculatorEnvironment needs a str prompt, problem {problem.problem_id!r} has "
            f"a {type(problem.prompt).__name__}"
        )
        raise TypeError(msg)
    return problem


class CalculatorEnvironment(BaseEnvironment):
    """One episode of an arithmetic problem with a ``calculator`` tool.

    The class is the factory of :class:`~trio_rollouts.MultiTurnAgent`:
    ``MultiTurnAgent(environment=CalculatorEnvironment, renderer=...,
    prompts=PromptSource(make_problems(...)))`` makes one per episode from its problem (a
    :class:`~trio_rollouts.Problem` with a ``str`` prompt and a numeric ``answer``;
    ``TypeError`` otherwise).

    - :meth:`reset`: one ``"user"`` message, the problem's prompt.
    - ``tools``: one OpenAI function, ``calculator``, with a string parameter
      ``expression`` (:data:`CALCULATOR_TOOL`).
    - :meth:`step`: a turn with tool calls gets one ``"tool"`` message per call, in
      order: the result (:func:`calculate`, written as ``"42"`` or ``"2.5"``) or, for a
      bad call, ``"error: ..."`` saying what was wrong (the call could not be parsed,
      another tool's name, ``expression`` missing, not a string or not evaluable, other
      arguments). A bad call is an observation: nothing is repaired, and the episode
      goes on. The first turn without tool calls ends the episode (``done=True``) with
      reward 1.0 when the last number of its content is the answer
      (:func:`~trio_rollouts.envs.last_number_reward`), else 0.0.
    - An episode that reaches the agent's ``max_turns`` while still calling the tool
      gets :meth:`final_reward`, 0.0.
    """

    def __init__(self, problem: Problem) -> None:
        super().__init__()
        #: The episode's problem.
        self.problem = _check_problem(problem)
        #: The tools offered: ``[CALCULATOR_TOOL]`` (a copy per environment).
        self.tools: list[dict[str, Any]] | None = [json.loads(json.dumps(CALCULATOR_TOOL))]

    async def reset(self) -> Sequence[ChatMessage]:
        """The problem as one user message.

        Cancellation: a checkpoint."""
        await trio.lowlevel.checkpoint()
        return [ChatMessage(role="user", content=str(self.problem.prompt))]

    async def step(self, turn: AssistantTurn) -> EnvironmentStep:
        """The tool messages of a turn with tool calls, or the end of the episode.

        Cancellation: a checkpoint."""
        await trio.lowlevel.checkpoint()
        if turn.tool_calls:
            return EnvironmentStep(messages=[_answer(call) for call in turn.tool_calls])
        return EnvironmentStep(done=True, reward=last_number_reward(self.problem, turn.content))


def _answer(call: ToolCall) -> ChatMessage:
    """The tool message answering one call: its result, or what is wrong with it."""
    return ChatMessage(role="tool", content=_result(call), extra={"tool_call_id": call.id})


def _result(call: ToolCall) -> str:
    if call.arguments is None:
        return (
            'error: the tool call is not a JSON object {"name": ..., "arguments": {...}}: '
            f"{call.raw!r:.120}"
        )
    if call.name != "calculator":
        return f'error: there is no tool {call.name!r}; the only tool is "calculator"'
    unexpected = sorted(set(call.arguments) - {"expression"})
    if unexpected:
        return f'error: unexpected arguments {unexpected}; calculator takes only "expression"'
    if "expression" not in call.arguments:
        return 'error: calculator needs the argument "expression"'
    expression = call.arguments["expression"]
    if not isinstance(expression, str):
        return f'error: "expression" must be a string, got {json.dumps(expression)[:80]}'
    try:
        return _format(calculate(expression))
    except CalculatorError as error:
        return f"error: {error}"


# --------------------------------------------------------------------------- the policy

FloatArray = npt.NDArray[np.float64]

_OFFSET_STREAM = 0x544F4F4C
_CALL, _ANSWER = 0, 1
_TOOL_MARK = "<|tool|>\n"
_USER_MARK = "<|user|>\n"
_GENERATION_PROMPT = "<|assistant|>\n"


def _softmax(logits: FloatArray) -> FloatArray:
    shifted = np.exp(logits - logits.max())
    probs: FloatArray = shifted / shifted.sum()
    return probs


def _expression(problem: Problem) -> str:
    """``"17 + 25"`` of ``"What is 17 + 25?"`` (the form of :func:`make_problems`)."""
    prompt = str(problem.prompt)
    expression = prompt.removeprefix("What is ").removesuffix("?")
    if expression == prompt or not expression.strip():
        msg = (
            f"ToolUsePolicy needs problems of the form 'What is <expression>?' "
            f"(make_problems), problem {problem.problem_id!r} is {prompt!r:.80}"
        )
        raise ValueError(msg)
    return expression


def _call_text(expression: str) -> str:
    arguments = {"name": "calculator", "arguments": {"expression": expression}}
    # PlainRenderer's form of a call, so that the turn re-renders as sampled and bridges.
    return f"<tool_call>{json.dumps(arguments)}</tool_call>"


def _answer_text(value: str) -> str:
    return f"The answer is {value}."


def _number(text: str) -> int | float | None:
    for kind in (int, float):
        try:
            value = kind(text)
        except ValueError:
            continue
        if math.isfinite(value):
            return value
    return None


@attrs.define(kw_only=True, eq=False)
class ToolUsePolicy:
    """A learnable policy for :class:`CalculatorEnvironment` on the embedded backend (the
    model of ``trio-rollouts demo --task tool``): two rows of logits shared by every
    problem (a tendency, as a model has), not a language model.

    It reads the state from the messages it is given (the conversation so far, which
    :class:`~trio_rollouts.MultiTurnAgent` passes as the request's prompt), finds the
    problem by its first user message, and returns ``K`` candidates with their
    probabilities (:data:`~trio_rollouts.inference.Policy`):

    - last message ``"user"`` (turn 1): candidate 0 calls the calculator with the
      problem's expression (``<tool_call>{"name": "calculator", "arguments":
      {"expression": "17 + 25"}}</tool_call>``); candidates 1 to ``K - 1`` answer at once
      with a wrong number (``"The answer is 41."``: the answer plus one of the problem's
      ``K - 1`` seeded non-zero :attr:`offsets`). Probabilities: softmax of
      :attr:`call_logits`.
    - last message ``"tool"`` (turn 2): candidate 0 answers with the tool's result
      (``"The answer is 42."``, the message's content); candidates 1 to ``K - 1`` with
      the result plus the offsets, wrong numbers. Probabilities: softmax of
      :attr:`answer_logits`.

    Any other state, or a problem it was not made for, is a ``ValueError``. So reward
    comes only through the tool, and learning shows as the tool-call rate and the
    accuracy rising (:meth:`tool_call_rate`, :meth:`accuracy`). Make one with
    :meth:`initial`, serve it with ``EmbeddedInference(policy=policy, ...)``, and train
    it with :meth:`grpo_step` on the groups of a ``MultiTurnAgent`` with a
    :class:`~trio_rollouts.PlainRenderer` (whose ids are code points, as the embedded
    backend's).
    """

    problems: list[Problem]
    #: ``(num_problems, K - 1)`` distinct non-zero ints: a problem's wrong answers are
    #: the right one (turn 1) or the tool's result (turn 2) plus these.
    offsets: npt.NDArray[np.int64]
    #: ``(K,)`` turn-1 logits: call the calculator (0), answer a wrong number (1..K-1).
    call_logits: FloatArray
    #: ``(K,)`` turn-2 logits: answer the tool's result (0), a wrong number (1..K-1).
    answer_logits: FloatArray
    _row_of_prompt: dict[str, int] = attrs.field(init=False, repr=False)
    _row_of_problem_id: dict[str, int] = attrs.field(init=False, repr=False)
    _expressions: list[str] = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        k = len(self.call_logits)
        if self.offsets.shape != (len(self.problems), k - 1) or self.answer_logits.shape != (k,):
            msg = (
                f"ToolUsePolicy: offsets must be (num_problems, K - 1) and both logits (K,), "
                f"got {self.offsets.shape}, {self.call_logits.shape}, {self.answer_logits.shape}"
            )
            raise ValueError(msg)
        self._expressions = [_expression(problem) for problem in self.problems]
        self._row_of_prompt = {str(p.prompt): row for row, p in enumerate(self.problems)}
        self._row_of_problem_id = {p.problem_id: row for row, p in enumerate(self.problems)}

    @classmethod
    def initial(
        cls,
        problems: Sequence[Problem],
        num_candidates: int = 4,
        seed: int = 0,
        init_scale: float = 0.1,
    ) -> ToolUsePolicy:
        """A fresh policy for ``problems`` (of :func:`make_problems`' form ``"What is
        <expression>?"``; ``ValueError`` otherwise): seeded offsets, and logits drawn from
        ``Normal(0, init_scale)``, so it starts near chance: it calls the tool with
        probability about ``1 / K``, and is right about ``1 / K ** 2`` of the time."""
        if num_candidates < 2:
            msg = f"num_candidates must be >= 2, got {num_candidates}"
            raise ValueError(msg)
        if not problems:
            msg = "ToolUsePolicy needs at least one problem"
            raise ValueError(msg)
        rng = np.random.default_rng([seed, _OFFSET_STREAM])
        spread = max(10, num_candidates)
        pool = np.array([d for d in range(-spread, spread + 1) if d != 0], dtype=np.int64)
        offsets = np.stack(
            [rng.choice(pool, size=num_candidates - 1, replace=False) for _ in problems]
        )
        return cls(
            problems=list(problems),
            offsets=offsets,
            call_logits=rng.normal(0.0, init_scale, size=num_candidates),
            answer_logits=rng.normal(0.0, init_scale, size=num_candidates),
        )

    def __call__(self, prompt: list[ChatMessage]) -> tuple[Sequence[str], npt.ArrayLike]:
        row = self._row(prompt)
        last = prompt[-1]
        if last.role == "user":
            return self.call_candidates(row), _softmax(self.call_logits)
        if last.role == "tool":
            return self.answer_candidates(row, last.content), _softmax(self.answer_logits)
        msg = (
            "ToolUsePolicy answers after a user message (turn 1) or a tool message (turn 2), "
            f"not after a {last.role!r} message"
        )
        raise ValueError(msg)

    def _row(self, prompt: list[ChatMessage]) -> int:
        first = next((m.content for m in prompt if m.role == "user"), None)
        row = None if first is None else self._row_of_prompt.get(first)
        if row is None:
            msg = (
                "ToolUsePolicy knows only the problems it was made for, not "
                f"{first!r:.80} (the conversation's first user message)"
            )
            raise ValueError(msg)
        return row

    def call_candidates(self, row: int) -> list[str]:
        """The turn-1 candidates of problem ``row``: the calculator call, then the wrong
        answers."""
        answer = self.problems[row].answer
        wrong = [_answer_text(_format(answer + int(d))) for d in self.offsets[row]]
        return [_call_text(self._expressions[row]), *wrong]

    def answer_candidates(self, row: int, result: str) -> list[str]:
        """The turn-2 candidates of problem ``row`` after the tool answered ``result``:
        the result, then wrong numbers (the result, or the answer when the result is not
        a number, plus the offsets)."""
        value = _number(result)
        base = self.problems[row].answer if value is None else value
        wrong = [_answer_text(_format(base + int(d))) for d in self.offsets[row]]
        return [_answer_text(result), *wrong]

    def tool_call_rate(self) -> float:
        """The probability that turn 1 calls the calculator (the same for every
        problem), computed exactly."""
        return float(_softmax(self.call_logits)[0])

    def accuracy(self) -> float:
        """The probability that an episode earns 1.0: it calls the calculator, then
        answers with the result (the calculator gets every problem of
        :func:`make_problems` right). The expected reward at temperature 1, computed
        exactly (no sampling noise)."""
        return float(_softmax(self.call_logits)[0] * _softmax(self.answer_logits)[0])

    def grpo_step(self, groups: Sequence[RolloutGroup], learning_rate: float, clip: float) -> None:
        """One policy-gradient step on both rows of logits from a batch of episodes.

        Per rollout: the GRPO advantage ``A`` (:meth:`RolloutGroup.advantages`). Per turn
        of it (each run of sampled ids, mask 1, of its trajectory): the candidate the
        model sampled (the decoded ids; which row it belongs to follows from the message
        before it, as in :meth:`__call__`), and the importance ratio ``rho = p_now /
        p_then``, ``p_then`` being the probability the turn's log-probabilities record
        (their sum is ``log p``). The gradient of the clipped surrogate ``min(rho * A,
        clip(rho, 1 +- clip) * A)`` is ``rho * A * (onehot - p_now)`` on that turn's
        row, or nothing once the ratio is clipped; it is averaged over the batch's
        rollouts and added (ascent).

        Raises ``TypeError`` for a rollout that is not a :class:`TokenRollout` with
        logprobs, and ``ValueError`` for a turn that is none of the candidates (cut by
        ``max_tokens``, or not of this policy).
        """
        rows = (self.call_logits, self.answer_logits)
        probs = (_softmax(rows[_CALL]), _softmax(rows[_ANSWER]))
        gradients = (np.zeros_like(rows[_CALL]), np.zeros_like(rows[_ANSWER]))
        count = sum(len(group) for group in groups)
        for group in groups:
            for rollout, advantage in zip(group, group.advantages(), strict=True):
                if advantage == 0.0:
                    continue
                token_rollout, problem_row = self._problem_row(rollout)
                for which, column, logprob in self._turns(token_rollout, problem_row):
                    ratio = probs[which][column] / math.exp(logprob)
                    if (advantage > 0 and ratio > 1 + clip) or (advantage < 0 and ratio < 1 - clip):
                        continue
                    step = ratio * advantage / count
                    gradients[which][:] -= step * probs[which]
                    gradients[which][column] += step
        self.call_logits = self.call_logits + learning_rate * gradients[_CALL]
        self.answer_logits = self.answer_logits + learning_rate * gradients[_ANSWER]

    def _problem_row(self, rollout: object) -> tuple[TokenRollout, int]:
        if not isinstance(rollout, TokenRollout) or rollout.logprobs is None:
            msg = (
                "ToolUsePolicy.grpo_step needs token rollouts with logprobs (an interface "
                f"that returns tokens and logprobs), got {type(rollout).__name__}"
            )
            raise TypeError(msg)
        row = self._row_of_problem_id.get(str(rollout.problem_id))
        if row is None:
            msg = f"ToolUsePolicy was not made for problem {rollout.problem_id!r}"
            raise ValueError(msg)
        return rollout, row

    def _turns(self, rollout: TokenRollout, row: int) -> Iterator[tuple[int, int, float]]:
        """``(which row of logits, column, log p then)`` of each sampled turn."""
        logprobs = rollout.logprobs or []
        masks = rollout.generation_mask or [[True] * len(ids) for ids in rollout.trajectory]
        for element, (ids, mask) in enumerate(zip(rollout.trajectory, masks, strict=True)):
            text = "".join(map(chr, ids))
            sampled = 0
            for start, end in _runs(mask):
                prefix = text[:start]
                completion = text[start:end]
                which, candidates = self._state(row, prefix)
                if completion not in candidates:
                    msg = (
                        f"a turn of problem {rollout.problem_id!r} is none of ToolUsePolicy's "
                        f"candidates: {completion!r:.80}"
                    )
                    raise ValueError(msg)
                logprob = math.fsum(logprobs[element][sampled : sampled + end - start])
                sampled += end - start
                yield which, candidates.index(completion), logprob

    def _state(self, row: int, prefix: str) -> tuple[int, list[str]]:
        """The row of logits and the candidates of a turn generated after ``prefix``
        (the plain layout: the last message before the generation prompt)."""
        body = prefix.removesuffix(_GENERATION_PROMPT)
        tool, user = body.rfind(_TOOL_MARK), body.rfind(_USER_MARK)
        if body != prefix and tool > user:
            result = body[tool + len(_TOOL_MARK) :].removesuffix("\n")
            return _ANSWER, self.answer_candidates(row, result)
        if body != prefix and user >= 0:
            return _CALL, self.call_candidates(row)
        msg = "a turn that follows neither a user nor a tool message (not the plain layout)"
        raise ValueError(msg)


def _runs(mask: Sequence[bool]) -> Iterator[tuple[int, int]]:
    """The ``[start, end)`` of each run of True in ``mask``."""
    start = None
    for index, value in enumerate(mask):
        if value and start is None:
            start = index
        elif not value and start is not None:
            yield start, index
            start = None
    if start is not None:
        yield start, len(mask)
