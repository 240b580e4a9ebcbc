"""A Hugging Face tokenizer as data.tokenizer_model: a transformers tokenizer directory (or its tokenizer.json)
encodes and decodes as transformers' PreTrainedTokenizerFast does, preprocesses a corpus, and is checked against
model.vocab_size before training. Reference: PreTrainedTokenizerFast loaded from the same directory."""
import json
import os

import numpy as np
import pytest

from gptpar.data.indexed import DataError, IndexedDataset
from gptpar.data.preprocess import preprocess
from gptpar.data.tokenizer import load_tokenizer
from gptpar.testing.runs import tiny_config
from gptpar.testing.tiny_tokenizer import source_texts, train_hf_tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = ["def add(a, b):\n    return a + b\n", "héllo wörld\t✓ — unseen bytes 🙂",
         "x = [i ** 2 for i in range(9)]"]


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory):
    return train_hf_tokenizer(tmp_path_factory.mktemp("hf_tok") / "tok")


def test_directory_and_json_encode_as_transformers_does(tokdir, tmp_path):
    ref = transformers.PreTrainedTokenizerFast.from_pretrained(tokdir)
    tok = load_tokenizer(tokdir)
    assert (tok.vocab_size, tok.eod, tok.pad) == (len(ref), ref.eos_token_id, ref.pad_token_id)
    assert ref.convert_ids_to_tokens(tok.eod) == "<end>"  # the declared eos, not the guessable "</s>"
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text == ref.decode(ids)
        with_special = [ref.pad_token_id] + ids + [ref.eos_token_id]
        assert tok.decode(with_special) == ref.decode(with_special) != text
        assert tok.decode(with_special, skip_special_tokens=True) == ref.decode(with_special,
                                                                               skip_special_tokens=True) == text
    assert tok.bos is None is ref.bos_token_id  # none declared
    ref.bos_token = "</s>"
    ref.save_pretrained(tmp_path / "with_bos")
    assert load_tokenizer(str(tmp_path / "with_bos")).bos == ref.bos_token_id == ref.convert_tokens_to_ids("</s>")
    # The bare tokenizer.json declares no eos: the first known spelling is taken.
    bare = load_tokenizer(os.path.join(tokdir, "tokenizer.json"))
    assert bare.encode(TEXTS[0]) == tok.encode(TEXTS[0])
    assert ref.convert_ids_to_tokens(bare.eod) == "</s>"

    empty = tmp_path / "not_a_tokenizer"
    empty.mkdir()
    with pytest.raises(DataError, match="must hold tokenizer.json"):
        load_tokenizer(str(empty))


def test_preprocess_and_vocab_checks(tokdir, tmp_path):
    from gptpar.training.preflight import check_data

    ref = transformers.PreTrainedTokenizerFast.from_pretrained(tokdir)
    texts = TEXTS + source_texts()[:3]
    with open(tmp_path / "c.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    preprocess(str(tmp_path / "c.jsonl"), ["text"], tokdir, str(tmp_path / "c"), workers=2, append_eod=True,
               progress=False)
    prefix = str(tmp_path / "c_text_document")
    ds = IndexedDataset(prefix)
    assert [list(ds[i]) for i in range(len(ds))] == [ref.encode(t) + [ref.eos_token_id] for t in texts]

    def cfg(vocab_size):
        return tiny_config(model={"vocab_size": vocab_size},
                           data={"synthetic": False, "data_path": prefix, "tokenizer_model": tokdir})

    n = len(ref)
    with pytest.raises(DataError, match=f"data.tokenizer_model {tokdir} has {n} pieces but model.vocab_size is "
                                        f"{n - 1}: set model.vocab_size={n}"):
        check_data(cfg(n - 1), print)
    check_data(cfg(n), print)
    assert int(np.concatenate([ds[i] for i in range(len(ds))]).max()) < n
