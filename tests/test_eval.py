"""eval.py and sample.py: perplexity, the lm-eval adapter, routing analysis and plots, sampling with a KV cache.

Checkpoints are written in tmp_path with checkpoint.save_file from tiny models; the data directories are
tiny byte-token shards. The "successor" model predicts the next letter of the alphabet with a known
probability, so task accuracies and generations can be worked out by hand.
"""
import json
import math
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import checkpoint
import data
import eval as ev
import sample
import train
from tokenizer import ByteTokenizer
from model import Attention, Model, ModelConfig

ROOT = Path(__file__).resolve().parents[1]
TASK = "tests/tasks/successor_mc.yaml"
SUCCESSOR_LOGIT = 10.0


def tiny_config(residual: str = "delta_block", **kw) -> ModelConfig:
    return ModelConfig(vocab_size=257, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64,
                       residual=residual, n_blocks=2, **kw)


def routed_model(residual: str = "delta_block", seed: int = 0, **kw) -> Model:
    """A tiny model with random router queries and norm weights, so routing is far from uniform."""
    torch.manual_seed(seed)
    model = Model(tiny_config(residual, **kw))
    with torch.no_grad():
        for router in model.routers:
            router.query.normal_(std=2.0)
            router.norm_weight.uniform_(0.5, 1.5)
    return model.eval()


def successor_model() -> Model:
    """Logit SUCCESSOR_LOGIT for byte b + 1 after byte b, 0 for every other token, whatever came before.

    Sublayers write nothing (zero o_proj / down_proj), so the final norm sees the one-hot embedding of the
    current token scaled to rms 1, i.e. sqrt(d) at that token's coordinate; lm_head maps it to the logits.
    """
    d = 260
    model = Model(ModelConfig(vocab_size=257, d_model=d, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=8, d_ff=8,
                              tie_embeddings=False))
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.embed_tokens.weight.zero_()
        model.embed_tokens.weight[:, :257] = torch.eye(257)
        model.lm_head.weight.zero_()
        model.lm_head.weight[1:, :256] = SUCCESSOR_LOGIT / math.sqrt(d) * torch.eye(256)
    return model.eval()


def write_data(directory: Path, val: np.ndarray, tokenizer: str = "byte", vocab_size: int = 257) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for split, tokens in (("train", val[::-1].copy()), ("val", val)):
        data.write_shard(str(directory / f"{split}_000000.bin"), tokens, vocab_size, tokenizer)
    (directory / "meta.json").write_text(json.dumps({"tokenizer": tokenizer, "vocab_size": vocab_size}))
    return directory


def byte_data(directory: Path, n: int = 500, seed: int = 0) -> Path:
    """Random bytes with an end-of-text every 50 tokens."""
    tokens = np.random.default_rng(seed).integers(0, 256, size=n).astype(np.uint16)
    tokens[49::50] = 256
    return write_data(directory, tokens)


def save(model: Model, out_dir: Path, data_dir: Path, seq_len: int = 16, step: int = 1) -> str:
    path = str(out_dir / f"ckpt_{step:07d}.pt")
    checkpoint.save_file(path, {"model": model.state_dict(), "model_config": asdict(model.cfg),
                                 "train_config": asdict(train.TrainConfig(data=str(data_dir), seq_len=seq_len)),
                                 "optimizer": {}, "loader": {}, "step": step})
    return path


def requests(*args) -> list:
    return [SimpleNamespace(args=a) for a in args]


def summed_logprob(model: Model, tokens: list[int], n_cont: int) -> float:
    """log p of the last n_cont tokens given the ones before, from one unbatched forward."""
    logits = model(torch.tensor([tokens[:-1]]))[0].log_softmax(-1)               # (T-1, V)
    return sum(logits[i - 1, tokens[i]].item() for i in range(len(tokens) - n_cont, len(tokens)))


# ------------------------------------------------------------------------------------------------ loading

@pytest.mark.filterwarnings("ignore:.*has no checksum")
def test_checkpoint_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        ev.load_model(str(tmp_path / "missing.pt"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="without checkpoints"):
        ev.load_model(str(tmp_path / "empty"))
    (tmp_path / "text.pt").write_text("not a checkpoint")
    with pytest.raises(ValueError, match="not a checkpoint this project writes"):
        ev.load_model(str(tmp_path / "text.pt"))
    torch.save({"state_dict": {}}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match=r"unknown checkpoint format, missing keys \['model', 'model_config'\]"):
        ev.load_model(str(tmp_path / "other.pt"))


def test_out_dir_resolves_to_newest_checkpoint(tmp_path):
    directory = byte_data(tmp_path / "data")
    save(routed_model(seed=1), tmp_path, directory, step=5)
    newest = routed_model(seed=2)
    save(newest, tmp_path, directory, step=20)
    model, ckpt = ev.load_model(str(tmp_path))
    assert ckpt["path"].endswith("ckpt_0000020.pt")
    assert torch.equal(model.routers[0].query, newest.routers[0].query)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled", "ignore:.*has no checksum")
def test_sharded_checkpoint_directory_loads(tmp_path):
    """An FSDP run's sharded checkpoint (torch.distributed.checkpoint folder + meta.json) evaluates directly."""
    import torch.distributed.checkpoint as dcp
    directory = byte_data(tmp_path / "data")
    model = routed_model(seed=3)
    sharded = tmp_path / "run" / "ckpt_0000007"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(sharded), no_dist=True)
    meta = {"model_config": asdict(model.cfg), "step": 7,
            "train_config": asdict(train.TrainConfig(data=str(directory), seq_len=16))}
    (sharded / "meta.json").write_text(json.dumps(meta))
    for path in (sharded, tmp_path / "run"):  # the folder itself, or its out_dir
        loaded, ckpt = ev.load_model(str(path))
        assert ckpt["path"] == str(sharded)
        idx = torch.randint(0, 257, (1, 9))
        assert torch.equal(loaded(idx), model(idx))


def test_data_with_another_vocabulary_is_rejected(tmp_path):
    path = save(routed_model(), tmp_path, byte_data(tmp_path / "data"))
    other = np.arange(100, dtype=np.uint16)
    gpt2 = write_data(tmp_path / "gpt2", other, tokenizer="gpt2", vocab_size=50257)
    with pytest.raises(ValueError, match="'gpt2' but the model was trained on 'byte' tokens"):
        ev.main([path, f"--data={gpt2}"])
    wide = write_data(tmp_path / "wide", other, vocab_size=300)
    with pytest.raises(ValueError, match="vocab_size 300 but the model's vocab_size is 257"):
        ev.main([path, f"--data={wide}"])


# --------------------------------------------------------------------------------------------- perplexity

def test_perplexity_is_exp_of_hand_computed_mean_token_loss(tmp_path):
    seq_len = 16
    directory = byte_data(tmp_path / "data", n=3 * seq_len + 6)   # three full windows and a short one
    model = routed_model()
    path = save(model, tmp_path, directory, seq_len=seq_len)
    result = ev.main([path, "--batch_size=2"])[path]["perplexity"]

    tokens = data.read_shard(str(directory / "val_000000.bin")).astype(np.int64)
    nll, n_bytes = [], 0
    with torch.no_grad():
        for start in range(0, len(tokens) - 1, seq_len):
            window = tokens[start:start + seq_len + 1].tolist()
            logp = model(torch.tensor([window[:-1]]))[0].log_softmax(-1)
            nll += [-logp[i, window[i + 1]].item() for i in range(len(window) - 1)]
            n_bytes += sum(t < 256 for t in window[1:])
    assert result["tokens"] == len(tokens) - 1 == len(nll)
    assert result["ppl"] == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-5)
    assert result["bits_per_byte"] == pytest.approx(sum(nll) / math.log(2) / n_bytes, rel=1e-5)
    saved = json.loads(Path(path[:-len(".pt")] + ".eval.json").read_text())
    assert saved["perplexity"]["ppl"] == result["ppl"]


def test_perplexity_on_a_text_file(tmp_path):
    path = save(successor_model(), tmp_path, byte_data(tmp_path / "data"), seq_len=8)
    text = tmp_path / "alphabet.txt"
    text.write_text("abcdefghijklmnopqrstuvwxyz")
    result = ev.main([path, f"--data={text}"])[path]["perplexity"]
    # Every one of the 25 targets is the successor of its input byte: p = e^10 / (e^10 + 256).
    p = math.exp(SUCCESSOR_LOGIT) / (math.exp(SUCCESSOR_LOGIT) + 256)
    assert result["tokens"] == 25
    assert result["loss"] == pytest.approx(-math.log(p), rel=1e-2)


# -------------------------------------------------------------------------------------- lm-eval adapter

def test_loglikelihood_is_the_summed_continuation_logprob():
    model, tok = routed_model(), ByteTokenizer()
    lm = ev.HarnessLM(model, tok, max_length=64, batch_size=3)
    pairs = [("To be, or not", " to be"), ("a", "bcd"), ("Once upon a time there", " was"), ("", "Hello")]
    got = lm.loglikelihood(requests(*pairs))
    with torch.no_grad():
        for (ctx, cont), (ll, _) in zip(pairs, got):
            ids = (tok.encode(ctx) or [tok.eot]) + tok.encode(cont)
            assert ll == pytest.approx(summed_logprob(model, ids, len(tok.encode(cont))), abs=1e-4)
    one_at_a_time = ev.HarnessLM(model, tok, max_length=64, batch_size=1).loglikelihood(requests(*pairs))
    assert [a for a, _ in got] == pytest.approx([a for a, _ in one_at_a_time], abs=1e-5)


def test_long_context_is_truncated_on_the_left():
    model, tok = routed_model(), ByteTokenizer()
    ctx, cont = "the beginning is cut off, the end is kept", "!?"
    (ll, _), = ev.HarnessLM(model, tok, max_length=8).loglikelihood(requests((ctx, cont)))
    ids = tok.encode(ctx + cont)[-9:]       # max_length inputs plus the last target
    with torch.no_grad():
        assert ll == pytest.approx(summed_logprob(model, ids, 2), abs=1e-5)
    with pytest.raises(ValueError, match="continuation has 9 tokens"):
        ev.HarnessLM(model, tok, max_length=8).loglikelihood(requests(("a", "123456789")))


def test_greedy_flag_and_hand_computed_loglikelihood():
    lm = ev.HarnessLM(successor_model(), ByteTokenizer(), max_length=16)
    (ll_de, greedy_de), (_, greedy_dd) = lm.loglikelihood(requests(("abc", "de"), ("abc", "dd")))
    log_p = SUCCESSOR_LOGIT - math.log(math.exp(SUCCESSOR_LOGIT) + 256)
    assert ll_de == pytest.approx(2 * log_p, abs=1e-3)
    assert greedy_de and not greedy_dd


def test_loglikelihood_rolling_scores_disjoint_windows():
    model, tok = routed_model(), ByteTokenizer()
    text = "a rolling window of twenty-five"
    short, long = ev.HarnessLM(model, tok, max_length=64), ev.HarnessLM(model, tok, max_length=8)
    ids = [tok.eot] + tok.encode(text)
    with torch.no_grad():
        whole = summed_logprob(model, ids, len(ids) - 1)
        # Windows of 8 predictions; each later one sees only the token before it as context.
        windowed = sum(summed_logprob(model, ids[s - 1:s + 8], len(ids[s:s + 8])) for s in range(1, len(ids), 8))
    assert short.loglikelihood_rolling(requests((text,)))[0] == pytest.approx(whole, abs=1e-4)
    assert long.loglikelihood_rolling(requests((text,)))[0] == pytest.approx(windowed, abs=1e-4)
    assert abs(whole - windowed) > 1e-3


def test_generate_until_stops_at_the_stop_string():
    lm = ev.HarnessLM(successor_model(), ByteTokenizer(), max_length=16)
    out = lm.generate_until(requests(("abc", {"until": ["f"], "max_gen_toks": 10}),
                                     ("wx", {"until": ["\n"], "max_gen_toks": 4})))
    assert out == ["de", "yz{|"]     # byte 'z' + 1 is '{'


def test_local_task_gives_the_hand_computed_accuracy(tmp_path, monkeypatch):
    pytest.importorskip("lm_eval")
    monkeypatch.chdir(ROOT)                  # the task YAML names its jsonl relative to the repository root
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    path = save(successor_model(), tmp_path, byte_data(tmp_path / "data"), seq_len=16)
    tasks = ev.main([path, f"--tasks={TASK}"])[path]["tasks"]
    # The model picks each question's alphabetical successor: d (gold), o (gold), u (gold is v), i (gold),
    # yz (gold; "yy" has an unlikely y -> y) -> 4 of 5.
    assert tasks["accuracy"] == {"successor_mc": pytest.approx(0.8)}
    assert tasks["average"] == pytest.approx(0.8)


def test_tasks_without_lm_eval_say_how_to_install(monkeypatch):
    monkeypatch.setattr(ev, "_HarnessBase", object)
    with pytest.raises(ModuleNotFoundError, match="pip install lm-eval"):
        ev.run_tasks(ev.HarnessLM(successor_model(), ByteTokenizer(), 8), [TASK])


# ----------------------------------------------------------------------------------------------- routing

@pytest.mark.parametrize("residual,kw", [("delta", {}), ("delta_block", {"null_source": True}), ("attnres", {})])
def test_recorded_weights_sum_to_one_and_recording_changes_nothing(residual, kw):
    model = routed_model(residual, **kw)
    x = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        off = model(x)
        recorder = ev.RoutingRecorder(model)
        model.routing_observer = recorder
        on = model(x)
    assert torch.equal(on, off)
    receivers = recorder.summary(model)
    assert len(receivers) == len(model.routers)
    for r in receivers:
        assert sum(r["weights"]) == pytest.approx(1.0, abs=1e-6)   # fp32 softmax
        assert r["max_weight"] == max(r["weights"])
    if residual == "delta":          # fine-grained: receiver l reads e and the l outputs before it
        assert [r["n_sources"] for r in receivers] == [l + 1 for l in range(4)]
    if residual == "attnres":
        assert receivers[-1]["name"] == "final"
    assert min(r["entropy"] for r in receivers if r["n_sources"] > 1) < 0.99   # random queries: not uniform


def test_zero_queries_route_uniformly(tmp_path):
    model = Model(tiny_config("delta")).eval()
    tokens = np.random.default_rng(0).integers(0, 256, size=200)
    result = ev.routing_analysis(model, [tokens], seq_len=16, n_windows=4, batch_size=2)
    for r in result["receivers"][1:]:
        assert r["entropy"] == pytest.approx(1.0, abs=1e-6)
        assert r["token_entropy"] == pytest.approx(1.0, abs=1e-6)
        assert r["max_weight"] == pytest.approx(1 / r["n_sources"], abs=1e-6)
    assert result["receivers"][0]["entropy"] is None           # a single source: entropy undefined
    assert result["mean_entropy"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="residual='baseline' has no depth routing"):
        ev.routing_analysis(Model(tiny_config("baseline")), [tokens], seq_len=16)


def test_routing_command_writes_json_and_png_for_several_checkpoints(tmp_path):
    directory = byte_data(tmp_path / "data", n=400)
    paths = []
    for residual in ("attnres", "delta_block"):
        (tmp_path / residual).mkdir()
        paths.append(save(routed_model(residual), tmp_path / residual, directory))
    prefix = str(tmp_path / "plots" / "routing")
    ev.main(paths + ["--routing", f"--out={prefix}", "--routing_windows=4", "--batch_size=2"])
    runs = json.loads(Path(prefix + ".json").read_text())
    assert list(runs) == ["attnres", "delta_block"]
    for run in runs.values():
        routed = [r for r in run["receivers"] if r["n_sources"] > 1]
        assert run["mean_max_weight"] == pytest.approx(np.mean([r["max_weight"] for r in routed]))
        assert run["tokens"] == 4 * 16
    import matplotlib.image
    for suffix in ("_depth.png", "_matrix.png"):
        with open(prefix + suffix, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        image = matplotlib.image.imread(prefix + suffix)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


# ---------------------------------------------------------------------------------------------- sampling

@pytest.mark.parametrize("residual", ["delta_block", "attnres", "baseline"])
def test_kv_cache_logits_equal_the_full_forward(residual):
    model = routed_model(residual) if residual != "baseline" else Model(tiny_config("baseline")).eval()
    idx = torch.randint(0, 256, (2, 11))
    with torch.no_grad():
        full = model(idx)
        cache = sample.KVCache(len(model.layers))
        steps = [sample.forward_cached(model, idx[:, :6], cache)]
        steps += [sample.forward_cached(model, idx[:, t:t + 1], cache) for t in range(6, 11)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    assert all(isinstance(layer.self_attn, Attention) for layer in model.layers)   # restored


def test_cached_and_uncached_greedy_generation_agree():
    model = routed_model("delta_block")
    idx = torch.randint(0, 256, (1, 5))

    def run(use_cache: bool, context: int) -> torch.Tensor:
        return torch.cat(list(sample.generate(model, idx, 12, temperature=0, context=context, use_cache=use_cache)), 1)

    assert torch.equal(run(True, 32), run(False, 32))
    assert run(True, 8).shape == (1, 12)        # past the window: rebuilt from its newer half


def test_sampling_from_the_command_line(tmp_path):
    path = save(successor_model(), tmp_path, byte_data(tmp_path / "data"), seq_len=16)
    report = ev.main([path, "--sample", "ab", "--max_new_tokens=5", "--temperature=0"])
    assert report[path]["sample"] == "abcdefg"
    tok = ByteTokenizer()
    top1 = sample.sample_text(successor_model(), tok, "k", 4, temperature=2.0, top_k=1, seed=3)
    assert top1 == "klmno"                      # top_k=1 is greedy at any temperature
    with pytest.raises(ValueError, match="temperature >= 0"):
        sample.sample_text(successor_model(), tok, "k", 4, temperature=-1.0)


def test_hugging_face_folder_evaluates_like_its_checkpoint(tmp_path):
    finetune = pytest.importorskip("finetune")
    pytest.importorskip("safetensors")
    directory = byte_data(tmp_path / "data", n=200)
    torch.manual_seed(0)
    model = Model(tiny_config("baseline")).eval()
    path = save(model, tmp_path, directory, seq_len=16)
    finetune.save_hf_qwen3(model, str(tmp_path / "hf"))
    from_ckpt = ev.main([path, f"--data={directory}", "--seq_len=16"])[path]["perplexity"]
    from_hf = ev.main([str(tmp_path / "hf"), f"--data={directory}", "--seq_len=16"])[str(tmp_path / "hf")]
    assert from_hf["perplexity"]["loss"] == pytest.approx(from_ckpt["loss"], rel=1e-6)
    assert (tmp_path / "hf" / "eval.json").exists()
    with pytest.raises(FileNotFoundError, match="tokenizer.json not found"):
        ev.main([str(tmp_path / "hf"), "--sample", "a"])
