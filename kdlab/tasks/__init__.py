"""Tasks: prompts, per-model prompting and verifiers. See :class:`kdlab.tasks.base.Task`."""

from kdlab.tasks.addition import Addition
from kdlab.tasks.countdown import Countdown
from kdlab.tasks.base import Example, Messages, Task, last_tagged

__all__ = ["Addition", "Countdown", "Example", "Messages", "Task", "last_tagged"]
