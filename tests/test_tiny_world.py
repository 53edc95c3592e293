from kdlab.evaluation.metrics import detect_language
from kdlab.tasks.countdown import verify
from kdlab.tiny.world import SPANISH_INSTRUCTION, countdown, countdown_rows, trace


def test_traces_state_each_step_and_end_with_the_answer():
    assert trace("6+1=7,7*3=21", "english") == (
        "<think>first add 6 and 1 to get 7, then multiply 7 and 3 to get 21</think><answer>6+1=7,7*3=21</answer>"
    )
    assert trace("8/2=4", "spanish") == "<think>primero divido 8 y 2 para obtener 4</think><answer>8/2=4</answer>"


def test_both_styles_verify_and_are_detected_in_their_language():
    task = countdown(num_train=40, num_val=0, num_test=0, seed=5)
    english, spanish = countdown_rows(task, "train", "english"), countdown_rows(task, "train", "spanish")
    for row_en, row_es, example in zip(english, spanish, task.examples("train")):
        assert verify(example["nums"], example["target"], row_en["completion"])
        assert verify(example["nums"], example["target"], row_es["completion"])
        assert detect_language(row_en["completion"]) == "en"
        assert detect_language(row_es["completion"]) == "es"
        assert SPANISH_INSTRUCTION in row_es["messages"][-1]["content"]
        assert SPANISH_INSTRUCTION not in row_en["messages"][-1]["content"]


def test_tiny_countdown_prompt_is_only_the_problem():
    task = countdown(num_train=1)
    assert task.user_prompt(task.examples("train")[0]).startswith("Numbers: [")
    assert task.student_messages(task.examples("train")[0])[0]["role"] == "user"


def test_packaged_world_pair_shares_a_vocabulary_and_the_teacher_is_several_times_larger():
    from kdlab.models import ModelSpec, load_causal_lm, load_tokenizer
    from kdlab.models.loading import shared_vocab_size

    specs = {role: ModelSpec(f"kdlab://tiny/{role}") for role in ("student", "teacher")}
    models = {role: load_causal_lm(spec) for role, spec in specs.items()}
    tokenizers = {role: load_tokenizer(spec) for role, spec in specs.items()}
    vocab = shared_vocab_size(tokenizers["student"], tokenizers["teacher"], models["student"], models["teacher"])
    assert models["teacher"].get_output_embeddings().weight.shape[0] > vocab  # padded rows, as in real families
    sizes = {role: sum(p.numel() for p in model.parameters()) for role, model in models.items()}
    assert sizes["teacher"] >= 3 * sizes["student"]  # 707k vs 206k parameters: 3.4x


def test_packaged_teacher_solves_and_switches_language_on_a_few_problems():
    """A cheap check of the model card's claims on 12 held-out problems (the card measures 200)."""
    from kdlab.evaluation.metrics import spanish_share
    from kdlab.evaluation.scoring import accuracy, completion_texts
    from kdlab.models import ModelSpec, load_causal_lm, load_tokenizer

    spec = ModelSpec("kdlab://tiny/teacher")
    model, tokenizer = load_causal_lm(spec), load_tokenizer(spec)
    task = countdown(num_train=0, num_val=12, num_test=0)
    examples = task.examples("val")
    english = completion_texts(model, tokenizer, task, examples, max_new_tokens=80)
    spanish = completion_texts(model, tokenizer, task, examples, role="teacher", max_new_tokens=80)
    assert accuracy(task, examples, english) >= 0.5
    assert spanish_share(english) == 0.0 and spanish_share(spanish) == 1.0


def test_teacher_4e_build_trains_a_copy_and_writes_its_card(tmp_path):
    """A two-step build of the Countdown-4E teacher on a copy of the packaged pair: the packaged teacher
    is left as it was, the new folder loads and its card and metrics.json hold every target."""
    import json
    import shutil

    from kdlab.models.loading import ASSETS
    from kdlab.tiny.build import TEACHER_4E, build_teacher_4e, teacher_4e_targets

    tiny = tmp_path / "tiny"
    shutil.copytree(ASSETS / "tiny", tiny, ignore=shutil.ignore_patterns("teacher-4e"))
    before = (tiny / "teacher" / "model.safetensors").read_bytes()
    recipe = dict(TEACHER_4E, countdown4e=64, countdown3=64, epochs=1, eval_examples=4, pass_at_k_samples=2)
    measured = build_teacher_4e(tiny, recipe)
    assert (tiny / "teacher" / "model.safetensors").read_bytes() == before
    assert (tiny / "teacher-4e" / "model.safetensors").read_bytes() != before
    card = (tiny / "teacher-4e" / "MODEL_CARD.md").read_text()
    assert card.count("| yes |") + card.count("| NO |") == len(teacher_4e_targets(recipe))
    saved = json.loads((tiny / "teacher-4e" / "metrics.json").read_text())
    assert saved["recipe"] == recipe and set(saved["measured"]) == {"teacher-4e", "teacher", "student", "build_seconds"}
    assert set(measured["student"]) == {"countdown3_accuracy", "countdown4e_accuracy", "countdown4e_pass@1", "countdown4e_pass@2"}
    assert not (tmp_path / "teacher-4e.build").exists()


def test_the_tiny_model_card_begins_with_what_its_builder_writes_from_metrics_json():
    """kdlab/assets/tiny/MODEL_CARD.md's tables and figures are ``kdlab.tiny.build.model_card`` of the committed
    ``metrics.json``; only the prose sections after them ("How these files were produced", ...) are written by hand."""
    import json
    from pathlib import Path

    from kdlab.tiny.build import model_card

    tiny = Path(__file__).resolve().parents[1] / "kdlab" / "assets" / "tiny"
    saved = json.loads((tiny / "metrics.json").read_text(encoding="utf-8"))
    card = (tiny / "MODEL_CARD.md").read_text(encoding="utf-8")
    generated = model_card(saved["recipe"], saved["measured"])
    assert card.startswith(generated) and card[len(generated):].lstrip().startswith("## How these files were produced")


def test_the_builds_draw_rows_in_the_order_the_packaged_models_were_trained_with(tmp_path):
    """SFTModule's data order is now rank-aware and resumable (drawn from (seed, epoch)); the builds keep the order the
    packaged models were trained with (a ``RandomSampler`` on a generator seeded with ``seed``, one permutation per
    epoch from the same generator), so that they rebuild those models."""
    import json

    import torch

    from kdlab.tiny.build import whole_logits_sft

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "completion": str(i + 1)}) + "\n" for i in range(6)))
    module = whole_logits_sft()("kdlab://tiny/teacher", dataset=str(data), batch_size=2, seed=0)
    loader = module.train_dataloader()
    # the loader the packaged models were trained with (over the rows themselves; the order depends on their number only)
    before = torch.utils.data.DataLoader(range(6), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(0), collate_fn=list)
    for _ in range(2):  # two epochs, each drawing from the one generator
        expected = [module.encoded[i] for batch in before for i in batch]
        assert [row for batch in loader for row in batch] == expected


def test_the_builds_train_with_the_loss_the_packaged_models_were_trained_with(tmp_path):
    """``python -m kdlab.tiny ...`` trains with cross-entropy over the whole upcast logits, padded head rows in
    the normaliser (:func:`kdlab.tiny.build.whole_logits_sft`), not SFTModule's chunked loss over the tokenizer's
    tokens: on the packaged teacher, whose head has a padding row, the two differ, and the build's is the old one."""
    import json

    import torch

    from kdlab.stages.sft import SFTModule
    from kdlab.tiny.build import whole_logits_sft

    rows = [{"prompt": "1+2=", "completion": "3"}, {"prompt": "10+20=", "completion": "30 and more"}]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    built, chunked = (cls("kdlab://tiny/teacher", dataset=str(data)) for cls in (whole_logits_sft(), SFTModule))
    assert issubclass(whole_logits_sft(), SFTModule) and built.model.get_output_embeddings().weight.shape[0] > len(built.tokenizer)
    batch = built.collate(built.rows)
    logits = built.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    whole = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), batch["labels"][:, 1:].reshape(-1), ignore_index=-100)
    assert torch.equal(built.loss(batch), whole)
    # SFTModule's own loss normalises over the tokenizer's tokens: the padding row's mass leaves the normaliser
    columns = len(built.tokenizer)
    tokens_only = torch.nn.functional.cross_entropy(logits[:, :-1, :columns].reshape(-1, columns).float(), batch["labels"][:, 1:].reshape(-1),
                                                    ignore_index=-100)
    torch.testing.assert_close(chunked.loss(batch), tokens_only, rtol=1e-5, atol=1e-6)
    assert not torch.isclose(tokens_only, whole, rtol=1e-6, atol=0)
