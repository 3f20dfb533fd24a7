"""The live dashboard in a real headless browser (Debian's chromium, driven by Playwright)
against a real training process: it loads, its curve grows, its Stop button stops the job,
its Pause and Resume buttons hold and release it, and its Settings panel changes the
running job's learning rate.

The browser is installed here, once per session and only when this test runs: the
`chromium` fixture calls scripts/install-browser.sh (apt-get, as root) when no chromium
is found, so a fresh Debian machine runs the test and no other run pays for the install.
"""

from __future__ import annotations

import contextlib
import html
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from _control_support import WAIT_S, Job

# The browser part only: installing chromium (the fixture) has its own limit, INSTALL_S.
pytestmark = pytest.mark.timeout(240, func_only=True)

INSTALL_SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "install-browser.sh"
INSTALL_S = 900  # apt-get update + chromium and its libraries on a slow mirror

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
MS = 30_000  # browser-side waits, milliseconds


def _find_chromium() -> str | None:
    path = os.environ.get("HOOKLOOP_CHROMIUM") or "/usr/bin/chromium"
    if Path(path).is_file() and os.access(path, os.X_OK):
        return path
    return shutil.which("chromium")


@pytest.fixture(scope="session")
def chromium() -> str:
    """The browser's path; installs Debian's chromium first when there is none."""
    found = _find_chromium()
    if found:
        return found
    # The script is best effort: it exits 0 and says why when apt cannot install.
    done = subprocess.run(
        ["bash", str(INSTALL_SCRIPT)], capture_output=True, text=True, timeout=INSTALL_S
    )
    found = _find_chromium()
    if found:
        return found
    pytest.skip(
        "Debian's chromium is not installed and scripts/install-browser.sh could not install "
        f"it (exit {done.returncode}):\n{(done.stdout + done.stderr)[-2000:]}"
    )


@contextlib.contextmanager
def _browser(tmp_path: Path, executable: str) -> Iterator:
    """A headless chromium context with its own profile under ``tmp_path``."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=executable, headless=True, args=CHROMIUM_ARGS
        )
        try:
            yield context
        finally:
            context.close()


def _watch(page) -> tuple[list[str], list[str]]:
    """The page's problems (script errors, console errors such as a Content-Security-Policy
    violation) and the URLs it requests, as they happen."""
    problems: list[str] = []
    urls: list[str] = []
    page.on("pageerror", lambda err: problems.append(f"page error: {err}"))
    # (a refused token, a refused command and the job's end log "Failed to load resource";
    # anything else is a problem)
    page.on(
        "console",
        lambda msg: (
            problems.append(f"console {msg.type}: {msg.text}")
            if msg.type == "error" and not msg.text.startswith("Failed to load resource")
            else None
        ),
    )
    page.on("request", lambda request: urls.append(request.url))
    return problems, urls


def _opened(context, job: Job) -> tuple:
    """A page on the job's dashboard, connected, and what it watches (problems, URLs)."""
    page = context.new_page()
    problems, urls = _watch(page)
    job.ready()
    page.goto(job.record.url, timeout=MS)
    page.wait_for_selector("#token", state="visible", timeout=MS)
    # no command can go anywhere before the first status names the job
    assert page.eval_on_selector_all("button[data-command]", "bs => bs.every(b => b.disabled)")
    _connect(page, job)
    return page, problems, urls


def _connect(page, job: Job) -> None:
    """Open the job's dashboard and give it the token."""
    page.fill("#token", job.token)
    page.click("#connect")
    page.wait_for_selector("#chart", state="visible", timeout=MS)


def test_dashboard_shows_a_growing_curve_and_its_stop_button_stops_the_job(tmp_path, chromium):
    job = Job(
        tmp_path / "job", tmp_path / "jobs", "dash-job", "callbacks.profile=true", sleep=0.005
    )
    try:
        with _browser(tmp_path, chromium) as context:
            _drive(context, job)
        assert job.wait_exit() == 0, job.stderr()
        (step,) = job.checkpoints().values()
        assert f"graceful_stop requested over HTTP at step {step}" in job.stderr()
    finally:
        job.kill()


def _drive(context, job: Job) -> None:
    page = context.new_page()
    problems, urls = _watch(page)
    page.on("dialog", lambda dialog: dialog.accept())  # the Stop button asks to confirm

    job.ready()
    page.goto(job.record.url, timeout=MS)
    page.wait_for_selector("#token", state="visible", timeout=MS)

    # a wrong token is refused and asked for again
    page.fill("#token", "not-the-token")
    page.click("#connect")
    page.wait_for_function(
        "() => document.getElementById('login-why').textContent.includes('not accepted')",
        timeout=MS,
    )

    _connect(page, job)
    page.wait_for_function(
        "() => Number(document.getElementById('chart').dataset.points) >= 2", timeout=MS
    )
    first = int(page.get_attribute("#chart", "data-points"))
    page.wait_for_function(
        f"() => Number(document.getElementById('chart').dataset.points) >= {first + 3}", timeout=MS
    )
    assert page.locator("#chart polyline").count() == 1
    assert page.text_content("#conn") == "live"
    assert int(page.text_content("#step").split("/")[0]) > 0
    assert page.evaluate("sessionStorage.getItem('hookloop.token')") == job.token
    # the job profiles its callbacks: the cost table lists their handlers
    page.wait_for_selector("#costs", state="visible", timeout=MS)
    page.wait_for_function(
        "() => document.querySelectorAll('#cost-rows tr').length >= 2", timeout=MS
    )
    labels = page.eval_on_selector_all(
        "#cost-rows tr td:first-child", "els => els.map(e => e.textContent)"
    )
    assert "ControlServer" in labels and "JsonLogger" in labels, labels
    shares = page.eval_on_selector_all(
        "#cost-rows tr td:last-child", "els => els.map(e => e.textContent)"
    )
    assert all(s.endswith(" %") for s in shares), shares

    page.click("button[data-command='graceful_stop']")
    page.wait_for_function(
        "() => document.getElementById('message').textContent.includes('graceful_stop filed')",
        timeout=MS,
    )
    job.wait_exit()
    page.wait_for_function(
        "() => document.getElementById('conn').textContent.startsWith('disconnected')", timeout=MS
    )
    assert not any(job.token in url for url in urls), "the token appeared in a URL"
    assert any(url.endswith("/control") for url in urls)
    assert problems == [], problems


NEW_LR = 0.0123
LR_INPUT = '#setting-fields input[data-key="lr"]'


def test_dashboard_settings_panel_sets_the_running_jobs_lr_and_shows_a_refusal(tmp_path, chromium):
    # the recipe's constant schedule: the logged lr is the peak a `set` changes
    job = Job(tmp_path / "job", tmp_path / "jobs", "set-job", "scheduler.name=constant")
    try:
        with _browser(tmp_path, chromium) as context:
            page, problems, urls = _opened(context, job)
            _set_lr_and_refuse_a_wrong_one(page, job)
        assert not any(job.token in url for url in urls), "the token appeared in a URL"
        assert problems == [], problems
    finally:
        job.kill()


def _set_lr_and_refuse_a_wrong_one(page, job: Job) -> None:
    settings = job.status()["settings"]
    old_lr = settings["lr"]
    assert settings["clip_grad_norm"] is None and old_lr != NEW_LR, settings
    # an input per settable key, showing its value (null: empty, "off")
    page.wait_for_function(
        f"() => {{ const i = document.querySelector('{LR_INPUT}');"
        f" return i !== null && i.value === '{old_lr!r}'; }}",
        timeout=MS,
    )
    keys = page.eval_on_selector_all("#setting-fields input", "els => els.map(e => e.dataset.key)")
    assert keys == list(settings), keys
    clip = page.locator('#setting-fields input[data-key="clip_grad_norm"]')
    assert clip.input_value() == "" and clip.get_attribute("placeholder") == "off"

    # a new lr: one `set` with that key alone, acknowledged next to the button
    page.fill(LR_INPUT, str(NEW_LR))
    page.click("#apply")
    page.wait_for_function(
        "() => document.getElementById('setting-message').textContent.startsWith('acknowledged')",
        timeout=MS,
    )
    (record,) = job.wait_for("the applied change", lambda: job.status()["changes"])
    assert record["values"] == {"lr": NEW_LR}, record  # the edited key only
    assert record["client"].startswith("dashboard"), record
    (change,) = record["changes"]
    assert (change["key"], change["old"], change["new"]) == ("lr", old_lr, NEW_LR), change
    # the next logged row after the change trains at the new lr
    after = job.wait_for(
        "a logged row after the change",
        lambda: [r for r in _train_rows(job) if r["step"] > record["step"]],
    )
    assert after[0]["lr"] == pytest.approx(NEW_LR, rel=1e-12), after[0]
    before = [r["lr"] for r in _train_rows(job) if r["step"] < record["step"]]
    assert all(lr == pytest.approx(old_lr, rel=1e-12) for lr in before), before
    # the panel lists the change, and the applied input follows the job again
    page.wait_for_function(
        "() => document.querySelectorAll('#change-rows tr').length === 1", timeout=MS
    )
    cells = page.eval_on_selector_all("#change-rows td", "els => els.map(e => e.textContent)")
    assert cells[:3] == [str(record["step"]), "lr", f"{old_lr!r} \u2192 {NEW_LR!r}"], cells
    assert cells[3].startswith("dashboard"), cells
    page.wait_for_function(
        f"() => document.querySelector('{LR_INPUT}').value === '{NEW_LR!r}'"
        " && !document.querySelector('" + LR_INPUT + "').classList.contains('edited')",
        timeout=MS,
    )

    # a refused value: the server's one line on the page, and nothing changes
    page.fill(LR_INPUT, "-1")
    page.click("#apply")
    page.wait_for_function(
        "() => document.getElementById('setting-message').textContent.startsWith('set: lr')",
        timeout=MS,
    )
    message = page.text_content("#setting-message")
    assert message == "set: lr must be a finite number > 0, got -1", message
    assert page.get_attribute("#setting-message", "class") == "bad"
    shown = page.text_content("#step")
    page.wait_for_function(  # the page has polled since: the typed value is still there
        f"() => document.getElementById('step').textContent !== {shown!r}", timeout=MS
    )
    assert page.input_value(LR_INPUT) == "-1"
    status = job.status()
    assert status["settings"]["lr"] == NEW_LR, status["settings"]
    assert [r["id"] for r in status["changes"]] == [record["id"]], status["changes"]


def _train_rows(job: Job) -> list[dict]:
    """The logged training rows, as the dashboard reads them (GET .../history)."""
    code, body, _ = job.request("GET", job.api("history") + "?after=0")
    assert code == 200, (code, body)
    return [r for r in body["records"] if r.get("kind") == "train"]


# -- the DiLoCo server's dashboard, with worker ids chosen by an attacker ---------------------
HOSTILE_IDS = [
    "x\" autofocus onfocus=\"document.title='pwned'",
    "</script><script>window.pwned = 1</script>",
    '<img src=x onerror="window.pwned = 1">',
]
HOSTILE_HOST = '<b onmouseover="window.pwned = 1">box</b>'


def _markup_as_strings(worker_ids: list[str]) -> str:
    """Rows written as markup, each id escaped for text only (``<``, ``>``, ``&``) and put
    into an attribute too: how the DiLoCo dashboard wrote them before it used textContent."""
    rows = "".join(
        f'<tr><td>{html.escape(w, quote=False)}</td><td><button data-id="'
        f'{html.escape(w, quote=False)}">kick</button></td></tr>'
        for w in worker_ids
    )
    return f"<title>before</title><table><tbody>{rows}</tbody></table>"


def test_diloco_dashboard_shows_hostile_worker_ids_as_text_and_runs_none(tmp_path, chromium):
    from hookloop.diloco.client import DiLoCoClient
    from test_diloco_server import TOKEN, _server

    srv = _server(tmp_path)
    try:
        client = DiLoCoClient(srv.address, token=TOKEN, timeout=WAIT_S)
        for worker_id in HOSTILE_IDS:
            client.register(worker_id, {"hostname": HOSTILE_HOST})
        with _browser(tmp_path, chromium) as context:
            # the attack is live in this browser: the first id, written into an attribute
            # escaped for text only, runs its handler
            naive = context.new_page()
            naive.set_content(_markup_as_strings(HOSTILE_IDS))
            naive.wait_for_function("() => document.title === 'pwned'", timeout=MS)
            naive.close()

            page = context.new_page()
            problems, _ = _watch(page)
            page.goto(f"http://{srv.address}/dashboard", timeout=MS)  # no token needed
            page.fill("#tok", TOKEN)
            page.press("#tok", "Tab")  # the token is taken when the input changes
            rows = "() => document.querySelectorAll('#workers tr').length"
            page.wait_for_function(f"{rows} === {len(HOSTILE_IDS)}", timeout=MS)
            _assert_shown_as_text_and_inert(page)

            # the kick button of the hostile id kicks exactly that worker
            assert page.text_content("#workers tr:nth-child(1) td") == HOSTILE_IDS[0]
            page.click("#workers tr:nth-child(1) button")
            page.wait_for_function(f"{rows} === {len(HOSTILE_IDS) - 1}", timeout=MS)
            assert page.text_content("#msg").startswith("kick_worker: "), page.text_content("#msg")
            assert set(client.get_status()["workers"]) == set(HOSTILE_IDS[1:])
            # the admin buttons work under the policy
            page.fill("#lr", "0.5")
            page.click("#apply-optimizer")
            page.wait_for_function(
                "() => document.getElementById('msg').textContent.includes('\"lr\": 0.5')",
                timeout=MS,
            )
            assert client.get_status()["outer_lr"] == 0.5
            _assert_shown_as_text_and_inert(page)
        assert problems == [], problems
    finally:
        srv.stop()


def _assert_shown_as_text_and_inert(page) -> None:
    """Every worker id and host on the page is text, and nothing of theirs ran."""
    ids = page.eval_on_selector_all("#workers td:first-child", "els => els.map(e => e.textContent)")
    hosts = page.eval_on_selector_all("#workers td:nth-child(2)", "e => e.map(x => x.textContent)")
    assert set(ids) <= set(HOSTILE_IDS) and len(ids) == len(set(ids)) > 0, ids
    assert hosts == [HOSTILE_HOST] * len(ids), hosts
    kicks = page.eval_on_selector_all("#workers button", "els => els.map(e => e.dataset.id)")
    assert kicks == ids, kicks
    assert page.title() == "DiLoCo Dashboard"
    assert page.evaluate("() => window.pwned === undefined")
    injected = "#workers img, #workers script, #workers b, [autofocus], [onfocus], [onerror]"
    assert page.locator(injected).count() == 0


def test_dashboard_pause_and_resume_buttons_hold_and_release_the_job(tmp_path, chromium):
    job = Job(tmp_path / "job", tmp_path / "jobs", "pause-job")
    try:
        with _browser(tmp_path, chromium) as context:
            page, problems, urls = _opened(context, job)
            _pause_then_resume(page, job)
            page.on("dialog", lambda dialog: dialog.accept())
            page.click("button[data-command='graceful_stop']")
            job.wait_exit()
        assert job.wait_exit() == 0, job.stderr()
        events = [r.get("event") for r in _records(job.out / "changes.jsonl")]
        assert events[:2] == ["pause", "resume"], events
        assert not any(job.token in url for url in urls), "the token appeared in a URL"
        assert problems == [], problems
    finally:
        job.kill()


def _pause_then_resume(page, job: Job) -> None:
    page.wait_for_function("() => !document.querySelector(\"[data-command='pause']\").disabled",
                           timeout=MS)  # fmt: skip
    page.click("button[data-command='pause']")
    page.wait_for_function(
        "() => document.getElementById('phase').textContent.includes('(paused at step')",
        timeout=MS,
    )
    held = job.status()
    assert held["paused"] is True
    assert page.is_disabled("button[data-command='pause']")
    # held: the dashboard keeps polling and the step stays where the pause took it
    for _ in range(3):
        page.wait_for_timeout(300)
        assert job.status()["step"] == held["paused_at_step"]
    page.click("button[data-command='resume']")
    page.wait_for_function(
        "() => !document.getElementById('phase').textContent.includes('paused')", timeout=MS
    )
    page.wait_for_function(
        f"() => Number(document.getElementById('step').textContent.split('/')[0]) > "
        f"{held['paused_at_step']}",
        timeout=MS,
    )


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
