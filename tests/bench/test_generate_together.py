"""bench/vllm_common.generate_together against a fake engine: the scheduler is paused while
every request is added and resumed before the first step, outputs come back in prompt order,
and a failing add aborts this call's requests and still resumes the scheduler. (The real
engine runs it in tests/serving.)"""

from types import SimpleNamespace

import pytest

from topth_ops.bench import vllm_common as vc


class FakeEngine:
    """Records the calls; each step finishes the newest unfinished request, so outputs
    arrive in reverse prompt order (the helper must restore it)."""

    def __init__(self, multiprocess=True, fail_at=None):
        self.log = []
        self.pending = []
        self.fail_at = fail_at
        if multiprocess:
            self.engine_core = SimpleNamespace(call_utility=lambda *a: self.log.append(("utility",) + a))
        else:
            self.engine_core = SimpleNamespace()

    def add_request(self, rid, prompt, params):
        if self.fail_at is not None and prompt == self.fail_at:
            raise ValueError(f"prompt {prompt} too long")
        self.log.append(("add", rid))
        self.pending.append((rid, prompt))
        return rid + "-internal"

    def abort_request(self, ids, internal=False):
        self.log.append(("abort", tuple(ids), internal))

    def has_unfinished_requests(self):
        return bool(self.pending)

    def step(self):
        self.log.append(("step",))
        rid, prompt = self.pending.pop()  # the newest first: not prompt order
        return [SimpleNamespace(request_id=rid, finished=True, prompt=prompt)]


def _llm(**kw):
    return SimpleNamespace(llm_engine=FakeEngine(**kw))


def test_pause_add_resume_then_steps_and_prompt_order():
    llm = _llm()
    seen = []
    outs = vc.generate_together(llm, ["a", "b", "c"], SimpleNamespace(), on_step=lambda o, t: seen.append(len(o)))
    assert [o.prompt for o in outs] == ["a", "b", "c"]
    kinds = [e[0] if e[0] != "utility" else e[1] for e in llm.llm_engine.log]
    assert kinds == ["pause_scheduler", "add", "add", "add", "resume_scheduler", "step", "step", "step"]
    assert llm.llm_engine.log[0] == ("utility", "pause_scheduler", "keep", False)
    assert seen == [1, 1, 1]


def test_request_ids_unique_across_calls():
    llm = _llm()
    vc.generate_together(llm, ["a"], SimpleNamespace(), on_step=lambda o, t: None)
    vc.generate_together(llm, ["a"], SimpleNamespace(), on_step=lambda o, t: None)
    ids = [e[1] for e in llm.llm_engine.log if e[0] == "add"]
    assert len(set(ids)) == 2


def test_in_process_engine_needs_no_pause():
    llm = _llm(multiprocess=False)
    outs = vc.generate_together(llm, ["x", "y"], SimpleNamespace(), on_step=lambda o, t: None)
    assert [o.prompt for o in outs] == ["x", "y"]
    assert [e[0] for e in llm.llm_engine.log] == ["add", "add", "step", "step"]


def test_failed_add_aborts_this_calls_requests_and_resumes():
    llm = _llm(fail_at="c")
    with pytest.raises(ValueError, match="too long"):
        vc.generate_together(llm, ["a", "b", "c", "d"], SimpleNamespace(), on_step=lambda o, t: None)
    log = llm.llm_engine.log
    aborts = [e for e in log if e[0] == "abort"]
    assert len(aborts) == 1 and len(aborts[0][1]) == 2 and aborts[0][2] is True
    assert all(i.endswith("-internal") for i in aborts[0][1])
    assert log[-1] == ("utility", "resume_scheduler")
    assert not any(e[0] == "step" for e in log)


@pytest.mark.vllm
def test_output_kind_final_only_without_on_step_cumulative_with():
    from vllm.sampling_params import RequestOutputKind

    params = SimpleNamespace(output_kind=None)
    vc.generate_together(_llm(), ["a"], params)
    assert params.output_kind == RequestOutputKind.FINAL_ONLY
    vc.generate_together(_llm(), ["a"], params, on_step=lambda o, t: None)  # the same params reused
    assert params.output_kind == RequestOutputKind.CUMULATIVE


def test_write_threshold_file_rows_checked():
    with pytest.raises(ValueError, match="rows must be an int >= 1"):
        vc.write_threshold_file("unused", "unused", rows=0)
    with pytest.raises(ValueError, match="rows must be an int >= 1"):
        vc.write_threshold_file("unused", "unused", rows=2.7)


def test_serving_bench_refuses_a_configuration_named_twice(capsys):
    """Each configuration's greedy agreement is taken against the first vllm run: a second
    'vllm' would be compared with the first's own tokens (and merged into its medians)."""
    from topth_ops.bench import vllm_serving

    with pytest.raises(SystemExit):
        vllm_serving.main(["--model", "m", "--configs", "vllm,dense,vllm"])
    assert "each configuration at most once" in capsys.readouterr().err


def test_top_two_best_first_per_step():
    lp = lambda x: SimpleNamespace(logprob=x)  # noqa: E731
    steps = [{7: lp(-2.0), 3: lp(-0.1), 9: lp(-1.0)}, {4: lp(-0.5), 5: lp(-0.25)}]
    out = SimpleNamespace(outputs=[SimpleNamespace(logprobs=steps)])
    assert vc.top_two(out) == [[(3, -0.1), (9, -1.0)], [(5, -0.25), (4, -0.5)]]
    assert vc.top_two(SimpleNamespace(outputs=[SimpleNamespace(logprobs=None)])) == []
