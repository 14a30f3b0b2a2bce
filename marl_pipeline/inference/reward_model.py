"""Model-based reward: a reward model served by an elastic pool of Ray actors, and the built-in tiny one.

Two kinds, both loaded with transformers from a local Hugging Face directory:

- ``classifier`` (any sequence-classification model): score = sigmoid(logit) of a one-logit head, or the
  softmax probability of the last label ("good") with several labels;
- ``judge`` (any causal LM): the model reads ``judge_template`` filled with the turn's prompt and response;
  score = P(yes) / (P(yes) + P(no)) of the next token (``judge_yes`` / ``judge_no``).

Scoring is stateless, so replicas are interchangeable: the pool sends each batch to the replica with the
fewest batches in flight, grows towards ``max_replicas`` while more than ``batches_per_replica`` batches
wait per replica, and retires replicas above ``min_replicas`` once they have idled ``idle_grace_s`` (ROLLART's
elastic reward pool). ``ray.util.ActorPool`` would do the dispatch, but it is not thread-safe and the reward
stage scores several micro-batches at once, nor can it retire a busy-looking actor: hence this small pool.

The built-in reward model (``builtin:tiny``, a judge) is taught in bootstrap/reward_model.py.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from marl_pipeline.config import RewardModelConfig


class RewardModelServer:
    """One replica: holds a reward model and scores (prompt, response) pairs; plain Python, or a Ray actor."""

    def __init__(self, path: str, kind: str, *, judge_template: str = "", judge_yes: str = " yes",
                 judge_no: str = " no", max_length: int = 256, num_threads: int | None = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

        if num_threads:
            torch.set_num_threads(num_threads)
        self.kind, self.template, self.max_length = kind, judge_template, max_length
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.tokenizer.truncation_side = "left"  # keep the response, which is what is judged
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if kind == "classifier":
            self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
            self.tokenizer.padding_side = "right"
        elif kind == "judge":
            self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            self.tokenizer.padding_side = "left"  # the next-token position is the last one of every row
            self.yes, self.no = (self._single_token(word, name) for word, name in ((judge_yes, "judge_yes"),
                                                                                  (judge_no, "judge_no")))
        else:
            raise ValueError(f"reward model kind {kind!r}: expected 'classifier' or 'judge'")
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.eval()

    @classmethod
    def from_settings(cls, path: str | Path, settings: RewardModelConfig, num_threads: int | None = None):
        """An in-process server for the configured reward model."""
        return cls(str(path), settings.model_kind, **server_options(settings, num_threads))

    def _single_token(self, word: str, name: str) -> int:
        ids = self.tokenizer(word, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise ValueError(f"reward_model.{name} {word!r} is {len(ids)} tokens for this tokenizer; it must be one")
        return ids[0]

    def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        """A score in [0, 1] per (prompt, response)."""
        import torch

        if self.kind == "judge":
            texts = [self.template.format(prompt=p, response=r) for p, r in zip(prompts, responses)]
        else:
            texts = [p + r for p, r in zip(prompts, responses)]
        batch = self.tokenizer(texts, return_tensors="pt", padding=True, truncation=True,
                               max_length=self.max_length, add_special_tokens=False)
        with torch.inference_mode():
            if self.kind == "classifier":
                logits = self.model(**batch).logits.float()
                scores = torch.sigmoid(logits[:, 0]) if logits.shape[1] == 1 else logits.softmax(-1)[:, -1]
            else:
                last = self.model(**batch).logits[:, -1, :].float().log_softmax(-1)
                scores = torch.sigmoid(last[:, self.yes] - last[:, self.no])  # = p_yes / (p_yes + p_no)
        return [float(s) for s in scores]

    def ready(self) -> bool:
        return True


def server_options(settings: RewardModelConfig, num_threads: int | None = None) -> dict:
    """The keyword arguments of :class:`RewardModelServer` for the configured reward model."""
    return {"judge_template": settings.judge_template, "judge_yes": settings.judge_yes, "judge_no": settings.judge_no,
            "max_length": settings.max_length, "num_threads": num_threads}


@dataclass(eq=False)
class _Replica:
    handle: object
    in_flight: int = 0
    idle_since: float = 0.0


class RewardModelPool:
    """Replicas of one reward model on Ray, sized by the batches waiting; see the module docstring."""

    def __init__(self, path: str | Path, settings: RewardModelConfig, idle_grace_s: float = 30.0) -> None:
        import ray

        self.settings, self.idle_grace_s = settings, idle_grace_s
        self._actor = ray.remote(RewardModelServer).options(num_cpus=settings.num_cpus, num_gpus=settings.num_gpus)
        self._kwargs = server_options(settings, num_threads=1)
        self._path = str(path)
        self._lock = threading.Lock()
        self._replicas: list[_Replica] = []
        self.peak_replicas = 0
        for _ in range(settings.min_replicas):
            self._replicas.append(self._spawn())
        ray.get([r.handle.ready.remote() for r in self._replicas])  # a bad model fails here, at set-up

    def _spawn(self) -> _Replica:
        replica = _Replica(self._actor.remote(self._path, self.settings.model_kind, **self._kwargs),
                           idle_since=time.monotonic())
        self.peak_replicas = max(self.peak_replicas, len(self._replicas) + 1)
        return replica

    def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        """Scores of every pair, in order; batches spread over the replicas."""
        import ray

        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        size = self.settings.batch_size
        chunks = [(prompts[i:i + size], responses[i:i + size]) for i in range(0, len(prompts), size)]
        calls = []
        with self._lock:
            self._resize(len(chunks))
            for chunk in chunks:
                replica = min(self._replicas, key=lambda r: r.in_flight)
                replica.in_flight += 1
                calls.append((replica, replica.handle.score.remote(*chunk)))
        try:
            results = ray.get([ref for _, ref in calls])
        finally:
            with self._lock:
                for replica, _ in calls:
                    replica.in_flight -= 1
                    replica.idle_since = time.monotonic()
        return [score for chunk in results for score in chunk]

    def _resize(self, new_batches: int) -> None:
        import ray

        s = self.settings
        pending = new_batches + sum(r.in_flight for r in self._replicas)
        target = min(s.max_replicas, max(s.min_replicas, math.ceil(pending / s.batches_per_replica)))
        while len(self._replicas) < target:
            self._replicas.append(self._spawn())
        now = time.monotonic()
        for replica in sorted(self._replicas, key=lambda r: r.idle_since):
            if len(self._replicas) <= target:
                break
            if replica.in_flight == 0 and now - replica.idle_since >= self.idle_grace_s:
                self._replicas.remove(replica)
                ray.kill(replica.handle)

    @property
    def replicas(self) -> int:
        with self._lock:
            return len(self._replicas)

    def shutdown(self) -> None:
        import ray

        with self._lock:
            for replica in self._replicas:
                ray.kill(replica.handle)
            self._replicas.clear()
