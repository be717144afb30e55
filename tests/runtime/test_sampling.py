"""The sampler programs against numpy references, at fixed shapes (one compile per shape), and
the exactness of a row across the programs its neighbours make a step run."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runtime.request import MAX_LOGIT_BIAS
from runtime.sampling import (SamplingNeeds, count_penalties, empty_rows, greedy, history_placeholder, pad_slots,
                              put_banned, put_positions, run_sampler, sampler_programs, sampling_rows, split_seed,
                              top_k, top_k_method)

S, V, W, NB, M = 4, 64, 16, 4, 5
SLOTS = 6  # the engine's largest seq bucket (at least): every program's tokens are padded to it


@functools.cache
def programs(max_logprobs: int = M, slots: int = SLOTS):
    jitted = {name: jax.jit(p.fn) for name, p in sampler_programs(max_logprobs, slots, V).items()}
    # the tail of the model program (runtime/step.py): the greedy tokens of the raw logits
    jitted["greedy"] = jax.jit(lambda logits, rows: pad_slots(greedy(logits, sampling_rows(rows).banned), slots))
    return jitted


def batch(rows: int = S, **fields) -> np.ndarray:
    """A rows buffer of `rows` neutral rows with `fields` set."""
    b = empty_rows(rows, NB)
    view = sampling_rows(b)
    for name, value in fields.items():
        getattr(view, name)[...] = value
    return b


def sample(logits, rows, history=None, *, prev=None, prev_burst=None, logprobs=True, needs=None, max_logprobs=M,
           history_chunk=W):
    """Tokens and logprobs (None when not asked) as the executor runs the programs. needs:
    default what the rows need, as the packer decides; a caller may switch on more. prev and
    prev_burst: the previous step's tokens that history placeholders stand for (default zeros).
    The count programs read the history in chunks of history_chunk entries."""
    slots = max(SLOTS, len(rows))
    p = programs(max_logprobs, slots)
    logits = np.asarray(logits, np.float32)
    if needs is None:
        needs = SamplingNeeds.of(rows, logprobs=logprobs)
    if history is None and needs.penalties:
        history = np.full((len(rows), W), -1, np.int32)
    prev = np.zeros(slots, np.int32) if prev is None else np.asarray(prev, np.int32)
    tokens, lp = run_sampler(lambda name, *args: p[name](*args), logits, p["greedy"](logits, rows), rows, history, prev,
                             np.zeros((2, slots), np.int32) if prev_burst is None else prev_burst, needs,
                             history_chunk=history_chunk)
    tokens = np.asarray(tokens)
    assert tokens.shape == (slots,) and not tokens[len(rows):].any()  # padding rows are 0
    return tokens[: len(rows)], None if lp is None else jax.tree.map(np.asarray, lp)


def random_logits(rng, rows=S, scale=3.0):
    return (scale * rng.standard_normal((rows, V))).astype(np.float32)


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_greedy_is_argmax_and_logprobs_are_raw():
    rng = np.random.default_rng()
    logits = random_logits(rng)
    tokens, lp = sample(logits, batch())
    np.testing.assert_array_equal(tokens, logits.argmax(-1))
    ref = log_softmax(logits.astype(np.float64))
    np.testing.assert_allclose(lp.sampled, ref[np.arange(S), tokens], atol=1e-5)
    np.testing.assert_array_equal(lp.top_ids, np.argsort(-ref, axis=-1, kind="stable")[:, :M])  # ties: lower id
    np.testing.assert_allclose(lp.top_logprobs, np.sort(ref, axis=-1)[:, ::-1][:, :M], atol=1e-5)


@pytest.mark.parametrize("method", ["plain", "chunked", "split"])
def test_top_k_methods_equal_a_stable_sort(method):
    """Every way `top_k` computes the top k gives a stable descending sort's first k: the same
    values and ids in the same order, ties (many here: values on a coarse grid) to the lower id."""
    rng = np.random.default_rng()
    x = np.round(rng.normal(size=(3, 5000)) * 2).astype(np.float32)  # ~20 distinct values
    x[1, 4990:] = 50.0  # a row whose top sits in the last, partly padded chunk
    for k in (1, 8, 9, 20, 27):
        vals, ids = jax.jit(top_k, static_argnames=("k", "method"))(x, k=k, method=method)
        want = np.argsort(-x, axis=-1, kind="stable")[:, :k]
        np.testing.assert_array_equal(np.asarray(ids), want, err_msg=f"{method} k={k}")
        np.testing.assert_array_equal(np.asarray(vals), np.take_along_axis(x, want, axis=-1))


def test_top_k_method_choice():
    """The GPU's measured choices; lax.top_k elsewhere (docs/benchmarks.md)."""
    assert top_k_method(256, 128_256, 20, "cpu") == "plain"
    assert top_k_method(256, 128_256, 20, "tpu") == "plain"
    assert top_k_method(1, 128_256, 20, "gpu") == "chunked"
    assert top_k_method(32, 128_256, 5, "gpu") == "chunked"
    assert top_k_method(64, 128_256, 20, "gpu") == "split"
    assert top_k_method(256, 128_256, 8, "gpu") == "plain"  # XLA's TopK kernel takes k <= 16 at once
    assert top_k_method(1, 512, 20, "gpu") == "split"  # chunks of 4 entries: too few
    assert top_k_method(1, 128_256, 0, "gpu") == "plain"


def test_no_logprobs_requested_returns_none():
    logits = random_logits(np.random.default_rng())
    tokens, lp = sample(logits, batch(), logprobs=False)
    assert lp is None
    np.testing.assert_array_equal(tokens, logits.argmax(-1))


def penalized_reference(logits, history, num_prompt, rep, pres, freq):
    out = logits.astype(np.float64).copy()
    for s in range(len(out)):
        ids = [t for t in history[s] if t >= 0]
        outputs = ids[num_prompt[s]:]
        for t in set(ids):
            out[s, t] = out[s, t] / rep[s] if out[s, t] > 0 else out[s, t] * rep[s]
        for t in set(outputs):
            out[s, t] -= freq[s] * outputs.count(t) + pres[s]
    return out


def test_penalties_match_reference():
    rng = np.random.default_rng()
    logits = random_logits(rng, scale=0.3)  # small spread: penalties decide the argmax
    history = np.full((S, W), -1, np.int32)
    num_prompt = np.zeros(S, np.int32)
    top = np.argsort(-logits, axis=-1)
    for s in range(S):
        n = int(rng.integers(4, W))
        ids = np.concatenate([top[s, :3], rng.integers(0, V, n - 3)])  # the current favourites repeat
        history[s, :n] = ids
        num_prompt[s] = int(rng.integers(0, n))
    rep = np.array([1.0, 1.5, 1.0, 2.0], np.float32)
    pres = np.array([0.0, 0.0, 1.0, 0.5], np.float32)
    freq = np.array([0.0, 0.0, 0.5, 1.0], np.float32)
    b = batch(num_prompt=num_prompt, repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq)
    tokens, lp = sample(logits, b, history)
    ref = penalized_reference(logits, history, num_prompt, rep, pres, freq)
    np.testing.assert_array_equal(tokens, ref.argmax(-1))
    assert tokens[0] == logits[0].argmax()  # a row without penalties is untouched
    # Counted in chunks (prompt/output boundaries inside chunks and between them): the same counts.
    p, zeros = programs(), (np.zeros(SLOTS, np.int32), np.zeros((2, SLOTS), np.int32))
    whole = p["count"](b, history, *zeros)
    for chunk in (4, 8):
        parts = count_penalties(lambda name, *args: p[name](*args), b, history, *zeros, chunk=chunk)
        jax.tree.map(np.testing.assert_array_equal, parts, whole)
        np.testing.assert_array_equal(sample(logits, b, history, logprobs=False, history_chunk=chunk)[0], tokens)
    with pytest.raises(ValueError, match="not whole chunks of 5"):
        count_penalties(lambda name, *args: p[name](*args), b, history, *zeros, chunk=5)
    # Logprobs stay those of the raw model distribution.
    np.testing.assert_allclose(lp.sampled, log_softmax(logits.astype(np.float64))[np.arange(S), tokens], atol=1e-5)


def test_logit_bias_is_added_before_the_penalties():
    """A row's bias is added to its ids' logits, then the penalties apply (vLLM's order): biased
    rows sample from the sum, greedy or random; rows without a bias keep their raw logits bit for
    bit (the penalize program runs for all rows once one has a bias). Logprobs stay raw."""
    rng = np.random.default_rng()
    logits = random_logits(rng, scale=0.3)
    ids = np.full((S, MAX_LOGIT_BIAS), -1, np.int32)
    vals = np.zeros((S, MAX_LOGIT_BIAS), np.float32)
    worst = logits.argmin(-1)
    ids[1, :2], vals[1, :2] = [worst[1], 7], [100.0, 1.0]  # row 1: its least likely id wins
    ids[2, :1], vals[2, :1] = [logits[2].argmax()], [-100.0]  # row 2: its favourite is pushed out
    ids[3, :MAX_LOGIT_BIAS] = np.arange(MAX_LOGIT_BIAS)  # row 3: every column used, penalized too
    vals[3] = rng.uniform(-2, 2, MAX_LOGIT_BIAS)
    history = np.full((S, W), -1, np.int32)
    history[3, :4] = np.argsort(-logits[3])[:4]
    b = batch(bias_ids=ids, bias_values=vals, repetition_penalty=np.array([1, 1, 1, 1.5], np.float32))
    assert SamplingNeeds.of(b, logprobs=False).penalties
    biased = logits.astype(np.float64).copy()
    for s in range(S):
        for t, v in zip(ids[s], vals[s]):
            if t >= 0:
                biased[s, t] += v
    ref = penalized_reference(biased, history, np.zeros(S, np.int32), np.array([1, 1, 1, 1.5]), np.zeros(S),
                              np.zeros(S))
    tokens, lp = sample(logits, b, history)
    np.testing.assert_array_equal(tokens, ref.argmax(-1))
    assert tokens[1] == worst[1] and tokens[2] != logits[2].argmax() and tokens[0] == logits[0].argmax()
    np.testing.assert_allclose(lp.sampled, log_softmax(logits.astype(np.float64))[np.arange(S), tokens], atol=1e-5)
    # The penalize program returns row 0's logits unchanged (no bias, no penalty): bit for bit.
    counts = programs()["count"](b, history, np.zeros(SLOTS, np.int32), np.zeros((2, SLOTS), np.int32))
    x, _ = programs()["penalize"](logits, b, counts)
    np.testing.assert_array_equal(np.asarray(x)[0], logits[0])
    # Random rows draw from the biased distribution: +100 on one id takes every draw.
    b2 = batch(bias_ids=ids, bias_values=vals, temperature=1.0, seeds=np.arange(2 * S).reshape(S, 2))
    drawn, _ = sample(logits, b2, logprobs=False)
    assert drawn[1] == worst[1]


def test_penalties_read_placeholders_from_the_previous_tokens():
    """A history entry history_placeholder(-(i + 1)) is the previous step's token of row i, which
    only the device has (lookahead): penalties see it exactly as if the host had written it."""
    rng = np.random.default_rng()
    logits = random_logits(rng, scale=0.3)
    top = np.argsort(-logits, axis=-1)
    history = np.full((S, W), -1, np.int32)
    for s in range(S):
        history[s, :6] = top[s, 1:7]  # everything but the favourite
    prev = rng.integers(0, V, SLOTS).astype(np.int32)
    prev[[1, 3]] = top[[0, 2], 0]  # rows 0 and 2 read their favourite: penalized, it loses the argmax
    b = batch(num_prompt=np.full(S, 2, np.int32), repetition_penalty=1.5, presence_penalty=1.0,
              frequency_penalty=0.5)
    with_placeholders = history.copy()
    with_placeholders[0, 6] = history_placeholder(-(1 + 1))  # row 0's last token: row 1 of the previous step
    with_placeholders[2, 6] = history_placeholder(-(3 + 1))
    resolved = history.copy()
    resolved[0, 6], resolved[2, 6] = prev[1], prev[3]
    got, _ = sample(logits, b, with_placeholders, prev=prev, logprobs=False)
    ref = penalized_reference(logits, resolved, np.full(S, 2), *(np.full(S, x) for x in (1.5, 1.0, 0.5)))
    np.testing.assert_array_equal(got, ref.argmax(-1))
    unresolved, _ = sample(logits, b, history, prev=prev, logprobs=False)  # the token left out
    assert (got != unresolved).any(), "the placeholders changed nothing: the test does not test them"


def test_banned_tokens_are_never_sampled():
    rng = np.random.default_rng()
    logits = random_logits(rng)
    best = logits.argmax(-1)
    banned = np.full((S, NB), -1, np.int32)
    banned[:, 0] = best
    banned[1, 1] = np.argsort(-logits[1])[1]
    tokens, _ = sample(logits, batch(banned=banned))
    assert tokens[0] == np.argsort(-logits[0])[1]
    assert tokens[1] == np.argsort(-logits[1])[2]
    # temperatures past ~1e38: XLA may divide by multiplying with 1/t, 0 in f32, which made the banned
    # -inf NaN, and argmax took a banned id (a min_tokens ban broken)
    for fields in (dict(temperature=5.0), dict(temperature=5.0, top_p=0.99), dict(repetition_penalty=1.5),
                   dict(temperature=1e38), dict(temperature=3e38, top_k=5)):
        tokens, _ = sample(logits, batch(banned=banned, seeds=[[1, 2]] * S, **fields))
        assert not (tokens[:, None] == banned).any(), fields


def test_a_top_p_float32_holds_as_zero_keeps_the_top_token():
    """top_p = 1e-50 is 0 in f32: no token passed, and the cutoff index -1 then kept every token."""
    logits = random_logits(np.random.default_rng())
    for seed in range(4):
        tokens, _ = sample(logits, batch(temperature=1.0, top_p=1e-50, seeds=[[seed, 1]] * S))
        assert (tokens == logits.argmax(-1)).all(), seed


ROWS = 1 << 16  # one call draws 65,536 samples (positions of one seed)
CALLS = 16  # 2^20 samples a distribution: a temperature 1% off fails the mean-logit check by ~10 sd


def draws(logits_row, calls=CALLS, **params):
    """calls * ROWS samples of one distribution: same seed, distinct positions."""
    seed = int(np.random.default_rng().integers(0, 2**63))
    out = []
    for c in range(calls):
        b = batch(ROWS, seeds=split_seed(seed), positions=np.arange(c * ROWS, (c + 1) * ROWS), **params)
        logits = np.broadcast_to(np.asarray(logits_row, np.float32), (ROWS, V))
        out.append(sample(logits, b, logprobs=False, max_logprobs=0)[0])
    return np.concatenate(out)


def check_distribution(samples, probs, logits):
    """samples drawn from probs (f64[V]), by three checks whose false alarms together stay < 1e-5:
    - every cell's count within 5.5 binomial standard deviations of its expectation (V cells: ~2e-6);
    - the G statistic over the cells (those expected < 5 times pooled) below the chi-square bound
      of p = 1e-8 (Wilson-Hilferty);
    - the mean logit of the samples within 5.5 standard errors of its expectation: the direction a
      temperature or filter that is slightly off moves first."""
    n = len(samples)
    counts = np.bincount(samples, minlength=V)
    assert (counts[probs == 0] == 0).all(), "sampled a token with probability 0"
    expected = n * probs
    sd = np.sqrt(expected * (1 - probs)) + 1e-9
    assert (np.abs(counts - expected) <= 5.5 * sd + 1).all(), np.abs(counts - expected).max()
    support = probs > 0
    small = support & (expected < 5)
    obs = np.append(counts[support & ~small], counts[small].sum())
    exp = np.append(expected[support & ~small], expected[small].sum())
    obs, exp = obs[exp > 0], exp[exp > 0]
    df = len(exp) - 1
    if df > 0:
        g = 2 * np.sum(obs[obs > 0] * np.log(obs[obs > 0] / exp[obs > 0]))
        z = ((g / df) ** (1 / 3) - (1 - 2 / (9 * df))) / np.sqrt(2 / (9 * df))
        assert z < 5.6, f"G = {g:.1f} over {df} degrees of freedom (z = {z:.1f})"
    x = np.asarray(logits, np.float64)
    mean, var = probs @ x, probs @ (x - probs @ x) ** 2
    z = (x[samples].mean() - mean) / np.sqrt(var / n + 1e-30)
    assert abs(z) < 5.5, f"mean logit {x[samples].mean():.5f}, expected {mean:.5f} (z = {z:.1f})"


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def test_temperature_samples_the_softmax():
    logits = np.random.default_rng().standard_normal(V).astype(np.float32)
    check_distribution(draws(logits, temperature=0.7), softmax(logits.astype(np.float64) / 0.7), logits)


def test_gumbel_noise_reaches_its_tail():
    """The draw's noise follows the Gumbel distribution past 16 nats: jax.random.gumbel's default
    mode never exceeded ~15.9 (23 bits), so a token that far below a row's top was never drawn.
    Counts over 2^28 values above 12 and 16 (~1,650 and ~30 expected) within 5 standard deviations
    (Poisson); the extreme bit patterns give the range's ends, 22.9 and -2.8."""
    from runtime.sampling import gumbel_from_bits, gumbel_noise

    seed = int(np.random.default_rng().integers(1 << 30))
    ths = jnp.asarray([12.0, 16.0], jnp.float32)
    count = jax.jit(lambda keys: (gumbel_noise(keys, 1 << 22).reshape(-1)[:, None] > ths).sum(0))
    n = sum(np.asarray(count(jax.vmap(lambda i: jax.random.fold_in(jax.random.key(seed), i))(jnp.arange(c, c + 16))))
            for c in range(0, 64, 16))
    expected = 2**28 * -np.expm1(-np.exp(-np.asarray([12.0, 16.0])))
    assert (np.abs(n - expected) <= 5 * np.sqrt(expected)).all(), (n, expected)
    ends = np.asarray(gumbel_from_bits(jnp.asarray([0xFFFFFFFF, 0xFFFFFFF0, 0x80000000, 0], jnp.uint32)), np.float64)
    x = (np.asarray([0, 15]) + 0.5) * 2.0**-32  # (exact in float32)
    np.testing.assert_allclose(ends[:2], -np.log(-np.log1p(-x)), rtol=1e-6)  # 22.87 and 20.22
    np.testing.assert_allclose(ends[2:], [-np.log(np.log(2)), -np.log(-np.log(2.0**-24))], rtol=1e-6)


@pytest.mark.parametrize("kind", ["top_k", "top_p", "min_p", "all"])
def test_filters_sample_the_renormalized_distribution(kind):
    logits = (2 * np.random.default_rng().standard_normal(V)).astype(np.float32)
    T = 1.3
    p = softmax(logits.astype(np.float64) / T)
    order = np.argsort(-p)
    keep = np.ones(V, bool)
    params = dict(temperature=T)
    if kind in ("top_k", "all"):
        params["top_k"] = 10
        keep[order[10:]] = False
    if kind in ("top_p", "all"):
        params["top_p"] = 0.6
        q = np.where(keep, p, 0)
        q = q / q.sum()
        cum = np.cumsum(q[order]) - q[order]
        keep[order[cum >= 0.6]] = False
    if kind in ("min_p", "all"):
        params["min_p"] = 0.1
        q = np.where(keep, p, 0)
        q = q / q.sum()
        keep &= q >= 0.1 * q.max()
    want = np.where(keep, p, 0)
    # 2^17 samples: the temperature's precision is the test above's; here a token kept or dropped
    # wrongly at a filter's boundary (probability >= ~1e-3 there) is many standard deviations off.
    check_distribution(draws(logits, calls=2, **params), want / want.sum(), logits)


NEEDS = [SamplingNeeds(*flags) for flags in itertools.product((False, True), repeat=4)]


def test_row_depends_only_on_its_seed_position_and_logits():
    """The same (seed, position, logits) gives the same token in any slot, whatever the
    neighbours need (penalties, filters, logprobs make the step run more programs)."""
    rng = np.random.default_rng()
    row = random_logits(rng, rows=1)[0]
    seed = split_seed(int(rng.integers(0, 2**63)))
    ref = None
    for slot in range(S):
        for neighbours in ({}, dict(top_k=3, top_p=0.5, min_p=0.2, repetition_penalty=1.5, frequency_penalty=0.5)):
            logits = random_logits(rng)
            logits[slot] = row
            b = batch(temperature=0.9, **neighbours)
            v = sampling_rows(b)
            for name, neutral in (("top_k", 0), ("top_p", 1.0), ("min_p", 0.0), ("repetition_penalty", 1.0),
                                  ("frequency_penalty", 0.0)):
                getattr(v, name)[slot] = neutral
            v.seeds[slot] = seed
            v.positions[slot] = 17
            history = rng.integers(-1, V, (S, W)).astype(np.int32)
            for logprobs in (False, True):
                tokens, _ = sample(logits, b, history, logprobs=logprobs)
                ref = tokens[slot] if ref is None else ref
                assert tokens[slot] == ref, (slot, neighbours, logprobs)


@pytest.mark.parametrize("target", ["greedy", "random"])
def test_row_token_is_the_same_in_every_program_variant(target):
    """A greedy row gets the identical token from the model program's argmax, after penalize, and
    inside either pick program; a seeded random row the identical draw from pick and pick_filtered,
    after penalize or not: the neutral settings are exact identities. Neighbours use everything."""
    rng = np.random.default_rng()
    logits = random_logits(rng)
    b = batch(temperature=[0.0, 0.8, 1.3, 0.0], top_k=[0, 5, 0, 0], top_p=[1.0, 0.9, 1.0, 1.0],
              min_p=[0.0, 0.0, 0.1, 0.0], repetition_penalty=[1.0, 1.4, 1.0, 1.2],
              presence_penalty=[0.0, 0.0, 0.7, 0.0], frequency_penalty=[0.0, 0.3, 0.0, 0.0],
              seeds=[split_seed(int(x)) for x in rng.integers(0, 2**63, S)], positions=rng.integers(0, 999, S))
    history = rng.integers(0, V, (S, W)).astype(np.int32)
    if target == "random":  # row 0 becomes a seeded random row without penalties or filters
        sampling_rows(b).temperature[0] = 0.7
    history[0] = -1
    need = SamplingNeeds(random=target == "random")
    for position in range(8 if target == "random" else 1):  # distinct noise: more chances to differ
        sampling_rows(b).positions[0] = position
        results = {}
        for needs in NEEDS:
            if needs.random or not need.random:  # a random row needs a pick program
                results[needs] = sample(logits, b, history, needs=needs)[0][0]
        assert len(set(results.values())) == 1, (position, results)
    if target == "greedy":
        assert results[need] == logits[0].argmax()


def test_split_seed():
    assert split_seed(5) == (5, 0)
    assert split_seed(2**32 + 7) == (7, 1)
    assert split_seed(-1) == (2**32 - 1, 2**32 - 1)


def test_put_positions_and_banned_write_the_named_columns():
    """The packer's per-step writes by column land where the named views (sampling_rows) read them,
    and nowhere else."""
    rows = empty_rows(4, 3)
    before = rows.copy()
    put_positions(rows, [1, 3], [7, 9])
    put_banned(rows, 2, np.array([5, 6], np.int32))
    v = sampling_rows(rows)
    assert v.positions.tolist() == [0, 7, 0, 9]
    assert v.banned.tolist() == [[-1] * 3, [-1] * 3, [5, 6, -1], [-1] * 3]
    changed = np.argwhere(rows != before).tolist()
    pos = sampling_rows(np.arange(rows.size, dtype=np.int32).reshape(rows.shape)).positions[0]  # its column
    assert sorted(changed) == [[1, pos], [2, rows.shape[1] - 3], [2, rows.shape[1] - 2], [3, pos]]
