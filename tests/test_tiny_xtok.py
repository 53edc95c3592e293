"""The cross-tokenizer teacher (``kdlab://tiny/teacher-xtok``, issue #27): a teacher whose vocabulary is not
the packaged one. Each test checks a sentence of its model card."""

import json

import pytest

from kdlab.models import ModelSpec, load_causal_lm, load_tokenizer
from kdlab.models.loading import ASSETS

XTOK = ASSETS / "tiny" / "teacher-xtok"
MESSAGES = [{"role": "user", "content": "Numbers: [3, 7, 25]\nTarget: 96"}]
TEXTS = ["<think>Numbers [6, 15, 50], target 285.\n50*6=300 leaves [15, 300].\n</think>\n<answer>50*6=300,300-15=285</answer>",
         "Razona solo en español. Add the numbers. Put the sum in <answer></answer>.\n12+30"]


@pytest.fixture(scope="module")
def tokenizers():
    return {role: load_tokenizer(ModelSpec(f"kdlab://tiny/{role}")) for role in ("student", "teacher-xtok")}


def test_the_cross_tokenizer_teacher_loads_with_padded_embedding_rows(tokenizers):
    model = load_causal_lm(ModelSpec("kdlab://tiny/teacher-xtok"))
    assert type(model).__name__ == "Qwen2ForCausalLM"  # its recipe's architecture (TEACHER_XTOK)
    rows = model.get_output_embeddings().weight.shape[0]
    assert rows > len(tokenizers["teacher-xtok"]) and rows % 64 == 0
    assert model.generation_config.eos_token_id == tokenizers["teacher-xtok"].convert_tokens_to_ids("<|im_end|>")


def test_another_vocabulary_with_other_ids_that_spells_task_text_with_the_same_strings(tokenizers):
    """999 tokens against 447, other ids for the same strings (the tags, most merges); as loaded (Qwen2Tokenizer
    splits digits) the same token strings on the tiny world's text: the vocabulary map translates every id."""
    student, teacher = tokenizers["student"], tokenizers["teacher-xtok"]
    assert (len(teacher), len(student)) == (999, 447) and teacher.get_vocab() != student.get_vocab()
    shared = set(teacher.get_vocab()) & set(student.get_vocab())
    moved = [token for token in shared if teacher.get_vocab()[token] != student.get_vocab()[token]]
    assert teacher.convert_tokens_to_ids("<think>") != student.convert_tokens_to_ids("<think>")
    merges = [token for token in shared if len(token) > 1 and not token.startswith("<")]
    assert sum(token in moved for token in merges) > len(merges) / 2  # most merges have other ids
    for text in TEXTS:
        t_ids, s_ids = teacher(text, add_special_tokens=False)["input_ids"], student(text, add_special_tokens=False)["input_ids"]
        assert teacher.convert_ids_to_tokens(t_ids) == student.convert_ids_to_tokens(s_ids) and t_ids != s_ids
    assert len(teacher("24", add_special_tokens=False)["input_ids"]) == 2  # digits one by one, as loaded


def test_its_chat_markup_is_the_same_text_as_the_students(tokenizers):
    rendered = {role: tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) for role, tok in tokenizers.items()}
    assert rendered["teacher-xtok"] == rendered["student"]
    for role, tok in tokenizers.items():
        assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>", role
        assert len(tok.tokenize("<think></think><answer></answer>")) == 4, role  # the tags are single tokens


def test_its_metrics_reach_the_target_and_the_model_card_states_them():
    saved = json.loads((XTOK / "metrics.json").read_text())
    xtok = saved["measured"]["teacher-xtok"]
    assert xtok["countdown3_accuracy"] >= 0.70
    card = (XTOK / "MODEL_CARD.md").read_text(encoding="utf-8")
    assert f"| teacher-xtok greedy Countdown-3 accuracy | {xtok['countdown3_accuracy']:.3f} | >= 0.7 | yes |" in card
    assert f"| teacher-xtok | {xtok['countdown3_accuracy']:.3f} | {xtok['spanish_prompt_accuracy']:.3f} | " \
           f"{xtok['countdown4e_accuracy']:.3f} | {xtok['parameters']:,} |" in card
    assert f"Build time on this machine: {saved['measured']['build_seconds']} s." in card


def test_it_solves_a_few_held_out_problems():
    """A cheap check of the card's Countdown-3 claim on 12 held-out problems (the card measures 200)."""
    from kdlab.evaluation.scoring import accuracy, completion_texts
    from kdlab.tiny.world import countdown

    spec = ModelSpec("kdlab://tiny/teacher-xtok")
    model, tokenizer = load_causal_lm(spec), load_tokenizer(spec)
    task = countdown(num_train=0, num_val=12, num_test=0)
    examples = task.examples("val")
    assert accuracy(task, examples, completion_texts(model, tokenizer, task, examples, max_new_tokens=80)) >= 0.5


@pytest.fixture(scope="module")
def built():
    """The tokenizer :data:`~kdlab.tiny.xtok.TEACHER_XTOK` trains (deterministic), before it is saved beside a model."""
    from kdlab.tiny.xtok import xtok_tokenizer

    return xtok_tokenizer()


def test_the_packaged_folder_is_what_its_recipe_builds(built, tokenizers):
    """The recipe in kdlab/tiny/xtok.py is the packaged folder's: the same recipe record and architecture, the
    vocabulary and merges its tokenizer step trains (digit runs kept together: multi-digit tokens such as '24'), and a
    model card written from them. As loaded (a Qwen2 folder: ``Qwen2Tokenizer``) digits are one token each, so those
    tokens are never produced (before: the recipe said Llama, numbers kept whole, and the card said so)."""
    from kdlab.tiny.xtok import TEACHER_XTOK, check_loads_as_recipe, keeps_numbers_whole, teacher_xtok_card

    saved = json.loads((XTOK / "metrics.json").read_text())
    assert saved["recipe"] == TEACHER_XTOK
    assert json.loads((XTOK / "config.json").read_text())["model_type"] == TEACHER_XTOK["architecture"] == "qwen2"
    folder, trained = json.loads((XTOK / "tokenizer.json").read_text()), json.loads(built.backend_tokenizer.to_str())
    for key in ("vocab", "merges"):
        assert folder["model"][key] == trained["model"][key], key
    assert folder["added_tokens"] == trained["added_tokens"]
    teacher = json.loads((XTOK.parent / "metrics.json").read_text())["measured"]["teacher"]
    assert (XTOK / "MODEL_CARD.md").read_text(encoding="utf-8") == teacher_xtok_card(saved["recipe"], saved["measured"], teacher)
    # the property: trained with digit runs together, loaded with digits one by one
    assert not keeps_numbers_whole(TEACHER_XTOK) and built.tokenize("24") == ["24"]
    loaded = tokenizers["teacher-xtok"]
    multi_digit = [token for token in loaded.get_vocab() if len(token) > 1 and token.isdigit()]
    assert "24" in multi_digit
    ids = loaded("Numbers [6, 15, 50], target 285. 2024", add_special_tokens=False)["input_ids"]
    assert not set(loaded.convert_ids_to_tokens(ids)) & set(multi_digit)
    check_loads_as_recipe(XTOK, built, TEACHER_XTOK)


def test_the_build_refuses_a_folder_whose_tokenizer_loads_otherwise_than_its_recipe_says(built, tmp_path):
    """The check the build runs before training: the packaged Qwen2 folder is refused for a recipe that wants numbers kept
    whole; a Llama folder with the same tokenizer loads as built and keeps numbers whole, as ``architecture: llama`` says."""
    from kdlab.tiny.build import padded_rows, save_pair
    from kdlab.tiny.xtok import TEACHER_XTOK, check_loads_as_recipe, keeps_numbers_whole, tiny_llama

    llama = {**TEACHER_XTOK, "architecture": "llama"}
    assert keeps_numbers_whole(llama)
    with pytest.raises(RuntimeError, match=r"loads as Qwen2Tokenizer, which tokenizes '2024' as \['2', '0', '2', '4'\].*architecture 'llama'"):
        check_loads_as_recipe(XTOK, built, llama)
    model = tiny_llama(len(built), hidden=8, layers=1, heads=2, embedding_rows=padded_rows(len(built)),
                       eos_token_id=built.eos_token_id, pad_token_id=built.pad_token_id)
    save_pair(tmp_path, built, {"llama": model})
    check_loads_as_recipe(tmp_path / "llama", built, llama)
    with pytest.raises(RuntimeError, match="architecture 'qwen2'"):
        check_loads_as_recipe(tmp_path / "llama", built, TEACHER_XTOK)
