"""A Qwen3-like decoder whose sublayer loop asks a depth-routing policy (router.py) for each input.

Architecture (Qwen3): token embedding, pre-norm RMSNorm, RoPE, grouped-query attention with per-head
q/k RMSNorm applied before RoPE, SwiGLU MLP, no biases, optional tied embeddings. Parameter names and
shapes are those of a Hugging Face Qwen3 state dict without its "model." prefix, so checkpoints map one to
one; routers live in `routers.*` (one stacked tensor per kind: router.Routers), so a baseline state dict fills every
backbone weight of a routed model.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from router import (BLOCK_SOURCES, BLOCK_SPLITS, METHODS, SOURCES, DepthState, Routers, depth_route, make_policy,
                    rms_norm)

KERNELS = ("auto", "triton", "reference")
OUT_INITS = ("scaled", "plain")
GATED_QUERY_INIT_STD = 0.02  # the default query init with gate=True: the authors' Linear(d, 1) queries, N(0, 0.02)


def uses_kernel(kernel: str, device: torch.device) -> bool:
    """The one dispatch point between the Triton kernels (depth_kernels/) and the reference (router.py): "auto"
    uses the kernels for CUDA tensors and the reference elsewhere; "triton" and "reference" force either
    ("triton" on CPU needs TRITON_INTERPRET=1, which is how the tests run it)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}: allowed values are {', '.join(KERNELS)}")
    return device.type == "cuda" if kernel == "auto" else kernel == "triton"


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, device: torch.device) -> tuple[Tensor, Tensor]:
    """cos and signed sin of shape (T, head_dim), fp32, in Hugging Face's half-split layout; the sine's first half
    is negated, for apply_rope. Computed per forward (it is tiny) so a model built on the meta device needs no
    buffer re-initialisation."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    freqs = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)  # (T, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)                                                   # (T, hd)
    sin = emb.sin()
    return emb.cos(), torch.cat((-sin[:, :head_dim // 2], sin[:, head_dim // 2:]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """x (B, H, T, hd): rotate pairs (i, i + hd/2) by position-dependent angles, x cos + (-x2, x1) sin, with
    (-x2, x1) sin written as roll(x, hd/2) times the signed sine: the same values bit for bit, without a
    concatenation per call, for which a compiled graph makes two views a call on the host."""
    return (x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin).to(x.dtype)


class KVCache:
    """One attention layer's keys and values for the P positions seen so far, (B, Hkv, P, hd) each (sampling:
    sample.py). Depth routing needs no cache: a token's sources are values at its own position only."""

    def __init__(self):
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    @property
    def length(self) -> int:
        """P: the number of cached positions, which is where new positions start."""
        return 0 if self.k is None else self.k.shape[2]

    def extend(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append the new positions' k, v (B, Hkv, t, hd) -> every position's, (B, Hkv, P+t, hd) each."""
        if self.k is not None:
            k, v = torch.cat((self.k, k), dim=2), torch.cat((self.v, v), dim=2)
        self.k, self.v = k, v
        return k, v


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)  # per-head q/k norm, before RoPE
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], cache: KVCache | None = None) -> Tensor:
        """x (B, T, d), already normed -> (B, T, d). With a cache, x holds T new positions that follow its P
        cached ones (rope is for positions P..P+T-1), and their keys and values are appended to it."""
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.n_heads, self.head_dim)).transpose(1, 2)     # (B, H, T, hd)
        k = self.k_norm(self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim)).transpose(1, 2)  # (B, Hkv, T, hd)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)              # (B, Hkv, T, hd)
        cos, signed_sin = rope
        q, k = apply_rope(q, cos, signed_sin), apply_rope(k, cos, signed_sin)
        gqa = self.n_heads != self.n_kv_heads
        if cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            P = cache.length
            k, v = cache.extend(k, v)                                                           # (B, Hkv, P+T, hd)
            # New position i (absolute P + i) sees keys 0..P+i; SDPA's is_causal would align the mask top-left.
            mask = torch.arange(P + T, device=x.device) <= P + torch.arange(T, device=x.device)[:, None]  # (T, P+T)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.down_proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    """One transformer layer = two sublayers f_l (input_layernorm -> self_attn, post_attention_layernorm ->
    mlp). Each returns the output v_l that is added to the residual stream; the depth state decides what each
    one reads, and applies its pre-norm (so the kernel path can fuse the read with it)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, state: DepthState, rope: tuple[Tensor, Tensor], cache: KVCache | None = None) -> None:
        """Both sublayers, each as: x = n_l(h^_l), the pre-norm of its routed input (router.DepthState.input:
        h~_l, h~_l + r_l, h~_l + γ_l r_l or r_l); v_l = f_l(x); then the residual add h~_{l+1} = h~_l + v_l,
        from the stream h~_l and never from h^_l (state.add). The stream lives in `state`, which also files
        v_l into the routing sources."""
        x = state.input(self.input_layernorm)                  # (B, T, d)  n_l(h^_l)
        state.add(self.self_attn(x, rope, cache))              # h~_{l+1} = h~_l + attn(x)
        x = state.input(self.post_attention_layernorm)         # (B, T, d)  n_{l+1}(h^_{l+1})
        state.add(self.mlp(x))                                 # h~_{l+2} = h~_{l+1} + mlp(x)


class Model(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.policy = make_policy(cfg.residual, cfg.n_layers, cfg.n_blocks, cfg.block_source,
                                  cfg.include_partial, cfg.null_source, cfg.block_split, cfg.sources)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Routers sit at the root, not inside layers: they are tiny, and a block's reads may need the
        # queries of several layers at once (which per-layer sharding would hide).
        n_receivers = self.policy.n_receivers(2 * cfg.n_layers)
        self.routers = Routers(n_receivers, cfg.d_model, cfg.gate, cfg.query_std, cfg.learned_null)
        self.route = depth_route        # Eq. 1 on the reference path (the kernel path reads with depth_kernels/)
        self.routing_observer = None    # see router.DepthState; None costs nothing
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Normal(0, init_std) matrices; with out_init="scaled" the two projections that write into the stream
        at init_std / sqrt(2 L), so the stream's variance does not grow with depth ("plain": init_std, the
        authors' code); norms at one; routers last, as Routers says (so that a seed gives a routed model exactly
        the baseline's backbone)."""
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.n_layers) if self.cfg.out_init == "scaled" else std
        for name, p in self.named_parameters():
            if p.dim() == 2 and not name.startswith("routers."):
                writes_stream = name.endswith(("o_proj.weight", "down_proj.weight"))
                nn.init.normal_(p, mean=0.0, std=out_std if writes_stream else std)
        for m in self.modules():
            if isinstance(m, Routers):
                m.reset_parameters()
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

    def num_params(self) -> int:
        """Unique parameters (a tied embedding counted once), embedding included, as the paper counts."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: Tensor, cache: list[KVCache] | None = None) -> Tensor:
        """idx (B, T) int64 -> logits (B, T, vocab_size). cache: one KVCache per layer, for tokens idx that
        follow the cached positions (sampling); the cache grows by T."""
        h = self.embed_tokens(idx)                                              # (B, T, d)  e = h~_0
        start = cache[0].length if cache else 0                                 # absolute position of idx[:, 0]
        cos, signed_sin = rope_cos_sin(start + idx.shape[1], self.cfg.head_dim, self.cfg.rope_theta, idx.device)
        rope = cos[start:], signed_sin[start:]
        state = self.depth_state(h)                                             # holds the stream h~
        for i, layer in enumerate(self.layers):
            layer(state, rope, None if cache is None else cache[i])             # two reads, two residual adds
        return self.lm_head(state.output(self.norm))                            # final norm of h~ (or of a read)

    def depth_state(self, embedding: Tensor) -> DepthState:
        """The routing state of one forward pass: the reference, or the kernels' memory-lean state (the
        baseline has nothing to route and always takes the plain path)."""
        args = (self.policy, self.routers, embedding, self.route, self.cfg.norm_eps, self.routing_observer)
        if self.policy.read != "none" and uses_kernel(self.cfg.kernel, embedding.device):
            # lazily: Triton decides at import whether to interpret
            from depth_kernels.grouped_state import GroupedDepthState
            norms = [norm for layer in self.layers for norm in (layer.input_layernorm, layer.post_attention_layernorm)]
            return GroupedDepthState(*args, norms=norms + [self.norm])
        return DepthState(*args)


# ------------------------------------------------------------------------------ the configuration

@dataclass
class ModelConfig:
    vocab_size: int = 257
    d_model: int = 256
    n_layers: int = 8
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 64
    d_ff: int = 1024
    rope_theta: float = 1_000_000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    init_std: float = 0.02
    out_init: str = "scaled"            # "scaled": o_proj and down_proj at init_std / sqrt(2 L); "plain": every
                                        # matrix at init_std (the authors' code); Model.init_weights
    # depth routing (router.py)
    residual: str = "baseline"          # one of router.METHODS
    n_blocks: int = 4                   # blocks K for attnres / delta_block (docs/method.md, "Block counts")
    block_split: str = "even"           # attnres / delta_block (like n_blocks, ignored by the other methods): "even"
                                        # (block b starts at layer floor(b L / K)) or "ceil" (the authors' code:
                                        # blocks of ceil(L / K) layers); router.block_starts
    block_source: str = "boundary"      # delta_block: "boundary" (the stream's change across each block, the
                                        # default) or "paper" (the authors' computation exactly: router.make_policy)
    sources: str = "deltas"             # routed methods: "deltas" (changes of the stream: the five methods) or
                                        # "states" (the stream itself at each commit; router.Policy.sources)
    include_partial: bool = True        # delta_block, boundary sources: the current partial block is a source
                                        # (the paper's variant never has one)
    null_source: bool = False           # an extra null source per receiver
    learned_null: bool = False          # the null source is a learned vector per receiver (zero at init), not 0
    gate: bool = False                  # zero-init scalar gate per receiver: exact identity at init
    query_init_std: float | None = None  # routers' queries start at N(0, std); 0 = zero queries. None: 0 (as the
                                        # paper states), or GATED_QUERY_INIT_STD with gate=True (query_std)
    kernel: str = "auto"                # depth-routing implementation: one of KERNELS (see uses_kernel)

    def __post_init__(self):
        check_model_config(self)      # each field against its allowed values, then across fields (below)

    @property
    def query_std(self) -> float:
        """The routers' query init std: query_init_std, or its default (None) resolved, 0 or gated 0.02."""
        if self.query_init_std is not None:
            return self.query_init_std
        return GATED_QUERY_INIT_STD if self.gate else 0.0

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}


# ------------------------------------------------------------------------------ the configuration's checks

Rule = tuple[Callable[[object], bool], str]  # (test of a value, the allowed values in words)


def one_of(names: tuple[str, ...]) -> Rule:
    return (lambda v: v in names, ", ".join(names))


AT_LEAST_1: Rule = (lambda v: v >= 1, "integers >= 1")
NON_NEGATIVE: Rule = (lambda v: 0 <= v < math.inf, "finite numbers >= 0")  # `0 <= v` is False for NaN too
MODEL_RULES: dict[str, Rule] = {
    **{key: AT_LEAST_1 for key in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff")},
    "head_dim": (lambda v: v >= 2 and v % 2 == 0, "even integers >= 2 (RoPE rotates pairs of channels)"),
    "rope_theta": (lambda v: 0 < v < math.inf, "finite numbers > 0"), "norm_eps": NON_NEGATIVE,
    "init_std": NON_NEGATIVE, "out_init": one_of(OUT_INITS), "residual": one_of(METHODS), "kernel": one_of(KERNELS),
    "block_source": one_of(BLOCK_SOURCES), "sources": one_of(SOURCES), "block_split": one_of(BLOCK_SPLITS),
    "query_init_std": (lambda v: v is None or NON_NEGATIVE[0](v), f"a finite std >= 0, or None for the default "
                       f"(0, or {GATED_QUERY_INIT_STD} with gate=True)"),
}


def check_model_config(cfg: ModelConfig) -> None:
    """ModelConfig's checks: every field in MODEL_RULES, then the settings that do not fit together (_conflicts),
    then a ceil split's block count. A ValueError names the field, its value and what is allowed."""
    for key, (allowed, words) in MODEL_RULES.items():
        if not allowed(getattr(cfg, key)):
            raise ValueError(f"{key}={getattr(cfg, key)!r}: allowed values are {words}")
    for bad, message in _conflicts(cfg):
        if bad:
            raise ValueError(message)
    if cfg.block_split == "ceil" and cfg.residual in ("attnres", "delta_block"):
        _check_ceil_split(cfg)


def _conflicts(cfg: ModelConfig) -> list[tuple[bool, str]]:
    """The checks across fields, each (the settings do not fit, why), in the order they are reported."""
    blocked = cfg.residual in ("attnres", "delta_block")
    return [
        (cfg.sources == "states" and (cfg.residual == "baseline" or cfg.block_source == "paper"),
         "sources='states' needs a routed method and block_source='boundary' (the paper's variant is a "
         "construction of deltas of its own)"),
        (blocked and not 1 <= cfg.n_blocks <= cfg.n_layers, f"n_blocks={cfg.n_blocks}: allowed values are "
         f"1..n_layers={cfg.n_layers} (blocks are made of whole layers)"),
        (cfg.n_heads % cfg.n_kv_heads != 0,
         f"n_heads={cfg.n_heads} is not a multiple of n_kv_heads={cfg.n_kv_heads}"),
        (cfg.residual != "delta_block" and (cfg.block_source != "boundary" or not cfg.include_partial),
         f"block_source and include_partial choose Delta Block's sources; residual={cfg.residual!r} has no "
         "block deltas (use residual='delta_block')"),
        (cfg.residual == "baseline" and (cfg.gate or cfg.null_source or (cfg.query_init_std or 0) > 0),
         "gate, null_source and query_init_std need a routed method; residual='baseline' has no routing"),
        (cfg.learned_null and not cfg.null_source,
         "learned_null=True: the learned vector is the null source; set null_source=True too"),
        (cfg.gate and cfg.residual in ("attnres", "full_attnres"),
         f"gate=True is for additive routing (delta, delta_block); {cfg.residual!r} replaces the sublayer "
         "input, so a zero gate would feed it zeros"),
    ]


def _check_ceil_split(cfg: ModelConfig) -> None:
    """Blocks of ceil(L / K) layers can be fewer than K (12 layers, K = 5: 4 blocks of 3)."""
    size = -(-cfg.n_layers // cfg.n_blocks)
    made = -(-cfg.n_layers // size)
    if made != cfg.n_blocks:
        raise ValueError(f"n_blocks={cfg.n_blocks} with block_split='ceil' makes {made} blocks of "
                         f"ceil({cfg.n_layers}/{cfg.n_blocks}) = {size} layers; use block_split='even' or "
                         f"an n_blocks that ceil blocks reach exactly")
