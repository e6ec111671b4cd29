"""``python -m dsa_jax run --model v4-flash``: the DeepSeek-V4 step (``dsa_jax.v4_step``) on a
synthetic ragged paged batch at V4-Flash dimensions.

V4-Flash (``reference.deepseek_v4.flash_config``, the released ``config.json``): 64 attention
heads of 512 (448 nope + 64 rope), window 128, 64 indexer heads of 128, index top-k 512, and
the 43-layer ratio pattern ``reference.deepseek_v4.FLASH_COMPRESS_RATIOS[:43]`` = two
window-only layers, then CSA (4) / HCA (128) alternating, the last layer CSA (the MTP layer,
entry 44, is not run). ``--layers N`` runs the first N layers of the pattern; ``--heads``,
``--context``, ``--prefill``, ``--topk``, ``--page-size`` scale the rest; ``--quick`` picks
small sizes (4 layers: SWA, SWA, CSA, HCA). Activations, compressor parameters, cache
history and compressor states are random (a shape and agreement check, not a model run).
"""

from __future__ import annotations

from dsa_jax.cli_common import pick_size

V4_FLASH = dict(heads=64, index_heads=64, index_dim=128, head_dim=512, layers=43, topk=512,
                window=128)


def sizes(args) -> dict:
    """The run's sizes: each flag given (not ``None``), else its default (``--quick``:
    small)."""
    q = args.quick
    pick = lambda flag, full, small: pick_size(flag, q, full, small)  # noqa: E731
    return dict(context=pick(args.context, 8192, 512), prefill=pick(args.prefill, 256, 32),
                heads=pick(args.heads, V4_FLASH["heads"], 2),
                index_heads=8 if q else V4_FLASH["index_heads"],
                k=pick(args.topk, V4_FLASH["topk"], 64),
                layers=pick(args.layers, V4_FLASH["layers"], 4),
                page_size=pick(args.page_size, 64, 16))


def _table(rng, num_seqs, pages_per_seq, page_size):
    import numpy as np

    num_pages = num_seqs * pages_per_seq + 1
    ids = rng.permutation(num_pages)[:num_seqs * pages_per_seq].astype(np.int32)
    cu = (np.arange(num_seqs + 1) * pages_per_seq * page_size).astype(np.int32)
    return ids, cu, num_pages


def build(rng, s: dict, q_lens, kv_lens, spec: bool = False, *, window_format: str = "plain",
          compressed_format: str = "plain", index_format: str = "plain"):
    """``(layout, inputs, params, caches, states, meta)`` of one synthetic batch (host arrays:
    the step's donation never consumes them, so both backends run on the same values).
    ``spec=True``: the float arrays as ``jax.ShapeDtypeStruct`` (for AOT cost analysis at full
    dims without allocating the caches); the page tables and metadata stay concrete.
    ``window_format`` / ``compressed_format``: the layout's V4 cache formats (``"plain"`` f32,
    ``"fp8"`` MODEL1 ``reference.v4_cache.Fp8V4Cache``); ``index_format``: the CSA index
    cache, ``"plain"`` f32 or ``"fp8"`` (``reference.fp8_cache.Fp8IndexCache``)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dsa_jax import v4_model as v4m
    from pallas_kernels.v4_compressor import rope_rows
    from reference import v4_compressor as vc
    from reference.formats import fp8_cache
    from reference.formats import model1 as v4_cache
    from reference.statements import deepseek_v4 as dv4

    for name, fmt in (("window_format", window_format), ("compressed_format", compressed_format),
                      ("index_format", index_format)):
        if fmt not in ("plain", "fp8"):
            raise ValueError(f"{name} must be 'plain' or 'fp8', got {fmt!r}")

    ratios = tuple(dv4.FLASH_COMPRESS_RATIOS[:V4_FLASH["layers"]][:s["layers"]])
    ps, ctx = s["page_size"], s["context"]
    cnt = {r: ratios.count(r) for r in (0, 4, 128)}
    pps = {0: -(-ctx // ps), 4: -(-(ctx // 4) // ps), 128: max(-(-(ctx // 128) // ps), 1)}
    layout = v4m.V4ModelLayout(
        ratios, ps, pps[0], window_size=V4_FLASH["window"],
        csa_page_size=ps if cnt[4] else None, csa_pages_per_seq=pps[4] if cnt[4] else None,
        hca_page_size=ps if cnt[128] else None, hca_pages_per_seq=pps[128] if cnt[128] else None,
        index_topk=s["k"], window_cache_format=window_format,
        compressed_cache_format=compressed_format)
    n, t = len(q_lens), sum(q_lens) + 2  # two padding rows
    def f32(*shape, scale=1.0):
        if spec:
            return jax.ShapeDtypeStruct(shape, np.float32)
        return rng.standard_normal(shape, np.float32) * np.float32(scale)
    tables = {r: _table(rng, n, pps[r], ps) for r in (0, 4, 128) if cnt[r] or r == 0}
    lc, lh, hi = cnt[4], cnt[128], s["index_heads"]
    opt = lambda c, x: x if c else None  # noqa: E731
    inputs = v4m.V4StepInputs(
        f32(len(ratios), t, s["heads"], 512, scale=1 / 8), f32(len(ratios), t, 512),
        opt(lc, f32(lc, t, 1024)), opt(lc, f32(lc, t, 1024)),
        opt(lc, f32(lc, t, hi, 128, scale=1 / 4)),
        opt(lc, f32(lc, t, hi, scale=1 / 8)), opt(lc, f32(lc, t, 256)), opt(lc, f32(lc, t, 256)),
        opt(lh, f32(lh, t, 512)), opt(lh, f32(lh, t, 512)), f32(len(ratios), s["heads"]))
    cos, sin = (np.asarray(x) for x in vc.rope_tables(ctx))
    ones = lambda *shape: np.ones(shape, np.float32)  # noqa: E731
    params = v4m.V4StepParams(cos, sin, opt(lc, f32(lc, 4, 1024)), opt(lc, ones(lc, 512)),
                              opt(lc, f32(lc, 4, 256)), opt(lc, ones(lc, 128)),
                              opt(lh, f32(lh, 128, 512)), opt(lh, ones(lh, 512)),
                              rope_rows=np.asarray(rope_rows(cos, sin)))
    wp = tables[0][2]

    def cache(c, p, w=512, fmt="plain"):
        if not c:
            return None
        if fmt == "plain":
            return f32(c, p, ps, w)
        if spec and w == 512:
            u32 = lambda *shape: jax.ShapeDtypeStruct(shape, np.uint32)  # noqa: E731
            return v4_cache.Fp8V4Cache(u32(c, p, ps, 128), u32(c, p, v4_cache.rope_rows(ps), 128))
        if spec:
            return fp8_cache.Fp8IndexCache(
                jax.ShapeDtypeStruct((c, p, ps, w), jnp.float8_e4m3fn),
                jax.ShapeDtypeStruct((c, p, fp8_cache.scale_lanes(ps)), np.float32))
        x = f32(c, p, ps, w)
        return jax.tree.map(np.asarray, v4_cache.quantize_v4_cache(x) if w == 512
                            else fp8_cache.quantize_index_cache(x))
    wf, cf = window_format, compressed_format
    caches = v4m.V4Caches(cache(cnt[0], wp, fmt=wf), cache(lc, wp, fmt=wf),
                          cache(lc, tables[4][2], fmt=cf) if lc else None,
                          cache(lc, tables[4][2], 128, fmt=index_format) if lc else None,
                          cache(lh, wp, fmt=wf), cache(lh, tables[128][2], fmt=cf) if lh else None)
    num_slots = n + 1
    st = lambda c, r, d: opt(c, vc.CompressorState(  # noqa: E731
        f32(c * num_slots, vc.state_rows(r), vc.compressor_coff(r) * d),
        f32(c * num_slots, vc.state_rows(r), vc.compressor_coff(r) * d)))
    states = v4m.V4States(st(lc, 4, 512), st(lc, 4, 128), st(lh, 128, 512))
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    dist = np.asarray([sum(q == 1 for q in q_lens), n, n], np.int32)
    fam = lambda r: tables[r][:2] if cnt[r] else (None, None)  # noqa: E731
    meta = v4m.V4BatchMeta(np.asarray(kv_lens, np.int32), cu_q, dist,
                           np.arange(n, dtype=np.int32), *tables[0][:2], *fam(4), *fam(128))
    return layout, inputs, params, caches, states, meta


def agreement(ref, pal) -> str:
    """Top-k overlap over CSA rows (entries chosen by both) and the output relative error."""
    import numpy as np

    overlaps = []
    for lay in range(ref.topk.shape[0]):
        for r in range(ref.topk.shape[1]):
            a = set(ref.topk[lay, r].tolist()) - {-1}
            if a:
                b = set(pal.topk[lay, r].tolist()) - {-1}
                overlaps.append(len(a & b) / len(a))
    o_ref, o_pal = np.asarray(ref.out, np.float64), np.asarray(pal.out, np.float64)
    rel = np.linalg.norm(o_pal - o_ref) / max(np.linalg.norm(o_ref), 1e-30)
    top = (f"top-k overlap mean {np.mean(overlaps):.4f} (min {np.min(overlaps):.4f})"
           if overlaps else "no CSA rows")
    return f"agreement pallas vs reference: {top}, output rel. error {rel:.2e}"


def run_v4(args, progress) -> int:
    """The ``--model v4-flash`` run (module docstring); ``progress(label)`` a context manager.
    Returns the exit status (``dsa_jax.__main__.main``: 0 passed, 1 NaN or disagreement)."""
    import numpy as np

    from dsa_jax.cli_common import backend_line, compare, time_backends, verdict
    from dsa_jax.v4_model import V4StepResult
    from dsa_jax.v4_step import v4_step  # the module's function (dsa_jax.v4_step is the same)
    from reference.formats.fp8_cache import Fp8IndexCache
    from reference.quant.bf16 import V4_DEFAULT_PRECISION

    if args.devices > 1:  # main refuses it first; run_v4(args) may be called directly
        raise ValueError("--model v4-flash runs on one device (dsa_jax.sharded_v4_step is the "
                         "mesh form)")
    s = sizes(args)
    rng = np.random.default_rng(args.seed)
    q_lens = [1] * args.decode + [3, s["prefill"]]
    kv_lens = [int(rng.integers(max(q, 1), s["context"] + 1)) for q in q_lens]
    layout, inputs, params, caches, states, meta = build(rng, s, q_lens, kv_lens)
    types = {0: "SWA", 4: "CSA", 128: "HCA"}
    # the official bf16 regime (v4_step's default) scores bf16 index keys; an fp8 index cache
    # (V3.2's keys with f32 scales) runs the f32 regime
    precision = "f32" if isinstance(caches.csa_index, Fp8IndexCache) else V4_DEFAULT_PRECISION
    print(f"model: DeepSeek-V4-Flash attention, {s['layers']} layers "
          f"{[types[r] for r in layout.compress_ratios]}, precision {precision}")
    print(f"layout: window {layout.window_size} tokens, page {layout.window_page_size} tokens x "
          f"{layout.window_pages_per_seq}/seq; CSA pages {layout.csa_page_size} entries x "
          f"{layout.csa_pages_per_seq}/seq; HCA pages {layout.hca_page_size} entries x "
          f"{layout.hca_pages_per_seq}/seq; heads {s['heads']} x 512, indexer "
          f"{s['index_heads']} x 128, top-k {s['k']}")
    print(f"batch: q_lens={q_lens} (+2 padding rows), kv_lens={kv_lens}; "
          f"T={inputs.q.shape[1]} rows")

    def step(backend):
        res = v4_step(inputs, params, caches, states, meta, layout=layout, backend=backend,
                      precision=precision)
        return res.out, res.topk

    backends = ["reference"] + (["pallas"] if args.dsa_use_pallas else [])
    results, timings = time_backends(step, backends, progress)
    nan = {}
    for b in backends:
        nan[b] = bool(np.isnan(np.asarray(results[b][0], np.float32)).any())
        print(backend_line(b, timings[b], results[b][0]))
    cmp = None
    if "pallas" in results:
        (ref_out, ref_topk), (pal_out, pal_topk) = results["reference"], results["pallas"]
        print(agreement(V4StepResult(ref_out, ref_topk, None, None),
                        V4StepResult(pal_out, pal_topk, None, None)))
        cmp = compare(ref_out, pal_out, ref_topk, pal_topk, precision)
    lines, status = verdict("the V4-Flash step", nan, timings, cmp)
    print("\n".join(lines))
    return status
