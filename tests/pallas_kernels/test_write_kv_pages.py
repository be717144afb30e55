"""The step's KV write: the Triton kernel (gpu_write.write_kv_pages) vs ref_write_kv_pages, the slot
function both use; the same kernel fed the merged QKV projection with RoPE on the
way (gpu_write.write_qkv, the model's write) vs ref_write_qkv, and dispatch.

CPU: the kernel in interpret mode must equal the XLA scatter bit for bit on fresh random ragged
batches (prefill chunks, decodes, chunks crossing pages, padding tokens, junk metadata past
num_seqs) over K x dtype x block size. Padding k/v rows are NaN, so a padding write shows; the
pool is finite random data, so a stray or lost write shows. Interpret mode writes back every
indexed row of a masked store, so a masked lane that shares a row with a real one clobbers it
there (on the GPU it is a no-op): test_padding_lanes_next_to_real_rows puts real rows at the
pool's first and last rows in a block with padding. `gpu`-marked tests run the kernel for real.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dispatch
from pallas_kernels.ragged_paged_attention import gpu_write, kv_write_slots, ref_write_kv_pages, ref_write_qkv

ON_GPU = jax.default_backend() == "gpu"
requires_gpu = pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU")
DTYPES = [jnp.float32, jnp.bfloat16]
JUNK = 1 << 20  # page index / length / offset far out of range


@dataclasses.dataclass(frozen=True)
class Shape:
    K: int
    H: int
    G: int
    T: int  # not a multiple of the test blocks' tokens
    S: int = 6  # metadata rows; rows past num_seqs hold junk
    P_max: int = 4
    spare_pages: int = 3

    @property
    def P(self) -> int:
        return self.S * self.P_max + self.spare_pages


SHAPES = {
    "k1_h128_page16": Shape(K=1, H=128, G=16, T=37),
    "k2_h32_page4": Shape(K=2, H=32, G=4, T=37),
    "k8_h16_page8": Shape(K=8, H=16, G=8, T=29),
}


def random_batch(rng, s: Shape, *, num_seqs: int | None = None, decode_only: bool = False,
                 fill: bool = False):
    """(q_lens, kv_lens) of a random ragged batch: decodes and prefill chunks at random context
    lengths, so writes start mid-page and cross page boundaries; fill=True spends the whole token
    budget (no padding unless a chunk had to be cut to fit its pages)."""
    n = int(rng.integers(1, s.S + 1)) if num_seqs is None else num_seqs
    budget = s.T if fill else int(rng.integers(n, s.T + 1))
    q_lens = np.ones(n, int)
    if not decode_only and n:
        extra = rng.multinomial(budget - n, rng.dirichlet(np.ones(n)))
        q_lens += np.where(rng.random(n) < 0.3, 0, extra) if not fill else extra
        q_lens = np.minimum(q_lens, s.P_max * s.G)
    kv_lens = [int(rng.integers(q, s.P_max * s.G + 1)) for q in q_lens]
    return tuple(int(q) for q in q_lens), tuple(kv_lens)


def make_inputs(s: Shape, q_lens, kv_lens, dtype, rng, kv_dtype=None):
    """Arguments of write_kv_pages (numpy -> jnp), poisoned: NaN padding rows, junk metadata."""
    kv_dtype = kv_dtype or dtype
    K, H, G, T, S, P_max, P = s.K, s.H, s.G, s.T, s.S, s.P_max, s.P
    n = len(q_lens)
    assert n <= S and sum(q_lens) <= T
    page_indices = rng.integers(P + 1, JUNK, (S, P_max)).astype(np.int32)
    free = rng.permutation(P)
    used = 0
    for i, kv_len in enumerate(kv_lens):
        pages = free[used: used + -(-kv_len // G)]
        used += len(pages)
        page_indices[i, : len(pages)] = pages
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cu_q_lens = np.concatenate([cu, rng.integers(0, JUNK, S - n)]).astype(np.int32)
    lens = np.concatenate([np.asarray(kv_lens, np.int32), rng.integers(0, JUNK, S - n)]).astype(np.int32)
    kv = rng.standard_normal((P, G, 2 * K, H), dtype=np.float32)
    k, v = (rng.standard_normal((T, K, H), dtype=np.float32) for _ in range(2))
    k[cu[-1]:] = v[cu[-1]:] = np.nan
    return (jnp.asarray(kv, kv_dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(lens),
            jnp.asarray(page_indices), jnp.asarray(cu_q_lens), jnp.asarray([n], jnp.int32))


def bits(x) -> np.ndarray:
    """The raw bits of an array: equality that also compares NaN payloads and signed zeros."""
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


@functools.lru_cache(maxsize=None)
def _ref_fn():
    return jax.jit(ref_write_kv_pages)


@functools.lru_cache(maxsize=None)
def _slots_fn():
    return jax.jit(kv_write_slots, static_argnames=("num_tokens", "page_size", "num_slots"))


@functools.lru_cache(maxsize=None)
def _kernel_fn(block_sizes):
    return jax.jit(functools.partial(gpu_write.write_kv_pages, block_sizes=block_sizes, interpret=True))


def assert_in_place(compiled, pool_bytes: int, *, check_temps: bool = True):
    """XLA's buffer assignment: the output aliases the donated pool and (check_temps) no
    pool-sized temporary exists, which a copy-in/copy-out around the kernel would need. Interpret
    mode's discharged kernel carries the pool through its grid loop, so only a real kernel's temps
    say anything."""
    ma = compiled.memory_analysis()
    assert ma.alias_size_in_bytes >= pool_bytes, (ma.alias_size_in_bytes, pool_bytes)
    if check_temps:
        assert ma.temp_size_in_bytes < pool_bytes, (ma.temp_size_in_bytes, pool_bytes)


def check_write(run, args, what: str):
    want = _ref_fn()(*args)
    got = run(*args)
    assert got.shape == args[0].shape and got.dtype == args[0].dtype
    written = np.asarray(_slots_fn()(*args[3:], num_tokens=args[1].shape[0], page_size=args[0].shape[1],
                                     num_slots=args[0].shape[0] * args[0].shape[1]))
    assert np.isfinite(np.asarray(want.astype(jnp.float32))).all(), f"{what}: the scatter wrote a padding row"
    np.testing.assert_array_equal(bits(got), bits(want), err_msg=what)
    return written


# ---- slot function --------------------------------------------------------------------------------

def test_padding_before_the_first_sequence_writes_nothing():
    """Tokens before cu_q_lens[0] are padding, as the attention kernels treat them: their slots are
    one past the pool. They got sequence 0's slots and overwrote its cached K/V."""
    G, P = 16, 6
    slots = kv_write_slots(jnp.asarray([7, 0], jnp.int32), jnp.asarray([[3, 1], [0, 0]], jnp.int32),
                           jnp.asarray([2, 3, 3], jnp.int32), jnp.asarray([1], jnp.int32), 4, page_size=G,
                           num_slots=P * G)
    np.testing.assert_array_equal(np.asarray(slots), [P * G, P * G, 3 * G + 6, P * G])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_write_kv_pages(dtype):
    """Each real token lands in page page_indices[s, pos // G], slot pos % G; padding writes nothing;
    writes that cross a page boundary split across two pages."""
    rng = np.random.default_rng(7)
    G, K, H, P, S, P_max, T = 4, 2, 8, 12, 4, 4, 11
    q_lens, kv_lens = (3, 1, 4), (5, 4, 9)  # seq 0 crosses pages 0|1, seq 1 ends a page, seq 2 spans 3
    pi = np.full((S, P_max), JUNK, np.int32)
    pi[0, :2], pi[1, :1], pi[2, :3] = [7, 2], [5], [0, 11, 3]
    cu = np.array([0, 3, 4, 8, JUNK], np.int32)
    kv0 = rng.standard_normal((P, G, 2 * K, H)).astype(np.float32)
    k = rng.standard_normal((T, K, H)).astype(np.float32)
    v = rng.standard_normal((T, K, H)).astype(np.float32)
    out = ref_write_kv_pages(jnp.asarray(kv0, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
                             jnp.asarray(np.array([*kv_lens, JUNK], np.int32)), jnp.asarray(pi), jnp.asarray(cu),
                             jnp.asarray([3], jnp.int32))
    want = np.asarray(jnp.asarray(kv0, dtype).astype(jnp.float32)).copy()
    kq, vq = (np.asarray(jnp.asarray(x, dtype).astype(jnp.float32)) for x in (k, v))
    for s, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        for i in range(q_len):
            pos, t = kv_len - q_len + i, cu[s] + i
            want[pi[s, pos // G], pos % G, 0::2] = kq[t]
            want[pi[s, pos // G], pos % G, 1::2] = vq[t]
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), want)
    assert out.dtype == dtype
    written = np.zeros((P, G), bool)
    written[[7, 7, 2], [2, 3, 0]] = written[5, 3] = True
    written[[11, 11, 11, 3], [1, 2, 3, 0]] = True
    untouched = np.asarray(out.astype(jnp.float32))[~written]
    np.testing.assert_array_equal(untouched, want[~written])  # padding tokens 8..10 wrote nothing
    assert np.asarray(ref_write_kv_pages(jnp.asarray(kv0), jnp.asarray(k), jnp.asarray(v),
                                         jnp.asarray(np.array([*kv_lens, JUNK], np.int32)), jnp.asarray(pi),
                                         jnp.asarray(cu), jnp.asarray([0], jnp.int32)) == kv0).all()


def test_kv_write_slots():
    """Hand-built: seq 0 crosses pages 7|2, seq 1 ends a page, seq 2 spans 3 pages, 3 padding tokens."""
    G, P = 4, 12
    pi = np.full((4, 4), JUNK, np.int32)
    pi[0, :2], pi[1, :1], pi[2, :3] = [7, 2], [5], [0, 11, 3]
    slots = kv_write_slots(jnp.asarray([5, 4, 9, JUNK], jnp.int32), jnp.asarray(pi),
                           jnp.asarray([0, 3, 4, 8, JUNK], jnp.int32), jnp.asarray([3], jnp.int32), 11,
                           page_size=G, num_slots=P * G)
    assert slots.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(slots), [7 * 4 + 2, 7 * 4 + 3, 2 * 4 + 0, 5 * 4 + 3,
                                                      11 * 4 + 1, 11 * 4 + 2, 11 * 4 + 3, 3 * 4 + 0,
                                                      P * G, P * G, P * G])


# ---- GPU kernel (Triton), interpret mode ----------------------------------------------------------

@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("rows", [16, None], ids=["rows16", "default_rows"])
def test_kernel_matches_scatter(shape, dtype, rows):
    s = SHAPES[shape]
    seed = int(np.random.SeedSequence().entropy % (1 << 32))  # fresh batches; the seed reproduces one
    rng = np.random.default_rng(seed)
    run = _kernel_fn(None if rows is None else gpu_write.WriteBlockSizes(rows_per_block=rows))
    batches = [random_batch(rng, s) for _ in range(4)]
    batches += [random_batch(rng, s, decode_only=True), random_batch(rng, s, num_seqs=s.S, fill=True),
                random_batch(rng, s, num_seqs=0)]
    for q_lens, kv_lens in batches:
        args = make_inputs(s, q_lens, kv_lens, dtype, rng)
        written = check_write(run, args, f"seed={seed} q_lens={q_lens} kv_lens={kv_lens}")
        assert (written < s.P * s.G).sum() == sum(q_lens)


@pytest.mark.parametrize("K", [1, 2])
def test_padding_lanes_next_to_real_rows(K):
    """Real rows at the pool's first and last rows share a block (and a store) with padding lanes:
    a masked lane indexed at row 0 or clamped to the last row would clobber them in interpret mode."""
    s = Shape(K=K, H=16, G=4, T=20, S=3, P_max=2, spare_pages=0)
    P, G = s.P, s.G
    rng = np.random.default_rng(0)
    args = list(make_inputs(s, (1, 2), (G, 2), jnp.float32, rng))
    pi = np.asarray(args[4]).copy()
    pi[0, 0], pi[1, 0] = P - 1, 0  # decode at the pool's last slot, a fresh 2-token prefill at slot 0
    args[4] = jnp.asarray(pi)
    written = check_write(_kernel_fn(gpu_write.WriteBlockSizes(rows_per_block=16)), args, "padding lanes")
    np.testing.assert_array_equal(written[:3], [P * G - 1, 0, 1])


@pytest.mark.parametrize("K", [1, 2])
def test_slots_outside_the_pool_write_nothing(K):
    """Padding's slot (num_slots), a page past the pool and a negative slot must be masked: on the
    GPU such a store would land outside the pool, and interpret mode drops out-of-range rows, so
    here the launch gets num_slots below the buffer's slots and the rows past it must keep their bits."""
    H, T, num_slots, guard = 16, 21, 24, 8
    rng = np.random.default_rng()
    slots = rng.permutation(num_slots)[:T].astype(np.int32)
    bad = rng.choice(T, 6, replace=False)
    slots[bad] = [num_slots, num_slots, num_slots + 1, num_slots + guard - 1, -1, -(num_slots + guard)]
    pool = rng.standard_normal(((num_slots + guard) * 2 * K, H)).astype(np.float32)
    k, v = (rng.standard_normal((T, K, H)).astype(np.float32) for _ in range(2))
    k[bad] = v[bad] = np.nan
    out = jax.jit(lambda pool, k, v, slots: gpu_write._write_groups(
        pool, jnp.stack([k, v], axis=2), slots, None, num_slots=num_slots, interpret=True,
        block_sizes=gpu_write.WriteBlockSizes(rows_per_block=16))[1])(
        jnp.asarray(pool), jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots))
    want = pool.copy().reshape(num_slots + guard, K, 2, H)
    ok = np.setdiff1d(np.arange(T), bad)
    want[slots[ok], :, 0], want[slots[ok], :, 1] = k[ok], v[ok]
    np.testing.assert_array_equal(bits(out), bits(want.reshape(pool.shape)))


def test_f32_rows_into_bf16_cache():
    """f32 activations over a bf16 cache: rows are rounded to the cache dtype, like the scatter."""
    s = SHAPES["k2_h32_page4"]
    rng = np.random.default_rng()
    q_lens, kv_lens = random_batch(rng, s)
    args = make_inputs(s, q_lens, kv_lens, jnp.float32, rng, kv_dtype=jnp.bfloat16)
    check_write(_kernel_fn(gpu_write.WriteBlockSizes(rows_per_block=16)), args, f"{q_lens} {kv_lens}")


def test_donated_pool_updated_in_place():
    """jit with kv_pages donated: the pool's buffer is consumed, XLA aliases it to the output, and
    every slot the step does not write keeps its bits."""
    s = SHAPES["k2_h32_page4"]
    rng = np.random.default_rng()
    q_lens, kv_lens = random_batch(rng, s)
    args = make_inputs(s, q_lens, kv_lens, jnp.bfloat16, rng)
    before = bits(args[0]).copy()
    want = _ref_fn()(*args)
    f = jax.jit(functools.partial(gpu_write.write_kv_pages, interpret=True), donate_argnums=0)
    assert_in_place(f.lower(*args).compile(), args[0].nbytes, check_temps=False)
    written = np.asarray(kv_write_slots(*args[3:], s.T, page_size=s.G, num_slots=s.P * s.G))
    out = f(*args)
    assert args[0].is_deleted()
    np.testing.assert_array_equal(bits(out), bits(want))
    untouched = np.ones(s.P * s.G, bool)
    untouched[written[written < s.P * s.G]] = False
    np.testing.assert_array_equal(bits(out).reshape(s.P * s.G, -1)[untouched],
                                  before.reshape(s.P * s.G, -1)[untouched])


def test_kernel_lowers_for_cuda():
    """Pallas' Triton lowering runs on CPU: catches unsupported ops before a GPU run. The pool is
    aliased to the output (operand 2 of the custom call: slots, interleaved K/V rows, pool)."""
    s = SHAPES["k8_h16_page8"]
    args = make_inputs(s, (3, 1), (9, 17), jnp.bfloat16, np.random.default_rng(1))
    f = jax.jit(gpu_write.write_kv_pages, donate_argnums=0)
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "write_kv_pages_gpu" in text and "triton" in text
    assert "output_operand_alias<output_tuple_indices = [], operand_index = 2" in text


@pytest.mark.parametrize("kwargs,message", [
    (dict(rows_per_block=8), "rows_per_block=8 must be >= 16"),
    (dict(rows_per_block=48), "rows_per_block=48 must be a power of two"),
    (dict(num_warps=3), "num_warps=3 must be a power of two"),
    (dict(rows_per_block=True), "rows_per_block=True"),
], ids=str)
def test_write_block_sizes_validate(kwargs, message):
    with pytest.raises(ValueError, match=message):
        gpu_write.WriteBlockSizes(**kwargs)


def test_bad_shapes_raise():
    s = SHAPES["k2_h32_page4"]
    args = make_inputs(s, (1,), (3,), jnp.float32, np.random.default_rng(2))
    with pytest.raises(ValueError, match=r"\[T, 2, 32\]"):
        gpu_write.write_kv_pages(args[0], args[1][:, :1], args[2][:, :1], *args[3:], interpret=True)
    with pytest.raises(ValueError, match=r"k \(37, 2, 32\) and v \(37, 2, 16\)"):
        gpu_write.write_kv_pages(args[0], args[1], args[2][..., :16], *args[3:], interpret=True)
    with pytest.raises(ValueError, match="head dim 24 must be a power of two"):
        gpu_write.write_kv_pages(args[0][..., :24], args[1][..., :24], args[2][..., :24], *args[3:], interpret=True)


# ---- merged QKV with RoPE (gpu_write.write_qkv), interpret mode ------------------------------------------

def make_qkv_inputs(s: Shape, q_lens, kv_lens, dtype, rng, *, R: int, kv_dtype=None):
    """Arguments of write_qkv: make_inputs' pool, k, v and metadata, with R random query heads per
    KV head merged in front of each k and v, and RoPE tables at random positions. Padding rows of
    q are NaN too."""
    kv, k, v, *meta = make_inputs(s, q_lens, kv_lens, dtype, rng, kv_dtype=kv_dtype)
    q = rng.standard_normal((s.T, s.K, R, s.H), dtype=np.float32)
    q[sum(q_lens):] = np.nan
    qkv = jnp.concatenate([jnp.asarray(q, dtype), k[:, :, None], v[:, :, None]], axis=2)
    angles = rng.integers(0, 1 << 16, (s.T, 1)) * (10000.0 ** -(np.arange(s.H // 2) / (s.H // 2)))
    return (kv, qkv, jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32), *meta)


@functools.lru_cache(maxsize=None)
def _qkv_fns(block_sizes):
    return (jax.jit(ref_write_qkv),
            jax.jit(functools.partial(gpu_write.write_qkv, block_sizes=block_sizes, interpret=True)))


def assert_rope_close(got, want, what: str):
    """Equal up to RoPE's last rounding: XLA (and the GPU) may contract x1 * c - x2 * s into a fused
    multiply-add where the other side rounds the product first, one unit in the last place of a
    term (terms are at most ~4 here: standard-normal inputs). Anything else, a NaN from a padding
    row or a row in the wrong place, is far outside this."""
    eps = float(jnp.finfo(got.dtype).eps)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2 * eps,
                               atol=8 * eps, err_msg=what)


def check_write_qkv(args, n_real: int, block_sizes, what: str):
    ref, kernel = _qkv_fns(block_sizes)
    want_q, want_pool = ref(*args)
    q, pool = kernel(*args)
    assert q.shape == want_q.shape and q.dtype == args[1].dtype and pool.dtype == args[0].dtype
    assert np.isfinite(np.asarray(want_pool.astype(jnp.float32))).all(), f"{what}: a padding row was written"
    assert_rope_close(pool, want_pool, what)
    assert_rope_close(q[:n_real], want_q[:n_real], what)
    # rows of v and slots nobody writes: bit for bit
    written = np.asarray(_slots_fn()(*args[4:], num_tokens=args[1].shape[0], page_size=args[0].shape[1],
                                     num_slots=args[0].shape[0] * args[0].shape[1]))
    rows = lambda x: bits(x).reshape(-1, x.shape[2] // 2, 2, x.shape[3])
    untouched = np.ones(rows(pool).shape[0], bool)
    untouched[written[written < untouched.size]] = False
    np.testing.assert_array_equal(rows(pool)[untouched], rows(want_pool)[untouched], err_msg=what)
    np.testing.assert_array_equal(rows(pool)[:, :, 1], rows(want_pool)[:, :, 1], err_msg=what)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("R", [1, 4])
@pytest.mark.parametrize("rows", [16, None], ids=["rows16", "default_rows"])
def test_write_qkv_matches_reference(shape, dtype, R, rows):
    """RoPE'd q out, RoPE'd k and v into their slots, bit for bit the jnp RoPE + XLA scatter, on
    fresh ragged batches (decodes, chunks crossing pages, padding, none at all)."""
    s = SHAPES[shape]
    seed = int(np.random.SeedSequence().entropy % (1 << 32))
    rng = np.random.default_rng(seed)
    bs = None if rows is None else gpu_write.WriteBlockSizes(rows_per_block=rows)
    batches = [random_batch(rng, s) for _ in range(2)]
    batches += [random_batch(rng, s, decode_only=True), random_batch(rng, s, num_seqs=s.S, fill=True),
                random_batch(rng, s, num_seqs=0)]
    for q_lens, kv_lens in batches:
        args = make_qkv_inputs(s, q_lens, kv_lens, dtype, rng, R=R)
        check_write_qkv(args, sum(q_lens), bs, f"seed={seed} q_lens={q_lens} kv_lens={kv_lens}")


def test_write_qkv_rotates_q_and_k_only():
    """At position 0 (cos 1, sin 0) RoPE is the identity, elsewhere it moves q and k but never v: the
    kernel's q equals the input's query heads only where the angle is 0, and v lands unrotated."""
    s = SHAPES["k2_h32_page4"]
    rng = np.random.default_rng(3)
    args = list(make_qkv_inputs(s, (5,), (9,), jnp.float32, rng, R=2))
    args[2] = args[2].at[0].set(1.0)
    args[3] = args[3].at[0].set(0.0)
    q, pool = _qkv_fns(None)[1](*args)
    np.testing.assert_array_equal(np.asarray(q[0]), np.asarray(args[1][0, :, :2].reshape(4, s.H)))
    assert not np.allclose(np.asarray(q[1:5]), np.asarray(args[1][1:5, :, :2].reshape(4, 4, s.H)))
    slots = np.asarray(kv_write_slots(*args[4:], s.T, page_size=s.G, num_slots=s.P * s.G))[:5]
    rows = np.asarray(pool).reshape(s.P * s.G, s.K, 2, s.H)[slots]
    np.testing.assert_array_equal(rows[:, :, 1], np.asarray(args[1][:5, :, 3]))
    np.testing.assert_array_equal(rows[0, :, 0], np.asarray(args[1][0, :, 2]))


def test_write_qkv_f32_into_bf16_cache():
    s = SHAPES["k1_h128_page16"]
    rng = np.random.default_rng()
    q_lens, kv_lens = random_batch(rng, s)
    args = make_qkv_inputs(s, q_lens, kv_lens, jnp.float32, rng, R=3, kv_dtype=jnp.bfloat16)
    check_write_qkv(args, sum(q_lens), gpu_write.WriteBlockSizes(rows_per_block=16), f"{q_lens} {kv_lens}")


def test_write_qkv_lowers_for_cuda_in_place():
    """One Triton launch with the pool (operand 4: slots, rows, cos, sin, pool) aliased to output 1."""
    s = SHAPES["k8_h16_page8"]
    args = make_qkv_inputs(s, (3, 1), (9, 17), jnp.bfloat16, np.random.default_rng(1), R=4)
    text = jax.jit(gpu_write.write_qkv, donate_argnums=0).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("write_kv_pages_gpu") >= 1 and "triton" in text
    assert "output_operand_alias<output_tuple_indices = [1], operand_index = 4" in text


def test_write_qkv_bad_shapes_raise():
    s = SHAPES["k2_h32_page4"]
    args = make_qkv_inputs(s, (1,), (3,), jnp.float32, np.random.default_rng(2), R=2)
    with pytest.raises(ValueError, match=r"must be \[T, K, R \+ 2, H\] = \[T, 2, R \+ 2, 32\]"):
        gpu_write.write_qkv(args[0], args[1][:, :1], *args[2:], interpret=True)
    with pytest.raises(ValueError, match="R >= 1"):
        gpu_write.write_qkv(args[0], args[1][:, :, 2:], *args[2:], interpret=True)
    with pytest.raises(ValueError, match=r"cos \(37, 8\) and sin \(37, 16\)"):
        gpu_write.write_qkv(args[0], args[1], args[2][:, :8], *args[3:], interpret=True)


# ---- dispatch -------------------------------------------------------------------------------------

def test_dispatch_write_qkv_routes_by_implementation():
    """"gpu" traces the Triton kernel (lowered for CUDA here); "tpu", "reference" and "auto" on CPU
    run the jnp RoPE and the scatter."""
    s = SHAPES["k2_h32_page4"]
    rng = np.random.default_rng()
    q_lens, kv_lens = random_batch(rng, s)
    args = make_qkv_inputs(s, q_lens, kv_lens, jnp.bfloat16, rng, R=2)
    want_q, want_pool = ref_write_qkv(*args)
    for impl in ("tpu", "reference", "auto"):
        q, pool = dispatch.write_qkv(*args, implementation=impl)
        np.testing.assert_array_equal(bits(pool), bits(want_pool))
        np.testing.assert_array_equal(bits(q), bits(want_q))
    for impl, kernel in (("gpu", True), ("reference", False)):
        f = jax.jit(functools.partial(dispatch.write_qkv, implementation=impl))
        assert ("write_kv_pages_gpu" in f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()) == kernel
    with pytest.raises(ValueError, match="implementation='cuda'"):
        dispatch.write_qkv(*args, implementation="cuda")


# ---- Real GPU -------------------------------------------------------------------------------------

GPU_SHAPES = {
    # 8B-like prefill step: 8192 new rows of 8 KV heads x 128 (16 MB of bf16 for K and V).
    "prefill_8192_k8": (Shape(K=8, H=128, G=16, T=8192, S=16, P_max=40, spare_pages=100), None),
    "decode_256_k8": (Shape(K=8, H=128, G=16, T=256, S=256, P_max=4, spare_pages=100), "decode"),
    "mixed_k1_h64_page64": (Shape(K=1, H=64, G=64, T=1000, S=12, P_max=20, spare_pages=5), None),
    "k2_h256_page32": (Shape(K=2, H=256, G=32, T=300, S=4, P_max=40, spare_pages=5), None),
}


DEVICE_DTYPES = pytest.mark.parametrize(
    "dtype,kv_dtype", [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.bfloat16), (jnp.float32, jnp.bfloat16)],
    ids=["float32", "bfloat16", "f32_into_bf16"])


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("case", list(GPU_SHAPES))
@DEVICE_DTYPES
def test_kernel_on_device(case, dtype, kv_dtype):
    s, kind = GPU_SHAPES[case]
    seed = int(np.random.SeedSequence().entropy % (1 << 32))
    rng = np.random.default_rng(seed)
    for rows in (None, 16, 128):
        bs = None if rows is None else gpu_write.WriteBlockSizes(rows_per_block=rows)
        f = jax.jit(functools.partial(gpu_write.write_kv_pages, block_sizes=bs), donate_argnums=0)
        for _ in range(2):  # fresh batches: a race or a stale row shows as a moving error
            q_lens, kv_lens = random_batch(rng, s, decode_only=kind == "decode", num_seqs=s.S if kind else None)
            args = make_inputs(s, q_lens, kv_lens, dtype, rng, kv_dtype=kv_dtype)
            want = bits(_ref_fn()(*args))
            out = f(*args)
            assert args[0].is_deleted()
            np.testing.assert_array_equal(bits(out), want, err_msg=f"seed={seed} rows={rows}")


@pytest.mark.gpu
@requires_gpu
def test_donated_write_has_no_pool_copy_on_device():
    """The compiled write must not copy the pool: the output is the donated buffer and no temporary
    is as large as the pool."""
    s, _ = GPU_SHAPES["prefill_8192_k8"]
    rng = np.random.default_rng()
    args = make_inputs(s, *random_batch(rng, s), jnp.bfloat16, rng)
    compiled = jax.jit(gpu_write.write_kv_pages, donate_argnums=0).lower(*args).compile()
    assert "triton" in compiled.as_text().lower()
    assert_in_place(compiled, args[0].nbytes)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("case", list(GPU_SHAPES))
@DEVICE_DTYPES
def test_write_qkv_on_device(case, dtype, kv_dtype):
    """The real kernel against the reference (assert_rope_close), and every slot the reference
    leaves alone keeps its bits."""
    s, kind = GPU_SHAPES[case]
    seed = int(np.random.SeedSequence().entropy % (1 << 32))
    rng = np.random.default_rng(seed)
    for rows in (None, 16):
        bs = None if rows is None else gpu_write.WriteBlockSizes(rows_per_block=rows)
        f = jax.jit(functools.partial(gpu_write.write_qkv, block_sizes=bs), donate_argnums=0)
        q_lens, kv_lens = random_batch(rng, s, decode_only=kind == "decode", num_seqs=s.S if kind else None)
        args = make_qkv_inputs(s, q_lens, kv_lens, dtype, rng, R=4, kv_dtype=kv_dtype)
        want_q, want_pool = jax.jit(ref_write_qkv)(*args)
        before = bits(args[0]).copy()
        q, pool = f(*args)
        n, what = sum(q_lens), f"seed={seed} rows={rows}"
        assert_rope_close(pool, want_pool, what)
        assert_rope_close(q[:n], want_q[:n], what)
        untouched = np.all(bits(want_pool) == before, axis=-1)
        np.testing.assert_array_equal(bits(pool)[untouched], before[untouched])
