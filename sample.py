"""Sample from a trained model, with a KV cache (infra/generation.py).

    python sample.py out/tiny_delta_block --prompt="ROMEO:" --temperature=0.8 --top_k=40
    python eval.py out/tiny_delta_block --sample "ROMEO:"            # the same, from eval.py
"""
import argparse

from infra import cli, distributed, trained
from infra.generation import sample_text


def main(argv: list[str]) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="a checkpoint file or an out_dir (its newest ckpt_*.pt)")
    p.add_argument("--prompt", default="")
    p.add_argument("--max_new_tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top_k", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no_cache", action="store_true", help="recompute the whole window at every step")
    p.add_argument("--device", default="auto")
    args = p.parse_args(argv)
    model, ckpt = trained.load_model(args.checkpoint, distributed.pick_device(args.device))
    text = sample_text(model, trained.run_tokenizer(ckpt, model), args.prompt, args.max_new_tokens,
                       args.temperature, args.top_k, trained.context_length(ckpt), not args.no_cache, args.seed)
    print(text)
    return text


if __name__ == "__main__":
    cli.run(main)
