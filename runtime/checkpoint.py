"""Load a model onto a mesh from any supported checkpoint, save and restore Orbax, convert.

Sources: a HF safetensors directory, a GGUF file, a llama2.c `.bin`, an xlaserve Orbax checkpoint
directory, or a preset name (`llama3_8b`, or explicitly `dummy:llama3_8b`) for random weights.
Every parameter is created or loaded straight into its target sharding: tensor by tensor, host
memory holds at most one tensor (plus the file's mmap), never a full replica of the model.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import uuid
from functools import cached_property
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from models.config import PRESETS, ModelConfig, RopeScaling, get_preset
from models.llama import abstract_model, is_qkv_param, make_forward, repeat_qkv, unrepeat_qkv
from pallas_kernels.dispatch import kv_pool_dtype, select_attention_impl, select_gemm_impl
from runtime.formats.base import CheckpointError, TensorSource, hf_tensor_plan, unused_tensors
from sharding.mesh import MeshConfig, check_mesh, mesh_axis_size
from sharding.rules import head_parallel_mesh, kv_repeat, state_shardings

ORBAX_CONFIG = "xlaserve_config.json"
ORBAX_STATE = "state"

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A model's config, structure and sharded params, with the mesh they live on."""

    config: ModelConfig
    graphdef: nnx.GraphDef
    params: nnx.State
    mesh: jax.sharding.Mesh
    dtype: jnp.dtype
    source: str
    tokenizer_path: Path | None = None

    @cached_property
    def kv_repeat(self) -> int:
        return kv_repeat(self.config, self.mesh)

    @cached_property
    def attn_impl(self) -> str:
        return select_attention_impl(self.mesh.devices.flat[0].platform, self.config.head_dim)

    @cached_property
    def gemm_impl(self) -> str:
        """Where the model's fused-epilogue GEMMs run (dispatch.select_gemm_impl; in the graph too)."""
        return select_gemm_impl(self.mesh)

    @cached_property
    def kv_dtype(self) -> jnp.dtype:
        """The KV pool's dtype where none is asked for (dispatch.kv_pool_dtype: the compute dtype;
        float32 for a 16-bit model on CPUs)."""
        return kv_pool_dtype(self.attn_impl, self.dtype)

    @cached_property
    def forward(self):
        """forward(params, tokens, positions, kv_pages, attn_meta, logits_indices=None, greedy=False,
        decode_only=False) (models/llama.py, make_forward)."""
        return make_forward(self.graphdef)

    def replica_views(self) -> list[LoadedModel]:
        """One model per index of the mesh's `replica` axis, on that replica's devices alone (the
        mesh with that axis cut to size 1), sharing this model's arrays: the weights are replicated
        over `replica` (sharding/rules.py), so each replica's devices already hold a whole copy and
        the views copy nothing. [self] when the mesh has one replica."""
        R = mesh_axis_size(self.mesh, "replica")
        if R == 1:
            return [self]
        local = jax.process_index()
        if any(d.process_index != local for d in self.mesh.devices.flat):
            raise NotImplementedError("replicas over devices of several processes: run one server per host instead")
        axis = self.mesh.axis_names.index("replica")
        views = []
        for r in range(R):
            sub = jax.sharding.Mesh(np.take(self.mesh.devices, [r], axis=axis), self.mesh.axis_names)
            devices = set(sub.devices.flat)

            def view(var, sub=sub, devices=devices):
                x = var.value
                assert "replica" not in jax.tree.leaves(tuple(x.sharding.spec)), x.sharding.spec
                shards = [s.data for s in x.addressable_shards if s.device in devices]
                return var.replace(jax.make_array_from_single_device_arrays(
                    x.shape, jax.sharding.NamedSharding(sub, x.sharding.spec), shards))

            params = jax.tree.map(view, self.params, is_leaf=lambda x: isinstance(x, nnx.Variable))
            graphdef, _, _ = _model_parts(self.config, sub, self.dtype)
            views.append(dataclasses.replace(self, graphdef=graphdef, params=params, mesh=sub))
        return views


def resolve_dtype(dtype, checkpoint_dtype) -> jnp.dtype:
    """`auto` is the checkpoint's own float dtype, but float16 loads as bfloat16 (the engine's paged
    attention takes float32 and bfloat16; bfloat16 is what the TPU computes in); dequantized or
    other formats load as float32. float16 stays available by name, for the model alone."""
    if dtype in (None, "auto"):
        dt = jnp.dtype(checkpoint_dtype)
        if dt == jnp.float16:
            return jnp.dtype(jnp.bfloat16)
        return dt if dt in (jnp.dtype(d) for d in _DTYPES.values()) else jnp.dtype(jnp.float32)
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported; use auto, {', '.join(_DTYPES)}")
        return jnp.dtype(_DTYPES[dtype])
    return jnp.dtype(dtype)


def open_tensor_source(path: str | Path) -> TensorSource:
    """The format reader for a checkpoint path (directory, GGUF file or llama2.c .bin). A GGUF file is
    also known by its magic bytes, whatever its name (ollama keeps them as `sha256-<digest>` blobs)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"checkpoint {p} does not exist")
    if p.is_dir():
        from runtime.formats.safetensors import SafetensorsSource

        return SafetensorsSource(p)
    from runtime.gguf_tokenizer import is_gguf_file

    if is_gguf_file(p):
        from runtime.formats.gguf import GGUFSource

        return GGUFSource(p)
    if p.suffix == ".bin":
        from runtime.formats.llama2c import Llama2cSource

        return Llama2cSource(p)
    raise CheckpointError(f"{p}: unknown checkpoint format (expected a directory, a GGUF file or a llama2.c .bin)")


def is_orbax_checkpoint(path: str | Path) -> bool:
    p = Path(path)
    return p.is_dir() and (p / ORBAX_CONFIG).is_file()


def load_model(
    model: str | Path,
    *,
    mesh: jax.sharding.Mesh | None = None,
    dtype="auto",
    seed: int = 0,
    progress: bool = True,
) -> LoadedModel:
    """Load `model` (path or preset) directly into its sharding on `mesh` (default: one device)."""
    mesh = mesh if mesh is not None else MeshConfig().make_mesh()
    check_mesh(mesh)
    name = str(model)
    if name.startswith("dummy:") or (name in PRESETS and not Path(name).exists()):
        cfg = get_preset(name.removeprefix("dummy:"))
        return init_dummy(cfg, mesh=mesh, dtype=resolve_dtype(dtype, jnp.bfloat16), seed=seed)
    if is_orbax_checkpoint(name):
        return restore_orbax(name, mesh=mesh, dtype=dtype)
    source = open_tensor_source(name)
    return load_from_source(source, mesh=mesh, dtype=resolve_dtype(dtype, source.dtype), progress=progress)


def _model_parts(cfg: ModelConfig, mesh, dtype):
    impl = select_attention_impl(mesh.devices.flat[0].platform, cfg.head_dim)  # = LoadedModel.attn_impl
    graphdef, abs_state = nnx.split(abstract_model(cfg, dtype=dtype, kv_repeat=kv_repeat(cfg, mesh), attn_impl=impl,
                                                   head_mesh=head_parallel_mesh(cfg, mesh),
                                                   gemm_impl=select_gemm_impl(mesh)))
    return graphdef, abs_state, state_shardings(abs_state, mesh, cfg)


def init_dummy(cfg: ModelConfig, *, mesh: jax.sharding.Mesh, dtype=jnp.bfloat16, seed: int = 0) -> LoadedModel:
    """Random weights for any preset, each created on device in its target sharding.

    One small jit per distinct (shape, sharding) rather than one jit of the whole model: layers
    share shapes, so an 80-layer model compiles a dozen tiny programs instead of one huge one.
    """
    dtype = jnp.dtype(dtype)
    graphdef, abs_state, shardings = _model_parts(cfg, mesh, dtype)
    flat_shardings = dict(nnx.to_flat_state(shardings))
    key = jax.random.key(seed, impl="rbg")  # compiles several times faster than threefry on CPU
    leaves = {}
    for i, (path, var) in enumerate(nnx.to_flat_state(abs_state)):
        name = str(path[-1])
        kind = "ones" if name == "scale" else "zeros" if name.endswith("bias") else "normal"
        rep = kv_repeat(cfg, mesh) if is_qkv_param(path) else 1  # drawn whole, then repeated
        make = _random_array(kind, var.value.shape, dtype, flat_shardings[path].value, rep)
        leaves[tuple(path)] = var.replace(make(jax.random.fold_in(key, i)))
    return LoadedModel(cfg, graphdef, nnx.from_flat_state(leaves), mesh, dtype, f"dummy:{cfg.name}")


@functools.lru_cache(maxsize=64)  # (bounded: a jit keeps its programs while it lives; a model has ~10 shapes)
def _random_array(kind: str, shape: tuple[int, ...], dtype, sharding, repeat: int = 1):
    """A jitted key -> array in `sharding`. repeat > 1: a merged qkv param, drawn in its canonical
    layout and repeated (models.llama.repeat_qkv), so the copies of a KV head are equal."""
    canon = shape
    if repeat > 1:
        *lead, Kr, Rr2, H = shape
        canon = (*lead, Kr // repeat, (Rr2 - 2) * repeat + 2, H)

    def make(key):
        if kind == "ones":
            x = jnp.ones(canon, dtype)
        elif kind == "zeros":
            x = jnp.zeros(canon, dtype)
        else:
            x = (0.02 * jax.random.normal(key, canon, jnp.float32)).astype(dtype)
        return repeat_qkv(x, repeat)

    return jax.jit(make, out_shardings=sharding)


def _check_unused(source: TensorSource, cfg: ModelConfig, plan) -> None:
    """Fail before loading when the checkpoint holds tensors the model would not use: a config with
    fewer layers than the weights (or without a bias they have) loads fine and generates wrong tokens.
    Left to the loading loop when a needed tensor is missing, which is the clearer error then."""
    names = set(source.keys())
    if any(n not in names for tp in plan.values() for n in tp.hf_names):
        return
    extra = unused_tensors(cfg, plan, names)
    if not extra:
        return
    layers = [int(n.split(".")[2]) for n in extra if n.startswith("model.layers.") and n.split(".")[2].isdigit()]
    L = cfg.num_layers
    why = (f"the weights go up to layer {max(layers)} but the config has {L} layers (0-{L - 1})"
           if layers and max(layers) >= L else "the model config has no parameter for them")
    shown = ", ".join(repr(n) for n in extra[:4]) + (f" and {len(extra) - 4} more" if len(extra) > 4 else "")
    raise CheckpointError(f"{source.path}: {len(extra)} checkpoint tensors would be left unused ({shown}); {why}")


def load_from_source(source: TensorSource, *, mesh: jax.sharding.Mesh, dtype, progress: bool = True) -> LoadedModel:
    cfg = source.config
    dtype = jnp.dtype(dtype)
    graphdef, abs_state, shardings = _model_parts(cfg, mesh, dtype)
    plan = hf_tensor_plan(cfg, kv_repeat(cfg, mesh))
    _check_unused(source, cfg, plan)
    flat_shardings = dict(nnx.to_flat_state(shardings))
    leaves = {}
    bar = tqdm(total=len(plan), desc=f"loading {source.path.name}", unit="tensor", disable=not progress)
    for path, var in nnx.to_flat_state(abs_state):
        tp = plan.get(tuple(path))
        if tp is None:
            raise CheckpointError(f"internal: model parameter {'/'.join(map(str, path))} has no checkpoint mapping")
        arrs = [source.get(name) for name in tp.hf_names]
        for name, arr, shape in zip(tp.hf_names, arrs, tp.hf_shapes):
            if tuple(arr.shape) != shape:
                raise CheckpointError(
                    f"{source.path}: tensor {name!r} has shape {tuple(arr.shape)}; model config "
                    f"{cfg.name!r} expects {shape}"
                )
        host = np.asarray(tp.to_param(*arrs)).astype(dtype)
        sharding = flat_shardings[path].value
        leaves[tuple(path)] = var.replace(jax.make_array_from_callback(host.shape, sharding, lambda i, h=host: h[i]))
        del host, arrs
        bar.update(1)
    bar.close()
    params = nnx.from_flat_state(leaves)
    return LoadedModel(cfg, graphdef, params, mesh, dtype, str(source.path), source.tokenizer_path())


# ---------------------------------------------------------------------------------------------- Orbax


def _config_to_json(cfg: ModelConfig) -> dict:
    return dataclasses.asdict(cfg)


def _config_from_json(d: dict) -> ModelConfig:
    d = dict(d)
    if d.get("rope_scaling"):
        d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    return ModelConfig(**d)


def _map_qkv(params: nnx.State, fn, kv_repeat: int) -> nnx.State:
    """params with fn(x, kv_repeat) applied to the merged qkv params (repeat_qkv / unrepeat_qkv)."""
    if kv_repeat == 1:
        return params
    return nnx.from_flat_state({tuple(path): var.replace(fn(var.value, kv_repeat)) if is_qkv_param(path) else var
                                for path, var in nnx.to_flat_state(params)})


def check_destination(dst: str | Path) -> Path:
    """The absolute path of a new checkpoint directory `dst`, or an error: it must not exist, or be
    an empty directory, and no part of its parent path may be a file. A symbolic link to an empty
    directory gives that directory's path (the checkpoint replaces it there); a dangling one is an error."""
    dst = Path(dst).absolute()
    if dst.is_symlink():
        if not dst.exists():
            raise FileNotFoundError(f"{dst} is a symbolic link to {os.readlink(dst)}, which does not exist")
        dst = dst.resolve()
    if dst.exists():
        if not dst.is_dir():
            raise FileExistsError(f"{dst} exists and is not a directory; refusing to overwrite")
        if any(dst.iterdir()):
            raise FileExistsError(f"{dst} exists and is not empty; refusing to overwrite")
    for parent in dst.parents:
        if parent.exists():
            if not parent.is_dir():
                raise NotADirectoryError(f"{parent} is a file; {dst} cannot be created under it")
            break
    return dst


def save_orbax(loaded: LoadedModel, dst: str | Path) -> Path:
    """Write params (Orbax), config and tokenizer to `dst`; restorable onto any mesh. The checkpoint
    is written into a hidden sibling directory and renamed to `dst` when complete, so `dst` never
    holds a partial checkpoint (an interrupted save leaves only `.DST.partial-*` beside it)."""
    dst = check_destination(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    # (not tempfile.mkdtemp, whose 0700 the checkpoint would keep: a plain mkdir follows the umask,
    # as the folders inside do, and an existing empty DST's mode is kept)
    tmp = dst.parent / f".{dst.name}.partial-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        if dst.exists():
            tmp.chmod(dst.stat().st_mode & 0o7777)
        _write_orbax(loaded, tmp)
        if dst.exists():  # (an empty directory: check_destination)
            dst.rmdir()
        tmp.rename(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def _write_orbax(loaded: LoadedModel, dst: Path) -> None:
    import orbax.checkpoint as ocp

    from runtime.gguf_tokenizer import is_gguf_file
    from runtime.tokenizer import FOLDER_FILES, NAMED_CHAT_TEMPLATES

    ckptr = ocp.StandardCheckpointer()  # writes on background threads
    try:
        ckptr.save(dst / ORBAX_STATE, _map_qkv(loaded.params, unrepeat_qkv, loaded.kv_repeat))
        ckptr.wait_until_finished()
    except BaseException:
        _settle(ckptr)  # (Ctrl-C) its threads would go on writing into the folder save_orbax removes
        raise
    finally:
        ckptr.close()
    meta = {"config": _config_to_json(loaded.config), "dtype": jnp.dtype(loaded.dtype).name, "source": loaded.source}
    tok = loaded.tokenizer_path
    if tok is not None:
        if Path(tok).is_dir():
            tdir = dst / "tokenizer"
            tdir.mkdir()
            for f in Path(tok).iterdir():
                if f.is_file() and (f.name.startswith(("tokenizer", "special_tokens")) or f.name in FOLDER_FILES):
                    shutil.copy2(f, tdir / f.name)
            named = Path(tok) / NAMED_CHAT_TEMPLATES
            if named.is_dir():  # transformers 5's named chat templates (tool_use, ...)
                (tdir / NAMED_CHAT_TEMPLATES).mkdir()
                for f in named.glob("*.jinja"):
                    if f.is_file():
                        shutil.copy2(f, tdir / NAMED_CHAT_TEMPLATES / f.name)
            meta["tokenizer"] = "tokenizer"
        elif is_gguf_file(tok):  # the source model itself: referenced, not copied (GGUF files are large)
            meta["tokenizer"] = str(Path(tok).absolute())
        else:  # a small file (llama2.c's .bin, a .model): copied, so the checkpoint stands alone
            (dst / "tokenizer").mkdir()
            shutil.copy2(tok, dst / "tokenizer" / Path(tok).name)
            meta["tokenizer"] = f"tokenizer/{Path(tok).name}"
    (dst / ORBAX_CONFIG).write_text(json.dumps(meta, indent=2))


def _settle(ckptr) -> None:
    """Waits for a failed or interrupted save's background writes to end (a second Ctrl-C too)."""
    while True:
        try:
            ckptr.wait_until_finished()
            return
        except KeyboardInterrupt:
            continue
        except Exception:  # noqa: BLE001 - the save's own failure, raised by the caller already
            return


def restore_orbax(path: str | Path, *, mesh: jax.sharding.Mesh, dtype="auto") -> LoadedModel:
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    try:
        meta = json.loads((path / ORBAX_CONFIG).read_text())
        cfg = _config_from_json(meta["config"])
        saved = jnp.dtype(meta.get("dtype", "float32"))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path / ORBAX_CONFIG}: not an xlaserve checkpoint config ({e})") from None
    dtype = resolve_dtype(dtype, saved)
    # On disk the merged qkv params have their canonical layout (kv_repeat 1; save_orbax). Restore
    # that into this mesh's shardings, then repeat them for this mesh and cast, on device.
    _, canon = nnx.split(abstract_model(cfg, dtype=saved))
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          canon, state_shardings(canon, mesh, cfg))
    state = path / ORBAX_STATE
    if not state.is_dir():
        raise CheckpointError(f"{path}: no {ORBAX_STATE}/ directory; an incomplete or damaged checkpoint")
    try:
        with ocp.StandardCheckpointer() as ckptr:
            params = ckptr.restore(state, target)
    except Exception as e:  # noqa: BLE001 - Orbax/TensorStore raise many types for damaged files
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CheckpointError(f"{state}: could not restore the parameters ({type(e).__name__}: {first[:300]})") from e
    graphdef, _, shardings = _model_parts(cfg, mesh, dtype)
    rep = kv_repeat(cfg, mesh)
    if rep > 1 or dtype != saved:
        params = jax.jit(lambda p: _map_qkv(jax.tree.map(lambda x: x.astype(dtype), p), repeat_qkv, rep),
                         out_shardings=shardings)(params)
    tok = meta.get("tokenizer")
    tok_path = None if tok is None else (path / tok if not Path(tok).is_absolute() else Path(tok))
    return LoadedModel(cfg, graphdef, params, mesh, dtype, str(path), tok_path)


def convert(src: str | Path, dst: str | Path, *, dtype="auto", progress: bool = True) -> Path:
    """`xlaserve convert SRC DST`: any supported source -> an Orbax checkpoint."""
    check_destination(dst)  # before the load, which can take minutes
    loaded = load_model(src, dtype=dtype, progress=progress)
    return save_orbax(loaded, dst)
