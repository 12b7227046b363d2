"""Whole-run properties of the kernel path (depth_kernels/grouped_state.py), not one call's: trained for several
optimizer steps with every method and option, nothing of a step outlives it (live tensor bytes are flat from
step to step, and no gradient bank or group of an earlier step is alive), also when a step is skipped or a
forward is abandoned before its backward. A reference cycle through an autograd node is never collected: one
such cycle keeps a step's sources, accumulators and tables alive for good, which a single forward and backward
cannot show."""
import gc
import os
import warnings

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"   # must be set before triton decorates the kernels

import pytest  # noqa: E402

from infra import distributed  # noqa: E402
from depth_kernels import grouped_state  # noqa: E402
from depth_kernels.groups import GradBank, Group  # noqa: E402
from model import Model, ModelConfig  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SMALL = dict(vocab_size=64, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=32, n_blocks=2)
STEPS = 4

# (id, ModelConfig overrides, how each step runs): every method, and each router and block option
CASES = [
    ("attnres", dict(residual="attnres"), {}),
    ("full_attnres-null", dict(residual="full_attnres", null_source=True), {}),
    ("delta-gate-learned_null", dict(residual="delta", gate=True, null_source=True, learned_null=True), {}),
    ("delta_block-boundary", dict(residual="delta_block"), {}),
    ("delta_block-paper-null", dict(residual="delta_block", block_source="paper", null_source=True), {}),
    ("delta_block-one_block-gate", dict(residual="delta_block", n_blocks=1, gate=True), {}),
    ("delta_block-accumulation", dict(residual="delta_block"), dict(micro_steps=2)),
    ("delta-checkpointing", dict(residual="delta"), dict(checkpointing=True)),
    ("delta_block-skipped_step", dict(residual="delta_block", null_source=True), dict(skip_at=2)),
    ("attnres-abandoned_forward", dict(residual="attnres"), dict(abandon_at=2)),
]


def live_objects(kind: type | tuple[type, ...], collect: bool = True) -> list:
    """Every object of `kind` the garbage collector tracks, after a collection (or before any: then what is
    in unreachable cycles counts too)."""
    if collect:
        gc.collect()
    with warnings.catch_warnings():      # isinstance on torch's deprecated aliases warns
        warnings.simplefilter("ignore")
        return [obj for obj in gc.get_objects() if _is(obj, kind)]


def _is(obj, kind) -> bool:
    """isinstance, False for a weak proxy whose object is gone (an earlier test's compiler leaves some)."""
    try:
        return isinstance(obj, kind)
    except ReferenceError:
        return False


def live_tensor_bytes() -> int:
    """Bytes of the distinct storages behind every tensor the garbage collector can reach. Tensors with no
    memory of their own (a compiler's fake tensors, which an earlier test's torch.compile may leave in torch's
    caches; meta tensors) are not a step's and are left out."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor
    real = [t for t in live_objects(torch.Tensor)
            if not isinstance(t, (FakeTensor, FunctionalTensor)) and t.device.type != "meta"]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in real}
    return sum(storages.values())


def live_routing_state() -> int:
    """How many gradient banks and groups (one forward pass's routing state) exist, uncollected: counted
    before the collector runs, so a state that only a collection would free (a cycle) counts."""
    return len(live_objects((GradBank, Group), collect=False))


def train_steps(overrides: dict, micro_steps: int = 1, checkpointing: bool = False, skip_at: int = -1,
                abandon_at: int = -1) -> tuple[list[int], list[int], list[float]]:
    """STEPS optimizer steps through the kernel path -> live bytes and routing states after each, and the losses.
    skip_at: that step's loss is non-finite and its update is skipped (as train.py does); abandon_at: that
    step raises between forward and backward, and the next step goes on."""
    gc.collect()      # what earlier tests left in cycles (a failed test's traceback holds its model) is not ours
    torch.manual_seed(0)
    model = Model(ModelConfig(**{**SMALL, **overrides}, kernel="triton")).to(DEVICE)
    if checkpointing:
        distributed.checkpoint_activations(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx = torch.randint(0, SMALL["vocab_size"], (1, 5), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    live, states, losses = [], [], []
    for step in range(STEPS):
        try:
            for _ in range(micro_steps):
                loss = torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
                if step == skip_at:
                    loss = loss * float("nan")
                if step == abandon_at:
                    raise KeyboardInterrupt       # what a signal between forward and backward looks like
                (loss / micro_steps).backward()
            losses.append(loss.item())
            if all(p.grad is None or p.grad.isfinite().all() for p in model.parameters()):
                optimizer.step()
        except KeyboardInterrupt:
            pass
        optimizer.zero_grad(set_to_none=True)
        loss = None
        states.append(live_routing_state())
        live.append(live_tensor_bytes())
    return live, states, losses


@pytest.mark.parametrize("overrides, how", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_nothing_outlives_its_step(overrides, how):
    live, states, losses = train_steps(overrides, **how)
    # The first step makes AdamW's states; from then on every step must leave exactly what it found.
    assert live[1:] == [live[1]] * (STEPS - 1), f"live tensor bytes after each step: {live}"
    assert states == [0] * STEPS, f"gradient banks and groups alive after each step: {states}"
    assert len(losses) == STEPS - ("abandon_at" in how)


def test_the_check_sees_a_cycle_through_the_graph(monkeypatch):
    """The same measurement finds the leak this file guards against: a bank that holds its sources, in nodes
    that keep their bank after their backward. Every node holds the bank, and a later source's graph leads back
    to those nodes: a cycle through the graph, which keeps every step alive."""
    add = GradBank.add

    def add_and_hold(bank, source):
        bank.__dict__.setdefault("held", []).append(source)
        add(bank, source)
    monkeypatch.setattr(GradBank, "add", add_and_hold)
    monkeypatch.setattr(grouped_state, "_take", lambda ctx: ctx.held)   # kept, not removed
    live, states, _ = train_steps(dict(residual="delta_block"))
    assert live[1] < live[2] < live[3] and states[1] < states[2] < states[3], (live, states)


def test_a_compiled_whole_model_breaks_at_the_reads_and_trains_as_eager():
    """torch.compile around the whole model (not the per-sublayer compile train.py does): the kernel path's
    reads run outside the traced graphs, and three steps give the eager losses bit for bit."""
    import torch._dynamo
    losses = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = Model(ModelConfig(**SMALL, residual="delta_block", gate=True, kernel="triton")).to(DEVICE)
        forward = torch.compile(model, backend="aot_eager") if compiled else model
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        idx = torch.randint(0, SMALL["vocab_size"], (1, 5), generator=torch.Generator().manual_seed(0)).to(DEVICE)
        losses.append([])
        for _ in range(3):
            loss = torch.nn.functional.cross_entropy(forward(idx).flatten(0, 1), idx.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses[-1].append(loss.item())
    torch._dynamo.reset()
    assert losses[1] == losses[0] and losses[0][-1] < losses[0][0]
