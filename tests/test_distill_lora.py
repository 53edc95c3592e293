"""LoRA students in DistillModule, and a teacher that is the student's own base (issue #28, item 3)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from kdlab.rollouts.policies import StudentRollouts, TeacherRollouts
from kdlab.stages.lora import AdaptersDisabled, LoraSpec
from kdlab.tasks import Addition

pytest.importorskip("peft")


def task():
    return Addition(max_digits=2, system_prompt="", num_train=16, num_val=4, num_test=0, seed=0)


def module(tiny_pair, **overrides):
    from kdlab.stages.distill import DistillModule

    settings = dict(rollout=TeacherRollouts(), batch_size=2, max_completion_tokens=8, val_examples=4, val_batch_size=4, warmup_steps=1,
                    lr=1e-2, lora=LoraSpec(r=4, alpha=8))
    settings.update(overrides)
    teacher = settings.pop("teacher", tiny_pair[1])
    return DistillModule(tiny_pair[0], teacher, task(), **settings)


def fit(m, tmp_path, steps=2):
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False, num_sanity_val_steps=0,
                         limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(m)
    return trainer


def test_only_the_adapters_move_and_hold_optimiser_state(tiny_pair, tmp_path):
    m = module(tiny_pair)
    names = {name: p.detach().clone() for name, p in m.student.named_parameters()}
    trainable = {name for name, p in m.student.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    trainer = fit(m, tmp_path)
    moved = {name for name, p in m.student.named_parameters() if not torch.equal(p, names[name])}
    assert moved and moved <= trainable  # adapters (B starts at 0, so at least the B matrices) and nothing else
    state = trainer.optimizers[0].state
    assert sum(1 for p in m.student.parameters() if p in state) == len(trainable)


def test_a_lora_fit_warns_of_nothing_deprecated(tiny_pair, tmp_path):
    """Issue #43: the LoRA path printed transformers' FutureWarning (peft asking for ``is_gradient_checkpointing``)
    on every run; wrapping, fitting and the base teacher's disabled adapters now emit none."""
    import warnings

    from kdlab.teachers import BaseModelTeacher

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = module(tiny_pair, teacher=BaseModelTeacher())  # the current spelling (base_teacher=True warns that it is old)
        fit(m, tmp_path)
    assert [str(w.message) for w in caught if issubclass(w.category, FutureWarning)] == []


def test_fused_head_and_logits_paths_give_the_same_adapter_gradients(tiny_pair):
    grads = []
    for fused in (False, True):
        torch.manual_seed(0)
        m = module(tiny_pair, fused_lm_head=fused)
        for name, p in m.student.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02)  # away from B = 0, so every adapter gets a gradient
        rollout = m.make_rollout(task().examples("train")[:2], 0)
        student, teacher = m.distillation_logits(rollout)
        loss = m.objective(student, teacher, rollout.completion_mask)
        params = [p for p in m.student.parameters() if p.requires_grad]
        grads.append(torch.autograd.grad(loss, params))
    for a, b in zip(*grads):
        assert (a - b).abs().max().item() < 1e-5


def test_the_base_teacher_is_the_student_without_adapters_in_the_same_memory(tiny_pair, tmp_path):
    from kdlab.models.loading import ModelSpec, load_causal_lm
    from kdlab.objectives.logits import completion_logits

    m = module(tiny_pair, teacher=None, base_teacher=True, rollout=StudentRollouts())
    assert isinstance(m.teacher, AdaptersDisabled) and not list(m.teacher.parameters())
    for name, p in m.student.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)  # the adapters now change the student's outputs
    rollout = m.make_rollout(task().examples("train")[:2], 0)
    base = load_causal_lm(ModelSpec(tiny_pair[0])).eval()
    inputs = rollout.model_inputs("teacher")
    with torch.no_grad():
        expected = completion_logits(base, inputs, rollout.completion_ids.shape[1], m.token_columns)
        teacher = completion_logits(m.teacher, inputs, rollout.completion_ids.shape[1], m.token_columns)
        student = completion_logits(m.student, rollout.model_inputs("student"), rollout.completion_ids.shape[1], m.token_columns)
    assert (teacher - expected).abs().max().item() < 1e-5
    assert (student - expected).abs().max().item() > 1e-3  # the student with its adapters differs
    base_weight = m.student.get_base_model().get_output_embeddings().weight
    assert m.teacher.get_output_embeddings().weight.data_ptr() == base_weight.data_ptr()  # no copy
    m.student.train()
    m.teacher.eval()  # the view never switches the student's mode
    assert m.student.training
    trainer = fit(m, tmp_path)
    assert float(trainer.callback_metrics["train/kl_forward"]) >= 0.0


def test_base_teacher_settings_are_checked(tiny_pair):
    with pytest.raises(ValueError, match="base_teacher.*needs lora, teacher: null"):
        module(tiny_pair, base_teacher=True)  # a teacher given as well
    with pytest.raises(ValueError, match="BaseModelTeacher is the student's base under its LoRA adapters: set DistillModule.lora"):
        module(tiny_pair, teacher=None, base_teacher=True, lora=None)


def test_a_lora_student_exports_merged_weights(tiny_pair, tmp_path):
    from kdlab.models.export import export_pretrained

    m = module(tiny_pair)
    for name, p in m.student.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    export_pretrained(m.student, m.student_tokenizer, tmp_path / "merged")
    from kdlab.models.loading import ModelSpec, load_causal_lm
    from kdlab.objectives.logits import completion_logits

    merged = load_causal_lm(ModelSpec(str(tmp_path / "merged"))).eval()
    rollout = m.make_rollout(task().examples("train")[:2], 0)
    inputs = rollout.model_inputs("student")
    m.student.eval()
    with torch.no_grad():
        a = completion_logits(merged, inputs, rollout.completion_ids.shape[1], m.token_columns)
        b = completion_logits(m.student, inputs, rollout.completion_ids.shape[1], m.token_columns)
    assert (a - b).abs().max().item() < 1e-4


def test_a_lora_run_with_a_base_teacher_resumes_bit_exact(tiny_pair, tmp_path):
    """LoRA student, its own base as the teacher, on-policy: stopped at step 3 and resumed from last.ckpt,
    it ends with the uninterrupted run's weights exactly (adapters, base, optimiser and data position)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(steps, root, ckpt_path=None):
        m = module(tiny_pair, teacher=None, base_teacher=True, rollout=StudentRollouts())
        checkpoint = ModelCheckpoint(dirpath=str(root / "ckpt"), save_last=True, every_n_train_steps=3)
        trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                             limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=str(root), callbacks=[checkpoint])
        trainer.fit(m, ckpt_path=ckpt_path)
        return m

    pl.seed_everything(0)
    full = run(6, tmp_path / "full")
    pl.seed_everything(0)
    run(3, tmp_path / "part")
    pl.seed_everything(123)
    resumed = run(6, tmp_path / "part", ckpt_path=str(tmp_path / "part" / "ckpt" / "last.ckpt"))
    for (name, a), b in zip(full.student.named_parameters(), resumed.student.parameters()):
        assert torch.equal(a, b), name


def merged_sparsity(student, base_path, tau):
    """Update sparsity of a LoRA student computed without kdlab's callback: peft's own merge (W + s B A) of a copy
    of the student, against the base model read again from its path, over every Hugging Face weight."""
    import copy

    from kdlab.models.loading import ModelSpec, load_causal_lm

    merged = dict(copy.deepcopy(student).merge_and_unload().named_parameters())
    small = total = 0
    for name, weight in load_causal_lm(ModelSpec(base_path)).named_parameters():
        delta = (merged[name].detach().double() - weight.detach().double()).abs()
        small, total = small + int((delta < tau).sum()), total + delta.numel()
    return small / total


def test_update_sparsity_measures_the_merged_weights_against_the_base_fresh_resumed_and_by_reference(tiny_pair, tmp_path, monkeypatch):
    """A LoRA student's update sparsity is that of its effective weights W + s B A against the base, by Hugging Face
    weight name: on a fresh run (against the weights at fit start), with ``reference`` (the base path) and on a run
    resumed from a checkpoint (the base reloaded), equal to the number computed from peft's merge."""
    import kdlab.callbacks.sparsity as sparsity
    from kdlab.callbacks import UpdateSparsity
    from lightning.pytorch.callbacks import ModelCheckpoint

    logged = []
    monkeypatch.setattr(sparsity, "log_metrics", lambda trainer, metrics: logged.append(metrics))

    def run(steps, ckpt_path=None):
        m = module(tiny_pair)
        callbacks = [UpdateSparsity(thresholds=(1e-6,)), UpdateSparsity(thresholds=(1e-6,), reference=tiny_pair[0]),
                     ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True, every_n_train_steps=2)]
        trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                             limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=str(tmp_path), callbacks=callbacks)
        trainer.fit(m, ckpt_path=ckpt_path)
        assert set(callbacks[0].initial) == set(callbacks[1].initial)  # one basis: the Hugging Face weights
        assert not any("lora_" in name for name in callbacks[0].initial)
        return m, logged[-2], logged[-1]

    pl.seed_everything(0)
    fresh, own, by_reference = run(2)
    assert any(p.abs().max() > 0 for name, p in fresh.student.named_parameters() if "lora_B" in name)
    expected = merged_sparsity(fresh.student, tiny_pair[0], 1e-6)
    assert expected < 0.9  # the adapters moved the projections they sit on
    assert own["sparsity/1e-06"] == pytest.approx(expected, abs=1e-9)
    assert by_reference["sparsity/1e-06"] == pytest.approx(expected, abs=1e-9)
    assert own["sparsity/1e-06/norms"] == 1.0 and own["sparsity/1e-06/attention"] < 0.9

    pl.seed_everything(0)
    resumed, own, by_reference = run(4, str(tmp_path / "ckpt" / "last.ckpt"))
    expected = merged_sparsity(resumed.student, tiny_pair[0], 1e-6)
    assert own["sparsity/1e-06"] == pytest.approx(expected, abs=1e-9)
    assert by_reference["sparsity/1e-06"] == pytest.approx(expected, abs=1e-9)


@pytest.mark.parametrize("dropout", [-0.1, 1.0, 1.5])
def test_lora_dropout_outside_0_1_is_refused_naming_the_key(dropout):
    with pytest.raises(ValueError, match=rf"lora.dropout must be in \[0, 1\), got {dropout}"):
        LoraSpec(r=4, alpha=8, dropout=dropout)
    LoraSpec(r=4, alpha=8, dropout=0.0), LoraSpec(r=4, alpha=8, dropout=0.5)  # in range: accepted


def test_lora_target_modules_that_match_no_adaptable_layer_are_refused_naming_them(tiny_pair):
    from kdlab.models.loading import ModelSpec, load_causal_lm
    from kdlab.stages.lora import apply_lora

    with pytest.raises(ValueError, match=r"lora.target_modules must name at least one module"):
        LoraSpec(r=4, alpha=8, target_modules=[])
    model = load_causal_lm(ModelSpec(tiny_pair[0]))
    with pytest.raises(ValueError, match=r"lora.target_modules: \['nonexistent'\] match no module of the model"):
        apply_lora(model, LoraSpec(r=4, alpha=8, target_modules=["q_proj", "nonexistent"]))  # a typo beside a valid name
    with pytest.raises(ValueError, match=r"lora.target_modules: 'model' matches model \(Qwen2Model\), not a layer peft adapts"):
        apply_lora(model, LoraSpec(r=4, alpha=8, target_modules=["model"]))
    adapted = apply_lora(model, LoraSpec(r=4, alpha=8, target_modules=["q_proj", "layers.1.self_attn.v_proj"]))  # suffixes match
    assert {name.split(".lora_")[0].rsplit(".", 1)[-1] for name, p in adapted.named_parameters() if p.requires_grad} == {"q_proj", "v_proj"}


@pytest.mark.parametrize("targets", [["lm_head"], ["embed_tokens"], ["q_proj", "embed_tokens"]])
def test_an_adapter_on_a_tied_embedding_or_head_is_refused_naming_the_key(tiny_pair, targets):
    """With tie_word_embeddings the head and the embedding are one tensor, which exports and vLLM pushes write once:
    an adapter on either would be dropped or land on both. Refused when the adapters are applied; an untied model
    and other targets on the tied model are accepted."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from kdlab.models.loading import resolve_path
    from kdlab.stages.lora import apply_lora

    config = AutoConfig.from_pretrained(resolve_path(tiny_pair[0]))
    config.tie_word_embeddings = True
    tied = AutoModelForCausalLM.from_config(config)
    assert tied.get_output_embeddings().weight is tied.get_input_embeddings().weight
    with pytest.raises(ValueError, match=r"lora.target_modules: .* tied .*tie_word_embeddings"):
        apply_lora(tied, LoraSpec(r=4, alpha=8, target_modules=targets))
    apply_lora(AutoModelForCausalLM.from_config(config), LoraSpec(r=4, alpha=8, target_modules=["q_proj"]))
    config.tie_word_embeddings = False
    apply_lora(AutoModelForCausalLM.from_config(config), LoraSpec(r=4, alpha=8, target_modules=targets))


def test_the_base_teacher_runs_through_the_fsdp1_root_of_the_student(tmp_path):
    """Under strategy: fsdp (FSDP1) the stage replaces the student by an FSDP root around the peft model; the base
    teacher calls that root with the adapters disabled (the inner peft model alone has only flat shards: 'weight must
    be 2-D'). On 2 gloo processes: its logits are the plain base model's, the student's differ, and the adapters
    still train after it ran."""
    import json
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    worker, env = Path(__file__).with_name("base_teacher_worker.py"), {**os.environ, "OMP_NUM_THREADS": "1"}
    ranks = [subprocess.Popen([sys.executable, str(worker), str(tmp_path), str(rank), port], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    for process in ranks:
        _, stderr = process.communicate(timeout=600)
        assert process.returncode == 0, stderr[-3000:]
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["teacher_vs_base"] < 1e-4, report
        assert report["student_vs_base"] > 1e-3, report
        assert report["adapter_grads"] > 0 and report["trainable"], report


def test_a_lora_distill_checkpoint_loads_as_the_model_with_its_adapters_merged(tiny_pair, tmp_path):
    """A LoRA distill run's final.ckpt (weights only, as FinalCheckpoint writes it) records its adapters' settings, and
    a stage that starts from it (``policy.checkpoint`` of RLVR, or FinalCheckpoint's suggestion
    ``--model.student.checkpoint=final.ckpt`` for a new run) gets the student with the adapters merged: the same logits."""
    from kdlab.models.loading import ModelSpec, load_causal_lm
    from kdlab.objectives.logits import completion_logits

    m = module(tiny_pair)
    for name, p in m.student.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    trainer = fit(m, tmp_path, steps=1)
    final = tmp_path / "final.ckpt"
    trainer.save_checkpoint(final, weights_only=True)
    assert torch.load(final, weights_only=True)["kdlab_lora"] == {"r": 4, "lora_alpha": 8, "target_modules": sorted(LoraSpec().target_modules)}
    rollout = m.make_rollout(task().examples("train")[:2], 0)
    inputs, length = rollout.model_inputs("student"), rollout.completion_ids.shape[1]
    m.student.eval()
    merged = load_causal_lm(ModelSpec(tiny_pair[0], checkpoint=str(final)), "policy").eval()
    assert not any("lora_" in name for name, _ in merged.named_parameters())
    with torch.no_grad():
        adapted = completion_logits(m.student, inputs, length, m.token_columns)
        assert (completion_logits(merged, inputs, length, m.token_columns) - adapted).abs().max().item() < 1e-4
        base = completion_logits(load_causal_lm(ModelSpec(tiny_pair[0])), inputs, length, m.token_columns)
        assert (base - adapted).abs().max().item() > 1e-3  # the adapters mattered
    again = module((ModelSpec(tiny_pair[0], checkpoint=str(final)), tiny_pair[1]))  # a new LoRA run from those weights
    again.student.eval()
    with torch.no_grad():  # fresh adapters (B = 0) on the merged weights
        assert (completion_logits(again.student, inputs, length, m.token_columns) - adapted).abs().max().item() < 1e-4


def test_lora_checkpoints_that_cannot_be_merged_say_what_works(tiny_pair, tmp_path):
    """Adapters without recorded settings (a distill, RLVR or SFT checkpoint written before kdlab recorded them) cannot
    be merged (alpha is not in the tensors): the error names the checkpoint and a way that works."""
    from kdlab.models.loading import ModelSpec, load_causal_lm

    m = module(tiny_pair)
    state = m.student.state_dict()
    for prefix, advice in (("student.", "written before kdlab recorded them"), ("model.", "SFTModule.export_dir")):
        path = tmp_path / f"{prefix}ckpt"
        torch.save({"state_dict": {prefix + key: value for key, value in state.items()}}, path)
        with pytest.raises(ValueError, match=rf"policy.checkpoint .*holds LoRA adapters without their settings .*{advice}"):
            load_causal_lm(ModelSpec(tiny_pair[0], checkpoint=str(path)), "policy")
    # the advice for a distill or RLVR checkpoint without settings, followed: the folder loads as the adapter model
    from kdlab.models import export_pretrained
    from kdlab.objectives.logits import completion_logits
    from kdlab.stages.lora import apply_lora

    for name, p in m.student.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    torch.save({"state_dict": {"student." + key: value for key, value in m.student.state_dict().items()}}, tmp_path / "student.ckpt")
    saved = torch.load(tmp_path / "student.ckpt", weights_only=True)["state_dict"]
    adapted = apply_lora(load_causal_lm(ModelSpec(tiny_pair[0])), LoraSpec(r=4, alpha=8))
    adapted.load_state_dict({key[len("student."):]: value for key, value in saved.items() if key.startswith("student.")})
    export_pretrained(adapted, m.student_tokenizer, tmp_path / "merged")
    rollout = m.make_rollout(task().examples("train")[:2], 0)
    inputs, length = rollout.model_inputs("student"), rollout.completion_ids.shape[1]
    m.student.eval()
    with torch.no_grad():
        merged = load_causal_lm(ModelSpec(str(tmp_path / "merged")), "policy")
        gap = completion_logits(merged, inputs, length, m.token_columns) - completion_logits(m.student, inputs, length, m.token_columns)
    assert gap.abs().max().item() < 1e-4


def test_with_adapters_disabled_the_lora_branch_and_its_dropout_are_skipped(tiny_pair):
    """What AdaptersDisabled's docstring says: with the student in train mode and LoRA dropout 0.5, the base teacher's
    logits are the plain base model's, the same on every call (no dropout mask drawn on the LoRA branch)."""
    from kdlab.models.loading import ModelSpec, load_causal_lm
    from kdlab.objectives.logits import completion_logits
    from kdlab.teachers import BaseModelTeacher

    m = module(tiny_pair, teacher=BaseModelTeacher(), rollout=StudentRollouts(), lora=LoraSpec(r=4, alpha=8, dropout=0.5))
    for name, p in m.student.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    rollout = m.make_rollout(task().examples("train")[:2], 0)
    inputs, length = rollout.model_inputs("teacher"), rollout.completion_ids.shape[1]
    m.student.train()
    with torch.no_grad():
        first, second = (completion_logits(m.teacher, inputs, length, m.token_columns) for _ in range(2))
        base = completion_logits(load_causal_lm(ModelSpec(tiny_pair[0])).eval(), inputs, length, m.token_columns)
        noisy = [completion_logits(m.student, inputs, length, m.token_columns) for _ in range(2)]
    assert torch.equal(first, second) and (first - base).abs().max().item() < 1e-5
    assert not torch.equal(*noisy)  # the student itself, in train mode, does draw LoRA dropout
