"""DeepSeek-V4.1's long indexer rows (issue 31, Deliver 6): AOT compiles (libtpu on CPU) of the
package's token top-k at ratio 1 and V4.1's indexer dims (32 heads x 128, top-512) with rows of
1M entries, and the bound on its XLA temporaries: score chunks and k, not rows x context
(``scripts/cost/v41_long_rows.py`` has every shape, chip and key format; the numbers are in
``docs/v41.md``).

Compiles, one chip each: a 4 x 1M decode with bf16 keys (one chunk of 4 rows, 16 MiB);
the same decode over fp8 index pages with a 4 MiB score chunk (4 chunks of 1 row in a loop: the
bound is a quarter of the 16 MiB of all rows' scores, so it holds only if the chunks are not
materialised together); and a 1024-row prefill chunk at 128K (8 chunks of 128 rows, 64 MiB
each, against 512 MiB of all rows' scores); the 4 x 1M decode over V4.1's fp4 index pages,
plain and as a candidate consumer's exact top-k among 2048 blocks of 8. A 1M prefill at the
table's block rows (16: the kernel's score row buffers ``f32[2, 16, 1M]``, 128 MiB, outgrow
VMEM) now compiles because the entry cuts the row block to fit (``blocks.resolve_blocks``):
gated on the chip with the least VMEM. Not gated: the 32 x 1M decode at pages of 64
(refused: its page table outgrows SMEM; the script records it)."""

from __future__ import annotations

import pytest

from pallas_kernels import aot
from pallas_kernels.indexer import compile_cases as icases
from pallas_kernels.indexer.scoring import SCORE_CHUNK_BYTES
from scripts.cost import v41_long_rows as lr

pytestmark = pytest.mark.kernel_gate  # also run on the newest jax (README)

K = icases.v41_flash().index_topk
SMALL_CHUNK = 4 * lr.MiB

# (shape name, key format, score_chunk_bytes or None for the default), one chip each, in turn
_GATES = [
    ("V4.1 decode 4x1048576", "bf16", None),
    ("V4.1 decode 4x1048576", "fp8 pages", SMALL_CHUNK),
    ("V4.1 prefill 1024@131072", "bf16", None),
    ("V4.1 decode 4x1048576", "fp4 pages", None),  # V4.1's own index pages, pages of 128
]
GATES = [(list(aot.CHIPS)[i % len(aot.CHIPS)], *g) for i, g in enumerate(_GATES)]
# the row block cut to fit, on the chip with the least VMEM
SMALLEST = min(sorted(aot.CHIPS), key=lambda c: aot.chip_info(c).vmem_capacity_bytes)
GATES.append((SMALLEST, "V4.1 prefill 64@1048576", "bf16", None))


@pytest.mark.parametrize("chip,name,key_format,chunk", GATES,
                         ids=[f"{c}-{n.split(' ', 1)[1]}-{f}" for c, n, f, _ in GATES])
def test_long_row_top_k_compiles_with_bounded_temporaries(chip, name, key_format, chunk):
    case = icases.v41_long_case(name, key_format, score_chunk_bytes=chunk)
    r = lr.measure(case, chip, k=K, exact=False,
                   chunk_bytes=SCORE_CHUNK_BYTES if chunk is None else chunk)
    assert r["ok"], r.get("error")
    assert r["N"] == icases.V41_LONG_SHAPES[name][1][0]  # ratio 1: one entry per token
    # the declared bound: score chunks and k, not the context
    assert r["chunk_bytes"] <= (SCORE_CHUNK_BYTES if chunk is None else chunk)
    assert r["bound"] == lr.temp_bound(r["chunk_bytes"], r["rows"], K, False)
    assert r["temp"] + r["xla_vmem"] <= r["bound"], r
    assert r["largest"].bytes <= r["chunk_bytes"], r["largest"]
    if r["chunk_rows"] < r["rows"]:  # chunked: the bound is below all rows' scores
        assert r["bound"] < r["full_scores"], r


def test_the_row_block_is_cut_to_fit_the_score_rows_in_vmem():
    """When compiling, the token-mode row block is cut by the ladder's step (4) until its two
    f32 score-row buffers fit the chip's VMEM budget: a 1M-entry prefill on every chip (16 rows
    at 128K stay 16); interpreting, nothing is cut."""
    from pallas_kernels.indexer import blocks

    for chip in sorted(aot.CHIPS):
        kw = dict(block_rows=None, block_pages=None, chip=chip, one_token_per_seq=False,
                  page_size=64)
        assert blocks.resolve_blocks(None, pages_per_seq=2048, mosaic=True, **kw).block_rows == 16
        b = blocks.resolve_blocks(None, pages_per_seq=16384, mosaic=True, **kw)
        assert b.block_rows < 16
        assert blocks.row_buffer_bytes(b.block_rows, b.block_pages, 64, 16384) <= \
            blocks.vmem_budget(chip) or b.block_rows == 1
        assert blocks.resolve_blocks(None, pages_per_seq=16384, mosaic=False,
                                     **kw).block_rows == 16


# Both at 1M, where a lane-padded [T, N / 8, 8] array is 256 MiB against bounds of 40 and 148
# MiB. At 4 x 128K the source's bound (22.1 MiB) separated nothing: the padded max-pool measured
# 24.2 MiB on jax 0.10.2, the fixed one 23.3 on jax 0.12 (tpu7x; CI's 3.12 leg failed it).
SELECTION_GATE = "V4.1 decode 4x1048576"


@pytest.mark.parametrize("selection", icases.V41_SELECTIONS)
def test_the_candidate_selections_compile_bounded(selection):
    """Over fp4 pages, exact: a REINDEX layer's top-k among its 2048 candidate blocks of 8
    (``index_topk_v41(candidates=)``, 4 x 1M: temporaries within two score chunks plus 64 B a
    candidate entry, where an exact top-k over whole rows is bounded by 8 chunks, a sort; it
    ranks only the 16384 candidate entries of a row) and the candidate source's selection
    (``index_select_v41(num_blocks=2048)``, 4 x 1M: the exact bound plus its blocks' sort).
    No XLA array above the chunk. Refused by these bounds, as measured: gathering the
    candidates through a ``[N / 8, 8]`` view of the row or max-pooling the blocks through one
    (256 MiB of temp at 4 x 1M: 8 lanes padded to 128)."""
    turn = len(_GATES) + icases.V41_SELECTIONS.index(selection)
    chip = list(aot.CHIPS)[turn % len(aot.CHIPS)]
    case = icases.v41_long_case(SELECTION_GATE, "fp4 pages", exact=True,
                                selection=selection)
    r = lr.measure(case, chip, k=K, exact=True, selection=selection)
    assert r["ok"], r.get("error")
    assert r["bound"] == lr.temp_bound(r["chunk_bytes"], r["rows"], K, True, selection,
                                       r["chunk_rows"])
    if selection == "consumer":  # 2 chunks, not the exact sort's 8
        assert r["bound"] < lr.temp_bound(r["chunk_bytes"], r["rows"], K, True) / 3
    assert r["temp"] + r["xla_vmem"] <= r["bound"], r
    assert r["largest"].bytes <= r["chunk_bytes"], r["largest"]
