"""Reading a compiled kernel's SASS without a GPU: loops, instruction classes,
occupancy and a dynamic warp-instruction estimate.

    a = analyze(cubin, ptx, trips, num_warps)      # trips: parity.compiled.tripcounts
    occupancy(regs, shared, num_warps, arch)      # CTAs per SM

disassembles the cubin with Triton's bundled nvdisasm (line info on: Triton
compiles with -lineinfo), finds the loops from the control flow (a branch to a
lower address closes a loop; the closing branch's source line names the `for`
it implements), counts per loop body the instructions and their classes (BAR =
bar.sync, SHFL, MUFU.EX2, LDGSTS = cp.async, UTMALDG = TMA load, HMMA, HGMMA),
and estimates the warp-instructions one launch issues:

    sum over code regions (instructions in the region x times it runs) x warps

where a loop body runs as often as `parity.compiled.tripcounts` says its source loop's
body runs over the grid (divided by ptxas's unroll factor, found by matching the
loop's bar.sync, ex2, mma, cp.async and global-store counts, which ptxas keeps one
for one, with a PTX loop's), code outside loops once per program, and a program
that leaves by an early `return` only the code before the first EXIT. Every
instruction of a region counts, predicated or branched around: an upper bound where a
branch skips code.
"""

import os
import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass, field

from . import timemodel

# Per-SM limits used for CTAs per SM (CUDA occupancy calculator rules): registers
# per SM, register allocation unit per warp, warps, CTAs, shared memory per SM and
# the 1 KiB the runtime reserves per CTA. sm_90 = H100, sm_80 = A100.
SM_LIMITS = {
    90: dict(regs=65536, reg_unit=256, warps=64, ctas=32, smem=228 * 1024, smem_reserved=1024),
    80: dict(regs=65536, reg_unit=256, warps=64, ctas=32, smem=164 * 1024, smem_reserved=1024),
}

# SASS opcode prefix -> class; the classes reported per loop body.
CLASSES = (("BAR", re.compile(r"BAR\.SYNC")), ("SHFL", re.compile(r"SHFL")),
           ("MUFU.EX2", re.compile(r"MUFU\.EX2")), ("LDGSTS", re.compile(r"LDGSTS")),
           ("UTMALDG", re.compile(r"UTMALDG")), ("HMMA", re.compile(r"HMMA")),
           ("HGMMA", re.compile(r"HGMMA")))
REPORTED = tuple(c for c, _ in CLASSES)

# Instruction kinds PTX and SASS have one for one, for ptxas's unroll factor; _EXACT are
# those ptxas never merges (it CSEs some global loads and shuffles).
_ONE_TO_ONE_SASS = (("gld", r"LDG\b"), ("gst", r"STG\b"), ("bar", r"BAR\.SYNC"),
                    ("ex2", r"MUFU\.EX2"), ("shfl", r"SHFL"), ("mma", r"HMMA"),
                    ("wgmma", r"HGMMA"), ("cpasync", r"LDGSTS"))
_ONE_TO_ONE_PTX = (("gld", r"ld\.global"), ("gst", r"st\.global"),
                   ("bar", r"(bar|barrier)\.sync"), ("ex2", r"ex2\.approx"),
                   ("shfl", r"shfl\.sync"), ("mma", r"mma\.sync"),
                   ("wgmma", r"wgmma\.mma_async"), ("cpasync", r"cp\.async\.(ca|cg)"))
_EXACT = ("gst", "bar", "ex2", "mma", "wgmma", "cpasync")


@dataclass
class Instr:
    addr: int
    op: str        # opcode with modifiers, predicate stripped: "BAR.SYNC.DEFER_BLOCKING"
    text: str
    loc: tuple     # (file name, line) or None
    predicated: bool = False


@dataclass
class Loop:
    start: int          # address of the first instruction of the body (the branch target)
    end: int            # address of the closing backward branch
    loc: tuple          # (file, line) of the closing branch
    parent: int = -1    # index of the innermost enclosing loop, -1 at top level
    depth: int = 0
    static: int = 0     # instructions in the body, nested loops excluded
    classes: Counter = field(default_factory=Counter)
    one_to_one: Counter = field(default_factory=Counter)


def tool(name: str) -> str:
    """Path of one of Triton's bundled CUDA tools (nvdisasm, cuobjdump, ptxas)."""
    from triton import knobs

    return getattr(knobs.nvidia, name).path


def has_nvdisasm() -> bool:
    """Whether Triton bundles nvdisasm here (its NVIDIA backend is installed)."""
    try:
        return os.path.exists(tool("nvdisasm"))
    except Exception:
        return False


def disassemble(cubin: bytes) -> str:
    """nvdisasm -c -g of a cubin (SASS with source lines)."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        res = subprocess.run([tool("nvdisasm"), "-c", "-g", path], capture_output=True, text=True)
    if res.returncode != 0 or "/*0000*/" not in res.stdout:
        raise RuntimeError(f"nvdisasm failed: {res.stderr[-1000:]}")
    return res.stdout


_INS = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;?\s*$")
_LOC = re.compile(r'//## File "([^"]+)", line (\d+)')
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_BRA = re.compile(r"^(?:@!?U?P\w+\s+)?BRA(?:\.\w+)*\s+`?\(?(\.L_x_\d+)")


def parse(text: str):
    """(instructions, {label: address}) of an nvdisasm listing."""
    ins, labels, loc, pending = [], {}, None, []
    for line in text.splitlines():
        m = _LOC.search(line)
        if m:
            loc = (os.path.basename(m.group(1)), int(m.group(2)))
            continue
        m = _LABEL.match(line)
        if m:
            pending.append(m.group(1))
            continue
        m = _INS.match(line)
        if m:
            addr, body = int(m.group(1), 16), m.group(2).rstrip(" ;")
            for p in pending:
                labels[p] = addr
            pending = []
            pred = body.startswith("@")
            op = body.split()[1] if pred else body.split()[0]
            ins.append(Instr(addr, op, body, loc, pred))
    return ins, labels


def _drop_padding(ins, labels):
    """The code without the trap loop (a branch to itself) and NOPs after the last EXIT."""
    last = len(ins)
    while last and (ins[last - 1].op == "NOP" or _self_branch(ins[last - 1], labels)):
        last -= 1
    return ins[:last]


def _self_branch(i, labels) -> bool:
    m = _BRA.match(i.text)
    return bool(m) and labels.get(m.group(1)) == i.addr


def classes_of(ins) -> Counter:
    c = Counter()
    for i in ins:
        for name, pat in CLASSES:
            if pat.match(i.op):
                c[name] += 1
    return c


def _one_to_one(lines, table) -> Counter:
    c = Counter()
    for ln in lines:
        for name, pat in table:
            if re.match(pat, ln):
                c[name] += 1
    return c


def find_loops(ins, labels) -> list:
    """Loops from backward branches, innermost-first nesting resolved; a branch
    to itself (the trap after the last EXIT) is not a loop."""
    loops = []
    for i in ins:
        m = _BRA.match(i.text)
        if m and m.group(1) in labels:
            target = labels[m.group(1)]
            if target < i.addr:
                loops.append(Loop(start=target, end=i.addr, loc=i.loc))
    loops.sort(key=lambda l: (l.start, -l.end))
    for k, lp in enumerate(loops):
        enclosing = [j for j, o in enumerate(loops) if j != k and o.start <= lp.start
                     and lp.end <= o.end and (o.start, -o.end) < (lp.start, -lp.end)]
        if enclosing:
            lp.parent = max(enclosing, key=lambda j: loops[j].start)
            lp.depth = loops[lp.parent].depth + 1
    return loops


def _within(loops, j, k) -> bool:
    """Whether loop j is loop k or nested in it."""
    while j >= 0:
        if j == k:
            return True
        j = loops[j].parent
    return False


def innermost(loops, addr) -> int:
    """Index of the innermost loop whose body holds `addr`, -1 if none."""
    best = -1
    for k, lp in enumerate(loops):
        if lp.start <= addr <= lp.end and (best < 0 or lp.depth > loops[best].depth):
            best = k
    return best


# ---------------------------------------------------------------- PTX loops

_PTX_LABEL = re.compile(r"^(\$L__\w+):")
_PTX_BRA = re.compile(r"^\s*(?:@!?%\w+\s+)?bra(?:\.uni)?\s+(\$L__\w+)")


def ptx_loops(ptx: str) -> list:
    """The exclusive 1:1 instruction counts (nested loops left out) of every PTX loop
    (a bra to an earlier label)."""
    lines, labels = [], {}
    for raw in ptx.splitlines():
        m = _PTX_LABEL.match(raw)
        if m:
            labels[m.group(1)] = len(lines)
            continue
        s = raw.strip()
        if not s or s.startswith("//") or s.startswith("."):
            continue
        lines.append(s)
    spans = []
    for n, s in enumerate(lines):
        m = _PTX_BRA.match(s)
        if m and m.group(1) in labels and labels[m.group(1)] <= n:
            spans.append((labels[m.group(1)], n))
    out = []
    for a, b in spans:
        inner = [(x, y) for x, y in spans if a <= x and y <= b and (x, y) != (a, b)]
        own = [re.sub(r"^@!?%\w+\s+", "", lines[k]) for k in range(a, b + 1)
               if not any(x <= k <= y for x, y in inner)]
        out.append(_one_to_one(own, _ONE_TO_ONE_PTX))
    return out


def unroll_factor(sass_counts: Counter, ptx_counts: list) -> tuple:
    """(factor, how): how many copies of a PTX loop body ptxas put in one SASS loop
    body: the smallest u with u x (some PTX loop's counts) == the SASS loop's counts
    of bar.sync, ex2, mma, wgmma, cp.async and global stores (kinds ptxas keeps one
    for one; it merges some loads and shuffles). 1 with a note when none fits or
    the loop has none of these kinds."""
    s = [sass_counts.get(k, 0) for k in _EXACT]
    if not any(s):
        return 1, "unroll taken as 1 (no bar.sync/ex2/mma/cp.async/store to compare with the PTX)"
    for u in range(1, 17):
        for p in ptx_counts:
            if [u * p.get(k, 0) for k in _EXACT] == s:
                return u, (f"ptxas unroll {u}" if u > 1 else "not unrolled by ptxas")
    return 1, "unroll taken as 1 (no PTX loop with these bar.sync/ex2/mma/cp.async/store counts)"


# ---------------------------------------------------------------- occupancy

def occupancy(regs, shared, warps, arch) -> dict:
    """CTAs per SM from registers, shared memory and warps against the arch's
    per-SM limits (SM_LIMITS), with the limiting resource."""
    lim = SM_LIMITS[arch if arch in SM_LIMITS else 80]
    per_warp = -(-max(int(regs or 0), 1) * 32 // lim["reg_unit"]) * lim["reg_unit"]
    by = dict(regs=(lim["regs"] // per_warp) // warps,
              smem=lim["smem"] // (int(shared or 0) + lim["smem_reserved"]),
              warps=lim["warps"] // warps, ctas=lim["ctas"])
    n = min(by.values())
    return dict(ctas=n, limiter=min(by, key=lambda k: (by[k], k != "regs")), by=by,
                warps_per_sm=n * warps)


# ---------------------------------------------------------------- the analysis

@dataclass
class Analysis:
    instructions: int
    loops: list            # one dict per SASS loop (see analyze)
    per_program: float     # instructions one program issues (per warp)
    dynamic: float         # warp-instructions of the whole launch
    dynamic_classes: dict  # the same for each reported class
    notes: list
    mma_flops: float = 0.0  # tensor-core FLOPs of the whole launch (HMMA / HGMMA shapes)
    chain: float = 0.0      # cycles of one program's dependent chain (parity.compiled.timemodel)

    def as_dict(self) -> dict:
        return dict(instructions=self.instructions, loops=self.loops,
                    per_program=self.per_program, dynamic=self.dynamic,
                    dynamic_classes=self.dynamic_classes, notes=self.notes,
                    mma_flops=self.mma_flops, chain=self.chain)


def analyze(cubin: bytes, ptx: str, trips, num_warps: int, sass: str = None,
            programs: int = 1) -> Analysis:
    """The SASS section of one launch; `trips` is parity.compiled.tripcounts.TripCounts
    for the launch's grid (None when they could not be derived: every loop body
    then counts once per each of `programs`, a lower bound, said in the notes)."""
    ins, labels = parse(sass if sass is not None else disassemble(cubin))
    ins = _drop_padding(ins, labels)
    loops = find_loops(ins, labels)
    owner = [innermost(loops, i.addr) for i in ins]
    for k, lp in enumerate(loops):
        own = [i for i, o in zip(ins, owner) if o == k]
        lp.static = len(own)
        lp.classes = classes_of(own)
        lp.one_to_one = _one_to_one([i.op for i in own], _ONE_TO_ONE_SASS)
    ptx_counts = ptx_loops(ptx) if ptx else []
    notes = []
    if trips is not None:
        programs = trips.programs
    elif loops:
        notes.append("no trip counts: each loop body counted once per program (a lower bound)")

    # executions of each SASS loop's body, summed over the grid
    runs = [None] * len(loops)
    how = [""] * len(loops)
    by_loc = {}
    for k, lp in enumerate(loops):
        by_loc.setdefault(lp.loc, []).append(k)
    for loc, ks in by_loc.items():
        known = trips is not None and loc in trips.loops
        if not known:
            continue
        total = trips.per_program[loc]
        unrolls = {k: unroll_factor(loops[k].one_to_one, ptx_counts) for k in ks}
        top = max(u for u, _ in unrolls.values())
        main = [k for k in ks if unrolls[k][0] == top]
        src = trips.loops[loc]["source"]
        for k in ks:
            u, why = unrolls[k]
            if k in main:
                runs[k] = total / len(main) / u
                copies = f", one of {len(main)} copies" if len(main) > 1 else ""
                how[k] = f"`{src}`: {trips.mean(loc):g} body runs per program{copies}; {why}"
            else:
                runs[k] = 0.0
                how[k] = (f"remainder of `{src}` after ptxas unroll {top}: not counted "
                          f"(< {top} iterations per entry)")
            if trips.unknown.get(loc):
                how[k] += f"; NOT derivable in {trips.unknown[loc]} programs (counted 0)"
    # a loop the source does not name runs once per run of its enclosing region
    for k in sorted(range(len(loops)), key=lambda j: loops[j].depth):
        if runs[k] is None:
            lp = loops[k]
            runs[k] = runs[lp.parent] if lp.parent >= 0 else programs
            how[k] = (f"no source loop at {lp.loc[0]}:{lp.loc[1]} (e.g. a wait loop): "
                      f"once per run of its enclosing code" if lp.loc else
                      "no line info: once per run of its enclosing code")

    exits = trips.early_exit if trips is not None else {}
    n_exit = sum(exits.values())
    prefix = []
    if n_exit:
        first_loop = min((lp.start for lp in loops), default=None)
        ex = [i for i in ins if i.op == "EXIT" and (first_loop is None or i.addr < first_loop)]
        if ex:
            prefix = [i for i in ins if i.addr <= ex[0].addr]
            notes.append(f"{n_exit} of {programs} programs return early "
                         f"({', '.join(f'{f}:{l}' for f, l in exits)}): {len(prefix)} "
                         f"instructions each (up to the first EXIT)")
        else:
            n_exit = 0
            notes.append("early returns found but no EXIT before the first loop: "
                         "counted as full programs")
    if trips is not None:
        for loc, n in trips.unknown.items():
            if loc not in by_loc:
                notes.append(f"{loc[0]}:{loc[1]}: not derivable in {n} programs")

    dyn, dyn_c, flops = 0.0, Counter(), 0.0
    top_runs = programs - n_exit
    for i, o in zip(ins, owner):
        r = runs[o] if o >= 0 else top_runs
        dyn += r
        flops += r * timemodel.mma_flops(i.op)
        for name, pat in CLASSES:
            if pat.match(i.op):
                dyn_c[name] += r
    dyn += len(prefix) * n_exit
    for name, c in classes_of(prefix).items():
        dyn_c[name] += c * n_exit
    out_loops = []
    for k, lp in enumerate(loops):
        nest = [j for j in range(len(loops)) if _within(loops, j, k)]
        incl = Counter()
        for j in nest:
            incl.update(loops[j].classes)
        out_loops.append(dict(
            line=f"{lp.loc[0]}:{lp.loc[1]}" if lp.loc else None, depth=lp.depth,
            parent=lp.parent, start=lp.start, end=lp.end, static=lp.static,
            static_nested=sum(loops[j].static for j in nest),
            classes={c: lp.classes.get(c, 0) for c in REPORTED},
            classes_nested={c: incl.get(c, 0) for c in REPORTED},
            runs=runs[k], runs_per_program=runs[k] / programs, trips=how[k]))
    # one program's chain: the code outside loops once, each loop body's steady state
    # (two runs in a row, the second's cycles) x its runs per program
    chain = timemodel.chain_cycles([i.text for i, o in zip(ins, owner) if o < 0])
    for k, lp in enumerate(out_loops):
        body = [i.text for i, o in zip(ins, owner) if o == k]
        lp["chain"] = timemodel.chain_cycles(body, passes=2)
        chain += lp["chain"] * lp["runs_per_program"]
    return Analysis(instructions=len(ins), loops=out_loops, per_program=dyn / programs,
                    dynamic=dyn * num_warps,
                    dynamic_classes={c: dyn_c.get(c, 0.0) * num_warps for c in REPORTED},
                    notes=notes, mma_flops=flops * num_warps, chain=chain)
