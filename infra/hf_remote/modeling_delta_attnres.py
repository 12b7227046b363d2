"""A depth-routed Qwen3-like model (Delta Block, Delta AttnRes, AttnRes, Full AttnRes) for Hugging Face
transformers, as exported from the Delta Attention Residuals repository.

Load it with remote code, since transformers has no such architecture of its own:

    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)

`model.py` and `router.py` beside this file are the repository's own (the network and the reference routing:
plain PyTorch, no Triton); this file adapts them to transformers' interfaces. `config.json`'s `model_config`
holds the repository's model configuration. Generation recomputes the whole prefix at each token (no key-value
cache); inputs may be padded on the right only.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from .model import Model, ModelConfig


class DeltaAttnResConfig(PretrainedConfig):
    model_type = "delta_attnres"

    def __init__(self, model_config: dict | None = None, max_position_embeddings: int = 4096, **kwargs):
        self.model_config = dict(model_config or {})
        self.max_position_embeddings = max_position_embeddings
        cfg = self.model_config
        # the usual names, which tools read (lm-eval, generation)
        self.vocab_size = cfg.get("vocab_size")
        self.hidden_size = cfg.get("d_model")
        self.num_hidden_layers = cfg.get("n_layers")
        self.num_attention_heads = cfg.get("n_heads")
        kwargs["tie_word_embeddings"] = cfg.get("tie_embeddings", False)
        super().__init__(**kwargs)


class DeltaAttnResForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = DeltaAttnResConfig
    base_model_prefix = "model"
    _no_split_modules = ["Layer"]
    _tied_weights_keys = {"model.lm_head.weight": "model.embed_tokens.weight"}   # with tie_word_embeddings

    def __init__(self, config: DeltaAttnResConfig):
        super().__init__(config)
        # the reference routing path: the Triton kernels are not part of an exported model
        self.model = Model(ModelConfig(**{**config.model_config, "kernel": "reference"}))
        self.post_init()

    def _init_weights(self, module: torch.nn.Module) -> None:
        """Model initialises itself; every weight is then read from the checkpoint."""

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.model.lm_head

    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                labels: torch.LongTensor | None = None, **kwargs) -> CausalLMOutput:
        """input_ids (B, T) -> logits (B, T, vocab); with labels, the mean next-token loss (-100 ignored)."""
        if attention_mask is not None and bool((attention_mask[:, 1:] > attention_mask[:, :-1]).any()):
            raise ValueError("attention_mask pads on the left: this model attends over the whole causal prefix, so "
                             "pad on the right (tokenizer.padding_side = 'right')")
        logits = self.model(input_ids)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)
