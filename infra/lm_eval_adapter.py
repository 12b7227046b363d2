"""The lm-evaluation-harness adapter: Model and a tokenizer.py tokenizer behind lm-eval's LM interface, and
running tasks through lm-eval's evaluator (eval.py --tasks).

lm-eval is an optional dependency: only running tasks needs it. Without it HarnessLM is a plain class (its
scoring and generation still work), and run_tasks says how to install it.
"""
from __future__ import annotations

import os

import torch
from tqdm import tqdm

from infra import cli
from infra import generation
from model import Model

try:  # lm-eval is optional: only --tasks needs it, and HarnessLM works without it
    from lm_eval.api.model import LM as _HarnessBase
except ImportError:
    _HarnessBase = object


class HarnessLM(_HarnessBase):
    """The lm-evaluation-harness LM interface over a Model and an infra/tokenizer.py tokenizer.

    Requests are scored in batches of similar length. An input longer than max_length keeps its right end
    (the continuation and the context nearest to it). Generation is greedy unless a request asks for a
    temperature, one request at a time with the KV cache (padding would shift positions: the model has no
    attention mask).
    """

    def __init__(self, model: Model, tokenizer, max_length: int, batch_size: int = 16):
        super().__init__()
        self.model, self.tok, self.max_length, self.batch_size = model, tokenizer, max_length, batch_size
        self.model_device = next(model.parameters()).device

    def _pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        # Trailing spaces of the context belong to the continuation (as lm-eval's HF model does): BPE tokenisers
        # merge a space with the following word. The continuation's tokens are those of the whole string past
        # the context's, so a merge across the boundary is not double counted.
        n = len(context) - len(context.rstrip())
        context, continuation = context[:len(context) - n], context[len(context) - n:] + continuation
        whole = self.tok.encode(context + continuation)
        ctx = self.tok.encode(context)
        return (ctx or [self.tok.eot]), whole[len(ctx):]

    @torch.no_grad()
    def score(self, pairs: list[tuple[list[int], list[int]]], desc: str = "loglikelihood") -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), whether every continuation token is the argmax) per pair."""
        for ctx, cont in pairs:
            if not cont or len(cont) > self.max_length:
                raise cli.UsageError(f"a continuation has {len(cont)} tokens; 1..max_length={self.max_length} are "
                                     "allowed (a longer --seq_len allows more)")
        order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0]) - len(pairs[i][1]))  # longest first
        results: list[tuple[float, bool]] = [(0.0, False)] * len(pairs)
        batches = [order[i:i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        for batch in tqdm(batches, desc=desc, unit="batch", disable=None):
            inputs = [(pairs[i][0] + pairs[i][1])[-(self.max_length + 1):-1] for i in batch]  # left-truncated
            width = max(len(s) for s in inputs)
            x = torch.zeros(len(batch), width, dtype=torch.long, device=self.model_device)
            for row, s in enumerate(inputs):
                x[row, :len(s)] = torch.tensor(s)          # right padding: causal, so earlier positions are exact
            logits = self.model(x)                          # (B, W, V)
            for row, i in enumerate(batch):
                cont, end = pairs[i][1], len(inputs[row])
                logp = logits[row, end - len(cont):end].float().log_softmax(-1)           # (n_cont, V)
                target = torch.tensor(cont, device=self.model_device)
                ll = logp.gather(-1, target[:, None]).sum().item()
                results[i] = (ll, bool((logp.argmax(-1) == target).all()))
        return results

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        return self.score([self._pair(*r.args) for r in requests])

    def loglikelihood_rolling(self, requests) -> list[float]:
        """Total log-likelihood of each string in disjoint windows of max_length predictions, the first one
        conditioned on eot and each later one on the token just before it (lm-eval's convention)."""
        pairs, owner = [], []
        for n, r in enumerate(requests):
            tokens = [self.tok.eot] + self.tok.encode(r.args[0])
            for s in range(1, len(tokens), self.max_length):
                pairs.append(([tokens[s - 1]], tokens[s:s + self.max_length]))
                owner.append(n)
        totals = [0.0] * len(requests)
        for n, (ll, _) in zip(owner, self.score(pairs, desc="loglikelihood_rolling")):
            totals[n] += ll
        return totals

    def generate_until(self, requests) -> list[str]:
        outputs = []
        for r in tqdm(requests, desc="generate_until", unit="request", disable=None):
            context, kwargs = r.args
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else until
            temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample", False) else 0.0
            max_new_tokens = int(kwargs.get("max_gen_toks", 256))
            outputs.append(generation.complete(self.model, self.tok, context, until, max_new_tokens, temperature,
                                               self.max_length))
        return outputs


def run_tasks(lm: HarnessLM, tasks: list[str], num_fewshot: int = 0, limit: int | None = None) -> dict:
    """Run lm-eval's evaluator -> {"results": lm-eval's per-task metrics, "average": the equal-weight mean of
    each requested task's accuracy (acc_norm where the task reports it, else acc), "table": printable}."""
    if _HarnessBase is object:
        raise cli.MissingPackageError("--tasks needs lm-evaluation-harness: pip install lm-eval")
    # Imported here: lm-eval is optional (checked above), and its evaluator takes seconds to import.
    from lm_eval import evaluator
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import make_table

    files = [t for t in tasks if t.endswith((".yaml", ".yml"))]
    for f in files:
        if not os.path.isfile(f):
            raise cli.NotFoundError(f"task file {f} not found")
    # Task files only: skip indexing lm-eval's hundreds of built-in tasks.
    manager = TaskManager(include_path=sorted({os.path.dirname(os.path.abspath(f)) for f in files}) or None,
                          include_defaults=len(files) < len(tasks))
    out = evaluator.simple_evaluate(model=lm, tasks=tasks, num_fewshot=num_fewshot, limit=limit,
                                    task_manager=manager, log_samples=False, bootstrap_iters=1000)
    # The requested tasks and groups are the results that are no group's subtask (MMLU reports both).
    children = {c for subtasks in out.get("group_subtasks", {}).values() for c in subtasks}
    accuracy = {name: m.get("acc_norm,none", m.get("acc,none")) for name, m in out["results"].items()
                if name not in children}
    accuracy = {name: value for name, value in accuracy.items() if isinstance(value, (int, float))}
    average = sum(accuracy.values()) / len(accuracy) if accuracy else None
    return {"results": out["results"], "accuracy": accuracy, "average": average, "table": make_table(out)}
