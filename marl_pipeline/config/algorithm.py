"""The algorithm: policy-gradient settings of the experiment, each agent's own values over them
(``agents.<a>.algorithm``), and the advantage estimator chosen by ``type`` (stages/advantages/ holds one module per
estimator)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, create_model

from marl_pipeline.config.base import StrictModel


class GRPOAdvantage(StrictModel):
    """(reward - group mean) / (group std + eps), per agent (DeepSeekMath's GRPO)."""

    type: Literal["grpo"] = "grpo"
    eps: float = Field(1e-6, gt=0)
    """Added to the group's reward std before dividing."""


class DrGRPOAdvantage(StrictModel):
    """reward - group mean, per agent: no division by the group's std (Dr. GRPO, Liu et al. 2025)."""

    type: Literal["dr_grpo"] = "dr_grpo"


class RLOOAdvantage(StrictModel):
    """reward - the mean of the group's other episodes, per agent (RLOO, Ahmadian et al. 2024)."""

    type: Literal["rloo"] = "rloo"


class AgentNormalizedAdvantage(StrictModel):
    """(reward - group mean) / (std of the agent's centred rewards over the micro-batch + eps): each agent's
    advantages scaled by its own reward statistics (Dr. MAS, Feng et al. 2026), not by one group's."""

    type: Literal["agent_normalized"] = "agent_normalized"
    eps: float = Field(1e-6, gt=0)
    """Added to the agent's std before dividing."""


Advantage = Annotated[GRPOAdvantage | DrGRPOAdvantage | RLOOAdvantage | AgentNormalizedAdvantage,
                      Field(discriminator="type")]


class AlgorithmConfig(StrictModel):
    """Policy-gradient settings: the experiment's (``algorithm:``), and each agent's with its own values over them
    (``ExperimentConfig.algorithm_of``)."""

    removed_keys: ClassVar[dict[str, str]] = {
        "advantage_eps": "algorithm.advantage_eps is now algorithm.advantage.eps (with advantage.type: grpo)"}

    clip_eps: float = Field(0.2, gt=0)
    """PPO-style ratio clipping range."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature at rollout."""
    max_new_tokens: int = Field(8, ge=1)
    """Longest completion per turn, in tokens."""
    advantage: Advantage = GRPOAdvantage()
    """How rewards become advantages (``type``: grpo, dr_grpo, rloo, agent_normalized)."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the k3 KL penalty to the agent's base policy (version 0); > 0 keeps a frozen copy of it in the
    trainer."""
    entropy_coef: float = Field(0.0, ge=0)
    """Weight of the entropy bonus (full-vocabulary entropy at each response token), subtracted from the loss."""
    drop_zero_advantage_groups: bool = False
    """Leave out an agent's groups whose episodes all earned the same reward (DAPO's filter)."""
    loss_normalization: Literal["token", "sequence"] = "token"
    """``token``: the step's summed token loss over its response-token count; ``sequence``: each sequence's mean
    token loss, averaged over the step's sequences."""
    tis_cap: float | None = Field(None, ge=1)
    """Truncated importance sampling: weight each token by min(trainer/engine ratio, cap); None: off."""





def with_own_values(algorithm: Mapping[str, Any], own: Mapping[str, Any]) -> dict[str, Any]:
    """The experiment's ``algorithm:`` (as a mapping) with an agent's own values (``agents.<a>.algorithm``) in place
    of those it sets; a null is not set. The one rule: ``ExperimentConfig.algorithm_of`` and a launch record's
    reading of it (run/provenance.py) both apply it."""
    return {**algorithm, **{name: value for name, value in own.items() if value is not None}}


def _unset_by_default(model: type[StrictModel]) -> dict[str, Any]:
    """Each field of ``model`` with its type and checks, None by default: not set."""
    fields = {}
    for name, info in model.model_fields.items():
        checks = [*info.metadata, *([Field(discriminator=info.discriminator)] if info.discriminator else [])]
        fields[name] = ((Annotated[info.annotation, *checks] if checks else info.annotation) | None,
                        Field(None, description=info.description))
    return fields


AgentAlgorithm = create_model(
    "AgentAlgorithm", __base__=StrictModel, __module__=__name__,
    __doc__="One agent's own values of ``algorithm:`` fields (``agents.<a>.algorithm``): each field set replaces the "
            "experiment's for that agent's sampling, advantages and loss; a field not set is the experiment's. A "
            "yes/no verifier and a solver writing a sum want different temperatures, entropy bonuses, estimators "
            "and response lengths (Dr. MAS trains each agent with its own settings).",
    **_unset_by_default(AlgorithmConfig))
