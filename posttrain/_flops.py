"""FLOPs of a compiled plan: every matrix multiply of the step's jaxpr (scan- and
remat-aware), and the ratio to the model's FLOPs that the plan itself explains."""

from __future__ import annotations

import math

from jax.extend.core import jaxprs_in_params


def _expected_ratio(m, length: int, expert_buffer: float, lm_head: bool = True) -> float:
    """Training FLOPs of the program over the model's that the plan explains: `full` remat
    recomputes each layer's forward in the backward pass (its 2 of 6 N go to 8 N; the LM head
    and the attention kernel are not recomputed; other policies save the matmuls), and
    expert-parallel buffers sized for `expert_buffer` x the balanced load run that many rows
    through the routed experts."""
    total = m.flops_per_token(length, lm_head)
    head = 6 * m.embed_dim * m.vocab_size if lm_head else 0
    attention = total - m.flops_per_token(0, lm_head)
    layers = total - head - attention
    if m.moe:
        routed = 6 * m.num_moe_layers * m.moe.top_k * 3 * m.embed_dim * m.moe.expert_mlp_dim
        layers += routed * (expert_buffer - 1)
    recompute = 4 / 3 if m.remat == "full" else 1.0
    return (layers * recompute + head + attention) / total


def _expert_buffer(m, mesh) -> float:
    """Rows the routed experts process over the balanced M*K (expert parallelism pads its
    all-to-all buffers: `ep_capacity_factor`, or the worst case `min(K, E/ep) * ep / K`)."""
    from posttrain.models import expert_parallelism

    if m.moe is None or m.moe.dispatch != "dropless":
        return 1.0
    ep = expert_parallelism(mesh)
    if ep == 1:
        return 1.0
    if m.moe.ep_capacity_factor is not None:
        return m.moe.ep_capacity_factor
    return min(m.moe.top_k, m.moe.num_experts // ep) * ep / m.moe.top_k


def matmul_flops(jaxpr) -> float:
    """FLOPs of every matrix multiply the program executes: `dot_general`s, with scan bodies
    counted `length` times and rematerialised forwards counted again where the backward pass
    recomputes them (XLA's cost analysis counts each loop body once). Fused kernels (Pallas)
    are not matmuls here; their attention FLOPs are added from the model's formula."""
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (lc, _), (lb, _) = eqn.params["dimension_numbers"]
            a, b = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
            contract = math.prod(a[i] for i in lc)
            batch = math.prod(a[i] for i in lb)
            total += 2.0 * math.prod(a) * math.prod(b) / (contract * batch)
            continue
        if name == "ragged_dot_general":  # MoE experts: each row meets one group's matrix
            numbers = eqn.params["ragged_dot_dimension_numbers"]
            (_, rc), (_, rb) = numbers.dot_dimension_numbers
            a, b = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
            shared = math.prod(b[i] for i in (*rc, *rb, *numbers.rhs_group_dimensions))
            total += 2.0 * math.prod(a) * math.prod(b) / shared
            continue
        subs = list(jaxprs_in_params(eqn.params))
        counts = [matmul_flops(getattr(j, "jaxpr", j)) for j in subs]
        if not counts:
            continue
        if name == "scan":
            total += eqn.params["length"] * sum(counts)
        elif name == "cond":
            total += max(counts)
        elif name == "shard_map":
            # The body's shapes are per device along its manual axes only (a pipeline's
            # `stage`), global along the others.
            sizes = dict(eqn.params["mesh"].shape)
            manual = eqn.params.get("newly_manual_axes") or sizes
            total += sum(counts) * math.prod(sizes[a] for a in manual)
        else:
            total += sum(counts)
    return total
