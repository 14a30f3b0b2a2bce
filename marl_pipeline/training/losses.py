"""GRPO's loss terms per token, their normalisation, and the token log-probabilities they need.

Every term is a [batch, length] tensor of per-token values; :func:`summed_loss` masks and sums them the
way the step normalises them (by tokens or by sequences), so the trainer divides once per step. The trainer sums
them with per-token weights (training/packing.py ``Pass.loss_weights``): the same normalisation, in a form that holds
for a packed pass too, whose rows share one row of the tensor.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from marl_pipeline.training.head import fused_token_terms


def pad_sequences(prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int):
    """Right-padded ``input_ids`` of prompt+response, the attention mask, and a mask over response tokens.

    ``response_mask[b, t]`` is 1 where token ``t + 1`` of row ``b`` is a response token, i.e. it is
    aligned with the logits at position ``t`` that predict it.
    """
    lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids)]
    width = max(lengths)
    input_ids = torch.full((len(lengths), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(lengths), width), dtype=torch.long)
    response_mask = torch.zeros((len(lengths), width - 1), dtype=torch.float32)
    for row, (prompt, response) in enumerate(zip(prompt_ids, response_ids)):
        ids = list(prompt) + list(response)
        input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, : len(ids)] = 1
        response_mask[row, len(prompt) - 1 : len(ids) - 1] = 1.0
    return input_ids, attention_mask, response_mask


LOGIT_CHUNK = 1024
"""Positions whose logits are computed at once: the pass's peak grows by at most four [1024 x vocabulary] float32
tensors (the logits, their log-softmax and both gradients: 800 MB for SmolLM2's 49k vocabulary), however long the
batch."""
_SCALED_HEADS = ("final_logit_softcapping", "logit_scale", "logits_scaling")  # more than a linear output head


@dataclass(frozen=True)
class TokenTerms:
    """What the loss needs at each scored position, flat in row-major order of the positions mask
    (:func:`scored_token_terms`)."""

    logprobs: torch.Tensor
    """log p(the next token), [N]."""
    entropy: torch.Tensor | None = None
    """The full-vocabulary entropy, [N] (asked for with ``entropy``)."""
    start_logprobs: torch.Tensor | None = None
    """The ``start`` model's log p(the next token), [N], no gradient."""
    start_kl: torch.Tensor | None = None
    """KL(start || model) over the vocabulary, [N]."""

    def scattered(self, name: str, positions: torch.Tensor) -> torch.Tensor:
        """One term as [batch, length - 1], zero where ``positions`` is False (the layout the per-token losses use)."""
        values, flat = getattr(self, name), positions.flatten()
        if not len(values):
            return torch.zeros(positions.shape, dtype=torch.float32, device=positions.device)
        # Gathered by the mask's running count, not masked_scatter: that one's backward (masked_select) makes a GPU
        # wait for the whole forward pass before it can queue the backward's kernels.
        index = (flat.cumsum(0) - 1).clamp(min=0)
        return torch.where(flat, values[index], 0.0).view(positions.shape)


def scored_token_terms(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, positions: torch.Tensor, *,
                       entropy: bool = False, start=None, chunk: int = LOGIT_CHUNK,
                       packing: dict | None = None, fused: bool = False) -> TokenTerms:
    """The next-token terms at the ``positions`` ([batch, length - 1], bool; position t predicts token t + 1).

    The output head runs on the scored positions alone, ``chunk`` of them at a time, each chunk's logits recomputed in
    the backward pass rather than kept (activation checkpointing): a [tokens x vocabulary] float32 tensor never exists
    for the whole pass, and prompt positions cost no head at all. ``start``: a frozen model whose log-probabilities
    and KL from which are wanted too (the warm-up's rehearsal). ``packing``: a packed pass's keyword arguments
    (training/packing.py), with no ``attention_mask``. ``fused``: the log-probabilities and entropy from
    training/head.py's fused head, where the head is a plain linear layer and no ``start`` model is asked for."""
    index = positions.flatten().nonzero().squeeze(1)  # the scored positions, flat: read once (a device sync)
    targets = input_ids[:, 1:].flatten()[index]
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "use_cache": False, **(packing or {})}
    features, head = _features(model, inputs, index)
    if fused and start is None and head is not None and head.bias is None:
        logprobs, entropies = fused_token_terms(features, head.weight, targets, entropy=entropy, chunk=chunk)
        return TokenTerms(logprobs, entropies)
    start_features = start_head = None
    if start is not None:
        with torch.no_grad():
            start_features, start_head = _features(start, inputs, index)
    columns = []
    for low in range(0, len(targets), chunk):
        part = slice(low, low + chunk)
        terms = functools.partial(_chunk_terms, head, start_head, entropy)
        args = (features[part], targets[part], None if start is None else start_features[part])
        if torch.is_grad_enabled() and features.requires_grad:
            columns.append(checkpoint(terms, *args, use_reentrant=False))
        else:
            columns.append(terms(*args))
    values = torch.cat(columns) if columns else features.new_zeros((0, 1 + entropy + 2 * (start is not None)))
    values = values.float().unbind(-1)
    return TokenTerms(values[0], values[1] if entropy else None, *(values[-2:] if start is not None else (None, None)))


def _features(model, inputs: dict, index):
    """The last hidden state at the scored positions (``index`` into the flat [batch x (length - 1)] positions) and
    the output head that maps it to logits; for a model whose head is more than a linear layer, its own logits there
    and no head. ``inputs``: the model's keyword arguments, with no KV cache (a training pass never reads one, and
    building it keeps every layer's keys and values)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if any(getattr(base.config, name, None) for name in _SCALED_HEADS):
        return model(**inputs).logits[:, :-1].flatten(0, 1)[index], None
    hidden = base.get_decoder()(**inputs).last_hidden_state
    return hidden[:, :-1].flatten(0, 1)[index], base.get_output_embeddings()


def _chunk_terms(head, start_head, entropy: bool, features, targets, start_features) -> torch.Tensor:
    """[n, k]: the log-probability of each target, then its entropy, start log-probability and KL as asked."""
    log_probs = (features if head is None else head(features)).float().log_softmax(-1)
    columns = [log_probs.gather(1, targets[:, None]).squeeze(1)]
    if entropy:
        columns.append(entropy_from_log_probs(log_probs))
    if start_features is not None:
        with torch.no_grad():
            start = (start_features if start_head is None else start_head(start_features)).float().log_softmax(-1)
        columns.append(start.gather(1, targets[:, None]).squeeze(1))
        columns.append((start.exp() * (start - log_probs)).sum(-1))
    return torch.stack(columns, -1)


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """log p(token t+1 | tokens <= t) for every position: shape [batch, length - 1]."""
    every = torch.ones(input_ids.shape[0], input_ids.shape[1] - 1, dtype=torch.bool, device=input_ids.device)
    return scored_token_terms(model, input_ids, attention_mask, every).scattered("logprobs", every)


def entropy_from_log_probs(log_probs: torch.Tensor) -> torch.Tensor:
    """H = -sum_v p_v log p_v over the last (vocabulary) dimension."""
    return -(log_probs.exp() * log_probs).sum(dim=-1)


def clipped_pg_token_loss(
    logprobs: torch.Tensor,
    engine_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_eps: float,
    tis_cap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO-clipped policy-gradient loss at each token: max(-A r, -A clip(r, 1 - eps, 1 + eps)).

    Without ``tis_cap`` the PPO ratio is r = pi_theta / pi_engine, the trainer's probability of the token
    over the rollout engine's (today's GRPO loss). With ``tis_cap`` (truncated importance sampling, Yao et
    al. 2025) the engine-vs-trainer correction moves into a weight and the clip's ratio is the trainer's own:
    r = pi_theta / sg(pi_theta) (``sg``: detached, the "old" policy recomputed by the trainer, as verl does),
    which is exactly 1 at the point of the gradient, so the clip is never active in our single update per
    batch; each token's term is then multiplied by w = min(sg(pi_theta) / pi_engine, cap), and the gradient
    is -A w grad log pi_theta. (Keeping r = pi_theta / pi_engine and multiplying by w would count the
    mismatch twice, r w ~ r^2.)

    Args:
        logprobs: the trainer's log-probabilities of the taken tokens, [batch, length].
        engine_logprobs: the rollout engine's log-probabilities of the same tokens, [batch, length].
        advantages: one advantage per sequence, [batch], or per token, [batch, length].
        clip_eps: ratios are clipped to [1 - clip_eps, 1 + clip_eps].
        tis_cap: truncate the importance weight at this value (None: no weight, the clip uses the engine ratio).

    Returns:
        The per-token loss [batch, length] and the ratio the clip used.
    """
    if tis_cap is None:
        ratio = torch.exp(logprobs - engine_logprobs)
    else:
        ratio = torch.exp(logprobs - logprobs.detach())
    adv = advantages[:, None] if advantages.dim() == 1 else advantages  # per sequence, or per token (a packed pass)
    pg_loss = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps))
    if tis_cap is not None:
        pg_loss = pg_loss * truncated_is_weights(logprobs, engine_logprobs, tis_cap)
    return pg_loss, ratio


def truncated_is_weights(logprobs: torch.Tensor, engine_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """min(exp(sg(logprobs) - engine_logprobs), cap) per token: a constant, no gradient flows through it."""
    return torch.exp(logprobs.detach() - engine_logprobs).clamp(max=cap)


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi_theta || pi_ref) per token: exp(ref - logp) - (ref - logp) - 1.

    Non-negative, and zero where the two policies agree on the token.
    """
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1


def grpo_token_loss(
    logprobs: torch.Tensor,
    engine_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_eps: float,
    *,
    tis_cap: float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO's loss at each token: clipped policy gradient + kl_coef * k3 KL to the reference - entropy_coef * H.

    Args:
        logprobs, engine_logprobs, advantages, clip_eps, tis_cap: as in :func:`clipped_pg_token_loss`.
        ref_logprobs: the frozen reference policy's log-probabilities of the taken tokens (None: no KL term).
        kl_coef: weight of the KL term.
        entropy: the policy's full-vocabulary entropy at each token (None: no entropy term).
        entropy_coef: weight of the entropy bonus.

    Returns:
        The per-token loss [batch, length] and the ratio the clip used.
    """
    loss, ratio = clipped_pg_token_loss(logprobs, engine_logprobs, advantages, clip_eps, tis_cap)
    if ref_logprobs is not None:
        loss = loss + kl_coef * k3_kl(logprobs, ref_logprobs)
    if entropy is not None:
        loss = loss - entropy_coef * entropy
    return loss, ratio


def summed_loss(token_loss: torch.Tensor, mask: torch.Tensor, normalization: str) -> torch.Tensor:
    """The per-token loss summed the way the step normalises it; the trainer divides by :func:`loss_units`.

    ``token``: the sum over response tokens (divided by the step's token count, every token weighs the same).
    ``sequence``: the sum of each sequence's mean token loss (divided by the step's sequence count, every
    sequence weighs the same, whatever its length). Either way a sum, so accumulating micro-batches of any
    size gives exactly the full-batch gradient.
    """
    masked = token_loss * mask
    if normalization == "token":
        return masked.sum()
    if normalization == "sequence":
        return (masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).sum()
    raise ValueError(f"loss normalization {normalization!r}: expected 'token' or 'sequence'")


def loss_units(mask: torch.Tensor, normalization: str) -> int:
    """What :func:`summed_loss` counts: response tokens, or sequences with at least one response token."""
    return int(mask.sum()) if normalization == "token" else int((mask.sum(dim=1) > 0).sum())


@torch.no_grad()
def mismatch_stats(logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the trainer's logprobs are from the engine's, over the masked tokens.

    ``mismatch_abs_logprob``: mean |logprobs - engine_logprobs|; ``mean_ratio`` and ``mismatch_ratio_std``: the
    mean and the (population) standard deviation of the importance ratio exp(logprobs - engine_logprobs).
    At staleness 0 this is the engine-vs-trainer numerical mismatch alone; with staleness > 0 it includes the
    policy's drift since the rollout's version.
    """
    tokens = mask.sum().clamp(min=1)
    diff = logprobs - engine_logprobs
    ratio = torch.exp(diff)
    mean_ratio = (ratio * mask).sum() / tokens
    std = torch.sqrt(((ratio - mean_ratio) ** 2 * mask).sum() / tokens)
    values = torch.stack([mean_ratio, (diff.abs() * mask).sum() / tokens, std]).tolist()  # one device-to-host copy
    return dict(zip(("mean_ratio", "mismatch_abs_logprob", "mismatch_ratio_std"), values))


@torch.no_grad()
def clip_fraction(ratio: torch.Tensor, mask: torch.Tensor, clip_eps: float) -> float:
    """Share of the masked tokens whose ratio is outside [1 - clip_eps, 1 + clip_eps]."""
    clipped = ((ratio - 1).abs() > clip_eps).float()
    return float((clipped * mask).sum() / mask.sum().clamp(min=1))
