"""Where the teacher's distribution comes from: one interface (:class:`~kdlab.teachers.base.TeacherSource`) and its
sources, each the value of ``DistillModule.teacher``:

* :class:`ModelTeacher` - a model in this process (``teacher: {path: ...}`` is this source);
* :class:`CachedTeacher` - a top-k cache file of the teacher's log-probs on a teacher dataset;
* :class:`Served` - a teacher behind vLLM's OpenAI-compatible HTTP API;
* :class:`Several` - several teachers routed (:class:`ByField`) or averaged (:class:`Average`), each any source;
* :class:`BaseModelTeacher` - the student's own base under its disabled LoRA adapters.
"""

from kdlab.teachers.base import TeacherRun, TeacherSource
from kdlab.teachers.base_model import BaseModelTeacher
from kdlab.teachers.cache import CachedTeacher
from kdlab.teachers.choice import Average, ByField, TeacherChoice
from kdlab.teachers.model import ModelTeacher
from kdlab.teachers.served import Served
from kdlab.teachers.several import Several

__all__ = ["TeacherRun", "TeacherSource", "BaseModelTeacher", "CachedTeacher", "Average", "ByField", "TeacherChoice", "ModelTeacher",
           "Served", "Several"]
