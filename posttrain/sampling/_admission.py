"""Admission control for `posttrain serve`: what one request may cost, and how much work the
server takes on at once, counted in sequences and KV tokens rather than HTTP requests (one
request with n=2000 is 2000 sequences).

A request of `prompts` with `n` samples of up to `max_tokens` each costs n x len(prompts)
sequences and, per prompt, its tokens plus n x max_tokens KV tokens (a prompt's samples share
its prefilled blocks). One request over `max_request_samples` sequences, or over the whole
queue's budget, can never be served: 400. A request that would take the queue over
`max_sequences` or `max_tokens`: 429, retry later. The handlers run on one event loop, so the
counters need no lock.
"""

import dataclasses
from collections.abc import Callable

from posttrain.sampling._backend import Settings
from posttrain.sampling._serve_request import _APIError


@dataclasses.dataclass(frozen=True)
class Cost:
    """What a request asks of the engine."""

    sequences: int  # n x prompts
    tokens: int  # KV tokens: each prompt's tokens + n x max_tokens


def cost(prompts: list[list[int]], settings: Settings) -> Cost:
    """The sequences and KV tokens `settings` asks for over `prompts`."""
    tokens = sum(len(p) + settings.n * settings.max_tokens for p in prompts)
    return Cost(settings.n * len(prompts), tokens)


class Admission:
    """The sequences and KV tokens admitted and not yet released (answered, failed, or dropped
    by a client that went away)."""

    def __init__(self, *, max_request_samples: int, max_sequences: int, max_tokens: int):
        self.max_request_samples = max_request_samples
        self.max_sequences, self.max_tokens = max_sequences, max_tokens
        self.requests = self.sequences = self.tokens = 0

    def admit(self, c: Cost) -> Callable[[], None]:
        """Takes `c` on; returns the call that gives it back (once, however often called).

        Raises:
          _APIError: 400 when no queue could take the request, 429 when this one is full now.
        """
        most = min(self.max_request_samples, self.max_sequences)
        if c.sequences > most:
            flag = "request-samples" if most == self.max_request_samples else "sequences"
            raise _APIError(
                f"the request asks for {c.sequences} sequences (n x prompts); this server "
                f"takes at most {most} per request (posttrain serve --max-{flag})",
                param="n",
            )
        if c.tokens > self.max_tokens:
            raise _APIError(
                f"the request needs {c.tokens} KV tokens (prompts + n x max_tokens); this "
                f"server holds at most {self.max_tokens} at once (posttrain serve "
                "--max-queue-tokens): lower n or max_tokens",
                param="max_tokens",
            )
        if (
            self.sequences + c.sequences > self.max_sequences
            or self.tokens + c.tokens > self.max_tokens
        ):
            raise _APIError(
                f"the server is busy ({self.sequences} of {self.max_sequences} sequences, "
                f"{self.tokens} of {self.max_tokens} KV tokens taken); retry later",
                status=429, kind="rate_limit_exceeded",
            )  # fmt: skip
        self.requests += 1
        self.sequences += c.sequences
        self.tokens += c.tokens
        return _Release(self, c)


class _Release:
    """Gives an admitted cost back, once."""

    def __init__(self, admission: Admission, c: Cost):
        self.admission, self.cost = admission, c

    def __call__(self) -> None:
        a, c = self.admission, self.cost
        if c is not None:
            a.requests, a.sequences, a.tokens = (
                a.requests - 1, a.sequences - c.sequences, a.tokens - c.tokens
            )  # fmt: skip
            self.cost = None
