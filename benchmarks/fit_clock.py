"""A Lightning callback that times a real fit by part, for ``benchmarks/estimate_check.py``: each optimiser step
(``on_train_batch_start`` to ``on_train_batch_end``), each validation, and each evaluating callback's work
(its ``on_fit_start``, ``measure`` and ``on_train_end``, wrapped when the fit sets up; a hook called from another
of the same callback, as ``on_train_end`` calls ``measure``, counted once); and every decode kdlab's
decoder makes (:class:`~kdlab.rollouts.decoding.IncrementalLM` or :class:`~kdlab.rollouts.static_cache.StaticCacheLM`: the model's config, rows, prompt length and
forwards), each under the part it belongs to. Appended to a fit with
``--trainer.callbacks+={"class_path": "fit_clock.Clock"}`` (``benchmarks/`` on the path); its records are
:data:`RECORDS`, one per fit."""

from __future__ import annotations

import functools
import time
from typing import Any

import lightning.pytorch as pl

RECORDS: list[dict[str, Any]] = []
WRAPPED = ("on_fit_start", "measure", "on_train_end")


class Clock(pl.Callback):
    def __init__(self) -> None:
        self.record: dict[str, Any] = {"steps": [], "parts": {}, "decodes": []}
        self.label = "train"
        self._start = 0.0
        self._restore: list[tuple[Any, str, Any]] = []

    # ---- decodes ------------------------------------------------------------------------------
    def _patch_decoder(self) -> None:
        from kdlab.rollouts import decoding, static_cache

        for cls in (decoding.IncrementalLM, static_cache.StaticCacheLM):  # whichever incremental_decoder picks
            self._patch(cls)

    def _patch(self, cls: Any) -> None:
        clock = self
        init, call = cls.__init__, cls.__call__

        def traced_init(decoder, model, input_ids, attention_mask, *args, **kwargs):
            start = time.perf_counter()
            init(decoder, model, input_ids, attention_mask, *args, **kwargs)
            decoder._clock = {"part": clock.label, "config": model.config, "dtype": str(next(model.parameters()).dtype).split(".")[-1],
                              "rows": int(input_ids.shape[0]), "prompt": int(input_ids.shape[1]), "forwards": 0,
                              "sampled": decoder.temperature > 0,
                              "start": start, "seconds": time.perf_counter() - start}
            clock.record["decodes"].append(decoder._clock)

        def traced_call(decoder, previous):
            decoder._clock["forwards"] += 1
            try:
                return call(decoder, previous)
            finally:  # from the decoder's construction to its last forward: prefill, token steps and the sampling between
                decoder._clock["seconds"] = time.perf_counter() - decoder._clock["start"]

        cls.__init__, cls.__call__ = traced_init, traced_call
        self._restore += [(cls, "__init__", init), (cls, "__call__", call)]

    # ---- parts --------------------------------------------------------------------------------
    def _timed(self, label: str, method: Any) -> Any:
        @functools.wraps(method)
        def run(*args, **kwargs):
            if self.label == label:  # a wrapped hook inside another of the same callback (on_train_end -> measure): timed once
                return method(*args, **kwargs)
            outer, self.label = self.label, label
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.record["parts"][label] = self.record["parts"].get(label, 0.0) + time.perf_counter() - start
                self.label = outer
        return run

    def setup(self, trainer, pl_module, stage: str) -> None:
        from kdlab.callbacks.periodic import PeriodicCallback

        self._patch_decoder()
        seen: dict[str, int] = {}
        for callback in trainer.callbacks:
            if isinstance(callback, PeriodicCallback) and hasattr(callback, "sample"):
                name = type(callback).__name__
                seen[name] = seen.get(name, 0) + 1
                label = f"{name} {seen[name]}"
                for hook in WRAPPED:
                    original = getattr(callback, hook)
                    setattr(callback, hook, self._timed(label, original))
                    self._restore.append((callback, hook, None))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.record["steps"].append(time.perf_counter() - self._start)

    def on_validation_start(self, trainer, pl_module) -> None:
        self.label, self._start_val = "validation", time.perf_counter()

    def on_validation_end(self, trainer, pl_module) -> None:
        self.record["parts"]["validation"] = self.record["parts"].get("validation", 0.0) + time.perf_counter() - self._start_val
        self.label = "train"

    def teardown(self, trainer, pl_module, stage: str) -> None:
        for owner, name, original in reversed(self._restore):
            if original is None:
                delattr(owner, name)  # the instance attribute: the class's method shows again
            else:
                setattr(owner, name, original)
        self._restore = []
        RECORDS.append(self.record)
