"""The CUDA split builders themselves (topth_ops.vllm.gpu_backend._builder_cls): the parent's
build is replaced by a recorder, so the split's calls to it are checked."""
import types

import pytest
import torch

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.model_executor.layers.attention")
GB = pytest.importorskip("topth_ops.vllm.gpu_backend")
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402
from vllm.v1.kv_cache_interface import EncoderOnlyAttentionSpec  # noqa: E402


CFG = types.SimpleNamespace(model_config=types.SimpleNamespace(rswa_window=None), speculative_config=None,
                            parallel_config=types.SimpleNamespace(decode_context_parallel_size=1))


@pytest.mark.parametrize("name", sorted(GB.PLATFORM_BACKENDS))
def test_builder_builds_whole_batch_and_prefill_part(monkeypatch, name):
    Builder = GB.split_backend(name).get_builder_cls()
    calls = []
    monkeypatch.setattr(Builder.__mro__[1], "build", lambda self, cpl, cm, fast=False: calls.append((cpl, cm, fast)) or cm)
    monkeypatch.setattr(Builder.__mro__[1], "__init__",
                        lambda self, spec, names, cfg, dev: self.__dict__.update(kv_cache_spec=spec, vllm_config=cfg))
    spec = types.SimpleNamespace(block_size=16)
    b = Builder(spec, ["l"], CFG, "cpu")
    assert b.reorder_batch_threshold == 1 and not Builder.supports_update_block_table
    assert not GB.split_backend(name).supports_dcp()
    qt = torch.tensor([0, 1, 2, 12], dtype=torch.int32)
    cm = CommonAttentionMetadata(query_start_loc=qt, query_start_loc_cpu=qt, seq_lens=torch.tensor([30, 5, 10]),
                                 num_reqs=3, num_actual_tokens=12, max_query_len=10, max_seq_len=30,
                                 block_table_tensor=torch.zeros(3, 4, dtype=torch.int32), slot_mapping=torch.arange(12),
                                 is_prefilling=torch.tensor([False, False, True]))
    m = b.build(7, cm, False)
    assert m.num_decodes == 2 and [(c[0], c[2], c[1].num_reqs) for c in calls] == [(7, False, 3), (0, True, 1)]
    assert m.block_table.shape == (2, 2)  # cut to ceil(30 / 16) blocks
    enc_spec = object.__new__(EncoderOnlyAttentionSpec)
    object.__setattr__(enc_spec, "block_size", 16)
    enc = Builder(enc_spec, ["l"], CFG, "cpu")
    assert enc.build(0, cm).num_decodes == 0
