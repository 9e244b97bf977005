"""topth_ops.hf.model.gguf_bos: a GGUF file's tokenizer.ggml.add_bos_token reaches the tokenizer
(transformers 5.19 drops it; Gemma 3 then loses its BOS and its perplexity nearly doubles)."""

import pytest

gguf = pytest.importorskip("gguf")  # part of the hf extra

from topth_ops.hf.model import gguf_bos  # noqa: E402
from topth_ops.hf.texts import bos_ids  # noqa: E402


class _Tok:
    def __init__(self, add_bos=False, bos_token_id=2):
        self.add_bos_token = add_bos
        self.bos_token_id = bos_token_id


def _file(tmp_path, flag):
    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    if flag is not None:
        w.add_add_bos_token(flag)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.mark.parametrize("flag,before,after", [(True, False, True), (True, True, True), (False, False, False),
                                               (None, False, False), (False, True, True)])
def test_the_files_bos_flag_reaches_the_tokenizer(tmp_path, flag, before, after):
    tok = _Tok(add_bos=before)
    assert gguf_bos(tok, _file(tmp_path, flag)) is bool(flag)
    assert tok.add_bos_token is after  # never switched off: a tokenizer that adds BOS keeps it
    assert bos_ids(tok) == ([2] if after else [])


def test_a_tokenizer_without_a_bos_token_is_left_alone(tmp_path):
    tok = _Tok(bos_token_id=None)
    assert gguf_bos(tok, _file(tmp_path, True)) is True
    assert tok.add_bos_token is False and bos_ids(tok) == []
