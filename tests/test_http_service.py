"""The HTTP base both servers stand on (hookloop.control.service), tested on its own: a
small app of our own behind a Gate, served on 127.0.0.1 by Serving, spoken to over raw
sockets and http.client, so what a client sees is what is checked.

Then the two real servers through it: the 401s they answer, byte for byte, are the ones
their clients (Forgather's workers, `forgather control`, `hookloop ctl`) already know.
"""

from __future__ import annotations

import http.client
import json
import socket

import pytest

from hookloop.control.bodies import load_object
from hookloop.control.service import (
    API_CSP,
    SAFE_HEADERS,
    Address,
    Gate,
    HttpError,
    Serving,
    bearer_matches,
    guarded,
    json_reply,
    listen,
    read_json,
)

web = pytest.importorskip("aiohttp.web")
pytestmark = pytest.mark.timeout(120)

TOKEN = "service-test-token-0123456789"
WAIT_S = 30.0
CAP = 1024  # the test app's client_max_size
REFUSED = "no entry: send 'Authorization: Bearer <token>'"


def _explain(request: web.Request, exc: web.HTTPException) -> web.Response:
    return json_reply({"error": f"{exc.status} at {request.path}"}, exc.status)


def _app(seen: list[str]) -> web.Application:
    """Routes that answer, refuse, fail and read a body; ``seen`` logs handler calls."""

    async def public(request: web.Request) -> web.Response:
        seen.append("public")
        return web.Response(text="hello", headers={"Content-Security-Policy": "default-src 'self'"})

    async def echo(request: web.Request) -> web.Response:
        seen.append("echo")
        return json_reply({"got": await read_json(request, load_object)})

    async def naive(request: web.Request) -> web.Response:
        seen.append("naive")
        return json_reply({"bytes": len(await request.read())})

    async def refuse(request: web.Request) -> web.Response:
        raise HttpError("the teapot is busy", 418)

    async def crash(request: web.Request) -> web.Response:
        raise RuntimeError("boom\nwith a second line")

    gate = Gate(
        name="test",
        error_prefix="test server error",
        authorized=lambda header: bearer_matches(header, TOKEN),
        public=lambda request: request.path == "/public",
        refusal=lambda: json_reply({"error": REFUSED}, 401),
        explain=_explain,
    )
    app = web.Application(middlewares=[guarded(gate)], client_max_size=CAP)
    app.router.add_get("/public", public)
    app.router.add_post("/echo", echo)
    app.router.add_post("/naive", naive)
    app.router.add_get("/refuse", refuse)
    app.router.add_get("/crash", crash)
    return app


@pytest.fixture
def served():
    """``(port, seen)`` of the test app, served from a background thread."""
    seen: list[str] = []
    serving = Serving("test")
    sock = listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    app = _app(seen)
    serving.start(lambda ready: serving.serve(app, Address(sock=sock), ready))
    try:
        yield port, seen
    finally:
        serving.stop()
    assert not serving.thread.is_alive()


def _http(port, method, path, body=None, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
    try:
        conn.request(method, path, body=body, headers=dict(headers or {}))
        response = conn.getresponse()
        return response.status, response.read(), response.headers
    finally:
        conn.close()


def _auth(token=TOKEN):
    return {"Authorization": f"Bearer {token}"}


def _one_line_error(body: bytes) -> str:
    error = json.loads(body)["error"]
    assert "\n" not in error and "Traceback" not in error and "<html" not in body.decode()
    return error


def test_bearer_matches_only_the_exact_token_and_never_raises():
    assert bearer_matches(f"Bearer {TOKEN}", TOKEN)
    assert bearer_matches(f"bearer   {TOKEN} ", TOKEN)  # scheme is case-insensitive
    for header in ("", TOKEN, f"Basic {TOKEN}", f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}",
                   "Bearer tökén", "Bearer \udcff"):  # fmt: skip
        assert not bearer_matches(header, TOKEN), header


@pytest.mark.parametrize(
    "headers",
    [{}, _auth("wrong-token"), {"Authorization": f"Basic {TOKEN}"}, {"Authorization": ""}],
    ids=["none", "wrong", "basic", "empty"],
)
def test_a_request_without_the_token_gets_the_servers_refusal_and_no_handler_runs(served, headers):
    port, seen = served
    status, body, got = _http(port, "POST", "/echo", b'{"a": 1}', headers)
    assert status == 401 and json.loads(body) == {"error": REFUSED}
    assert got["Content-Type"].startswith("application/json")
    assert seen == []  # refused at the door
    # a public route needs no token; a refused one is refused even when it does not exist
    assert _http(port, "GET", "/public")[0] == 200 and seen == ["public"]
    assert _http(port, "GET", "/nowhere")[0] == 401


def test_a_non_ascii_authorization_header_is_a_401_not_a_500(served):
    port, _ = served
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as conn:
        conn.sendall(b"GET /refuse HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer t\xc3\xb6k\r\n"
                     b"Connection: close\r\n\r\n")  # fmt: skip
        head = conn.recv(65536)
    assert head.startswith(b"HTTP/1.1 401"), head[:80]


def test_a_declared_body_over_the_cap_is_refused_before_a_byte_of_it_is_read(served):
    port, seen = served
    request = (
        "POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN + "\r\n"
        "Content-Type: application/json\r\nContent-Length: 10000000\r\n\r\n"
    )
    # the attack: headers promising 10 MB, then nothing. A route that just reads the
    # body (aiohttp's cap counts bytes as they arrive) sits waiting for them.
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as conn:
        conn.sendall(request.format(path="/naive").encode())
        conn.settimeout(0.5)
        with pytest.raises(TimeoutError):
            conn.recv(65536)
    assert seen == ["naive"]
    # read_body looks at the declared length first: 413 at once, the body never sent
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as conn:
        conn.sendall(request.format(path="/echo").encode())
        head = conn.recv(65536)
    assert head.startswith(b"HTTP/1.1 413"), head[:80]
    assert b'{"error": "413 at /echo"}' in head
    # a body within the cap is read as usual, and one just over it refused as well
    assert _http(port, "POST", "/echo", b'{"a": [1, 2]}', _auth())[:2] == (
        200,
        b'{"got": {"a": [1, 2]}}',
    )
    over = b'{"a": "' + b"x" * CAP + b'"}'
    assert _http(port, "POST", "/echo", over, _auth())[0] == 413


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'{"lr": NaN}', "lr must be a finite number"),
        (b'{"x\\ny": NaN}', "x\\ny must be a finite number"),  # a key with a newline
        (b"\xff\xfe", "not valid JSON"),
        (b'{"a":' * 40 + b"1" + b"}" * 40, "deeper than 16 levels"),
    ],
    ids=["malformed", "list", "nan", "newline-key", "not-utf8", "deep"],
)
def test_a_bad_json_body_is_a_400_in_one_line(served, body, says):
    port, _ = served
    status, text, got = _http(port, "POST", "/echo", body, _auth())
    assert status == 400
    assert says in _one_line_error(text)
    assert got["Content-Type"].startswith("application/json")


def test_refusals_failures_and_unknown_routes_are_one_json_line(served, caplog):
    port, _ = served
    status, body, _ = _http(port, "GET", "/refuse", headers=_auth())
    assert (status, json.loads(body)) == (418, {"error": "the teapot is busy"})
    with caplog.at_level("ERROR", logger="hookloop.control"):
        status, body, _ = _http(port, "GET", "/crash", headers=_auth())
    assert status == 500
    assert _one_line_error(body) == "test server error: boom with a second line"
    assert "test: GET /crash failed: boom with a second line" in caplog.text
    status, body, _ = _http(port, "GET", "/nowhere", headers=_auth())
    assert (status, json.loads(body)) == (404, {"error": "404 at /nowhere"})
    status, body, _ = _http(port, "PUT", "/echo", headers=_auth())
    assert (status, json.loads(body)) == (405, {"error": "405 at /echo"})


def test_every_answer_carries_the_safe_headers_and_a_policy(served):
    port, _ = served
    answers = {
        "200 page": _http(port, "GET", "/public"),
        "200 json": _http(port, "POST", "/echo", b"{}", _auth()),
        "400": _http(port, "POST", "/echo", b"{", _auth()),
        "401": _http(port, "GET", "/refuse"),
        "404": _http(port, "GET", "/nowhere", headers=_auth()),
        "413": _http(port, "POST", "/echo", b"x" * (CAP + 1), _auth()),
        "418": _http(port, "GET", "/refuse", headers=_auth()),
        "500": _http(port, "GET", "/crash", headers=_auth()),
    }
    for name, (_, _, headers) in answers.items():
        for key, value in SAFE_HEADERS.items():
            assert headers[key] == value, (name, key)
        policy = headers["Content-Security-Policy"]
        # a response keeps its own policy (a page's); every other one gets the empty one
        assert policy == ("default-src 'self'" if name == "200 page" else API_CSP), name


def test_serving_stops_and_frees_its_port_and_start_raises_what_failed():
    serving = Serving("test")
    sock = listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    app = _app([])
    serving.start(lambda ready: serving.serve(app, Address(sock=sock), ready))
    assert serving.port == port and _http(port, "GET", "/public")[0] == 200
    serving.stop()
    assert not serving.thread.is_alive()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=WAIT_S).close()
    # bound by aiohttp on a port that is taken: start() raises the bind's own error
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        other = Serving("test")
        where = Address(host="127.0.0.1", port=taken)
        with pytest.raises(OSError, match=r"(?i)address already in use"):
            other.start(lambda ready: other.serve(_app([]), where, ready))


def test_listen_names_the_address_it_cannot_take():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            listen("127.0.0.1", port)


# -- the two servers through the base: their 401s, as their clients know them ----------------
def test_the_control_server_refuses_as_it_always_has():
    from hookloop.control.job import LiveJob
    from hookloop.control.routes import ControlRoutes

    routes = ControlRoutes(LiveJob("job-1", None, None), lambda header: False, lambda: [])
    serving = Serving("control")
    sock = listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    app = routes.app()
    serving.start(lambda ready: serving.serve(app, Address(sock=sock), ready))
    try:
        status, body, headers = _http(port, "GET", "/jobs/job-1/status")
    finally:
        serving.stop()
    assert status == 401
    assert body == (
        b'{"error": "missing or wrong bearer token; send the header \'Authorization: Bearer '
        b"<token>' (`hookloop ctl JOB token` prints the token)\"}"
    )
    assert headers["WWW-Authenticate"] == 'Bearer realm="hookloop"'


def test_the_diloco_server_refuses_as_it_always_has(tmp_path):
    from test_diloco_server import TOKEN as DILOCO_TOKEN
    from test_diloco_server import _server

    srv = _server(tmp_path)
    try:
        status, body, headers = _http(srv.port, "GET", "/status", headers=_auth("nope"))
        big = _http(srv.port, "POST", "/heartbeat", b"", {
            **_auth(DILOCO_TOKEN), "Content-Length": str(srv.max_payload_mb * 2**20 + 1)
        })  # fmt: skip
    finally:
        srv.stop()
    assert status == 401 and "WWW-Authenticate" not in headers
    assert body == b'{"error": "missing or wrong token: send \'Authorization: Bearer <token>\'"}'
    assert big[0] == 413 and json.loads(big[1]) == {
        "error": f"the body is larger than the server's cap of {srv.max_payload_mb} MB "
        "(hookloop diloco serve --max-payload-mb)"
    }
