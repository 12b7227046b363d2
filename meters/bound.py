"""The fewest bytes per token a training step must move for depth routing, per method: a lower bound beside what
meters/traffic.py counts today.

Counted against the baseline with a fused pre-norm (the paper configs compile the norms): every receiver's read
is fused into its sublayer's pre-norm, which reads the stream h~ and writes the norm's output forward, and reads
them and dy and writes dx backward, as the baseline's norm does; so the read itself adds nothing there. What no
schedule of this computation can avoid, in the dtypes train.py uses (meters/traffic.py's REGIMES):

- each committed source is read at least once forward (its logit and its share of every read that uses it), and
  at least once backward (its gradient needs it again: dz_i = a_i (go . s_i - D)), where its routing gradient is
  written once, in its dtype: 3 x its bytes in all;
- a receiver that reads the partial block h~_l - h~_tau of an fp32 stream must read the block's base h~_tau
  forward and again backward (the partial is the difference of two fp32 tensors: a bf16 copy of either would
  change the numerics; keeping the partial itself costs more), and the partial's gradient, which the base must
  receive with a minus sign (the +dp_l reaching h~_l flows back to h~_tau through the residual additions and
  cancels there), must wait in memory from receiver l's backward to the base's: written once and read once, in
  the dtype the kernels hand gradients over in (the sources', as every sublayer output's gradient is: bf16 under
  autocast): 2 x 4d + 2 x 2d bytes in all;
- nothing else: the read-outs, their logits and softmax state are recomputable from the sources in registers, and
  the queries' and norm weights' gradients are (d,) reductions.

It is a bound, not a design: it lets every receiver of a step read every source it needs in one pass, which a
forward pass cannot do (a receiver's input exists only after the sublayer before it has run), so the bytes
above it belong to the grouped schedule (depth_kernels/group_read.py): phase 1's state handed to each receiver, go and
D handed back, and each later group reading the committed sources and their gradient accumulators again.

The floor adds what any schedule that runs the forward pass in order must move besides (`handoffs`). A receiver l
that reads k >= 2 committed sources needs, when its turn comes, r_C = sum over them of a_il s_i: no on-chip memory
keeps anything across the sublayers that run between, so it either reads the k sources (k rows) or reads r_C (or
anything d wide it is made from) that an earlier pass wrote (2 rows: written, read): at least 2 rows. Its backward
needs its r again (the norm's input h~ + g r and D = go . r; the baseline's norm reads h~ alone): at least 1 row
(r_C read again, or r saved: 2). And the sources' gradients need its go: either its backward reads the k sources
and reads and writes their accumulators (3k rows), or it hands go to a later pass (2 rows: written, read): at
least 2. So 5 rows of d values in the dtype gradients and read-outs are handed over in (bf16 under autocast) per
such receiver; a receiver with one committed source is left out (its reads may be the bound's own).
"""
from __future__ import annotations

import torch

from model import ModelConfig
from router import make_policy


def _walk(cfg: ModelConfig) -> tuple[int, int, int]:
    """(committed sources, receivers that read the partial block, receivers that read 2 or more committed
    sources) of one forward pass of cfg's policy."""
    policy = make_policy(cfg.residual, cfg.n_layers, cfg.n_blocks, cfg.block_source, cfg.include_partial,
                         cfg.null_source, cfg.block_split, cfg.sources)
    committed, partial_readers, has_partial, handoffs = 1, 0, False, 0     # e is the first source
    n = 2 * cfg.n_layers
    for l in range(n + int(policy.final_read)):
        boundary = l < n and l in policy.boundaries
        if boundary and has_partial and not policy.commit_after_read:
            committed, has_partial = committed + 1, False
        reads = policy.read != "none" and l >= policy.reads_from
        if reads and has_partial and policy.include_partial and policy.sources == "deltas" \
                and policy.block_source == "boundary":
            partial_readers += 1
        handoffs += reads and committed >= 2
        if boundary and has_partial and policy.commit_after_read:
            committed, has_partial = committed + 1, False
        has_partial = has_partial or (l < n and policy.read != "none")
    return committed, partial_readers, handoffs


def lower_bound(cfg: ModelConfig, param_dtype: torch.dtype = torch.float32,
                output_dtype: torch.dtype = torch.bfloat16) -> dict[str, float]:
    """{"sources", "partial", "bytes_per_token"}: the bound's two terms and their sum, in bytes per token, for a
    step whose embedding and stream are param_dtype and whose sublayer outputs are output_dtype; and "handoffs",
    "floor": the hand-offs any in-order schedule adds (the module docstring) and bound + hand-offs."""
    if cfg.residual == "baseline":
        return {"sources": 0.0, "partial": 0.0, "bytes_per_token": 0.0, "handoffs": 0.0, "floor": 0.0}
    committed, partial_readers, handoff_readers = _walk(cfg)
    d, stream = cfg.d_model, torch.empty(0, dtype=param_dtype).element_size()
    source = stream if cfg.sources == "states" or cfg.block_source == "paper" else \
        torch.empty(0, dtype=output_dtype).element_size()
    sources = 3 * d * (stream + (committed - 1) * source)       # e, then the committed deltas or states
    handed = torch.empty(0, dtype=output_dtype).element_size()  # the dtype gradients are handed over in
    partial = 2 * d * (stream + handed) * partial_readers        # the base twice; its gradient written and read
    handoffs = 5 * d * handed * handoff_readers                   # r_C in, r again, go out: 5 rows
    return {"sources": float(sources), "partial": float(partial), "bytes_per_token": float(sources + partial),
            "handoffs": float(handoffs), "floor": float(sources + partial + handoffs)}
