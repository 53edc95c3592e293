"""Which language the student would answer in, measured without sampling and apart from correctness
(``kdlab.callbacks.style_log_odds.StyleLogOdds``).

The share of sampled answers a language detector calls Spanish (:class:`~kdlab.callbacks.StyleTransfer`) mixes
style with everything else a sample does: a student that stops answering, or answers wrongly, moves it too, and
it carries the sampling noise of one draw per prompt. This measure asks the student how likely two fixed
answers are, both correct, one in each language, on its own prompt.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from kdlab.callbacks.periodic import PeriodicCallback, resume_path
from kdlab.runlog import log_metrics
from kdlab.tasks.base import Task, fill_answer_template

DEFAULT_TEMPLATES = {"spanish": "La respuesta es {answer}.", "english": "The answer is {answer}."}


def template_logprobs(model: torch.nn.Module, tokenizer: Any, prompts: list[str], completions: list[str], device: torch.device,
                      batch_size: int = 25) -> torch.Tensor:
    """Mean log-prob per token ``(N,)`` (nats, fp32) of each ``completions[i]`` after ``prompts[i]`` under ``model``
    at temperature 1: prompt and completion tokenised apart (no special tokens added) and joined, as a decoded
    completion follows its prompt."""
    values = []
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    for start in range(0, len(prompts), batch_size):
        pairs = [(tokenizer(p, add_special_tokens=False)["input_ids"], tokenizer(c, add_special_tokens=False)["input_ids"])
                 for p, c in zip(prompts[start : start + batch_size], completions[start : start + batch_size])]
        if any(not completion for _, completion in pairs):
            raise ValueError("StyleLogOdds: a template tokenises to no tokens")
        width = max(len(p) + len(c) for p, c in pairs)
        ids = torch.full((len(pairs), width), pad, dtype=torch.long)
        attention = torch.zeros((len(pairs), width), dtype=torch.long)
        targets = torch.zeros((len(pairs), width), dtype=torch.bool)  # positions whose token is a completion token
        for row, (prompt, completion) in enumerate(pairs):
            joined = prompt + completion
            ids[row, : len(joined)] = torch.tensor(joined)
            attention[row, : len(joined)] = 1
            targets[row, len(prompt) : len(joined)] = True
        ids, attention, targets = ids.to(device), attention.to(device), targets.to(device)
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()  # (b, W-1, V): predicts token t+1
        token = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # (b, W-1)
        mask = targets[:, 1:]
        values.append((token * mask).sum(1) / mask.sum(1))
    return torch.cat(values)


class StyleLogOdds(PeriodicCallback):
    """``style/log_odds``: per held-out prompt, the length-normalised log-odds of a Spanish over an English answer
    that both give the gold answer, averaged over prompts (nats per token; > 0: the Spanish one is likelier).

    For each of the first ``examples`` prompts of the task's ``split`` (the student's prompt, rendered as training
    renders it), the student scores ``templates["spanish"]`` and ``templates["english"]`` filled with the prompt's
    gold answer (:meth:`~kdlab.tasks.base.Task.gold_answer`) and the example's fields; the prompt's log-odds is
    the mean log-prob per token of the Spanish answer minus that of the English one. Logged: ``style/log_odds``
    (the mean over prompts), ``style/log_odds_spanish_share`` (the share of prompts whose log-odds is > 0),
    once at the start of fit ``style/log_odds_before`` and ``style/log_odds_spanish_share_before``, and at each
    measurement ``style/log_odds_delta`` = after - before. Independent of sampling (no draw) and of whether the
    student would answer correctly (both answers are correct).

    Args:
        templates: ``{"spanish": ..., "english": ...}`` answer templates with ``{answer}``.
        task: the prompts' task (``None``: the module's).
        examples, batch_size, split: which prompts and how many per forward pass.
        every_n_steps: also measure every that many optimiser steps (always at the end of fit).
    """

    def __init__(self, templates: dict[str, str] | None = None, task: Task | None = None, examples: int = 200, batch_size: int = 25,
                 split: str = "val", every_n_steps: int | None = None) -> None:
        super().__init__(every_n_steps)
        self.templates = dict(DEFAULT_TEMPLATES if templates is None else templates)
        if set(self.templates) != {"spanish", "english"}:
            raise ValueError(f"StyleLogOdds.templates must have exactly the keys 'spanish' and 'english', got {sorted(self.templates)}")
        for name, template in self.templates.items():
            if "{answer}" not in template:
                raise ValueError(f"StyleLogOdds.templates[{name!r}] must contain {{answer}}, got {template!r}")
        if examples < 1 or batch_size < 1:
            raise ValueError(f"StyleLogOdds.examples and batch_size must be >= 1, got {examples} and {batch_size}")
        self.task, self.examples, self.batch_size, self.split = task, examples, batch_size, split
        self.before: dict[str, float] = {}

    def per_prompt(self, pl_module: pl.LightningModule) -> torch.Tensor:
        """The log-odds ``(examples,)`` of each prompt under the module's student now."""
        task = self.task or pl_module.task
        rows = list(task.examples(self.split))[: self.examples]
        if not rows:
            raise ValueError(f"StyleLogOdds: the task's {self.split!r} split is empty")
        tokenizer, model = pl_module.student_tokenizer, pl_module.student
        prompts = [task.render(tokenizer, task.student_messages(row)) for row in rows]
        filled = {name: [fill_answer_template(task, row, template, f"StyleLogOdds.templates[{name!r}]") for row in rows]
                  for name, template in self.templates.items()}
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                spanish = template_logprobs(model, tokenizer, prompts, filled["spanish"], pl_module.device, self.batch_size)
                english = template_logprobs(model, tokenizer, prompts, filled["english"], pl_module.device, self.batch_size)
        finally:
            model.train(was_training)
        return spanish - english

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.before or trainer.global_step != 0 or resume_path(trainer):
            return
        odds = self.per_prompt(pl_module)
        self.before = {"log_odds": odds.mean().item(), "log_odds_spanish_share": (odds > 0).float().mean().item()}
        log_metrics(trainer, {f"style/{name}_before": value for name, value in self.before.items()})

    def measure(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        odds = self.per_prompt(pl_module)
        now = {"style/log_odds": odds.mean().item(), "style/log_odds_spanish_share": (odds > 0).float().mean().item()}
        if self.before:
            now["style/log_odds_delta"] = now["style/log_odds"] - self.before["log_odds"]
        log_metrics(trainer, now)

    def state_dict(self) -> dict[str, Any]:
        return {"before": dict(self.before)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.before = dict(state_dict.get("before", {}))
