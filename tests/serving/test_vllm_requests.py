"""Per-request sparsity: parsing and checking a request's ``extra_args["topth"]``, the
front-end check against the engine's file, and the worker-side processor that follows
vLLM's persistent batch (rows added, removed, moved, swapped)."""

import pytest

from topth_ops.thresholds import save_threshold_sets
from topth_ops.vllm import requests as R

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("value,want", [
    ({"set": 2}, R.Choice(set=2)), (1, R.Choice(set=1)), ({"k": 64}, R.Choice(k=64)),
    ("dense", R.Choice(dense=True)), ({"dense": True}, R.Choice(dense=True)), ("k=32", R.Choice(k=32)),
    (" set = 0", R.Choice(set=0)), (" DENSE ", R.Choice(dense=True)), ("K=64", R.Choice(k=64)),
])
def test_accepted_forms(value, want):
    assert R.parse_choice({"topth": value, "other": 1}) == want


def test_no_choice_is_the_default():
    assert R.parse_choice(None) is None and R.parse_choice({"x": 1}) is None


@pytest.mark.parametrize("value,match", [
    ({"set": -1}, r"\['set'\] must be an integer >= 0"), ({"set": "1"}, "integer"), ({"k": True}, "integer"),
    ({"set": 1, "k": 2}, "exactly one of"), ({"sets": 1}, "exactly one of"), ({}, "exactly one of"),
    ({"dense": False}, "must be true"), ("sparse", "set index"), (1.5, "set index"), (True, "set index"),
    ("k=-2", "set index"), ("k=x", "set index"), ("top=3", "set index"), ("set=+1", "set index"),
    ("set=1_0", "set index"), ("set=\u0661", "set index"), (-1, "a set index must be >= 0"), ("1", "set index"),
])
def test_malformed_values_are_refused(value, match):
    with pytest.raises(R.RequestChoiceError, match=match):
        R.parse_choice({"topth": value})


@pytest.fixture
def three_sets(make_cfg, make_threshold_set):
    cfg = make_cfg(layers=2, heads=4, kv_heads=2, head_dim=16)
    return [make_threshold_set(cfg, k=k) for k in (16, 32, 64)]


def test_resolve(three_sets):
    ok = [True, True, True]
    assert R.resolve(None, three_sets, 1, ok) == 1
    assert R.resolve(R.Choice(k=64), three_sets, 1, ok) == 2
    assert R.resolve(R.Choice(dense=True), three_sets, 1, ok) == 3
    with pytest.raises(R.RequestChoiceError, match=r"set 3 does not exist.*0: k=16, 1: k=32, 2: k=64"):
        R.resolve(R.Choice(set=3), three_sets, 1, ok)
    with pytest.raises(R.RequestChoiceError, match="k 128: no set"):
        R.resolve(R.Choice(k=128), three_sets, 1, ok)
    with pytest.raises(R.RequestChoiceError, match="cannot be served beside the default"):
        R.resolve(R.Choice(set=0), three_sets, 1, [False, True, True])
    with pytest.raises(R.RequestChoiceError, match="serves dense attention"):
        R.resolve(R.Choice(set=0), [], 0, [], dense_mode=True)
    assert R.resolve(R.Choice(dense=True), [], 0, [], dense_mode=True) == 0


def test_servable_needs_the_defaults_placement_and_selection(three_sets):
    three_sets[0].placement = "pre_softmax"
    assert R.servable_sets(three_sets, 1, "none") == [False, True, True]


def test_front_end_checks_against_the_environments_file(tmp_path, three_sets):
    path = str(tmp_path / "th.safetensors")
    save_threshold_sets(path, three_sets)
    env = {"TOPTH_VLLM_THRESHOLDS": path, "TOPTH_VLLM_THRESHOLD_SET": "0"}
    R.validate({"topth": {"k": 32}}, env)
    R.validate({"topth": "dense"}, env)
    with pytest.raises(R.RequestChoiceError, match="k 48: no set"):
        R.validate({"topth": {"k": 48}}, env)
    with pytest.raises(R.RequestChoiceError, match="set 5 does not exist"):
        R.validate({"topth": {"set": 5}}, env)
    with pytest.raises(R.RequestChoiceError, match="serves dense"):
        R.validate({"topth": {"set": 0}}, {"TOPTH_VLLM_MODE": "dense"})
    R.validate({"topth": {"set": 9}}, {})  # no engine configured here: the worker checks
    with pytest.raises(R.RequestChoiceError):  # malformed is refused everywhere
        R.validate({"topth": {"set": "x"}}, {})


def test_processor_follows_the_persistent_batch():
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

    p = R.TopthRequests()

    def sp(v=None):
        return SamplingParams(extra_args=None if v is None else {"topth": v})

    p.update_state(BatchUpdate(4, [], [(0, sp(1), None, []), (1, sp("dense"), None, []), (2, sp(), None, []),
                                       (3, sp({"k": 32}), None, [])], []))
    assert R.row_choices(4) == [R.Choice(set=1), R.Choice(dense=True), None, R.Choice(k=32)]
    # request 1 finishes, the last row moves into its place, then rows 0 and 2 swap
    p.update_state(BatchUpdate(3, [1], [], [(3, 1, MoveDirectionality.UNIDIRECTIONAL),
                                            (0, 2, MoveDirectionality.SWAP)]))
    assert R.row_choices(3) == [None, R.Choice(k=32), R.Choice(set=1)]
    p.update_state(BatchUpdate(3, [], [(0, sp(2), None, [])], []))
    assert R.row_choices(3) == [R.Choice(set=2), R.Choice(k=32), R.Choice(set=1)]
    p.update_state(None)
    assert R.row_choices(3)[0] == R.Choice(set=2)
    # the last update added a request into a reused slot without listing a removal
    assert R.batch_counts() == (5, 3)
    with pytest.raises(ValueError, match="exactly one of"):
        R.TopthRequests.validate_params(sp({"set": 1, "dense": True}))
