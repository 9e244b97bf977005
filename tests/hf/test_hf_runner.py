"""topth_ops.hf.runner.token_nll: per-token NLL with the LM head in chunks, against a float64
log-softmax of the full logits of one ordinary forward (tiny random Llama, no download)."""

import pytest
import torch

from topth_ops.hf.runner import token_nll

VOCAB, T = 80, 23


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval()


def _oracle(model, ids):
    with torch.no_grad():
        logits = model(ids.view(1, -1)).logits[0].double()
    return -torch.log_softmax(logits[:-1], -1).gather(1, ids[1:, None])[:, 0]


@pytest.mark.parametrize("first,chunk", [(1, 512), (1, 5), (7, 4), (T - 1, 3)])
def test_token_nll_matches_full_logits(model, first, chunk):
    ids = torch.randint(0, VOCAB, (T,), generator=torch.Generator().manual_seed(3))
    got = token_nll(model, ids, first, chunk=chunk)
    want = _oracle(model, ids)[first - 1:]
    assert got.shape == (T - first,) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # the summed NLL evaluate records: the oracle's sum over the same tokens
    assert abs(float(got.double().sum()) - float(want.sum())) < 1e-3


@pytest.mark.parametrize("first", [0, T, -1])
def test_token_nll_rejects_first_target_out_of_range(model, first):
    with pytest.raises(ValueError, match="first_target must lie in"):
        token_nll(model, torch.zeros(T, dtype=torch.int64), first)


@pytest.mark.parametrize("ids,chunk,match", [(torch.zeros(1, T, dtype=torch.int64), 512, "ids must be 1-D"),
                                             (torch.zeros(T, dtype=torch.int64), 0, "chunk must be >= 1")])
def test_token_nll_rejects_bad_ids_and_chunk(model, ids, chunk, match):
    with pytest.raises(ValueError, match=match):
        token_nll(model, ids, 1, chunk=chunk)


def test_token_nll_applies_final_logit_softcapping(model, monkeypatch):
    """A model whose forward soft-caps its logits (Gemma 2 style) is scored on the capped logits."""
    ids = torch.randint(0, VOCAB, (T,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        logits = model(ids.view(1, -1)).logits[0].double()
    cap = 0.05 * float(logits.abs().max())  # small enough to change the distribution
    want = -torch.log_softmax(cap * torch.tanh(logits[:-1] / cap), -1).gather(1, ids[1:, None])[:, 0]
    monkeypatch.setattr(model.config, "final_logit_softcapping", cap, raising=False)
    torch.testing.assert_close(token_nll(model, ids, 1, chunk=6).double(), want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(want, _oracle(model, ids))  # the cap mattered
