"""Per-request inputs (SamplingParams) and the scheduler's per-request state (Request).

Pure Python, no JAX: the scheduler and the servers' validation both import this module.
"""

from __future__ import annotations

import enum
import math
import numbers
import operator
from dataclasses import dataclass, field
from typing import Container, Iterator, Mapping, Sequence

# Finish reasons, as the OpenAI API spells them.
FINISH_STOP = "stop"  # EOS, a stop token id or a stop string
FINISH_LENGTH = "length"  # max_tokens (or max_model_len) reached
FINISH_ABORT = "abort"  # cancelled by the client or the engine

# What each output of a running request carries (SamplingParams.output_kind), as vLLM names them.
OUTPUT_CUMULATIVE = "cumulative"  # the whole text, token ids and logprobs so far
OUTPUT_DELTA = "delta"  # only what this output adds (text, token_ids and logprobs == the new_* fields)
OUTPUT_FINAL_ONLY = "final_only"  # no output until the request finishes
OUTPUT_KINDS = (OUTPUT_CUMULATIVE, OUTPUT_DELTA, OUTPUT_FINAL_ONLY)

# Token ids a request may bias (SamplingParams.logit_bias): the width of the sampling rows' bias
# columns (runtime/sampling.py), fixed so that every step ships one shape.
MAX_LOGIT_BIAS = 32


_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_INTS = ("top_k", "seed", "logprobs", "min_tokens", "max_tokens", "n")
_ALL_TOKENS = 2**31 - 1  # a top_k at least this keeps every token (the sampling rows hold it as an int32)
_F32_MAX, _F32_TINY = 3.4028234663852886e38, 1.1754943508222875e-38
GREEDY_BELOW = 1e-5  # a temperature below this samples greedily (vLLM's _SAMPLING_EPS)
# The sampler scales logits by 1 / temperature (XLA's rewrite of the division). Up to this, a
# logit above 1e-8 in magnitude stays a normal float32 when scaled; past ~8.5e37 the reciprocal
# itself is subnormal, flushed to 0, and every token ties (top-k and top-p then kept them all).
MAX_TEMPERATURE = 1e30
# Logits are divided or multiplied by the repetition penalty in float32: within these they stay
# finite (for |logits| up to ~3e8), so penalised tokens keep their order.
REPETITION_PENALTY_RANGE = (1e-30, 1e30)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. Validated on construction; the engine samples inside the step.

    top_k 0 (or -1) and top_p 1.0 and min_p 0.0 disable those filters; temperature 0 is greedy, and
    so is one below GREEDY_BELOW (vLLM's rule: logits divided by it would overflow float32). The
    float settings must lie within float32's range, which the sampler computes in; temperature at
    most MAX_TEMPERATURE and repetition_penalty within REPETITION_PENALTY_RANGE, where the scaled or
    penalised logits stay finite float32s in their order.
    max_tokens None means "until max_model_len". logprobs None returns none; an int asks for the
    sampled token's logprob plus that many top alternatives (the engine enforces its own cap).
    logit_bias maps token ids to a value in [-100, 100] added to their logits before the penalties
    and sampling (OpenAI's logit_bias), at most MAX_LOGIT_BIAS ids; logprobs stay those of the
    model's raw distribution.

    output_kind (OUTPUT_KINDS) says what the outputs of a running request carry when the engine
    streams them (Engine.step with partial outputs, the async engine): "cumulative" copies the
    whole sequence so far into every output, which costs the engine's host O(length) per request
    per step; "delta" sends only what is new (streaming servers); "final_only" sends nothing until
    the end. The final output (finished=True) is always cumulative.

    min_tokens: no EOS, stop token id or stop string ends a sequence before it has that many
    tokens (EOS and stop token ids are banned from sampling until then; stop strings are looked
    for from the next token on), as in vLLM. stop and stop_token_ids take None for none.

    skip_special_tokens (vLLM's name and default) leaves the tokenizer's special tokens (BOS, EOS,
    chat markers such as <|im_end|>) out of the output text; their ids stay in token_ids. Stop
    strings are matched against the text as produced, so with False they can match those markers.

    The text ends before what stopped it: the matched stop string, or the text of the stop token
    (EOS or one of stop_token_ids) that ended the sequence, whose id stays in token_ids. With
    include_stop_str_in_output (vLLM's name) the text keeps them.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logprobs: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    min_tokens: int = 0
    max_tokens: int | None = 16
    ignore_eos: bool = False
    n: int = 1
    logit_bias: Mapping[int, float] | None = None
    output_kind: str = OUTPUT_CUMULATIVE
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        # Copies, so that a caller mutating its list cannot change a submitted request (None: none, as in vLLM).
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", [_token_id(t, "stop_token_ids") for t in self.stop_token_ids or ()])
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, Mapping):
                raise ValueError(f"logit_bias must be a mapping of token id to bias, got {self.logit_bias!r}")
            object.__setattr__(self, "logit_bias", {_token_id(t, "logit_bias keys"): _bias(v, t)
                                                    for t, v in self.logit_bias.items()} or None)
        for name in _INTS:  # numpy integers (a sweep's np.arange) as ints; bools and floats are refused below
            v = getattr(self, name)
            if isinstance(v, numbers.Integral) and not isinstance(v, (int, bool)):
                object.__setattr__(self, name, operator.index(v))
        if self.top_k == -1:  # the vLLM / HF spelling of "disabled"
            object.__setattr__(self, "top_k", 0)
        self._validate()
        if self.top_k >= _ALL_TOKENS:  # more than any vocabulary: every token, as disabled (vLLM clamps it)
            object.__setattr__(self, "top_k", 0)
        if self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)
        for name in _FLOATS:  # floats, and -0.0 as 0.0: the sampling rows tell settings by their bits
            object.__setattr__(self, name, float(getattr(self, name)) + 0.0)

    def _validate(self) -> None:
        def fail(msg: str) -> None:
            raise ValueError(msg)

        for name in _FLOATS:
            v = getattr(self, name)
            if not isinstance(v, numbers.Real) or isinstance(v, bool):
                fail(f"{name} must be a number, got {v!r}")
            if not is_finite(v):
                fail(f"{name} must be a finite number, got {v if isinstance(v, float) else 'an int past the range of floats'}")
            if abs(v) > _F32_MAX:
                fail(f"{name} must be within float32's range (|x| <= {_F32_MAX:.4g}), got {v:g}")

        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            fail(f"temperature must be a number in [0, {MAX_TEMPERATURE:g}] (the sampler scales by its reciprocal in "
                 f"float32), got {self.temperature:g}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            fail(f"top_k must be an int >= 0 (0 or -1 disables it), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            fail(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            fail(f"min_p must be in [0, 1], got {self.min_p}")
        lo, hi = REPETITION_PENALTY_RANGE
        if not lo <= self.repetition_penalty <= hi:
            fail(f"repetition_penalty must be a number in [{lo:g}, {hi:g}] (logits are divided or multiplied by it "
                 f"in float32), got {self.repetition_penalty:g}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            fail(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            fail(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            fail(f"seed must be an int or None, got {self.seed!r}")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool) or self.logprobs < 0
        ):
            fail(f"logprobs must be None or an int >= 0, got {self.logprobs!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                fail(f"stop strings must be non-empty strings, got {s!r}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            fail(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None:
            if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
                fail(f"max_tokens must be None or an int >= 1, got {self.max_tokens!r}")
            if self.min_tokens > self.max_tokens:
                fail(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            fail(f"n must be an int >= 1, got {self.n!r}")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                fail(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.output_kind not in OUTPUT_KINDS:
            fail(f"output_kind must be one of {', '.join(OUTPUT_KINDS)}, got {self.output_kind!r}")
        if self.logit_bias is not None and len(self.logit_bias) > MAX_LOGIT_BIAS:
            fail(f"logit_bias has {len(self.logit_bias)} token ids; at most {MAX_LOGIT_BIAS} are supported")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and queued again for recompute
    RUNNING = "running"  # holds a slot; prefilling or decoding
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One sequence's state as the scheduler sees it. The scheduler owns and mutates it.

    token_ids is the prompt followed by the generated tokens. num_computed_tokens of them have
    their K/V in `pages` (page i holds positions [i*G, (i+1)*G)); the last sampled token is never
    computed until the next step feeds it.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # sampling_params.max_tokens resolved against max_model_len
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0  # lower runs earlier; ties are first come, first served
    cache_salt: str | None = None  # requests with different salts never share cached pages
    arrival: int = 0  # admission order key, assigned by the scheduler
    fork_index: int = 0  # 0 for a submitted request; i for the i-th child forked from it
    parent_id: str | None = None

    status: RequestStatus = RequestStatus.WAITING
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    pages: list[int] = field(default_factory=list)
    page_hashes: list[bytes] = field(default_factory=list)  # chain hashes of full pages of token_ids
    slot: int | None = None
    # Which occupancy of its slot this is: a new value at every admission, unique within the
    # scheduler, so state kept per slot on the device (the executor's page table) knows when a slot's
    # pages start over.
    lease: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_preemptions: int = 0

    # Scheduler bookkeeping.
    prefill_target: int = 0  # tokens to compute before decoding; set at each admission
    num_registered_pages: int = 0  # pages [0, this) are offered to the prefix cache already
    inflight: tuple[int, int] = (0, 0)  # page index range whose hashes are marked as being computed
    admitted_once: bool = False

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def is_prefill(self) -> bool:
        return self.num_computed_tokens < self.prefill_target

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def order_key(self) -> tuple[int, int, int]:
        return (self.priority, self.arrival, self.fork_index)

    def check_stop_token(self, token_id: int, n: int | None = None) -> tuple[str, int | str | None] | None:
        """The finish reason after `token_id` was appended as output token number `n` (default: the
        last one), or None to keep going."""
        p = self.sampling_params
        if n is None:  # num_output_tokens, without the property call (per token per step)
            n = len(self.token_ids) - len(self.prompt_token_ids)
        if n >= p.min_tokens:
            if not p.ignore_eos and token_id in self.eos_token_ids:
                return FINISH_STOP, None
            if token_id in p.stop_token_ids:
                return FINISH_STOP, token_id
        if n >= self.max_tokens:
            return FINISH_LENGTH, None
        return None


def _token_id(t, what: str) -> int:
    # operator.index accepts numpy integers (tokenizers return them) and refuses floats and bools.
    try:
        if isinstance(t, bool):
            raise TypeError
        v = operator.index(t)
    except TypeError:
        raise ValueError(f"{what} must be ints >= 0, got {t!r}") from None
    if v < 0:
        raise ValueError(f"{what} must be ints >= 0, got {t!r}")
    if v >= _MAX_TOKEN_ID:  # (no vocabulary is that large; the prefix cache hashes ids as int64)
        raise ValueError(f"{what} must be ints below 2**31, got {t!r}")
    return int(v)


_MAX_TOKEN_ID = 2**31


def _bias(v, token) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not -100.0 <= v <= 100.0:
        raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {v!r} for token {token!r}")
    return float(v)


def new_request_id(prefix: str, counter: Iterator[int], live: Container[str]) -> str:
    """`prefix` + the next number of `counter` that no live request has as its id (a caller may have
    chosen such an id for one of its own)."""
    while (request_id := f"{prefix}{next(counter)}") in live:
        pass
    return request_id


def is_finite(v: numbers.Real) -> bool:
    """Whether a real number is finite; an int past float's range is not (math.isfinite raises)."""
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def request_label(request_id: str | None) -> str:
    """The prefix that names a request in an error message ("request 'x': "); none for an unnamed one."""
    return f"request {request_id!r}: " if request_id else ""


def check_priority(priority) -> None:
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"priority must be an int, got {priority!r}")


def validate_cache_salt(cache_salt: object) -> str | None:
    """`cache_salt` when it is a string (any: the prefix cache hashes lone surrogates too) or None;
    else ValueError, before the scheduler hashes it inside a step."""
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise ValueError(f"cache_salt must be a string or None, got {cache_salt!r}")
    return cache_salt


def validate_prompt(prompt_token_ids: Sequence[int]) -> list[int]:
    """A new list of the prompt's ids, or ValueError. A list of plain ints is checked in C-speed
    builtins (~24 us for 512 ids, against ~107 us id by id); anything else id by id."""
    ids = prompt_token_ids
    if type(ids) is list and ids and set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < _MAX_TOKEN_ID:
        return list(ids)
    ids = [_token_id(t, "prompt token ids") for t in prompt_token_ids]
    if not ids:
        raise ValueError("prompt has 0 tokens; at least 1 is needed")
    return ids
