"""The training loop's AdamW: torch's, with its fused step and the gradient clipping walking lists built once.

Every step, torch.optim.AdamW(fused=True) gathers each parameter's gradient and state again from dicts (its
_init_group: a Python loop with a dozen checks per parameter) and groups them by device and dtype, and
torch.nn.utils.clip_grad_norm_ groups the gradients twice more. At the 1044M depth (36 layers, about 400
parameter tensors) that is Python work per parameter that the GPU waits on at every step (meters.host). Here the
lists of parameters and of their state, grouped as torch groups them, are built once the state exists and kept;
a step reads only the gradients, then calls the same kernels with the same arguments in the same order as torch:
the same numbers bit for bit (tests/test_adamw.py); zero_grad drops the gradients along the same lists.

The lists are dropped whenever they could be stale: a load_state_dict (the state's tensors are new) or a new
parameter group. A step or a clipping on which some parameter has no gradient is torch's (which skips it).
Everything that is not a fused step (adamw="loop", amsgrad, a closure) is torch's own step.
"""
from __future__ import annotations

import torch
from torch import Tensor

Lists = tuple[list[Tensor], ...]


def grouped(lists: list[list[Tensor]]) -> list[Lists]:
    """Parallel lists split by the first list's (device, dtype), as torch's optimizers and clipping split them
    (same order of groups and of tensors within a group)."""
    split = torch.optim.Optimizer._group_tensors_by_device_and_dtype(lists)
    return [tuple(group) for group, _ in split.values()]


def gradients(params: list[Tensor]) -> list[Tensor] | None:
    """The parameters' gradients, or None when some parameter has none."""
    grads = [p.grad for p in params]
    return None if any(g is None for g in grads) else grads


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW; its fused step, zero_grad and clip_grad_norm from lists kept between steps (the module's
    doc)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._steps: list[tuple[dict, Lists]] | None = None     # per (param group, device, dtype): its lists
        self._clipped: list[list[Tensor]] | None = None          # every parameter, per (device, dtype)
        self.register_load_state_dict_post_hook(AdamW._forget)

    def _forget(self) -> None:
        self._steps = self._clipped = None

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        self._forget()

    def _fast(self) -> bool:
        """Whether a step is torch's fused one with nothing that needs its per-parameter walk."""
        d = self.defaults
        return bool(d["fused"]) and not (d["amsgrad"] or d["maximize"] or d["differentiable"]) and not any(
            isinstance(x, Tensor) for g in self.param_groups for x in (g["lr"], *g["betas"]))

    def _step_lists(self) -> list[tuple[dict, Lists]] | None:
        """(group, (params, exp_avgs, exp_avg_sqs, steps)) per param group and (device, dtype), once every
        parameter has its state (after torch's first step); None before."""
        if self._steps is None and all(p in self.state for g in self.param_groups for p in g["params"]):
            self._steps = [(group, lists) for group in self.param_groups for lists in grouped(
                [group["params"], *([self.state[p][k] for p in group["params"]]
                                    for k in ("exp_avg", "exp_avg_sq", "step"))])]
        return self._steps

    @torch.no_grad()
    def step(self, closure=None):
        steps = self._step_lists() if closure is None and self._fast() else None
        grads = steps and [gradients(params) for _, (params, *_) in steps]
        if not grads or any(g is None for g in grads):
            return super().step(closure)
        grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        for (group, (params, exp_avgs, exp_avg_sqs, state_steps)), group_grads in zip(steps, grads):
            beta1, beta2 = group["betas"]
            device = params[0].device
            torch._foreach_add_(state_steps, 1)       # torch's _fused_adam: the count first, undone when skipped
            torch._fused_adamw_(params, group_grads, exp_avgs, exp_avg_sqs, [], state_steps, amsgrad=False,
                                lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
                                eps=group["eps"], maximize=False,
                                grad_scale=None if grad_scale is None else grad_scale.to(device, non_blocking=True),
                                found_inf=None if found_inf is None else found_inf.to(device, non_blocking=True))
            if found_inf is not None:
                torch._foreach_sub_(state_steps, [found_inf.to(device, non_blocking=True)] * len(state_steps))
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's; with set_to_none, over the kept list once it exists (torch's walks the groups with checks per
        parameter: 101 against 32 µs for 400 tensors here)."""
        if not set_to_none or self._clipped is None:
            return super().zero_grad(set_to_none)
        for params in self._clipped:
            for p in params:
                p.grad = None

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float) -> Tensor:
        """torch.nn.utils.clip_grad_norm_(every parameter, max_norm, foreach=True) on the kept lists: the global
        2-norm of the gradients before clipping, then the gradients scaled by min(1, max_norm / (norm + 1e-6))."""
        if self._clipped is None:
            self._clipped = [params for params, in grouped([[p for g in self.param_groups for p in g["params"]]])]
        grads = [gradients(params) for params in self._clipped]
        if any(g is None for g in grads):
            params = [p for g in self.param_groups for p in g["params"]]
            return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        device = grads[0][0].device
        norms = [norm.to(device) for group in grads for norm in torch._foreach_norm(group, 2.0)]
        total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for group in grads:
            torch._foreach_mul_(group, coef.to(group[0].device))
        return total
