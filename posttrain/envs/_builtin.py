"""Built-in environments: `calculator`, `python_tool` and the `fault_injection` wrapper.

- `calculator`: one tool that evaluates arithmetic exactly (integers, + - * / // % ** and
  parentheses); the episode's answer is scored by the record's reward domain.
- `python_tool`: one tool that runs Python in the bwrap sandbox (`posttrain.rewards.sandbox`)
  and returns its exit code and output; the answer is scored by the record's domain.
- `fault_injection`: wraps another tool environment so that each tool call fails with
  probability `rate` (a timeout, an error message or an empty result), deterministically for
  a given record, call and seed, so that rollouts contain failures and recoveries.
"""

from __future__ import annotations

import ast
import hashlib
import json
import operator
import random
from collections.abc import Mapping
from typing import Any

from posttrain.envs._base import Environment, Tool, ToolEnvironment, make_env, register_env
from posttrain.rewards import sandbox

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_MAX_DIGITS = 1000  # results longer than this are refused (a ** b ** c would run forever)


def calculate(expression: str) -> str:
    """Evaluates an arithmetic expression exactly.

    Args:
        expression: integers or decimals with + - * / // % ** and parentheses, e.g. "347 * 589".
    """
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from e
    value = _evaluate(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def _evaluate(node: ast.AST):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) * len(str(abs(left))) > _MAX_DIGITS:
            raise ValueError("the result would be too large")
        return _OPS[type(node.op)](left, right)
    raise ValueError(f"unsupported in an arithmetic expression: {ast.unparse(node)!r}")


CALCULATOR_SYSTEM = (
    "You can call the calculate tool for exact arithmetic. When you know the result, answer "
    "with the number alone."
)


def calculator_env(record: Mapping[str, Any], system: str = CALCULATOR_SYSTEM) -> ToolEnvironment:
    """An episode with the `calculate` tool; the record's domain scores the final answer."""
    return ToolEnvironment(record, [Tool(calculate)], system=system)


def python_env(
    record: Mapping[str, Any],
    *,
    timeout_s: float = 10.0,
    memory_mb: int = 512,
    max_output_chars: int = 2000,
    system: str = (
        "You can run Python code with the python tool (standard library only; print what you "
        "need to see). When you know the answer, give it without calling a tool."
    ),
) -> ToolEnvironment:
    """An episode with a sandboxed Python interpreter; the record's domain scores the answer."""
    if min(timeout_s, memory_mb) <= 0 or max_output_chars < 0:
        raise ValueError(
            f"python_tool needs timeout_s > 0, memory_mb > 0 and max_output_chars >= 0, got "
            f"{timeout_s}, {memory_mb}, {max_output_chars}"
        )

    def python(code: str) -> str:
        """Runs a Python program in a sandbox and returns its exit code and output.

        Args:
            code: the program; print what you want to see.
        """
        result = sandbox.run(code, timeout_s=timeout_s, memory_mb=memory_mb)
        status = "timed out" if result.timed_out else f"exit code {result.exit_code}"
        out = {"status": status, "stdout": result.stdout[-max_output_chars:]}
        if result.stderr:
            out["stderr"] = result.stderr[-max_output_chars:]
        if not result.ok:  # the model sees the failure; ToolEnvironment counts it as an error
            raise RuntimeError(json.dumps(out, ensure_ascii=False))
        return json.dumps(out, ensure_ascii=False)

    return ToolEnvironment(record, [Tool(python)], system=system)


FAULTS = ("timeout", "error", "empty")


class FaultInjection(Environment):
    """Another tool environment whose tool calls fail with probability `rate`.

    A failed call answers, at random among `faults`: a timeout message, an error message or an
    empty result, instead of running the tool; each counts as a tool error. Draws are seeded by
    the record, the call's position in the episode and `seed`, so reruns fail the same calls.
    """

    def __init__(self, inner: ToolEnvironment, *, rate: float, seed: int = 0, faults=FAULTS):
        if not isinstance(inner, ToolEnvironment):
            raise ValueError(
                f"fault_injection wraps a tool environment, not {type(inner).__name__}"
            )
        if not 0 <= rate <= 1 or not faults or set(faults) - set(FAULTS):
            raise ValueError(f"fault_injection: rate in [0, 1] and faults from {FAULTS}")
        super().__init__(inner.record)
        self.inner, self.rate, self.faults = inner, rate, tuple(faults)
        self.tools = inner.tools
        digest = hashlib.sha256(json.dumps(inner.record, sort_keys=True, default=str).encode())
        self._rng = random.Random(f"{seed}:{digest.hexdigest()}")
        run = inner.call

        def call(c: Mapping[str, Any]) -> tuple[str, bool]:
            if self._rng.random() >= self.rate:
                return run(c)
            fault = self._rng.choice(self.faults)
            name = c["function"]["name"]
            if fault == "timeout":
                return f"Error: {name} timed out; try again", False
            if fault == "error":
                return f"Error: {name} is temporarily unavailable (503); try again", False
            return "", False

        inner.call = call

    def reset(self) -> list[dict]:
        return self.inner.reset()

    def step(self, message: dict):
        return self.inner.step(message)

    def close(self) -> None:
        self.inner.close()


def fault_injection_env(
    record: Mapping[str, Any], *, inner: str, rate: float = 0.3, seed: int = 0, **options
) -> FaultInjection:
    """`inner`'s environment (made with `options`) with failing tool calls."""
    return FaultInjection(make_env(inner, record, **options), rate=rate, seed=seed)


register_env("calculator", calculator_env)
register_env("python_tool", python_env)
register_env("fault_injection", fault_injection_env)
