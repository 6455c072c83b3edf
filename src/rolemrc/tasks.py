"""The 18 RoleMRC test tasks and the five judged dimensions (facts §3).

One table, used by evaluation (judge routing), probing (grouping by dimension) and synthesis
(task names of the assembled data).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import Any


class Dimension(str, Enum):
    KB = "knowledge_boundary"
    RS = "role_style"
    MT = "multi_turn"
    NI = "nested_instruction"
    PI = "prioritized_instruction"

    @property
    def short(self) -> str:
        return self.name

    @property
    def title(self) -> str:
        return {
            "KB": "Knowledge Boundary",
            "RS": "Role Style",
            "MT": "Multi-turn Instruction-following",
            "NI": "Nested Instruction-following",
            "PI": "Prioritized Instruction-following",
        }[self.name]


KB, RS, MT, NI, PI = Dimension.KB, Dimension.RS, Dimension.MT, Dimension.NI, Dimension.PI

# task -> (dimensions, expectation). The expectation is what the judge is told to look for:
# for KB, whether the question lies within ("within") or outside ("outside") the role's
# knowledge boundary; for MT, whether the last reply should keep refusing ("refuse") or
# attempt an answer after being pressed ("answer"); PI: the system refusal directive wins.
TASKS: dict[str, tuple[tuple[Dimension, ...], str | None]] = {
    "role_related_mrc_answer_with_narration": ((KB, RS), "within"),
    "role_related_mrc_answer_no_narration": ((KB,), "within"),
    "role_unrelated_mrc_refused_with_narration": ((KB,), "outside"),
    "role_unrelated_mrc_refused_no_narration": ((KB, RS), "outside"),
    "role_related_mrc_refused_with_narration": ((KB,), "within"),
    "role_unrelated_mrc_answer_with_narration": ((KB,), "outside"),
    "role_related_mrc_refused_no_narration": ((RS,), None),
    "role_unrelated_mrc_answer_no_narration": ((RS,), None),
    "role_related_mrc_answer_with_narration-special-content": ((NI,), None),
    "role_related_mrc_answer_with_narration-special-format": ((NI,), None),
    "role_related_mrc_answer_no_narration-special-content": ((NI,), None),
    "role_related_mrc_answer_no_narration-special-format": ((NI,), None),
    "role_related_mrc_refused_with_narration-2ndrefused": ((MT,), "refuse"),
    "role_related_mrc_refused_no_narration-2ndrefused": ((MT,), "refuse"),
    "role_unrelated_mrc_refused_with_narration-2ndanswer": ((MT,), "answer"),
    "role_unrelated_mrc_refused_no_narration-2ndanswer": ((MT,), "answer"),
    "role_related_mrc_answer_with_narration-refused": ((PI,), "refuse"),
    "role_related_mrc_answer_no_narration-refused": ((PI,), "refuse"),
}

TEST_TASKS: tuple[str, ...] = tuple(TASKS)


def dimensions_of(task: str) -> tuple[Dimension, ...]:
    """Dimensions a test task is judged on; KeyError with the known names if unknown."""
    try:
        return TASKS[task][0]
    except KeyError:
        raise KeyError(f"unknown RoleMRC test task {task!r}; known tasks: {', '.join(TASKS)}") from None


def expectation_of(task: str) -> str | None:
    return TASKS[task][1]


def balanced_subset(items: Sequence[Any], n: int) -> list[Any]:
    """``n`` items taken round-robin over tasks (in order of first appearance, each task's items in
    file order): a small, deterministic subset that still covers every task and dimension."""
    if n < 1:
        raise ValueError(f"subset size must be >= 1, got {n}")
    by_task: dict[str, list[Any]] = {}
    for item in items:
        by_task.setdefault(item.task, []).append(item)
    queues = list(by_task.values())
    out: list[Any] = []
    depth = 0
    while len(out) < n and any(depth < len(q) for q in queues):
        out += [q[depth] for q in queues if depth < len(q)][: n - len(out)]
        depth += 1
    return out
