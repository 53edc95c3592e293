"""The data order of a stage: for training, a permutation of the ``train`` split drawn from (seed, epoch),
sharded across ranks like ``DistributedSampler``, and resumable mid-epoch (the loader's position is in
every checkpoint); for evaluation (``val``/``test``), the split in order, shared out so that each example
is counted once across ranks (:func:`evaluation_loader`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch.utils.data import DataLoader, Dataset, DistributedSampler


class EpochShuffle(DistributedSampler):
    """This rank's share of a random order of ``size`` indices drawn from (seed, epoch): PyTorch's
    ``DistributedSampler`` (shuffled, padded by repeating the order's head to a multiple of
    ``num_replicas``, rank r taking positions r, r + W, r + 2W, ...), plus a mid-epoch skip.

    The order depends on (seed, epoch) only, so a resumed run shuffles each epoch as an uninterrupted
    run would, whatever the process layout. ``skip`` drops this rank's first indices of the next pass
    only: a run resumed in the middle of an epoch continues after its last trained batch, on one process
    or several (resume with the same number of processes and batch size: the skip counts batches per
    rank). Being a ``DistributedSampler``, Lightning does not wrap it.
    """

    def __init__(self, size: int, seed: int, num_replicas: int = 1, rank: int = 0) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"EpochShuffle: rank {rank} is not in [0, {num_replicas})")
        # DistributedSampler seeds each epoch's permutation with seed + epoch: spread the seeds apart
        super().__init__(range(size), num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed * 1_000_003)
        self.size, self.skip = size, 0

    def __iter__(self):
        mine = list(super().__iter__())
        skip, self.skip = self.skip, 0
        return iter(mine[skip:])


def data_parallel_layout(trainer: Any) -> dict[str, int]:
    """``{"num_replicas", "rank"}`` of this process among the data-parallel replicas of ``trainer``'s strategy (one
    replica without a trainer). Under tensor parallelism the ranks of one TP group are one replica: they read the
    same data."""
    layout = (getattr(trainer.strategy, "distributed_sampler_kwargs", None) if trainer is not None else None) or {}
    return {"num_replicas": int(layout.get("num_replicas", 1)), "rank": int(layout.get("rank", 0))}


def resumable_loader(items: Sequence[Any], batch_size: int, seed: int, layout: dict[str, int], resume: dict[str, Any] | None = None,
                     decode_group: int = 1) -> ResumableLoader:
    """A stage's training loader over ``items``: this rank's share (``layout``, :func:`data_parallel_layout`) of the
    (seed, epoch) order (:class:`EpochShuffle`, ``loader.sampler``), ``batch_size`` items per micro-batch, grouped
    ``decode_group`` micro-batches at a time. ``resume``, a checkpoint's ``kdlab_data_position``, continues its epoch
    after its last trained micro-batch (refused if saved with another batch size or process count:
    :func:`check_data_position`)."""
    sampler = EpochShuffle(len(items), seed, layout["num_replicas"], layout["rank"])
    if resume is not None:
        check_data_position(resume, batch_size, layout["num_replicas"])
        sampler.set_epoch(resume["epoch"])
        sampler.skip = resume["batches_done"] * batch_size
    loader = ResumableLoader(items, batch_size=batch_size, sampler=sampler, collate_fn=list)
    loader.decode_group = decode_group
    loader.resumed_batches = resume["batches_done"] if resume is not None else 0
    return loader


class EvalShard(DistributedSampler):
    """This rank's share of ``size`` evaluation examples, in order: positions r, r + W, r + 2W, ... (W =
    ``num_replicas``) of ``0 .. total_size - 1``, where ``total_size`` is ``size`` rounded up to a multiple of W, as
    ``DistributedSampler`` (unshuffled) pads. Every rank thus takes ``ceil(size / W)`` positions and as many
    batches (a sharded model's forwards, and DDP's, are collectives: a rank with one batch fewer would leave the
    others waiting). A position ``p >= size`` is padding: it stands for example ``p % size`` (the order's head,
    repeated, as ``DistributedSampler`` repeats it) and :class:`EvalExamples` marks it not counted, so every
    example is counted exactly once over all ranks. Being a ``DistributedSampler``, Lightning does not wrap it
    (its own would repeat the head with nothing to tell the repeats apart)."""

    def __init__(self, size: int, num_replicas: int = 1, rank: int = 0) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"EvalShard: rank {rank} is not in [0, {num_replicas})")
        super().__init__(range(size), num_replicas=num_replicas, rank=rank, shuffle=False)

    def __iter__(self):
        return iter(range(self.rank, self.total_size, self.num_replicas))


class EvalExamples(Dataset):
    """The examples of an evaluation, read at :class:`EvalShard` positions: position ``p`` gives
    ``(examples[p % len(examples)], p < len(examples))``, the example and whether it is counted (not padding)."""

    def __init__(self, examples: Sequence[Any]) -> None:
        self.examples = list(examples)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, position: int) -> tuple[Any, bool]:
        return self.examples[position % len(self.examples)], position < len(self.examples)


class EvalBatch(list):
    """One evaluation batch: its examples (a list, as Lightning passes it to ``validation_step``) and ``counted``,
    one bool per example, False for a padding repeat (:class:`EvalShard`) whose results are dropped."""

    counted: list[bool]

    @classmethod
    def collate(cls, items: list[tuple[Any, bool]]) -> EvalBatch:
        batch = cls(example for example, _ in items)
        batch.counted = [counted for _, counted in items]
        return batch


def evaluation_loader(examples: Sequence[Any], batch_size: int, layout: dict[str, int]) -> DataLoader:
    """The loader of an evaluation over ``examples`` (in order): this rank's share (``layout``,
    :func:`data_parallel_layout`; :class:`EvalShard`), ``batch_size`` examples per :class:`EvalBatch`. Over all ranks
    each example is counted once; a rank's last batch may end with one padding repeat (decoded, not counted)."""
    sampler = EvalShard(len(examples), layout["num_replicas"], layout["rank"])
    return DataLoader(EvalExamples(examples), batch_size=batch_size, sampler=sampler, collate_fn=EvalBatch.collate)


def check_data_position(position: dict[str, Any], batch_size: int, num_replicas: int) -> None:
    """Refuse to resume mid-epoch from a data position (``kdlab_data_position`` of a checkpoint) saved with
    another batch size or process count: :class:`EpochShuffle`'s skip counts this rank's batches, so the run
    would skip or repeat examples. Positions saved before these were recorded are taken as they are."""
    from kdlab.errors import ConfigError

    saved = {"batch_size": position.get("batch_size", batch_size), "processes": position.get("num_replicas", num_replicas)}
    now = {"batch_size": batch_size, "processes": num_replicas}
    if position.get("batches_done", 0) and saved != now:
        changed = ", ".join(f"{name} {saved[name]} -> {now[name]}" for name in saved if saved[name] != now[name])
        raise ConfigError(f"the checkpoint was saved {position['batches_done']} batches into epoch {position.get('epoch')} with other "
                          f"data settings ({changed}): resuming would skip or repeat training examples; resume with the run's "
                          f"batch_size and number of processes")


def data_position(trainer: Any, checkpoint: dict[str, Any], batch_size: int, num_replicas: int, whole_steps: bool = True) -> dict[str, Any]:
    """``kdlab_data_position`` of a checkpoint Lightning is writing during fit: the epoch and the micro-batches of it
    already trained, so a resumed fit continues with the next one (the settings they were counted with too:
    :func:`check_data_position`). With ``whole_steps`` (automatic optimisation), a checkpoint saved inside an
    optimiser step (a preemption) holds no accumulated gradient, so the position is the step's first
    micro-batch and Lightning's counters are rewound to it (:func:`rewind_batch_progress`): the resumed fit
    replays the whole step (weights and optimiser are unchanged within it)."""
    done, epoch = trainer.fit_loop.epoch_loop.batch_progress.current.processed, trainer.current_epoch
    if done >= trainer.num_training_batches:  # saved at the epoch's last batch: next is a new epoch
        epoch, done = epoch + 1, 0
    partial = done % trainer.accumulate_grad_batches if whole_steps else 0
    if partial:
        done -= partial
        rewind_batch_progress(checkpoint, done)
    else:
        drop_unfinished_batch(checkpoint)
    return {"epoch": epoch, "batches_done": done, "batch_size": batch_size, "num_replicas": num_replicas}


def drop_unfinished_batch(checkpoint: dict[str, Any]) -> None:
    """In a Lightning ``checkpoint`` saved while a micro-batch was drawn but not trained (an interruption inside the
    training step), count that batch as not drawn in the whole run's counters too. On restart Lightning does so for
    the epoch's counters only (``reset_on_restart`` of ``current``), so the run-wide count, which places validation
    when ``check_val_every_n_epoch`` is ``null`` (``val_check_interval`` counted over the run), stayed one ahead:
    validation ran one micro-batch early, or not at all."""
    progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.batch_progress")
    if progress is None:
        return
    total = progress["total"]
    if total["processed"] == total["completed"]:  # not a save after the batch trained (on_train_batch_end)
        total["ready"] = total["started"] = total["completed"]


def rewind_batch_progress(checkpoint: dict[str, Any], position: int) -> None:
    """Set the training loop's batch counters in a Lightning ``checkpoint`` to ``position`` micro-batches into the
    current epoch (a fit stopped inside an accumulation window: ``position`` is the window's start), so a fit
    resumed from it starts there: Lightning restarts at the epoch's ``completed`` count and steps the optimiser
    when its ``ready`` count reaches a multiple of ``accumulate_grad_batches``. The whole run's counts move by
    as much."""
    progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.batch_progress")
    if progress is None:
        return
    back = progress["current"]["completed"] - position
    for scope, value in (("current", position), ("total", progress["total"]["completed"] - back)):
        for name in ("ready", "started", "processed", "completed"):
            progress[scope][name] = value
    progress["is_last_batch"] = False


class DecodeGroup:
    """Consecutive micro-batches whose prompts are decoded together (one batched decode for all of them):
    their examples, and once the first of them is trained, each one's rollout (see
    :meth:`kdlab.stages.distill.DistillModule.micro_batch_rollout`).

    ``following`` is the epoch's next group (``None`` after its last), drawn from the loader when first asked
    for (at the latest once this group's micro-batches are all yielded), so work that does not wait for this
    group's training (a served teacher's scores of teacher-written completions, completions written ahead by an
    engine outside the training process) can start early, as many groups ahead as it walks."""

    def __init__(self, batches: list[list[Any]], draw: Callable[[], DecodeGroup | None] | None = None) -> None:
        self.batches = batches
        self.rollouts: list[Any] | None = None
        self._draw, self._following = draw, None

    @property
    def following(self) -> DecodeGroup | None:
        if self._draw is not None:
            self._following, self._draw = self._draw(), None
        return self._following

    @following.setter
    def following(self, group: DecodeGroup | None) -> None:
        self._following, self._draw = group, None

    @property
    def examples(self) -> list[Any]:
        return [example for batch in self.batches for example in batch]


class MicroBatch(list):
    """One micro-batch of examples (a list, as Lightning passes it to ``training_step``) that knows its
    :class:`DecodeGroup` and its ``index`` there."""

    group: DecodeGroup
    index: int


class ResumableLoader(DataLoader):
    """The training DataLoader. It resumes mid-epoch through its :class:`EpochShuffle` sampler (the data
    position is in the checkpoint, see :meth:`~kdlab.stages.checkpointing.CheckpointedStage.on_save_checkpoint`); ``state_dict`` and
    ``load_state_dict`` tell Lightning so, which otherwise warns that a mid-epoch resume is unreliable.

    It yields :class:`MicroBatch` lists, the same micro-batches in the same order whatever the grouping,
    grouped ``decode_group`` at a time (set after construction; 1 by default). Groups start at every
    multiple of ``decode_group`` micro-batches from the epoch's start, so they line up with Lightning's
    accumulation groups when ``decode_group`` divides ``accumulate_grad_batches``; a run resumed
    ``batches_done`` micro-batches into an epoch (``resumed_batches``) first completes its group. It draws
    groups ahead as they are asked for (:attr:`DecodeGroup.following`)."""

    decode_group = 1
    resumed_batches = 0

    def __iter__(self):
        batches = super().__iter__()
        first = (-self.resumed_batches) % self.decode_group or self.decode_group
        self.resumed_batches = 0  # the next epoch starts at its beginning

        def draw(size: int) -> DecodeGroup | None:
            chunk = [batch for _, batch in zip(range(size), batches)]
            return DecodeGroup(chunk, lambda: draw(self.decode_group)) if chunk else None

        group = draw(first)
        while group is not None:
            for index, batch in enumerate(group.batches):
                item = MicroBatch(batch)
                item.group, item.index = group, index
                yield item
            group = group.following

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass
