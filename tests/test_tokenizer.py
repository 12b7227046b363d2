"""tokenizer.py: the byte tokenizer, tokenizer.json files and their names, and unknown names."""
import pytest
from tokenizers import Tokenizer, models

from infra import tokenizer
from tests.helpers import tiny_tokenizer_json


def test_byte_tokenizer():
    tok = tokenizer.get_tokenizer("byte")
    text = "Ay, there's the rub — ünïcödé"
    ids = tok.encode(text)
    assert max(ids) < 256 and tok.vocab_size == 257 and tok.eot == 256
    assert tok.decode(ids + [tok.eot] + ids) == text + text


def test_unknown_tokenizer():
    with pytest.raises(ValueError, match="byte.*gpt2.*qwen3"):
        tokenizer.get_tokenizer("sentencepiece")


def test_tokenizer_json(tmp_path):
    path = tiny_tokenizer_json(tmp_path)
    for tok in (tokenizer.get_tokenizer("tiny", path=path), tokenizer.get_tokenizer(path)):
        text = "to be, or not to be: ünïcödé"
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.encode_batch([text, "be"]) == [ids, tok.encode("be")]
        assert tok.eot == 0 and tok.vocab_size == Tokenizer.from_file(path).get_vocab_size() > 256
    assert tokenizer.get_tokenizer("tiny", path=path, model_vocab_size=512).vocab_size == 512
    # Known only by its file, a tokenizer is named by its content, which shards record; not by its path.
    assert tokenizer.get_tokenizer(path).name == tokenizer.file_identity(path)
    assert tokenizer.file_identity(path).startswith("tokenizer.json:")
    # Given a Qwen3 tokenizer file, the model's padded vocabulary is what shards and checks use.
    assert tokenizer.get_tokenizer("qwen3", path=path).vocab_size == 151936


def test_tokenizer_json_needs_endoftext(tmp_path):
    path = str(tmp_path / "t.json")
    Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(path)
    with pytest.raises(ValueError, match="endoftext"):
        tokenizer.get_tokenizer(path)
