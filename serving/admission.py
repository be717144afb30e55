"""The bounded waiting queue: how many accepted requests (and prompt tokens) may wait for the
engine before new ones are turned away with 429 / RESOURCE_EXHAUSTED.

A request counts as waiting from its admission until its first output (its prefill is done) or
its end, whichever comes first. Without this bound a burst queues without limit inside the
scheduler and every request's latency grows with it; with it, clients get an immediate, retryable
answer. All calls come from the server's event loop, so there is no locking.
"""

from __future__ import annotations

from serving.errors import Overloaded


class Ticket:
    """One admitted request's place in the waiting counts; release() is idempotent."""

    __slots__ = ("_queue", "tokens", "_released")

    def __init__(self, queue: AdmissionQueue, tokens: int) -> None:
        self._queue, self.tokens, self._released = queue, tokens, False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._queue._release(self)


class AdmissionQueue:
    def __init__(self, max_requests: int, max_tokens: int, *, retry_after_s: float = 1.0) -> None:
        if max_requests < 1 or max_tokens < 1:
            raise ValueError(f"max_requests ({max_requests}) and max_tokens ({max_tokens}) must be >= 1")
        self.max_requests, self.max_tokens, self.retry_after_s = max_requests, max_tokens, retry_after_s
        self.waiting_requests = 0
        self.waiting_tokens = 0
        self.num_rejected = 0

    def admit(self, num_tokens: int) -> Ticket:
        """A ticket for a request of `num_tokens` prompt tokens, or Overloaded naming the full limit.

        A request bigger than max_tokens on its own is still admitted into an empty queue, so that
        a long prompt that fits the model is never refused forever."""
        if self.waiting_requests + 1 > self.max_requests:
            self.num_rejected += 1
            raise Overloaded(
                f"the waiting queue is full: {self.waiting_requests} requests waiting; max_waiting_requests is "
                f"{self.max_requests}; retry later", code="queue_full", retry_after=self.retry_after_s)
        if self.waiting_requests and self.waiting_tokens + num_tokens > self.max_tokens:
            self.num_rejected += 1
            raise Overloaded(
                f"the waiting queue is full: {self.waiting_tokens} prompt tokens waiting + {num_tokens} exceeds "
                f"max_waiting_tokens {self.max_tokens}; retry later", code="queue_full",
                retry_after=self.retry_after_s)
        self.waiting_requests += 1
        self.waiting_tokens += num_tokens
        return Ticket(self, num_tokens)

    def _release(self, ticket: Ticket) -> None:
        self.waiting_requests -= 1
        self.waiting_tokens -= ticket.tokens
