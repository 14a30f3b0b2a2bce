"""The policy's own replies for warm-up, as rollout would send and sample them: each prompt's ids (text as it is,
chat messages through the agent's chat template), and replies sampled from the model itself (what
``bootstrap/warmup.py`` rehearses)."""

from __future__ import annotations

import torch

from marl_pipeline.environment import ChatMessages
from marl_pipeline.inference.chat import ChatTokenizer


def warmup_prompt_ids(tokenizer, prompts: list[str | ChatMessages], source: str) -> list[list[int]]:
    """Each prompt's ids as rollout would send them to the engine: text tokenized as it is, chat messages through
    the agent's chat template (``inference/chat.py``, which says which agent lacks one)."""
    chat, ids = None, []
    for prompt in prompts:
        if isinstance(prompt, str):
            ids.append(tokenizer(prompt, add_special_tokens=False)["input_ids"])
            continue
        chat = chat or ChatTokenizer(tokenizer, source)
        ids.append(chat.first_ids(prompt))
    return ids


@torch.no_grad()
def sample_replies(model, prompts: list[list[int]], *, max_new_tokens: int, temperature: float, eos: int, pad: int,
                   batch_size: int = 32) -> list[list[int]]:
    """The model's own reply to each prompt, as rollout samples it: ids up to and including the first EOS (all
    ``max_new_tokens`` of them when it never stops, with no EOS added, as the engine would return them)."""
    from transformers import GenerationConfig

    # Explicit, not the checkpoint's generation_config: SmolLM2's asks for top-p 0.9 at temperature 0.2.
    generation = GenerationConfig(do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                                  max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad)
    model.eval()
    replies = []
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start:start + batch_size]
        width = max(len(ids) for ids in batch)
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in batch],  # left-padded: replies align
                                 device=model.device)
        attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch], device=model.device)
        output = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=generation)
        for row in output[:, width:].tolist():
            replies.append(row[:row.index(eos) + 1] if eos in row else row)
    return replies


def policy_replies(model, tokenizer, prompts: list[str | ChatMessages], *, source: str, max_new_tokens: int,
                   temperature: float) -> list[str]:
    """The policy's own reply to each prompt, sampled as rollout samples, as text: what a plugin's
    ``own_reply_warmup_examples`` builds its examples on (their prompts then hold the replies as messages)."""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    ids = sample_replies(model, warmup_prompt_ids(tokenizer, prompts, source), max_new_tokens=max_new_tokens,
                         temperature=temperature, eos=eos, pad=pad)
    return [tokenizer.decode(reply, skip_special_tokens=True) for reply in ids]
