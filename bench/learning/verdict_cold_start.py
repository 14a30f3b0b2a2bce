"""Probe: the verifier's verdict cold start on SmolLM2-135M, with and without rehearsing its working.

For each ``--rehearse`` share, the base model is warmed up as ``warmup_turns: verdict`` does it (bootstrap/warmup.py,
environments/math_worked.py), then measured on the run's held-out verifier cases with greedy decoding through
transformers (not vLLM), as the evaluations asset plays them: the working, then the verdict on the shown answer.
Also the working at temperature 1 on the same questions (``--samples`` each): its accuracy and the share that
states a number, the exploration RL starts from. Version 0 of a run is the warmed-up model, so these are its
starting skills.

    .venv/bin/python -m bench.learning.verdict_cold_start --config configs/smollm2_arithmetic.yaml \
        --rehearse 0 0.5 --lr 3e-5
"""

from __future__ import annotations

import argparse
import itertools
import time
from dataclasses import replace

import numpy as np
import torch

from environments.math_answers import same_answer, stated_answer
from marl_pipeline.bootstrap.model_sources import resolve_model_source
from marl_pipeline.bootstrap.own_replies import sample_replies
from marl_pipeline.bootstrap.warmup import supervised_warmup, warmup_trainer
from marl_pipeline.config import load_config
from marl_pipeline.environment import Turn, build_environment
from marl_pipeline.inference.chat import ChatTokenizer
from marl_pipeline.policy.checkpoint import load_policy
from marl_pipeline.stages.evaluation import EvaluationSettings, evaluation_cases
from marl_pipeline.training.losses import pad_sequences, token_logprobs


def _replies(model, chat: ChatTokenizer, conversations, *, greedy: bool, max_new_tokens: int) -> list[str]:
    prompts = [chat.first_ids(messages) for messages in conversations]
    eos = chat.tokenizer.eos_token_id
    if greedy:
        from transformers import GenerationConfig
        generation = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos,
                                      pad_token_id=eos)
        ids = []
        for prompt in prompts:
            output = model.generate(input_ids=torch.tensor([prompt]), generation_config=generation)
            ids.append(output[0, len(prompt):].tolist())
    else:
        ids = sample_replies(model, prompts, max_new_tokens=max_new_tokens, temperature=1.0, eos=eos, pad=eos)
    return [chat.tokenizer.decode(row, skip_special_tokens=True) for row in ids]


@torch.no_grad()
def _drift(model, base, chat: ChatTokenizer, questions, settings: EvaluationSettings) -> float:
    """How far the working moved: the mean per-token log-likelihood the base model gives its own sampled workings
    (temperature 1) minus the one ``model`` gives them (0: unchanged)."""
    prompts = [chat.first_ids(messages) for messages in questions]
    eos = chat.tokenizer.eos_token_id
    torch.manual_seed(2)
    replies = sample_replies(base, prompts, max_new_tokens=settings.max_new_tokens["verifier"], temperature=1.0,
                             eos=eos, pad=eos)
    input_ids, attention_mask, mask = pad_sequences(prompts, replies, eos)
    return float(((token_logprobs(base, input_ids, attention_mask) - token_logprobs(model, input_ids, attention_mask))
                  * mask).sum() / mask.sum())


@torch.no_grad()
def measure(model, env, chat: ChatTokenizer, settings: EvaluationSettings, samples: int, base=None) -> dict[str, float]:
    model.eval()
    cases = evaluation_cases(env, "verifier", settings)
    questions = [env.render_prompt("verifier", case.task, list(case.transcript)) for case in cases]
    workings = _replies(model, chat, questions, greedy=True, max_new_tokens=settings.max_new_tokens["verifier"])
    played = [replace(case, transcript=[*case.transcript, Turn("verifier", working)])
              for case, working in zip(cases, workings)]
    asks = [env.render_prompt("verifier", case.task, case.transcript) for case in played]
    verdicts = _replies(model, chat, asks, greedy=True, max_new_tokens=settings.max_new_tokens["verifier"])
    metrics = env.evaluate("verifier", played, verdicts)
    sampled = _replies(model, chat, [q for q in questions for _ in range(samples)], greedy=False,
                       max_new_tokens=settings.max_new_tokens["verifier"])
    tasks = [case.task for case in cases for _ in range(samples)]
    metrics["working_accuracy_t1"] = float(np.mean([env.grade(task, text) >= 1 for task, text in zip(tasks, sampled)]))
    metrics["working_drift"] = _drift(model, base, chat, questions, settings) if base is not None else 0.0
    metrics["states_a_number_t1"] = float(np.mean([stated_answer(text) is not None for text in sampled]))
    says_yes = np.array([v.strip().lower().startswith("yes") for v in verdicts])
    same = np.array([same_answer(case.transcript[-1].text, case.transcript[0].text) for case in played])
    metrics["yes_share"] = float(says_yes.mean())
    # The comparison itself, whatever the working's truth: "Yes" when the shown answer is its own, and when not.
    metrics["p_yes_same"] = float(says_yes[same].mean()) if same.any() else float("nan")
    metrics["p_yes_different"] = float(says_yes[~same].mean()) if (~same).any() else float("nan")
    metrics["same_cases"] = float(same.sum())
    return metrics


def _own_working_examples(model, env, chat: ChatTokenizer, config, *, count: int, share: float):
    """``--own-workings``: verdict examples whose working is the model's own reply to the question (sampled at
    temperature 1), not the noisy teacher's, each labelled by whether the shown answer is the same as it; and
    rehearsals (the question, no completion) at ``share``."""
    rng = np.random.default_rng(1)
    tasks = env.sample_tasks(rng, count)
    episodes = [env.episode_task(task, index) for index, task in enumerate(tasks)]
    questions = [env.render_prompt("verifier", episode, []) for episode in episodes]
    workings = _replies(model, chat, questions, greedy=False,
                        max_new_tokens=config.algorithm_of("verifier").max_new_tokens)
    examples = []
    for episode, question, working in zip(episodes, questions, workings):
        if rng.random() < share:
            examples.append((question, None))
            continue
        transcript = [Turn("solver", env.source.other_answer(episode, rng) or episode["answer"]),
                      Turn("verifier", working)]
        label = "Yes" if same_answer(working, env.shown_answer(episode, transcript)) else "No"
        examples.append((env.render_prompt("verifier", episode, transcript), label))
    return examples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/smollm2_arithmetic.yaml")
    parser.add_argument("--rehearse", type=float, nargs="+", default=[0.0, 0.5])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, nargs="+", default=[3e-5])
    parser.add_argument("--own-workings", action="store_true",
                        help="verdict examples on the model's own sampled workings, not the noisy teacher's")
    parser.add_argument("--no-base", action="store_true", help="skip measuring the base model")
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = load_config(args.config)
    settings = EvaluationSettings.from_config(config)
    options = {**config.environment.options, "quote_own_answer": True, "warmup_turns": "verdict"}
    base, tokenizer = load_policy(resolve_model_source(config.agents["verifier"].model))
    chat = ChatTokenizer(tokenizer, "the verifier")
    env = build_environment(config.environment.name, options)
    rows = [] if args.no_base else [("base", measure(base, env, chat, settings, args.samples), 0.0)]
    for share, lr in itertools.product(args.rehearse, args.lr):
        env = build_environment(config.environment.name, {**options, "rehearse_working": share})
        trainer = warmup_trainer(str(resolve_model_source(config.agents["verifier"].model)), lr=lr, seed=1,
                                 dtype=config.agents["verifier"].trainer.dtype,
                                 chunk_tokens=config.agents["verifier"].trainer.chunk_tokens)
        model = trainer.model
        torch.manual_seed(config.seed)
        start = time.perf_counter()
        examples = (_own_working_examples(model, env, chat, config, count=600, share=share) if args.own_workings
                    else env.warmup_examples("verifier", np.random.default_rng(1), 4000))
        losses = supervised_warmup(trainer, examples, steps=args.steps, batch_size=args.batch_size, seed=1,
                                   max_new_tokens=config.algorithm_of("verifier").max_new_tokens,
                                   temperature=config.algorithm_of("verifier").temperature)
        seconds = time.perf_counter() - start
        print(f"rehearse {share}, lr {lr}: loss {losses[0]:.3f} -> {losses[-1]:.3f} in {seconds:.0f} s", flush=True)
        rows.append((f"rehearse {share}, lr {lr}", measure(model, env, chat, settings, args.samples, base), seconds))
    keys = ["balanced_accuracy", "agreement", "working_accuracy", "working_accuracy_t1", "working_drift",
            "yes_share", "p_yes_same", "p_yes_different", "same_cases"]
    print("| model | warm-up s | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 2) + "|")
    for name, metrics, seconds in rows:
        print(f"| {name} | {seconds:.0f} | " + " | ".join(f"{metrics[k]:.3f}" for k in keys) + " |")


if __name__ == "__main__":
    main()
