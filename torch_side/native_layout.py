"""Token layout <-> chunk-slot layout of the torch path, and its slabs.

Every sequence (a batch row or a `cu_seqlens` segment) is cut into chunks of C tokens in
processing order (backwards with `reverse`), and the chunks of all sequences are stacked
into "slots" [H, M, C, D], ordered by chunk position ("step"). The slots are processed a
slab of consecutive steps at a time, gathered straight from the token-layout inputs and
scattered straight into the outputs, so memory is the outputs plus one slab's workspace.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import numpy as np
import torch

from bridge.decay import RESET_FLOOR


class ChunkTable(NamedTuple):
    """The chunk slots of a call (see chunk_table). Sequences are ranked by chunk count,
    longest first; slots are ordered by step, then rank, so the sequences active at step c
    are ranks [0, active[c]) and their slots are contiguous.

    token [M*C]: the token read by each slot position (0 at padding); sequence [M]: the
    sequence of each slot; active: the sequences active at each step; grid: the number of
    sequences when they all have the same whole number of chunks, in order, forwards (then
    slot step * grid + s reads the step-th chunk of sequence s: a strided view), else None;
    order / unorder: rank <-> sequence; slots: M; mask [M, C, 1]: True at real tokens
    (None without padding)."""
    token: torch.Tensor
    sequence: torch.Tensor
    active: list
    grid: Optional[int]
    order: torch.Tensor
    unorder: torch.Tensor
    slots: int
    mask: Optional[torch.Tensor]


@functools.lru_cache(maxsize=64)
def chunk_table(cu: tuple, C: int, reverse: bool) -> ChunkTable:
    """The ChunkTable of the sequences cu[i]:cu[i+1] in chunks of C (host side, cached)."""
    cu = np.asarray(cu, dtype=np.int64)
    lens = np.diff(cu)
    nch = -(-lens // C)
    order = np.argsort(-nch, kind="stable")
    active = nch[order][None, :] > np.arange(int(nch.max(initial=0)))[:, None]
    step, rank = np.nonzero(active)
    seq = order[rank]
    pos = step[:, None] * C + np.arange(C)
    valid = pos < lens[seq][:, None]
    tok = np.where(valid, cu[seq + 1][:, None] - 1 - pos if reverse else cu[seq][:, None] + pos, 0)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
    even = not reverse and len(lens) and (lens == lens[0]).all() and lens[0] % C == 0
    return ChunkTable(token=t(tok.reshape(-1)), sequence=t(seq), active=active.sum(1).tolist(),
                      grid=len(lens) if even else None, order=t(order),
                      unorder=t(np.argsort(order)), slots=len(seq),
                      mask=None if valid.all() else torch.from_numpy(valid[..., None]))


def accumulation_dtype(q):
    """float64 for float64 q, else float32 (SPEC: accumulation)."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


class CallLayout(NamedTuple):
    """A call's chunk table, chunk size C and compute (accumulation) dtype."""
    table: ChunkTable
    chunk: int
    dtype: torch.dtype


def call_layout(plan, q, cu_seqlens, chunk_size) -> CallLayout:
    """The CallLayout of a call: chunks of chunk_size, or of the longest sequence rounded up
    to a power of two when shorter; the table on q's device."""
    B, T = plan.B, plan.T
    cu = tuple(b * T for b in range(B + 1)) if cu_seqlens is None else tuple(cu_seqlens.tolist())
    longest = max(e - s for s, e in zip(cu, cu[1:]))
    C = min(chunk_size, 1 << max(longest - 1, 0).bit_length())
    table = chunk_table(cu, C, plan.reverse)
    if table.token.device != q.device:
        table = ChunkTable(*(x.to(q.device) if torch.is_tensor(x) else x for x in table))
    return CallLayout(table, C, accumulation_dtype(q))


class Slots:
    """The token-layout arrays of one call and its CallLayout: gathers slab inputs into slot
    layout [h, m, C, D] and scatters slot-layout results back."""

    def __init__(self, plan, layout, q, k, v, g, gk, gv, g_gamma):
        self.plan, self.table, self.C, self.dtype = plan, *layout
        self.n_tokens = plan.B * plan.T
        flat = lambda x: None if x is None else x.reshape(self.n_tokens, *x.shape[2:])
        if plan.g == "head":
            g = g.unsqueeze(-1)
        self.q, self.k, self.v, self.g, self.gk, self.gv = map(flat, (q, k, v, g, gk, gv))
        self.gamma = None
        if g_gamma is not None:  # [H, 1] per head or [H, N] per sequence
            gamma = g_gamma.to(self.dtype).clamp(min=-RESET_FLOOR)
            self.gamma = gamma[:, None] if gamma.dim() == 1 else gamma.t()
        self.token = self.table.token.view(-1, self.C)

    def slabs(self, config, backward=False):
        """[(r0, r1, active, after)]: slots r0:r1 of consecutive chunk steps, as many as fit
        the budget (config.slab_elements, see NativeConfig; backward_slab_scale times it for
        the backward; at least one step); active: the sequences active at each of those
        steps, after: at the step past them (0 at the end)."""
        plan, active = self.plan, self.table.active
        offs = np.cumsum([0] + active).tolist()
        per_slot = plan.H * self.C * max(plan.K, plan.V)
        slab = config.slab_elements
        grow = config.backward_slab_scale if backward else 1
        budget = grow * min(slab, max(slab // 4,
                                      self.n_tokens * plan.H * plan.V // config.slab_output_share))
        out, c0 = [], 0
        while c0 < len(active):
            c1 = c0 + 1
            while c1 < len(active) and (offs[c1 + 1] - offs[c0]) * per_slot <= budget:
                c1 += 1
            out.append((offs[c0], offs[c1], active[c0:c1], active[c1] if c1 < len(active) else 0))
            c0 = c1
        return out

    def real_tokens(self, r0, r1):
        """[m, C, 1] True at real tokens of slots r0:r1, or None without padding."""
        return None if self.table.mask is None else self.table.mask[r0:r1]

    def _grid_view(self, x, r0, r1):
        """x [L, h, D] at slots r0:r1 as a strided view [h, m / n, n, C, D] (see ChunkTable's
        grid: n sequences), or None where the slots are not a grid."""
        n = self.table.grid
        if n is None:
            return None
        # slots step * n + s: steps r0 // n .. r1 // n of every sequence s
        xv = x.view(n, -1, self.C, *x.shape[1:])[:, r0 // n:r1 // n]
        return xv.permute(3, 1, 0, 2, 4)

    def gather(self, x, r0, r1, scale=1.0, gate=False):
        """[L, h, D] -> slots r0:r1 as [h, m, C, D] in the compute dtype, 0 at padding.
        gate: x holds log decays, clamped at -RESET_FLOOR (bridge.decay: -inf is a reset)."""
        view = self._grid_view(x, r0, r1)
        if view is None:
            view = x.index_select(0, self.token[r0:r1].reshape(-1))
            view = view.view(r1 - r0, self.C, *x.shape[1:]).permute(2, 0, 1, 3).unsqueeze(1)
        y = torch.empty(view.shape, dtype=self.dtype, device=x.device)  # one strided copy
        # scaled in the copy, unless x is narrower (then widened first, scaled after)
        if scale != 1.0 and x.dtype == self.dtype:
            torch.mul(view, scale, out=y)
        else:
            y.copy_(view)
            if scale != 1.0:
                y.mul_(scale)
        y = y.flatten(1, 2)
        if gate:  # before the padding mask: -inf * 0 is NaN
            y.clamp_(min=-RESET_FLOOR)
        keep = self.real_tokens(r0, r1)
        return y if keep is None else y.mul_(keep)

    def scatter(self, dst, y, r0, r1, scale=1.0):
        """dst [L, h, D] at the tokens of slots r0:r1 <- scale * y [h, m, C, D] (padding left
        out)."""
        view = self._grid_view(dst, r0, r1)
        if view is not None:  # straight into dst
            y = y.reshape(view.shape)
            if scale != 1.0:
                torch.mul(y, scale, out=view)
            else:
                view.copy_(y)
            return
        y = y.mul(scale) if scale != 1.0 else y
        idx = self.token[r0:r1].reshape(-1)
        y = y.permute(1, 2, 0, 3).reshape(-1, *dst.shape[1:]).to(dst.dtype)
        keep = self.real_tokens(r0, r1)
        if keep is None:
            dst.index_copy_(0, idx, y)
        else:
            sel = keep.reshape(-1)
            dst.index_copy_(0, idx[sel], y[sel])

    def inputs(self, r0, r1, with_q=True):
        """Slots r0:r1 of (q scaled or None, k, v, key gates a or None, value gates b or None)."""
        plan, C, H, Hk = self.plan, self.C, self.plan.H, self.plan.Hk
        q = self.gather(self.q, r0, r1, plan.scale) if with_q else None
        k, v = self.gather(self.k, r0, r1), self.gather(self.v, r0, r1)
        if Hk != H:  # query head h reads kv head h // (H // Hk)
            k, v = (x.unsqueeze(1).expand(Hk, H // Hk, *x.shape[1:]).flatten(0, 1) for x in (k, v))
        parts = [self.gather(x, r0, r1, gate=True) for x in (self.g, self.gk) if x is not None]
        if self.gamma is not None:  # 0 at padding
            gs = self.gamma if self.gamma.shape[1] == 1 else self.gamma.index_select(
                1, self.table.sequence[r0:r1])
            gs, keep = gs[..., None, None], self.real_tokens(r0, r1)
            parts.append(gs * keep if keep is not None else gs.expand(H, r1 - r0, C, 1))
        a = functools.reduce(torch.add, parts) if parts else None
        return q, k, v, a, self.gather(self.gv, r0, r1, gate=True) if self.gv is not None \
            else None

    def by_rank(self, x, N, like):
        """[N, H, K, V] -> [H, N, K, V] in rank order and the compute dtype (zeros for None)."""
        if x is None:
            return torch.zeros(self.plan.H, N, self.plan.K, self.plan.V, dtype=self.dtype,
                               device=like.device)
        return x.to(self.dtype).transpose(0, 1).index_select(1, self.table.order)

    def by_sequence(self, x):
        """by_rank's inverse: [H, N, K, V] -> [N, H, K, V], contiguous."""
        return x.index_select(1, self.table.unorder).transpose(0, 1).contiguous()
