"""Distillation across tokenizers (kdlab.objectives.aligned, DistillModule(cross_tokenizer=...), issue #27)."""

from __future__ import annotations

import json
import math
from functools import lru_cache

import lightning.pytorch as pl
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kdlab.errors import ConfigError
from kdlab.objectives.aligned import CrossTokenizer, VocabularyMap
from kdlab.objectives.lazy import HeadLogits
from kdlab.objectives.kl import ForwardKL, GeneralizedJSD, ReverseKL, SampledForwardKL, TotalVariation
from kdlab.rollouts.policies import (
    CachedTeacherRollouts,
    RolloutContext,
    StudentRollouts,
    TeacherDatasetRollouts,
    TeacherRollouts,
    TeacherTokens,
)
from kdlab.rollouts.mixture import MixtureRollouts
from kdlab.tasks import Addition

STUDENT = "kdlab://tiny/student"  # the tiny world's tokenizer (digits split one by one)
OTHER = "kdlab://tiny-random/teacher"  # a byte-level BPE trained on another corpus: a different vocabulary


@lru_cache(maxsize=None)
def tokenizer(path: str):
    from kdlab.models.loading import ModelSpec, load_tokenizer

    return load_tokenizer(ModelSpec(path))


def bound(teacher_path: str, student_path: str, uld_weight: float = 0.0) -> CrossTokenizer:
    teacher, student = tokenizer(teacher_path), tokenizer(student_path)
    cross = CrossTokenizer(uld_weight)
    cross.bind(teacher, student, len(teacher), len(student))
    return cross


def encode_rows(tok, texts, end=True):
    from kdlab.data import right_pad

    rows = [tok(text, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if end else []) for text in texts]
    return right_pad(rows, tok.pad_token_id)


TEXTS = ["Using 3, 7, 25: 25 - 7 = 18, 18 * 3 = 54", "<answer>54</answer> done", "x"]


# ---- the objective --------------------------------------------------------------------------
@pytest.mark.parametrize("objective", [ForwardKL(), ReverseKL(), GeneralizedJSD(0.3), TotalVariation(), ForwardKL(reduction="token", chunk_size=3)],
                         ids=["forward", "reverse", "jsd", "tv", "forward-token-chunk3"])
def test_identical_tokenizers_give_the_vocabulary_objective_loss_and_gradient(objective):
    tok = tokenizer(STUDENT)
    cross = bound(STUDENT, STUDENT)
    assert cross.vocabulary.size == len(tok)
    ids, mask = encode_rows(tok, TEXTS)
    torch.manual_seed(0)
    student = torch.randn(*ids.shape, len(tok), dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(*ids.shape, len(tok), dtype=torch.float64)
    weights = torch.tensor([0.5, 1.5, 1.0], dtype=torch.float64)
    groups = cross.groups(ids, mask, ids, mask)
    assert groups.one_to_one_share == 1.0 and len(groups) == int(mask.sum())
    loss, diagnostics = cross.loss(objective, student, teacher, groups, ids, ids, mask, weights)
    (grad,) = torch.autograd.grad(loss, student)
    expected = objective(student, teacher, mask, weights)
    (expected_grad,) = torch.autograd.grad(expected, student)
    expected_diagnostics = objective.take_diagnostics()
    assert abs(loss.item() - expected.item()) < 1e-6
    assert (grad - expected_grad).abs().max().item() < 1e-6
    for name, value in expected_diagnostics.items():
        assert abs(diagnostics[name].item() - value.item()) < 1e-6, name
    assert diagnostics["teacher_unmapped_mass"].item() == 0.0


def test_a_per_token_statistic_an_objective_records_covers_every_aligned_chunk():
    """record_tokens inside token_loss reduces over all the chunks of the aligned pass, as over the vocabulary
    objective's chunks (with identical tokenizers the two see the same rows)."""
    class Recording(ForwardKL):
        def token_loss(self, student_logits, teacher_logits):
            self.record_tokens("student_peak", student_logits.softmax(-1).amax(-1), reduce="mean")
            self.record_tokens("rows", torch.ones(student_logits.shape[0]), reduce="sum")
            return super().token_loss(student_logits, teacher_logits)

    tok = tokenizer(STUDENT)
    cross = bound(STUDENT, STUDENT)
    ids, mask = encode_rows(tok, TEXTS)
    torch.manual_seed(0)
    student, teacher = torch.randn(*ids.shape, len(tok), dtype=torch.float64), torch.randn(*ids.shape, len(tok), dtype=torch.float64)
    objective = Recording(chunk_size=3)
    cross.loss(objective, student, teacher, cross.groups(ids, mask, ids, mask), ids, ids, mask)
    aligned = objective.pop_records()
    objective(student, teacher, mask)
    plain = objective.pop_records()
    assert aligned["rows"] == plain["rows"] == int(mask.sum()) > 3  # several chunks
    torch.testing.assert_close(aligned["student_peak"], plain["student_peak"])


def test_identical_tokenizers_on_the_fused_head_match_the_vocabulary_objective():
    tok = tokenizer(STUDENT)
    cross = bound(STUDENT, STUDENT)
    ids, mask = encode_rows(tok, TEXTS)
    torch.manual_seed(1)
    hidden = torch.randn(*ids.shape, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(len(tok), 16, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(*ids.shape, len(tok), dtype=torch.float64)
    objective = ReverseKL()
    loss, _ = cross.loss(objective, HeadLogits(hidden, weight, 0.5), teacher, cross.groups(ids, mask, ids, mask), ids, ids, mask)
    grads = torch.autograd.grad(loss, (hidden, weight))
    expected = objective(HeadLogits(hidden, weight, 0.5), teacher, mask)
    expected_grads = torch.autograd.grad(expected, (hidden, weight))
    assert abs(loss.item() - expected.item()) < 1e-6
    for got, want in zip(grads, expected_grads):
        assert (got - want).abs().max().item() < 1e-6


def reference_events(logprobs_start, chain, own_ids, map_own, removed):
    """The events of one group from their definition, one entry at a time (the test's own reading of the
    module docstring): the map's pairs but the removed ones, the group's text, and the rest."""
    kept = [logprobs_start[map_own[p]].exp() if p not in removed else torch.zeros((), dtype=chain.dtype) for p in range(len(map_own))]
    text = chain.exp()
    rest = 1.0 - sum(kept) - text
    return torch.stack([*kept, text, rest.clamp(min=0.0)])


def test_across_tokenizers_the_loss_and_gradient_are_those_of_the_defined_events():
    """Forward KL between the two event distributions, built entry by entry from the definition, summed
    over groups with the sequence reduction: equal to the chunked objective (loss and gradient, 1e-6)."""
    teacher_tok, student_tok = tokenizer(OTHER), tokenizer(STUDENT)
    cross = bound(OTHER, STUDENT)
    vocabulary: VocabularyMap = cross.vocabulary
    s_ids, s_mask = encode_rows(student_tok, TEXTS)
    t_ids, t_mask = encode_rows(teacher_tok, TEXTS)
    groups = cross.groups(s_ids, s_mask, t_ids, t_mask)
    assert 0.0 < groups.one_to_one_share < 1.0  # both kinds of group occur
    assert bool((groups.student_length > 1).any() or (groups.teacher_length > 1).any())
    torch.manual_seed(2)
    student = torch.randn(*s_ids.shape, len(student_tok), dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(*t_ids.shape, len(teacher_tok), dtype=torch.float64)
    objective = ForwardKL(chunk_size=4)
    loss, diagnostics = cross.loss(objective, student, teacher, groups, s_ids, t_ids, s_mask)
    (grad,) = torch.autograd.grad(loss, student)

    s_log, t_log = torch.log_softmax(student, -1), torch.log_softmax(teacher, -1)
    per_row: dict[int, list[torch.Tensor]] = {}
    for g in range(len(groups)):
        b = int(groups.row[g])
        s0, sn = int(groups.student_start[g]), int(groups.student_length[g])
        t0, tn = int(groups.teacher_start[g]), int(groups.teacher_length[g])
        removed = {int(vocabulary.student_pair[s_ids[b, s0]]), int(vocabulary.teacher_pair[t_ids[b, t0]])} - {-1}
        s_chain = sum(s_log[b, s0 + k, s_ids[b, s0 + k]] for k in range(sn))
        t_chain = sum(t_log[b, t0 + k, t_ids[b, t0 + k]] for k in range(tn))
        p_s = reference_events(s_log[b, s0], s_chain, s_ids, vocabulary.student_ids.tolist(), removed)
        p_t = reference_events(t_log[b, t0], t_chain, t_ids, vocabulary.teacher_ids.tolist(), removed)
        assert abs(p_s.sum().item() - 1.0) < 1e-9 and abs(p_t.sum().item() - 1.0) < 1e-9
        positive = p_t > 0
        per_row.setdefault(b, []).append((p_t[positive] * (p_t[positive].log() - p_s[positive].clamp(min=1e-300).log())).sum())
    expected = sum(torch.stack(values).mean() for values in per_row.values()) / len(per_row)
    (expected_grad,) = torch.autograd.grad(expected, student)
    assert abs(loss.item() - expected.item()) < 1e-6
    assert (grad - expected_grad).abs().max().item() < 1e-6
    assert abs(diagnostics["kl_forward"].item() - expected.item()) < 1e-6
    assert 0.0 < diagnostics["teacher_unmapped_mass"].item() < 1.0


def test_chunk_size_changes_neither_loss_nor_gradient_and_uld_mixes_in():
    teacher_tok, student_tok = tokenizer(OTHER), tokenizer(STUDENT)
    s_ids, s_mask = encode_rows(student_tok, TEXTS)
    t_ids, t_mask = encode_rows(teacher_tok, TEXTS)
    torch.manual_seed(3)
    student = torch.randn(*s_ids.shape, len(student_tok), dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(*t_ids.shape, len(teacher_tok), dtype=torch.float64)
    results = []
    for chunk_size, uld in ((1, 0.0), (5, 0.0), (1000, 0.0), (7, 0.25), (1000, 0.25), (3, 1.0)):
        cross = bound(OTHER, STUDENT, uld)
        loss, _ = cross.loss(ReverseKL(chunk_size=chunk_size), student, teacher, cross.groups(s_ids, s_mask, t_ids, t_mask), s_ids, t_ids, s_mask)
        results.append((uld, loss.item(), torch.autograd.grad(loss, student)[0]))
    for (uld_a, loss_a, grad_a), (uld_b, loss_b, grad_b) in zip(results, results[1:]):
        if uld_a == uld_b:
            assert abs(loss_a - loss_b) < 1e-9 and (grad_a - grad_b).abs().max().item() < 1e-9
    assert results[3][1] != results[0][1]
    # w = 1: the sorted-probability distance alone, which is 0 when both sorted vectors agree
    same = bound(STUDENT, STUDENT, 1.0)
    ids, mask = encode_rows(student_tok, TEXTS)
    logits = torch.randn(*ids.shape, len(student_tok), dtype=torch.float64)
    permuted = logits[..., torch.randperm(len(student_tok))]
    loss, _ = same.loss(ForwardKL(), permuted, logits, same.groups(ids, mask, ids, mask), ids, ids, mask)
    assert abs(loss.item()) < 1e-9


def test_sampled_objectives_run_over_the_events():
    teacher_tok, student_tok = tokenizer(OTHER), tokenizer(STUDENT)
    cross = bound(OTHER, STUDENT)
    s_ids, s_mask = encode_rows(student_tok, TEXTS)
    t_ids, t_mask = encode_rows(teacher_tok, TEXTS)
    student = torch.randn(*s_ids.shape, len(student_tok), requires_grad=True)
    teacher = torch.randn(*t_ids.shape, len(teacher_tok))
    loss, _ = cross.loss(SampledForwardKL(seed=1), student, teacher, cross.groups(s_ids, s_mask, t_ids, t_mask), s_ids, t_ids, s_mask)
    (grad,) = torch.autograd.grad(loss, student)
    assert math.isfinite(loss.item()) and bool(torch.isfinite(grad).all()) and grad.abs().sum() > 0


# ---- re-tokenising rollouts ------------------------------------------------------------------
def context(writer_cut: int = 0) -> RolloutContext:
    student_tok, teacher_tok = tokenizer(STUDENT), tokenizer(OTHER)
    return RolloutContext(
        student=None, teacher=None, tokenizer=student_tok, token_columns=len(student_tok), max_new_tokens=64,
        eos_token_ids=(student_tok.eos_token_id,), pad_token_id=student_tok.pad_token_id, student_temperature=1.0,
        teacher_temperature=1.0, generator=None,
        teacher_tokens=TeacherTokens(teacher_tok, len(teacher_tok), (teacher_tok.eos_token_id,)),
    )


TEXT = st.lists(st.sampled_from(list("0123456789 +-*/=()abcxyzé世界🎉\n<>/") + ["<answer>", "</answer>", "  "]), max_size=30).map("".join)


@settings(max_examples=60, deadline=None)
@given(texts=st.lists(TEXT, min_size=1, max_size=3), writer=st.sampled_from(["student", "teacher"]),
       ended=st.booleans(), cut=st.integers(0, 2))
def test_retokenised_rollouts_align_every_byte(texts, writer, ended, cut):
    """Whoever writes (and wherever its tokens are cut, even inside a multi-byte character), the two
    sides of a re-tokenised rollout spell the same bytes, the groups cover them all, and the end tokens
    pair up exactly when the writer ended."""
    from kdlab.data import PromptBatch, right_pad

    ctx = context()
    tok = ctx.tokenizer if writer == "student" else ctx.teacher_tokens.tokenizer
    end = (ctx.eos_token_ids if writer == "student" else ctx.teacher_tokens.eos_token_ids)[0]
    rows = []
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        ids = ids[: max(0, len(ids) - cut)] if cut else ids
        rows.append(ids + ([end] if ended else []))
    ids, mask = right_pad(rows, 0)
    empty = torch.zeros(len(rows), 1, dtype=torch.long)
    prompts = PromptBatch([{"id": str(k)} for k in range(len(rows))], empty, empty, empty, empty)
    rollout = ctx.retokenized(prompts, ids, mask, writer)
    cross = bound(OTHER, STUDENT)
    t_ids, t_mask = rollout.completion("teacher")
    groups = cross.groups(rollout.completion_ids, rollout.completion_mask, t_ids, t_mask)
    vocabulary = cross.vocabulary
    for b in range(len(rows)):
        s_tokens = rollout.completion_ids[b][rollout.completion_mask[b]].tolist()
        t_tokens = t_ids[b][t_mask[b]].tolist()
        s_bytes = b"".join(vocabulary.student_bytes[i] for i in s_tokens)
        assert s_bytes == b"".join(vocabulary.teacher_bytes[i] for i in t_tokens)
        covered = sum(sum(len(vocabulary.student_bytes[int(rollout.completion_ids[b, int(groups.student_start[g]) + k])])
                          for k in range(int(groups.student_length[g]))) for g in range(len(groups)) if int(groups.row[g]) == b)
        assert covered == len(s_bytes)
        ends_paired = [g for g in range(len(groups)) if int(groups.row[g]) == b
                       and int(rollout.completion_ids[b, int(groups.student_start[g])]) == ctx.eos_token_ids[0]
                       and int(t_ids[b, int(groups.teacher_start[g])]) == ctx.teacher_tokens.eos_token_ids[0]]
        assert len(ends_paired) == (1 if ended else 0)


# ---- DistillModule ---------------------------------------------------------------------------
def task():
    return Addition(max_digits=2, system_prompt="", num_train=16, num_val=4, num_test=0, seed=0)


def module(rollout=None, **overrides):
    from kdlab.stages.distill import DistillModule

    settings = dict(rollout=rollout, cross_tokenizer=CrossTokenizer(), batch_size=2, max_completion_tokens=12, val_examples=4,
                    val_batch_size=4, warmup_steps=1, lr=1e-3)
    settings.update(overrides)
    return DistillModule(STUDENT, overrides.pop("teacher", OTHER), task(), **{k: v for k, v in settings.items() if k != "teacher"})


def fit(m, tmp_path, steps=2, callbacks=()):
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False, num_sanity_val_steps=0,
                         limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                         callbacks=list(callbacks))
    trainer.fit(m)
    return trainer


def test_different_vocabularies_without_cross_tokenizer_name_the_setting():
    from kdlab.stages.distill import DistillModule

    with pytest.raises(ValueError, match="tokenizers differ.*cross_tokenizer"):
        DistillModule(STUDENT, OTHER, task())


def test_what_needs_one_vocabulary_and_lossy_tokenizers_are_refused_before_weights_load(monkeypatch, tmp_path):
    import kdlab.stages.distill as distill

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were read")

    monkeypatch.setattr(distill, "load_causal_lm", no_weights)
    monkeypatch.setattr("kdlab.teachers.model.load_causal_lm", no_weights)
    with pytest.raises(ConfigError, match="MixtureRollouts needs .*one vocabulary shared by student and teacher.*ModelTeacher"):
        module(MixtureRollouts(lam=0.0))
    # a tokenizer that lowercases its input cannot be aligned by bytes: the same check, named with the
    # model and the first differing character
    import copy

    from tokenizers import normalizers

    from kdlab.objectives.aligned import CrossTokenizer

    lossy = copy.deepcopy(tokenizer(OTHER))
    lossy.backend_tokenizer.normalizer = normalizers.Lowercase()
    with pytest.raises(ConfigError, match=r"DistillModule.teacher's tokenizer does not reproduce.*character 0 'A'.*in the train example 'add-train-0': 'Add the numbers"):
        CrossTokenizer().check_texts(task(), tokenizer(STUDENT), lossy)
    CrossTokenizer().check_texts(task(), tokenizer(STUDENT), tokenizer(OTHER))
    # any policy that declares it needs one vocabulary (as VLLMRollouts does) is refused by what it declares, whatever
    # its class is called
    from kdlab.rollouts.policies import RolloutPolicy

    engine = type("SomeEngine", (RolloutPolicy,), {"needs": lambda self: frozenset({"one_vocabulary"})})()
    with pytest.raises(ConfigError, match="SomeEngine needs one vocabulary shared by student and teacher"):
        module(engine)


class LateAccent(Addition):
    """Addition whose train example ``late`` (0-based) asks about ``cafe`` + a combining acute accent, which the packaged
    tokenizers' NFC normaliser turns into ``café``: text that no tokenizer here reproduces byte for byte."""

    def __init__(self, late: int, **kwargs):
        super().__init__(**kwargs)
        self.late = late

    def user_prompt(self, example):
        late = example["id"] == self.examples("train")[self.late]["id"]
        return super().user_prompt(example) + (" (cafe\u0301)" if late else "")


def test_every_example_is_checked_before_weights_load_and_the_first_failing_one_is_named(monkeypatch):
    """A task whose 13th train example (past the 8 that were probed before) has text the tokenizers do not reproduce
    is refused when the module is built, before any weights are read, naming that example; ``check_examples`` limits
    the check to the first examples of each split (then that example is not read), and must be a positive integer."""
    import kdlab.stages.distill as distill
    from kdlab.stages.distill import DistillModule

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were read")

    monkeypatch.setattr(distill, "load_causal_lm", no_weights)
    monkeypatch.setattr("kdlab.teachers.model.load_causal_lm", no_weights)
    late = LateAccent(12, max_digits=2, system_prompt="", num_train=16, num_val=4, num_test=0, seed=0)
    name = late.examples("train")[12]["id"]
    with pytest.raises(ConfigError, match=rf"DistillModule.student's tokenizer does not reproduce.*'e'.*in the train example '{name}'"):
        DistillModule(STUDENT, OTHER, late, cross_tokenizer=CrossTokenizer())
    CrossTokenizer(check_examples=12).check_texts(late, tokenizer(STUDENT), tokenizer(OTHER))
    with pytest.raises(ConfigError, match=rf"in the train example '{name}'"):
        CrossTokenizer(check_examples=13).check_texts(late, tokenizer(STUDENT), tokenizer(OTHER))
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="CrossTokenizer.check_examples must be a positive integer or None"):
            CrossTokenizer(check_examples=bad)


@pytest.mark.parametrize("rollout", ["teacher", "student", "dataset", "cached"])
def test_every_rollout_source_trains_across_tokenizers(rollout, tmp_path):
    """Off-policy online, on-policy, a teacher dataset and its top-k cache: each trains (finite loss, the
    student moves) with the teacher reading the completion in its own tokens; HeldOutKL runs across tokenizers."""
    from kdlab.callbacks import HeldOutKL

    policy = {"teacher": TeacherRollouts, "student": StudentRollouts}.get(rollout, lambda: None)()
    if rollout in ("dataset", "cached"):
        data = tmp_path / "teacher.jsonl"
        rows = [{"id": ex["id"], "completion": task().reference_completion(ex)} for ex in task().examples("train")]
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
        policy = TeacherDatasetRollouts(str(data))
        if rollout == "cached":
            from kdlab.models.loading import ModelSpec, load_causal_lm
            from kdlab.rollouts.teacher_data import build_teacher_cache

            teacher = load_causal_lm(ModelSpec(OTHER))
            build_teacher_cache(teacher, tokenizer(OTHER), task(), str(data), str(tmp_path / "cache.safetensors"), top_k=8,
                                temperature=0.5, max_new_tokens=12, max_prompt_tokens=256, batch_size=4)
    if rollout == "cached":  # the cache is the teacher: only the teacher's tokenizer is read (no HeldOutKL: it cannot score new text)
        from kdlab.teachers import CachedTeacher

        m = module(policy, teacher=CachedTeacher(str(tmp_path / "cache.safetensors"), tokenizer=OTHER))
        assert m.teacher_source.models() == {} and m._frozen == {}
    else:
        m = module(policy)
    before = [p.detach().clone() for p in m.student.parameters()]
    heldout = [HeldOutKL(examples=4, batch_size=4)] if rollout != "cached" else []
    trainer = fit(m, tmp_path, callbacks=heldout)
    metrics = trainer.callback_metrics
    assert math.isfinite(float(metrics["train/loss"]))
    assert 0.0 < float(metrics["train/one_to_one_share"]) <= 1.0
    assert any(not torch.equal(a, b) for a, b in zip(before, m.student.parameters()))
    if heldout:
        assert heldout[0].before["forward"] > 0 and math.isfinite(heldout[0].kl(m)[0])
    if rollout == "cached":  # the top-k teacher's tail, over the teacher's own completion positions
        rollout_ = m.make_rollout(task().examples("train")[:2], 0)
        teacher_logprobs, teacher_mask = m.teacher_source.completion_logprobs(rollout_), rollout_.completion("teacher")[1]
        logged = {}
        m.log = lambda name, value, **kwargs: logged.__setitem__(name, float(value))
        m.training_step(task().examples("train")[:2], 0)
        expected = (1 - teacher_logprobs.logprobs.exp().sum(-1))[teacher_mask.bool()].mean()
        assert 0 < logged["train/teacher_tail_mass"] == pytest.approx(float(expected), abs=1e-6)


def test_a_cache_across_tokenizers_never_loads_the_teachers_weights(tmp_path, monkeypatch):
    """The earlier spelling (teacher: {path} with a CachedTeacherRollouts cache and cross_tokenizer) loaded the teacher's
    weights although the cache replaces them; it now reads only the teacher's tokenizer, and trains what the new
    spelling (teacher: CachedTeacher with TeacherDatasetRollouts) trains, bit for bit."""
    from kdlab.models.loading import ModelSpec, load_causal_lm
    from kdlab.rollouts.teacher_data import build_teacher_cache
    from kdlab.teachers import CachedTeacher

    data = tmp_path / "teacher.jsonl"
    data.write_text("".join(json.dumps({"id": ex["id"], "completion": task().reference_completion(ex)}) + "\n" for ex in task().examples("train")))
    cache = str(tmp_path / "cache.safetensors")
    build_teacher_cache(load_causal_lm(ModelSpec(OTHER)), tokenizer(OTHER), task(), str(data), cache, top_k=8,
                        temperature=0.5, max_new_tokens=12, max_prompt_tokens=256, batch_size=4)
    loads = []
    import kdlab.teachers.model

    original = kdlab.teachers.model.load_causal_lm
    monkeypatch.setattr(kdlab.teachers.model, "load_causal_lm", lambda *a, **k: loads.append(a) or original(*a, **k))
    runs = []
    for old in (True, False):
        pl.seed_everything(0)
        if old:
            with pytest.warns(FutureWarning, match="CachedTeacherRollouts is deprecated: use DistillModule.teacher: .*CachedTeacher"):
                m = module(CachedTeacherRollouts(str(data), cache))
        else:
            m = module(TeacherDatasetRollouts(str(data)), teacher=CachedTeacher(cache, tokenizer=OTHER))
        trainer = fit(m, tmp_path, steps=2)
        runs.append((float(trainer.callback_metrics["train/loss"]), [p.detach().clone() for p in m.student.parameters()]))
    assert loads == []
    assert runs[0][0] == runs[1][0] and all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


def test_identical_tokenizers_through_cross_tokenizer_train_like_the_plain_module(tmp_path):
    from kdlab.stages.distill import DistillModule

    runs = []
    for cross in (None, CrossTokenizer()):
        pl.seed_everything(0)
        m = DistillModule(STUDENT, "kdlab://tiny/teacher", task(), cross_tokenizer=cross, batch_size=2, max_completion_tokens=12,
                          val_examples=4, val_batch_size=4, warmup_steps=1, lr=1e-3)
        trainer = fit(m, tmp_path, steps=3)
        runs.append((float(trainer.callback_metrics["train/loss"]), [p.detach().clone() for p in m.student.parameters()]))
    (loss_a, weights_a), (loss_b, weights_b) = runs
    assert abs(loss_a - loss_b) < 1e-5
    # fp32 rounding of the two paths (1e-7 of a gradient) passes through Adam's normalisation: 1e-4 is a
    # tenth of one step's move at lr 1e-3; a different loss moves the weights by ~3e-3 in three steps
    assert max((a - b).abs().max().item() for a, b in zip(weights_a, weights_b)) < 1e-4


def test_rollout_sensitivity_is_refused_across_tokenizers_and_callbacks_sample_the_teacher_in_its_own_columns(tmp_path):
    from kdlab.callbacks import Coverage, RolloutSensitivity

    m = module(TeacherRollouts())
    with pytest.raises(ConfigError, match="RolloutSensitivity.*cross_tokenizer.*HeldOutKL"):
        RolloutSensitivity().setup(None, m, "fit")
    coverage = Coverage(task(), ks=(1,), samples=1, examples=4, batch_size=4, max_new_tokens=8)
    texts = coverage.sample(m, m.task, m.task.examples("val"), role="teacher")
    assert len(texts) == 4 and m.teacher_columns != m.token_columns


def test_the_docs_page_shows_what_its_script_computes_from_the_packaged_models_and_the_reports():
    """docs/cross_tokenizer.md's worked example and results table are exactly what
    scripts/cross_tokenizer_example.py computes (nothing typed by hand)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parents[1]
    result = subprocess.run([sys.executable, "scripts/cross_tokenizer_example.py", "--check"], cwd=root, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


@pytest.mark.parametrize("objective", [ForwardKL(), ReverseKL()], ids=["forward", "reverse"])
def test_a_student_vocabulary_inside_the_teachers_conditions_the_teacher_on_what_the_student_can_write(objective):
    """The student's tokens are the teacher's first V_S (same ids, fewer columns): every group is one token,
    the student has no rest, and the teacher's mass on its last tokens is on tokens the student cannot write as one token. The
    loss is then the vocabulary objective against the teacher renormalised over the student's columns:
    finite (not ~1e4 x that mass), loss and gradient to 1e-6."""
    tok = tokenizer(STUDENT)
    v_t = len(tok)
    v_s = v_t - 8
    cross = CrossTokenizer()
    cross.bind(tok, tok, v_t, v_s)
    ids, mask = encode_rows(tok, [TEXTS[0], "x + 1 = 2"])  # (the tags are the last ids: kept out)
    assert int(ids[mask].max()) < v_s
    torch.manual_seed(4)
    student = torch.randn(*ids.shape, v_s, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(*ids.shape, v_t, dtype=torch.float64)
    loss, diagnostics = cross.loss(objective, student, teacher, cross.groups(ids, mask, ids, mask), ids, ids, mask)
    (grad,) = torch.autograd.grad(loss, student)
    expected = objective(student, teacher[..., :v_s], mask)
    (expected_grad,) = torch.autograd.grad(expected, student)
    assert abs(loss.item() - expected.item()) < 1e-6 and (grad - expected_grad).abs().max().item() < 1e-6
    tail = torch.softmax(teacher, -1)[..., v_s:].sum(-1)
    dropped = torch.stack([tail[b][mask[b]].mean() for b in range(len(ids))]).mean()  # the sequence reduction
    assert abs(diagnostics["teacher_unmapped_mass"].item() - dropped.item()) < 1e-6 and dropped.item() > 0.01


def test_a_student_pad_id_past_the_teachers_rows_pads_the_teachers_prompts_with_the_teachers_own(tmp_path):
    """A Qwen student (pad id 151,643) beside a smaller-vocabulary teacher: the student's pad id is no row of the
    teacher's embedding. The teacher's prompts are left-padded with the teacher's pad id, so a batch of prompts of
    unequal length trains (with the student's id the teacher's embedding lookup failed: index out of range)."""
    import shutil

    from transformers import AutoTokenizer

    from kdlab.models.loading import resolve_path

    student = tmp_path / "student"
    shutil.copytree(resolve_path("kdlab://tiny/teacher-xtok"), student)
    tokenizer = AutoTokenizer.from_pretrained(student)
    tokenizer.add_special_tokens({"pad_token": "<|pad|>"})
    tokenizer.save_pretrained(student)
    from kdlab.stages.distill import DistillModule

    m = DistillModule(str(student), "kdlab://tiny/student", task(), cross_tokenizer=CrossTokenizer(), batch_size=4, max_completion_tokens=6,
                val_examples=4, val_batch_size=4)
    teacher_rows = m.teacher.get_input_embeddings().weight.shape[0]
    assert m.pad_id >= teacher_rows and m.pad_id < m.student.get_input_embeddings().weight.shape[0]
    examples = m.task.examples("train")[:4]
    prompts = m._prompts(examples)
    assert len(set(prompts.teacher_mask.sum(1).tolist())) > 1, "prompts of unequal length, so some are padded"
    padding = prompts.teacher_ids[prompts.teacher_mask == 0]
    assert padding.numel() and set(padding.tolist()) == {int(m.teacher_tokenizer.pad_token_id)}
    assert set(prompts.student_ids[prompts.student_mask == 0].tolist()) <= {m.pad_id}
    loss = m.training_step(examples, 0)
    assert torch.isfinite(loss)


# ---- end tokens --------------------------------------------------------------------------------
XTOK = "kdlab://tiny/teacher-xtok"


def gemma_like_tokenizer(folder):
    """The packaged cross-tokenizer teacher's tokenizer with Gemma's end tokens: EOS ``<eos>`` (id 0) and a turn
    that ends with ``<end_of_turn>`` (id 2, an end id through the generation config, not the tokenizer's EOS)."""
    from transformers import AutoTokenizer

    tokenizer(XTOK).save_pretrained(folder)
    names = {"<|endoftext|>": "<eos>", "<|im_end|>": "<end_of_turn>"}
    for name in ("tokenizer.json", "tokenizer_config.json"):
        path = folder / name
        text = path.read_text()
        for old, new in names.items():
            text = text.replace(old, new)
        path.write_text(text)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(eos_token="<eos>", pad_token="<eos>")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return AutoTokenizer.from_pretrained(folder)


def gemma_like_stop(teacher_tok, text: str, cross: CrossTokenizer):
    """``cross`` bound to the Gemma-like teacher (end ids ``<eos>``, ``<end_of_turn>``) and the packaged student
    (``<|im_end|>``), and the groups of a rollout where the teacher writes ``text`` and stops with ``<end_of_turn>``:
    ``(cross, rollout, groups, teacher completion ids)``."""
    from kdlab.data import right_pad

    student_tok = tokenizer(STUDENT)
    eos, end_of_turn = teacher_tok.eos_token_id, teacher_tok.convert_tokens_to_ids("<end_of_turn>")
    assert (eos, end_of_turn) == (0, 2)
    cross.bind(teacher_tok, student_tok, len(teacher_tok), len(student_tok), (eos, end_of_turn), (student_tok.eos_token_id,))
    ctx = RolloutContext(student=None, teacher=None, tokenizer=student_tok, token_columns=len(student_tok), max_new_tokens=64,
                         eos_token_ids=(student_tok.eos_token_id,), pad_token_id=student_tok.pad_token_id, student_temperature=1.0,
                         teacher_temperature=1.0, generator=None, teacher_tokens=TeacherTokens(teacher_tok, len(teacher_tok), (eos, end_of_turn)))
    ids, mask = right_pad([teacher_tok(text, add_special_tokens=False)["input_ids"] + [end_of_turn]], eos)
    rollout = ctx.retokenized(None, ids, mask, "teacher")
    teacher_ids, teacher_mask = rollout.completion("teacher")
    return cross, rollout, cross.groups(rollout.completion_ids, rollout.completion_mask, teacher_ids, teacher_mask), teacher_ids


def test_every_end_token_of_either_side_is_one_shared_end_event(tmp_path):
    """A Gemma-like teacher (EOS ``<eos>``, turns end with ``<end_of_turn>``) and a ChatML student (``<|im_end|>``):
    the teacher writes '5 4' and stops with ``<end_of_turn>``. A student whose p(stop) equals the teacher's p(any end
    token) at every position (summed over ``<eos>`` and ``<end_of_turn>``) gets zero loss: the end event pairs every
    end id of each side (before: the student's stop was compared with p(<eos>) ~ 0 and the loss was ~11 per group)."""
    student_tok, teacher_tok = tokenizer(STUDENT), gemma_like_tokenizer(tmp_path)
    eos, end_of_turn = teacher_tok.eos_token_id, teacher_tok.convert_tokens_to_ids("<end_of_turn>")
    cross, rollout, groups, teacher_ids = gemma_like_stop(teacher_tok, "5 4", CrossTokenizer())
    five_t, five_s = teacher_tok.convert_tokens_to_ids("5"), student_tok.convert_tokens_to_ids("5")
    for split in (1.0, 0.5):  # the teacher's stop all on <end_of_turn>, then half on each end token
        teacher = torch.full((*teacher_ids.shape, len(teacher_tok)), -30.0, dtype=torch.float64)
        teacher[..., five_t] = math.log(0.5)
        teacher[..., end_of_turn] = math.log(0.5 * split)
        teacher[..., eos] = math.log(0.5 * (1 - split)) if split < 1 else -30.0
        student = torch.full((*rollout.completion_ids.shape, len(student_tok)), -30.0, dtype=torch.float64)
        student[..., five_s] = student[..., student_tok.eos_token_id] = math.log(0.5)
        student.requires_grad_(True)
        loss, _ = cross.loss(ForwardKL(reduction="token"), student, teacher, groups, rollout.completion_ids, teacher_ids,
                             rollout.completion_mask)
        (grad,) = torch.autograd.grad(loss, student)
        assert len(groups) == 4 and loss.item() < 1e-6, (split, loss.item())
        assert grad[..., student_tok.eos_token_id].abs().max().item() < 1e-6


def test_uld_counts_each_sides_end_ids_as_one_entry_the_sum_of_their_probabilities(tmp_path):
    """docs/cross_tokenizer.md, "ULD and the end tokens", by hand. The Gemma-like teacher writes '5' and stops with
    ``<end_of_turn>`` (two groups: '5', then the two end tokens); at every position it puts 0.5 on '5' and 0.25 on
    each of ``<eos>`` and ``<end_of_turn>``, the student 0.6 on '5' and 0.4 on ``<|im_end|>`` (every other token
    probability 0). Merged, the teacher's sorted vector is (0.5, 0.5, 0, ...), so ULD is |0.6 - 0.5| + |0.4 - 0.5| =
    0.2 at each group start, where the three unmerged teacher entries (0.5, 0.25, 0.25) would give 0.1 + 0.15 + 0.25
    = 0.5. The hybrid mixes it with the forward KL on the events (0.5 and 0.5 against 0.6 and 0.4 in both groups)."""
    from kdlab.objectives.aligned import sorted_probability_distance

    student_tok, teacher_tok = tokenizer(STUDENT), gemma_like_tokenizer(tmp_path)
    eos, end_of_turn = teacher_tok.eos_token_id, teacher_tok.convert_tokens_to_ids("<end_of_turn>")
    five_t, five_s = teacher_tok.convert_tokens_to_ids("5"), student_tok.convert_tokens_to_ids("5")
    kl = 0.5 * math.log(0.5 / 0.6) + 0.5 * math.log(0.5 / 0.4)
    for uld_weight, expected in ((1.0, 0.2), (0.5, 0.5 * kl + 0.5 * 0.2)):
        cross, rollout, groups, teacher_ids = gemma_like_stop(teacher_tok, "5", CrossTokenizer(uld_weight))
        assert len(groups) == 2 and groups.teacher_length.tolist() == [1, 1]
        teacher = torch.full((*teacher_ids.shape, len(teacher_tok)), -1000.0, dtype=torch.float64)  # exp: exactly 0
        teacher[..., five_t] = math.log(0.5)
        teacher[..., eos] = teacher[..., end_of_turn] = math.log(0.25)
        student = torch.full((*rollout.completion_ids.shape, len(student_tok)), -1000.0, dtype=torch.float64)
        student[..., five_s], student[..., student_tok.eos_token_id] = math.log(0.6), math.log(0.4)
        for reduction in ("token", "sequence"):  # one row of two groups: the mean over groups either way
            loss, _ = cross.loss(ForwardKL(reduction=reduction), student, teacher, groups, rollout.completion_ids, teacher_ids,
                                 rollout.completion_mask)
            assert abs(loss.item() - expected) < 1e-9, (uld_weight, reduction, loss.item(), expected)
    unmerged = sorted_probability_distance(torch.log_softmax(student[0, :1], -1), torch.log_softmax(teacher[0, :1], -1))
    assert abs(unmerged.item() - 0.5) < 1e-9


# ---- text that a training step meets ------------------------------------------------------------
def byte_tokens(tok, text):
    """``text`` written one byte token at a time (as sampling may write it), not as the tokenizer encodes it."""
    from kdlab.alignment import _byte_decoder

    by_byte = {byte: char for char, byte in _byte_decoder().items()}
    return [tok.convert_tokens_to_ids(by_byte[byte]) for byte in text.encode("utf-8")]


def student_written(text_ids):
    from kdlab.data import right_pad

    student_tok = tokenizer(STUDENT)
    ids, mask = right_pad([row + [student_tok.eos_token_id] for row in text_ids], student_tok.pad_token_id)
    rollout = context().retokenized(None, ids, mask, "student")
    return rollout, *rollout.completion("teacher")


def test_a_special_tokens_name_written_as_text_is_read_as_text():
    """The student writes 'x <|im_end|> y' in ordinary byte tokens: the teacher reads those bytes as text
    (``split_special_tokens``), not as its special token, and every byte is aligned (before: the teacher read its
    ``<|im_end|>``, which covers no bytes, and the step raised 'spell different bytes')."""
    student_tok, teacher_tok = tokenizer(STUDENT), tokenizer(OTHER)
    rollout, teacher_ids, teacher_mask = student_written([byte_tokens(student_tok, "x <|im_end|> y")])
    read = teacher_ids[0][teacher_mask[0]].tolist()
    assert teacher_tok.decode(read[:-1]) == "x <|im_end|> y" and read.count(teacher_tok.eos_token_id) == 1
    groups = bound(OTHER, STUDENT).groups(rollout.completion_ids, rollout.completion_mask, teacher_ids, teacher_mask)
    assert groups.misaligned_rows == 0 and groups.aligned_bytes == len("x <|im_end|> y")


def test_a_row_whose_tokenizations_spell_different_bytes_is_left_out_and_counted():
    """The student writes 'cafe' + a combining accent; the teacher's tokenizer normalises it (NFC) to 'café', other
    bytes. That row gets no group (left out of the loss) and is counted in ``misaligned_rows``; the other row of the
    batch is aligned as usual and the step goes on (before: ValueError 'spell different bytes')."""
    student_tok = tokenizer(STUDENT)
    rollout, teacher_ids, teacher_mask = student_written([byte_tokens(student_tok, "cafe\u0301 54"), byte_tokens(student_tok, "54")])
    cross = bound(OTHER, STUDENT)
    groups = cross.groups(rollout.completion_ids, rollout.completion_mask, teacher_ids, teacher_mask)
    assert groups.misaligned_rows == 1 and set(groups.row.tolist()) == {1}
    student = torch.randn(*rollout.completion_ids.shape, len(student_tok), dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(*teacher_ids.shape, len(tokenizer(OTHER)), dtype=torch.float64)
    loss, diagnostics = cross.loss(ForwardKL(), student, teacher, groups, rollout.completion_ids, teacher_ids, rollout.completion_mask)
    (grad,) = torch.autograd.grad(loss, student)
    assert diagnostics["misaligned_rows"].item() == 1 and torch.isfinite(loss) and grad[0].abs().max().item() == 0.0


def test_groups_stop_at_a_special_token_inside_a_completion():
    """The student writes 'ab <|im_start|> cd': the teacher reads 'abcd' (the special token covers no bytes), so after
    it the two models no longer condition on the same text. Only the groups before it are compared ('a', 'b'); before,
    groups 'c' and 'd' compared a student that had read <|im_start|> with a teacher that had not."""
    student_tok = tokenizer(STUDENT)
    im_start = student_tok.convert_tokens_to_ids("<|im_start|>")
    text = lambda value: student_tok(value, add_special_tokens=False)["input_ids"]  # noqa: E731
    rollout, teacher_ids, teacher_mask = student_written([text("ab") + [im_start] + text("cd")])
    cross = bound(OTHER, STUDENT)
    groups = cross.groups(rollout.completion_ids, rollout.completion_mask, teacher_ids, teacher_mask)
    assert groups.student_start.tolist() == [0, 1] and groups.teacher_start.tolist() == [0, 1]
    assert groups.cut_rows == 1  # counted, and logged as train/cut_rows
    student = torch.randn(*rollout.completion_ids.shape, len(student_tok), dtype=torch.float64)
    teacher = torch.randn(*teacher_ids.shape, len(tokenizer(OTHER)), dtype=torch.float64)
    _, diagnostics = cross.loss(ForwardKL(), student, teacher, groups, rollout.completion_ids, teacher_ids, rollout.completion_mask)
    assert diagnostics["cut_rows"].item() == 1
    # a completion that ends with the end token keeps its end group
    rollout, teacher_ids, teacher_mask = student_written([text("abcd")])
    groups = bound(OTHER, STUDENT).groups(rollout.completion_ids, rollout.completion_mask, teacher_ids, teacher_mask)
    assert groups.student_start.tolist() == [0, 1, 2, 3, 4] and groups.cut_rows == 0


def test_the_optimum_is_the_teacher_conditioned_on_shared_single_tokens_not_its_distribution_over_text():
    """The student's vocabulary is the teacher's without its last tokens, among them ``<answer>``, which the student
    can still write as several tokens starting with ``<``. The teacher puts 0.5 on ``<answer>``, 0.25 on ``<`` and
    0.25 on ``x``. A student consistent with the teacher's distribution over text (p(``<``) = 0.75, since ``<answer>``
    starts with ``<``) is not the optimum: the teacher's ``<answer>`` mass is dropped and the optimum is the teacher
    renormalised over single shared tokens (p(``<``) = p(``x``) = 0.5, loss 0)."""
    tok = tokenizer(STUDENT)
    v_t, v_s = len(tok), len(tok) - 8
    answer, less, x = tok.convert_tokens_to_ids("<answer>"), tok.convert_tokens_to_ids("<"), tok.convert_tokens_to_ids("x")
    spelled = byte_tokens(tok, "<answer>")  # the student writes the same text in byte tokens
    assert answer >= v_s > max(max(spelled), x) and spelled[0] == less
    cross = CrossTokenizer()
    cross.bind(tok, tok, v_t, v_s)
    ids, mask = torch.tensor([[x]]), torch.tensor([[True]])
    groups = cross.groups(ids, mask, ids, mask)
    teacher = torch.full((1, 1, v_t), -40.0, dtype=torch.float64)
    teacher[0, 0, [answer, less, x]] = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64).log()

    def loss_for(p_less):
        student = torch.full((1, 1, v_s), -40.0, dtype=torch.float64)
        student[0, 0, [less, x]] = torch.tensor([p_less, 1 - p_less], dtype=torch.float64).log()
        return cross.loss(ForwardKL(), student, teacher, groups, ids, ids, mask)[0].item()

    assert loss_for(0.5) < 1e-9 and loss_for(0.75) > 0.1
