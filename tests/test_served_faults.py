"""A served teacher's replies are checked before use, its key never reaches a file, and no fault makes it wait
forever (issue #41 items 1-3 and 7): kdlab's loopback server with each fault switch (kdlab.rollouts.loopback.FAULTS)
gives a named ServedTeacherError within the request's deadline, never a tensor of bad ids or log-probs."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kdlab.rollouts.loopback import FAULTS, LoopbackServer
from kdlab.rollouts.served import ServedTeacher, ServedTeacherError
from kdlab.served_wire import Wire, ranked_topk
from kdlab.served_workers import DecodeWorkers

TEACHER = "kdlab://tiny-random/teacher"
KEY = "kdlab-test-key-7f3a9c1e5b"
PROMPTS, STARTS = [[1, 2, 3, 4, 5], [6, 7, 8]], [1, 2]


@pytest.fixture(scope="module")
def server():
    with LoopbackServer(TEACHER, name="tiny-teacher") as running:
        yield running


@pytest.fixture(autouse=True)
def no_faults(server):
    server.faults, server.fault_after, server.completions, server.api_key = set(), 0, 0, None
    yield
    server.faults, server.api_key = set(), None


def teacher(server, **settings):
    served = ServedTeacher(server.url, "tiny-teacher", TEACHER, **{"timeout_s": 5.0, "retries": 1, "backoff_s": 0.0, "decode_workers": 0, **settings})
    served.check(server.tokenizer)
    return served


def entry(logprob):
    return {"logprob": logprob, "rank": 1, "decoded_token": "x"}


# ---- item 1: every reply checked, field named ---------------------------------------------------------
@pytest.mark.parametrize("rows, field", [
    ([{"3": entry(-0.1), "-1": entry(-2.0)}], r"token id -1 outside the rows of the served model's output layer \[0, 353\)"),
    ([{"3": entry(-0.1), "353": entry(-2.0)}], r"token id 353 outside the rows of the served model's output layer \[0, 353\)"),
    ([{"3": entry(-0.1), "03": entry(-2.0)}], "token id 3 appears twice"),
    ([{"3": entry(0.5), "4": entry(-2.0)}], "a logprob of 0.5 > 0"),
    ([{"3": entry(math.nan), "4": entry(-2.0)}], "not finite"),
    ([{"3": entry(-math.inf), "4": entry(-2.0)}], "not finite"),
    ([{"3": entry(-0.1), "4": entry(-0.2)}], "probabilities sum to 1.72"),
    ([{str(t): entry(-9.0) for t in range(4)}], "a position has 4 entries, more than the 3 asked for"),
])
def test_a_reply_entry_no_model_gives_is_refused_naming_the_field(rows, field):
    """Ids outside [0, V), an id twice at one position, a log-prob above 0 or not finite, a position's mass
    above 1, more than K + 1 entries: refused before any array is sized from them (today they pass)."""
    with pytest.raises(ValueError, match=field):
        ranked_topk(rows, 2, 353)


SCORING_FAULTS = {
    "id_out_of_range": r"token id 384 outside the rows of the served model's output layer \[0, 384\)",
    "negative_id": r"token id -1 outside the rows of the served model's output layer \[0, 384\)",
    "repeated_id": "appears twice at one position",
    "positive_logprob": "a logprob of 0.5 > 0",
    "nan_logprob": "not JSON|not finite",
    "mass_over_one": "probabilities sum to",
    "missing_index": "an index is missing",
    "duplicate_index": r"indices \[0, 0\] are not exactly 0..1",
    "too_many_entries": "more than the 21 asked for",
    "wrong_model": "answered for model 'another-model'",
    "huge_reply": "more than the .* this request can need",
    "other_prompt": r"position \d+ holds no entry for the prompt's own token \d+ \(vLLM always sends it\): a reply for another prompt",
}


@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize("fault", sorted(SCORING_FAULTS))
def test_each_scoring_reply_fault_is_a_named_error_on_the_host(server, fault, workers):
    served = teacher(server, decode_workers=workers)
    server.faults = {fault}
    started = time.monotonic()
    with pytest.raises(ServedTeacherError, match=rf"served teacher {server.url}/v1/completions: .*({SCORING_FAULTS[fault]})"):
        served.prompt_logprobs_many(PROMPTS, STARTS)
    assert time.monotonic() - started < 10.0


def test_a_reply_scored_on_another_prompt_is_refused_naming_the_position(server):
    """The server scores another prompt of the same length (each token id + 1: a server or proxy that mixed up its
    requests). Every position of vLLM's reply holds the scored prompt's own token; the first position of ours
    without it is named, in either prompt of the request (before, the other prompt's log-probs were accepted).
    With top_k -1 every token is at every position: such a reply cannot be told apart, and passes."""
    served = teacher(server, top_k=5)
    server.faults = {"other_prompt"}
    with pytest.raises(ServedTeacherError, match=r"/v1/completions: a reply vLLM would not give \(prompt_logprobs of prompt 0: position 1 "
                                                  r"holds no entry for the prompt's own token 2 \(vLLM always sends it\): a reply for another prompt\)"):
        served.prompt_logprobs_many(PROMPTS, STARTS)
    with pytest.raises(ServedTeacherError, match=r"prompt_logprobs of prompt 0: position 4 holds no entry for the prompt's own token 5"):
        served.prompt_logprobs_many([PROMPTS[0]], [4])  # only the positions asked for are read, and checked
    with pytest.raises(ServedTeacherError, match=r"prompt_logprobs of prompt 1: position 2 holds no entry for the prompt's own token 8"):
        served.prompt_logprobs_many([[1, 2], PROMPTS[1]], [2, 2])  # no position of prompt 0 asked for
    assert teacher(server, top_k=-1).prompt_logprobs_many(PROMPTS, STARTS)[2] == [4, 1]


@pytest.mark.parametrize("fault, field", [("long_sample", "more than max_tokens=4"), ("sample_out_of_range", r"token id 384 outside the vocabulary \[0, 353\)"),
                                          ("missing_index", "an index is missing")])
def test_each_sampling_reply_fault_is_a_named_error(server, fault, field):
    served = teacher(server)
    server.faults = {fault}
    with pytest.raises(ServedTeacherError, match=rf"served teacher {server.url}/v1/completions: .*{field}"):
        served.sample([1, 2, 3], 4, 1.0, 0, [])


def test_the_vocabulary_check_sees_added_tokens_the_probe_text_does_not_contain(server):
    """A served tokenizer with one more added token than ServedTeacher.tokenizer's tokenizes the probe text
    the same way; its /tokenizer_info (vLLM's --enable-tokenizer-info-endpoint) tells them apart."""
    from kdlab.models.loading import ModelSpec, load_tokenizer

    local = load_tokenizer(ModelSpec(TEACHER))
    original = server.tokenizer
    served = load_tokenizer(ModelSpec(TEACHER))
    served.add_tokens(["<extra_tool_token>"], special_tokens=True)
    server.tokenizer = served
    try:
        with pytest.raises(ServedTeacherError, match=r"/tokenizer_info: the server's added tokens differ .*<extra_tool_token>"):
            ServedTeacher(server.url, "tiny-teacher", TEACHER, retries=0).check(local)
    finally:
        server.tokenizer = original
    checked = ServedTeacher(server.url, "tiny-teacher", TEACHER, retries=0)
    checked.check(local)
    assert checked.vocabulary == len(local)


# ---- item 3: deadlines, limits, retries -----------------------------------------------------------------
def test_a_server_that_trickles_its_reply_is_cut_off_at_the_request_deadline(server):
    served = teacher(server, timeout_s=1.0, retries=0)
    server.faults = {"trickle"}
    started = time.monotonic()
    with pytest.raises(ServedTeacherError, match=r"/v1/completions: timed out.* \(after 1 attempt\(s\) of at most 1 s\)"):
        served.prompt_logprobs_many(PROMPTS, STARTS)
    assert time.monotonic() - started < 3.0  # per socket read, each byte in 0.2 s would have held it for minutes


@pytest.mark.parametrize("fault, attempts", [("status_429", 3), ("error", 3), ("hang_up", 3), ("malformed", 3), ("timeout", 3),
                                             ("status_400", 1), ("huge_reply", 1)])
def test_retries_are_for_what_a_retry_can_mend_and_the_message_counts_them_truly(server, fault, attempts):
    """408/429/5xx, a timeout, a reply cut off or not JSON are retried; another 4xx or a reply past the byte
    limit is not; the message counts the requests sent (a connection the server closed is reopened once
    at no retry's cost, and that request counts too)."""
    # a short timeout only for the timeout fault: elsewhere a loaded machine's slow reply would time out and be retried
    served = teacher(server, retries=2, backoff_s=0.01, timeout_s=1.0 if fault == "timeout" else 10.0)
    server.faults, server.completions = {fault}, 0
    with pytest.raises(ServedTeacherError, match=r"after (\d+) attempt\(s\)") as error:
        served.prompt_logprobs_many(PROMPTS, STARTS)
    sent = int(error.value.args[0].rsplit("after ", 1)[1].split(" ")[0])
    assert sent == server.completions and sent - (fault == "hang_up") == attempts


def test_a_decoding_process_that_never_answers_is_killed_at_its_deadline(server):
    wire = Wire(server.url, 0.5, 0, 0.0)
    workers = DecodeWorkers(1, wire, "tiny-teacher", 20, grace_s=0.5)
    try:
        assert workers.run(PROMPTS, STARTS, 353, 384)[2] == [4, 1]
        (process,) = workers.running
        os.kill(process.pid, signal.SIGSTOP)  # alive, silent
        started = time.monotonic()
        with pytest.raises(ServedTeacherError, match=r"/v1/completions: its decoding process gave no answer within 1 s"):
            workers.run(PROMPTS, STARTS, 353, 384)
        assert time.monotonic() - started < 3.0
        assert workers.run(PROMPTS, STARTS, 353, 384)[2] == [4, 1]  # a fresh one
    finally:
        workers.close()


def test_a_server_killed_mid_run_ends_in_a_named_error_within_the_deadline(tmp_path):
    process = subprocess.Popen([sys.executable, "-m", "kdlab.rollouts.loopback", TEACHER, "--port", "0", "--name", "tiny-teacher"],
                               stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    try:
        line = process.stdout.readline()
        url = line.rsplit(" at ", 1)[1].strip()
        served = ServedTeacher(url, "tiny-teacher", TEACHER, timeout_s=2.0, retries=1, backoff_s=0.0, decode_workers=1)
        assert served.prompt_logprobs_many(PROMPTS, STARTS)[2] == [4, 1]
        process.kill()
        process.wait()
        started = time.monotonic()
        with pytest.raises(ServedTeacherError, match=rf"served teacher {url}/v1/completions: .*Connection refused.*after \d attempt\(s\)"):
            served.prompt_logprobs_many(PROMPTS, STARTS)
        assert time.monotonic() - started < 6.0
    finally:
        process.kill()


# ---- item 2: secrets -------------------------------------------------------------------------------------
def test_the_key_is_read_from_its_environment_variable_and_sent_as_a_bearer_token(server, monkeypatch):
    server.api_key = KEY
    with pytest.raises(ServedTeacherError, match=r"HTTP 401.*set ServedTeacher.api_key_env.*after 1 attempt"):
        ServedTeacher(server.url, "tiny-teacher", TEACHER, retries=2, backoff_s=0.0).check(server.tokenizer)
    served = ServedTeacher(server.url, "tiny-teacher", TEACHER, retries=0, api_key_env="KDLAB_TEST_KEY", decode_workers=1)
    monkeypatch.delenv("KDLAB_TEST_KEY", raising=False)
    with pytest.raises(ServedTeacherError, match="api_key_env='KDLAB_TEST_KEY' names an environment variable that is not set"):
        served.check(server.tokenizer)
    monkeypatch.setenv("KDLAB_TEST_KEY", KEY)
    served.check(server.tokenizer)
    assert served.prompt_logprobs_many(PROMPTS, STARTS)[2] == [4, 1]  # the decoding process reads it too
    assert KEY not in repr(served.__dict__) and KEY not in repr(served._wire.__dict__)


def shown(key: str, message: str) -> list[str]:
    """The runs of 6 or more printable characters of ``key`` that ``message`` repeats."""
    import re

    return [run for run in re.findall(r"[\x21-\x7e]{6,}", key) if run in message]


@pytest.mark.parametrize("workers", [0, 1])
def test_the_key_reaches_no_message_whatever_its_variable_holds(server, monkeypatch, workers):
    """A key read with the line ending of a Windows key file (``\\r``, ``\\r\\n``) or spaces around it is stripped and
    works (http.client refused it, quoting the header, and the wire retried and quoted it again); one holding a control
    or non-ASCII character inside is refused naming the variable, before anything is sent and without a retry, in
    this process or a decoding process. The key's text is in no message."""
    server.api_key = KEY
    for value in (KEY + "\r", f"  {KEY}\r\n", "\t" + KEY + " "):
        monkeypatch.setenv("KDLAB_TEST_KEY", value)
        served = ServedTeacher(server.url, "tiny-teacher", TEACHER, retries=2, backoff_s=0.0, api_key_env="KDLAB_TEST_KEY", decode_workers=workers)
        served.check(server.tokenizer)
        assert served.prompt_logprobs_many(PROMPTS, STARTS)[2] == [4, 1]
    for value in (KEY[:9] + "\r\n" + KEY[9:], KEY + "\x7f", KEY + "\u00e9", KEY[:9] + "\x1b" + KEY[9:]):
        monkeypatch.setenv("KDLAB_TEST_KEY", value)
        served = ServedTeacher(server.url, "tiny-teacher", TEACHER, retries=2, backoff_s=0.0, api_key_env="KDLAB_TEST_KEY", decode_workers=workers)
        server.completions = 0
        with pytest.raises(ServedTeacherError, match="the environment variable ServedTeacher.api_key_env='KDLAB_TEST_KEY' names holds a control "
                                                      "or non-ASCII character") as error:
            served.prompt_logprobs_many(PROMPTS, STARTS)
        assert shown(value, str(error.value)) == [] and server.completions == 0
        with pytest.raises(ServedTeacherError) as error:
            served.check(server.tokenizer)
        assert "KDLAB_TEST_KEY" in str(error.value) and shown(value, str(error.value)) == []


def test_a_header_http_client_refuses_is_not_quoted_and_not_retried(server, monkeypatch):
    """Whatever header value http.client refuses (here a key past the check above), the error names the endpoint and
    what happened, never the header's value, and no retry follows (none could send it)."""
    wire = Wire(server.url, 5.0, 2, 0.0)
    monkeypatch.setattr(wire, "_headers", lambda: {"Authorization": f"Bearer {KEY}\r\n"})
    server.completions = 0
    with pytest.raises(ServedTeacherError, match=rf"served teacher {server.url}/v1/completions: http.client refused to send the request.* "
                                                  "not sent, not retried") as error:
        wire.request("/v1/completions", {"model": "tiny-teacher", "prompt": [1, 2, 3], "max_tokens": 1})
    assert shown(KEY, str(error.value)) == [] and server.completions == 0


@pytest.mark.parametrize("url", [f"http://user:{KEY}@127.0.0.1:8000", f"http://127.0.0.1:8000/?key={KEY}",
                                 f"http://127.0.0.1:8000/#{KEY}", f"http://{KEY}@127.0.0.1:8000"])
def test_a_url_carrying_a_secret_is_refused_without_repeating_it(url):
    with pytest.raises(ValueError, match=r"ServedTeacher.url='http://127.0.0.1:8000': a URL with a user, password, query or fragment") as error:
        ServedTeacher(url, "m", TEACHER)
    assert KEY not in str(error.value)
    with pytest.raises(ValueError, match="the NAME of an environment variable") as error:
        ServedTeacher("http://127.0.0.1:8000", "m", TEACHER, api_key_env=KEY.replace("-", "/"))
    assert KEY.replace("-", "/") not in str(error.value)


def test_a_finished_run_holds_the_key_in_no_file(server, tmp_path, monkeypatch, capsys):
    """`kdlab fit` against a server that wants a key: its run directory (config.yaml, run_info.json, the
    metrics and event logs, the checkpoints) holds the variable's name and never the key, and neither does
    its console output (a sweep's fit.log); an archive (scripts/archive_runs.py) keeps a subset of these files."""
    from kdlab.cli.main import main

    server.api_key = KEY
    monkeypatch.setenv("KDLAB_TEST_KEY", KEY)
    monkeypatch.setattr("sys.argv", ["kdlab"])
    smoke = Path(__file__).parents[1] / "experiments" / "tiny" / "smoke.yaml"
    served = ('{"class_path": "kdlab.rollouts.served.ServedTeacher", "init_args": {"url": "' + server.url + '", "model": "tiny-teacher", '
              '"tokenizer": "' + TEACHER + '", "api_key_env": "KDLAB_TEST_KEY", "retries": 0}}')
    main(["fit", f"--config={smoke}", "--trainer.max_steps=1", "--trainer.limit_val_batches=0", "--model.teacher=null",
          f"--model.served_teacher={served}", f"--trainer.logger.init_args.save_dir={tmp_path}"])
    files = [path for path in tmp_path.rglob("*") if path.is_file()]
    assert any(path.name == "config.yaml" for path in files) and any(path.suffix == ".ckpt" for path in files)
    assert any(b"KDLAB_TEST_KEY" in path.read_bytes() for path in files if path.name == "config.yaml")
    assert [str(path) for path in files if KEY.encode() in path.read_bytes()] == []
    out = capsys.readouterr()  # what a sweep's fit.log would hold
    assert "train/loss" in out.out + out.err and KEY not in out.out + out.err


def test_every_fault_switch_has_a_test_here():
    text = Path(__file__).read_text(encoding="utf-8")
    assert [fault for fault in FAULTS if f'"{fault}"' not in text] == []


def test_the_docs_serve_only_on_loopback_or_with_a_key():
    """Every `vllm serve` command of docs/teachers.md listens on 127.0.0.1 or demands a key."""
    import re

    text = (Path(__file__).parents[1] / "docs" / "teachers.md").read_text(encoding="utf-8")
    commands = re.findall(r"`(vllm serve [^`]*)`", text)
    assert commands and [c for c in commands if "--host 127.0.0.1" not in c and "--api-key" not in c] == []


def test_every_fault_switch_is_a_row_of_the_bad_inputs_page():
    text = (Path(__file__).parents[1] / "docs" / "bad_inputs.md").read_text(encoding="utf-8")
    assert [fault for fault in FAULTS if f"`{fault}`" not in text and fault not in ("timeout", "malformed", "error", "wrong_model", "status_400")] == []


def test_a_url_with_a_password_on_the_command_line_is_refused_and_echoed_nowhere(tmp_path, capsys, monkeypatch):
    from kdlab.cli.main import entry

    monkeypatch.setattr("sys.argv", ["kdlab"])
    smoke = Path(__file__).parents[1] / "experiments" / "tiny" / "smoke.yaml"
    served = ('{"class_path": "kdlab.rollouts.served.ServedTeacher", "init_args": {"url": "http://user:' + KEY + '@127.0.0.1:9", '
              '"model": "m", "tokenizer": "' + TEACHER + '"}}')
    with pytest.raises(SystemExit):
        entry(["fit", f"--config={smoke}", "--model.teacher=null", f"--model.served_teacher={served}", f"--trainer.logger.init_args.save_dir={tmp_path}"])
    out = capsys.readouterr()
    assert "a URL with a user, password, query or fragment is refused" in out.err
    assert KEY not in out.out + out.err and [p for p in tmp_path.rglob("*") if p.is_file() and KEY.encode() in p.read_bytes()] == []


def test_the_loopback_server_refuses_what_vllm_refuses():
    """A Content-Length past the limit (or missing), max_tokens past max_model_len, a prompt id outside the
    vocabulary: HTTP 400, as vLLM answers, before any work (today it reads any length and samples any count).
    A server of its own: a request an earlier test left in flight on the module's server could finish meanwhile
    and count as work."""
    with LoopbackServer(TEACHER, name="tiny-teacher") as server:
        refused_without_work(server)


def refused_without_work(server) -> None:
    import http.client
    import json

    def post(body: bytes, length: str | None = None):
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        connection.putrequest("POST", "/v1/completions")
        connection.putheader("Content-Length", length if length is not None else str(len(body)))
        connection.endheaders()
        connection.send(body)
        response = connection.getresponse()
        status, text = response.status, response.read()
        connection.close()
        return status, text

    done = server.completions
    assert done == 0
    assert post(b"{}", str(1 << 40))[0] == 400
    assert post(b"{}", "abc")[0] == 400
    status, text = post(json.dumps({"model": "tiny-teacher", "prompt": [1, 2, 3], "max_tokens": 10**9}).encode())
    assert status == 400 and b"exceed max_model_len=512" in text
    status, text = post(json.dumps({"model": "tiny-teacher", "prompt": [1, 2, 10**6], "max_tokens": 1}).encode())
    assert status == 400 and b"a prompt token outside [0, 353)" in text
    assert server.completions == done  # none of the four did any work
