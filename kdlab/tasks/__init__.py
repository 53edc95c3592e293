"""Tasks: prompts, per-model prompting and verifiers. See :class:`kdlab.tasks.base.Task`."""

from kdlab.tasks.addition import Addition
from kdlab.tasks.countdown import Countdown
from kdlab.tasks.math import GSM8K, MATH
from kdlab.tasks.multiple_choice import MedReason, Science
from kdlab.tasks.skills import Counting, Reversal, Sorting
from kdlab.tasks.base import Example, Messages, Task, last_tagged

__all__ = ["Addition", "Countdown", "Counting", "GSM8K", "MATH", "MedReason", "Reversal", "Science", "Sorting", "Example", "Messages", "Task", "last_tagged"]
