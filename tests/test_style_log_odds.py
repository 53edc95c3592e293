"""StyleLogOdds: the log-odds of a Spanish over an English correct answer, checked against one unpadded forward
per prompt; answer templates and worked-answer demonstrations filled from the task's gold answer."""

import json

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from kdlab.callbacks import StyleLogOdds
from kdlab.callbacks.style_log_odds import template_logprobs
from kdlab.stages import DistillModule
from kdlab.tasks import Addition, Counting, Countdown


def rows(trainer):
    return [json.loads(line) for line in open(f"{trainer.log_dir}/metrics.jsonl")]


def one_at_a_time(model, tokenizer, prompt, completion):
    """Mean log-prob per completion token, one sequence, no padding, log_softmax in fp64."""
    p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    c = tokenizer(completion, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([p + c])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()
    logp = torch.log_softmax(logits, -1)
    return sum(logp[len(p) - 1 + i, token].item() for i, token in enumerate(c)) / len(c)


def test_log_odds_match_one_unpadded_forward_per_prompt_and_move_with_the_student(tiny_pair, tmp_path):
    task = Addition(max_digits=2, num_train=8, num_val=7, system_prompt="")
    module = DistillModule(*tiny_pair, task, max_completion_tokens=6, batch_size=4)
    trainer = pl.Trainer(accelerator="cpu", logger=TensorBoardLogger(tmp_path), enable_progress_bar=False)
    callback = StyleLogOdds(examples=7, batch_size=3)  # 3 batches of different padded widths, the last one short
    callback.on_fit_start(trainer, module)
    tokenizer, student = module.student_tokenizer, module.student.eval()
    expected = []
    for example in task.examples("val"):
        prompt = task.render(tokenizer, task.student_messages(example))
        total = example["a"] + example["b"]
        expected.append(one_at_a_time(student, tokenizer, prompt, f"La respuesta es {total}.")
                        - one_at_a_time(student, tokenizer, prompt, f"The answer is {total}."))
    expected = torch.tensor(expected)
    (before,) = rows(trainer)
    assert before["style/log_odds_before"] == pytest.approx(expected.mean().item(), abs=1e-5)
    assert before["style/log_odds_spanish_share_before"] == pytest.approx((expected > 0).double().mean().item())
    with torch.no_grad():  # move the student: the measure follows it
        module.student.lm_head.weight.mul_(0.5)
    callback.measure(trainer, module)
    after = rows(trainer)[-1]
    assert after["style/log_odds"] != pytest.approx(before["style/log_odds_before"], abs=1e-4)
    assert after["style/log_odds_delta"] == pytest.approx(after["style/log_odds"] - before["style/log_odds_before"], abs=1e-6)
    restored = StyleLogOdds()
    restored.load_state_dict(callback.state_dict())
    assert restored.before == callback.before


def test_template_logprobs_are_independent_of_the_batch_they_share(tiny_pair):
    from kdlab.models import ModelSpec, load_causal_lm, load_tokenizer

    spec = ModelSpec(tiny_pair[0])
    tokenizer, model = load_tokenizer(spec, "student"), load_causal_lm(spec, "student").eval()
    prompts, completions = ["a short one", "a much longer prompt than the first one here"], ["The answer is 7.", "La respuesta es 12."]
    with torch.no_grad():
        together = template_logprobs(model, tokenizer, prompts, completions, torch.device("cpu"), batch_size=2)
        apart = torch.cat([template_logprobs(model, tokenizer, [p], [c], torch.device("cpu")) for p, c in zip(prompts, completions)])
    torch.testing.assert_close(together, apart, atol=1e-5, rtol=0)


def test_bad_templates_are_named():
    with pytest.raises(ValueError, match="exactly the keys 'spanish' and 'english'"):
        StyleLogOdds(templates={"spanish": "{answer}"})
    with pytest.raises(ValueError, match=r"templates\['english'\] must contain \{answer\}"):
        StyleLogOdds(templates={"spanish": "{answer}", "english": "The answer."})


def test_a_worked_answer_demonstration_is_filled_from_the_gold_answer():
    task = Addition(max_digits=1, num_val=3, system_prompt="", teacher_instruction="Responde solo en español.",
                    teacher_demonstration="Ejemplo de respuesta correcta: {a} + {b} = {answer}. La respuesta es {answer}.")
    example = task.examples("val")[0]
    user = task.teacher_messages(example)[-1]["content"]
    total = example["a"] + example["b"]
    assert user == (f"Ejemplo de respuesta correcta: {example['a']} + {example['b']} = {total}. La respuesta es {total}.\n\n"
                    f"{task.user_prompt(example)}\n\nResponde solo en español.")
    assert task.student_messages(example)[-1]["content"] == task.user_prompt(example)  # the student never sees it
    counting = Counting(num_val=1, teacher_demonstration="Hay {answer}.")
    row = counting.examples("val")[0]
    assert counting.teacher_messages(row)[-1]["content"].startswith(f"Hay {row['word'].count(row['letter'])}.\n\n")
    with pytest.raises(ValueError, match=r"teacher_demonstration 'x \{c\}' names 'c' which Addition examples lack"):
        Addition(num_val=1, teacher_demonstration="x {c}").teacher_messages(task.examples("val")[0])
    with pytest.raises(ValueError, match="Countdown.gold_answer gives nothing .* teacher_demonstration needs the answer"):
        countdown = Countdown(num_train=0, num_val=1, num_test=0, teacher_demonstration="{answer}")
        countdown.teacher_messages(countdown.examples("val")[0])
