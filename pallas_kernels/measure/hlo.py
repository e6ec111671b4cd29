"""The optimized HLO text of a compiled program, parsed: its instructions, the Pallas calls and
their declared ``pl.CostEstimate`` bytes (``parse_kernel_calls``), ``while`` loops and their
carried state (``parse_loops``), big entry-computation results (``parse_large_results``), and
every gather / scatter (``parse_indexed_ops``), with shape helpers (``strip_layout``,
``shape_bytes``, ``dims``). ``pallas_kernels.measure.xla_cost`` builds the cost report and the
verdicts on top of it.

Gathers and scatters (``parse_indexed_ops``): every HLO ``gather(`` / ``scatter(``
instruction, in the entry computation or inside a fused computation, with its operand shapes,
number of indices (``num_indices``: index tuples, i.e. the indices array without its index
vector dim) and slice size (``slice_elems``: elements moved per index). XLA's TPU model prices a
per-element op (a slice of a few elements, ``take_along_axis``, ``x.at[rows, cols].set``) at
tens of times its data; a row op (``jnp.take(cache, ids, axis=0)``: a whole row per index) or a
per-row metadata op (one scalar per query row or sequence) is not the problem.
``IndexedOp.source`` names the JAX source line of each op, and ``parse_large_results`` the
entry-computation ops that produce big buffers: where to look when the XLA bytes are high.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

# Entry-computation XLA results at least this large are listed (``XlaCost.large_results``).
LARGE_RESULT_BYTES = 64 * 1024 * 1024

_COMP_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s+->\s+.*\{\s*$")
_INSTR_RE = re.compile(r"^\s+(?:ROOT\s+)?%?([\w.\-]+)\s+=\s+")
_OPCODE_RE = re.compile(r"\s*([\w\-]+)\(")
_DIMS_RE = re.compile(r"^[a-z0-9]+\[([\d,]*)\]")
_LAYOUT_RE = re.compile(r"\{[^{}]*\}")
_FRAME_RE = re.compile(r"stack_frame_id=(\d+)")


@dataclass(frozen=True)
class IndexedOp:
    """One HLO ``gather`` or ``scatter``.

    ``result_shape`` / ``operand_shapes``: layout-free shape strings (``"f32[64,2048]"``);
    gather operands are ``(operand, indices)``, scatter operands ``(operands..., indices,
    updates...)``. ``num_indices``: index tuples; ``slice_elems``: elements moved per index
    (gather: ``prod(slice_sizes)``; scatter: the update window). ``computation``: the HLO
    computation holding it (a fused computation or the entry). ``source``: the innermost user
    frame, ``"file.py:line function"``, or ``""`` when the HLO does not say; ``functions``:
    the function names of the whole recorded stack, innermost first; ``source_inferred``: both
    were read off the enclosing fusion (or its first user) because XLA dropped the op's own
    metadata."""

    kind: str
    name: str
    result_shape: str
    operand_shapes: tuple[str, ...]
    num_indices: int
    slice_elems: int
    computation: str
    source: str = ""
    functions: tuple[str, ...] = field(default=())
    source_inferred: bool = False

    def describe(self) -> str:
        """One line: kind, shapes, indices x slice, source (``~``: read off the enclosing
        fusion or its user because XLA dropped the op's own metadata)."""
        where = f" @ {'~' if self.source_inferred else ''}{self.source}" if self.source else ""
        return (f"{self.kind} {self.result_shape} <- ({', '.join(self.operand_shapes)}): "
                f"{self.num_indices} indices x {self.slice_elems} elems{where}")


@dataclass(frozen=True)
class KernelCall:
    """One Pallas call (``tpu_custom_call``): its name and declared ``pl.CostEstimate`` bytes
    (``None`` when it declares none, which XLA counts as 0)."""

    name: str
    bytes_accessed: int | None


@dataclass(frozen=True)
class Loop:
    """One HLO ``while``: its name, the bytes of its carried state (every array its body can
    read is in that tuple, so one iteration touches on the order of ``state_bytes``), and the
    JAX op that made it (``op_name`` metadata, e.g. ``.../searchsorted/.../while``)."""

    name: str
    state_bytes: int
    op_name: str


# ----------------------------------------------------------------------------- HLO text


@dataclass(frozen=True)
class _Instr:
    name: str
    shape: str  # layout-free
    opcode: str
    operands: tuple[str, ...]
    attrs: str  # the text after the operand list
    computation: str
    entry: bool = False


def strip_layout(shape: str) -> str:
    """``"f32[64,2048]{1,0:T(8,128)}"`` -> ``"f32[64,2048]"`` (tuples too)."""
    prev = None
    while prev != shape:
        prev, shape = shape, _LAYOUT_RE.sub("", shape)
    return shape


_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s4": 1, "u4": 1, "bf16": 2, "f16": 2, "s16": 2,
             "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8,
             "c128": 16}


def shape_bytes(shape: str) -> int:
    """Bytes of an array or tuple shape string (fp8 and unknown element types count 1 byte)."""
    shape = re.sub(r"/\*.*?\*/", "", shape)
    return sum(_ITEMSIZE.get(t, 1) * math.prod(int(d) for d in ds.split(",") if d)
               for t, ds in re.findall(r"([a-z][a-z0-9]*)\[([\d,]*)\]", shape))


def dims(shape: str) -> tuple[int, ...]:
    """Dimensions of an array shape string (``"s32[64,2048,2]"`` -> ``(64, 2048, 2)``)."""
    m = _DIMS_RE.match(shape.strip())
    if not m:
        raise ValueError(f"not an array shape: {shape!r}")
    return tuple(int(d) for d in m.group(1).split(",") if d)


def _closing(text: str, start: int, open_ch: str = "(", close_ch: str = ")") -> int:
    """Index of the bracket closing the one at ``text[start]``."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == open_ch:
            depth += 1
        elif text[i] == close_ch:
            depth -= 1
            if depth == 0:
                return i
    raise ValueError(f"unbalanced {open_ch!r} in HLO line: {text[:200]!r}")


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur).strip())
    return parts


def _parse_instr(line: str, computation: str, entry: bool) -> _Instr | None:
    m = _INSTR_RE.match(line)
    if not m:
        return None
    pos = m.end()
    if line[pos] == "(":  # tuple shape
        end = _closing(line, pos)
        shape, pos = line[pos:end + 1], end + 1
    else:
        end = line.find(" ", pos)
        shape, pos = line[pos:end], end
    op = _OPCODE_RE.match(line, pos)
    if not op:
        return None
    open_at = op.end() - 1
    close_at = _closing(line, open_at)
    operands = tuple(o.split()[-1].lstrip("%") for o in _split_top(line[open_at + 1:close_at]))
    return _Instr(m.group(1), strip_layout(shape), op.group(1), operands,
                  line[close_at + 1:], computation, entry)


def parse_instructions(hlo_text: str) -> list[_Instr]:
    """Every instruction of every computation of an HLO module's text."""
    return list(_instructions(hlo_text))


@functools.lru_cache(maxsize=8)  # ``analyze`` reads one module's text several ways
def _instructions(hlo_text: str) -> tuple[_Instr, ...]:
    out, comp, entry = [], "", False
    for line in hlo_text.splitlines():
        c = _COMP_RE.match(line)
        if c:
            comp, entry = c.group(2), bool(c.group(1))
            continue
        if line.startswith("}"):
            comp = ""
            continue
        if comp:
            ins = _parse_instr(line, comp, entry)
            if ins is not None:
                out.append(ins)
    return tuple(out)


def _source_table(hlo_text: str) -> dict[int, tuple[tuple[str, ...], str]]:
    """stack frame id -> (function names innermost first, ``"file:line function"`` innermost).

    The HLO text lists FileNames, FunctionNames, FileLocations and StackFrames tables (1-based
    ids). A frame's printed ``parent_frame_id`` is its parent's id plus one (0 and 1: none),
    read off programs whose call chain is known; a cycle or a bad id ends the chain."""
    tables: dict[str, dict[int, str]] = {}
    current = None
    for line in hlo_text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(line, {})
            continue
        m = re.match(r"^(\d+) (.*)$", line) if current is not None else None
        if m:
            current[int(m.group(1))] = m.group(2)
        elif current is not None and line.strip() == "":
            continue
        else:
            current = None
    files, funcs = tables.get("FileNames", {}), tables.get("FunctionNames", {})
    locs, frames = tables.get("FileLocations", {}), tables.get("StackFrames", {})

    def loc(i: int) -> tuple[str, str]:
        text = locs.get(i, "")
        f = re.search(r"file_name_id=(\d+)", text)
        fn = re.search(r"function_name_id=(\d+)", text)
        ln = re.search(r"\bline=(\d+)", text)
        path = files.get(int(f.group(1)), '""').strip('"') if f else "?"
        func = funcs.get(int(fn.group(1)), '""').strip('"') if fn else "?"
        return func, f"{path.rsplit('/', 1)[-1]}:{ln.group(1) if ln else '?'} {func}"

    out = {}
    for fid in frames:
        names, seen, cur, inner = [], set(), fid, ""
        while cur in frames and cur not in seen:
            seen.add(cur)
            text = frames[cur]
            lid = re.search(r"file_location_id=(\d+)", text)
            func, where = loc(int(lid.group(1))) if lid else ("?", "?")
            names.append(func)
            inner = inner or where
            par = re.search(r"parent_frame_id=(\d+)", text)
            cur = int(par.group(1)) - 1 if par else 0
        out[fid] = (tuple(names), inner)
    return out


def _frame_finder(instrs: list[_Instr]) -> Callable[[_Instr], tuple[int | None, bool]]:
    """``ins -> (stack frame id, inferred)``. XLA drops the metadata of some ops it rewrites
    (a scatter inside its fusion, measured); then the fusion instruction that calls the
    computation, or else the first op that uses that fusion, names the source
    (``inferred=True``), climbing through nested fusions."""
    callers: dict[str, _Instr] = {}
    users: dict[tuple[str, str], list[_Instr]] = {}
    for i in instrs:
        for callee in re.findall(r"(?:calls|to_apply|body)=%?([\w.\-]+)", i.attrs):
            callers.setdefault(callee, i)
        for o in i.operands:
            users.setdefault((i.computation, o), []).append(i)

    def frame(i: _Instr) -> int | None:
        m = _FRAME_RE.search(i.attrs)
        return int(m.group(1)) if m else None

    def find(ins: _Instr) -> tuple[int | None, bool]:
        if frame(ins) is not None:
            return frame(ins), False
        comp, seen = ins.computation, set()
        while comp in callers and comp not in seen:  # climb nested fusions
            seen.add(comp)
            caller = callers[comp]
            for cand in [caller, *users.get((caller.computation, caller.name), [])]:
                if frame(cand) is not None:
                    return frame(cand), True
            comp = caller.computation
        return None, False

    return find


def _indexed(ins: _Instr, shapes: dict[tuple[str, str], str], sources, find) -> IndexedOp:
    ops = tuple(shapes.get((ins.computation, o), "?") for o in ins.operands)
    ivd_m = re.search(r"index_vector_dim=(\d+)", ins.attrs)
    ivd = int(ivd_m.group(1)) if ivd_m else 0
    if ins.opcode == "gather":
        idx_shape = ops[1]
        sizes = re.search(r"slice_sizes=\{([\d,]*)\}", ins.attrs)
        slice_elems = math.prod(int(s) for s in sizes.group(1).split(",") if s) if sizes else 1
    else:
        n = (len(ops) - 1) // 2
        idx_shape, upd = ops[n], ops[n + 1]
        win = re.search(r"update_window_dims=\{([\d,]*)\}", ins.attrs)
        wdims = [int(s) for s in win.group(1).split(",") if s] if win else []
        udims = dims(upd) if upd != "?" else ()
        slice_elems = math.prod(udims[d] for d in wdims if d < len(udims))
    idims = dims(idx_shape) if idx_shape != "?" else ()
    num = math.prod(d for i, d in enumerate(idims) if i != ivd)
    frame, inferred = find(ins)
    funcs, where = sources.get(frame, ((), "")) if frame is not None else ((), "")
    return IndexedOp(ins.opcode, ins.name, ins.shape, ops, int(num), int(slice_elems),
                     ins.computation, where, funcs, inferred and bool(where))


def parse_indexed_ops(hlo_text: str) -> list[IndexedOp]:
    """Every ``gather`` / ``scatter`` instruction of the module (fused computations included),
    in text order."""
    instrs = parse_instructions(hlo_text)
    shapes = {(i.computation, i.name): i.shape for i in instrs}
    sources, find = _source_table(hlo_text), _frame_finder(instrs)
    return [_indexed(i, shapes, sources, find) for i in instrs
            if i.opcode in ("gather", "scatter")]


def parse_kernel_calls(hlo_text: str) -> list[KernelCall]:
    """Every Pallas call (``custom_call_target="tpu_custom_call"``) and its declared bytes."""
    out = []
    for ins in parse_instructions(hlo_text):
        if ins.opcode != "custom-call" or 'custom_call_target="tpu_custom_call"' not in ins.attrs:
            continue
        at = ins.attrs.find("backend_config=")
        est = None
        if at >= 0:
            cfg, _ = json.JSONDecoder().raw_decode(ins.attrs[at + len("backend_config="):])
            ce = cfg.get("custom_call_config", {}).get("cost_estimate")
            if ce and "bytes_accessed" in ce:
                est = int(ce["bytes_accessed"])
        out.append(KernelCall(ins.name, est))
    return out


def parse_loops(hlo_text: str) -> list[Loop]:
    """Every ``while`` instruction with its carried-state bytes and JAX op name."""
    out = []
    for ins in parse_instructions(hlo_text):
        if ins.opcode == "while":
            m = re.search(r'op_name="([^"]*)"', ins.attrs)
            out.append(Loop(ins.name, shape_bytes(ins.shape), m.group(1) if m else ""))
    return out


@dataclass(frozen=True)
class LargeResult:
    """An entry-computation XLA op whose result is large: a hint at where XLA's bytes go
    (``op_name``: the JAX op, e.g. ``jit(step)/squeeze`` for a cache slice)."""

    opcode: str
    shape: str
    bytes: int
    op_name: str


# copy-start's tuple holds source and destination: its copy-done is listed instead.
_NOT_XLA_WORK = ("parameter", "get-tuple-element", "tuple", "bitcast", "custom-call",
                 "copy-start", "constant")


def parse_large_results(hlo_text: str, min_bytes: int = LARGE_RESULT_BYTES) -> list[LargeResult]:
    """Entry-computation ops (fusions, copies, ...; not parameters, tuples, bitcasts or the
    Pallas calls) whose result has at least ``min_bytes``, largest first."""
    out = []
    for ins in parse_instructions(hlo_text):
        if not ins.entry or ins.opcode in _NOT_XLA_WORK:
            continue
        b = shape_bytes(ins.shape)
        if b >= min_bytes:
            m = re.search(r'op_name="([^"]*)"', ins.attrs)
            out.append(LargeResult(ins.opcode, ins.shape, b, m.group(1) if m else ""))
    return sorted(out, key=lambda r: -r.bytes)


_CYCLES_RE = re.compile(r'"estimated_cycles":"(\d+)"')


def estimated_cycles(hlo_text: str) -> int:
    """The sum of XLA's per-instruction ``estimated_cycles`` (the TPU backend config of a
    compiled program's ops; a ``while`` body once, as its bytes), 0 where the backend gives none
    (XLA:CPU). A second view of XLA's model beside ``bytes accessed`` (they can disagree:
    BENCHMARKS.md, session 29, where the bytes counted a weight's cross-program prefetch)."""
    return sum(int(c) for c in _CYCLES_RE.findall(hlo_text))


def has_while(hlo_text: str) -> bool:
    """True when the module has a ``while`` instruction."""
    return bool(parse_loops(hlo_text))
