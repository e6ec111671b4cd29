"""The DeepSeek-V4 attention layer's configuration and parameters, for the layer statement
(``reference.statements.deepseek_v4``): ``V4AttentionConfig`` (one layer's dims, RoPE and
indexer settings; V4-Pro / V4-Flash / a tiny test config), the official layer-type pattern per
model, and the parameters by the official checkpoint's names (shapes, checks, a seeded init)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from reference.core import checks as _checks
from reference.v4_compressor import ref as vc

LAYER_TYPES = (0, 4, 128)  # window only, CSA, HCA

# The released config.json ``compress_ratios`` (layers, then the MTP layer).
PRO_COMPRESS_RATIOS = (128, 128) + (4, 128) * 29 + (4, 0)  # 61 layers + MTP
FLASH_COMPRESS_RATIOS = (0, 0) + (4, 128) * 20 + (4, 0)  # 43 layers + MTP


@dataclasses.dataclass(frozen=True)
class V4AttentionConfig:
    """The official ``ModelArgs`` fields one attention layer reads, plus ``layer_id``. Frozen and
    hashable (a ``jax.jit`` static); invalid combinations raise ValueError naming the numbers."""

    dim: int
    n_heads: int
    q_lora_rank: int
    head_dim: int
    rope_head_dim: int
    o_groups: int
    o_lora_rank: int
    window_size: int
    compress_ratios: tuple[int, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    layer_id: int = 0
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_factor: float = 16.0
    original_seq_len: int = 65536
    beta_fast: int = 32
    beta_slow: int = 1
    norm_eps: float = 1e-6

    def __post_init__(self):
        object.__setattr__(self, "compress_ratios", tuple(self.compress_ratios))
        for name in ("dim", "n_heads", "q_lora_rank", "head_dim", "rope_head_dim", "o_groups",
                     "o_lora_rank", "window_size", "index_n_heads", "index_head_dim",
                     "index_topk"):
            _checks.positive_int(name, getattr(self, name))
        _checks.nonneg_int("layer_id", self.layer_id)
        _checks.nonneg_int("original_seq_len", self.original_seq_len)
        if self.n_heads % self.o_groups:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of "
                             f"o_groups={self.o_groups} (contiguous head groups for wo_a)")
        if self.rope_head_dim % 2:
            raise ValueError(f"rope_head_dim={self.rope_head_dim} must be even (interleaved "
                             f"pairs)")
        for name in ("head_dim", "index_head_dim"):
            if getattr(self, name) <= self.rope_head_dim:
                raise ValueError(f"{name}={getattr(self, name)} must exceed rope_head_dim="
                                 f"{self.rope_head_dim} (RoPE on its last rope_head_dim dims)")
        if not self.layer_id < len(self.compress_ratios):
            raise ValueError(f"layer_id={self.layer_id} must index compress_ratios (length "
                             f"{len(self.compress_ratios)})")
        bad = [r for r in self.compress_ratios if isinstance(r, bool) or r not in LAYER_TYPES]
        if bad:
            raise ValueError(f"compress_ratios entries must be in {LAYER_TYPES} (0 window only, "
                             f"4 CSA, 128 HCA), got {bad[0]!r} in {self.compress_ratios}")
        for name in ("rope_theta", "compress_rope_theta", "rope_factor", "norm_eps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {name}={getattr(self, name)}")

    @property
    def compress_ratio(self) -> int:
        """This layer's ratio ``compress_ratios[layer_id]``: 0, 4 or 128."""
        return self.compress_ratios[self.layer_id]

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.rope_head_dim


def config_from_model_args(args, layer_id: int) -> V4AttentionConfig:
    """The layer ``layer_id`` of a model given by the official ``inference/config.json`` (or
    ``ModelArgs`` as a dict): the fields of ``V4AttentionConfig`` are read by their official
    names, the rest ignored; a required field that is missing raises ValueError naming it
    (the YaRN / theta / eps fields default to the released values)."""
    fields = {f.name: f for f in dataclasses.fields(V4AttentionConfig)}
    kwargs = {k: args[k] for k in fields if k in args and k != "layer_id"}
    missing = [k for k, f in fields.items() if k not in kwargs and k != "layer_id"
               and f.default is dataclasses.MISSING]
    if missing:
        raise ValueError(f"model args lack {missing[0]!r} (all missing: {missing})")
    return V4AttentionConfig(**kwargs, layer_id=layer_id)


def pro_config(layer_id: int = 2) -> V4AttentionConfig:
    """V4-Pro (``inference/config.json``): dim 7168, 128 heads, q_lora 1536, 16 x 1024 output
    groups, index top-k 1024; layer 2 is CSA, 1 HCA, 61 (MTP) window only."""
    return V4AttentionConfig(dim=7168, n_heads=128, q_lora_rank=1536, head_dim=512,
                             rope_head_dim=64, o_groups=16, o_lora_rank=1024, window_size=128,
                             compress_ratios=PRO_COMPRESS_RATIOS, index_n_heads=64,
                             index_head_dim=128, index_topk=1024, layer_id=layer_id)


def flash_config(layer_id: int = 2) -> V4AttentionConfig:
    """V4-Flash (its ``config.json``): dim 4096, 64 heads, q_lora 1024, 8 x 1024 output groups,
    index top-k 512; layers 0-1 window only, then CSA / HCA alternating, 42 CSA."""
    return V4AttentionConfig(dim=4096, n_heads=64, q_lora_rank=1024, head_dim=512,
                             rope_head_dim=64, o_groups=8, o_lora_rank=1024, window_size=128,
                             compress_ratios=FLASH_COMPRESS_RATIOS, index_n_heads=64,
                             index_head_dim=128, index_topk=512, layer_id=layer_id)


def tiny_config(compress_ratio: int = 4, **overrides) -> V4AttentionConfig:
    """A small config keeping every structure (window 128, ratios 4 / 128, groups, sink,
    indexer): dim 64, 4 heads in 2 groups, head_dim 128 (64 nope + 64 rope), index 4 x 128
    (the Hadamard and the fp4 blocks need 2**k x 32), top-k 8. ``overrides`` replace fields."""
    fields = dict(dim=64, n_heads=4, q_lora_rank=32, head_dim=128, rope_head_dim=64,
                  o_groups=2, o_lora_rank=16, window_size=128, compress_ratios=(compress_ratio,),
                  index_n_heads=4, index_head_dim=128, index_topk=8, layer_id=0)
    fields.update(overrides)
    return V4AttentionConfig(**fields)


# ---------------------------------------------------------------------------------------------
# Parameters.

def param_shapes(config: V4AttentionConfig) -> dict[str, tuple[int, ...]]:
    """The attention parameters this layer reads, by official checkpoint name, and their shapes
    (torch ``Linear`` weights ``[out, in]``)."""
    c = config
    shapes = {
        "attn_sink": (c.n_heads,),
        "wq_a.weight": (c.q_lora_rank, c.dim),
        "q_norm.weight": (c.q_lora_rank,),
        "wq_b.weight": (c.n_heads * c.head_dim, c.q_lora_rank),
        "wkv.weight": (c.head_dim, c.dim),
        "kv_norm.weight": (c.head_dim,),
        "wo_a.weight": (c.o_groups * c.o_lora_rank, c.n_heads * c.head_dim // c.o_groups),
        "wo_b.weight": (c.dim, c.o_groups * c.o_lora_rank),
    }
    r = c.compress_ratio
    if r:
        shapes.update(_compressor_shapes("compressor", r, c.head_dim, c.dim))
    if r == 4:
        shapes["indexer.wq_b.weight"] = (c.index_n_heads * c.index_head_dim, c.q_lora_rank)
        shapes["indexer.weights_proj.weight"] = (c.index_n_heads, c.dim)
        shapes.update(_compressor_shapes("indexer.compressor", 4, c.index_head_dim, c.dim))
    return shapes


def _compressor_shapes(prefix: str, ratio: int, d: int, dim: int) -> dict:
    width = vc.compressor_coff(ratio) * d
    return {f"{prefix}.ape": (ratio, width), f"{prefix}.wkv.weight": (width, dim),
            f"{prefix}.wgate.weight": (width, dim), f"{prefix}.norm.weight": (d,)}


def check_params(params, config: V4AttentionConfig) -> None:
    """Refuse ``params`` unless it holds exactly ``param_shapes(config)``: a missing or an
    unexpected key, or a wrong shape, raises ValueError naming the key (and both shapes); a
    non-float dtype raises as ``reference.core.checks.floating``."""
    want = param_shapes(config)
    missing = [k for k in want if k not in params]
    if missing:
        raise ValueError(f"params is missing {missing[0]!r} (layer {config.layer_id}, ratio "
                         f"{config.compress_ratio}; all missing: {missing})")
    extra = sorted(k for k in params if k not in want)
    if extra:
        raise ValueError(f"params has unexpected key {extra[0]!r} for layer {config.layer_id} "
                         f"(ratio {config.compress_ratio}); this layer reads {sorted(want)} "
                         f"(dequantize fp8 weights; drop their .scale tensors)")
    for k, shape in want.items():
        got = tuple(np.shape(params[k]))
        if got != shape:
            raise ValueError(f"params[{k!r}] must have shape {shape}, got {got}")
        _checks.floating(f"params[{k!r}]", params[k])


def init_params(config: V4AttentionConfig, seed: int = 0) -> dict[str, jax.Array]:
    """Random f32 parameters of ``param_shapes(config)`` for tests (NumPy's generator, so no
    per-shape compile): weights ``N(0, 1 / in)``, norm weights ``1 + N(0, 0.1)``, ``ape`` and
    ``attn_sink`` ``N(0, 1)``."""
    return random_params(param_shapes(config), np.random.default_rng(seed))


def random_params(shapes: dict[str, tuple[int, ...]], rng: np.random.Generator
                  ) -> dict[str, jax.Array]:
    """f32 arrays of ``shapes`` drawn from ``rng`` in name order: ``*.weight`` ``N(0, 1 / in)``,
    ``*norm.weight`` ``1 + N(0, 0.1)``, anything else ``N(0, 1)`` (the statements' test
    parameters)."""
    params = {}
    for name, shape in sorted(shapes.items()):
        z = rng.standard_normal(shape, dtype=np.float32)
        if name.endswith("norm.weight"):
            z = 1 + np.float32(0.1) * z
        elif name.endswith(".weight"):
            z = z / np.float32(math.sqrt(shape[1]))
        params[name] = jnp.asarray(z)
    return params
