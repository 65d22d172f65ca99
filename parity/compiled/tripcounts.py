"""How often each source loop of a Triton kernel runs, per program, without a GPU.

The kernel's Python source (and that of every `@triton.jit` helper it calls) is
rewritten into a plain Python "skeleton" that keeps only its control flow and
scalar integer arithmetic: tensors, pointers, loads and every `tl` operation
but a few scalar ones become `UNKNOWN`, which absorbs whatever is done with it.
Run once per program id with the launch's constexprs and scalar arguments, the
skeleton counts every `for` body execution (runtime `range`/`tl.range` loops and
unrolled `tl.static_range` ones alike), keyed by (file name, line of the `for`),
and the line of an early `return`. Tensors keep their dtype where it is known
(`pointer(dtype)` arguments, loads through them, `.to`, `tl.zeros`/`full`/`dot`),
so a branch on `x.dtype` is derived. A loop whose bounds, or an `if` whose
condition, depends on a loaded value (e.g. cu_seqlens) is not derivable: it is
listed in `unknown` (such a loop counts 0 iterations; such an `if` is taken as
false). Nothing here imports a GPU driver.

    counts = trip_counts(kernel, grid, params)   # params: {name: value or pointer(dtype)}
    counts.per_program      # {(file, line): body executions summed over programs}
    counts.programs, counts.early_exit, counts.unknown
"""

import ast
import inspect
import itertools
import os
import textwrap
from collections import Counter
from dataclasses import dataclass, field

from .symbolic import (UNKNOWN, FakeTL, FakeTriton, Typed, loop_range, typed_to,
                       unwrap)
@dataclass
class TripCounts:
    """Loop body executions of one launch, summed over its programs."""

    kernel: str
    programs: int
    per_program: Counter = field(default_factory=Counter)  # (file, line) -> total executions
    early_exit: Counter = field(default_factory=Counter)   # (file, line) of a return -> programs
    unknown: Counter = field(default_factory=Counter)      # (file, line) -> programs
    loops: dict = field(default_factory=dict)               # (file, line) -> dict(kind, source)
    evaluated: int = 0                                      # programs actually run

    def mean(self, key) -> float:
        """Executions of loop `key`'s body per program, averaged over the grid."""
        return self.per_program[key] / self.programs


class _Run:
    def __init__(self, grid):
        self.grid = list(grid) + [1] * (3 - len(grid))
        self.pid = [0, 0, 0]
        self.counts = Counter()
        self.unknown = set()

    def loop(self, key, make):
        try:
            it = make()
        except Exception:  # Underivable, or an operation with no scalar meaning
            self.unknown.add(key)
            return
        for x in it:
            self.counts[key] += 1
            yield x

    def cond(self, key, make):
        try:
            return bool(make())
        except Exception:  # Underivable, or an operation with no scalar meaning
            self.unknown.add(key)
            return False


class _Rewrite(ast.NodeTransformer):
    """Kernel AST -> skeleton AST (see the module docstring)."""

    def __init__(self, file, offset, loops, is_kernel, looping):
        self.file, self.offset, self.loops, self.is_kernel = file, offset, loops, is_kernel
        self.looping = looping  # names of jit helpers that contain a loop
        self.relevant = set()

    def slice(self, fdef):
        """The names control flow depends on: those read by loop bounds, branch
        conditions and return values, closed over the assignments that define
        them (flow-insensitive). Other assignments and calls are dropped, so the
        skeleton runs nothing but its control flow."""
        def names(node):
            return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} if node else set()

        rel, assigns = set(), []
        for node in ast.walk(fdef):
            if isinstance(node, ast.For):
                rel |= names(node.iter)
            elif isinstance(node, (ast.If, ast.While, ast.IfExp)):
                rel |= names(node.test)
            elif isinstance(node, ast.Return):
                rel |= names(node.value)
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                assigns.append((set().union(*(names(t) for t in targets)), node))
        while True:
            grown = set(rel)
            for targets, node in assigns:
                if (targets & grown) or self._calls_loop(node.value):
                    grown |= names(node.value) | targets
            if grown == rel:
                break
            rel = grown
        self.relevant = rel

    def _calls_loop(self, node):
        return node is not None and any(
            isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in self.looping
            for n in ast.walk(node))

    def _keep(self, node, targets):
        return bool(set().union(*({n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
                                  for t in targets)) & self.relevant) \
            or self._calls_loop(node.value)

    def visit_Assign(self, node):
        if not self._keep(node, node.targets):
            return None
        return self._guard(self.generic_visit(node), node.targets)

    def visit_AugAssign(self, node):
        if not self._keep(node, [node.target]):
            return None
        return self._guard(self.generic_visit(node), [node.target])

    @staticmethod
    def _guard(stmt, targets):
        """stmt, its targets made UNKNOWN if it raises (an operation the skeleton
        has no scalar meaning for)."""
        names = sorted({n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)})
        fallback = [ast.parse(f"{n} = __UNKNOWN").body[0] for n in names] or [ast.Pass()]
        handler = ast.ExceptHandler(type=ast.Name(id="Exception", ctx=ast.Load()), name=None,
                                    body=fallback)
        return ast.copy_location(ast.Try(body=[stmt], handlers=[handler], orelse=[],
                                         finalbody=[]), stmt)

    def visit_Expr(self, node):
        return self.generic_visit(node) if self._calls_loop(node.value) else None

    def key(self, node):
        return (self.file, node.lineno + self.offset)

    def _lazy(self, expr):
        return ast.Lambda(args=ast.arguments(posonlyargs=[], args=[], vararg=None, kwonlyargs=[],
                                             kw_defaults=[], kwarg=None, defaults=[]), body=expr)

    def _stmts(self, body):
        out = []
        for s in body:
            s = self.visit(s)
            out += s if isinstance(s, list) else [] if s is None else [s]
        return out or [ast.Pass()]

    def _call(self, name, *args):
        return ast.Call(func=ast.Name(id=name, ctx=ast.Load()), args=list(args), keywords=[])

    def visit_FunctionDef(self, node):
        node.decorator_list = []
        node.returns = None
        for a in node.args.args + node.args.kwonlyargs:
            a.annotation = None
        node.body = self._stmts(node.body)
        return node

    def visit_AnnAssign(self, node):
        if node.value is None or not self._keep(node, [node.target]):
            return None
        return ast.copy_location(ast.Assign(targets=[node.target],
                                            value=self.visit(node.value)), node)

    def visit_Assert(self, node):
        return None

    def visit_For(self, node):
        key = self.key(node)
        src = ast.unparse(node.iter)
        kind = "static" if "static_range" in src else "runtime"
        self.loops[key] = dict(kind=kind, source=f"for {ast.unparse(node.target)} in {src}")
        it = self._call("__loop", ast.Constant(key), self._lazy(self.visit(node.iter)))
        body = self._stmts(node.body)
        return ast.copy_location(ast.For(target=node.target, iter=it, body=body, orelse=[]), node)

    def _test(self, node):
        return self._call("__cond", ast.Constant(self.key(node)), self._lazy(self.visit(node.test)))

    def visit_If(self, node):
        body = self._stmts(node.body)
        orelse = self._stmts(node.orelse) if node.orelse else []
        return ast.copy_location(ast.If(test=self._test(node), body=body, orelse=orelse), node)

    def visit_While(self, node):
        key = self.key(node)
        self.loops[key] = dict(kind="while", source=f"while {ast.unparse(node.test)}")
        body = self._stmts(node.body)
        count = ast.parse(f"__count({key!r})").body[0]
        return ast.copy_location(ast.While(test=self._test(node), body=[count] + body, orelse=[]),
                                 node)

    def visit_Return(self, node):
        value = self.visit(node.value) if node.value is not None else None
        ret = ast.copy_location(ast.Return(value=value), node)
        if not self.is_kernel:
            return ret
        return [ast.parse(f"__exit({self.key(node)!r})").body[0], ret]

    def visit_IfExp(self, node):
        self.generic_visit(node)
        return ast.IfExp(test=self._call("__cond", ast.Constant(self.key(node)),
                                         self._lazy(node.test)), body=node.body,
                         orelse=node.orelse)

    def visit_Call(self, node):
        self.generic_visit(node)
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr == "to":
            return ast.Call(func=ast.Name(id="__to", ctx=ast.Load()),
                            args=[f.value, *node.args], keywords=node.keywords)
        return node


def _is_jit(obj) -> bool:
    """A `@triton.jit` function (compiled or interpreted): wraps a plain function."""
    return inspect.isfunction(getattr(obj, "fn", None))


class Skeleton:
    """The skeletons of a kernel and of the jit helpers it reaches."""

    def __init__(self):
        self._made = {}
        self.loops = {}

    def build(self, jitfn, run, is_kernel=False):
        if id(jitfn) in self._made:
            return self._made[id(jitfn)]
        fn = jitfn.fn
        lines, start = inspect.getsourcelines(fn)
        src = textwrap.dedent("".join(lines))
        tree = ast.parse(src)
        fdef = tree.body[0]
        fdef.decorator_list = []
        # the def line is `start` (decorators included in getsourcelines)
        offset = start - 1
        file = os.path.basename(fn.__code__.co_filename)
        rw = _Rewrite(file, offset, self.loops, is_kernel, self._looping(fn))
        rw.slice(fdef)
        new = rw.visit(tree)
        ast.fix_missing_locations(new)
        code = compile(new, f"<skeleton {fn.__name__}>", "exec")
        env = self._globals(fn, run)
        exec(code, env)
        made = env[fdef.name]
        self._made[id(jitfn)] = made
        return made

    @staticmethod
    def _looping(fn) -> set:
        """Global names of `fn` that are jit helpers reaching a loop."""
        out = set()
        for name in fn.__code__.co_names:
            g = fn.__globals__.get(name)
            if _is_jit(g) and _has_loop(g):
                out.add(name)
        return out

    def _globals(self, fn, run):
        tl = FakeTL(run)
        scope = dict(fn.__globals__)
        if fn.__closure__:
            scope.update({n: c.cell_contents for n, c in zip(fn.__code__.co_freevars,
                                                               fn.__closure__)})
        env = {}
        for name in fn.__code__.co_names + fn.__code__.co_freevars:
            if name not in scope:
                continue
            env[name] = self._value(scope[name], run, tl)
        env.update(__builtins__=__builtins__, __UNKNOWN=UNKNOWN, __loop=run.loop,
                   __cond=run.cond, __to=typed_to,
                   __count=lambda k: run.counts.__setitem__(k, run.counts[k] + 1),
                   __exit=lambda k: run.__dict__.setdefault("exit", k),
                   range=loop_range)
        return env

    def _value(self, v, run, tl):
        import types

        if type(v).__name__ == "ConstexprFunction":  # plain Python on constexprs
            def constexpr_call(*a, **k):
                try:
                    return v.fn(*(unwrap(x) for x in a), **{n: unwrap(x) for n, x in k.items()})
                except Exception:  # an argument the skeleton does not know
                    return UNKNOWN
            return constexpr_call
        if _is_jit(v):
            skel = self

            def call(*a, **k):
                return skel.build(v, run)(*a, **k)
            return call
        v = unwrap(v)
        if isinstance(v, (bool, int, float, str)) or v is None:
            return v
        if isinstance(v, types.ModuleType):
            if v.__name__ == "triton.language":
                return tl
            if v.__name__ == "triton":
                return FakeTriton(tl)
            if v.__name__ == "builtins":
                return v
            return UNKNOWN
        return UNKNOWN


def trip_counts(kernel, grid, params: dict, max_programs: int = 1 << 20) -> TripCounts:
    """Run the skeleton of `kernel` (a JITFunction) once per program of `grid`;
    `params` maps every parameter name to its constexpr or scalar value (pass
    None for an absent tensor, `pointer(dtype)` for a tensor whose dtype the
    kernel may branch on, anything else for a tensor: it becomes UNKNOWN).
    Programs that differ only along an axis the skeleton never reads (no
    `tl.program_id(axis)`) are run once and weighted."""
    grid = [int(g) for g in grid]
    programs = 1
    for g in grid:
        programs *= g
    run = _Run(grid)
    skel = Skeleton()
    fn = skel.build(kernel, run, is_kernel=True)
    names = list(inspect.signature(kernel.fn).parameters)
    args = []
    for n in names:
        v = unwrap(params.get(n, UNKNOWN))
        args.append(v if isinstance(v, (bool, int, float, str, Typed)) or v is None
                    else UNKNOWN)
    read = _axes_read(kernel)
    axes = [range(g) if a in read else range(1) for a, g in enumerate(run.grid)]
    weight = 1
    for a, g in enumerate(run.grid):
        if a not in read:
            weight *= g
    if programs // weight > max_programs:
        raise ValueError(f"{kernel.__name__}: {programs // weight} programs to evaluate")
    out = TripCounts(kernel=kernel.__name__, programs=programs)
    for pid in itertools.product(*axes):
        run.pid = list(pid)
        run.counts, run.unknown = Counter(), set()
        run.__dict__.pop("exit", None)
        fn(*args)
        for k, c in run.counts.items():
            out.per_program[k] += c * weight
        for k in run.unknown:
            out.unknown[k] += weight
        if "exit" in run.__dict__:
            out.early_exit[run.exit] += weight
        out.evaluated += 1
    out.loops = dict(skel.loops)
    return out


def _has_loop(jitfn, seen=None) -> bool:
    """Whether a jit function, or a jit helper it calls, has a for/while loop."""
    seen = seen if seen is not None else set()
    if id(jitfn) in seen:
        return False
    seen.add(id(jitfn))
    tree = ast.parse(textwrap.dedent("".join(inspect.getsourcelines(jitfn.fn)[0])))
    if any(isinstance(n, (ast.For, ast.While)) for n in ast.walk(tree)):
        return True
    return any(_is_jit(jitfn.fn.__globals__.get(n)) and _has_loop(jitfn.fn.__globals__[n], seen)
               for n in jitfn.fn.__code__.co_names)


def _axes_read(kernel) -> set:
    """Grid axes whose program id the kernel (or a helper) reads: a constant
    `tl.program_id(a)` argument, else all three."""
    seen, axes, todo = set(), set(), [kernel]
    while todo:
        f = todo.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        tree = ast.parse(textwrap.dedent("".join(inspect.getsourcelines(f.fn)[0])))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in ("program_id", "num_programs"):
                arg = node.args[0] if node.args else (node.keywords[0].value if node.keywords
                                                      else ast.Constant(0))
                if isinstance(arg, ast.Constant) and isinstance(arg.value, int):
                    axes.add(arg.value)
                else:
                    axes.update((0, 1, 2))
        for name in f.fn.__code__.co_names:
            g = f.fn.__globals__.get(name)
            if _is_jit(g):
                todo.append(g)
    return axes
