"""A reward from an LLM judge behind an OpenAI-compatible chat-completions endpoint (``reward.judge``), asked through
the judge's service, so its quota holds whoever else calls it.

The score of a turn is P(yes) / (P(yes) + P(no)) over the judge's first token (``logprobs``, ``top_logprobs``);
a reply without log-probabilities scores 1 when it starts with the approving word, else 0. The micro-batch's turns
are asked at once, each its own request: the endpoint batches concurrent requests itself (vLLM's continuous
batching), and chat completions take one conversation a request.
"""

from __future__ import annotations

import asyncio
import math
import re

from marl_pipeline.config import JudgeConfig
from marl_pipeline.external import ServiceClient, service


class JudgeScorer:
    """``score(prompts, responses)`` for ``stages.reward.ModelReward``."""

    def __init__(self, settings: JudgeConfig, client: ServiceClient | None = None) -> None:
        self.settings, self._client = settings, client

    @property
    def client(self) -> ServiceClient:
        if self._client is None:
            self._client = service(self.settings.service)
        return self._client

    def message(self, prompt: str, response: str) -> str:
        values = {"prompt": prompt, "response": response}
        return re.sub(r"\{(prompt|response)\}", lambda match: values[match.group(1)], self.settings.template)

    def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        return asyncio.run(self._score_all(prompts, responses))

    async def _score_all(self, prompts: list[str], responses: list[str]) -> list[float]:
        return list(await asyncio.gather(*[self._score(p, r) for p, r in zip(prompts, responses)]))

    async def _score(self, prompt: str, response: str) -> float:
        text = self.message(prompt, response)
        answer = await self.client.achat([{"role": "user", "content": text}], model=self.settings.model,
                                         expected_cost=len(text), max_tokens=1, temperature=0.0, logprobs=True,
                                         top_logprobs=self.settings.top_logprobs)
        return verdict(answer, self.settings.yes, self.settings.no)


def verdict(answer: dict, yes: str, no: str) -> float:
    """A chat completion's P(yes) / (P(yes) + P(no)) over its first token's alternatives (see the module)."""
    yes, no = yes.strip().lower(), no.strip().lower()
    choice = answer["choices"][0]
    content = ((choice.get("logprobs") or {}).get("content") or [{}])[0]
    mass = {yes: 0.0, no: 0.0}
    for option in content.get("top_logprobs") or []:
        word = option["token"].strip().lower()
        if word in mass:
            mass[word] += math.exp(option["logprob"])
    if mass[yes] + mass[no] > 0:
        return mass[yes] / (mass[yes] + mass[no])
    return float((choice["message"].get("content") or "").strip().lower().startswith(yes))
