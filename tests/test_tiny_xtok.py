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
    assert type(model).__name__ == "Qwen2ForCausalLM"  # the first version of the build (its model card says so)
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
