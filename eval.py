"""Evaluate checkpoints: perplexity, zero-shot lm-evaluation-harness tasks, routing analysis, samples.

    python eval.py out/tiny_delta_block                          # held-out loss, perplexity (bits per byte)
    python eval.py out/tiny_delta_block --data=some_text.txt     # ... on a text file or a shard directory
    python eval.py CKPT --tasks=hellaswag,arc_easy,arc_challenge,piqa,winogrande,boolq,mmlu,lambada_openai
    python eval.py out/tiny_attnres out/tiny_delta_block --routing --out=docs/routing_tiny
    python eval.py CKPT --sample "ROMEO:" --temperature=0.8 --top_k=40

CKPT is a checkpoint file that train.py writes, a sharded FSDP checkpoint folder (ckpt_*/ with meta.json), an
out_dir (its newest checkpoint), or a Hugging Face Qwen3 folder (pretrained weights, read by finetune.load_hf_qwen3). Perplexity and task results go to a JSON next to
the checkpoint (ckpt_0000600.eval.json; eval.json in a Qwen3 folder); the routing analysis writes OUT.json,
OUT_depth.png (max weight and normalised entropy by depth) and OUT_matrix.png (receiver x source).
"""
from __future__ import annotations

import argparse
import math
import os
from contextlib import nullcontext
from dataclasses import asdict

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

import checkpoint
import cli
import data
import files
import sample
import train
from tokenizer import get_tokenizer
from model import Model, ModelConfig
from router import depth_weights

try:  # lm-eval is an optional extra: only --tasks needs it, and HarnessLM works without it
    from lm_eval.api.model import LM as _HarnessBase
except ImportError:
    _HarnessBase = object

CHECKPOINT_KEYS = ("model", "model_config")


# ----------------------------------------------------------------------------------------------- loading

def resolve_checkpoint(path: str) -> str:
    """A checkpoint file, a sharded checkpoint directory (FSDP), a Hugging Face folder, or the newest
    checkpoint of an out_dir."""
    if os.path.isfile(os.path.join(path, "config.json")) or os.path.isfile(os.path.join(path, "meta.json")):
        return path
    if os.path.isdir(path):
        if not checkpoint.checkpoint_paths(path):
            raise FileNotFoundError(f"{path} is a directory without checkpoints (ckpt_*.pt)")
        return checkpoint.newest_intact(path)[0]
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint at {path} (expected a ckpt_*.pt file, an out_dir or a Qwen3 folder)")
    return path


def pick_device(name: str = "auto") -> torch.device:
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)


def load_model(path: str, device: torch.device | str = "cpu") -> tuple[Model, dict]:
    """(model in eval mode, the checkpoint dict with "path" added). Clear errors for other file formats."""
    path = resolve_checkpoint(path)
    if os.path.isfile(os.path.join(path, "config.json")):  # Hugging Face Qwen3; 2048: the paper's Qwen3 length
        import finetune
        model = finetune.load_hf_qwen3(path)
        ckpt = {"path": path, "hf_folder": path, "model_config": asdict(model.cfg), "train_config": {"seq_len": 2048}}
        return model.to(device).eval(), ckpt
    ckpt = checkpoint.load_checkpoint(path)
    missing = [k for k in CHECKPOINT_KEYS if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        found = sorted(ckpt)[:8] if isinstance(ckpt, dict) else type(ckpt).__name__
        raise ValueError(f"{path}: unknown checkpoint format, missing keys {missing} (found {found}); "
                         f"train.py writes a dict with keys {list(CHECKPOINT_KEYS)}, 'train_config', 'step'")
    unknown = set(ckpt["model_config"]) - ModelConfig.field_names()
    if unknown:
        raise ValueError(f"{path}: model_config has fields this model.py does not know: {sorted(unknown)}")
    model = Model(ModelConfig(**ckpt["model_config"]))
    model.load_state_dict(ckpt["model"])
    ckpt["path"] = path
    return model.to(device).eval(), ckpt


def run_data_dir(ckpt: dict) -> str:
    """The data directory the checkpoint was trained on (the embedded corpus is prepared if needed)."""
    name = ckpt.get("train_config", {}).get("data")
    if name is None:
        raise ValueError(f"{ckpt['path']} records no train_config['data']: pass --data")
    return train.data_dir(train.TrainConfig(data=name))


def run_tokenizer(ckpt: dict, model: Model):
    if "hf_folder" in ckpt:  # Qwen3's tokenizer ships with its weights
        path = os.path.join(ckpt["hf_folder"], "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} not found: copy Qwen3's tokenizer.json into {ckpt['hf_folder']}")
        return get_tokenizer("qwen3", path, model.cfg.vocab_size)
    meta = data.load_meta(run_data_dir(ckpt))
    return get_tokenizer(meta["tokenizer"], meta.get("tokenizer_path"), model.cfg.vocab_size)


def context_length(ckpt: dict) -> int:
    """The sequence length the model was trained with: the window for evaluation and sampling."""
    return int(ckpt.get("train_config", {}).get("seq_len", 1024))


def load_tokens(ckpt: dict, model: Model, path: str | None, split: str) -> tuple[list[np.ndarray], str]:
    """Token arrays (one per shard) of `split` of the run's data, a shard directory, or a text file -> (arrays,
    tokenizer name). Data made with another tokenizer, or with ids past the embedding, is an error."""
    if path is not None and os.path.isfile(path):
        tok = run_tokenizer(ckpt, model)
        with open(path, encoding="utf-8") as f:
            return [np.asarray(tok.encode(f.read()), dtype=np.int64)], tok.name
    directory = path or run_data_dir(ckpt)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"--data={directory}: neither a text file nor a shard directory")
    meta = data.load_meta(directory)
    if path is not None and ckpt.get("train_config", {}).get("data") is not None:
        trained = data.load_meta(run_data_dir(ckpt))["tokenizer"]
        if trained != meta["tokenizer"]:
            raise ValueError(f"{directory} was tokenised with {meta['tokenizer']!r} but the model was trained on "
                             f"{trained!r} tokens: the vocabularies do not match")
    data.check_vocab(meta, model.cfg.vocab_size)
    shards = sorted(p for p in os.listdir(directory) if p.startswith(f"{split}_") and p.endswith(".bin"))
    if not shards:
        raise FileNotFoundError(f"no {split}_*.bin shards in {directory}")
    return [data.read_shard(os.path.join(directory, p)) for p in shards], meta["tokenizer"]


# -------------------------------------------------------------------------------------------- perplexity

def windows(tokens: np.ndarray, seq_len: int) -> list[np.ndarray]:
    """Windows of up to seq_len + 1 tokens, consecutive ones sharing one token: each token but the first is a
    target exactly once (the last window may be shorter)."""
    return [tokens[s:s + seq_len + 1] for s in range(0, len(tokens) - 1, seq_len)]


@torch.no_grad()
def perplexity(model: Model, token_arrays: list[np.ndarray], seq_len: int, batch_size: int = 8,
               max_tokens: int | None = None, byte_level: bool = False) -> dict:
    """Mean token loss (nats) over every target of the arrays, its exp, and for the byte tokenizer bits per
    byte (the total loss in bits over the targets that are bytes; end-of-text is predicted but is no byte)."""
    device = next(model.parameters()).device
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    chunks = [w for arr in token_arrays for w in windows(np.asarray(arr), seq_len)]
    if max_tokens is not None:
        chunks = chunks[:max(1, max_tokens // seq_len)]
    if not chunks:
        raise ValueError("no tokens to evaluate: the data needs at least 2 tokens")
    total, n_targets, n_bytes = 0.0, 0, 0
    # Batches of equal-length windows; only a shard's last window can be shorter.
    groups: dict[int, list[np.ndarray]] = {}
    for w in chunks:
        groups.setdefault(len(w), []).append(w)
    batches = [g[i:i + batch_size] for g in groups.values() for i in range(0, len(g), batch_size)]
    for batch in tqdm(batches, desc="perplexity", unit="batch", disable=None):
        spans = torch.from_numpy(np.stack(batch).astype(np.int64)).to(device)    # (B, T+1)
        x, y = spans[:, :-1], spans[:, 1:]
        if int(spans.max()) >= model.cfg.vocab_size:
            raise ValueError(f"token id {int(spans.max())} is outside the model's vocab_size {model.cfg.vocab_size}")
        with autocast:
            logits = model(x)                                                       # (B, T, V)
        total += F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum").item()
        n_targets += y.numel()
        n_bytes += int((y < 256).sum())
    loss = total / n_targets
    out = {"loss": loss, "ppl": math.exp(loss), "tokens": n_targets}
    if byte_level:
        out["bits_per_byte"] = total / math.log(2) / n_bytes
    return out


# ----------------------------------------------------------------------------------- lm-evaluation-harness

class HarnessLM(_HarnessBase):
    """The lm-evaluation-harness LM interface over a Model and a data.py tokenizer.

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
                raise ValueError(f"a continuation has {len(cont)} tokens; 1..max_length={self.max_length} are allowed")
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
            temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample", False) else 0.0
            outputs.append(sample.complete(self.model, self.tok, context, [until] if isinstance(until, str) else until,
                                           int(kwargs.get("max_gen_toks", 256)), temperature, self.max_length))
        return outputs


def run_tasks(lm: HarnessLM, tasks: list[str], num_fewshot: int = 0, limit: int | None = None) -> dict:
    """Run lm-eval's evaluator -> {"results": lm-eval's per-task metrics, "average": the equal-weight mean of
    each requested task's accuracy (acc_norm where the task reports it, else acc), "table": printable}."""
    if _HarnessBase is object:
        raise ModuleNotFoundError("--tasks needs lm-evaluation-harness: pip install lm-eval")
    from lm_eval import evaluator
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import make_table

    files = [t for t in tasks if t.endswith((".yaml", ".yml"))]
    for f in files:
        if not os.path.isfile(f):
            raise FileNotFoundError(f"task file {f} not found")
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


# ---------------------------------------------------------------------------------------- routing analysis

def receiver_name(index: int, n_layers: int) -> str:
    """Receiver l < 2L is layer l // 2's attention (even) or MLP (odd); 2L is AttnRes's final read."""
    return "final" if index == 2 * n_layers else f"L{index // 2} {'attn' if index % 2 == 0 else 'mlp'}"


class RoutingRecorder:
    """The model's routing_observer: per receiver, the routing weights summed over every token seen.

    Weights are recomputed from the sources the receiver is about to read with router.depth_weights, the
    same function the reference routing uses; nothing in the forward pass is touched.
    """

    def __init__(self, model: Model):
        self.eps = model.cfg.norm_eps
        self.sums: dict[int, torch.Tensor] = {}        # receiver -> (N,) sum over tokens of a_i
        self.max_sums: dict[int, float] = {}           # receiver -> sum over tokens of max_i a_i
        self.entropy_sums: dict[int, float] = {}       # receiver -> sum over tokens of H(a) / log N
        self.tokens: dict[int, int] = {}

    @torch.no_grad()
    def __call__(self, index: int, sources: list[torch.Tensor], router) -> None:
        values = torch.stack(sources).float()                                          # (N, B, T, d)
        w = depth_weights(values, router.query.float(), router.norm_weight.float(), self.eps)  # (N, B, T)
        w = w.flatten(1).double()                                                      # (N, B*T)
        n = w.shape[0]
        entropy = -(w * w.clamp_min(1e-30).log()).sum(0) / math.log(max(n, 2))                # (B*T,)
        self.sums[index] = self.sums.get(index, 0) + w.sum(1).cpu()
        self.max_sums[index] = self.max_sums.get(index, 0.0) + w.max(0).values.sum().item()
        self.entropy_sums[index] = self.entropy_sums.get(index, 0.0) + entropy.sum().item()
        self.tokens[index] = self.tokens.get(index, 0) + w.shape[1]

    def summary(self, model: Model) -> list[dict]:
        """Per receiver: the mean weights over tokens and their max, normalised entropy H/log N (1 = uniform;
        None for a single source), and embedding weight, plus the per-token max and entropy averaged."""
        out = []
        for index in sorted(self.sums):
            mean = (self.sums[index] / self.tokens[index])                             # (N,) sums to 1
            n = mean.numel()
            entropy = -(mean * mean.clamp_min(1e-30).log()).sum().item() / math.log(n) if n > 1 else None
            out.append({"index": index, "name": receiver_name(index, model.cfg.n_layers), "n_sources": n,
                        "uniform": 1 / n, "null_source": model.policy.null_source, "weights": mean.tolist(),
                        "max_weight": mean.max().item(), "entropy": entropy, "embedding_weight": mean[0].item(),
                        "token_max_weight": self.max_sums[index] / self.tokens[index],
                        "token_entropy": self.entropy_sums[index] / self.tokens[index] if n > 1 else None})
        return out


@torch.no_grad()
def routing_analysis(model: Model, token_arrays: list[np.ndarray], seq_len: int, n_windows: int = 16,
                     batch_size: int = 8) -> dict:
    """Record routing weights over the first n_windows held-out windows. The means over receivers use those
    with at least two sources (a single source always gets weight 1)."""
    if model.policy.read == "none":
        raise ValueError(f"residual={model.cfg.residual!r} has no depth routing to analyse")
    chunks = [w for arr in token_arrays for w in windows(np.asarray(arr), seq_len) if len(w) == seq_len + 1]
    chunks = chunks[:n_windows]
    if not chunks:
        raise ValueError(f"the data has no window of {seq_len + 1} tokens to analyse")
    device = next(model.parameters()).device
    recorder = RoutingRecorder(model)
    model.routing_observer = recorder
    try:
        for i in tqdm(range(0, len(chunks), batch_size), desc="routing", unit="batch", disable=None):
            model(torch.from_numpy(np.stack(chunks[i:i + batch_size])[:, :-1].astype(np.int64)).to(device))
    finally:
        model.routing_observer = None
    receivers = recorder.summary(model)
    routed = [r for r in receivers if r["n_sources"] > 1]
    return {"residual": model.cfg.residual, "n_layers": model.cfg.n_layers, "tokens": len(chunks) * seq_len,
            "mean_max_weight": float(np.mean([r["max_weight"] for r in routed])),
            "mean_entropy": float(np.mean([r["entropy"] for r in routed])),
            "mean_embedding_weight": float(np.mean([r["embedding_weight"] for r in routed])),
            "receivers": receivers}


def plot_routing(runs: dict[str, dict], prefix: str) -> list[str]:
    """PNG plots for {label: routing_analysis(...)}, runs side by side on shared axes -> the file paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = [prefix + "_depth.png", prefix + "_matrix.png"]
    os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
    fig, (ax_max, ax_ent) = plt.subplots(1, 2, figsize=(12, 4.2), sharex=True)
    for (label, run), color in zip(runs.items(), plt.rcParams["axes.prop_cycle"].by_key()["color"]):
        rs = run["receivers"]
        x = [r["index"] for r in rs]
        ax_max.plot(x, [r["max_weight"] for r in rs], "o-", color=color, label=f"{label}: max of mean weights")
        ax_max.plot(x, [r["token_max_weight"] for r in rs], "--", color=color, alpha=0.6,
                    label=f"{label}: per-token max, averaged")
        ax_max.step(x, [r["uniform"] for r in rs], ":", where="mid", color=color, label=f"{label}: uniform 1/N")
        ax_ent.plot(x, [np.nan if r["entropy"] is None else r["entropy"] for r in rs], "o-", color=color, label=label)
    ax_ent.axhline(1.0, ls=":", color="gray", label="uniform")
    longest = max(runs.values(), key=lambda run: len(run["receivers"]))["receivers"]
    for ax in (ax_max, ax_ent):
        ax.set_xticks([r["index"] for r in longest], [r["name"] for r in longest], rotation=90, fontsize=7)
    ax_max.set(title="max routing weight", xlabel="receiving sublayer", ylim=(0, 1.05))
    ax_ent.set(title="normalised entropy H(a) / log N of the mean weights", xlabel="receiving sublayer",
               ylim=(0, 1.05))
    ax_max.legend(fontsize=7)
    ax_ent.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)

    n_rows = max(len(run["receivers"]) for run in runs.values())
    n_cols = max(r["n_sources"] for run in runs.values() for r in run["receivers"])
    fig, axes = plt.subplots(1, len(runs), figsize=(1.2 + 3.6 * len(runs), 0.5 + 0.3 * n_rows),
                             sharex=True, sharey=True, squeeze=False)
    for ax, (label, run) in zip(axes[0], runs.items()):
        matrix = np.full((n_rows, n_cols), np.nan)                   # (receivers, sources); NaN = no such source
        for row, r in enumerate(run["receivers"]):
            w = r["weights"]
            if r["null_source"]:                                     # the zero source goes to the last column
                matrix[row, :len(w) - 1], matrix[row, -1] = w[:-1], w[-1]
            else:
                matrix[row, :len(w)] = w
        image = ax.imshow(matrix, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        ax.set(title=f"{label} ({run['residual']})", xlabel="source (0 = embedding)")
    longest = max(runs.values(), key=lambda run: len(run["receivers"]))["receivers"]  # row l is receiver l
    axes[0][0].set_yticks(range(n_rows), [r["name"] for r in longest])
    axes[0][0].set_ylabel("receiving sublayer")
    fig.colorbar(image, ax=axes[0].tolist(), label="mean routing weight")
    fig.savefig(paths[1], dpi=120)
    plt.close(fig)
    return paths


# ------------------------------------------------------------------------------------------------ command

def _save_results(ckpt_path: str, key: str, value: dict) -> str:
    """Merge {key: value} into the JSON next to the checkpoint."""
    is_folder = os.path.isdir(ckpt_path)
    path = os.path.join(ckpt_path, "eval.json") if is_folder else os.path.splitext(ckpt_path)[0] + ".eval.json"
    results = files.read_json(path) if os.path.exists(path) else {}
    results[key] = value
    files.write_json(path, results, default=str)
    return path


def _label(path: str) -> str:
    """A run's name in plots: its out_dir, or the Hugging Face folder."""
    return os.path.basename(os.path.abspath(path) if os.path.isdir(path) else os.path.dirname(os.path.abspath(path)))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoints", nargs="+", help="checkpoint files or folders, out_dirs (newest checkpoint), Qwen3 folders")
    p.add_argument("--data", help="a shard directory or a text file (default: the run's held-out split)")
    p.add_argument("--split", default="val")
    p.add_argument("--seq_len", type=int, help="evaluation window (default: the run's training seq_len)")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--max_tokens", type=int, help="evaluate at most this many tokens")
    p.add_argument("--tasks", help="comma-separated lm-eval task names or task YAML files")
    p.add_argument("--num_fewshot", type=int, default=0)
    p.add_argument("--limit", type=int, help="at most this many documents per task")
    p.add_argument("--routing", action="store_true", help="routing analysis: JSON and PNG plots")
    p.add_argument("--routing_windows", type=int, default=16, help="held-out windows to record routing over")
    p.add_argument("--out", help="routing output prefix (default: <first out_dir>/routing)")
    p.add_argument("--sample", metavar="PROMPT", help="generate text after PROMPT")
    p.add_argument("--max_new_tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top_k", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    return p


def main(argv: list[str]) -> dict:
    args = _parser().parse_args(argv)
    device = pick_device(args.device)
    report: dict = {}
    for path in args.checkpoints:
        model, ckpt = load_model(path, device)
        seq_len = args.seq_len or context_length(ckpt)
        entry = report.setdefault(ckpt["path"], {})
        if args.sample is not None:
            entry["sample"] = sample.sample_text(model, run_tokenizer(ckpt, model), args.sample, args.max_new_tokens,
                                                 args.temperature, args.top_k, seq_len, seed=args.seed)
            print(f"--- {ckpt['path']}\n{entry['sample']}")
        if args.tasks:
            lm = HarnessLM(model, run_tokenizer(ckpt, model), seq_len, args.batch_size)
            tasks = run_tasks(lm, args.tasks.split(","), args.num_fewshot, args.limit)
            print(f"{ckpt['path']}\n{tasks['table']}\naverage ({', '.join(tasks['accuracy'])}): {tasks['average']}")
            entry["tasks"] = {k: v for k, v in tasks.items() if k != "table"}
            _save_results(ckpt["path"], "tasks", entry["tasks"])
        if args.routing:
            arrays, _ = load_tokens(ckpt, model, args.data, args.split)
            entry["routing"] = routing_analysis(model, arrays, seq_len, args.routing_windows, args.batch_size)
            entry["routing"]["checkpoint"] = ckpt["path"]
        if args.sample is None and not args.tasks and not args.routing:
            arrays, tokenizer = load_tokens(ckpt, model, args.data, args.split)
            result = perplexity(model, arrays, seq_len, args.batch_size, args.max_tokens, tokenizer == "byte")
            result.update(data=args.data or run_data_dir(ckpt), split=args.split, seq_len=seq_len)
            entry["perplexity"] = result
            bpb = f" | bits/byte {result['bits_per_byte']:.4f}" if "bits_per_byte" in result else ""
            print(f"{ckpt['path']}: loss {result['loss']:.4f} | ppl {result['ppl']:.3f}{bpb} | {result['tokens']:,} "
                  f"tokens -> {_save_results(ckpt['path'], 'perplexity', result)}")
    if args.routing:
        runs = {}
        for path, entry in report.items():
            runs[_label(path) if _label(path) not in runs else os.path.relpath(path)] = entry["routing"]
        prefix = args.out or os.path.join(os.path.dirname(next(iter(report))), "routing")
        plots = plot_routing(runs, prefix)
        files.write_json(prefix + ".json", runs)
        for label, run in runs.items():
            print(f"{label}: mean max weight {run['mean_max_weight']:.3f} | mean normalised entropy "
                  f"{run['mean_entropy']:.3f} | mean embedding weight {run['mean_embedding_weight']:.3f}")
        print("wrote", ", ".join([prefix + ".json"] + plots))
    return report


if __name__ == "__main__":
    cli.run(main)
