"""Sampling from a trained model, with a KV cache (the command: sample.py; eval.py --sample and the lm-eval
adapter's generation use it too).

Depth routing needs no cache of its own: a token's sources (the embedding, earlier sublayer outputs, block
sums) are values at that token's position only, so the new token's sources are computed in its own forward.
Only sequence attention looks at earlier positions, and for that the usual per-layer K/V cache suffices:
Model.forward takes one (model.KVCache per layer) and then runs only the new positions.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from infra import cli
from model import KVCache, Model


def next_token(logits: Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None) -> Tensor:
    """logits (B, V) -> (B, 1): argmax at temperature 0, else a sample from the top_k tokens' softmax."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]                # (B, 1) the k-th largest
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)


@torch.no_grad()
def generate(model: Model, idx: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
             context: int = 1024, use_cache: bool = True, generator: torch.Generator | None = None) -> Iterator[Tensor]:
    """Yield max_new_tokens tokens (B, 1), one at a time, after the prompt idx (B, T).

    The model sees at most `context` tokens. Without the cache every step re-reads the last `context`
    tokens (nanoGPT's crop). With it, a full window is rebuilt from its newer half, so positions stay
    within the length the model was trained on and a rebuild happens once every context // 2 tokens.
    """
    if temperature < 0 or (top_k is not None and top_k < 1) or context < 2:
        raise cli.UsageError(f"need temperature >= 0, top_k >= 1 and context >= 2; got {temperature}, {top_k}, "
                             f"{context}")
    model.eval()
    cache = pending = None                                                     # pending: tokens not yet cached
    for _ in range(max_new_tokens):
        if not use_cache:
            logits = model(idx[:, -context:])
        else:
            if cache is None:
                cache, pending = [KVCache() for _ in model.layers], idx[:, -context:]
            elif cache[0].length + 1 > context:
                cache, pending = [KVCache() for _ in model.layers], idx[:, -(context // 2):]
            logits = model(pending, cache)
        token = next_token(logits[:, -1], temperature, top_k, generator)       # (B, 1)
        idx, pending = torch.cat((idx, token), dim=1), token
        yield token


def sample_text(model: Model, tokenizer, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8,
                top_k: int | None = 40, context: int = 1024, use_cache: bool = True, seed: int = 0) -> str:
    """The prompt followed by max_new_tokens sampled tokens, decoded. An empty prompt starts from eot."""
    device = next(model.parameters()).device
    ids = tokenizer.encode(prompt) or [tokenizer.eot]
    if max(ids) >= model.cfg.vocab_size:
        raise cli.UserError(f"tokenizer {tokenizer.name!r} produced id {max(ids)} but the model's vocab_size is "
                            f"{model.cfg.vocab_size}")
    generator = torch.Generator(device=device).manual_seed(seed)
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    out = [t.item() for t in generate(model, idx, max_new_tokens, temperature, top_k, context, use_cache, generator)]
    return prompt + tokenizer.decode(out)


def complete(model: Model, tokenizer, context: str, until: list[str], max_new_tokens: int,
             temperature: float = 0.0, max_context: int = 1024) -> str:
    """The text generated after `context` (greedy at temperature 0), up to the first stop string or eot."""
    device = next(model.parameters()).device
    idx = torch.tensor([(tokenizer.encode(context) or [tokenizer.eot])[-max_context:]], dtype=torch.long, device=device)
    new: list[int] = []
    text = ""
    for token in generate(model, idx, max_new_tokens, temperature, context=max_context):
        if token.item() == tokenizer.eot:
            break
        new.append(token.item())
        text = tokenizer.decode(new)
        if any(u in text for u in until):
            break
    for u in until:
        text = text.split(u)[0]
    return text
