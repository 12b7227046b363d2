"""finetune.py: router learning rates, the step-0 identity check and its log, freezing the backbone, export,
the prepared text and its reuse, validation on WikiText-2 (val_text, through `datasets`: local files and a stand-in
for the hub; its test split by default, as the authors' script), the CLI, the paper's fine-tuning configs, and
experiments/step0.py."""
import json

import numpy as np
import pytest
import torch

from infra import checkpoint
from infra import shards
from infra.tokenizer import get_tokenizer
import finetune
from infra.config import ConfigError, TrainConfig, load_config
from finetune import FinetuneConfig
from infra.hf_qwen3 import load_hf_qwen3, model_config_from_hf
from model import Model, ModelConfig
from tests.tiny_qwen3 import QWEN3_0P6B, ckpts, corpus, tokens  # noqa: F401 (ckpts, corpus: fixtures)

transformers = pytest.importorskip("transformers")


# ----------------------------------------------------------------------------------------------- fine-tuning

def run_args(folder, corpus, tmp_path, *extra):
    return [f"--init_from={folder}", f"--text={corpus}", "--text_val_docs=10", f"--data={tmp_path / 'data'}",
            f"--out_dir={tmp_path / 'out'}", "--max_steps=1", "--warmup_steps=0", "--batch_size=4",
            "--micro_batch_size=4", "--seq_len=32", "--eval_batches=2", "--lr=1e-4", "--device=cpu", *extra]


def read_log(tmp_path):
    with open(tmp_path / "out" / "log.jsonl") as f:
        return [json.loads(line) for line in f]


def step_changes(folder, tmp_path, **overrides):
    """{parameter name: |after one step - before|} from the run's checkpoint and a fresh conversion."""
    before = load_hf_qwen3(str(folder), **overrides).state_dict()
    after = checkpoint.load_checkpoint(str(tmp_path / "out" / "ckpt_0000001.pt"))["model"]
    return {k: (after[k] - before[k]).abs() for k in before}


def test_one_step_moves_routers_at_router_lr_and_backbone_at_lr(ckpts, corpus, tmp_path, capsys):
    """Adam's first update is lr * g / (|g| + eps) ~ lr per element (plus lr * wd * p on matrices)."""
    folder, _ = ckpts["untied_sharded"]
    routed = dict(residual="delta_block", n_blocks=2, null_source=True)
    finetune.main(run_args(folder, corpus, tmp_path, *(f"--{k}={v}" for k, v in routed.items())))
    step0 = read_log(tmp_path)[0]
    assert step0["step"] == 0 and not step0["init_is_identity"] and step0["init_max_abs_logit_diff"] > 0
    assert step0["val_loss_converted"] != step0["val_loss_pretrained"]
    assert "the init is NOT an identity" in capsys.readouterr().out
    changes = step_changes(folder, tmp_path, **routed)
    queries = [v for k, v in changes.items() if k.endswith(".query")]
    assert torch.allclose(torch.stack(queries).max(), torch.tensor(1e-2), rtol=1e-3)  # 1e-4 x 100
    for k, v in changes.items():
        if not k.startswith("routers."):  # every backbone tensor gets gradient somewhere
            assert v.max().item() == pytest.approx(1e-4, rel=0.1), k


def test_gated_init_logs_identity_and_freeze_backbone(ckpts, corpus, tmp_path, capsys):
    folder, _ = ckpts["tied"]
    routed = dict(residual="delta", null_source=True, gate=True)
    finetune.main(run_args(folder, corpus, tmp_path, "--freeze_backbone=true",
                           *(f"--{k}={v}" for k, v in routed.items())))
    step0 = read_log(tmp_path)[0]
    assert step0["init_max_abs_logit_diff"] == 0.0 and step0["init_is_identity"]
    assert step0["val_loss_converted"] == step0["val_loss_pretrained"]
    assert "the init is an exact identity" in capsys.readouterr().out
    # the pretrained side of the check is the baseline conversion of the same checkpoint
    cfg = TrainConfig(data=str(tmp_path / "data"), batch_size=4, micro_batch_size=4, seq_len=32, eval_batches=2)
    base = finetune.step0_check(load_hf_qwen3(str(folder)), cfg, torch.device("cpu"))
    assert base["val_loss_converted"] == step0["val_loss_pretrained"]
    changes = step_changes(folder, tmp_path, **routed)
    assert all(v.max() == 0 for k, v in changes.items() if not k.startswith("routers."))
    # The gate's gradient is tiny here: sources that sum to the stream make the read c * h~, along which the
    # pre-norm is scale invariant, so Adam's lr * g / (|g| + eps) is a sizeable part of the router lr, not all.
    gates = torch.stack([v for k, v in changes.items() if k.endswith(".gate")])
    assert 1e-3 < gates.max().item() <= 1e-2 * (1 + 1e-6)


def test_baseline_finetune_exports_to_transformers(ckpts, corpus, tmp_path):
    folder, _ = ckpts["untied_sharded"]
    finetune.main(run_args(folder, corpus, tmp_path))
    out = tmp_path / "hf"
    finetune.main(["export", str(tmp_path / "out" / "ckpt_0000001.pt"), str(out), f"--source={folder}"])
    ckpt = checkpoint.load_checkpoint(str(tmp_path / "out" / "ckpt_0000001.pt"))
    ours = Model(ModelConfig(**ckpt["model_config"]))
    ours.load_state_dict(ckpt["model"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    idx = tokens()
    with torch.no_grad():
        assert (ours.eval()(idx) - hf(idx).logits).abs().max().item() < 1e-5


def test_prepared_text_is_not_reused_with_other_settings(ckpts, corpus, tmp_path):
    folder, _ = ckpts["tied"]
    ft = FinetuneConfig(init_from=str(folder), text=str(corpus), text_val_docs=10)
    meta = finetune.prepare_text(ft, str(tmp_path / "d"))
    assert meta["n_val_docs"] == 10 and meta["n_train_docs"] == 50 and meta["tokenizer_path"].endswith("tokenizer.json")
    assert finetune.prepare_text(ft, str(tmp_path / "d")) == meta
    assert finetune.prepare_text(ft, str(tmp_path / "d"), rank=1) == meta  # other ranks: reuse, never prepare
    ft.text_val_docs = 5
    with pytest.raises(ValueError, match="holds shards prepared from"):
        finetune.prepare_text(ft, str(tmp_path / "d"))
    ft.text_val_docs = 60
    with pytest.raises(ValueError, match="both splits need text"):
        finetune.prepare_text(ft, str(tmp_path / "e"))


def test_read_texts(tmp_path):
    (tmp_path / "a.txt").write_text("one whole document\n\nstill the same one")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "second"}) + "\n\n" + json.dumps({"text": "third"}) + "\n")
    assert list(finetune.read_texts(str(tmp_path))) == ["one whole document\n\nstill the same one", "second", "third"]
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"c\.jsonl:2: expected a JSON object with a string field 'text'"):
        list(finetune.read_texts(str(tmp_path / "c.jsonl")))
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(ValueError, match="expected a .txt or .jsonl file"):
        list(finetune.read_texts(str(tmp_path / "x.csv")))


def test_cli_errors(ckpts, corpus, tmp_path):
    folder, _ = ckpts["tied"]
    with pytest.raises(ConfigError, match="router_lr_scale"):
        finetune.main(run_args(folder, corpus, tmp_path, "--router_lr=1.0"))
    with pytest.raises(ValueError, match="--init_from=PATH is required"):
        finetune.main([f"--data={tmp_path}"])
    with pytest.raises(ValueError, match="nothing to train"):
        finetune.main(run_args(folder, corpus, tmp_path, "--freeze_backbone=true"))


@pytest.mark.parametrize("name", ["delta_block", "attnres", "baseline"])
def test_paper_configs_fit_the_released_qwen3_0p6b(name):
    model_cfg, cfg, ft = load_config([f"configs/finetune_qwen3_0p6b_{name}.py"],
                                     classes=(ModelConfig, TrainConfig, FinetuneConfig))
    assert (cfg.max_steps, cfg.batch_size, cfg.warmup_steps, cfg.lr) == (20_000, 32, 500, 5e-5)
    converted = model_config_from_hf(QWEN3_0P6B, **finetune.routing_overrides(model_cfg))
    assert converted.residual == name
    if name == "delta_block":
        assert converted.null_source and cfg.lr * ft.router_lr_scale == pytest.approx(5e-3)
    if name == "attnres":   # Table 5's router lr; Table 2's N = 28 blocks, a block per layer
        assert cfg.lr * ft.router_lr_scale == pytest.approx(5e-3)
        assert (converted.n_blocks, converted.n_layers, converted.null_source) == (28, 28, False)
        assert not converted.gate


@pytest.mark.parametrize("arg, allowed", [("router_lr_scale=-1.0", "finite numbers >= 0"),
                                          ("text_val_docs=0", "integers >= 1"),
                                          ("text_max_tokens=-5", r"0 \(the whole text\) or integers >= 1"),
                                          ("text=", "'fineweb', or a .txt / .jsonl file or folder"),
                                          ("val_text=wiki.csv", r"'' \(text's first documents\), 'wikitext2'"),
                                          ("val_text=wikitext2:valid", r"'' \(text's first documents\), 'wikitext2' "
                                           r"\(its test split, the authors'\), 'wikitext2:test', "
                                           r"'wikitext2:validation', or a \.txt / \.jsonl / \.parquet file$")])
def test_nonsense_finetune_values_name_key_value_and_allowed_values(arg, allowed):
    key, value = arg.split("=")
    shown = repr(value) if key in ("text", "val_text") else value     # string fields are shown quoted
    with pytest.raises(ValueError, match=rf"^{key}={shown}: allowed values are {allowed}") as error:
        load_config([f"--{arg}"], classes=(ModelConfig, TrainConfig, FinetuneConfig))
    assert "\n" not in str(error.value)


# ----------------------------------------------------------------------------------------- val_text (WikiText-2)

VAL_ROWS = [" = Valkyria Chronicles = \n", "", " the river runs over the stone \n", " the old hill \n"]


def val_tokens(folder, text):
    tok = get_tokenizer(str(folder / "tokenizer.json"), str(folder / "tokenizer.json"))
    return tok.encode(text) + [tok.eot]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_a_local_val_text_file_becomes_the_val_split(ckpts, corpus, tmp_path, suffix):
    """The same `datasets` path as WikiText-2's, offline: rows joined by blank lines, tokenised with the
    checkpoint's tokenizer, as the val split; the text's own held-out documents kept as text_val."""
    folder, _ = ckpts["tied"]
    path = tmp_path / f"wiki{suffix}"
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps({"text": row}) + "\n" for row in VAL_ROWS))
    else:
        pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
        pq.write_table(pa.table({"text": VAL_ROWS}), str(path))
    plain = finetune.prepare_text(FinetuneConfig(init_from=str(folder), text=str(corpus), text_val_docs=10),
                                  str(tmp_path / "plain"))
    ft = FinetuneConfig(init_from=str(folder), text=str(corpus), text_val_docs=10, val_text=str(path))
    meta = finetune.prepare_text(ft, str(tmp_path / "d"))
    val = shards.read_shard(str(tmp_path / "d" / "val_000000.bin"))
    assert val.tolist() == val_tokens(folder, "\n\n".join(VAL_ROWS))
    assert meta["val_tokens"] == len(val) and meta["val_text"] == str(path)
    kept = shards.read_shard(str(tmp_path / "d" / "text_val_000000.bin"))
    assert np.array_equal(kept, shards.read_shard(str(tmp_path / "plain" / "val_000000.bin")))
    assert meta["text_val_tokens"] == plain["val_tokens"] and meta["train_tokens"] == plain["train_tokens"]
    assert finetune.prepare_text(ft, str(tmp_path / "d")) == meta == shards.load_meta(str(tmp_path / "d"))
    ft.val_text = ""
    with pytest.raises(ValueError, match="holds shards prepared from"):
        finetune.prepare_text(ft, str(tmp_path / "d"))


@pytest.fixture
def hub(monkeypatch):
    """A stand-in for `datasets.load_dataset` that records each call and returns VAL_ROWS."""
    datasets = pytest.importorskip("datasets")
    calls = []

    def load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        return {"text": VAL_ROWS}

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


@pytest.mark.parametrize("val_text, split", [("wikitext2", "test"), ("wikitext2:test", "test"),
                                             ("wikitext2:validation", "validation")])
def test_wikitext2_loads_the_split_asked_for_the_test_split_by_default(ckpts, corpus, tmp_path, hub, val_text,
                                                                       split):
    """Plain "wikitext2" is the test split, the one the authors' fine-tuning script loads; the split is named
    in the stamp and meta.json, so a folder prepared from one split is not reused for the other."""
    folder, _ = ckpts["tied"]
    ft = FinetuneConfig(init_from=str(folder), text=str(corpus), text_val_docs=10, val_text=val_text)
    meta = finetune.prepare_text(ft, str(tmp_path / "d"))
    (args, kwargs), = hub
    assert args == ("wikitext", "wikitext-2-raw-v1") and kwargs["split"] == split
    assert meta["val_text"] == f"wikitext2:{split}"
    val = shards.read_shard(str(tmp_path / "d" / "val_000000.bin"))
    assert val.tolist() == val_tokens(folder, "\n\n".join(VAL_ROWS))
    ft.val_text = "wikitext2:validation" if split == "test" else "wikitext2"
    with pytest.raises(ValueError, match="holds shards prepared from"):
        finetune.prepare_text(ft, str(tmp_path / "d"))


def test_an_unreachable_hub_is_one_line(ckpts, corpus, tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    folder, _ = ckpts["tied"]

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'wikitext' on the Hub (LocalEntryNotFoundError)\nmore")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    ft = FinetuneConfig(init_from=str(folder), text=str(corpus), text_val_docs=10, val_text="wikitext2")
    message = (r"^val_text='wikitext2': could not load wikitext/wikitext-2-raw-v1 \(test\): "
               r"ConnectionError: Couldn't reach 'wikitext' on the Hub \(LocalEntryNotFoundError\)$")
    with pytest.raises(shards.DataError, match=message):
        finetune.prepare_text(ft, str(tmp_path / "e"))
    assert not (tmp_path / "e" / "finetune_text.json").exists()   # not marked prepared
    with pytest.raises(FileNotFoundError, match="val_text=.*: no such file"):
        finetune.load_val_text(str(tmp_path / "missing.jsonl"), str(tmp_path / "cache"))


def test_step0_experiment_measures_each_conversion(tmp_path):
    """experiments/step0.py on a baseline of the sweep's model (random weights at std 0.5, so that the stream is
    large against RMSNorm's eps as in a trained model, saved as a Qwen3 folder): the gated conversion is exact,
    AttnRes's zero-query read is h~/N (only RMSNorm's eps moves the logits), the authors' Delta Block sources
    are not an identity, and random queries (a seeded draw: the same figures twice) make the read non-uniform."""
    from experiments import step0
    from infra.hf_qwen3 import save_hf_qwen3
    from model import Model, ModelConfig
    model_cfg, _ = load_config([step0.CONFIG, "--init_std=0.5"])
    torch.manual_seed(0)
    hf = str(tmp_path / "hf")
    save_hf_qwen3(Model(model_cfg), hf)
    gated = step0.measure(hf, step0.CONVERSIONS["delta_block, gate=True"])
    assert gated["init_max_abs_logit_diff"] == 0.0 and gated["jump"] == 0.0 and gated["query_init_std"] == 0.02
    attnres = step0.measure(hf, step0.CONVERSIONS["attnres, 4 blocks"])
    assert 0 < attnres["init_max_abs_logit_diff"] < 1e-2 and abs(attnres["jump"]) < 1e-4
    assert attnres["query_init_std"] == 0.0
    paper = step0.measure(hf, step0.CONVERSIONS["delta_block, the authors' sources, null source"])
    assert paper["init_max_abs_logit_diff"] > 1.0 and paper["jump"] > 1e-2
    random = step0.measure(hf, step0.CONVERSIONS["attnres, 4 blocks, random queries"])
    assert random["query_init_std"] == 0.02 and random["overrides"]["query_init_std"] == 0.02
    assert random["init_max_abs_logit_diff"] > 10 * attnres["init_max_abs_logit_diff"]
    assert step0.measure(hf, step0.CONVERSIONS["attnres, 4 blocks, random queries"]) == random
