import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from kdlab.stages import SFTModule
from kdlab.tasks import Addition


def rows_file(tmp_path, rows):
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_loss_is_taken_on_completion_tokens_only(tiny_pair, tmp_path):
    path = rows_file(tmp_path, [{"messages": [{"role": "user", "content": "1+2"}], "completion": "<answer>3</answer>"}])
    module = SFTModule(tiny_pair[0], dataset=path)
    batch = module.collate(module.rows)
    ids, prompt_length = module.encode(module.rows[0])
    labels = batch["labels"][0]
    assert torch.all(labels[:prompt_length] == -100)
    completion = module.tokenizer.decode(labels[prompt_length:].tolist())
    assert completion == "<answer>3</answer><|im_end|>"


def test_sft_on_task_references_learns_them(tiny_pair, tmp_path):
    module = SFTModule(tiny_pair[0], tasks=[Addition(num_train=8)], lr=1e-2, warmup_steps=1, batch_size=8, schedule="constant")
    batch = module.collate(module.rows)
    before = module.loss(batch).item()
    pl.Trainer(max_steps=40, accelerator="cpu", logger=False, default_root_dir=tmp_path, enable_checkpointing=False, enable_progress_bar=False).fit(module)
    assert module.loss(batch).item() < 0.5 * before
    import yaml

    described = yaml.safe_load((tmp_path / "config.yaml").read_text())["model"]  # a Python run describes itself, SFT too
    assert described["class_path"] == "kdlab.stages.sft.SFTModule" and described["init_args"]["lr"] == 1e-2
    assert described["init_args"]["tasks"][0]["class_path"] == "kdlab.tasks.addition.Addition"


def test_cosine_schedule_warms_up_then_decays(tiny_pair, tmp_path):
    module = SFTModule(tiny_pair[0], tasks=[Addition(num_train=4)], lr=1.0, warmup_steps=2, batch_size=4)
    seen = []

    class Record(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            seen.append(optimizer.param_groups[0]["lr"])

    pl.Trainer(max_steps=6, accelerator="cpu", logger=False, default_root_dir=tmp_path, enable_checkpointing=False, enable_progress_bar=False, callbacks=[Record()]).fit(module)
    assert seen[:2] == pytest.approx([0.5, 1.0])
    assert seen[2] == pytest.approx(1.0) and seen[-1] < seen[3] < seen[2]


def test_bad_sft_inputs_name_the_file_line_and_field(tiny_pair, tmp_path):
    path = rows_file(tmp_path, [{"prompt": "x"}])
    with pytest.raises(ValueError, match=r"sft.jsonl:1: missing string field 'completion'"):
        SFTModule(tiny_pair[0], dataset=path)
    with pytest.raises(ValueError, match="exactly one of dataset or tasks"):
        SFTModule(tiny_pair[0])
    with pytest.raises(ValueError, match="SFTModule.schedule"):
        SFTModule(tiny_pair[0], tasks=[Addition(num_train=1)], schedule="linear")


def test_saved_model_reloads_with_its_tokenizer(tiny_pair, tmp_path):
    module = SFTModule(tiny_pair[0], tasks=[Addition(num_train=2)])
    module.save_pretrained(tmp_path / "out")
    reloaded = SFTModule(str(tmp_path / "out"), tasks=[Addition(num_train=2)])
    for name, value in module.model.state_dict().items():
        assert torch.equal(value, reloaded.model.state_dict()[name])


def test_lora_sft_trains_only_the_adapters_and_exports_merged_weights(tiny_pair, tmp_path):
    pytest.importorskip("peft")
    from kdlab.models import ModelSpec, load_causal_lm
    from kdlab.stages.lora import LoraSpec

    module = SFTModule(tiny_pair[0], tasks=[Addition(num_train=8)], lr=1e-2, warmup_steps=1, batch_size=8, schedule="constant",
                       lora=LoraSpec(r=4, alpha=8, target_modules=["q_proj", "v_proj", "up_proj"]), export_dir=str(tmp_path / "merged"))
    trainable = {n for n, p in module.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    before = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    batch = module.collate(module.rows)
    pl.Trainer(max_steps=5, accelerator="cpu", logger=False, default_root_dir=tmp_path, enable_checkpointing=False, enable_progress_bar=False).fit(module)
    changed = {n for n, p in module.model.named_parameters() if not torch.equal(before[n], p)}
    assert changed and changed <= trainable
    trained_loss = module.loss(batch).item()
    exported = load_causal_lm(ModelSpec(str(tmp_path / "merged")))  # a plain model: adapters merged in
    assert not any("lora" in n for n, _ in exported.named_parameters())
    logits = exported(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"][:, 1:]
    merged_loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100).item()
    assert merged_loss == pytest.approx(trained_loss, rel=1e-4)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-head", "logits"])
def test_the_loss_and_its_gradients_are_the_completion_tokens_cross_entropy(tiny_pair, tmp_path, fused):
    """The chunked loss (fused head or logits) equals ``cross_entropy`` over the whole fp32 logits, value and
    every parameter's gradient (the tiny student's head has no padding rows, so both normalise over the same
    tokens)."""
    module = SFTModule(tiny_pair[0], tasks=[Addition(num_train=8)], batch_size=8, fused_lm_head=fused)
    assert module.uses_fused_head() is fused and module.model.get_output_embeddings().weight.shape[0] == len(module.tokenizer)
    batch = module.collate(module.rows)
    loss = module.loss(batch)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in module.model.named_parameters()}
    module.model.zero_grad()
    logits = module.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    reference = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), batch["labels"][:, 1:].reshape(-1), ignore_index=-100)
    reference.backward()
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-6)
    for name, p in module.model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_the_fused_loss_never_holds_the_logits():
    """The fused loss's peak extra memory (forward and backward) is a few ``(256, V)`` fp32 blocks, under half of one
    fp32 copy of the ``(B, T, V)`` logits; cross-entropy over whole upcast logits (the earlier loss)
    holds more than two."""
    from test_gpu_paths import LiveBytes
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1, tie_word_embeddings=False))
    ids = torch.randint(0, 4096, (8, 512))  # 16 chunks of 256 positions
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    module = SFTModule.__new__(SFTModule)
    torch.nn.Module.__init__(module)
    module.model, module.fused_lm_head, module.token_columns = model, True, 4096
    logits_bytes = ids.numel() * 4096 * 4
    peaks = {}
    for name, loss in (("fused", lambda: module.loss(batch)),
                       ("whole", lambda: torch.nn.functional.cross_entropy(model(input_ids=ids).logits[:, :-1].reshape(-1, 4096).float(), ids[:, 1:].reshape(-1)))):
        model.zero_grad(set_to_none=True)
        with LiveBytes([*model.parameters(), *model.buffers(), *batch.values()]) as counter:
            loss().backward()
        peaks[name] = counter.peak
    chunk_bytes = 256 * 4096 * 4  # one (256, V) fp32 block
    assert peaks["fused"] < 6 * chunk_bytes < logits_bytes / 2 and 2 * logits_bytes < peaks["whole"], {**peaks, "logits": logits_bytes}


def test_lora_on_the_lm_head_takes_the_logits_path_so_its_adapter_trains(tiny_pair):
    """peft's LoRA layer on ``lm_head`` exposes the base weight; the fused loss would leave the adapter's term out
    (and give it no gradient), so the head is refused for the fused path and the loss is the logits' cross-entropy."""
    pytest.importorskip("peft")
    from kdlab.objectives.logits import fused_head_unsupported
    from kdlab.stages.lora import LoraSpec

    module = SFTModule(tiny_pair[0], tasks=[Addition(num_train=8)], batch_size=8, lora=LoraSpec(r=4, alpha=8, target_modules=["q_proj", "lm_head"]))
    assert "adapters" in fused_head_unsupported(module.model) and not module.uses_fused_head()
    for name, p in module.model.named_parameters():
        if "lm_head" in name and "lora_B" in name:
            torch.nn.init.normal_(p)  # a trained adapter: its term changes the logits
    batch = module.collate(module.rows)
    loss = module.loss(batch)
    logits = module.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    reference = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), batch["labels"][:, 1:].reshape(-1), ignore_index=-100)
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-6)
    loss.backward()
    head_adapters = [p.grad for name, p in module.model.named_parameters() if "lm_head" in name and "lora_" in name]
    assert head_adapters and all(g is not None and g.abs().sum() > 0 for g in head_adapters)


def test_under_fsdp1_the_default_loss_takes_the_logits_path(tiny_pair):
    """Lightning's FSDP1 wraps the module, so after the forward the head's weight is a flat shard: the default
    (``fused_lm_head: None``) reads logits there; ``true`` still insists."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import FSDPStrategy

    module = SFTModule(tiny_pair[0], tasks=[Addition(num_train=4)])
    assert module.uses_fused_head()
    module._trainer = SimpleNamespace(strategy=object.__new__(FSDPStrategy))
    assert not module.uses_fused_head()
    module.fused_lm_head = True
    assert module.uses_fused_head()


@pytest.mark.parametrize("key, value, message", [
    ("min_lr_ratio", -1.0, r"SFTModule.min_lr_ratio must be in \[0, 1\], got -1.0"),
    ("min_lr_ratio", 1.5, r"SFTModule.min_lr_ratio must be in \[0, 1\], got 1.5"),
    ("warmup_steps", -5, r"SFTModule.warmup_steps must be an integer >= 0, got -5"),
    ("batch_size", 0, r"SFTModule.batch_size must be >= 1, got 0"),
    ("max_length", 0, r"SFTModule.max_length must be >= 2 \(a prompt token and a completion token\), got 0"),
])
def test_bad_optimiser_and_data_settings_fail_at_construction_naming_the_key(tiny_pair, monkeypatch, key, value, message):
    """A negative ``min_lr_ratio`` would train with a negative learning rate (gradient ascent) at the end of the cosine;
    the others fail later in torch's own words. All are refused before any weights load, naming the key."""
    import kdlab.stages.sft

    monkeypatch.setattr(kdlab.stages.sft, "load_causal_lm", lambda *a, **k: pytest.fail("weights were read"))
    with pytest.raises(ValueError, match=message):
        SFTModule(tiny_pair[0], tasks=[Addition(num_train=4)], **{key: value})


@pytest.mark.parametrize("row", [{"prompt": "", "completion": "a"}, {"messages": [], "completion": "a"},
                                 {"messages": [{"role": "user"}], "completion": "a"}, {"messages": "1+2", "prompt": "1+2", "completion": "a"}],
                         ids=["empty-prompt", "no-messages", "no-content", "messages-not-a-list"])
def test_an_empty_prompt_is_refused_when_the_file_is_read_naming_file_and_line(tiny_pair, tmp_path, row):
    """A row with nothing to condition on (``"prompt": ""``, no messages, a message without content) is refused
    while the file is read, naming its file and line (it used to pass and fail in the first step, KeyError 'messages')."""
    path = rows_file(tmp_path, [{"prompt": "x", "completion": "y"}, row])
    with pytest.raises(ValueError, match=r"sft.jsonl:2: needs a non-empty 'prompt' string or a non-empty 'messages' list"):
        SFTModule(tiny_pair[0], dataset=path)


def test_rows_longer_than_max_length_are_refused_before_the_first_step_naming_the_example_or_line(tiny_pair, tmp_path, monkeypatch):
    """Every row is encoded and checked when the fit is set up, before any step (a long row used to be found only when
    its batch came, possibly hours in, and was named '?'): a task's row by its example id, a JSONL row by file:line."""
    monkeypatch.setattr(SFTModule, "training_step", lambda *a, **k: pytest.fail("a training step ran"))

    def fit(module):
        pl.Trainer(max_steps=1, accelerator="cpu", logger=False, default_root_dir=tmp_path, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False).fit(module)

    module = SFTModule(tiny_pair[0], tasks=[Addition(num_train=4)], max_length=14, batch_size=1)
    lengths = [len(module.encode(row)[0]) for row in module.rows]
    longest = max(range(4), key=lambda i: (lengths[i] > 14, -i))  # the first too-long row
    assert lengths[longest] > 14, lengths
    with pytest.raises(ValueError, match=rf"SFTModule.max_length=14: Addition example 'add-train-{longest}' has {lengths[longest]} tokens"):
        fit(module)
    path = rows_file(tmp_path, [{"prompt": "p", "completion": "a"}, {"prompt": "p", "completion": "a " * 50}])
    with pytest.raises(ValueError, match=r"SFTModule.max_length=14: .*sft.jsonl:2 has \d+ tokens"):
        fit(SFTModule(tiny_pair[0], dataset=path, max_length=14, batch_size=1))


def trained_rows(monkeypatch):
    """Record the rows (their padded token ids) of every micro-batch the loss is taken on."""
    seen = []
    loss = SFTModule.loss

    def recording(self, batch, *args, **kwargs):
        seen.append(sorted(map(tuple, batch["input_ids"].tolist())))
        return loss(self, batch, *args, **kwargs)

    monkeypatch.setattr(SFTModule, "loss", recording)
    return seen


def test_a_fit_resumed_mid_epoch_trains_the_rows_an_uninterrupted_fit_trains(tiny_pair, tmp_path, monkeypatch):
    """The data position is in every checkpoint: 3 steps, then a resume to 6, trains on the micro-batches an
    uninterrupted 6-step fit trains on, in its order (Addition(num_train=8), batch_size=2: 4 steps an epoch, so the
    resume starts inside epoch 0 and the second epoch is reshuffled as the uninterrupted fit reshuffles it)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    seen = trained_rows(monkeypatch)

    def fit(steps, root, ckpt_path=None):
        module = SFTModule(tiny_pair[0], tasks=[Addition(num_train=8)], batch_size=2, warmup_steps=1, schedule="constant")
        pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                   default_root_dir=root, callbacks=[ModelCheckpoint(dirpath=root, save_last=True, every_n_train_steps=1)]).fit(module, ckpt_path=ckpt_path)
        rows, seen[:] = list(seen), []
        return rows

    whole = fit(6, tmp_path / "whole")
    first = fit(3, tmp_path / "parts")
    second = fit(6, tmp_path / "parts", ckpt_path=str(tmp_path / "parts" / "last.ckpt"))
    assert len(whole) == 6 and whole[:4] != whole[4:] + whole[:2]
    assert first + second == whole


def test_the_data_order_is_the_seeds_under_ddp_too(tiny_pair):
    """Under DDP Lightning swapped the seeded sampler for its own DistributedSampler (seeded by the global seed), so
    ``SFTModule.seed`` stopped mattering. The stage's own order is rank-aware: rank r of W takes positions r, r + W, ...
    of the seed's order, and Lightning keeps it."""
    from lightning.pytorch.trainer.states import RunningStage

    def order(seed, devices):
        trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", logger=False)
        module = SFTModule(tiny_pair[0], tasks=[Addition(num_train=16)], batch_size=4, seed=seed)
        module.trainer = trainer
        loader = trainer._data_connector._prepare_dataloader(module.train_dataloader(), shuffle=True, mode=RunningStage.TRAINING)
        return list(iter(loader.sampler))

    single = {seed: order(seed, 1) for seed in (1, 2)}
    assert sorted(single[1]) == list(range(16)) and single[1] != single[2]
    for seed in (1, 2):
        assert order(seed, 2) == single[seed][0::2]


UNEVEN = [{"prompt": f"Q{i}: ", "completion": "x " * length} for i, length in enumerate([40, 1, 1, 1, 20, 3, 1, 10])]


def step_gradients(path, tmp_path, batch_size, accumulate):
    """The gradients the first optimiser step is taken on (accumulated over its micro-batches)."""
    grads = {}

    class Gradients(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            grads.update({name: p.grad.clone() for name, p in pl_module.model.named_parameters()})

    module = SFTModule("kdlab://tiny-random/student", dataset=path, batch_size=batch_size, warmup_steps=0, schedule="constant")
    pl.Trainer(max_steps=1, accumulate_grad_batches=accumulate, accelerator="cpu", logger=False, default_root_dir=tmp_path, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, callbacks=[Gradients()]).fit(module)
    return grads


def test_an_optimiser_steps_loss_is_the_token_mean_over_its_whole_batch_whatever_the_accumulation(tmp_path):
    """batch_size 4 and batch_size 2 x accumulate_grad_batches 2 step on the same gradients, with rows whose completions
    run from 2 to over 40 tokens: the step's loss is the mean over every completion token of its 4 rows (a mean of the
    micro-batches' means, the earlier loss, weighs a token of the short-completion micro-batch several times more)."""
    path = rows_file(tmp_path, UNEVEN[:4])
    whole, accumulated = step_gradients(path, tmp_path, 4, 1), step_gradients(path, tmp_path, 2, 2)
    for name, grad in whole.items():
        torch.testing.assert_close(accumulated[name], grad, rtol=1e-4, atol=1e-7, msg=name)


def test_sft_fits_under_ddp_and_its_steps_loss_is_the_token_mean_over_every_ranks_rows(tmp_path):
    """2 gloo processes x batch_size 2 x accumulate_grad_batches 2 step on the gradients one process takes from the same
    8 rows in one batch: each micro-batch's token sum is divided by the step's completion tokens averaged over the
    ranks (a collective) and over the accumulation, so DDP's average of the ranks' gradients is the whole batch's token
    mean (rank r of 2 takes positions r, r + 2, ... of the order, so the step holds the 8 rows either way). The fit
    itself used to hang before its first step: SFTModule.on_fit_start read ``Trainer.log_dir``, a collective under
    DDP, on rank zero only."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    path = rows_file(tmp_path, UNEVEN)
    worker = Path(__file__).parent / "sft_ranks_worker.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(worker), path, str(tmp_path)], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "config.yaml").is_file()
    ranks = torch.load(tmp_path / "grads.pt")
    whole = step_gradients(path, tmp_path, 8, 1)
    for name, grad in whole.items():
        torch.testing.assert_close(ranks[name], grad, rtol=1e-4, atol=1e-7, msg=name)


def test_fsdp2_is_refused_when_the_fit_is_set_up_naming_the_strategy(tiny_pair):
    """SFTModule does not shard its model under ``ModelParallelStrategy`` (FSDP2: it has no ``configure_model``), which
    check_strategy accepts for the other stages: refused at setup naming trainer.strategy and what works, before
    Lightning's own TypeError (which names neither kdlab's key nor the strategies that train SFT)."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import ModelParallelStrategy

    module = SFTModule(tiny_pair[0], tasks=[Addition(num_train=4)])
    module._trainer = SimpleNamespace(strategy=object.__new__(ModelParallelStrategy))
    with pytest.raises(ValueError, match=r"trainer.strategy: SFTModule does not shard under ModelParallelStrategy \(FSDP2\); use one device, ddp or fsdp"):
        module.setup("fit")


def test_a_lora_sft_checkpoint_loads_in_the_next_stage_with_its_adapters_merged(tiny_pair, tmp_path):
    """A LoRA SFT run's final.ckpt (weights only, as FinalCheckpoint writes it) records its adapters' settings
    (``kdlab_lora``), so the next stage that starts from it (here a distillation's ``student.checkpoint``; RLVR's
    ``policy.checkpoint`` loads the same way) trains from the weights the SFT run ended with: each equals the SFT
    model's effective weight ``W + (alpha / r) B A`` (what its exports write). Failed before: the checkpoint held the
    adapters without their settings, and the load was refused."""
    pytest.importorskip("peft")
    from kdlab.models import ModelSpec
    from kdlab.models.export import merged_weights
    from kdlab.stages import DistillModule
    from kdlab.stages.lora import LoraSpec

    module = SFTModule(tiny_pair[0], tasks=[Addition(num_train=8)], lr=1e-2, warmup_steps=1, batch_size=8, schedule="constant",
                       lora=LoraSpec(r=4, alpha=8, target_modules=["q_proj", "v_proj", "up_proj"]))
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=False, default_root_dir=tmp_path, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(module)
    final = tmp_path / "final.ckpt"
    trainer.save_checkpoint(final, weights_only=True)
    assert torch.load(final, weights_only=True)["kdlab_lora"] == {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "up_proj", "v_proj"]}
    effective = dict(merged_weights(module.model))
    following = DistillModule(ModelSpec(tiny_pair[0], checkpoint=str(final)), tiny_pair[1], Addition(num_train=4))
    loaded = following.student.state_dict()
    assert not any("lora_" in name for name in loaded)
    base = SFTModule(tiny_pair[0], tasks=[Addition(num_train=1)]).model.state_dict()
    moved = [name for name, value in effective.items() if not torch.equal(value, base[name])]
    assert moved and all(".q_proj." in name or ".v_proj." in name or ".up_proj." in name for name in moved)  # the adapters mattered
    for name, value in effective.items():
        torch.testing.assert_close(loaded[name], value, rtol=1e-5, atol=1e-6, msg=name)


SFT_CONFIG = """
seed_everything: 42
trainer:
  max_steps: 6
  accelerator: cpu
  devices: 1
  log_every_n_steps: 1
  logger:
    class_path: lightning.pytorch.loggers.TensorBoardLogger
    init_args: {save_dir: SAVE_DIR, name: sft}
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {save_last: true, every_n_train_steps: 2}
model:
  class_path: kdlab.stages.SFTModule
  init_args:
    model: kdlab://tiny-random/student
    tasks:
      - class_path: kdlab.tasks.Addition
        init_args: {num_train: 8}
    batch_size: 2
    lr: 1.0e-3
    warmup_steps: 1
"""


@pytest.mark.parametrize("stop, resume_from", [(3, "on_exception.ckpt"), (5, "last.ckpt")], ids=["on_exception", "older-last"])
def test_a_resumed_sft_run_logs_what_the_uninterrupted_run_logs_step_for_step(tmp_path, monkeypatch, capsys, stop, resume_from):
    """SFT checkpoints carry the log position, as every stage's: Ctrl-C inside step ``stop``, then ``--ckpt_path`` of the
    on-exception checkpoint (nothing logged after it) or of the older last.ckpt (step 4: the interrupted run logged
    step 5 after it); the resumed run's TensorBoard scalars and ``metrics.jsonl`` equal the uninterrupted run's, every
    scalar at its optimiser step, once. Failed before: no log position and no ``metrics.jsonl`` in an SFT run, its
    TensorBoard scalars at Lightning's logger step (one lower) and, after the older checkpoint, step 5 logged twice."""
    import signal

    from test_resume import logged

    from kdlab.cli.main import main

    monkeypatch.setattr("sys.argv", ["kdlab"])

    def cli_fit(save_dir, *extra):
        config = tmp_path / f"{save_dir.name}.yaml"
        config.write_text(SFT_CONFIG.replace("SAVE_DIR", str(save_dir)))
        return main(["fit", f"--config={config}", *extra])

    full = cli_fit(tmp_path / "full")
    real = SFTModule.training_step

    def interrupted(self, batch, batch_idx):
        if self.global_step == stop:
            raise KeyboardInterrupt
        return real(self, batch, batch_idx)

    monkeypatch.setattr(SFTModule, "training_step", interrupted)
    try:
        with pytest.raises(SystemExit):
            cli_fit(tmp_path / "part")
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # Lightning ignores further Ctrl-C after one
    monkeypatch.setattr(SFTModule, "training_step", real)
    run_dir = tmp_path / "part" / "sft" / "version_0"
    checkpoint = run_dir / "checkpoints" / resume_from
    assert torch.load(checkpoint, weights_only=True)["kdlab_log_position"]["global_step"] == (stop if resume_from == "on_exception.ckpt" else 4)
    resumed = cli_fit(tmp_path / "part", f"--ckpt_path={checkpoint}")
    assert Path(resumed.trainer.log_dir) == run_dir
    expected, got = logged(full.trainer.log_dir), logged(run_dir)
    assert [step for step, _ in expected[0]["train/loss"]] == [1, 2, 3, 4, 5, 6]
    assert got[0] == expected[0]  # TensorBoard: every scalar at the uninterrupted run's step, once
    assert got[1] == expected[1]  # metrics.jsonl
    for a, b in zip(full.model.model.parameters(), resumed.model.model.parameters()):
        assert torch.equal(a, b)
