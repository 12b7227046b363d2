"""Prepare token shards (infra/corpus.py does the work; the format and the loader: infra/shards.py).

    python data.py shakespeare --out=data/shakespeare                       # embedded, byte-level, offline
    python data.py fineweb --out=data/fineweb_edu_gpt2 --tokenizer=gpt2     # FineWeb-Edu, streamed
"""
import argparse
import json

from infra import cli
from infra.corpus import SHAKESPEARE_DIR, prepare_fineweb, prepare_shakespeare


def main(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(description="prepare token shards")
    sub = parser.add_subparsers(dest="corpus", required=True)
    p = sub.add_parser("shakespeare", help="the embedded byte-level corpus")
    p.add_argument("--out", default=SHAKESPEARE_DIR)
    p.add_argument("--n_val_docs", type=int, default=2)
    p = sub.add_parser("fineweb", help="FineWeb-Edu (or another text dataset) streamed from the hub")
    p.add_argument("--out", required=True)
    p.add_argument("--tokenizer", default="gpt2")
    p.add_argument("--tokenizer_path", default=None)
    p.add_argument("--dataset", default="HuggingFaceFW/fineweb-edu")
    p.add_argument("--name", default="sample-10BT")
    p.add_argument("--shard_tokens", type=int, default=100_000_000)
    p.add_argument("--max_tokens", type=int, default=None)
    p.add_argument("--val_docs", type=int, default=1000)
    args = vars(parser.parse_args(argv))
    corpus, out = args.pop("corpus"), args.pop("out")
    meta = prepare_shakespeare(out, **args) if corpus == "shakespeare" else prepare_fineweb(out, **args)
    print(json.dumps(meta, indent=2))
    return meta


if __name__ == "__main__":
    cli.run(main)
