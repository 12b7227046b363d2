"""infra.adamw.AdamW against torch's AdamW and clip_grad_norm_: the same numbers bit for bit, from kept lists."""
import copy

import pytest
import torch

from infra import adamw


def parameters(seed: int = 0) -> list[torch.nn.Parameter]:
    """Awkward parameters: two dtypes interleaved (so torch splits them into groups), odd sizes, a scalar."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (3,), (), (11, 2, 3), (5,), (2, 9)]
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.bfloat16, torch.float32, torch.float32]
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(d)) for s, d in zip(shapes, dtypes)]


def optimizers(fused: bool = True, **kwargs):
    """(torch's AdamW, ours) over equal parameters in two groups (decayed and not), equal settings."""
    made = []
    for cls in (torch.optim.AdamW, adamw.AdamW):
        p = parameters()
        groups = [{"params": p[::2], "weight_decay": 0.1}, {"params": p[1::2], "weight_decay": 0.0}]
        made.append(cls(groups, lr=3e-2, betas=(0.9, 0.95), eps=1e-8, fused=fused, **kwargs))
    return made


def params_of(opt) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def give_gradients(opt, step: int, scale: float = 1.0, missing: int | None = None) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for i, p in enumerate(params_of(opt)):
        p.grad = None if i == missing else (scale * torch.randn(p.shape, generator=g)).to(p.dtype)


def assert_same(ref, ours) -> None:
    for a, b in zip(params_of(ref), params_of(ours)):
        assert torch.equal(a, b)
        for key, value in ref.state[a].items():
            assert torch.equal(value, ours.state[b][key]), key


def step_both(ref, ours, step: int, max_norm: float, **gradient_kwargs) -> None:
    norms = []
    for opt in (ref, ours):
        give_gradients(opt, step, **gradient_kwargs)
        if isinstance(opt, adamw.AdamW):
            norms.append(opt.clip_grad_norm(max_norm))
        else:
            norms.append(torch.nn.utils.clip_grad_norm_(params_of(opt), max_norm, foreach=True))
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert all(p.grad is None for p in params_of(opt))
    assert torch.equal(*norms)
    assert_same(ref, ours)


@pytest.mark.parametrize("fused", [True, False])
def test_steps_and_clipping_equal_torchs_bit_for_bit(fused):
    ref, ours = optimizers(fused)
    for step in range(6):          # gradient norms from about 1 to 40: some clipped at 5, some not
        step_both(ref, ours, step, max_norm=5.0, scale=0.2 * 2 ** step)


def test_a_step_skipped_by_found_inf_and_one_with_a_grad_scale_equal_torchs():
    ref, ours = optimizers()
    step_both(ref, ours, 0, max_norm=1.0)
    for found_inf, grad_scale, step in ((1.0, None, 1), (0.0, 4.0, 2), (1.0, 2.0, 3), (0.0, None, 4)):
        for opt in (ref, ours):
            opt.found_inf = torch.tensor(found_inf)
            opt.grad_scale = None if grad_scale is None else torch.tensor(grad_scale)
        step_both(ref, ours, step, max_norm=1.0)
    assert ours.state[params_of(ours)[0]]["step"].item() == 3          # two of five steps skipped


def test_after_the_first_step_no_step_walks_the_parameters(monkeypatch):
    ref, ours = optimizers()
    for step in range(2):            # torch's step makes the state; the next keeps the lists
        step_both(ref, ours, step, max_norm=1.0)
    norms = {}
    for opt in (ref, ours):
        with monkeypatch.context() as patched:
            if opt is ours:          # torch's own step walks them: ours may not
                for cls, name in ((torch.optim.AdamW, "_init_group"),
                                  (torch.optim.Optimizer, "_group_tensors_by_device_and_dtype")):
                    patched.setattr(cls, name, walked)
            for step in range(2, 4):
                give_gradients(opt, step)
                norms[opt, step] = (opt.clip_grad_norm(1.0) if opt is ours else
                                    torch.nn.utils.clip_grad_norm_(params_of(opt), 1.0, foreach=True))
                opt.step()
    assert all(torch.equal(norms[ref, step], norms[ours, step]) for step in (2, 3))
    assert_same(ref, ours)


def walked(*args, **kwargs):
    raise AssertionError("the step gathered the parameters' state again")


def test_a_parameter_without_a_gradient_takes_torchs_step():
    ref, ours = optimizers()
    step_both(ref, ours, 0, max_norm=1.0)
    step_both(ref, ours, 1, max_norm=1.0, missing=2)     # torch skips that parameter; so do we
    step_both(ref, ours, 2, max_norm=1.0)


def test_a_loaded_state_is_the_one_the_next_steps_update():
    ref, ours = optimizers()
    for step in range(2):
        step_both(ref, ours, step, max_norm=1.0)
    donor, _ = optimizers()
    for step in range(3):                                # another history: other moments and step counts
        give_gradients(donor, 10 + step)
        donor.step()
    for opt in (ref, ours):          # a copy each: a loaded state may share the given tensors
        opt.load_state_dict(copy.deepcopy(donor.state_dict()))
    for step in range(2, 4):
        step_both(ref, ours, step, max_norm=1.0)


def test_zero_grad_without_set_to_none_zeroes_the_gradients():
    _, ours = optimizers()
    for step in range(2):                # the first step makes the state and the lists; the second uses them
        give_gradients(ours, step)
        ours.clip_grad_norm(1.0)
        ours.step()
    ours.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in params_of(ours))


def test_a_new_parameter_group_is_stepped():
    ref, ours = optimizers()
    step_both(ref, ours, 0, max_norm=1.0)
    for opt in (ref, ours):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(4))], "weight_decay": 0.0})
    for step in range(1, 3):
        step_both(ref, ours, step, max_norm=1.0)
