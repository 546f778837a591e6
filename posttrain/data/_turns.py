"""Token-in / token-out conversations: the ids of each new turn, never a re-render of old ones.

Multi-turn rollouts (and the episode-recording endpoint) grow one token sequence per episode:
the prompt's ids, then each turn's sampled ids as the sampler drew them, then the ids of what
the environment answered. Re-rendering the whole conversation with the chat template and
re-tokenizing it would give different ids for earlier turns whenever the template or the
tokenizer does not round-trip what the model sampled (whitespace, a tool call's JSON layout,
merges across a turn boundary), and the trainer would then score tokens the sampler never
drew. So `Turns` renders only the difference a new message makes:

- `prompt(messages)`: the first prompt, rendered with the tools and the generation prompt.
- `observation(history, new)`: the text the template puts after the conversation `history`
  (which ends with the model's turn) once `new` messages (tool results, a user's reply) and
  the next generation prompt are added, plus what the template writes after the model's
  end-of-turn token (Qwen's newline), which the sampler never generates.

A template that rewrites earlier turns when later ones are added (some drop past reasoning)
cannot be extended this way; `observation` says so instead of guessing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from posttrain.data._tokenizer import Tokenizer

_PROBE = "\x00posttrain-probe\x00"


class Turns:
    """The ids of each part of a conversation for one tokenizer, chat template and tool set.

    Args:
      tokenizer: a `posttrain.data.Tokenizer` with a chat template.
      tools: JSON schemas (`tool_schema`) the template renders into the prompt, or None.
      chat_template: a template name or text (default: the tokenizer's).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        tools: Sequence[Mapping] | None = None,
        chat_template: str | None = None,
    ):
        self.tokenizer, self.tools, self.chat_template = tokenizer, tools or None, chat_template
        self.end, self.after_end = self._end_of_turn()

    def render(self, messages: Sequence[Mapping], *, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=generation_prompt,
            tokenize=False,
            tools=self.tools,
            chat_template=self.chat_template,
        )

    def prompt(self, messages: Sequence[Mapping]) -> list[int]:
        """The ids of the conversation's start, ending with the generation prompt."""
        return self.encode(self.render(messages, generation_prompt=True))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def observation(
        self, history: Sequence[Mapping], new: Sequence[Mapping], *, ended: bool = True
    ) -> list[int]:
        """The ids that follow the model's last turn in `history` when `new` messages arrive,
        through the generation prompt of its next turn.

        Args:
          history: the conversation so far; its last message is the model's turn, as parsed
            from what it sampled (content and tool calls).
          new: the messages that answer it (role "tool" or "user").
          ended: the sampled turn ended with an end-of-turn token; what the template writes
            after that token (e.g. a newline) comes first. A turn cut by its token budget
            (False) is closed here: the end-of-turn token comes first, then that.

        Raises:
          ValueError: the template renders `history` differently once `new` follows it.
        """
        before = self.render(history, generation_prompt=False)
        after = self.render([*history, *new], generation_prompt=True)
        if not after.startswith(before):
            raise ValueError(
                "the chat template renders earlier turns differently once new messages follow "
                "(it is not prefix-stable), so an episode cannot be extended token in / token "
                f"out; first difference at character {_first_difference(before, after)}: "
                f"{before[-60:]!r} became {after[len(before) - 60 : len(before) + 20]!r}. Use a "
                "template that leaves past turns as they are (chat_template=...)"
            )
        closing = self.after_end if ended else self.end + self.after_end
        return self.encode(closing + after[len(before) :])

    def _end_of_turn(self) -> tuple[str, str]:
        """(the end-of-turn token's text, what the template writes after it) for an assistant
        turn: ("<|im_end|>", "\n") for ChatML."""
        ask = [{"role": "user", "content": "?"}]
        ends = [
            self.tokenizer.decode([e], skip_special_tokens=False) for e in self.tokenizer.eos_ids
        ]
        try:
            full = self.render(
                [*ask, {"role": "assistant", "content": _PROBE}], generation_prompt=False
            )
        except Exception:  # a template that refuses the probe: assume nothing follows the end
            return (ends or [""])[0], ""
        tail = full[full.rfind(_PROBE) + len(_PROBE) :]
        for end in ends:
            if end and tail.startswith(end):
                return end, tail[len(end) :]
        return (ends or [""])[0], ""


def _first_difference(a: str, b: str) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
