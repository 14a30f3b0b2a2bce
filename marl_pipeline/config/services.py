"""Services outside the cluster a run calls (``services.<name>``), and the judge reward that asks one of them."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from marl_pipeline.config.base import StrictModel


class ServiceConfig(StrictModel):
    """One external service (a search API, a code runner, an LLM judge) and its quota: every call of the run goes
    through one scheduler for it (marl_pipeline/services), which keeps the calls within these limits."""

    base_url: str
    """Where the service answers, e.g. ``http://127.0.0.1:8000/v1``; a call's path is appended to it."""
    requests_per_second: float | None = Field(None, gt=0)
    """Most calls started in any one-second window (None: no limit)."""
    tokens_per_minute: int | None = Field(None, ge=1)
    """Most tokens (the response's ``usage.total_tokens``, estimated before the call) in any one-minute window."""
    concurrency: int = Field(16, ge=1, le=4096)
    """Most calls in flight at once."""
    margin: float = Field(0.05, ge=0, lt=1)
    """The windows are this much longer than the quota's (1.05 s, 63 s): a call reaches the service a few ms after
    its grant, and two grants one window apart must not arrive inside one of the service's windows."""
    retries: int = Field(4, ge=0, le=20)
    """Times a call is tried again after a 429, a 5xx, a timeout or a connection error."""
    backoff_s: float = Field(0.5, gt=0)
    """First wait before a retry; doubled at each retry, and at least the ``Retry-After`` the service sent."""
    max_backoff_s: float = Field(30.0, gt=0)
    """Longest wait between two tries (a ``Retry-After`` above it is still honoured)."""
    timeout_s: float = Field(60.0, gt=0)
    """One try's limit, connection and response together."""
    headers: dict[str, str] = Field(default_factory=dict)
    """Sent with every call (keep secrets out of the file: ``api_key_env``)."""
    api_key_env: str | None = None
    """An environment variable holding a key sent as ``Authorization: Bearer <key>`` (read where the call runs)."""
    scheduled: bool = True
    """False: each caller calls on its own, retrying by itself, and the scheduler only counts (the baseline)."""

    @field_validator("base_url")
    @classmethod
    def validate_base_url(cls, url: str) -> str:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"base_url {url!r} must start with http:// or https://")
        return url.rstrip("/")


class JudgeConfig(StrictModel):
    """A reward from an LLM judge behind an OpenAI-compatible chat-completions endpoint (``reward.judge``): the
    score of a turn is P(yes) / (P(yes) + P(no)) of the judge's first token, mixed into the environment's reward."""

    service: str
    """The ``services`` entry the judge is called through (its quota applies)."""
    model: str
    """The model name the endpoint serves (its ``/models``)."""
    template: str = "Question: {prompt}\nAnswer: {response}\nIs the answer right? Reply yes or no."
    """The user message the judge is sent, with ``{prompt}`` and ``{response}`` of the scored turn."""
    yes: str = "yes"
    """The approving first token (compared without case or surrounding spaces)."""
    no: str = "no"
    """The rejecting first token."""
    agents: list[str] | None = None
    """Agents whose reward gets the judge's score (None: every agent)."""
    weight: float = Field(0.5, ge=0, le=1)
    """An agent's reward is ``(1 - weight) * environment reward + weight * judge score``."""
    top_logprobs: int = Field(10, ge=1, le=20)
    """First-token alternatives asked for; a reply without log-probabilities is scored 1 for yes, 0 otherwise."""

    @model_validator(mode="after")
    def validate_template(self) -> JudgeConfig:
        if not all(field in self.template for field in ("{prompt}", "{response}")):
            raise ValueError("template must contain {prompt} and {response}")
        if self.yes.strip().lower() == self.no.strip().lower():
            raise ValueError(f"yes and no are the same word ({self.yes!r})")
        return self


class RewardConfig(StrictModel):
    """Rewards besides the environment's own (the reward model is ``reward_model``)."""

    judge: JudgeConfig | None = None
    """An LLM judge asked through a service (None: no judge)."""
