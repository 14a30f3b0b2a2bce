"""Chat prompts, token in and token out, on the real SmolLM2 chat model: the template is applied once, the engine
samples from exactly those ids, they are stored and trained on, and an agent's later turn extends its earlier
ids (prompt + reply as sampled) instead of re-tokenizing the conversation's text."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from pydantic import BaseModel, ConfigDict

from marl_pipeline.environment import ActionResult, EvaluationCase, register_environment
from marl_pipeline.inference.chat import ChatPromptError, ChatSession, ChatTokenizer, load_chat_tokenizer
from marl_pipeline.store import MicroBatchKey
from tests.sampling import requests
from tests.test_model_sources import needs_smollm2

SYSTEM = {"role": "system", "content": "Answer with one number."}
IM_END = 2  # SmolLM2's <|im_end|>: its chat template's end-of-turn token and its eos


class ChatTwice:
    """Tests-only plugin: the solver answers a sum in chat, the environment replies, and so on for three turns
    (each later prompt repeats the conversation so far, the solver's replies and the replies to them)."""

    name = "chat_twice"
    turn_order = ("solver", "solver", "solver")

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")

    def __init__(self, options) -> None:
        pass

    def sample_tasks(self, rng, count):
        return [{"id": f"t{i}", "a": int(rng.integers(1, 9)), "b": int(rng.integers(1, 9))} for i in range(count)]

    def render_prompt(self, role, task, transcript):
        messages = [SYSTEM, {"role": "user", "content": f"What is {task['a']} + {task['b']}?"}]
        for turn in transcript:
            messages += [{"role": "assistant", "content": turn.text}, {"role": "user", "content": turn.observation}]
        return messages

    def observe(self, role, task, transcript):
        return "Right. Say it again." if str(task["a"] + task["b"]) in transcript[-1].text else "Wrong. Try again."

    def execute(self, task, transcript):
        return [ActionResult("said", True) for _ in transcript]

    def score(self, task, transcript, results):
        return {"solver": float(str(task["a"] + task["b"]) in transcript[-1].text)}

    def text_corpus(self, rng, count):
        return []

    def warmup_examples(self, role, rng, count):
        return []

    def evaluation_cases(self, role, rng, count):
        return [EvaluationCase(task, [], str(task["a"] + task["b"])) for task in self.sample_tasks(rng, count)]

    def evaluate(self, role, cases, responses):
        return {"accuracy": float(np.mean([c.label in r for c, r in zip(cases, responses)]))}

    def answer_of(self, role, response):
        return response.strip()[:8]


register_environment(ChatTwice)


def _session(tokenizer) -> ChatSession:
    return ChatSession("chat_twice", lambda role: tokenizer)


@pytest.fixture(scope="module")
def chat_tokenizer(smollm2_dir) -> ChatTokenizer:
    return load_chat_tokenizer(str(smollm2_dir))


@needs_smollm2
def test_a_later_turn_extends_the_earlier_ids_as_the_template_would_render_them(chat_tokenizer) -> None:
    """With a reply whose ids are its text's own tokenization, extending the ids gives exactly the template of the
    whole conversation: the end-of-turn token and the template's glue are where the template puts them, whether
    the reply stopped on the end-of-turn token or ran out of tokens without it."""
    tokenizer = chat_tokenizer.tokenizer
    env = ChatTwice(None)
    task = {"id": "t", "a": 2, "b": 3}
    reply = "The answer is 5."
    reply_ids = tokenizer(reply, add_special_tokens=False)["input_ids"]
    for sampled in ([*reply_ids, IM_END], reply_ids):  # stopped on <|im_end|>; cut off by max_tokens
        session = _session(chat_tokenizer)
        first = env.render_prompt("solver", task, [])
        first_ids = session.request(0, "solver", 0, first)
        expected_first = tokenizer.apply_chat_template(first, add_generation_prompt=True, return_dict=True)
        assert first_ids == expected_first["input_ids"]
        session.record(0, "solver", reply, sampled)
        second = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "Sure?"}]
        second_ids = session.request(0, "solver", 1, second)
        assert second_ids[:len(first_ids) + len(sampled)] == first_ids + sampled  # extended, never re-tokenized
        assert second_ids == tokenizer.apply_chat_template(second, add_generation_prompt=True,
                                                           return_dict=True)["input_ids"]
        assert session.prompt_text("solver", second_ids).endswith(
            "The answer is 5.<|im_end|>\n<|im_start|>user\nSure?<|im_end|>\n<|im_start|>assistant\n")


@needs_smollm2
def test_sampled_ids_are_kept_even_where_the_text_tokenizes_differently(chat_tokenizer) -> None:
    """The reason for token in, token out: a reply sampled as single characters decodes to text that the tokenizer
    would encode otherwise; the next prompt still holds the sampled ids."""
    tokenizer = chat_tokenizer.tokenizer
    sampled = [tokenizer.convert_tokens_to_ids(c) for c in "Hello"] + [IM_END]
    text = tokenizer.decode(sampled, skip_special_tokens=True)
    assert tokenizer(text, add_special_tokens=False)["input_ids"] != sampled[:-1]  # the text drifts
    session = _session(chat_tokenizer)
    first = [SYSTEM, {"role": "user", "content": "Say hello."}]
    first_ids = session.request(3, "solver", 0, first)
    session.record(3, "solver", text, sampled)
    second = session.request(3, "solver", 1, [*first, {"role": "assistant", "content": text},
                                              {"role": "user", "content": "Again."}])
    assert second[len(first_ids):len(first_ids) + len(sampled)] == sampled


@needs_smollm2
def test_bad_chat_prompts_name_the_environment_role_and_turn(chat_tokenizer, tiny_model_dir) -> None:
    first = [SYSTEM, {"role": "user", "content": "What is 1 + 1?"}]
    session = _session(chat_tokenizer)
    session.request(0, "solver", 0, first)
    session.record(0, "solver", "2", [17, IM_END])
    with pytest.raises(ChatPromptError, match=r"environment 'chat_twice', role 'solver', turn 1: the messages must "
                                              r"start with the 2 messages.*message 2 should be its previous reply: "
                                              r"expected \{'role': 'assistant', 'content': '2'\}, got .*'3'"):
        session.request(0, "solver", 1, [*first, {"role": "assistant", "content": "3"},
                                         {"role": "user", "content": "?"}])
    with pytest.raises(ChatPromptError, match=r"turn 1: .*message 0 should be one it was shown"):
        session.request(0, "solver", 1, [{"role": "user", "content": "other"}])
    with pytest.raises(ChatPromptError, match=r"turn 1: render_prompt returned a str after chat messages"):
        session.request(0, "solver", 1, "plain text")
    session.request(1, "solver", 0, "plain text")
    with pytest.raises(ChatPromptError, match=r"turn 1: render_prompt returned chat messages after a str"):
        session.request(1, "solver", 1, first)
    with pytest.raises(ChatPromptError, match=r"turn 0: message 1 has role 'tool'.*roles are"):
        session.request(2, "solver", 0, [SYSTEM, {"role": "tool", "content": "x"}])
    with pytest.raises(ChatPromptError, match=r"turn 0: message 0 is .*exactly the keys 'role' and 'content'"):
        session.request(2, "solver", 0, [{"role": "user"}])
    with pytest.raises(ChatPromptError, match=r"turn 0: the last message is the assistant's"):
        session.request(2, "solver", 0, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    with pytest.raises(ChatPromptError, match=r"turn 0: render_prompt returned int"):
        session.request(2, "solver", 0, 7)
    # The built-in tiny model has no chat template: plain strings work for it, messages are refused up front.
    tiny = ChatSession("chat_twice", lambda role: load_chat_tokenizer(str(tiny_model_dir)))
    assert tiny.request(0, "solver", 0, "1+2=") == "1+2="
    with pytest.raises(ChatPromptError, match=rf"role 'solver', turn 0: the tokenizer of {tiny_model_dir} has no "
                                              r"chat template.*or have the environment render a str"):
        tiny.request(1, "solver", 0, first)


@pytest.fixture(scope="module")
def chat_run(local_ray, smollm2_dir, tmp_path_factory):
    """A one-agent run of ``chat_twice`` on SmolLM2, its base policy committed to a fresh store."""
    from marl_pipeline.bootstrap.policies import prepare_base_policies
    from marl_pipeline.config import parse_config
    from marl_pipeline.environment import build_environment
    from marl_pipeline.store import ExperienceStore

    config = parse_config({
        "run": "chat", "seed": 0, "store": str(tmp_path_factory.mktemp("chat") / "store"),
        "environment": {"name": "chat_twice"},
        "agents": {"solver": {"model": str(smollm2_dir), "warmup": {"steps": 0},
                              "engine": {"max_model_len": 512}}},
        "pipeline": {"steps": 1, "prompts_per_micro_batch": 2, "samples_per_prompt": 2, "micro_batches_per_step": 1},
        "algorithm": {"max_new_tokens": 64},
        "evaluation": {"cases_per_agent": 4},
        "ray": {"keep_actors": True},  # the recomputations and the evaluation below take one engine in turn
    })
    store = ExperienceStore(config.store)
    prepare_base_policies(config, build_environment("chat_twice", {}), store)
    return config, store


@pytest.mark.launch
@needs_smollm2
def test_engine_stored_and_trainer_ids_are_the_templates_and_a_recomputation_repeats_them(chat_run,
                                                                                         chat_tokenizer) -> None:
    from marl_pipeline.cluster.specs import trainer_options
    from marl_pipeline.stages.recompute import recompute_stage
    from marl_pipeline.stages.training import train_batch_for
    from marl_pipeline.training.losses import pad_sequences
    from marl_pipeline.training.trainer import PolicyTrainer

    config, store = chat_run
    key = MicroBatchKey("chat", 0, 0)
    tokenizer = chat_tokenizer.tokenizer
    env = ChatTwice(None)
    _, rollouts, _ = recompute_stage("rollouts", config, store, key)
    rows = sorted(rollouts.to_pylist(), key=lambda r: (r["episode"], r["turn"]))
    assert len(rows) == 2 * 2 * 3 and {r["status"] for r in rows} == {"ok"}
    for row in rows[::3]:
        # Turn 0: the engine sampled from (and stored) exactly the ids the template gives; no BOS added by vLLM.
        messages = env.render_prompt("solver", json.loads(row["task"]), [])
        assert row["turn"] == 0 and row["prompt_ids"] == tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    later = [(first, second) for first, second in itertools.pairwise(rows) if second["turn"] == first["turn"] + 1]
    for first, second in later:
        # A later turn: the earlier turn's ids as sampled, then <|im_end|> only if the reply lacks it (cut off by
        # max_tokens), then ChatML's glue, the environment's reply and the generation prompt.
        assert (first["response_ids"][-1] == IM_END) == (first["finish_reason"] == "stop")
        closing = [] if first["finish_reason"] == "stop" else [IM_END]
        glue = tokenizer(f"\n<|im_start|>user\n{first['observation']}<|im_end|>\n<|im_start|>assistant\n",
                         add_special_tokens=False)["input_ids"]
        assert second["prompt_ids"] == first["prompt_ids"] + first["response_ids"] + closing + glue
        assert second["prompt_text"] == tokenizer.decode(second["prompt_ids"])  # display text: the ids decoded
    # Both ends of a turn were extended (seeded sampling, so this holds run to run): a reply that stopped on
    # <|im_end|> and one that max_new_tokens cut off.
    assert {first["finish_reason"] for first, _ in later} == {"stop", "length"}

    # The trainer is given exactly the stored ids, and its logprobs of the sampled tokens agree with the engine's
    # (they would not if either had seen other ids, e.g. an extra BOS or a re-tokenized history).
    recompute_stage("environment_results", config, store, key)
    recompute_stage("rewards", config, store, key)
    batch = train_batch_for(store, key, "solver")
    stored = {r["sample_id"]: r for r in rows}
    by_order = [stored[s] for s in sorted(stored)]
    assert batch.prompt_ids == [r["prompt_ids"] for r in by_order]
    input_ids, attention_mask, _ = pad_sequences(batch.prompt_ids, batch.response_ids, 0)
    for row, r in enumerate(by_order):
        width = int(attention_mask[row].sum())
        assert input_ids[row, :width].tolist() == r["prompt_ids"] + r["response_ids"]
    trainer = PolicyTrainer(str(store.policy_dir("chat", "solver", 0)), 0,
                            **trainer_options(config.agent_slice("solver")))
    for r in by_order:
        trained = trainer.completion_logprobs(r["prompt_ids"], r["response_ids"])
        assert np.abs(np.asarray(trained) - np.asarray(r["logprobs"])).max() < 1e-3  # measured: under 6e-5

    # A recomputed rollout (the engine restarted at the same version, same seeds) gives the same ids.
    _, again, _ = recompute_stage("rollouts", config, store, key)
    ids = ("sample_id", "prompt_ids", "response_ids")
    assert again.select(ids).sort_by("sample_id").to_pylist() == rollouts.select(ids).sort_by("sample_id").to_pylist()


@pytest.mark.launch
@needs_smollm2
def test_evaluation_tokenizes_chat_cases_once_and_plain_strings_still_work(chat_run, chat_tokenizer) -> None:
    import ray

    from marl_pipeline.cluster import warm_actors
    from marl_pipeline.cluster.spawn import start_engines
    from marl_pipeline.stages.evaluation import EvaluationSettings, evaluate_agent, evaluation_cases

    config, store = chat_run
    env = ChatTwice(None)
    tokenizer = chat_tokenizer.tokenizer
    engine = start_engines(config, store, {"solver": 0})["solver"]
    try:
        settings = EvaluationSettings.from_config(config)
        table = evaluate_agent(env, "solver", engine, settings)
        cases = evaluation_cases(env, "solver", settings)
        for case, row in zip(cases, table.to_pylist()):
            messages = env.render_prompt("solver", case.task, case.transcript)
            assert row["prompt_text"] == tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                       tokenize=False)
        # A plain string is tokenized by vLLM as before; Completion.prompt_ids are the ids it used.
        _, (completion,) = ray.get(engine.generate.remote(requests(["What is 2 + 2?"], [0], 4, 0.0)))
        assert completion.prompt_ids == tokenizer("What is 2 + 2?")["input_ids"]
        with pytest.raises(TypeError, match=r"prompt 1: expected a str or a non-empty list of int token ids"):
            ray.get(engine.generate.remote(requests(["ok", []], [0, 1], 4, 0.0)))
    finally:
        warm_actors.release(engine, keep=False)  # started through the kept-actor registry: leave it, not just kill


def test_engine_prompts_are_checked_before_vllm() -> None:
    from marl_pipeline.inference.engine import engine_prompt

    assert engine_prompt("prompt 0", "text") == "text"
    assert engine_prompt("prompt 0", [1, 2]) == {"prompt_token_ids": [1, 2]}
    for bad in ([], [1, "2"], [1.0], (1, 2), None):
        with pytest.raises(TypeError, match=r"prompt 3: expected a str or a non-empty list of int token ids"):
            engine_prompt("prompt 3", bad)
