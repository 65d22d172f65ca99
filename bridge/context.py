"""The framework-neutral half of context parallelism (SPEC.md, "Context parallelism"):
which device holds what, and the prefix combine of the slices' states, written with
Python operators that torch tensors, JAX arrays and NumPy arrays all have.

torch_side/context.py (`context_group=`) and jax_side/context.py (`context_axis=`) run
the rest with their framework's collective and autodiff, in SPEC.md's names:

    P, p         devices on the axis (ranks in the group), this device's index
    T            the tokens of every device's slice (SPEC's Tl)
    order        the visiting order: 0..P-1, or P-1..0 with reverse
    first        step 1: the device of each sequence's first processed token, where its
                 initial_state enters
    o_loc, F     step 1: the local pass's output [B,T,H,V] and final state [N,H,K,V]
    a, b         SPEC's per-token log decays a_t [B,T,H,K or 1], b_t [B,T,H,V]
    A, B         step 2: each sequence's log decays summed over the slice, [N,H,K], [N,H,V]
    Fs, As, Bs   step 3: (F, A, B) of every device, from the one all_gather, [P, ...]
    S_in         step 4: the state entering this device's slice [N,H,K,V]; final_state
                 the state after the last device visited
    seq, n0      each local token's sequence [T]; the sequence at the slice's entry edge
    ca, cb       step 5: inclusive sums of a, b from the entry edge to each token
"""


def visiting_order(P: int, reverse: bool) -> list:
    """The devices in the order the recurrence visits their slices."""
    return list(range(P))[::-1] if reverse else list(range(P))


def local_offsets(cu_seqlens, T, p):
    """The global packed offsets cu_seqlens [N+1] as offsets into device p's slice of T
    tokens, clip(cu - p*T, 0, T): a sequence outside the slice becomes empty there."""
    return (cu_seqlens - p * T).clip(0, T)


def first_device(cu_seqlens, T: int, P: int, reverse: bool):
    """[N]: the device holding each sequence's first processed token (its first token, or
    its last with reverse; an empty sequence: the device its offset falls on), from the
    global offsets cu_seqlens [N+1] (integers)."""
    first = (cu_seqlens[1:] - 1) if reverse else cu_seqlens[:-1]
    return (first // max(T, 1)).clip(0, P - 1)


def prefix_combine(Fs, transition, order, zero):
    """Step 4: from S = zero, for each device j in visiting order S_in[j] = S, then
    S = transition(j, S) + Fs[j], transition(j, S) being S scaled by device j's summed
    decays. Returns (S_in, a list by device index; final_state, the last S)."""
    S, S_in = zero, [None] * len(order)
    for j in order:
        S_in[j] = S
        S = transition(j, S) + Fs[j]
    return S_in, S
