"""The two HTTP servers (a training job's control server, the DiLoCo server) against hostile
requests: a JSON value no field takes is answered 400 with one line naming the field, never
500, and every response carries a Content-Security-Policy (a page: only its own script and
style; anything else: nothing at all) and ``nosniff``. Real servers on 127.0.0.1.

The browser half (a hostile worker id shown on the DiLoCo dashboard, no script run) is in
tests/test_control_dashboard.py, beside the Playwright fixture it shares.
"""

from __future__ import annotations

import http.client
import json
import math
import re
import struct
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _control_support import WAIT_S, train_in_background
from hookloop import Callback
from hookloop.control import ControlServer
from hookloop.control.bodies import MAX_INT, MAX_TEXT, BodyError, load_object
from hookloop.control.dashboard import CSP as CONTROL_CSP
from hookloop.diloco.dashboard import CSP as DILOCO_CSP
from hookloop.diloco.dashboard import PAGE as DILOCO_PAGE
from hookloop.diloco.wire import save_tensors
from test_diloco_server import TOKEN, _server, _weights

pytest.importorskip("aiohttp")
pytestmark = pytest.mark.timeout(180)

HUGE = "1" + "0" * 400  # 10**400: a valid JSON integer that no float holds


def _huge(template: str) -> str:
    """``template`` with 10**400 written where it says HUGE."""
    return template.replace("HUGE", HUGE)


DEEP = "[" * 8000 + "]" * 8000  # json.loads: RecursionError, not ValueError (16,000 bytes)


def _http(port, method, path, body=None, token=None, headers=None):
    """``(status, text, headers)`` of one request to 127.0.0.1:port."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
    hdrs = dict(headers or {})
    if token:
        hdrs["Authorization"] = f"Bearer {token}"
    try:
        conn.request(method, path, body=body, headers=hdrs)
        response = conn.getresponse()
        return response.status, response.read().decode("utf-8", "replace"), response.headers
    finally:
        conn.close()


def _refused(status, text, field):
    """A 400 whose error is one line naming ``field``."""
    assert status == 400, (status, text)
    error = json.loads(text)["error"]
    assert "\n" not in error and len(error) < 400, error
    assert field in error, (field, error)
    return error


# -- the payloads break naive handling (what the servers did with them) -----------------------
def test_the_payloads_crash_naive_handling_with_other_errors_than_valueerror():
    # a range check written as math.isfinite(x) and low <= x raises on a huge int
    with pytest.raises(OverflowError):
        math.isfinite(json.loads(HUGE))
    # an id looked up in a dict raises on a list
    with pytest.raises(TypeError, match="unhashable"):
        _ = json.loads('["w"]') in {"w": 1}
    # a deep body fails json.loads with RecursionError, which `except ValueError` misses
    with pytest.raises(RecursionError):
        json.loads(DEEP)
    # Python reads NaN and infinities, which JSON itself does not allow
    assert math.isnan(json.loads("NaN")) and json.loads("1e999") == math.inf


def test_load_object_refuses_every_value_no_field_takes_naming_its_path():
    cases = {
        _huge('{"a": {"b": [1, HUGE]}}'): "a.b[1] must be a number of magnitude at most 2**53",
        '{"lr": NaN}': "lr must be a finite number, got nan",
        '{"lr": -Infinity}': "lr must be a finite number, got -inf",
        '{"lr": 1e999}': "lr must be a finite number, got inf",
        '{"s": "%s"}' % ("x" * (MAX_TEXT + 1)): f"s must be a string of at most {MAX_TEXT}",
        DEEP: "nests lists or objects deeper than 16 levels",
        '{"a":' * 40 + "1" + "}" * 40: "nests lists or objects deeper than 16 levels",
        "[1]": "the body must be a JSON object, got a list",
        "\xff": "not valid JSON",
    }
    for body, message in cases.items():
        with pytest.raises(BodyError) as info:
            load_object(body.encode("latin-1") if body == "\xff" else body.encode())
        assert message in str(info.value) and "\n" not in str(info.value), (body[:40], info.value)
    assert load_object(b'{"n": %d, "x": -1.5e300, "ok": [true, null]}' % MAX_INT)["n"] == MAX_INT


# -- the DiLoCo server ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def diloco(tmp_path_factory):
    srv = _server(tmp_path_factory.mktemp("diloco"))
    yield srv
    srv.stop()


def _submission(header: str) -> bytes:
    """A submission body: the length-prefixed JSON ``header``, then real pseudo-gradients."""
    raw = header.encode()
    return struct.pack("!I", len(raw)) + raw + save_tensors(_weights())


LIST_ID = '{"worker_id": ["w"]}'
#: (route, body, the field the refusal names), for every route that reads a JSON body.
DILOCO_ATTACKS = [
    ("register", LIST_ID, "worker_id"),
    ("register", '{"worker_id": {"a": 1}}', "worker_id"),
    ("register", '{"worker_id": "a\\nforged log line"}', "worker_id"),
    ("register", '{"worker_id": "%s"}' % ("w" * 201), "worker_id"),
    ("register", '{"worker_id": "w", "hostname": ["box"]}', "hostname"),
    ("register", '{"worker_id": "w", "extra": [1]}', "extra"),
    ("register", _huge('{"worker_id": "w", "step": HUGE}'), "step"),
    ("register", '{"worker_id": "w", "round": NaN}', "round"),
    ("register", DEEP, "deeper than 16"),
    ("register", "[]", "JSON object"),
    ("heartbeat", _huge('{"worker_id": "w", "steps_per_second": HUGE}'), "steps_per_second"),
    ("heartbeat", '{"worker_id": "w", "steps_per_second": 1e999}', "steps_per_second"),
    ("heartbeat", '{"worker_id": "w", "steps_per_second": NaN}', "steps_per_second"),
    ("heartbeat", '{"worker_id": "w", "steps_per_second": true}', "steps_per_second"),
    ("heartbeat", '{"worker_id": "w", "steps_per_second": "fast"}', "steps_per_second"),
    ("heartbeat", LIST_ID, "worker_id"),
    ("deregister", '{"worker_id": {"a": 1}}', "worker_id"),
    ("deregister", "{}", "worker_id"),
    ("control/kick_worker", LIST_ID, "worker_id"),
    ("control/kick_worker", '{"worker_id": {"a": 1}}', "worker_id"),
    ("control/update_optimizer", _huge('{"lr": HUGE}'), "lr"),
    ("control/update_optimizer", '{"lr": 1e999}', "lr"),
    ("control/update_optimizer", '{"lr": NaN}', "lr"),
    ("control/update_optimizer", '{"lr": true}', "lr"),
    ("control/update_optimizer", _huge('{"momentum": HUGE}'), "momentum"),
    ("control/update_optimizer", '{"momentum": -Infinity}', "momentum"),
    ("control/update_optimizer", '{"lr": 0.5, "client": ["me"]}', "client"),
    ("control/update_num_workers", _huge('{"num_workers": HUGE}'), "num_workers"),
    ("control/update_num_workers", '{"num_workers": 1000001}', "num_workers"),
    ("control/update_num_workers", '{"num_workers": true}', "num_workers"),
    ("control/update_num_workers", '{"num_workers": 2.5}', "num_workers"),
    ("control/save_state", DEEP, "deeper than 16"),
    ("control/shutdown", '{"x": NaN}', "x"),  # refused before the server acts
    ("control/shutdown", "[1, 2]", "JSON object"),
]
SUBMISSION_ATTACKS = [
    ('{"worker_id": ["w"]}', "worker_id"),
    (_huge('{"worker_id": "w", "fragment_id": HUGE}'), "fragment_id"),
    ('{"worker_id": "w", "fragment_id": NaN}', "fragment_id"),
    ("[" * 20_000 + "]" * 20_000, "bad submission body"),
]


@pytest.mark.parametrize(("route", "body", "field"), DILOCO_ATTACKS)
def test_the_diloco_server_answers_a_bad_json_value_400_naming_the_field(
    diloco, route, body, field
):
    status, text, _ = _http(diloco.port, "POST", f"/{route}", body.encode(), TOKEN)
    _refused(status, text, field)


@pytest.mark.parametrize("route", ["submit_pseudograd", "submit_fragment_pseudograd"])
@pytest.mark.parametrize(("header", "field"), SUBMISSION_ATTACKS)
def test_a_submission_header_with_a_bad_value_is_answered_400(diloco, route, header, field):
    status, text, _ = _http(diloco.port, "POST", f"/{route}", _submission(header), TOKEN)
    _refused(status, text, field)


def test_after_the_attacks_the_diloco_server_serves_as_before(diloco):
    keys = ("status", "num_workers", "num_registered", "outer_lr", "outer_momentum")
    before = json.loads(_http(diloco.port, "GET", "/status", token=TOKEN)[1])
    for route, body, _ in DILOCO_ATTACKS:
        _http(diloco.port, "POST", f"/{route}", body.encode(), TOKEN)
    status, text, _ = _http(diloco.port, "GET", "/status", token=TOKEN)
    answer = json.loads(text)
    assert status == 200 and answer["status"] == "running", answer
    assert {k: answer[k] for k in keys} == {k: before[k] for k in keys}, answer
    # a worker id with quotes and angle brackets is taken (the dashboard shows it as text)
    hostile = 'x" autofocus onfocus="alert(1)'
    body = json.dumps({"worker_id": hostile, "hostname": "<b>box</b>"}).encode()
    bound = {"X-Worker-Binding": "secret"}  # as hookloop's workers ask (Forgather's need a flag)
    assert _http(diloco.port, "POST", "/register", body, TOKEN, bound)[0] == 200
    assert json.loads(_http(diloco.port, "GET", "/status", token=TOKEN)[1])["workers"][hostile]
    kick = json.dumps({"worker_id": hostile}).encode()
    assert _http(diloco.port, "POST", "/control/kick_worker", kick, TOKEN)[0] == 200


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30)
    | st.sampled_from([10**400, -(10**400), 2**53 + 1, 10**6]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                 max_size=3),
    max_leaves=8,
)  # fmt: skip
FUZZED_FIELDS = {
    "register": ["worker_id", "hostname", "extra"],
    "heartbeat": ["worker_id", "steps_per_second"],
    "deregister": ["worker_id"],
    "control/kick_worker": ["worker_id"],
    "control/update_optimizer": ["lr", "momentum", "client"],
    "control/update_num_workers": ["num_workers"],
}


def test_fuzzed_field_values_never_get_a_5xx_from_the_diloco_server(diloco):
    @settings(
        max_examples=150,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(route=st.sampled_from(sorted(FUZZED_FIELDS)), data=st.data())
    def probe(route, data):  # fmt: skip
        body = {name: data.draw(_json_values, label=name) for name in FUZZED_FIELDS[route]}
        raw = json.dumps(body).encode()  # NaN and Infinity travel as Python writes them
        status, text, _ = _http(diloco.port, "POST", f"/{route}", raw, TOKEN)
        assert status < 500, (route, body, status, text)
        if status >= 400:
            error = json.loads(text)["error"]
            assert "\n" not in error and len(error) < 600, error

    probe()
    status, text, _ = _http(diloco.port, "GET", "/status", token=TOKEN)
    assert status == 200 and json.loads(text)["status"] == "running"


# -- the control server -----------------------------------------------------------------------
class _Pace(Callback):
    """Keeps the loop slow enough to serve requests, and keeps its live settings."""

    def __init__(self) -> None:
        self.live = None
        self.started = threading.Event()

    def on_train_start(self, ctx) -> None:
        self.live = ctx.settings
        self.started.set()

    def on_train_step_end(self, ctx) -> None:
        time.sleep(0.002)


@pytest.fixture
def control(tmp_path, make_trainer):
    server = ControlServer(jobs_dir=tmp_path / "jobs", announce=False, required=True)
    pace = _Pace()
    trainer = make_trainer(callbacks=[server, pace], max_steps=10**6, log_every=5)
    thread, _ = train_in_background(trainer)
    deadline = time.monotonic() + WAIT_S
    while server.record is None:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield server, pace
    finally:
        trainer.control.request_abort("test over")
        thread.join(WAIT_S)


CONTROL_ATTACKS = [
    (_huge('{"command": "set", "values": {"lr": HUGE}}'), "values.lr"),
    ('{"command": "set", "values": {"lr": NaN}}', "values.lr"),
    ('{"command": "set", "values": {"lr": 1e999}}', "values.lr"),
    (_huge('{"command": "set", "values": {"log_every": HUGE}}'), "values.log_every"),
    ('{"command": "set", "values": {"log_every": true}}', "log_every"),
    ('{"command": "set", "values": {"lr": [0.1]}}', "lr"),
    ('{"command": "set", "values": {"betas": [0.9, Infinity]}}', "values.betas[1]"),
    ('{"command": "set", "values": [1]}', '"values"'),
    ('{"command": "abort", "client": ["me"]}', "client"),
    ('{"command": "abort", "client": "me\\nforged"}', "client"),
    ('{"command": ["abort"]}', "unknown command"),
    ('{"command": "abort", "x": "%s"}' % ("y" * (MAX_TEXT + 1)), "x must be a string"),
    ("[" * 50 + "]" * 50, "JSON object"),
    ('{"a":' * 40 + "1" + "}" * 40, "deeper than 16"),
    (DEEP, "not valid JSON"),
]


def test_the_control_server_answers_a_bad_json_value_400_naming_the_field(control):
    server, pace = control
    pace.started.wait(WAIT_S)
    # the attack: the job's own check of a setting is no guard against a huge integer
    with pytest.raises(OverflowError):
        pace.live.check({"lr": json.loads(HUGE)})
    port, path = server.record.port, f"/jobs/{server.job_id}/control"
    for body, field in CONTROL_ATTACKS:
        status, text, _ = _http(port, "POST", path, body.encode(), server.token)
        _refused(status, text, field)
    status, text, _ = _http(port, "GET", f"/jobs/{server.job_id}/status", token=server.token)
    answer = json.loads(text)
    assert answer["phase"] == "training" and answer["stopping"] is None, answer
    assert answer["changes"] == [] and answer["recent_commands"] == [], answer


# -- every response carries a Content-Security-Policy -----------------------------------------
HTML = {"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"}


def _check_headers(status, text, headers, page_csp):
    policy = headers.get("Content-Security-Policy")
    assert policy, (status, text[:200], dict(headers))
    assert headers.get("X-Content-Type-Options") == "nosniff", dict(headers)
    assert "frame-ancestors 'none'" in policy and "'unsafe-inline'" not in policy, policy
    if headers.get("Content-Type", "").startswith("text/html"):
        assert status == 200 and policy == page_csp, (status, policy)
        assert re.search(r"script-src 'sha256-[A-Za-z0-9+/=]+'(;|$)", policy), policy
        assert "default-src 'none'" in policy and "connect-src 'self'" in policy, policy
    else:
        assert policy.startswith("default-src 'none'") and "script-src" not in policy, policy


def test_every_response_of_the_diloco_server_carries_its_policy(diloco):
    requests = [
        ("GET", "/", None, None),
        ("GET", "/dashboard", None, None),  # the page holds no secret: no token needed
        ("GET", "/dashboard", None, TOKEN),
        ("GET", "/status", None, None),
        ("GET", "/status", None, TOKEN),
        ("GET", "/nowhere", None, TOKEN),
        ("PUT", "/register", b"{}", TOKEN),
        ("POST", "/register", b"not json", TOKEN),
        ("POST", "/control/reboot", b"{}", TOKEN),
        ("POST", "/heartbeat", b'{"worker_id": "w", "steps_per_second": NaN}', TOKEN),
    ]
    pages = 0
    for method, path, body, token in requests:
        status, text, headers = _http(diloco.port, method, path, body, token, HTML)
        _check_headers(status, text, headers, DILOCO_CSP)
        pages += headers.get("Content-Type", "").startswith("text/html")
    assert pages == 3
    status, text, headers = _http(diloco.port, "GET", "/dashboard")
    assert text.encode() == DILOCO_PAGE and "<title>DiLoCo Dashboard</title>" in text


def test_every_response_of_the_control_server_carries_its_policy(control):
    server, _ = control
    job = f"/jobs/{server.job_id}"
    requests = [
        ("GET", "/", None, None),
        ("GET", "/", None, server.token),
        ("GET", "/jobs", None, None),
        ("GET", f"{job}/status", None, None),
        ("GET", f"{job}/status", None, server.token),
        ("GET", f"{job}/history?after=x", None, server.token),
        ("GET", "/nowhere", None, server.token),
        ("PUT", f"{job}/control", b"{}", server.token),
        ("POST", f"{job}/control", b'{"command": "set", "values": {"lr": NaN}}', server.token),
        ("POST", f"{job}/control", b"x" * 100_000, server.token),
    ]
    pages = 0
    for method, path, body, token in requests:
        status, text, headers = _http(server.record.port, method, path, body, token, HTML)
        _check_headers(status, text, headers, CONTROL_CSP)
        pages += headers.get("Content-Type", "").startswith("text/html")
    assert pages == 2


def test_the_pages_hold_no_inline_handler_and_write_no_markup_from_values():
    from hookloop.control.dashboard import PAGE as CONTROL_PAGE
    from hookloop.control.dashboard import SCRIPT as CONTROL_SCRIPT
    from hookloop.diloco.dashboard import SCRIPT as DILOCO_SCRIPT

    for page, script in ((DILOCO_PAGE, DILOCO_SCRIPT), (CONTROL_PAGE, CONTROL_SCRIPT)):
        assert not re.search(rb"\son[a-z]+\s*=", page), "an inline event handler"
        for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
            assert sink not in script, sink
        assert page.count(b"<script>") == 1 and b"<form" not in page
