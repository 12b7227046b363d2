"""Every method leaves the repository as a Hugging Face folder (infra/hf_export.py): routed models with their
own modeling code, loaded by transformers with trust_remote_code, giving the repository's logits, generating,
and scored by lm-eval's own `hf` backend; nothing is downloaded (tiny models, a tokenizer trained here)."""
import os

import pytest
import torch

from infra import hf_export
from infra.hf_qwen3 import load_hf_qwen3
from tests.tiny_qwen3 import ckpts, corpus, tokens, transformers, write_checkpoint  # noqa: F401 (fixtures)

TASK = os.path.join(os.path.dirname(__file__), "tasks", "successor_mc.yaml")
# every method, and each option that changes the forward: null sources, gates, learned nulls, the ceil split,
# the paper's block sources, states as sources, a query init that is not zero
ROUTED = {
    "delta_block": dict(residual="delta_block", n_blocks=2),
    "delta_block_paper_ceil": dict(residual="delta_block", n_blocks=3, block_source="paper", block_split="ceil"),
    # (on 5 layers: ceil blocks of 2, 2, 1 layers where even ones are 1, 2, 2)
    "delta_block_gate_null": dict(residual="delta_block", n_blocks=2, gate=True, null_source=True),
    "delta_learned_null": dict(residual="delta", n_blocks=2, null_source=True, learned_null=True),
    "attnres": dict(residual="attnres", n_blocks=2),
    "attnres_states": dict(residual="attnres", n_blocks=2, sources="states", query_init_std=0.5),
    "full_attnres_null": dict(residual="full_attnres", null_source=True),
}


def routed(folder, seed: int = 0, **options):
    """The tiny Qwen3 with routing, its routers moved off their initialisation so that routing matters."""
    model = load_hf_qwen3(str(folder), **options)
    torch.manual_seed(seed)
    with torch.no_grad():
        for router in model.routers:
            for p in router.tensors():
                p.add_(0.5 * torch.randn_like(p))
    return model.eval()


def load(path, **kwargs):
    return transformers.AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32,
                                                             **kwargs).eval()


@pytest.mark.parametrize("name", list(ROUTED))
def test_every_method_loads_in_transformers_with_the_same_logits(ckpts, corpus, tmp_path, name):  # noqa: F811
    folder, _ = ckpts["tied" if name != "delta_block" else "untied_sharded"]
    if "ceil" in name:
        folder = tmp_path / "five_layers"
        write_checkpoint(folder, corpus, tie=True, num_hidden_layers=5)
    ours = routed(folder, **ROUTED[name])
    hf_export.save_hf(ours, str(tmp_path / "hf"), source=str(folder), max_shard_bytes=60_000)
    theirs = load(tmp_path / "hf")
    idx = tokens()
    with torch.no_grad():
        assert (ours(idx) - theirs(idx).logits).abs().max().item() <= 1e-5
    assert theirs.config.model_config == {**ours.cfg.__dict__, "kernel": "reference"}


def test_an_exported_model_generates_as_the_repository_does(ckpts, tmp_path):  # noqa: F811
    folder, _ = ckpts["tied"]
    ours = routed(folder, **ROUTED["delta_block_gate_null"])
    hf_export.save_hf(ours, str(tmp_path / "hf"), source=str(folder))
    theirs = load(tmp_path / "hf")
    prompt = tokens(B=1, T=5)
    greedy = prompt
    with torch.no_grad():
        for _ in range(6):
            greedy = torch.cat([greedy, ours(greedy)[:, -1:].argmax(-1)], dim=1)
        assert torch.equal(theirs.generate(prompt, max_new_tokens=6, do_sample=False), greedy)
        left_padded = torch.tensor([[0, 1, 1, 1, 1]])
        with pytest.raises(ValueError, match="pads on the left"):
            theirs(prompt, attention_mask=left_padded)


def test_lm_eval_scores_an_exported_model_with_its_own_hf_backend(ckpts, tmp_path):  # noqa: F811
    pytest.importorskip("lm_eval")
    from lm_eval import evaluator
    from lm_eval.tasks import TaskManager
    folder, _ = ckpts["tied"]
    hf_export.save_hf(routed(folder, **ROUTED["attnres"]), str(tmp_path / "hf"), source=str(folder))
    # the tokenizer trained for the tests has no tokenizer_config.json; lm-eval wants its end-of-text token
    (tmp_path / "hf" / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>", '
                                                            '"tokenizer_class": "PreTrainedTokenizerFast"}')
    manager = TaskManager(include_path=os.path.dirname(TASK))
    result = evaluator.simple_evaluate(model="hf", model_args=f"pretrained={tmp_path / 'hf'},trust_remote_code=True,"
                                       "dtype=float32", tasks=["successor_mc"], task_manager=manager, device="cpu",
                                       batch_size=1, limit=4)
    accuracy = result["results"]["successor_mc"]["acc,none"]
    assert 0.0 <= accuracy <= 1.0 and result["config"]["model"] == "hf"


def test_a_routed_folder_needs_remote_code_and_is_no_qwen3(ckpts, tmp_path):  # noqa: F811
    folder, _ = ckpts["tied"]
    hf_export.save_hf(routed(folder, **ROUTED["delta_block"]), str(tmp_path / "hf"), source=str(folder))
    with pytest.raises(ValueError, match="trust_remote_code"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=False)
    with pytest.raises(ValueError, match="model_type='delta_attnres', expected 'qwen3'"):
        load_hf_qwen3(str(tmp_path / "hf"))
    assert "from depth_kernels" not in (tmp_path / "hf" / "model.py").read_text()   # transformers could not import it


def test_the_export_rewrites_each_line_it_names_exactly_once(monkeypatch):
    monkeypatch.setitem(hf_export.REWRITES, "router.py", [("import torch", "import torch  # twice")])
    with pytest.raises(RuntimeError, match="router.py: the export rewrites 'import torch', found 2 times"):
        hf_export.exported_source("router.py")
