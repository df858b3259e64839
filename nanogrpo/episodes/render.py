"""Chat messages to token ids for multi-turn episodes, without re-tokenising the context.

An episode's context grows by pieces: the first observation (the prompt), then per turn what the model
sampled and what follows it (the rest of the template's close of the model's message, the
environment's next message(s), the generation prompt). :class:`ChatRenderer` turns each piece into
token ids on its own:

- the chat template is rendered with a marker in place of each message's content, and the text
  between markers (the template's own, with its control tokens) is tokenised as usual;
- each content is tokenised with ``split_special_tokens``: an observation's text that spells
  ``<|im_end|>`` stays text, so an environment that echoes the model cannot forge a turn boundary;
- what follows a model turn is the template's rendering of ``[user, assistant] + new messages``
  past that of ``[user, assistant]``, from the assistant content's end: the template's close of the
  model's message minus the EOS the model sampled itself (``<|im_end|>`` -> ``"\\n"``), then the new
  messages and the generation prompt. A template whose rendering of a longer conversation does not
  extend the shorter one's cannot be used this way: a :class:`~nanogrpo.errors.ModelError` says so.

Template pieces are tokenised once per shape (the roles of the messages) and cached.

Text from outside (an environment's observation, a tool's output, an agent program's messages) is
measured in bytes before it is tokenised: ``n`` tokens hold at most ``n * token_bytes(tokenizer)``
bytes of text (:func:`token_bytes`), so text over that bound is refused (or cut) without tokenising
it, however large it is.
"""

from __future__ import annotations

import re
from functools import lru_cache

from nanogrpo.data.prompts import render_plain
from nanogrpo.errors import ModelError

_MARK = "\x00{}\x00"
_SPLIT = re.compile("\x00(\\d+)\x00")
_BASE = [{"role": "user", "content": "\x00u\x00"}, {"role": "assistant", "content": "\x00a\x00"}]


TOKEN_BYTES_FLOOR = 4
"""One token stands for at least one character, up to 4 bytes in UTF-8 (an unknown character maps to one
``unk`` token in a character-level vocabulary)."""


@lru_cache(maxsize=8)
def token_bytes(tokenizer) -> int:
    """The most bytes of text one token of ``tokenizer`` can stand for: its longest vocabulary entry in
    UTF-8 bytes (an upper bound for byte-level BPE, SentencePiece and WordPiece entries alike), at least
    :data:`TOKEN_BYTES_FLOOR`. Text of more than ``n * token_bytes(tok)`` bytes cannot fit in ``n``
    tokens (a normaliser that merges characters, e.g. NFC of decomposed text, aside). Computed once per
    tokenizer (a pass over its vocabulary: milliseconds)."""
    try:
        vocab = tokenizer.get_vocab()
    except (AttributeError, NotImplementedError):
        return 64  # no vocabulary to read: a generous bound (the longest entries of common BPEs are < 64)
    longest = max((len(t.encode("utf-8", "surrogatepass")) for t in vocab if isinstance(t, str)), default=0)
    return max(TOKEN_BYTES_FLOOR, longest)


class ChatRenderer:
    """Token ids of a prompt and of what follows each model turn (see the module docstring)."""

    def __init__(self, tokenizer, template: str = "auto", system_prompt: str | None = None):
        if template not in ("auto", "plain"):
            raise ModelError(f"unknown chat template mode {template!r} (use auto or plain)")
        if template == "auto" and not getattr(tokenizer, "chat_template", None):
            raise ModelError(
                "the tokenizer has no chat template; set model.chat_template=plain for base models"
            )
        self.tok, self.template, self.system = tokenizer, template, system_prompt or ""
        self._cache: dict[tuple, list] = {}
        eos = tokenizer.eos_token or ""
        self.eos_text = eos

    # ------------------------------------------------------------------ text

    def _render(self, messages: list[dict[str, str]], generation: bool) -> str:
        if self.template == "plain":
            text = render_plain(messages)
            return text if generation else text[: -len("Assistant:")]
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)

    def _encode(self, text: str, plain: bool = False) -> list[int]:
        if not text:
            return []
        return list(self.tok(text, add_special_tokens=False, split_special_tokens=plain)["input_ids"])

    def _pieces(self, key: tuple, text: str) -> list:
        """``text`` with markers -> [template ids, slot index, template ids, ...] (cached by ``key``)."""
        if key not in self._cache:
            out: list = []
            parts = _SPLIT.split(text)
            for i, part in enumerate(parts):
                out.append(int(part) if i % 2 else self._encode(part))
            self._cache[key] = out
        return self._cache[key]

    def _fill(self, pieces: list, contents: list[str]) -> list[int]:
        ids: list[int] = []
        for p in pieces:
            ids += self._encode(contents[p], plain=True) if isinstance(p, int) else p
        return ids

    @staticmethod
    def _marked(messages: list[dict[str, str]]) -> list[dict[str, str]]:
        return [{**m, "content": _MARK.format(i)} for i, m in enumerate(messages)]

    # ------------------------------------------------------------------ ids

    def messages(self, observation) -> list[dict[str, str]]:
        """The first observation as chat messages: a string is the user's message after the system
        prompt (if any); a list of messages is taken as it is."""
        if isinstance(observation, str):
            head = [{"role": "system", "content": self.system}] if self.system else []
            return head + [{"role": "user", "content": observation}]
        return list(observation)

    def prompt(self, observation) -> list[int]:
        """Token ids of the prompt an episode starts from (generation prompt included)."""
        msgs = self.messages(observation)
        key = ("prompt", tuple(m["role"] for m in msgs))
        if key not in self._cache:
            self._pieces(key, self._render(self._marked(msgs), True))
        return self._fill(self._cache[key], [m["content"] for m in msgs])

    def after_turn(self, observation) -> list[int]:
        """Token ids that follow a model turn ended by EOS: the close of its message (less the EOS), the
        observation (a string: the user's message; or messages) and the generation prompt."""
        msgs = (
            [{"role": "user", "content": observation}] if isinstance(observation, str) else list(observation)
        )
        key = ("turn", tuple(m["role"] for m in msgs))
        if key not in self._cache:
            marked = self._marked(msgs)
            short = self._render(_BASE, False)
            long = self._render(_BASE + marked, True)
            if not long.startswith(short) or "\x00a\x00" not in short:
                raise ModelError(
                    "the chat template does not render a longer conversation as an extension of "
                    "a shorter one: multi-turn episodes cannot use it (set model.chat_template)"
                )
            close = short.split("\x00a\x00", 1)[1]
            if self.eos_text and close.startswith(self.eos_text):
                close = close[len(self.eos_text) :]
            self._pieces(key, close + long[len(short) :])
        return self._fill(self._cache[key], [m["content"] for m in msgs])
