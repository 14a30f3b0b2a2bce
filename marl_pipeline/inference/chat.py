"""Chat prompts, token in and token out: the agent's chat template applied once, later turns extending the ids.

An environment may render a turn as chat messages (``environment.ChatMessages``). The agent's own tokenizer
applies its chat template to its first turn's messages; those ids go to vLLM as ``prompt_token_ids``, are
stored, and are what the trainer sees. A later turn of the same agent in the same episode is its previous
prompt ids + its previous response ids exactly as sampled + the ids of only the new messages. Nothing is
re-tokenized from decoded text: a reply's text does not always tokenize back to the sampled ids, and that
drift between what was sampled and what is trained destabilizes multi-turn RL.

The new messages' ids come from a fixed base conversation, as SkyRL and verl do it: the template of a base that
ends with an assistant message, cut right after that message's end-of-turn token, is a prefix of the template
of the base plus the new messages; what follows the cut is exactly what the template puts after an assistant's
end-of-turn token (for SmolLM2's ChatML: ``\\n<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n``).

End of turn: a reply that stopped on the template's end-of-turn token (vLLM keeps the stop token in the ids)
is followed directly by the new messages; one that stopped without it (``max_tokens``) gets the token put in
between, as the template closes every assistant message. The token then belongs to the next prompt, not to the
reply, so the trainer never scores a token the engine did not sample.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from marl_pipeline.environment import ChatMessage, Prompt

ROLES = ("system", "user", "assistant")
BASE_CONVERSATION: list[ChatMessage] = [{"role": "user", "content": "I am a user."},
                                        {"role": "assistant", "content": "I am an assistant."}]
"""The fixed base for the new messages' ids. No system message: some templates refuse one; a template that adds
a default system message (SmolLM2's, Qwen's) adds it to the base, which is cut off anyway."""


class ChatPromptError(ValueError):
    """A chat prompt cannot be tokenized: bad messages, a history that does not match, no chat template."""


class ChatTokenizer:
    """An agent's tokenizer with its chat template: the first turn's ids, and the ids that continue a conversation."""

    def __init__(self, tokenizer, source: str) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ChatPromptError(f"the tokenizer of {source} has no chat template, so it cannot take chat messages: "
                                  "use a chat model for this agent, or have the environment render a str")
        self.tokenizer, self.source = tokenizer, source
        # One tokenizer serves every rollout thread; a fast tokenizer resets its truncation and padding on each
        # call, which raises "Already borrowed" when two threads do it at once.
        self._lock = threading.Lock()
        self.end_of_turn, self._base_ids = self._cut_base()

    def _template(self, messages: list[ChatMessage], generation_prompt: bool) -> list[int]:
        with self._lock:
            return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                                           tokenize=True, return_dict=True)["input_ids"])

    def _cut_base(self) -> tuple[int, list[int]]:
        """The template's end-of-turn token (the first token after an assistant message's content) and the base's
        ids up to and including it."""
        ids = self._template(BASE_CONVERSATION, generation_prompt=False)
        text = self.tokenizer.apply_chat_template(BASE_CONVERSATION, tokenize=False)
        content_end = text.rfind(BASE_CONVERSATION[-1]["content"]) + len(BASE_CONVERSATION[-1]["content"])
        before = self.tokenizer(text[:content_end], add_special_tokens=False)["input_ids"]
        if ids[:len(before)] != before or len(ids) == len(before):
            raise ChatPromptError(f"the chat template of {self.source} does not close an assistant message with a "
                                  "token of its own, so later turns cannot extend the earlier ids")
        return ids[len(before)], ids[:len(before) + 1]

    def first_ids(self, messages: list[ChatMessage]) -> list[int]:
        """The template applied to a whole conversation, with the generation prompt."""
        return self._template(messages, generation_prompt=True)

    def continued_ids(self, earlier_ids: list[int], new_messages: list[ChatMessage]) -> list[int]:
        """``earlier_ids`` (a prompt and its sampled reply) + the end-of-turn token if the reply lacks it + the new
        messages' ids + the generation prompt."""
        rendered = self._template([*BASE_CONVERSATION, *new_messages], generation_prompt=True)
        if rendered[:len(self._base_ids)] != self._base_ids:
            raise ChatPromptError(f"the chat template of {self.source} renders earlier messages differently once "
                                  "new ones follow, so later turns cannot extend the earlier ids")
        closing = [] if earlier_ids[-1] == self.end_of_turn else [self.end_of_turn]
        return [*earlier_ids, *closing, *rendered[len(self._base_ids):]]

    def decode(self, ids: list[int]) -> str:
        """The ids as text, special tokens included (for display: stored ``prompt_text``)."""
        with self._lock:
            return self.tokenizer.decode(ids, skip_special_tokens=False)


_LOADED: dict[str, ChatTokenizer] = {}
_LOADED_LOCK = threading.Lock()


def fetched_chat_tokenizer(source: str, fetch: Callable[[], object]) -> ChatTokenizer:
    """The chat tokenizer of the policy directory ``source``, built from ``fetch()`` (a Hugging Face tokenizer) the
    first time in this process (no policy version changes it); ``fetch`` may ask another node, where ``source`` is."""
    with _LOADED_LOCK:
        if source not in _LOADED:
            _LOADED[source] = ChatTokenizer(fetch(), source)
        return _LOADED[source]


def load_chat_tokenizer(model_dir: str) -> ChatTokenizer:
    """The chat tokenizer of a policy directory on this node, loaded once per process."""
    from transformers import AutoTokenizer

    return fetched_chat_tokenizer(model_dir, lambda: AutoTokenizer.from_pretrained(model_dir))


def checked_messages(prompt: object, where: str) -> list[ChatMessage]:
    """``prompt`` as a list of ``{"role", "content"}`` messages ending with one to answer; else a clear error."""
    if not isinstance(prompt, list) or not prompt:
        raise ChatPromptError(f"{where}: render_prompt returned {type(prompt).__name__}, expected a str or a "
                              "non-empty list of chat messages")
    for index, message in enumerate(prompt):
        if not isinstance(message, dict) or set(message) != {"role", "content"}:
            raise ChatPromptError(f"{where}: message {index} is {message!r:.120}, expected a dict with exactly the "
                                  "keys 'role' and 'content'")
        if message["role"] not in ROLES or not isinstance(message["content"], str):
            raise ChatPromptError(f"{where}: message {index} has role {message['role']!r} and content of type "
                                  f"{type(message['content']).__name__}; roles are {ROLES}, content is a str")
    if prompt[-1]["role"] == "assistant":
        raise ChatPromptError(f"{where}: the last message is the assistant's; end with a system or user message "
                              "for the agent to answer")
    return [{"role": m["role"], "content": m["content"]} for m in prompt]


@dataclass
class _Conversation:
    messages: list[ChatMessage]
    """What the agent was shown last turn, then its reply as an assistant message."""
    ids: list[int]
    """The last turn's prompt ids + response ids, exactly as sampled."""


class ChatSession:
    """The chat conversations of one batch of episodes, per (episode, role): what each request sends the engine.

    ``request`` gives a turn's engine prompt (the str as it is, or token ids); ``record`` keeps the reply, so the
    role's next turn in that episode extends the ids. ``tokenizer_of(role)`` gives the role's ``ChatTokenizer``;
    it is called only when that role is first given chat messages (a plain-string agent needs no template).
    """

    def __init__(self, environment: str, tokenizer_of: Callable[[str], ChatTokenizer]) -> None:
        self.environment, self._tokenizer_of = environment, tokenizer_of
        self._tokenizers: dict[str, ChatTokenizer] = {}
        self._chats: dict[tuple[int, str], _Conversation | None] = {}  # None: the role's earlier turn was a str
        self._pending: dict[tuple[int, str], tuple[list[ChatMessage], list[int]]] = {}

    def tokenizer(self, role: str, where: str = "") -> ChatTokenizer:
        if role not in self._tokenizers:
            try:
                self._tokenizers[role] = self._tokenizer_of(role)
            except ChatPromptError as error:
                raise ChatPromptError(f"{where or self._where(role, None)}: {error}") from None
        return self._tokenizers[role]

    def _where(self, role: str, turn: int | None) -> str:
        return f"environment {self.environment!r}, role {role!r}" + ("" if turn is None else f", turn {turn}")

    def request(self, episode: int, role: str, turn: int, prompt: Prompt) -> str | list[int]:
        """What the engine is sent for ``role``'s ``turn`` of ``episode``, given what ``render_prompt`` returned."""
        key, where = (episode, role), self._where(role, turn)
        earlier = self._chats.get(key)
        if isinstance(prompt, str):
            if isinstance(earlier, _Conversation):
                raise ChatPromptError(f"{where}: render_prompt returned a str after chat messages earlier in the "
                                      "episode; a role's turns in one episode are all strings or all messages")
            self._chats[key] = None
            return prompt
        messages = checked_messages(prompt, where)
        tokenizer = self.tokenizer(role, where)
        if key not in self._chats:
            ids = tokenizer.first_ids(messages)
        elif earlier is None:
            raise ChatPromptError(f"{where}: render_prompt returned chat messages after a str earlier in the "
                                  "episode; a role's turns in one episode are all strings or all messages")
        else:
            _check_history(earlier.messages, messages, where)
            ids = tokenizer.continued_ids(earlier.ids, messages[len(earlier.messages):])
        self._pending[key] = (messages, ids)
        return ids

    def record(self, episode: int, role: str, text: str, response_ids: list[int]) -> None:
        """Keep the reply to the last ``request`` of (episode, role), for that role's next turn."""
        pending = self._pending.pop((episode, role), None)
        if pending is not None:
            messages, ids = pending
            self._chats[(episode, role)] = _Conversation([*messages, {"role": "assistant", "content": text}],
                                                         [*ids, *response_ids])

    def prompt_text(self, role: str, request: str | list[int]) -> str:
        """The request as text for display: the str itself, or the ids decoded (never tokenized again)."""
        return request if isinstance(request, str) else self.tokenizer(role).decode(request)


def _check_history(known: list[ChatMessage], messages: list[ChatMessage], where: str) -> None:
    """A later turn's messages must start with the earlier turn's messages and the agent's reply to them."""
    for index, expected in enumerate(known):
        got = messages[index] if index < len(messages) else None
        if got != expected:
            what = "its previous reply" if index == len(known) - 1 else "one it was shown"
            raise ChatPromptError(
                f"{where}: the messages must start with the {len(known) - 1} messages this role was shown at its "
                f"previous turn and its reply as an assistant message (so the earlier ids are extended, not "
                f"re-tokenized); message {index} should be {what}: expected {expected!r:.160}, got {got!r:.160}")
