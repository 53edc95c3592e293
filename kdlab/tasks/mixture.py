"""Several tasks as one: a run that trains one student on Countdown and on Addition (for instance each from
its own teacher, ``DistillModule(teachers=..., teacher_choice=ByField(...))``), or one that trains on a task
and is evaluated on another (``splits``: distil on Countdown-3, measure pass@k on a harder Countdown set)."""

from __future__ import annotations

import torch

from kdlab.tasks.base import SPLITS, Example, Messages, Task


class MultiTask(Task):
    """The union of named tasks. Each example is its task's example with ``"task"`` set to the task's name
    and its id prefixed ``"<name>:"``; every per-example method (prompts, score, format, reference) is the
    example's own task's. Splits interleave the tasks round-robin (row 0 of each task, then row 1, ...), so
    every batch mixes them while the data order stays the stages' to shuffle.

    Args:
        tasks: name -> task (``class_path`` entries in YAML). All must agree on ``chat_template``: a prompt is
            rendered by the one setting of the run.
        field: the field that names an example's task (``ByField(field=...)`` routes on it).
        splits: split (``train``, ``val``, ``test``) -> the names of the tasks it draws from; a split not
            named draws from every task (the default: every split from every task). ``{train: [countdown3],
            val: [countdown3s]}`` trains on one task and evaluates on the other (``val/accuracy``,
            ``val/pass@k``); an empty list leaves the split empty.
    """

    def __init__(self, tasks: dict[str, Task], field: str = "task", splits: dict[str, list[str]] | None = None) -> None:
        super().__init__()
        if not tasks:
            raise ValueError("MultiTask.tasks: give at least one name -> task")
        for name, task in tasks.items():
            if not isinstance(task, Task):
                raise ValueError(f"MultiTask.tasks.{name}: expected a kdlab Task, got {type(task).__name__}")
            if ":" in name or not name:
                raise ValueError(f"MultiTask.tasks: task name {name!r} must be non-empty and hold no ':'")
        templates = {name: task.chat_template for name, task in tasks.items()}
        if len(set(templates.values())) > 1:
            raise ValueError(f"MultiTask.tasks: every task must have the same chat_template, got {templates}")
        for split, names in (splits or {}).items():
            if split not in SPLITS:
                raise ValueError(f"MultiTask.splits: {split!r} is not a split; use {SPLITS}")
            unknown = [name for name in names if name not in tasks]
            if unknown:
                raise ValueError(f"MultiTask.splits.{split}: {unknown} not among MultiTask.tasks {sorted(tasks)}")
        self.tasks = torch.nn.ModuleDict(tasks)
        self.field = field
        self.splits = {split: list(names) for split, names in (splits or {}).items()}
        self.chat_template = next(iter(templates.values()))

    def task_of(self, example: Example) -> Task:
        """The task ``example`` came from (by its ``field``)."""
        name = example.get(self.field)
        if name not in self.tasks:
            raise KeyError(f"MultiTask: example {example.get('id')!r} has {self.field}={name!r}, not one of {sorted(self.tasks)}")
        return self.tasks[name]

    def load_split(self, split: str) -> list[Example]:
        names = self.splits.get(split, list(self.tasks))
        parts = {name: self.tasks[name].examples(split) for name in names}
        for name, rows in parts.items():
            clash = next((row for row in rows if self.field in row), None)
            if clash is not None:
                raise ValueError(f"MultiTask.tasks.{name}: example {clash['id']!r} already has a field {self.field!r}; set MultiTask.field")
        mixed = []
        for index in range(max((len(rows) for rows in parts.values()), default=0)):
            for name, rows in parts.items():
                if index < len(rows):
                    mixed.append({**rows[index], "id": f"{name}:{rows[index]['id']}", self.field: name})
        return mixed

    def user_prompt(self, example: Example) -> str:
        return self.task_of(example).user_prompt(example)

    def student_messages(self, example: Example) -> Messages:
        return self.task_of(example).student_messages(example)

    def teacher_messages(self, example: Example) -> Messages:
        return self.task_of(example).teacher_messages(example)

    def score(self, example: Example, completion: str) -> float:
        return self.task_of(example).score(example, completion)

    def well_formed(self, completion: str) -> bool:  # no example here: a completion is well formed for some task
        return any(task.well_formed(completion) for task in self.tasks.values())

    def reference_completion(self, example: Example) -> str | None:
        return self.task_of(example).reference_completion(example)
