"""Policy-gradient loss and the token log-probabilities it needs."""

from __future__ import annotations

import torch


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


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """log p(token t+1 | tokens <= t) for every position: shape [batch, length - 1]."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
    return torch.gather(torch.log_softmax(logits, dim=-1), 2, input_ids[:, 1:, None]).squeeze(-1)


def clipped_pg_loss_sum(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clipped policy-gradient loss, summed (not averaged) over the masked tokens.

    Summing lets the trainer divide once by the whole step's token count, so accumulating micro-batches
    gives exactly the full-batch gradient whatever their sizes.

    Args:
        logprobs: current policy's log-probabilities of the taken tokens, [batch, length].
        old_logprobs: the rollout engine's log-probabilities of the same tokens, [batch, length].
        advantages: one advantage per sequence, [batch].
        mask: 1 for response tokens, 0 elsewhere, [batch, length].
        clip_eps: ratios are clipped to [1 - clip_eps, 1 + clip_eps].

    Returns:
        The summed loss and statistics (clip fraction, mean ratio) over the masked tokens.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    adv = advantages[:, None]
    pg_loss = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps))
    loss_sum = (pg_loss * mask).sum()
    with torch.no_grad():
        tokens = mask.sum().clamp(min=1)
        clipped = ((ratio - 1).abs() > clip_eps).float()
        stats = {"clip_fraction": float((clipped * mask).sum() / tokens),
                 "mean_ratio": float((ratio * mask).sum() / tokens)}
    return loss_sum, stats
