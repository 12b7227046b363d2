"""lm_eval_adapter.py: log-likelihoods against hand-computed sums, left truncation, rolling windows, generation,
and a local task run through eval.py --tasks with its accuracy worked out by hand."""
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import eval as ev
from infra import lm_eval_adapter
from infra.lm_eval_adapter import HarnessLM
from model import Model
from tests.helpers import SUCCESSOR_LOGIT, byte_data, routed_model, save, successor_model
from infra.tokenizer import ByteTokenizer

ROOT = Path(__file__).resolve().parents[1]
TASK = "tests/tasks/successor_mc.yaml"


def requests(*args) -> list:
    return [SimpleNamespace(args=a) for a in args]


def summed_logprob(model: Model, tokens: list[int], n_cont: int) -> float:
    """log p of the last n_cont tokens given the ones before, from one unbatched forward."""
    logits = model(torch.tensor([tokens[:-1]]))[0].log_softmax(-1)               # (T-1, V)
    return sum(logits[i - 1, tokens[i]].item() for i in range(len(tokens) - n_cont, len(tokens)))


def test_loglikelihood_is_the_summed_continuation_logprob():
    model, tok = routed_model(), ByteTokenizer()
    lm = HarnessLM(model, tok, max_length=64, batch_size=3)
    pairs = [("To be, or not", " to be"), ("a", "bcd"), ("Once upon a time there", " was"), ("", "Hello")]
    got = lm.loglikelihood(requests(*pairs))
    with torch.no_grad():
        for (ctx, cont), (ll, _) in zip(pairs, got):
            ids = (tok.encode(ctx) or [tok.eot]) + tok.encode(cont)
            assert ll == pytest.approx(summed_logprob(model, ids, len(tok.encode(cont))), abs=1e-4)
    one_at_a_time = HarnessLM(model, tok, max_length=64, batch_size=1).loglikelihood(requests(*pairs))
    assert [a for a, _ in got] == pytest.approx([a for a, _ in one_at_a_time], abs=1e-5)


def test_long_context_is_truncated_on_the_left():
    model, tok = routed_model(), ByteTokenizer()
    ctx, cont = "the beginning is cut off, the end is kept", "!?"
    (ll, _), = HarnessLM(model, tok, max_length=8).loglikelihood(requests((ctx, cont)))
    ids = tok.encode(ctx + cont)[-9:]       # max_length inputs plus the last target
    with torch.no_grad():
        assert ll == pytest.approx(summed_logprob(model, ids, 2), abs=1e-5)
    with pytest.raises(ValueError, match="continuation has 9 tokens"):
        HarnessLM(model, tok, max_length=8).loglikelihood(requests(("a", "123456789")))


def test_greedy_flag_and_hand_computed_loglikelihood():
    lm = HarnessLM(successor_model(), ByteTokenizer(), max_length=16)
    (ll_de, greedy_de), (_, greedy_dd) = lm.loglikelihood(requests(("abc", "de"), ("abc", "dd")))
    log_p = SUCCESSOR_LOGIT - math.log(math.exp(SUCCESSOR_LOGIT) + 256)
    assert ll_de == pytest.approx(2 * log_p, abs=1e-3)
    assert greedy_de and not greedy_dd


def test_loglikelihood_rolling_scores_disjoint_windows():
    model, tok = routed_model(), ByteTokenizer()
    text = "a rolling window of twenty-five"
    short, long = HarnessLM(model, tok, max_length=64), HarnessLM(model, tok, max_length=8)
    ids = [tok.eot] + tok.encode(text)
    with torch.no_grad():
        whole = summed_logprob(model, ids, len(ids) - 1)
        # Windows of 8 predictions; each later one sees only the token before it as context.
        windowed = sum(summed_logprob(model, ids[s - 1:s + 8], len(ids[s:s + 8])) for s in range(1, len(ids), 8))
    assert short.loglikelihood_rolling(requests((text,)))[0] == pytest.approx(whole, abs=1e-4)
    assert long.loglikelihood_rolling(requests((text,)))[0] == pytest.approx(windowed, abs=1e-4)
    assert abs(whole - windowed) > 1e-3


def test_generate_until_stops_at_the_stop_string():
    lm = HarnessLM(successor_model(), ByteTokenizer(), max_length=16)
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
    monkeypatch.setattr(lm_eval_adapter, "_HarnessBase", object)
    with pytest.raises(ModuleNotFoundError, match="pip install lm-eval"):
        lm_eval_adapter.run_tasks(HarnessLM(successor_model(), ByteTokenizer(), 8), [TASK])
