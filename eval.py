"""Evaluate checkpoints: perplexity, and the command for zero-shot lm-evaluation-harness tasks, routing
analysis and samples.

    python eval.py out/tiny_delta_block                          # held-out loss, perplexity (bits per byte)
    python eval.py out/tiny_delta_block --data=some_text.txt     # ... on a text file or a shard directory
    python eval.py CKPT --tasks=hellaswag,arc_easy,arc_challenge,piqa,winogrande,boolq,mmlu,lambada_openai
    python eval.py out/tiny_attnres out/tiny_delta_block --routing --out=results/redundancy/tiny
    python eval.py CKPT --sample "ROMEO:" --temperature=0.8 --top_k=40

CKPT is a checkpoint file that train.py writes, a sharded FSDP checkpoint folder (ckpt_*/ with meta.json), an
out_dir (its newest checkpoint), or a Hugging Face Qwen3 folder (infra/trained.py reads each). Perplexity and
task results go to a JSON next to the checkpoint (ckpt_0000600.eval.json; eval.json in a Qwen3 folder). Tasks
run through infra/lm_eval_adapter.py, the routing analysis is infra/routing_analysis.py's (it writes OUT.json,
OUT_depth.png, OUT_matrix.png, and the similarity of the sources' keys as deltas and as states,
OUT_similarity.png and OUT_similarity_matrix.png), samples are infra/generation.py's (as sample.py's).
"""
from __future__ import annotations

import argparse
import math
import os

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from infra import cli
from infra import distributed
from infra import files
from infra import generation
from infra import shards
from infra import trained
from infra.lm_eval_adapter import HarnessLM, run_tasks
from model import Model
from infra.routing_analysis import plot_routing, plot_similarity, routing_analysis


def load_tokens(ckpt: dict, model: Model, path: str | None, split: str) -> tuple[list[np.ndarray], str]:
    """Token arrays (one per shard) of `split` of the run's data, a shard directory, or a text file -> (arrays,
    tokenizer name). Data made with another tokenizer, or with ids past the embedding, is an error."""
    if path is not None and os.path.isfile(path):
        tok = trained.run_tokenizer(ckpt, model)
        with open(path, encoding="utf-8") as f:
            return [np.asarray(tok.encode(f.read()), dtype=np.int64)], tok.name
    directory = path or trained.run_data_dir(ckpt)
    if not os.path.isdir(directory):
        raise cli.NotFoundError(f"--data={directory}: neither a text file nor a shard directory")
    meta = shards.load_meta(directory, model.cfg.vocab_size)
    if path is not None and ckpt.get("train_config", {}).get("data") is not None:
        trained_on = shards.load_meta(trained.run_data_dir(ckpt), model.cfg.vocab_size)["tokenizer"]
        if trained_on != meta["tokenizer"]:
            raise shards.DataError(f"{directory} was tokenised with {meta['tokenizer']!r} but the model was "
                                   f"trained on {trained_on!r} tokens: the vocabularies do not match")
    shards.check_vocab(meta, model.cfg.vocab_size)
    names = sorted(p for p in os.listdir(directory) if p.startswith(f"{split}_") and p.endswith(".bin"))
    if not names:
        raise cli.NotFoundError(f"no {split}_*.bin shards in {directory}")
    return [shards.read_shard(os.path.join(directory, p)) for p in names], meta["tokenizer"]


@torch.no_grad()
def perplexity(model: Model, token_arrays: list[np.ndarray], seq_len: int, batch_size: int = 8,
               max_tokens: int | None = None, byte_level: bool = False) -> dict:
    """Mean token loss (nats) over every target of the arrays, its exp, and for the byte tokenizer bits per
    byte (the total loss in bits over the targets that are bytes; end-of-text is predicted but is no byte)."""
    device = next(model.parameters()).device
    chunks = [w for arr in token_arrays for w in shards.windows(np.asarray(arr), seq_len)]
    if max_tokens is not None:
        chunks = chunks[:max(1, max_tokens // seq_len)]
    if not chunks:
        raise shards.DataError("no tokens to evaluate: the data needs at least 2 tokens")
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
            raise shards.DataError(f"token id {int(spans.max())} is outside the model's vocab_size "
                                   f"{model.cfg.vocab_size}")
        with distributed.autocast(device):
            logits = model(x)                                                       # (B, T, V)
        total += F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum").item()
        n_targets += y.numel()
        n_bytes += int((y < 256).sum())
    loss = total / n_targets
    out = {"loss": loss, "ppl": math.exp(loss), "tokens": n_targets}
    if byte_level:
        out["bits_per_byte"] = total / math.log(2) / n_bytes
    return out


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
    p.add_argument("checkpoints", nargs="+",
                   help="checkpoint files or folders, out_dirs (newest checkpoint), Qwen3 folders")
    p.add_argument("--data", help="a shard directory or a text file (default: the run's held-out split)")
    p.add_argument("--split", default="val")
    p.add_argument("--seq_len", type=cli.positive_int, help="evaluation window (default: the run's training seq_len)")
    p.add_argument("--batch_size", type=cli.positive_int, default=8)
    p.add_argument("--max_tokens", type=cli.positive_int, help="evaluate at most this many tokens")
    p.add_argument("--tasks", help="comma-separated lm-eval task names or task YAML files")
    p.add_argument("--num_fewshot", type=int, default=0)
    p.add_argument("--limit", type=int, help="at most this many documents per task")
    p.add_argument("--routing", action="store_true", help="routing weights and source similarity: JSON, PNG")
    p.add_argument("--routing_windows", type=cli.positive_int, default=16,
                   help="held-out windows to record routing over")
    p.add_argument("--out", help="routing output prefix (default: <first out_dir>/routing)")
    p.add_argument("--sample", metavar="PROMPT", help="generate text after PROMPT")
    p.add_argument("--max_new_tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top_k", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    return p


def _perplexity(args: argparse.Namespace, model: Model, ckpt: dict, seq_len: int) -> dict:
    arrays, tokenizer = load_tokens(ckpt, model, args.data, args.split)
    result = perplexity(model, arrays, seq_len, args.batch_size, args.max_tokens, tokenizer == "byte")
    result.update(data=args.data or trained.run_data_dir(ckpt), split=args.split, seq_len=seq_len)
    bpb = f" | bits/byte {result['bits_per_byte']:.4f}" if "bits_per_byte" in result else ""
    print(f"{ckpt['path']}: loss {result['loss']:.4f} | ppl {result['ppl']:.3f}{bpb} | {result['tokens']:,} "
          f"tokens -> {_save_results(ckpt['path'], 'perplexity', result)}")
    return result


def _tasks(args: argparse.Namespace, model: Model, ckpt: dict, seq_len: int) -> dict:
    lm = HarnessLM(model, trained.run_tokenizer(ckpt, model), seq_len, args.batch_size)
    with cli.downloading(f"the datasets of the tasks {args.tasks} (lm-eval fetches them from the Hugging Face hub "
                         "once, then keeps them in its cache)", "run once with a network; perplexity needs none "
                         "(eval.py without --tasks)"):
        tasks = run_tasks(lm, args.tasks.split(","), args.num_fewshot, args.limit)
    print(f"{ckpt['path']}\n{tasks['table']}\naverage ({', '.join(tasks['accuracy'])}): {tasks['average']}")
    result = {k: v for k, v in tasks.items() if k != "table"}
    _save_results(ckpt["path"], "tasks", result)
    return result


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _write_routing(report: dict, out: str | None) -> None:
    """The routing analyses of every checkpoint: one JSON, the plots side by side, a line per run."""
    runs = {}
    for path, entry in report.items():
        runs[_label(path) if _label(path) not in runs else os.path.relpath(path)] = entry["routing"]
    prefix = out or os.path.join(os.path.dirname(next(iter(report))), "routing")
    plots = plot_routing(runs, prefix) + plot_similarity(runs, prefix)
    files.write_json(prefix + ".json", runs)
    for label, run in runs.items():  # per-token figures averaged over tokens, then over receivers
        print(f"{label}: max weight {run['mean_max_weight']:.3f} | normalised entropy {run['mean_entropy']:.3f} "
              f"(of the mean weights {run['mean_weights_entropy']:.3f}) | embedding weight "
              f"{run['mean_embedding_weight']:.3f} | key similarity deltas {_fmt(run['mean_similarity_deltas'])} "
              f"states {_fmt(run['mean_similarity_states'])}")
    print("wrote", ", ".join([prefix + ".json"] + plots))


def main(argv: list[str]) -> dict:
    """Per checkpoint: a sample, tasks and a routing analysis as asked, or else the perplexity."""
    args = _parser().parse_args(argv)
    device = distributed.pick_device(args.device)
    report: dict = {}
    for path in args.checkpoints:
        model, ckpt = trained.load_model(path, device)
        seq_len = args.seq_len or trained.context_length(ckpt)
        entry = report.setdefault(ckpt["path"], {})
        if args.sample is not None:
            entry["sample"] = generation.sample_text(model, trained.run_tokenizer(ckpt, model), args.sample,
                                                 args.max_new_tokens, args.temperature, args.top_k, seq_len,
                                                 seed=args.seed)
            print(f"--- {ckpt['path']}\n{entry['sample']}")
        if args.tasks:
            entry["tasks"] = _tasks(args, model, ckpt, seq_len)
        if args.routing:
            arrays, _ = load_tokens(ckpt, model, args.data, args.split)
            entry["routing"] = routing_analysis(model, arrays, seq_len, args.routing_windows, args.batch_size)
            entry["routing"]["checkpoint"] = ckpt["path"]
        if args.sample is None and not args.tasks and not args.routing:
            entry["perplexity"] = _perplexity(args, model, ckpt, seq_len)
    if args.routing:
        _write_routing(report, args.out)
    return report


if __name__ == "__main__":
    cli.run(main)
